"""The simulator: xla implementation ≡ scan implementation on every preset, W·V ≡ fast, semantics, Tables 1 and 2.

Tolerances: the two engines compute identical cast inputs (so identical zeroed counts) and differ
only in the order FP32 products and sums are rounded (the α chain is one factor exp(m_b − m_final)
per block in the xla implementation, a running product in the scan implementation). Measured: |Δout| ≤ 2e-6·max|out|
and |Δℓ|/ℓ ≤ 4e-7 on the workloads below; the asserted bounds are 1e-5.

Most tests share one batch shape (6 instances × 8 queries × N = 1000, d = 32) and one compiled
function per (config semantics, engine), so the suite compiles each only once.
"""

import functools
import math
from functools import partial

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pcast_jax import block, engine, metrics, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, resolve
from pcast_jax.sweep import SweepSpec, run_sweep
from pcast_jax.sweep.spec import CONFIG_GROUP
from pcast_jax.workloads import SinkWorkload, make_instance

from cases import FULL, distinct_configs, distinct_programs, shared_program

FP32_RTOL = 1e-5
E4M3_REL = 2.0**-4  # largest relative error of a round-to-nearest cast to 3 mantissa bits (normal range)
F16_REL = 2.0**-11  # same for float16 (10 mantissa bits)
N, Q_LEN, D = 1000, 8, 32  # N is a multiple of neither 64 nor 128: padded keys


#: One preset per compiled program: a test of how the operations compose needs one of each.
PROGRAMS = distinct_programs(PRESETS)
F32_ACC_PROGRAMS = distinct_programs({n: c for n, c in PRESETS.items() if c.accumulator == "f32"})
#: Presets whose P elements are E4M3 (the E4M3 error bounds below apply; E2M1 elements do not obey them)
E4M3_F32_ACC_PRESETS = distinct_configs({n: c for n, c in PRESETS.items()
                                         if c.accumulator == "f32" and c.p_format in ("e4m3", "mxfp8")})


def _batch(deltas=(3.0, 7.0, 11.0), seeds=(0, 1), *, n=N, q_len=Q_LEN, d=D, sink_positions=None):
    """Sink instances stacked over (Δ, seed): scores (I, q, N), v (I, N, d), non-sink mask (N,)."""
    w = SinkWorkload(n=n, q_len=q_len, d=d, sink_positions=sink_positions)
    insts = [make_instance(jax.random.PRNGKey(s), w, dl) for dl in deltas for s in seeds]
    return jnp.stack([i.scores for i in insts]), jnp.stack([i.v for i in insts]), ~insts[0].is_sink


def _vmapped(cfg, engine_name, q_offset):
    def one(scores, v, count_mask):
        return engine.attention(scores, v, cfg, implementation=engine_name, count_mask=count_mask, q_offset=q_offset)

    return jax.vmap(one, in_axes=(0, 0, None))


_compiled = shared_program(_vmapped)


@functools.lru_cache(maxsize=None)
def _compiled_weights(cfg, q_offset):
    return jax.jit(jax.vmap(partial(engine.effective_weights, config=cfg, q_offset=q_offset)))


def _run(cfg, engine_name, scores, v, count_mask=None, q_offset=None):
    mask = jnp.ones(scores.shape[-1], bool) if count_mask is None else count_mask
    return _compiled(resolve(cfg), engine_name, q_offset)(scores, v, mask)


def _weights(cfg, scores, q_offset=None):
    return _compiled_weights(resolve(cfg), q_offset)(scores)


def _mix(w, v):
    return jnp.einsum("iqn,ind->iqd", w, v, precision="highest")


def assert_engines_agree(fast, scan, f16_bound=None):
    """Equal to FP32 rounding; zeroed and counted positions identical.

    ``f16_bound``: for an f16 accumulator, the most one f16 ulp per block product can move each
    output. The engines form each block's P8·V with FP32 sums in different orders, so a product
    within FP32 rounding of an f16 midpoint may round to either neighbour (seen on some CPUs).
    """
    scale = float(jnp.max(jnp.abs(scan.out)))
    if f16_bound is None:
        chex.assert_trees_all_close(fast.out, scan.out, atol=FP32_RTOL * scale, rtol=FP32_RTOL)
    else:
        diff = jnp.abs(fast.out - scan.out)
        assert bool(jnp.all(diff <= FP32_RTOL * scale + f16_bound)), float(jnp.max(diff - f16_bound))
    chex.assert_trees_all_close(fast.row_sum, scan.row_sum, atol=0.0, rtol=FP32_RTOL)
    chex.assert_trees_all_close(fast.zeroed_mass, scan.zeroed_mass, atol=1e-7, rtol=FP32_RTOL)
    np.testing.assert_array_equal(np.asarray(fast.n_zeroed), np.asarray(scan.n_zeroed))
    np.testing.assert_array_equal(np.asarray(fast.n_counted), np.asarray(scan.n_counted))
    assert np.all(np.isfinite(np.asarray(fast.out)))


# --------------------------------------------------------------------------------------------
# xla ≡ scan
# --------------------------------------------------------------------------------------------


def test_one_preset_per_program_stands_for_every_preset():
    """The tests over :data:`PROGRAMS` run once per compiled program; this is what makes that cover every preset."""
    covered = [name for param in PROGRAMS for name in param.id.split("=")]
    assert sorted(covered) == sorted(PRESETS)
    assert len(PROGRAMS) == len({c.program() for c in PRESETS.values()}) >= 9


def test_presets_that_differ_only_in_numbers_share_a_program():
    """S, τ and the V channel max are the program's numbers (KernelConfig.program), so e.g. the paper's
    forward configs at S = 1, 256 and 448 compile one program; zero or non-zero τ and V channel max, the
    scale mode and every other field select another."""
    programs = {cfg.program() for cfg in PRESETS.values()}
    assert len(programs) < len(PRESETS)
    assert PRESETS["fwd_s1"].program() == PRESETS["fwd_s448"].program() == PRESETS["fwd_s256"].program()
    assert PRESETS["cudnn_fp8"].program() == PRESETS["cudnn_fp8_s32"].program()
    assert PRESETS["cudnn_fp8"].program() != PRESETS["cudnn_fp8_tau0"].program()  # τ = 0: no lag at all
    assert PRESETS["fa3"].program() != PRESETS["fwd_s256"].program()  # exponent vs multiply mode
    sage = PRESETS["sageattn2pp"]
    assert sage.program() != sage.replace(v_channel_max=0.0).program()


@pytest.mark.parametrize("name", ["fa3", "cudnn_fp8_s32", "sageattn2pp"])
def test_numbers_bound_as_arguments_give_the_same_bits(name):
    """One program for every config of a program computes each config's numbers bit for bit as the
    config itself does (its numbers are opaque to XLA either way, engine.bound): exponent mode at
    S = 256, cuDNN's τ with S·2^-τ and a learned sink as initial max, the V channel scale."""
    cfg = PRESETS[name]
    scores, v, mask = _batch(deltas=(9.0,), seeds=(0,))
    sink = jnp.float32(2.5)
    for impl in engine.IMPLEMENTATIONS:
        own = jax.jit(lambda s, v: engine.attention(s, v, cfg, implementation=impl, count_mask=mask,
                                                    sink_logit=sink))(scores[0], v[0])
        bound = jax.jit(lambda s, v, n: engine.attention(s, v, cfg.program().bind(n), implementation=impl,
                                                         count_mask=mask, sink_logit=sink))(scores[0], v[0],
                                                                                            cfg.numbers())
        chex.assert_trees_all_equal(own, bound)
        assert int(jnp.sum(own.n_zeroed)) > 0


def test_a_bound_config_keeps_its_numbers_apart():
    """A BoundConfig's numeric fields are NaN (reading one instead of a bound number computes NaN, never
    another config's value); bind takes only a program; the numbers cannot be replaced or saved."""
    cfg = PRESETS["cudnn_fp8_s32"]
    bound = cfg.program().bind(cfg.numbers(), name="mine")
    assert bound.name == "mine" and math.isnan(bound.scale) and math.isnan(bound.rescale_threshold)
    assert bound.effective_scale == np.float32(cfg.effective_scale) and bound.numbers() == cfg.numbers()
    assert bound.replace(causal=True).causal and bound.replace(causal=True).numbers() == cfg.numbers()
    with pytest.raises(PcastError, match="program"):
        cfg.bind(cfg.numbers())
    with pytest.raises(PcastError, match="bound"):
        bound.replace(scale=2.0)
    with pytest.raises(PcastError, match="save"):
        bound.to_dict()
    assert bound != cfg.program().bind(cfg.numbers())  # identity: no cache keyed by it can mix numbers


@pytest.mark.parametrize("cfg", PROGRAMS)
def test_fast_equals_scan_every_program(cfg):
    """Δ = 3, 7, 11, two seeds, q_len = 8, padded N, under the causal mask: the engines' statistics equal
    (zeroed counts exactly) and the bottom-right mask counted, for one preset per compiled program (the
    others differ in numbers only). ``tests/test_oracle.py`` and the conformance matrix hold both engines to
    the oracle for every preset, statistics included."""
    scores, v, mask = _batch()
    c = cfg.replace(causal=True)
    fast = _run(c, "xla", scores, v, mask)
    scan = _run(c, "scan", scores, v, mask)
    f16_bound = None
    if c.accumulator == "f16":  # one f16 ulp (2^-10 relative) of each block's |P8|·|V|, weighted
        f16_bound = 2 * F16_REL * _mix(_weights(c.replace(accumulator="f32"), scores), jnp.abs(v))
    assert_engines_agree(fast, scan, f16_bound)
    assert int(jnp.sum(fast.n_zeroed)) > 0  # the comparison of zeroed counts is not vacuous
    visible = np.arange(N)[None, :] <= (np.arange(Q_LEN)[:, None] + (N - Q_LEN))
    expected = np.sum(visible & np.asarray(mask), axis=-1)  # bottom-right aligned causal mask
    np.testing.assert_array_equal(np.asarray(fast.n_counted), np.broadcast_to(expected, fast.n_counted.shape))


@pytest.mark.parametrize("name", ["rev_s1", "fa3", "dynamic_pow2"])
def test_fast_equals_scan_single_query_and_mid_sequence_sink(name):
    """q_len = 1 and a fifth sink in the middle of the sequence (multi-sink pattern), N = 777."""
    scores, v, mask = _batch((6.0, 9.0), (3, 4, 5), n=777, q_len=1, d=16, sink_positions=(0, 1, 2, 3, 400))
    assert_engines_agree(_run(name, "xla", scores, v, mask), _run(name, "scan", scores, v, mask))


@pytest.mark.parametrize("name", ["hpc_ops", "fa3"])
def test_fast_equals_scan_fp8_qkv(name):
    """The production path: Q, K, V quantized per tensor to E4M3 (``attention_qkv``)."""
    cfg = PRESETS[name].replace(qkv="e4m3")
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(7), 3)
    d, n, q_len = 32, 500, 6
    u = jax.random.normal(kq, (d,))
    q = u + 0.5 * jax.random.normal(kk, (q_len, d))
    k = jax.random.normal(kv, (n, d)).at[:4].add(3.0 * u)  # four keys aligned with the queries: sinks
    v = jax.random.normal(jax.random.PRNGKey(8), (n, d))
    outs = []
    for c in (cfg, cfg.replace(causal=True)):
        fast = jax.jit(partial(engine.attention_qkv, config=c, implementation="xla"))(q, k, v)
        scan = jax.jit(partial(engine.attention_qkv, config=c, implementation="scan"))(q, k, v)
        assert_engines_agree(fast, scan)
        assert int(jnp.sum(fast.n_zeroed)) > 0
        outs.append(fast.out)
    exact_qkv = jax.jit(partial(engine.attention_qkv, config=PRESETS[name]))(q, k, v)
    assert float(jnp.max(jnp.abs(exact_qkv.out - outs[0]))) > 0  # Q/K/V were quantized


def test_attention_qkv_honours_per_head_scales():
    """qkv_granularity="head": one E4M3 scale per (batch, head), as the model hook quantizes."""
    from pcast_jax import nn

    b, h, t, n, d = 2, 3, 5, 256, 16
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    spread = jnp.array([1e-4, 1.0, 40.0])[None, :, None, None]  # heads of very different ranges
    q = jax.random.normal(kq, (b, h, t, d)) * spread
    k = jax.random.normal(kk, (b, h, n, d)).at[:, :, :2].add(4.0) * spread
    v = jax.random.normal(kv, (b, h, n, d)) * spread
    head = PRESETS["rev_s256"].replace(qkv="e4m3", qkv_granularity="head")
    tensor = head.replace(qkv_granularity="tensor")
    x8, dx = engine.quantize_qkv(v, "head")
    assert dx.shape == (b, h, 1, 1)
    # the scale of head (1, 2) is its own amax / 448, its values E4M3 under it (NumPy / ml_dtypes, not the package)
    vh = np.asarray(v[1, 2], np.float64)
    np.testing.assert_allclose(dx[1, 2, 0, 0], np.max(np.abs(vh)) / 448.0, rtol=2e-7)
    want = (np.asarray(v[1, 2], np.float32) / np.float32(dx[1, 2, 0, 0])).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(x8[1, 2]), want.astype(np.float32))
    per_head = engine.attention_qkv(q, k, v, head).out
    per_tensor = engine.attention_qkv(q, k, v, tensor).out
    # the same numbers as the jax.nn-style entry point, whose per-head path the model hook uses
    hook = nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), config=head)
    np.testing.assert_allclose(per_head, jnp.swapaxes(hook, 1, 2), rtol=2e-5, atol=1e-6 * float(jnp.max(jnp.abs(v))))
    # and not the per-tensor numbers: the quiet head loses its resolution under one shared scale
    exact = engine.attention_qkv(q, k, v, PRESETS["rev_s256"]).out[:, 0]  # FP32 Q/K/V

    def err(o):
        return float(jnp.max(jnp.abs(o[:, 0] - exact)))

    assert err(per_head) < 0.1 * err(per_tensor)


# --------------------------------------------------------------------------------------------
# effective weights
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("i, cfg", [pytest.param(i, p.values[0], id=p.id) for i, p in enumerate(F32_ACC_PROGRAMS)])
def test_effective_weights_times_v_is_the_fast_output(i, cfg):
    """The weights (and ``weights_and_stats``) times V are the xla output, per compiled program: every
    other program in turn causal (``make test-full``: both)."""
    scores, v, mask = _batch()
    for c in (cfg, cfg.replace(causal=True)) if FULL else (cfg.replace(causal=bool(i % 2)),):
        w = _weights(c, scores)
        assert w.shape == scores.shape
        fast = _run(c, "xla", scores, v, mask)
        scale = float(jnp.max(jnp.abs(fast.out)))
        chex.assert_trees_all_close(_mix(w, v), fast.out, atol=FP32_RTOL * scale, rtol=FP32_RTOL)
        stats = jax.jit(jax.vmap(partial(engine.weights_and_stats, config=c, count_mask=mask)))(scores)
        np.testing.assert_array_equal(np.asarray(stats.weights), np.asarray(w))
        for field in ("row_sum", "n_zeroed", "n_counted", "zeroed_mass"):
            np.testing.assert_array_equal(np.asarray(getattr(stats, field)), np.asarray(getattr(fast, field)))


@pytest.mark.parametrize("part", [0, 1], ids=["groups-even", "groups-odd"])
def test_evaluate_fast_equals_scan(part):
    """metrics.evaluate: the fast path ((W − P)·V, one product for all FP32-accumulator configs)
    and the scan path (kernel output minus reference output) agree; causal configs are measured
    against the causal reference. One preset per structure (the presets that differ only in S, a
    nonzero τ or a nonzero V channel max take the same paths through both; tests/test_oracle.py holds
    every preset's metrics in both engines to the oracle)."""
    inst = make_instance(jax.random.PRNGKey(0), SinkWorkload(n=N, q_len=Q_LEN, d=D), 7.0)
    structures = {}
    for cfg in (PRESETS["fwd_s256"], *PRESETS.values()):
        key = cfg.replace(scale=1.0, rescale_threshold=float(cfg.rescale_threshold > 0),
                          v_channel_max=float(cfg.v_channel_max > 0))
        structures.setdefault(key, cfg)
    # every other group of the sweep's (XLA's compile time grows ~quadratically with configs per program) per
    # case, so the two halves of a halved run (tests/cases.py) take each once; the causal pair in both
    configs = tuple(structures.values())
    groups = [configs[i:i + CONFIG_GROUP] for i in range(0, len(configs), CONFIG_GROUP)][part::2]
    causal = PRESETS["fwd_s256"].replace(causal=True)
    groups.append((PRESETS["fwd_s256"], causal))

    def run(implementation):
        outs = [jax.jit(partial(metrics.evaluate, configs=g, implementation=implementation))(inst) for g in groups]
        return {k: jnp.concatenate([o[k] for o in outs]) for k in outs[0]}

    fast, scan = run("xla"), run("scan")
    np.testing.assert_array_equal(np.asarray(fast["frac_zeroed"]), np.asarray(scan["frac_zeroed"]))
    np.testing.assert_allclose(np.asarray(fast["zeroed_mass"]), np.asarray(scan["zeroed_mass"]), rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(np.asarray(fast["mse"]), np.asarray(scan["mse"]), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(fast["mse_expected"]), np.asarray(scan["mse_expected"]), rtol=1e-5)
    out = engine.attention(inst.scores, inst.v, causal, implementation="scan").out
    ref = engine.reference_attention(inst.scores, inst.v, causal=True)
    np.testing.assert_allclose(float(fast["mse"][-1]), float(jnp.mean((out - ref) ** 2)), rtol=1e-4)
    assert float(fast["mse"][-1]) != pytest.approx(float(fast["mse"][-2]), rel=1e-3)  # the same preset, not causal


def test_nonsink_mass_follows_the_configs_reference():
    """A causal config's nonsink_mass is the causal FP32 softmax's (float64 here), not the full one's."""
    inst = make_instance(jax.random.PRNGKey(1), SinkWorkload(n=N, q_len=Q_LEN, d=D), 3.0)
    configs = (PRESETS["fwd_s256"], PRESETS["fwd_s256"].replace(causal=True))
    got = np.asarray(metrics.evaluate(inst, configs, sampled=False)["nonsink_mass"], np.float64)
    s = np.asarray(inst.scores, np.float64)
    sink = np.asarray(inst.is_sink)
    visible = np.arange(N)[None, :] <= np.arange(Q_LEN)[:, None] + (N - Q_LEN)  # bottom-right aligned
    for i, mask in enumerate((np.ones_like(visible), visible)):
        z = np.where(mask, s, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[i], np.mean(np.sum(np.where(sink, 0.0, p), -1)), rtol=1e-5)
    assert got[1] < got[0] * (1 - 1e-4)  # the causal rows see fewer non-sink keys


# --------------------------------------------------------------------------------------------
# Semantics
# --------------------------------------------------------------------------------------------


def test_huge_delta_forward_s1_zeroes_every_non_sink():
    """Δ = 30: every non-sink P = exp(s − Δ − z) is far below 2^-10 once block 0 sets the max."""
    scores, v, mask = _batch((30.0,), range(6))
    for eng in ("xla", "scan"):
        r = _run("fwd_s1", eng, scores, v, mask)
        np.testing.assert_array_equal(np.asarray(r.n_zeroed), np.asarray(r.n_counted))
        np.testing.assert_array_equal(np.asarray(r.n_counted), N - 4)
    # Reverse order casts the non-sinks before the sink block is seen: all 60 non-sinks of the sink
    # block vanish, elsewhere only P below e^-6.93 of the non-sink max (Thm. 4: ~0.1 %).
    in_sink_block = mask & (jnp.arange(N) < 64)
    np.testing.assert_array_equal(np.asarray(_run("rev_s1", "xla", scores, v, in_sink_block).n_zeroed), 60)
    rev = _run("rev_s1", "xla", scores, v, mask & ~in_sink_block)
    assert float(jnp.sum(rev.n_zeroed)) / float(jnp.sum(rev.n_counted)) < 0.01


@pytest.mark.parametrize("name", ["rev_s256", "fa3", "flashinfer_sm90"])
def test_reverse_order_zeroes_nothing_before_the_sink_block(name):
    """Reverse order, S ≥ 256, Δ = 7: blocks before the sink block see only the non-sink max, so no P
    underflows there (Thm. 4: ~1e-13 per value). Inside the sink block a rare non-sink P far below
    the sink max can still cast to zero (measured at N = 4096: 1 (rev_s256) and 13 (fa3) of 1M)."""
    cfg = PRESETS[name]
    scores, v, mask = _batch((7.0,), range(6))
    in_sink_block = mask & (jnp.arange(N) < cfg.block_kv)
    assert int(jnp.sum(_run(cfg, "xla", scores, v, mask & ~in_sink_block).n_zeroed)) == 0
    inside = _run(cfg, "xla", scores, v, in_sink_block)
    assert int(jnp.sum(inside.n_zeroed)) <= 0.01 * int(jnp.sum(inside.n_counted))
    fwd = _run(cfg.replace(order="forward"), "xla", scores, v, mask & ~in_sink_block)
    assert int(jnp.sum(fwd.n_zeroed)) > 0  # the same scale in forward order does zero some


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_multiply_and_exponent_modes_agree_for_power_of_two_scale(order):
    """S = 256 = 2^8: P·S (multiply) and exp2(z·log2e − (m·log2e − 8)) (exponent) are the same
    number up to a few FP32 ulps, so the cast zeroes the same positions. Not bit-identical by
    construction (a P·S within an ulp of 2^-10 could flip); measured identical here and on 1M
    values at N = 4096, asserted to 1e-4 of the counted positions."""
    mult = KernelConfig(order=order, scale=256.0, scale_mode="multiply")
    expo = KernelConfig(order=order, scale=256.0, scale_mode="exponent")
    scores, v, mask = _batch((7.0, 9.0, 11.0))
    rm = _run(mult, "xla", scores, v, mask)
    re = _run(expo, "xla", scores, v, mask)
    assert int(jnp.sum(rm.n_zeroed)) > 0
    assert int(jnp.sum(jnp.abs(rm.n_zeroed - re.n_zeroed))) <= 1e-4 * int(jnp.sum(rm.n_counted))
    np.testing.assert_allclose(np.asarray(re.row_sum), 256.0 * np.asarray(rm.row_sum), rtol=1e-5)
    scale = float(jnp.max(jnp.abs(rm.out)))
    np.testing.assert_allclose(np.asarray(re.out), np.asarray(rm.out), atol=1e-3 * scale)


@pytest.mark.parametrize("cfg", E4M3_F32_ACC_PRESETS)
def test_all_probabilities_representable_error_is_cast_rounding_only(cfg):
    """Scores in [−4, 0]: every P·S lies in E4M3's normal range for every preset's S, so each
    weight carries a relative error ≤ 2^-4 and |O − O_ref| ≤ 2^-4 · Σ_j P_j |v_j| per row."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(11))
    scores = jax.random.uniform(k1, (6, Q_LEN, N), minval=-4.0, maxval=0.0)
    v = jax.random.normal(k2, (6, N, D))
    r = _run(cfg, "xla", scores, v)
    assert int(jnp.sum(r.n_zeroed)) == 0
    err = jnp.abs(r.out - engine.reference_attention(scores, v))
    bound = E4M3_REL * _mix(engine.reference_probs(scores), jnp.abs(v))
    assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-6))
    assert float(jnp.max(err)) > 0  # the cast did round


@pytest.mark.parametrize("name", ["rev_s1", "fa3", "dynamic_pow2", "sageattn2pp"])
def test_fully_masked_causal_blocks_in_reverse_order_stay_finite(name):
    """q_offset = 0: row i sees keys 0..i only, so in reverse order the first 15 blocks processed are
    entirely masked (m = −inf). No NaN may appear; row 0 (one visible key, P = 1) returns v[0]."""
    cfg = PRESETS[name].replace(causal=True, order="reverse")
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    scores = 3.0 * jax.random.normal(k1, (6, Q_LEN, N))
    v = jax.random.normal(k2, (6, N, D))
    p = engine.reference_probs(scores, causal=True, q_offset=0)
    # cast error: ≤ 2^-4 relative for normal P·S, ≤ 2^-10 absolute (on P/ℓ) below that
    bound = E4M3_REL * _mix(p, jnp.abs(v)) + 2.0**-10 * _mix((p > 0).astype(jnp.float32), jnp.abs(v))
    for eng in ("xla", "scan"):
        r = _run(cfg, eng, scores, v, q_offset=0)
        for x in r:
            assert bool(jnp.all(jnp.isfinite(x))), eng
        np.testing.assert_array_equal(np.asarray(r.n_counted[0]), np.arange(1, Q_LEN + 1))
        # exactly v[0] when S·1 is an E4M3 value; S = 2^8.807 casts to 448, off by 448/2^8.807
        np.testing.assert_allclose(np.asarray(r.out[:, 0]), np.asarray(v[:, 0]), rtol=1e-3, atol=1e-6)
        err = jnp.abs(r.out - engine.reference_attention(scores, v, causal=True, q_offset=0))
        assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-5))
    w = _weights(cfg, scores, q_offset=0)
    assert bool(jnp.all(jnp.isfinite(w))) and bool(jnp.all(w[:, 0, 1:] == 0))


def test_f16_accumulator_differs_from_f32_by_f16_rounding_only():
    """sageattn2 with each block's P8·V rounded to float16 once: per block the error is
    ≤ 2^-11 |P8_b·V_b|, so |O16 − O32| ≤ 2^-11 Σ_j W_j |v_j| (W the effective weights, ≥ 0)."""
    # sageattn2 at SageAttention2++'s tile (SM90's CTA_K is 128, the SM89 f16 kernel's 64)
    f32 = PRESETS["sageattn2"].replace(block_kv=PRESETS["sageattn2pp"].block_kv)
    # one f16 rounding per block at V's own scale (the preset rounds per 32 keys with V scaled)
    f16 = PRESETS["sageattn2pp"].replace(f16_round_keys=0, v_channel_max=0.0)
    assert f32.replace(accumulator="f16") == f16
    scores, v, mask = _batch()
    v = jnp.clip(v, -2.25, 2.25)  # SageAttention2++ bounds V so the f16 accumulator cannot overflow
    bound = F16_REL * _mix(_weights(f32, scores), jnp.abs(v))
    for eng in ("xla", "scan"):
        r32 = _run(f32, eng, scores, v, mask)
        r16 = _run(f16, eng, scores, v, mask)
        np.testing.assert_array_equal(np.asarray(r16.n_zeroed), np.asarray(r32.n_zeroed))
        diff = jnp.abs(r16.out - r32.out)
        assert bool(jnp.all(diff <= bound * (1 + 1e-3) + 1e-6 * float(jnp.max(jnp.abs(r32.out)))))
        assert float(jnp.max(diff)) > 0  # the f16 rounding did happen


def test_dynamic_scale_never_saturates():
    """Dynamic mode picks, per row and block, the largest 2^k with max(P)·2^k ≤ 448: the cast input
    never exceeds 448 (so satfinite never clips) and the block maximum lands in (224, 448]."""
    cfg = PRESETS["dynamic_pow2"]
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    z = jnp.concatenate([
        jax.random.normal(k1, (4096, 64)) * jnp.linspace(0.1, 40.0, 4096)[:, None],
        jnp.full((1, 64), -3.0),  # every P of the block equal
        jnp.log(448.0 * 2.0 ** -jnp.arange(1, 65, dtype=jnp.float32))[None, :],  # P near 448·2^-k
    ])
    m_new = jnp.maximum(jnp.max(z, axis=-1), jax.random.normal(k2, (z.shape[0],)) + 2.0)
    p, ps, unscale = block.block_probs(z, m_new, cfg)
    row_max = jnp.max(ps, axis=-1)
    live = np.asarray(jnp.max(p, axis=-1) > 0)
    assert bool(jnp.all(row_max <= 448.0))
    assert bool(jnp.all(row_max[live] > 224.0))
    scale = jnp.max(ps / jnp.where(p > 0, p, 1.0), axis=-1)  # the 2^k applied to the block
    np.testing.assert_array_equal(np.asarray(unscale * scale)[live], 1.0)
    # end to end: with NaN-on-overflow the outputs are bit-identical to satfinite
    scores, v, mask = _batch((0.0, 7.0, 20.0))
    sat = _run(cfg, "xla", scores, v, mask)
    nan = _run(cfg.replace(overflow="nan"), "xla", scores, v, mask)
    np.testing.assert_array_equal(np.asarray(sat.out), np.asarray(nan.out))


# --------------------------------------------------------------------------------------------
# The paper's tables
# --------------------------------------------------------------------------------------------

TABLE1_DELTAS = (5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0)
#: Paper Table 1 (N = 4096, k_sink = 4, B = 64), percent.
TABLE1 = {
    ("frac_zeroed", "fwd_s1"): (22.3, 51.6, 82.0, 94.8, 99.5, 100.0, 100.0),
    ("frac_zeroed", "fwd_s256"): (0.0, 0.0, 0.0, 0.3, 2.3, 11.7, 67.9),
    ("nonsink_mass", "fwd_s1"): (88.0, 74.0, 51.7, 32.2, 13.9, 5.8, 0.8),
}
#: Cells where the paper's value is off the model's exact expectation by more than the bar,
#: with the largest deviation accepted there (pp). Non-sink mass at Δ = 8: the quadrature of
#: ``theory.non_sink_mass`` gives 30.05 %, the simulator 30.05 ± 0.12 % over 240 seeds; the paper's
#: 32.2 is the expectation at Δ ≈ 7.9 (its frac. zeroed 94.8 % also matches Δ ≈ 7.9 better).
TABLE1_KNOWN_DEVIATIONS = {("nonsink_mass", "fwd_s1", 8.0): 2.5}


@pytest.fixture(scope="module")
def table1():
    """240 seeds × 32 query rows. frac. zeroed and non-sink mass depend on the scores only, and
    the scores of a seed do not depend on d, so d = 1 gives the same numbers as d = 128, cheaply."""
    spec = SweepSpec(configs=("fwd_s1", "fwd_s256"), deltas=TABLE1_DELTAS, ns=(4096,), seeds=240,
                     q_len=32, d=1, expected_mse=False)
    return run_sweep(spec, progress=False)


def test_table1_within_two_points_of_the_paper(table1):
    """Every cell within 2 percentage points of the paper (one documented exception).

    The paper averages 12 seeds; its own cells carry a seed noise of up to ~1.3 pp (Δ = 6), so we
    compare with 240 seeds, where the noise of our estimate is ≤ 0.25 pp.
    """
    for (metric, cfg), paper in TABLE1.items():
        got = 100 * table1.mean(metric, config=cfg, n=4096)
        for delta, g, p in zip(TABLE1_DELTAS, got, paper):
            bar = TABLE1_KNOWN_DEVIATIONS.get((metric, cfg, delta), 2.0)
            assert abs(g - p) <= bar, f"{metric} {cfg} Δ={delta}: {g:.2f}% vs paper {p}%"


def test_table1_matches_the_exact_model(table1):
    """The simulator's means equal the quadratures of the same model within 4 standard errors."""
    for delta in TABLE1_DELTAS:
        mass = table1.get("nonsink_mass", config="fwd_s1", n=4096, delta=delta)
        expect = float(theory.non_sink_mass(delta, n=4096, k_sink=4))
        assert abs(mass.mean() - expect) <= 4 * mass.std(ddof=1) / np.sqrt(mass.size) + 2e-3
        for cfg, scale in (("fwd_s1", 1.0), ("fwd_s256", 256.0)):
            frac = table1.get("frac_zeroed", config=cfg, n=4096, delta=delta)
            expect = float(theory.collapse_fraction_spread(delta, scale, k_sink=4))
            assert abs(frac.mean() - expect) <= 4 * frac.std(ddof=1) / np.sqrt(frac.size) + 2e-3, (cfg, delta)


def test_table_metrics_do_not_depend_on_head_dim():
    """What the Table 1 fixture relies on: d changes V only, never the scores of a seed."""
    kw = dict(configs=("fwd_s1",), deltas=(7.0,), ns=(1024,), seeds=2, q_len=4, expected_mse=False)
    a = run_sweep(SweepSpec(d=1, **kw), progress=False)
    b = run_sweep(SweepSpec(d=64, **kw), progress=False)
    for m in ("frac_zeroed", "zeroed_mass", "nonsink_mass"):
        np.testing.assert_array_equal(a.data[m], b.data[m])


TABLE2_NS = (4096, 8192, 16384)
#: Paper Table 2, MSE × 1e5 at Δ = 7 (d = 128, q_len = 32, B = 64).
TABLE2 = {
    "fwd_s1": (5.65, 4.40, 2.94),
    "rev_s1": (1.70, 0.83, 0.32),
    "fwd_s448": (1.81, 0.90, 0.32),
    "fwd_s256": (1.64, 0.80, 0.28),
    "rev_s256": (1.64, 0.81, 0.28),
}


@pytest.mark.slow
def test_table2_mse_within_15_percent_of_the_paper():
    """Every MSE within 15 % of the paper, and the paper's orderings, with 60 seeds.

    60 rather than the paper's 20 seeds: a 20-seed mean carries ~5 % seed noise (sem), in the
    paper's cells as in ours, so at 20 seeds a 15 % bar is a ~2σ bar on the difference of two noisy
    numbers. With seeds 0..19 fwd_s448 at N = 8192 is 0.749 (−17 %); over 200 seeds it is
    0.774 ± 0.013 (−14 %), the tightest cell: across ten disjoint 20-seed groups it ranges
    −19 % … −7 %, so the paper's 0.90 sits at the upper end of its own seed noise.
    """
    spec = SweepSpec(configs=tuple(TABLE2), deltas=(7.0,), ns=TABLE2_NS, seeds=60, q_len=32, d=128,
                     expected_mse=False)
    res = run_sweep(spec, progress=False)
    mse = {c: 1e5 * np.array([res.mean("mse", config=c, n=n, delta=7.0) for n in TABLE2_NS]) for c in TABLE2}
    for c, paper in TABLE2.items():
        for n, got, p in zip(TABLE2_NS, mse[c], paper):
            assert abs(got / p - 1) <= 0.15, f"{c} N={n}: {got:.3f}e-5 vs paper {p}e-5"
    best = np.min([mse[c] for c in TABLE2 if c != "fwd_s1"], axis=0)
    ratio = mse["fwd_s1"] / best
    assert np.all(ratio >= 3.0), ratio  # forward S=1 worst by at least 3x at every N
    assert np.all(np.diff(ratio) > 0), ratio  # and the gap grows with N (paper: 3.4, 5.5, 10.5)
    assert np.all(mse["fwd_s256"] < mse["fwd_s448"])  # S = 256 beats S = 448 (paper: by 10-15 %)


@pytest.mark.parametrize("config", ["fa3", PRESETS["fa3"]], ids=["name", "KernelConfig"])
def test_the_engines_refuse_a_config_no_entry_point_bound(config):
    """engine.run, run_weights and run_qkv, and the implementations they run, take the BoundConfig an entry point
    made once (engine.bound of presets.resolve); a preset name or a config with its own numbers is a TypeError
    naming ``config``, before any computation; engine.bound itself takes no preset name."""
    from pcast_jax import implementations

    scores, v, counted = jnp.zeros((2, 8)), jnp.ones((8, 4)), jnp.ones((2, 8), bool)
    for module, run, args in ((engine, "run", (scores, v)), (engine, "run_weights", (scores,)),
                              (engine, "run_qkv", (v, v, v)), (implementations, "scan", (scores, v, counted)),
                              (implementations, "xla", (scores, v, counted))):
        with pytest.raises(TypeError, match=rf"^config=.*: {module.__name__[10:]}\.{run} takes a BoundConfig"):
            getattr(module, run)(*args, config)
    with pytest.raises(TypeError, match=r"implementations\.xla_weights takes a BoundConfig"):
        implementations.xla_weights(scores, counted, config, 8)
    if isinstance(config, str):
        with pytest.raises(TypeError, match=r"^config='fa3': engine\.bound takes a resolved KernelConfig"):
            engine.bound(config)
    else:
        bound = engine.bound(config, causal=True)
        assert bound.causal and bound.name == "fa3" and engine.bound(bound) is bound
