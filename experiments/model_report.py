"""The real-model report (beyond the paper): renders :mod:`pcast_jax.models.fp8_study` as markdown, CSV and figures.

:func:`build_report` runs the study (P-cast error per layer and head of SmolLM2-135M, theory vs
measured, end-to-end perplexity / KL / top-1 agreement with FP8 attention), writes the files of
:data:`FILES` into a folder through :mod:`pcast_jax.report` (atomic CSV and PNG writes, Figure
objects, no pyplot state) and returns the markdown. ``pcast model-report`` wraps it into
``DIR/model_report.md`` (:mod:`pcast_experiments.model_command`); the reproduction report embeds the same
markdown as a section (:func:`model_section`). The library computes the study; this application renders it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import numpy as np

from pcast_jax import report
from pcast_jax.analysis.study import SINK_MASS_MIN
from pcast_jax.errors import PcastError, check_int
from pcast_jax.models.fp8_study import (
    FULL,
    HELDOUT_FILES,
    MAX_TOKENS,
    QUICK,
    SCALES,
    ModelStudy,
    ReportSizes,
    Stopwatch,
    describe,
    heldout_tokens,
    run_study,
    safe_ratio,
)

__all__ = ["HELDOUT_FILES", "ReportSizes", "FULL", "QUICK", "build_report", "heldout_tokens",
           "FILES"]

#: Files :func:`build_report` writes (name → what it holds).
FILES: dict[str, str] = {
    "model_heads.csv": "per (configuration, layer, head): MSE, relative MSE, fraction of non-sink P "
                       "zeroed (pooled over rows, frac_zeroed, and the mean of per-row fractions, "
                       "frac_zeroed_row_mean), zeroed mass, with the head's sink statistics",
    "model_layers.csv": "per layer: sink gap Δ, σ, relative MSE of every configuration, MSE ratios, "
                        "fractions zeroed (mean over heads of frac_zeroed_row_mean)",
    "model_theory.csv": "per (layer, head): Δ, σ, Eq. (7) with σ = 1 and with the measured σ, the "
                        "Eq. (6) count, Thm. 4 at the measured σ, and the simulator's measured "
                        "zeroed fractions (frac_zeroed_row_mean)",
    "model_e2e.csv": "per configuration: perplexity, mean and max KL(FP32 ‖ FP8), top-1 agreement "
                     "on the held-out text",
    "model_decode.csv": "decode view per (kernel, phase, layer, head): the last positions' queries against "
                        "the whole KV cache under the prefill preset and the split-KV decode preset: MSE, "
                        "relative MSE, fraction of non-sink P zeroed (frac_zeroed_row_mean), zeroed mass, "
                        "the head's sink",
    "model_sink_gap.png": "heatmaps of the sink gap Δ and of σ per layer × head",
    "model_mse_ratio.png": "heatmap of the Fwd S=1 / Rev S=256 MSE ratio per layer × head, and "
                           "per-layer ratios",
    "model_theory.png": "Eq. (7) (σ = 1 and measured σ) vs the measured zeroed fraction, per head",
    "model_e2e.png": "KL(FP32 ‖ FP8) and top-1 disagreement per configuration",
}


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


#: Percentile a robust colour range ends at: one extreme head (a sink gap of 30 among gaps of 5–12)
#: would otherwise take the whole colour scale and leave every other head one colour.
ROBUST_PERCENTILE = 98.0


def _heatmap(ax, data, title, cmap, label, fig, vmin=None, vmax=None, center=None, robust: bool = False):
    """One value per (layer, head) as an image with its colour bar.

    ``center``: a diverging scale symmetric about it (equal distances from it, equal colour
    strength; the colour bar ticks both sides). ``robust``: the colour range ends at the
    :data:`ROBUST_PERCENTILE` th percentile when values beyond it lie far out; the colour bar then
    points past its end and the title names the largest value.
    """
    from matplotlib.colors import Normalize

    data = np.asarray(data, np.float64)
    finite = data[np.isfinite(data)]
    extend = "neither"
    if center is not None:
        dist = np.abs(finite - center)
        half = max(float(np.max(dist)) if finite.size else 0.0, 1e-6)
        if robust and finite.size:
            top = float(np.percentile(dist, ROBUST_PERCENTILE))
            if top > 0 and half - top > 0.25 * top:
                over, under = bool(np.any(finite > center + top)), bool(np.any(finite < center - top))
                extend = "both" if over and under else "max" if over else "min"
                title = (f"{title}\n(colours span ±{top:.3g}, the {ROBUST_PERCENTILE:g}th percentile; values "
                         f"{float(np.min(finite)):.3g} to {float(np.max(finite)):.3g})")
                half = top
        norm = Normalize(vmin=center - half, vmax=center + half)
    else:
        if robust and finite.size:
            lo, hi = float(np.min(finite)), float(np.max(finite))
            top = float(np.percentile(finite, ROBUST_PERCENTILE))
            if hi - top > 0.25 * (top - lo):  # the last few values would stretch the scale by a quarter or more
                vmax = top if vmax is None else vmax
                extend = "max"
                title = f"{title}\n(colours end at {top:.3g}, the {ROBUST_PERCENTILE:g}th percentile; max {hi:.3g})"
        norm = Normalize(vmin=vmin, vmax=vmax)
    im = ax.imshow(data, aspect="auto", cmap=cmap, origin="lower", interpolation="nearest", norm=norm)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(data.shape[1]))
    return fig.colorbar(im, ax=ax, label=label, extend=extend)


def _fig_sink_gap(study: ModelStudy, path):
    stats = study.stats
    fig, axes = report.new_figure(ncols=2, figsize=(10.0, 5.5))
    _heatmap(axes[0], stats["delta"], "sink gap Δ = max sink logit − non-sink mean", "viridis",
             "Δ (logits)", fig, robust=True)
    _heatmap(axes[1], stats["sigma"], "σ = std of non-sink logits", "magma", "σ (logits)", fig, robust=True)
    report.save_figure(fig, path)


def _fig_mse_ratio(study: ModelStudy, layer_rows, path):
    heads = study.heads
    fig, axes = report.new_figure(ncols=2, figsize=(11.0, 5.5))
    ratio = np.log10(heads["fwd_s1"]["mse"] / np.maximum(heads["rev_s256"]["mse"], 1e-30))
    _heatmap(axes[0], ratio, "log10 MSE(Fwd S=1) / MSE(Rev S=256) per head", "RdBu_r",
             "log10 ratio", fig, center=0.0, robust=True)
    ax = axes[1]
    layers = [r["layer"] for r in layer_rows]
    drawn = []
    for key, label, color in (("ratio_fwd_s1/rev_s256", "Fwd S=1 / Rev S=256", "#d62728"),
                              ("ratio_fwd_s256/rev_s256", "Fwd S=256 / Rev S=256", "#2ca02c"),
                              ("ratio_fwd_s1+qkv8/rev_s256+qkv8", "same, E4M3 Q/K/V", "#7f7f7f")):
        if key in layer_rows[0]:
            drawn += [r[key] for r in layer_rows]
            ax.plot([r[key] for r in layer_rows], layers, "o-", color=color, label=label, ms=4)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    pos = [v for v in drawn if np.isfinite(v) and v > 0] + [1.0]
    narrow = max(pos) / min(pos) < 20  # within about a decade: ticks at 1, 1.5, 2, 3, 5, 7 (else 1, 2, 5)
    report.label_log_axis(ax.xaxis, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if narrow else (1.0, 2.0, 5.0))
    ax.set_xlabel("layer MSE ratio (sum over heads)")
    ax.set_ylabel("layer")
    ax.set_title("MSE ratio per layer", fontsize=10)
    ax.legend(fontsize=8)
    report.save_figure(fig, path)


def _fig_theory(theory_rows, path):
    """One panel per scale that the run measured (Forward S=1 and/or S=256); none → no figure."""
    scales = [scale for scale in SCALES if theory_rows and f"measured_fwd_s{scale}" in theory_rows[0]]
    if not scales:
        return None
    fig, axes = report.new_figure(ncols=len(scales), figsize=(5.0 * len(scales) + 0.6, 4.8))
    axes = np.atleast_1d(axes)
    for ax, scale in zip(axes, scales):
        key = f"measured_fwd_s{scale}"
        y = np.array([r[key] for r in theory_rows])
        x_sigma = np.array([r[f"eq7_sigma_s{scale}"] for r in theory_rows])
        x_one = np.array([r[f"eq7_sigma1_s{scale}"] for r in theory_rows])
        x_count = np.array([r[f"eq6_count_s{scale}"] for r in theory_rows])
        layer = np.array([r["layer"] for r in theory_rows])
        ax.scatter(x_one, y, s=10, marker="x", color="0.6", label="Eq. (7), σ = 1 (paper)")
        sc = ax.scatter(x_sigma, y, s=14, c=layer, cmap="viridis", label="Eq. (7), measured σ")
        ax.scatter(x_count, y, s=8, marker="+", color="#d62728", alpha=0.6,
                   label="Eq. (6) counted on the logits")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("predicted fraction of non-sink P zeroed")
        ax.set_ylabel(f"measured, Forward S={scale}")
        ax.set_title(f"S = {scale}: theory vs simulator, one point per head", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.colorbar(sc, ax=list(axes), label="layer")
    return report.save_figure(fig, path)


def _log_bars(ax, y, values, *, color, xlabel, zero_text):
    """Horizontal bars on a log axis; a value of exactly 0 gets no bar but a label (a log axis has no 0)."""
    values = np.asarray(values, np.float64)
    pos = values[np.isfinite(values) & (values > 0)]
    lo = float(pos.min()) / 3.0 if pos.size else 1e-6
    hi = float(pos.max()) * 3.0 if pos.size else 1.0
    ax.barh(y, np.where(values > 0, values, np.nan), color=color)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    for yi, v in zip(y, values):
        if v == 0:
            ax.text(lo * 1.15, yi, zero_text, va="center", ha="left", fontsize=7, color="0.3")
    ax.set_xlabel(xlabel)


def _fig_e2e(e2e_rows, path):
    rows = [r for r in e2e_rows if r["config"] != "fp32"]
    fig, axes = report.new_figure(ncols=2, figsize=(11.0, 0.32 * len(rows) + 1.6))
    names = [r["config"] for r in rows]
    y = np.arange(len(rows))
    _log_bars(axes[0], y, [r["kl"] for r in rows], color="#1f77b4",
              xlabel="mean KL(FP32 ‖ FP8) per token (nats)", zero_text="0 (identical to FP32)")
    _log_bars(axes[1], y, [1.0 - r["top1_agree"] for r in rows], color="#ff7f0e",
              xlabel="top-1 disagreement with FP32", zero_text="0 (same top-1 on every token)")
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)  # first config on top; every row in view, bar or not
    return report.save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _f3(x):
    return report.fmt_num(x, 3)


def _f2(x):
    return report.fmt_num(x, 2)


def _sci(x):
    return report.fmt_sci(x, 2)


def _x(x):
    return report.fmt_ratio(x, 2)


def _med(x):
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else float("nan")


#: The zeroed mass a row may lose before the report calls the collapse one that matters (``pcast analyze``'s
#: default ``mass_limit``).
MASS_LIMIT = 1e-3


def _summary(study: ModelStudy, layer_rows, theory_rows, e2e_rows, tokens) -> list[str]:
    """Plain statements, each with the numbers behind it, worded for the model in hand (a model without a
    sink is not told that its P collapses)."""
    heads, stats = study.heads, study.stats
    out = []
    sink_heads = int(np.sum(np.asarray(stats["sink_mass"]) >= SINK_MASS_MIN))
    total = int(np.size(stats["sink_mass"]))
    gap = (f"the sink gap Δ (max sink logit − non-sink mean) has median {_f2(_med(stats['delta']))} logits over all "
           f"heads, and the non-sink logits have σ = {_f2(_med(stats['sigma']))} (median), not the paper's σ = 1")
    if sink_heads == 0:
        out.append(
            f"**Sinks: none.** No head of this model has a sink: no key takes ≥ {SINK_MASS_MIN:.0%} of a head's "
            "attention (the most-attended key of a head takes a median "
            f"{report.fmt_pct(_med(stats['sink_mass']))}); {gap}. "
            "P-collapse needs a sink far above the other logits, so it is not expected here.")
    else:
        sink0 = np.all(stats["sink_positions"][:, :, 0] == 0, axis=1)
        first = len(sink0)
        while first > 0 and sink0[first - 1]:
            first -= 1
        where = (f"position 0 is the sink of every head of layers {first}–{len(sink0) - 1}" if first < len(sink0)
                 else "position 0 is not the sink of every head of any last layers")
        out.append(f"**Sinks.** {sink_heads} of {total} heads have a sink (one key takes ≥ {SINK_MASS_MIN:.0%} of "
                   f"the attention); {where}; {gap}.")
    th = {k: np.array([r.get(k, np.nan) for r in theory_rows], np.float64) for k in theory_rows[0]}

    def mae(pred, meas):
        ok = np.isfinite(th[pred]) & np.isfinite(th[meas])
        return float(np.mean(np.abs(th[pred][ok] - th[meas][ok]))) if ok.any() else float("nan")

    if "fwd_s1" in heads:
        fz1 = heads["fwd_s1"]["frac_zeroed_row_mean"]
        worst = float(np.nanmax(heads["fwd_s1"]["zeroed_mass"]))
        if sink_heads == 0:
            title = (f"**No sink, so no P-collapse; what Forward S=1 zeroes comes from the spread of the logits** "
                     f"(worst head: {_sci(worst)} of a row's mass).")
        elif worst > MASS_LIMIT:
            title = "**P-collapse in forward order (holds).**"
        else:
            title = (f"**P-collapse in forward order (harmless here: the zeroed P carry at most {_sci(worst)} of a "
                     "row's mass per head).**")
        out.append(
            f"{title} Forward S=1 zeroes a median "
            f"{report.fmt_pct(_med(fz1))} of the non-sink P per head (up to {report.fmt_pct(np.nanmax(fz1))}), "
            "carrying "
            f"a median {_sci(_med(heads['fwd_s1']['zeroed_mass']))} of each row's softmax mass. "
            f"Eq. (7) with each head's measured Δ and σ, Φ((Δ − 6.93 − ln S)/σ), predicts the "
            f"fraction with a mean absolute error of {report.fmt_pct(mae('eq7_sigma_s1', 'measured_fwd_s1'))}"
            f" over heads; counting the logits below max sink − 6.93 (Eq. (6), no Gaussian "
            f"assumption) is off by {report.fmt_pct(mae('eq6_count_s1', 'measured_fwd_s1'))}. The paper's "
            f"σ = 1 form Φ(Δ − 6.93) is off by {report.fmt_pct(mae('eq7_sigma1_s1', 'measured_fwd_s1'))}: it "
            f"is too steep (near-total collapse for Δ ≳ 9, none for Δ ≲ 4).")
    if "fwd_s256" in heads:
        fz256 = heads["fwd_s256"]["frac_zeroed_row_mean"]
        lead = ("**S = 256 does not stop underflow on this model (the σ = 1 prediction fails), but what it zeroes "
                "carries almost no mass.**" if _med(fz256) > 0.01 else "**S = 256 stops underflow on this model.**")
        txt = (f"{lead} Forward S=256 still zeroes a median "
               f"{report.fmt_pct(_med(fz256))} of non-sink P per head (max {report.fmt_pct(np.nanmax(fz256))}); "
               f"Eq. (7) with the measured σ tracks it (mean abs. error "
               f"{report.fmt_pct(mae('eq7_sigma_s256', 'measured_fwd_s256'))}) where the paper's σ = 1 form "
               f"predicts almost none (error {report.fmt_pct(mae('eq7_sigma1_s256', 'measured_fwd_s256'))}).")
        if "rev_s256" in heads:
            txt += (f" Reverse S=256 zeroes a median {report.fmt_pct(_med(heads['rev_s256']['frac_zeroed_row_mean']))} "
                    f"too: its pre-sink running max sits ~σ·√(2 ln N) above the non-sink mean, so "
                    f"with σ ≈ 3 the tail below max − 12.5 is not empty (Thm. 4's zero-underflow "
                    f"bound assumes σ = 1; at the measured σ it predicts "
                    f"{report.fmt_pct(_med(th['thm4_sigma_s256']))} for the median head).")
        txt += (f" The softmax mass of the zeroed P is a median "
                f"{_sci(_med(heads['fwd_s256']['zeroed_mass']))} per row for Forward S=256 vs "
                f"{_sci(_med(heads['fwd_s1']['zeroed_mass']))} for Forward S=1." if "fwd_s1" in heads else "")
        out.append(txt)
    if "fwd_s1" in heads and "rev_s256" in heads:
        per_head = heads["fwd_s1"]["mse"] / np.maximum(heads["rev_s256"]["mse"], 1e-30)
        lr = np.array([r["ratio_fwd_s1/rev_s256"] for r in layer_rows])
        total = safe_ratio(np.sum(heads["fwd_s1"]["mse"]), np.sum(heads["rev_s256"]["mse"]))
        txt = (f"**MSE.** Forward S=1 has {_x(total)} the attention-output MSE of Reverse S=256 "
               f"summed over all heads (per-layer ratio median {_x(_med(lr))}, range "
               f"{_x(np.nanmin(lr))}–{_x(np.nanmax(lr))}; per head median {_x(_med(per_head))}, "
               f"{np.mean(per_head > 1):.0%} of heads worse). Relative MSE of Forward S=1 is "
               f"{_sci(_med(heads['fwd_s1']['rel_mse']))} (median head) vs "
               f"{_sci(_med(heads['rev_s256']['rel_mse']))} for Reverse S=256.")
        if "fwd_s256" in heads:
            r2 = safe_ratio(np.sum(heads["fwd_s256"]["mse"]), np.sum(heads["rev_s256"]["mse"]))
            txt += (f" Forward S=256 / Reverse S=256 = {_x(r2)}: the paper's saturation (either fix "
                    f"alone reaches the same floor) " + ("holds" if r2 < 1.25 else "does not hold")
                    + " on this model.")
            if "dynamic_pow2" in heads and r2 >= 1.25:
                r3 = safe_ratio(np.sum(heads["dynamic_pow2"]["mse"]), np.sum(heads["fwd_s256"]["mse"]))
                txt += (f" The gap is not underflow: the forward dynamic per-block 2^k scale zeroes "
                        f"a median {report.fmt_pct(_med(heads['dynamic_pow2']['frac_zeroed_row_mean']))} of non-sink P "
                        f"yet has {_x(r3)} the MSE of Forward S=256. The likely cause (seen on a "
                        f"deep head by splitting Σ(W − P)² by the size of P): the MSE is dominated "
                        f"by the E4M3 rounding of the few large non-sink P (0.02–1); reverse order "
                        f"casts each block relative to the running max at that time, so the key "
                        f"that sets a new running max is cast as exactly 1·S and the later rescale "
                        f"exp(m_old − m_new) is FP32, while forward order casts every non-sink P "
                        f"relative to the sink.")
        pairs = [(a, b) for a, b in (("fwd_s448", "fwd_s256"), ("flashinfer_sm90", "fa3"))
                 if a in heads and b in heads]
        if pairs:
            txt += (" S = 448 vs S = 256 (paper: 10–15% worse): "
                    + "; ".join(f"{a} / {b} = {_x(safe_ratio(np.sum(heads[a]['mse']), np.sum(heads[b]['mse'])))}"
                                for a, b in pairs) + ".")
        out.append(txt)
    e2e = {r["config"]: r for r in e2e_rows}
    if "fwd_s1" in e2e and "rev_s256" in e2e:
        a, b = e2e["fwd_s1"], e2e["rev_s256"]
        held = "held-out " if not study.token_source or "the next" in study.token_source else ""
        txt = (f"**End to end ({tokens} {held}tokens; the metric the paper lacks).** "
               f"FP32 perplexity {_f3(e2e['fp32']['perplexity'])}. Forward S=1: perplexity "
               f"{_f3(a['perplexity'])}, KL {_sci(a['kl'])} nats/token, top-1 agreement "
               f"{report.fmt_pct(a['top1_agree'])}; Reverse S=256: {_f3(b['perplexity'])}, KL {_sci(b['kl'])}, "
               f"{report.fmt_pct(b['top1_agree'])} — Forward S=1 has {_x(safe_ratio(a['kl'], b['kl']))} the KL.")
        p_only = [r for r in e2e_rows if r["config"] != "fp32" and study.is_p_cast_only(r["config"])]
        fixed = [r for r in p_only if study.fixes_p_collapse(r["config"])]
        if len(p_only) > 2:
            txt += (f" Over all P-cast-only configurations the perplexity moves by at most "
                    f"{report.fmt_pct(max(abs(r['ppl_change']) for r in p_only), 2)} (either sign: "
                    f"below what {tokens} tokens resolve), while the KL orders them")
            if fixed:
                txt += (f": every configuration with S ≥ 256 or dynamic scaling lies in "
                        f"{_sci(min(r['kl'] for r in fixed))}–{_sci(max(r['kl'] for r in fixed))}")
                if "rev_s1" in e2e:
                    txt += f", Reverse S=1 at {_sci(e2e['rev_s1']['kl'])}"
            txt += "."
        if "fwd_s1+qkv8" in e2e and "rev_s256+qkv8" in e2e:
            c, d = e2e["fwd_s1+qkv8"], e2e["rev_s256+qkv8"]
            txt += (f" With E4M3 Q/K/V (one scale per tensor) the KL becomes {_sci(c['kl'])} vs "
                    f"{_sci(d['kl'])} ({_x(safe_ratio(c['kl'], d['kl']))})")
            if "qkv8_exact_p" in e2e:
                floor = e2e["qkv8_exact_p"]["kl"]
                txt += (f"; Q/K/V quantization alone (exact softmax) gives {_sci(floor)}, so the "
                        f"Q/K/V floor " + ("dominates" if floor > a["kl"] else "does not dominate")
                        + " even Forward S=1's P-cast error")
            if "fwd_s1+qkv8h" in e2e and "rev_s256+qkv8h" in e2e:
                c, d = e2e["fwd_s1+qkv8h"], e2e["rev_s256+qkv8h"]
                txt += (f". With one scale per head: {_sci(c['kl'])} vs {_sci(d['kl'])} "
                        f"({_x(safe_ratio(c['kl'], d['kl']))})")
                if "qkv8h_exact_p" in e2e:
                    txt += f", floor {_sci(e2e['qkv8h_exact_p']['kl'])}"
            txt += (". The paper's §7.4 caveat holds: where the Q/K/V quantization floor dominates, "
                    "fixing the P-cast changes the end-to-end error little.")
        out.append(txt)
    return out


def _model_name(cfg, model_path) -> str:
    """SmolLM2-135M-Instruct by default; another model's own name (or its file's)."""
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    return cfg.name.strip() or Path(model_path).name


def _markdown(study: ModelStudy, layer_rows, theory_rows, e2e_rows, level: int, env: str,
              name: str = "SmolLM2-135M-Instruct") -> str:
    h = "#" * level
    sizes, heads, cfg = study.sizes, study.heads, study.model
    lines = [f"{h} Real model: {name} with simulated FP8 attention", ""]
    lines += [
        f"{name} ({cfg.architecture}, {cfg.num_layers} layers, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}; weights dequantized to FP32) "
        f"run in JAX. Every attention is replaced by the kernel-faithful simulator (xla implementation, "
        f"causal, query head h reads KV head h // {cfg.group_size}). Per-head analysis: the FP32 "
        f"model's post-RoPE Q/K/V on "
        + (study.token_source if study.token_source else
           f"the first {sizes.tokens} tokens of `argparse.py`; end to end: the first {sizes.tokens} tokens of "
           f"{', '.join(f'`{f}`' for f in HELDOUT_FILES[:1])} (held out)")
        + ". Presets keep Q/K/V in FP32 (P-cast only, as the paper); `+qkv8` adds E4M3 "
        "Q/K/V with one scale per tensor (amax/448 over the layer's Q, K or V).",
        "",
        "Definitions: a head's *sink* is the key receiving the most attention (mean column sum); "
        "*non-sink P zeroed* = share of a row's non-sink causal P that were > 0 before the cast and "
        "0 after, averaged over the rows with ≥ 16 non-sink keys (the mean of per-row fractions, "
        "`frac_zeroed_row_mean`; `frac_zeroed` in `model_heads.csv` pools the counts over the rows instead); "
        "*MSE* = mean "
        "over rows and dims of (O − O_FP32)², *relative MSE* = MSE / mean(O_FP32²) (V is not unit "
        "variance); *KL* = mean over positions of KL(p_FP32 ‖ p_FP8) of the next-token "
        "distributions; *top-1* = share of positions whose argmax matches the FP32 model.",
        "",
        f"{h}# Findings", "",
    ]
    lines += [f"- {s}" for s in _summary(study, layer_rows, theory_rows, e2e_rows, sizes.tokens)]
    lines.append("")

    # End to end
    lines += [f"{h}# End to end: perplexity, KL and top-1 agreement (`model_e2e.csv`)", ""]
    cols = [("config", "Configuration"), ("description", "What it does"),
            ("perplexity", "Perplexity", _f3), ("ppl_change", "ΔPPL", lambda v: report.fmt_signed(100 * v, 2, "%")),
            ("kl", "KL (nats/token)", _sci), ("kl_max", "max KL", _sci),
            ("top1_agree", "top-1 agree", lambda v: report.fmt_pct(v, 2))]
    md_rows = [dict(r, config=(r["config"] if r["same_as"] == r["config"]
                               else f"{r['config']} (= {r['same_as']})")) for r in e2e_rows]
    lines += [report.markdown_table(md_rows, cols, align="llrrrrr", name="model_e2e"), ""]
    lines += ["![KL and top-1 disagreement per configuration](model_e2e.png)", ""]

    # Per preset summary of the per-head analysis
    lines += [f"{h}# Per head: every configuration on the real Q/K/V (`model_heads.csv`)", ""]
    ref = heads.get("rev_s256")
    prow = []
    for name, m in heads.items():
        alias = study.head_alias[name]
        row = {"config": name if alias == name else f"{name} (= {alias})",
               "desc": describe(study.hooks[name], study.model.head_dim),
               "rel": float(np.sum(m["mse"]) / np.sum(m["ref_sq"])),
               "med_rel": _med(m["rel_mse"]),
               "frac": _med(m["frac_zeroed_row_mean"]), "mass": _med(m["zeroed_mass"])}
        if ref is not None:
            row["ratio"] = safe_ratio(np.sum(m["mse"]), np.sum(ref["mse"]))
        prow.append(row)
    cols = [("config", "Configuration"), ("desc", "What it does"), ("rel", "rel. MSE (all heads)", _sci),
            ("med_rel", "median head rel. MSE", _sci), ("ratio", "MSE / Rev S=256", _x),
            ("frac", "median non-sink P zeroed", report.fmt_pct), ("mass", "median zeroed mass", _sci)]
    lines += [report.markdown_table(prow, cols, align="llrrrrr", name="model_heads (per config)"), ""]

    # Per layer
    lines += [f"{h}# Per layer: sink gap, MSE ratio, zeroed fraction (`model_layers.csv`)", ""]
    cols = [("layer", "Layer"), ("sink_position", "sink pos."), ("delta", "Δ", _f2), ("sigma", "σ", _f2),
            ("sink_mass", "sink mass", _f2)]
    if "fwd_s1" in heads:
        cols.append(("rel_mse_fwd_s1", "rel. MSE Fwd S=1", _sci))
    if "rev_s256" in heads:
        cols.append(("rel_mse_rev_s256", "rel. MSE Rev S=256", _sci))
    for key, head in (("ratio_fwd_s1/rev_s256", "Fwd S=1 / Rev S=256"),
                      ("ratio_fwd_s256/rev_s256", "Fwd S=256 / Rev S=256"),
                      ("ratio_fwd_s1+qkv8/rev_s256+qkv8", "same with E4M3 Q/K/V")):
        if key in layer_rows[0]:
            cols.append((key, head, _x))
    for name, head in (("fwd_s1", "zeroed Fwd S=1"), ("fwd_s256", "zeroed Fwd S=256"),
                       ("rev_s256", "zeroed Rev S=256")):
        if name in heads:
            cols.append((f"frac_zeroed_row_mean_{name}", head, report.fmt_pct))
    lines += [report.markdown_table(layer_rows, cols, name="model_layers"), ""]
    lines += ["![Sink gap Δ and σ per layer × head](model_sink_gap.png)", "",
              "![Fwd S=1 / Rev S=256 MSE ratio](model_mse_ratio.png)", ""]

    # Theory vs measured, per layer means
    lines += [f"{h}# Theory vs measured zeroed fraction (`model_theory.csv`)", "",
              "Per-layer means over heads of: Eq. (7) with the paper's σ = 1, Φ(Δ − 6.93 − ln S); "
              "Eq. (7) with the head's measured σ, Φ((Δ − 6.93 − ln S)/σ) "
              "(`theory.collapse_fraction(Δ, S, k_sink=1, sigma=σ)`: the measured Δ already holds "
              "the max over the sink set, so δk is not added again); the Eq. (6) count of logits "
              "below max sink − 6.93 − ln S; and the simulator's measured fraction. Δ and σ are "
              "head means over rows, plugged in once (the per-row spread is ignored).", ""]
    trows = []
    layers = sorted({r["layer"] for r in theory_rows})
    for layer in layers:
        rs = [r for r in theory_rows if r["layer"] == layer]
        trows.append({k: float(np.nanmean([r.get(k, np.nan) for r in rs]))
                      for k in rs[0] if k not in ("head",)} | {"layer": layer})
    cols = [("layer", "Layer"), ("delta", "Δ", _f2), ("sigma", "σ", _f2)]
    for scale in SCALES:
        cols += [(f"eq7_sigma1_s{scale}", f"S={scale}: Eq.7 σ=1", report.fmt_pct),
                 (f"eq7_sigma_s{scale}", f"S={scale}: Eq.7 σ", report.fmt_pct),
                 (f"eq6_count_s{scale}", f"S={scale}: Eq.6 count", report.fmt_pct)]
        if f"measured_fwd_s{scale}" in theory_rows[0]:
            cols.append((f"measured_fwd_s{scale}", f"S={scale}: measured Fwd", report.fmt_pct))
    if "measured_rev_s256" in theory_rows[0]:
        cols += [("thm4_sigma_s256", "Rev S=256: Thm.4 σ", report.fmt_pct),
                 ("measured_rev_s256", "Rev S=256: measured", report.fmt_pct)]
    lines += [report.markdown_table(trows, cols, name="model_theory"), ""]
    lines += ["![Theory vs measured zeroed fraction per head](model_theory.png)", ""]

    if study.decode_pairs:
        lines += _decode_markdown(study, h)

    wall, cpu = study.clock.total()
    stages = "; ".join(f"{k} {w:.0f} s wall / {c:.0f} s CPU" for k, (w, c) in study.clock.stages.items())
    lines += [f"{h}# Runtime", "",
              f"{sizes.tokens} tokens: {wall:.0f} s wall, {cpu:.0f} s CPU (process time, all threads) "
              f"on {env}. Stages: {stages}.", ""]
    lines += [f"{h}# Files", ""] + [f"- `{k}` — {v}" for k, v in FILES.items()] + [""]
    return "\n".join(lines)


def _decode_markdown(study: ModelStudy, h: str) -> list[str]:
    """The decode view: a paragraph from the numbers and the per (kernel, phase) summary table."""
    sizes, cfg = study.sizes, study.model
    summary = study.decode_summary()
    lines = [f"{h}# Decode phase: last-position queries, split-KV presets (`model_decode.csv`)", "",
             f"A decode step's view of the same traces: the last {sizes.decode_rows} positions of the "
             f"{sizes.tokens}-token analysis text, each query against the whole KV cache before it, per "
             f"layer and head (Q/K/V FP32: the P-cast alone), under each kernel's prefill preset (one "
             f"Algorithm-1 pass per row) and its split-KV decode preset, both with the kernel's tile at "
             f"head dim {cfg.head_dim}. With {sizes.tokens} keys a tile of B keys gives "
             f"⌈{sizes.tokens}/B⌉ KV blocks to deal over the splits; splits left without a block do nothing.", ""]
    sentences = []
    for row in summary:
        if row["phase"] != "decode":
            continue
        pre = next(r for r in summary if r["kernel"] == row["kernel"] and r["phase"] == "prefill")
        sentences.append(
            f"{row['kernel']}: `{row['config']}` ({row['kv_splits']} {row['split_layout']} splits, "
            f"B = {row['block_kv']}) zeroes on average {report.fmt_pct(row['mean_frac_zeroed_row_mean'])} of a row's "
            "non-sink P "
            f"against {report.fmt_pct(pre['mean_frac_zeroed_row_mean'])} for `{pre['config']}` in one pass "
            f"({_x(row['zeroed_ratio_to_prefill'])}; fewer in {report.fmt_pct(row['heads_less_zeroed_frac'])} of the "
            f"heads, more in {report.fmt_pct(row['heads_more_zeroed_frac'])}), and its MSE over all heads is "
            f"{_x(row['mse_ratio_to_prefill'])} the one-pass MSE.")
    lines += [" ".join(sentences), ""]
    cols = [("kernel", "Kernel"), ("phase", "phase"), ("config", "preset"), ("block_kv", "B"),
            ("kv_splits", "splits"), ("rel_mse", "rel. MSE (all heads)", _sci),
            ("median_frac_zeroed_row_mean", "median non-sink P zeroed", report.fmt_pct),
            ("mean_frac_zeroed_row_mean", "mean non-sink P zeroed", report.fmt_pct),
            ("mean_zeroed_mass", "mean zeroed mass", _sci),
            ("mse_ratio_to_prefill", "MSE / prefill", _x),
            ("heads_less_zeroed_frac", "heads zeroing less", report.fmt_pct)]
    reference = {k: "n/a: the one-pass reference" for k in ("mse_ratio_to_prefill", "heads_less_zeroed_frac")}
    shown = [r if r["phase"] == "decode" else {**reference, **r} for r in summary]
    lines += [report.markdown_table(shown, cols, align="lllrrrrrrrr", name="model_decode (summary)"), ""]
    return lines


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def build_report(out_dir, *, tokens: int | None = None, quick: bool = False, level: int = 2,
                 log: Callable[[str], None] | None = None, model_path=None, token_ids=None,
                 token_source: str = "token_ids") -> str:
    """Run the real-model analysis, write its CSV and PNG files into ``out_dir``, return markdown.

    Args:
      out_dir: folder for the files of :data:`FILES` (created if needed).
      tokens: analysis and held-out sequence length (default 1024; 128 with ``quick``).
      quick: the :data:`QUICK` configuration set (Fwd S=1 and Rev S=256 only).
      level: markdown heading level of the section title (2 → ``##``).
      log: one-line progress messages (default: none).
      model_path: the model (see :func:`pcast_jax.models.load_model`); default SmolLM2-135M-Instruct.
      token_ids, token_source: token ids to run on instead of the standard-library texts (no tokenizer
        needed) and what they are, in words (:func:`pcast_jax.models.fp8_study.run_study`).

    Raises:
      ImportError: the model extra is missing (message says how to install it).
      PcastError: bad ``tokens`` (must be in [32, 4096]) or missing plotting libraries.
    """
    import importlib.util

    from pcast_jax.models.gguf_loader import require_model_extra

    require_model_extra()
    for module in ("matplotlib",):
        if importlib.util.find_spec(module) is None:
            raise PcastError(f"the model report needs {module}: pip install 'pcast_jax[plots]'")
    sizes = QUICK if quick else FULL
    if tokens is not None:
        sizes = dataclasses.replace(sizes, tokens=check_int("tokens", tokens, min_value=32,
                                                            max_value=MAX_TOKENS))
    level = check_int("level", level, min_value=1, max_value=4)
    log = log or (lambda _line: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    env = f"{os.cpu_count()} CPU cores (load average {load:.1f} at start)"
    study = run_study(sizes, log=log, clock=Stopwatch(log), model_path=model_path, token_ids=token_ids,
                      token_source=token_source)
    head_rows, layer_rows = study.head_rows(), study.layer_rows()
    theory_rows, e2e_rows = study.theory_rows(), study.e2e_rows()
    report.write_csv(out / "model_heads.csv", head_rows)
    report.write_csv(out / "model_layers.csv", layer_rows)
    report.write_csv(out / "model_theory.csv", theory_rows)
    report.write_csv(out / "model_e2e.csv", e2e_rows)
    report.write_csv(out / "model_decode.csv", study.decode_rows())
    _fig_sink_gap(study, out / "model_sink_gap.png")
    if "fwd_s1" in study.heads and "rev_s256" in study.heads:
        _fig_mse_ratio(study, layer_rows, out / "model_mse_ratio.png")
    _fig_theory(theory_rows, out / "model_theory.png")
    _fig_e2e(e2e_rows, out / "model_e2e.png")
    return _markdown(study, layer_rows, theory_rows, e2e_rows, level, env, _model_name(study.model, model_path))


def model_section(out_dir, quick: bool = False, log=None) -> str:
    """Run the real-model analysis, write its ``model_*.csv`` / ``model_*.png`` into ``out_dir``.

    Returns the section's markdown (starting with a ``##`` heading). Raises ImportError naming
    the install commands when the model extra is missing (callers may skip the section then).
    """
    return build_report(out_dir, quick=quick, level=2, log=log)
