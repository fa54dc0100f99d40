"""The what-if report: every analysis at report size, rendered as markdown tables and figures.

:func:`report` runs the surrogate validation and the four analyses and returns a
:class:`WhatIfReport` (markdown, the tables as lists of dicts, the figure paths). Rendering goes
through :mod:`pcast_jax.report` only: :func:`markdown_table` formats cells for
:func:`pcast_jax.report.markdown_table`, figures are matplotlib Figure objects from
:func:`pcast_jax.report.new_figure` saved atomically by :func:`pcast_jax.report.save_figure`.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import importlib.util
import math
import os
import time
from pathlib import Path

import numpy as np

from pcast_jax import formats, theory
from pcast_jax import report as _report
from pcast_jax.errors import check_positive
from pcast_jax.whatif import calibration, dynamic, progress, scale_search, validation, worst_case
from pcast_jax.whatif.calibration import calibrate_prop3
from pcast_jax.whatif.dynamic import dynamic_vs_static
from pcast_jax.whatif.objective import Scenario
from pcast_jax.whatif.scale_search import optimal_scale
from pcast_jax.whatif.surrogates import Surrogate
from pcast_jax.whatif.validation import validate_gradients
from pcast_jax.whatif.worst_case import PAPER_TRANSITION, worst_case_delta
from pcast_jax.workloads import SinkWorkload

__all__ = ["WhatIfReport", "markdown_table", "report"]

_DPI = 120  # the what-if figures are small (6 × 4 in)


@dataclasses.dataclass
class WhatIfReport:
    """Everything :func:`report` produced: markdown text, tables (lists of dicts), figure paths."""

    markdown: str
    tables: dict
    figures: list
    seconds: dict

    def write_tables(self, out_dir) -> list[Path]:
        """Write each non-empty table as ``whatif_<name>.csv`` in ``out_dir``; returns the paths."""
        out = Path(out_dir)
        return [_report.write_csv(out / f"whatif_{name}.csv", rows)
                for name, rows in self.tables.items() if rows]


def _fmt(v) -> str:
    """One table cell: yes/no, integers as such, floats to four significant digits, "–" if not finite."""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return "–"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str] | None = None, name: str = "whatif") -> str:
    """A GitHub markdown table of ``rows`` (dicts) restricted to ``columns``, one line per row.

    Keys are the headers; numbers get four significant digits (scientific below 1e-3 and from
    1e5), booleans yes/no; a non-finite value is an error naming the row
    (:func:`pcast_jax.report.check_published`). Ends with a newline.
    """
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    return _report.markdown_table(rows, [(c, c, _fmt) for c in columns], name=name) + "\n"


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(n=1024, q_len=8, seeds=4, calib_seeds=4, dyn_seeds=3, dyn_ns=(1024,), calib_steps=150,
                    steps=40, worst_configs=("fwd_s1", "fwd_s256"), curve_points=17, bootstrap=200)
    return dict(n=4096, q_len=32, seeds=8, calib_seeds=16, dyn_seeds=8, dyn_ns=(1024, 4096, 16384),
                calib_steps=300, steps=60, worst_configs=("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"),
                curve_points=65, bootstrap=1000)


def report(*, quick: bool = False, out_dir=None, base_seed: int = 0, workers: int | None = None) -> WhatIfReport:
    """Run the four analyses and the surrogate validation; return markdown, tables and figures.

    ``quick`` uses N = 1024, q_len = 8 and a few seeds (under a minute on 2 cores); the full size is
    the paper's workload (N = 4096, q_len = 32). Figures are written to ``out_dir`` when given and
    matplotlib is installed.

    ``workers``: how many analyses run at once in threads (default: the CPU count, at most 4). Their
    time is mostly XLA compiling one program per setting, which runs on one core, so two at a time
    halve the wait on a 2-core machine; each analysis computes exactly what it computes alone (its own
    programs, its own seeds), so the tables do not depend on ``workers``.
    """
    z = _sizes(bool(quick))
    workers = min(4, os.cpu_count() or 1) if workers is None else int(check_positive("workers", workers))
    tables, md = {}, []
    n, q = z["n"], z["q_len"]

    sc = Scenario(config="fwd_s1", n=n, q_len=q, seeds=z["seeds"], base_seed=base_seed)
    surs = (Surrogate(), Surrogate(lsb_mode="staircase"), Surrogate(kind="ste"))
    surs_rep = tuple(dataclasses.replace(x, atoms="representable") for x in surs)
    wl = SinkWorkload(n=n, q_len=q)

    def optimal_pair():
        mean = optimal_scale(wl, seeds=z["seeds"], curve_points=z["curve_points"], base_seed=base_seed)
        stair = optimal_scale(wl, seeds=z["seeds"], curve_points=0, base_seed=base_seed,
                              start_log2_scale=mean.continuous_log2_scale,
                              surrogate=Surrogate(lsb_mode="staircase", atoms="representable"))
        return mean, stair

    # (name, function, progress steps), longest first as measured at the quick size (optimal scale
    # ~2x the others), so that two workers finish together
    jobs = [("optimal_scale", optimal_pair, 2 * scale_search.STEPS),
            ("validate_log2_scale", lambda: validate_gradients(sc, param="log2_scale", surrogates=surs_rep),
             validation.progress_steps(surs_rep)),
            ("calibrate_prop3", lambda: calibrate_prop3("fwd_s1", n, seeds=z["calib_seeds"], q_len=q,
                                                        steps=z["calib_steps"], bootstrap=z["bootstrap"],
                                                        base_seed=base_seed),
             calibration.progress_steps()),
            ("validate_delta", lambda: validate_gradients(sc, param="delta", surrogates=surs),
             validation.progress_steps(surs)),
            # dMSE/dσ is dominated by where each sink P lands in its cell: resolving it takes twice the seeds
            ("validate_sigma", lambda: validate_gradients(sc.replace(seeds=2 * z["seeds"]), param="sigma",
                                                          surrogates=surs, step=0.1),
             validation.progress_steps(surs))]
    for cfg in z["worst_configs"]:
        for obj in ("total", "collapse"):
            jobs.append((f"worst_delta {cfg} {obj}",
                         functools.partial(worst_case_delta, cfg, n, objective=obj, seeds=z["seeds"], q_len=q,
                                           steps=z["steps"], base_seed=base_seed), worst_case.STEPS))
    jobs.append(("dynamic", lambda: dynamic_vs_static(ns=z["dyn_ns"], seeds=z["dyn_seeds"], q_len=q,
                                                      base_seed=base_seed), dynamic.STEPS))
    # every step of every analysis, known before the first: the progress total never grows
    progress.fix(sum(j[2] for j in jobs) + (out_dir is not None))
    out, times = _run_jobs([(name, fn) for name, fn, _ in jobs], workers)
    val_delta, val_sigma, val_scale = out["validate_delta"], out["validate_sigma"], out["validate_log2_scale"]
    tables["validate"] = val_delta + val_sigma + val_scale
    worst = [out[f"worst_delta {cfg} {obj}"] for cfg in z["worst_configs"] for obj in ("total", "collapse")]
    tables["worst_delta"] = [r for w in worst for r in w.rows()]
    opt_mean, opt_stair = out["optimal_scale"]
    tables["optimal_scale"] = opt_mean.rows()
    cal = out["calibrate_prop3"]
    tables["calibrate_prop3"] = cal.rows()
    dyn = out["dynamic"]
    tables["dynamic"] = dyn.rows()

    # ---- markdown
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
    for label in (s.label for s in surs):
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
    curve_rows = []
    for i, dl in enumerate(cal.deltas):
        row = {"delta": float(dl), "simulated": float(cal.sim_mean[i])}
        row.update({f"fit_{m}": float(c[i]) for m, c in cal.model_mean.items()})
        row["paper_c1_deltak"] = float(cal.paper_curve[i])
        row["frac_zeroed_sim"] = float(cal.frac_sim[i])
        row["F_eq7_theory"] = float(cal.frac_theory[i])
        curve_rows.append(row)
    tables["calibrate_curves"] = curve_rows
    md.append("\n" + markdown_table(curve_rows[::2]))
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
    return WhatIfReport(markdown="\n".join(md), tables=tables, figures=figures, seconds=times)


def _run_jobs(jobs, workers: int) -> tuple[dict, dict]:
    """Run ``(name, fn)`` jobs, ``workers`` at a time; return ({name: result}, {name: seconds}).

    Each job runs in a copy of the caller's context (so it reports to the caller's progress). The
    first error stops the jobs not yet started; the ones running finish (a thread cannot be cut
    short), then the first error in job order is raised.
    """
    def timed(fn):
        t = time.perf_counter()
        return fn(), time.perf_counter() - t

    if workers <= 1:
        done = {name: timed(fn) for name, fn in jobs}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pcast-whatif") as pool:
            futs = {name: pool.submit(contextvars.copy_context().run, timed, fn) for name, fn in jobs}
            _, pending = concurrent.futures.wait(futs.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            concurrent.futures.wait([f for f in pending if not f.cancelled()])
            failed = [f.exception() for f in futs.values() if not f.cancelled() and f.exception() is not None]
            if failed:
                raise failed[0]
            done = {name: f.result() for name, f in futs.items()}
    return {k: v[0] for k, v in done.items()}, {k: v[1] for k, v in done.items()}


def _figures(out: Path, val_delta, worst, opt, cal) -> list[Path]:
    """The four what-if figures as PNG files in ``out`` (none without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = _report.new_figure(figsize=(6.0, 4.0))
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
    paths.append(_report.save_figure(fig, out / "whatif_gradients.png", dpi=_DPI))

    fig, ax = _report.new_figure(figsize=(6.0, 4.0))
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
    paths.append(_report.save_figure(fig, out / "whatif_worst_delta.png", dpi=_DPI))

    if opt.curve_scales.size:
        fig, ax = _report.new_figure(figsize=(6.0, 4.0))
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
        paths.append(_report.save_figure(fig, out / "whatif_scale.png", dpi=_DPI))

    fig, ax = _report.new_figure(figsize=(6.0, 4.0))
    ax.semilogy(cal.deltas, cal.sim_mean, "ko", label=f"simulated {cal.target}")
    for m, c in cal.model_mean.items():
        ax.semilogy(cal.deltas, c, "-", label=f"fit, Z = {m}")
    ax.semilogy(cal.deltas, cal.paper_curve, "--", label="Prop. 3 + Eq. (6), c = 1, δ = δk")
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("MSE")
    ax.set_title(f"Prop. 3 calibration ({cal.config}, N = {cal.n})")
    ax.legend(fontsize=7)
    paths.append(_report.save_figure(fig, out / "whatif_prop3.png", dpi=_DPI))
    return paths
