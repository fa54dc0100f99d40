"""FP8 formats: every code, the underflow and overflow edges, properties on random float32."""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcast_jax import formats
from pcast_jax.errors import PcastError

FMTS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
F32 = np.float32


pytestmark = pytest.mark.usefixtures("strict_rank_promotion")


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def assert_same_floats(actual, expected):
    """Bit-identical float32, except that any NaN equals any NaN."""
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert a.shape == e.shape
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    np.testing.assert_array_equal(nan_a, nan_e)
    np.testing.assert_array_equal(_bits(a)[~nan_a], _bits(e)[~nan_e])


def ml_cast(x, fmt):
    return np.asarray(x, np.float32).astype(FMTS[fmt]).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Every code round-trips bit-exactly.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_all_codes_decode_like_ml_dtypes_and_jax(fmt):
    codes = np.arange(256, dtype=np.uint8)
    from_ml = codes.view(FMTS[fmt]).astype(np.float32)
    from_jax = jax.lax.bitcast_convert_type(jnp.asarray(codes), FMTS[fmt]).astype(jnp.float32)
    assert_same_floats(formats.all_codes(fmt), from_ml)
    assert_same_floats(from_jax, from_ml)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("overflow", ["satfinite", "nan"])
def test_all_codes_round_trip_bit_exactly(fmt, overflow):
    codes = np.arange(256, dtype=np.uint8)
    values = formats.all_codes(fmt)
    out = formats.cast(values, fmt, overflow=overflow)
    back = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(out).astype(FMTS[fmt]), jnp.uint8))
    nan = np.isnan(values)
    inf = np.isinf(values)
    assert np.isnan(np.asarray(out)[nan]).all()
    keep = ~nan & ~(inf & (overflow == "satfinite"))
    np.testing.assert_array_equal(back[keep], codes[keep])
    if overflow == "satfinite" and inf.any():  # E5M2 ±inf saturate to ±max
        fmax = formats.get_format(fmt).max
        np.testing.assert_array_equal(np.asarray(out)[inf], np.sign(values[inf]) * fmax)


def test_nan_codes_are_exactly_the_reserved_ones():
    v = formats.all_codes("e4m3")
    assert sorted(np.flatnonzero(np.isnan(v)).tolist()) == [0x7F, 0xFF]
    assert not np.isinf(v).any()
    w = formats.all_codes("e5m2")
    assert sorted(np.flatnonzero(np.isinf(w)).tolist()) == [0x7C, 0xFC]
    assert np.isnan(w).sum() == 6


# ------------------------------------------------------------------------------------------
# Edges.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overflow", ["satfinite", "nan"])
def test_underflow_edge(overflow):
    rtz = F32(2.0**-10)
    below, above = np.nextafter(rtz, F32(0)), np.nextafter(rtz, F32(1))
    x = np.array([below, rtz, above, 3 * 2.0**-11, 3 * 2.0**-10, 2.0**-9, 2.0**-6], np.float32)
    expect = np.array([0, 0, 2.0**-9, 2.0**-9, 2.0**-8, 2.0**-9, 2.0**-6], np.float32)
    for sign in (1, -1):
        out = np.asarray(formats.cast(sign * x, "e4m3", overflow=overflow))
        np.testing.assert_array_equal(out, sign * expect)
        assert_same_floats(out, ml_cast(sign * x, "e4m3"))
    # the tie at 2^-10 goes to +0 / -0 (even), keeping the sign
    assert not np.signbit(formats.cast(rtz))
    assert np.signbit(formats.cast(-rtz))


def test_overflow_edge_e4m3():
    x = np.array([448, 464, np.nextafter(F32(464), F32(np.inf)), 480, 1e30, np.inf], np.float32)
    nan_mode = np.asarray(formats.cast(x, "e4m3", overflow="nan"))
    sat = np.asarray(formats.cast(x, "e4m3", overflow="satfinite"))
    np.testing.assert_array_equal(nan_mode[:2], [448, 448])  # 464 is a tie -> even 448
    assert np.isnan(nan_mode[2:]).all()
    np.testing.assert_array_equal(sat, np.full(x.shape, 448, np.float32))
    np.testing.assert_array_equal(np.asarray(formats.cast(-x, "e4m3")), -sat)
    assert np.isnan(np.asarray(formats.cast(-x, "e4m3", overflow="nan"))[2:]).all()
    assert_same_floats(nan_mode, ml_cast(x, "e4m3"))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_overflow_threshold_semantics(fmt):
    """Below nan_threshold rounds to max; above overflows; the tie goes to the even neighbour."""
    f = formats.get_format(fmt)
    thr = F32(f.nan_threshold)
    below, above = np.nextafter(thr, F32(0)), np.nextafter(thr, F32(np.inf))
    out = np.asarray(formats.cast(np.array([below, thr, above], np.float32), fmt, overflow="nan"))
    assert out[0] == f.max
    assert not np.isfinite(out[2])
    max_code = int(np.array(f.max, np.float32).astype(f.dtype).view(np.uint8))
    max_is_even = max_code % 2 == 0
    assert (out[1] == f.max) == max_is_even  # E4M3: 448 even -> 448; E5M2: 57344 odd -> inf
    assert_same_floats(out, ml_cast([below, thr, above], fmt))
    sat = np.asarray(formats.cast(np.array([below, thr, above, np.inf], np.float32), fmt))
    np.testing.assert_array_equal(sat, np.full(4, f.max, np.float32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("overflow", ["satfinite", "nan"])
def test_nan_and_inf_inputs(fmt, overflow):
    f = formats.get_format(fmt)
    out = np.asarray(formats.cast(np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32), fmt,
                                  overflow=overflow))
    assert np.isnan(out[:2]).all()
    if overflow == "satfinite":
        np.testing.assert_array_equal(out[2:], [f.max, -f.max])
    elif f.has_inf:
        np.testing.assert_array_equal(out[2:], [np.inf, -np.inf])
    else:
        assert np.isnan(out[2:]).all()


def test_jit_equals_eager():
    rng = np.random.default_rng(1)
    x = np.concatenate([
        formats.all_codes("e4m3"),
        (rng.standard_normal(4096) * np.exp(rng.uniform(-12, 7, 4096))).astype(np.float32),
        np.array([2.0**-10, 464, 480, np.inf, -np.inf, np.nan], np.float32),
    ]).astype(np.float32)
    for fmt in ("e4m3", "e5m2"):
        for overflow in ("satfinite", "nan"):
            for barrier in (True, False):
                eager = formats.cast(x, fmt, overflow=overflow, barrier=barrier)
                cast = functools.partial(formats.cast, fmt=fmt, overflow=overflow, barrier=barrier)
                jitted = jax.jit(cast)(x)
                assert_same_floats(jitted, eager)
                # the round trip must not be optimised away, even fused with later arithmetic
                fused = jax.jit(lambda v, cast=cast: cast(v) * 2)(x)
                assert_same_floats(fused, np.asarray(eager) * 2)


# ------------------------------------------------------------------------------------------
# Properties on random float32.
# ------------------------------------------------------------------------------------------
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
arrays_any = hnp.arrays(np.float32, 64, elements=any32)
arrays_finite = hnp.arrays(np.float32, 64, elements=finite32)
FMT = st.sampled_from(["e4m3", "e5m2"])
MODE = st.sampled_from(["satfinite", "nan"])


@settings(max_examples=100, deadline=None)
@given(arrays_any, FMT, MODE)
def test_matches_ml_dtypes_below_overflow(x, fmt, overflow):
    f = formats.get_format(fmt)
    out = np.asarray(formats.cast(x, fmt, overflow=overflow))
    ref = ml_cast(x, fmt)
    inside = ~(np.abs(x) > f.max)  # NaN counts as inside; above max the modes differ by design
    assert_same_floats(out[inside], ref[inside])
    if overflow == "nan":  # the nan mode follows ml_dtypes everywhere, overflow included
        assert_same_floats(out[np.abs(x) > f.max], ref[np.abs(x) > f.max])


@settings(max_examples=100, deadline=None)
@given(arrays_any, FMT, MODE)
def test_idempotent(x, fmt, overflow):
    once = formats.cast(x, fmt, overflow=overflow)
    assert_same_floats(formats.cast(once, fmt, overflow=overflow), once)


@settings(max_examples=100, deadline=None)
@given(arrays_finite, FMT, MODE)
def test_monotone_and_sign_symmetric(x, fmt, overflow):
    xs = np.sort(x)
    out = np.asarray(formats.cast(xs, fmt, overflow=overflow))
    kept = out[~np.isnan(out)]  # "nan" mode: E4M3 overflow is NaN (E5M2 gives ±inf)
    if overflow == "satfinite":
        assert kept.size == out.size
    assert np.all(kept[1:] >= kept[:-1])
    neg = np.asarray(formats.cast(-xs, fmt, overflow=overflow))
    assert_same_floats(neg, -out)


@settings(max_examples=100, deadline=None)
@given(arrays_finite, FMT)
def test_satfinite_never_nan_and_within_max(x, fmt):
    f = formats.get_format(fmt)
    out = np.asarray(formats.cast(x, fmt, overflow="satfinite"))
    assert not np.isnan(out).any()
    assert np.all(np.abs(out) <= f.max)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, 64,
                  elements=st.floats(min_value=2.0**-12, max_value=440.0, width=32)))
def test_rounding_error_is_at_most_half_lsb(x):
    out = np.asarray(formats.cast(x, "e4m3"), np.float64)
    err = np.abs(out - x.astype(np.float64))
    half = np.asarray(formats.lsb(x, "e4m3"), np.float64) / 2
    assert np.all(err <= half)


# ------------------------------------------------------------------------------------------
# LSB, enumeration, constants, errors.
# ------------------------------------------------------------------------------------------
def test_lsb_values():
    x = np.array([0, 2.0**-10, 2.0**-7, 2.0**-6, 1, 1.9, 2, 3, 100, 256, 300, 448, 1000], np.float32)
    expect = [2.0**-9] * 4 + [0.125, 0.125, 0.25, 0.25, 8, 32, 32, 32, 32]
    np.testing.assert_array_equal(np.asarray(formats.lsb(x, "e4m3")), np.float32(expect))
    np.testing.assert_array_equal(np.asarray(formats.lsb(-x, "e4m3")), np.float32(expect))
    np.testing.assert_array_equal(np.asarray(formats.lsb(np.float32([1, 2]), "e5m2")), [0.25, 0.5])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_lsb_equals_gap_to_next_value(fmt):
    v = formats.positive_values(fmt)
    gaps = np.diff(v)
    np.testing.assert_array_equal(np.asarray(formats.lsb(v[:-1], fmt)), gaps)
    assert float(formats.lsb(0.0, fmt)) == v[0]  # subnormal spacing = smallest subnormal


def test_positive_values_e4m3():
    v = formats.positive_values("e4m3")
    assert v.size == 126
    assert np.all(np.diff(v) > 0)
    assert v[0] == 2.0**-9 and v[-1] == 448
    sub = v[v < 2.0**-6]
    np.testing.assert_array_equal(sub, np.arange(1, 8) * 2.0**-9)  # Eq. (1): 7 subnormals
    normals = v[v >= 2.0**-6]
    assert normals.size == 119
    for n in range(-6, 9):  # 8 equispaced values per binade [2^n, 2^(n+1))
        b = normals[(normals >= 2.0**n) & (normals < 2.0 ** (n + 1))]
        assert b.size == (7 if n == 8 else 8)
        assert np.all(np.diff(b) == 2.0 ** (n - 3))
    assert formats.positive_values("e5m2").size == 123


def test_finfo_constants():
    e = formats.E4M3
    assert (e.max, e.smallest_normal, e.smallest_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    assert e.round_to_zero == 2.0**-10 and e.nan_threshold == 464.0 and e.max_lsb == 32.0
    assert e.mantissa_bits == 3 and not e.has_inf
    m = formats.E5M2
    assert (m.max, m.smallest_normal, m.smallest_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert m.mantissa_bits == 2 and m.has_inf and m.max_lsb == 8192.0
    assert m.nan_threshold == 61440.0
    assert math.isclose(-math.log(e.round_to_zero), 10 * math.log(2))


def test_format_names():
    assert formats.get_format("E4M3") is formats.E4M3
    assert formats.get_format("float8_e4m3fn") is formats.E4M3
    assert formats.get_format(formats.E5M2) is formats.E5M2


@pytest.mark.parametrize("bad", ["e3m4", "fp8", "", 7])
def test_unknown_format_names_fmt(bad):
    with pytest.raises(PcastError, match="fmt"):
        formats.get_format(bad)
    with pytest.raises(PcastError, match="fmt"):
        formats.cast(np.float32([1.0]), bad)
    with pytest.raises(PcastError, match="fmt"):
        formats.positive_values(bad)


def test_unknown_overflow_mode_names_overflow():
    with pytest.raises(PcastError, match="overflow"):
        formats.cast(np.float32([1.0]), "e4m3", overflow="wrap")
    assert issubclass(PcastError, ValueError)


# --------------------------------------------------------------------------------------------
# A dtype wherever a format name is
# --------------------------------------------------------------------------------------------

_DTYPE_FORMS = {"jnp": lambda dt: getattr(jnp, dt.name), "ml_dtypes": lambda dt: getattr(ml_dtypes, dt.name),
                "np.dtype": lambda dt: np.dtype(dt)}


@pytest.mark.parametrize("form", _DTYPE_FORMS)
@pytest.mark.parametrize("dtype, name", list(formats.DTYPE_NAMES.items()), ids=lambda x: str(x))
def test_a_dtype_names_its_format(dtype, name, form):
    from pcast_jax.config import KernelConfig
    from pcast_jax.sweep import SweepSpec

    given = _DTYPE_FORMS[form](dtype)
    assert formats.format_name(given) == name
    assert formats.get_format(given) is formats.get_format(name)
    x = jnp.asarray([0.3, -1.7, 2.0**-12], jnp.float32)
    assert np.array_equal(np.asarray(formats.cast(x, given)), np.asarray(formats.cast(x, name)), equal_nan=True)
    if name not in formats.P_FORMATS:  # E8M0 is a scale format only
        with pytest.raises(PcastError, match=r"p_format=.*dtype float8_e8m0fnu .*e4m3.*float8_e5m2 \(e5m2\)"):
            KernelConfig(p_format=given)
        return
    cfg = KernelConfig(p_format=given)
    ref = KernelConfig(p_format=name)
    assert cfg.p_format == name and isinstance(cfg.p_format, str)
    assert cfg == ref and hash(cfg) == hash(ref) and cfg.name == ref.name and cfg.to_dict() == ref.to_dict()
    assert SweepSpec(configs=(cfg,), deltas=(7.0,), ns=(64,), seeds=1).fingerprint() == SweepSpec(
        configs=(ref,), deltas=(7.0,), ns=(64,), seeds=1).fingerprint()


@pytest.mark.parametrize("form", _DTYPE_FORMS)
def test_qkv_and_accumulator_take_dtypes_too(form):
    from pcast_jax.config import KernelConfig

    e4m3 = _DTYPE_FORMS[form](np.dtype(ml_dtypes.float8_e4m3fn))
    f16 = np.float16 if form == "ml_dtypes" else _DTYPE_FORMS[form](np.dtype(np.float16))  # a NumPy scalar type
    cfg = KernelConfig(qkv=e4m3, accumulator=f16, block_kv=64)
    assert (cfg.qkv, cfg.accumulator) == ("e4m3", "f16") and cfg == KernelConfig(qkv="e4m3", accumulator="f16",
                                                                                  block_kv=64)


@pytest.mark.parametrize("call, param", [
    (lambda: formats.get_format(jnp.bfloat16), "fmt"),
    (lambda: formats.get_format(np.dtype(np.float32), param="p_fmt"), "p_fmt"),
    (lambda: formats.get_block_format(jnp.float8_e4m3fn), "fmt"),
    (lambda: formats.cast(jnp.ones(2), np.int8), "fmt"),
])
def test_an_unknown_dtype_is_refused_naming_the_parameter_and_the_formats(call, param):
    with pytest.raises(PcastError, match=rf"^{param}=.* is not a format {param} takes; it takes .*(e4m3|mxfp8)"):
        call()


@pytest.mark.parametrize("kwargs, param", [({"p_format": np.float32}, "p_format"),
                                           ({"p_format": jnp.float8_e8m0fnu}, "p_format"),
                                           ({"accumulator": jnp.float8_e4m3fn}, "accumulator"),
                                           ({"qkv": jnp.bfloat16}, "qkv")])
def test_kernel_config_refuses_a_dtype_of_no_format_it_takes(kwargs, param):
    from pcast_jax.config import KernelConfig

    with pytest.raises(PcastError, match=rf"^{param}=.*: dtype \w+ is not a format {param} takes; it takes "):
        KernelConfig(**kwargs)
