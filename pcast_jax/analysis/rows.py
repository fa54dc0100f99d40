"""The query rows of one layer: which keys each row sees, a sample of rows, and the layer's visibility.

Shared by the per-head passes (:mod:`~pcast_jax.analysis.statistics`, :mod:`~pcast_jax.analysis.chunk`,
:mod:`~pcast_jax.analysis.heads`): a chunk of rows is either contiguous (its first row, a scalar) or a
sample's positions (:func:`sample_rows`), and every function here takes either.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int

__all__ = ["HIGHEST", "expand_kv", "row_positions", "take_rows", "kernel_mask", "visible_rows", "softmax_rows",
           "RowSample", "sample_rows", "check_sample", "row_arg", "learned_logits", "has_learned", "cap_arg",
           "layer_soft_caps", "layer_windows"]

#: The precision of every product of the analysis (Q·K, P·V of the reference).
HIGHEST = lax.Precision.HIGHEST


def expand_kv(kv: jax.Array, num_heads: int) -> jax.Array:
    """Repeat KV heads ``[T, Hkv, D] -> [T, Hq, D]`` so query head h gets KV head h // (Hq/Hkv)."""
    return jnp.repeat(kv, num_heads // kv.shape[1], axis=1)


def row_positions(row0, rows: int):
    """The query positions of a chunk of rows ``[rows]``: ``row0 .. row0 + rows`` where ``row0`` is the first
    row (a scalar), or ``row0`` itself where it is a sample's positions ``[rows]`` (:func:`sample_rows`)."""
    return row0 + jnp.arange(rows) if jnp.ndim(row0) == 0 else row0


def take_rows(x, row0, rows: int, axis: int):
    """The chunk's rows (:func:`row_positions`) of ``x`` along ``axis``: a slice, or a sample's gather."""
    if jnp.ndim(row0) == 0:
        return lax.dynamic_slice_in_dim(x, row0, rows, axis=axis)
    return jnp.take(x, row0, axis=axis)


def kernel_mask(config: KernelConfig, row0) -> tuple[KernelConfig, object]:
    """The config and ``q_offset`` the engine takes for a chunk whose logits are masked already: its first
    row for contiguous rows (the kernel's causal mask, which the masked logits agree with), no causal mask
    of its own for a sample's rows (their logits carry every hidden key as −inf; the engine counts and
    sums only keys with P > 0, so the two give the same numbers)."""
    return (config, row0) if jnp.ndim(row0) == 0 else (dataclasses.replace(config, causal=False), None)


def visible_rows(row0, rows: int, num_keys: int, length, window):
    """``[rows, N]`` bool: query ``i`` (:func:`row_positions`) sees key ``j`` (causal, ``j ≤ i``; within the
    local window ``i − j ≤ window`` when ``window ≥ 0``; both ``i`` and ``j`` below ``length``, the real
    tokens)."""
    i = row_positions(row0, rows)[:, None]
    j = jnp.arange(num_keys)[None, :]
    vis = (j <= i) & (i < length) & (j < length)
    return vis & ((window < 0) | (i - j <= window))


def softmax_rows(scores, vis, learned=None):
    """Softmax over the visible keys of each row (a row with none: zeros); a ``learned`` sink logit
    (−inf: none; broadcasting against the rows) is a column with no key in the denominator."""
    masked = jnp.where(vis, scores, -jnp.inf)
    top = jnp.max(masked, axis=-1, keepdims=True)
    learned = jnp.full_like(top, -jnp.inf) if learned is None else jnp.broadcast_to(learned, top.shape)
    top = jnp.maximum(top, learned)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(vis, jnp.exp(masked - top), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(learned - top)
    return weights / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)


class RowSample(NamedTuple):
    """A stratified random sample of query rows (:func:`sample_rows`).

    Attributes:
      positions: ``[n]`` int32 sorted query positions.
      bounds: ``[H + 1]`` the strata's edges: stratum ``h`` holds the rows ``bounds[h] .. bounds[h + 1] − 1``.
    """

    positions: np.ndarray
    bounds: np.ndarray

    @property
    def strata(self) -> np.ndarray:
        """``[n]``: each sampled row's stratum."""
        return np.searchsorted(self.bounds, self.positions, side="right") - 1

    @property
    def sizes(self) -> np.ndarray:
        """``[H]``: the rows of each stratum."""
        return np.diff(self.bounds)


def sample_rows(length: int, rows: int, rng: np.random.Generator) -> RowSample:
    """A stratified random sample of ``min(rows, length)`` of the real query rows ``0 .. length − 1``: the rows cut
    into ``rows // 2`` strata of consecutive positions (as equal as whole rows allow), two or three rows drawn
    without replacement from each (from ``rng``). Strata by position keep what changes along the sequence —
    the first rows, which see few keys; a local window's edge — in every sample, and leave each stratum two
    rows or more for its variance (:func:`pcast_jax.stats.stratified_ratio`)."""
    rows = min(rows, length)
    num = max(1, rows // 2)
    bounds = np.round(np.linspace(0, length, num + 1)).astype(np.int64)
    picks = [bounds[h] + rng.choice(bounds[h + 1] - bounds[h], size=min(rows // num + (h < rows % num),
                                                                          bounds[h + 1] - bounds[h]), replace=False)
             for h in range(num)]
    return RowSample(np.sort(np.concatenate(picks)).astype(np.int32), bounds)


def check_sample(sample, length: int) -> RowSample | None:
    """A sample of query rows: None (every row), a :class:`RowSample`, or sorted distinct int positions ``[n]``
    below ``length`` (a simple random sample: one stratum of every row)."""
    if sample is None:
        return None
    if not isinstance(sample, RowSample):
        sample = RowSample(np.asarray(sample), np.array([0, length]))
    arr = np.asarray(sample.positions)
    bounds = np.asarray(sample.bounds)
    if arr.ndim != 1 or not arr.size or not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 \
            or arr.max() >= length or np.any(np.diff(arr) <= 0):
        raise PcastError(f"sample must be sorted distinct query rows in [0, {length}) (sample_rows), got "
                         f"{arr.dtype} {arr.shape}")
    if bounds.ndim != 1 or bounds.size < 2 or bounds[0] != 0 or bounds[-1] != length or np.any(np.diff(bounds) <= 0):
        raise PcastError(f"sample.bounds must rise from 0 to {length} (the strata's edges), got {bounds.tolist()}")
    return RowSample(arr.astype(np.int32), bounds.astype(np.int64))


def row_arg(row0):
    """A chunk's first row (an int32 scalar) or its sample's positions (an int32 array), as the passes take it."""
    return np.int32(row0) if np.ndim(row0) == 0 else np.asarray(row0, np.int32)


def learned_logits(sinks, num_heads: int) -> jax.Array:
    """``[Hq]`` float32 learned sink logits of one layer (−inf: none) from None or ``[Hq]`` numbers."""
    if sinks is None:
        return jnp.full((num_heads,), -jnp.inf, jnp.float32)
    sinks = np.asarray(sinks, np.float32)
    if sinks.shape != (num_heads,) or np.isnan(sinks).any() or np.isposinf(sinks).any():
        raise PcastError(f"sinks must hold {num_heads} learned sink logits (one per query head; -inf: none), "
                         f"got {sinks.dtype} {sinks.shape}")
    return jnp.asarray(sinks)


def has_learned(sinks) -> bool:
    return sinks is not None and bool(np.isfinite(np.asarray(sinks, np.float32)).any())


def cap_arg(soft_cap: float):
    """A layer's soft cap as the compiled row passes take it: None for none (a program without the tanh,
    whose cost on every logit is then saved), else the float32 cap (one program for every cap)."""
    return np.float32(soft_cap) if soft_cap > 0 else None


def layer_soft_caps(logits_soft_cap, num_layers: int) -> np.ndarray:
    """``[L]`` float32 soft cap of each layer (0: none) from None, one number > 0 for every layer, or one
    number ≥ 0 per layer."""
    caps = np.zeros(num_layers) if logits_soft_cap is None else np.asarray(logits_soft_cap, np.float64)
    caps = np.broadcast_to(caps, (num_layers,)) if caps.ndim == 0 else caps
    if caps.shape != (num_layers,) or not np.all(np.isfinite(caps)) or caps.min() < 0:
        raise PcastError(f"logits_soft_cap must be a number > 0 or {num_layers} numbers >= 0 (one per layer; 0: none), "
                         f"got {np.asarray(logits_soft_cap).tolist()}")
    return caps.astype(np.float32)


def layer_windows(local_window_size, num_layers: int) -> np.ndarray:
    """``[L]`` int64 left extents of each layer's local window (−1: none) from ``None``, one int for every
    layer, or one int (or None) per layer."""
    if local_window_size is None:
        return np.full(num_layers, -1, np.int64)
    if isinstance(local_window_size, (int, np.integer)):
        local_window_size = [local_window_size] * num_layers
    values = list(np.asarray(local_window_size, dtype=object).reshape(-1))
    if len(values) != num_layers:
        raise PcastError(f"local_window_size must hold one entry per layer ({num_layers}), got {len(values)}")
    out = np.empty(num_layers, np.int64)
    for i, value in enumerate(values):
        out[i] = -1 if value is None else check_int("local_window_size", value, min_value=-1, max_value=2**31 - 1)
    return out
