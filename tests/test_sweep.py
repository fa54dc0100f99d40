"""The sweep driver: layout-independent results, resume, corrupted files, budgets, files, CLI."""

import csv
import json
import struct
import subprocess
import sys
import zipfile
from functools import partial
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from pcast_jax import cli, engine, metrics
from pcast_jax import sweep as sweep_mod
from pcast_jax.errors import PcastError
from pcast_jax.sweep import SweepSpec, estimate_instance_bytes, load_result, run_sweep
from pcast_jax.workloads import SinkWorkload, make_instance

from cases import count_chunks, subprocess_env

#: multiply, exponent and dynamic scale modes; N = 300 pads to 320 (B = 64) and 384 (B = 128)
SPEC_KW = dict(configs=("rev_s256", "fa3", "dynamic_pow2"), deltas=(5.0, 7.0, 9.0), ns=(300,), seeds=5,
               q_len=4, d=8)


@pytest.fixture(scope="module")
def spec():
    return SweepSpec(**SPEC_KW)


@pytest.fixture(scope="module")
def reference(spec):
    """The sweep in one chunk per N, in memory."""
    return run_sweep(spec, chunk_size=spec.seeds, progress=False)


def assert_same_bits(a, b):
    assert set(a.data) == set(b.data) == set(metrics.METRICS)
    for m in a.data:
        assert a.data[m].shape == b.data[m].shape
        np.testing.assert_array_equal(a.data[m].view(np.uint32), b.data[m].view(np.uint32), err_msg=m)




# --------------------------------------------------------------------------------------------
# Results do not depend on the layout
# --------------------------------------------------------------------------------------------


def test_results_are_finite_and_shaped(spec, reference):
    shape = (len(spec.ns), len(spec.configs), len(spec.deltas), spec.seeds)
    for m, arr in reference.data.items():
        assert arr.shape == shape and arr.dtype == np.float32
        assert np.all(np.isfinite(arr)), m
    # draws are shared across Δ and configs: the non-sink mass falls with Δ seed by seed
    mass = reference.get("nonsink_mass", config="rev_s256")
    assert np.all(np.diff(mass, axis=1) < 0)
    np.testing.assert_array_equal(reference.data["nonsink_mass"][:, 0], reference.data["nonsink_mass"][:, 2])


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_bit_identical_for_any_chunk_size_and_rerun(spec, reference, chunk_size):
    first = run_sweep(spec, chunk_size=chunk_size, progress=False)
    assert_same_bits(first, reference)
    assert_same_bits(run_sweep(spec, chunk_size=chunk_size, progress=False), first)


def test_bit_identical_with_delta_groups(spec, reference):
    """A memory budget for two (seed, Δ) instances splits the Δ axis into groups of two."""
    budget = 2 * max(estimate_instance_bytes(spec, n) for n in spec.ns)
    assert sweep_mod.plan_layout(spec, n_devices=1, memory_budget=budget)["delta_group"] == 2
    assert_same_bits(run_sweep(spec, memory_budget=budget, progress=False), reference)


def test_seed_offset_selects_the_same_instances(spec, reference):
    """Seeds 2..4 of the reference are seeds 0..2 of a sweep with seed_offset = 2."""
    shifted = run_sweep(SweepSpec(**{**SPEC_KW, "seeds": 3, "seed_offset": 2}), progress=False)
    for m in reference.data:
        np.testing.assert_array_equal(shifted.data[m], reference.data[m][..., 2:])


_SUBPROCESS = """
import json, sys
import jax, numpy as np
from pcast_jax.sweep import SweepSpec, run_sweep
assert len(jax.devices()) == 4, jax.devices()
spec = SweepSpec(**json.loads(sys.argv[1]))
four = run_sweep(spec, progress=False)
three = run_sweep(spec, devices=jax.devices()[:3], chunk_size=3, progress=False)
np.savez(sys.argv[2], **{"four_" + k: v for k, v in four.data.items()},
         **{"three_" + k: v for k, v in three.data.items()})
"""


def _four_device_results(tmp_path, spec_kw):
    env = subprocess_env(4)
    out = tmp_path / "four.npz"
    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in spec_kw.items()}
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, json.dumps(kw), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def _assert_same_as_one_device(got, reference):
    for prefix in ("four_", "three_"):
        for m, arr in reference.data.items():
            np.testing.assert_array_equal(got[prefix + m].view(np.uint32), arr.view(np.uint32), err_msg=prefix + m)


def test_bit_identical_on_four_devices(tmp_path, reference):
    """Sharded over 4 (forced host) devices, seeds padded to a multiple of the device count."""
    _assert_same_as_one_device(_four_device_results(tmp_path, SPEC_KW), reference)


@pytest.mark.slow
def test_bit_identical_on_four_devices_paper_configs_with_dynamic(tmp_path):
    """fwd_s1 beside dynamic_pow2 once differed here in the last bits of dynamic_pow2's MSEs: XLA
    rewrote the weights' division by the row sum ℓ into a multiply by 1/ℓ in the 1-device program
    but not in the 4-device one; the engine now multiplies by 1/ℓ itself (the same bits as the
    rewritten 1-device program)."""
    kw = {**SPEC_KW, "configs": ("fwd_s1", "rev_s256", "fa3", "sageattn2pp", "dynamic_pow2"), "ns": (300, 520)}
    reference = run_sweep(SweepSpec(**kw), progress=False)
    _assert_same_as_one_device(_four_device_results(tmp_path, kw), reference)


# --------------------------------------------------------------------------------------------
# Files, resume, refusal
# --------------------------------------------------------------------------------------------


def test_files_written_and_loadable(tmp_path, spec, reference):
    out = tmp_path / "run"
    res = run_sweep(spec, out, chunk_size=2, progress=False)
    assert_same_bits(res, reference)
    assert_same_bits(load_result(out), reference)
    assert load_result(out).spec == spec
    with np.load(out / "results.npz") as z:
        coords = {"coord_n", "coord_config", "coord_delta", "coord_seed"}
        assert set(z.files) == set(metrics.METRICS) | {"fingerprint"} | coords
        assert str(z["fingerprint"]) == spec.fingerprint()
        assert z["coord_config"].tolist() == list(spec.config_names) and z["coord_n"].tolist() == list(spec.ns)
        assert z["coord_delta"].tolist() == list(spec.deltas)
        assert z["coord_seed"].tolist() == list(range(spec.seed_offset, spec.seed_offset + spec.seeds))
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(spec.ns) * len(spec.configs) * len(spec.deltas)
    row = next(r for r in rows if r["config"] == "fa3" and int(r["n"]) == 300 and float(r["delta"]) == 7.0)
    assert float(row["mse_mean"]) == pytest.approx(float(res.mean("mse", config="fa3", n=300, delta=7.0)),
                                                   rel=1e-6)
    assert int(row["seeds"]) == spec.seeds
    for key in ("mse_sem", "frac_zeroed_mean", "nonsink_mass_mean", "mse_expected_mean", "zeroed_mass_sem"):
        assert key in row
    manifest = json.loads((out / "spec.json").read_text())
    assert manifest["fingerprint"] == spec.fingerprint()
    assert len(list((out / "chunks").glob("*.npz"))) == 3  # 5 seeds in chunks of 2


def test_resume_recomputes_only_missing_chunks(tmp_path, spec, reference, monkeypatch):
    out = tmp_path / "run"
    run_sweep(spec, out, chunk_size=2, progress=False)
    chunks = sorted((out / "chunks").glob("*.npz"))
    for path in chunks[::2]:
        path.unlink()
    (out / "results.npz").unlink()
    calls = count_chunks(monkeypatch)
    resumed = run_sweep(spec, out, progress=False)  # the saved layout (chunks of 2) is reused
    assert len(calls) == len(chunks[::2])
    assert_same_bits(resumed, reference)
    calls.clear()
    assert_same_bits(run_sweep(spec, out, progress=False), reference)
    assert calls == []  # everything on disk: nothing recomputed


def test_corrupted_or_foreign_chunk_is_recomputed_not_read(tmp_path, spec, reference, monkeypatch):
    out = tmp_path / "run"
    run_sweep(spec, out, chunk_size=2, progress=False)
    chunks = sorted((out / "chunks").glob("*.npz"))
    chunks[0].write_bytes(b"PK\x03\x04 not a zip file")  # truncated / garbage
    chunks[2].write_bytes(chunks[1].read_bytes())  # a valid chunk file, but of other seeds
    _flip_a_value_byte(chunks[1], "m_mse.npy")  # one bit of one stored MSE (the zip CRC no longer matches)
    calls = count_chunks(monkeypatch)
    assert_same_bits(run_sweep(spec, out, progress=False), reference)
    assert len(calls) == 3


def _flip_a_value_byte(path: Path, member: str) -> None:
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    data = info.header_offset + 30 + name_len + extra_len
    last = data + info.compress_size - 1  # last byte of the .npy payload: inside the array values
    raw[last] ^= 0x01
    path.write_bytes(bytes(raw))


def test_different_spec_in_same_folder_is_refused(tmp_path, spec):
    out = tmp_path / "run"
    run_sweep(spec, out, progress=False)
    other = SweepSpec(**{**SPEC_KW, "seeds": 6})
    with pytest.raises(PcastError, match="seeds"):
        run_sweep(other, out, progress=False)
    with pytest.raises(PcastError, match="different sweep"):
        run_sweep(SweepSpec(**{**SPEC_KW, "implementation": "scan"}), out, progress=False)


def test_too_small_memory_budget_fails_before_any_work(tmp_path, spec, monkeypatch):
    calls = count_chunks(monkeypatch)
    out = tmp_path / "never"
    with pytest.raises(PcastError, match="memory budget"):
        run_sweep(spec, out, memory_budget=10_000, progress=False)
    with pytest.raises(PcastError, match="chunk_size"):
        run_sweep(spec, out, chunk_size=5, memory_budget=estimate_instance_bytes(spec, 300) + 1,
                  progress=False)
    assert calls == [] and not out.exists()


def test_result_lookup_errors_name_the_parameter(reference):
    with pytest.raises(PcastError, match="metric"):
        reference.get("rmse", config="fa3")
    with pytest.raises(PcastError, match="config"):
        reference.mean("mse", config="fwd_s3")
    with pytest.raises(PcastError, match="n="):
        reference.get("mse", config="fa3", n=4096)
    with pytest.raises(PcastError, match="delta"):
        reference.mean("mse", config="fa3", delta=8.0)
    assert reference.mean("mse", config="fa3", n=300).shape == (3,)
    assert reference.get("mse", config="fa3", n=300, delta=7.0).shape == (5,)


def test_sweep_matches_direct_evaluation(spec, reference):
    """A sweep cell is metrics.evaluate on the instance drawn from the documented key."""
    n, seed, delta = 300, 3, 9.0
    inst = make_instance(sweep_mod.instance_key(spec.base_seed, n, seed), spec.workload(n), delta)
    direct = jax.jit(partial(metrics.evaluate, configs=spec.configs))(inst)
    for m in metrics.METRICS:
        got = reference.data[m][spec.ns.index(n), :, spec.deltas.index(delta), seed]
        np.testing.assert_allclose(got, np.asarray(direct[m]), rtol=1e-5, atol=1e-12, err_msg=m)


def test_jit_and_eager_agree():
    """Same zeroed counts, outputs to FP32 rounding, with and without jit (the cast carries an
    optimization barrier, so XLA cannot fuse the FP8 round trip away)."""
    w = SinkWorkload(n=300, q_len=4, d=8)
    inst = make_instance(jax.random.PRNGKey(0), w, 7.0)
    mask = ~inst.is_sink
    for name in ("fwd_s1", "fa3", "dynamic_pow2"):
        for eng in engine.IMPLEMENTATIONS:
            fn = partial(engine.attention, config=name, implementation=eng, count_mask=mask)
            jitted = jax.jit(fn)(inst.scores, inst.v)
            with jax.disable_jit():
                eager = fn(inst.scores, inst.v)
            np.testing.assert_array_equal(np.asarray(jitted.n_zeroed), np.asarray(eager.n_zeroed))
            scale = float(np.max(np.abs(np.asarray(eager.out))))
            chex.assert_trees_all_close(jitted.out, eager.out, atol=1e-6 * scale, rtol=1e-6)
            chex.assert_trees_all_close(jitted.row_sum, eager.row_sum, atol=0.0, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

CLI_ARGS = ["sweep", "--configs", "fwd_s1,rev_s256", "--delta", "5:9:2", "--n", "256,300", "--seeds", "3",
            "--q-len", "4", "--d", "8", "--no-progress"]


def test_cli_sweep_happy_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(CLI_ARGS) == 0
    text = capsys.readouterr().out
    spec = SweepSpec(configs=("fwd_s1", "rev_s256"), deltas=(5.0, 7.0, 9.0), ns=(256, 300), seeds=3, q_len=4, d=8)
    out = Path("sweeps") / spec.fingerprint()  # the default folder
    res = load_result(out)
    assert res.spec == spec
    lines = text.splitlines()
    table = [ln.split() for ln in lines if ln.split()[:1] in (["256"], ["300"])]
    assert len(table) == 2 * 2 * 3
    n, cfg, delta, mean_mse = table[-1][:4]
    assert (n, cfg, delta) == ("300", "rev_s256", "9")
    assert float(mean_mse) == pytest.approx(float(res.mean("mse", config="rev_s256", n=300, delta=9.0)), rel=1e-3)
    assert str(out / "results.npz") in text and str(out / "summary.csv") in text
    # the same command again resumes from the files and prints the same table
    assert cli.main(CLI_ARGS) == 0
    again = capsys.readouterr().out
    assert "resuming" in again
    assert [ln for ln in again.splitlines() if ln.split()[:1] == ["300"]] == \
        [ln for ln in lines if ln.split()[:1] == ["300"]]


def test_cli_sweep_options(tmp_path, capsys):
    out = tmp_path / "custom"
    args = ["sweep", "--configs", "fa3", "--delta", "6,8", "--n", "300", "--seeds", "2", "--seed-offset", "4",
            "--base-seed", "9", "--q-len", "3", "--d", "4", "--sink-positions", "0,1,150", "--sigma", "1.5",
            "--implementation", "scan", "--chunk-size", "1", "--no-expected-mse", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    res = load_result(out)
    s = res.spec
    assert (s.deltas, s.ns, s.seeds, s.seed_offset, s.base_seed, s.q_len, s.d) == ((6.0, 8.0), (300,), 2, 4, 9, 3, 4)
    assert (s.sink_positions, s.sigma, s.implementation, s.expected_mse) == ((0, 1, 150), 1.5, "scan", False)
    assert np.all(np.isnan(res.data["mse_expected"]))
    assert json.loads((out / "spec.json").read_text())["layout"]["chunk_size"] == 1


@pytest.mark.parametrize("option, value", [
    ("--delta", "5:x"), ("--delta", "9:5:1"), ("--delta", "5:9:0"), ("--delta", "1,,2"), ("--delta", "nan"),
    ("--n", "abc"), ("--n", "0"), ("--configs", "fwd_s1,nope"), ("--seeds", "0"), ("--seeds", "2.5"),
    ("--q-len", "-1"), ("--d", "x"), ("--sigma", "0"), ("--implementation", "slow"), ("--chunk-size", "0"),
    ("--sink-positions", "0,400"), ("--k-sink", "-2"), ("--seed-offset", "-1"),
])
def test_cli_sweep_bad_values_exit_2_naming_the_option(tmp_path, capsys, option, value):
    args = ["sweep", "--n", "300", "--seeds", "2", "--q-len", "2", "--d", "4", "--out", str(tmp_path / "o"),
            "--no-progress", option, value]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err
    assert not (tmp_path / "o").exists()


def test_cli_sweep_distributed_options_are_checked_before_any_work(tmp_path, capsys):
    """--process-id alone cannot start the multi-process runtime: one line, exit 2, nothing written."""
    out = tmp_path / "o"
    assert cli.main(["sweep", "--n", "300", "--seeds", "2", "--process-id", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "process_id" in err[0] and "coordinator" in err[0]
    assert not out.exists()


def test_cli_presets(capsys):
    from pcast_jax.presets import PRESETS

    assert cli.main(["presets"]) == 0
    text = capsys.readouterr().out
    for name, cfg in PRESETS.items():
        line = next(ln for ln in text.splitlines() if ln.split()[1:2] == [name])
        assert cfg.order in line and str(cfg.block_kv) in line and cfg.describe() in line


def test_micro_batch_is_picked_for_the_device_and_a_saved_spec_keeps_its_own():
    """1 on CPU; on an accelerator the largest power of two
    whose instances take 1/8 of its memory, capped by the seeds; a spec read back never re-picks."""
    from pcast_jax.sweep.spec import auto_micro_batch

    spec = SweepSpec(seeds=20)
    assert spec.micro_batch == 1 and spec.to_dict()["micro_batch"] == 1
    assert auto_micro_batch(spec, backend="gpu", memory_bytes=140 << 30) == 32  # 20 seeds → 32
    assert auto_micro_batch(SweepSpec(seeds=1000), backend="gpu", memory_bytes=140 << 30) == 256
    huge = SweepSpec(seeds=1000, ns=(1 << 20,))
    assert auto_micro_batch(huge, backend="gpu", memory_bytes=16 << 30) == 1  # one 1M-key instance is big
    per = estimate_instance_bytes(huge, 1 << 20)
    m = auto_micro_batch(huge, backend="tpu", memory_bytes=per * 64)
    assert m == 8 and m * per <= 64 * per / 8
    assert SweepSpec.from_dict(spec.to_dict()).micro_batch == 1


def test_planner_estimate_covers_what_xla_allocates_and_not_much_more():
    """estimate_instance_bytes against the compiled chunk's own figure (arguments + outputs +
    temporaries): never below it, at most 2x, for the presets that allocate differently and Table 2's
    shape (both engines; sampled V or not; every preset, measured once: 1.3-1.75x at N = 2048); the
    seeds of a chunk add nothing (the chunk loops over them), so the planner charges them nothing."""
    import numpy as np

    from pcast_jax.presets import PRESETS
    from pcast_jax.sweep.compute import chunk_args, chunk_metrics, chunk_shape, config_groups

    def compiled_bytes(spec, n):  # the largest group's program: the groups run one after another
        args = (chunk_args(spec, 0, spec.seeds, 1), np.asarray(spec.deltas, np.float32), np.int32(spec.base_seed))
        mems = [chunk_metrics.lower(*args, shape=g, n_shards=1).compile().memory_analysis()
                for g in config_groups(chunk_shape(spec, n))]
        if None in mems:
            pytest.skip("this jaxlib reports no memory analysis for CPU executables")
        return max(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes for m in mems)

    # what allocates differently: block-scaled P, split-KV, f16 accumulators, lazy rescale, dynamic S
    kinds = ("mxfp8_p", "nvfp4_fakequant", "cudnn_mxfp8", "fa3_splitkv", "trtllm_xqa_multiblock", "sageattn2pp",
             "fa4_pr2717", "cudnn_fp8", "dynamic_pow2", "vllm_triton_fp8_3d")
    assert set(kinds) <= set(PRESETS)
    specs = [SweepSpec(configs=kinds, ns=(2048,), q_len=16, d=64, seeds=1), SweepSpec(ns=(4096,), seeds=1),
             SweepSpec(ns=(4096,), seeds=1, implementation="scan"), SweepSpec(ns=(4096,), seeds=1, sampled_mse=False)]
    got = [compiled_bytes(spec, spec.ns[0]) for spec in specs]
    for spec, nbytes in zip(specs, got):
        ratio = estimate_instance_bytes(spec, spec.ns[0]) / nbytes
        assert 1.0 <= ratio <= 2.0, (spec.config_names, spec.implementation, spec.sampled_mse, ratio)
    assert compiled_bytes(SweepSpec(ns=(4096,), seeds=16), 4096) < 1.05 * got[1]
    big = SweepSpec(ns=(1 << 20,), seeds=64)  # N = 1M fits a 6 GiB budget, all 64 seeds in one chunk
    assert sweep_mod.plan_layout(big, n_devices=1, memory_budget=6 << 30)["chunk_size"] == 64
