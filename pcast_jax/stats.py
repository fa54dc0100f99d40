"""Small statistics shared by sweeps, reports and analyses (host-side NumPy).

Verdicts that compare a measured value with a threshold go through :func:`decide`: the value's
standard error (over seeds) times a two-sided 95 % Student-t quantile (:func:`z_value`) must keep
the threshold outside ``value ± z·se``, else the comparison is *within noise* at that many seeds.
Ratios of two configs measured on the same seeds use :func:`paired_ratio` (delta method).
"""

from __future__ import annotations

import math

import numpy as np

from pcast_jax.errors import PcastError

__all__ = ["mean_sem", "summary_cells", "sem", "paired_ratio", "stratified_ratio", "z_value", "decide", "CONFIDENCE",
           "fmt_pm", "NO_SE"]

#: Two-sided confidence level of a decided comparison (:func:`z_value`).
CONFIDENCE = 0.95


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


def summary_cells(x) -> tuple[float | None, float | None]:
    """(mean, standard error) of the seeds ``x`` as a published row holds them: None where there is none.

    A metric that was switched off is NaN in every seed (no mean); one seed has no standard error.
    Never a NaN in a summary: JSON writes null, CSV an empty cell.
    """
    x = np.asarray(x, np.float64)
    if x.size == 0 or np.isnan(x).all():
        return None, None
    m, e = mean_sem(x)
    return m, (e if x.size > 1 and math.isfinite(e) else None)


def paired_ratio(a, b) -> tuple[float, float]:
    """mean(a) / mean(b) for paired samples (``a[i]``, ``b[i]`` from the same seed), ± its s.e.

    The estimate is the ratio of the means R = ā / b̄ (what a table prints as "A / B"). Its
    standard error is the delta method's: R − R_true ≈ mean(d) with d_i = (a_i − R·b_i) / b̄, so
    se(R) = sem(d) = √(var a − 2R cov(a, b) + R² var b) / (b̄ √n). Pairing enters through
    cov(a, b): noise the two configs share (the same draw of scores and V) cancels, so the
    ratio's error is far smaller than the two means' errors suggest. ``b`` must have a positive
    mean; the s.e. is NaN with fewer than 2 pairs.
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape or a.size == 0:
        raise PcastError(f"paired_ratio needs two samples of one length; got {a.size} and {b.size}")
    mb = float(np.mean(b))
    if not mb > 0:
        raise PcastError(f"paired_ratio: the denominator's mean is {mb!r}; it must be > 0")
    r = float(np.mean(a)) / mb
    return r, sem((a - r * b) / mb)


def stratified_ratio(a, b, strata, sizes) -> tuple[float, float]:
    """R = Σ_h N_h ā_h / Σ_h N_h b̄_h from a stratified sample without replacement, ± its s.e.

    ``a``, ``b``: the sampled units' values; ``strata``: each unit's stratum (an index into ``sizes``);
    ``sizes``: N_h, the units of each stratum (the population). A mean over the units is ``b = 1``; a mean over
    the units where a condition holds is ``a = x·[condition]``, ``b = [condition]``. The standard error is the
    delta method's (as :func:`paired_ratio`): R − R_true ≈ Σ_h W_h d̄_h with d = (a − R·b) / B̄, W_h = N_h / N
    and B̄ = Σ_h W_h b̄_h, so se(R)² = Σ_h W_h² (1 − n_h/N_h) s_h²(d) / n_h (a stratum taken whole adds
    nothing). NaN where B̄ is not > 0 or a stratum has a single unit sampled of several.
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    strata = np.asarray(strata).ravel()
    sizes = np.asarray(sizes, np.float64).ravel()
    if a.shape != b.shape or a.shape != strata.shape or a.size == 0:
        raise PcastError(f"stratified_ratio needs a, b and strata of one length; got {a.size}, {b.size}, {strata.size}")
    n_h = np.bincount(strata, minlength=sizes.size).astype(np.float64)
    weights = sizes / sizes.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_a = np.bincount(strata, a, minlength=sizes.size) / n_h
        mean_b = np.bincount(strata, b, minlength=sizes.size) / n_h
        taken = n_h > 0
        big_b = float(np.sum(weights[taken] * mean_b[taken]))
        if not big_b > 0 or not np.all(taken | (sizes == 0)):
            return float("nan"), float("nan")
        r = float(np.sum(weights[taken] * mean_a[taken])) / big_b
        d = (a - r * b) / big_b
        dev = d - (np.bincount(strata, d, minlength=sizes.size) / n_h)[strata]
        s2 = np.bincount(strata, dev * dev, minlength=sizes.size) / (n_h - 1)
        whole = n_h >= sizes
        if np.any(~whole & taken & (n_h < 2)):
            return r, float("nan")
        var = np.where(whole | ~taken, 0.0, weights ** 2 * (1 - n_h / sizes) * s2 / n_h)
    return r, math.sqrt(float(np.sum(var)))


def z_value(n: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student-t quantile for a mean over ``n`` seeds (n − 1 degrees of freedom).

    2.36 at 8 seeds, 2.09 at 20, 1.98 at 96 (→ 1.96 for large n). Needs scipy.
    """
    from scipy import stats

    if n < 2:
        return float("inf")
    return float(stats.t.ppf(0.5 + confidence / 2, n - 1))


def decide(value: float, se: float, threshold: float, z: float) -> bool | None:
    """Is ``value`` above ``threshold``? True / False when ``value ± z·se`` excludes it, else None.

    A zero s.e. (e.g. a config compared with itself, or a fraction that is 0 on every seed) decides
    on the value alone; a NaN s.e. (fewer than 2 seeds) decides nothing.
    """
    if not math.isfinite(se):
        return None
    if value - z * se > threshold:
        return True
    if value + z * se < threshold or (se == 0 and value <= threshold):
        return False
    return None


#: What a published standard error says where there is none (a mean of fewer than 2 values).
NO_SE = "n/a: fewer than 2 values, no standard error"


def fmt_pm(value: float, se: float, digits: int = 3, suffix: str = "") -> str:
    """``value ± se`` with ``digits`` decimals (``1.084 ± 0.012×``)."""
    return f"{value:.{digits}f} ± {se:.{digits}f}{suffix}"
