"""Block-scaled P formats (MXFP8, MXFP4, NVFP4), E2M1 and the scale formats, and their theory.

Formats are checked code by code against ml_dtypes and the block casts against a float64 NumPy
implementation written here from the specifications (OCP Microscaling Formats v1.0 §6.3 for MX;
NVIDIA Model Optimizer's NVFP4 recipe), which shares no code with the package. The engines run the
new presets against the independent oracle (tests/oracle.py). The closed forms of
``pcast_jax.theory`` for block-scaled P are checked against the simulator across Δ, N and block_kv.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pcast_jax import engine, formats, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS

import oracle

# --------------------------------------------------------------------------------------------
# Element and scale formats, every code
# --------------------------------------------------------------------------------------------

ELEMENTS = [("e2m1", ml_dtypes.float4_e2m1fn, 4), ("e4m3", ml_dtypes.float8_e4m3fn, 8),
            ("e5m2", ml_dtypes.float8_e5m2, 8), ("e8m0", ml_dtypes.float8_e8m0fnu, 8)]


@pytest.mark.parametrize("name,dtype,bits", ELEMENTS)
def test_every_code_matches_ml_dtypes(name, dtype, bits):
    codes = formats.all_codes(name)
    assert codes.shape == (1 << bits,)
    ref = np.arange(1 << bits, dtype=np.uint8).view(dtype).astype(np.float32)
    np.testing.assert_array_equal(codes, ref)
    # the cast of every representable value is the identity (both overflow modes); E8M0's 2^-127 is
    # a float32 subnormal, which XLA on CPU flushes to zero before the cast
    finite = codes[np.isfinite(codes) & ((codes == 0) | (np.abs(codes) >= np.finfo(np.float32).tiny))]
    for mode in formats.OVERFLOW_MODES:
        np.testing.assert_array_equal(np.asarray(formats.cast(finite, name, overflow=mode)), finite)


def test_e2m1_facts_and_number_line():
    f = formats.E2M1
    assert (f.max, f.smallest_normal, f.smallest_subnormal, f.round_to_zero, f.bits, f.emax) == (6, 1, 0.5, 0.25, 4, 2)
    np.testing.assert_array_equal(formats.positive_values("e2m1"), [0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(oracle.E2M1.values, [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert not f.has_inf


def test_scale_formats():
    e8 = formats.E8M0
    vals = formats.positive_values("e8m0")
    assert len(vals) == 255 and vals[0] == 2.0**-127 and vals[-1] == 2.0**127
    assert np.all(np.log2(vals) == np.round(np.log2(vals)))  # powers of two only, no zero
    assert e8.bits == 8
    ue = formats.UE4M3
    assert ue.max == 448 and ue.round_to_zero == 2.0**-10 and ue.dtype == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("name", ["e2m1", "e4m3", "e5m2"])
def test_cast_matches_ml_dtypes_on_random_values_and_midpoints(name, rng):
    f = formats.get_format(name)
    v = formats.positive_values(name).astype(np.float64)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.uniform(-4, 2, 5000), (v[1:] + v[:-1]) / 2, -v])
    x = x.astype(np.float32)
    sat = np.asarray(formats.cast(x, name, overflow="satfinite"))
    ref = np.clip(x, -f.max, f.max).astype(f.dtype).astype(np.float32)
    np.testing.assert_array_equal(sat, ref)
    nan = np.asarray(formats.cast(x, name, overflow="nan"))
    np.testing.assert_array_equal(nan, x.astype(f.dtype).astype(np.float32))


@pytest.mark.parametrize("name,over", [("e2m1", 6.0), ("e4m3", 448.0), ("e5m2", 57344.0)])
def test_both_overflow_behaviours(name, over):
    big = np.array([1e6, -1e6, np.inf], np.float32)
    sat = np.asarray(formats.cast(big, name, overflow="satfinite"))
    np.testing.assert_array_equal(sat, [over, -over, over])
    nan = np.asarray(formats.cast(big, name, overflow="nan"))
    if name == "e2m1":  # no NaN and no infinity to give: ml_dtypes saturates too
        np.testing.assert_array_equal(nan, [6.0, -6.0, 6.0])
    elif name == "e4m3":
        assert np.all(np.isnan(nan))
    else:
        np.testing.assert_array_equal(nan, [np.inf, -np.inf, np.inf])


# --------------------------------------------------------------------------------------------
# Block casts against a float64 implementation of the specifications
# --------------------------------------------------------------------------------------------

def _nearest_even(y, line):
    """Round |y| to the sorted non-negative values ``line`` (ties to the even index), keep the sign."""
    a = np.abs(y)
    i = np.clip(np.searchsorted(line, a), 1, len(line) - 1)
    lo, hi = line[i - 1], line[i]
    mid = (lo + hi) / 2
    r = np.where((a > mid) | ((a == mid) & (i % 2 == 0)), hi, lo)
    return np.sign(y) * np.minimum(r, line[-1])


E2M1_LINE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
E4M3_LINE = np.array([m / 8 * 2.0**-6 for m in range(8)]
                     + [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)][:-1], np.float64)


def spec_mx(x, elem_line, emax):
    """OCP MX v1.0 §6.3: shared_exp = floor(log2(amax)) − emax_elem; X = 2^shared_exp; P_i = Q(V_i / X)."""
    xb = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float64)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        shared = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - emax
    scale = np.where(amax > 0, 2.0 ** np.clip(shared, -126, 127), 1.0)  # −127: float32 subnormal
    q = _nearest_even(xb / scale[..., None], elem_line)  # clamped to the max normal
    return (q * scale[..., None]).reshape(x.shape), scale


def spec_nvfp4(x, g=1.0):
    """Model Optimizer NVFP4: s = E4M3(amax / (6 g)) (1 for a zero block), q = E2M1(x / (s g)); s = 0 → 0."""
    xb = x.reshape(x.shape[:-1] + (-1, 16)).astype(np.float64)
    amax = np.abs(xb).max(-1)
    s = _nearest_even(np.float32(amax / (6.0 * g)).astype(np.float64), E4M3_LINE)
    s = np.where(amax > 0, s, 1.0)
    sc = s * g
    q = np.where((sc > 0)[..., None], _nearest_even(xb / np.where(sc > 0, sc, 1.0)[..., None], E2M1_LINE), 0.0)
    return (q * sc[..., None]).reshape(x.shape), sc


def _samples(rng):
    mags = 10.0 ** rng.uniform(-9, 3, (64, 1))  # blocks spanning many binades, some with tiny maxima
    x = rng.standard_normal((64, 128)) * mags
    x[3] = 0.0  # an all-zero row of blocks
    x[5, :16] = 2.0**-13  # an NVFP4 block whose scale rounds to 0: zeroed, never NaN
    return x.astype(np.float32)


def test_e4m3_line_of_this_file_is_ml_dtypes():
    np.testing.assert_array_equal(E4M3_LINE, np.concatenate([[0.0], formats.positive_values("e4m3")]))


@pytest.mark.parametrize("name,line,emax", [("mxfp8", E4M3_LINE, 8), ("mxfp4", E2M1_LINE, 2)])
def test_mx_block_cast_matches_the_spec(name, line, emax, rng):
    x = _samples(rng)
    q, scale = formats.block_quantize(x, name)
    ref, ref_scale = spec_mx(x, line, emax)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)
    np.testing.assert_array_equal(np.asarray(formats.block_cast(x, name)), ref)
    # the scale is a representable E8M0 value; elements lie on the element grid
    sc = np.asarray(scale)
    np.testing.assert_array_equal(sc.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), sc)
    assert np.all(np.isin(np.abs(np.asarray(q)), line))


def test_mx_scale_examples():
    """Hand-worked: amax = 1 → X = 2^-8 (E4M3) / 2^-2 (E2M1); amax 0.75 → 2^(−1−8); 500 saturates to 448·X."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1.0
    _, s8 = formats.block_quantize(x, "mxfp8")
    _, s4 = formats.block_quantize(x, "mxfp4")
    assert float(s8[0, 0]) == 2.0**-8 and float(s4[0, 0]) == 2.0**-2
    x[0, 0] = 0.75
    assert float(formats.block_quantize(x, "mxfp8")[1][0, 0]) == 2.0**-9
    x[0, 0] = 1.953125  # = 500 · 2^-8, X = 2^-8
    q, _ = formats.block_quantize(x, "mxfp8")
    assert float(q[0, 0]) == 448.0


@pytest.mark.parametrize("g", [1.0, 1.0 / 2688.0, 3.0])
def test_nvfp4_block_cast_matches_the_spec(g, rng):
    x = _samples(rng)
    q, scale = formats.block_quantize(x, "nvfp4", second_level=g)
    ref, ref_scale = spec_nvfp4(x, g)
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(formats.block_cast(x, "nvfp4", second_level=g)), ref, rtol=1e-6, atol=0)
    assert np.all(np.isin(np.abs(np.asarray(q)), E2M1_LINE))


def _nvfp4_ties(rng, rows: int = 512):
    """Blocks of 16 whose elements lie exactly on E2M1 rounding ties of their block scale, and block
    maxima exactly on UE4M3 ties of amax/6: every value is exact in float32, so only a division that
    is not one IEEE division (x · (1/s)) can move them off the tie."""
    e4 = formats.positive_values("e4m3").astype(np.float64)
    ties = (E2M1_LINE[1:] + E2M1_LINE[:-1]) / 2  # 0.25, 0.75, 1.25, …, 5
    s_b = rng.choice(e4[(e4 >= 2.0**-4) & (e4 <= 256)], rows)  # mostly not powers of two
    blocks = np.zeros((rows, 2, 16))
    blocks[:, 0, 0] = 6 * s_b  # block max: scale exactly s_b
    blocks[:, 0, 1:8] = ties * s_b[:, None]
    blocks[:, 0, 8:] = rng.choice(ties, (rows, 8)) * s_b[:, None]
    mids = (e4[1:] + e4[:-1]) / 2
    blocks[:, 1, 0] = 6 * rng.choice(mids[(mids >= 2.0**-4) & (mids <= 256)], rows)  # amax/6 on a UE4M3 tie
    blocks[:, 1, 1:] = (blocks[:, 1, :1] * rng.uniform(-1, 1, (rows, 15))).astype(np.float32)
    x = blocks.reshape(rows, 32)
    assert np.array_equal(x.astype(np.float32).astype(np.float64), x)
    return x


@pytest.mark.parametrize("g", [1.0, 2.0**-3])
@pytest.mark.parametrize("jit", [False, True])
def test_nvfp4_exact_ties_round_to_even(g, jit, rng):
    """Exact ties of the element (E2M1) and of the block scale (UE4M3) round to even, as float64
    division and ml_dtypes' cast give them (XLA rewrote x / broadcast(s) as x · (1/s), which rounded
    x/s = 1.25 to 1.5 and amax/6 off its tie)."""
    x = _nvfp4_ties(rng)
    fn = functools.partial(formats.block_quantize, fmt="nvfp4", second_level=g)
    q, scale = (jax.jit(fn) if jit else fn)(x.astype(np.float32))
    xb = x.reshape(-1, 2, 16)
    s_ref = np.minimum(np.abs(xb).max(-1) / (6 * g), 448.0)  # saturating (Model Optimizer's min(·, 448))
    s_ref = s_ref.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * g
    q_ref = (xb / s_ref[..., None]).astype(ml_dtypes.float4_e2m1fn).astype(np.float64).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), s_ref)
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    # the ties are really there: float32 x · (1/s) moves some of them
    recip = xb.astype(np.float32) * (np.float32(1.0) / s_ref.astype(np.float32))[..., None]
    assert np.any(recip.astype(ml_dtypes.float4_e2m1fn).astype(np.float64).reshape(x.shape) != q_ref)


def test_block_scale_underflow_zeroes_the_block_never_nan():
    x = np.full((2, 16), 2.0**-13, np.float32)  # amax/6 ≤ 2^-10: the UE4M3 scale rounds to 0
    x[1] = 6 * 2.0**-10 * 1.01  # just above: scale 2^-10·1.01 → 2^-9 (smallest subnormal)
    y = np.asarray(formats.block_cast(x, "nvfp4"))
    assert np.all(y[0] == 0) and np.all(np.isfinite(y))
    assert np.all(y[1] > 0)
    x = np.full((1, 32), 1e-38, np.float32)  # MX exponent clamped: elements ~ 0, finite
    assert np.all(np.isfinite(np.asarray(formats.block_cast(x, "mxfp8"))))


def test_oracle_block_cast_is_the_spec(rng):
    x = _samples(rng).astype(np.float64)
    for name, fn in (("mxfp8", lambda z: spec_mx(z, E4M3_LINE, 8)[0]), ("mxfp4", lambda z: spec_mx(z, E2M1_LINE, 2)[0]),
                     ("nvfp4", lambda z: spec_nvfp4(z)[0])):
        deq, _, near, _ = oracle.block_cast(x, name)
        ref = fn(x)
        assert np.all((deq == ref) | near)


def test_block_cast_is_jittable_and_rank_generic(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    for name in formats.BLOCK_FORMATS:
        y = jax.jit(lambda z, n=name: formats.block_cast(z, n))(x)
        flat = np.asarray(formats.block_cast(x.reshape(6, 64), name))
        np.testing.assert_array_equal(np.asarray(y), flat.reshape(x.shape))
    with pytest.raises(PcastError, match="multiple of the block size 32"):
        formats.block_quantize(np.ones((2, 48), np.float32), "mxfp8")


# --------------------------------------------------------------------------------------------
# KernelConfig and the kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e2m1", "mxfp8", "mxfp4", "nvfp4", "e5m2", "e4m3"])
def test_p_format_is_accepted_and_named(fmt):
    cfg = KernelConfig(p_format=fmt)
    assert cfg.p_format == fmt
    assert (fmt in cfg.name) == (fmt != "e4m3")
    assert KernelConfig.from_string(cfg.to_string()) == cfg
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("fmt,bkv", [("mxfp8", 48), ("mxfp4", 16), ("nvfp4", 24)])
def test_block_scale_must_tile_block_kv(fmt, bkv):
    with pytest.raises(PcastError, match=rf"p_format='{fmt}'.*block_kv={bkv}"):
        KernelConfig(p_format=fmt, block_kv=bkv)


def test_block_formats_refuse_dynamic_and_f16():
    with pytest.raises(PcastError, match="p_format='nvfp4'"):
        KernelConfig(p_format="nvfp4", scale_mode="dynamic")
    with pytest.raises(PcastError, match="p_format='mxfp8'"):
        KernelConfig(p_format="mxfp8", accumulator="f16")
    with pytest.raises(PcastError, match="p_format"):
        KernelConfig(p_format="fp4")


def test_existing_fingerprint_is_unchanged():
    from pcast_jax.sweep.spec import SweepSpec

    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "e2m1", "e5m2"])
def test_pallas_kernels_refuse_other_p_formats(fmt):
    from pallas_kernels import api

    q = np.zeros((1, 1, 64, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(PcastError, match=rf"p_format='{fmt}'"):
        api._validate(q, q, q, KernelConfig(p_format=fmt), "triton", None, 2, False)


def test_presets_cite_and_follow_sources():
    s3, fq, mx = PRESETS["sageattn3"], PRESETS["nvfp4_fakequant"], PRESETS["mxfp8_p"]
    # SageAttention3: mainloop_tma_ws.h walks n_block from n_block_max - 1 down; kBlockN 128 (launch.h)
    assert (s3.p_format, s3.scale, s3.scale_mode, s3.order, s3.block_kv) == ("nvfp4", 2688.0, "exponent",
                                                                             "reverse", 128)
    # Model Optimizer's Triton flash attention: forward kv_start loop, BLOCK_N 32, ℓ from unquantized P
    assert (fq.p_format, fq.scale, fq.scale_mode, fq.order, fq.block_kv) == ("nvfp4", 2688.0, "multiply",
                                                                             "forward", 32)
    assert (mx.p_format, mx.block_format.block, mx.fmt.name) == ("mxfp8", 32, "e4m3")


# --------------------------------------------------------------------------------------------
# Engines: the scale multiplied back after P·V; zeroed follows the cast
# --------------------------------------------------------------------------------------------

EXTRA = {
    "sageattn3": PRESETS["sageattn3"], "nvfp4_fakequant": PRESETS["nvfp4_fakequant"], "mxfp8_p": PRESETS["mxfp8_p"],
    "mxfp4_rev_b128": KernelConfig(order="reverse", p_format="mxfp4", block_kv=128, scale=4.0),
    "nvfp4_s1": KernelConfig(p_format="nvfp4"),  # scale underflow at small P: zeroed whole blocks
    "e2m1_s16": KernelConfig(p_format="e2m1", scale=16.0),
    "nvfp4_split3s": PRESETS["nvfp4_fakequant"].replace(kv_splits=3, split_layout="strided"),
    "sageattn3_causal": PRESETS["sageattn3"].replace(causal=True),
}


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(EXTRA))
def test_block_scaled_configs_match_the_oracle(name, engine_name, rng):
    cfg = EXTRA[name]
    for delta in (5.0, 10.0, 14.0):
        s, v, mask = oracle.sink_scores(rng, q=6, n=700, d=16, delta=delta)
        res = engine.attention(s, v, cfg, implementation=engine_name, count_mask=mask)
        ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
        out = np.asarray(res.out, np.float64)
        tol = 3e-6 * np.max(np.abs(ref.out)) + ref.out_slack
        assert np.all(np.abs(out - ref.out) <= tol), name
        assert np.all(np.abs(np.asarray(res.n_zeroed) - ref.n_zeroed) <= ref.zeroed_slack)
        assert np.all(np.abs(np.asarray(res.zeroed_mass, np.float64) - ref.zeroed_mass) <= ref.mass_tolerance())


def test_zeroed_counts_the_block_scaled_cast(rng):
    """block.zeroed is exactly P·S > 0 whose dequantized value is 0, both engines, and weights agree."""
    from pcast_jax import block

    cfg = KernelConfig(p_format="nvfp4", scale=1.0)
    ps = jnp.asarray(np.exp(rng.standard_normal((4, 64)) * 4 - 10), jnp.float32)
    z = np.asarray(block.zeroed(ps, cfg))
    q, sc = block.cast_p(ps, cfg)
    assert np.array_equal(z, np.asarray(block.dequantize(q, sc, cfg)) == 0)
    assert z.any() and not z.all()
    s, v, mask = oracle.sink_scores(rng, q=4, n=512, d=8, delta=9.0)
    a = engine.attention(s, v, cfg, implementation="scan", count_mask=mask)
    b = engine.attention(s, v, cfg, implementation="xla", count_mask=mask)
    np.testing.assert_array_equal(np.asarray(a.n_zeroed), np.asarray(b.n_zeroed))
    w = engine.effective_weights(s, cfg)
    np.testing.assert_allclose(np.asarray(w @ v), np.asarray(b.out), atol=1e-6)


# --------------------------------------------------------------------------------------------
# Theory against the simulator
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_element_threshold_is_the_casts_boundary(fmt, rng):
    """The largest zeroed element of each block equals block_element_threshold (exact form)."""
    bs = formats.BLOCK_FORMATS[fmt].block
    a = (10.0 ** rng.uniform(-4, 2, 200)).astype(np.float32)
    thr = np.asarray(theory.block_element_threshold(a, fmt=fmt))
    # a block with max a, one element just at the threshold and one just above it
    x = np.zeros((200, bs), np.float32)
    x[:, 0] = a
    x[:, 1] = (thr * (1 - 2.0**-20)).astype(np.float32)  # ±2^-20: clear of float32 rounding of x / scale
    x[:, 2] = (thr * (1 + 2.0**-20)).astype(np.float32)
    y = np.asarray(formats.block_cast(x, fmt))
    live = thr < a  # NVFP4 blocks with a ≤ 6·2^-10 lose their scale: all of the block is zero
    assert np.all(y[:, 1] == 0) and np.all(y[live, 2] > 0) and np.all(y[~live] == 0)
    thr, a = thr[live], a[live]
    smooth = np.asarray(theory.block_element_threshold(a, fmt=fmt, exact=False))
    ratio = thr / smooth  # the exact threshold lies within a factor 2 (MX) / half an E4M3 step (NVFP4)
    if fmt == "nvfp4":
        normal = a / 6 >= 2.0**-6  # the UE4M3 scale is a normal number: relative rounding ≤ 2^-4
        assert np.all(np.abs(ratio[normal] - 1) <= 1 / 16 + 1e-6)
    else:
        assert np.all((ratio <= 1.0 + 1e-6) & (ratio > 0.5 - 1e-6))
    g = jax.grad(lambda t: theory.block_element_threshold(t, fmt=fmt, exact=False))(1.0)
    assert float(g) > 0


def test_scale_underflow_threshold_matches_the_cast():
    s = 2688.0
    thr = float(theory.block_scale_underflow(s, fmt="nvfp4"))
    assert math.isclose(thr, 2.0**-10 / 448, rel_tol=1e-6)
    x = np.zeros((2, 16), np.float32)
    x[0, 0] = np.float32(thr * s * (1 - 2.0**-20))  # a/6 just below 2^-10: the scale rounds to 0
    x[1, 0] = np.float32(thr * s * (1 + 2.0**-20))
    y = np.asarray(formats.block_cast(x, "nvfp4"))
    assert y[0, 0] == 0 and y[1, 0] > 0
    assert float(jax.grad(lambda t: theory.block_scale_underflow(t))(s)) < 0
    assert float(theory.block_scale_underflow(1.0, fmt="mxfp8")) < 1e-40


def test_block_critical_delta_values():
    assert abs(float(theory.block_critical_delta(2688.0)) - 13.77) < 0.01
    dc = float(theory.block_critical_delta(2688.0))
    f = float(theory.block_collapse_fraction(dc, 2688.0))
    assert 0.35 < f < 0.65  # Δc sits where the scale of the typical block underflows
    assert float(jax.grad(lambda s: theory.block_critical_delta(s))(2688.0)) == pytest.approx(1 / 2688.0, rel=1e-4)


def _simulated_fraction(cfg, delta, n, rows=48, seed=0):
    rng = np.random.default_rng(seed)
    s, v, mask = oracle.sink_scores(rng, q=rows, n=n, d=4, delta=delta)
    res = _jitted(cfg)(s, v, mask)
    return float(np.mean(np.asarray(res.n_zeroed))) / mask.sum()


_JIT: dict = {}


def _jitted(cfg):
    if cfg not in _JIT:
        _JIT[cfg] = jax.jit(lambda s, v, m: engine.attention(s, v, cfg, count_mask=m))
    return _JIT[cfg]


# Tolerances: 48 rows × ~N keys give a binomial standard error below 0.01 for a per-key fraction,
# but keys of one row share the sink max, so rows are the independent units: sd(F_row)/√48 ≤ 0.02
# near Δc. Away from Δc the model error is below 0.005 (MX: u uniform; NVFP4: scale rounding
# ignored). Near Δc the E4M3 rounding of the block scale (±1/16) moves the boundary by ±0.06 in Δ,
# i.e. up to ±0.04 in F where dF/dΔ ≈ 0.6.
@pytest.mark.parametrize("fmt,scale,block_kv,n,delta,tol", [
    ("nvfp4", 2688.0, 64, 4096, 7.0, 0.01), ("nvfp4", 2688.0, 128, 4096, 10.0, 0.01),
    ("nvfp4", 2688.0, 64, 1024, 13.0, 0.05), ("nvfp4", 2688.0, 128, 4096, 14.0, 0.06),
    ("nvfp4", 2688.0, 64, 1024, 16.0, 0.01), ("nvfp4", 1.0, 64, 4096, 4.0, 0.03),
    ("mxfp8", 1.0, 64, 4096, 10.0, 0.002), ("mxfp8", 1.0, 128, 1024, 14.0, 0.004),
    ("mxfp4", 1.0, 64, 4096, 7.0, 0.01), ("mxfp4", 4.0, 128, 1024, 12.0, 0.015),
])
def test_block_collapse_fraction_matches_the_simulator(fmt, scale, block_kv, n, delta, tol):
    cfg = KernelConfig(p_format=fmt, scale=scale, block_kv=block_kv)
    sim = _simulated_fraction(cfg, delta, n)
    th = float(theory.block_collapse_fraction(delta, scale, fmt=fmt, n=n))
    assert abs(sim - th) <= tol, (sim, th)


def test_block_collapse_fraction_is_jittable_and_gradable():
    f = jax.jit(lambda d, s: theory.block_collapse_fraction(d, s))
    assert float(f(13.0, 2688.0)) == pytest.approx(float(theory.block_collapse_fraction(13.0, 2688.0)), abs=1e-6)
    g = float(jax.grad(lambda d: theory.block_collapse_fraction(d, 2688.0))(13.8))
    assert g > 0.1  # the scale-underflow collapse sets in around Δc
    # MX: only the 28 non-sink keys of the sinks' own scale block depend on Δ
    assert 0.0 <= float(jax.grad(lambda d: theory.block_collapse_fraction(d, 1.0, fmt="mxfp8"))(10.0)) < 0.01
    with pytest.raises(PcastError, match="k_sink"):
        theory.block_collapse_fraction(7.0, 1.0, fmt="nvfp4", k_sink=20)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_step_bounds_the_error_and_block_dp_is_its_sup(fmt, rng):
    """Every element's error ≤ half the top step (+ MX saturation); sup step/a → block_dp."""
    bf = formats.BLOCK_FORMATS[fmt]
    a_max = (2.0 ** rng.uniform(-3, 6, 400)).astype(np.float32)
    x = (rng.uniform(0, 1, (400, bf.block)) * a_max[:, None]).astype(np.float32)
    x[:, 0] = a_max
    y = np.asarray(formats.block_cast(x, fmt))
    step = np.asarray(theory.block_step(a_max, fmt=fmt))
    _, scale = formats.block_quantize(x, fmt)
    sat = (a_max - bf.element.max * np.asarray(scale)[:, 0]).clip(min=0)  # MX: a/X up to 2^(emax+1)
    assert np.all(np.abs(y - x).max(axis=1) <= step / 2 * (1 + 1e-6) + sat)
    ratio = step / a_max
    assert np.all(ratio <= theory.block_dp(fmt) * (1 + 1e-6))
    assert ratio.max() >= 0.97 * theory.block_dp(fmt)
    assert theory.block_dp("mxfp8") == 0.125 and theory.block_dp("mxfp4") == 0.5
