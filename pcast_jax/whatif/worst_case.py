"""Worst-case sink strength: projected Adam ascent on Δ through the smooth surrogate.

:func:`worst_case_delta` climbs the surrogate MSE of one config from several starting points,
refines the best interior peak with the exact simulator and scans the exact MSE over the whole
range, so the local peak can be compared with Δc and the paper's transition region.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcast_jax import theory
from pcast_jax.errors import PcastError, check_choice, check_finite, check_int, check_positive
from pcast_jax.presets import resolve
from pcast_jax.whatif import progress
from pcast_jax.whatif.objective import Scenario, grid_mses, seed_mses, theta_points
from pcast_jax.whatif.surrogates import Surrogate, as_surrogate

__all__ = ["PAPER_TRANSITION", "WorstDeltaResult", "worst_case_delta"]

#: Progress steps of one :func:`worst_case_delta` call.
STEPS = 2

#: The paper's transition region (§1.2, §3.4, Fig. 2): P-collapse matters for Δ ≈ 6–9.
PAPER_TRANSITION = (6.0, 9.0)


@dataclasses.dataclass
class WorstDeltaResult:
    """Outcome of :func:`worst_case_delta` for one config (all Δ in score units).

    ``worst_delta`` is the best point Adam reached over all starts (it can sit on the range's
    edge); ``local_peak`` the best interior local maximum (NaN if every start ran to an edge),
    refined by the exact scan into ``exact_local_peak``.
    """

    config: str
    n: int
    objective: str
    surrogate: str
    delta_range: tuple
    starts: np.ndarray
    finals: np.ndarray  # Δ reached from each start
    final_values: np.ndarray  # surrogate MSE there
    worst_delta: float
    local_peak: float
    exact_local_peak: float
    exact_local_value: float
    grid_deltas: np.ndarray  # exact scan over delta_range
    grid_values: np.ndarray
    exact_global_delta: float  # argmax of the exact scan over the whole range
    critical_delta: float  # Δc = 10 ln 2 + ln S − δk (theory.critical_delta)
    seconds: float

    @property
    def in_paper_region(self) -> bool:
        """Whether the exact local peak lies in the paper's transition region Δ ∈ [6, 9]."""
        return bool(PAPER_TRANSITION[0] <= self.exact_local_peak <= PAPER_TRANSITION[1])

    def rows(self) -> list[dict]:
        return [{
            "config": self.config, "n": self.n, "objective": self.objective,
            "worst_delta": self.worst_delta, "local_peak": self.local_peak,
            "exact_local_peak": self.exact_local_peak, "exact_mse_at_peak": self.exact_local_value,
            "exact_global_argmax": self.exact_global_delta, "delta_c": self.critical_delta,
            "peak_in_6_9": self.in_paper_region, "finals": " ".join(f"{x:.2f}" for x in self.finals),
            "seconds": round(self.seconds, 2),
        }]


@partial(jax.jit, static_argnames=("scenario", "surrogate", "part", "steps", "lr"))
def _ascend(starts, lo, hi, sigma, log2_scale, *, scenario, surrogate, part, steps, lr):
    """Projected Adam ascent on the mean surrogate MSE over Δ, vmapped over starting points."""

    def mean_mse(delta):
        return jnp.mean(seed_mses(delta, sigma, log2_scale, scenario=scenario, surrogate=surrogate,
                                   part=part))

    def run(d0):
        opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05), b2=0.9, eps=1e-20)
        # normalise the objective by its starting value so Adam's step is scale-free
        scale = jax.lax.stop_gradient(mean_mse(d0)) + 1e-30

        def loss(d):
            return -mean_mse(d) / scale

        def step(carry, _):
            d, st = carry
            g = jax.grad(loss)(d)
            upd, st = opt.update(g, st, d)
            d = jnp.clip(optax.apply_updates(d, upd), lo, hi)
            return (d, st), d

        (d, _), path = jax.lax.scan(step, (d0, opt.init(d0)), None, length=steps)
        return d, mean_mse(d), path

    return jax.vmap(run)(starts)


#: Largest exact Δ scan :func:`worst_case_delta` runs (points), so that no range a user passes runs unbounded.
MAX_SCAN_POINTS = 4096


def worst_case_delta(config="fwd_s1", n: int = 4096, *, objective: str = "total",
                     delta_range=(4.0, 13.0), starts=None, steps: int = 60, learning_rate: float = 0.3,
                     seeds: int = 4, q_len: int = 32, k_sink: int = 4, sigma: float = 1.0,
                     sigma_v: float = 1.0, surrogate: Surrogate | str | None = None, base_seed: int = 0,
                     grid_step: float = 0.25, refine_step: float = 0.05) -> WorstDeltaResult:
    """Sink strength Δ that maximises the output MSE of ``config``: Adam ascent on the surrogate.

    ``objective``: ``"total"`` (the whole expected MSE) or ``"collapse"`` (Prop. 3's term only,
    Σ_{j∈Z} P_j²/ℓ², the P-collapse part). Ascent starts from every value in ``starts`` (default
    four points spread over ``delta_range``) and is projected onto the range; the best final point
    is refined by an exact scan (±0.5 around it, ``refine_step``), and the exact MSE is also scanned
    over the whole range (``grid_step``) to show whether the local maximum is the global one.
    Compare with Δc = 10 ln 2 + ln S − δk and the paper's transition region Δ ∈ [6, 9].
    """
    cfg = resolve(config)
    check_choice("objective", objective, ("total", "collapse"))
    part = "total" if objective == "total" else "collapse"
    try:
        lo, hi = (check_finite("delta_range", float(x)) for x in delta_range)
    except (TypeError, ValueError):
        raise PcastError(f"delta_range={delta_range!r} must be two numbers (lo, hi)") from None
    if not lo < hi:
        raise PcastError(f"delta_range={delta_range!r} must have lo < hi")
    check_int("steps", steps, min_value=1, max_value=100000)
    check_positive("learning_rate", learning_rate)
    check_positive("grid_step", grid_step)
    check_positive("refine_step", refine_step)
    # every loop a user can size has a bound: the two exact scans are at most MAX_SCAN_POINTS long
    if (hi - lo) / grid_step + 1 > MAX_SCAN_POINTS:
        raise PcastError(f"delta_range={delta_range!r} with grid_step={grid_step!r} is "
                         f"{(hi - lo) / grid_step + 1:.3g} points; at most {MAX_SCAN_POINTS} are scanned "
                         "(narrow delta_range or raise grid_step)")
    if 1.0 / refine_step + 1 > MAX_SCAN_POINTS:
        raise PcastError(f"refine_step={refine_step!r} gives {1.0 / refine_step + 1:.3g} points; at most "
                         f"{MAX_SCAN_POINTS} are scanned")
    sur = as_surrogate(surrogate if surrogate is not None else Surrogate())
    if sur.kind == "exact":
        raise PcastError("surrogate='exact' has no useful gradient; use 'smooth' (or 'ste')")
    if starts is None:
        starts = np.linspace(lo, hi, 6)[1:-1]
    starts = np.atleast_1d(np.asarray(starts, np.float32))
    if starts.size == 0 or not np.all(np.isfinite(starts)):
        raise PcastError(f"starts={starts!r} must be finite numbers")
    starts = np.clip(starts, lo, hi)
    sc = Scenario(config=cfg, n=n, q_len=q_len, k_sink=k_sink, sigma_v=sigma_v, seeds=seeds,
                  base_seed=base_seed)
    check_positive("sigma", sigma)
    t0 = time.perf_counter()
    progress.plan(STEPS)
    progress.stage(f"worst-delta {cfg.name} ({objective}): Adam ascent from {starts.size} starts")
    finals, values, _ = _ascend(jnp.asarray(starts), jnp.float32(lo), jnp.float32(hi), jnp.float32(sigma),
                                jnp.float32(sc.log2_scale), scenario=sc, surrogate=sur, part=part,
                                steps=int(steps), lr=float(learning_rate))
    finals, values = np.asarray(finals, np.float64), np.asarray(values, np.float64)
    best = float(finals[int(np.argmax(values))])
    margin = 1e-3 * (hi - lo)
    interior = (finals > lo + margin) & (finals < hi - margin)
    local = float(finals[interior][int(np.argmax(values[interior]))]) if interior.any() else float("nan")

    def exact(deltas):
        th = theta_points(sc, np.asarray(deltas, np.float64), sigma, None)
        return np.asarray(grid_mses(th, scenario=sc, surrogate=Surrogate(kind="exact"), part=part),
                          np.float64).mean(axis=1)

    progress.stage(f"worst-delta {cfg.name} ({objective}): exact MSE on the Δ grid")
    if math.isfinite(local):
        fine = np.arange(max(lo, local - 0.5), min(hi, local + 0.5) + 1e-9, refine_step)
        fine_vals = exact(fine)
        i = int(np.argmax(fine_vals))
        exact_peak, exact_val = float(fine[i]), float(fine_vals[i])
    else:
        exact_peak = exact_val = float("nan")
    grid = np.arange(lo, hi + 1e-9, grid_step)
    grid_vals = exact(grid)
    if cfg.block_format is not None:  # the block scale's Δc (the analogue of Eq. 7's for block-scaled P)
        dc = float(theory.block_critical_delta(cfg.scale, fmt=cfg.p_format, k_sink=k_sink, sigma=sigma))
    else:
        dc = float(theory.critical_delta(cfg.scale, k_sink=k_sink, sigma=sigma, fmt=cfg.p_format))
    return WorstDeltaResult(
        config=cfg.name, n=n, objective=objective, surrogate=sur.label, delta_range=(lo, hi),
        starts=starts.astype(np.float64), finals=finals, final_values=values, worst_delta=best,
        local_peak=local, exact_local_peak=exact_peak, exact_local_value=exact_val, grid_deltas=grid,
        grid_values=grid_vals, exact_global_delta=float(grid[int(np.argmax(grid_vals))]), critical_delta=dc,
        seconds=time.perf_counter() - t0)
