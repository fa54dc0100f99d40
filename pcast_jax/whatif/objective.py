"""The differentiable objective: a kernel config on the sweep's draws, and its expected P-cast MSE.

:class:`Scenario` fixes the config and the workload; :func:`expected_mse` gives the per-seed
expected MSE σ_V² Σ(W − P)² at (Δ, σ, log2 S) through a cast surrogate (differentiable in all
three), :func:`mse_and_grad` its seed mean and gradient with standard errors, and
:func:`expected_mse_scores` the same for given score matrices (real traces). The underscored
helpers (the jitted per-point evaluator and the point grids) are shared with the analyses of
this package.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import engine as _engine
from pcast_jax.config import COMPUTED_SCALE_MODES, KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int, check_positive
from pcast_jax.presets import resolve
from pcast_jax.stats import mean_sem
from pcast_jax.sweep import instance_key
from pcast_jax.whatif.surrogates import PARTS, Surrogate, as_surrogate, make_cast_fn
from pcast_jax.workloads import SinkWorkload, make_instance

__all__ = ["PARAMS", "Scenario", "expected_mse", "mse_and_grad", "expected_mse_scores"]

PARAMS = ("delta", "sigma", "log2_scale")


def static_config(config) -> KernelConfig:
    """The config the differentiable path runs: same order/blocks, multiply mode with S = 1."""
    cfg = resolve(config)
    if cfg.scale_mode in COMPUTED_SCALE_MODES:
        raise PcastError(f"config={cfg.name!r} has scale_mode={cfg.scale_mode!r}: the what-if path needs a "
                         "static scale (compare dynamic scales with dynamic_vs_static)")
    if cfg.accumulator != "f32" or cfg.qkv != "f32" or cfg.mma_acc_bits:
        raise PcastError(f"config={cfg.name!r}: the expected MSE covers the P-cast only; accumulator "
                         f"must be 'f32' (got {cfg.accumulator!r}), qkv 'f32' (got {cfg.qkv!r}) and "
                         f"mma_acc_bits 0 (got {cfg.mma_acc_bits})")
    return cfg.replace(scale=1.0, scale_mode="multiply", name=cfg.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """A kernel config on a synthetic sink workload: the static part of every what-if evaluation.

    The draws of seed i are the sweep's (``instance_key(base_seed, n, seed_offset + i)``); Δ, σ and
    log2 S are the differentiable parameters. The config's own S is the default log2 S.

    Attributes:
      config: preset name or KernelConfig with a static scale (multiply or exponent mode).
      n, q_len, k_sink, sink_positions: the workload (:class:`~pcast_jax.workloads.SinkWorkload`).
      sigma_v: standard deviation of V (scales the MSE by σ_V²).
      seeds, seed_offset, base_seed: which draws (as in :class:`~pcast_jax.sweep.SweepSpec`).
      batch_size: seeds per vmapped batch inside the jit (memory bound; results agree to float32
        rounding whatever it is).
    """

    config: Any = "fwd_s1"
    n: int = 4096
    q_len: int = 32
    k_sink: int = 4
    sink_positions: tuple | None = None
    sigma_v: float = 1.0
    seeds: int = 8
    seed_offset: int = 0
    base_seed: int = 0
    batch_size: int | None = None

    def __post_init__(self):
        cfg = resolve(self.config)
        static_config(cfg)
        object.__setattr__(self, "config", cfg)
        check_int("seeds", self.seeds, min_value=1, max_value=1 << 20)
        check_int("seed_offset", self.seed_offset, min_value=0)
        check_int("base_seed", self.base_seed, min_value=0, max_value=2**31 - 1)
        check_positive("sigma_v", self.sigma_v)
        self.workload()  # validates n, q_len, k_sink, sink_positions
        if self.batch_size is None:
            per_seed = self.q_len * self.n
            object.__setattr__(self, "batch_size", int(max(1, min(self.seeds, (1 << 21) // per_seed))))
        else:
            check_int("batch_size", self.batch_size, min_value=1)

    def workload(self) -> SinkWorkload:
        return SinkWorkload(n=self.n, q_len=self.q_len, d=1, k_sink=self.k_sink,
                            sink_positions=self.sink_positions, sigma=1.0, sigma_v=self.sigma_v)

    @property
    def log2_scale(self) -> float:
        return float(self.config.log2_scale)

    def seed_indices(self) -> jnp.ndarray:
        return jnp.asarray(np.arange(self.seeds, dtype=np.uint32) + np.uint32(self.seed_offset))

    def replace(self, **kw) -> "Scenario":
        """A copy with fields changed (the batch size is re-derived unless given)."""
        kw.setdefault("batch_size", None)
        return dataclasses.replace(self, **kw)


def check_param_value(name, value):
    """Concrete values are validated; traced ones pass (they come from a grad or an optimizer)."""
    if isinstance(value, jax.core.Tracer):
        return value
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise PcastError(f"{name}={value!r} must be finite")
    if name == "sigma" and np.any(arr <= 0):
        raise PcastError(f"sigma={value!r} must be > 0")
    if name == "log2_scale" and np.any(np.abs(arr) > 100):
        raise PcastError(f"log2_scale={value!r} must lie in [-100, 100]")
    return value


def _row_mse(scores, log2_scale, *, cfg, surrogate, part, fmt, overflow, sigma_v):
    """σ_V² · mean over rows of Σ_j (W_j − P_j)² for one (q_len, N) score matrix."""
    fn = make_cast_fn(surrogate, jnp.exp2(log2_scale), fmt=fmt, overflow=overflow, part=part)
    w = _engine.effective_weights(scores, cfg, cast_fn=fn)
    p = _engine.reference_probs(scores, causal=cfg.causal)
    return sigma_v**2 * jnp.mean(jnp.sum(jnp.square(w - p), axis=-1))


def _per_seed(theta, *, scenario: Scenario, surrogate: Surrogate, part: str, with_grad: bool = False):
    """Per-seed expected MSE (seeds,) at θ = (Δ, σ, log2 S) [and per-seed gradients (seeds, 3)].

    Traceable (no jit of its own): seeds are drawn inside and processed by ``lax.map`` in vmapped
    batches of ``scenario.batch_size``.
    """
    cfg = static_config(scenario.config)
    work = scenario.workload()
    orig = scenario.config

    def one(seed):
        inst = make_instance(instance_key(scenario.base_seed, scenario.n, seed), work, 0.0)

        def f(th):
            scores = th[1] * inst.scores + jnp.where(inst.is_sink, th[0], 0.0)
            return _row_mse(scores, th[2], cfg=cfg, surrogate=surrogate, part=part, fmt=orig.p_format,
                            overflow=orig.overflow, sigma_v=scenario.sigma_v)

        return jax.value_and_grad(f)(theta) if with_grad else f(theta)

    return jax.lax.map(one, scenario.seed_indices(), batch_size=scenario.batch_size)


def seed_mses(delta, sigma, log2_scale, *, scenario, surrogate, part):
    """Traceable (seeds,) values at scalar Δ, σ, log2 S."""
    theta = jnp.stack([jnp.asarray(delta, jnp.float32), jnp.asarray(sigma, jnp.float32),
                       jnp.asarray(log2_scale, jnp.float32)])
    return _per_seed(theta, scenario=scenario, surrogate=surrogate, part=part)


@partial(jax.jit, static_argnames=("scenario", "surrogate", "part", "with_grad"))
def _point(theta, *, scenario, surrogate, part, with_grad=False):
    """One point θ (3,) → (seeds,) values [and (seeds, 3) gradients]; compiled once per setting."""
    return _per_seed(theta, scenario=scenario, surrogate=surrogate, part=part, with_grad=with_grad)


def grid_mses(thetas, *, scenario, surrogate, part, with_grad=False):
    """(P, 3) points → (P, seeds) values [and (P, seeds, 3) gradients].

    One compiled function per setting whatever P is (points are visited one call at a time;
    seeds are vectorised inside each call).
    """
    outs = [_point(th, scenario=scenario, surrogate=surrogate, part=part, with_grad=with_grad)
            for th in jnp.asarray(thetas, jnp.float32)]
    if with_grad:
        return jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs])
    return jnp.stack(outs)


def theta_points(scenario: Scenario, delta, sigma, log2_scale) -> jnp.ndarray:
    """Validated (P, 3) array of points from scalars or 1-D arrays (broadcast together)."""
    log2_scale = scenario.log2_scale if log2_scale is None else log2_scale
    for name, v in (("delta", delta), ("sigma", sigma), ("log2_scale", log2_scale)):
        check_param_value(name, v)
    try:
        d, s, l2 = np.broadcast_arrays(*(np.asarray(v, np.float32) for v in (delta, sigma, log2_scale)))
    except ValueError:
        raise PcastError("delta, sigma and log2_scale must broadcast to one shape") from None
    if d.ndim > 1:
        raise PcastError(f"delta, sigma, log2_scale must be scalars or 1-D (got shape {d.shape})")
    return jnp.asarray(np.stack([np.atleast_1d(d), np.atleast_1d(s), np.atleast_1d(l2)], axis=-1))


def expected_mse(scenario: Scenario, *, delta=7.0, sigma=1.0, log2_scale=None,
                 surrogate: Surrogate | str = "exact", part: str = "total"):
    """Per-seed expected MSE at (Δ, σ, log2 S): shape (seeds,), or (P, seeds) for 1-D inputs.

    ``log2_scale`` defaults to the config's S. ``part``: ``"total"``, ``"collapse"`` (Prop. 3's
    Σ_{j∈Z} P_j²/ℓ² term) or ``"noise"`` (the rest). With ``surrogate="exact"`` the values equal
    the sweep's ``mse_expected`` on the same seeds. Traced scalar inputs (inside jax.grad or jit)
    are passed through, so this is differentiable in Δ, σ and log2 S.
    """
    if not isinstance(scenario, Scenario):
        raise PcastError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    sur = as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    if any(isinstance(v, jax.core.Tracer) for v in (delta, sigma, log2_scale)):
        l2 = scenario.log2_scale if log2_scale is None else log2_scale
        return seed_mses(delta, sigma, l2, scenario=scenario, surrogate=sur, part=part)
    scalar = all(np.ndim(v) == 0 for v in (delta, sigma, log2_scale))
    out = grid_mses(theta_points(scenario, delta, sigma, log2_scale), scenario=scenario, surrogate=sur, part=part)
    return out[0] if scalar else out


def mse_and_grad(scenario: Scenario, *, delta=7.0, sigma=1.0, log2_scale=None,
                 surrogate: Surrogate | str = "smooth", part: str = "total") -> dict:
    """Mean expected MSE over seeds and its gradient w.r.t. Δ, σ, log2 S (with seed spread).

    Returns a dict: ``value`` (mean), ``value_sem``, ``grad`` {param: mean}, ``grad_sem``
    {param: standard error over seeds}, ``per_seed`` (values) and ``per_seed_grad`` (seeds, 3).
    """
    if not isinstance(scenario, Scenario):
        raise PcastError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    sur = as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    for name, v in (("delta", delta), ("sigma", sigma), ("log2_scale", log2_scale)):
        if np.ndim(v) != 0:
            raise PcastError(f"{name} must be a scalar here (got shape {np.shape(v)})")
    vals, grads = grid_mses(theta_points(scenario, delta, sigma, log2_scale), scenario=scenario, surrogate=sur,
                        part=part, with_grad=True)
    vals, grads = np.asarray(vals[0], np.float64), np.asarray(grads[0], np.float64)
    value, value_sem = mean_sem(vals)
    per_param = [mean_sem(grads[:, i]) for i in range(len(PARAMS))]
    return {
        "value": value, "value_sem": value_sem,
        "grad": {p: per_param[i][0] for i, p in enumerate(PARAMS)},
        "grad_sem": {p: per_param[i][1] for i, p in enumerate(PARAMS)},
        "per_seed": vals, "per_seed_grad": grads,
    }


@partial(jax.jit, static_argnames=("config", "surrogate", "part", "sigma_v", "batch_size"))
def scores_mses(log2_scale, scores, *, config, surrogate, part, sigma_v, batch_size):
    cfg = static_config(config)

    def one(s):
        return _row_mse(s, log2_scale, cfg=cfg, surrogate=surrogate, part=part, fmt=config.p_format,
                        overflow=config.overflow, sigma_v=sigma_v)

    return jax.lax.map(one, scores, batch_size=batch_size)


def check_scores(scores) -> jnp.ndarray:
    try:
        arr = np.asarray(scores, dtype=np.float32)
    except (TypeError, ValueError):
        raise PcastError("scores must be a real array shaped (q_len, N) or (batch, q_len, N)") from None
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or 0 in arr.shape:
        raise PcastError(f"scores.shape={np.shape(scores)} must be (q_len, N) or (batch, q_len, N)")
    if np.isnan(arr).any() or np.isposinf(arr).any():
        raise PcastError("scores contain NaN or +inf: logits must be finite (-inf marks a masked key)")
    if not np.all(np.any(np.isfinite(arr), axis=-1)):
        raise PcastError("scores: a query row has every key masked (-inf)")
    return jnp.asarray(arr)


def expected_mse_scores(scores, *, config="fwd_s1", log2_scale=None, surrogate="exact",
                        part="total", sigma_v=1.0, batch_size=None):
    """Per-instance expected MSE (batch,) for given scores (real traces), differentiable in log2 S.

    ``scores``: (q_len, N) or (batch, q_len, N) logits with the softmax scale applied.
    """
    cfg = resolve(config)
    static_config(cfg)
    sur = as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    s = check_scores(scores)
    log2_scale = cfg.log2_scale if log2_scale is None else log2_scale
    check_param_value("log2_scale", log2_scale)
    check_positive("sigma_v", sigma_v)
    if batch_size is None:
        batch_size = int(max(1, min(s.shape[0], (1 << 21) // (s.shape[1] * s.shape[2]))))
    check_int("batch_size", batch_size, min_value=1)
    return scores_mses(jnp.float32(log2_scale), s, config=cfg, surrogate=sur, part=part,
                        sigma_v=float(sigma_v), batch_size=int(batch_size))
