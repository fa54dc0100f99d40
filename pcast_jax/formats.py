"""FP8 number formats: facts read from ``ml_dtypes.finfo``, the cast, the LSB, every code.

The paper's number line (§2.1, Eq. (1)–(2)): E4M3FN has 126 positive finite values, max 448,
smallest normal 2^-6, smallest subnormal 2^-9; values with |x| <= 2^-10 round to zero (the tie at
exactly 2^-10 goes to the even neighbour, 0).

Two overflow behaviours exist in practice:

* ``"satfinite"`` — Hopper's ``cvt.rn.satfinite`` (what the Pallas Mosaic GPU and Triton kernels
  emit): out-of-range and infinite inputs saturate to ±max; NaN stays NaN.
* ``"nan"`` — ``ml_dtypes`` / XLA's ``convert``: E4M3FN has no infinity, so anything that rounds
  past max (|x| > 464 for E4M3FN) becomes NaN. E5M2 keeps ±inf.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pcast_jax.errors import check_choice

__all__ = [
    "FP8Format",
    "E4M3",
    "E5M2",
    "FORMATS",
    "OVERFLOW_MODES",
    "get_format",
    "cast",
    "to_fp8",
    "lsb",
    "positive_values",
    "all_codes",
]

OVERFLOW_MODES = ("satfinite", "nan")


@dataclasses.dataclass(frozen=True, slots=True)
class FP8Format:
    """An 8-bit float format; every number is taken from ``ml_dtypes.finfo``."""

    name: str
    dtype: np.dtype

    @property
    def max(self) -> float:
        """Largest finite value (448 for E4M3FN, 57344 for E5M2)."""
        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def smallest_normal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_normal)

    @property
    def smallest_subnormal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_subnormal)

    @property
    def mantissa_bits(self) -> int:
        return int(ml_dtypes.finfo(self.dtype).nmant)

    @property
    def round_to_zero(self) -> float:
        """Largest magnitude that casts to 0: half the smallest subnormal (2^-10 for E4M3)."""
        return self.smallest_subnormal / 2.0

    @property
    def nan_threshold(self) -> float:
        """Smallest magnitude that no longer rounds to max under round-to-nearest-even.

        Exactly this value is a tie: it rounds to max when max has an even mantissa (E4M3FN:
        464 → 448, so overflow starts strictly above 464) and overflows otherwise (E5M2: 61440 → inf).
        """
        return self.max + self.max_lsb / 2.0

    @property
    def max_lsb(self) -> float:
        """Spacing of the top binade (32 for E4M3FN)."""
        return 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        return bool(np.isinf(np.array(np.inf, np.float32).astype(self.dtype)))

    def __repr__(self) -> str:
        return f"FP8Format({self.name!r})"


E4M3 = FP8Format("e4m3", np.dtype(ml_dtypes.float8_e4m3fn))
E5M2 = FP8Format("e5m2", np.dtype(ml_dtypes.float8_e5m2))
FORMATS = {"e4m3": E4M3, "e4m3fn": E4M3, "float8_e4m3fn": E4M3, "e5m2": E5M2, "float8_e5m2": E5M2}


def get_format(fmt: str | FP8Format, *, param: str = "fmt") -> FP8Format:
    """Return the format for a name (``"e4m3"``, ``"e5m2"`` …) or pass a format through."""
    if isinstance(fmt, FP8Format):
        return fmt
    check_choice(param, str(fmt).lower() if isinstance(fmt, str) else fmt, tuple(FORMATS))
    return FORMATS[fmt.lower()]


def to_fp8(x, fmt: str | FP8Format = "e4m3", *, overflow: str = "satfinite"):
    """Round float32 ``x`` to the FP8 format (round-to-nearest-even), returned in that FP8 dtype.

    ``"satfinite"`` clamps to ±max first (``minimum``/``maximum``, which both Pallas backends lower;
    NaN passes through), like ``cvt.rn.satfinite``; ``"nan"`` converts directly (ml_dtypes/XLA).
    This is the cast of Algorithm 1 line 9 as the kernels run it; :func:`cast` is the simulator's
    float32 view of it.
    """
    f = get_format(fmt)
    if overflow == "satfinite":
        x = jnp.minimum(jnp.maximum(x, -f.max), f.max)
    return x.astype(f.dtype)


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
    y = to_fp8(jnp.asarray(x, jnp.float32), f, overflow=overflow)
    if barrier:
        y = jax.lax.optimization_barrier(y)
    return y.astype(jnp.float32)


def lsb(x, fmt: str | FP8Format = "e4m3"):
    """Spacing between consecutive representable values of ``fmt`` in the binade holding |x|.

    Normal binade [2^n, 2^(n+1)): 2^(n - mantissa_bits); subnormal range: the subnormal step.
    Values above max report the top binade's spacing. Exact (uses frexp, no logs).
    """
    f = get_format(fmt)
    a = jnp.abs(jnp.asarray(x, jnp.float32))
    _, e = jnp.frexp(a)  # a = m * 2^e, m in [0.5, 1)  ->  binade exponent n = e - 1
    n = jnp.minimum(e - 1, int(math.floor(math.log2(f.max))))
    normal = jnp.ldexp(jnp.float32(1.0), n - f.mantissa_bits)
    return jnp.where(a < f.smallest_normal, jnp.float32(f.smallest_subnormal), normal)


def all_codes(fmt: str | FP8Format = "e4m3") -> np.ndarray:
    """All 256 bit patterns decoded to float32 (NaN where the code is NaN)."""
    f = get_format(fmt)
    return np.arange(256, dtype=np.uint8).view(f.dtype).astype(np.float32)


def positive_values(fmt: str | FP8Format = "e4m3") -> np.ndarray:
    """Sorted positive finite values (126 for E4M3FN), enumerated from the codes."""
    v = all_codes(fmt)
    v = v[np.isfinite(v) & (v > 0)]
    return np.unique(v)
