"""The criterion: when does a kernel's P-cast lose too much? One limit, two poolings, one uncertainty rule.

Every verdict of the package — ``pcast analyze``, ``pcast doctor``, ``pcast jax-fp8``, ``pcast probe``
(:mod:`pcast_jax.testing`) and the vendors study — judges the same two masses against the same limit:

* **The masses**: the *zeroed mass* (the exact softmax mass of non-sink keys whose P the cast sets to 0)
  and the *clipped mass* (the mass of keys whose P·S the cast saturates at the format's max).
* **The limit**: :data:`MASS_LIMIT` of the softmax's mass, each (``mass_limit=`` where a caller may set it,
  validated by :func:`check_mass_limit`).
* **The uncertainty rule** (:func:`over_limit`): a mass with a standard error is *over* its limit when
  ``mean − z·s.e.`` lies above it, *under* when ``mean + z·s.e.`` lies below it, else *within noise*
  (:func:`pcast_jax.stats.decide`); a mass without one is over or under as it stands.
* **Two poolings**, named by what they pool:

  - :func:`worst_head` (the analysis of a trace: ``pcast analyze``, ``pcast jax-fp8``): each head's masses are
    means over its query rows and then over the sequences; the kernel meets the criterion when the worst
    head's zeroed mass and the worst head's clipped mass are both at most the limit (with sampled rows, each
    head decided by the rule above).
  - :func:`worst_delta` (a synthetic workload over a Δ range: ``pcast doctor``, ``pcast probe``, the vendors
    study): at each Δ the masses are means over query rows and seeds, each with its s.e. over the seeds
    (:func:`over_limits` on one row, z = :data:`Z` unless a caller passes the Student-t quantile); the worst
    row decides.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Literal

import numpy as np

from pcast_jax import report
from pcast_jax.errors import PcastError, check_f32
from pcast_jax.stats import decide

__all__ = ["MASS_LIMIT", "ZEROED_MASS_LIMIT", "CLIPPED_MASS_LIMIT", "Z", "Verdict", "VERDICTS", "Pooling",
           "POOLINGS", "SAFE", "WITHIN_NOISE_ROWS", "check_mass_limit", "mass_text", "over_limit", "over_limits",
           "verdict_word", "worst_delta", "meets_criterion", "verdict", "criterion_words", "worst_head"]

#: The largest share of the softmax's mass the cast may zero, and clip, in every verdict.
MASS_LIMIT = 1e-3
#: The limit on the zeroed mass (non-sink keys).
ZEROED_MASS_LIMIT = MASS_LIMIT
#: The limit on the clipped (saturated) mass.
CLIPPED_MASS_LIMIT = MASS_LIMIT
#: The z of :func:`worst_delta`'s rule where the caller passes none (``pcast doctor``, ``pcast probe``).
Z = 2.0

#: One row's call under the uncertainty rule.
Verdict = Literal["over", "under", "within noise"]
VERDICTS = ("over", "under", "within noise")
#: How rows are pooled before the limit: the worst head of a trace, or the worst Δ of a synthetic workload.
Pooling = Literal["worst_head", "worst_delta"]
POOLINGS = ("worst_head", "worst_delta")

#: The verdict of a kernel meeting the criterion under :func:`worst_head`.
SAFE = "safe to serve"
#: The verdict of a sampled analysis whose error keeps the criterion undecided.
WITHIN_NOISE_ROWS = "within noise: analyse more rows"


def check_mass_limit(mass_limit) -> float:
    """``mass_limit`` as a float in (0, 1) (a share of the attention mass), else a PcastError naming it."""
    mass_limit = check_f32("mass_limit", mass_limit, positive=True)
    if mass_limit >= 1:
        raise PcastError(f"mass_limit={mass_limit} must be below 1 (a share of the attention mass)")
    return mass_limit


def mass_text(x: float) -> str:
    """A share of the attention mass as printed: a percentage (:func:`pcast_jax.report.fmt_pct`), or scientific
    below 0.1 % (:func:`pcast_jax.report.fmt_sci`); a head with no usable row says so."""
    if not math.isfinite(x):
        return "n/a (no usable row)"
    return report.fmt_pct(x, 1) if x >= 0.001 or x == 0 else report.fmt_sci(x, 1)


# --------------------------------------------------------------------------------------------
# The uncertainty rule and the worst-Δ pooling
# --------------------------------------------------------------------------------------------


def over_limit(mean: float, se: float, limit: float = MASS_LIMIT, z: float = Z) -> bool | None:
    """One mass against its limit: True / False when ``mean ± z·se`` excludes it, else None (within noise)."""
    return decide(mean, se, limit, z)


def over_limits(zeroed: tuple[float, float], clipped: tuple[float, float], z: float = Z) -> bool | None:
    """One row of :func:`worst_delta`: is its zeroed or its clipped mass over the limit?

    ``zeroed`` and ``clipped`` are (mean, s.e.) over seeds. True when either mass is decidedly over its
    limit (:data:`ZEROED_MASS_LIMIT`, :data:`CLIPPED_MASS_LIMIT`: mean − z·s.e. above it), False when both are
    decidedly under (mean + z·s.e. below it), else None: within noise (:func:`over_limit`).
    """
    calls = [over_limit(*zeroed, ZEROED_MASS_LIMIT, z), over_limit(*clipped, CLIPPED_MASS_LIMIT, z)]
    return worst_delta(calls)


def verdict_word(over: bool | None) -> Verdict:
    """``"over"``, ``"under"`` or ``"within noise"`` for a call of :func:`over_limits`."""
    return {True: "over", False: "under", None: "within noise"}[over]


def worst_delta(calls: Iterable[bool | None]) -> bool | None:
    """The rows' calls pooled: True when one is over, False when every one is under, else None."""
    calls = list(calls)
    return True if True in calls else (False if all(c is False for c in calls) else None)


# --------------------------------------------------------------------------------------------
# The worst-head pooling
# --------------------------------------------------------------------------------------------


def meets_criterion(zeroed_mass_max: float, saturated_mass_max: float, mass_limit: float = MASS_LIMIT) -> bool:
    """:func:`worst_head`'s test: the worst head's zeroed mass and the worst head's clipped (saturated) mass
    are both at most ``mass_limit``."""
    return bool(zeroed_mass_max <= mass_limit and saturated_mass_max <= mass_limit)


def criterion_words(mass_limit: float = MASS_LIMIT) -> str:
    """The worst-head criterion (:func:`meets_criterion`) in words."""
    return (f"A kernel is *safe to serve* here when its worst head loses at most {mass_text(mass_limit)} of the "
            f"attention mass to zeroed P and has at most {mass_text(mass_limit)} clipped at the format's max "
            "(each head: mean over its query rows and the sequences); safe scales are found by simulating "
            "that kernel on this trace.")


def verdict(zeroed_mass_max: float, saturated_mass_max: float, mass_limit: float = MASS_LIMIT) -> str:
    """:data:`SAFE`, or what fails the criterion: ``"loses mass"``, ``"clips mass"`` or both."""
    if meets_criterion(zeroed_mass_max, saturated_mass_max, mass_limit):
        return SAFE
    fails = [word for word, mass in (("loses", zeroed_mass_max), ("clips", saturated_mass_max)) if mass > mass_limit]
    return " and ".join(fails) + " mass"


def _sequence_sem(values: np.ndarray, sems: np.ndarray) -> np.ndarray:
    """``[L, H]``: the standard error of the mean over sequences (axis 0) of independent per-sequence means
    ``values`` with standard errors ``sems``: √(Σ se²) / n over the sequences with a value."""
    finite = np.isfinite(values)
    n = finite.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(np.where(finite, np.asarray(sems, np.float64) ** 2, 0.0).sum(axis=0)) / n


def nanmean(x, axis=None):
    """``np.nanmean`` without the warning for an all-NaN slice (a head with no usable row stays NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def worst_head(heads: dict, limit: float, layers, *, sem: dict | None = None, z: float | None = None) -> dict:
    """The worst heads of one configuration's ``{metric: [B, L, H]}``: zeroed and clipped mass (each head
    a mean over sequences), where the worst zeroed head is, how many heads fail the criterion, whether it is
    met (``meets``) and the verdict.

    With ``sem`` (the same metrics' standard errors over sampled rows) each head is judged by
    :func:`over_limit` at ``z``: the criterion (:func:`meets_criterion`) is met where every head's
    masses lie below the limit by more than ``z`` standard errors, failed where one lies above by more, and
    else undecided (``meets`` None, the verdict :data:`WITHIN_NOISE_ROWS`); the worst head's standard errors
    come as ``zeroed_mass_max_sem`` and ``saturated_mass_max_sem``."""
    zeroed = nanmean(heads["zeroed_mass"], axis=0)
    clipped = nanmean(heads["saturated_mass"], axis=0) if "saturated_mass" in heads else np.zeros_like(zeroed)
    clipped = np.nan_to_num(clipped, nan=0.0)
    filled = np.where(np.isfinite(zeroed), zeroed, -np.inf)
    layer, head = np.unravel_index(np.argmax(filled), zeroed.shape)
    out = {"zeroed_mass_max": float(np.nanmax(zeroed)), "saturated_mass_max": float(np.max(clipped)),
           "worst_layer": layers[layer], "worst_head": int(head)}
    if sem is None:
        out["heads_over_limit"] = int(np.sum((np.nan_to_num(zeroed, nan=0.0) > limit) | (clipped > limit)))
        out["heads"] = int(zeroed.size)
        out["meets"] = meets_criterion(out["zeroed_mass_max"], out["saturated_mass_max"], limit)
        out["verdict"] = verdict(out["zeroed_mass_max"], out["saturated_mass_max"], limit)
        return out
    zeroed_se = _sequence_sem(heads["zeroed_mass"], sem["zeroed_mass"])
    clipped_se = (_sequence_sem(heads["saturated_mass"], sem["saturated_mass"]) if "saturated_mass" in heads
                  else np.zeros_like(zeroed))
    clipped_se = np.where(np.isfinite(clipped_se), clipped_se, np.nan)
    above = {"loses": np.zeros(zeroed.shape, bool), "clips": np.zeros(zeroed.shape, bool)}
    undecided = np.zeros(zeroed.shape, bool)
    for idx in np.ndindex(*zeroed.shape):
        for word, value, se in (("loses", zeroed[idx], zeroed_se[idx]), ("clips", clipped[idx], clipped_se[idx])):
            if not math.isfinite(value):
                continue  # a head with no usable row: nothing to judge (as the full analysis)
            decided = over_limit(float(value), float(se), limit, z)
            above[word][idx] |= decided is True
            undecided[idx] |= decided is None
    failing = above["loses"] | above["clips"]
    out.update(zeroed_mass_max_sem=float(zeroed_se[layer, head]),
               saturated_mass_max_sem=float(clipped_se[np.unravel_index(np.argmax(clipped), clipped.shape)]),
               heads_over_limit=int(failing.sum()), heads_within_noise=int((undecided & ~failing).sum()),
               heads=int(zeroed.size))
    out["meets"] = False if failing.any() else (None if undecided.any() else True)
    fails = [word for word in ("loses", "clips") if above[word].any()]
    out["verdict"] = (" and ".join(fails) + " mass" if fails else WITHIN_NOISE_ROWS if out["meets"] is None
                      else SAFE)
    return out
