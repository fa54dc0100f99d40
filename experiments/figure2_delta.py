"""Figure 2 — MSE vs sink strength Δ ∈ [4, 13] (N = 4096, d = 128, q_len = 32, B = 64, 20 seeds).

Top: MSE of the five configurations (log y). Bottom: the diagnostic panel — non-sink probability
mass and the fraction of non-sink P zeroed by the S = 1 cast (bars) and the S = 256 cast (line),
in percent. The paper's Table 1 / Table 2 values are overlaid as open markers.
"""

from __future__ import annotations

import numpy as np

from pcast_jax import report
from pcast_jax.stats import mean_sem

from . import table1, table2
from .common import (
    PAPER_COLORS,
    PAPER_LABELS,
    PAPER_ORDER,
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
        Finding("Fig. 2: S=256 gives ~10–15% lower MSE than S=448 (forward)", "10–15% lower",
                f"fwd S=448 / fwd S=256 = {s448_mid.min():.2f}–{s448_mid.max():.2f} over Δ = 5…9 "
                f"(median {np.median(s448_mid):.2f}, i.e. {100 * (1 - 1 / np.median(s448_mid)):.0f}% lower)",
                "yes" if 1.08 <= np.median(s448_mid) <= 1.2 else "partly"),
        Finding("Fig. 2: at Δ ≥ 11 all configurations converge (non-sink mass < 2%)",
                "converge; mass < 2%",
                f"at Δ ≥ 11 the four others are within {100 * (conv_wo448 - 1):.0f}% of each other, "
                f"Forward S=448 stays {100 * (conv['fwd_s448'] - 1):.0f}% above (its larger dp on the sink "
                f"probabilities); non-sink mass at Δ = 11: {mass_11:.1f}%",
                "yes" if max(conv.values()) < 1.1 and mass_11 < 2.0 else
                ("partly" if conv_wo448 < 1.1 else "no")),
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
                   notes=["Forward S=1 / best other config by Δ: " + ", ".join(
                       f"{d:g}: {r:.1f}×" for d, r in zip(s.deltas_fig2, worst_ratio)) + ".",
                          "At large Δ the output is dominated by the k_sink sink probabilities, whose own "
                          "E4M3 quantization (present in every configuration, larger at S = 448) sets "
                          "the MSE floor; the non-sink collapse no longer matters there (Remark 2)."])


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
