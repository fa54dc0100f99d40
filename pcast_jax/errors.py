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
    "host_values",
    "shown_value",
]


class PcastError(ValueError):
    """A user-facing error; the CLI prints its message as one line and exits non-zero."""


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_choice(param: str, value, choices) -> None:
    if value not in choices:
        raise PcastError(f"{param}={value!r} is not one of {', '.join(map(repr, choices))}")


def check_finite(param: str, value) -> float:
    if not _is_real(value):
        raise PcastError(f"{param}={value!r} must be a real number")
    if not math.isfinite(float(value)):
        raise PcastError(f"{param}={value!r} must be finite (got NaN or inf)")
    return float(value)


def check_positive(param: str, value) -> float:
    v = check_finite(param, value)
    if v <= 0:
        raise PcastError(f"{param}={value!r} must be > 0")
    return v


def check_int(param: str, value, *, min_value: int | None = None, max_value: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PcastError(f"{param}={value!r} must be an integer")
    v = int(value)
    if min_value is not None and v < min_value:
        raise PcastError(f"{param}={value!r} must be >= {min_value}")
    if max_value is not None and v > max_value:
        raise PcastError(f"{param}={value!r} must be <= {max_value}")
    return v


def host_values(value):
    """``value`` as a float64 NumPy array when it is concrete host data; ``None`` for jax values."""
    if isinstance(value, (bool, np.bool_)):
        raise PcastError(f"got a boolean {value!r} where a number was expected")
    if isinstance(value, (numbers.Real, np.generic)):
        return np.asarray(float(value))
    if isinstance(value, np.ndarray):
        if value.dtype == bool:
            raise PcastError("got a boolean array where numbers were expected")
        return value.astype(np.float64)
    if isinstance(value, (list, tuple)):
        return np.asarray(value, dtype=np.float64)
    return None


def shown_value(param: str, value, arr: np.ndarray) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, np.generic):
        return f"{param}={value!r}"
    if arr.ndim == 0:
        return f"{param}={float(arr)!r}"
    return f"{param} (array, offending value {float(arr.flat[0])!r})"


def check_values(param: str, value, *, lo: float | None = None, strict: bool = False,
                 lo_text: str | None = None) -> None:
    """Every concrete value (scalar, list or array) finite and ≥ ``lo`` (> with ``strict``).

    Traced and other jax values pass unchecked, so functions using this stay jit- and grad-able.
    """
    arr = host_values(value)
    if arr is None:
        return
    bad = ~np.isfinite(arr)
    if bad.any():
        raise PcastError(f"{shown_value(param, value, arr[bad] if arr.ndim else arr)} must be finite "
                         "(got NaN or inf)")
    if lo is not None:
        bad = arr <= lo if strict else arr < lo
        if bad.any():
            op = ">" if strict else ">="
            raise PcastError(f"{shown_value(param, value, arr[bad] if arr.ndim else arr)} must be "
                             f"{op} {lo_text or format(lo, 'g')}")
