"""Attention traces of a loaded model: post-RoPE Q/K/V per layer and head.

The sink statistics of a trace are model-agnostic and live in :mod:`pcast_jax.analysis.statistics`
(re-exported here: ``sink_statistics``, ``SINK_SELECTIONS``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from pcast_jax.analysis.statistics import SINK_SELECTIONS, sink_statistics
from pcast_jax.models.llama import causal_attention, forward_with_aux
from pcast_jax.models.llama_common import LlamaConfig

__all__ = ["QKVTrace", "SINK_SELECTIONS", "extract_qkv", "sink_statistics"]

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

    def hook(q, k, v, layer, **kwargs):  # valid, window, soft_cap: as the forward passes them
        return inner(q, k, v, layer, **kwargs), (q, k, v)

    return hook


def extract_qkv(params, cfg: LlamaConfig, tokens, *, rope: str | None = None,
                attention_fn=None) -> QKVTrace:
    """Post-RoPE Q, K, V of every layer, collected through the ``attention_fn`` hook.

    Args:
        params, cfg, tokens: as :func:`pcast_jax.models.llama.forward`.
        rope: RoPE convention (default: the model's own, ``cfg.rope``).
        attention_fn: the attention that produces each layer's output (default exact f32);
            later layers' inputs depend on it, so a lossy attention changes the traces.

    Returns:
        :class:`QKVTrace` of float32 arrays stacked over layers by the layer scan.
    """
    _, (q, k, v) = forward_with_aux(params, cfg, tokens, attention_fn=_recording_hook(attention_fn),
                                    rope=rope)
    return QKVTrace(q, k, v)
