"""End-to-end metrics of a model run: its next-token logits against the FP32 model's on the same tokens."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax.errors import PcastError

__all__ = ["E2EMetrics", "compare_logits", "scored_positions", "validate_lengths", "check_scored"]


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
