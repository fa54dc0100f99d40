"""Checking the surrogate gradients against central finite differences of the exact simulator.

:func:`validate_gradients` evaluates, on the same seeds, the exact expected MSE on both sides of
each point and every surrogate's value, analytic gradient and own finite difference, and says
where a surrogate's gradient can be trusted.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pcast_jax.errors import PcastError, check_choice, check_positive
from pcast_jax.stats import mean_sem, sem
from pcast_jax.whatif import progress
from pcast_jax.whatif.objective import PARAMS, Scenario, check_param_value, grid_mses
from pcast_jax.whatif.surrogates import Surrogate, as_surrogate

__all__ = ["validate_gradients"]


def progress_steps(surrogates=None) -> int:
    """Progress steps of one :func:`validate_gradients` call with these ``surrogates`` (default: two)."""
    return 1 + (2 if surrogates is None else len(tuple(surrogates)))


def validate_gradients(scenario: Scenario, *, param: str = "delta", points=None, step=None,
                       surrogates=None, base: dict | None = None, rel_tol: float = 0.25) -> list[dict]:
    """Surrogate gradients vs central finite differences of the exact simulator (same seeds).

    For each point θ0 of ``param``: the exact mean MSE and its central difference
    [f(θ0 + h) − f(θ0 − h)]/2h per seed (common random numbers, so the seed-to-seed noise of the
    difference is small), and for every surrogate its value, its analytic gradient at θ0 and its own
    central difference with the same h. A gradient is called trustworthy where its sign agrees with
    the exact difference, the exact difference is resolved (|FD| > 2 SEM) and the relative error is
    within ``rel_tol``.

    For ``param="log2_scale"`` the default step is h = 0.5 at half-integer points, so both ends are
    powers of two: the exact MSE is jagged in S between E4M3-representable values (the atoms at
    P = 1), and this octave secant is the only slope that has a meaning for it. Compare it with
    surrogates that use ``atoms="representable"`` (the default then): with exact atoms the
    surrogate's gradient at a non-representable S is the atom's rounding error, not the trend.
    """
    if not isinstance(scenario, Scenario):
        raise PcastError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    check_choice("param", param, PARAMS)
    check_positive("rel_tol", rel_tol)
    if points is None:
        points = {"delta": np.arange(4.0, 13.01, 1.0), "sigma": np.array([0.8, 1.0, 1.2]),
                  "log2_scale": np.arange(0.5, 9.0, 1.0)}[param]
    points = np.atleast_1d(np.asarray(points, np.float64))
    if points.size == 0:
        raise PcastError("points must hold at least one value")
    if step is None:
        step = {"delta": 0.25, "sigma": 0.05, "log2_scale": 0.5}[param]
    step = check_positive("step", step)
    if surrogates is None:
        atoms = "representable" if param == "log2_scale" else "exact"
        surrogates = (Surrogate(atoms=atoms), "ste")
    surrogates = tuple(as_surrogate(s) for s in surrogates)
    base = {"delta": 7.0, "sigma": 1.0, "log2_scale": scenario.log2_scale, **(base or {})}
    for k in base:
        check_choice("base", k, PARAMS)
    idx = PARAMS.index(param)
    center = np.array([base["delta"], base["sigma"], base["log2_scale"]], np.float64)
    pts = np.repeat(center[None], len(points), axis=0)
    pts[:, idx] = points
    shifted = np.concatenate([pts, pts, pts])
    shifted[: len(points), idx] -= step
    shifted[len(points): 2 * len(points), idx] += step
    for row in shifted:
        for name, v in zip(PARAMS, row):
            check_param_value(name, float(v))
    shifted_j = jnp.asarray(shifted, jnp.float32)
    exact = Surrogate(kind="exact")
    progress.plan(progress_steps(surrogates))
    progress.stage(f"validate d/d{param}: exact finite differences at {len(points)} points")
    ev = np.asarray(grid_mses(shifted_j, scenario=scenario, surrogate=exact, part="total"), np.float64)
    lo, hi, mid = np.split(ev, 3)
    fd_seed = (hi - lo) / (2 * step)  # (P, seeds)
    fd, fd_sem = mean_sem(fd_seed, axis=1)
    rows = []
    for sur in surrogates:
        progress.stage(f"validate d/d{param}: surrogate {sur.label}")
        vals, grads = grid_mses(jnp.asarray(pts, jnp.float32), scenario=scenario, surrogate=sur, part="total",
                            with_grad=True)
        vals, grads = np.asarray(vals, np.float64), np.asarray(grads, np.float64)[..., idx]
        # the program that gave the gradients gives the values too: one compilation per surrogate, not two
        sv = np.asarray(grid_mses(shifted_j[: 2 * len(points)], scenario=scenario, surrogate=sur, part="total",
                              with_grad=True)[0], np.float64)
        own = ((sv[len(points):] - sv[: len(points)]) / (2 * step)).mean(axis=1)
        for i, x0 in enumerate(points):
            ex_mean = float(mid[i].mean())
            grad = float(grads[i].mean())
            f, fs = float(fd[i]), float(fd_sem[i])
            rel = (grad - f) / abs(f) if f != 0 else float("inf")
            resolved = bool(abs(f) > 2 * fs) if np.isfinite(fs) else True
            sign_ok = bool(np.sign(grad) == np.sign(f))
            rows.append({
                "config": scenario.config.name, "n": scenario.n, "param": param, "point": float(x0),
                "step": step, "surrogate": sur.label, "exact_mse": ex_mean, "surrogate_mse": float(vals[i].mean()),
                "value_rel_err": float(vals[i].mean()) / ex_mean - 1.0,
                "exact_fd": f, "exact_fd_sem": fs, "surrogate_grad": grad,
                "surrogate_grad_sem": sem(grads[i]),
                "surrogate_own_fd": float(own[i]), "grad_rel_err": rel, "sign_agrees": sign_ok,
                "resolved": resolved, "trustworthy": bool(sign_ok and resolved and abs(rel) <= rel_tol),
            })
    return rows
