"""FP8 Q, K, V whose scores are a synthetic attention sink (§3.1), for the kernels.

The simulator's sink workload draws scores directly (N(0, 1) plus Δ on the sink keys). A kernel
needs Q and K, so here Q·Kᵀ/√d produces those scores: the first ``d − 3`` coordinates of Q and K
are N(0, 1) draws rounded to the 1/8 grid and clipped to ±4 (all E4M3 values), which gives
non-sink scores of variance ≈ 1; the last three coordinates carry the sink: Q holds 8 there, the
sink keys hold three E4M3 values summing to Δ·√d/8 (to ~2^-12 relative), other keys hold 0.

Every product of two such values is a multiple of 2^-6 and every partial sum stays far below
2^18, so Q8·K8ᵀ accumulates exactly in FP32 in any order: a kernel and the simulator see the same
scores bit for bit. V is N(0, σ_V²) rounded to E4M3 (descale 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pcast_jax.errors import PcastError, check_int, check_positive

__all__ = ["SinkQKV", "sink_qkv"]

_SINK_COORDS = 3
_SINK_QUERY_VALUE = 8.0


class SinkQKV(NamedTuple):
    """FP8 inputs of a sink workload.

    Attributes:
      q: (batch, heads, q_len, d) float8_e4m3fn.
      k: (batch, kv_heads, N, d) float8_e4m3fn.
      v: (batch, kv_heads, N, d) float8_e4m3fn.
      softmax_scale: 1/√d, the scale that makes the scores N(0, 1)-like.
      delta: (batch,) the sink gap Δ each batch element actually has (after E4M3 rounding).
      is_sink: (N,) bool, True at the sink keys.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    softmax_scale: float
    delta: np.ndarray
    is_sink: np.ndarray


def _e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _sink_coordinates(target: float) -> np.ndarray:
    """Three E4M3 values whose sum is ``target`` to about 2^-12 relative (greedy residuals)."""
    parts = []
    rest = float(target)
    for _ in range(_SINK_COORDS):
        part = float(_e4m3(rest))
        if abs(part) < 2.0**-6:  # keep products on the 2^-6 grid
            part = 0.0
        parts.append(part)
        rest -= part
    return np.asarray(parts, np.float32)


def _grid(key, shape):
    x = jax.random.normal(key, shape, jnp.float32)
    return jnp.clip(jnp.round(x * 8.0) / 8.0, -4.0, 4.0)


def sink_qkv(
    key,
    *,
    deltas,
    heads: int = 2,
    kv_heads: int = 1,
    q_len: int = 64,
    n: int = 512,
    head_dim: int = 128,
    k_sink: int = 4,
    sigma_v: float = 1.0,
) -> SinkQKV:
    """Draw FP8 Q, K, V with one batch element per sink gap in ``deltas``.

    Args:
      key: PRNG key; the same key gives the same non-sink draws at every Δ.
      deltas: sequence of sink gaps Δ ≥ 0 (one batch element each).
      heads, kv_heads: query and KV heads (heads a multiple of kv_heads).
      q_len, n, head_dim: query rows, keys N, head dimension d (d > 3).
      k_sink: sink keys at positions 0 … k_sink − 1.
      sigma_v: standard deviation of V before the E4M3 rounding.
    """
    deltas = np.atleast_1d(np.asarray(deltas, np.float64))
    if deltas.ndim != 1 or deltas.size == 0 or not np.all(np.isfinite(deltas)) or np.any(deltas < 0):
        raise PcastError(f"deltas={deltas.tolist()} must be a non-empty list of finite values >= 0")
    check_int("heads", heads, min_value=1)
    check_int("kv_heads", kv_heads, min_value=1)
    if heads % kv_heads:
        raise PcastError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    check_int("q_len", q_len, min_value=1)
    check_int("n", n, min_value=1)
    check_int("head_dim", head_dim, min_value=_SINK_COORDS + 1)
    check_int("k_sink", k_sink, min_value=0, max_value=n)
    check_positive("sigma_v", sigma_v)
    batch = deltas.size
    g = head_dim - _SINK_COORDS
    kq, kk, kv = jax.random.split(key, 3)
    q_body = jnp.broadcast_to(_grid(kq, (heads, q_len, g)), (batch, heads, q_len, g))
    k_body = jnp.broadcast_to(_grid(kk, (kv_heads, n, g)), (batch, kv_heads, n, g))
    scale = 1.0 / math.sqrt(head_dim)
    coords = np.stack([_sink_coordinates(d / (scale * _SINK_QUERY_VALUE)) for d in deltas])  # (batch, 3)
    actual = coords.astype(np.float64).sum(axis=1) * _SINK_QUERY_VALUE * scale
    is_sink = np.arange(n) < k_sink
    q_tail = jnp.full((batch, heads, q_len, _SINK_COORDS), _SINK_QUERY_VALUE, jnp.float32)
    k_tail = jnp.where(
        jnp.asarray(is_sink)[None, None, :, None], jnp.asarray(coords)[:, None, None, :], 0.0
    )
    k_tail = jnp.broadcast_to(k_tail, (batch, kv_heads, n, _SINK_COORDS))
    q = jnp.concatenate([q_body, q_tail], axis=-1).astype(jnp.float8_e4m3fn)
    k = jnp.concatenate([k_body, k_tail], axis=-1).astype(jnp.float8_e4m3fn)
    v = sigma_v * jax.random.normal(kv, (kv_heads, n, head_dim), jnp.float32)
    v = jnp.broadcast_to(v, (batch,) + v.shape).astype(jnp.float8_e4m3fn)
    return SinkQKV(q, k, v, scale, actual, is_sink)
