"""The formats as data, without JAX: every number read from ``ml_dtypes.finfo`` (``numpy.iinfo``).

:class:`FP8Format` (an element or scale format: E4M3, E5M2, E2M1, E8M0, UE4M3; the fixed-point P
formats INT8 and UINT8) and
:class:`BlockFormat` (MXFP8, MXFP4, NVFP4), the names ``KernelConfig`` accepts, and the lookups. The
casts that use them are in :mod:`pcast_jax.formats`, which re-exports everything here; this module
imports no JAX, so describing a kernel (``pcast_jax.config``) and the command line's help stay light.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from pcast_jax.errors import PcastError, check_choice

__all__ = ["OVERFLOW_MODES", "SCALE_MIN", "SCALE_MAX", "FP8Format", "BlockFormat", "E4M3", "E4M3FNUZ", "E5M2",
           "E2M1", "INT8", "UINT8", "E8M0", "UE4M3",
           "FORMATS", "SCALE_FORMATS", "MXFP8", "MXFP4", "NVFP4", "BLOCK_FORMATS",
           "P_FORMATS", "DTYPE_NAMES", "FLOAT_DTYPE_NAMES", "format_name", "get_format", "get_block_format"]

OVERFLOW_MODES = ("satfinite", "nan")
#: Bounds on a static P scale S: S, 1/S and S·ℓ (ℓ ≤ N < 2^27) stay finite, nonzero float32 numbers.
SCALE_MIN, SCALE_MAX = 2.0**-100, 2.0**100


@dataclasses.dataclass(frozen=True, slots=True)
class FP8Format:
    """A small number format (8 or 4 bits); every number is taken from ``ml_dtypes.finfo``.

    An integer dtype (``int8``, ``uint8``) is a fixed-point format: the integers of ``numpy.iinfo``,
    one step 1 apart, rounded to nearest even and clipped to the range (what TensorRT's INT8
    quantize does: roundWithTiesToEven(clip(x/s, −128, 127))). It has no normal range: every value
    lies below :attr:`smallest_normal` (2^magnitude bits), so the "subnormal" step 1 is its LSB
    everywhere and half a step (0.5) rounds to zero.
    """

    name: str
    dtype: np.dtype

    @property
    def is_integer(self) -> bool:
        """A fixed-point (integer) format: INT8, UINT8."""
        return bool(np.issubdtype(self.dtype, np.integer))

    @property
    def max(self) -> float:
        """Largest finite value (448 for E4M3FN, 57344 for E5M2, 127 for INT8, 255 for UINT8)."""
        if self.is_integer:
            return float(np.iinfo(self.dtype).max)
        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def min(self) -> float:
        """Smallest finite value (−max for the floats, −128 for INT8, 0 for UINT8)."""
        return float(np.iinfo(self.dtype).min) if self.is_integer else -self.max

    @property
    def smallest_normal(self) -> float:
        if self.is_integer:
            return float(2**self.mantissa_bits)
        return float(ml_dtypes.finfo(self.dtype).smallest_normal)

    @property
    def smallest_subnormal(self) -> float:
        return 1.0 if self.is_integer else float(ml_dtypes.finfo(self.dtype).smallest_subnormal)

    @property
    def bits(self) -> int:
        """Storage bits of one code (8, or 4 for E2M1)."""
        if self.is_integer:
            return int(np.iinfo(self.dtype).bits)
        return int(ml_dtypes.finfo(self.dtype).bits)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal: ⌊log2 max⌋ (8 for E4M3, 15 for E5M2, 2 for E2M1)."""
        return int(math.floor(math.log2(self.max)))

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits; an integer format's magnitude bits (7 for INT8, 8 for UINT8)."""
        if self.is_integer:
            return int(math.ceil(math.log2(self.max + 1)))
        return int(ml_dtypes.finfo(self.dtype).nmant)

    @property
    def round_to_zero(self) -> float:
        """Largest magnitude that casts to 0: half the smallest subnormal (2^-10 for E4M3, 0.5 for INT8)."""
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
        """Spacing of the top binade (32 for E4M3FN; 1 for an integer format)."""
        if self.is_integer:
            return 1.0
        return 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        if self.is_integer:
            return False
        return bool(np.isinf(np.array(np.inf, np.float32).astype(self.dtype)))

    def __repr__(self) -> str:
        return f"FP8Format({self.name!r})"


E4M3 = FP8Format("e4m3", np.dtype(ml_dtypes.float8_e4m3fn))
#: E4M3FNUZ (AMD MI300 / ROCm's FP8, what vLLM's ``current_platform.fp8_dtype()`` gives there): exponent
#: bias 8, no −0 or inf, max 240, smallest subnormal 2^-10, so values at or below 2^-11 round to zero.
E4M3FNUZ = FP8Format("e4m3fnuz", np.dtype(ml_dtypes.float8_e4m3fnuz))
E5M2 = FP8Format("e5m2", np.dtype(ml_dtypes.float8_e5m2))
E2M1 = FP8Format("e2m1", np.dtype(ml_dtypes.float4_e2m1fn))
#: Fixed-point P formats (TensorRT ``IAttention`` kINT8; LiteRT's softmax output, whose zero point −128
#: on an int8 code makes it the integers 0 … 255 of UINT8 for P ≥ 0): round(P·S) clipped to the range.
INT8 = FP8Format("int8", np.dtype(np.int8))
UINT8 = FP8Format("uint8", np.dtype(np.uint8))
#: Scale formats: E8M0 (MX) and UE4M3 (NVFP4: the E4M3 codes with the sign bit clear).
E8M0 = FP8Format("e8m0", np.dtype(ml_dtypes.float8_e8m0fnu))
UE4M3 = FP8Format("ue4m3", np.dtype(ml_dtypes.float8_e4m3fn))
FORMATS = {"e4m3": E4M3, "e4m3fn": E4M3, "float8_e4m3fn": E4M3, "e4m3fnuz": E4M3FNUZ, "float8_e4m3fnuz": E4M3FNUZ,
           "e5m2": E5M2, "float8_e5m2": E5M2, "e2m1": E2M1, "float4_e2m1fn": E2M1, "int8": INT8, "uint8": UINT8}
SCALE_FORMATS = {"e8m0": E8M0, "float8_e8m0fnu": E8M0, "ue4m3": UE4M3}


@dataclasses.dataclass(frozen=True, slots=True)
class BlockFormat:
    """A block-scaled format: ``block`` consecutive elements along the last axis share one scale.

    ``scale_fmt`` is E8M0 (MX: power-of-two scale from the block maximum's exponent) or UE4M3
    (NVFP4: block maximum / element max, rounded to E4M3). See the module docstring for the rules.
    """

    name: str
    element: FP8Format
    block: int
    scale_fmt: FP8Format

    @property
    def is_mx(self) -> bool:
        return self.scale_fmt is E8M0

    def __repr__(self) -> str:
        return f"BlockFormat({self.name!r})"


MXFP8 = BlockFormat("mxfp8", E4M3, 32, E8M0)
MXFP4 = BlockFormat("mxfp4", E2M1, 32, E8M0)
NVFP4 = BlockFormat("nvfp4", E2M1, 16, UE4M3)
BLOCK_FORMATS = {"mxfp8": MXFP8, "mxfp4": MXFP4, "nvfp4": NVFP4}
#: Every name ``KernelConfig.p_format`` accepts.
P_FORMATS = tuple(FORMATS) + tuple(BLOCK_FORMATS)
#: The formats that have a dtype, by dtype: its canonical name (E4M3 and UE4M3 share float8_e4m3fn: "e4m3").
DTYPE_NAMES = {E4M3.dtype: "e4m3", E4M3FNUZ.dtype: "e4m3fnuz", E5M2.dtype: "e5m2", E2M1.dtype: "e2m1",
               E8M0.dtype: "e8m0"}
#: The wide float dtypes that fields such as ``KernelConfig.accumulator`` and ``qkv`` name.
FLOAT_DTYPE_NAMES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


def _as_dtype(x) -> np.dtype | None:
    """``x`` as a dtype if it is one (``np.dtype``, a scalar type: ``jnp.float8_e4m3fn``,
    ``ml_dtypes.float8_e5m2``, ``np.float32``), else None."""
    if isinstance(x, np.dtype):
        return x
    if isinstance(x, type):
        try:
            return np.dtype(x)
        except TypeError:
            return None
    return None


def format_name(fmt, *, param: str = "fmt", choices=None):
    """A format given as a dtype → its canonical name; anything else is returned as it is.

    ``jnp.float8_e4m3fn``, ``ml_dtypes.float8_e4m3fn`` and ``np.dtype(ml_dtypes.float8_e4m3fn)`` all
    give ``"e4m3"`` (:data:`DTYPE_NAMES`; float32 and float16 give ``"f32"`` and ``"f16"``). ``choices``
    are the names the parameter takes (default: every format with a dtype).

    Raises:
      PcastError: a dtype of no format ``param`` takes, naming ``param`` and the formats it takes.
    """
    dtype = _as_dtype(fmt)
    if dtype is None:
        return fmt
    names = {**DTYPE_NAMES, **FLOAT_DTYPE_NAMES}
    choices = tuple(DTYPE_NAMES.values()) if choices is None else tuple(choices)
    name = names.get(dtype)
    if name not in choices:
        by_dtype = ", ".join(f"{d.name} ({n})" for d, n in names.items() if n in choices)
        raise PcastError(f"{param}={fmt!r}: dtype {dtype.name} is not a format {param} takes; it takes "
                         f"{', '.join(dict.fromkeys(choices))} by name" + (f", or the dtypes {by_dtype}" if by_dtype
                                                                            else ""))
    return name


def get_format(fmt, *, param: str = "fmt") -> FP8Format:
    """Return the format for a name (``"e4m3"``, ``"e5m2"`` …) or a dtype (``jnp.float8_e4m3fn``,
    ``ml_dtypes.float8_e5m2``, ``np.dtype(...)``: :func:`format_name`), or pass a format through."""
    if isinstance(fmt, FP8Format):
        return fmt
    fmt = format_name(fmt, param=param, choices=tuple(FORMATS) + tuple(SCALE_FORMATS))
    if isinstance(fmt, str) and fmt.lower() in SCALE_FORMATS:
        return SCALE_FORMATS[fmt.lower()]
    check_choice(param, str(fmt).lower() if isinstance(fmt, str) else fmt, tuple(FORMATS))
    return FORMATS[fmt.lower()]


def get_block_format(fmt: str | BlockFormat, *, param: str = "fmt") -> BlockFormat:
    """Return the block-scaled format for a name (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    fmt = format_name(fmt, param=param, choices=tuple(BLOCK_FORMATS))  # no block format has a dtype: refused
    check_choice(param, str(fmt).lower() if isinstance(fmt, str) else fmt, tuple(BLOCK_FORMATS))
    return BLOCK_FORMATS[fmt.lower()]
