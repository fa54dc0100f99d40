"""Validation helpers: every bad input becomes a ValueError that names the parameter.

The one dialect of the package: ``check_*(param, value, ...)`` returns the validated value (or
nothing) and raises :class:`PcastError` with ``param=value`` and what is allowed.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = [
    "PcastError",
    "check_choice",
    "check_finite",
    "check_positive",
    "check_int",
    "check_values",
    "check_f32",
    "F32_MAX",
    "F32_TINY",
    "host_values",
    "shown_value",
    "EXIT_ERROR",
    "EXIT_PEER_FAILED",
    "EXIT_INTERRUPTED",
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
]


class PcastError(ValueError):
    """A user-facing error; the CLI prints its message as one line and exits non-zero."""


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_choice(param: str, value, choices) -> None:
    if value not in choices:
        raise PcastError(f"{param}={value!r} is not one of {', '.join(map(repr, choices))}")


#: Largest finite float32: every number the simulator computes with is a float32.
F32_MAX = float(np.finfo(np.float32).max)


def _range_limit(float32: bool, max_abs: float | None) -> float | None:
    if max_abs is not None:
        return min(max_abs, F32_MAX) if float32 else max_abs
    return F32_MAX if float32 else None


def _range_text(limit: float) -> str:
    if limit == F32_MAX:
        return "finite in float32 (|x| <= 3.4e38)"
    mantissa, exp = math.frexp(limit)
    exact = f" = 2^{exp - 1}" if mantissa == 0.5 and limit >= 2**20 else ""  # a power of two: say which
    return f"<= {limit:g}{exact} in magnitude"


def check_finite(param: str, value, *, float32: bool = False, max_abs: float | None = None) -> float:
    """``value`` as a float: a real number, finite (and with ``float32`` finite in float32).

    ``max_abs`` is a tighter bound for numbers that are squared or summed in float32.
    """
    if not _is_real(value):
        raise PcastError(f"{param}={_short(value)} must be a real number")
    try:
        float(value)
    except OverflowError:  # an integer beyond float64
        raise PcastError(f"{param}={_short(value)} is beyond float range; it must be finite") from None
    if not math.isfinite(float(value)):
        raise PcastError(f"{param}={value!r} must be finite (got NaN or inf)")
    limit = _range_limit(float32, max_abs)
    if limit is not None and abs(float(value)) > limit:
        raise PcastError(f"{param}={value!r} must be {_range_text(limit)}")
    return float(value)


#: Smallest normal float32: a positive parameter below it would be subnormal or 0 in float32.
F32_TINY = float(np.finfo(np.float32).tiny)


def check_positive(param: str, value, *, float32: bool = False, max_abs: float | None = None) -> float:
    v = check_finite(param, value, float32=float32, max_abs=max_abs)
    if v <= 0:
        raise PcastError(f"{param}={value!r} must be > 0")
    if float32 and v < F32_TINY:
        raise PcastError(f"{param}={value!r} must be >= {F32_TINY:.4g} (smaller is subnormal or 0 in float32)")
    return v


def check_f32(param: str, value, *, positive: bool = False, max_abs: float | None = None) -> float:
    """``value`` as a float that is finite in float32 (and > 0 with ``positive``; |x| ≤ ``max_abs``)."""
    if positive:
        return check_positive(param, value, float32=True, max_abs=max_abs)
    return check_finite(param, value, float32=True, max_abs=max_abs)


def check_int(param: str, value, *, min_value: int | None = None, max_value: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PcastError(f"{param}={value!r} must be an integer")
    v = int(value)
    if min_value is not None and v < min_value:
        raise PcastError(f"{param}={value!r} must be >= {min_value}")
    if max_value is not None and v > max_value:
        raise PcastError(f"{param}={value!r} must be <= {max_value}")
    return v


def host_values(value, param: str = "value"):
    """``value`` as a float64 NumPy array when it is concrete host data; ``None`` for jax values.

    Booleans, complex numbers, numbers beyond float64 and lists that are not numbers raise one
    :class:`PcastError` naming ``param`` (never a raw TypeError or OverflowError, never a silently
    dropped imaginary part).
    """
    if isinstance(value, (bool, np.bool_)):
        raise PcastError(f"{param}: got a boolean {value!r} where a number was expected")
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    if kind == "c" or (isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)):
        raise PcastError(f"{param}={_short(value)} is complex; it must be a real number")
    if not isinstance(value, (numbers.Real, np.generic, np.ndarray, list, tuple)):
        if hasattr(value, "shape") and hasattr(value, "dtype"):  # a jax array or tracer: checked where it runs
            return None
        raise PcastError(f"{param}={_short(value)} must be a real number or an array of them")
    try:
        if isinstance(value, np.ndarray):
            if value.dtype == bool:
                raise PcastError(f"{param}: got a boolean array where numbers were expected")
            return value.astype(np.float64)
        return np.asarray(float(value) if isinstance(value, (numbers.Real, np.generic)) else value, np.float64)
    except OverflowError:
        raise PcastError(f"{param}={_short(value)} is beyond float range; it must be finite in float32") from None
    except (TypeError, ValueError):
        raise PcastError(f"{param}={_short(value)} must be real numbers") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def shown_value(param: str, value, arr: np.ndarray) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, np.generic):
        return f"{param}={value!r}"
    if arr.ndim == 0:
        return f"{param}={float(arr)!r}"
    return f"{param} (array, offending value {float(arr.flat[0])!r})"


def check_values(param: str, value, *, lo: float | None = None, strict: bool = False,
                 lo_text: str | None = None, float32: bool = False, max_abs: float | None = None) -> None:
    """Every concrete value (scalar, list or array) finite and ≥ ``lo`` (> with ``strict``).

    With ``float32`` every value must also be finite in float32 (|x| ≤ 3.4e38); ``max_abs`` is a
    tighter bound for numbers that are squared or summed in float32. Traced and other jax values
    pass unchecked, so functions using this stay jit- and grad-able.
    """
    arr = host_values(value, param)
    if arr is None:
        return
    bad = ~np.isfinite(arr)
    if bad.any():
        raise PcastError(f"{shown_value(param, value, arr[bad] if arr.ndim else arr)} must be finite "
                         "(got NaN or inf)")
    limit = _range_limit(float32, max_abs)
    if limit is not None:
        bad = np.abs(arr) > limit
        if bad.any():
            raise PcastError(f"{shown_value(param, value, arr[bad] if arr.ndim else arr)} must be "
                             f"{_range_text(limit)}")
    if lo is not None:
        bad = arr <= lo if strict else arr < lo
        if bad.any():
            op = ">" if strict else ">="
            raise PcastError(f"{shown_value(param, value, arr[bad] if arr.ndim else arr)} must be "
                             f"{op} {lo_text or format(lo, 'g')}")


#: Exit status of ``pcast``: bad input or an error this process reports (the CLI's usual failure).
EXIT_ERROR = 2
#: Exit status of a multi-process run's processes when another process of the run failed, was
#: interrupted or killed, or the coordinator was lost: this process stops because the run cannot go on.
EXIT_PEER_FAILED = 3
#: Exit status after Ctrl-C (SIGINT), as shells report it (128 + 2); SIGTERM gives 128 + 15 = 143.
EXIT_INTERRUPTED = 130
#: Default seconds a multi-process run waits for the coordinator and for every process to join.
DEFAULT_TIMEOUT_S = 300.0
#: Largest timeout accepted (one week): JAX's own deadline is a 32-bit count of seconds.
MAX_TIMEOUT_S = 7 * 86400.0
#: Default seconds after which a silent process counts as lost (JAX's heartbeat timeout) and the
#: longest the processes wait for each other when they exit.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
