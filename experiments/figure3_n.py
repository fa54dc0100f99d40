"""Figure 3 — MSE vs KV length N ∈ {512, …, 16384} at Δ = 7 (log-log), the five configurations.

The improvement of Forward S=256 over Forward S=1 grows with N as the non-sink mass grows
(paper: 1.3× at N = 512 → 10× at N = 16384).
"""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import NullLocator

from pcast_jax import report
from pcast_jax.stats import mean_sem

from . import table2
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
    mse_by_length,
    paper_line,
)

NAME = "figure3_n"
TITLE = "Figure 3 — MSE vs sequence length N (Δ = 7)"

PAPER_IMPROVEMENT = {512: 1.3, 16384: 10.0}  # Forward S=1 / Forward S=256, Figure 3 caption


def run(ctx: Context) -> Section:
    s = ctx.sizes
    ns = np.asarray(s.ns_fig3)
    metrics = ("mse", "mse_expected", "frac_zeroed", "nonsink_mass")
    data = {(m, c): mse_by_length(ctx, m, c) for m in metrics for c in PAPER_ORDER}
    rows = []
    for c in PAPER_ORDER:
        for n in s.ns_fig3:
            m, se = mean_sem(data["mse", c][n])
            me, see = mean_sem(data["mse_expected", c][n])
            rows.append({"config": c, "n": n, "delta": 7.0, "seeds": s.seeds, "mse": m, "mse_sem": se,
                         "mse_expected": me, "mse_expected_sem": see,
                         "frac_zeroed": float(np.mean(data["frac_zeroed", c][n])),
                         "nonsink_mass": float(np.mean(data["nonsink_mass", c][n])),
                         "paper_mse": table2.PAPER[c][n] * 1e-5 if n in table2.PAPER[c] else report.NOT_IN_PAPER})
    mean = {(r["config"], r["n"]): r["mse"] for r in rows}
    improvement = {n: mean["fwd_s1", n] / mean["fwd_s256", n] for n in s.ns_fig3}
    for r in rows:
        r["improvement_fwd_s1_over_fwd_s256"] = improvement[r["n"]]

    fig, ax = report.new_figure(figsize=(7.5, 4.8))
    handles = []
    for c in PAPER_ORDER:
        y = np.array([mean[c, n] for n in s.ns_fig3])
        se = np.array([r["mse_sem"] for r in rows if r["config"] == c])
        h = ax.errorbar(ns, y, yerr=se, capsize=2, **paper_line(c))
        handles.append(h)
        pn = sorted(table2.PAPER[c])
        ax.plot(pn, [table2.PAPER[c][n] * 1e-5 for n in pn], "D", mfc="none", mec=PAPER_COLORS[c], ms=9,
                mew=1.5)
    handles += ax.plot([], [], "D", mfc="none", mec="k", label="paper, Table 2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(set(s.ns_fig3) | {n for c in PAPER_ORDER for n in table2.PAPER[c]})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(n) for n in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    report.label_log_axis(ax.yaxis)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MSE vs FP32 reference")
    ax.set_title(f"FP8 P-cast MSE vs sequence length (Δ = 7, {s.seeds} seeds, kernel-faithful)")
    ax.grid(alpha=0.3, which="both")
    lo, hi = s.ns_fig3[0], s.ns_fig3[-1]
    top = max(mean["fwd_s1", n] for n in s.ns_fig3)
    bottom = min(min(mean[c, n] for c in PAPER_ORDER) for n in s.ns_fig3)
    ax.set_ylim(bottom / 1.4, top * 1.6)  # room for the labels above the red curve
    for n, side, dy in ((lo, "left", 9), (hi, "right", -10)):
        ax.annotate(f"{improvement[n]:.1f}× vs Fwd S=256", (n, mean["fwd_s1", n]), textcoords="offset points",
                    xytext=(6 if side == "left" else -6, dy), ha=side, va="bottom" if dy > 0 else "top",
                    fontsize=9, color=PAPER_COLORS["fwd_s1"])
    ax.legend(handles=handles, fontsize=8, loc="lower left")

    md_rows = [{"config": PAPER_LABELS[c], **{f"n{n}": f"{mean[c, n] * 1e5:.3g}" for n in s.ns_fig3}}
               for c in PAPER_ORDER]
    md_rows.append({"config": "**Fwd S=1 / Fwd S=256**", **{f"n{n}": f"{improvement[n]:.1f}×" for n in s.ns_fig3}})
    paper_improvement = {**PAPER_IMPROVEMENT,
                         **{k: table2.PAPER['fwd_s1'][k] / table2.PAPER['fwd_s256'][k] for k in (4096, 8192)}}
    md_rows.append({"config": "paper (Fig. 3 caption, Table 2)",
                    **{f"n{n}": f"{paper_improvement[n]:.1f}×" if n in paper_improvement else report.NOT_IN_PAPER
                       for n in s.ns_fig3}})
    cols = [Column("config", "MSE ×10⁻⁵, N =")] + [Column(f"n{n}", str(n)) for n in s.ns_fig3]
    verdicts = []
    parts = []
    for n, p in PAPER_IMPROVEMENT.items():
        if n in improvement:
            parts.append(f"{improvement[n]:.1f}× at N={n} (paper {p:g}×)")
            verdicts.append(abs(improvement[n] / p - 1) <= 0.3)
        else:
            parts.append(f"N={n} not run")
    if lo not in PAPER_IMPROVEMENT:
        parts.append(f"{improvement[lo]:.1f}× at N={lo}")
    grows = all(np.diff([improvement[n] for n in s.ns_fig3]) > 0)
    findings = [Finding("Fig. 3: Forward S=256 over Forward S=1 improvement grows with N",
                        "1.3× (N=512) → 10× (N=16384)",
                        "; ".join(parts) + ("; monotone in N" if grows else "; not monotone in N"),
                        "yes" if verdicts and all(verdicts) and grows else "partly")]
    intro = (f"Δ = 7, N ∈ {{{', '.join(map(str, s.ns_fig3))}}}, {s.seeds} seeds, the five configurations; "
             f"N = {s.n_main} comes from the Figure 2 sweep (same draws). Error bars: ± one standard error. "
             "Open diamonds: the paper's Table 2.")
    caption = ("MSE vs sequence length at Δ = 7 (log-log). The number above the red curve at each end is "
               "the Forward S=1 / Forward S=256 MSE ratio (paper: 1.3× at N=512 to 10× at N=16384). "
               f"Forward S=256 (green) lies under Reverse S=256 (blue): they differ by at most "
               f"{100 * max(abs(mean['fwd_s256', n] / mean['rev_s256', n] - 1) for n in s.ns_fig3):.1f}%.")
    return Section(NAME, TITLE, intro, tables=[Table("figure3_n", rows, cols, md_rows=md_rows)],
                   figures=[Figure("figure3_n", fig, caption)], findings=findings)


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
