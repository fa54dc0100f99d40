"""Table 1 — P-collapse under forward iteration (N = 4096, k_sink = 4, B = 64, 12 seeds).

Simulated fraction of non-sink P cast to zero at S = 1 and S = 256, non-sink mass and the
effective information loss (non-sink mass × fraction zeroed at S = 1), beside Eq. (7) and its
spread-integrated version (:mod:`pcast_jax.theory`) and the paper's printed values.
"""

from __future__ import annotations

import functools

import numpy as np

from pcast_jax import report, theory
from pcast_jax.stats import sem

from .common import Column, Context, Finding, Section, Table, delta_sweep

NAME = "table1"
TITLE = "Table 1 — P-collapse (forward iteration)"

#: Paper, Table 1 (percent). "≈100%" is entered as 100.
PAPER = {
    5.0: {"s1": 22.3, "s256": 0.0, "mass": 88.0, "loss": 19.6},
    6.0: {"s1": 51.6, "s256": 0.0, "mass": 74.0, "loss": 38.2},
    7.0: {"s1": 82.0, "s256": 0.0, "mass": 51.7, "loss": 42.4},
    8.0: {"s1": 94.8, "s256": 0.3, "mass": 32.2, "loss": 30.5},
    9.0: {"s1": 99.5, "s256": 2.3, "mass": 13.9, "loss": 13.9},
    10.0: {"s1": 100.0, "s256": 11.7, "mass": 5.8, "loss": 5.8},
    12.0: {"s1": 100.0, "s256": 67.9, "mass": 0.8, "loss": 0.8},
}
#: Tolerances (percentage points) for the summary verdict: the project's bar of 2 points per cell.
#: With the paper's 12 seeds, seed noise alone is about 1.3 pp at Δ = 6 (the engine tests use 240
#: seeds and meet the bar there), so a "partly" here can be noise; the table shows every difference.
TOL_FRAC_PP = 2.0
TOL_MASS_PP = 2.0


#: A percentage (the values are in percent already) with one decimal.
_percent = functools.partial(report.fmt_num, digits=1)


def _pp(x):
    return report.fmt_signed(x, 1)


def run(ctx: Context) -> Section:
    s = ctx.sizes
    res = delta_sweep(ctx)
    k = s.seeds_table1  # the first k seeds of the Δ sweep = a k-seed run (draws are per seed)
    closed = theory.table1_closed_form(s.deltas_table1, k_sink=s.k_sink, n=s.n_main)
    rows = []
    for i, delta in enumerate(s.deltas_table1):
        fz1 = res.get("frac_zeroed", config="fwd_s1", n=s.n_main, delta=delta)[:k]
        fz256 = res.get("frac_zeroed", config="fwd_s256", n=s.n_main, delta=delta)[:k]
        mass = res.get("nonsink_mass", config="fwd_s1", n=s.n_main, delta=delta)[:k]
        zmass = res.get("zeroed_mass", config="fwd_s1", n=s.n_main, delta=delta)[:k]
        ours = {
            "s1": 100 * float(np.mean(fz1)),
            "s256": 100 * float(np.mean(fz256)),
            "mass": 100 * float(np.mean(mass)),
        }
        ours["loss"] = ours["mass"] * ours["s1"] / 100
        paper = PAPER.get(delta, {})
        row = {"delta": delta, "seeds": k}
        for key in ("s1", "s256", "mass", "loss"):
            row[f"{key}_ours"] = ours[key]
            row[f"{key}_paper"] = paper.get(key, report.NOT_IN_PAPER)
            row[f"{key}_diff_pp"] = ours[key] - paper[key] if key in paper else report.NOT_IN_PAPER
        row["s1_eq7"] = 100 * float(closed["frac_zeroed_s1"][i])
        row["s1_eq7_spread"] = 100 * float(closed["frac_zeroed_s1_spread"][i])
        row["s256_eq7"] = 100 * float(closed["frac_zeroed_s256"][i])
        row["s256_eq7_spread"] = 100 * float(closed["frac_zeroed_s256_spread"][i])
        row["mass_theory"] = 100 * float(closed["non_sink_mass"][i])
        row["zeroed_mass_s1_ours"] = 100 * float(np.mean(zmass))
        row["s1_sem"] = 100 * sem(fz1) if k > 1 else "n/a: one seed"
        rows.append(row)

    cols = [
        Column("delta", "Δ", lambda x: f"{x:g}"),
        Column("s1_ours", "S=1 ours", _percent), Column("s1_paper", "S=1 paper", _percent),
        Column("s1_diff_pp", "Δpp", _pp), Column("s1_eq7", "Eq.(7)", _percent),
        Column("s1_eq7_spread", "Eq.(7)+spread", _percent),
        Column("s256_ours", "S=256 ours", lambda x: report.fmt_num(x, 2)),
        Column("s256_paper", "S=256 paper", _percent), Column("s256_diff_pp", "Δpp", _pp),
        Column("s256_eq7_spread", "Eq.(7)+spread", lambda x: report.fmt_num(x, 2)),
        Column("mass_ours", "non-sink mass ours", _percent), Column("mass_paper", "paper", _percent),
        Column("mass_diff_pp", "Δpp", _pp),
        Column("loss_ours", "info loss ours", _percent), Column("loss_paper", "paper", _percent),
        Column("loss_diff_pp", "Δpp", _pp),
    ]
    dk = float(theory.delta_k(s.k_sink))
    intro = (
        f"Forward order, N = {s.n_main}, k_sink = {s.k_sink}, B = 64, q_len = {s.q_len}, "
        f"seeds 0–{k - 1} of the Figure 2 sweep (the same draws as a {k}-seed run). All numbers in "
        "percent here (table1.csv holds them as fractions, in columns ending in `_frac`). "
        "\"Frac. zeroed\" counts non-sink P values that were > 0 and cast to 0 "
        "(S = 1 and S = 256, from the same simulation); non-sink mass is the exact FP32 softmax "
        "mass on non-sink keys (per-row mean); info loss = non-sink mass × frac. zeroed (S = 1), as "
        "the paper defines it. Eq. (7) is F = Φ(Δ + δk − 10 ln 2 − ln S) with δ4 = "
        f"{dk:.3f}; \"+spread\" integrates Eq. (7) over the per-row law of the sink maximum "
        "(`theory.collapse_fraction_spread`). Δpp = ours − paper in percentage points. The paper "
        "prints ≈100% at Δ = 10 and 12 (S = 1); we compare against 100."
    )
    d_s1 = [abs(r["s1_diff_pp"]) for r in rows]
    d_s256 = [abs(r["s256_diff_pp"]) for r in rows]
    d_mass = [abs(r["mass_diff_pp"]) for r in rows]
    d_eq7 = [abs(r["s1_eq7"] - r["s1_ours"]) for r in rows]
    d_spread = [abs(r["s1_eq7_spread"] - r["s1_ours"]) for r in rows]
    peak = max(rows, key=lambda r: r["loss_ours"])
    findings = [
        Finding("Table 1: fraction of non-sink P zeroed at S=1 (forward)",
                "22.3% → 82.0% → ≈100% (Δ=5,7,10)",
                f"{rows[0]['s1_ours']:.1f}% → {_row(rows, 7.0)['s1_ours']:.1f}% → "
                f"{_row(rows, 10.0)['s1_ours']:.1f}%; max |Δ| {max(d_s1):.1f} pp",
                _verdict(max(d_s1), TOL_FRAC_PP)),
        Finding("Table 1: fraction zeroed at S=256 (forward)",
                "0% up to Δ=7, 11.7% at Δ=10, 67.9% at Δ=12",
                f"{_row(rows, 7.0)['s256_ours']:.2f}% at Δ=7, {_row(rows, 10.0)['s256_ours']:.1f}% at Δ=10, "
                f"{_row(rows, 12.0)['s256_ours']:.1f}% at Δ=12; max |Δ| {max(d_s256):.1f} pp",
                _verdict(max(d_s256), TOL_FRAC_PP)),
        Finding("Table 1: non-sink mass", "88.0% → 51.7% → 0.8% (Δ=5,7,12)",
                f"{rows[0]['mass_ours']:.1f}% → {_row(rows, 7.0)['mass_ours']:.1f}% → "
                f"{_row(rows, 12.0)['mass_ours']:.1f}%; max |Δ| {max(d_mass):.1f} pp",
                _verdict(max(d_mass), TOL_MASS_PP)),
        Finding("Table 1: effective info loss peaks at Δ≈6–7 (~40%)", "42.4% at Δ=7",
                f"peak {peak['loss_ours']:.1f}% at Δ={peak['delta']:g}",
                "yes" if peak["delta"] in (6.0, 7.0) and 35 <= peak["loss_ours"] <= 50 else "partly"),
        Finding("Eq. (7) reproduces the simulated S=1 column \"to within a few points\"",
                "within a few pp; spread explains the residual",
                f"Eq. (7) max |Δ| {max(d_eq7):.1f} pp, with spread {max(d_spread):.1f} pp",
                "yes" if max(d_eq7) <= 6 else "partly"),
    ]
    off = [r for r in rows if abs(r["mass_diff_pp"]) > 1.0]
    notes = [f"Largest differences to the paper: S=1 {max(d_s1):.1f} pp, S=256 {max(d_s256):.1f} pp, "
             f"non-sink mass {max(d_mass):.1f} pp (verdict tolerance {TOL_FRAC_PP:g} pp for fractions, "
             f"{TOL_MASS_PP:g} pp for mass).",
             "With the paper's 12 seeds the fractions carry about 1.3 pp of seed noise (Δ = 6); at 240 seeds "
             "(tests/test_engine.py) every fraction is within 2 pp of the paper.",
             "`zeroed_mass_s1_ours_frac` in table1.csv is the exact probability mass of the zeroed P values "
             "(what the product \"info loss\" approximates)."]
    for r in off:
        notes.append(f"Non-sink mass at Δ = {r['delta']:g}: the paper's {r['mass_paper']:.1f}% is "
                     f"{-r['mass_diff_pp']:+.1f} pp from our simulation ({r['mass_ours']:.1f}%) and "
                     f"{r['mass_paper'] - r['mass_theory']:+.1f} pp from the closed-form per-row mean "
                     f"(`theory.non_sink_mass`: {r['mass_theory']:.1f}%), while the other rows agree "
                     "to within a point; the paper does not say what makes this row differ.")
    return Section(NAME, TITLE, intro, tables=[Table("table1", csv_rows(rows), cols, md_rows=rows)],
                   findings=findings, notes=notes)


def csv_rows(rows: list[dict]) -> list[dict]:
    """``table1.csv``'s rows: every percentage as a fraction in [0, 1], its column name ending in ``_frac``.

    (The markdown table shows percent; percentage-point differences ``*_diff_pp`` become ``*_diff_frac``.)
    """
    out = []
    for r in rows:
        row = {"delta": r["delta"], "seeds": r["seeds"]}
        for key, value in r.items():
            if key in row:
                continue
            name = key.removesuffix("_pp") + "_frac"
            row[name] = value if isinstance(value, str) else value / 100.0
        out.append(row)
    return out


def _row(rows, delta):
    return next(r for r in rows if r["delta"] == delta)


def _verdict(err, tol):
    return "yes" if err <= tol else ("partly" if err <= 2 * tol else "no")


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
