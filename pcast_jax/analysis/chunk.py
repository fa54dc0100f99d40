"""The per-chunk math of the per-head analysis: one chunk of one head's query rows through the simulated kernel.

Every program reads one :class:`ChunkContext` (the chunk's logits and where it sits in the layer) and takes its
static choices (the configs, whether a learned sink acts, the keys visited) as keywords. The rows are
independent, so a chunk of rows gives those rows of the whole head's result; :mod:`~pcast_jax.analysis.plan`
decides the chunks, :mod:`~pcast_jax.analysis.heads` runs them.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pcast_jax import engine as _engine
from pcast_jax.analysis.rows import HIGHEST, kernel_mask, softmax_rows, visible_rows
from pcast_jax.config import KernelConfig
from pcast_jax.nn import kernel_logits, kernel_operands, soft_capped

__all__ = ["ChunkContext", "layer_operands", "kernel_logits_rows", "chunk_family", "further_row_metrics"]


class ChunkContext(NamedTuple):
    """What every program of one chunk of one head's query rows reads (a pytree: its arrays are traced)."""

    #: ``[rows, K]``: the chunk's logits as the kernel multiplies them (:func:`kernel_logits_rows`)
    logits: jax.Array
    #: the layer's operands (:func:`layer_operands`): ``q, k, v [Hq, T, D]`` and ``factor [Hq]``
    operands: tuple
    #: ``[Hq, k]`` each head's sink positions
    sink_positions: jax.Array
    #: ``[Hq, T, D]`` the exact output (a sample's: ``[Hq, n, D]``); None where only masses are computed
    reference: jax.Array | None
    #: the head (int32)
    head: jax.Array
    #: the chunk's first row (int32), or a sample's positions ``[rows]``
    row0: jax.Array
    #: with a sample: the chunk's first row among the sample's (the reference's rows)
    ref_row0: jax.Array
    #: the real tokens (int32)
    length: jax.Array
    #: the layer's local window (int32; −1: none)
    window: jax.Array
    #: ``[Hq]`` learned sink logits (−inf: none)
    learned: jax.Array
    #: the layer's soft cap (float32), or None for none
    cap: jax.Array | None


@functools.partial(jax.jit, static_argnames=("config",))
def layer_operands(q, k, v, *, config: KernelConfig):
    """:func:`pcast_jax.nn.kernel_operands` of one layer ``[T, H, D]``: ``(q, k, v [Hq, T, D],
    factor [Hq])`` (Q/K/V quantized over the whole layer, as the kernel's call sees it)."""
    ops = kernel_operands(*(jnp.swapaxes(x, 0, 1)[None] for x in (q, k, v)), config, 1.0 / math.sqrt(q.shape[2]))
    factor = jnp.broadcast_to(jnp.asarray(ops[3], jnp.float32).reshape(-1), (q.shape[1],))
    return ops[0][0], ops[1][0], ops[2][0], factor


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def kernel_logits_rows(operands, head, row0, *, rows: int, keys: int):
    """The logits of head ``head``'s query rows ``row0 .. row0 + rows`` on its first ``keys`` keys as the
    kernel multiplies them (from :func:`layer_operands`; before the soft cap and the mask): one product per
    chunk of rows, shared by every config and scan whose operands are these
    (:func:`pcast_jax.analysis.heads.analyze_layers`)."""
    q, k, _, factor = operands
    head_dim = k.shape[2]
    if jnp.ndim(row0) == 0:
        q_rows = lax.dynamic_slice(q, (head, row0, 0), (1, rows, head_dim))
    else:
        q_rows = jnp.take(lax.dynamic_index_in_dim(q, head, 0, keepdims=True), row0, axis=1)
    k_head = lax.dynamic_slice(k, (head, 0, 0), (1, keys, head_dim))
    return kernel_logits(q_rows[None], k_head[None], factor[head])[0, 0]



def _chunk_logits(ctx: ChunkContext, keys: int):
    """A chunk's logits (:func:`kernel_logits_rows`) as the kernel sees them, on its first ``keys`` keys
    (:func:`~pcast_jax.analysis.plan.keys_visited`): soft-capped at the cap, the keys the layer hides
    (:func:`~pcast_jax.analysis.rows.visible_rows`) masked; with the visible keys, the sink columns and the
    counted (visible non-sink) keys per row."""
    logits = ctx.logits[:, :keys]
    rows, num_keys = logits.shape
    s = soft_capped(logits, ctx.cap)
    vis = visible_rows(ctx.row0, rows, num_keys, ctx.length, ctx.window)
    s = jnp.where(vis, s, -jnp.inf)
    sinks = ctx.sink_positions[ctx.head]
    is_sink = jnp.any(jnp.arange(num_keys)[:, None] == sinks[None, :], axis=-1)
    return s, vis, is_sink, jnp.sum(vis & ~is_sink[None, :], axis=-1)


def _chunk_rows(ctx: ChunkContext, *, config: KernelConfig, has_learned: bool, keys: int):
    """Per-row quantities of the head's chunk of query rows: the chunk's logits on the keys the kernel visits
    (:func:`_chunk_logits`), then the kernel, against the reference's rows (the chunk's, or a sample's from
    ``ref_row0`` on)."""
    head, ref = ctx.head, ctx.reference
    v = ctx.operands[2][:, :keys]
    rows = ctx.logits.shape[0]
    s, vis, is_sink, counted = _chunk_logits(ctx, keys)
    # the reference's rows: the chunk's (every row), or the sample's from the chunk's first (a sample)
    ref_at = ctx.row0 if jnp.ndim(ctx.row0) == 0 else ctx.ref_row0
    r = lax.dynamic_slice(ref, (head, ref_at, 0), (1, rows, ref.shape[-1]))[0]
    config, q_offset = kernel_mask(config, ctx.row0)
    res = _engine.run(s, v[head], _engine.bound(config), implementation="xla", count_mask=~is_sink,
                      q_offset=q_offset, sink_logit=ctx.learned[head] if has_learned else None)
    # Q/K/V as the kernel sees them, P in FP32: the Q/K/V quantization's share of the error (none with
    # FP32 Q/K/V, which the kernel sees as the reference does).
    if config.qkv == "e4m3":
        qkv_only = jnp.einsum("rs,sd->rd", softmax_rows(s, vis, ctx.learned[head]), v[head], precision=HIGHEST)
        qkv_sq_err = jnp.sum(jnp.square(qkv_only - r), axis=-1)
    else:
        qkv_sq_err = jnp.zeros(rows, jnp.float32)
    out = {"sq_err": jnp.sum(jnp.square(res.out - r), axis=-1), "ref_sq": jnp.sum(jnp.square(r), axis=-1),
           "qkv_sq_err": qkv_sq_err,
           "n_zeroed": res.n_zeroed, "n_counted": counted, "zeroed_mass": res.zeroed_mass}
    out.update(further_row_metrics(res._replace(n_counted=counted), counted.astype(jnp.float32)))
    return out


def _chunk_masses(ctx: ChunkContext, *, configs: tuple[KernelConfig, ...], has_learned: bool, keys: int):
    """The zeroed and the clipped mass per row of :func:`_chunk_rows`' rows for every config of ``configs``
    (a family: configs that differ only in ``scale``, so the same operands and logits), ``[C, rows]``
    each, from :func:`pcast_jax.engine.weights_and_stats` (the kernel's own statistics, without the
    contraction with V; the pre-cast P, which does not depend on the scale in the multiply mode, is one
    computation for all of them)."""
    s, _, is_sink, counted = _chunk_logits(ctx, keys)
    sink = ctx.learned[ctx.head] if has_learned else None
    stats = [_engine.run_weights(s, _engine.bound(masked), count_mask=~is_sink, q_offset=q_offset, sink_logit=sink)
             for masked, q_offset in (kernel_mask(cfg, ctx.row0) for cfg in configs)]
    return counted, jnp.stack([w.zeroed_mass for w in stats]), jnp.stack([w.saturated_mass for w in stats])


@functools.partial(jax.jit, static_argnames=("jobs", "has_learned", "keys"))
def chunk_family(ctx: ChunkContext, *, jobs: tuple, has_learned: bool, keys: int) -> list:
    """One chunk's :func:`_chunk_rows` (a job ``("config", config)``) and :func:`_chunk_masses` (``("family",
    configs)``) of one kernel family (configs that differ only in ``scale``), in one program: one call where
    there was one per job, and XLA computes what the jobs share before the cast (the masked logits, the block
    maxima, the running max) as common subexpressions."""
    return [_chunk_rows(ctx, config=what, has_learned=has_learned, keys=keys) if kind == "config" else
            _chunk_masses(ctx, configs=what, has_learned=has_learned, keys=keys)
            for kind, what in jobs]


def further_row_metrics(res, counted) -> dict:
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
