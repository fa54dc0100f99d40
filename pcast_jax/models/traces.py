"""Attention traces of a real model: post-RoPE Q/K/V per layer and head, and sink statistics.

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
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.models.gguf_loader import LlamaConfig
from pcast_jax.models.llama import causal_attention, expand_kv, forward_with_aux

__all__ = ["QKVTrace", "SINK_SELECTIONS", "extract_qkv", "sink_statistics"]

SINK_SELECTIONS = ("received", "first")
_HIGHEST = lax.Precision.HIGHEST


class QKVTrace(NamedTuple):
    """Post-RoPE attention inputs of every layer: ``q [L, T, Hq, D]``, ``k, v [L, T, Hkv, D]``.

    For batched tokens ``[B, T]`` every array has a leading ``B`` axis.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array


@functools.lru_cache(maxsize=32)
def _recording_hook(attention_fn):
    """An attention hook that runs ``attention_fn`` and also returns its inputs as aux."""
    inner = attention_fn or causal_attention

    def hook(q, k, v, layer):
        return inner(q, k, v, layer), (q, k, v)

    return hook


def extract_qkv(params, cfg: LlamaConfig, tokens, *, rope: str = "adjacent",
                attention_fn=None) -> QKVTrace:
    """Post-RoPE Q, K, V of every layer, collected through the ``attention_fn`` hook.

    Args:
        params, cfg, tokens: as :func:`pcast_jax.models.llama.forward`.
        rope: RoPE convention (``"adjacent"`` for GGUF weights).
        attention_fn: the attention that produces each layer's output (default exact f32);
            later layers' inputs depend on it, so a lossy attention changes the traces.

    Returns:
        :class:`QKVTrace` of float32 arrays stacked over layers by the layer scan.
    """
    _, (q, k, v) = forward_with_aux(params, cfg, tokens, attention_fn=_recording_hook(attention_fn),
                                    rope=rope)
    return QKVTrace(q, k, v)


def _head_statistics(q, k, *, num_sinks: int, sink_selection: str, min_keys: int):
    """Sink statistics of one head: ``q, k [T, D]`` (post-RoPE) -> dict of scalars.

    Sums over non-sink keys are taken as (sum over causal keys) - (sum over the few sink
    columns), so each quantity costs one fused pass over the ``[T, T]`` logits.
    """
    num_tokens, head_dim = q.shape
    positions = jnp.arange(num_tokens)
    scores = jnp.einsum("td,sd->ts", q, k, precision=_HIGHEST) / math.sqrt(head_dim)
    causal = positions[None, :] <= positions[:, None]
    masked = jnp.where(causal, scores, -jnp.inf)
    weights = jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True))
    inv_norm = 1.0 / jnp.sum(weights, axis=-1)                           # [T]
    received = jnp.sum(weights * inv_norm[:, None], axis=0) / num_tokens  # [T]
    if sink_selection == "received":
        _, sink_positions = lax.top_k(received, num_sinks)
        sink_positions = jnp.sort(sink_positions)
    else:
        sink_positions = jnp.arange(num_sinks)
    sink_scores = scores[:, sink_positions]                              # [T, k]
    sink_visible = sink_positions[None, :] <= positions[:, None]         # [T, k]
    n_other = positions + 1 - jnp.sum(sink_visible, axis=-1)             # [T]
    valid_row = (positions >= sink_positions[-1]) & (n_other >= min_keys)
    safe_n = jnp.maximum(n_other, 1)

    def other_sum(full, sink_part):
        """Row sum over non-sink causal keys of an elementwise function of the logits."""
        return (jnp.sum(jnp.where(causal, full, 0.0), axis=-1)
                - jnp.sum(jnp.where(sink_visible, sink_part, 0.0), axis=-1))

    other_mean = other_sum(scores, sink_scores) / safe_n
    centered = lambda x: (x - other_mean[:, None]) ** 2  # noqa: E731
    other_std = jnp.sqrt(jnp.maximum(other_sum(centered(scores), centered(sink_scores)), 0.0)
                         / safe_n)
    sink_max = jnp.max(jnp.where(sink_visible, sink_scores, -jnp.inf), axis=-1)
    gap = jnp.where(valid_row, sink_max - other_mean, 0.0)
    gap_sigma = jnp.where(valid_row, gap / jnp.maximum(other_std, 1e-12), 0.0)
    sink_mass_rows = jnp.sum(jnp.where(sink_visible, weights[:, sink_positions], 0.0),
                             axis=-1) * inv_norm
    # Eq. (6) with the running max at the sink max (forward order, sink in the first block):
    # a non-sink P = exp(s - m) is zeroed by the E4M3 cast with scale S iff s < m - 10 ln2 - ln S.
    below = {}
    for scale in (1, 256):
        threshold = (sink_max - 10 * math.log(2) - math.log(scale))[:, None]
        below[scale] = other_sum((scores < threshold).astype(jnp.float32),
                                 (sink_scores < threshold).astype(jnp.float32)) / safe_n
    n_rows = jnp.sum(valid_row)

    def row_mean(x):
        total = jnp.sum(jnp.where(valid_row, x, 0.0))
        return jnp.where(n_rows > 0, total / jnp.maximum(n_rows, 1), jnp.nan)

    return {
        "sink_positions": sink_positions.astype(jnp.int32),
        "delta": row_mean(gap),
        "delta_sigma": row_mean(gap_sigma),
        "sigma": row_mean(other_std),
        "sink_mass": row_mean(sink_mass_rows),
        "underflow_s1": row_mean(below[1]),
        "underflow_s256": row_mean(below[256]),
        "position0_mass": jnp.mean(weights[:, 0] * inv_norm),
        "top_received": jnp.max(received),
        "rows_used": n_rows.astype(jnp.int32),
    }


@functools.partial(jax.jit, static_argnames=("num_sinks", "sink_selection", "min_keys"))
def _layer_statistics(q, k, *, num_sinks: int, sink_selection: str, min_keys: int):
    """Per-head statistics of one layer, ``q [T, Hq, D]``, ``k [T, Hkv, D]``.

    Heads run one after another (``lax.map``), so memory stays at a few ``[T, T]`` arrays.
    """
    k = expand_kv(k, q.shape[1])
    per_head = functools.partial(_head_statistics, num_sinks=num_sinks,
                                 sink_selection=sink_selection, min_keys=min_keys)
    return lax.map(lambda qk: per_head(*qk), (jnp.swapaxes(q, 0, 1), jnp.swapaxes(k, 0, 1)))


def sink_statistics(q, k, v=None, cfg: LlamaConfig | None = None, *, num_sinks: int = 1,
                    sink_selection: str = "received", min_keys: int = 16) -> dict[str, np.ndarray]:
    """Per-layer, per-head sink statistics of a trace (see the module docstring for definitions).

    Args:
        q: ``[L, T, Hq, D]`` post-RoPE queries (from :func:`extract_qkv`).
        k: ``[L, T, Hkv, D]`` post-RoPE keys.
        v: unused (accepted so a whole :class:`QKVTrace` can be passed as ``*trace``).
        cfg: optional; when given, shapes are checked against it.
        num_sinks: sink tokens per head (``k_sink``), >= 1.
        sink_selection: ``"received"`` (top positions by mean attention received) or
            ``"first"`` (positions ``0 .. num_sinks-1``).
        min_keys: rows with fewer non-sink keys than this are skipped (their std is noise).

    Returns:
        dict of numpy arrays, each ``[L, H]`` unless noted: ``sink_positions [L, H, num_sinks]``,
        ``delta`` (raw logits), ``sigma``, ``delta_sigma`` (Δ in σ units), ``sink_mass`` (mean
        attention on the sinks), ``position0_mass`` (mean attention on position 0 over all rows),
        ``top_received`` (largest mean attention received by one key), ``underflow_s1`` and
        ``underflow_s256`` (fraction of non-sink logits below ``max sink − 6.93 − ln S``, i.e.
        the P values an E4M3 cast with scale S zeroes when the running max sits at the sink,
        Eq. 6), ``rows_used``.
        Rows-based entries are NaN for a head with no usable row.
    """
    del v
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
    min_keys = check_int("min_keys", min_keys, min_value=1, max_value=num_tokens)
    per_layer = [
        _layer_statistics(q[layer], k[layer], num_sinks=num_sinks, sink_selection=sink_selection,
                          min_keys=min_keys)
        for layer in range(layers)
    ]
    return {name: np.stack([np.asarray(stats[name]) for stats in per_layer])
            for name in per_layer[0]}
