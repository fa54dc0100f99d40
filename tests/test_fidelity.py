"""Kernel fidelity beyond one Algorithm-1 pass: split-KV, SageAttention2++'s f16 path, tiles by head dim.

Every new field is also held to the independent oracle in ``test_oracle.py``; these tests cover the
identity of configs (names, fingerprints), the split schedule, the f16 round trip surviving XLA's GPU
pipeline, finiteness at any V scale, the kernels refusing what they do not run, and decode shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pcast_jax import block, engine
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, get_preset, preset_for, tagged
from pcast_jax.sweep import SweepSpec
from pcast_jax.workloads import SinkWorkload, make_instance

# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


def test_split_and_f16_fields_keep_the_default_fingerprint_and_names():
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"
    d = KernelConfig(scale=256.0).to_dict()
    assert (d["kv_splits"], d["split_layout"], d["f16_round_keys"], d["v_channel_max"]) == (1, "contiguous", 0, 0.0)
    assert KernelConfig(scale=256.0, order="reverse").name == "rev_s256"
    assert KernelConfig(kv_splits=8).name == "fwd_s1_split8"
    assert KernelConfig(kv_splits=8, split_layout="strided").name == "fwd_s1_split8s"
    cfg = get_preset("trtllm_xqa_multiblock")
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["kv_splits"] == 6  # XQA_DECODE_LAUNCH


def test_fields_normalise_where_they_do_not_act():
    assert KernelConfig(split_layout="strided") == KernelConfig()  # one split: no layout
    assert KernelConfig(f16_round_keys=32, v_channel_max=2.25) == KernelConfig()  # FP32 accumulator
    assert KernelConfig(accumulator="f16", f16_round_keys=64) == KernelConfig(accumulator="f16")
    with pytest.raises(PcastError, match="f16_round_keys=48 must divide block_kv=64"):
        KernelConfig(accumulator="f16", f16_round_keys=48)
    with pytest.raises(PcastError, match="kv_splits"):
        KernelConfig(kv_splits=0)
    with pytest.raises(PcastError, match="split_layout"):
        KernelConfig(kv_splits=2, split_layout="zigzag")
    with pytest.raises(PcastError, match="v_channel_max"):
        KernelConfig(accumulator="f16", v_channel_max=-1.0)


def test_tiles_resolve_from_head_dim():
    assert get_preset("fa3").block_kv == 224 and preset_for("fa3", 128) == get_preset("fa3")
    assert preset_for("fa3", 64).block_kv == 160 and preset_for("fa3", 64).name == "fa3"  # the name passed
    assert preset_for("fa3", 256).block_kv == 128
    assert preset_for("flashinfer_sm90", 64).block_kv == 128
    assert preset_for("flashinfer_sm90", 128).block_kv == 192
    assert preset_for("trtllm_xqa", 64) == get_preset("trtllm_xqa")  # no table: unchanged


# --------------------------------------------------------------------------------------------
# Split-KV
# --------------------------------------------------------------------------------------------


def test_split_schedule():
    fwd = KernelConfig(kv_splits=3)
    np.testing.assert_array_equal(block.split_schedule(7, fwd), [[0, 1, 2], [3, 4, 5], [6, 7, 7]])
    np.testing.assert_array_equal(block.split_schedule(7, fwd.replace(order="reverse")),
                                  [[2, 1, 0], [5, 4, 3], [6, 7, 7]])
    strided = fwd.replace(split_layout="strided")
    np.testing.assert_array_equal(block.split_schedule(7, strided), [[0, 3, 6], [1, 4, 7], [2, 5, 7]])
    np.testing.assert_array_equal(block.split_schedule(2, KernelConfig(kv_splits=4)), [[0], [1], [2], [2]])
    np.testing.assert_array_equal(block.split_schedule(5, KernelConfig()), [[0, 1, 2, 3, 4]])


def test_one_split_equals_the_plain_run_bit_for_bit():
    inst = make_instance(jax.random.key(3), SinkWorkload(n=1000, q_len=8, d=16), 7.0)
    cfg = get_preset("rev_s256")
    a = engine.attention(inst.scores, inst.v, cfg, implementation="scan")
    b = engine.attention(inst.scores, inst.v, cfg.replace(kv_splits=1, split_layout="strided"), implementation="scan")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_splits_fast_equals_scan_and_weights(layout):
    inst = make_instance(jax.random.key(4), SinkWorkload(n=1000, q_len=8, d=16), 7.0)
    cfg = get_preset("fwd_s1").replace(kv_splits=5, split_layout=layout)
    mask = ~np.arange(1000).__lt__(4)
    a = engine.attention(inst.scores, inst.v, cfg, implementation="scan", count_mask=mask)
    b = engine.attention(inst.scores, inst.v, cfg, implementation="xla", count_mask=mask)
    w = engine.weights_and_stats(inst.scores, cfg, count_mask=mask)
    np.testing.assert_array_equal(np.asarray(a.n_zeroed), np.asarray(b.n_zeroed))
    np.testing.assert_array_equal(np.asarray(a.n_zeroed), np.asarray(w.n_zeroed))
    np.testing.assert_allclose(np.asarray(b.out), np.asarray(a.out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(w.weights @ inst.v), np.asarray(a.out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(w.zeroed_mass), np.asarray(a.zeroed_mass), atol=1e-7)


def test_multiblock_decode_relieves_the_forward_collapse():
    """Only the split holding the sink block runs under the sink's max: most rows' P survive."""
    inst = make_instance(jax.random.key(5), SinkWorkload(n=4096, q_len=4, d=16), 7.0)
    mask = np.arange(4096) >= 4
    one = engine.attention(inst.scores, inst.v, "trtllm_xqa", count_mask=mask)
    fwd1 = engine.attention(inst.scores, inst.v, "fwd_s1", count_mask=mask)
    multi = engine.attention(inst.scores, inst.v, get_preset("fwd_s1").replace(kv_splits=8, split_layout="strided"),
                             count_mask=mask)
    assert int(jnp.sum(multi.n_zeroed)) < 0.5 * int(jnp.sum(fwd1.n_zeroed))
    assert int(jnp.sum(engine.attention(inst.scores, inst.v, "trtllm_xqa_multiblock", count_mask=mask).n_zeroed)) \
        <= int(jnp.sum(one.n_zeroed))


def test_decode_sweep_point_runs():
    """q_len = 1 at N = 131072, the sink at position 0: a first-class sweep point."""
    from pcast_jax.sweep import run_sweep

    spec = SweepSpec(configs=("fwd_s1", "trtllm_xqa_multiblock"), deltas=(7.0,), ns=(131072,), seeds=1, q_len=1,
                     d=16, expected_mse=False)
    res = run_sweep(spec, progress=False)
    z1 = float(np.mean(res.get("frac_zeroed", config="fwd_s1", n=131072, delta=7.0)))
    zm = float(np.mean(res.get("frac_zeroed", config="trtllm_xqa_multiblock", n=131072, delta=7.0)))
    assert np.isfinite(res.get("mse", config="trtllm_xqa_multiblock", n=131072, delta=7.0)).all()
    assert 0 <= zm < z1


# --------------------------------------------------------------------------------------------
# SageAttention2++: per-channel V range, f16 per 32-key MMA, a barrier outside kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
def test_sageattn2pp_is_finite_at_any_v_scale(engine_name):
    cfg = get_preset("sageattn2pp")
    old = cfg.replace(f16_round_keys=0, v_channel_max=0.0)
    flat = jnp.zeros((2, 512))
    v = jnp.full((512, 8), 2.3)
    assert bool(jnp.all(jnp.isfinite(engine.attention(flat, v, cfg, implementation=engine_name).out)))
    with pytest.raises(PcastError, match="overflowed"):  # has teeth: without the V scale the f16 sum overflows
        engine.attention(flat, v, old, implementation=engine_name)  # (an eager call names it instead of returning inf)
    inst = make_instance(jax.random.key(6), SinkWorkload(n=2048, q_len=8, d=16, sigma_v=30.0), 7.0)
    out = engine.attention(inst.scores, inst.v, cfg, implementation=engine_name).out
    ref = engine.reference_attention(inst.scores, inst.v)
    mse = float(jnp.mean((out - ref) ** 2))
    base = float(jnp.mean((engine.attention(inst.scores, inst.v, "sageattn2").out - ref) ** 2))
    assert np.isfinite(mse) and mse < 2 * base + 1e-3 * 30.0**2 * 2.0**-22


def test_sageattn2pp_rounds_per_32_keys():
    """Two f16 roundings per 64-key block give a (slightly) different output than one."""
    inst = make_instance(jax.random.key(8), SinkWorkload(n=1024, q_len=8, d=16), 5.0)
    cfg = get_preset("sageattn2pp")
    a = engine.attention(inst.scores, inst.v, cfg).out
    b = engine.attention(inst.scores, inst.v, cfg.replace(f16_round_keys=0)).out
    assert float(jnp.max(jnp.abs(a - b))) > 0


_HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
def test_f16_round_trip_survives_gpu_lowering(engine_name):
    """The engine's f32 → f16 → f32 chain sits behind an optimization barrier in the CUDA lowering."""
    s = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    v = jax.ShapeDtypeStruct((256, 16), jnp.float32)

    def f(scores, values):
        return engine.attention(scores, values, "sageattn2pp", implementation=engine_name).out

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=_HOPPER)):
        lowered = jax.jit(f).trace(s, v).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    to_f16 = re.findall(r"stablehlo\.convert.*-> tensor<[^>]*xf16>", text)
    barriers = re.findall(r"stablehlo\.optimization_barrier[^\n]*xf16>", text)
    assert to_f16 and barriers, "the f16 round trip is missing or unguarded"
    assert len(barriers) >= 1


def test_kernels_refuse_what_they_do_not_run():
    q = jnp.zeros((1, 1, 64, 128), jnp.float8_e4m3fn)
    kv = jnp.zeros((1, 1, 256, 128), jnp.float8_e4m3fn)
    cfg = get_preset("sageattn2pp").replace(block_kv=128, f16_round_keys=16)
    with pytest.raises(PcastError, match="f16_round_keys=16"):
        pk.fp8_attention(q, kv, kv, config=cfg, implementation="triton", interpret=True)
    cfg = get_preset("fa3").replace(mma_acc_bits=14)
    with pytest.raises(PcastError, match="mma_acc_bits=14"):
        pk.fp8_attention(q, kv, kv, config=cfg, implementation="triton", interpret=True)


def test_every_kernel_preset_cites_a_tile():
    assert {c.block_kv for c in tagged("table3").values()} >= {64, 128, 192, 224}
    assert PRESETS["trtllm_xqa_multiblock"].split_layout == "strided"
    assert PRESETS["fa3_splitkv"].split_layout == "contiguous"


def test_xqa_nb_sub_seq_follows_the_sm90_launcher():
    """nbSubSeq = min(max(1, round(⌊3·SMs / (batch·KV heads)⌋ · 0.25)), ⌈N / 64⌉), XQA_NB_SUB_SEQ first."""
    from pcast_jax.presets import XQA_DECODE_LAUNCH, xqa_nb_sub_seq

    def f(batch, heads=8, sms=132, n=4096, env=None):
        return xqa_nb_sub_seq(batch=batch, nb_k_heads=heads, sms=sms, max_seq_len=n, env=env)

    assert [f(b) for b in (1, 2, 3, 4, 8, 16)] == [12, 6, 4, 3, 2, 1]  # 396 // 8 = 49 → 12.25 → 12, …
    assert f(1, heads=22) == 5  # 396 // 22 = 18 → 4.5 rounds away from zero (banker's rounding would give 4)
    assert f(1, heads=1, n=1 << 20) == 99 and f(1, heads=1) == 64 and f(1, heads=1, n=200) == 4  # ⌈N / 64⌉ caps it
    assert f(16, env=7) == 7 and f(16, env=0) == 1  # the override, unless ≤ 0
    assert get_preset("trtllm_xqa_multiblock").kv_splits == xqa_nb_sub_seq(**XQA_DECODE_LAUNCH) == 6
    with pytest.raises(PcastError, match="batch"):
        f(0)


#: KV tiles as the kernels' sources give them at head dim 128 (cited in pcast_jax/config.py):
#: hpc-ops kTileN (prefill/warp_spec_with_kvcache_fp8_dim128.cu), SageAttention2 SM90 CTA_K
#: (qk_int_sv_f8_cuda_sm90.cu), SageAttention2++'s SM89 f16 kernel CTA_K, FA4's FwdConfig(128, 128).
SOURCE_TILES = {"hpc_ops": 128, "hpc_ops_prior": 128, "sageattn2": 128, "sageattn2pp": 64, "fa4": 128,
                "fa3": 224, "flashinfer_sm90": 192, "trtllm_xqa": 64}


@pytest.mark.parametrize("name", list(SOURCE_TILES))
def test_preset_tiles_are_the_sources(name):
    assert get_preset(name).block_kv == SOURCE_TILES[name]


def test_forward_kernels_do_not_depend_on_their_tile_when_the_sinks_come_first():
    """Forward order with the sinks in the first block: every block after it sees the sinks' max, so
    the P-cast (and the zeroed count) does not depend on B: hpc_ops at its 128-key tile and at the 64
    the presets used to assume agree."""
    inst = make_instance(jax.random.key(3), SinkWorkload(n=1024, q_len=4, d=8), 10.0)
    cfg = get_preset("hpc_ops")
    a = engine.attention(inst.scores, inst.v, cfg, count_mask=~inst.is_sink)
    b = engine.attention(inst.scores, inst.v, cfg.replace(block_kv=64), count_mask=~inst.is_sink)
    np.testing.assert_array_equal(np.asarray(a.n_zeroed), np.asarray(b.n_zeroed))
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(b.out), rtol=1e-5, atol=1e-7)
