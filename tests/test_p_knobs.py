"""P-precision knobs beyond a scale: P against the block's own max, INT8 / UINT8 P, the FP16 softmax.

Each held to the independent oracle (``tests/oracle.py`` implements ``p_offset``, the integer formats and
the float16 softmax from their description) in both engines, through both Pallas kernels in interpret
mode where the kernels run them, and the diffuse-row closed form of ``theory.py`` held to simulation.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.workloads import sink_qkv
from pcast_jax import engine, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, tagged

import oracle

Q, N, D = 8, 300, 16
OUT_RTOL = 3e-6

#: Each new value meets each scale mode, order, split-KV, causal, a learned-sink placement and the f16
#: accumulator at least once.
GRID = [
    KernelConfig(p_offset="block_max", scale=3.0, kv_splits=2, split_layout="strided"),
    KernelConfig(p_offset="block_max", scale_mode="exponent", scale=256.0, order="reverse", causal=True),
    KernelConfig(p_offset="block_max", scale_mode="dynamic", accumulator="f16", sink_mode="block_max"),
    KernelConfig(p_offset="row_lse", p_format="uint8", scale=256.0, causal=True),
    KernelConfig(p_offset="row_lse", p_format="e4m3", scale=448.0, block_kv=32),
    KernelConfig(p_format="int8", scale=100.0, order="reverse"),
    KernelConfig(p_format="uint8", scale_mode="dynamic", block_kv=128),
    KernelConfig(softmax="f16", scale=200.0, order="reverse"),
    KernelConfig(softmax="f16", scale_mode="exponent", scale=256.0, kv_splits=3),
    KernelConfig(softmax="f16", scale_mode="dynamic", p_offset="block_max", sink_mode="init_max"),
]


def _instance(delta: float = 9.0):
    rng = np.random.default_rng(7)
    return oracle.sink_scores(rng, q=Q, n=N, d=D, delta=delta)


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: c.name)
def test_each_knob_matches_the_oracle_in_both_engines(cfg):
    s, v, mask = _instance()
    sink = None if cfg.sink_mode == "epilogue" and cfg.p_offset != "row_lse" else 6.5
    ref = oracle.attention(s, v, count_mask=mask, sink_logit=sink, **oracle.config_kwargs(cfg))
    for impl in engine.IMPLEMENTATIONS:
        res = engine.attention(s, v, cfg, implementation=impl, count_mask=mask, sink_logit=sink)
        out = np.asarray(res.out, np.float64)
        tol = OUT_RTOL * np.max(np.abs(ref.out)) + ref.out_slack
        assert not np.any(np.abs(out - ref.out) > tol), (impl, np.max(np.abs(out - ref.out) - tol))
        assert np.all(np.abs(np.asarray(res.n_zeroed) - ref.n_zeroed) <= ref.zeroed_slack), impl
        np.testing.assert_allclose(np.asarray(res.row_sum), ref.row_sum, rtol=1e-5, err_msg=impl)
        assert np.all(np.abs(np.asarray(res.zeroed_mass, np.float64) - ref.zeroed_mass) <= ref.mass_tolerance()), impl


def test_the_block_max_control_zeroes_nothing_outside_the_sinks_block():
    """P against each block's own max: a sink in block 0 zeroes the keys of its own block at S = 1 and no
    other key, where the running max zeroes nearly every non-sink key (Δ = 12)."""
    s, v, mask = _instance(delta=12.0)
    running = KernelConfig(scale=1.0, block_kv=64)
    local = running.replace(p_offset="block_max")
    zr = np.asarray(engine.attention(s, v, running, count_mask=mask).n_zeroed)
    keep = mask.copy()
    keep[:64] = False  # the sink's block
    zl_out = np.asarray(engine.attention(s, v, local, count_mask=keep).n_zeroed)
    assert zr.min() > 0.9 * (N - 4) and zl_out.max() == 0
    control = PRESETS["tpu_ragged_paged_fp8p"]
    keep[:control.block_kv] = False
    assert int(np.asarray(engine.attention(s, v, control, count_mask=keep).n_zeroed).max()) == 0


def test_the_diffuse_row_closed_form_matches_simulation():
    """A row of N equal logits, P normalised before the cast: output = g(N, S)·mean(V), 0 from N = ⌈S/r⌉."""
    ns = np.array([16, 100, 253, 255, 300, 511, 512, 600, 1000])
    rows = np.where(np.arange(1000)[None, :] < ns[:, None], 0.25, -np.inf).astype(np.float32)
    v = np.random.default_rng(3).standard_normal((1000, 4)).astype(np.float32)
    mean_v = np.stack([v[:n].mean(axis=0) for n in ns])
    for name, vanish in (("tensorrt_int8", 254), ("litert_uint8", 512)):
        cfg = PRESETS[name]
        assert int(theory.diffuse_row_vanishing_length(cfg.scale, fmt=cfg.p_format)) == vanish
        gain = np.asarray(theory.diffuse_row_gain(ns, cfg.scale, fmt=cfg.p_format))
        assert np.all((gain == 0) == (ns >= vanish)), name
        out = np.asarray(engine.attention(rows, v, cfg).out)
        np.testing.assert_allclose(out, gain[:, None] * mean_v, rtol=1e-5, atol=1e-6, err_msg=name)
        # the unnormalised online P of a fused kernel is 1 for every key: g(1, S) (255/256 for UINT8 at S = 256,
        # which saturates: a scale calibrated on the normalised P clips the online one)
        online = np.asarray(engine.attention(rows, v, cfg.replace(p_offset="running_max")).out)
        g1 = float(theory.diffuse_row_gain(1, cfg.scale, fmt=cfg.p_format))
        np.testing.assert_allclose(online, g1 * mean_v, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", pk.BACKENDS)
def test_both_kernels_run_the_block_max_and_f16_softmax_knobs(backend):
    """The kernels take P against the block's max and hold P in float16 through block.py, as the simulator."""
    w = sink_qkv(jax.random.key(5), deltas=(9.0,), heads=1, kv_heads=1, q_len=64, n=256, head_dim=64)
    kwargs = {"scale": 8.0 / 8.0, "q_descale": 0.5, "k_descale": 0.25, "v_descale": 2.0}
    for cfg in (PRESETS["tpu_ragged_paged_fp8p"].replace(order="reverse", scale=1.0),
                KernelConfig(softmax="f16", scale=200.0, scale_mode="multiply", block_kv=64)):
        out, stats = pk.fp8_attention(w.q, w.k, w.v, config=cfg, implementation=backend, interpret=True,
                                      return_stats=True, **kwargs)
        ref = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg, **kwargs)
        np.testing.assert_array_equal(np.asarray(stats.n_zeroed), np.asarray(ref.n_zeroed))
        chex.assert_trees_all_close(out, ref.out, rtol=2e-6, atol=2e-6 * 2.0 * 448)


@pytest.mark.parametrize("backend", pk.BACKENDS)
def test_kernels_refuse_what_they_do_not_run_naming_why(backend):
    w = sink_qkv(jax.random.key(5), deltas=(9.0,), heads=1, kv_heads=1, q_len=64, n=128, head_dim=64)
    with pytest.raises(PcastError, match=r"p_offset='row_lse' not supported by the kernels: .* second pass"):
        pk.fp8_attention(w.q, w.k, w.v, config=KernelConfig(p_offset="row_lse", scale=448.0),
                         implementation=backend, interpret=True)
    for name in tagged("p_knobs"):
        if PRESETS[name].p_format != "e4m3":
            with pytest.raises(PcastError, match=r"p_format='u?int8' not supported by the kernels"):
                pk.fp8_attention(w.q, w.k, w.v, config=name, implementation=backend, interpret=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"p_offset": "local"}, r"p_offset='local' is not one of"),
    ({"softmax": "bf16"}, r"softmax='bf16' is not one of"),
    ({"p_format": "int8", "overflow": "nan"}, r"overflow='nan': p_format='int8' is an integer format"),
    ({"p_offset": "block_max", "rescale_threshold": 8.0}, r"p_offset='block_max' .* rescale_threshold=8 must be 0"),
    ({"p_offset": "row_lse", "scale_mode": "exponent"}, r"p_offset='row_lse' .* needs scale_mode='multiply'"),
    ({"p_offset": "row_lse", "kv_splits": 2}, r"p_offset='row_lse' .* needs kv_splits=1"),
    ({"p_offset": "row_lse", "softmax": "f16"}, r"p_offset='row_lse' .* needs softmax='f32'"),
    ({"softmax": "f16", "rescale_threshold": 8.0}, r"softmax='f16' with rescale_threshold=8"),
    ({"softmax": "f16", "scale": 2.0**17}, r"scale=131072.0 with softmax='f16': .* at most 65504"),
])
def test_bad_knob_values_name_the_field(kwargs, match):
    with pytest.raises(PcastError, match=match):
        KernelConfig(**kwargs)


def test_new_fields_keep_old_dicts_and_round_trip():
    """A config that sets neither knob has the dict it had before they existed; set, they round-trip."""
    assert "p_offset" not in KernelConfig().to_dict() and "softmax" not in KernelConfig().to_dict()
    for name in tagged("p_knobs"):
        cfg = PRESETS[name]
        assert KernelConfig.from_dict(cfg.to_dict()) == cfg
        assert KernelConfig.from_string(cfg.to_string()) == cfg
    cfg = KernelConfig(softmax="f16", p_offset="block_max")
    assert cfg.name == "fwd_s1_blockmax_f16softmax" and KernelConfig.from_string(cfg.to_string()) == cfg
    assert KernelConfig(p_offset="row_lse", sink_mode="init_max").sink_mode == "epilogue"  # a softmax column
