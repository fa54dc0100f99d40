"""Sweeps that sample no V (``SweepSpec(sampled_mse=False)``): the same metrics, without V's cost."""

import json

import jax
import numpy as np
import pytest

from pcast_jax import cli, metrics, workloads
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS
from pcast_jax.sweep import SweepSpec, estimate_instance_bytes, instance_key, run_sweep

KW = dict(deltas=(5.0, 9.0), ns=(512,), seeds=3, q_len=4, d=8)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_the_default_keeps_its_fingerprint_and_the_option_round_trips():
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"
    assert SweepSpec().to_dict()["sampled_mse"] is True
    free = SweepSpec(sampled_mse=False)
    assert free.fingerprint() != SweepSpec().fingerprint()
    assert SweepSpec.from_dict(free.to_dict()) == free
    assert estimate_instance_bytes(free, 4096) < estimate_instance_bytes(SweepSpec(), 4096)
    with pytest.raises(PcastError, match="sampled_mse=1 must be True or False"):
        SweepSpec(sampled_mse=1)
    with pytest.raises(PcastError, match="sampled_mse=False.*implementation='scan'"):
        SweepSpec(sampled_mse=False, implementation="scan")


def test_make_instance_without_v_draws_the_same_scores():
    w = workloads.SinkWorkload(n=256, q_len=4, d=8)
    key = instance_key(0, 256, 5)
    full = workloads.make_instance(key, w, 7.0)
    free = workloads.make_instance(key, w, 7.0, draw_v=False)
    assert free.v is None
    np.testing.assert_array_equal(_bits(free.scores), _bits(full.scores))
    np.testing.assert_array_equal(free.is_sink, full.is_sink)


def test_evaluate_refuses_what_it_cannot_compute():
    w = workloads.SinkWorkload(n=256, q_len=4, d=8)
    inst = workloads.make_instance(instance_key(0, 256, 0), w, 7.0, draw_v=False)
    with pytest.raises(PcastError, match="instance.v is None"):
        metrics.evaluate(inst, ("fwd_s1",))
    with pytest.raises(PcastError, match="implementation='scan' needs V"):
        metrics.evaluate(inst, ("fwd_s1",), implementation="scan", sampled=False)


@pytest.fixture(scope="module", params=[0, 1], ids=["presets-even", "presets-odd"])
def both(request):
    """Every preset swept with and without V on the same seeds: every other preset (sorted by name) per
    case, so a halved run (tests/cases.py) compiles the two sweeps over half the presets and the two
    halves together sweep each once (a 47-preset sweep pair, and its rerun in chunks of one, cost 3.5
    min of a cold half)."""
    configs = tuple(sorted(PRESETS))[request.param::2]
    full = run_sweep(SweepSpec(configs=configs, **KW), progress=False)
    free = run_sweep(SweepSpec(configs=configs, sampled_mse=False, **KW), progress=False)
    return full, free


#: mse_expected is a sum of (W − P)²: the subtraction of two nearly equal numbers leaves it P's FP32 rounding
#: relative to W − P, up to ~1e-5 of it (measured: 1.1e-5 on the presets' sweep below).
MSE_EXPECTED_RTOL = 3e-5


def _same(a, b, label=""):
    """Counts bit for bit; masses and mse_expected to float32 rounding. The sweeps with and without V are two
    programs over every preset, and XLA fuses their sums in ways that depend on the whole program (a
    change to one preset's graph moved other presets' masses by a few ulps), so bits are not promised."""
    np.testing.assert_array_equal(a["frac_zeroed"], b["frac_zeroed"], err_msg=f"{label} frac_zeroed")
    for m in ("zeroed_mass", "nonsink_mass"):
        np.testing.assert_allclose(a[m], b[m], rtol=1e-6, atol=0, err_msg=f"{label} {m}")
    np.testing.assert_allclose(a["mse_expected"], b["mse_expected"], rtol=MSE_EXPECTED_RTOL, atol=0, err_msg=label)


def test_without_v_every_other_metric_is_the_same_for_every_preset(both):
    full, free = both
    assert np.isnan(free.data["mse"]).all() and np.isfinite(full.data["mse"]).all()
    _same(free.data, full.data)
    # and they are not trivially equal: the configs differ from one another
    assert len(np.unique(free.data["mse_expected"][0, :, 1, 0])) > 5


def test_without_v_the_paper_configs_are_bit_identical_at_table2():
    spec = dict(deltas=(7.0,), ns=(4096,), seeds=2)
    full = run_sweep(SweepSpec(**spec), progress=False)
    free = run_sweep(SweepSpec(**spec, sampled_mse=False), progress=False)
    for m in ("mse_expected", "frac_zeroed", "zeroed_mass", "nonsink_mass"):
        np.testing.assert_array_equal(_bits(free.data[m]), _bits(full.data[m]), err_msg=m)


def test_without_v_the_sweep_is_bit_identical_for_any_chunking(both):
    _, free = both
    again = run_sweep(free.spec, chunk_size=1, progress=False)
    for m in metrics.METRICS:
        np.testing.assert_array_equal(_bits(again.data[m]), _bits(free.data[m]), err_msg=m)


def test_without_v_the_alone_evaluation_matches_the_sweep(both):
    _, free = both
    spec = free.spec
    inst = workloads.make_instance(instance_key(spec.base_seed, 512, 2), spec.workload(512), spec.deltas[1],
                                   draw_v=False)
    alone = jax.jit(lambda i: metrics.evaluate(i, spec.configs, sampled=False))(inst)
    assert np.isnan(alone["mse"]).all()
    for m in ("frac_zeroed", "zeroed_mass", "nonsink_mass"):  # another program: FP32 rounding
        np.testing.assert_allclose(alone[m], free.data[m][0, :, 1, 2], rtol=1e-6, atol=0, err_msg=m)
    np.testing.assert_allclose(alone["mse_expected"], free.data["mse_expected"][0, :, 1, 2], rtol=MSE_EXPECTED_RTOL,
                               atol=0)


TINY = ["--n", "64", "--seeds", "2", "--q-len", "2", "--d", "4", "--delta", "7", "--no-progress"]


def test_cli_without_sampled_v_prints_the_v_averaged_mse(tmp_path, capsys):
    out = tmp_path / "free"
    two = ["5,7" if a == "7" else a for a in TINY]  # two Δ: a line to plot against Δ
    assert cli.main(["sweep", *two, "--no-sampled-mse", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MSE (V-averaged)" in text and "nan" not in text
    assert json.loads((out / "spec.json").read_text())["spec"]["sampled_mse"] is False
    assert cli.main(["sweep", *two, "--no-sampled-mse", "--format", "csv", "--out", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "mse_expected_mean" in header and "mse_mean" not in header.split(",")
    assert cli.main(["plot", str(out), "--y", "mse", "--out", str(tmp_path / "mse.png")]) == 2
    assert "(was it run with --no-sampled-mse?)" in capsys.readouterr().err
    assert cli.main(["plot", str(out), "--x", "delta", "--y", "mse_expected", "--out", str(tmp_path / "e.png")]) == 0
    assert (tmp_path / "e.png").stat().st_size > 0


@pytest.mark.parametrize("extra, words", [
    (["--no-sampled-mse", "--metrics", "mse"], "'mse' is not computed with --no-sampled-mse"),
    (["--no-expected-mse", "--metrics", "mse_expected"], "'mse_expected' is not computed with --no-expected-mse"),
    (["--no-sampled-mse", "--implementation", "scan"], "--no-sampled-mse takes every metric"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--micro-batch", "two"], "--micro-batch"),
])
def test_cli_refuses_metrics_the_sweep_does_not_compute(tmp_path, capsys, extra, words):
    assert cli.main(["sweep", *TINY, *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pcast: error:") and words in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_cli_micro_batch_is_part_of_the_identity(tmp_path, capsys):
    out = tmp_path / "mb"
    assert cli.main(["sweep", *TINY, "--micro-batch", "2", "--out", str(out)]) == 0
    assert "micro_batch=2" in capsys.readouterr().out
    assert json.loads((out / "spec.json").read_text())["spec"]["micro_batch"] == 2
