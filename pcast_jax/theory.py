"""The paper's closed forms, exact and differentiable.

One module, over 600 lines: the closed forms build on one another (δk, F, Δc, the thresholds, the
theorems) and are read and checked as one set, one function per equation.

Every function names its equation / proposition. Scores follow the paper's model (§3.1): non-sink
scores ``s ~ N(0, σ²)`` and the ``k_sink`` sink scores ``Δ + σ·z`` with ``z ~ N(0, 1)``; the paper
is the case ``σ = 1``. ``scale`` is the static P-scale ``S`` of Alg. 1 (``P_fp8 = cast(P·S)``).

The smooth functions (δk, F, Δc, thresholds, Prop. 3, Thm. 4 and its sink-block gap) are written in
``jax.numpy`` and are ``jax.jit``- and ``jax.grad``-able in every real argument (Δ, S, σ and even k).
Concrete Python / numpy inputs are validated and raise :class:`~pcast_jax.errors.PcastError` naming the parameter;
traced values pass through unchecked. The discrete results (dp(S), Prop. 5, Theorems 6–7) are
computed by exact enumeration of the E4M3 number line.

A cast gives zero when ``P·S ≤ 2^-10`` (the tie at ``2^-10`` rounds to even, i.e. 0); the paper
writes ``<``, which differs only on a set of measure zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import log_ndtr, ndtr
from jax.scipy.stats import norm

from pcast_jax import formats
from pcast_jax.errors import PcastError, check_values, host_values, shown_value
from pcast_jax.numberline import SCALE_MAX, SCALE_MIN

#: Largest σ accepted: e^(σ²/2) is formed in log space, σ² must stay finite in float32.
_SIGMA_MAX = 1e18
#: Largest σ_V accepted: σ_V² times a sum of squared probabilities stays finite in float32.
_SIGMA_V_MAX = 1e15


def _check_scale(scale) -> None:
    """S in [2^-100, 2^100], as a kernel config takes it: S, 1/S and S·ℓ stay finite in float32."""
    check_values("scale", scale, lo=SCALE_MIN, lo_text="2^-100", float32=True, max_abs=SCALE_MAX)

__all__ = [
    "LN2",
    "delta_k",
    "delta_k_asymptotic",
    "underflow_threshold",
    "underflow_p_threshold",
    "collapse_fraction",
    "collapse_fraction_spread",
    "critical_delta",
    "mse_collapse",
    "pre_sink_max",
    "reverse_underflow_prob",
    "sink_block_collapse_fraction",
    "skip_softmax_lost_mass_bound",
    "non_sink_mass",
    "is_bit_exact_scale",
    "scaling_exactness",
    "dp",
    "dp_table",
    "top_lsb_table",
    "normal_coverage",
    "theorem6_holds",
    "Characterization",
    "characterize_s256",
    "table1_closed_form",
    "block_element_threshold",
    "block_scale_underflow",
    "block_critical_delta",
    "block_collapse_fraction",
    "block_step",
    "block_dp",
    "learned_sink_collapse_fraction",
    "learned_sink_critical_delta",
    "max_scaled_p",
    "saturation_free_scale",
    "diffuse_row_gain",
    "diffuse_row_vanishing_length",
]

LN2 = math.log(2.0)

# Fixed quadrature grid for densities of Gaussian maxima.  The density of the max of k iid N(0,1)
# is analytic and decays like a Gaussian on the left and like k·φ(x) on the right, so the plain
# trapezoid rule on a uniform grid converges geometrically; with step 0.01 on [-12, 14] the
# discretisation error is far below float32 rounding for every k in [1, 1e30].
_GRID_LO, _GRID_HI, _GRID_STEP = -12.0, 14.0, 0.01
_GRID_NP = _GRID_LO + _GRID_STEP * np.arange(int(round((_GRID_HI - _GRID_LO) / _GRID_STEP)) + 1)


def _float_dtype():
    return jnp.result_type(float)


def _cast_threshold_log(fmt) -> float:
    """``-ln(round-to-zero boundary)``: 10 ln 2 ≈ 6.93 for E4M3 (Eq. (5)), 17 ln 2 for E5M2."""
    return -math.log(formats.get_format(fmt).round_to_zero)


# --------------------------------------------------------------------------------------------
# Gaussian maxima (Eq. (3), Eq. (11)).
# --------------------------------------------------------------------------------------------
def _grid():
    return jnp.asarray(_GRID_NP, _float_dtype())


def _log_cdf(x):
    """ln Φ(x), accurate in float32 on both tails (ln Φ(x) = log1p(−Φ(−x)) for x > 0)."""
    positive = x > 0
    upper = jnp.log1p(-ndtr(-jnp.where(positive, x, 1.0)))
    lower = log_ndtr(jnp.where(positive, -1.0, x))
    return jnp.where(positive, upper, lower)


def _max_density(x, k):
    """Density of the max of ``k`` iid N(0,1) on ``x``: k·φ(x)·Φ(x)^(k-1) (in log space)."""
    return k * jnp.exp(norm.logpdf(x) + (k - 1.0) * _log_cdf(x))


def _expect_over_max(fn, k):
    """E[fn(M)] for M = max of ``k`` iid N(0,1), by the trapezoid rule on the fixed grid.

    ``k`` may be an array; ``fn`` receives the grid broadcast against ``k`` (grid on the last axis).
    """
    x = _grid()
    k = jnp.asarray(k, _float_dtype())
    shape = k.shape + x.shape
    x = jnp.broadcast_to(x, shape)  # explicit broadcasting: fine under rank_promotion="raise"
    density = _max_density(x, jnp.broadcast_to(k[..., None], shape))
    # Self-normalised (Σ weights = 1 exactly): removes the common float32 rounding of the density,
    # which keeps |error| < 1e-6 for k up to 1e30 in float32 (~1e-14 in float64).
    weights = density / jnp.sum(density, axis=-1, keepdims=True)
    return jnp.sum(weights * fn(x), axis=-1)


def delta_k(k):
    """δk = E[max of k iid N(0,1)], Eq. (3), computed exactly by quadrature.

    δk = ∫ x · k φ(x) Φ(x)^(k-1) dx, evaluated with the trapezoid rule on a fixed grid (absolute
    error below 1e-6 in float32 for k up to 1e30, ~1e-14 in float64). δ1 = 0,
    δ2 = 1/√π ≈ 0.5642, δ4 ≈ 1.0294. ``k`` may be real (the max whose CDF is Φ^k) and traced.

    Args:
      k: number of Gaussians, >= 1 (scalar or array).
    """
    check_values("k", k, lo=1.0, float32=True)
    return _delta_k_core(jnp.asarray(k, _float_dtype()))


@jax.jit
def _delta_k_core(k):
    return _expect_over_max(lambda x: x, k)


def delta_k_asymptotic(k):
    """The asymptotic √(2 ln k) that the paper contrasts with δk in §3.2 (1.67 at k = 4)."""
    check_values("k", k, lo=1.0, float32=True)
    return jnp.sqrt(2.0 * jnp.log(jnp.asarray(k, _float_dtype())))


# --------------------------------------------------------------------------------------------
# Forward-order collapse (Prop. 1, Eq. (5)–(7)).
# --------------------------------------------------------------------------------------------
def underflow_p_threshold(scale, *, fmt="e4m3"):
    """Largest P that casts to zero with scale S, Prop. 1 / Eq. (5): P·S ≤ 2^-10 ⇔ P ≤ 2^-10/S."""
    _check_scale(scale)
    rtz = formats.get_format(fmt).round_to_zero
    return rtz / jnp.asarray(scale, _float_dtype())


def underflow_threshold(delta, scale, *, k_sink=4, sigma=1.0, fmt="e4m3"):
    """Score below which a non-sink P underflows in forward order, Prop. 1 / Eq. (6).

    Forward order puts the sink block first, so m_global = Δ + σ·δk (Eq. (3) with sink scores
    Δ + σ z) and P = exp(s − m_global). P·S < 2^-10 ⇔ s < Δ + σ·δk − 10 ln 2 − ln S.
    σ enters only through the sink-max shift σ·δk; the threshold is on the raw score s (to turn it
    into a fraction divide by σ, see :func:`collapse_fraction`). σ = 1 gives Eq. (6) as printed.

    Args:
      delta: sink strength Δ (sink logit gap over the non-sink mean).
      scale: static P-scale S > 0.
      k_sink: number of sink tokens (>= 1).
      sigma: standard deviation σ > 0 of the scores.
      fmt: FP8 format of the cast (10 ln 2 becomes −ln(round-to-zero boundary)).
    """
    check_values("delta", delta, float32=True)
    _check_scale(scale)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    return _threshold_core(*_arrays(delta, scale, k_sink, sigma), cast_log=_cast_threshold_log(fmt))


def _arrays(*values):
    dtype = _float_dtype()
    return tuple(jnp.asarray(v, dtype) for v in values)


@functools.partial(jax.jit, static_argnames=("cast_log",))
def _threshold_core(delta, scale, k, sigma, *, cast_log):
    return delta + sigma * _delta_k_core(k) - cast_log - jnp.log(scale)


@functools.partial(jax.jit, static_argnames=("cast_log",))
def _fraction_core(delta, scale, k, sigma, *, cast_log):
    # (Δ + σδk − c − ln S)/σ = (Δ − c − ln S)/σ + δk, with a gradient in σ finite down to σ → 0
    return _prob(norm.cdf(_over_sigma(delta - cast_log - jnp.log(scale), sigma) + _delta_k_core(k)))


#: |a/σ| past which Φ is flat (Φ(−40) and 1 − Φ(40) are 0 in float64): clamped, gradient 0 there.
_Z_FLAT = 40.0


def _over_sigma(a, sigma):
    """a/σ with a gradient in σ that stays finite as σ → 0 (never 0·inf = NaN).

    Where |a| > 40σ the value is clamped to ±40 (Φ is flat) and σ is replaced before the division,
    so no infinite partial is formed; elsewhere |a/σ| ≤ 40 and d(a/σ)/dσ = −(a/σ)/σ is finite.
    """
    flat = jnp.abs(a) > _Z_FLAT * sigma
    safe = jnp.where(flat, 1.0, sigma)
    return jnp.where(flat, jnp.sign(a) * _Z_FLAT, a * jnp.exp(-jnp.log(safe)))


def _prob(x):
    """A probability or fraction clipped to [0, 1] (quadrature and float32 rounding can step out)."""
    return jnp.clip(x, 0.0, 1.0)


def collapse_fraction(delta, scale, *, k_sink=4, sigma=1.0, fmt="e4m3"):
    """Fraction of non-sink P zeroed in forward order, Corollary 2 / Eq. (7).

    Paper (σ = 1): F(Δ, S) = Φ(Δ + δk − 10 ln 2 − ln S). Generalisation to non-sink scores
    s ~ N(0, σ²) and sink scores Δ + σ z: the threshold of Eq. (6) on s is
    t = Δ + σ δk − 10 ln 2 − ln S, so F = Pr[s < t] = Φ((Δ + σ δk − 10 ln 2 − ln S)/σ).
    This plugs in the *mean* of the sink max; see :func:`collapse_fraction_spread` for the version
    that integrates over its spread. Smooth in Δ, S, σ (and k).
    """
    check_values("delta", delta, float32=True)
    _check_scale(scale)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    return _fraction_core(*_arrays(delta, scale, k_sink, sigma), cast_log=_cast_threshold_log(fmt))


def collapse_fraction_spread(delta, scale, *, k_sink=4, sigma=1.0, fmt="e4m3"):
    """Eq. (7) integrated over the per-row spread of m_global (proof of Corollary 2).

    F_spread = E_M[Φ((Δ + σM − 10 ln 2 − ln S)/σ)], M ~ max of k_sink iid N(0,1), i.e. the
    exact probability Pr[s < m_global − 10 ln 2 − ln S] when m_global is the sink max
    Δ + σ·max(z) (non-sink scores exceeding the sink max are neglected, which is immaterial
    for Δ ≳ 4). Equivalently Pr[s/σ − M < (Δ − 10 ln 2 − ln S)/σ], a wider distribution than the
    plug-in of Eq. (7): F_spread > F in the lower tail and F_spread < F in the upper tail. At
    Δ = Δc it equals E[Φ(M − δk)] ≈ 0.497 for k = 4 (not exactly 1/2: M is right-skewed), for
    every S and σ. It reproduces the paper's simulated Table 1 columns to about one point, where
    Eq. (7) is off by up to ~4 points.
    """
    check_values("delta", delta, float32=True)
    _check_scale(scale)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    return _spread_core(*_arrays(delta, scale, k_sink, sigma), cast_log=_cast_threshold_log(fmt))


@functools.partial(jax.jit, static_argnames=("cast_log",))
def _spread_core(delta, scale, k, sigma, *, cast_log):
    offset = _over_sigma(delta - cast_log - jnp.log(scale), sigma)
    offset, k = jnp.broadcast_arrays(offset, k)
    return _prob(_expect_over_max(lambda x: norm.cdf(offset[..., None] + x), k))


def critical_delta(scale, *, k_sink=4, sigma=1.0, fmt="e4m3"):
    """Critical sink strength Δc = 10 ln 2 + ln S − σ δk, Eq. (7) / §7.2.

    At Δ = Δc the median non-sink P sits on the round-to-zero boundary 2^-10/S and F = 1/2
    (for every σ). Δc ≈ 5.90 at S = 1 and ≈ 11.45 at S = 256 (k = 4, σ = 1).
    """
    _check_scale(scale)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    return _critical_core(*_arrays(scale, k_sink, sigma), cast_log=_cast_threshold_log(fmt))


@functools.partial(jax.jit, static_argnames=("cast_log",))
def _critical_core(scale, k, sigma, *, cast_log):
    return cast_log + jnp.log(scale) - sigma * _delta_k_core(k)


def mse_collapse(p, zeroed_mask, sigma_v, *, axis=-1):
    """Per-dimension output MSE from the zeroed set Z, Prop. 3 / Eq. (9).

    MSE = σV² / ℓ² · Σ_{j∈Z} P_j², with ℓ = Σ_j P_j over all positions (the exact FP32 running
    sum). Assumes zero-mean V rows with E[V Vᵀ] = σV² I, pairwise uncorrelated (Eq. (8)'s
    cross term vanishes). Smooth in ``p`` and ``sigma_v``.

    Args:
      p: probabilities P_j (any positive scale; only ratios to ℓ matter), reduced over ``axis``.
      zeroed_mask: boolean array of p's shape, True where the cast zeroed P_j (j ∈ Z).
      sigma_v: standard deviation σV of V's entries (>= 0).
      axis: the position axis.
    """
    check_values("sigma_v", sigma_v, lo=0.0, float32=True, max_abs=_SIGMA_V_MAX)
    p = jnp.asarray(p)
    zeroed_mask = jnp.asarray(zeroed_mask)
    if p.shape != zeroed_mask.shape:
        raise PcastError(f"zeroed_mask shape {zeroed_mask.shape} must equal p shape {p.shape}")
    if zeroed_mask.dtype != jnp.bool_:
        raise PcastError(f"zeroed_mask must be boolean, got dtype {zeroed_mask.dtype}")
    ell = jnp.sum(p, axis=axis)
    lost = jnp.sum(jnp.where(zeroed_mask, p * p, jnp.zeros_like(p)), axis=axis)
    return jnp.square(jnp.asarray(sigma_v, p.dtype)) * lost / jnp.square(ell)


def non_sink_mass(delta, *, n=4096, k_sink=4, sigma=1.0, per_row=True):
    """Share of the softmax mass on non-sink tokens (Table 1 "Non-sink mass").

    With A = Σ_{N−k} e^s (non-sink) and B = Σ_k e^(Δ+σz) (sinks) the share is A/(A + B).

    * ``per_row=False``: mean-field ratio of expectations (N − k)/((N − k) + k e^Δ) (the e^(σ²/2)
      factors cancel, so σ drops out).
    * ``per_row=True`` (default): E[A/(A + B)] over the sink fluctuations, the per-row average the
      paper tabulates. A is replaced by its mean (N − k)e^(σ²/2) (relative spread ≈ 2% at
      N = 4096, σ = 1, a second-order effect: ~0.1 point; ~0.3 point at σ = 2) and the
      expectation over the k lognormal sink terms is exact via 1/(1 + X) = ∫₀^∞ e^(−t(1+X)) dt:
      E = ∫₀^∞ e^(−t) L(c t)^k dt, L(u) = E[exp(−u e^(σz))], c = e^(Δ − σ²/2)/(N − k),
      a two-dimensional quadrature. Smooth in Δ, σ, N, k.
    """
    check_values("delta", delta, float32=True)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    _check_n(n, k_sink)
    dtype = _float_dtype()
    delta = jnp.asarray(delta, dtype)
    k = jnp.asarray(k_sink, dtype)
    rest = jnp.asarray(n, dtype) - k
    if not per_row:  # rest / (rest + k e^Δ) as a sigmoid: no overflow of e^Δ, finite gradients
        return _prob(jax.nn.sigmoid(jnp.log(rest) - jnp.log(k) - delta))
    return _prob(_per_row_mass_core(delta, k, rest, jnp.asarray(sigma, dtype)))


@jax.jit
def _per_row_mass_core(delta, k, rest, sigma):
    dtype = delta.dtype
    log_c = delta - 0.5 * jnp.square(sigma) - jnp.log(rest)
    z = jnp.asarray(np.linspace(-10.0, 10.0, 801), dtype)
    z_weight = jnp.exp(norm.logpdf(z))
    z_weight = z_weight / jnp.sum(z_weight)
    log_t = jnp.asarray(np.linspace(-30.0, 4.5, 1381), dtype)  # t = e^u, dt = t du
    t = jnp.exp(log_t)
    log_c, k, sigma = jnp.broadcast_arrays(log_c, k, sigma)
    lead = (1,) * log_c.ndim
    log_t_col = jnp.reshape(log_t, lead + (-1, 1))
    z_row = jnp.reshape(z, lead + (1, -1))
    # L(c t) for every t: E_z[exp(−c t e^(σ z))], shape (..., t, z).
    # The log argument is capped at 80 (e^80 is finite in float32): past it L is 0 to float32
    # precision anyway, and an infinite e^x would make the gradient 0 · inf = NaN (large Δ).
    log_arg = jnp.minimum(log_c[..., None, None] + log_t_col + sigma[..., None, None] * z_row, 80.0)
    exponent = -jnp.exp(log_arg)
    # ln L = log1p(−E[1 − e^(exponent)]): keeps float32 precision where L is close to 1.
    one_minus = jnp.sum(-jnp.expm1(exponent) * jnp.reshape(z_weight, lead + (1, -1)), axis=-1)
    one_minus = jnp.clip(one_minus, 0.0, 1.0 - jnp.finfo(dtype).eps)  # L^k stays > 0: finite grads
    t = jnp.reshape(t, lead + (-1,))
    t_weight = jnp.exp(-t) * t  # e^(−t) dt on the u = ln t grid; Σ t_weight·du = 1
    integrand = t_weight * jnp.exp(k[..., None] * jnp.log1p(-one_minus))
    # Self-normalised by the quadrature of ∫ e^(−t) dt = 1 (cancels common float32 rounding).
    return jnp.sum(integrand, axis=-1) / jnp.sum(t_weight, axis=-1)


# --------------------------------------------------------------------------------------------
# Reverse order (Eq. (11), Theorem 4 / Eq. (13)–(14)).
# --------------------------------------------------------------------------------------------
def _check_n(n, k_sink):
    check_values("n", n, lo=1.0, float32=True)
    n_arr, k_arr = host_values(n, "n"), host_values(k_sink, "k_sink")
    if n_arr is not None and k_arr is not None and np.any(n_arr - k_arr < 1):
        raise PcastError(f"{shown_value('n', n, np.min(n_arr))} must be > k_sink={np.max(k_arr):g} "
                         "(at least one non-sink token)")


def pre_sink_max(n, *, k_sink=4):
    """Pre-sink running max in reverse order, Eq. (11): m_pre-sink ≈ √(2 ln(N − k_sink)).

    The extreme-value bound for the max of N − k_sink standard Gaussians (in units of σ); it
    upper-bounds the exact mean, :func:`delta_k` at N − k_sink (4.08 vs 3.63 at N = 4096).
    """
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    _check_n(n, k_sink)
    dtype = _float_dtype()
    return jnp.sqrt(2.0 * jnp.log(jnp.asarray(n, dtype) - jnp.asarray(k_sink, dtype)))


_MAX_MODELS = ("eq11", "mean", "distribution")


def reverse_underflow_prob(n, scale, *, k_sink=4, sigma=1.0, fmt="e4m3", max_model="eq11"):
    """Probability that a non-sink P underflows before the sink block in reverse order, Thm. 4.

    Eq. (13)–(14): P = exp(s − m) survives iff s > m − 10 ln 2 − ln S (m − 18 ln 2 at S = 256), so
    Pr[underflow] = Φ((m − 10 ln 2 − ln S)/σ) with m = σ·μ the running max in score units.
    ``max_model`` picks μ:

    * ``"eq11"`` — the paper's μ = √(2 ln(N − k_sink)) (Eq. (11)), which exceeds E[max];
    * ``"mean"`` — the exact expected max δ_{N−k_sink} (Eq. (3) with k = N − k_sink), plugged in;
    * ``"distribution"`` — E_M[Φ(M − (10 ln 2 + ln S)/σ)] over the law of that max: the
      per-token probability in the last pre-sink block (checked against simulation). Φ is convex
      in the lower tail, so the plug-in ``"mean"`` value is smaller, and the upper tail of M can
      make it larger than ``"eq11"`` (2.3e-15 vs 2.3e-17 at N = 4096, S = 256); at N = 10^6,
      S = 256 it is 5e-13, so Theorem 4's "< 1e-12" still holds.

    All models use the *final* pre-sink max; blocks processed earlier see a smaller running max
    and underflow less. The B − k_sink non-sink tokens that share the sink's block are processed
    with m = sink max and follow Eq. (7) instead.
    """
    _check_scale(scale)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    _check_n(n, k_sink)
    if max_model not in _MAX_MODELS:
        raise PcastError(f"max_model={max_model!r} is not one of {', '.join(map(repr, _MAX_MODELS))}")
    return _reverse_core(*_arrays(n, scale, k_sink, sigma), cast_log=_cast_threshold_log(fmt),
                         max_model=max_model)


@functools.partial(jax.jit, static_argnames=("cast_log", "max_model"))
def _reverse_core(n, scale, k, sigma, *, cast_log, max_model):
    gap = (cast_log + jnp.log(scale)) / sigma
    count = n - k
    if max_model == "eq11":
        return _prob(norm.cdf(jnp.sqrt(2.0 * jnp.log(count)) - gap))
    if max_model == "mean":
        return _prob(norm.cdf(_delta_k_core(count) - gap))
    gap, count = jnp.broadcast_arrays(gap, count)
    return _prob(_expect_over_max(lambda x: norm.cdf(x - gap[..., None]), count))


def sink_block_collapse_fraction(delta, scale=256.0, *, n=4096, block_kv=64, k_sink=4, sigma=1.0, fmt="e4m3"):
    """Fraction of non-sink P that reverse order still zeroes: the keys in the sink's KV block, Thm. 4.

    Theorem 4 (Eq. (13)–(14), :func:`reverse_underflow_prob`) covers the blocks processed before the
    sink's: their running max is the non-sink max, and at S = 256 they underflow with probability
    below 1e-12. The ``min(B, N) − k_sink`` non-sink keys that share the sink's block (the ``k_sink``
    sinks at positions 0 … k_sink − 1, block 0, processed last) take P = exp(s − m) against the sink's max
    inside that block and zero as in forward order, Eq. (7). Of all ``N − k_sink`` non-sink keys the
    zeroed fraction is

        (min(B, N) − k) / (N − k) · F(Δ, S),

    with F integrated over the spread of the sink max (:func:`collapse_fraction_spread`; the plug-in
    :func:`collapse_fraction` gives 0.11 % instead of 0.17 % at Δ = 10, S = 256, B = 64, N = 4096). It
    is 0.17 % at Δ = 10 and 0.99 % at Δ = 12 there, bounded by (B − k)/(N − k) as Δ grows. The
    pre-sink underflow of Eq. (14) is left out (below 1e-12 of the keys at S = 256).
    """
    check_values("block_kv", block_kv, lo=1.0, float32=True)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    _check_n(n, k_sink)
    b_arr, k_arr = host_values(block_kv, "block_kv"), host_values(k_sink, "k_sink")
    if b_arr is not None and k_arr is not None and np.any(b_arr < k_arr):
        raise PcastError(f"{shown_value('block_kv', block_kv, np.min(b_arr))} must be >= k_sink="
                         f"{np.max(k_arr):g} (the sinks share one KV block)")
    share = (jnp.minimum(jnp.asarray(block_kv, _float_dtype()), n) - k_sink) / (jnp.asarray(n, _float_dtype())
                                                                               - k_sink)
    return share * collapse_fraction_spread(delta, scale, k_sink=k_sink, sigma=sigma, fmt=fmt)


# --------------------------------------------------------------------------------------------
# Skip-softmax (beyond the paper: TensorRT-LLM fmha_v2 / FlashInfer trtllm-gen, BLASST).
# --------------------------------------------------------------------------------------------
def skip_softmax_lost_mass_bound(threshold, *, n=4096, block_kv=64):
    """Largest exact softmax mass a row loses to skip-softmax with threshold λ (beyond the paper).

    A KV block is skipped only when its max is below the running max before it by more than −ln λ
    (:func:`pcast_jax.block.skip_rows`), so each key it holds has exp(s − M) < λ against the row's
    final max M, and the block holding the row's maximum is never skipped (its max is at least the
    running max before it). With L the skipped keys' Σ exp(s − M) < K·λ and the kept mass R ≥ 1 (the
    maximum itself), the lost share L / (L + R) obeys

        lost < K·λ / (1 + K·λ),   K = max(N − B, 0)

    (renormalised, not zeroed: the output is the softmax over the kept keys). With FlashInfer's
    λ = factor / N it stays below factor / (1 + factor) at every N. It is attained as the skipped keys
    approach exp(s − M) = λ and the maximum's block holds nothing else. A learned sink as the initial
    running max can see every block skipped: pass ``block_kv=0`` (K = N, the sink's term is R ≥ 1).
    """
    check_values("threshold", threshold, lo=0.0, float32=True)
    lam = host_values(threshold, "threshold")
    if lam is not None and np.any(lam >= 1.0):
        raise PcastError(f"{shown_value('threshold', threshold, np.max(lam))} must be < 1 (skip_softmax_threshold)")
    check_values("n", n, lo=1.0, float32=True)
    check_values("block_kv", block_kv, lo=0.0, float32=True)
    k = jnp.maximum(jnp.asarray(n, _float_dtype()) - jnp.asarray(block_kv, _float_dtype()), 0.0)
    x = k * jnp.asarray(threshold, _float_dtype())
    return x / (1.0 + x)


# --------------------------------------------------------------------------------------------
# Scale factor (Prop. 5, Def. 1, Remark 3, §5.3, Theorems 6–7).
# --------------------------------------------------------------------------------------------
def is_bit_exact_scale(scale):
    """Whether S is a power of two whose reciprocal is also a normal float32, Prop. 5 (C1).

    S = 2^k with −126 ≤ k ≤ 126: then S and 1/S are exact float32 and x·S, x·(1/S) only move the
    exponent. Any other S (e.g. 448) rounds x·S for most x. S is read as float32 (the kernel's
    type). Returns a boolean array (``bool()`` it for a scalar).
    """
    check_values("scale", scale, lo=0.0, strict=True, float32=True)  # a predicate: any float32 S
    s = jnp.asarray(scale, jnp.float32)
    mantissa, exponent = jnp.frexp(s)  # s = mantissa · 2^exponent, mantissa in [0.5, 1)
    k = exponent - 1
    return (mantissa == 0.5) & (k >= -126) & (k <= 126) & jnp.isfinite(s)


def scaling_exactness(x, scale):
    """Check Prop. 5 on float32 values: are x·S and x·(1/S) exact? (numpy, IEEE arithmetic).

    Both products are formed in float32 exactly as a kernel does (``x * S`` and
    ``x * float32(1/S)``) and compared with exact float64 arithmetic: a float32×float32 product
    is exact in float64, so ``r == x·S`` and ``r·S == x`` are exact tests. Subnormal float32
    inputs/results are outside Prop. 5's "result in representable range" (and XLA on CPU
    flushes them), so they are reported as out of range.

    Args:
      x: array of float32 values.
      scale: the scale S (> 0).

    Returns:
      ``(exact, in_range)``: boolean arrays of x's shape. ``exact`` is True where both products
      are exact; ``in_range`` where x, x·S and x/S are zero or normal finite float32.
      Prop. 5 says ``exact[in_range]`` is all True exactly when S = 2^k.
    """
    _check_scale(scale)
    x32 = np.asarray(x, dtype=np.float32)
    s32 = np.float32(scale)
    inv32 = np.float32(1.0) / s32
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        mul = x32 * s32
        rec = x32 * inv32
        x64, s64 = x32.astype(np.float64), np.float64(s32)
        exact = (mul.astype(np.float64) == x64 * s64) & (rec.astype(np.float64) * s64 == x64)
        tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max

        def normal(v):
            a = np.abs(v)
            return (a == 0) | ((a >= tiny) & (a <= big))

        in_range = normal(x64) & normal(x64 * s64) & normal(x64 / s64) & np.isfinite(x64)
    return exact, in_range


def _cells(fmt):
    """Left ends and widths of the cells [v_i, v_{i+1}) of the non-negative number line."""
    values = np.concatenate([[0.0], formats.positive_values(fmt).astype(np.float64)])
    return values[:-1], np.maximum.accumulate(np.diff(values))


def top_lsb_table(scales, *, fmt="e4m3"):
    """Numerator of Eq. (17): the largest LSB among cells [v_i, v_{i+1}) with v_i < S (numpy).

    This is the LSB of the binade containing the largest x < S: 2^(n−3) with n = ⌈log2 S⌉ − 1
    (n = ⌊log2 S⌋ unless S is a power of two; at S = 2^k the top binade used is [2^(k−1), 2^k)),
    and 2^-9 for S ≤ 2^-5 (subnormal spacing). For S above max it is the top binade's LSB (32).
    Exact (a power of two), so ``top_lsb_table(S) * 16 > S`` tests dp(S) > 2^-4 without rounding.
    """
    scales = np.asarray(scales, dtype=np.float64)
    _check_scale(scales)
    starts, widths = _cells(fmt)
    idx = np.searchsorted(starts, scales, side="left")  # number of cell starts < S (>= 1)
    return widths[idx - 1]


def dp_table(scales, *, fmt="e4m3"):
    """dp(S) of Definition 1 / Eq. (17) and Remark 3 / Eq. (18) for many S (numpy, float64).

    dp(S) = max_{x∈[0,S)} LSB(x) / S by enumeration of the 126 positive E4M3 values (the binade
    with maximum LSB overlapping [0, S]); for S > 448 the saturation term of Remark 3 joins:
    dp(S) = max(32/S, 2(1 − 448/S)). Appendix A: dp(2^k) = 2^-4 (k = 0..8; in fact k = −5..8),
    dp(3) = 0.083, dp(100) = 0.080, dp(250) = 0.064, dp(300) = 0.107, dp(448) = 0.071,
    dp(512) = 0.25; for S ≤ 2^-5 (subnormal range, §5 footnote) dp(S) = 2^-9/S.

    "Overlapping" means overlapping in more than a point: at S = 2^k the binade [2^k, 2^(k+1))
    touches [0, S] only at S itself and is excluded (Theorem 6 proof, Appendix A: the top binade
    is [2^(k−1), 2^k)). For another ``fmt`` the same enumeration runs on its number line and
    Remark 3 uses its max and top-binade LSB.
    """
    scales = np.asarray(scales, dtype=np.float64)
    _check_scale(scales)
    f = formats.get_format(fmt)
    out = top_lsb_table(scales, fmt=fmt) / scales
    saturated = scales > f.max
    overflow_step = 2.0 * (1.0 - f.max / np.where(saturated, scales, f.max))
    return np.where(saturated, np.maximum(out, overflow_step), out)


def dp(scale, *, fmt="e4m3"):
    """dp(S), Definition 1 / Eq. (17) with Remark 3 / Eq. (18) above max (jax.numpy, jit-able).

    Same values as :func:`dp_table` (which is float64 numpy); piecewise smooth in S, so
    ``jax.grad`` gives −LSB/S² (or Remark 3's slope) away from the binade edges.
    """
    _check_scale(scale)
    return _dp_core(jnp.asarray(scale, _float_dtype()), fmt=formats.get_format(fmt).name)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _dp_core(s, *, fmt):
    f = formats.get_format(fmt)
    starts_np, widths_np = _cells(fmt)
    dtype = s.dtype
    idx = jnp.searchsorted(jnp.asarray(starts_np, dtype), s, side="left")
    step = jnp.asarray(widths_np, dtype)[jnp.clip(idx - 1, 0, widths_np.size - 1)]
    ratio = step / s
    overflow_step = 2.0 * (1.0 - f.max / s)
    return jnp.where(s > f.max, jnp.maximum(ratio, overflow_step), ratio)


def normal_coverage(scale, *, fmt="e4m3"):
    """Lower end of the normal range in the P domain, 2^-6/S (§5.3, condition (C3)); smaller = better."""
    _check_scale(scale)
    return formats.get_format(fmt).smallest_normal / jnp.asarray(scale, _float_dtype())


def _non_power_grid(lo, hi, count):
    """Dense log grid in [lo, hi] plus float64 neighbours of every power of two, minus powers."""
    grid = np.geomspace(lo, hi, count)
    k = np.arange(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)
    pw = np.ldexp(1.0, k)
    grid = np.concatenate([grid, np.nextafter(pw, 0.0), np.nextafter(pw, np.inf), pw * 1.001,
                           pw * 0.999, [lo, hi]])
    grid = grid[(grid >= lo) & (grid <= hi)]
    mantissa, _ = np.frexp(grid)
    return np.unique(grid[mantissa != 0.5])


def theorem6_holds(*, grid_points=20001, upper=4096.0, fmt="e4m3") -> dict[str, bool]:
    """Check Theorem 6 (i)–(iii) by exhaustive enumeration; returns ``{"i": …, "ii": …, "iii": …}``.

    (i) dp(2^k) = 2^-4 exactly for k = 0..8; (ii) dp(S) > 2^-4 for every non-power-of-two S in
    [2^-6, 448] of a dense log grid plus the float64 neighbours of each power of two (tested
    exactly as LSB·16 > S); (iii) dp(S) > 2^-4 (Remark 3 form) on a dense grid of S in
    (448, ``upper``], powers of two included. Also records (i') the extension to k = −5..8 and
    the footnote value dp(S) = 2^-9/S below 2^-5.
    """
    f = formats.get_format(fmt)
    target = 2.0 ** -(f.mantissa_bits + 1)
    pw = np.ldexp(1.0, np.arange(0, 9))
    result = {"i": bool(np.all(dp_table(pw, fmt=fmt) == target))}
    grid = _non_power_grid(f.smallest_normal, f.max, grid_points)
    result["ii"] = bool(np.all(top_lsb_table(grid, fmt=fmt) / target > grid))
    above = np.concatenate([np.geomspace(f.max, upper, grid_points)[1:],
                            [np.nextafter(f.max, np.inf)],
                            np.ldexp(1.0, np.arange(9, int(math.log2(upper)) + 1))])
    result["iii"] = bool(np.all(dp_table(above, fmt=fmt) > target))
    low_pw = np.ldexp(1.0, np.arange(-5, 9))
    result["i_extended"] = bool(np.all(dp_table(low_pw, fmt=fmt) == target))
    tiny = np.geomspace(f.smallest_subnormal, 2.0 ** -5, 257)
    result["subnormal_footnote"] = bool(
        np.allclose(dp_table(tiny, fmt=fmt), f.smallest_subnormal / tiny, rtol=1e-15, atol=0))
    return result


@dataclasses.dataclass(frozen=True, slots=True)
class Characterization:
    """Theorem 7's three conditions evaluated on S = 2^k, k = 0..k_max."""

    c1: tuple[float, ...]  # bit-exact scales 2^k (Prop. 5)
    c2: tuple[float, ...]  # those with dp(S) = 2^-4 (Theorem 6)
    c3: float  # max{2^k : 2^k <= max}
    unique: tuple[float, ...]  # scales satisfying C1, C2 and C3
    best_coverage_in_c2: float  # arg min of 2^-6/S over the C2 candidates


def characterize_s256(*, k_max=30, fmt="e4m3") -> Characterization:
    """Theorem 7: among S = 2^k (k >= 0), the scales satisfying (C1) bit-exactness, (C2)
    dp(S) = 2^-4 and (C3) S = max{2^k : 2^k <= 448}, by exhaustive enumeration.

    ``unique`` is ``(256.0,)`` for E4M3. (C1)∧(C2) leave nine candidates {1, …, 256} and
    (C3) — equivalently the best normal coverage 2^-6/S among them — picks 256 (Remark 4).
    """
    f = formats.get_format(fmt)
    target = 2.0 ** -(f.mantissa_bits + 1)
    scales = np.ldexp(1.0, np.arange(0, k_max + 1))
    c1 = tuple(float(s) for s in scales if bool(is_bit_exact_scale(float(s))))
    c1_arr = np.asarray(c1)
    c2 = tuple(float(s) for s in c1_arr[dp_table(c1_arr, fmt=fmt) == target])
    c3 = float(scales[scales <= f.max].max())
    unique = tuple(s for s in c2 if s == c3)
    c2_arr = np.asarray(c2)
    best = float(c2_arr[np.argmin(f.smallest_normal / c2_arr)])
    return Characterization(c1=c1, c2=c2, c3=c3, unique=unique, best_coverage_in_c2=best)


def table1_closed_form(deltas, *, k_sink=4, n=4096, sigma=1.0) -> dict[str, np.ndarray]:
    """Closed-form columns of Table 1 (N = 4096, k_sink = 4) for the given Δ values.

    Returns numpy arrays keyed ``delta``, ``frac_zeroed_s1`` / ``frac_zeroed_s256`` (Eq. (7)),
    ``frac_zeroed_s1_spread`` / ``frac_zeroed_s256_spread`` (Eq. (7) integrated over the sink-max
    spread), ``non_sink_mass`` (per-row average, :func:`non_sink_mass`) and ``info_loss``
    (non-sink mass × frac. zeroed at S = 1, as the paper defines it; from the spread column).
    All fractions in [0, 1].
    """
    deltas = np.asarray(deltas, dtype=np.float64)
    check_values("delta", deltas, float32=True)
    d = jnp.asarray(deltas, _float_dtype())
    out = {"delta": deltas}
    for s, tag in ((1.0, "s1"), (256.0, "s256")):
        out[f"frac_zeroed_{tag}"] = np.asarray(collapse_fraction(d, s, k_sink=k_sink, sigma=sigma))
        out[f"frac_zeroed_{tag}_spread"] = np.asarray(
            collapse_fraction_spread(d, s, k_sink=k_sink, sigma=sigma))
    out["non_sink_mass"] = np.asarray(non_sink_mass(d, n=n, k_sink=k_sink, sigma=sigma))
    out["info_loss"] = out["non_sink_mass"] * out["frac_zeroed_s1_spread"]
    return out



# --------------------------------------------------------------------------------------------
# Block-scaled P (MXFP8, MXFP4, NVFP4): the project's own derivations, not the paper's.
# --------------------------------------------------------------------------------------------
#
# Setting (forward order, sinks first, the paper's §3.1 scores): x = P·S with P = exp(s − m) and
# m = Δ + σ M_s the sink max (M_s = max of k_sink standard normals). Keys are cast in blocks of K
# (32 for MX, 16 for NVFP4) with a = max of x over the block. The element format has largest
# normal E = 2^emax·(…), round-to-zero boundary r_e (half its smallest subnormal: 2^-10 for E4M3,
# 1/4 for E2M1) and emax = ⌊log2 E⌋; the NVFP4 scale format (UE4M3) rounds to zero at r_s = 2^-10.


def _block_parts(fmt):
    bf = formats.get_block_format(fmt)
    el = bf.element
    return bf, float(el.max), float(el.round_to_zero), int(el.emax), int(el.mantissa_bits)


def block_element_threshold(block_max, *, fmt="nvfp4", exact=True):
    """Largest x in a block with maximum ``block_max`` = a that the block-scaled cast sends to 0.

    MX (OCP MX v1.0): X = 2^(⌊log2 a⌋ − emax) and an element is zero iff x/X ≤ r_e, so the threshold
    is r_e·X, between r_e·a·2^(−emax−1) and r_e·a·2^(−emax): 2^-18·a … 2^-19·a for MXFP8 (E4M3),
    a/16 … a/32 for MXFP4 (E2M1). NVFP4: s = E4M3(a/6) and x is zero iff x/s ≤ 1/4, i.e. x ≤ s/4 ≈
    a/24 (exactly s/4; 0 if s itself rounds to 0: then every x ≤ a is zero and a is returned).

    ``exact=False`` drops the rounding of the scale (MX: ⌊log2 a⌋ → log2 a, the upper end; NVFP4:
    s → a/6), which makes the threshold linear in a and so useful under ``jax.grad``; the exact
    version is jit-able and piecewise constant (MX) or piecewise linear in a through the rounding.
    """
    bf, emax_val, r_e, emax, _ = _block_parts(fmt)
    check_values("block_max", block_max, lo=0.0, float32=True)
    a = jnp.asarray(block_max, _float_dtype())
    if bf.is_mx:
        if not exact:
            return r_e * a * 2.0**-emax
        _, e = jnp.frexp(a)
        return r_e * jnp.ldexp(jnp.ones_like(a), jnp.clip(e - 1 - emax, -126, 127))
    if not exact:
        return r_e * a / emax_val
    sb = formats.to_fp8(a.astype(jnp.float32) / emax_val, formats.UE4M3).astype(a.dtype)
    return jnp.where(sb > 0, r_e * sb, a)


def block_scale_underflow(scale, *, fmt="nvfp4"):
    """Largest block-max P (relative to the row max P = 1) whose whole block the cast zeroes.

    NVFP4: the UE4M3 scale a/6 rounds to zero iff a/6 ≤ 2^-10 (the tie goes to the even 0), with
    a = S·max_b P, so the block is lost iff max_b P ≤ 6·2^-10/S. With SageAttention3's row
    normalisation S = 448·6 this is 2^-10/448 ≈ 2.18e-6: ln(max_b P) ≤ −(10 ln 2 + ln 448) ≈ −13.04,
    a block whose largest score sits 13.04 below the row max vanishes.
    MX: E8M0 has no zero; the exponent is clamped (at −127 by the format, −126 in the float32
    simulator), after which elements are zeroed at r_e·2^-126: the whole block goes when
    max_b P ≤ r_e·2^-126/S (≈ e^-94 for E4M3 at S = 1), never in practice.
    Smooth in S (jit- and grad-able).
    """
    bf, emax_val, r_e, _, _ = _block_parts(fmt)
    _check_scale(scale)
    (s,) = _arrays(scale)
    if bf.is_mx:
        return r_e * 2.0**-126 / s
    return emax_val * float(formats.UE4M3.round_to_zero) / s


def block_critical_delta(scale, *, fmt="nvfp4", k_sink=4, sigma=1.0):
    """Δc of a block-scaled P: the sink strength at which the typical block's scale underflows.

    A non-sink block's max score is σ·M_b with M_b the max of K normals, mean δ_K; the block is
    lost when S·exp(σM_b − m) ≤ 6·2^-10 (NVFP4, :func:`block_scale_underflow`) with m = Δ + σδk.
    Setting M_b = δ_K gives Δc = ln(S / (6·2^-10)) + σ(δ_K − δk): the analogue of Eq. (7)'s
    Δc = 10 ln 2 + ln S − σδk, with the element boundary replaced by the scale boundary and the
    block max δ_K in place of the median non-sink score 0. NVFP4, S = 2688, k = 4: Δc ≈ 13.77
    (E4M3 per-tensor: 5.90 at S = 1, 11.45 at S = 256). For MX the scale cannot underflow before
    e^-94: Δc = ln(S/(r_e 2^-126)) + σ(δ_K − δk) is returned for completeness.
    """
    bf, _, _, _, _ = _block_parts(fmt)
    check_values("k_sink", k_sink, lo=1.0, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    k, sg = _arrays(k_sink, sigma)
    thr = block_scale_underflow(scale, fmt=fmt)
    return -jnp.log(thr) + sg * (_delta_k_core(jnp.asarray(float(bf.block), _float_dtype())) - _delta_k_core(k))


def block_collapse_fraction(delta, scale, *, fmt="nvfp4", n=4096, k_sink=4, sigma=1.0):
    """Expected fraction of non-sink P the block-scaled cast zeroes, forward order (cf. Eq. (7)).

    Derivation. Take a non-sink key j in a block of K keys without sinks; z_j and the other K − 1
    standardized scores are iid N(0, 1), M' = max of the others, m = Δ + σM_s, c = ln S − m.

    NVFP4: the block scale is zero iff σ max(z_j, M') + c ≤ ln(6 r_s), i.e. max(z_j, M') ≤ t with
    t = (ln(6 r_s) − c)/σ; otherwise x_j is zero iff x_j ≤ a/24 (element threshold with s → a/6),
    i.e. z_j ≤ M' − L/σ with L = ln(6/r_e) = ln 24 (z_j cannot be the block max then). Hence

      Pr[zero | M', M_s] = Φ(t) if M' ≤ t, else Φ(M' − L/σ),

    F_block = E_{M_s} E_{M'}[·] with M' ~ max of K − 1 and M_s ~ max of k_sink normals (the spread
    of the sink max integrated as in the proof of Corollary 2).
    MX: the scale never underflows in practice; x_j is zero iff x_j ≤ r_e·X with
    X = 2^(⌊log2 a⌋ − emax): z_j ≤ M' − L_u/σ, L_u = (emax + u) ln 2 − ln r_e, u = frac(log2 a),
    averaged over u uniform on [0, 1) (assumption: a's mantissa is spread over a binade). MX's F
    does not depend on Δ or S: the per-block scale removes the sink's influence entirely.
    The K − k_sink non-sink keys sharing the sinks' scale block have a = S (the sink max is the
    row max, P = 1): zero iff σz_j ≤ m − L (NVFP4; r_e·X with u = frac(log2 S) for MX).
    F = [(n − K)·F_block + (K − k_sink)·F_sink] / (n − k_sink), assuming the sinks lead the row and
    no non-sink score exceeds the sink max (Δ ≳ 4, as Eq. (7) assumes).

    ``delta``, ``scale`` may be traced (jit, grad in both); ``n``, ``k_sink``, ``sigma`` numbers.
    """
    bf, emax_val, r_e, emax, _ = _block_parts(fmt)
    check_values("delta", delta, float32=True)
    _check_scale(scale)
    k_sink_i = int(k_sink)
    kb = bf.block
    if not 1 <= k_sink_i <= kb or int(n) < 2 * kb:
        raise PcastError(f"block_collapse_fraction needs 1 <= k_sink <= {kb} (one scale block holds the sinks) "
                         f"and n >= {2 * kb}; got k_sink={k_sink!r}, n={n!r}")
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    d, s, sg = _arrays(delta, scale, sigma)  # σ may be traced too (grad in σ)
    u = (jnp.arange(16, dtype=_float_dtype()) + 0.5) / 16.0  # midpoints of the fractional part
    if bf.is_mx:
        lu = ((emax + u) * LN2 - math.log(r_e)) / sg  # (16,)
        f_block = _expect_over_max(lambda x: jnp.mean(norm.cdf(x[..., None] - lu.reshape((1,) * x.ndim + lu.shape)),
                                                       axis=-1), float(kb - 1))
        f_block = jnp.broadcast_to(f_block, jnp.broadcast_shapes(d.shape, s.shape))
        frac = jnp.log2(s) - jnp.floor(jnp.log2(s))
        l_sink = ((emax + frac) * LN2 - math.log(r_e)) / sg
        f_sink = _expect_over_max(lambda x: norm.cdf((d[..., None] + sg * x) / sg - l_sink[..., None]), float(k_sink_i))
    else:
        ln_rs = math.log(emax_val * float(formats.UE4M3.round_to_zero))
        big_l = math.log(emax_val / r_e) / sg

        # ∫_t^∞ Φ(m − L) f_{K−1}(m) dm on a grid anchored at t (y = m − t ≥ 0), so that the moving
        # boundary is differentiated too (below the grid's −12 the density is nil: anchored there);
        # trapezoid rule over the grid's span, the density decays like a Gaussian.
        y = jnp.asarray(np.arange(0.0, _GRID_HI - _GRID_LO + 1e-9, 0.01), _float_dtype())
        wy = jnp.full(y.shape, 0.01, _float_dtype()).at[0].set(0.005).at[-1].set(0.005)

        def given_sink(ms):  # ms: (..., G) sink max values -> Pr[zero | M_s], (..., G)
            t = (ln_rs - jnp.log(s)[..., None] + d[..., None] + sg * ms) / sg
            mo = jnp.maximum(t, _GRID_LO)[..., None] + y
            tail = jnp.sum(wy * norm.cdf(mo - big_l) * _max_density(mo, float(kb - 1)), axis=-1)
            return jnp.exp(kb * _log_cdf(t)) + tail

        d, s = jnp.broadcast_arrays(d, s)
        f_block = _expect_over_max(given_sink, jnp.full(d.shape, float(k_sink_i), _float_dtype()))
        f_sink = _expect_over_max(lambda x: norm.cdf((d[..., None] + sg * x) / sg - big_l), float(k_sink_i))
    n_f = float(n)
    return _prob(((n_f - kb) * f_block + (kb - k_sink_i) * f_sink) / (n_f - k_sink_i))


def block_step(block_max, *, fmt="nvfp4"):
    """Spacing of the element grid at the top of a block with maximum a, in x's units (cf. dp(S)).

    The largest rounding step any value of the block sees is the spacing of the element format's
    top binade times the block scale: 2^(emax − mant)·X for MX (X = 2^(⌊log2 a⌋ − emax): 2^(⌊log2 a⌋
    − mant)), 2·s for NVFP4 (E2M1's top binade [4, 6] has spacing 2; s = E4M3(a/6)). Jit-able;
    piecewise smooth in a. Divide by a for the relative step (:func:`block_dp`).
    """
    bf, emax_val, _, emax, mant = _block_parts(fmt)
    a = jnp.asarray(block_max, _float_dtype())
    top = 2.0 ** (emax - mant)
    if bf.is_mx:
        _, e = jnp.frexp(a)
        return top * jnp.ldexp(jnp.ones_like(a), jnp.clip(e - 1 - emax, -126, 127))
    sb = formats.to_fp8(a.astype(jnp.float32) / emax_val, formats.UE4M3).astype(a.dtype)
    return top * sb


def block_dp(fmt="nvfp4"):
    """sup over a of block_step(a)/a, the block-scaled analogue of dp(S) (Definition 1).

    dp(S) is the top-binade LSB relative to S; here the block max plays S's part and the scale
    is re-chosen per block, so the bound holds whatever S and Δ are. MX: 2^(⌊log2 a⌋ − mant)/a ≤
    2^-mant, reached at a = 2^k: 1/8 for MXFP8 (E4M3; dp(2^k) = 1/16 for a per-tensor S = 2^k,
    since MX puts a in the top binade [2^emax X, 2^(emax+1) X) that E4M3 saturates at 448 < 512),
    1/2 for MXFP4. NVFP4: 2·E4M3(a/6)/a ≤ (2/6)(1 + 2^-4) = 0.3542 while a/6 is an E4M3 normal
    (a ≥ 6·2^-6); below, the subnormal scale step makes it larger.
    """
    bf, emax_val, _, _, mant = _block_parts(fmt)
    if bf.is_mx:
        return 2.0**-mant
    return 2.0 ** (bf.element.emax - mant) / emax_val * (1.0 + 2.0 ** -(formats.E4M3.mantissa_bits + 1))


# --------------------------------------------------------------------------------------------
# Beyond the paper: a learned sink as the initial running max, and the lazy rescale (τ).
# --------------------------------------------------------------------------------------------
def learned_sink_collapse_fraction(delta_l, scale, *, sigma=1.0, n_segments=1, fmt="e4m3"):
    """Fraction of non-sink P zeroed when a learned sink logit is the initial running max.

    Derivation (our own, the paper's model of §3.1 with a learned sink instead of sink tokens): a
    kernel that starts its online softmax at m = s_L (sink_mode ``"init_max"``: vLLM's Triton
    attention, cuDNN) keeps m = s_L for every block while s_L exceeds the token scores, in *either*
    KV order, so every non-sink P = exp(s − Δ_L) with Δ_L = s_L above the non-sink mean. Prop. 1 then
    gives P·S ≤ 2^-10 ⇔ s ≤ Δ_L − 10 ln 2 − ln S, and for s ~ N(0, σ²)

        F_L(Δ_L, S) = Φ((Δ_L − 10 ln 2 − ln S) / σ),

    Eq. (7) with no δk shift (one deterministic logit, not the max of k sink tokens) and no dependence
    on the order: reverse iteration is no longer a fix. In split-KV mode only segment 0 starts from
    s_L (the merge adds the sink once); the other segments run from their own token maxima and lose
    almost nothing, so F ≈ F_L / n_segments. An ``"epilogue"`` kernel never puts s_L in its running
    max: the learned sink zeroes nothing there. ``scale`` is the S the cast applies (cuDNN: scale_s·2^-τ).
    Smooth in Δ_L, S and σ.
    """
    check_values("delta_l", delta_l, float32=True)
    check_values("scale", scale, lo=0.0, strict=True, float32=True)
    check_values("sigma", sigma, lo=0.0, strict=True, float32=True, max_abs=_SIGMA_MAX)
    check_values("n_segments", n_segments, lo=1.0, float32=True)
    return _learned_core(*_arrays(delta_l, scale, sigma, n_segments), cast_log=_cast_threshold_log(fmt))


@functools.partial(jax.jit, static_argnames=("cast_log",))
def _learned_core(delta_l, scale, sigma, n_segments, *, cast_log):
    return _prob(norm.cdf((delta_l - cast_log - jnp.log(scale)) / sigma) / n_segments)


def learned_sink_critical_delta(scale, *, fmt="e4m3"):
    """Δ_L,c = 10 ln 2 + ln S: the learned-sink logit at which half the non-sink P is zeroed under the
    initial-max placement (:func:`learned_sink_collapse_fraction` = 1/2, for every σ). 6.93 at S = 1,
    12.48 at S = 256; with cuDNN's S = scale_s·2^-4 and scale_s = 1, 4.16."""
    check_values("scale", scale, lo=0.0, strict=True, float32=True)
    return _cast_threshold_log(fmt) + jnp.log(jnp.asarray(scale, _float_dtype()))


def _rescale_gap(rescale_threshold, unit: str):
    from pcast_jax.errors import check_choice

    check_choice("unit", unit, ("log2", "natural"))
    check_values("rescale_threshold", rescale_threshold, lo=0.0, float32=True)
    tau = jnp.asarray(rescale_threshold, _float_dtype())
    return tau * (LN2 if unit == "log2" else 1.0), tau


def max_scaled_p(scale, rescale_threshold, *, unit="log2", compensation="none"):
    """The largest P·S a lazy rescale lets the cast see: S_eff · e^gap.

    With a threshold τ the running max lags the true one by at most gap = τ·ln 2 (``unit="log2"``, FA4,
    FlashInfer) or τ (``"natural"``, cuDNN), so P = exp(s − m) ≤ e^gap, and P·S ≤ S_eff·e^gap with
    S_eff = S (``compensation="none"``) or S·2^-τ (``"pow2"``, cuDNN). Past the format's max the cast
    saturates while ℓ keeps the unclipped P: FA4 with τ = 4, S = 256 reaches 4096; cuDNN with τ = 4 nats
    reaches (e/2)^4·scale_s ≈ 3.41·scale_s.
    """
    from pcast_jax.errors import check_choice

    check_values("scale", scale, lo=0.0, strict=True, float32=True)
    check_choice("compensation", compensation, ("none", "pow2"))
    gap, tau = _rescale_gap(rescale_threshold, unit)
    s_eff = jnp.asarray(scale, _float_dtype()) * (jnp.exp2(-tau) if compensation == "pow2" else 1.0)
    return s_eff * jnp.exp(gap)


def saturation_free_scale(rescale_threshold, *, unit="log2", compensation="none", fmt="e4m3"):
    """The largest power-of-two S whose :func:`max_scaled_p` stays within the format's max.

    S = 2^⌊log2(max / e^gap · (2^τ with the ``"pow2"`` compensation))⌋: FlashInfer's rule
    2^⌊log2 448 − τ⌋ for log2 units (τ = 8 → 1, τ = 4 → 16, τ = 0.75 → 256) and for cuDNN's τ = 4 nats
    a scale_s of 128. A power of two keeps the scaling bit-exact (Prop. 5); the largest one also keeps
    the collapse threshold 10 ln 2 + ln S as high as saturation allows.
    """
    from pcast_jax.errors import check_choice

    check_choice("compensation", compensation, ("none", "pow2"))
    gap, tau = _rescale_gap(rescale_threshold, unit)
    room = math.log2(formats.get_format(fmt).max) - gap / LN2 + (tau if compensation == "pow2" else 0.0)
    return jnp.exp2(jnp.floor(room))


# --------------------------------------------------------------------------------------------
# P normalised before the cast (KernelConfig.p_offset = "row_lse"): diffuse rows. Beyond the paper.
# --------------------------------------------------------------------------------------------
def diffuse_row_gain(n, scale, *, fmt="int8"):
    """Output gain of a row of ``n`` equal logits whose normalised P is cast (``p_offset="row_lse"``).

    Not in the paper. Each key's P is 1/N; the cast gives q = cast(S/N) (round to nearest even,
    clipped) and the kernel outputs Σ q·V/S = g·mean(V) with

        g(N, S) = N · cast(S/N) / S,

    1 where S/N is a value of the format, otherwise off by the rounding of S/N (e.g. 300/256 at
    N = 300, S = 256 with UINT8), and 0 — the row vanishes — once S/N ≤ the format's round-to-zero
    boundary (:func:`diffuse_row_vanishing_length`). A kernel that casts the unnormalised online P
    (P = 1 for every key of such a row) has g = 1 for every N. ``n`` and ``scale`` broadcast; S/N is
    formed in float32, as the kernel forms P.
    """
    check_values("n", n, lo=1.0, float32=True)
    _check_scale(scale)
    f = formats.get_format(fmt, param="fmt")
    n = jnp.asarray(n, jnp.float32)
    s = jnp.asarray(scale, jnp.float32)
    return n * formats.cast(s / n, f) / s


def diffuse_row_vanishing_length(scale, *, fmt="int8"):
    """Smallest N at which every normalised P of a row of N equal logits casts to 0: ⌈S / r⌉.

    Not in the paper. P = 1/N and P·S = S/N rounds to 0 when S/N ≤ r, the format's round-to-zero
    boundary (half its smallest step: 0.5 for INT8 and UINT8, 2^-10 for E4M3; the tie at r rounds to
    the even 0), i.e. N ≥ S/r: 2S for the integer formats (254 for TensorRT's S = 127, 512 for
    LiteRT's 256), 1024·S for E4M3. Exact arithmetic: where S/r is not an integer the float32 S/N
    next to the boundary may decide the last N either way. ``scale`` may be an array.
    """
    _check_scale(scale)
    rtz = formats.get_format(fmt, param="fmt").round_to_zero
    return np.ceil(np.asarray(scale, np.float64) / rtz).astype(np.int64)
