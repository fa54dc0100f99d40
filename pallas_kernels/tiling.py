"""A semantic KV block on the MMA tile a backend lowers.

The P-cast semantics live in the *semantic* KV block of ``config.block_kv`` keys: the running
max m and α update once per block (FlashAttention-3's 224 or 160, FlashInfer's 192, the paper's
64). A backend computes a block on a KV *tile* of :func:`kv_tile` keys, the block's keys first:

* Mosaic GPU: the block rounded up to a multiple of 32 (the FP8 wgmma K step; the P8 and Vᵀ
  tiles take the widest swizzle of 128, 64, 32 bytes that divides the tile, see
  ``pallas_kernels.mosaic_gpu``). Every preset's block is already a multiple of 32.
* Triton: the next power of two ≥ max(block, 32) (Triton tensors have power-of-two shapes), so
  224, 192 and 160 run on a 256-key tile and 96 on 128.

The tile's keys past the block (and keys past N, and causally hidden ones) get a score of −inf:
their P is exactly 0, P8 = 0, so they add nothing to ℓ, to P8·V or to the zero count, and the
block's running max sees only its own keys. A tile that reaches past the block reads the next
block's K/V, or zero padding after the last block (:func:`padded_keys`, added by
``pallas_kernels.api``), so every read is in bounds and every V it multiplies is finite.
"""

from __future__ import annotations

import jax.numpy as jnp

from pcast_jax import block
from pcast_jax.config import MMA_K, KernelConfig

__all__ = ["kv_tile", "n_blocks", "padded_keys", "needs_mask", "key_mask", "block_max", "chunk_step"]


def kv_tile(backend: str, block_kv: int) -> int:
    """Keys per MMA tile with which ``backend`` computes a semantic block of ``block_kv`` keys."""
    if backend == "mosaic":
        return -(-block_kv // MMA_K) * MMA_K
    return max(MMA_K, 1 << (block_kv - 1).bit_length())


def n_blocks(n_keys: int, block_kv: int) -> int:
    """Semantic KV blocks over N keys (the last one padded with masked keys, as the simulator does)."""
    return -(-n_keys // block_kv)


def padded_keys(n_keys: int, block_kv: int, tile: int) -> int:
    """Key length of K and Vᵀ that a kernel reads: every block's tile in bounds, rounded up to 16
    (a TMA tensor's row stride, here that of Vᵀ in FP8, is a multiple of 16 bytes)."""
    return -(-((n_blocks(n_keys, block_kv) - 1) * block_kv + tile) // 16) * 16


def needs_mask(n_keys: int, cfg: KernelConfig, tile: int) -> bool:
    """Whether some score of some tile must be masked (else the kernel skips the select)."""
    ragged = n_keys % cfg.block_kv or tile != cfg.block_kv
    return bool(cfg.causal or cfg.kv_splits > 1 or ragged)


def key_mask(cols, rows, blk, n_keys: int, q_start, cfg: KernelConfig):
    """Visible scores of the tile of semantic block ``blk``: ``cols < limit`` per row.

    ``cols``: int32 iota over the keys of the tile, ``(rows, tile)``; ``rows``: int32 iota over its
    query rows, ``(rows,)``, or None without causal (each backend's own: Mosaic GPU needs register
    layouts); ``q_start``:
    position of row 0 (bottom-right aligned causal). Key ``blk·B + c`` is visible if c < B, it is
    before N and (causal) not after the query: c < min(B, N − blk·B, q_start + row − blk·B + 1), one
    limit per row, so the tile needs no row iota of its own. An idle split step's ``blk`` =
    n_blocks masks the whole tile.
    """
    base = blk * cfg.block_kv
    limit = jnp.minimum(cfg.block_kv, n_keys - base)
    if cfg.causal:
        limit = block.expand_rows(jnp.minimum(limit, rows + (q_start - base + 1)), cols.shape)
    return cols < limit


def block_max(m, z_chunks, cfg: KernelConfig, sink=None):
    """Lines 4–5 of a block whose scores come as column chunks: ``(block max, m_new)``, the rowmax Z_j
    over all chunks (a learned sink folded in by a ``"block_max"`` kernel) and the running max
    :func:`pcast_jax.block.update_max` (which lags by up to τ with a lazy rescale)."""
    bm = None
    for z in z_chunks:
        zm = jnp.max(z, axis=-1)
        bm = zm if bm is None else jnp.maximum(bm, zm)
    bm = block.fold_sink(bm, sink, cfg)
    return bm, block.update_max(m, bm, cfg)


def chunk_step(m_new, z, zeros, cfg: KernelConfig, block_max=None) -> block.BlockStep:
    """Lines 6–8 for a column chunk of a block whose max and running max ``m_new`` (:func:`block_max`)
    are known.

    :func:`pcast_jax.block.block_step` from (m_new, ℓ = ``zeros``, per-row zeros in the backend's
    layout): m_new stays, α = 1 (0 in a row with nothing visible yet), so P and P·S are the block's own
    for these keys (taken against the whole block's max with ``p_offset="block_max"``) and
    ``row_sum`` is β·ΣP of the chunk; the caller adds the chunks and α·ℓ (``alpha`` of the returned
    step is not the block's).
    """
    return block.block_step(m_new, zeros, z, block_max, m_new, cfg)
