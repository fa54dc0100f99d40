"""Smoke test of ``pcast reproduce --quick``: the report folder and the paper's key orderings."""

from __future__ import annotations

import csv
import json
import math
import os
import re

import pytest

from pcast_jax import cli
from pcast_jax.errors import PcastError

FIGURES = ("figure1_dp", "figure2_delta", "figure3_n")
TABLES = ("table1", "table2", "table2_ratios", "figure1_dp", "figure2_delta", "figure3_n", "appendix_a", "appendix_b",
          "table3_kernels", "table3_xqa_subseq", "findings")


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
    _check_table3_markdown_is_readable(out)
    _check_rerun_resumes(out)


def _check_files(quick_report):
    out = quick_report
    assert (out / "report.md").stat().st_size > 1000
    from pcast_jax.report import NO_SUCH_COLUMN

    for name in TABLES:
        rows = _rows(out / f"{name}.csv")
        assert rows, name
        for r in rows:  # tidy: one kind of row per file, every cell filled
            assert all(v not in ("", NO_SUCH_COLUMN) for v in r.values()), (name, r)
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
    rows = _rows(quick_report / "table2.csv")
    assert {r["config"] for r in rows} == {"fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"}
    ratios = _rows(quick_report / "table2_ratios.csv")
    assert sorted(int(r["n"]) for r in ratios) == sorted({int(r["n"]) for r in rows})
    assert all(float(r["fwd_s1_over_best"]) > 0 and r["best_config"] != "fwd_s1" for r in ratios)
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
            assert "pct" not in col or col.endswith("15pct"), (path.name, col)  # 15pct: a true/false flag
            if col.endswith("_frac") or col in ("frac_zeroed", "nonsink_mass", "zeroed_mass"):
                vals = [float(r[col]) for r in rows if not r[col].startswith("n/a")]
                bound = 1.0 + 1e-9 if "diff" not in col else 1.0
                assert all(-bound <= v <= bound for v in vals), (path.name, col, vals[:5])
    assert "s1_ours_frac" in _rows(quick_report / "table1.csv")[0]


def _check_table3_markdown_is_readable(quick_report):
    """Table 3 is shown as small tables (per phase: what runs, what it measured); the CSV has it all."""
    md = (quick_report / "report.md").read_text()
    section = md.split("## Table 3")[1].split("Data: [`table3_kernels.csv`]")[0]
    tables, current = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) >= 4
    for t in tables:
        assert t[0].count("|") - 1 <= 9 and len(t) - 2 <= 12, t[0]
    assert "**Prefill**: what each kernel runs." in section and "**Decode**, N = " in section
    assert len(_rows(quick_report / "table3_kernels.csv")[0]) > 40  # every column stays in the CSV


def _check_appendix_a_matches_paper(quick_report):
    rows = _rows(quick_report / "appendix_a.csv")
    assert len(rows) == 15
    for r in rows:
        assert r["matches_printed_digits"] == "true", r
        assert math.isclose(float(r["dp"]), float(r["dp_paper"]), abs_tol=5e-4)
    dp = {float(r["scale"]): float(r["dp"]) for r in rows}
    assert all(dp[2.0**k] == 0.0625 for k in range(9))
    assert dp[512.0] == 0.25


def _check_table3_kernels(quick_report):
    """Table 3 as the kernels run: a prefill and a decode row per kernel, our verdict from the numbers."""
    from pcast_experiments import table3_kernels as t3
    from pcast_jax.metrics import expected_is_exact
    from pcast_jax.presets import get_preset, preset_for

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
        if k.decode is None:  # not run, and the reason is given in words in every cell it has no number for
            assert dec["preset"] == t3.NOT_RUN and dec["not_run"] and dec["mse_d7"] == "n/a: not run", k.label
            assert dec["verdict"] == f"not run: {k.no_decode}"
            continue
        assert int(dec["kv_splits"]) == get_preset(k.decode).kv_splits > 1 and dec["not_run"] == "no: it ran"
        assert int(dec["block_kv"]) == int(pre["block_kv"])  # a split-KV launch runs the same tile
    decode_kernels = {r["implementation"] for r in rows if r["phase"] == "decode" and r["preset"] != t3.NOT_RUN}
    assert {"FlashAttention-3", "TensorRT-LLM XQA"} <= decode_kernels
    ran = [r for r in rows if r["preset"] != t3.NOT_RUN]
    for r in ran:
        for t in ("d7", "d10"):
            z, se = float(r[f"zeroed_{t}_frac"]), float(r[f"zeroed_sem_{t}_frac"])
            mse = float(r[f"mse_{t}"])
            assert 0.0 <= z <= 1.0 and se >= 0.0 and math.isfinite(mse) and mse > 0, (r["preset"], t)
    changed = []
    for r in ran:  # our verdict follows from the row's numbers and their errors; a change is flagged and explained
        best = next(b for b in ran if b["preset"] == r["best_preset"] and (b["phase"], b["n"]) == (r["phase"], r["n"]))
        assert best["in_table3"] == "true" and float(best["mse_ratio_to_best_d7"]) == 1.0
        ratio, ratio_se = float(r["mse_ratio_to_best_d7"]), float(r["mse_ratio_to_best_sem_d7"])
        assert ratio > 0 and ratio_se >= 0 and r["ratio_metric"] in ("mse_expected", "mse", "mse / mse_expected")
        # each row's MSE is its preset's best estimator: V-averaged unless its accumulator adds an error
        assert r["mse_metric"] == ("mse_expected" if expected_is_exact(get_preset(r["base_preset"])) else "mse"), r
        vs = r["zeroed_vs_one_forward_pass_d10"]
        none_zeroed = float(r["zeroed_one_forward_pass_d10_frac"]) == 0
        assert vs.startswith("n/a: ") == none_zeroed, r  # not applicable, said in words
        penalty = {"yes": True, "no": False}.get(r["scale_penalty_d7"])
        assert penalty is not None or r["scale_penalty_d7"] == f"within noise at {r['verdict_seeds']} seeds"
        if ratio - 3 * ratio_se > t3.SCALE_PENALTY:  # above the threshold against the best: a penalty
            assert penalty is True, r
        expect = t3.verdict(float(r["zeroed_d7_frac"]), float(r["zeroed_sem_d7_frac"]), penalty,
                            None if none_zeroed else float(vs),
                            0.0 if none_zeroed else float(r["zeroed_vs_one_forward_pass_sem_d10"]),
                            int(r["verdict_seeds"]))
        assert r["verdict"] == expect, r
        change = r["in_table3"] == "true" and t3.decided(expect) and expect != r["paper_status"]
        assert (r["verdict_changes"] == "true") == change and (r["finding"] != "none: as the paper") == change, r
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
    """The measured verdict: collapse first, then the scale penalty, then the order / split safety net;
    each comparison decided only when its threshold is outside value ± z·s.e., else "within noise"."""
    from pcast_experiments import table3_kernels as t3
    from pcast_jax.stats import z_value

    n = 20
    z = z_value(n)
    assert 2.09 < z < 2.10 and 2.36 < z_value(8) < 2.37  # two-sided 95 % Student t, n − 1 degrees of freedom
    net = t3.SAFETY_NET
    assert t3.verdict(t3.COLLAPSE_FRAC * 2, 0.01, False, 1.0, 0.0, n) == "S=1 baseline"
    assert t3.verdict(0.0, 0.0, False, 1.0, 0.0, n) == "Optimal"
    assert t3.verdict(0.0, 0.0, True, net * 0.8, 0.01, n) == "Near-optimal"
    assert t3.verdict(0.0, 0.0, True, net * 1.2, 0.01, n) == "Suboptimal scale"
    assert t3.verdict(0.0, 0.0, True, None, 0.0, n) == "Near-optimal"  # nothing to protect against
    assert t3.verdict(0.0, 0.0, None, 1.0, 0.0, n) == f"within noise at {n} seeds (Optimal or Suboptimal scale)"
    # the scale penalty against every Table 3 kernel: 1.08 ± 0.02 is not clear of 1.05 at z ≈ 2.09
    assert t3.scale_penalty([(1.0, 0.0), (1.08, 0.02)], n) is None
    assert t3.scale_penalty([(1.0, 0.0), (1.08, 0.01)], n) is True  # 1.08 − 2.09 · 0.01 > 1.05
    assert t3.scale_penalty([(1.0, 0.0), (1.02, 0.01)], n) is False  # 1.02 + 2.09 · 0.01 < 1.05
    assert t3.scale_penalty([(1.02, 0.01), (1.10, 0.01)], n) is True  # one decided penalty suffices
    # a collapse fraction on the edge leaves every later branch open
    v = t3.verdict(t3.COLLAPSE_FRAC, 0.01, True, net * 1.2, 0.01, n)
    assert v == f"within noise at {n} seeds (Suboptimal scale or S=1 baseline)" and not t3.decided(v)
    assert set(t3.VERDICTS) >= {k.paper_status for k in t3.KERNELS if k.in_table3}


def test_table3_verdicts_hold_on_a_disjoint_seed_set(tmp_path):
    """Table 3's verdicts on seeds 0–7 and on seeds 8–15 (disjoint draws) are the same.

    Cost: two runs of both Table 3 sweeps (prefill and decode, 24 configs in all, Δ = 7 and 10) at
    N = 1024, q_len 8, d 64, 8 seeds: about 20 s on 2 CPU cores, most of it the XLA compiles.
    """
    import dataclasses

    from pcast_experiments import table3_kernels as t3
    from pcast_experiments.common import QUICK, Context
    from pcast_jax.config import KernelConfig
    from pcast_jax.metrics import expected_is_exact

    ctx = Context(tmp_path, quick=True, progress=False, log=lambda line: None)
    ctx.sizes = dataclasses.replace(QUICK, seeds_table3=8, ns_table3=(1024,), q_len=8, d=64)
    first, _, _ = t3.measure(ctx)
    second, _, _ = t3.measure(ctx, seed_offset=ctx.sizes.seeds_table3)
    spec = {name: sw["seed_indices"] for name, sw in ctx.sweep_log.items()}
    assert spec["kernels_prefill"] == [0, 7] and spec["kernels_prefill_seeds8"] == [8, 15]  # disjoint
    assert spec["kernels_prefill_sampled_v"] == [0, 7] and spec["kernels_prefill_sampled_v_seeds8"] == [8, 15]
    # V is drawn only where a preset's sampled MSE is needed (an accumulator the expectation does not see)
    for name, sw in ctx.sweep_log.items():
        exact = {expected_is_exact(KernelConfig.from_dict(c)) for c in sw["spec"]["configs"]}
        assert exact == {not sw["spec"].get("sampled_mse", True)}, name
    assert "kernels_decode_sampled_v" not in spec  # every decode preset accumulates in FP32
    assert [r["mse_d7"] for r in first if r["preset"] != t3.NOT_RUN] != \
        [r["mse_d7"] for r in second if r["preset"] != t3.NOT_RUN]  # other draws, other numbers
    verdicts = [(r["implementation"], r["phase"], r["verdict"]) for r in first]
    assert verdicts == [(r["implementation"], r["phase"], r["verdict"]) for r in second]
    assert any(t3.decided(v) for *_, v in verdicts)  # the S=1 baseline is decided at 8 seeds …
    assert any(v.startswith("within noise at 8 seeds (") for *_, v in verdicts)  # … the S ≈ 448 boundary is not


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


#: What each study selected before presets carried tags (the era catalogues PAPER_CONFIGS, KERNEL_PRESETS,
#: BLOCK_SCALED_PRESETS, KERNELS_2026 and AMD_PRESETS), in their order.
_SELECTED_BEFORE_TAGS = {
    "paper": ("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"),
    "table3": ("fa3", "fa4", "flashinfer_sm90", "trtllm_xqa", "trtllm_xqa_multiblock", "fa3_splitkv", "sageattn2",
               "sageattn2pp", "hpc_ops_prior", "hpc_ops", "dynamic_pow2"),
    "block_scaled": ("sageattn3", "nvfp4_fakequant", "mxfp8_p"),
    "sinks_and_rescale": ("cudnn_fp8", "cudnn_fp8_tau0", "cudnn_fp8_s32", "cudnn_fp8_s32_tau0", "cudnn_mxfp8",
                          "te_fp8_dpa", "fa4_pr2109", "fa4_pr2717", "vllm_triton_fp8", "vllm_triton_fp8_3d",
                          "vllm_triton_fp8_rocm", "vllm_fa4", "flashinfer_sm100_cutedsl", "flashinfer_sm120",
                          "flashinfer_sm120_pr5020", "trtllm_fmha_v2", "sglang_triton_decode"),
    "amd": ("fa_triton_amd_mi300", "fa_triton_amd_mi355", "vllm_rocm_flash_fp8"),
    "p_knobs": ("tpu_ragged_paged_fp8p", "tensorrt_int8", "litert_uint8"),
}


def test_each_study_selects_by_tag_the_presets_it_ran_before():
    """Tags replaced the era catalogues: every tag and each study still select the presets they ran before,
    in the same order (presets added since come on top, with no edit here), and every preset has a tag."""
    from typing import get_args

    from pcast_experiments import common, sinks_and_rescale
    from pcast_jax import presets
    from pcast_jax.models import fp8_study

    def before(names, tag):  # the presets of the old catalogue, in the order ``names`` has them
        return tuple(n for n in names if n in _SELECTED_BEFORE_TAGS[tag])

    for tag in _SELECTED_BEFORE_TAGS:
        assert before(presets.tagged(tag), tag) == _SELECTED_BEFORE_TAGS[tag], tag
    assert sorted(sum((tuple(presets.tagged(t)) for t in get_args(presets.Tag)), ())) == sorted(presets.PRESETS)
    assert common.PAPER_ORDER == _SELECTED_BEFORE_TAGS["paper"]
    assert before(sinks_and_rescale.PRESETS_STUDIED, "sinks_and_rescale") == _SELECTED_BEFORE_TAGS["sinks_and_rescale"]
    hooks = tuple(h.name for h in fp8_study.ReportSizes().head_configs)
    assert hooks[:16] == _SELECTED_BEFORE_TAGS["paper"] + _SELECTED_BEFORE_TAGS["table3"]
    with pytest.raises(PcastError, match="tag"):
        presets.tagged("kernels_2026")


def test_markdown_table_formats_and_escapes():
    from pcast_jax import report

    rows = [{"a": "x|y", "b": 0.5, "c": "n/a: not run"}, {"a": "z", "b": 0.25, "c": 2}]
    md = report.markdown_table(rows, [("a", "A"), ("b", "B", report.fmt_pct), ("c", "C")])
    lines = md.splitlines()
    assert lines[0] == "| A | B | C |" and lines[1] == "|:---|---:|---:|"
    assert lines[2] == "| x\\|y | 50.0% | n/a: not run |"
    assert lines[3] == "| z | 25.0% | 2 |"


def test_csv_and_json_round_trip(tmp_path):
    from pcast_jax import report

    rows = [{"n": 4096, "mse": 5.65e-5, "flag": True}, {"n": 8192, "mse": "n/a: not run", "extra": "x"}]
    path = report.write_csv(tmp_path / "t.csv", rows)
    back = _rows(path)
    assert list(back[0]) == ["n", "mse", "flag", "extra"]
    assert float(back[0]["mse"]) == 5.65e-5 and back[0]["flag"] == "true"
    assert back[1]["mse"] == "n/a: not run" and back[1]["extra"] == "x"
    assert back[0]["extra"] == report.NO_SUCH_COLUMN  # a column the row does not have says so
    with pytest.raises(PcastError, match=r"table t: .*column 'extra' is missing"):  # a tidy table has none
        report.write_csv(tmp_path / "t.csv", rows, tidy=True)
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


def _fake_experiment(monkeypatch, rows, findings=()):
    """``pcast reproduce --only fake`` runs one experiment whose table holds ``rows``."""
    import sys
    import types

    from pcast_experiments import registry
    from pcast_experiments.common import Column, Section, Table

    mod = types.ModuleType("fake_nan_experiment")
    mod.run = lambda ctx: Section("fake", "A fake table", "intro", findings=list(findings), tables=[
        Table("fake_table", rows, [Column("config", "config"), Column("mse", "MSE")])])
    monkeypatch.setitem(sys.modules, "fake_nan_experiment", mod)
    monkeypatch.setattr(registry, "EXPERIMENTS", {"fake": "fake_nan_experiment"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None, "—"])
def test_a_non_finite_cell_is_an_error_naming_table_and_config(tmp_path, capsys, monkeypatch, bad):
    """A NaN (or inf, a missing value, a bare dash) in one row of a table: `pcast reproduce` exits 2
    with one `pcast:` line naming the table and the row's config, and writes no CSV for it."""
    _fake_experiment(monkeypatch, [{"config": "fwd_s1", "mse": 1.0e-5}, {"config": "rev_s256", "mse": bad}])
    assert cli.main(["reproduce", "--out", str(tmp_path), "--only", "fake", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pcast:"), err
    assert "table fake_table" in err[0] and "config=rev_s256" in err[0] and "'mse'" in err[0], err
    assert not (tmp_path / "fake_table.csv").exists()


def test_a_non_finite_number_in_a_finding_is_an_error(tmp_path, capsys, monkeypatch):
    from pcast_experiments.common import Finding
    from pcast_jax import report

    finding = Finding("a claim", "1.0×", f"ours {report.fmt_ratio(float('nan'))}", "partly")
    _fake_experiment(monkeypatch, [{"config": "fwd_s1", "mse": 1.0e-5}], [finding])
    assert cli.main(["reproduce", "--out", str(tmp_path), "--only", "fake", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "table findings" in err and "claim=a claim" in err and "'ours nan×'" in err, err
    # a value that is not applicable, said in words, is published
    _fake_experiment(monkeypatch, [{"config": "fwd_s1", "mse": "n/a: never casts P"}])
    assert cli.main(["reproduce", "--out", str(tmp_path), "--only", "fake", "--no-progress"]) == 0
    assert _rows(tmp_path / "fake_table.csv") == [{"config": "fwd_s1", "mse": "n/a: never casts P"}]


def test_a_figure_with_a_non_finite_point_is_an_error(tmp_path):
    from pcast_jax import report
    from pcast_jax.errors import PcastError

    fig, ax = report.new_figure()
    ax.plot([1, 2, 3], [1.0, 2.0, 3.0], label="fwd_s256")
    report.save_figure(fig, tmp_path / "ok.png")
    ax.plot([1, 2, 3], [1.0, float("nan"), 3.0], label="fwd_s1")
    with pytest.raises(PcastError, match="figure bad: line 'fwd_s1'"):
        report.save_figure(fig, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_paired_ratio_and_decide():
    """The delta-method s.e. of a paired ratio against a float64 simulation of many seed sets."""
    import numpy as np

    from pcast_jax.stats import decide, paired_ratio

    rng = np.random.default_rng(1)
    common = rng.lognormal(0.0, 0.5, (4000, 40))  # per-instance noise both configs share
    a = 1.08 * common * rng.lognormal(0.0, 0.05, common.shape)
    b = common * rng.lognormal(0.0, 0.05, common.shape)
    est = [paired_ratio(x, y) for x, y in zip(a, b)]
    r, se = np.array(est).T
    assert abs(np.std(r) / np.mean(se) - 1) < 0.1  # the s.e. is the spread over seed sets
    assert np.std(r) < 0.5 * np.std(a.mean(1)) / b.mean()  # pairing removes the shared noise
    assert decide(1.10, 0.01, 1.05, 2.0) is True and decide(1.0, 0.01, 1.05, 2.0) is False
    assert decide(1.06, 0.01, 1.05, 2.0) is None and decide(1.06, float("nan"), 1.05, 2.0) is None
    assert decide(0.0, 0.0, 0.05, 2.0) is False  # zero everywhere, zero s.e.: decided
    with pytest.raises(Exception, match="denominator"):
        paired_ratio([1.0, 2.0], [0.0, 0.0])
