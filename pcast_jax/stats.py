"""Small statistics shared by sweeps, reports and analyses (host-side NumPy)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["mean_sem", "sem"]


def sem(x, axis=None):
    """Standard error of the mean, s / √n with the n − 1 sample deviation; NaN where n < 2.

    ``axis=None`` pools every element and returns a Python float; otherwise an array over the
    remaining axes.
    """
    x = np.asarray(x, np.float64)
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return float("nan") if axis is None else np.full(np.delete(x.shape, axis), np.nan)
    s = np.std(x, axis=axis, ddof=1) / math.sqrt(n)
    return float(s) if axis is None else s


def mean_sem(x, axis=None):
    """(mean, standard error of the mean) of ``x`` along ``axis`` (every element by default)."""
    x = np.asarray(x, np.float64)
    m = np.mean(x, axis=axis)
    return (float(m) if axis is None else m), sem(x, axis)
