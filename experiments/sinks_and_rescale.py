"""Learned sinks and the lazy rescale in FP8 attention kernels, and cuDNN — our own analysis beyond the paper.

Three studies on the paper's synthetic workload (N(0, σ²) logits, Q/K/V in FP32 so the P-cast is
isolated; expected MSE, which averages V out):

1. **Learned-sink collapse per placement and order** vs the sink logit Δ_L (no token sinks): the
   initial-max placement (vLLM Triton, cuDNN) beside the epilogue (FA3/FA4, FlashInfer, TRT-LLM) and
   the every-block-max placement (vllm-gaudi), forward and reverse, S = 1 and 256, one pass and four
   split-KV segments; the closed form :func:`pcast_jax.theory.learned_sink_collapse_fraction` beside.
2. **Saturation vs τ and logit spread**: FA4's exponent-mode S = 256 with lazy-rescale thresholds τ
   (log2 units) as its 2026 versions ran them, on logits of growing σ (the wide logits of the FA4
   reports), with the bound :func:`pcast_jax.theory.max_scaled_p` beside.
3. **Every sink and lazy-rescale preset at Table 3's operating points** (N = 4096, Δ = 7 and 10 with four token sinks,
   and a learned sink Δ_L = 7 and 10), with verdicts that carry their uncertainty.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from pcast_jax import report, theory
from pcast_jax.config import KernelConfig
from pcast_jax.presets import get_preset, tagged
from pcast_jax.stats import decide, fmt_pm, mean_sem, paired_ratio, z_value
from pcast_jax.sweep import SweepResult, SweepSpec, run_sweep

__all__ = ["NAME", "TITLE", "FILES", "Sizes", "FULL", "QUICK", "PRESETS_STUDIED", "sinks_and_rescale_section"]

NAME = "sinks_and_rescale"
TITLE = ("Learned sinks and lazy rescale in FP8 attention kernels, and cuDNN (our own analysis, beyond the "
         "paper)")
FILES = {
    f"{NAME}_sinks.csv": "learned-sink collapse per (placement, order, S, segments, Δ_L): simulated zeroed fraction "
                         "± s.e., zeroed mass, expected MSE, the closed form's fraction",
    f"{NAME}_sinks.png": "zeroed fraction of non-sink P vs the learned-sink logit Δ_L, per placement and order, "
                         "theory dashed",
    f"{NAME}_saturation.csv": "saturation per (τ, σ): saturated fraction and mass ± s.e., expected MSE, the largest "
                              "P·S the lag allows",
    f"{NAME}_saturation.png": "saturated fraction of P and the mass it carries vs the logits' σ, one line per "
                              "lazy-rescale threshold τ",
    f"{NAME}_presets.csv": "every sink and lazy-rescale preset at N = 4096, token sinks Δ = 7 / 10 and a learned "
                           "sink Δ_L = 7 / 10: zeroed and saturated fractions, expected MSE, MSE / reverse S = 256 "
                           "(paired ± s.e.), verdict",
    f"{NAME}_smollm2.csv": "SmolLM2-135M with an injected learned sink per head (absorbing a stated share of the "
                           "mass): KL, top-1 agreement and perplexity per preset against the exact softmax with the "
                           "same sinks",
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    seeds: int
    q_len: int
    n: int
    d: int
    deltas_l: tuple
    sigmas: tuple
    model_tokens: int = 512
    #: study 3's presets; None: every preset tagged "sinks_and_rescale" (:data:`PRESETS_STUDIED`)
    presets: tuple | None = None


FULL = Sizes(seeds=16, q_len=32, n=4096, d=128, deltas_l=tuple(float(x) for x in range(2, 17)),
             sigmas=(1.0, 1.5, 2.0, 3.0, 4.0))
QUICK = Sizes(seeds=3, q_len=8, n=1024, d=64, deltas_l=(2.0, 5.0, 7.0, 9.0, 12.0, 14.0), sigmas=(1.0, 3.0),
              model_tokens=64)

#: Study 1's configurations: (label, config, segments).
_PLACEMENTS = tuple(
    (f"{mode} {'fwd' if order == 'forward' else 'rev'} S={s:g}" + (f" ×{seg} seg." if seg > 1 else ""),
     KernelConfig(order=order, scale=float(s), block_kv=64, sink_mode=mode, kv_splits=seg), seg)
    for mode, order, s, seg in (
        ("init_max", "forward", 1, 1), ("init_max", "reverse", 1, 1), ("init_max", "forward", 256, 1),
        ("init_max", "forward", 1, 4), ("epilogue", "forward", 1, 1), ("epilogue", "reverse", 1, 1),
        ("block_max", "forward", 1, 1), ("block_max", "forward", 1, 4)))
#: Study 2: FA4's FP8 forward (reverse, S = 256 in the exponent, B = 128) at each threshold τ (log2).
_TAUS = (0.0, 0.75, 2.0, 4.0)
#: The reference of study 3's ratios: the paper's best static configuration.
_BEST = "rev_s256"
#: Study 3's presets: every preset tagged "sinks_and_rescale", in registry order.
PRESETS_STUDIED = tuple(tagged("sinks_and_rescale"))


def _run(spec: SweepSpec, out: Path, tag: str, quick: bool) -> SweepResult:
    folder = out / "sweeps" / (("quick-" if quick else "") + f"{NAME}-{tag}-{spec.fingerprint()[:8]}")
    return run_sweep(spec, out_dir=folder, progress=False)


def _sinks_study(sz: Sizes, out: Path, quick: bool) -> list[dict]:
    configs = tuple(dataclasses.replace(c, name=f"sink{i}") for i, (_, c, _) in enumerate(_PLACEMENTS))
    spec = SweepSpec(configs=configs, deltas=sz.deltas_l, ns=(sz.n,), seeds=sz.seeds, q_len=sz.q_len, d=sz.d,
                     k_sink=0, sink_logit="delta", sampled_mse=False)
    res = _run(spec, out, "sinks", quick)
    rows = []
    for (label, cfg, seg), c in zip(_PLACEMENTS, configs):
        for dl in sz.deltas_l:
            fz, fz_se = mean_sem(res.get("frac_zeroed", config=c.name, n=sz.n, delta=dl))
            zm, _ = mean_sem(res.get("zeroed_mass", config=c.name, n=sz.n, delta=dl))
            me, _ = mean_sem(res.get("mse_expected", config=c.name, n=sz.n, delta=dl))
            pred = (float(theory.learned_sink_collapse_fraction(dl, cfg.scale, n_segments=seg))
                    if cfg.sink_mode != "epilogue" else 0.0)
            if cfg.sink_mode == "block_max":  # folded into every segment's max: the one-pass law
                pred = float(theory.learned_sink_collapse_fraction(dl, cfg.scale))
            rows.append({"placement": cfg.sink_mode, "order": cfg.order, "scale": cfg.scale, "segments": seg,
                         "label": label, "delta_l": dl, "seeds": sz.seeds, "frac_zeroed": fz,
                         "frac_zeroed_sem": fz_se, "zeroed_mass": zm, "mse_expected": me, "theory_frac": pred})
    return rows


def _saturation_study(sz: Sizes, out: Path, quick: bool) -> list[dict]:
    base = get_preset("fa4")
    configs = tuple(base.replace(rescale_threshold=t, name=f"fa4_tau{t:g}") for t in _TAUS)
    rows = []
    for sigma in sz.sigmas:
        spec = SweepSpec(configs=configs, deltas=(0.0,), ns=(sz.n,), seeds=sz.seeds, q_len=sz.q_len, d=sz.d,
                         k_sink=0, sigma=sigma, sampled_mse=False)
        res = _run(spec, out, f"sat{sigma:g}", quick)
        for tau, c in zip(_TAUS, configs):
            fs, fs_se = mean_sem(res.get("frac_saturated", config=c.name, n=sz.n, delta=0.0))
            sm, sm_se = mean_sem(res.get("saturated_mass", config=c.name, n=sz.n, delta=0.0))
            me, me_se = mean_sem(res.get("mse_expected", config=c.name, n=sz.n, delta=0.0))
            rows.append({"tau_log2": tau, "sigma": sigma, "scale": c.scale, "seeds": sz.seeds,
                         "max_scaled_p": float(theory.max_scaled_p(c.scale, tau)), "frac_saturated": fs,
                         "frac_saturated_sem": fs_se, "saturated_mass": sm, "saturated_mass_sem": sm_se,
                         "mse_expected": me, "mse_expected_sem": me_se})
    return rows


def _verdict(zeroed: float, saturated: float, ratio: float, ratio_se: float, seeds: int) -> str:
    words = []
    if zeroed > 0.5:
        words.append("collapses (most non-sink P zeroed)")
    elif zeroed > 0.05:
        words.append("partial collapse")
    if saturated > 0:
        words.append("saturates")
    above = decide(ratio, ratio_se, 1.1, z_value(seeds))
    if above is True:
        words.append("error above the reverse S = 256 floor")
    elif above is False:
        words.append("at the floor (within 10 %)")
    else:
        words.append(f"within noise of the 10 % line at {seeds} seeds")
    return "; ".join(words)


def _presets_study(sz: Sizes, out: Path, quick: bool) -> list[dict]:
    studied = PRESETS_STUDIED if sz.presets is None else sz.presets
    names = (_BEST, *studied)
    rows = []
    for kind, kw in (("token sinks (k = 4)", {"k_sink": 4}), ("learned sink", {"k_sink": 0, "sink_logit": "delta"})):
        spec = SweepSpec(configs=names, deltas=(7.0, 10.0), ns=(sz.n,), seeds=sz.seeds, q_len=sz.q_len, d=sz.d,
                         sampled_mse=False, **kw)
        res = _run(spec, out, "presets-" + kind.split()[0], quick)
        for name in studied:
            cfg = get_preset(name)
            for dl in spec.deltas:
                m = {k: res.get(k, config=name, n=sz.n, delta=dl) for k in
                     ("frac_zeroed", "zeroed_mass", "frac_saturated", "saturated_mass", "mse_expected")}
                mean = {k: mean_sem(v)[0] for k, v in m.items()}
                r, r_se = paired_ratio(m["mse_expected"], res.get("mse_expected", config=_BEST, n=sz.n, delta=dl))
                rows.append({"preset": name, "workload": kind, "delta": dl, "n": sz.n, "seeds": sz.seeds,
                             "describe": cfg.describe(), **mean, "ratio_vs_best": r, "ratio_vs_best_sem": r_se,
                             "verdict": _verdict(mean["frac_zeroed"], mean["frac_saturated"], r, r_se, sz.seeds)})
    return rows


#: Share of each real head's attention mass the injected learned sink absorbs (our own construction).
SINK_SHARE = 0.3
#: Presets run end to end on SmolLM2 with the injected sinks.
E2E_PRESETS = ("fwd_s1", "rev_s256", "fa3", "trtllm_fmha_v2", "vllm_triton_fp8", "cudnn_fp8_tau0", "cudnn_fp8",
               "sglang_triton_decode")


def calibrate_sinks(q, k, share: float, *, iters: int = 60):
    """Per (layer, head) learned-sink logits that absorb ``share`` of the attention mass on average.

    ``q [L, T, Hq, D]``, ``k [L, T, Hkv, D]`` (post-RoPE, one sequence). With LSE_i the log-sum-exp of
    row i's causal logits, the sink takes σ(s − LSE_i) of row i's mass; s solves mean_i σ(s − LSE_i) =
    ``share`` (monotone in s: bisection). Returns ``[L, Hq]`` float32.
    """
    import jax
    import jax.numpy as jnp

    from pcast_jax.models.llama import expand_kv

    t, hq, d = q.shape[1], q.shape[2], q.shape[3]

    def lse(ql, kl):
        logits = jnp.einsum("thd,shd->hts", ql, expand_kv(kl, hq), precision="highest") / math.sqrt(d)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
        return jax.nn.logsumexp(logits, axis=-1)  # (Hq, T)

    rows = jax.lax.map(lambda a: lse(*a), (q, k))  # (L, Hq, T)
    lo, hi = jnp.min(rows, -1) - 30.0, jnp.max(rows, -1) + 30.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        big = jnp.mean(jax.nn.sigmoid(mid[..., None] - rows), -1) > share
        lo, hi = jnp.where(big, lo, mid), jnp.where(big, mid, hi)
    return np.asarray((lo + hi) / 2, np.float32)


def _real_model_study(n_tokens: int, presets, log) -> tuple[list[dict], dict]:
    """SmolLM2 with an injected learned sink per head: KL and top-1 agreement of each preset against
    the exact softmax with the same sinks (needs the ``model`` extra: ImportError otherwise)."""
    import jax.numpy as jnp

    from pcast_jax import nn
    from pcast_jax.analysis.logit_metrics import compare_logits
    from pcast_jax.models import extract_qkv, forward, load_model, load_tokenizer, stdlib_text_tokens

    cfg, params = load_model()
    tokens = jnp.asarray(stdlib_text_tokens(load_tokenizer(), n_tokens))
    trace = extract_qkv(params, cfg, tokens)
    sinks = jnp.asarray(calibrate_sinks(trace.q, trace.k, SINK_SHARE))

    def hook_for(config):
        def hook(q, k, v, layer):
            return nn.dot_product_attention(q, k, v, is_causal=True, config=config, sinks=sinks[layer])
        return hook

    ref = forward(params, cfg, tokens, attention_fn=hook_for(None))
    plain = compare_logits(forward(params, cfg, tokens), ref, tokens)  # what the sinks themselves change
    rows = []
    for name in presets:
        log(f"sinks and rescale: SmolLM2 with injected sinks, {name}")
        m = compare_logits(ref, forward(params, cfg, tokens, attention_fn=hook_for(name)), tokens)
        rows.append({"preset": name, "tokens": n_tokens, "sink_share": SINK_SHARE, "kl": m.kl,
                     "top1_agreement": m.top1_agree, "perplexity": m.perplexity})
    info = {"sinks_min": float(jnp.min(sinks)), "sinks_max": float(jnp.max(sinks)),
            "sinks_median": float(jnp.median(sinks)), "kl_sinks_vs_none": plain.kl, "ppl_ref": float(
                compare_logits(ref, ref, tokens).perplexity)}
    return rows, info


def _sinks_figure(rows: list[dict], path: Path) -> None:
    fig, ax = report.new_figure(figsize=(7.5, 4.8))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    colors = ["#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#1f77b4", "#17becf", "#8c564b", "#e377c2"]
    markers = ["o", "s", "^", "D", "v", "<", "x", "+"]  # coinciding curves stay visible: open markers of each size
    for i, (label, color, marker) in enumerate(zip(labels, colors, markers)):
        sel = [r for r in rows if r["label"] == label]
        ax.plot([r["delta_l"] for r in sel], [100 * r["frac_zeroed"] for r in sel], marker=marker, ls="-",
                ms=9 - 0.7 * i, mfc="none", lw=1.0, color=color, label=label)
    theory_curves: dict = {}
    for r in rows:  # one dashed line per distinct closed form
        key = (r["scale"], r["segments"] if r["placement"] == "init_max" else 1, r["placement"] == "epilogue")
        theory_curves.setdefault(key, {})[r["delta_l"]] = r["theory_frac"]
    for pts in theory_curves.values():
        xs = sorted(pts)
        ax.plot(xs, [100 * pts[x] for x in xs], "k--", lw=0.9, alpha=0.7)
    ax.plot([], [], "k--", lw=0.9, label="closed form")
    ax.set_xlabel("learned-sink logit Δ_L (above the non-sink mean)")
    ax.set_ylabel("non-sink P zeroed (%)")
    ax.set_title("Learned sink: zeroed P per placement and KV order (B = 64)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    report.save_figure(fig, path)


def _saturation_figure(rows: list[dict], path: Path) -> None:
    fig, (left, right) = report.new_figure(ncols=2, figsize=(9.0, 4.0))
    for tau in _TAUS:
        sel = [r for r in rows if r["tau_log2"] == tau]
        label = f"τ = {tau:g} (log2): P·S ≤ {sel[0]['max_scaled_p']:.0f}"
        sig = [r["sigma"] for r in sel]
        left.plot(sig, [100 * r["frac_saturated"] for r in sel], "o-", ms=4, label=label)
        right.plot(sig, [100 * r["saturated_mass"] for r in sel], "o-", ms=4, label=label)
    left.set_ylabel("P values saturated at 448 (%)")
    right.set_ylabel("probability mass they carry (%)")
    for ax in (left, right):
        ax.set_xlabel("σ of the logits")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7.5)
    fig.suptitle("FA4 FP8 (reverse, S = 256): saturation vs lazy-rescale threshold τ", fontsize=10)
    report.save_figure(fig, path)


def _crossing(rows: list[dict], label: str) -> float:
    """Δ_L where the simulated zeroed fraction crosses 1/2 (linear interpolation), NaN if it does not."""
    sel = [(r["delta_l"], r["frac_zeroed"]) for r in rows if r["label"] == label]
    for (x0, y0), (x1, y1) in zip(sel, sel[1:]):
        if y0 < 0.5 <= y1:
            return x0 + (0.5 - y0) * (x1 - x0) / (y1 - y0)
    return float("nan")


def _findings(sinks: list[dict], sat: list[dict], presets: list[dict]) -> list[str]:
    def at(label, dl):
        return next(r for r in sinks if r["label"] == label and r["delta_l"] == dl)

    dl = 9.0 if any(r["delta_l"] == 9.0 for r in sinks) else sinks[len(sinks) // 16]["delta_l"]
    fwd, rev, epi = at("init_max fwd S=1", dl), at("init_max rev S=1", dl), at("epilogue fwd S=1", dl)
    split = at("init_max fwd S=1 ×4 seg.", dl)
    c256 = _crossing(sinks, "init_max fwd S=256")
    lines = [
        f"**Order no longer fixes it.** With the learned sink as the initial running max, forward and reverse "
        f"zero {report.fmt_pct(fwd['frac_zeroed'])} and {report.fmt_pct(rev['frac_zeroed'])} of the non-sink P at "
        f"Δ_L = {dl:g} (closed form {report.fmt_pct(fwd['theory_frac'])}); an epilogue kernel zeroes "
        f"{report.fmt_pct(epi['frac_zeroed'])}. Four split-KV segments cut it to "
        f"{report.fmt_pct(split['frac_zeroed'])} (closed form F/4: {report.fmt_pct(split['theory_frac'])}).",
    ]
    if math.isfinite(c256):
        lines.append(f"**S = 256 moves the threshold** to Δ_L ≈ {c256:.2f} (simulated crossing of 1/2; closed form "
                     f"10 ln 2 + ln 256 = {float(theory.learned_sink_critical_delta(256.0)):.2f}).")
    worst = max(sat, key=lambda r: r["frac_saturated"])
    safe = [r for r in sat if r["max_scaled_p"] <= 448]
    lines.append(
        f"**Saturation.** The most P saturated is {report.fmt_pct(worst['frac_saturated'], 2)} at τ = "
        f"{worst['tau_log2']:g}, σ = {worst['sigma']:g} (P·S up to {worst['max_scaled_p']:.0f}); every threshold whose "
        f"bound stays within 448 saturates nothing: "
        f"{'yes' if all(r['frac_saturated'] == 0 for r in safe) else 'no'} ({len(safe)} cells).")
    bad = sorted({r["preset"] for r in presets if r["frac_zeroed"] > 0.5})
    sat_p = sorted({r["preset"] for r in presets if r["frac_saturated"] > 0})
    lines.append(f"**Sink and lazy-rescale presets.** Most non-sink P zeroed somewhere at these operating points: "
                 f"{', '.join(bad) or 'none'}; saturating: {', '.join(sat_p) or 'none'}.")
    return lines


def sinks_and_rescale_section(out_dir, quick: bool = False, log=None, sizes: Sizes | None = None) -> str:
    """Run the three studies, write their CSV and PNG files into ``out_dir``; return the markdown section."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sz = sizes or (QUICK if quick else FULL)
    say = log or (lambda line: None)
    say("sinks and rescale: learned-sink placements")
    sinks = _sinks_study(sz, out, quick)
    say("sinks and rescale: saturation vs tau and sigma")
    sat = _saturation_study(sz, out, quick)
    say("sinks and rescale: the presets")
    presets = _presets_study(sz, out, quick)
    try:
        real, real_info = _real_model_study(sz.model_tokens, E2E_PRESETS[:3] if quick else E2E_PRESETS, say)
    except ImportError as exc:  # the model extra is optional
        real, real_info = [], {"missing": str(exc)}
    report.write_csv(out / f"{NAME}_sinks.csv", sinks)
    report.write_csv(out / f"{NAME}_saturation.csv", sat)
    report.write_csv(out / f"{NAME}_presets.csv", presets)
    if real:
        report.write_csv(out / f"{NAME}_smollm2.csv", real)
    _sinks_figure(sinks, out / f"{NAME}_sinks.png")
    _saturation_figure(sat, out / f"{NAME}_saturation.png")
    pct = report.fmt_pct
    sat_table = report.markdown_table(sat, [
        ("tau_log2", "τ (log2)", lambda x: f"{x:g}"), ("sigma", "σ", lambda x: f"{x:g}"),
        ("max_scaled_p", "largest P·S", lambda x: f"{x:.0f}"),
        ("frac_saturated", "P saturated", lambda x: pct(x, 3)),
        ("saturated_mass", "mass saturated", lambda x: pct(x, 2)),
        ("mse_expected", "expected MSE", report.fmt_sci)], name=f"{NAME}_saturation")
    rows_fmt = [{**r, "ratio_vs_best": fmt_pm(r["ratio_vs_best"], r["ratio_vs_best_sem"], 2, "×")} for r in presets]
    preset_table = report.markdown_table(rows_fmt, [
        ("preset", "preset"), ("workload", "workload"), ("delta", "Δ or Δ_L", lambda x: f"{x:g}"),
        ("frac_zeroed", "zeroed", pct), ("frac_saturated", "saturated", lambda x: pct(x, 3)),
        ("ratio_vs_best", "MSE / rev S=256"), ("verdict", "verdict")], name=f"{NAME}_presets")
    if real:
        real_md = [
            f"**Learned sinks injected into SmolLM2-135M** ({real[0]['tokens']} tokens of Python standard-library "
            f"source; our own construction, the model has none): per layer and head one sink logit chosen so that it "
            f"absorbs {pct(SINK_SHARE, 0)} of the head's attention mass on average (logits "
            f"{real_info['sinks_min']:.1f} … {real_info['sinks_max']:.1f}, median {real_info['sinks_median']:.1f}). "
            "Each preset runs every layer through the drop-in `dot_product_attention(..., sinks=...)`; KL and top-1 "
            "agreement are against the exact softmax with the same sinks (perplexity "
            f"{real_info['ppl_ref']:.3g}).",
            "",
            report.markdown_table(real, [
                ("preset", "preset"), ("kl", "KL (nats/token)", report.fmt_sci),
                ("top1_agreement", "top-1 agreement", lambda x: pct(x, 1)),
                ("perplexity", "perplexity", lambda x: f"{x:.3g}")], name=f"{NAME}_smollm2"),
            "",
        ]
    else:
        real_md = [f"The SmolLM2 part needs the real-model extra ({real_info['missing']}).", ""]
    return "\n".join([
        f"## {TITLE}",
        "",
        "Our own analysis, beyond the paper: the presets follow the kernels' sources (`pcast_jax/presets/`, each "
        "citing file and line; assumptions stated there), and the closed forms are ours "
        "(`theory.learned_sink_collapse_fraction`, `theory.max_scaled_p`). Synthetic logits N(0, σ²), "
        f"N = {sz.n}, {sz.q_len} query rows, {sz.seeds} seeds, expected MSE (V averaged out).",
        "",
        "\n\n".join(_findings(sinks, sat, presets)),
        "",
        f"![learned sinks]({NAME}_sinks.png)",
        "",
        f"![saturation]({NAME}_saturation.png)",
        "",
        sat_table,
        "",
        preset_table,
        "",
        *real_md,
        "Verdicts: a ratio is decided against 1.1 only outside ratio ± t·s.e. (95 %), else it says so. Data: "
        + ", ".join(f"[`{f}`]({f})" for f in FILES if f.endswith(".csv")) + ".",
    ])
