"""Smoke test of ``pcast reproduce --quick``: the report folder and the paper's key orderings."""

from __future__ import annotations

import csv
import json
import math
import os
import re

import pytest

from pcast_jax import cli

FIGURES = ("figure1_dp", "figure2_delta", "figure3_n")
TABLES = ("table1", "table2", "figure1_dp", "figure2_delta", "figure3_n", "appendix_a", "appendix_b",
          "table3_kernels", "findings")


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_quick_reproduce(tmp_path, capsys):
    """One ``--quick`` run (once: it is the expensive part), then every check on its folder."""
    out = tmp_path / "report"
    assert cli.main(["reproduce", "--quick", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "report.md") in printed
    assert printed.count(" s\n") >= 8  # one line per experiment with its time
    _check_files(out)
    _check_report_embeds_figures_and_summary(out)
    _check_forward_s1_is_worst_at_delta7(out)
    _check_s256_fixes_collapse(out)
    _check_csv_units_are_fractions(out)
    _check_appendix_a_matches_paper(out)
    _check_table3_kernels(out)
    _check_rerun_resumes(out)


def _check_files(quick_report):
    out = quick_report
    assert (out / "report.md").stat().st_size > 1000
    for name in TABLES:
        rows = _rows(out / f"{name}.csv")
        assert rows, name
    for name in FIGURES:
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    meta = json.loads((out / "run.json").read_text())
    assert meta["mode"] == "quick"
    for key in ("jax", "jaxlib", "numpy", "ml_dtypes", "python"):
        assert meta["versions"][key]
    assert set(meta["experiments"]) == {"table1", "table2", "figure1_dp", "figure2_delta", "figure3_n",
                                        "appendix_a", "appendix_b", "table3_kernels"}
    for sweep in meta["sweeps"].values():
        assert sweep["spec"]["configs"] and sweep["spec"]["seeds"] >= 1
        assert (out / "sweeps" / sweep["folder"].split("/")[-1] / "results.npz").exists()


def _check_report_embeds_figures_and_summary(quick_report):
    md = (quick_report / "report.md").read_text()
    for name in FIGURES:
        assert re.search(rf"!\[[^\]]*\]\({name}\.png\)", md), name
    assert "what reproduces and what does not" in md
    assert "QUICK MODE" in md
    # every finding of findings.csv is in the summary table, verdicts included
    for row in _rows(quick_report / "findings.csv"):
        assert row["verdict"] in ("yes", "partly", "no")
        assert row["claim"].split("|")[0][:40] in md


def _check_forward_s1_is_worst_at_delta7(quick_report):
    rows = [r for r in _rows(quick_report / "table2.csv") if r["config"] != "ratio_fwd_s1_over_best"]
    for n in {r["n"] for r in rows}:
        at_n = {r["config"]: float(r["mse"]) for r in rows if r["n"] == n}
        assert max(at_n, key=at_n.get) == "fwd_s1", (n, at_n)
        assert at_n["fwd_s1"] > 2 * min(at_n.values())
    fig2 = [r for r in _rows(quick_report / "figure2_delta.csv") if float(r["delta"]) == 7.0]
    mse = {r["config"]: float(r["mse_expected"]) for r in fig2}
    assert max(mse, key=mse.get) == "fwd_s1"


def _check_s256_fixes_collapse(quick_report):
    rows = {float(r["delta"]): r for r in _rows(quick_report / "table1.csv")}
    assert float(rows[7.0]["s256_ours_frac"]) < 0.01  # fraction of non-sink P zeroed at S = 256
    assert float(rows[7.0]["s1_ours_frac"]) > 0.5
    # collapse grows with Δ at both scales
    s1 = [float(rows[d]["s1_ours_frac"]) for d in sorted(rows)]
    assert all(b >= a - 0.005 for a, b in zip(s1, s1[1:]))


def _check_csv_units_are_fractions(quick_report):
    """One unit convention in every CSV: proportions are fractions in [0, 1], never percent."""
    for path in sorted(quick_report.glob("*.csv")):
        rows = _rows(path)
        for col in rows[0]:
            assert "pct" not in col or col.endswith("15pct"), (path.name, col)  # 15pct: a yes/no flag
            if col.endswith("_frac") or col in ("frac_zeroed", "nonsink_mass", "zeroed_mass"):
                vals = [float(r[col]) for r in rows if r[col] not in ("", None)]
                bound = 1.0 + 1e-9 if "diff" not in col else 1.0
                assert all(-bound <= v <= bound for v in vals), (path.name, col, vals[:5])
    assert "s1_ours_frac" in _rows(quick_report / "table1.csv")[0]


def _check_appendix_a_matches_paper(quick_report):
    rows = _rows(quick_report / "appendix_a.csv")
    assert len(rows) == 15
    for r in rows:
        assert r["matches_printed_digits"] == "yes", r
        assert math.isclose(float(r["dp"]), float(r["dp_paper"]), abs_tol=5e-4)
    dp = {float(r["scale"]): float(r["dp"]) for r in rows}
    assert all(dp[2.0**k] == 0.0625 for k in range(9))
    assert dp[512.0] == 0.25


def _check_table3_kernels(quick_report):
    """Table 3 as the kernels run: a prefill and a decode row per kernel, our verdict from the numbers."""
    from pcast_experiments import table3_kernels as t3
    from pcast_jax.config import get_preset, preset_for

    rows = _rows(quick_report / "table3_kernels.csv")
    for col in ("implementation", "phase", "preset", "order", "scale", "block_kv", "kv_splits", "paper_status",
                "verdict", "finding", "not_run", "zeroed_d7_frac", "zeroed_d10_frac", "mse_d7", "mse_d10",
                "mse_sem_d7", "zeroed_sem_d10_frac", "zeroed_one_forward_pass_d10_frac"):
        assert col in rows[0], col
    d = json.loads((quick_report / "run.json").read_text())["sizes"]["d"]
    for k in t3.KERNELS:
        mine = {r["phase"]: r for r in rows if r["implementation"] == k.label}
        assert set(mine) == {"prefill", "decode"}, k.label
        pre, dec = mine["prefill"], mine["decode"]
        assert int(pre["block_kv"]) == preset_for(k.prefill, d).block_kv and int(pre["kv_splits"]) == 1
        if k.decode is None:  # not run, and the reason is given
            assert dec["preset"] == "—" and dec["not_run"] and dec["mse_d7"] == "", k.label
            continue
        assert int(dec["kv_splits"]) == get_preset(k.decode).kv_splits > 1 and not dec["not_run"]
        assert int(dec["block_kv"]) == int(pre["block_kv"])  # a split-KV launch runs the same tile
    decode_kernels = {r["implementation"] for r in rows if r["phase"] == "decode" and r["preset"] != "—"}
    assert {"FlashAttention-3", "TensorRT-LLM XQA"} <= decode_kernels
    ran = [r for r in rows if r["preset"] != "—"]
    best = {}
    for r in ran:
        for t in ("d7", "d10"):
            z, se = float(r[f"zeroed_{t}_frac"]), float(r[f"zeroed_sem_{t}_frac"])
            mse = float(r[f"mse_{t}"])
            assert 0.0 <= z <= 1.0 and se >= 0.0 and math.isfinite(mse) and mse > 0, (r["preset"], t)
        if r["in_table3"] == "yes":
            key = (r["phase"], r["n"])
            best[key] = min(best.get(key, math.inf), float(r["mse_d7"]))
    changed = []
    for r in ran:  # our verdict follows from the row's numbers; a change is flagged and explained
        ratio = float(r["mse_d7"]) / best[r["phase"], r["n"]]
        assert math.isclose(ratio, float(r["mse_ratio_to_best_d7"]), rel_tol=1e-6)
        expect = t3.verdict(float(r["zeroed_d7_frac"]), ratio, float(r["zeroed_d10_frac"]),
                            float(r["zeroed_one_forward_pass_d10_frac"]))
        assert r["verdict"] == expect, r
        change = r["in_table3"] == "yes" and expect != r["paper_status"]
        assert (r["verdict_changes"] == "yes") == change and bool(r["finding"]) == change, r
        if change:
            changed.append(r["implementation"])
    claims = [f["claim"] for f in _rows(quick_report / "findings.csv") if f["experiment"] == "table3_kernels"]
    assert sorted(c for c in claims if c.startswith("Table 3 verdict of")) == sorted(
        f"Table 3 verdict of {k} as it runs (prefill and decode)" for k in set(changed))
    # multi-block XQA: only one sub-sequence sees the sink tile first, so far fewer P underflow at Δ = 10
    xqa = {r["phase"]: r for r in ran if r["implementation"] == "TensorRT-LLM XQA"}
    assert float(xqa["decode"]["zeroed_d10_frac"]) < 0.5 * float(xqa["prefill"]["zeroed_d10_frac"])
    assert float(xqa["prefill"]["zeroed_d10_frac"]) == pytest.approx(
        float(xqa["prefill"]["zeroed_one_forward_pass_d10_frac"]))  # forward, one pass: its own counterpart


def test_table3_verdict_rule():
    """The measured verdict: collapse first, then the scale penalty, then the order / split safety net."""
    from pcast_experiments import table3_kernels as t3

    fwd = 0.04
    assert t3.verdict(t3.COLLAPSE_FRAC * 2, 1.0, 1.0, 1.0) == "S=1 baseline"
    assert t3.verdict(0.0, t3.SCALE_PENALTY, fwd, fwd) == "Optimal"
    assert t3.verdict(0.0, t3.SCALE_PENALTY * 1.2, t3.SAFETY_NET * fwd, fwd) == "Near-optimal"
    assert t3.verdict(0.0, t3.SCALE_PENALTY * 1.2, t3.SAFETY_NET * fwd * 1.1, fwd) == "Suboptimal scale"
    assert t3.verdict(0.0, t3.SCALE_PENALTY * 1.2, 0.0, 0.0) == "Near-optimal"  # nothing to protect against
    assert set(t3.VERDICTS) >= {k.paper_status for k in t3.KERNELS if k.in_table3}


def _check_rerun_resumes(quick_report):
    """A second run reuses every finished chunk (no recompute): the numbers are identical."""
    before = (quick_report / "table2.csv").read_text()
    chunks = sorted((quick_report / "sweeps").rglob("chunks/*.npz"))
    stamps = [p.stat().st_mtime_ns for p in chunks]
    assert cli.main(["reproduce", "--quick", "--out", str(quick_report), "--no-progress",
                     "--only", "table2"]) == 0
    assert (quick_report / "table2.csv").read_text() == before
    assert [p.stat().st_mtime_ns for p in chunks] == stamps
    md = (quick_report / "report.md").read_text()
    assert "## Table 2" in md and "## Table 1" not in md  # --only: the report holds only what ran


def test_unknown_experiment_is_a_user_error(tmp_path, capsys):
    assert cli.main(["reproduce", "--out", str(tmp_path), "--only", "table9"]) == 2
    err = capsys.readouterr().err
    assert "table9" in err and "table1" in err


def test_reproduce_is_added_by_the_experiments_package(capsys, monkeypatch):
    ep = cli.added_commands()["reproduce"]
    assert ep.value == "pcast_experiments.command"
    import pcast_experiments.command

    assert ep.load() is pcast_experiments.command and pcast_experiments.command.HELP
    assert cli.main([]) == 0  # no command: the help, which lists the added commands
    assert "reproduce" in capsys.readouterr().out
    # without the package: one clear line, exit status 2
    monkeypatch.setattr(cli, "added_commands", lambda: {})
    assert cli.main(["reproduce", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pcast: error:") and "pcast_experiments" in err and len(err.splitlines()) == 1


def test_library_does_not_import_the_experiments():
    import ast
    from pathlib import Path

    import pcast_jax

    for path in Path(pcast_jax.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("experiments", "pcast_experiments"), (path, name)


def test_markdown_table_formats_and_escapes():
    from pcast_jax import report

    rows = [{"a": "x|y", "b": 0.5, "c": None}, {"a": "z", "b": float("nan"), "c": 2}]
    md = report.markdown_table(rows, [("a", "A"), ("b", "B", report.fmt_pct), ("c", "C")])
    lines = md.splitlines()
    assert lines[0] == "| A | B | C |" and lines[1] == "|:---|---:|---:|"
    assert lines[2] == "| x\\|y | 50.0% | — |"
    assert lines[3] == "| z | — | 2 |"


def test_csv_and_json_round_trip(tmp_path):
    from pcast_jax import report

    rows = [{"n": 4096, "mse": 5.65e-5, "flag": True}, {"n": 8192, "mse": float("nan"), "extra": "x"}]
    path = report.write_csv(tmp_path / "t.csv", rows)
    back = _rows(path)
    assert list(back[0]) == ["n", "mse", "flag", "extra"]
    assert float(back[0]["mse"]) == 5.65e-5 and back[0]["flag"] == "yes"
    assert back[1]["mse"] == "" and back[1]["extra"] == "x"
    j = report.write_json(tmp_path / "r.json", {"a": float("inf"), "b": [1, 2.5]})
    assert json.loads(j.read_text()) == {"a": None, "b": [1, 2.5]}
    mask = os.umask(0o022)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # the usual mode, not mkstemp's 0600
    assert not list(tmp_path.glob(".*.tmp"))


def test_library_versions_names_the_stack():
    from pcast_jax import report

    v = report.library_versions()
    for key in ("python", "jax", "jaxlib", "numpy", "ml_dtypes"):
        assert v[key], key


def test_extra_sections_run_after_the_paper_and_their_files_are_listed(tmp_path, monkeypatch):
    """The extras loop of ``reproduce``: each extra's files reach run.json and report.md with the
    module's own descriptions; an extra whose optional dependency is missing is skipped with a note."""
    import json
    import sys
    import types

    from pcast_experiments import registry

    def section(out_dir, quick=False, log=None):
        (out_dir / "fake_table.csv").write_text("a,b\n1,2\n")
        return "## A fake study\n\nbody\n"

    def missing(out_dir, quick=False, log=None):
        raise ImportError("the fake extra needs `pip install nothing`")

    mod = types.ModuleType("fake_extra_module")
    mod.section, mod.missing = section, missing
    mod.FILES = {"fake_table.csv": "a table the fake study wrote"}
    monkeypatch.setitem(sys.modules, "fake_extra_module", mod)
    monkeypatch.setattr(registry, "EXPERIMENTS", {})
    monkeypatch.setitem(registry.EXTRA_SECTIONS, "fake", ("fake_extra_module", "section"))
    monkeypatch.setitem(registry.EXTRA_SECTIONS, "fake_missing", ("fake_extra_module", "missing"))
    report_md = registry.reproduce(tmp_path, extras=("fake", "fake_missing"), log=lambda line: None)
    meta = json.loads((tmp_path / "run.json").read_text())
    assert "fake_table.csv" in meta["files"]
    assert meta["experiments"]["fake"]["files"] == ["fake_table.csv"]
    text = report_md.read_text()
    assert "## A fake study" in text and "`fake_table.csv` — a table the fake study wrote" in text
    assert "Skipped: the fake extra needs `pip install nothing`" in text
