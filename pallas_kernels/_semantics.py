"""The per-block arithmetic of Algorithm 1 shared by both kernels (traced inside the kernel body).

Each function mirrors one line of the scan engine (``pcast_jax.engine``): the same operations in
the same order on the same FP32 values, so a kernel run in interpret mode reproduces the
simulator's P8 bit for bit and its output to FP32 rounding. The kernels pass arrays in their own
register layouts; everything here is plain ``jnp`` that both Pallas backends lower.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pcast_jax.config import KernelConfig
from pcast_jax.formats import E4M3

#: log2(e) as the engine uses it (a Python float, rounded to FP32 where it meets FP32 data).
LOG2E = math.log2(math.e)
#: Largest finite E4M3FN value; P·S is clamped to ±this before the cast (cvt.rn.satfinite).
E4M3_MAX = E4M3.max
#: E4M3FN round-to-zero boundary: 0 < x <= 2^-10 casts to 0 (the tie goes to the even 0).
E4M3_ROUND_TO_ZERO = E4M3.round_to_zero


def row_broadcast(row, shape):
    """(rows,) → (rows, cols), the value of each row repeated along the columns."""
    return lax.broadcast_in_dim(row, shape, [0])


def safe_max(m):
    """m with −inf replaced by 0 (fully masked rows give exp(−inf) = 0, not NaN)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def alpha(m_old, m_new, cfg: KernelConfig):
    """Line 6: α = exp(m_old − m_new) (exp2 form in the exponent mode)."""
    if cfg.scale_mode == "exponent":
        return jnp.exp2((m_old - safe_max(m_new)) * LOG2E)
    return jnp.exp(m_old - safe_max(m_new))


def block_probs(z, m_new, cfg: KernelConfig):
    """Line 7: (P that ℓ sums, P·S that is cast, per-row unscale or None) for a block of scores.

    ``z`` is (rows, block_kv). The unscale factor exists only in the dynamic mode: the largest
    2^k with rowmax(P)·2^k ≤ 448 scales the block, and its P8·V is multiplied by 2^-k (exact).
    """
    m = row_broadcast(safe_max(m_new), z.shape)
    if cfg.scale_mode == "exponent":
        p = jnp.exp2(z * LOG2E - (m * LOG2E - cfg.log2_scale))
        return p, p, None
    p = jnp.exp(z - m)
    if cfg.scale_mode == "multiply":
        return p, p * cfg.scale, None
    p_max = jnp.max(p, axis=1)
    # floor(log2(448 / rowmax P)); the argument is >= log2(448) > 0, so truncation is floor
    k = jnp.log2(E4M3_MAX / jnp.where(p_max > 0.0, p_max, 1.0)).astype(jnp.int32).astype(jnp.float32)
    k = jnp.minimum(jnp.maximum(k, 0.0), 126.0)
    s = jnp.exp2(k)
    s = jnp.where(p_max * s > E4M3_MAX, s * 0.5, s)  # guard against log2 rounding up
    return p, p * row_broadcast(s, p.shape), 1.0 / s


def block_product(pv, unscale, cfg: KernelConfig):
    """Line 10's P8·V_j as it is accumulated: rounded to f16 for an f16 accumulator, then × 2^-k."""
    if cfg.accumulator == "f16":
        pv = pv.astype(jnp.float16).astype(jnp.float32)
    if unscale is not None:
        pv = pv * row_broadcast(unscale, pv.shape)
    return pv


def clamp_for_cast(ps):
    """P·S clamped to ±448 so the FP8 cast saturates like cvt.rn.satfinite everywhere."""
    return jnp.minimum(jnp.maximum(ps, -E4M3_MAX), E4M3_MAX)


def zeroed(ps):
    """Line 9's loss: P·S > 0 that casts to E4M3 zero (exactly 0 < P·S ≤ 2^-10)."""
    return (ps > 0.0) & (ps <= E4M3_ROUND_TO_ZERO)


def epilogue_divisor(row_sum, cfg: KernelConfig):
    """Line 12: S·ℓ in the multiply mode, ℓ in the exponent mode (ℓ already holds S)."""
    if cfg.scale_mode == "multiply":
        return jnp.float32(cfg.scale) * row_sum
    return row_sum
