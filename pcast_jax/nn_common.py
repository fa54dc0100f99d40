"""Which keys a query sees, as ``jax.nn.dot_product_attention`` takes it: masks, lengths, windows.

Shared by :mod:`pcast_jax.nn` (the drop-in) and :mod:`pcast_jax.analysis.capture` (what a recorded
layer saw). Each function validates its argument and names it in the
:class:`~pcast_jax.errors.PcastError` it raises.
"""

from __future__ import annotations

import jax.numpy as jnp

from pcast_jax import block
from pcast_jax.errors import PcastError, check_int

__all__ = ["broadcast_4d", "causal_keys", "local_window", "seq_lengths", "visibility"]


def broadcast_4d(name: str, x, shape, dtype):
    """``x`` (bias or mask) as ``dtype``, broadcast to ``shape`` (B, N, T, S)."""
    x = jnp.asarray(x, dtype)
    try:
        return jnp.broadcast_to(x, shape)
    except ValueError:
        raise PcastError(f"{name}.shape={x.shape} does not broadcast to (B, N, T, S) = {shape}") from None


def seq_lengths(name: str, x, batch: int):
    """``query_seq_lengths`` / ``key_value_seq_lengths``: an integer (B,) array (jax.nn's int32)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise PcastError(f"{name} must be an integer array of shape (B,) = ({batch},), got {x.dtype} {x.shape}")
    return x.astype(jnp.int32)


def local_window(local_window_size):
    """``local_window_size`` as a ``(left, right)`` pair of ints >= 0, or None."""
    if local_window_size is None:
        return None
    w = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
    try:  # positions are int32: a window as wide as any sequence is at most 2^31 - 1
        left, right = (check_int("local_window_size", x, min_value=0, max_value=2**31 - 1) for x in w)
    except PcastError:
        raise
    except (TypeError, ValueError):
        raise PcastError(f"local_window_size={local_window_size!r} must be an int or a (left, right) pair "
                         "of ints >= 0") from None
    return left, right


def visibility(shape, mask, causal: bool, alignment: str, q_lens, kv_lens, window):
    """(B, N, T, S) bool: True where a query sees a key (None when every key is visible).

    ``mask`` (B, N, T, S) bool or None; causal and the local window are measured from query
    position ``i`` (top-left, as ``jax.nn``) or ``i + S − T`` (bottom-right, as the kernels);
    ``q_lens`` / ``kv_lens`` (B,) hide padded query rows and keys.
    """
    b, _, t, s = shape
    parts = [] if mask is None else [mask]
    q_pos = jnp.arange(t)[:, None] + (s - t if alignment == "bottom_right" else 0)
    k_pos = jnp.arange(s)[None, :]
    if causal:
        parts.append(block.visible(q_pos, k_pos)[None, None])
    if window is not None:
        left, right = window
        parts.append(((q_pos <= k_pos + left) & (q_pos >= k_pos - right))[None, None])
    if q_lens is not None:
        parts.append((jnp.arange(t)[None, :, None] < q_lens[:, None, None])[:, None])
    if kv_lens is not None:
        parts.append((jnp.arange(s)[None, None, :] < kv_lens[:, None, None])[:, None])
    if not parts:
        return None
    vis = parts[0]
    for x in parts[1:]:
        vis = vis & x
    return jnp.broadcast_to(vis, shape)


def causal_keys(num_tokens: int, valid=None, window=None):
    """``[T, T]`` bool of one sequence: key ``j`` visible to query ``i`` — causal, a real key where
    ``valid [T]`` (True at real tokens, right padding) is given, at most ``window`` positions back where it
    is given and ≥ 0 (an int, traced or not; −1: none)."""
    idx = jnp.arange(num_tokens)
    mask = idx[None, :] <= idx[:, None]
    if valid is not None:
        mask = mask & jnp.asarray(valid, bool)[None, :]
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
        mask = mask & ((window < 0) | (idx[:, None] - idx[None, :] <= window))
    return mask
