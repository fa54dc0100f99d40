"""Same key, same bits: workloads, the cast, the engines and the sweep are deterministic.

What is bit-identical, and what is equal only to FP32 rounding (and why):

* A workload instance depends on its PRNG key only; Δ shifts the sink columns and nothing else.
* The cast gives the same bits under ``jit``, eagerly and under ``jax.disable_jit()``, also when
  it sits inside a larger jitted expression (the optimization barrier keeps XLA from fusing the
  f32 → f8 → f32 round trip away).
* An engine call repeated gives the same bits. A jitted instance gives the same bits alone or
  inside a ``lax.map`` loop of any length — which is why the sweep loops over seeds and Δ rather
  than vmapping them: XLA:CPU emits shape-dependent code for reductions and exponentials, so the
  same instance inside vmapped batches of different sizes can differ in the last bit.
* jit vs eager: equal to a few ULPs, not bitwise. XLA:CPU contracts ``a * b + c`` into one
  fused multiply-add inside a jitted computation (the scan implementation's α updates, the exponent
  mode's ``exp2(z·log2e − c)``), computes ``x / d`` with d broadcast along rows as ``x · (1/d)``
  in some fusion contexts (the epilogue O / (S·ℓ)), and orders reductions by what it fused. The
  two tests after the tolerance test pin down the first two causes. The zeroed counts are
  identical, and the cast itself is bit-identical in every mode; ÷S after it is too when S = 2^k
  (Prop. 5), and within one ULP otherwise.
* Scan vs xla implementation: identical cast inputs, so identical ``n_zeroed``; the outputs agree to
  FP32 rounding only, because the xla implementation applies exp(m_b − m_final) once per block where the
  scan multiplies the α factors one after another, and sums ℓ and P8·V in another order (held for one
  preset per compiled program in ``tests/test_engine.py``, for every preset against the oracle in
  ``tests/test_oracle.py``).
* The sweep: one end-to-end check that 1 and 4 (forced host) devices with different chunk sizes
  give bit-identical results, and that a sweep value equals the instance evaluated on its own.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcast_jax import engine, formats, metrics, sweep, workloads
from pcast_jax.presets import get_preset

from cases import subprocess_env

# every scale mode, both orders, the f16 accumulator, and each engine at least twice
PAIRS = [("fwd_s1", "scan"), ("rev_s256", "xla"), ("fa3", "scan"), ("sageattn2pp", "xla"),
         ("dynamic_pow2", "scan"), ("flashinfer_sm90", "xla")]
WORKLOAD = workloads.SinkWorkload(n=200, q_len=4, d=8, k_sink=4)  # 200: the last block is padded


def _instance(seed=0, delta=7.0, workload=WORKLOAD):
    return workloads.make_instance(jax.random.PRNGKey(seed), workload, delta)


def _same(a, b, label=""):
    if a is None or b is None:  # an optional field (Instance.v without V, sink_logit without a learned sink)
        assert a is None and b is None, label
        return
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, label
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{label}: bits differ"


def _same_result(r1, r2, label=""):
    for field in r1._fields:
        _same(getattr(r1, field), getattr(r2, field), f"{label} {field}")


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


def test_instance_depends_on_its_key_only():
    a, b = _instance(3), _instance(3)
    for x, y in zip(a, b):
        _same(x, y)
    jitted = jax.jit(lambda k: workloads.make_instance(k, WORKLOAD, 7.0))(jax.random.PRNGKey(3))
    for x, y in zip(a, jitted):
        _same(x, y)
    other = _instance(4)
    assert not np.array_equal(a.scores, other.scores) and not np.array_equal(a.v, other.v)


def test_delta_moves_the_sink_columns_and_nothing_else():
    base = _instance(5, delta=0.0)
    sink = np.asarray(base.is_sink)
    for delta in (3.0, 9.5):
        inst = _instance(5, delta=delta)
        _same(inst.v, base.v)
        _same(np.asarray(inst.scores)[:, ~sink], np.asarray(base.scores)[:, ~sink])
        _same(inst.scores, base.scores + jnp.where(base.is_sink, jnp.float32(delta), 0.0))


# --------------------------------------------------------------------------------------------
# The cast
# --------------------------------------------------------------------------------------------


def _cast_inputs():
    rng = np.random.default_rng(11)
    p = np.exp(-rng.exponential(4.0, 4096)).astype(np.float32)  # P in (0, 1], many near underflow
    edges = np.array([2.0**-10, 2.0**-10 * 1.0000001, 464.0, 448.0, 1e30, -1e30], np.float32)
    return np.concatenate([p, -p, edges, formats.all_codes("e4m3")[np.isfinite(formats.all_codes("e4m3"))]])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("overflow", ["satfinite", "nan"])
def test_scaled_cast_is_the_same_under_jit_eager_and_disable_jit(fmt, overflow):
    x = _cast_inputs()

    def cast_scaled(p, scale):  # lines 7 and 9 of Algorithm 1: P·S, then the cast
        return formats.cast(p * scale, fmt, overflow=overflow)

    def unscale(p8, scale):  # the epilogue's ÷S
        return p8 / scale

    for scale in (1.0, 256.0, 448.0, 2.0**8.807):
        args = (jnp.asarray(x), jnp.float32(scale))
        eager = cast_scaled(*args)
        _same(jax.jit(cast_scaled)(*args), eager, f"jit S={scale}")
        with jax.disable_jit():
            _same(cast_scaled(*args), eager, f"disable_jit S={scale}")
        # ÷S inside one jitted pipeline vs eagerly: exact (so identical) for S = 2^k only
        fused = jax.jit(lambda p, s: unscale(cast_scaled(p, s), s))(*args)
        alone = unscale(eager, args[1])
        if math.frexp(scale)[0] == 0.5:
            _same(fused, alone, f"÷S, S={scale}")
        finite = np.isfinite(np.asarray(alone))
        np.testing.assert_array_max_ulp(np.asarray(fused)[finite], np.asarray(alone)[finite], maxulp=1)


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, engine_name", PAIRS)
def test_engine_rerun_and_loop_position_give_the_same_bits(preset, engine_name):
    insts = [_instance(s) for s in range(4)]
    scores = jnp.stack([i.scores for i in insts])
    v = jnp.stack([i.v for i in insts])
    count_mask = ~insts[0].is_sink

    def one(s, vv):
        return engine.attention(s, vv, preset, implementation=engine_name, count_mask=count_mask)

    _same_result(one(scores[1], v[1]), one(scores[1], v[1]), "eager rerun")
    single = jax.jit(one)
    looped = jax.jit(lambda S, V: jax.lax.map(lambda sv: one(*sv), (S, V)))
    all4 = looped(scores, v)
    last2 = looped(scores[2:], v[2:])
    for i in range(4):
        _same_result(jax.tree.map(lambda x: x[i], all4), single(scores[i], v[i]), f"instance {i}")
    _same_result(jax.tree.map(lambda x: x[2:], all4), last2, "loop of 2 vs loop of 4")


@pytest.mark.parametrize("preset, engine_name", PAIRS)
def test_jit_vs_disable_jit_same_zeros_and_fp32_close_outputs(preset, engine_name):
    inst = _instance(6, delta=9.0)
    f = lambda s, v: engine.attention(s, v, preset, implementation=engine_name, count_mask=~inst.is_sink)  # noqa: E731
    jitted = jax.jit(f)(inst.scores, inst.v)
    with jax.disable_jit():
        eager = f(inst.scores, inst.v)
    _same(jitted.n_zeroed, eager.n_zeroed)
    _same(jitted.n_counted, eager.n_counted)
    ulps = 8 * np.finfo(np.float32).eps
    np.testing.assert_allclose(jitted.out, eager.out, rtol=0, atol=ulps * float(jnp.max(jnp.abs(eager.out))))
    np.testing.assert_allclose(jitted.row_sum, eager.row_sum, rtol=ulps)
    np.testing.assert_allclose(jitted.zeroed_mass, eager.zeroed_mass, rtol=ulps, atol=1e-12)


def test_jit_differs_from_eager_only_by_fused_multiply_add():
    """The cause of the tolerance above: jit rounds a·b + c once, eager rounds a·b and then the sum."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    once = (a.astype(np.float64) * b + c).astype(np.float32)
    twice = a * b + c
    assert not np.array_equal(once, twice)  # the inputs do tell the two apart
    _same(jax.jit(lambda x, y, z: x * y + z)(a, b, c), once, "jit")
    _same(jnp.asarray(a) * b + c, twice, "eager")


def test_division_by_a_broadcast_divisor_is_a_reciprocal_multiply():
    """The second cause: XLA turns x / d (d broadcast along rows) into x · (1/d), two roundings.

    It does so in some fusion contexts and not others, so the epilogue O / (S·ℓ) can differ by an
    ULP between jit and eager; dividing by a power of two is exact either way (Prop. 5).
    """
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    d = rng.uniform(1.0, 500.0, 64).astype(np.float32)
    divided = x / d[:, None]
    via_reciprocal = x * (np.float32(1.0) / d)[:, None]
    assert not np.array_equal(divided, via_reciprocal)
    _same(jax.jit(lambda a, b: a / b[:, None])(x, d), via_reciprocal, "jit")
    pow2 = np.exp2(np.round(np.log2(d))).astype(np.float32)
    _same(jax.jit(lambda a, b: a / b[:, None])(x, pow2), x / pow2[:, None], "power of two")


# --------------------------------------------------------------------------------------------
# The sweep: one end-to-end check (1 vs 4 devices, different chunk sizes and Δ groupings)
# --------------------------------------------------------------------------------------------

SWEEP_KW = dict(configs=["fwd_s1", "rev_s256", "fa3"], deltas=[4.0, 12.0], ns=[200], seeds=7,
                seed_offset=3, base_seed=17, q_len=4, d=8)

_FOUR_DEVICES = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    assert len(jax.devices()) == 4, jax.devices()
    from pcast_jax import engine, sweep, workloads
    kw = json.loads(sys.argv[1])
    spec = sweep.SweepSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})
    res = sweep.run_sweep(spec, chunk_size=3, progress=False)
    inst = workloads.make_instance(jax.random.PRNGKey(9), workloads.SinkWorkload(n=200, q_len=4, d=8), 7.0)
    on3 = jax.device_put((inst.scores, inst.v), jax.devices()[3])
    r = jax.jit(lambda s, v: engine.attention(s, v, "rev_s256"))(*on3)
    np.savez(sys.argv[2], out=np.asarray(r.out), **{"m_" + k: v for k, v in res.data.items()})
""")


@pytest.fixture(scope="module")
def four_device_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("devices") / "four.npz"
    env = subprocess_env(4)
    proc = subprocess.run([sys.executable, "-c", _FOUR_DEVICES, json.dumps(SWEEP_KW), str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _spec():
    return sweep.SweepSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in SWEEP_KW.items()})


def test_sweep_is_bit_identical_on_1_and_4_devices_and_any_chunking(four_device_run, tmp_path):
    spec = _spec()
    # one seed and one Δ per call here; 3 seeds (padded to 4, one per device) and both Δ there
    budget = int(1.5 * sweep.estimate_instance_bytes(spec, 200))
    assert sweep.plan_layout(spec, n_devices=1, chunk_size=1, memory_budget=budget) == {"chunk_size": 1,
                                                                                       "delta_group": 1}
    one = sweep.run_sweep(spec, devices=jax.devices()[:1], progress=False, memory_budget=budget, chunk_size=1)
    for m, arr in one.data.items():
        assert arr.shape == (1, 3, 2, 7)
        if m != "mse_expected":
            assert np.isfinite(arr).all(), m
        _same(arr, four_device_run["m_" + m], m)
    # one value of the sweep is the instance evaluated on its own
    ni, ci, di, si = 0, 1, 1, 4
    key = sweep.instance_key(spec.base_seed, spec.ns[ni], spec.seed_offset + si)
    inst = workloads.make_instance(key, spec.workload(spec.ns[ni]), spec.deltas[di])
    alone = jax.jit(lambda i: metrics.evaluate(i, spec.configs))(inst)
    for m in metrics.METRICS:
        _same(one.data[m][ni, ci, di, si], alone[m][ci], m)


def test_engine_on_another_device_gives_the_same_bits(four_device_run):
    inst = workloads.make_instance(jax.random.PRNGKey(9), workloads.SinkWorkload(n=200, q_len=4, d=8), 7.0)
    r = jax.jit(lambda s, v: engine.attention(s, v, get_preset("rev_s256")))(inst.scores, inst.v)
    _same(r.out, four_device_run["out"])
