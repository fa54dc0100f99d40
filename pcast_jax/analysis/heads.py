"""Per layer and head, on any ``[L, T, H, D]`` trace: sink statistics and P-cast metrics.

Model-agnostic: the inputs are post-RoPE Q, K, V of causal self-attention layers, one sequence,
whatever model they come from (:mod:`pcast_jax.analysis.capture` records them from any JAX model;
:func:`pcast_jax.models.extract_qkv` from a loaded checkpoint).

Sinks in a real head
--------------------
The paper's model (§3.1) puts ``k_sink`` sink tokens at the start of the sequence with logits
``Δ`` above the mean of ``N(0, σ²)`` non-sink logits. In a real head the sink is wherever the
attention mass goes, so by default (``sink_selection="received"``) the sinks of a head are the
``num_sinks`` key positions receiving the most attention, measured as the column sum of the
causal attention matrix divided by T (the mean attention mass a query row puts on that key; rows
that cannot see the key contribute 0, which keeps late, rarely-visible keys from winning on
noise). In SmolLM2-135M on Python source text this is position 0 for every head from layer 12
on, while layers 3–10 sink on an early bare-space token (a content sink, cf. the multi-sink
remark of §7.4) and layers 0, 1, 11 spread their attention. ``sink_selection="first"`` takes
positions ``0 .. num_sinks-1`` as the paper's synthetic workload does.

Per head, with ``s_ij = q_i·k_j / sqrt(D)`` (causal, ``j <= i``) and sink set ``S``, on the query
rows ``i`` that see every sink and at least ``min_keys`` non-sink keys:

* ``delta``: mean over rows of ``max_{j∈S} s_ij − mean_{j∉S} s_ij`` in raw logits. This is the
  paper's ``Δ + δk`` (Eq. 3; the max over sinks carries δk) and is the quantity the underflow
  condition of Eq. (6) compares with ``10 ln 2 + ln S = 6.93 + ln S``.
* ``sigma``: mean over rows of the non-sink logit standard deviation ``std_{j∉S} s_ij``. The
  paper assumes σ = 1; real heads have σ ≈ 2–3, so the Gaussian collapse fraction becomes
  ``Φ((delta − 6.93 − ln S) / sigma)`` instead of Eq. (7)'s ``Φ(Δ + δk − 6.93 − ln S)``.
* ``delta_sigma``: mean over rows of the gap divided by that row's std (Δ in units of σ).
* ``underflow_s1`` / ``underflow_s256``: measured fraction of non-sink logits more than
  ``6.93 + ln S`` below the sink max, i.e. the P values an E4M3 cast with scale S zeroes when the
  running max sits at the sink (forward order, Eq. 6) — no Gaussian assumption.
* ``underflow_mass``: the exact softmax mass those zeroed P carry, for every S of
  :data:`SCALE_GRID` (what the safe scale of :mod:`pcast_jax.analysis.study` reads).

Definitions used in the reports
-------------------------------
* **Visible keys** of query row ``i``: what the layer lets it see — causal (``j ≤ i``), within
  the layer's local window (``i − j ≤ w``) when it has one, and inside the sequence's real tokens
  (``length``; right padding is neither a query nor a key). Every statistic, simulated kernel and
  reference here uses them; a kernel simulation sees the hidden keys as masked (−inf logits). A layer
  with a logit soft cap (``logits_soft_cap``) has every logit here replaced by ``cap·tanh(logit/cap)``.
* **Non-sink position** of a head: every key position except the head's ``num_sinks`` sink
  positions from :func:`sink_statistics` (by default the single key receiving the
  most attention).
* **Fraction of non-sink P zeroed** (``frac_zeroed``): for each query row ``i``, the share of its
  non-sink visible keys whose P was positive before the cast and 0 after it; averaged over the
  rows with at least ``min_keys`` non-sink visible keys (whether or not they see the sink: a row
  past a local window loses mass too). ``frac_zeroed_pooled`` pools the counts of all rows instead.
* **zeroed_mass**: exact FP32 softmax probability carried by the zeroed positions, averaged over
  the same rows; ``saturated_mass`` likewise for the keys whose P·S the cast clips.
* **MSE**: mean over rows and head dimensions of ``(O − O_ref)²``, O_ref the exact FP32
  attention on the FP32 Q/K/V; **relative MSE** = MSE / mean(O_ref²) (V of a real model is not
  unit-variance, so the absolute MSE is not comparable with the paper's σ_V = 1 numbers).
  ``rel_mse_qkv``: the relative MSE of the same Q/K/V as the kernel sees them (E4M3 when the config
  quantizes them) with P in FP32 — the Q/K/V quantization's share (0 for FP32 Q/K/V).
* Every per-row quantity is computed on chunks of query rows, so memory stays at a few
  ``[rows, T]`` arrays per call whatever the sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax import block as _block
from pcast_jax import engine as _engine
from pcast_jax import stats as _stats
from pcast_jax.config import KernelConfig
from pcast_jax.engine import check_implementation
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.nn import kernel_inputs, kernel_logits, kernel_operands, soft_capped
from pcast_jax.presets import resolve

__all__ = [
    "SINK_SELECTIONS", "SCALE_GRID", "HEAD_METRICS", "E2EMetrics", "expand_kv", "sink_statistics", "find_sinks",
    "heads_attention", "head_metrics", "analyze_trace", "analyze_layers", "compare_logits", "scored_positions",
    "validate_lengths", "pending_statistics",
]

SINK_SELECTIONS = ("received", "first")
#: What :func:`head_metrics` returns per head at least (see the module docstring); every further
#: per-row count ``n_<what>`` or mass ``<what>_mass`` the engine's result carries comes as
#: ``frac_<what>`` (of the visible keys) / ``<what>_mass`` beside them: ``frac_saturated`` and
#: ``saturated_mass`` (P·S clipped at the format's max).
HEAD_METRICS = ("mse", "ref_sq", "rel_mse", "rel_mse_qkv", "frac_zeroed", "frac_zeroed_pooled", "zeroed_mass",
                "rows_used")
#: The scales S of ``sink_statistics``' ``underflow_mass`` (powers of two up to 256, and 448, the
#: largest S at which P·S ≤ 1·S stays inside E4M3 without saturating).
SCALE_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 448)
_HIGHEST = lax.Precision.HIGHEST


def expand_kv(kv: jax.Array, num_heads: int) -> jax.Array:
    """Repeat KV heads ``[T, Hkv, D] -> [T, Hq, D]`` so query head h gets KV head h // (Hq/Hkv)."""
    return jnp.repeat(kv, num_heads // kv.shape[1], axis=1)


def row_positions(row0, rows: int):
    """The query positions of a chunk of rows ``[rows]``: ``row0 .. row0 + rows`` where ``row0`` is the first
    row (a scalar), or ``row0`` itself where it is a sample's positions ``[rows]`` (:func:`sample_rows`)."""
    return row0 + jnp.arange(rows) if jnp.ndim(row0) == 0 else row0


def _take_rows(x, row0, rows: int, axis: int):
    """The chunk's rows (:func:`row_positions`) of ``x`` along ``axis``: a slice, or a sample's gather."""
    if jnp.ndim(row0) == 0:
        return lax.dynamic_slice_in_dim(x, row0, rows, axis=axis)
    return jnp.take(x, row0, axis=axis)


def _kernel_mask(config: KernelConfig, row0) -> tuple[KernelConfig, object]:
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


def _row_logits(q, k, head, row0, rows: int, cap, keys: int):
    """FP32 logits ``[rows, keys]`` of head ``head``'s query rows ``row0 .. row0 + rows`` on the first ``keys``
    keys (all they see: :func:`_keys_below`); ``q, k [Hq, T, D]``; soft-capped at ``cap`` (None: none)."""
    head_dim = q.shape[-1]
    if jnp.ndim(row0) == 0:
        q_rows = lax.dynamic_slice(q, (head, row0, 0), (1, rows, head_dim))[0]
    else:
        q_rows = jnp.take(lax.dynamic_index_in_dim(q, head, 0, keepdims=False), row0, axis=0)
    k_head = lax.dynamic_slice(k, (head, 0, 0), (1, keys, head_dim))[0]
    return soft_capped(jnp.einsum("td,sd->ts", q_rows, k_head, precision=_HIGHEST) / math.sqrt(head_dim), cap)


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _received_rows(q, k, head, row0, length, window, learned, cap, *, rows: int, keys: int):
    """Attention received per key ``[T]`` from rows ``row0 .. row0 + rows`` (column sums of the softmax; 0
    past their first ``keys`` keys) and the mass those rows put on key 0."""
    scores = _row_logits(q, k, head, row0, rows, cap, keys)
    vis = visible_rows(row0, rows, keys, length, window)
    probs = _softmax_rows(scores, vis, learned[head])
    return jnp.pad(jnp.sum(probs, axis=0), (0, k.shape[1] - keys)), jnp.sum(probs[:, 0])


def _softmax_rows(scores, vis, learned=None):
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


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _statistic_rows(q, k, head, row0, length, window, learned, cap, sink_positions, min_keys, *, rows: int,
                    keys: int):
    """Per-row sink statistics of head ``head`` on its query rows ``row0 .. row0 + rows`` (first ``keys`` keys).

    Sums over non-sink keys are taken as (sum over visible keys) − (sum over the few sink columns), so
    each quantity costs one fused pass over the chunk's ``[rows, keys]`` logits.
    """
    scores = _row_logits(q, k, head, row0, rows, cap, keys)
    vis = visible_rows(row0, rows, keys, length, window)
    probs = _softmax_rows(scores, vis, learned[head])
    # a sink past the chunk's keys is not visible to its rows: its column index is clipped, its visibility False
    sinks = jnp.minimum(sink_positions[head], keys - 1)
    vis_sinks = sink_positions[head] < keys
    sink_scores = scores[:, sinks]                                       # [rows, k]
    sink_visible = vis[:, sinks] & vis_sinks[None, :]                    # [rows, k]
    n_other = jnp.sum(vis, axis=-1) - jnp.sum(sink_visible, axis=-1)     # [rows]
    valid_row = jnp.all(sink_visible, axis=-1) & (n_other >= min_keys)
    safe_n = jnp.maximum(n_other, 1)

    def other_sum(full, sink_part):
        """Row sum over non-sink visible keys of an elementwise function of the logits."""
        extra = (None,) * (full.ndim - 2)
        return (jnp.sum(jnp.where(vis[(...,) + extra], full, 0.0), axis=1)
                - jnp.sum(jnp.where(sink_visible[(...,) + extra], sink_part, 0.0), axis=1))

    other_mean = other_sum(scores, sink_scores) / safe_n
    centered = lambda x: (x - other_mean[:, None]) ** 2  # noqa: E731
    other_std = jnp.sqrt(jnp.maximum(other_sum(centered(scores), centered(sink_scores)), 0.0) / safe_n)
    sink_max = jnp.max(jnp.where(sink_visible, sink_scores, -jnp.inf), axis=-1)
    gap = jnp.where(valid_row, sink_max - other_mean, 0.0)
    gap_sigma = jnp.where(valid_row, gap / jnp.maximum(other_std, 1e-12), 0.0)
    sink_mass_rows = jnp.sum(jnp.where(sink_visible, probs[:, sinks], 0.0), axis=-1)
    # Eq. (6) with the running max at the sink max (forward order, sink in the first block):
    # a non-sink P = exp(s - m) is zeroed by the E4M3 cast with scale S iff s < m - 10 ln2 - ln S.
    sink_probs = probs[:, sinks]
    thresholds = sink_max[:, None] - 10 * math.log(2) - jnp.log(jnp.asarray(SCALE_GRID, jnp.float32))
    under_mass = other_sum(
        jnp.where(scores[:, :, None] < thresholds[:, None, :], probs[:, :, None], 0.0),
        jnp.where(sink_scores[:, :, None] < thresholds[:, None, :], sink_probs[:, :, None], 0.0))
    below = {}
    for scale in (1, 256):
        threshold = (sink_max - 10 * math.log(2) - math.log(scale))[:, None]
        below[scale] = other_sum((scores < threshold).astype(jnp.float32),
                                 (sink_scores < threshold).astype(jnp.float32)) / safe_n
    return {"valid": valid_row, "delta": gap, "delta_sigma": gap_sigma, "sigma": other_std,
            "sink_mass": sink_mass_rows, "underflow_s1": below[1], "underflow_s256": below[256],
            "underflow_mass": under_mass}

#: Bytes of temporaries per logit of the sink statistics' row chunks, an upper bound of XLA's
#: ``memory_analysis`` (49 at 64 and at 256 rows of 1,024 keys: the ``[rows, T, len(SCALE_GRID)]``
#: underflow masses are fused, never held).
_STAT_BYTES_PER_SCORE = 64


def _chunks(num_rows: int, step: int, length: int) -> list[tuple[int, int, int]]:
    """``(row0, rows, keys)`` of the query-row chunks of ``step`` rows (the last one ragged): each with the
    keys its rows see under a causal mask (:func:`_keys_below`), ``length`` the real tokens."""
    return [(r0, rows, _keys_below(_chunk_end(r0, rows, step, length), num_rows))
            for r0 in range(0, num_rows, step) for rows in (min(step, num_rows - r0),)]


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


#: A sample's chunks see their keys rounded up to whole eighths of the sequence, so that the chunks of any
#: sample take a few shapes (one compiled program each); the keys past a chunk's last row are masked.
_SAMPLE_KEY_PARTS = 8


def _row_chunks(num_rows: int, step: int, length: int, sample=None) -> list[tuple]:
    """:func:`_chunks`, or for ``sample`` (sorted positions ``[n]``) its chunks of ``step`` positions: ``(positions
    [rows], rows, keys)``, the keys rounded up to whole eighths of ``num_rows`` (:data:`_SAMPLE_KEY_PARTS`)."""
    if sample is None:
        return _chunks(num_rows, step, length)
    unit = max(1, -(-num_rows // _SAMPLE_KEY_PARTS))
    out = []
    for i in range(0, len(sample), step):
        part = np.asarray(sample[i:i + step], np.int32)
        out.append((part, len(part), min(num_rows, -(-(int(part[-1]) + 1) // unit) * unit)))
    return out


def _row_arg(row0):
    """A chunk's first row (an int32 scalar) or its sample's positions (an int32 array), as the passes take it."""
    return np.int32(row0) if np.ndim(row0) == 0 else np.asarray(row0, np.int32)


def _received_parts(qh, kh, scalars, chunks) -> list:
    """The first pass of the statistics on one layer (:func:`_layer_inputs`), dispatched: per head and chunk of
    rows (heads outer), :func:`_received_rows`."""
    return [_received_rows(qh, kh, np.int32(h), _row_arg(r0), *scalars, rows=rows, keys=keys)
            for h in range(qh.shape[0]) for r0, rows, keys in chunks]


def _layer_sinks(parts, *, num_heads: int, length: int, num_sinks: int, sink_selection: str):
    """From one layer's fetched :func:`_received_parts`: per head, the attention each key receives ``[Hq, T]``,
    the mass on key 0 ``[Hq]`` and the sink positions ``[Hq, num_sinks]`` (the most-received keys, or the
    first)."""
    per = len(parts) // num_heads
    received = np.stack([np.sum([parts[h * per + c][0] for c in range(per)], axis=0)
                         for h in range(num_heads)]).astype(np.float64) / length   # [Hq, T]
    position0 = np.array([sum(float(parts[h * per + c][1]) for c in range(per))
                          for h in range(num_heads)]) / length
    if sink_selection == "received":  # the most-received keys, the lower position first on a tie
        sink_positions = np.sort(np.argsort(-received, axis=-1, kind="stable")[:, :num_sinks], axis=-1)
    else:
        sink_positions = np.broadcast_to(np.arange(num_sinks), (num_heads, num_sinks))
    return sink_positions.astype(np.int32), received, position0


def _layer_inputs(q, k, *, length: int, window: int, learned, soft_cap: float, sample=None):
    """One layer's ``q, k [Hq, T, D]`` (KV heads repeated), the row passes' scalars and chunks of rows (every
    row, or the ``sample``'s positions)."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    qh = jnp.swapaxes(q, 0, 1)
    kh = jnp.swapaxes(expand_kv(k, num_heads), 0, 1)
    chunks = _row_chunks(num_tokens, _rows_per_chunk(num_tokens, num_tokens, _STAT_BYTES_PER_SCORE), length, sample)
    scalars = (np.int32(length), np.int32(window), learned_logits(learned, num_heads), _cap_arg(soft_cap))
    return qh, kh, scalars, chunks


def _trace_inputs(q, k, *, length: int, local_window_size, sinks, logits_soft_cap, sample=None) -> list:
    """:func:`_layer_inputs` of every layer of ``q [L, T, Hq, D]``, ``k [L, T, Hkv, D]``."""
    layers = q.shape[0]
    windows = layer_windows(local_window_size, layers)
    caps = layer_soft_caps(logits_soft_cap, layers)
    return [_layer_inputs(q[layer], k[layer], length=length, window=int(windows[layer]),
                          learned=None if sinks is None else np.asarray(sinks)[layer], soft_cap=float(caps[layer]),
                          sample=sample)
            for layer in range(layers)]


def _trace_sinks(inputs: list, *, length: int, num_sinks: int, sink_selection: str) -> list:
    """:func:`_layer_sinks` of every layer of :func:`_trace_inputs`, the layers' first passes dispatched
    before the one fetch (``length``: the rows the column sums are a mean over)."""
    fetched = jax.device_get([_received_parts(*inp) for inp in inputs])
    return [_layer_sinks(parts, num_heads=inp[0].shape[0], length=length, num_sinks=num_sinks,
                         sink_selection=sink_selection) for parts, inp in zip(fetched, inputs)]


def _layer_statistics(rows_out: list, sink_positions, received, position0) -> dict[str, np.ndarray]:
    """Per-head statistics of one layer from its fetched :func:`_statistic_rows` (heads outer) and
    :func:`_layer_sinks`: the means over each head's valid rows."""
    num_heads = len(sink_positions)
    per = len(rows_out) // num_heads
    per_head = [{name: np.concatenate([rows_out[h * per + c][name] for c in range(per)])
                 for name in rows_out[0]} for h in range(num_heads)]
    out = {"sink_positions": sink_positions}
    for name in ("delta", "delta_sigma", "sigma", "sink_mass", "underflow_s1", "underflow_s256", "underflow_mass"):
        values = []
        for rows in per_head:
            valid = rows["valid"]
            x = rows[name].astype(np.float64)
            values.append(np.sum(x[valid], axis=0) / valid.sum() if valid.any() else np.full(x.shape[1:], np.nan))
        out[name] = np.stack(values).astype(np.float32)
    out["position0_mass"] = position0.astype(np.float32)
    out["top_received"] = received.max(axis=-1).astype(np.float32)
    out["rows_used"] = np.array([rows["valid"].sum() for rows in per_head], np.int32)
    return out


def learned_logits(sinks, num_heads: int) -> jax.Array:
    """``[Hq]`` float32 learned sink logits of one layer (−inf: none) from None or ``[Hq]`` numbers."""
    if sinks is None:
        return jnp.full((num_heads,), -jnp.inf, jnp.float32)
    sinks = np.asarray(sinks, np.float32)
    if sinks.shape != (num_heads,) or np.isnan(sinks).any() or np.isposinf(sinks).any():
        raise PcastError(f"sinks must hold {num_heads} learned sink logits (one per query head; -inf: none), "
                         f"got {sinks.dtype} {sinks.shape}")
    return jnp.asarray(sinks)


def _has_learned(sinks) -> bool:
    return sinks is not None and bool(np.isfinite(np.asarray(sinks, np.float32)).any())


def _cap_arg(soft_cap: float):
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


def sink_statistics(q, k, v=None, cfg=None, *, num_sinks: int = 1, sink_selection: str = "received",
                    min_keys: int = 16, length: int | None = None,
                    local_window_size=None, sinks=None, logits_soft_cap=None) -> dict[str, np.ndarray]:
    """Per-layer, per-head sink statistics of a trace (see the module docstring for definitions).

    Args:
        q: ``[L, T, Hq, D]`` post-RoPE queries (a captured trace, or
            :func:`pcast_jax.models.extract_qkv`).
        k: ``[L, T, Hkv, D]`` post-RoPE keys.
        v: unused (accepted so a whole ``(q, k, v)`` trace can be passed as ``*trace``).
        cfg: optional model config (``num_heads``, ``num_kv_heads``, ``head_dim``); when given,
            shapes are checked against it.
        num_sinks: sink tokens per head (``k_sink``), >= 1.
        sink_selection: ``"received"`` (top positions by mean attention received) or
            ``"first"`` (positions ``0 .. num_sinks-1``).
        min_keys: rows with fewer non-sink keys than this are skipped (their std is noise).
        length: the real tokens (right padding beyond is neither a query nor a key); default T.
        local_window_size: each layer's local window (query ``i`` sees keys ``i − w … i``): None,
            one int for every layer, or one int (or None) per layer, as :func:`layer_windows` reads it.
        sinks: optional ``[L, Hq]`` learned sink logits (gpt-oss ``sinks``; −inf: none): a softmax
            column with no key, in every probability here.
        logits_soft_cap: the layers' soft caps, as :func:`layer_soft_caps` reads them: every logit
            here is ``cap·tanh(logit/cap)``.

    Returns:
        dict of numpy arrays, each ``[L, H]`` unless noted: ``sink_positions [L, H, num_sinks]``,
        ``delta`` (raw logits), ``sigma``, ``delta_sigma`` (Δ in σ units), ``sink_mass`` (mean
        attention on the sinks), ``position0_mass`` (mean attention on position 0 over all rows),
        ``top_received`` (largest mean attention received by one key), ``underflow_s1`` and
        ``underflow_s256`` (fraction of non-sink logits below ``max sink − 6.93 − ln S``, i.e.
        the P values an E4M3 cast with scale S zeroes when the running max sits at the sink,
        Eq. 6), ``underflow_mass [L, H, len(SCALE_GRID)]`` (the exact softmax mass those zeroed
        P carry, per scale of :data:`SCALE_GRID`), ``rows_used``.
        Rows-based entries are NaN for a head with no usable row. The rows are taken in chunks
        (memory a few ``[rows, T]`` arrays, whatever T).
    """
    del v
    _, finish = pending_statistics(q, k, cfg, num_sinks=num_sinks, sink_selection=sink_selection, min_keys=min_keys,
                                   length=length, local_window_size=local_window_size, sinks=sinks,
                                   logits_soft_cap=logits_soft_cap)
    return finish()


def pending_statistics(q, k, cfg=None, *, num_sinks: int = 1, sink_selection: str = "received", min_keys: int = 16,
                       length: int | None = None, local_window_size=None, sinks=None, logits_soft_cap=None,
                       sample=None):
    """:func:`sink_statistics` in two steps: ``(sink_positions [L, Hq, num_sinks], finish)``.

    The sink positions are found (the first pass over every layer's rows, fetched once) and the second
    pass is dispatched, not waited for: ``finish()`` fetches it and returns :func:`sink_statistics`'
    dict. Work queued between the two (the kernels, which need only the sink positions) runs beside
    the statistics. The arguments as :func:`sink_statistics` takes them; ``sample``: optional sorted query
    positions ``[n]`` (:func:`sample_rows`), the only rows read (every key kept): the attention received per
    key, the sinks found from it and every row mean are then those of the sample.
    """
    q, k, num_sinks, length = _check_qk(q, k, cfg, num_sinks=num_sinks, sink_selection=sink_selection, length=length)
    min_keys = check_int("min_keys", min_keys, min_value=1, max_value=q.shape[1])
    sample = _check_sample(sample, length)
    inputs = _trace_inputs(q, k, length=length, local_window_size=local_window_size, sinks=sinks,
                           logits_soft_cap=logits_soft_cap, sample=None if sample is None else sample.positions)
    found = _trace_sinks(inputs, length=length if sample is None else len(sample.positions), num_sinks=num_sinks,
                         sink_selection=sink_selection)
    parts = [[_statistic_rows(qh, kh, np.int32(h), _row_arg(r0), *scalars, jnp.asarray(positions),
                              np.int32(min_keys), rows=rows, keys=keys)
              for h in range(qh.shape[0]) for r0, rows, keys in chunks]
             for (qh, kh, scalars, chunks), (positions, _, _) in zip(inputs, found)]

    def finish() -> dict[str, np.ndarray]:
        per_layer = [_layer_statistics(rows, *layer) for rows, layer in zip(jax.device_get(parts), found)]
        return {name: np.stack([np.asarray(stats[name]) for stats in per_layer]) for name in per_layer[0]}

    return np.stack([positions for positions, _, _ in found]), finish


def _check_sample(sample, length: int) -> RowSample | None:
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


def _check_qk(q, k, cfg, *, num_sinks, sink_selection: str, length):
    """:func:`sink_statistics`' ``q, k`` as arrays, ``num_sinks`` and ``length`` checked (PcastError naming them)."""
    q = jnp.asarray(q)
    k = jnp.asarray(k)
    if q.ndim != 4 or k.ndim != 4:
        raise PcastError(f"q and k must be [L, T, H, D]; got shapes {q.shape} and {k.shape}")
    layers, num_tokens, num_heads, head_dim = q.shape
    if k.shape[:2] != (layers, num_tokens) or k.shape[3] != head_dim or num_heads % k.shape[2]:
        raise PcastError(f"k shape {k.shape} does not match q shape {q.shape}")
    if cfg is not None and (num_heads, k.shape[2], head_dim) != (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
        raise PcastError(f"q/k heads and head_dim {(num_heads, k.shape[2], head_dim)} do not match "
                         f"cfg {(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)}")
    check_choice("sink_selection", sink_selection, SINK_SELECTIONS)
    num_sinks = check_int("num_sinks", num_sinks, min_value=1, max_value=num_tokens - 1)
    length = num_tokens if length is None else check_int("length", length, min_value=2, max_value=num_tokens)
    return q, k, num_sinks, length


def find_sinks(q, k, *, num_sinks: int = 1, sink_selection: str = "received", length: int | None = None,
               local_window_size=None, sinks=None, logits_soft_cap=None) -> np.ndarray:
    """``[L, Hq, num_sinks]`` int32: each head's sink positions, :func:`sink_statistics`' ``sink_positions``
    without the other statistics (one pass over the rows, none with ``sink_selection="first"``); the
    arguments as :func:`sink_statistics` takes them."""
    q, k, num_sinks, length = _check_qk(q, k, None, num_sinks=num_sinks, sink_selection=sink_selection,
                                        length=length)
    layers, _, num_heads = q.shape[:3]
    if sink_selection == "first":
        return np.broadcast_to(np.arange(num_sinks, dtype=np.int32), (layers, num_heads, num_sinks)).copy()
    inputs = _trace_inputs(q, k, length=length, local_window_size=local_window_size, sinks=sinks,
                           logits_soft_cap=logits_soft_cap)
    return np.stack([positions for positions, _, _ in _trace_sinks(inputs, length=length, num_sinks=num_sinks,
                                                                    sink_selection=sink_selection)])


def scores_and_values(q, k, v, cfg: KernelConfig):
    """Per-head logits ``[Hq, T, T]`` (1/√D applied, no mask) and values ``[Hq, T, D]``.

    Exactly what :func:`pcast_jax.nn.dot_product_attention` feeds the kernel (FP32 Q/K/V, or E4M3
    with the scales of ``cfg.qkv_granularity``), for one sequence in the model's ``[T, H, D]`` layout.
    """
    logits, v_seen = kernel_inputs(*(jnp.swapaxes(x, 0, 1)[None] for x in (q, k, v)), cfg,
                                   1.0 / math.sqrt(q.shape[2]))
    return logits[0], v_seen[0]


def heads_attention(q, k, v, config: str | KernelConfig, *, count_mask=None,
                    implementation: str = "xla") -> _engine.AttentionResult:
    """The simulated kernel on every query head of one layer (full causal self-attention).

    Args:
      q: ``[T, Hq, D]`` post-RoPE queries (unscaled); k, v: ``[T, Hkv, D]``.
      config: preset name or :class:`KernelConfig`; its ``causal`` flag is forced on and the mask
        has ``q_offset = 0`` (query i sits at position i, since q_len = N = T). With
        ``config.qkv == "e4m3"`` Q/K/V are quantized with ``config.qkv_granularity`` scales.
      count_mask: optional ``[Hq, T]`` bool, the positions counted as zeroed (non-sink keys).
      implementation: ``"xla"`` (vmapped over heads) or ``"scan"`` (the block-by-block reference).

    Returns:
      :class:`pcast_jax.engine.AttentionResult` with a leading head axis (``out [Hq, T, D]``).
    """
    cfg = dataclasses.replace(resolve(config), causal=True)
    impl = check_implementation(implementation)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise PcastError(f"q must be [T, Hq, D] and k, v [T, Hkv, D] with Hq a multiple of Hkv; "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    scores, v_seen = scores_and_values(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                        jnp.asarray(v, jnp.float32), cfg)

    def one(s, vh, cm):
        return _engine.attention(s, vh, cfg, implementation=impl, count_mask=cm, q_offset=0)

    if count_mask is None:
        return jax.vmap(lambda s, vh: one(s, vh, None))(scores, v_seen)
    return jax.vmap(one)(scores, v_seen, jnp.asarray(count_mask, bool))


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _reference_rows(q, k, v, row0, length, window, learned, cap, *, rows: int, keys: int):
    """Exact FP32 attention of query rows ``row0 .. row0 + rows`` of every head, ``q, k, v [Hq, T, D]``, on
    the first ``keys`` keys (all the rows see)."""
    head_dim = q.shape[-1]
    q_rows = _take_rows(q, row0, rows, 1)
    k, v = k[:, :keys], v[:, :keys]
    s = soft_capped(jnp.einsum("hrd,hsd->hrs", q_rows, k, precision=_HIGHEST) / math.sqrt(head_dim), cap)
    probs = _softmax_rows(s, visible_rows(row0, rows, keys, length, window)[None], learned[:, None, None])
    return jnp.einsum("hrs,hsd->hrd", probs, v, precision=_HIGHEST)


def _reference(q, k, v, *, length: int | None = None, window: int = -1, sinks=None,
               soft_cap: float = 0.0, sample=None) -> jax.Array:
    """Exact FP32 attention per head of one layer ``[T, H, D]``: ``[Hq, T, D]`` (rows past ``length``: 0; with a
    ``sample`` of rows ``[n]``, those rows alone: ``[Hq, n, D]``), on chunks of query rows (dispatched: not waited
    for)."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    qh, kh, vh = (jnp.swapaxes(expand_kv(jnp.asarray(x, jnp.float32), num_heads), 0, 1) for x in (q, k, v))
    length = num_tokens if length is None else length
    chunks = _row_chunks(num_tokens, _rows_per_chunk(num_tokens, num_heads * num_tokens, 8), length, sample)
    learned = learned_logits(sinks, num_heads)
    out = jnp.concatenate([_reference_rows(qh, kh, vh, _row_arg(r0), np.int32(length), np.int32(window), learned,
                                           _cap_arg(soft_cap), rows=rows, keys=keys) for r0, rows, keys in chunks],
                          axis=1)
    return out


def _reference_jit(q, k, v):
    """:func:`_reference` of full causal attention (kept for callers of the whole-layer form)."""
    return _reference(q, k, v)


#: What one compiled call of the simulated kernel may hold at once. XLA:CPU allocates a program's
#: temporaries in one block per call; glibc serves a block above 32 MiB (its largest mmap threshold)
#: with fresh pages from the kernel every time, which costs more than the arithmetic (measured: a
#: layer of 9 heads × 1,024 tokens spent 0.17 s of 0.19 s faulting in 254 MiB). Chunks of a head's
#: query rows whose temporaries stay below it reuse the freed memory: 2.5× faster per layer.
_CHUNK_BYTES = 16 << 20
#: Bytes of temporaries per score of the simulated kernel, an upper bound measured from XLA's
#: ``memory_analysis`` (27 for a forward kernel, 43 for split-KV at 1,024 keys).
_BYTES_PER_SCORE = 48


def _rows_per_chunk(num_rows: int, num_keys: int, bytes_per_score: int = _BYTES_PER_SCORE) -> int:
    """The query rows of one chunk: a power of two whose temporaries fit :data:`_CHUNK_BYTES`."""
    rows = max(1, _CHUNK_BYTES // (bytes_per_score * max(num_keys, 1)))
    return min(num_rows, 1 << (rows.bit_length() - 1))


def _whole_tiles(rows: int, config: KernelConfig) -> int:
    """Rows per chunk rounded up to whole query tiles (``config.block_q``): the rows of a tile share one
    tile-amax scale and one skip-softmax vote, so a chunk (whose rows the kernel tiles from its first,
    at a multiple of the chunk) never splits a tile."""
    bq = config.block_q
    return rows if bq <= 1 else -(-rows // bq) * bq


@functools.partial(jax.jit, static_argnames=("config",))
def _layer_operands(q, k, v, *, config: KernelConfig):
    """:func:`pcast_jax.nn.kernel_operands` of one layer ``[T, H, D]``: ``(q, k, v [Hq, T, D],
    factor [Hq])`` (Q/K/V quantized over the whole layer, as the kernel's call sees it)."""
    ops = kernel_operands(*(jnp.swapaxes(x, 0, 1)[None] for x in (q, k, v)), config, 1.0 / math.sqrt(q.shape[2]))
    factor = jnp.broadcast_to(jnp.asarray(ops[3], jnp.float32).reshape(-1), (q.shape[1],))
    return ops[0][0], ops[1][0], ops[2][0], factor


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _kernel_logits_rows(operands, head, row0, *, rows: int, keys: int):
    """The logits of head ``head``'s query rows ``row0 .. row0 + rows`` on its first ``keys`` keys as the
    kernel multiplies them (from :func:`_layer_operands`; before the soft cap and the mask): one product per
    chunk of rows, shared by every config and scan whose operands are these (:func:`_layer_passes`)."""
    q, k, _, factor = operands
    head_dim = k.shape[2]
    if jnp.ndim(row0) == 0:
        q_rows = lax.dynamic_slice(q, (head, row0, 0), (1, rows, head_dim))
    else:
        q_rows = jnp.take(lax.dynamic_index_in_dim(q, head, 0, keepdims=True), row0, axis=1)
    k_head = lax.dynamic_slice(k, (head, 0, 0), (1, keys, head_dim))
    return kernel_logits(q_rows[None], k_head[None], factor[head])[0, 0]


def keys_visited(config: KernelConfig, row_end: int, num_keys: int) -> int:
    """The keys a causal kernel visits for query rows below ``row_end`` (the keys they see, :func:`_chunks`):
    its KV blocks up to the last row's diagonal, for split-KV only where that leaves every split as it is.

    A causal kernel does not visit a block past the diagonal of its query tile (FlashAttention-2/3
    ``n_block_max``, the Triton kernels' loop bound), so the per-head analysis simulates a chunk of rows on
    these keys only: the same blocks, without the fully masked ones a full row would add, which change no
    number but the rounding of sums over blocks (FP32). A split-KV kernel cuts its splits from every block
    of the row's keys (:func:`pcast_jax.block.split_schedule`): it gets the chunk's blocks alone only where
    their schedule gives each split the same of them in the same order as the schedule of every block does
    (:func:`_same_splits`: strided splits, or no more blocks than splits; the steps at which a split visits
    the masked blocks change nothing); elsewhere all ``num_keys``.
    """
    keys = _keys_below(row_end, num_keys, config.block_kv)
    if config.kv_splits > 1 and not _same_splits(config, keys, num_keys):
        return num_keys
    return keys


@functools.lru_cache(maxsize=None)
def _same_splits(config: KernelConfig, keys: int, num_keys: int) -> bool:
    """Whether the split schedule of the first ``keys`` keys' blocks walks them as the schedule of all
    ``num_keys`` keys' blocks does: each split the same of them in the same order (the splits' other
    blocks are past the rows' diagonal, fully masked, and add nothing to the split or to the merge)."""
    seen, whole = -(-keys // config.block_kv), -(-num_keys // config.block_kv)

    def walks(n_blocks: int) -> list:
        return [row for row in ([int(b) for b in split if b < seen]
                                for split in _block.split_schedule(n_blocks, config)) if row]

    return walks(seen) == walks(whole)


def _keys_below(row_end: int, num_keys: int, block: int = 1) -> int:
    """The keys ``0 .. row_end`` rounded up to whole blocks of ``block``, at most ``num_keys``: all that query
    rows below ``row_end`` see under a causal mask."""
    return min(num_keys, -(-row_end // block) * block)


def _chunk_end(row0: int, rows: int, step: int, length: int) -> int:
    """The last key + 1 that the query rows ``row0 .. row0 + rows`` may see: their end, or the real tokens'
    (``length``) rounded up to a whole chunk of ``step`` rows, so that the chunks of every length take the
    same few shapes."""
    return min(row0 + rows, -(-length // step) * step)


def _chunk_logits(logits, sink_positions, head, row0, length, window, cap, keys: int):
    """A chunk's logits (:func:`_kernel_logits_rows`) as the kernel sees them, on its first ``keys`` keys
    (:func:`keys_visited`): soft-capped at ``cap`` (None: none), the keys the layer hides
    (:func:`visible_rows`) masked; with the visible keys, the sink columns and the counted (visible
    non-sink) keys per row."""
    logits = logits[:, :keys]
    rows, num_keys = logits.shape
    s = soft_capped(logits, cap)
    vis = visible_rows(row0, rows, num_keys, length, window)
    s = jnp.where(vis, s, -jnp.inf)
    sinks = sink_positions[head]
    is_sink = jnp.any(jnp.arange(num_keys)[:, None] == sinks[None, :], axis=-1)
    return s, vis, is_sink, jnp.sum(vis & ~is_sink[None, :], axis=-1)


def _chunk_rows(logits, operands, sink_positions, ref, head, row0, ref_row0, length, window, learned, cap, *,
                config: KernelConfig, has_learned: bool, keys: int):
    """Per-row quantities of head ``head`` on its query rows ``row0 ..`` (the rows are independent, so a
    chunk of rows gives those rows of the whole head's result): the chunk's logits on the keys the kernel
    visits (:func:`_chunk_logits`), then the kernel; ``ref [Hq, T, D]`` (a sample's: ``[Hq, n, D]``, the chunk's
    rows from ``ref_row0`` on), ``sink_positions [Hq, k]``."""
    v = operands[2][:, :keys]
    rows = logits.shape[0]
    s, vis, is_sink, counted = _chunk_logits(logits, sink_positions, head, row0, length, window, cap, keys)
    # the reference's rows: the chunk's (every row), or the sample's from the chunk's first (a sample)
    ref_at = row0 if jnp.ndim(row0) == 0 else ref_row0
    r = lax.dynamic_slice(ref, (head, ref_at, 0), (1, rows, ref.shape[-1]))[0]
    config, q_offset = _kernel_mask(config, row0)
    res = _engine.attention(s, v[head], config, implementation="xla", count_mask=~is_sink, q_offset=q_offset,
                            sink_logit=learned[head] if has_learned else None)
    # Q/K/V as the kernel sees them, P in FP32: the Q/K/V quantization's share of the error (none with
    # FP32 Q/K/V, which the kernel sees as the reference does).
    if config.qkv == "e4m3":
        qkv_only = jnp.einsum("rs,sd->rd", _softmax_rows(s, vis, learned[head]), v[head], precision=_HIGHEST)
        qkv_sq_err = jnp.sum(jnp.square(qkv_only - r), axis=-1)
    else:
        qkv_sq_err = jnp.zeros(rows, jnp.float32)
    out = {"sq_err": jnp.sum(jnp.square(res.out - r), axis=-1), "ref_sq": jnp.sum(jnp.square(r), axis=-1),
           "qkv_sq_err": qkv_sq_err,
           "n_zeroed": res.n_zeroed, "n_counted": counted, "zeroed_mass": res.zeroed_mass}
    out.update(_further_row_metrics(res._replace(n_counted=counted), counted.astype(jnp.float32)))
    return out


def _chunk_masses(logits, sink_positions, head, row0, length, window, learned, cap, *,
                  configs: tuple[KernelConfig, ...], has_learned: bool, keys: int):
    """The zeroed and the clipped mass per row of :func:`_chunk_rows`' rows for every config of ``configs``
    (a family: configs that differ only in ``scale``, so the same operands and logits), ``[C, rows]``
    each, from :func:`pcast_jax.engine.weights_and_stats` (the kernel's own statistics, without the
    contraction with V; the pre-cast P, which does not depend on the scale in the multiply mode, is one
    computation for all of them)."""
    s, _, is_sink, counted = _chunk_logits(logits, sink_positions, head, row0, length, window, cap, keys)
    sink = learned[head] if has_learned else None
    stats = [_engine.weights_and_stats(s, masked, count_mask=~is_sink, q_offset=q_offset, sink_logit=sink)
             for masked, q_offset in (_kernel_mask(cfg, row0) for cfg in configs)]
    return counted, jnp.stack([w.zeroed_mass for w in stats]), jnp.stack([w.saturated_mass for w in stats])


@functools.partial(jax.jit, static_argnames=("jobs", "has_learned", "keys"))
def _chunk_family(logits, operands, sink_positions, ref, head, row0, ref_row0, length, window, learned, cap, *,
                  jobs: tuple, has_learned: bool, keys: int) -> list:
    """One chunk's :func:`_chunk_rows` (a job ``("config", config)``) and :func:`_chunk_masses` (``("family",
    configs)``) of one kernel family (configs that differ only in ``scale``), in one program: one call where
    there was one per job, and XLA computes what the jobs share before the cast (the masked logits, the block
    maxima, the running max) as common subexpressions."""
    scalars = (length, window, learned, cap)
    return [_chunk_rows(logits, operands, sink_positions, ref, head, row0, ref_row0, *scalars, config=what,
                        has_learned=has_learned, keys=keys) if kind == "config" else
            _chunk_masses(logits, sink_positions, head, row0, *scalars, configs=what, has_learned=has_learned,
                          keys=keys)
            for kind, what in jobs]


def _valid_rows(counted: np.ndarray, min_keys: int, length: int, positions=None) -> np.ndarray:
    """``[..., Hq, n]`` bool: the rows a head's means are taken over (``min_keys`` counted keys, real tokens);
    ``positions [n]``: the rows' query positions (default ``0 .. n − 1``)."""
    positions = np.arange(counted.shape[-1]) if positions is None else positions
    return (counted >= min_keys) & (positions < length)


def _row_mean(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per head (last axis the rows): the float64 mean of ``x`` over the valid rows, float32; NaN where none."""
    n_rows = valid.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_rows > 0, np.where(valid, x, 0.0).sum(axis=-1) / np.maximum(n_rows, 1),
                        np.nan).astype(np.float32)


def _sampled_mean(x: np.ndarray, valid: np.ndarray, sample: RowSample, ratio_of=None):
    """Per head (last axis the sample's rows): the estimate of :func:`_row_mean` over every row from the
    stratified ``sample`` and its standard error (:func:`pcast_jax.stats.stratified_ratio`); with ``ratio_of``,
    of Σ x / Σ ratio_of over the valid rows. Float32 ``(mean, se)``; NaN where no valid row was sampled."""
    valid = np.broadcast_to(valid, x.shape)
    denominator = np.ones(x.shape) if ratio_of is None else np.broadcast_to(ratio_of, x.shape)
    mean, se = np.full(x.shape[:-1], np.nan), np.full(x.shape[:-1], np.nan)
    strata, sizes = sample.strata, sample.sizes
    for idx in np.ndindex(*x.shape[:-1]):
        rows = valid[idx]
        if rows.any():
            mean[idx], se[idx] = _stats.stratified_ratio(np.where(rows, x[idx], 0.0),
                                                         np.where(rows, denominator[idx], 0.0), strata, sizes)
    return mean.astype(np.float32), se.astype(np.float32)


def _layer_passes(qkv, reference, configs: Sequence[KernelConfig], families: Sequence[tuple[KernelConfig, ...]],
                  sink_positions, *, min_keys: int, length: int, window: int, sinks=None,
                  soft_cap: float = 0.0, sample=None):
    """Every config's :func:`head_metrics` and every family's :func:`scale_masses` on one layer, dispatched:
    ``(parts, finish)``, the per-chunk device arrays and the callable that takes them, fetched
    (``jax.device_get``), to the results. The caller fetches when it needs them, so the layers'
    computations queue without waiting for each other.

    The configs and families whose kernels multiply the same operands (the same Q/K/V quantization) and
    take the same chunks of rows share each chunk's logits: one product of Q and K per chunk of rows and
    head (:func:`_kernel_logits_rows`), whatever the number of configs and candidate scales. ``qkv``: the
    layer's ``(q, k, v [T, H, D])``, padding zeroed; ``reference [Hq, T, D]`` (None without configs);
    ``families``: per family its configs (the candidate scales); ``sample``: optional sorted query positions
    (:func:`sample_rows`), the only rows simulated (every key kept). Returns the metrics per config and
    ``{"zeroed_mass", "saturated_mass"}`` (each ``[len(family), Hq]``) per family; with a sample, each also
    with its standard error over the sampled rows (``<metric>_sem``).
    """
    num_tokens, num_heads = np.shape(qkv[0])[:2]
    head_dim = np.shape(qkv[0])[2]
    positions = jnp.asarray(sink_positions, jnp.int32)
    learned = learned_logits(sinks, num_heads)
    has_learned = _has_learned(sinks)
    scalars = (np.int32(length), np.int32(window), learned, _cap_arg(soft_cap))
    jobs = [("config", i, cfg) for i, cfg in enumerate(configs)] + [("family", i, fam[0]) for i, fam in
                                                                     enumerate(families)]
    groups: dict = {}  # the same operands and chunks of rows: one logits product per chunk for all of them
    for kind, i, cfg in jobs:
        step = _whole_tiles(_rows_per_chunk(num_tokens, num_tokens), cfg)
        groups.setdefault((cfg.qkv, cfg.qkv_granularity, step), []).append((kind, i, cfg))
    parts: dict = {(kind, i): [] for kind, i, _ in jobs}
    for (_, _, step), members in groups.items():
        operands = _layer_operands(*qkv, config=members[0][2])
        for h in range(num_heads):
            at = 0  # the chunk's first row among the sample's (the sample's reference holds those rows only)
            for r0, rows, seen in _row_chunks(num_tokens, step, length, None if sample is None else sample.positions):
                head, row0 = np.int32(h), _row_arg(r0)
                visited = [keys_visited(cfg, seen, num_tokens) for _, _, cfg in members]
                logits = _kernel_logits_rows(operands, head, row0, rows=rows, keys=max(visited))
                by_family: dict = {}  # one program per kernel family and key count
                for (kind, i, cfg), keys in zip(members, visited):
                    by_family.setdefault((cfg.replace(scale=1.0), keys), []).append((kind, i))
                for (_, keys), jobs in by_family.items():
                    done = _chunk_family(logits, operands, positions, reference, head, row0, np.int32(at), *scalars,
                                         jobs=tuple((kind, configs[i] if kind == "config" else families[i])
                                                    for kind, i in jobs),
                                         has_learned=has_learned, keys=keys)
                    for job, part in zip(jobs, done):
                        parts[job].append(part)
                at += rows
    return parts, functools.partial(_layer_results, num_heads=num_heads, num_tokens=num_tokens, head_dim=head_dim,
                                    num_configs=len(configs), families=families, min_keys=min_keys, length=length,
                                    sample=sample)


def _layer_results(parts: dict, *, num_heads: int, num_tokens: int, head_dim: int, num_configs: int,
                   families, min_keys: int, length: int, sample: RowSample | None) -> tuple[list[dict], list[dict]]:
    """:func:`_layer_passes`' results from its parts on the host: the metrics per config and
    ``{"zeroed_mass", "saturated_mass"}`` (each ``[len(family), Hq]``) per family (with a ``sample`` of rows,
    the sample's estimates and their standard errors)."""
    positions = np.arange(num_tokens) if sample is None else sample.positions
    num_rows = len(positions)
    metrics = [_rows_metrics(parts[("config", i)], num_heads, head_dim, min_keys=min_keys, length=length,
                             sample=sample) for i in range(num_configs)]
    masses = []
    for i, family in enumerate(families):
        chunks = parts[("family", i)]
        counted = np.concatenate([p[0] for p in chunks]).reshape(num_heads, num_rows).astype(np.float64)
        valid = _valid_rows(counted, min_keys, length, positions)
        found = {}
        for j, name in ((1, "zeroed_mass"), (2, "saturated_mass")):
            x = np.concatenate([p[j] for p in chunks], axis=-1).reshape(len(family), num_heads,
                                                                        num_rows).astype(np.float64)
            if sample is None:
                found[name] = _row_mean(x, valid[None])
            else:
                found[name], found[f"{name}_sem"] = _sampled_mean(x, valid[None], sample)
        masses.append(found)
    return metrics, masses


def _rows_metrics(parts: list[dict], num_heads: int, head_dim: int, *, min_keys: int, length: int,
                  sample: RowSample | None = None) -> dict:
    """:func:`head_metrics` from one config's :func:`_chunk_rows` of every head and chunk (heads outer): the
    row means on the host; with a ``sample`` of rows, the sample's estimates of them and each one's standard
    error (``<metric>_sem``)."""
    rows = {name: np.concatenate([p[name] for p in parts]).reshape(num_heads, -1) for name in parts[0]}
    rows = {name: x.astype(np.float64) for name, x in rows.items()}  # [Hq, T], or [Hq, n] of a sample
    positions = np.arange(rows["n_counted"].shape[-1]) if sample is None else sample.positions
    counted = rows.pop("n_counted")
    valid = _valid_rows(counted, min_keys, length, positions)
    n_rows = valid.sum(axis=-1)
    n_zeroed = rows.pop("n_zeroed")
    frac = n_zeroed / np.maximum(counted, 1.0)
    sq_err, ref_rows, qkv_rows = (rows.pop(name) for name in ("sq_err", "ref_sq", "qkv_sq_err"))
    if sample is not None:
        real = positions < length
        out = {}
        for name, x, where, ratio_of in (("mse", sq_err / head_dim, real, None), ("ref_sq", ref_rows / head_dim, real,
                                                                                   None),
                                         ("rel_mse", sq_err, real, ref_rows), ("rel_mse_qkv", qkv_rows, real, ref_rows),
                                         ("frac_zeroed", frac, valid, None),
                                         ("frac_zeroed_pooled", n_zeroed, real, counted)):
            out[name], out[f"{name}_sem"] = _sampled_mean(x, where, sample, ratio_of)
        out["rows_used"] = n_rows.astype(np.int32)
        for name, x in rows.items():
            out[name], out[f"{name}_sem"] = _sampled_mean(x, valid, sample)
        return out

    def row_mean(x):
        return _row_mean(x, valid)

    err, ref_sq, qkv_err = (x.sum(axis=-1) / (length * head_dim) for x in (sq_err, ref_rows, qkv_rows))
    with np.errstate(invalid="ignore", divide="ignore"):  # a head whose exact output is 0: inf or NaN, as before
        rel_mse = err / ref_sq
        rel_mse_qkv = qkv_err / ref_sq
    out = {
        "mse": err.astype(np.float32), "ref_sq": ref_sq.astype(np.float32), "rel_mse": rel_mse.astype(np.float32),
        "rel_mse_qkv": rel_mse_qkv.astype(np.float32),
        "frac_zeroed": row_mean(frac),
        "frac_zeroed_pooled": (n_zeroed.sum(axis=-1) / np.maximum(counted.sum(axis=-1), 1)).astype(np.float32),
        "zeroed_mass": row_mean(rows.pop("zeroed_mass")), "rows_used": n_rows.astype(np.int32),
    }
    out.update({name: row_mean(x) for name, x in rows.items()})
    return out


def scale_masses(trace, family: KernelConfig, scales: Sequence[float], sink_positions, *, min_keys: int = 16,
                 length: int | None = None, local_window_size=None, sinks=None,
                 logits_soft_cap=None) -> dict[str, np.ndarray]:
    """The zeroed and the clipped mass of one kernel family at every scale, per layer and head, in one pass.

    P before the cast does not depend on ``scale``: each layer's operands and each chunk of rows' logits
    are computed once, and one compiled call per chunk evaluates every scale's cast and statistics
    (:func:`_chunk_masses`), with no contraction with V. The rows and their means are those of
    :func:`head_metrics`, so each scale's masses are that kernel's ``zeroed_mass`` and
    ``saturated_mass``.

    Args:
      trace: ``(q, k, v)`` of one sequence, as :func:`analyze_trace` takes it.
      family: the kernel (its ``scale`` is replaced by each of ``scales``).
      scales: the candidate scales.
      sink_positions, min_keys, length, local_window_size, sinks, logits_soft_cap: as :func:`analyze_trace`.

    Returns:
      ``{"zeroed_mass", "saturated_mass"}``, each ``[len(scales), L, Hq]`` float32.
    """
    _, masses = analyze_layers(trace, (), sink_positions, families=((family, scales),), min_keys=min_keys,
                               length=length, local_window_size=local_window_size, sinks=sinks,
                               logits_soft_cap=logits_soft_cap)
    return masses[0]


def _further_row_metrics(res, counted) -> dict:
    """Every further per-row field of the engine's result, by its name: a count ``n_<what>`` as
    the fraction ``frac_<what>`` of the row's visible keys (``n_visible``, sinks included, as
    :mod:`pcast_jax.metrics` counts them; the counted keys when the engine gives no ``n_visible``),
    a ``<what>_mass`` as it is."""
    out = {}
    visible = getattr(res, "n_visible", None)
    per = counted if visible is None else jnp.asarray(visible, jnp.float32)
    for field in res._fields:
        value = getattr(res, field)
        if field in ("n_counted", "n_zeroed", "n_visible", "zeroed_mass") or jnp.shape(value) != counted.shape:
            continue
        if field.startswith("n_"):
            out["frac_" + field[2:]] = value / jnp.maximum(per, 1.0)
        elif field.endswith("_mass"):
            out[field] = value
    return out


def head_metrics(q, k, v, config: str | KernelConfig, sink_positions, *,
                 min_keys: int = 16, reference=None, length: int | None = None,
                 local_window_size: int | None = None, sinks=None, logits_soft_cap=None) -> dict[str, np.ndarray]:
    """Per-head P-cast metrics of one layer (definitions in the module docstring).

    Args:
      q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (one layer of a trace).
      config: preset name or :class:`KernelConfig` (its fields say whether and how Q/K/V are
        quantized).
      sink_positions: ``[Hq, k]`` int, each head's sink positions (``sink_statistics``).
      min_keys: rows with fewer non-sink keys are left out of the row means.
      reference: optional ``[Hq, T, D]`` exact FP32 output of this layer (computed when not given;
        :func:`analyze_trace` computes it once per layer for every configuration).
      length: the real tokens (right padding beyond is neither a query nor a key, and is left out
        of the Q/K/V quantization's scales); default T.
      local_window_size: the layer's local window (query ``i`` sees keys ``i − w … i``); None: none.
      sinks: optional ``[Hq]`` learned sink logits (−inf: none), placed as the config's ``sink_mode``
        says in the kernel, a column with no key in the reference.
      logits_soft_cap: optional number ≥ 0 (0: none): the logits the kernel and the reference see are
        ``cap·tanh(logits/cap)``.

    Returns:
      dict of ``[Hq]`` numpy arrays, keys :data:`HEAD_METRICS` and the engine's further per-row
      counts and masses (``frac_<what>``, ``<what>_mass``).
    """
    cfg = dataclasses.replace(resolve(config), causal=True)
    min_keys = check_int("min_keys", min_keys, min_value=1)
    sink_positions = jnp.asarray(sink_positions, jnp.int32)
    if sink_positions.ndim != 2 or sink_positions.shape[0] != np.shape(q)[1]:
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [Hq, k] with "
                         f"Hq={np.shape(q)[1]}")
    num_tokens = np.shape(q)[0]
    length = num_tokens if length is None else check_int("length", length, min_value=1, max_value=num_tokens)
    window = -1 if local_window_size is None else check_int("local_window_size", local_window_size, min_value=-1,
                                                             max_value=2**31 - 1)
    cap = float(layer_soft_caps(logits_soft_cap, 1)[0])
    real = (np.arange(num_tokens) < length)[:, None, None]
    q, k, v = (jnp.asarray(np.where(real, np.asarray(x, np.float32), 0.0)) for x in (q, k, v))
    if reference is None:
        reference = _reference(q, k, v, length=length, window=window, sinks=sinks, soft_cap=cap)
    parts, finish = _layer_passes((q, k, v), reference, [cfg], (), sink_positions, min_keys=min_keys,
                                  length=length, window=window, sinks=sinks, soft_cap=cap)
    metrics, _ = finish(jax.device_get(parts))
    return metrics[0]


def analyze_trace(trace, configs: Sequence[str | KernelConfig], sink_positions, *,
                  min_keys: int = 16, progress=None, length: int | None = None,
                  local_window_size=None, sinks=None, references: dict | None = None,
                  logits_soft_cap=None) -> dict[str, np.ndarray]:
    """:func:`head_metrics` for every configuration and layer of a trace (:func:`analyze_layers`).

    Args:
      trace: ``(q, k, v)`` of one sequence (``q [L, T, Hq, D]``, ``k, v [L, T, Hkv, D]``).
      configs: preset names or :class:`KernelConfig` objects.
      sink_positions: ``[L, Hq, k]`` from :func:`sink_statistics`.
      progress: optional callable ``(config_name) -> None`` called with each configuration's name before
        the layers run.
      length: the sequence's real tokens (default T).
      local_window_size: each layer's local window, as :func:`sink_statistics` takes it.
      sinks: optional ``[L, Hq]`` learned sink logits (−inf: none).
      logits_soft_cap: each layer's soft cap, as :func:`layer_soft_caps` reads it.
      references: optional dict that keeps each layer's padded Q/K/V and exact output between calls
        on the same sequence (filled here; pass the same dict again to reuse them).

    Returns:
      dict metric → ``[n_configs, L, Hq]`` numpy array (the keys of :func:`head_metrics`).
    """
    configs = [resolve(config) for config in configs]
    for cfg in configs:
        if progress is not None:
            progress(cfg.name)
    metrics, _ = analyze_layers(trace, configs, sink_positions, min_keys=min_keys, length=length,
                                local_window_size=local_window_size, sinks=sinks, references=references,
                                logits_soft_cap=logits_soft_cap)
    return metrics


def _real_rows(x: np.ndarray, real: np.ndarray) -> np.ndarray:
    """``x [T, H, D]`` with the rows past the real tokens zeroed (no copy where every row is real)."""
    return x if real.all() else np.where(real, x, 0.0)


def analyze_layers(trace, configs: Sequence[str | KernelConfig], sink_positions, *,
                   families: Sequence[tuple[KernelConfig, Sequence[float]]] = (), min_keys: int = 16,
                   progress=None, length: int | None = None, local_window_size=None, sinks=None,
                   references: dict | None = None, logits_soft_cap=None, sample=None) -> tuple[dict, list[dict]]:
    """:func:`analyze_trace` and :func:`scale_masses` of several families in one pass over the layers.

    Layer by layer, every configuration and every family's candidate scales run on the same chunks of
    rows, and those whose kernels multiply the same operands (the same Q/K/V quantization) share each
    chunk's product of Q and K; the numbers are those of :func:`analyze_trace` and :func:`scale_masses`.

    Args:
      trace, configs, sink_positions, min_keys, length, local_window_size, sinks, references,
        logits_soft_cap: as :func:`analyze_trace`.
      families: ``(family, scales)`` pairs, as :func:`scale_masses` takes them.
      progress: optional callable ``(layer) -> None`` called with each layer's index before it runs.
      sample: optional sorted query positions ``[n]`` (:func:`sample_rows`): only these rows are simulated,
        on every key they see (so the kernel's running max is exact), and every row mean is the sample's.

    Returns:
      ``(metrics, masses)``: :func:`analyze_trace`'s dict (None without configs) and per family
      :func:`scale_masses`' dict; with a sample each metric and mass also as ``<name>_sem``, its standard
      error over the sampled rows.
    """
    q, k, v = trace
    if np.ndim(q) != 4:
        raise PcastError(f"trace.q must be [L, T, Hq, D] (one sequence); got shape {np.shape(q)}")
    sink_positions = np.asarray(sink_positions)
    if sink_positions.shape[:2] != (np.shape(q)[0], np.shape(q)[2]):
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [L, Hq, k] = "
                         f"[{np.shape(q)[0]}, {np.shape(q)[2]}, k]")
    if sink_positions.ndim != 3:
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [L, Hq, k]")
    min_keys = check_int("min_keys", min_keys, min_value=1)
    num_layers, num_tokens = np.shape(q)[:2]
    length = num_tokens if length is None else check_int("length", length, min_value=1, max_value=num_tokens)
    sample = _check_sample(sample, length)
    windows = layer_windows(local_window_size, num_layers)
    caps = layer_soft_caps(logits_soft_cap, num_layers)
    kernels = [dataclasses.replace(resolve(config), causal=True) for config in configs]
    scans = []
    for family, scales in families:
        cfg = dataclasses.replace(resolve(family), causal=True)
        scans.append(tuple(cfg.replace(scale=float(s)) for s in scales))
    real = (np.arange(num_tokens) < length)[:, None, None]
    layer_inputs = {} if references is None else references  # a layer's Q/K/V (padding zeroed) and exact
    # output: the same for every configuration
    per_layer = []
    for layer in range(num_layers):
        if progress is not None:
            progress(layer)
        learned = None if sinks is None else sinks[layer]
        if layer in layer_inputs:
            qkv, reference = layer_inputs[layer]
        else:
            qkv = tuple(jnp.asarray(_real_rows(np.asarray(x[layer], np.float32), real)) for x in (q, k, v))
            reference = None
            if kernels:
                reference = _reference(*qkv, length=length, window=int(windows[layer]), sinks=learned,
                                       soft_cap=float(caps[layer]),
                                       sample=None if sample is None else sample.positions)
                if references is not None:
                    layer_inputs[layer] = qkv, reference
        per_layer.append(_layer_passes(qkv, reference, kernels, scans, sink_positions[layer], min_keys=min_keys,
                                       length=length, window=int(windows[layer]), sinks=learned,
                                       soft_cap=float(caps[layer]), sample=sample))
    # fetched once, after every layer's computations are queued: none waits for the host
    per_layer = [finish(parts) for parts, (_, finish) in zip(jax.device_get([p for p, _ in per_layer]), per_layer)]
    metrics = None
    if kernels:
        metrics = {m: np.stack([np.stack([layer[0][c][m] for layer in per_layer]) for c in range(len(kernels))])
                   for m in per_layer[0][0][0]}
    masses = [{name: np.stack([layer[1][f][name] for layer in per_layer], axis=1)
               for name in per_layer[0][1][f]} for f in range(len(scans))]
    return metrics, masses


class E2EMetrics(NamedTuple):
    """Next-token quality of a model run against the FP32 model on the same tokens.

    Attributes:
      nll: mean next-token negative log-likelihood (nats).
      perplexity: exp(nll).
      kl: mean over predicted positions of KL(p_FP32 ‖ p_run) (nats).
      kl_max: largest per-position KL.
      top1_agree: fraction of positions whose argmax equals the FP32 model's.
    """

    nll: float
    perplexity: float
    kl: float
    kl_max: float
    top1_agree: float


@jax.jit
def _compare(ref_logits, logits, tokens, scored):
    """Pooled over the scored positions ``scored [..., T-1]`` of ``[..., T, V]`` logits."""
    ref_lp = jax.nn.log_softmax(ref_logits[..., :-1, :], axis=-1)
    lp = jax.nn.log_softmax(logits[..., :-1, :], axis=-1)
    n = jnp.maximum(jnp.sum(scored), 1)

    def mean(x):
        return jnp.sum(jnp.where(scored, x, 0.0)) / n

    nll = mean(-jnp.take_along_axis(lp, tokens[..., 1:, None], axis=-1)[..., 0])
    kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
    agree = (jnp.argmax(ref_lp, -1) == jnp.argmax(lp, -1)).astype(jnp.float32)
    return nll, mean(kl), jnp.max(jnp.where(scored, kl, -jnp.inf)), mean(agree)


def compare_logits(ref_logits, logits, tokens, *, lengths=None) -> E2EMetrics:
    """:class:`E2EMetrics` of ``logits [T, V]`` against ``ref_logits [T, V]`` on ``tokens [T]``.

    Position t predicts token t+1, so T − 1 positions are scored. KL(p‖q) = Σ p (log p − log q)
    in nats, computed from log-softmax (≥ 0 up to float32 rounding). A batch ``[B, T, V]`` /
    ``[B, T]`` pools every scored position of every sequence; with ``lengths [B]`` (right padding)
    only positions t with t + 1 < length are scored, whatever the logits hold elsewhere.
    """
    ref_logits = jnp.asarray(ref_logits, jnp.float32)
    logits = jnp.asarray(logits, jnp.float32)
    tokens = jnp.asarray(tokens, jnp.int32)
    if ref_logits.shape != logits.shape or ref_logits.ndim not in (2, 3) \
            or tokens.shape != logits.shape[:-1]:
        raise PcastError(f"ref_logits and logits must both be [T, V] (or [B, T, V]) and tokens [T] "
                         f"(or [B, T]); got {ref_logits.shape}, {logits.shape}, {tokens.shape}")
    if tokens.shape[-1] < 2:
        raise PcastError("tokens must hold at least 2 tokens (one predicted position)")
    lengths = validate_lengths(lengths, tokens)
    check_scored(lengths)
    if lengths is None:
        lengths = jnp.full(tokens.shape[:-1], tokens.shape[-1], jnp.int32)
    scored = scored_positions(lengths, tokens.shape[-1])
    nll, kl, kl_max, agree = (float(x) for x in _compare(ref_logits, logits, tokens, scored))
    return E2EMetrics(nll=nll, perplexity=math.exp(nll), kl=kl, kl_max=kl_max, top1_agree=agree)


def scored_positions(lengths, num_tokens: int) -> jax.Array:
    """``[..., T - 1]`` bool: position t predicts token t + 1, a real token (t + 1 < length)."""
    return jnp.arange(num_tokens - 1) < jnp.asarray(lengths, jnp.int32)[..., None] - 1


def validate_lengths(lengths, tokens: jax.Array):
    """``lengths`` of right-padded ``tokens``: ``[B]`` for ``[B, T]`` (a scalar for ``[T]``), each in [1, T]."""
    if lengths is None:
        return None
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)
    shape = tuple(np.shape(lengths))
    want = tokens.shape[:-1]
    if shape != want:
        raise PcastError(f"lengths must have shape {want} (one length per sequence of tokens "
                         f"{tuple(tokens.shape)}), got {shape}")
    dtype = lengths.dtype if hasattr(lengths, "dtype") else np.asarray(lengths).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise PcastError(f"lengths must be integers, got dtype {dtype}")
    try:
        host = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:
        host = None  # traced inside a caller's jit
    num_tokens = tokens.shape[-1]
    if host is not None and (host.min() < 1 or host.max() > num_tokens):
        raise PcastError(f"lengths must lie in [1, T={num_tokens}] (right padding), got {host.tolist()}")
    return jnp.asarray(lengths, jnp.int32)


def check_scored(lengths) -> None:
    """At least one position is scored: some sequence has a real next token (length >= 2)."""
    if lengths is None:
        return
    try:
        host = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:
        return
    if host.max() < 2:
        raise PcastError(f"lengths={host.tolist()}: no sequence has 2 real tokens, nothing to score")


