"""pcast_jax.analysis: capture through every entry point, the trace file, analyze(), the report, the CLI."""

import csv
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model_core import TINY, brute_force_sink_stats, planted_trace, tiny_params

import pcast_jax as pj
from pcast_jax import cli
from pcast_jax import nn as pnn
from pcast_jax.analysis import Recorder, Trace, analyze, compare_logits, load_trace, sink_statistics, write_report
from pcast_jax.analysis.chunk import further_row_metrics
from pcast_jax.analysis.report import NO_ROWS
from pcast_jax.analysis.statistics import SCALE_GRID
from pcast_jax.errors import PcastError
from pcast_jax.models import FP8Attention, extract_qkv, forward


def planted(layers=2, batch=1, T=96):
    """A Trace [L, B, T, 4, 16]: KV head 0 with a strong sink at key 5, KV head 1 a weak one."""
    qs, ks = [], []
    for layer in range(layers):
        for b in range(batch):
            q, k = planted_trace(T=T, seed=6 + 10 * layer + b)
            qs.append(q[0])
            ks.append(k[0])
    q = np.stack(qs).reshape(layers, batch, T, 4, 16)
    k = np.stack(ks).reshape(layers, batch, T, 2, 16)
    v = np.random.default_rng(1).normal(size=k.shape).astype(np.float32)
    return Trace(q=q, k=k, v=v, lengths=np.full(batch, T), layers=tuple(f"block{i}" for i in range(layers)))


def brute_force_underflow_mass(q, k, sink, scale, min_keys):
    """Float64, row by row: the softmax mass of non-sink keys with s < max sink − 10 ln2 − ln S."""
    T, d = q.shape
    s = q.astype(np.float64) @ k.T.astype(np.float64) / math.sqrt(d)
    masses = []
    for i in range(T):
        other = np.setdiff1d(np.arange(i + 1), [sink])
        if i < sink or len(other) < min_keys:
            continue
        p = np.exp(s[i, : i + 1] - s[i, : i + 1].max())
        p /= p.sum()
        below = other[s[i, other] < s[i, sink] - 10 * math.log(2) - math.log(scale)]
        masses.append(p[below].sum())
    return np.mean(masses)



def test_summary_says_one_head_has_a_sink():
    """One sink head reads "1 of 2 heads has a sink", as "none … has" and "4 of 8 … have" read."""
    t = planted(layers=1)
    one = Trace(q=t.q[..., ::2, :], k=t.k, v=t.v, lengths=t.lengths, layers=t.layers)  # query heads 0 and 2
    result = analyze(one, ["fwd_s1"], min_keys=8)
    assert result.sink_heads().sum() == 1
    assert "), 1 of 2 heads has a sink (" in result.summary_lines()[0]

# ----------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------


def test_recorder_drop_in_under_jit_folds_the_scale_and_keeps_the_output():
    q = jax.random.normal(jax.random.key(0), (2, 32, 4, 8))
    k = jax.random.normal(jax.random.key(1), (2, 32, 2, 8))
    v = jax.random.normal(jax.random.key(2), (2, 32, 2, 8))
    rec = Recorder()
    run = jax.jit(lambda q, k, v: rec.dot_product_attention(q, k, v, is_causal=True, scale=0.5,
                                                            key_value_seq_lengths=jnp.array([32, 20])))
    out = run(q, k, v)
    want = jax.jit(lambda q, k, v: pnn.dot_product_attention(
        q, k, v, is_causal=True, scale=0.5, key_value_seq_lengths=jnp.array([32, 20])))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))  # recording changes nothing
    trace = rec.trace()
    assert trace.q.shape == (1, 2, 32, 4, 8) and trace.layers == ("call0",)
    np.testing.assert_array_equal(trace.lengths, [32, 20])
    # logits q·k/√D of the trace equal the call's scale·q·k
    np.testing.assert_allclose(trace.q[0], np.asarray(q) * 0.5 * math.sqrt(8), rtol=1e-6)
    np.testing.assert_array_equal(trace.k[0], np.asarray(k))


def test_recorder_flax_attention_fn_one_layer_per_function():
    nnx = pytest.importorskip("flax.nnx")
    rec = Recorder()
    layers = [nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(i),
                                     attention_fn=rec.attention_fn("fwd_s1")) for i in range(3)]
    plain = [nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(i),
                                    attention_fn=pnn.attention_fn("fwd_s1")) for i in range(3)]
    x = y = jax.random.normal(jax.random.key(3), (2, 24, 16))
    inputs = []
    for layer, twin in zip(layers, plain):
        inputs.append(x)
        x, y = x + layer(x, is_causal=True), y + twin(y, is_causal=True)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # recording changes nothing
    trace = rec.trace()
    assert trace.layers == ("layer0", "layer1", "layer2") and trace.q.shape == (3, 2, 24, 2, 8)
    # layer 1's recorded keys are its own key projection of its input
    k1 = layers[1].key(inputs[1])
    np.testing.assert_allclose(trace.k[1], np.asarray(k1), rtol=1e-6, atol=1e-6)
    # under nnx.jit: the same layers, recorded again after clear()
    rec.clear()
    jitted = nnx.jit(lambda layer, x: layer(x, is_causal=True))
    jitted(layers[1], inputs[1])
    again = rec.trace()
    assert again.layers == ("layer1",)
    np.testing.assert_allclose(again.k[0], trace.k[1], rtol=1e-5, atol=1e-5)


def test_recorder_model_hook_equals_extract_qkv_per_sequence():
    params = tiny_params(TINY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (3, 20)))
    lengths = jnp.array([20, 15, 10])
    rec = Recorder()
    logits = forward(params, TINY, tokens, attention_fn=rec.hook(), lengths=lengths)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(params, TINY, tokens, lengths=lengths)),
                               rtol=1e-5, atol=1e-5)
    trace = rec.trace(tokens=tokens)
    assert trace.layers == ("layer0", "layer1") and trace.q.shape == (2, 3, 20, 4, 8)
    np.testing.assert_array_equal(trace.lengths, [20, 15, 10])
    for b in range(3):
        ref = extract_qkv(params, TINY, tokens[b])
        n = int(lengths[b])
        for got, want in zip(trace.sequence(b), ref):
            np.testing.assert_allclose(got, np.asarray(want)[:, :n], rtol=1e-5, atol=1e-5)
    assert rec.hook() is rec.hook()  # one compiled forward


def test_recorder_refuses_what_the_analysis_cannot_see():
    rec = Recorder()
    q = jnp.ones((8, 2, 4))
    with pytest.raises(PcastError, match="not causal"):
        rec.dot_product_attention(q, q, q)
    with pytest.raises(PcastError, match="bias"):
        rec.dot_product_attention(q, q, q, bias=jnp.zeros((8, 8)), is_causal=True)
    with pytest.raises(PcastError, match="1 queries and 8 keys"):
        rec.dot_product_attention(q[:1], q, q, is_causal=True)
    with pytest.raises(PcastError, match="nothing was recorded"):
        rec.trace()


def test_trace_file_round_trip_and_damaged_files(tmp_path):
    trace = planted(batch=2)
    trace = Trace(q=trace.q, k=trace.k, v=trace.v, lengths=np.array([96, 60]), layers=trace.layers,
                  tokens=np.zeros((2, 96), np.int32))
    path = trace.save(tmp_path / "t.npz")
    back = load_trace(path)
    for name in ("q", "k", "v", "lengths", "tokens"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert back.layers == trace.layers
    assert back.sequence(1)[0].shape == (2, 60, 4, 16)

    def damaged(**fields):
        bad = tmp_path / f"bad{len(list(tmp_path.glob('bad*')))}.npz"
        data = dict(np.load(path))
        data.update(fields)
        for name, value in fields.items():
            if value is None:
                del data[name]
        np.savez(bad, **data)
        return bad

    bad_q = trace.q.copy()
    bad_q[0, 0, 3, 1, 2] = np.nan
    cases = {"'q' holds a non-finite": damaged(q=bad_q), "'lengths' is missing": damaged(lengths=None),
             "'lengths' must be 2 integers": damaged(lengths=np.array([96, 97])),
             "'layers' must hold 2 distinct": damaged(layers=np.array(["a", "a"])),
             "'k' .* do not match": damaged(k=trace.k[:, :, :50]),
             "'format'": damaged(format=np.array("something else")),
             "'local_window_size' must be 2 integers": damaged(local_window_size=np.array([-2, 4])),
             "'sinks' must be 2×4": damaged(sinks=np.full((2, 4), np.nan, np.float32))}
    for message, bad in cases.items():
        with pytest.raises(PcastError, match=message) as info:
            load_trace(bad)
        assert bad.name in str(info.value)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(PcastError, match="junk.npz"):
        load_trace(tmp_path / "junk.npz")
    with pytest.raises(PcastError, match="does not exist"):
        load_trace(tmp_path / "absent.npz")


# ----------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------


def test_underflow_mass_per_scale_matches_float64_rows():
    q, k = planted_trace()
    stats = sink_statistics(q, k, num_sinks=1, min_keys=8)
    assert stats["underflow_mass"].shape == (1, 4, len(SCALE_GRID))
    for h in (0, 2):
        for si in (0, 4, 8):
            want = brute_force_underflow_mass(q[0, :, h], k[0, :, h // 2], 5, SCALE_GRID[si], 8)
            assert stats["underflow_mass"][0, h, si] == pytest.approx(want, rel=1e-3, abs=1e-7)
    ref = brute_force_sink_stats(q[0, :, 0], k[0, :, 0], np.array([5]), 8)
    assert stats["sink_mass"][0, 0] == pytest.approx(ref["sink_mass"], rel=2e-4)


@pytest.mark.parametrize("config", ["fwd_s1", "fa3_splitkv", "e4m3 Q/K/V per head"])
def test_head_metrics_on_row_chunks_equal_the_whole_layer(config):
    """head_metrics runs the kernel on chunks of each head's query rows (here 32, 32, 32 and a ragged 4)
    with Q/K/V quantized over the whole layer: the metrics of heads_attention's whole-layer rows."""
    from pcast_jax.analysis import heads
    from pcast_jax.analysis.plan import KERNEL_BYTES_PER_SCORE, Chunking, rows_per_chunk
    from pcast_jax.presets import PRESETS

    if config.startswith("e4m3"):
        config = PRESETS["fwd_s1"].replace(qkv="e4m3", qkv_granularity="head", name="fwd_s1_q8")
    tr = planted(layers=1, T=100)
    q, k, v = (x[0, 0] for x in (tr.q, tr.k, tr.v))
    sinks = sink_statistics(q[None], k[None])["sink_positions"][0]
    chunking = Chunking(chunk_bytes=KERNEL_BYTES_PER_SCORE * 100 * 40)
    assert rows_per_chunk(100, 100, chunking.chunk_bytes) == 32
    got = heads.head_metrics(q, k, v, config, sinks, chunking=chunking)

    is_sink = np.zeros((4, 100), bool)
    np.put_along_axis(is_sink, sinks, True, axis=1)
    res = heads.heads_attention(q, k, v, config, count_mask=~is_sink)
    ref = np.asarray(heads._reference_jit(*(jnp.asarray(x) for x in (q, k, v))), np.float64)
    out = np.asarray(res.out, np.float64)
    counted = np.asarray(res.n_counted, np.float64)
    zeroed = np.asarray(res.n_zeroed, np.float64)
    valid = (np.arange(100)[None] >= sinks.max(-1)[:, None]) & (counted >= 16)
    np.testing.assert_array_equal(got["rows_used"], valid.sum(-1))
    np.testing.assert_allclose(got["mse"], np.mean((out - ref) ** 2, axis=(1, 2)), rtol=1e-5)
    np.testing.assert_allclose(got["frac_zeroed"], zeroed.sum(-1) / counted.sum(-1), rtol=1e-6)  # pooled over rows
    for name, rows in (("frac_zeroed_row_mean", zeroed / np.maximum(counted, 1)),
                       ("zeroed_mass", np.asarray(res.zeroed_mass, np.float64))):
        np.testing.assert_allclose(got[name], np.where(valid, rows, 0).sum(-1) / valid.sum(-1), rtol=1e-5, atol=1e-9)
    if config != "fa3_splitkv":  # the planted sink collapses some P under forward S = 1: the counts are exercised
        assert got["frac_zeroed"].max() > 0 and got["frac_zeroed_row_mean"].max() > 0


@pytest.mark.parametrize("name", ["fwd_s1", "fa3_splitkv", "aiter_mha_fp8_mi355"])
def test_the_planned_layer_equals_one_chunk_of_every_row_on_every_key(name):
    """plan_layer cuts a layer into chunks of query rows (whole query tiles) on the keys a causal kernel visits,
    one Q·K product per chunk for every config and candidate scale; the metrics and the candidates' masses equal
    those of one chunk holding every row on every key: the counts exactly, the masses and the MSE to FP32
    rounding of sums over blocks of other shapes."""
    from pcast_jax.analysis.heads import analyze_layers
    from pcast_jax.analysis.plan import Chunking, plan_layer
    from pcast_jax.presets import PRESETS

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 256, 2, 16)).astype(np.float32) for _ in range(3))
    q[..., 0], k[:, :1, :, 0] = 2.5, 12.0  # a sink ~30 logits above the rest
    positions = np.zeros((1, 2, 1), np.int32)
    cfg = PRESETS[name].replace(causal=True)
    scans = (tuple(cfg.replace(scale=s) for s in (1.0, 16.0)),)
    planned, one = Chunking(chunk_bytes=48 * 256 * 32), Chunking(chunk_bytes=1 << 40, causal_keys=False)
    layout = plan_layer([cfg], scans, num_tokens=256, length=256, chunking=planned)
    whole = plan_layer([cfg], scans, num_tokens=256, length=256, chunking=one)
    assert len(layout.groups) == 1 and layout.groups[0].jobs == (("config", 0), ("family", 0))
    assert len(layout.groups[0].chunks) > 1 and layout.keys_visited() < 256 * 256 * 2
    assert [(c.rows, c.keys) for c in whole.groups[0].chunks] == [(256, 256)]
    assert whole.keys_visited() == 256 * 256 * len(whole.groups[0].chunks[0].programs)
    families = ((cfg, (1.0, 16.0)),)
    got, got_masses = analyze_layers((q, k, v), [cfg], positions, families=families, min_keys=8, chunking=planned)
    ref, ref_masses = analyze_layers((q, k, v), [cfg], positions, families=families, min_keys=8, chunking=one)
    assert np.any(ref["frac_zeroed"] > 0)
    for metric in ("frac_zeroed", "frac_zeroed_row_mean", "rows_used"):
        np.testing.assert_array_equal(got[metric], ref[metric], err_msg=metric)
    # masses: sums of at most 256 float32 terms in another order, about 1e-6 relative; 1e-5 leaves a margin
    for metric in ("zeroed_mass", "saturated_mass"):
        np.testing.assert_allclose(got[metric], ref[metric], rtol=1e-5, atol=1e-12, err_msg=metric)
        np.testing.assert_allclose(got_masses[0][metric], ref_masses[0][metric], rtol=1e-5, atol=1e-12,
                                   err_msg=metric)
    # the MSE: FP32 rounding of the outputs (about 1e-6 of them) moves a mean of (O − O_ref)² by at most
    # 1e-6 · sqrt(MSE · mean O_ref²)
    bound = 1e-6 * np.sqrt(ref["mse"] * ref["ref_sq"])
    np.testing.assert_array_less(np.abs(got["mse"] - ref["mse"]), bound + 1e-30)


def test_further_engine_fields_become_metrics_by_name():
    class Result(NamedTuple):
        out: jax.Array
        n_zeroed: jax.Array
        n_counted: jax.Array
        zeroed_mass: jax.Array
        n_saturated: jax.Array
        n_visible: jax.Array
        saturated_mass: jax.Array
        n_future: jax.Array

    counted = jnp.array([[4.0, 2.0]])
    res = Result(jnp.zeros((1, 2, 3)), counted, counted, counted, jnp.array([[1.0, 2.0]]), jnp.array([[5.0, 4.0]]),
                 jnp.array([[0.5, 0.25]]), jnp.array([[5.0, 2.0]]))
    got = further_row_metrics(res, counted)
    assert sorted(got) == ["frac_future", "frac_saturated", "saturated_mass"]
    np.testing.assert_allclose(got["frac_saturated"], [[0.2, 0.5]])  # of the visible keys, sinks included
    np.testing.assert_allclose(got["frac_future"], [[1.0, 0.5]])
    np.testing.assert_allclose(got["saturated_mass"], [[0.5, 0.25]])


def test_analyze_planted_sinks_verdicts_safe_scale_and_tables():
    trace = planted(layers=2, batch=2)
    lines = []
    result = analyze(trace, ["fwd_s1", "rev_s256"], min_keys=8, progress=lines.append)
    assert any("2 configs (fwd_s1, rev_s256)" in line for line in lines)
    # one line per layer done: the layers, the rows and the time left
    assert [line.split(" (")[0] for line in lines if " done " in line] == ["layer 1/2 done", "layer 2/2 done"]
    assert all("rows" in line and "s left" in line for line in lines if " done " in line)
    assert result.heads["zeroed_mass"].shape == (2, 2, 2, 4)
    sink = result.sink_heads()
    assert sink[:, :2].all() and not sink[:, 2:].any()  # KV head 0 (query heads 0, 1) carries the sink
    # the forward S = 1 kernel zeroes what the statistics say the running max at the sink zeroes
    fwd = result.head_mean("zeroed_mass")[0]
    predicted = np.nanmean(result.stats["underflow_mass"][..., 0], axis=0)
    np.testing.assert_allclose(fwd[:, :2], predicted[:, :2], rtol=0.05)
    rows = {r["config"]: r for r in result.config_rows()}
    assert rows["rev_s256"]["zeroed_mass_mean"] < rows["fwd_s1"]["zeroed_mass_mean"] / 10
    assert rows["rev_s256"]["verdict"] == "safe to serve" and rows["fwd_s1"]["verdict"] == "loses mass"
    scale = result.safe_scale("fwd_s1")
    assert result.scans[0].members == ("fwd_s1",)
    assert [r["meets"] for r in result.scans[0].rows] == [r["scale"] >= scale for r in result.scans[0].rows]
    summary = result.summary_lines()
    assert summary[0].startswith("On this model (2 layers × 4 heads, 2 sequences of 96 tokens), 4 of 8 heads")
    assert any(line.startswith("- `fwd_s1`: **loses mass**") for line in summary)
    assert any(f"`fwd_s1` (forward order, B = 64, multiply mode): `scale = {scale:g}`" in line for line in summary)
    assert rows["fwd_s1"]["saturated_mass_max"] == 0.0  # neither kernel clips here
    # a scale beyond E4M3's max saturates at the sink: clipped mass fails the criterion by itself
    over = analyze(trace, [pj.KernelConfig(scale=1024.0, name="fwd_s1024")], min_keys=8)
    row = over.config_rows()[0]
    assert row["frac_saturated_mean"] > 0 and row["saturated_mass_max"] > 0.5  # the sink's P, clipped
    assert row["zeroed_mass_max"] <= 1e-3 and row["verdict"] == "clips mass"
    assert over.safe_scale() == scale  # the same family (forward, B = 64): the same scan
    frame = result.to_dataframe()
    assert len(frame) == 2 * 2 * 2 * 4 and {"zeroed_mass", "delta", "rel_mse"} <= set(frame.columns)
    ds = result.to_xarray()
    assert ds["zeroed_mass"].dims == ("config", "sequence", "layer", "head")
    assert list(ds["layer"].values) == ["block0", "block1"]
    np.testing.assert_array_equal(ds["zeroed_mass"].sel(config="fwd_s1").values, result.heads["zeroed_mass"][0])


def test_analyze_end_to_end_matches_compare_logits():
    params = tiny_params(TINY)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 24)))
    lengths = jnp.array([24, 18])
    rec = Recorder()
    forward(params, TINY, tokens, attention_fn=rec.hook(), lengths=lengths)
    trace = rec.trace(tokens=tokens)

    def logits(config):
        hook = None if config is None else FP8Attention(config=config)
        return forward(params, TINY, tokens, attention_fn=hook, lengths=lengths)

    result = analyze(trace, ["fwd_s1"], min_keys=4, logits_fn=logits)
    want = compare_logits(logits(None), logits(result.configs[0]), tokens, lengths=lengths)
    assert result.e2e["fwd_s1"] == want and result.e2e_fp32.kl == 0.0
    assert any(line.startswith("End to end") for line in result.summary_lines())
    with pytest.raises(PcastError, match="tokens"):
        analyze(Trace(trace.q, trace.k, trace.v, trace.lengths, trace.layers), ["fwd_s1"], logits_fn=logits)
    with pytest.raises(PcastError, match="mass_limit"):
        analyze(trace, ["fwd_s1"], mass_limit=2.0)
    with pytest.raises(PcastError, match="configs"):
        analyze(trace, "fwd_s1")


def test_report_and_cli(tmp_path, capsys):
    trace = planted(layers=2, batch=1)
    path = trace.save(tmp_path / "trace.npz")
    assert cli.main(["analyze", str(path), "--configs", "fwd_s1,rev_s256", "--out", str(tmp_path / "rep"),
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("On this model (2 layers × 4 heads, 1 sequence of 96 tokens)")
    markdown = (tmp_path / "rep" / "analysis.md").read_text()
    assert markdown.splitlines()[2].startswith("On this model")
    assert (tmp_path / "rep" / "analysis_layers.png").stat().st_size > 1000
    with open(tmp_path / "rep" / "analysis_heads.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 4 and {r["config"] for r in rows} == {"fwd_s1", "rev_s256"}
    assert cli.main(["analyze", str(tmp_path / "absent.npz"), "--out", str(tmp_path / "x")]) == 2
    assert "absent.npz" in capsys.readouterr().err
    # a head whose sink sits too late for any row leaves words in the per-head table, never NaN
    short = planted(layers=1, batch=2)
    short = Trace(short.q, short.k, short.v, np.array([20, 96]), short.layers)
    result = analyze(short, ["fwd_s1"], min_keys=20)
    assert np.isnan(result.heads["zeroed_mass"][0, 0]).all() and np.isfinite(result.head_mean("zeroed_mass")).all()
    write_report(result, tmp_path / "few")
    assert "n/a: no query row" in (tmp_path / "few" / "analysis_heads.csv").read_text()
    with pytest.raises(PcastError, match="min_keys=20"):
        analyze(Trace(short.q, short.k, short.v, np.array([20, 20]), short.layers), ["fwd_s1"], min_keys=20)


def check_own_model_page(scope: dict, printed: str, folder: Path) -> None:
    """docs/guides/own_model.md, after tests/test_docs.py ran its blocks: the Flax example and the
    swap → capture → analyse path print and write what the page says."""
    assert "fwd_s1: KL(FP32 || FP8) = " in printed
    result = scope["result"]
    assert printed.splitlines()[2] == result.summary_lines()[0]
    assert result.summary_lines()[0].startswith("On this model (2 layers × 4 heads, 1 sequence of 512 tokens)")
    assert len(scope["frame"]) == 3 * 2 * 4 and "zeroed_mass" in scope["dataset"]
    assert (folder / "trace.npz").is_file() and (folder / "analysis" / "analysis.md").is_file()
    sampled = scope["sampled"]  # the trace folder, read a layer at a time, 128 rows of each layer sampled
    assert (folder / "trace" / "index.npz").is_file() and scope["streamed"].dtype == "bfloat16"
    assert sampled.rows == 128 and sampled.heads_sem is not None
    answer = scope["answer"]  # JAX's FP8 attention on the recorded model: the scale_s the scan recommends
    assert answer.config.rescale_threshold == 0.0 and answer.answer() in printed
    assert answer.recommended is None or answer.answer().startswith(f"Pass fp8_params['scale_s'] = "
                                                                    f"{answer.recommended:g} ")


# ----------------------------------------------------------------------------------------------
# Recommendations computed by the kernel they recommend; what the layer computes
# ----------------------------------------------------------------------------------------------


def numpy_forward_losses(q, k, length, window, block, scale, min_keys, learned=None, cap=None, tau=0.0):
    """Independent of the package: per query head of one layer, the zeroed and clipped mass of a
    forward-order kernel (KV blocks of ``block`` keys, running max over blocks, P·S cast to E4M3 by
    ml_dtypes), each a mean over the rows with >= min_keys visible non-sink keys; the sink is the key
    receiving the most attention. ``q [T, Hq, D]``, ``k [T, Hkv, D]``; keys ``i - window .. i``
    (window < 0: all of ``0 .. i``) among the first ``length`` tokens. ``learned [Hq]``: learned sink
    logits, a softmax column with no key that the running max never sees (the epilogue placement).
    ``cap``: a logit soft cap, every logit ``cap·tanh(logit/cap)``. ``tau`` > 0: a lazy rescale (cuDNN's
    reference): the running max moves only when a block's max exceeds it by more than ``tau`` logits, so
    P = exp(s − m) may exceed 1; ``scale`` is the S applied."""
    import ml_dtypes

    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    vis = (j <= i) & ((window < 0) | (i - j <= window))
    zeroed_out, clipped_out = [], []
    for h in range(num_heads):
        s = q[:length, h].astype(np.float64) @ k[:length, h // group].T.astype(np.float64) / math.sqrt(head_dim)
        s = s if cap is None else cap * np.tanh(s / cap)
        extra = -np.inf if learned is None else float(learned[h])
        top = np.maximum(np.where(vis, s, -np.inf).max(1, keepdims=True), extra)
        exact = np.where(vis, np.exp(np.where(vis, s, -np.inf) - top), 0)
        exact /= exact.sum(1, keepdims=True) + np.exp(extra - top)
        sink = int(np.argmax(exact.sum(0)))
        s32 = s.astype(np.float32)
        m = np.full(length, -np.inf, np.float32)
        zeroed, clipped = np.zeros(length), np.zeros(length)
        for b0 in range(0, length, block):
            cols = slice(b0, min(b0 + block, length))
            seen = vis[:, cols]
            sb = np.where(seen, s32[:, cols], np.float32(-np.inf))
            with np.errstate(invalid="ignore"):
                m = np.where(sb.max(1) - m > tau, np.maximum(m, sb.max(1)), m)
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.where(seen, np.exp(sb - m[:, None]), np.float32(0)).astype(np.float32)
                ps = p * np.float32(scale)
                cast = ps.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            other = np.arange(length)[cols] != sink
            zeroed += np.sum(exact[:, cols] * ((p > 0) & (cast == 0) & other), axis=1)
            clipped += np.sum(exact[:, cols] * (ps > 448), axis=1)
        rows = (vis.sum(1) - vis[:, sink]) >= min_keys
        zeroed_out.append(zeroed[rows].mean() if rows.any() else np.nan)
        clipped_out.append(clipped[rows].mean() if rows.any() else np.nan)
    return np.array(zeroed_out), np.array(clipped_out)


def numpy_safe_scale(trace, block, limit, min_keys, windows):
    """The smallest power of two 1..256 whose forward kernel keeps the worst head (per layer and head, a
    mean over sequences) at zeroed <= limit and clipped <= limit (None: none does); with the worst
    zeroed mass of every scale."""
    worst, safe = {}, None
    for scale in [2.0 ** e for e in range(9)]:
        per_seq = [[numpy_forward_losses(trace.q[layer, b], trace.k[layer, b], int(trace.lengths[b]), windows[layer],
                                         block, scale, min_keys) for layer in range(trace.q.shape[0])]
                   for b in range(trace.q.shape[1])]
        zeroed = np.nanmean([[z for z, _ in seq] for seq in per_seq], axis=0)
        clipped = np.nanmean([[c for _, c in seq] for seq in per_seq], axis=0)
        worst[scale] = float(np.nanmax(zeroed))
        if safe is None and np.nanmax(zeroed) <= limit and np.nanmax(clipped) <= limit:
            safe = scale
    return safe, worst


def character_trace(kind, *, T=128, D=16, seed=0):
    """One layer, 4 query heads on 2 KV heads, of a given character (see the test below)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, 1, T, 4, D)).astype(np.float32)
    k = rng.normal(size=(1, 1, T, 2, D)).astype(np.float32)
    v = rng.normal(size=(1, 1, T, 2, D)).astype(np.float32)
    lengths = [T]
    if kind == "no sink":  # logits with σ ≈ 2.5 and no key standing out
        k *= 2.5
    else:
        k *= 0.6
        q[..., 0] = 1.0
        k[..., 0] = 0.0
        position = {"sink at 0": 0, "sink in the middle": 70}.get(kind, 0)
        gain = {"max not the sink": 6.5}.get(kind, 9.0)
        k[0, 0, position, :, :] = 0.0
        k[0, 0, position, :, 0] = gain * math.sqrt(D)
        if kind == "max not the sink":  # keys 20 and 40 beat the sink on half the rows, lose on the rest
            q[..., 1] = rng.normal(size=q.shape[:-1]) * 1.5
            for pos in (20, 40):
                k[0, 0, pos, :, :] = 0.0
                k[0, 0, pos, :, 1] = 8.0 * math.sqrt(D) / 1.5
        if kind == "several lengths":
            q, k, v = (np.concatenate([x, np.roll(x, 3, axis=2)], axis=1) for x in (q, k, v))
            lengths = [T, T - 37]
    return Trace(q=q, k=k, v=v, lengths=np.array(lengths), layers=("attn",))


def assert_report_agrees_with_its_rows(result, limit):
    """The report never contradicts itself: every verdict and scan row applies the one criterion to its own
    numbers, the recommendation is the smallest scanned scale meeting it, every analysed configuration of a
    family says what the scan's row at its scale says, and the words print the recommendation."""
    from pcast_jax.criterion import SAFE, meets_criterion

    rows = {r["config"]: r for r in result.config_rows()}
    for row in rows.values():  # one criterion: the verdict is the worst head's zeroed and clipped mass
        assert (row["verdict"] == SAFE) == meets_criterion(row["zeroed_mass_max"], row["saturated_mass_max"], limit)
    summary = "\n".join(result.summary_lines())
    for scan in result.scans:
        for r in scan.rows:  # below the recommendation every simulated row fails, at it the row meets
            assert r["meets"] == meets_criterion(r["zeroed_mass_max"], r["saturated_mass_max"], limit)
            assert not r["meets"] or (scan.recommended is not None and r["scale"] >= scan.recommended)
        assert scan.recommended is None or any(r["meets"] and r["scale"] == scan.recommended for r in scan.rows)
        for cfg in result.configs:  # no analysed config of the family contradicts the recommendation
            if cfg.name not in scan.members or cfg.scale not in [r["scale"] for r in scan.rows]:
                continue
            scanned = next(r for r in scan.rows if r["scale"] == cfg.scale)
            assert rows[cfg.name]["zeroed_mass_max"] == pytest.approx(scanned["zeroed_mass_max"], rel=1e-6, abs=1e-12)
            assert (rows[cfg.name]["verdict"] == SAFE) == scanned["meets"]
            if scan.recommended is None or cfg.scale < scan.recommended:
                assert rows[cfg.name]["verdict"] != SAFE
            elif cfg.scale == scan.recommended:
                assert rows[cfg.name]["verdict"] == SAFE
        if scan.recommended is not None:
            assert f"`scale = {scan.recommended:g}`" in summary


@pytest.mark.parametrize("kind", ["sink at 0", "no sink", "max not the sink", "sink in the middle",
                                  "several lengths"])
def test_recommendation_is_what_its_own_kernel_rows_say(kind):
    """On traces unlike the examples (all GQA, 4 query heads on 2 KV heads), the recommended scale is the
    smallest simulated candidate meeting the stated criterion, every verdict uses that criterion, the
    words print it, and an independent NumPy forward kernel agrees on the scale and the masses."""
    trace = character_trace(kind)
    limit = 1e-3
    result = analyze(trace, ["fwd_s1", "fwd_s256", "rev_s256"], min_keys=8, mass_limit=limit)
    assert_report_agrees_with_its_rows(result, limit)
    forward = next(scan for scan in result.scans if "fwd_s1" in scan.members)
    assert forward.members == ("fwd_s1", "fwd_s256")
    want, worst = numpy_safe_scale(trace, 64, limit, 8, [-1])
    assert forward.recommended == want
    assert all(np.diff(list(worst.values())) <= 1e-12)  # the bisection's premise: zeroed mass falls with S
    for r in forward.rows:
        assert r["zeroed_mass_max"] == pytest.approx(worst[r["scale"]], rel=2e-3, abs=1e-7)
    if kind in ("max not the sink", "no sink"):  # the closed form (running max at the sink's logit) would
        closed = SCALE_GRID[int(np.argmax(result.worst_underflow_mass() <= limit))]  # recommend too small a scale
        assert closed < forward.recommended


def test_windowed_layer_is_analysed_as_it_runs(tmp_path):
    """A layer with a sink at key 0 and a 128-token window, recorded through the drop-in: the trace keeps
    the window, and the analysis (statistics, kernel, reference) sees only the keys the layer sees; an
    independent NumPy forward kernel on the windowed keys agrees, the full causal one does not."""
    trace = character_trace("sink at 0", T=320)
    rec = Recorder()
    q, k, v = (x[0] for x in (trace.q, trace.k, trace.v))
    out = rec.dot_product_attention(q, k, v, is_causal=True, local_window_size=(128, 0))
    want = pnn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(128, 0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    recorded = rec.trace()
    np.testing.assert_array_equal(recorded.local_window_size, [128])
    result = analyze(recorded, ["fwd_s1"], min_keys=8)
    got = result.head_mean("zeroed_mass")[0, 0]
    windowed, _ = numpy_forward_losses(q[0], k[0], 320, 128, 64, 1.0, 8)
    full, _ = numpy_forward_losses(q[0], k[0], 320, -1, 64, 1.0, 8)
    np.testing.assert_allclose(got, windowed, rtol=2e-3, atol=1e-7)
    assert np.all(np.abs(full - windowed) > 0.1 * windowed)  # the window changes the answer
    # the reference honours the window: the kernel's relative MSE is small, as against windowed attention
    assert result.config_rows()[0]["rel_mse_mean"] < 1e-2
    assert "1 of 1 layers attend within a local window (128 keys back)" in "\n".join(result.summary_lines())
    assert load_trace(recorded.save(tmp_path / "w.npz")).local_window_size.tolist() == [128]


def test_recorder_records_what_the_call_sees_or_refuses_it():
    """Validation before recording: a refused call records nothing; layer names never merge; a padding
    mask becomes lengths; a mask the trace cannot hold is refused naming it, eagerly or at trace()."""
    q = jax.random.normal(jax.random.key(0), (2, 24, 4, 8))
    k = jax.random.normal(jax.random.key(1), (2, 24, 2, 8))
    rec = Recorder()
    with pytest.raises(PcastError):  # the attention refuses a float mask: nothing is recorded
        rec.dot_product_attention(q, k, k, mask=jnp.ones((24, 24)), is_causal=True)
    with pytest.raises(PcastError):  # integer inputs
        rec.dot_product_attention(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32), is_causal=True)
    with pytest.raises(PcastError, match="nothing was recorded"):
        rec.trace()
    rec.attention_fn(name="x")
    with pytest.raises(PcastError, match="name='x' is already a layer"):
        rec.attention_fn(name="x")
    # causal & key padding given as a mask: recorded as lengths, the output unchanged
    valid = jnp.arange(24)[None, :] < jnp.array([24, 17])[:, None]
    padding = jnp.tril(jnp.ones((24, 24), bool))[None, None] & valid[:, None, None, :]
    out = jax.jit(lambda q, k: rec.dot_product_attention(q, k, k, mask=padding))(q, k)
    want = jax.jit(lambda q, k: pnn.dot_product_attention(q, k, k, mask=padding))(q, k)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    trace = rec.trace()
    np.testing.assert_array_equal(trace.lengths, [24, 17])
    np.testing.assert_array_equal(trace.local_window_size, [-1])
    # a window given as a mask is recorded as the window
    rec.clear()
    band = jnp.tril(jnp.ones((24, 24), bool)) & ~jnp.tril(jnp.ones((24, 24), bool), -6)
    rec.dot_product_attention(q, k, k, mask=band)
    np.testing.assert_array_equal(rec.trace().local_window_size, [5])
    # one layer called with two different windows: refused at trace(), naming the argument
    rec.clear()
    layer = rec.attention_fn(name="banded")
    layer(q, k, k, mask=band[None, None].astype(jnp.float32))
    layer(q, k, k, mask=(jnp.tril(jnp.ones((24, 24), bool)) & ~jnp.tril(jnp.ones((24, 24), bool), -9))[None, None])
    with pytest.raises(PcastError, match="layer banded was called with local windows \\[5, 8\\]"):
        rec.trace()
    # what a trace cannot hold: a non-causal mask (eager: refused at once; under jit: at trace())
    rec.clear()
    with pytest.raises(PcastError, match="'mask'"):
        rec.dot_product_attention(q, k, k, mask=jnp.ones((24, 24), bool))
    with pytest.raises(PcastError, match="nothing was recorded"):
        rec.trace()
    jax.jit(lambda q, k: rec.dot_product_attention(q, k, k, mask=~jnp.tril(jnp.ones((24, 24), bool), -1)))(q, k)
    with pytest.raises(PcastError, match="call0 .*'mask'"):
        rec.trace()
    rec.clear()
    per_head = jnp.broadcast_to(jnp.tril(jnp.ones((24, 24), bool)), (4, 24, 24)).at[1, 5, 0].set(False)
    with pytest.raises(PcastError, match="differs between heads"):
        rec.dot_product_attention(q, k, k, mask=per_head)


def test_learned_sinks_are_recorded_and_analysed():
    """The drop-in's learned sinks ride in the trace and act in the statistics, the kernel and the
    reference: the zeroed mass is an independent NumPy kernel's with the sink column in the softmax."""
    trace = character_trace("sink at 0")
    q, k, v = (x[0] for x in (trace.q, trace.k, trace.v))
    learned = np.array([8.0, 9.0, 10.0, 11.0], np.float32)
    rec = Recorder()
    rec.dot_product_attention(q, k, v, is_causal=True, sinks=learned)
    recorded = rec.trace()
    np.testing.assert_array_equal(recorded.sinks, learned[None])
    result = analyze(recorded, ["fwd_s1"], min_keys=8)
    want, _ = numpy_forward_losses(q[0], k[0], 128, -1, 64, 1.0, 8, learned=learned)
    plain, _ = numpy_forward_losses(q[0], k[0], 128, -1, 64, 1.0, 8)
    np.testing.assert_allclose(result.head_mean("zeroed_mass")[0, 0], want, rtol=2e-3, atol=1e-7)
    assert np.all(want < 0.8 * plain)  # the learned sink takes a share of every row
    assert result.config_rows()[0]["rel_mse_mean"] < 1e-2  # the reference has the sink too
    assert np.all(result.stats["sink_mass"] < 0.9 * analyze(trace, ["fwd_s1"], min_keys=8).stats["sink_mass"])


def test_statistics_and_reference_on_row_chunks_equal_one_chunk():
    """Every per-row pass runs on chunks of query rows (bounded memory at any T): 7 ragged chunks give
    what one chunk gives, in the statistics, the reference and a windowed, padded layer's metrics."""
    from pcast_jax.analysis import heads
    from pcast_jax.analysis.plan import STAT_BYTES_PER_SCORE, Chunking, rows_per_chunk
    from pcast_jax.analysis.statistics import find_sinks

    tr = character_trace("sink in the middle", T=100)
    q, k, v = (x[0, 0] for x in (tr.q, tr.k, tr.v))
    whole = sink_statistics(q[None], k[None], min_keys=8, length=90, local_window_size=40)
    # the sink positions alone (what a scan of candidate scales needs) are the statistics' own
    np.testing.assert_array_equal(find_sinks(q[None], k[None], length=90, local_window_size=40),
                                  whole["sink_positions"])
    ref = np.asarray(heads._reference(q, k, v, length=90, window=40))
    metrics = heads.head_metrics(q, k, v, "fwd_s1", whole["sink_positions"][0], min_keys=8, length=90,
                                 local_window_size=40)
    chunking = Chunking(chunk_bytes=STAT_BYTES_PER_SCORE * 100 * 16)
    assert rows_per_chunk(100, 100, chunking.chunk_bytes, STAT_BYTES_PER_SCORE) == 16
    chunked = sink_statistics(q[None], k[None], min_keys=8, length=90, local_window_size=40, chunking=chunking)
    for name, value in whole.items():
        np.testing.assert_allclose(chunked[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(np.asarray(heads._reference(q, k, v, length=90, window=40, chunking=chunking)), ref,
                               rtol=1e-6, atol=1e-7)
    again = heads.head_metrics(q, k, v, "fwd_s1", whole["sink_positions"][0], min_keys=8, length=90,
                               local_window_size=40, chunking=chunking)
    for name, value in metrics.items():
        np.testing.assert_allclose(again[name], value, rtol=1e-5, atol=1e-9, err_msg=name)
    assert np.all(ref[:, 90:] == 0) and metrics["zeroed_mass"].max() > 0


# ----------------------------------------------------------------------------------------------
# Everyday use: the names passed, coordinates, JSON, figures without matplotlib
# ----------------------------------------------------------------------------------------------


def test_json_report_has_the_numbers_of_the_csv_and_the_words(tmp_path, capsys, monkeypatch):
    """`pcast analyze --format json` prints analysis.json: per configuration the numbers of
    analysis_configs.csv (bit for bit), the verdicts and safe scales the words print, a non-finite
    number as null with its reason; a preset passed as `fa3` stays `fa3` (head dim 16 runs its
    160-key tile, a column beside it), and the data set is keyed and indexed by what was passed."""
    import json

    from pcast_jax import stats
    from pcast_jax.analysis.report import NO_FIGURES

    trace = planted(layers=1, batch=2)
    path = trace.save(tmp_path / "trace.npz")
    out = tmp_path / "rep"
    assert cli.main(["analyze", str(path), "--configs", "fwd_s1,fa3", "--out", str(out), "--format", "json",
                     "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads((out / "analysis.json").read_text())
    with open(out / "analysis_configs.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["config"] for r in data["configs"]] == [r["config"] for r in csv_rows] == ["fwd_s1", "fa3"]
    assert [r["block_kv"] for r in data["configs"]] == [64, 160]  # FA3's tile at d <= 64
    compared = 0
    for row, cells in zip(data["configs"], csv_rows):
        for key, text in cells.items():
            value = row[key]
            if value is None:  # non-finite: null in JSON, the reason in words in the CSV and beside it
                assert text == row["null_reasons"][key] and text in (NO_ROWS, stats.NO_SE)
            elif isinstance(value, float):
                assert value == float(text), key
                compared += 1
    assert compared >= 10
    markdown = (out / "analysis.md").read_text()
    for row in data["configs"]:
        assert data["verdicts"][row["config"]] == row["verdict"] and f"`{row['config']}`: **{row['verdict']}**" \
            in markdown
    for scan in data["scans"]:
        assert scan["recommended"] == data["safe_scale"][scan["members"][0]]
        assert f"`scale = {scan['recommended']:g}`" in markdown
    assert data["criterion"]["mass_limit"] == 1e-3 and data["criterion"]["text"] in markdown
    assert "NaN" not in (out / "analysis.json").read_text() and "Infinity" not in (out / "analysis.json").read_text()
    assert (out / "analysis_decision.png").stat().st_size > 1000
    # the data set: keyed by the name passed, the tile as a coordinate, every dimension indexed
    result = analyze(trace, ["fwd_s1", "fa3"], min_keys=16)
    ds = result.to_xarray()
    assert int(ds["block_kv"].sel(config="fa3")) == 160
    assert list(ds["sequence"].values) == [0, 1] and list(ds["head"].values) == [0, 1, 2, 3]
    np.testing.assert_array_equal(ds["zeroed_mass"].sel(config="fa3", sequence=1, head=2).values,
                                  result.heads["zeroed_mass"][1, 1, :, 2])
    # without matplotlib: every other file is written, the words say which extra to install
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    bare = tmp_path / "bare"
    assert cli.main(["analyze", str(path), "--configs", "fwd_s1", "--out", str(bare), "--no-progress"]) == 0
    assert NO_FIGURES in capsys.readouterr().out
    assert {p.name for p in bare.iterdir()} == {"analysis.md", "analysis.json", "analysis_configs.csv",
                                                 "analysis_heads.csv"}
    assert "pcast_jax[plots]" in (bare / "analysis.md").read_text()
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", str(path), "--format", "yaml", "--out", str(bare)])
    assert exc.value.code == 2


def test_soft_capped_layer_is_recorded_and_analysed_with_capped_logits(tmp_path):
    """A layer with logits_soft_cap, recorded through the drop-in: the trace keeps the cap (through its
    file too), and the statistics, kernel and reference see cap·tanh(logit/cap): the zeroed mass is an
    independent NumPy kernel's on the capped logits, not on the raw ones."""
    trace = character_trace("sink at 0")
    q, k, v = (x[0] for x in (trace.q, trace.k, trace.v))
    rec = Recorder()
    out = rec.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=20.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(
        pnn.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=20.0)))
    recorded = load_trace(rec.trace().save(tmp_path / "capped.npz"))
    np.testing.assert_array_equal(recorded.logits_soft_cap, [20.0])
    result = analyze(recorded, ["fwd_s1"], min_keys=8)
    want, _ = numpy_forward_losses(q[0], k[0], 128, -1, 64, 1.0, 8, cap=20.0)
    raw, _ = numpy_forward_losses(q[0], k[0], 128, -1, 64, 1.0, 8)
    got = result.head_mean("zeroed_mass")[0, 0]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-7)
    assert want.min() > 1e-3 and np.all(np.abs(raw - want) > 0.2 * want)  # the cap changes the answer
    assert result.config_rows()[0]["rel_mse_mean"] < 1e-2  # the reference is capped too
    assert "1 of 1 layers soft-cap their logits (cap·tanh(logit/cap), cap = 20)" in "\n".join(result.summary_lines())
    with pytest.raises(PcastError, match="logits_soft_cap"):
        Trace(q=trace.q, k=trace.k, v=trace.v, lengths=trace.lengths, layers=trace.layers,
              logits_soft_cap=np.array([np.nan], np.float32))


def test_recorder_names_drop_in_layers_from_the_model_and_warns_on_ambiguous_calls():
    """Two eager forward passes through a model of three layer objects are three layers of two
    sequences, named after the layer class; a plain function's calls are layers in call order, with a
    RecorderWarning when one place makes a second layer; name= says which layer a call is."""
    import warnings

    from pcast_jax.analysis import RecorderWarning

    rec = Recorder()

    class Block:
        def __init__(self, seed):
            self.w = jax.random.normal(jax.random.key(seed), (3, 8, 2, 4)) / 3

        def __call__(self, x):
            q, k, v = (jnp.einsum("btd,dhe->bthe", x, w) for w in self.w)
            return x + rec.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)

    model = [Block(i) for i in range(3)]
    inputs = [jax.random.normal(jax.random.key(10 + p), (1, 16, 8)) for p in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        for x in inputs:  # two forward passes
            for block in model:
                x = block(x)
    trace = rec.trace()
    assert trace.layers == ("Block0", "Block1", "Block2") and trace.q.shape[:2] == (3, 2)
    first = jnp.einsum("btd,dhe->bthe", inputs[1], model[0].w[0])  # pass 2's first layer is sequence 1
    np.testing.assert_allclose(trace.q[0, 1], np.asarray(first[0]), rtol=1e-6, atol=1e-6)

    rec = Recorder()
    q = jax.random.normal(jax.random.key(0), (1, 16, 2, 4))

    def layer(x, name=None):
        return rec.dot_product_attention(x, x, x, is_causal=True, name=name)

    with pytest.warns(RecorderWarning, match="layers call0 and call1 come from the same place"):
        for _ in range(2):
            layer(q)
    assert rec.trace().layers == ("call0", "call1")
    rec.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        for _ in range(2):  # two passes of a two-layer functional model, each call named
            for i in range(2):
                layer(q * (i + 1), name=f"attn{i}")
    trace = rec.trace()
    assert trace.layers == ("attn0", "attn1") and trace.q.shape[:2] == (2, 2)
    rec.attention_fn(name="taken")
    with pytest.raises(PcastError, match="name='taken' is a layer of this recorder's attention_fn"):
        layer(q, name="taken")
    layer(q[:, :8], name="attn0")  # a second batch of another length
    with pytest.raises(PcastError, match="layer attn0 was called with q of shapes"):
        rec.trace()


def test_recorder_jitted_functional_loop_replays_its_layer_names():
    """Under jit the names are given when the forward is traced: a loop of layers from one place is
    layers in call order without a warning, and a second run adds sequences."""
    import warnings

    from pcast_jax.analysis import RecorderWarning

    rec = Recorder()

    @jax.jit
    def forward(x):
        for _ in range(2):
            x = x + rec.dot_product_attention(x, x, x, is_causal=True)
        return x

    x = jax.random.normal(jax.random.key(0), (1, 16, 2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        forward(x)
        forward(x * 2)
    trace = rec.trace()
    assert trace.layers == ("call0", "call1") and trace.q.shape[:2] == (2, 2)


# The JAX question on a model: which scale_s to pass to cuDNN's FP8 attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, gpu, tau", [("sink at 0", None, 4.0), ("no sink", "hopper", 0.0)])
def test_jax_fp8_scan_on_a_trace_is_the_numpy_kernel(kind, gpu, tau):
    """``jax_fp8.predict(trace=...)`` where scale_s reaches P (cuDNN's older reference: Hopper's τ = 0, or a
    τ in nats given without a GPU): per candidate scale_s the worst head's zeroed and clipped mass, and the
    recommended scale_s, equal an independent NumPy cuDNN kernel (forward order, 128-key blocks, lazy rescale
    τ, P·scale_s·2^-τ cast to E4M3) on a trace with a sink and on one without; the answer names it."""
    from pcast_jax import jax_fp8

    trace = character_trace(kind, T=320)
    limit = 1e-3
    r = jax_fp8.predict(trace=trace, gpu=gpu, min_keys=8, mass_limit=limit,
                        rescale_threshold=None if gpu else tau)
    assert r.config.rescale_threshold == tau and f"τ = {tau:g} nats" in r.gpu and r.scale_s_reaches_p
    rows = r.rows()
    assert [row["scale_s"] for row in rows] == [2.0 ** e for e in range(len(rows))]
    assert rows[-1]["s_eff"] == 256.0  # up to the largest scale_s whose S_eff stays within E4M3's 448
    want = None
    for row in rows:
        zeroed, clipped = numpy_forward_losses(trace.q[0, 0], trace.k[0, 0], 320, -1, 128,
                                               row["scale_s"] * 2.0 ** -tau, 8, tau=tau)
        assert row["zeroed_mass_max"] == pytest.approx(zeroed.max(), rel=2e-3, abs=1e-7), row
        assert row["saturated_mass_max"] == pytest.approx(clipped.max(), rel=2e-3, abs=1e-7), row
        if want is None and zeroed.max() <= limit and clipped.max() <= limit:
            want = row["scale_s"]
    assert want is not None and r.recommended == want
    assert r.answer().startswith(f"Pass fp8_params['scale_s'] = {want:g} ")
    assert r.summary().splitlines()[0] == f"GPU: {r.gpu}." and r.summary().endswith(r.answer())


@pytest.mark.parametrize("gpu, order", [("blackwell", "forward"), ("sm120", "reverse")])
def test_jax_fp8_on_the_open_kernels_scans_nothing_and_says_why(gpu, order):
    """On cuDNN's open SM100 / SM120 kernels scale_s never reaches P: one row, the kernel at its baked S = 16
    with τ = 4 (log2), whose masses equal an independent NumPy kernel (forward: S = 16, lag 4 ln 2 logits);
    no scale_s is recommended and the answer says there is none to pass, whatever scale_s was given."""
    from pcast_jax import jax_fp8

    trace = character_trace("sink at 0", T=320)
    r = jax_fp8.predict(trace=trace, gpu=gpu, min_keys=8, scale_s=64.0)
    (row,) = r.rows()
    assert row["scale_s"] is None and row["s_eff"] == 16.0 and r.recommended is None and not r.scale_s_reaches_p
    assert r.config.order == order
    if order == "forward":  # the NumPy kernel walks forward (the reverse walk is held to tests/oracle.py)
        zeroed, clipped = numpy_forward_losses(trace.q[0, 0], trace.k[0, 0], 320, -1, 128, 16.0, 8,
                                               tau=4 * math.log(2))
        # exp2 of the exponent mode against exp·16: float32 rounding, far below the masses compared
        assert row["zeroed_mass_max"] == pytest.approx(zeroed.max(), rel=2e-3, abs=1e-7)
        assert row["saturated_mass_max"] == pytest.approx(clipped.max(), rel=2e-3, abs=1e-7)
    assert r.answer().startswith("No scale_s to pass: this engine casts P at its own S = 16")
    assert "scale_s = 64 given: accepted and ignored" in r.summary()


def test_jax_fp8_scan_with_a_model_gives_each_candidates_kl():
    """With ``logits_fn`` every candidate's row carries the KL and top-1 agreement of the logits the model gave
    at that scale_s (here a stand-in model whose logits drift as 1/scale_s), and the answer quotes the
    recommendation's."""
    import dataclasses

    from pcast_jax import jax_fp8

    base = character_trace("no sink", T=320)
    tokens = np.random.default_rng(3).integers(0, 11, (1, 320))
    trace = dataclasses.replace(base, tokens=tokens)
    ref = np.random.default_rng(4).normal(size=(1, 320, 11)).astype(np.float32)
    noise = np.random.default_rng(5).normal(size=ref.shape).astype(np.float32)
    seen = []

    def logits(config):
        seen.append(None if config is None else config.scale)
        return ref if config is None else ref + noise / config.scale

    r = jax_fp8.predict(trace=trace, gpu="hopper", min_keys=8, logits_fn=logits)
    assert seen == [None] + [row["scale_s"] for row in r.rows()]
    for row in r.rows():
        want = compare_logits(ref, ref + noise / row["scale_s"], tokens)
        assert (row["kl"], row["top1_agree"]) == (want.kl, want.top1_agree)
    assert f"KL {r.e2e[r.recommended].kl:.2e} nats/token" in r.answer()
    with pytest.raises(PcastError, match="tokens"):
        jax_fp8.predict(trace=base, logits_fn=logits)


def test_jax_fp8_scan_says_when_no_scale_s_passes():
    """A limit no candidate meets: the answer says so instead of recommending one."""
    from pcast_jax import jax_fp8

    trace = character_trace("no sink", T=320)
    r = jax_fp8.predict(trace=trace, gpu="hopper", min_keys=8, mass_limit=1e-9)
    assert r.recommended is None and not any(row["meets"] for row in r.rows())
    assert r.answer().startswith("No scale_s passes")


def test_jax_fp8_cli_on_a_trace(tmp_path, capsys):
    """``pcast jax-fp8 --trace``: the GPU and its τ first, a row per scale_s, the argument to pass last;
    the JSON carries the same recommendation; --scale-s marks the row given."""
    path = character_trace("no sink", T=320).save(tmp_path / "t.npz")
    assert cli.main(["jax-fp8", "--trace", str(path), "--gpu", "hopper", "--scale-s", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("GPU: Hopper (sm90): cuDNN's closed SM90 FP8 engine") and "τ = 0 nats" in lines[0]
    assert any(line.startswith("  scale_s = 3 (given):") for line in lines)
    assert lines[-1].startswith("Pass fp8_params['scale_s'] = ")
    assert cli.main(["jax-fp8", "--trace", str(path), "--tau", "4", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"].startswith("no GPU given: cuDNN's older test reference") and data["scale_s_reaches_p"]
    assert data["answer"].startswith(f"Pass fp8_params['scale_s'] = {data['recommended_scale_s']:g} ")
    assert cli.main(["jax-fp8", "--trace", str(path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"].startswith("Blackwell (sm100), the default: cuDNN's open SM100 FP8 kernels")
    assert data["recommended_scale_s"] is None and data["answer"].startswith("No scale_s to pass")


def test_scale_masses_equal_the_full_kernel_per_scale_bit_for_bit():
    """The safe-scale scan's masses-only pass (every candidate scale in one call, no contraction with V)
    gives each scale's zeroed and clipped mass bit for bit as the full kernel simulated at that scale, and so
    does one pass of both over the layers (analyze_layers, the logits of each chunk shared): a
    split-KV exponent-mode family and a lazy-rescale multiply-mode one, on a trace whose most-attended key
    is not the first block's maximum."""
    from pcast_jax.analysis.heads import analyze_layers, analyze_trace, scale_masses
    from pcast_jax.analysis.study import kernel_for

    trace = character_trace("max not the sink")
    one = (trace.q[:, 0], trace.k[:, 0], trace.v[:, 0])
    positions = sink_statistics(*one, min_keys=8)["sink_positions"]
    for name, scales in (("fa3_splitkv", (1.0, 64.0)), ("cudnn_fp8", (16.0, 4096.0))):
        family = kernel_for(name, 16)
        got = scale_masses(one, family, scales, positions, min_keys=8)
        full = analyze_trace(one, [family.replace(scale=s) for s in scales], positions, min_keys=8)
        # configs and a family in one pass over the layers, on each chunk's shared logits: the same bits
        both, masses = analyze_layers(one, [family.replace(scale=s) for s in scales], positions,
                                      families=((family, scales),), min_keys=8)
        for metric in ("zeroed_mass", "saturated_mass"):
            np.testing.assert_array_equal(got[metric], full[metric], err_msg=f"{name} {metric}")
            np.testing.assert_array_equal(masses[0][metric], got[metric], err_msg=f"{name} {metric} one pass")
        for metric, value in full.items():
            np.testing.assert_array_equal(both[metric], value, err_msg=f"{name} {metric} one pass")
        assert np.all(got["zeroed_mass"][0] >= got["zeroed_mass"][1])  # a larger scale zeroes less


def test_kernels_that_compute_their_scale_get_no_scale_scan():
    """A tile-amax or dynamic kernel computes S itself: no candidate static scale is simulated for it, and no
    safe scale is recommended, where a static kernel beside it gets its scan."""
    result = analyze(character_trace("sink at 0"), ["aiter_mha_fp8_mi300", "fwd_s1"], min_keys=8)
    assert [scan.members for scan in result.scans] == [("fwd_s1",)]
    with pytest.raises(PcastError, match="config='aiter_mha_fp8_mi300' has no scan"):
        result.safe_scale("aiter_mha_fp8_mi300")


def test_safe_scale_is_given_in_the_knob_each_deployment_sets():
    """pcast analyze's safe scale in each family's own knob: cuDNN's scale_s where the engine applies it
    (Hopper's reference, τ = 0: P multiplied by scale_s), vLLM ROCm's prob_scale (S = 0.5/prob_scale on
    MI300), the config field elsewhere (the older reference at τ = 4 nats and the open SM100 kernel are in
    no row with a knob)."""
    names = ["cudnn_fp8_tau0", "vllm_rocm_flash_fp8", "fwd_s1", "cudnn_fp8", "cudnn_sm100_fp8"]
    result = analyze(character_trace("sink at 0"), names, min_keys=8)
    scans = {scan.members[0]: scan for scan in result.scans}
    cudnn, rocm, plain = scans["cudnn_fp8_tau0"], scans["vllm_rocm_flash_fp8"], scans["fwd_s1"]
    assert (cudnn.knob, cudnn.knob_where, rocm.knob, rocm.knob_where, plain.knob) == (
        "scale_s", "jax cudnn", "prob_scale", "vllm rocm_flash", "scale")
    assert scans["cudnn_fp8"].knob == scans["cudnn_sm100_fp8"].knob == "scale"
    for row in cudnn.rows:
        assert row["knob_value"] == row["scale"] and row["applied_scale"] == row["scale"]
    for row in rocm.rows:
        assert row["knob_value"] == 0.5 / row["scale"]
    summary = "\n".join(result.summary_lines())
    assert cudnn.recommended is not None and rocm.recommended is not None
    assert f"in jax cudnn's knob: `scale_s = {cudnn.recommended:g}`" in summary
    assert f"in vllm rocm_flash's knob: `prob_scale = {0.5 / rocm.recommended:g}`" in summary
