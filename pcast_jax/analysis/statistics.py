"""Per layer and head, on any ``[L, T, H, D]`` trace: where each head's sinks are and how strong they are.

Model-agnostic: the inputs are post-RoPE Q, K of causal self-attention layers, one sequence, whatever model
they come from. Every pass runs on chunks of query rows (:func:`~pcast_jax.analysis.plan.row_chunks`), so
memory stays at a few ``[rows, T]`` arrays per call whatever the sequence length.

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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax.analysis.plan import DEFAULT_CHUNKING, STAT_BYTES_PER_SCORE, Chunking, row_chunks, rows_per_chunk
from pcast_jax.analysis.rows import (
    HIGHEST,
    cap_arg,
    check_sample,
    expand_kv,
    layer_soft_caps,
    layer_windows,
    learned_logits,
    row_arg,
    softmax_rows,
    visible_rows,
)
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.nn import soft_capped

__all__ = ["SINK_SELECTIONS", "SCALE_GRID", "sink_statistics", "pending_statistics", "find_sinks"]

SINK_SELECTIONS = ("received", "first")
#: The scales S of ``sink_statistics``' ``underflow_mass`` (powers of two up to 256, and 448, the
#: largest S at which P·S ≤ 1·S stays inside E4M3 without saturating).
SCALE_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 448)


def _row_logits(q, k, head, row0, rows: int, cap, keys: int):
    """FP32 logits ``[rows, keys]`` of head ``head``'s query rows ``row0 .. row0 + rows`` on the first ``keys``
    keys (all they see: :func:`~pcast_jax.analysis.plan.keys_below`); ``q, k [Hq, T, D]``; soft-capped at
    ``cap`` (None: none)."""
    head_dim = q.shape[-1]
    if jnp.ndim(row0) == 0:
        q_rows = lax.dynamic_slice(q, (head, row0, 0), (1, rows, head_dim))[0]
    else:
        q_rows = jnp.take(lax.dynamic_index_in_dim(q, head, 0, keepdims=False), row0, axis=0)
    k_head = lax.dynamic_slice(k, (head, 0, 0), (1, keys, head_dim))[0]
    return soft_capped(jnp.einsum("td,sd->ts", q_rows, k_head, precision=HIGHEST) / math.sqrt(head_dim), cap)


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _received_rows(q, k, head, row0, length, window, learned, cap, *, rows: int, keys: int):
    """Attention received per key ``[T]`` from rows ``row0 .. row0 + rows`` (column sums of the softmax; 0
    past their first ``keys`` keys) and the mass those rows put on key 0."""
    scores = _row_logits(q, k, head, row0, rows, cap, keys)
    vis = visible_rows(row0, rows, keys, length, window)
    probs = softmax_rows(scores, vis, learned[head])
    return jnp.pad(jnp.sum(probs, axis=0), (0, k.shape[1] - keys)), jnp.sum(probs[:, 0])


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _statistic_rows(q, k, head, row0, length, window, learned, cap, sink_positions, min_keys, *, rows: int,
                    keys: int):
    """Per-row sink statistics of head ``head`` on its query rows ``row0 .. row0 + rows`` (first ``keys`` keys).

    Sums over non-sink keys are taken as (sum over visible keys) − (sum over the few sink columns), so
    each quantity costs one fused pass over the chunk's ``[rows, keys]`` logits.
    """
    scores = _row_logits(q, k, head, row0, rows, cap, keys)
    vis = visible_rows(row0, rows, keys, length, window)
    probs = softmax_rows(scores, vis, learned[head])
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


def _received_parts(qh, kh, scalars, chunks) -> list:
    """The first pass of the statistics on one layer (:func:`_layer_inputs`), dispatched: per head and chunk of
    rows (heads outer), :func:`_received_rows`."""
    return [_received_rows(qh, kh, np.int32(h), row_arg(r0), *scalars, rows=rows, keys=keys)
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


def _layer_inputs(q, k, *, length: int, window: int, learned, soft_cap: float, sample=None,
                  chunking: Chunking):
    """One layer's ``q, k [Hq, T, D]`` (KV heads repeated), the row passes' scalars and chunks of rows (every
    row, or the ``sample``'s positions)."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    qh = jnp.swapaxes(q, 0, 1)
    kh = jnp.swapaxes(expand_kv(k, num_heads), 0, 1)
    step = rows_per_chunk(num_tokens, num_tokens, chunking.chunk_bytes, STAT_BYTES_PER_SCORE)
    chunks = row_chunks(num_tokens, step, length, sample)
    scalars = (np.int32(length), np.int32(window), learned_logits(learned, num_heads), cap_arg(soft_cap))
    return qh, kh, scalars, chunks


def _trace_inputs(q, k, *, length: int, local_window_size, sinks, logits_soft_cap, sample=None,
                  chunking: Chunking) -> list:
    """:func:`_layer_inputs` of every layer of ``q [L, T, Hq, D]``, ``k [L, T, Hkv, D]``."""
    layers = q.shape[0]
    windows = layer_windows(local_window_size, layers)
    caps = layer_soft_caps(logits_soft_cap, layers)
    return [_layer_inputs(q[layer], k[layer], length=length, window=int(windows[layer]),
                          learned=None if sinks is None else np.asarray(sinks)[layer], soft_cap=float(caps[layer]),
                          sample=sample, chunking=chunking)
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


def sink_statistics(q, k, v=None, cfg=None, *, num_sinks: int = 1, sink_selection: str = "received",
                    min_keys: int = 16, length: int | None = None,
                    local_window_size=None, sinks=None, logits_soft_cap=None,
                    chunking: Chunking = DEFAULT_CHUNKING) -> dict[str, np.ndarray]:
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
        chunking: how the rows are cut into compiled calls (:class:`~pcast_jax.analysis.plan.Chunking`).

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
                                   logits_soft_cap=logits_soft_cap, chunking=chunking)
    return finish()


def pending_statistics(q, k, cfg=None, *, num_sinks: int = 1, sink_selection: str = "received", min_keys: int = 16,
                       length: int | None = None, local_window_size=None, sinks=None, logits_soft_cap=None,
                       sample=None, chunking: Chunking = DEFAULT_CHUNKING):
    """:func:`sink_statistics` in two steps: ``(sink_positions [L, Hq, num_sinks], finish)``.

    The sink positions are found (the first pass over every layer's rows, fetched once) and the second
    pass is dispatched, not waited for: ``finish()`` fetches it and returns :func:`sink_statistics`'
    dict. Work queued between the two (the kernels, which need only the sink positions) runs beside
    the statistics. The arguments as :func:`sink_statistics` takes them; ``sample``: optional sorted query
    positions ``[n]`` (:func:`~pcast_jax.analysis.rows.sample_rows`), the only rows read (every key kept): the
    attention received per key, the sinks found from it and every row mean are then those of the sample.
    """
    q, k, num_sinks, length = _check_qk(q, k, cfg, num_sinks=num_sinks, sink_selection=sink_selection, length=length)
    min_keys = check_int("min_keys", min_keys, min_value=1, max_value=q.shape[1])
    sample = check_sample(sample, length)
    inputs = _trace_inputs(q, k, length=length, local_window_size=local_window_size, sinks=sinks,
                           logits_soft_cap=logits_soft_cap, sample=None if sample is None else sample.positions,
                           chunking=chunking)
    found = _trace_sinks(inputs, length=length if sample is None else len(sample.positions), num_sinks=num_sinks,
                         sink_selection=sink_selection)
    parts = [[_statistic_rows(qh, kh, np.int32(h), row_arg(r0), *scalars, jnp.asarray(positions),
                              np.int32(min_keys), rows=rows, keys=keys)
              for h in range(qh.shape[0]) for r0, rows, keys in chunks]
             for (qh, kh, scalars, chunks), (positions, _, _) in zip(inputs, found)]

    def finish() -> dict[str, np.ndarray]:
        per_layer = [_layer_statistics(rows, *layer) for rows, layer in zip(jax.device_get(parts), found)]
        return {name: np.stack([np.asarray(stats[name]) for stats in per_layer]) for name in per_layer[0]}

    return np.stack([positions for positions, _, _ in found]), finish


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
               local_window_size=None, sinks=None, logits_soft_cap=None,
               chunking: Chunking = DEFAULT_CHUNKING) -> np.ndarray:
    """``[L, Hq, num_sinks]`` int32: each head's sink positions, :func:`sink_statistics`' ``sink_positions``
    without the other statistics (one pass over the rows, none with ``sink_selection="first"``); the
    arguments as :func:`sink_statistics` takes them."""
    q, k, num_sinks, length = _check_qk(q, k, None, num_sinks=num_sinks, sink_selection=sink_selection,
                                        length=length)
    layers, _, num_heads = q.shape[:3]
    if sink_selection == "first":
        return np.broadcast_to(np.arange(num_sinks, dtype=np.int32), (layers, num_heads, num_sinks)).copy()
    inputs = _trace_inputs(q, k, length=length, local_window_size=local_window_size, sinks=sinks,
                           logits_soft_cap=logits_soft_cap, chunking=chunking)
    return np.stack([positions for positions, _, _ in _trace_sinks(inputs, length=length, num_sinks=num_sinks,
                                                                    sink_selection=sink_selection)])
