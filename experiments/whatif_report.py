"""The what-if report (beyond the paper): renders :mod:`pcast_jax.whatif.study` as markdown, CSV and figures.

:func:`build_report` runs the study (surrogate gradients against the exact simulator, the worst Δ,
the optimal static scale, Prop. 3's calibration, the dynamic scale), writes the files of :data:`FILES`
into a folder through :mod:`pcast_jax.report` and returns the markdown. ``pcast whatif report`` writes
it as ``DIR/whatif.md`` (the library's command reaches :func:`write_report` through the entry-point
group ``pcast_jax.reports``); the reproduction report embeds it as a section (:func:`whatif_section`),
the same protocol as the other studies beyond the paper. The library computes; this application renders.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from pcast_jax import formats, report, theory
from pcast_jax.whatif import progress
from pcast_jax.whatif.study import WhatIfStudy, run_study
from pcast_jax.whatif.worst_case import PAPER_TRANSITION

__all__ = ["FILES", "build_report", "render", "whatif_section", "write_report"]

_DPI = 120  # the what-if figures are small (6 × 4 in)

#: Files :func:`build_report` writes (name → what it holds).
FILES: dict[str, str] = {
    "whatif_validate.csv": "per (parameter, point, surrogate): the surrogate's gradient against the exact "
                           "simulator's central difference ± s.e., and whether it is trustworthy",
    "whatif_worst_delta.csv": "per (config, objective): the Δ gradient ascent found, the exact local peak and "
                              "global argmax, Δc",
    "whatif_optimal_scale.csv": "per power-of-two S: exact MSE, ratio to S = 256, dp(S), normal coverage",
    "whatif_calibrate_prop3.csv": "Prop. 3's constant and δk fitted per model: mean, s.d. over seeds, "
                                  "bootstrap 95 % interval",
    "whatif_calibrate_curves.csv": "per Δ: the simulated MSE, each fit, the paper's curve, zeroed fractions "
                                   "simulated and by Eq. (7)",
    "whatif_dynamic.csv": "per (N, Δ): the dynamic 2^k scale's MSE against static S = 256 and 448 (ratios ± s.e.)",
    "whatif_gradients.png": "dMSE/dΔ: each surrogate's gradient against the exact finite difference",
    "whatif_worst_delta.png": "exact MSE vs Δ per config, the local peak gradient ascent found",
    "whatif_scale.png": "exact MSE vs S: the dp(S) sawtooth and the P = 1 atom",
    "whatif_prop3.png": "Prop. 3 calibration: simulated MSE vs the fitted curves and the paper's",
}


def markdown_table(rows: list[dict], columns: list[str] | None = None, name: str = "whatif") -> str:
    """:func:`pcast_jax.report.cell_table`: the what-if tables' one cell format."""
    return report.cell_table(rows, columns, name=name)


def render(study: WhatIfStudy, out_dir=None) -> tuple[str, dict[str, list[dict]], list[Path]]:
    """The study's markdown, its tables (name → rows) and its figures (written into ``out_dir`` when given
    and matplotlib is installed)."""
    tables = study.tables()
    n, q, quick, workers, times = study.n, study.q_len, study.quick, study.workers, study.seconds
    val_delta, worst, opt_mean, opt_stair, cal = (study.validate_delta, study.worst, study.optimal_mean,
                                                  study.optimal_staircase, study.calibration)
    md = []
    md.append(f"## What-if analyses (N = {n}, q_len = {q}{', quick' if quick else ''})\n")
    md.append("Expected MSE σ_V² Σ(W − P)² on the sweep's draws; gradients by jax.grad through a surrogate "
              "of the E4M3 cast, checked against central differences of the exact simulator (same seeds).\n")
    md.append("### Surrogate gradients vs exact finite differences (fwd_s1)\n")
    cols = ["param", "point", "surrogate", "exact_mse", "value_rel_err", "exact_fd", "exact_fd_sem",
            "surrogate_grad", "grad_rel_err", "trustworthy"]
    md.append(markdown_table(tables["validate"], name="validate", columns=cols))
    md.append("\nFor log2 S the exact slope is the octave secant between powers of two (the exact MSE is jagged "
              "between E4M3-representable S, where the P = 1 atom rounds); exact_mse at those half-integer "
              "points includes that atom error, so value_rel_err is not meaningful there.\n")
    for label in study.surrogates:
        rows = [r for r in val_delta if r["surrogate"] == label and r["resolved"]]
        ok = sum(r["trustworthy"] for r in rows)
        md.append(f"- {label}: dMSE/dΔ trustworthy (sign right, within 25 %) at {ok} of {len(rows)} resolved "
                  f"points.\n")
    md.append("\n### Worst-case sink strength (Adam ascent on Δ, smooth surrogate)\n")
    md.append(markdown_table(tables["worst_delta"], name="worst_delta", columns=[
        "config", "objective", "worst_delta", "local_peak", "exact_local_peak", "exact_mse_at_peak",
        "exact_global_argmax", "delta_c", "peak_in_6_9", "seconds"]))
    md.append("\n### Optimal static scale (Δ = 7)\n")
    md.append(f"Adam over log2 S from S = 1: mean-LSB surrogate stops at log2 S = "
              f"{opt_mean.continuous_log2_scale:.2f} (flat beyond the collapse); the staircase surrogate, "
              f"started there, settles at {opt_stair.continuous_log2_scale:.2f} (a dp sawtooth minimum). "
              f"Best neighbouring power of two "
              f"(exact): {opt_mean.best_neighbour:g}; best over 2^0..2^10 (exact): {opt_mean.best_power:g}. "
              f"Exact MSE: S = 256 {opt_mean.at_256:.4g}, S = 448 {opt_mean.at_448:.4g} "
              f"({opt_mean.at_448 / opt_mean.at_256 - 1:+.1%}); dp(448)²/dp(256)² − 1 = "
              f"{(float(theory.dp(448.0)) / float(theory.dp(256.0))) ** 2 - 1:+.1%}. Collapse part at 256 / 448: "
              f"{opt_mean.parts[256.0][0]:.2e} / {opt_mean.parts[448.0][0]:.2e} (coverage buys nothing here). "
              f"The surrogates' own MSE(448)/MSE(256) − 1: mean-LSB "
              f"{opt_mean.surrogate_at_448 / opt_mean.surrogate_at_256 - 1:+.1%}, staircase "
              f"{opt_stair.surrogate_at_448 / opt_stair.surrogate_at_256 - 1:+.1%}.\n")
    md.append(markdown_table(tables["optimal_scale"], name="optimal_scale",
                             columns=["scale", "exact_mse", "rel_to_256", "dp", "normal_coverage"]))
    md.append("\n### Prop. 3 calibration (fwd_s1, target = simulated MSE)\n")
    md.append(markdown_table(tables["calibrate_prop3"], name="calibrate_prop3", columns=[
        "model", "parameter", "mean", "sd_over_seeds", "boot95_lo", "boot95_hi"]))
    md.append("\n" + markdown_table(tables["calibrate_curves"][::2]))
    md.append("\n### Dynamic per-block 2^k scale vs static\n")
    dcols = ["n", "delta", "dynamic_pow2", "ratio_vs_fwd_s256", "ratio_vs_fwd_s256_sem", "ratio_vs_fwd_s448",
             "ratio_vs_fwd_s448_sem", "frac_zeroed_dynamic_pow2", "frac_zeroed_fwd_s256"]
    md.append(markdown_table(tables["dynamic"], name="dynamic", columns=dcols))
    md.append(f"\nRun times (s, {workers} at a time): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
              + "\n")

    figures = []
    if out_dir is not None:
        progress.stage("report: figures")
        figures = _figures(Path(out_dir), val_delta, worst, opt_mean, cal)
    return "\n".join(md), tables, figures


def write_tables(tables: dict[str, list[dict]], out_dir) -> list[Path]:
    """Write each non-empty table as ``whatif_<name>.csv`` in ``out_dir``; returns the paths."""
    out = Path(out_dir)
    return [report.write_csv(out / f"whatif_{name}.csv", rows) for name, rows in tables.items() if rows]


def build_report(out_dir, *, quick: bool = False, base_seed: int = 0, workers: int | None = None
                 ) -> tuple[str, list[str], int]:
    """Run the study, write its CSV and PNG files into ``out_dir``; return (markdown, CSV names, figures)."""
    study = run_study(quick=quick, base_seed=base_seed, workers=workers, extra_steps=1)
    markdown, tables, figures = render(study, out_dir)
    return markdown, [p.name for p in write_tables(tables, out_dir)], len(figures)


def write_report(out_dir, *, quick: bool = False, base_seed: int = 0) -> tuple[list[str], int]:
    """``pcast whatif report``: the files of :func:`build_report` and ``whatif.md`` in ``out_dir``; returns
    (the CSV files' names, how many figures)."""
    markdown, files, figures = build_report(out_dir, quick=quick, base_seed=base_seed)
    report.write_text(Path(out_dir) / "whatif.md", markdown)
    return files, figures


def whatif_section(out_dir, quick: bool = True, log=None) -> str:
    """Run the what-if analyses (reduced size), write ``whatif_*.csv`` and figures into ``out_dir``.

    Returns the section's markdown (a ``##`` heading first), with its figures embedded and its CSV files
    listed.
    """
    if log is not None:
        log("what-if: surrogate validation, worst Δ, optimal S, Prop. 3 calibration, dynamic scale …")
    study = run_study(quick=True, extra_steps=1)
    markdown, tables, figures = render(study, out_dir)
    files = [p.name for p in write_tables(tables, out_dir)]
    md = [markdown, ""]
    for fig in figures:
        md += [f"![{fig.stem}]({fig.name})", ""]
    md.append("Data: " + ", ".join(f"[`{f}`]({f})" for f in files) + ". Full size: `pcast whatif report`.")
    return "\n".join(md)


def _figures(out: Path, val_delta, worst, opt, cal) -> list[Path]:
    """The four what-if figures as PNG files in ``out`` (none without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = report.new_figure(figsize=(6.0, 4.0))
    pts = sorted({r["point"] for r in val_delta})
    ex = [next(r for r in val_delta if r["point"] == p) for p in pts]
    # the values are ~1e-5: scale them into the axis label (matplotlib's offset text would sit on the title)
    peak = max([abs(r["exact_fd"]) for r in ex] + [abs(r["surrogate_grad"]) for r in val_delta
                                                    if math.isfinite(r["surrogate_grad"])] + [1e-300])
    exp10 = math.floor(math.log10(peak))
    unit = 10.0**exp10
    ax.errorbar(pts, [r["exact_fd"] / unit for r in ex], yerr=[2 * r["exact_fd_sem"] / unit for r in ex],
                fmt="ko", ms=4, zorder=5, label="exact simulator, central difference ±2 SEM")
    # distinct styles: where two surrogates agree, the later (dashed, thinner) one leaves the first visible
    styles = [dict(ls="-", lw=3.0, alpha=0.55), dict(ls="--", lw=1.4, marker=".", ms=5),
              dict(ls=":", lw=1.6), dict(ls="-.", lw=1.2)]
    for i, label in enumerate(dict.fromkeys(r["surrogate"] for r in val_delta)):
        rows = [r for r in val_delta if r["surrogate"] == label]
        ax.plot([r["point"] for r in rows], [r["surrogate_grad"] / unit for r in rows], label=label,
                zorder=3 + i, **styles[i % len(styles)])
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel(f"dMSE/dΔ (×10$^{{{exp10}}}$)" if exp10 else "dMSE/dΔ")
    ax.set_title("fwd_s1: surrogate gradient vs exact finite difference", fontsize=10)
    ax.legend(fontsize=7)
    paths.append(report.save_figure(fig, out / "whatif_gradients.png", dpi=_DPI))

    fig, ax = report.new_figure(figsize=(6.0, 4.0))
    for w in worst:
        if w.objective == "total":
            ax.semilogy(w.grid_deltas, w.grid_values, label=w.config)
            if math.isfinite(w.exact_local_peak):
                ax.plot([w.exact_local_peak], [w.exact_local_value], "k^")
    ax.axvspan(*PAPER_TRANSITION, color="0.9", label="paper's transition region")
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("expected MSE")
    ax.set_title("Exact MSE vs Δ; ▲ = local peak found by gradient ascent")
    ax.legend(fontsize=7)
    paths.append(report.save_figure(fig, out / "whatif_worst_delta.png", dpi=_DPI))

    if opt.curve_scales.size:
        fig, ax = report.new_figure(figsize=(6.0, 4.0))
        ax.semilogy(opt.curve_scales, opt.curve_values, "-", color="0.6", lw=0.8, label="exact MSE (any S)")
        reps = formats.positive_values("e4m3")
        on = np.isin(opt.curve_scales.astype(np.float32), reps)
        ax.semilogy(opt.curve_scales[on], opt.curve_values[on], "o", ms=3, label="S an E4M3 value")
        ax.semilogy([256.0, 448.0], [opt.at_256, opt.at_448], "r*", ms=10, label="S = 256, 448")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("static scale S")
        ax.set_ylabel("expected MSE (Δ = 7)")
        ax.set_title("MSE vs S: dp(S) sawtooth + P = 1 atom")
        ax.legend(fontsize=7)
        paths.append(report.save_figure(fig, out / "whatif_scale.png", dpi=_DPI))

    fig, ax = report.new_figure(figsize=(6.0, 4.0))
    ax.semilogy(cal.deltas, cal.sim_mean, "ko", label=f"simulated {cal.target}")
    for m, c in cal.model_mean.items():
        ax.semilogy(cal.deltas, c, "-", label=f"fit, Z = {m}")
    ax.semilogy(cal.deltas, cal.paper_curve, "--", label="Prop. 3 + Eq. (6), c = 1, δ = δk")
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("MSE")
    ax.set_title(f"Prop. 3 calibration ({cal.config}, N = {cal.n})")
    ax.legend(fontsize=7)
    paths.append(report.save_figure(fig, out / "whatif_prop3.png", dpi=_DPI))
    return paths
