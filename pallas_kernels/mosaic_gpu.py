"""FP8 attention forward for Hopper on the Pallas Mosaic GPU backend.

Warp-specialized like FlashAttention-3: one or two compute warpgroups, each owning
``BLOCK_Q = 64`` query rows, and one memory warpgroup that streams K blocks and Vᵀ blocks with
TMA into a ring of ``num_slots`` shared-memory slots, in the kernel's KV order. Barriers say when
a slot is full (TMA done) and when it is free (every compute warpgroup has consumed it).

Per KV block (``config.block_kv`` keys, on a tile of :func:`pallas_kernels.tiling.kv_tile` keys:
block_kv rounded up to a multiple of 32, the extra keys masked) each compute warpgroup does
Algorithm 1 exactly as ``pcast_jax.engine``'s scan implementation does (every line of it from
:mod:`pcast_jax.block`):

* Z = (Q8 · K8ᵀ) · q_descale·k_descale·softmax_scale, an FP8 × FP8 → FP32 ``wgmma``;
* running max, α, P and the row sum ℓ in FP32 (exp, or exp2 with log2 S folded in);
* P8 = cast_E4M3(clamp(P·S, ±448)) written to shared memory, fenced with ``commit_smem``;
* P8 · V8 in a fresh FP32 accumulator (FP8 ``wgmma`` needs a K-major B operand, so V is stored
  transposed in HBM and the (d, tile) tile is passed transposed), then O = α·O + P8·V8; with an
  f16 accumulator one wgmma per ``f16_round_keys`` keys (slices of the P8 and Vᵀ tiles, whose
  swizzle is narrowed to the slice), each scaled per V channel and rounded to f16
  (:func:`pcast_jax.block.block_pv`);
* the number of P that were > 0 before the cast and 0 after it.

The epilogue writes O / (S·ℓ) (or O / ℓ) × the per-channel V factor, m, ℓ and the zero counts.
Split-KV (``kv_splits > 1``) adds the split to the query-tile grid axis: each CTA walks its split's
row of :func:`pcast_jax.block.split_schedule` (an idle step loads a block and masks it) and writes
its unnormalised O; ``pallas_kernels.api`` merges the splits.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling
from pcast_jax import block
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int

__all__ = ["BLOCK_Q", "SMEM_BYTES", "compute_warpgroups", "mosaic_attention", "smem_bytes"]

#: Query rows per compute warpgroup (the wgmma M dimension).
BLOCK_Q = 64
#: Shared memory one Hopper CTA may use (227 KiB).
SMEM_BYTES = 232448
_F8 = jnp.float8_e4m3fn


def check_limits(cfg: KernelConfig, *, q_len: int, head_dim: int, n_kv: int, num_slots: int) -> None:
    """What this backend runs: head dims 64 and 128, q_len a multiple of :data:`BLOCK_Q`, 2–8 TMA
    slots, and a ring of KV tiles that fits :data:`SMEM_BYTES` (the query-tile semantics it refuses, the
    tile-amax scale and skip-softmax, are declared on ``block_q``: :meth:`KernelConfig.refusal`). Raises
    PcastError naming the parameter."""
    if head_dim not in (64, 128):
        raise PcastError(f"head_dim={head_dim} not supported by the mosaic backend: must be 64 or 128")
    if q_len % BLOCK_Q:
        raise PcastError(f"q_len={q_len} not supported by the mosaic backend: must be a multiple of {BLOCK_Q}")
    check_int("num_slots", num_slots, min_value=2, max_value=8)
    tile = tiling.kv_tile("mosaic", cfg.block_kv)
    slots = min(num_slots, tiling.n_blocks(n_kv, cfg.block_kv))
    smem = smem_bytes(compute_warpgroups(q_len, head_dim, tile, slots), head_dim, tile, slots)
    if smem > SMEM_BYTES:
        raise PcastError(
            f"block_kv={cfg.block_kv} with head_dim={head_dim} and num_slots={num_slots} needs "
            f"{smem} bytes of shared memory > {SMEM_BYTES}: use a smaller block_kv or num_slots"
        )


def smem_bytes(compute_wgs: int, head_dim: int, tile: int, slots: int) -> int:
    """Shared memory of one CTA: ``compute_wgs`` warpgroups, KV tiles of ``tile`` keys, ``slots`` slots."""
    rows = compute_wgs * BLOCK_Q
    return (
        rows * head_dim  # Q tiles (fp8)
        + 2 * slots * tile * head_dim  # K and Vᵀ ring (fp8)
        + rows * tile  # P8 tiles
        + 4 * rows * head_dim  # output staging (f32)
        + 3 * 4 * rows  # m, ℓ and zero counts
        + compute_wgs * 2 * 4 * head_dim  # V channel factors (f32)
        + 4096  # barriers and alignment (measured overhead ≈ 2.2 KB)
    )


def compute_warpgroups(q_len: int, head_dim: int, tile: int, slots: int) -> int:
    """Two compute warpgroups (128 query rows per CTA) where q_len and shared memory allow, else one
    (e.g. FlashAttention-3's 224-key tile at d = 128 with two slots needs 232,960 B with two)."""
    two = q_len % (2 * BLOCK_Q) == 0 and smem_bytes(2, head_dim, tile, slots) <= SMEM_BYTES
    return 2 if two else 1


def _swizzle(minor_bytes: int) -> int:
    """The largest of 128, 64, 32 that divides ``minor_bytes``: a wgmma over a slice of the minor
    dimension (one f16 rounding group of keys) must start on a swizzle tile."""
    return next(sw for sw in (128, 64, 32) if minor_bytes % sw == 0)


def _smem_transforms(minor_bytes: int):
    """Tiling + swizzle for an FP8 tile whose minor dimension spans ``minor_bytes`` bytes."""
    swizzle = _swizzle(minor_bytes)
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def softmax_chunk(tile: int, group_keys: int, cfg: KernelConfig) -> int:
    """Keys per chunk in which the mask and lines 5–9 run over a KV tile (the block's max first).

    Up to 128 keys, and in the dynamic mode (its per-block scale needs the whole block's P), the
    whole tile. Wider tiles go chunk by chunk, one P8 swizzle tile each (32 keys for 224 and 160,
    64 for 192), so that no int32 key iota or mask spans the whole tile: masked over the whole
    tile, FA3's 224 keys at d = 128 spilled 216 B and FlashInfer's 192 204 B (XLA's ptxas, jax
    0.11.2, N = 512); chunked, neither spills (the FP32 P·S of one chunk is live at a time).
    """
    if tile <= 128 or cfg.scale_mode == "dynamic":
        return tile
    return _swizzle(group_keys)


def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def mosaic_attention(
    q,
    k,
    v_t,
    v_factors,
    schedule,
    params,
    *,
    config: KernelConfig,
    n_keys: int | None = None,
    num_slots: int = 2,
    interpret: bool | plgpu.InterpretGPUParams = False,
    sinks=None,
):
    """Run the kernel on FP8 inputs already validated by ``pallas_kernels.fp8_attention``.

    Args:
      q: (batch, heads, q_len, d) float8_e4m3fn.
      k: (batch, kv_heads, N, d) float8_e4m3fn.
      v_t: (batch, kv_heads, d, N') float8_e4m3fn — V transposed; N' =
        :func:`pallas_kernels.tiling.padded_keys` of N (K likewise), the keys past N zero.
      v_factors: (batch, kv_heads, 2, d) float32 per V channel: row 0 multiplies each FP8 product
        P8·V8 before the accumulator takes it, row 1 the output
        (:func:`pallas_kernels.api.v_channel_factors`).
      schedule: (kv_splits, steps) int32, the KV block each split visits at each step
        (:func:`pcast_jax.block.split_schedule`; read only with ``kv_splits > 1``).
      params: (4,) float32: [q_descale·k_descale·softmax_scale, 0, 0, 0].
      config: the P-cast semantics (multiply/exponent, order, block_kv, causal).
      n_keys: N, the keys that exist (default: all of K); the others are masked.
      num_slots: K/V shared-memory slots in the TMA ring (≥ 2).
      interpret: run under Mosaic GPU interpret mode (CPU); ``True`` or the interpreter's
        parameters (e.g. ``plgpu.InterpretGPUParams(detect_races=True)``).
      sinks: optional (heads,) float32 learned sink logits, placed as ``config.sink_mode`` says
        (:func:`pcast_jax.block.sink_start`, :func:`~pcast_jax.block.fold_sink`,
        :func:`~pcast_jax.block.add_sink`; split-KV: split 0 starts from it, the merge adds it).

    Returns:
      Per KV split, leading axis (kv_splits,): out (..., batch, heads, q_len, d) f32 — the output
      with one split, else the split's unnormalised O —, the running max m, ℓ and the count of
      zeroed P (float, integer-valued), each (..., batch, heads, q_len) f32.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads = v_t.shape[1]
    n_kv = v_t.shape[-1] if n_keys is None else n_keys
    block_kv = config.block_kv  # the semantic block: m and α update once per block_kv keys
    tile_kv = tiling.kv_tile("mosaic", block_kv)  # the MMA tile computing it (keys past block_kv masked)
    group = heads // kv_heads
    n_blocks = tiling.n_blocks(n_kv, block_kv)
    slots = max(1, min(num_slots, n_blocks))
    compute_wgs = compute_warpgroups(q_len, head_dim, tile_kv, slots)
    tile_q = compute_wgs * BLOCK_Q
    causal = config.causal
    splits = config.kv_splits
    masked = tiling.needs_mask(n_kv, config, tile_kv)
    f16_acc = config.accumulator == "f16"
    group_keys = config.f16_round_keys or tile_kv  # keys per P8·V wgmma (f16: per rounding)
    chunk = softmax_chunk(tile_kv, group_keys, config)
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # a (d,) vector over the accumulator's columns
    has_sink = sinks is not None
    sinks = jnp.zeros((heads,), jnp.float32) if sinks is None else sinks

    def per_column(vec):
        """(d,) per-channel factors over a (BLOCK_Q, d) accumulator tile."""
        return lax.broadcast_in_dim(vec, (BLOCK_Q, head_dim), (1,))

    def kv_steps_for(q_tile):
        """KV blocks this CTA visits: all of them, or (causal) those left of its last row; with
        split-KV every step of the split's schedule (the causal mask does the rest)."""
        if splits > 1:
            return schedule.shape[1]
        if not causal:
            return n_blocks
        return block.causal_kv_steps(n_kv - q_len + (q_tile + 1) * tile_q - 1, block_kv, n_blocks)

    def body(q_ref, k_ref, vt_ref, vf_ref, sched_ref, params_ref, sinks_ref, out_ref, m_ref, rowsum_ref, nzero_ref,
             scoped):
        (q_smem, k_smem, vt_smem, p_smem, o_smem, m_smem, l_smem, z_smem, vf_smem), barriers = scoped
        q_bar, k_bar, v_bar, k_free, v_free, vf_bar = barriers
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        tile = lax.axis_index("q_tile")  # query tile tile // splits, KV split tile % splits
        q_tile = lax.div(tile, jnp.array(splits, tile.dtype))
        split = lax.rem(tile, jnp.array(splits, tile.dtype))
        wg = lax.axis_index("wg")
        kv_h = lax.div(h, jnp.array(group, h.dtype))
        kv_steps = kv_steps_for(q_tile)

        def block_of(step):
            """The KV block visited at ``step``; an idle split step gives n_blocks (all masked)."""
            if splits > 1:
                return sched_ref[split, step]
            return block.kv_block(step, kv_steps, config)

        def cols_of(blk):
            """Keys of the block loaded for ``blk`` (an idle step loads the last block, masked)."""
            return pl.ds(jnp.minimum(blk, n_blocks - 1) * block_kv, tile_kv)

        @pl.when(wg < compute_wgs)
        def _compute():
            if compute_wgs == 2:
                plgpu.set_max_registers(232, action="increase")
            q0 = q_tile * tile_q + wg * BLOCK_Q
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q0, BLOCK_Q)], q_smem.at[wg], q_bar.at[wg])
            plgpu.copy_gmem_to_smem(vf_ref.at[b, kv_h], vf_smem.at[wg], vf_bar.at[wg])
            score_scale = params_ref[0]
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            sink = None
            if has_sink:  # the head's learned sink logit on every row
                sink = plgpu.layout_cast(jnp.full((BLOCK_Q,), sinks_ref[h], jnp.float32), row_layout)
            m0, ell0 = block.sink_start(sink, (BLOCK_Q,), config)
            if sink is not None and splits > 1:  # only split 0 starts from the sink
                m0, ell0 = jnp.where(split == 0, m0, -jnp.inf), jnp.where(split == 0, ell0, 0.0)
            m = plgpu.layout_cast(m0, row_layout)
            ell = plgpu.layout_cast(ell0, row_layout)
            nz = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout)
            o = plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(vf_bar.at[wg])

            def step(s, carry):
                m, ell, o, nz = carry
                slot = lax.rem(s, jnp.array(slots, s.dtype))
                blk = block_of(s)

                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                acc = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, tile_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                z = acc * score_scale  # line 3

                def visible(lo, zc):  # the chunk of keys [lo, lo + chunk) of the tile, masked
                    if not masked:
                        return zc
                    cols = plgpu.broadcasted_iota(jnp.int32, zc.shape, 1, layout=plgpu.Layout.WGMMA) + lo
                    rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=row_layout) if causal else None
                    return jnp.where(tiling.key_mask(cols, rows, blk, n_kv, n_kv - q_len + q0, config), zc, -jnp.inf)

                chunks = [(lo, visible(lo, z[:, lo:lo + chunk] if chunk < tile_kv else z))
                          for lo in range(0, tile_kv, chunk)]
                bm, m_new = tiling.block_max(m, [zc for _, zc in chunks], config, sink)  # lines 4-5, the whole block
                zeros = ell * 0.0  # ℓ is finite: zeros in its register layout
                ell_part = zeros
                for lo, zc in chunks:  # lines 5-9 per chunk under the block's max (tiling.chunk_step)
                    st = tiling.chunk_step(m_new, zc, zeros, config, bm)
                    p_smem.at[wg, :, pl.ds(lo, chunk)][...] = block.cast_p(st.ps, config)  # line 9
                    nz = nz + jnp.where(block.zeroed(st.ps, config), 1.0, 0.0).sum(axis=1)
                    ell_part = ell_part + st.row_sum
                plgpu.commit_smem()
                a = block.alpha(m, m_new, config)  # line 6
                st = st._replace(m=m_new, alpha=a, row_sum=a * ell + ell_part)  # line 8 (unscale: one chunk)

                plgpu.barrier_wait(v_bar.at[slot])

                def product(lo, hi):  # P8[:, lo:hi] · V[lo:hi], one FP8 wgmma (all B: the whole tile)
                    keys = pl.ds(lo, group_keys)

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem.at[wg, :, keys], vt_smem.at[slot, :, keys].transpose((1, 0)))
                        return acc_ref[...]

                    pv = pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))
                    if not f16_acc:
                        return pv
                    return pv * per_column(plgpu.load(vf_smem.at[wg, 0], layout=col_layout))

                pv_block = block.block_pv(product, config)
                plgpu.barrier_arrive(v_free.at[slot])
                o = block.accumulate(o, st.alpha, pv_block, st.unscale, config)  # line 10
                return st.m, st.row_sum, o, nz

            m, ell, o, nz = lax.fori_loop(0, kv_steps, step, (m, ell, o, nz))
            if splits == 1:  # line 12 (the sink's term added once); split-KV leaves it to the merge
                out_factor = per_column(plgpu.load(vf_smem.at[wg, 1], layout=col_layout))
                ell = block.add_sink(ell, m, sink, config)
                o = block.finalize(o, ell, config) * out_factor
            o_smem.at[wg][...] = o
            m_smem.at[wg][...] = m
            l_smem.at[wg][...] = ell
            z_smem.at[wg][...] = nz
            plgpu.commit_smem()
            rows = pl.ds(q0, BLOCK_Q)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[split, b, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[split, b, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(l_smem.at[wg], rowsum_ref.at[split, b, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(z_smem.at[wg], nzero_ref.at[split, b, h, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            if compute_wgs == 2:  # hand registers to the compute warpgroups (3 x 128 threads)
                plgpu.set_max_registers(40, action="decrease")

            def load(step, slot):
                cols = cols_of(block_of(step))
                plgpu.copy_gmem_to_smem(k_ref.at[b, kv_h, cols], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(
                    vt_ref.at[b, kv_h, :, cols], vt_smem.at[slot], v_bar.at[slot]
                )

            for i in range(slots):
                pl.when(i < kv_steps)(functools.partial(load, i, i))

            # Wait for every step to be consumed (also the last ones, so that each phase of the
            # "free" barriers is observed), refilling the slot while steps remain.
            @pl.loop(0, kv_steps)
            def _refill(s):
                slot = lax.rem(s, jnp.array(slots, s.dtype))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

                @pl.when(s + slots < kv_steps)
                def _():
                    load(s + slots, slot)

    def entry(q_ref, k_ref, vt_ref, vf_ref, sched_ref, params_ref, sinks_ref, out_ref, m_ref, rowsum_ref, nzero_ref):
        scratch = (
            plgpu.SMEM((compute_wgs, BLOCK_Q, head_dim), _F8, transforms=_smem_transforms(head_dim)),
            plgpu.SMEM((slots, tile_kv, head_dim), _F8, transforms=_smem_transforms(head_dim)),
            plgpu.SMEM((slots, head_dim, tile_kv), _F8, transforms=_smem_transforms(group_keys)),
            plgpu.SMEM((compute_wgs, BLOCK_Q, tile_kv), _F8, transforms=_smem_transforms(group_keys)),
            plgpu.SMEM((compute_wgs, BLOCK_Q, head_dim), jnp.float32),
            plgpu.SMEM((compute_wgs, BLOCK_Q), jnp.float32),
            plgpu.SMEM((compute_wgs, BLOCK_Q), jnp.float32),
            plgpu.SMEM((compute_wgs, BLOCK_Q), jnp.float32),
            plgpu.SMEM((compute_wgs, 2, head_dim), jnp.float32),
        )
        barriers = (
            plgpu.Barrier(num_barriers=compute_wgs),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=slots),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=slots),
            plgpu.Barrier(num_barriers=compute_wgs),
        )
        pl.run_scoped(
            lambda *scoped: body(
                q_ref, k_ref, vt_ref, vf_ref, sched_ref, params_ref, sinks_ref, out_ref, m_ref, rowsum_ref, nzero_ref,
                scoped,
            ),
            scratch,
            barriers,
            collective_axes="wg",
        )

    stats = jax.ShapeDtypeStruct((splits, batch, heads, q_len), jnp.float32)
    kernel = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((splits, batch, heads, q_len, head_dim), jnp.float32), stats, stats, stats),
        grid=(batch, heads, q_len // tile_q * splits),
        grid_names=("batch", "heads", "q_tile"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=_interpret_params(interpret),
        kernel_name=f"pcast_fp8_attention_{config.scale_mode}_{config.order}",
    )
    return kernel(q, k, v_t, v_factors, schedule, params, sinks)
