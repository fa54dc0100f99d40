"""Validation helpers: every bad input becomes a ValueError that names the parameter."""

from __future__ import annotations

import math
import numbers

__all__ = [
    "PcastError",
    "check_choice",
    "check_finite",
    "check_positive",
    "check_int",
    "check_range",
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


def check_range(param: str, value, lo: float | None = None, hi: float | None = None) -> float:
    v = check_finite(param, value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise PcastError(f"{param}={value!r} must lie in [{lo}, {hi}]")
    return v
