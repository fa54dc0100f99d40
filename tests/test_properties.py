"""Properties of the cast and of the simulator, checked on random inputs (hypothesis).

The cast (angles that complement tests/test_formats.py): it returns the *nearest* E4M3 value with
ties to the even code (checked against the 126-value table, ties drawn on purpose); neighbouring
float32 inputs never cast out of order; in the normal range it commutes with powers of two (and
does not below 2^-6); on every float32 bit pattern it is idempotent, saturating mode is never
NaN for a non-NaN input, and it agrees with the NaN mode wherever that one is finite.

The simulator: a bound derived from the E4M3 step. For a multiply-mode kernel (and the exponent
mode, where the cast input is S·P up to FP32 rounding) with S ≤ 448, the cast input is
y_j = S·P_j ≤ S ≤ 448, so it never saturates, and round-to-nearest with 3 mantissa bits gives

    |cast(y) − y| ≤ max(2^-4 · y, 2^-10)            (normal range: half an LSB of 2^-3 relative;
                                                     subnormals and zeros: half of 2^-9).

ℓ sums the *pre-cast* P, so it is the exact softmax normaliser (to FP32 rounding) and the kernel
output is O = Σ_j W̃_j V_j with W̃_j = cast(S P_j)·d_j/(S ℓ), where d_j = exp(m_b − m_final) ≤ 1
is block j's α decay and W_j = P_j d_j / ℓ is the exact softmax weight. Hence, per key,

    |W̃_j − W_j| = d_j/(S ℓ) · |cast(S P_j) − S P_j| ≤ max(2^-4 · W_j, 2^-10/(S ℓ)),

and per output entry |O − O_ref| ≤ Σ_j max(2^-4 W_j, 2^-10/(S ℓ)) |V_j|. When no S·P_j is below
the smallest normal 2^-6 (guaranteed when S·exp(z_j − max z) ≥ 2^-6 for every key, since the
running max never exceeds the final one) this is 2^-4 Σ_j W_j |V_j|. Forward and reverse order
then agree within the sum of their two bounds. Finally Prop. 5: multiplying a float32 by S = 2^k
and dividing it back is exact whenever the product stays a normal float32; S = 448 is not.
"""

from __future__ import annotations

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcast_jax import engine, formats, workloads
from pcast_jax.config import KernelConfig
from pcast_jax.presets import get_preset

E4M3 = formats.E4M3
FMT = st.sampled_from(["e4m3", "e5m2"])
MODE = st.sampled_from(["satfinite", "nan"])
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# float32 from raw bit patterns: every sign, exponent and payload, subnormals, ±inf and NaNs
bit_patterns = hnp.arrays(np.uint32, 256, elements=st.integers(0, 2**32 - 1)).map(lambda a: a.view(np.float32))


def _grid(fmt):
    """All finite values of the format, sorted, with each value's code parity (0 = even)."""
    f = formats.get_format(fmt)
    pos = formats.positive_values(f)
    vals = np.concatenate([-pos[::-1], [0.0], pos]).astype(np.float32)
    parity = (vals.astype(f.dtype).view(np.uint8) & 1).astype(np.int8)
    return vals, parity


def _nearest(x, fmt):
    """The value of the grid nearest to each x (|x| ≤ max), ties to the even code."""
    vals, parity = _grid(fmt)
    x = np.asarray(x, np.float64)
    hi = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = x - vals[lo], vals[hi] - x
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (parity[hi] == 0))
    return np.where(pick_hi, vals[hi], vals[lo]).astype(np.float32)


def _midpoints(fmt):
    vals, _ = _grid(fmt)
    return ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)


# --------------------------------------------------------------------------------------------
# The cast
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), fmt=FMT, mode=MODE)
def test_cast_is_the_nearest_value_with_ties_to_even(data, fmt, mode):
    fmax = formats.get_format(fmt).max
    anywhere = hnp.arrays(np.float32, 64, elements=st.floats(-fmax, fmax, width=32))
    ties = hnp.arrays(np.float32, 16, elements=st.sampled_from(_midpoints(fmt).tolist()))
    x = np.concatenate([data.draw(anywhere), data.draw(ties)])
    np.testing.assert_array_equal(np.asarray(formats.cast(x, fmt, overflow=mode)), _nearest(x, fmt))


def test_every_midpoint_rounds_to_the_even_neighbour():
    for fmt in ("e4m3", "e5m2"):
        mids = _midpoints(fmt)
        got = np.asarray(formats.cast(mids, fmt))
        vals, parity = _grid(fmt)
        idx = np.searchsorted(vals, got)
        assert (parity[idx] == 0).all()
        assert len(mids) == len(vals) - 1


@settings(max_examples=60, **SETTINGS)
@given(x=hnp.arrays(np.float32, 128, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       fmt=FMT, mode=MODE)
def test_neighbouring_float32_never_cast_out_of_order(x, fmt, mode):
    up = np.nextafter(x, np.float32(np.inf))
    cx, cu = np.asarray(formats.cast(x, fmt, overflow=mode)), np.asarray(formats.cast(up, fmt, overflow=mode))
    both = ~np.isnan(cx) & ~np.isnan(cu)
    assert (cx[both] <= cu[both]).all()
    if mode == "satfinite":
        assert both.all()


@settings(max_examples=60, **SETTINGS)
@given(x=hnp.arrays(np.float32, 128, elements=st.floats(2.0**-6, 448.0, width=32)),
       sign=st.sampled_from([-1.0, 1.0]), k=st.integers(-6, 6))
def test_cast_commutes_with_powers_of_two_in_the_normal_range(x, sign, k):
    x = (sign * x).astype(np.float32)
    y = (x * np.float32(2.0**k)).astype(np.float32)  # exact: a power of two
    ok = (np.abs(y) >= E4M3.smallest_normal) & (np.abs(y) <= E4M3.max)
    lhs = np.asarray(formats.cast(y[ok]))
    rhs = np.asarray(formats.cast(x[ok])) * np.float32(2.0**k)
    np.testing.assert_array_equal(lhs, rhs)


def test_below_the_normal_range_scaling_does_not_commute():
    x = np.float32(2.0**-7 + 2.0**-10)  # a subnormal tie: 4.5 steps of 2^-9
    assert float(formats.cast(x)) * 2**7 == 1.0
    assert float(formats.cast(x * np.float32(2**7))) == 1.125  # normal there: no information lost


@settings(max_examples=60, **SETTINGS)
@given(x=bit_patterns, fmt=FMT, mode=MODE)
def test_idempotent_on_every_bit_pattern(x, fmt, mode):
    once = np.asarray(formats.cast(x, fmt, overflow=mode))
    twice = np.asarray(formats.cast(once, fmt, overflow=mode))
    np.testing.assert_array_equal(np.isnan(once), np.isnan(twice))
    np.testing.assert_array_equal(once[~np.isnan(once)], twice[~np.isnan(twice)])
    f = formats.get_format(fmt)
    becomes_nan = np.isnan(x)
    if mode == "nan" and not f.has_inf:  # E4M3FN has no infinity: overflow is NaN
        becomes_nan = becomes_nan | (np.abs(x) > f.nan_threshold)
    np.testing.assert_array_equal(np.isnan(once), becomes_nan)


@settings(max_examples=60, **SETTINGS)
@given(x=bit_patterns, fmt=FMT)
def test_saturating_mode_is_never_nan_and_agrees_with_nan_mode_where_that_is_finite(x, fmt):
    f = formats.get_format(fmt)
    sat = np.asarray(formats.cast(x, fmt, overflow="satfinite"))
    nan_mode = np.asarray(formats.cast(x, fmt, overflow="nan"))
    ok = ~np.isnan(x)
    assert not np.isnan(sat[ok]).any()
    assert (np.abs(sat[ok]) <= f.max).all()
    finite = np.isfinite(nan_mode)
    np.testing.assert_array_equal(sat[finite], nan_mode[finite])
    big = ok & (np.abs(x) > f.nan_threshold)
    np.testing.assert_array_equal(sat[big], np.sign(x[big]) * np.float32(f.max))


@settings(max_examples=40, **SETTINGS)
@given(p=hnp.arrays(np.float32, 128, elements=st.floats(0.0, 1.0, width=32)),
       log2_scale=st.floats(-100.0, 100.0))
def test_scaled_p_cast_is_never_nan_for_any_allowed_scale(p, log2_scale):
    cfg = KernelConfig(scale=2.0**log2_scale)  # the full range KernelConfig accepts
    y = np.asarray(formats.cast(jnp.asarray(p) * jnp.float32(cfg.scale), cfg.p_format, overflow=cfg.overflow))
    assert np.isfinite(y).all() and (y >= 0).all() and (y <= E4M3.max).all()


# --------------------------------------------------------------------------------------------
# The simulator: the E4M3 step bounds the kernel's error
# --------------------------------------------------------------------------------------------

SIM_CONFIGS = {
    "fwd_s256": get_preset("fwd_s256"),
    "rev_s256": get_preset("rev_s256"),
    "fwd_s1": get_preset("fwd_s1"),
    "flashinfer_sm90": get_preset("flashinfer_sm90"),  # S = 448: ×S rounds in FP32, still ≤ max
    "fa3": get_preset("fa3"),  # exponent mode, S folded into exp2
}
SLACK = 2e-5  # FP32 rounding of exp, ℓ (≤ 320 terms), the contraction and the reference softmax


@functools.partial(jax.jit, static_argnames=("cfg", "n"))
def _simulate(seed, delta, *, cfg, n):
    inst = workloads.make_instance(jax.random.PRNGKey(seed), workloads.SinkWorkload(n=n, q_len=4, d=8), delta)
    res = engine.attention(inst.scores, inst.v, cfg)
    w_kernel = engine.effective_weights(inst.scores, cfg)
    w_exact = engine.reference_probs(inst.scores)
    o_ref = jnp.einsum("qn,nd->qd", w_exact, inst.v, precision="highest")
    ell = res.row_sum / (cfg.scale if cfg.scale_mode == "exponent" else 1.0)  # unscaled ℓ
    floor = 2.0**-10 / (cfg.scale * ell)  # the absolute term of the bound, per row
    per_key = jnp.maximum(2.0**-4 * w_exact, floor[:, None])
    bound = per_key @ jnp.abs(inst.v)  # (q, d)
    rel_bound = 2.0**-4 * (w_exact @ jnp.abs(inst.v))
    weighted_v = w_exact @ jnp.abs(inst.v)
    smallest_cast_input = cfg.scale * jnp.min(jnp.exp(inst.scores - jnp.max(inst.scores, -1, keepdims=True)))
    return dict(out=res.out, o_ref=o_ref, w_kernel=w_kernel, w_exact=w_exact, floor=floor, bound=bound,
                rel_bound=rel_bound, weighted_v=weighted_v, smallest_cast_input=smallest_cast_input)


seeds = st.integers(0, 2**31 - 1)
sizes = st.just(320)  # not a multiple of fa3's block of 128: padded


@settings(max_examples=25, **SETTINGS)
@given(seed=seeds, delta=st.floats(-2.0, 16.0), n=sizes, name=st.sampled_from(sorted(SIM_CONFIGS)))
def test_each_kernel_weight_is_within_the_e4m3_step_of_the_softmax(seed, delta, n, name):
    r = _simulate(seed, delta, cfg=SIM_CONFIGS[name], n=n)
    w, p = np.asarray(r["w_kernel"], np.float64), np.asarray(r["w_exact"], np.float64)
    allowed = np.maximum(2.0**-4 * p, np.asarray(r["floor"], np.float64)[:, None])
    assert (np.abs(w - p) <= allowed * (1 + SLACK) + SLACK * p + 1e-30).all()


@settings(max_examples=25, **SETTINGS)
@given(seed=seeds, delta=st.floats(-2.0, 16.0), n=sizes, name=st.sampled_from(sorted(SIM_CONFIGS)))
def test_output_error_is_within_the_derived_bound(seed, delta, n, name):
    r = {k: np.asarray(v, np.float64) for k, v in _simulate(seed, delta, cfg=SIM_CONFIGS[name], n=n).items()}
    err = np.abs(r["out"] - r["o_ref"])
    assert (err <= r["bound"] * (1 + SLACK) + SLACK * r["weighted_v"]).all()


@settings(max_examples=25, **SETTINGS)
@given(seed=seeds, delta=st.floats(0.0, 4.0), n=sizes)
def test_without_underflow_the_error_is_at_most_2_to_minus_4_of_the_weighted_values(seed, delta, n):
    fwd = {k: np.asarray(v, np.float64) for k, v in _simulate(seed, delta, cfg=SIM_CONFIGS["fwd_s256"], n=n).items()}
    rev = {k: np.asarray(v, np.float64) for k, v in _simulate(seed, delta, cfg=SIM_CONFIGS["rev_s256"], n=n).items()}
    assume(fwd["smallest_cast_input"] >= E4M3.smallest_normal)  # every S·P_j is a normal E4M3 number
    for r in (fwd, rev):
        rel = np.abs(r["w_kernel"] - r["w_exact"]) / r["w_exact"]
        assert rel.max() <= 2.0**-4 * (1 + SLACK) + SLACK
        assert (np.abs(r["out"] - r["o_ref"]) <= r["rel_bound"] * (1 + SLACK) + SLACK * r["weighted_v"]).all()
    gap = np.abs(fwd["out"] - rev["out"])
    assert (gap <= (fwd["rel_bound"] + rev["rel_bound"]) * (1 + SLACK) + 2 * SLACK * fwd["weighted_v"]).all()


@pytest.mark.parametrize("name", ["fwd_s256", "fa3"])
def test_the_relative_bound_is_tight(name):
    r = {k: np.asarray(v, np.float64) for k, v in _simulate(1, 2.0, cfg=SIM_CONFIGS[name], n=320).items()}
    assert r["smallest_cast_input"] >= E4M3.smallest_normal
    rel = np.abs(r["w_kernel"] - r["w_exact"]) / r["w_exact"]
    assert 0.75 * 2.0**-4 <= rel.max() <= 2.0**-4 * (1 + SLACK) + SLACK


# --------------------------------------------------------------------------------------------
# Prop. 5: ×S and ÷S are exact in FP32 exactly when S = 2^k
# --------------------------------------------------------------------------------------------

normal32 = st.floats(2.0**-100, 2.0**100, width=32)
_xla_mul = jax.jit(lambda a, s: a * s)
_xla_div = jax.jit(lambda a, s: a / s)  # XLA may compute this as a · (1/s)


@settings(max_examples=100, **SETTINGS)
@given(x=hnp.arrays(np.float32, 64, elements=normal32), sign=st.sampled_from([-1.0, 1.0]), k=st.integers(-24, 24))
def test_power_of_two_scaling_is_exact(x, sign, k):
    x = (sign * x).astype(np.float32)
    s = np.float32(2.0**k)
    exact = x.astype(np.float64) * 2.0**k
    for mul, div in ((np.multiply, np.divide), (_xla_mul, _xla_div)):  # IEEE float32; XLA
        y = np.asarray(mul(x, s))
        np.testing.assert_array_equal(y.astype(np.float64), exact)
        np.testing.assert_array_equal(np.asarray(div(y, s)), x)


@pytest.mark.parametrize("scale", [448.0, 2.0**8.807, 3.0])
def test_other_scales_round(scale):
    x = np.float32(1.0) + np.float32(2.0**-23) * np.arange(1, 65, dtype=np.float32)  # odd mantissas
    s = np.float32(scale)
    y = x * s
    assert math.frexp(float(s))[0] != 0.5
    assert (y.astype(np.float64) != x.astype(np.float64) * float(s)).any()  # ×S rounds
    assert (y * (np.float32(1) / s) != x).any()  # ÷S done as ×(1/S), as XLA may: not the identity
