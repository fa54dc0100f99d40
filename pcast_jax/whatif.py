"""Differentiable what-if analyses of the P-cast: surrogates of the FP8 cast, jax.grad and optax.

The quantity every analysis works on is the expected per-dimension output error given the scores,

    MSE(Δ, σ, log2 S) = σ_V² · mean_rows Σ_j (W_j − P_j)²        (Prop. 3 / Eq. (8), V i.i.d.)

with W the kernel's effective weights (:func:`pcast_jax.engine.effective_weights`) and P the exact
softmax: the same number the sweep reports as ``mse_expected``. The scores are drawn exactly as the
sweep draws them (same PRNG keys, common random numbers across Δ, σ and S), so a what-if value at
a point equals the sweep's. The cast of Alg. 1 line 9 is pluggable (``cast_fn`` of the engine):

* ``"exact"`` — the real E4M3 cast. Piecewise constant: its gradient is useless (zero a.e.), only
  finite differences over many seeds see the slope.
* ``"ste"`` — straight-through estimator: forward the exact cast, backward identity (zero beyond
  ±max, where the satfinite clip acts).
* ``"smooth"`` — the cast replaced by its expected squared error per element, x = P·S:
  e(x) = (1 − g(x))·x² + g(x)·(LSB(x)²/12 + relu(x − max)²), with a soft underflow gate
  g = sigmoid((ln x − ln 2^-10)/τ) at the round-to-zero boundary (P = 2^-10/S, Prop. 1) and a
  local LSB that is either smooth in x (``lsb_mode="mean"``: κ·x with κ the binade-averaged
  LSB/x, floored at the subnormal step) or a soft staircase 2^(⌊log2 x⌋_τ − 3)
  (``lsb_mode="staircase"``, which keeps the dp(S) sawtooth of §5). The entries with P = 1
  exactly (the row maximum of a block that set the running max) are atoms, not a continuum:
  ``atoms="exact"`` gives them their exact rounding error (cast(S) − S)², ``"representable"``
  assumes S itself is an E4M3 value (only saturation counts). The engine receives
  y = x − √e(x), so (W − P)² carries exactly e(x) per element.

All evaluators are jit-compiled, vectorised over seeds (``lax.map`` in vmapped batches, no Python
loop over seeds) and differentiable in Δ, σ and log2 S. Analyses: :func:`validate_gradients`,
:func:`worst_case_delta`, :func:`optimal_scale`, :func:`calibrate_prop3`,
:func:`dynamic_vs_static`; :func:`report` runs all of them for the reproduction report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcast_jax import engine as _engine
from pcast_jax import formats, theory
from pcast_jax.config import KernelConfig, resolve
from pcast_jax.errors import PcastError, check_choice, check_finite, check_int, check_positive
from pcast_jax.sweep import SweepSpec, instance_key, run_sweep
from pcast_jax.workloads import SinkWorkload, make_instance

__all__ = [
    "CAST_KINDS",
    "LSB_MODES",
    "ATOM_MODES",
    "PARTS",
    "PARAMS",
    "PAPER_TRANSITION",
    "Surrogate",
    "Scenario",
    "expected_squared_error",
    "make_cast_fn",
    "expected_mse",
    "expected_mse_scores",
    "mse_and_grad",
    "validate_gradients",
    "worst_case_delta",
    "optimal_scale",
    "calibrate_prop3",
    "dynamic_vs_static",
    "report",
    "markdown_table",
    "MODELS",
    "WorstDeltaResult",
    "OptimalScaleResult",
    "Prop3Calibration",
    "DynamicComparison",
    "WhatIfReport",
]

CAST_KINDS = ("exact", "ste", "smooth")
LSB_MODES = ("mean", "staircase")
ATOM_MODES = ("exact", "representable")
PARTS = ("total", "collapse", "noise")
PARAMS = ("delta", "sigma", "log2_scale")
#: The paper's transition region (§1.2, §3.4, Fig. 2): P-collapse matters for Δ ≈ 6–9.
PAPER_TRANSITION = (6.0, 9.0)
_TINY = 1e-30  # keeps √e differentiable where e = 0 (f32 normal, far below any real error²)


# --------------------------------------------------------------------------------------------
# Surrogates of the cast
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Surrogate:
    """How line 9's cast is replaced (module docstring).

    Attributes:
      kind: ``"exact"``, ``"ste"`` or ``"smooth"``.
      gate_temperature: τ of the soft underflow gate sigmoid((ln x − ln 2^-10)/τ), in units of
        ln P — i.e. of the scores: the gate smooths the threshold of Eq. (6) over ±τ.
      lsb_mode: ``"mean"`` (LSB ∝ x, no sawtooth) or ``"staircase"`` (soft ⌊log2 x⌋).
      lsb_temperature: width of the soft staircase steps, in binades (staircase only).
      atoms: ``"exact"`` or ``"representable"`` treatment of the P = 1 entries (smooth only).
    """

    kind: str = "smooth"
    gate_temperature: float = 0.2
    lsb_mode: str = "mean"
    lsb_temperature: float = 0.05
    atoms: str = "exact"

    def __post_init__(self):
        check_choice("kind", self.kind, CAST_KINDS)
        check_positive("gate_temperature", self.gate_temperature)
        check_choice("lsb_mode", self.lsb_mode, LSB_MODES)
        check_positive("lsb_temperature", self.lsb_temperature)
        check_choice("atoms", self.atoms, ATOM_MODES)
        if self.gate_temperature > 5 or self.lsb_temperature > 0.5:
            raise PcastError(f"gate_temperature={self.gate_temperature} must be <= 5 and "
                             f"lsb_temperature={self.lsb_temperature} <= 0.5 (a surrogate, not a blur)")

    @property
    def label(self) -> str:
        if self.kind != "smooth":
            return self.kind
        lsb = "mean" if self.lsb_mode == "mean" else f"staircase {self.lsb_temperature:g}"
        return f"smooth(lsb {lsb}, gate {self.gate_temperature:g}, atoms {self.atoms})"


def _as_surrogate(surrogate) -> Surrogate:
    if isinstance(surrogate, Surrogate):
        return surrogate
    if isinstance(surrogate, str):
        check_choice("surrogate", surrogate, CAST_KINDS)
        return Surrogate(kind=surrogate)
    raise PcastError(f"surrogate={surrogate!r} must be one of {CAST_KINDS} or a Surrogate")


def _soft_floor(y, temperature):
    """⌊y⌋ smoothed over ±temperature around each integer; exact on half-integers, C¹."""
    yy = y - 0.5
    n = jnp.floor(yy)
    r = yy - n  # in [0, 1)
    lo, hi = jax.nn.sigmoid(-0.5 / temperature), jax.nn.sigmoid(0.5 / temperature)
    s = (jax.nn.sigmoid((r - 0.5) / temperature) - lo) / (hi - lo)
    return n + s


def _fmt_consts(fmt):
    f = formats.get_format(fmt)
    emin = round(math.log2(f.smallest_normal))  # −6 for E4M3
    top = math.floor(math.log2(f.max))  # 8 for E4M3: top binade [256, 512) ∩ [0, 448]
    # κ: E[LSB²] = κ² E[x²] for x log-uniform within a binade, E[x²] = 4^n (4 − 1)/ln 4.
    kappa = 2.0 ** -f.mantissa_bits * math.sqrt(math.log(4.0) / 3.0)
    return f, emin, top, kappa


def expected_squared_error(x, *, surrogate: Surrogate | str = "smooth", fmt="e4m3"):
    """(collapse, noise) parts of the smooth surrogate's E[(cast(x) − x)²] for x = P·S ≥ 0.

    collapse = (1 − g)·x² (the values lost to underflow, Prop. 1 smoothed), noise =
    g·(LSB(x)²/12 + relu(x − max)²) (round-to-nearest noise of a value uniform in its cell, and
    the satfinite clip above max). Elementwise; differentiable in x. Atoms (P = 1) are handled by
    :func:`make_cast_fn`, not here.
    """
    sur = _as_surrogate(surrogate)
    f, emin, top, kappa = _fmt_consts(fmt)
    x = jnp.asarray(x)
    pos = x > 0
    xs = jnp.where(pos, x, 1.0)
    gate = jnp.where(pos, jax.nn.sigmoid((jnp.log(xs) - math.log(f.round_to_zero)) / sur.gate_temperature), 0.0)
    xc = jnp.minimum(xs, f.max)
    if sur.lsb_mode == "mean":
        sub = f.smallest_subnormal
        # soft max(sub, κ x) as a 4-norm: within 10 % of the true LSB² at the normal/subnormal seam
        lsb2 = jnp.sqrt(sub**4 + (kappa * xc) ** 4)
    else:
        expo = jnp.clip(_soft_floor(jnp.log2(xc), sur.lsb_temperature), emin, top)
        lsb2 = jnp.exp2(2.0 * (expo - f.mantissa_bits))
    over = jnp.maximum(x - f.max, 0.0)
    noise = gate * (lsb2 / 12.0 + over * over)
    collapse = (1.0 - gate) * x * x
    return collapse, noise


def make_cast_fn(surrogate: Surrogate | str, scale, *, fmt="e4m3", overflow="satfinite", part="total"):
    """A ``cast_fn`` for :func:`pcast_jax.engine.effective_weights` with P-scale ``scale``.

    The engine is run with S = 1, so ``cast_fn`` receives P itself; it returns what stands in for
    cast(P·S)/S (the P-domain value the kernel multiplies V by). ``scale`` may be traced.

    ``part`` restricts the error to the collapse (underflowed values) or the noise (everything else)
    so that Σ(W − P)² splits as Prop. 3's term plus the quantization floor (exact and smooth kinds).
    """
    sur = _as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    if sur.kind == "ste" and part != "total":
        raise PcastError(f"part={part!r} needs kind 'exact' or 'smooth' (the STE has no split)")
    f = formats.get_format(fmt)
    check_choice("overflow", overflow, formats.OVERFLOW_MODES)

    def exact(x):
        return formats.cast(x, f, overflow=overflow)

    def split_exact(x, c):
        if part == "total":
            return c
        lost = (c == 0) & (x > 0)
        return jnp.where(lost, 0.0, x) if part == "collapse" else jnp.where(lost, x, c)

    def fn(p):
        s = jnp.asarray(scale, jnp.float32)
        x = p * s
        if sur.kind == "exact":
            return split_exact(x, exact(x)) / s
        if sur.kind == "ste":
            xc = jnp.clip(x, -f.max, f.max)
            return (xc + jax.lax.stop_gradient(exact(x) - xc)) / s
        collapse, noise = expected_squared_error(x, surrogate=sur, fmt=f)
        err = {"total": collapse + noise, "collapse": collapse, "noise": noise}[part]
        c = jax.lax.stop_gradient(exact(x))
        if sur.atoms == "exact":
            d = c - x
            atom_lost = (c == 0) & (x > 0)
            atom = {"total": d * d, "collapse": jnp.where(atom_lost, x * x, 0.0),
                    "noise": jnp.where(atom_lost, 0.0, d * d)}[part]
        else:
            over = jnp.maximum(x - f.max, 0.0)
            atom = over * over if part != "collapse" else jnp.zeros_like(x)
        err = jnp.where(p == 1.0, atom, err)
        return (x - jnp.sqrt(err + _TINY)) / s

    return fn


# --------------------------------------------------------------------------------------------
# The differentiable expected MSE
# --------------------------------------------------------------------------------------------


def _static_config(config) -> KernelConfig:
    """The config the differentiable path runs: same order/blocks, multiply mode with S = 1."""
    cfg = resolve(config)
    if cfg.scale_mode == "dynamic":
        raise PcastError(f"config={cfg.name!r} has scale_mode='dynamic': the what-if path needs a "
                         "static scale (compare dynamic scales with dynamic_vs_static)")
    if cfg.accumulator != "f32" or cfg.qkv != "f32":
        raise PcastError(f"config={cfg.name!r}: the expected MSE covers the P-cast only; accumulator "
                         f"must be 'f32' (got {cfg.accumulator!r}) and qkv 'f32' (got {cfg.qkv!r})")
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
        _static_config(cfg)
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


def _check_param_value(name, value):
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
    cfg = _static_config(scenario.config)
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


def _seed_mses(delta, sigma, log2_scale, *, scenario, surrogate, part):
    """Traceable (seeds,) values at scalar Δ, σ, log2 S."""
    theta = jnp.stack([jnp.asarray(delta, jnp.float32), jnp.asarray(sigma, jnp.float32),
                       jnp.asarray(log2_scale, jnp.float32)])
    return _per_seed(theta, scenario=scenario, surrogate=surrogate, part=part)


@partial(jax.jit, static_argnames=("scenario", "surrogate", "part", "with_grad"))
def _point(theta, *, scenario, surrogate, part, with_grad=False):
    """One point θ (3,) → (seeds,) values [and (seeds, 3) gradients]; compiled once per setting."""
    return _per_seed(theta, scenario=scenario, surrogate=surrogate, part=part, with_grad=with_grad)


def _grid(thetas, *, scenario, surrogate, part, with_grad=False):
    """(P, 3) points → (P, seeds) values [and (P, seeds, 3) gradients].

    One compiled function per setting whatever P is (points are visited one call at a time;
    seeds are vectorised inside each call).
    """
    outs = [_point(th, scenario=scenario, surrogate=surrogate, part=part, with_grad=with_grad)
            for th in jnp.asarray(thetas, jnp.float32)]
    if with_grad:
        return jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs])
    return jnp.stack(outs)


def _thetas(scenario: Scenario, delta, sigma, log2_scale) -> jnp.ndarray:
    """Validated (P, 3) array of points from scalars or 1-D arrays (broadcast together)."""
    log2_scale = scenario.log2_scale if log2_scale is None else log2_scale
    for name, v in (("delta", delta), ("sigma", sigma), ("log2_scale", log2_scale)):
        _check_param_value(name, v)
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
    sur = _as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    if any(isinstance(v, jax.core.Tracer) for v in (delta, sigma, log2_scale)):
        l2 = scenario.log2_scale if log2_scale is None else log2_scale
        return _seed_mses(delta, sigma, l2, scenario=scenario, surrogate=sur, part=part)
    scalar = all(np.ndim(v) == 0 for v in (delta, sigma, log2_scale))
    out = _grid(_thetas(scenario, delta, sigma, log2_scale), scenario=scenario, surrogate=sur, part=part)
    return out[0] if scalar else out


def mse_and_grad(scenario: Scenario, *, delta=7.0, sigma=1.0, log2_scale=None,
                 surrogate: Surrogate | str = "smooth", part: str = "total") -> dict:
    """Mean expected MSE over seeds and its gradient w.r.t. Δ, σ, log2 S (with seed spread).

    Returns a dict: ``value`` (mean), ``value_sem``, ``grad`` {param: mean}, ``grad_sem``
    {param: standard error over seeds}, ``per_seed`` (values) and ``per_seed_grad`` (seeds, 3).
    """
    if not isinstance(scenario, Scenario):
        raise PcastError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    sur = _as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    for name, v in (("delta", delta), ("sigma", sigma), ("log2_scale", log2_scale)):
        if np.ndim(v) != 0:
            raise PcastError(f"{name} must be a scalar here (got shape {np.shape(v)})")
    vals, grads = _grid(_thetas(scenario, delta, sigma, log2_scale), scenario=scenario, surrogate=sur,
                        part=part, with_grad=True)
    vals, grads = np.asarray(vals[0], np.float64), np.asarray(grads[0], np.float64)
    k = len(vals)
    sem = (lambda a: float(np.std(a, ddof=1) / math.sqrt(k)) if k > 1 else float("nan"))
    return {
        "value": float(np.mean(vals)), "value_sem": sem(vals),
        "grad": {p: float(np.mean(grads[:, i])) for i, p in enumerate(PARAMS)},
        "grad_sem": {p: sem(grads[:, i]) for i, p in enumerate(PARAMS)},
        "per_seed": vals, "per_seed_grad": grads,
    }


@partial(jax.jit, static_argnames=("config", "surrogate", "part", "sigma_v", "batch_size"))
def _scores_mses(log2_scale, scores, *, config, surrogate, part, sigma_v, batch_size):
    cfg = _static_config(config)

    def one(s):
        return _row_mse(s, log2_scale, cfg=cfg, surrogate=surrogate, part=part, fmt=config.p_format,
                        overflow=config.overflow, sigma_v=sigma_v)

    return jax.lax.map(one, scores, batch_size=batch_size)


def _check_scores(scores) -> jnp.ndarray:
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
    _static_config(cfg)
    sur = _as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    s = _check_scores(scores)
    log2_scale = cfg.log2_scale if log2_scale is None else log2_scale
    _check_param_value("log2_scale", log2_scale)
    check_positive("sigma_v", sigma_v)
    if batch_size is None:
        batch_size = int(max(1, min(s.shape[0], (1 << 21) // (s.shape[1] * s.shape[2]))))
    check_int("batch_size", batch_size, min_value=1)
    return _scores_mses(jnp.float32(log2_scale), s, config=cfg, surrogate=sur, part=part,
                        sigma_v=float(sigma_v), batch_size=int(batch_size))


# --------------------------------------------------------------------------------------------
# Validation of the surrogate gradients against finite differences of the exact simulator
# --------------------------------------------------------------------------------------------


def _theta(base: dict, param: str, value):
    t = dict(base)
    t[param] = value
    return t


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
    surrogates = tuple(_as_surrogate(s) for s in surrogates)
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
            _check_param_value(name, float(v))
    shifted_j = jnp.asarray(shifted, jnp.float32)
    exact = Surrogate(kind="exact")
    ev = np.asarray(_grid(shifted_j, scenario=scenario, surrogate=exact, part="total"), np.float64)
    lo, hi, mid = np.split(ev, 3)
    fd_seed = (hi - lo) / (2 * step)  # (P, seeds)
    k = fd_seed.shape[1]
    fd = fd_seed.mean(axis=1)
    fd_sem = fd_seed.std(axis=1, ddof=1) / math.sqrt(k) if k > 1 else np.full(len(points), np.nan)
    rows = []
    for sur in surrogates:
        vals, grads = _grid(jnp.asarray(pts, jnp.float32), scenario=scenario, surrogate=sur, part="total",
                            with_grad=True)
        vals, grads = np.asarray(vals, np.float64), np.asarray(grads, np.float64)[..., idx]
        sv = np.asarray(_grid(shifted_j[: 2 * len(points)], scenario=scenario, surrogate=sur, part="total"),
                        np.float64)
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
                "surrogate_grad_sem": float(grads[i].std(ddof=1) / math.sqrt(k)) if k > 1 else float("nan"),
                "surrogate_own_fd": float(own[i]), "grad_rel_err": rel, "sign_agrees": sign_ok,
                "resolved": resolved, "trustworthy": bool(sign_ok and resolved and abs(rel) <= rel_tol),
            })
    return rows


# --------------------------------------------------------------------------------------------
# (a) Worst-case sink strength: gradient ascent on Δ
# --------------------------------------------------------------------------------------------


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
        return jnp.mean(_seed_mses(delta, sigma, log2_scale, scenario=scenario, surrogate=surrogate,
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
    sur = _as_surrogate(surrogate if surrogate is not None else Surrogate())
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
    finals, values, _ = _ascend(jnp.asarray(starts), jnp.float32(lo), jnp.float32(hi), jnp.float32(sigma),
                                jnp.float32(sc.log2_scale), scenario=sc, surrogate=sur, part=part,
                                steps=int(steps), lr=float(learning_rate))
    finals, values = np.asarray(finals, np.float64), np.asarray(values, np.float64)
    best = float(finals[int(np.argmax(values))])
    margin = 1e-3 * (hi - lo)
    interior = (finals > lo + margin) & (finals < hi - margin)
    local = float(finals[interior][int(np.argmax(values[interior]))]) if interior.any() else float("nan")

    def exact(deltas):
        th = _thetas(sc, np.asarray(deltas, np.float64), sigma, None)
        return np.asarray(_grid(th, scenario=sc, surrogate=Surrogate(kind="exact"), part=part),
                          np.float64).mean(axis=1)

    if math.isfinite(local):
        fine = np.arange(max(lo, local - 0.5), min(hi, local + 0.5) + 1e-9, refine_step)
        fine_vals = exact(fine)
        i = int(np.argmax(fine_vals))
        exact_peak, exact_val = float(fine[i]), float(fine_vals[i])
    else:
        exact_peak = exact_val = float("nan")
    grid = np.arange(lo, hi + 1e-9, grid_step)
    grid_vals = exact(grid)
    dc = float(theory.critical_delta(cfg.scale, k_sink=k_sink, sigma=sigma, fmt=cfg.p_format))
    return WorstDeltaResult(
        config=cfg.name, n=n, objective=objective, surrogate=sur.label, delta_range=(lo, hi),
        starts=starts.astype(np.float64), finals=finals, final_values=values, worst_delta=best,
        local_peak=local, exact_local_peak=exact_peak, exact_local_value=exact_val, grid_deltas=grid,
        grid_values=grid_vals, exact_global_delta=float(grid[int(np.argmax(grid_vals))]), critical_delta=dc,
        seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# (b) Optimal static scale: Adam over continuous log2 S, then exact powers of two
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OptimalScaleResult:
    """Outcome of :func:`optimal_scale` (S values, MSE values are exact means unless named)."""

    source: str  # "synthetic(...)" or "scores(...)"
    config: str
    surrogate: str
    start_log2_scale: float
    continuous_log2_scale: float  # where Adam ended
    continuous_surrogate_mse: float
    neighbours: dict  # {2^floor: exact MSE, 2^ceil: exact MSE}
    best_neighbour: float
    powers: dict  # {2^k: exact MSE} for every k in the range
    best_power: float
    at_256: float
    at_448: float
    at_continuous: float  # exact MSE at the continuous optimum (unrounded S)
    surrogate_at_256: float  # the search surrogate's MSE at S = 256 and 448 (does it see the gap?)
    surrogate_at_448: float
    parts: dict  # {S: (collapse, noise)} exact split at 256 and 448
    curve_scales: np.ndarray  # exact MSE vs S (dense, for the sawtooth figure)
    curve_values: np.ndarray
    seconds: float

    def rows(self) -> list[dict]:
        out = []
        for s, v in sorted(self.powers.items()):
            out.append({"scale": s, "log2_scale": math.log2(s), "exact_mse": v,
                        "rel_to_256": v / self.at_256 if self.at_256 else float("nan"),
                        "dp": float(theory.dp(s)), "normal_coverage": float(theory.normal_coverage(s))})
        out.append({"scale": 448.0, "log2_scale": math.log2(448.0), "exact_mse": self.at_448,
                    "rel_to_256": self.at_448 / self.at_256 if self.at_256 else float("nan"),
                    "dp": float(theory.dp(448.0)), "normal_coverage": float(theory.normal_coverage(448.0))})
        return out


@partial(jax.jit, static_argnames=("evaluate", "steps", "lr"))
def _descend_scale(l0, lo, hi, scores, *, evaluate, steps, lr):
    """Projected Adam descent on the mean surrogate MSE over log2 S."""
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05), b2=0.9, eps=1e-20)
    norm = jax.lax.stop_gradient(evaluate(l0, scores)) + 1e-30

    def step(carry, _):
        l2, st = carry
        g = jax.grad(lambda v: evaluate(v, scores) / norm)(l2)
        upd, st = opt.update(g, st, l2)
        l2 = jnp.clip(optax.apply_updates(l2, upd), lo, hi)
        return (l2, st), l2

    (l2, _), path = jax.lax.scan(step, (l0, opt.init(l0)), None, length=steps)
    return l2, evaluate(l2, scores), path


@partial(jax.jit, static_argnames=("evaluate",))
def _evaluate_many(log2_scales, scores, *, evaluate):
    return jax.lax.map(lambda l2: evaluate(l2, scores), log2_scales)


@dataclasses.dataclass(frozen=True)
class _Evaluator:
    """Hashable closure: mean MSE over the instances at a (traced) log2 S."""

    scenario: Scenario | None  # synthetic draws, or None: the scores argument is used
    config: KernelConfig
    surrogate: Surrogate
    part: str
    delta: float
    sigma: float
    sigma_v: float = 1.0

    def __call__(self, log2_scale, scores):
        if self.scenario is not None:
            return jnp.mean(_seed_mses(jnp.float32(self.delta), jnp.float32(self.sigma), log2_scale,
                                       scenario=self.scenario, surrogate=self.surrogate, part=self.part))
        batch = max(1, min(scores.shape[0], (1 << 21) // (scores.shape[1] * scores.shape[2])))
        return jnp.mean(_scores_mses(log2_scale, scores, config=self.config, surrogate=self.surrogate,
                                     part=self.part, sigma_v=self.sigma_v, batch_size=batch))


def optimal_scale(workload: SinkWorkload | None = None, *, scores=None, config="fwd_s1", delta: float = 7.0,
                  seeds: int = 4, exact_seeds: int | None = None, surrogate: Surrogate | str | None = None,
                  start_log2_scale: float = 0.0,
                  log2_range=(-2.0, 10.0), steps: int = 150, learning_rate: float = 0.25,
                  powers=range(0, 11), curve_points: int = 65, base_seed: int = 0) -> OptimalScaleResult:
    """Best static P-scale S for a workload: Adam over continuous log2 S, then exact powers of two.

    Either a synthetic ``workload`` (default: the paper's N = 4096, q_len = 32, k_sink = 4, with
    sink strength ``delta``) or a ``scores`` array (q_len, N) / (batch, q_len, N) of real logits.
    The config fixes the order and block size; its S is replaced by the search variable.

    1. Adam on log2 S with the smooth surrogate (default ``atoms="representable"``: the search
       assumes S is an E4M3 value, so the P = 1 atoms cost nothing below max).
    2. Exact MSE at the neighbouring powers of two 2^⌊·⌋, 2^⌈·⌉ → best neighbour; also every 2^k
       of ``powers``, S = 448, and the continuous optimum itself.
    3. An exact curve over S ∈ [2^7, 2^9.2] (the dp(S) sawtooth of §5 in MSE form).

    The search averages ``seeds`` instances; the exact evaluations use ``exact_seeds`` (default
    max(seeds, 32)): which sink P lands where in its cell scatters the per-seed MSE(448)/MSE(256)
    from about 0.6 to 2, so the 256-vs-448 gap needs tens of seeds.
    """
    cfg = resolve(config)
    _static_config(cfg)
    sur = _as_surrogate(surrogate if surrogate is not None else Surrogate(atoms="representable"))
    if sur.kind == "exact":
        raise PcastError("surrogate='exact' has no useful gradient; use 'smooth' (or 'ste')")
    check_finite("delta", delta)
    check_finite("start_log2_scale", start_log2_scale)
    try:
        lo, hi = (check_finite("log2_range", float(x)) for x in log2_range)
    except (TypeError, ValueError):
        raise PcastError(f"log2_range={log2_range!r} must be two numbers (lo, hi)") from None
    if not (lo < hi and -100 <= lo and hi <= 100):
        raise PcastError(f"log2_range={log2_range!r} must satisfy -100 <= lo < hi <= 100")
    check_int("steps", steps, min_value=1, max_value=100000)
    check_positive("learning_rate", learning_rate)
    check_int("curve_points", curve_points, min_value=0, max_value=100000)
    powers = [check_int("powers", k, min_value=-100, max_value=100) for k in powers]
    if not powers:
        raise PcastError("powers must hold at least one exponent k")
    if scores is not None and workload is not None:
        raise PcastError("give either workload or scores, not both")
    t0 = time.perf_counter()
    if scores is not None:
        arr = _check_scores(scores)
        scenario = exact_scenario = None
        source = f"scores{tuple(arr.shape)}"
        sigma = 1.0
    else:
        w = workload or SinkWorkload()
        if not isinstance(w, SinkWorkload):
            raise PcastError(f"workload must be a SinkWorkload, got {type(w).__name__}")
        scenario = Scenario(config=cfg, n=w.n, q_len=w.q_len, k_sink=w.k_sink, sink_positions=w.sink_positions,
                            sigma_v=w.sigma_v, seeds=seeds, base_seed=base_seed)
        exact_seeds = max(seeds, 32) if exact_seeds is None else check_int("exact_seeds", exact_seeds, min_value=1)
        exact_scenario = scenario.replace(seeds=exact_seeds)
        arr = jnp.zeros((1, 1, 1), jnp.float32)
        source = f"synthetic(n={w.n}, q_len={w.q_len}, k_sink={w.k_sink}, delta={delta:g}, sigma={w.sigma:g})"
        sigma = w.sigma

    def evaluator(surr, part="total"):
        sc_ = exact_scenario if surr.kind == "exact" else scenario
        return _Evaluator(sc_, cfg, surr, part, float(delta), float(sigma))

    exact_sur = Surrogate(kind="exact")
    l2, val, _ = _descend_scale(jnp.float32(start_log2_scale), jnp.float32(lo), jnp.float32(hi), arr,
                                evaluate=evaluator(sur), steps=int(steps), lr=float(learning_rate))
    l2 = float(l2)

    def ex(log2s, part="total"):
        xs = jnp.asarray(np.asarray(log2s, np.float32))
        return np.asarray(_evaluate_many(xs, arr, evaluate=evaluator(exact_sur, part)), np.float64)

    ks = sorted(set(powers) | {math.floor(l2), math.ceil(l2)})
    pw = {2.0**k: float(v) for k, v in zip(ks, ex(ks))}
    nb = {2.0 ** math.floor(l2): pw[2.0 ** math.floor(l2)], 2.0 ** math.ceil(l2): pw[2.0 ** math.ceil(l2)]}
    extra = ex([8.0, math.log2(448.0), l2])
    sur_vals = np.asarray(_evaluate_many(jnp.asarray([8.0, math.log2(448.0)], jnp.float32), arr,
                                         evaluate=evaluator(sur)), np.float64)
    curve_l2 = np.linspace(7.0, 9.2, curve_points) if curve_points else np.zeros(0)
    if curve_points:  # every E4M3 value in the range: the exact MSE dips there (P = 1 atoms)
        reps = formats.positive_values(cfg.p_format).astype(np.float64)
        curve_l2 = np.unique(np.concatenate([curve_l2, np.log2(reps[(reps >= 2.0**7) & (reps <= 2.0**9.2)])]))
    curve_v = ex(curve_l2) if curve_l2.size else np.zeros(0)
    split = [math.log2(256.0), math.log2(448.0)]
    coll, noise = ex(split, "collapse"), ex(split, "noise")
    parts = {256.0: (float(coll[0]), float(noise[0])), 448.0: (float(coll[1]), float(noise[1]))}
    in_range = {k: v for k, v in pw.items() if round(math.log2(k)) in powers}
    best_nb = min(nb, key=nb.get)
    return OptimalScaleResult(
        source=source, config=cfg.name, surrogate=sur.label, start_log2_scale=float(start_log2_scale),
        continuous_log2_scale=l2, continuous_surrogate_mse=float(val), neighbours=nb, best_neighbour=best_nb,
        powers=in_range, best_power=min(in_range, key=in_range.get),
        at_256=float(extra[0]), at_448=float(extra[1]), at_continuous=float(extra[2]),
        surrogate_at_256=float(sur_vals[0]), surrogate_at_448=float(sur_vals[1]), parts=parts,
        curve_scales=np.exp2(curve_l2), curve_values=curve_v, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# (c) Calibrating Prop. 3 (Remark 1) and δk of Eq. (7) against the simulator
# --------------------------------------------------------------------------------------------


MODELS = ("actual", "row", "mean")


@dataclasses.dataclass
class Prop3Calibration:
    """Fits of Prop. 3 (with Remark 1's constant c) and of δk in Eq. (7) to simulations.

    Every model is MSE(Δ) ≈ c · σ_V² Σ_{j∈Z} P_j²/ℓ² + κ · floor(Δ), fitted per seed in log space,
    where floor is the simulator's own quantization-noise part (what the cast loses on values it
    does not zero, expected over V) and Z is:

    * ``"actual"`` — the set the exact cast zeroes (Prop. 3 as stated; c is Remark 1's constant);
    * ``"row"`` — Prop. 1 with each row's own running max: s_j < m_row − 10 ln 2 − ln S + ε
      (ε fitted; 0 means Prop. 1 is exact);
    * ``"mean"`` — the paper's closed form, Eq. (6): s_j < Δ + σ δ − 10 ln 2 − ln S (δ fitted;
      the paper's δ = δk).

    ``per_seed[model]`` maps parameter → (seeds,) fits; ``summary[model]`` parameter → mean, sd over
    seeds and a bootstrap 95 % interval of the mean. ``delta_f`` is the separate fit of δ in
    F(Δ) = Φ((Δ + σ δ − 10 ln 2 − ln S)/σ) to the simulated fraction zeroed.
    """

    config: str
    n: int
    target: str
    deltas: np.ndarray
    per_seed: dict
    summary: dict
    delta_k_theory: float
    sim_mean: np.ndarray  # mean simulated target per Δ
    model_mean: dict  # model -> mean fitted curve per Δ
    paper_curve: np.ndarray  # "mean" model with c = 1, κ = 1, δ = δk (no fit), mean over seeds
    frac_sim: np.ndarray  # mean simulated fraction zeroed per Δ
    frac_model: np.ndarray  # Eq. (7) with the fitted δ
    frac_theory: np.ndarray  # Eq. (7) with δk (no fit)
    seconds: float

    def rows(self) -> list[dict]:
        out = []
        for model, params in self.summary.items():
            for name, st in params.items():
                out.append({"model": model, "parameter": name, "mean": st["mean"], "sd_over_seeds": st["sd"],
                            "boot95_lo": st["lo95"], "boot95_hi": st["hi95"]})
        out.append({"model": "theory", "parameter": "delta_k (Eq. 3)", "mean": self.delta_k_theory,
                    "sd_over_seeds": 0.0, "boot95_lo": float("nan"), "boot95_hi": float("nan")})
        return out


def _collapse_features(scores0, is_sink, sigma):
    """Per-instance statistics for A = Σ_{j∈Z} P_j²/ℓ² (row mean) with Z = {non-sink j : s_j < t}.

    ``scores0`` are the Δ = 0, σ = 1 draws (q_len, N). Returns (features(Δ, t) → A, row_max(Δ)):
    t is a scalar or per row (q_len,); A is differentiable in t because Σ_{s_j<t} e^{2 s_j} is the
    piecewise-linear interpolation of the cumulative sum over the sorted non-sink scores.
    """
    s = sigma * scores0
    big = jnp.float32(1e30)
    order = jnp.sort(jnp.where(is_sink, big, s), axis=-1)  # non-sink scores ascending, sinks last
    real = order < big
    cum = jnp.cumsum(jnp.where(real, jnp.exp(2.0 * jnp.where(real, order, 0.0)), 0.0), axis=-1)
    h1 = jnp.sum(jnp.where(is_sink, 0.0, jnp.exp(s)), axis=-1)  # Σ_{non-sink} e^s per row
    h2 = cum[..., -1]
    sink = jnp.where(is_sink, s, -jnp.inf)
    ns_max = jnp.max(jnp.where(is_sink, -jnp.inf, s), axis=-1)

    def row_max(delta):
        return jnp.maximum(delta + jnp.max(sink, axis=-1), ns_max)  # m_global per row

    def features(delta, t):
        m = row_max(delta)
        ell = jnp.sum(jnp.exp(delta + sink - m[:, None]), axis=-1) + jnp.exp(-m) * h1
        t = jnp.broadcast_to(t, m.shape)
        g = jnp.minimum(jax.vmap(lambda x, c, tt: jnp.interp(tt, x, c, left=0.0))(order, cum, t), h2)
        return jnp.mean(jnp.exp(-2.0 * m) * g / (ell * ell))

    return features, row_max


@partial(jax.jit, static_argnames=("scenario", "sigma", "steps", "model"))
def _fit_prop3(deltas, targets, collapse, floor, *, scenario: Scenario, sigma: float, steps: int, model: str):
    """Per-seed Adam fits of (log c, log κ, shift) → (params (seeds, 3), rms_log (seeds,), curves)."""
    work = scenario.workload()
    cfg = scenario.config
    dk = theory.delta_k(scenario.k_sink)
    cut = -math.log(cfg.fmt.round_to_zero) + math.log(cfg.scale)  # 10 ln 2 + ln S (Eq. (6))
    base_t = theory.underflow_threshold(deltas, cfg.scale, k_sink=scenario.k_sink, sigma=sigma,
                                        fmt=cfg.p_format) - sigma * dk  # Eq. (6) with δ = 0

    def one(seed, target, coll, fl):
        inst = make_instance(instance_key(scenario.base_seed, scenario.n, seed), work, 0.0)
        feats, row_max = _collapse_features(inst.scores, inst.is_sink, sigma)

        def a_of(shift):
            if model == "actual":
                return coll / scenario.sigma_v**2
            if model == "row":
                return jax.vmap(lambda d: feats(d, row_max(d) - cut + shift))(deltas)
            return jax.vmap(feats)(deltas, base_t + sigma * shift)

        def curve(params):
            log_c, log_k, shift = params
            return jnp.exp(log_c) * scenario.sigma_v**2 * a_of(shift) + jnp.exp(log_k) * fl

        def loss(params):
            return jnp.mean(jnp.square(jnp.log(curve(params)) - jnp.log(target)))

        init = jnp.stack([jnp.float32(0.0), jnp.float32(0.0),
                          jnp.asarray(dk if model == "mean" else 0.0, jnp.float32)])
        opt = optax.adam(optax.cosine_decay_schedule(0.05, steps, alpha=0.02))

        def step(carry, _):
            p, st = carry
            upd, st = opt.update(jax.grad(loss)(p), st, p)
            p = optax.apply_updates(p, upd)
            if model == "actual":  # no shift parameter
                p = p.at[2].set(0.0)
            return (p, st), None

        (p, _), _ = jax.lax.scan(step, (init, opt.init(init)), None, length=steps)
        paper = scenario.sigma_v**2 * jax.vmap(feats)(deltas, base_t + sigma * dk) + fl
        return p, jnp.sqrt(loss(p)), curve(p), paper

    return jax.vmap(one)(scenario.seed_indices(), targets, collapse, floor)


@partial(jax.jit, static_argnames=("scenario", "sigma", "steps"))
def _fit_delta_f(deltas, frac, *, scenario: Scenario, sigma: float, steps: int):
    """Per-seed least-squares δ of F(Δ) = Φ((Δ + σ δ − 10 ln 2 − ln S)/σ) (Eq. (7))."""
    cfg = scenario.config
    dk = theory.delta_k(scenario.k_sink)

    def one(fz):
        def floss(d):
            f = theory.collapse_fraction(deltas + sigma * (d - dk), cfg.scale, k_sink=scenario.k_sink,
                                         sigma=sigma, fmt=cfg.p_format)
            return jnp.mean(jnp.square(f - fz))

        opt = optax.adam(optax.cosine_decay_schedule(0.05, steps, alpha=0.02))

        def step(carry, _):
            d, st = carry
            upd, st = opt.update(jax.grad(floss)(d), st, d)
            return (optax.apply_updates(d, upd), st), None

        d0 = jnp.asarray(dk, jnp.float32)
        (d, _), _ = jax.lax.scan(step, (d0, opt.init(d0)), None, length=steps)
        return d, jnp.sqrt(floss(d))

    return jax.vmap(one)(frac)


def _bootstrap_mean(x, rng, reps=1000):
    idx = rng.integers(0, len(x), size=(reps, len(x)))
    means = x[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def calibrate_prop3(config="fwd_s1", n: int = 4096, *, deltas=None, seeds: int = 8, target: str = "mse",
                    q_len: int = 32, d: int = 128, k_sink: int = 4, sigma: float = 1.0, sigma_v: float = 1.0,
                    steps: int = 300, base_seed: int = 0, bootstrap: int = 1000,
                    models=MODELS) -> Prop3Calibration:
    """Fit Prop. 3's constant c (Remark 1) and δk (Eq. (7)) to simulations, per seed.

    The sweep gives, per seed and Δ, the simulated ``target`` (``"mse"``: output MSE with sampled
    V of width ``d``, the paper's measurement; ``"mse_expected"``: σ_V² Σ(W − P)²) and the fraction
    of non-sink P zeroed; the what-if evaluator splits the exact expected MSE into its collapse part
    (Prop. 3 with the actual Z) and the noise floor. See :class:`Prop3Calibration` for the models.
    With i.i.d. V (this workload) Eq. (8)'s cross term vanishes, so model "actual" must give c ≈ 1;
    "row" and "mean" measure how well Prop. 1's threshold predicts Σ_{j∈Z} P_j².
    """
    cfg = resolve(config)
    _static_config(cfg)
    check_choice("target", target, ("mse", "mse_expected"))
    check_int("steps", steps, min_value=1, max_value=100000)
    check_int("bootstrap", bootstrap, min_value=10, max_value=10**6)
    check_int("seeds", seeds, min_value=2, max_value=1 << 16)
    check_int("k_sink", k_sink, min_value=1)
    check_positive("sigma", sigma)
    models = tuple(models)
    for m in models:
        check_choice("models", m, MODELS)
    deltas = np.arange(4.0, 13.01, 0.5) if deltas is None else np.asarray(deltas, np.float64)
    if deltas.ndim != 1 or deltas.size < 3 or not np.all(np.isfinite(deltas)):
        raise PcastError("deltas must be at least 3 finite values")
    t0 = time.perf_counter()
    spec = SweepSpec(configs=(cfg,), deltas=tuple(float(x) for x in deltas), ns=(n,), seeds=seeds, q_len=q_len,
                     d=d, k_sink=k_sink, sigma=sigma, sigma_v=sigma_v, base_seed=base_seed,
                     expected_mse=(target == "mse_expected"))
    res = run_sweep(spec, progress=False)
    tgt = np.asarray(res.get(target, config=cfg.name, n=n), np.float64).T  # (seeds, D)
    frac = np.asarray(res.get("frac_zeroed", config=cfg.name, n=n), np.float64).T
    if not np.all(tgt > 0):
        raise PcastError(f"the simulated {target} has zeros; log fits need MSE > 0 everywhere")
    sc = Scenario(config=cfg, n=n, q_len=q_len, k_sink=k_sink, sigma_v=sigma_v, seeds=seeds, base_seed=base_seed)
    th = _thetas(sc, deltas, sigma, None)
    exact = Surrogate(kind="exact")
    coll = np.asarray(_grid(th, scenario=sc, surrogate=exact, part="collapse"), np.float64).T  # (seeds, D)
    floor = np.asarray(_grid(th, scenario=sc, surrogate=exact, part="noise"), np.float64).T
    dk = float(theory.delta_k(k_sink))
    args = tuple(jnp.asarray(x, jnp.float32) for x in (deltas, tgt, coll, floor))
    rng = np.random.default_rng(base_seed)

    def summarize(values: dict) -> dict:
        out = {}
        for k, v in values.items():
            lo95, hi95 = _bootstrap_mean(v, rng, bootstrap)
            out[k] = {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)), "lo95": lo95, "hi95": hi95}
        return out

    per_seed, summary, curves, paper = {}, {}, {}, None
    shift_name = {"actual": None, "row": "epsilon (row threshold shift)", "mean": "delta (Eq. 6 shift)"}
    for m in models:
        p, rms, curve, paper_c = (np.asarray(x, np.float64) for x in
                                  _fit_prop3(*args, scenario=sc, sigma=float(sigma), steps=int(steps), model=m))
        vals = {"c": np.exp(p[:, 0]), "kappa (floor factor)": np.exp(p[:, 1])}
        if shift_name[m]:
            vals[shift_name[m]] = p[:, 2]
        vals["rms_log_residual"] = rms
        per_seed[m], summary[m], curves[m] = vals, summarize(vals), curve.mean(axis=0)
        paper = paper_c.mean(axis=0)
    d_f, f_rms = (np.asarray(x, np.float64) for x in
                  _fit_delta_f(args[0], jnp.asarray(frac, jnp.float32), scenario=sc, sigma=float(sigma),
                               steps=int(steps)))
    per_seed["F"] = {"delta (Eq. 7 fit)": d_f, "rms_residual": f_rms}
    summary["F"] = summarize(per_seed["F"])
    fz = lambda dl: np.asarray(theory.collapse_fraction(jnp.asarray(deltas + sigma * (dl - dk), jnp.float32),
                                                        cfg.scale, k_sink=k_sink, sigma=sigma, fmt=cfg.p_format),
                               np.float64)
    return Prop3Calibration(
        config=cfg.name, n=n, target=target, deltas=deltas, per_seed=per_seed, summary=summary,
        delta_k_theory=dk, sim_mean=tgt.mean(axis=0), model_mean=curves, paper_curve=paper,
        frac_sim=frac.mean(axis=0), frac_model=fz(summary["F"]["delta (Eq. 7 fit)"]["mean"]), frac_theory=fz(dk),
        seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# (d) Dynamic per-block power-of-two scale (§7.4 future work) vs static scales
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DynamicComparison:
    """Paired comparison of a dynamic-scale config with static ones on shared draws.

    ``table`` rows: one per (N, Δ) with the mean ``metric`` of every config, the paired ratio
    dynamic/static (mean of per-seed ratios) with its standard error, and the fractions zeroed.
    """

    metric: str
    configs: tuple
    dynamic: str
    ns: tuple
    deltas: tuple
    seeds: int
    table: list
    seconds: float

    def rows(self) -> list[dict]:
        return list(self.table)

    def largest_gain(self, static: str) -> dict:
        """The (N, Δ) row where the dynamic scale beats ``static`` by the widest resolved margin."""
        key = f"ratio_vs_{static}"
        resolved = [r for r in self.table if abs(r[key] - 1) > 2 * r[f"{key}_sem"]]
        pool = resolved or self.table
        return min(pool, key=lambda r: r[key])


def dynamic_vs_static(*, dynamic="dynamic_pow2", statics=("fwd_s256", "fwd_s448"), deltas=None,
                      ns=(1024, 4096, 16384), seeds: int = 8, metric: str = "mse_expected", q_len: int = 32,
                      d: int = 128, k_sink: int = 4, base_seed: int = 0, out_dir=None) -> DynamicComparison:
    """Sweep the dynamic per-block 2^k scale against static scales (default 256 and 448).

    One :func:`~pcast_jax.sweep.run_sweep` over Δ ∈ [4, 13] (step 1) × ``ns`` × seeds; every config
    sees the same draws, so the per-seed ratios are paired. ``metric``: ``"mse_expected"`` (the
    expected MSE over V, low variance) or ``"mse"`` (one V draw, the paper's measurement).
    """
    dyn = resolve(dynamic)
    if dyn.scale_mode != "dynamic":
        raise PcastError(f"dynamic={dyn.name!r} must have scale_mode='dynamic' (e.g. 'dynamic_pow2')")
    statics = tuple(resolve(s) for s in ((statics,) if isinstance(statics, (str, KernelConfig)) else statics))
    if not statics:
        raise PcastError("statics must name at least one static-scale config")
    for s in statics:
        if s.scale_mode == "dynamic":
            raise PcastError(f"statics: {s.name!r} is dynamic; give static-scale configs")
    check_choice("metric", metric, ("mse_expected", "mse"))
    deltas = tuple(float(x) for x in (np.arange(4.0, 13.01, 1.0) if deltas is None else np.atleast_1d(deltas)))
    ns = tuple(check_int("ns", int(x) if isinstance(x, (np.integer,)) else x, min_value=k_sink + 1)
               for x in np.atleast_1d(ns).tolist())
    check_int("seeds", seeds, min_value=2, max_value=1 << 20)
    t0 = time.perf_counter()
    spec = SweepSpec(configs=(dyn,) + statics, deltas=deltas, ns=ns, seeds=seeds, q_len=q_len, d=d,
                     k_sink=k_sink, base_seed=base_seed, expected_mse=True)
    res = run_sweep(spec, out_dir=out_dir, progress=False)
    table = []
    for n in ns:
        for dl in deltas:
            row = {"n": n, "delta": dl}
            dv = np.asarray(res.get(metric, config=dyn.name, n=n, delta=dl), np.float64)
            row[dyn.name] = float(dv.mean())
            row[f"frac_zeroed_{dyn.name}"] = float(res.mean("frac_zeroed", config=dyn.name, n=n, delta=dl))
            for s in statics:
                sv = np.asarray(res.get(metric, config=s.name, n=n, delta=dl), np.float64)
                ratio = dv / sv
                row[s.name] = float(sv.mean())
                row[f"ratio_vs_{s.name}"] = float(ratio.mean())
                row[f"ratio_vs_{s.name}_sem"] = float(ratio.std(ddof=1) / math.sqrt(len(ratio)))
                row[f"frac_zeroed_{s.name}"] = float(res.mean("frac_zeroed", config=s.name, n=n, delta=dl))
            table.append(row)
    return DynamicComparison(metric=metric, configs=spec.config_names, dynamic=dyn.name, ns=ns, deltas=deltas,
                             seeds=seeds, table=table, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# Report: every analysis at report size, as markdown + rows + figures
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WhatIfReport:
    """Everything :func:`report` produced: markdown text, tables (lists of dicts), figure paths."""

    markdown: str
    tables: dict
    figures: list
    seconds: dict


def _fmt(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return "–"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub markdown table of ``rows`` (dicts) restricted to ``columns``."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(n=1024, q_len=8, seeds=4, calib_seeds=4, dyn_seeds=3, dyn_ns=(1024,), calib_steps=150,
                    steps=40, worst_configs=("fwd_s1", "fwd_s256"), curve_points=17, bootstrap=200)
    return dict(n=4096, q_len=32, seeds=8, calib_seeds=16, dyn_seeds=8, dyn_ns=(1024, 4096, 16384),
                calib_steps=300, steps=60, worst_configs=("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"),
                curve_points=65, bootstrap=1000)


def report(*, quick: bool = False, out_dir=None, base_seed: int = 0) -> WhatIfReport:
    """Run the four analyses and the surrogate validation; return markdown, tables and figures.

    ``quick`` uses N = 1024, q_len = 8 and a few seeds (about a minute on 2 cores); the full size is
    the paper's workload (N = 4096, q_len = 32). Figures are written to ``out_dir`` when given and
    matplotlib is installed.
    """
    z = _sizes(bool(quick))
    times, tables, md = {}, {}, []
    n, q = z["n"], z["q_len"]

    t = time.perf_counter()
    sc = Scenario(config="fwd_s1", n=n, q_len=q, seeds=z["seeds"], base_seed=base_seed)
    surs = (Surrogate(), Surrogate(lsb_mode="staircase"), Surrogate(kind="ste"))
    val_delta = validate_gradients(sc, param="delta", surrogates=surs)
    # dMSE/dσ is dominated by where each sink P lands in its cell: resolving it takes twice the seeds
    val_sigma = validate_gradients(sc.replace(seeds=2 * z["seeds"]), param="sigma", surrogates=surs, step=0.1)
    surs_rep = tuple(dataclasses.replace(x, atoms="representable") for x in surs)
    val_scale = validate_gradients(sc, param="log2_scale", surrogates=surs_rep)
    tables["validate"] = val_delta + val_sigma + val_scale
    times["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    worst = []
    for cfg in z["worst_configs"]:
        for obj in ("total", "collapse"):
            worst.append(worst_case_delta(cfg, n, objective=obj, seeds=z["seeds"], q_len=q, steps=z["steps"],
                                          base_seed=base_seed))
    tables["worst_delta"] = [r for w in worst for r in w.rows()]
    times["worst_delta"] = time.perf_counter() - t

    t = time.perf_counter()
    wl = SinkWorkload(n=n, q_len=q)
    opt_mean = optimal_scale(wl, seeds=z["seeds"], curve_points=z["curve_points"], base_seed=base_seed)
    opt_stair = optimal_scale(wl, seeds=z["seeds"], curve_points=0, base_seed=base_seed,
                              start_log2_scale=opt_mean.continuous_log2_scale,
                              surrogate=Surrogate(lsb_mode="staircase", atoms="representable"))
    tables["optimal_scale"] = opt_mean.rows()
    times["optimal_scale"] = time.perf_counter() - t

    t = time.perf_counter()
    cal = calibrate_prop3("fwd_s1", n, seeds=z["calib_seeds"], q_len=q, steps=z["calib_steps"],
                          bootstrap=z["bootstrap"], base_seed=base_seed)
    tables["calibrate_prop3"] = cal.rows()
    times["calibrate_prop3"] = time.perf_counter() - t

    t = time.perf_counter()
    dyn = dynamic_vs_static(ns=z["dyn_ns"], seeds=z["dyn_seeds"], q_len=q, base_seed=base_seed)
    tables["dynamic"] = dyn.rows()
    times["dynamic"] = time.perf_counter() - t

    # ---- markdown
    md.append(f"## What-if analyses (N = {n}, q_len = {q}{', quick' if quick else ''})\n")
    md.append("Expected MSE σ_V² Σ(W − P)² on the sweep's draws; gradients by jax.grad through a surrogate "
              "of the E4M3 cast, checked against central differences of the exact simulator (same seeds).\n")
    md.append("### Surrogate gradients vs exact finite differences (fwd_s1)\n")
    cols = ["param", "point", "surrogate", "exact_mse", "value_rel_err", "exact_fd", "exact_fd_sem",
            "surrogate_grad", "grad_rel_err", "trustworthy"]
    md.append(markdown_table(tables["validate"], cols))
    md.append("\nFor log2 S the exact slope is the octave secant between powers of two (the exact MSE is jagged "
              "between E4M3-representable S, where the P = 1 atom rounds); exact_mse at those half-integer "
              "points includes that atom error, so value_rel_err is not meaningful there.\n")
    for label in (s.label for s in surs):
        rows = [r for r in val_delta if r["surrogate"] == label and r["resolved"]]
        ok = sum(r["trustworthy"] for r in rows)
        md.append(f"- {label}: dMSE/dΔ trustworthy (sign right, within 25 %) at {ok} of {len(rows)} resolved "
                  f"points.\n")
    md.append("\n### Worst-case sink strength (Adam ascent on Δ, smooth surrogate)\n")
    md.append(markdown_table(tables["worst_delta"], ["config", "objective", "worst_delta", "local_peak",
                                                     "exact_local_peak", "exact_mse_at_peak", "exact_global_argmax",
                                                     "delta_c", "peak_in_6_9", "seconds"]))
    md.append("\n### Optimal static scale (Δ = 7)\n")
    md.append(f"Adam over log2 S from S = 1: mean-LSB surrogate stops at log2 S = "
              f"{opt_mean.continuous_log2_scale:.2f} (flat beyond the collapse); the staircase surrogate, "
              f"started there, settles at {opt_stair.continuous_log2_scale:.2f} (a dp sawtooth minimum). "
              f"Best neighbouring power of two "
              f"(exact): {opt_mean.best_neighbour:g}; best over 2^0..2^10 (exact): {opt_mean.best_power:g}. "
              f"Exact MSE: S = 256 {opt_mean.at_256:.4g}, S = 448 {opt_mean.at_448:.4g} "
              f"({opt_mean.at_448 / opt_mean.at_256 - 1:+.1%}); dp(448)²/dp(256)² − 1 = "
              f"{(float(theory.dp(448.0)) / float(theory.dp(256.0))) ** 2 - 1:+.1%}. Collapse part at 256 / 448: "
              f"{opt_mean.parts[256.0][0]:.2e} / {opt_mean.parts[448.0][0]:.2e} (coverage buys nothing here). "
              f"The surrogates' own MSE(448)/MSE(256) − 1: mean-LSB "
              f"{opt_mean.surrogate_at_448 / opt_mean.surrogate_at_256 - 1:+.1%}, staircase "
              f"{opt_stair.surrogate_at_448 / opt_stair.surrogate_at_256 - 1:+.1%}.\n")
    md.append(markdown_table(tables["optimal_scale"], ["scale", "exact_mse", "rel_to_256", "dp", "normal_coverage"]))
    md.append("\n### Prop. 3 calibration (fwd_s1, target = simulated MSE)\n")
    md.append(markdown_table(tables["calibrate_prop3"], ["model", "parameter", "mean", "sd_over_seeds",
                                                         "boot95_lo", "boot95_hi"]))
    curve_rows = []
    for i, dl in enumerate(cal.deltas):
        row = {"delta": float(dl), "simulated": float(cal.sim_mean[i])}
        row.update({f"fit_{m}": float(c[i]) for m, c in cal.model_mean.items()})
        row["paper_c1_deltak"] = float(cal.paper_curve[i])
        row["frac_zeroed_sim"] = float(cal.frac_sim[i])
        row["F_eq7_theory"] = float(cal.frac_theory[i])
        curve_rows.append(row)
    tables["calibrate_curves"] = curve_rows
    md.append("\n" + markdown_table(curve_rows[::2]))
    md.append("\n### Dynamic per-block 2^k scale vs static\n")
    dcols = ["n", "delta", "dynamic_pow2", "ratio_vs_fwd_s256", "ratio_vs_fwd_s256_sem", "ratio_vs_fwd_s448",
             "ratio_vs_fwd_s448_sem", "frac_zeroed_dynamic_pow2", "frac_zeroed_fwd_s256"]
    md.append(markdown_table(tables["dynamic"], dcols))
    md.append("\nRun times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + "\n")

    figures = []
    if out_dir is not None:
        figures = _figures(Path(out_dir), val_delta, worst, opt_mean, cal)
    return WhatIfReport(markdown="\n".join(md), tables=tables, figures=figures, seconds=times)


def _figures(out: Path, val_delta, worst, opt, cal) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted({r["point"] for r in val_delta})
    ex = [next(r for r in val_delta if r["point"] == p) for p in pts]
    ax.errorbar(pts, [r["exact_fd"] for r in ex], yerr=[2 * r["exact_fd_sem"] for r in ex], fmt="ko",
                label="exact simulator, central difference ±2 SEM")
    for label in dict.fromkeys(r["surrogate"] for r in val_delta):
        rows = [r for r in val_delta if r["surrogate"] == label]
        ax.plot([r["point"] for r in rows], [r["surrogate_grad"] for r in rows], "-", label=label)
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("dMSE/dΔ")
    ax.set_title("fwd_s1: surrogate gradient vs exact finite difference")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "whatif_gradients.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for w in worst:
        if w.objective == "total":
            ax.semilogy(w.grid_deltas, w.grid_values, label=w.config)
            if math.isfinite(w.exact_local_peak):
                ax.plot([w.exact_local_peak], [w.exact_local_value], "k^")
    ax.axvspan(*PAPER_TRANSITION, color="0.9", label="paper's transition region")
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("expected MSE")
    ax.set_title("Exact MSE vs Δ; ▲ = local peak found by gradient ascent")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "whatif_worst_delta.png"))

    if opt.curve_scales.size:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.semilogy(opt.curve_scales, opt.curve_values, "-", color="0.6", lw=0.8, label="exact MSE (any S)")
        reps = formats.positive_values("e4m3")
        on = np.isin(opt.curve_scales.astype(np.float32), reps)
        ax.semilogy(opt.curve_scales[on], opt.curve_values[on], "o", ms=3, label="S an E4M3 value")
        ax.semilogy([256.0, 448.0], [opt.at_256, opt.at_448], "r*", ms=10, label="S = 256, 448")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("static scale S")
        ax.set_ylabel("expected MSE (Δ = 7)")
        ax.set_title("MSE vs S: dp(S) sawtooth + P = 1 atom")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / "whatif_scale.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(cal.deltas, cal.sim_mean, "ko", label=f"simulated {cal.target}")
    for m, c in cal.model_mean.items():
        ax.semilogy(cal.deltas, c, "-", label=f"fit, Z = {m}")
    ax.semilogy(cal.deltas, cal.paper_curve, "--", label="Prop. 3 + Eq. (6), c = 1, δ = δk")
    ax.set_xlabel("sink strength Δ")
    ax.set_ylabel("MSE")
    ax.set_title(f"Prop. 3 calibration ({cal.config}, N = {cal.n})")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "whatif_prop3.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
