"""Trace folders read one layer at a time, and the analysis of a sample of query rows with its error."""

import math

import ml_dtypes
import numpy as np
import pytest

from pcast_jax import cli
from pcast_jax.analysis import StreamedTrace, Trace, analyze, load_trace
from pcast_jax.analysis import heads as H
from pcast_jax.analysis.rows import sample_rows
from pcast_jax.analysis.statistics import find_sinks
from pcast_jax.criterion import WITHIN_NOISE_ROWS as WITHIN_NOISE
from pcast_jax.errors import PcastError

CONFIGS = ["fwd_s1", "fwd_s256", "rev_s256", "fa3", "fa3_splitkv"]


def character(kind: str, *, layers=1, T=512, D=16, seed=0) -> Trace:
    """``layers`` layers of 4 query heads on 2 KV heads: a sink at key 0 whose pull varies by row ("sink",
    "window": the same within a 100-key window), or logits of σ ≈ 2.5 with no key standing out ("no sink")."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(layers, 1, T, 4, D)).astype(np.float32)
    k = rng.normal(size=(layers, 1, T, 2, D)).astype(np.float32)
    v = rng.normal(size=(layers, 1, T, 2, D)).astype(np.float32)
    if kind == "no sink":
        k *= 2.5
    else:
        k *= 0.6
        q[..., 0] = 1.0 + 0.3 * rng.normal(size=q.shape[:-1])
        k[..., 0] = 0.0
        k[:, 0, 0, :, :] = 0.0
        k[:, 0, 0, :, 0] = 9.0 * math.sqrt(D)
    window = np.full(layers, 100 if kind == "window" else -1)
    return Trace(q=q, k=k, v=v, lengths=np.array([T]), layers=tuple(f"l{i}" for i in range(layers)),
                 local_window_size=window)


def mixed_trace() -> Trace:
    """3 layers, 2 sequences of different lengths, a window, learned sinks and a soft cap."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(3, 2, 96, 4, 16)).astype(np.float32)
    k = rng.normal(size=(3, 2, 96, 2, 16)).astype(np.float32)
    v = rng.normal(size=(3, 2, 96, 2, 16)).astype(np.float32)
    k[:, :, 0, :, 0] += 12.0
    q[..., 0] += 1.0
    sinks = np.full((3, 4), -np.inf, np.float32)
    sinks[1] = [2.0, 3.0, -1.0, 0.5]
    return Trace(q=q, k=k, v=v, lengths=np.array([96, 70]), layers=("a", "b", "c"),
                 local_window_size=np.array([-1, 40, -1]), sinks=sinks,
                 logits_soft_cap=np.array([0.0, 0.0, 30.0], np.float32))


# -- trace folders ------------------------------------------------------------------------------------


def test_trace_folder_is_read_layer_by_layer_and_analyses_as_the_npz(tmp_path, monkeypatch):
    trace = mixed_trace()
    trace.save(tmp_path / "t.npz")
    trace.save_layers(tmp_path / "t")
    folder = load_trace(tmp_path / "t")
    assert isinstance(folder, StreamedTrace) and folder.shape == (3, 2, 96, 4, 2, 16)
    for name in ("lengths", "local_window_size", "sinks", "logits_soft_cap"):
        np.testing.assert_array_equal(getattr(folder, name), getattr(trace, name))
    assert folder.layers == trace.layers
    read = []
    real_layer = StreamedTrace.layer
    monkeypatch.setattr(StreamedTrace, "layer", lambda self, i: read.append(i) or real_layer(self, i))
    streamed = analyze(folder, ["fwd_s1", "rev_s256"], min_keys=8)
    assert read == [0, 1, 2]  # each layer read once, in order: one layer's q, k, v held at a time
    whole = analyze(load_trace(tmp_path / "t.npz"), ["fwd_s1", "rev_s256"], min_keys=8)
    for name, arr in whole.heads.items():  # the same computations on the same float32 numbers
        np.testing.assert_array_equal(streamed.heads[name], arr, err_msg=name)
    for name, arr in whole.stats.items():
        np.testing.assert_array_equal(streamed.stats[name], arr, err_msg=name)
    assert [s.rows for s in streamed.scans] == [s.rows for s in whole.scans]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_trace_folder_dtypes_are_memory_mapped_and_read_as_float32(tmp_path, dtype):
    trace = mixed_trace()
    trace.save_layers(tmp_path / "t", dtype=dtype)
    stored = np.load(tmp_path / "t" / "layer00001_k.npy", mmap_mode="r")  # a plain .npy, mappable
    assert isinstance(stored, np.memmap) and stored.shape == (2, 96, 2, 16)
    folder = load_trace(tmp_path / "t")
    want = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    for i in range(3):
        for got, full in zip(folder.layer(i), trace.layer(i)):
            assert got.dtype == np.float32
            # the stored dtype's rounding of the float32 numbers, widened back exactly (an ml_dtypes/NumPy cast)
            np.testing.assert_array_equal(got, full.astype(want).astype(np.float32))


def test_recorder_writes_a_trace_folder(tmp_path):
    import jax

    from pcast_jax.analysis import Recorder

    rec = Recorder()
    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
    rec.dot_product_attention(q, q, q, is_causal=True, name="x")
    rec.save_layers(tmp_path / "rec", dtype="bfloat16")
    folder = load_trace(tmp_path / "rec")
    assert folder.layers == ("x",) and folder.dtype == "bfloat16"
    np.testing.assert_array_equal(folder.layer(0)[0], np.asarray(q, np.float32).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))


def _damage(tmp_path, how):
    trace = mixed_trace()
    trace.save_layers(tmp_path / "t")
    path = tmp_path / "t" / "layer00001_v.npy"
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif how == "shape":
        np.save(path, np.zeros((2, 96, 2, 8), np.float32))
    elif how == "dtype":
        np.save(path, np.zeros((2, 96, 2, 16), np.float64))
    elif how == "missing":
        path.unlink()
    elif how == "no index":
        (tmp_path / "t" / "index.npz").unlink()
    elif how == "directory":
        path.unlink()
        path.mkdir()
    return tmp_path / "t"


@pytest.mark.parametrize("how, words", [("truncated", "layer00001_v.npy is"), ("shape", "layer00001_v.npy holds"),
                                        ("dtype", "layer00001_v.npy holds float64"),
                                        ("missing", "layer00001_v.npy does not exist"),
                                        ("no index", "has no index.npz"),
                                        ("directory", "layer00001_v.npy is not a regular file")])
def test_damaged_trace_folders_are_refused_naming_the_file(tmp_path, how, words):
    with pytest.raises(PcastError, match=words.replace(".", r"\.")):
        load_trace(_damage(tmp_path, how))


def test_a_non_finite_value_in_a_layer_file_is_refused_when_read(tmp_path):
    trace = mixed_trace()
    trace.save_layers(tmp_path / "t")
    bad = trace.v[2].copy()
    bad[1, 5, 0, 3] = np.nan
    np.save(tmp_path / "t" / "layer00002_v.npy", bad)
    folder = load_trace(tmp_path / "t")  # headers are right: refused when the layer is read
    folder.layer(0)
    with pytest.raises(PcastError, match=r"layer00002_v\.npy: holds a non-finite value"):
        folder.layer(2)
    with pytest.raises(PcastError, match="non-finite"):
        analyze(folder, ["fwd_s1"], min_keys=8)


def test_saving_a_trace_folder_refuses_what_the_dtype_cannot_hold(tmp_path):
    trace = mixed_trace()
    with pytest.raises(PcastError, match="dtype='float64' must be one of"):
        trace.save_layers(tmp_path / "a", dtype="float64")
    big = Trace(q=trace.q, k=trace.k, v=trace.v * 1e5, lengths=trace.lengths, layers=trace.layers)
    with pytest.raises(PcastError, match=r"dtype='float16': field 'v' of layer 'a' holds a value beyond float16"):
        big.save_layers(tmp_path / "b", dtype="float16")
    assert not (tmp_path / "b").exists()  # written as a set: nothing of it


def test_cli_reads_trace_folders(tmp_path, capsys):
    trace = character("sink", T=128)
    trace.save_layers(tmp_path / "t", dtype="bfloat16")
    assert cli.main(["analyze", str(tmp_path / "t"), "--configs", "fwd_s1,rev_s256", "--out",
                     str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "On this model (1 layers × 4 heads" in out or "On this model (1 layer" in out
    assert "layer 1/1 done" in err and "s left" in err
    assert cli.main(["jax-fp8", "--trace", str(tmp_path / "t"), "--gpu", "hopper"]) == 0
    assert "scale_s" in capsys.readouterr().out


# -- sampled rows -----------------------------------------------------------------------------------------


def test_sample_rows_is_stratified_seeded_and_in_range():
    a = sample_rows(1000, 64, np.random.default_rng(5))
    b = sample_rows(1000, 64, np.random.default_rng(5))
    np.testing.assert_array_equal(a.positions, b.positions)
    assert len(a.positions) == 64 and len(set(a.positions.tolist())) == 64
    assert a.positions.min() >= 0 and a.positions.max() < 1000 and np.all(np.diff(a.positions) > 0)
    assert np.array_equal(np.bincount(a.strata), np.full(32, 2))  # two rows of each of the 32 strata
    assert a.sizes.sum() == 1000
    assert len(sample_rows(10, 64, np.random.default_rng(0)).positions) == 10


def test_a_sample_of_every_row_is_the_full_analysis():
    trace = character("window", T=256)
    q, k, v = (x[:, 0] for x in (trace.q, trace.k, trace.v))
    w = trace.local_window_size
    positions = find_sinks(q, k, local_window_size=w)
    family = ((H.resolve("fwd_s1"), (2.0, 16.0)),)
    full, full_masses = H.analyze_layers((q, k, v), CONFIGS, positions, local_window_size=w, families=family)
    every = sample_rows(256, 256, np.random.default_rng(0))
    sampled, masses = H.analyze_layers((q, k, v), CONFIGS, positions, local_window_size=w, families=family,
                                       sample=every)
    # every row, in chunks whose keys are rounded up differently: the same numbers up to the FP32 rounding of
    # sums over the extra masked blocks (rtol 1e-5, 80× float32's epsilon), and a census has no sampling error
    for name, arr in full.items():
        np.testing.assert_allclose(sampled[name], arr, rtol=1e-5, atol=1e-12, err_msg=name)
        if name != "rows_used":
            assert np.all(sampled[name + "_sem"][np.isfinite(arr)] == 0), name
    for name in ("zeroed_mass", "saturated_mass"):
        np.testing.assert_allclose(masses[0][name], full_masses[0][name], rtol=1e-5, atol=1e-12)


#: The test's z: a two-sided normal tail of 2·10⁻⁹ per comparison (the seed is fixed, so the test is
#: deterministic; z says how far from the full value a correct error could put a sampled one).
Z_TEST = 6.0


@pytest.mark.parametrize("kind", ["sink", "no sink", "window"])
def test_sampled_rows_hold_the_full_value_within_their_error(kind):
    trace = character(kind)
    q, k, v = (x[:, 0] for x in (trace.q, trace.k, trace.v))
    w = trace.local_window_size
    positions = find_sinks(q, k, local_window_size=w)  # the full analysis' sinks: the rows' error alone
    full, _ = H.analyze_layers((q, k, v), ["fwd_s1"], positions, local_window_size=w)
    sample = sample_rows(512, 64, np.random.default_rng(11))
    sampled, _ = H.analyze_layers((q, k, v), ["fwd_s1"], positions, local_window_size=w, sample=sample)
    checked = 0
    for name in ("zeroed_mass", "frac_zeroed", "frac_zeroed_row_mean", "mse", "rel_mse", "saturated_mass"):
        err = np.abs(sampled[name].astype(np.float64) - full[name])
        se = sampled[name + "_sem"].astype(np.float64)
        assert np.all(err <= Z_TEST * se + 1e-6 * np.abs(full[name])), (name, err, se)  # + FP32 rounding
        checked += int(np.sum(se > 0))
    assert checked >= 16  # the error is a real one (the sample varies), not a 0 that holds by luck
    assert sampled["rows_used"].max() <= 64 < full["rows_used"].min()


def test_analyze_rows_decides_within_the_error():
    trace = character("sink", layers=2)
    full = analyze(trace, ["fwd_s1", "rev_s256"])
    sampled = analyze(trace, ["fwd_s1", "rev_s256"], rows=64, seed=3)
    assert sampled.rows == 64 and full.rows is None and full.heads_sem is None
    np.testing.assert_array_equal(sampled.stats["sink_positions"], full.stats["sink_positions"])
    rows = {r["config"]: r for r in sampled.config_rows()}
    for name, row in rows.items():
        assert row["zeroed_mass_max_sem"] > 0
        if row["verdict"] != WITHIN_NOISE:  # decided: the full analysis agrees
            assert row["verdict"] == {r["config"]: r for r in full.config_rows()}[name]["verdict"]
    # a limit at the worst head's sampled mass is inside its error: not decided
    limit = rows["fwd_s1"]["zeroed_mass_max"]
    tight = analyze(trace, ["fwd_s1"], rows=64, seed=3, mass_limit=limit)
    assert tight.config_rows()[0]["verdict"] == WITHIN_NOISE
    assert tight.scans[0].within_noise and tight.scans[0].recommended is None
    words = "\n".join(tight.summary_lines())
    assert "Sampled: 64 random query rows" in words and WITHIN_NOISE in words and " ± " in words
    from pcast_jax.analysis.report import report_data

    data = report_data(tight)  # the JSON says why there is no recommendation, and no decision on the row
    assert data["scans"][0]["recommended"] is None and WITHIN_NOISE in data["scans"][0]["null_reasons"]["recommended"]
    undecided = [r for r in data["scans"][0]["rows"] if r["meets"] is None]
    assert undecided and all(WITHIN_NOISE in r["null_reasons"]["meets"] for r in undecided)
    assert data["configs"][0]["zeroed_mass_max_sem"] > 0
    # rows at least the sequence: every row, the full analysis
    whole = analyze(trace, ["fwd_s1", "rev_s256"], rows=512)
    assert whole.rows is None
    np.testing.assert_array_equal(whole.heads["zeroed_mass"], full.heads["zeroed_mass"])


def test_rows_refused_where_a_sample_cannot_stand_for_the_kernel():
    trace = character("sink", T=128)
    with pytest.raises(PcastError, match="rows=1"):
        analyze(trace, ["fwd_s1"], rows=1)
    with pytest.raises(PcastError, match=r"rows=16: trtllm_fmha_v2_skip share one scale or vote over a tile"):
        analyze(trace, ["trtllm_fmha_v2_skip"], rows=16)


def test_cli_rows_and_flags(tmp_path, capsys):
    trace = character("sink", T=256)
    trace.save(tmp_path / "t.npz")
    assert cli.main(["analyze", str(tmp_path / "t.npz"), "--configs", "fwd_s1", "--rows", "32", "--seed", "4",
                     "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "Sampled: 32 random query rows" in out and " ± " in out and err == ""
    assert "± s.e. (zeroed)" in (tmp_path / "out" / "analysis.md").read_text()
    assert cli.main(["analyze", str(tmp_path / "t.npz"), "--seed", "4", "--out", str(tmp_path / "o2")]) == 2
    assert "--seed='4': only with --rows" in capsys.readouterr().err
    assert cli.main(["analyze", str(tmp_path / "t.npz"), "--rows", "1", "--out", str(tmp_path / "o3")]) == 2
    assert "--rows" in capsys.readouterr().err
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90", "--no-progress"]) == 2
    assert "--progress/--no-progress: only with --trace" in capsys.readouterr().err
