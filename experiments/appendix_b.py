"""Appendix B — paired t-tests of Forward S=256 vs Reverse S=256 (saturation, §7.1).

100 instances per (Δ, N) (100 seeds, each an instance of q_len = 32 query rows whose per-instance
MSE is one sample); both configurations run on the same draws, so the test is paired
(``scipy.stats.ttest_rel``). Sign convention: difference = MSE(Reverse) − MSE(Forward), so a
negative value means reverse is better — the reading of the paper's footnote ("where significant,
reverse is marginally better") of its negative mean differences and t values.
"""

from __future__ import annotations

import numpy as np

from pcast_jax import report
from pcast_jax.stats import sem

from .common import Column, Context, Finding, Section, Table, delta_sweep, spec_for

NAME = "appendix_b"
TITLE = "Appendix B — saturation: paired t-tests, Forward S=256 vs Reverse S=256"

#: Paper, Appendix B: (Δ, N) → (mean diff, t, significant).
PAPER = {
    (7.0, 4096): (-7e-9, -1.0, False),
    (7.0, 16384): (-3e-9, -1.1, False),
    (10.0, 16384): (-2e-8, -4.4, True),
    (12.0, 16384): (-1e-8, -3.6, True),
}
ALPHA = 0.05
CONFIGS = ("fwd_s256", "rev_s256")


def run(ctx: Context) -> Section:
    from scipy import stats

    s = ctx.sizes
    by_n: dict[int, list[float]] = {}
    for delta, n in s.ttest_points:
        by_n.setdefault(n, []).append(delta)
    results = {}
    for n, ds in by_n.items():
        if n == s.n_main and set(ds) <= set(s.deltas_fig2) and s.seeds_ttest <= s.seeds:
            results[n] = delta_sweep(ctx)  # the Δ sweep already holds these draws and both configs
        else:
            results[n] = ctx.sweep(f"ttest_n{n}", spec_for(s, configs=CONFIGS, deltas=tuple(sorted(ds)),
                                                           ns=(n,), seeds=s.seeds_ttest, expected_mse=False))
    rows = []
    for delta, n in s.ttest_points:
        res = results[n]
        fwd = np.asarray(res.get("mse", config="fwd_s256", n=n, delta=delta), np.float64)[:s.seeds_ttest]
        rev = np.asarray(res.get("mse", config="rev_s256", n=n, delta=delta), np.float64)[:s.seeds_ttest]
        t = stats.ttest_rel(rev, fwd)
        diff = rev - fwd
        p_mean, p_t, p_sig = PAPER.get((delta, n), (report.NOT_IN_PAPER,) * 3)
        rows.append({"delta": delta, "n": n, "instances": len(diff), "mse_fwd_s256": float(fwd.mean()),
                     "mse_rev_s256": float(rev.mean()), "mean_diff": float(diff.mean()),
                     "sem_diff": sem(diff),
                     "relative_diff_frac": float(diff.mean() / fwd.mean()), "t": float(t.statistic),
                     "p": float(t.pvalue), "significant": bool(t.pvalue < ALPHA),
                     "paper_mean_diff": p_mean, "paper_t": p_t, "paper_significant": p_sig,
                     "paper_point": (delta, n) in PAPER})
    cols = [Column("delta", "Δ", lambda x: f"{x:g}"), Column("n", "N"),
            Column("instances", "instances"),
            Column("mse_fwd_s256", "MSE fwd", report.fmt_sci), Column("mse_rev_s256", "MSE rev", report.fmt_sci),
            Column("mean_diff", "mean diff ours", lambda x: f"{x:+.1e}"),
            Column("paper_mean_diff", "paper", report.words_or(lambda x: f"{x:+.0e}")),
            Column("relative_diff_frac", "diff / MSE", lambda x: f"{100 * x:+.2f}%"),
            Column("t", "t ours", lambda x: f"{x:+.2f}"),
            Column("paper_t", "paper", report.words_or(lambda x: f"{x:+.1f}")),
            Column("p", "p", lambda x: f"{x:.2g}"),
            Column("significant", "sig.? ours", lambda x: "Yes" if x else "No"),
            Column("paper_significant", "paper", report.words_or(lambda x: "Yes" if x else "No"))]
    on_paper = [r for r in rows if r["paper_point"]]
    same_sig = sum(r["significant"] == r["paper_significant"] for r in on_paper)
    worst_rel = max(abs(r["relative_diff_frac"]) for r in rows)
    rev_better = all(r["mean_diff"] < 0 for r in rows if r["significant"])
    missing = [f"({d:g}, {n})" for (d, n) in PAPER if (d, n) not in s.ttest_points]
    pattern = ", ".join(f"({r['delta']:g}, {r['n']}): {'Yes' if r['significant'] else 'No'}" for r in rows)
    findings = [
        Finding("App. B: Fwd S=256 and Rev S=256 saturate to the same floor",
                "|diff| ~1e-8, three orders of magnitude below the MSE",
                f"|mean diff| / MSE ≤ {100 * worst_rel:.3f}% at every point",
                "yes" if worst_rel < 1e-3 else ("partly" if worst_rel < 1e-2 else "no")),
        Finding("App. B: significance of Rev vs Fwd at S=256 (p < 0.05)",
                "(7, 4k): No, (7, 16k): No, (10, 16k): Yes, (12, 16k): Yes; reverse better where significant",
                pattern + ("" if rev_better else "; forward better at a significant point")
                + (f"; not run: {', '.join(missing)}" if missing else ""),
                "yes" if on_paper and same_sig == len(on_paper) and rev_better and not missing
                else ("partly" if on_paper and same_sig >= len(on_paper) - 1 else "no")),
    ]
    shared = s.n_main in {n for _, n in s.ttest_points} and s.seeds_ttest <= s.seeds
    intro = (f"{s.seeds_ttest} instances per (Δ, N) (seeds 0–{s.seeds_ttest - 1}; one instance = "
             f"{s.q_len} query rows, its MSE averaged over rows and d = {s.d}), both configurations on "
             "the same draws, `scipy.stats.ttest_rel(rev, fwd)`; mean diff = MSE(Reverse S=256) − "
             "MSE(Forward S=256) (negative: reverse better), significant at p < 0.05. The paper "
             "prints one significant digit for the mean difference and t."
             + (f" Points at N = {s.n_main} are read from the Figure 2 sweep (same draws)." if shared else ""))
    notes = []
    if on_paper:
        same_sign = all(np.sign(r["mean_diff"]) == np.sign(r["paper_mean_diff"]) for r in on_paper)
        factor = max(max(abs(r["mean_diff"]), abs(r["paper_mean_diff"]))
                     / max(min(abs(r["mean_diff"]), abs(r["paper_mean_diff"])), 1e-300) for r in on_paper)
        sign = "have the paper's sign at every point" if same_sign else "do not all have the paper's sign"
        note = f"Our mean differences {sign} and are within a factor {factor:.1f} of its values."
        differ = [r for r in on_paper if r["significant"] != r["paper_significant"]]
        if differ:
            note += (" Where the verdicts differ, the t statistics differ: "
                     + ", ".join(f"({r['delta']:g}, {r['n']}): t = {r['t']:+.1f} vs the paper's {r['paper_t']:+.1f}"
                                 for r in differ)
                     + f". Every difference is below {100 * worst_rel:.2f}% of the MSE.")
        notes.append(note)
    return Section(NAME, TITLE, intro, tables=[Table("appendix_b", rows, cols)], findings=findings, notes=notes)


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
