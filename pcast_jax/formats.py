"""Low-precision number formats: facts read from ``ml_dtypes.finfo``, the cast, the LSB, every code.

The formats themselves (:class:`FP8Format`, :class:`BlockFormat` and the names) live in the
JAX-free :mod:`pcast_jax.numberline` and are re-exported here.

The paper's number line (§2.1, Eq. (1)–(2)): E4M3FN has 126 positive finite values, max 448,
smallest normal 2^-6, smallest subnormal 2^-9; values with |x| <= 2^-10 round to zero (the tie at
exactly 2^-10 goes to the even neighbour, 0).

Two overflow behaviours exist in practice:

* ``"satfinite"`` — Hopper's ``cvt.rn.satfinite`` (what the Pallas Mosaic GPU and Triton kernels
  emit): out-of-range and infinite inputs saturate to ±max; NaN stays NaN.
* ``"nan"`` — ``ml_dtypes`` / XLA's ``convert``: E4M3FN has no infinity, so anything that rounds
  past max (|x| > 464 for E4M3FN) becomes NaN. E5M2 keeps ±inf. E2M1 (FP4) has neither NaN nor
  infinity: ml_dtypes saturates, so both modes give ±6 past the range.

Beyond the element formats (E4M3, E5M2, E2M1) there are two scale formats, E8M0 (``float8_e8m0fnu``:
powers of two 2^-127 … 2^127, no zero, no sign) and UE4M3 (the non-negative half of E4M3), and the
block-scaled formats (:class:`BlockFormat`) that pair them along the last axis:

* MX (OCP Microscaling Formats v1.0, §6.3): blocks of 32 share one E8M0 scale
  X = 2^(⌊log2 amax⌋ − emax_elem), emax_elem the exponent of the element format's largest normal
  (8 for E4M3, 2 for E2M1); elements P_i = cast(V_i / X) saturating to the element max.
  MXFP8 = E4M3 elements, MXFP4 = E2M1 elements. The exponent is clamped to [−126, 127]: E8M0 reaches
  2^-127, but that is a float32 subnormal which XLA flushes to zero, so the simulator stops one
  binade short (it matters only for block maxima below 2^-118); an all-zero block gets X = 1
  (assumption: the specification leaves amax = 0 to the implementation; any X gives the same zeros).
* NVFP4 (NVIDIA Model Optimizer's in-kernel fake-quant,
  ``modelopt/torch/kernels/quantization/common/nvfp4_quant.py``): blocks of 16 E2M1 elements with a
  UE4M3 scale s_b = cast_E4M3(min(amax_b / (6 · g), 448)) under an FP32 second level g (there
  g = amax / (6 · 448), amax = 1 for softmax P by default); elements cast_E2M1(V_i / (s_b · g)). A
  block scale that rounds to 0 zeroes its block (the kernel's ``zero_scale`` branch; never NaN); an
  all-zero block gets s_b = 1 (its elements are 0 whatever the scale). (The offline quantizer
  ``qtensor/nvfp4_tensor.py`` clamps s_b to [2^-9, 448] instead and never zeroes a block.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax.errors import PcastError, check_choice, host_values
from pcast_jax.numberline import (
    BLOCK_FORMATS,
    DTYPE_NAMES,
    E2M1,
    E4M3,
    E4M3FNUZ,
    E5M2,
    E8M0,
    FORMATS,
    INT8,
    MXFP4,
    MXFP8,
    NVFP4,
    OVERFLOW_MODES,
    P_FORMATS,
    SCALE_FORMATS,
    UE4M3,
    UINT8,
    BlockFormat,
    FP8Format,
    format_name,
    get_block_format,
    get_format,
)

__all__ = [
    "ARITHMETIC_CAST_FORMATS",
    "cast_arithmetic",
    "FP8Format",
    "BlockFormat",
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "E2M1",
    "INT8",
    "UINT8",
    "E8M0",
    "UE4M3",
    "MXFP8",
    "MXFP4",
    "NVFP4",
    "FORMATS",
    "SCALE_FORMATS",
    "BLOCK_FORMATS",
    "P_FORMATS",
    "get_block_format",
    "DTYPE_NAMES",
    "format_name",
    "block_quantize",
    "block_cast",
    "OVERFLOW_MODES",
    "get_format",
    "cast",
    "to_fp8",
    "lsb",
    "positive_values",
    "all_codes",
]


def to_fp8(x, fmt: str | FP8Format = "e4m3", *, overflow: str = "satfinite"):
    """Round float32 ``x`` to the FP8 format (round-to-nearest-even), returned in that FP8 dtype.

    ``"satfinite"`` clamps to ±max first (``minimum``/``maximum``, which both Pallas backends lower;
    NaN passes through), like ``cvt.rn.satfinite``; ``"nan"`` converts directly (ml_dtypes/XLA).
    This is the cast of Algorithm 1 line 9 as the kernels run it; :func:`cast` is the simulator's
    float32 view of it. An integer format rounds to nearest even and clips to its range either way
    (an integer has no NaN to give).
    """
    f = get_format(fmt)
    if f.is_integer:
        return jnp.minimum(jnp.maximum(jnp.round(x), f.min), f.max).astype(f.dtype)
    if overflow == "satfinite":
        x = jnp.minimum(jnp.maximum(x, -f.max), f.max)
    return x.astype(f.dtype)


def _real_input(x):
    """``x`` as float32; strings, complex numbers and other non-numbers raise one PcastError naming x."""
    if isinstance(x, jax.Array) and not jnp.iscomplexobj(x):
        return x.astype(jnp.float32)
    host_values(x, "x")  # refuses complex numbers, booleans, lists of non-numbers
    try:
        return jnp.asarray(x, jnp.float32)
    except (TypeError, ValueError) as exc:
        raise PcastError(f"x={str(x)[:40]!r} must be real numbers ({type(exc).__name__})") from None


def cast(x, fmt: str | FP8Format = "e4m3", *, overflow: str = "satfinite", barrier: bool = True):
    """Round ``x`` to the FP8 format (round-to-nearest-even) and return it as float32.

    Args:
      x: array-like of floats (computed in float32).
      fmt: format name or :class:`FP8Format`.
      overflow: ``"satfinite"`` saturates to ±max like ``cvt.rn.satfinite`` (±inf too);
        ``"nan"`` follows ml_dtypes/XLA (E4M3FN: NaN past 464; E5M2: ±inf).
      barrier: put a ``lax.optimization_barrier`` after the cast so XLA cannot fuse the
        f32→f8→f32 round trip away; jit and eager give the same bits either way.

    NaN inputs stay NaN in both modes.
    """
    f = get_format(fmt)
    check_choice("overflow", overflow, OVERFLOW_MODES)
    y = to_fp8(_real_input(x), f, overflow=overflow)
    if barrier:
        y = jax.lax.optimization_barrier(y)
    return y.astype(jnp.float32)


#: Element formats whose saturating cast :func:`cast_arithmetic` computes in float32 arithmetic.
ARITHMETIC_CAST_FORMATS = ("e4m3", "e5m2", "int8", "uint8")  # E2M1 has no NaN: XLA casts NaN to -0 there


def cast_arithmetic(x, fmt: str | FP8Format = "e4m3"):
    """``formats.cast(x, fmt, overflow="satfinite")`` bit for bit, in float32 arithmetic.

    XLA:CPU converts float32 to an FP8 type one element at a time with integer code that does not
    vectorize (2–3 ns per value, the largest cost of a P-cast after the P·V product); the
    same round-to-nearest-even is cheap in float32: clamp to ±max, then clear the low
    ``23 − mantissa_bits`` bits of the float32 encoding, rounded to nearest even (normal range), or
    round |x| / smallest_subnormal to an integer (subnormal range; both scalings are exact powers
    of two). The sign is copied from ``x`` (so −0 and negative values cast as the FP8 type does);
    NaN gives the quiet NaN of its sign, as the round trip through the FP8 type does.
    The simulator's engines use it for line 9 (``tests/test_compile.py`` checks every float32 code that
    matters against the FP8 type); the kernels and :func:`cast` convert to the FP8 type itself.
    """
    fmt = get_format(fmt)
    if fmt.name not in ARITHMETIC_CAST_FORMATS:
        raise PcastError(f"fmt={fmt.name!r}: cast_arithmetic covers {', '.join(ARITHMETIC_CAST_FORMATS)} only "
                         "(use cast)")
    x = jnp.asarray(x, jnp.float32)
    if fmt.is_integer:  # round to nearest even, clipped: the integer code as a float32 value (NaN → 0, −0 → 0)
        r = jnp.minimum(jnp.maximum(jnp.round(x), fmt.min), fmt.max)
        return jnp.where(jnp.isnan(x) | (r == 0.0), 0.0, r)
    drop = 23 - fmt.mantissa_bits
    x = jnp.minimum(jnp.maximum(x, -fmt.max), fmt.max)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & np.uint32(0x80000000)
    mag = bits & np.uint32(0x7FFFFFFF)
    normal = (mag + np.uint32((1 << (drop - 1)) - 1) + ((mag >> drop) & np.uint32(1))) & np.uint32(
        (0xFFFFFFFF << drop) & 0xFFFFFFFF)
    a = jax.lax.bitcast_convert_type(mag, jnp.float32)
    step = np.float32(fmt.smallest_subnormal)
    sub = jax.lax.round(a * np.float32(1.0 / step), jax.lax.RoundingMethod.TO_NEAREST_EVEN) * step
    sub = jax.lax.bitcast_convert_type(sub, jnp.uint32)
    r = jnp.where(a < np.float32(fmt.smallest_normal), sub, normal)
    r = jnp.where(mag > np.uint32(0x7F800000), np.uint32(0x7FC00000), r)  # NaN
    return jax.lax.bitcast_convert_type(r | sign, jnp.float32)


def lsb(x, fmt: str | FP8Format = "e4m3"):
    """Spacing between consecutive representable values of ``fmt`` in the binade holding |x|.

    Normal binade [2^n, 2^(n+1)): 2^(n - mantissa_bits); subnormal range: the subnormal step.
    Values above max report the top binade's spacing. Exact (uses frexp, no logs).
    """
    f = get_format(fmt)
    a = jnp.abs(jnp.asarray(x, jnp.float32))
    if f.is_integer:  # one step everywhere
        return jnp.ones_like(a)
    _, e = jnp.frexp(a)  # a = m * 2^e, m in [0.5, 1)  ->  binade exponent n = e - 1
    n = jnp.minimum(e - 1, int(math.floor(math.log2(f.max))))
    normal = jnp.ldexp(jnp.float32(1.0), n - f.mantissa_bits)
    return jnp.where(a < f.smallest_normal, jnp.float32(f.smallest_subnormal), normal)


def all_codes(fmt: str | FP8Format = "e4m3") -> np.ndarray:
    """All 2^bits bit patterns decoded to float32 (256, or 16 for E2M1; NaN where the code is NaN)."""
    f = get_format(fmt)
    return np.arange(1 << f.bits, dtype=np.uint8).view(f.dtype).astype(np.float32)


def positive_values(fmt: str | FP8Format = "e4m3") -> np.ndarray:
    """Sorted positive finite values (126 for E4M3FN), enumerated from the codes."""
    v = all_codes(fmt)
    v = v[np.isfinite(v) & (v > 0)]
    return np.unique(v)


def split_blocks(x, block: int, fmt_name: str | None = None):
    """x (..., n) → (..., n / block, block); ``fmt_name`` names the format in the error."""
    n = x.shape[-1]
    if n % block:
        from pcast_jax.errors import PcastError

        if fmt_name is not None:
            raise PcastError(f"the last axis ({n}) must be a multiple of {fmt_name}'s block of {block} keys")
        raise PcastError(f"the last axis ({n}) must be a multiple of the block size {block}")
    return x.reshape(x.shape[:-1] + (n // block, block))


def _divide(x, d):
    """``x / d`` correctly rounded (one IEEE division), ``d`` broadcast to ``x``'s shape.

    XLA's algebraic simplifier rewrites a division by a broadcast or a constant, ``x / broadcast(d)``,
    as ``x · broadcast(1/d)``: two roundings, which move values that lie exactly on a rounding tie of
    the target format (x/d = 1.25 for E2M1 comes out as 1.2500001 and rounds up to 1.5 instead of to
    the even 1.0). The divisor materialized at ``x``'s shape behind an optimization barrier is an
    operand XLA cannot see through, so the division stays one.
    """
    d = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(d, jnp.float32), jnp.shape(x)))
    return x / d


def block_quantize(x, fmt: str | BlockFormat, *, overflow: str = "satfinite", second_level=None):
    """Block-scaled cast along the last axis: ``(elements, scales)`` with x ≈ elements · scale.

    Returns float32 ``elements`` of x's shape (values of the element format) and float32 ``scales``
    ``(..., n / block)`` (values of the scale format, times ``second_level`` for NVFP4).

    * MX: e = clamp(⌊log2 amax_b⌋ − emax_elem, −126, 127) (exact: from ``frexp``), X_b = 2^e
      (X_b = 1 for an all-zero block); elements = cast(x / X_b) saturating to the element max
      (OCP MX v1.0 §6.3 clamps to the max normal, whatever ``overflow`` says).
    * NVFP4: g = ``second_level`` (FP32, broadcast over the rows ``x.shape[:-1]``; 1 if None);
      s_b = cast_E4M3(amax_b / (6 g)), saturating at 448 (1 for an all-zero block);
      elements = cast_E2M1(x / (s_b g)); scale = s_b · g; s_b = 0 zeroes the block's elements.

    Rank-generic. Every division is one correctly rounded IEEE division (:func:`_divide`; XLA would
    otherwise multiply by a rounded reciprocal), so elements and NVFP4 block scales are exact
    roundings of x / (s_b g) and amax_b / (6 g), ties to even included; for MX the divisor is an exact
    power of two anyway.
    """
    bf = get_block_format(fmt)
    check_choice("overflow", overflow, OVERFLOW_MODES)
    x = jnp.asarray(x, jnp.float32)
    xb = split_blocks(x, bf.block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    el = bf.element
    if bf.is_mx:
        _, e = jnp.frexp(amax)  # amax = m 2^e, m in [0.5, 1) -> floor(log2 amax) = e - 1
        k = jnp.clip(e - 1 - el.emax, -126, 127)  # 2^-127 is a float32 subnormal (flushed by XLA)
        scale = jnp.where(amax > 0.0, jnp.ldexp(jnp.float32(1.0), k), 1.0)
        q = to_fp8(_divide(xb, scale[..., None]), el, overflow="satfinite").astype(jnp.float32)
    else:
        g = jnp.float32(1.0) if second_level is None else jnp.asarray(second_level, jnp.float32)
        g = jnp.broadcast_to(g, x.shape[:-1])[..., None]
        s_b = to_fp8(_divide(amax, el.max * g), UE4M3, overflow="satfinite").astype(jnp.float32)
        s_b = jnp.where(amax > 0.0, s_b, 1.0)
        scale = s_b * g
        safe = jnp.where(scale > 0.0, scale, 1.0)
        q = to_fp8(_divide(xb, safe[..., None]), el, overflow=overflow).astype(jnp.float32)
        q = jnp.where((scale > 0.0)[..., None], q, 0.0)
    return q.reshape(x.shape), scale


def block_cast(x, fmt: str | BlockFormat, *, overflow: str = "satfinite", second_level=None, barrier: bool = True):
    """The dequantized value of :func:`block_quantize`: elements × their block's scale, float32."""
    bf = get_block_format(fmt)
    q, scale = block_quantize(x, bf, overflow=overflow, second_level=second_level)
    if barrier:
        q, scale = jax.lax.optimization_barrier((q, scale))
    y = split_blocks(q, bf.block) * scale[..., None]
    return y.reshape(q.shape)
