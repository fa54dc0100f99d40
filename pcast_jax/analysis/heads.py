"""Per layer and head, on any ``[L, T, H, D]`` trace: every kernel config's P-cast metrics (the driver).

Model-agnostic: the inputs are post-RoPE Q, K, V of causal self-attention layers, one sequence,
whatever model they come from (:mod:`pcast_jax.analysis.capture` records them from any JAX model;
:func:`pcast_jax.models.extract_qkv` from a loaded checkpoint). The sinks come from
:mod:`~pcast_jax.analysis.statistics`; each layer runs as :func:`~pcast_jax.analysis.plan.plan_layer` plans it,
each chunk through :mod:`~pcast_jax.analysis.chunk`; the end-to-end metrics of a model run are in
:mod:`~pcast_jax.analysis.logit_metrics`.

Definitions used in the reports
-------------------------------
* **Visible keys** of query row ``i``: what the layer lets it see — causal (``j ≤ i``), within
  the layer's local window (``i − j ≤ w``) when it has one, and inside the sequence's real tokens
  (``length``; right padding is neither a query nor a key). Every statistic, simulated kernel and
  reference here uses them; a kernel simulation sees the hidden keys as masked (−inf logits). A layer
  with a logit soft cap (``logits_soft_cap``) has every logit here replaced by ``cap·tanh(logit/cap)``.
* **Non-sink position** of a head: every key position except the head's ``num_sinks`` sink
  positions from :func:`~pcast_jax.analysis.statistics.sink_statistics` (by default the single key receiving the
  most attention).
* **Fraction of non-sink P zeroed**, two poolings (both registered in :data:`pcast_jax.quantities.QUANTITIES`):
  ``frac_zeroed``, as in a sweep, pools the counts of the head's real query rows (the non-sink visible keys
  whose P was positive before the cast and 0 after it, over all non-sink visible keys);
  ``frac_zeroed_row_mean`` is the mean of per-row fractions instead, over the rows with at least
  ``min_keys`` non-sink visible keys (whether or not they see the sink: a row past a local window loses
  mass too).
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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import engine as _engine
from pcast_jax import stats as _stats
from pcast_jax.analysis.chunk import ChunkContext, chunk_family, kernel_logits_rows, layer_operands
from pcast_jax.analysis.plan import (
    DEFAULT_CHUNKING,
    REFERENCE_BYTES_PER_SCORE,
    Chunking,
    plan_layer,
    row_chunks,
    rows_per_chunk,
)
from pcast_jax.analysis.rows import (
    HIGHEST,
    RowSample,
    cap_arg,
    check_sample,
    expand_kv,
    has_learned,
    layer_soft_caps,
    layer_windows,
    learned_logits,
    row_arg,
    softmax_rows,
    take_rows,
    visible_rows,
)
from pcast_jax.config import KernelConfig
from pcast_jax.engine import check_implementation
from pcast_jax.errors import PcastError, check_int
from pcast_jax.nn import kernel_inputs, soft_capped
from pcast_jax.presets import resolve

__all__ = ["HEAD_METRICS", "scores_and_values", "heads_attention", "head_metrics", "analyze_trace", "analyze_layers",
           "scale_masses"]

#: What :func:`head_metrics` returns per head at least (see the module docstring); every further
#: per-row count ``n_<what>`` or mass ``<what>_mass`` the engine's result carries comes as
#: ``frac_<what>`` (of the visible keys) / ``<what>_mass`` beside them: ``frac_saturated`` and
#: ``saturated_mass`` (P·S clipped at the format's max).
HEAD_METRICS = ("mse", "ref_sq", "rel_mse", "rel_mse_qkv", "frac_zeroed", "frac_zeroed_row_mean", "zeroed_mass",
                "rows_used")


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

    bound = _engine.bound(cfg)  # resolved above, bound once for every head

    def one(s, vh, cm):
        return _engine.run(s, vh, bound, implementation=impl, count_mask=cm, q_offset=0)

    if count_mask is None:
        return jax.vmap(lambda s, vh: one(s, vh, None))(scores, v_seen)
    return jax.vmap(one)(scores, v_seen, jnp.asarray(count_mask, bool))


@functools.partial(jax.jit, static_argnames=("rows", "keys"))
def _reference_rows(q, k, v, row0, length, window, learned, cap, *, rows: int, keys: int):
    """Exact FP32 attention of query rows ``row0 .. row0 + rows`` of every head, ``q, k, v [Hq, T, D]``, on
    the first ``keys`` keys (all the rows see)."""
    head_dim = q.shape[-1]
    q_rows = take_rows(q, row0, rows, 1)
    k, v = k[:, :keys], v[:, :keys]
    s = soft_capped(jnp.einsum("hrd,hsd->hrs", q_rows, k, precision=HIGHEST) / math.sqrt(head_dim), cap)
    probs = softmax_rows(s, visible_rows(row0, rows, keys, length, window)[None], learned[:, None, None])
    return jnp.einsum("hrs,hsd->hrd", probs, v, precision=HIGHEST)


def _reference(q, k, v, *, length: int | None = None, window: int = -1, sinks=None,
               soft_cap: float = 0.0, sample=None, chunking: Chunking = DEFAULT_CHUNKING) -> jax.Array:
    """Exact FP32 attention per head of one layer ``[T, H, D]``: ``[Hq, T, D]`` (rows past ``length``: 0; with a
    ``sample`` of rows ``[n]``, those rows alone: ``[Hq, n, D]``), on chunks of query rows (dispatched: not waited
    for)."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    qh, kh, vh = (jnp.swapaxes(expand_kv(jnp.asarray(x, jnp.float32), num_heads), 0, 1) for x in (q, k, v))
    length = num_tokens if length is None else length
    step = rows_per_chunk(num_tokens, num_heads * num_tokens, chunking.chunk_bytes, REFERENCE_BYTES_PER_SCORE)
    chunks = row_chunks(num_tokens, step, length, sample)
    learned = learned_logits(sinks, num_heads)
    out = jnp.concatenate([_reference_rows(qh, kh, vh, row_arg(r0), np.int32(length), np.int32(window), learned,
                                           cap_arg(soft_cap), rows=rows, keys=keys) for r0, rows, keys in chunks],
                          axis=1)
    return out


def _reference_jit(q, k, v):
    """:func:`_reference` of full causal attention (kept for callers of the whole-layer form)."""
    return _reference(q, k, v)


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
                  soft_cap: float = 0.0, sample=None, chunking: Chunking = DEFAULT_CHUNKING):
    """Every config's :func:`head_metrics` and every family's :func:`scale_masses` on one layer, dispatched:
    ``(parts, finish)``, the per-chunk device arrays and the callable that takes them, fetched
    (``jax.device_get``), to the results. The caller fetches when it needs them, so the layers'
    computations queue without waiting for each other.

    The layer runs as :func:`~pcast_jax.analysis.plan.plan_layer` plans it: per program group, one product of
    Q and K per chunk of rows and head (:func:`~pcast_jax.analysis.chunk.kernel_logits_rows`), whatever the
    number of configs and candidate scales, and one call per program. ``qkv``: the layer's ``(q, k, v [T, H,
    D])``, padding zeroed; ``reference [Hq, T, D]`` (None without configs); ``families``: per family its configs
    (the candidate scales); ``sample``: optional sorted query positions
    (:func:`~pcast_jax.analysis.rows.sample_rows`), the only rows simulated (every key kept). Returns the
    metrics per config and ``{"zeroed_mass", "saturated_mass"}`` (each ``[len(family), Hq]``) per family; with a
    sample, each also with its standard error over the sampled rows (``<metric>_sem``).
    """
    num_tokens, num_heads = np.shape(qkv[0])[:2]
    head_dim = np.shape(qkv[0])[2]
    positions = jnp.asarray(sink_positions, jnp.int32)
    learned = learned_logits(sinks, num_heads)
    with_learned = has_learned(sinks)
    layer = (np.int32(length), np.int32(window), learned, cap_arg(soft_cap))
    plan = plan_layer(configs, families, num_tokens=num_tokens, length=length,
                      sample=None if sample is None else sample.positions, chunking=chunking)
    parts: dict = {job: [] for group in plan.groups for job in group.jobs}
    for group in plan.groups:
        operands = layer_operands(*qkv, config=group.operands)
        for h in range(num_heads):
            head = np.int32(h)
            for chunk in group.chunks:
                row0 = row_arg(chunk.row0)
                logits = kernel_logits_rows(operands, head, row0, rows=chunk.rows, keys=chunk.keys)
                ctx = ChunkContext(logits, operands, positions, reference, head, row0, np.int32(chunk.at), *layer)
                for program in chunk.programs:
                    done = chunk_family(ctx, jobs=tuple((kind, configs[i] if kind == "config" else families[i])
                                                        for kind, i in program.jobs),
                                        has_learned=with_learned, keys=program.keys)
                    for job, part in zip(program.jobs, done):
                        parts[job].append(part)
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
    """:func:`head_metrics` from one config's :func:`~pcast_jax.analysis.chunk.chunk_family` of every head and
    chunk (heads outer): the row means on the host; with a ``sample`` of rows, the sample's estimates of them
    and each one's standard error (``<metric>_sem``)."""
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
                                         ("frac_zeroed", n_zeroed, real, counted),
                                         ("frac_zeroed_row_mean", frac, valid, None)):
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
        "frac_zeroed": (n_zeroed.sum(axis=-1) / np.maximum(counted.sum(axis=-1), 1)).astype(np.float32),
        "frac_zeroed_row_mean": row_mean(frac),
        "zeroed_mass": row_mean(rows.pop("zeroed_mass")), "rows_used": n_rows.astype(np.int32),
    }
    out.update({name: row_mean(x) for name, x in rows.items()})
    return out


def scale_masses(trace, family: KernelConfig, scales: Sequence[float], sink_positions, *, min_keys: int = 16,
                 length: int | None = None, local_window_size=None, sinks=None,
                 logits_soft_cap=None, chunking: Chunking = DEFAULT_CHUNKING) -> dict[str, np.ndarray]:
    """The zeroed and the clipped mass of one kernel family at every scale, per layer and head, in one pass.

    P before the cast does not depend on ``scale``: each layer's operands and each chunk of rows' logits
    are computed once, and one compiled call per chunk evaluates every scale's cast and statistics
    (:func:`~pcast_jax.analysis.chunk.chunk_family`), with no contraction with V. The rows and their means are those of
    :func:`head_metrics`, so each scale's masses are that kernel's ``zeroed_mass`` and
    ``saturated_mass``.

    Args:
      trace: ``(q, k, v)`` of one sequence, as :func:`analyze_trace` takes it.
      family: the kernel (its ``scale`` is replaced by each of ``scales``).
      scales: the candidate scales.
      sink_positions, min_keys, length, local_window_size, sinks, logits_soft_cap, chunking: as
        :func:`analyze_trace`.

    Returns:
      ``{"zeroed_mass", "saturated_mass"}``, each ``[len(scales), L, Hq]`` float32.
    """
    _, masses = analyze_layers(trace, (), sink_positions, families=((family, scales),), min_keys=min_keys,
                               length=length, local_window_size=local_window_size, sinks=sinks,
                               logits_soft_cap=logits_soft_cap, chunking=chunking)
    return masses[0]


def head_metrics(q, k, v, config: str | KernelConfig, sink_positions, *,
                 min_keys: int = 16, reference=None, length: int | None = None,
                 local_window_size: int | None = None, sinks=None, logits_soft_cap=None,
                 chunking: Chunking = DEFAULT_CHUNKING) -> dict[str, np.ndarray]:
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
      chunking: how the rows are cut into compiled calls (:class:`~pcast_jax.analysis.plan.Chunking`).

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
        reference = _reference(q, k, v, length=length, window=window, sinks=sinks, soft_cap=cap, chunking=chunking)
    parts, finish = _layer_passes((q, k, v), reference, [cfg], (), sink_positions, min_keys=min_keys,
                                  length=length, window=window, sinks=sinks, soft_cap=cap, chunking=chunking)
    metrics, _ = finish(jax.device_get(parts))
    return metrics[0]


def analyze_trace(trace, configs: Sequence[str | KernelConfig], sink_positions, *,
                  min_keys: int = 16, progress=None, length: int | None = None,
                  local_window_size=None, sinks=None, references: dict | None = None,
                  logits_soft_cap=None, chunking: Chunking = DEFAULT_CHUNKING) -> dict[str, np.ndarray]:
    """:func:`head_metrics` for every configuration and layer of a trace (:func:`analyze_layers`).

    Args:
      trace: ``(q, k, v)`` of one sequence (``q [L, T, Hq, D]``, ``k, v [L, T, Hkv, D]``).
      configs: preset names or :class:`KernelConfig` objects.
      sink_positions: ``[L, Hq, k]`` from :func:`~pcast_jax.analysis.statistics.sink_statistics`.
      progress: optional callable ``(config_name) -> None`` called with each configuration's name before
        the layers run.
      length: the sequence's real tokens (default T).
      local_window_size: each layer's local window, as :func:`~pcast_jax.analysis.statistics.sink_statistics` takes it.
      sinks: optional ``[L, Hq]`` learned sink logits (−inf: none).
      logits_soft_cap: each layer's soft cap, as :func:`layer_soft_caps` reads it.
      references: optional dict that keeps each layer's padded Q/K/V and exact output between calls
        on the same sequence (filled here; pass the same dict again to reuse them).
      chunking: how the rows are cut into compiled calls (:class:`~pcast_jax.analysis.plan.Chunking`).

    Returns:
      dict metric → ``[n_configs, L, Hq]`` numpy array (the keys of :func:`head_metrics`).
    """
    configs = [resolve(config) for config in configs]
    for cfg in configs:
        if progress is not None:
            progress(cfg.name)
    metrics, _ = analyze_layers(trace, configs, sink_positions, min_keys=min_keys, length=length,
                                local_window_size=local_window_size, sinks=sinks, references=references,
                                logits_soft_cap=logits_soft_cap, chunking=chunking)
    return metrics


def _real_rows(x: np.ndarray, real: np.ndarray) -> np.ndarray:
    """``x [T, H, D]`` with the rows past the real tokens zeroed (no copy where every row is real)."""
    return x if real.all() else np.where(real, x, 0.0)


def analyze_layers(trace, configs: Sequence[str | KernelConfig], sink_positions, *,
                   families: Sequence[tuple[KernelConfig, Sequence[float]]] = (), min_keys: int = 16,
                   progress=None, length: int | None = None, local_window_size=None, sinks=None,
                   references: dict | None = None, logits_soft_cap=None, sample=None,
                   chunking: Chunking = DEFAULT_CHUNKING) -> tuple[dict, list[dict]]:
    """:func:`analyze_trace` and :func:`scale_masses` of several families in one pass over the layers.

    Layer by layer, every configuration and every family's candidate scales run on the same chunks of
    rows, and those whose kernels multiply the same operands (the same Q/K/V quantization) share each
    chunk's product of Q and K; the numbers are those of :func:`analyze_trace` and :func:`scale_masses`.

    Args:
      trace, configs, sink_positions, min_keys, length, local_window_size, sinks, references,
        logits_soft_cap, chunking: as :func:`analyze_trace`.
      families: ``(family, scales)`` pairs, as :func:`scale_masses` takes them.
      progress: optional callable ``(layer) -> None`` called with each layer's index before it runs.
      sample: optional sorted query positions ``[n]`` (:func:`~pcast_jax.analysis.rows.sample_rows`): only these
        rows are simulated, on every key they see (so the kernel's running max is exact), and every row mean is
        the sample's.

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
    sample = check_sample(sample, length)
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
                                       sample=None if sample is None else sample.positions, chunking=chunking)
                if references is not None:
                    layer_inputs[layer] = qkv, reference
        per_layer.append(_layer_passes(qkv, reference, kernels, scans, sink_positions[layer], min_keys=min_keys,
                                       length=length, window=int(windows[layer]), sinks=learned,
                                       soft_cap=float(caps[layer]), sample=sample, chunking=chunking))
    # fetched once, after every layer's computations are queued: none waits for the host
    per_layer = [finish(parts) for parts, (_, finish) in zip(jax.device_get([p for p, _ in per_layer]), per_layer)]
    metrics = None
    if kernels:
        metrics = {m: np.stack([np.stack([layer[0][c][m] for layer in per_layer]) for c in range(len(kernels))])
                   for m in per_layer[0][0][0]}
    masses = [{name: np.stack([layer[1][f][name] for layer in per_layer], axis=1)
               for name in per_layer[0][1][f]} for f in range(len(scans))]
    return metrics, masses
