"""Figure 2 — MSE vs sink strength Δ ∈ [4, 13] (N = 4096, d = 128, q_len = 32, B = 64, 20 seeds).

Top: MSE of the five configurations (log y). Bottom: the diagnostic panel — non-sink probability
mass and the fraction of non-sink P zeroed by the S = 1 cast (bars) and the S = 256 cast (line),
in percent. The paper's Table 1 / Table 2 values are overlaid as open markers.
"""

from __future__ import annotations

import numpy as np

from pcast_jax import report
from pcast_jax.stats import fmt_pm, mean_sem
from pcast_jax.workloads import sink_mask

from . import table1, table2
from .common import (
    FULL,
    PAPER_COLORS,
    PAPER_LABELS,
    PAPER_ORDER,
    SINK_DELTA,
    Column,
    Context,
    Figure,
    Finding,
    Section,
    Table,
    delta_sweep,
    paper_line,
)

NAME = "figure2_delta"
TITLE = "Figure 2 — MSE vs sink strength Δ"


def run(ctx: Context) -> Section:
    s = ctx.sizes
    res = delta_sweep(ctx)
    deltas = np.asarray(s.deltas_fig2)
    n = s.n_main
    rows = []
    stats = {}
    for c in PAPER_ORDER:
        for d in s.deltas_fig2:
            m, se = mean_sem(res.get("mse", config=c, n=n, delta=d))
            me, see = mean_sem(res.get("mse_expected", config=c, n=n, delta=d))
            fz, _ = mean_sem(res.get("frac_zeroed", config=c, n=n, delta=d))
            zm, _ = mean_sem(res.get("zeroed_mass", config=c, n=n, delta=d))
            ns, _ = mean_sem(res.get("nonsink_mass", config=c, n=n, delta=d))
            stats[c, d] = m
            rows.append({"config": c, "delta": d, "n": n, "seeds": s.seeds, "mse": m, "mse_sem": se,
                         "mse_expected": me, "mse_expected_sem": see, "frac_zeroed": fz,
                         "zeroed_mass": zm, "nonsink_mass": ns})

    fig, (top, bot) = report.new_figure(nrows=2, figsize=(7.5, 7.0), height_ratios=(3, 2), sharex=True)
    for c in PAPER_ORDER:
        y = np.array([stats[c, d] for d in s.deltas_fig2])
        se = np.array([r["mse_sem"] for r in rows if r["config"] == c])
        top.plot(deltas, y, **paper_line(c))
        top.fill_between(deltas, np.maximum(y - se, y * 0.5), y + se, color=PAPER_COLORS[c], alpha=0.15, lw=0)
        if n == 4096:
            top.plot([7.0], [table2.PAPER[c][4096] * 1e-5], "D", mfc="none", mec=PAPER_COLORS[c], ms=9,
                     mew=1.5)
    if n == 4096:
        top.plot([], [], "D", mfc="none", mec="k", label="paper, Table 2 (Δ=7)")
    top.set_yscale("log")
    report.label_log_axis(top.yaxis)
    top.set_ylabel("MSE vs FP32 reference")
    top.set_title(f"FP8 P-cast MSE under attention sink (N = {n}, {s.seeds} seeds, kernel-faithful)")
    top.grid(alpha=0.3, which="both")
    top.legend(fontsize=8, ncol=2, loc="lower right")

    def col(metric, c):
        return 100 * np.array([r[metric] for r in rows if r["config"] == c])

    w = 0.38
    bot.bar(deltas - w / 2, col("nonsink_mass", "fwd_s1"), w, color="#1f77b4", alpha=0.8,
            label="non-sink prob. mass (%)")
    bot.bar(deltas + w / 2, col("frac_zeroed", "fwd_s1"), w, color="#d62728", alpha=0.8,
            label="P zeroed by S=1 cast (%)")
    bot.plot(deltas, col("frac_zeroed", "fwd_s256"), "o-", color="#2ca02c", ms=4,
             label="P zeroed by S=256 cast (%)")
    if n == 4096:
        pd = sorted(table1.PAPER)
        bot.plot(pd, [table1.PAPER[d]["s1"] for d in pd], "x", color="k", ms=6,
                 label="paper, Table 1 (S=1, S=256, mass)")
        bot.plot(pd, [table1.PAPER[d]["s256"] for d in pd], "x", color="k", ms=6)
        bot.plot(pd, [table1.PAPER[d]["mass"] for d in pd], "x", color="k", ms=6)
    bot.set_ylim(0, 135)
    bot.set_yticks([0, 20, 40, 60, 80, 100])
    bot.set_xlabel("sink strength Δ")
    bot.set_ylabel("%")
    bot.set_title("Probability mass at risk vs. P-zeroing fraction (forward order)", fontsize=10)
    bot.set_xticks(deltas)
    bot.grid(alpha=0.3, axis="y")
    bot.legend(fontsize=7.5, loc="upper center", ncol=2, framealpha=0.95)

    # checks of the paper's statements about this figure
    dl = list(s.deltas_fig2)
    fwd1 = np.array([stats["fwd_s1", d] for d in dl])
    others = {c: np.array([stats[c, d] for d in dl]) for c in PAPER_ORDER if c != "fwd_s1"}
    floor = np.min(np.stack(list(others.values())), axis=0)
    worst_ratio = fwd1 / floor
    excess = fwd1 - floor  # the MSE that P-collapse adds on top of the best configuration
    peak_excess = dl[int(np.argmax(excess))]
    local_max = [dl[i] for i in range(1, len(dl) - 1) if fwd1[i] >= fwd1[i - 1] and fwd1[i] >= fwd1[i + 1]]
    global_max = dl[int(np.argmax(fwd1))]
    i7 = dl.index(7.0)
    s448 = others["fwd_s448"] / others["fwd_s256"]
    mid = [d for d in dl if 5 <= d <= 9]
    s448_mid = np.array([s448[dl.index(d)] for d in mid])
    high = [d for d in dl if d >= 11]
    conv = {c: max(stats[c, d] / min(stats[o, d] for o in PAPER_ORDER) for d in high) for c in PAPER_ORDER}
    conv_wo448 = max(v for c, v in conv.items() if c != "fwd_s448")
    mass_11 = (100 * float(np.mean(res.get("nonsink_mass", config="fwd_s1", n=n, delta=11.0)))
               if 11.0 in dl else float("nan"))
    findings = [
        Finding("Fig. 2: Forward S=1 MSE peaks in the transition region; the others stay at the floor",
                "peak at Δ = 7–8",
                f"excess over the best config peaks at Δ = {peak_excess:g}; local maximum of the MSE at "
                f"Δ = {', '.join(f'{d:g}' for d in local_max) or 'none'}; above Δ ≈ 10 every config rises "
                f"to the sink-quantization floor, so the global maximum is at Δ = {global_max:g}",
                "yes" if peak_excess in (7.0, 8.0) and global_max in (7.0, 8.0) else
                ("partly" if peak_excess in (7.0, 8.0) or set(local_max) & {7.0, 8.0} else "no")),
        Finding(f"Fig. 2: Forward S=1 is ~3.4× worse than the optimized configs at Δ = 7 (N = {n})", "3.4×",
                f"{worst_ratio[i7]:.1f}×", "yes" if abs(worst_ratio[i7] / 3.4 - 1) <= 0.25 else "partly"),
        Finding("Fig. 2: at Δ ≥ 11 all configurations converge (non-sink mass < 2%)",
                "converge; mass < 2%",
                f"at Δ ≥ 11 the four others are within {100 * (conv_wo448 - 1):.0f}% of each other, "
                f"Forward S=448 stays {100 * (conv['fwd_s448'] - 1):.0f}% above (its larger dp on the sink "
                f"probabilities); non-sink mass at Δ = 11: {mass_11:.1f}%",
                "yes" if max(conv.values()) < 1.1 and mass_11 < 2.0 else
                ("partly" if conv_wo448 < 1.1 else "no")),
        sink_block_finding(res, s),
        prop3_finding(res, s),
    ]
    intro = (f"N = {n}, d = {s.d}, q_len = {s.q_len}, B = 64, k_sink = {s.k_sink}, {s.seeds} seeds, "
             f"Δ = {s.deltas_fig2[0]:g}…{s.deltas_fig2[-1]:g}. Shaded bands: ± one standard error. "
             "All Δ values and configurations share the same draws per seed (the engine adds Δ to the "
             "sink scores of one instance), so the curves are smooth and comparisons paired.")
    caption = ("Top: MSE vs sink strength, log scale; open diamonds are the paper's Table 2 values at "
               "Δ = 7; Forward S=256 (green) lies under Reverse S=256 (blue). Bottom: non-sink probability mass "
               "(blue bars), fraction of non-sink P zeroed by "
               "the S = 1 cast (red bars) and by the S = 256 cast (green line), forward order; black × "
               "are the paper's Table 1 values.")
    md_rows = [{"what": f"MSE ×10⁻⁵, {PAPER_LABELS[c]}",
                **{f"d{d:g}": f"{stats[c, d] * 1e5:.3g}" for d in s.deltas_fig2}} for c in PAPER_ORDER]
    for label, metric, c in (("non-sink mass %", "nonsink_mass", "fwd_s1"),
                             ("zeroed by S=1 cast %", "frac_zeroed", "fwd_s1"),
                             ("zeroed by S=256 cast %", "frac_zeroed", "fwd_s256")):
        vals = col(metric, c)
        md_rows.append({"what": label, **{f"d{d:g}": f"{v:.3g}" for d, v in zip(s.deltas_fig2, vals)}})
    cols = [Column("what", "Δ =")] + [Column(f"d{d:g}", f"{d:g}") for d in s.deltas_fig2]
    return Section(NAME, TITLE, intro, tables=[Table("figure2_delta", rows, cols, md_rows=md_rows)],
                   figures=[Figure("figure2_delta", fig, caption)], findings=findings,
                   notes=[f"Forward S=448 / Forward S=256 = {s448_mid.min():.2f}–{s448_mid.max():.2f} over "
                          f"Δ = 5…9 on these {s.seeds} seeds (median {np.median(s448_mid):.2f}); the paper's "
                          "\"10–15% lower MSE\" is decided in Table 3's section by paired ratios on "
                          f"{FULL.seeds_table3} seeds.",
                          "Forward S=1 / best other config by Δ: " + ", ".join(
                       f"{d:g}: {r:.1f}×" for d, r in zip(s.deltas_fig2, worst_ratio)) + ".",
                          "At large Δ the output is dominated by the k_sink sink probabilities, whose own "
                          "E4M3 quantization (present in every configuration, larger at S = 448) sets "
                          "the MSE floor; the non-sink collapse no longer matters there (Remark 2)."])


#: Theorem 4's check: reverse S = 256 at these Δ, where the sink's own KV block starts to zero.
THM4_DELTAS = (10.0, 12.0)
#: Prop. 3's check: the Δ of Table 2 and Figure 3.
PROP3_DELTA = SINK_DELTA


def _redraw(res, n: int, delta: float):
    """The sweep's instances at (N, Δ) without V, seed by seed: (scores (seeds, q, N), is_sink (N,))."""
    import jax
    import jax.numpy as jnp

    from pcast_jax.sweep.spec import instance_key
    from pcast_jax.workloads import SinkWorkload, make_instance

    sp = res.spec
    w = SinkWorkload(n=n, q_len=sp.q_len, d=sp.d, k_sink=sp.k_sink, sigma=sp.sigma, sigma_v=sp.sigma_v)
    draw = jax.jit(jax.vmap(lambda seed: make_instance(instance_key(sp.base_seed, n, seed), w, 0.0,
                                                       draw_v=False).scores))
    scores = draw(jnp.arange(sp.seed_offset, sp.seed_offset + sp.seeds, dtype=jnp.uint32))
    is_sink = jnp.asarray(sink_mask(w))
    return scores + jnp.where(is_sink, jnp.float32(delta), 0.0), is_sink


def sink_block_finding(res, s) -> Finding:
    """Theorem 4 (zero underflow for reverse + S = 256) against the sink's own KV block.

    The Δ sweep's Reverse S=256 zeroed fraction at :data:`THM4_DELTAS` beside the closed form
    :func:`pcast_jax.theory.sink_block_collapse_fraction`; the same instances redrawn and counted before
    the sink's block only (where the theorem's guarantee applies), which must zero nothing.
    """
    import jax
    import jax.numpy as jnp

    from pcast_jax import engine, theory
    from pcast_jax.presets import get_preset
    from pcast_jax.stats import decide, z_value

    n, block = s.n_main, get_preset("rev_s256").block_kv
    z = z_value(s.seeds)
    before = jnp.arange(n) >= block  # the blocks reverse order visits before the sinks' block 0
    count = jax.jit(jax.vmap(lambda sc: jnp.sum(engine.weights_and_stats(
        sc, get_preset("rev_s256"), count_mask=before).n_zeroed)))
    parts, agree, none, before_total = [], [], [], 0
    for d in THM4_DELTAS:
        got, se = mean_sem(res.get("frac_zeroed", config="rev_s256", n=n, delta=d))
        none.append(decide(got, se, 0.0, z) is False)
        model = float(theory.sink_block_collapse_fraction(d, 256.0, n=n, block_kv=block, k_sink=s.k_sink))
        agree.append(abs(got - model) <= z * se + 0.25 * model)
        scores, is_sink = _redraw(res, n, d)
        before_total += int(jnp.sum(count(scores)))
        parts.append(f"Δ = {d:g}: {100 * got:.2f} ± {100 * se:.2f}% (closed form (B − k)/(N − k)·F(Δ, 256) = "
                     f"{100 * model:.2f}%)")
    zero_before = before_total == 0
    ours = ("Reverse S=256 zeroes " + "; ".join(parts) + f" of non-sink P (B = {block}, N = {n}, {s.seeds} seeds): "
            f"the keys sharing the sink's KV block; {before_total} zeroed in the blocks before it")
    verdict = "yes" if all(none) else "partly" if zero_before and all(agree) else "no"
    return Finding("Thm. 4: reverse + S=256 zeroes no non-sink P (< 1e-12)", "no underflow", ours, verdict)


def prop3_finding(res, s) -> Finding:
    """Prop. 3 / Eq. (9): the MSE of the zeroed set, σ_V²/ℓ² Σ_{j∈Z} P_j², as a share of P-collapse's MSE.

    Z is Forward S=1's zeroed non-sink set at :data:`PROP3_DELTA` on the Δ sweep's own instances
    (redrawn), the term :func:`pcast_jax.theory.mse_collapse`; the excess is Forward S=1's expected MSE
    minus Reverse S=256's on the same seeds; the share a paired ratio ± s.e. "yes" when the share is
    decidedly above 90 %, "partly" when decidedly above 50 %, "no" otherwise.
    """
    import jax
    import jax.numpy as jnp

    from pcast_jax import engine, theory
    from pcast_jax.presets import get_preset
    from pcast_jax.stats import decide, paired_ratio, z_value

    n, d = s.n_main, PROP3_DELTA
    scores, is_sink = _redraw(res, n, d)
    cfg = get_preset("fwd_s1")

    def per_seed(sc):
        w = engine.weights_and_stats(sc, cfg, count_mask=~is_sink).weights
        p = engine.reference_probs(sc)
        zeroed = (w == 0) & (p > 0) & ~is_sink
        return jnp.mean(theory.mse_collapse(p, zeroed, 1.0)), jnp.sum(zeroed) / (sc.shape[0] * jnp.sum(~is_sink))

    term, frac = (np.asarray(x, np.float64) for x in jax.jit(jax.vmap(per_seed))(scores))
    swept = np.asarray(res.get("frac_zeroed", config="fwd_s1", n=n, delta=d), np.float64)
    if not np.allclose(frac, swept, rtol=1e-5, atol=1e-7):  # the redraw must be the sweep's instances
        raise AssertionError(f"Prop. 3 redraw: zeroed {frac.mean():.6f} vs the sweep's {swept.mean():.6f}")
    excess = (np.asarray(res.get("mse_expected", config="fwd_s1", n=n, delta=d), np.float64)
              - np.asarray(res.get("mse_expected", config="rev_s256", n=n, delta=d), np.float64))
    share, se = paired_ratio(term, excess)
    z = z_value(s.seeds)
    verdict = ("yes" if decide(share, se, 0.9, z) is True else
               "partly" if decide(share, se, 0.5, z) is True else "no")
    return Finding(
        "Prop. 3 / Eq. (9): the zeroed set's σV²/ℓ² Σ_Z P² is P-collapse's MSE",
        "MSE_collapse = σV²/ℓ² Σ_Z P²",
        f"at Δ = {d:g} (N = {n}, Forward S=1, {s.seeds} seeds) Eq. (9) is {fmt_pm(100 * share, 100 * se, 1, '%')} "
        f"of the excess MSE over Reverse S=256 ({np.mean(term):.3g} of {np.mean(excess):.3g}); the rest is the "
        "coarse subnormal rounding of the non-sink P that survive the S=1 cast",
        verdict)


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
