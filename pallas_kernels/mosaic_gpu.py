"""FP8 attention forward for Hopper on the Pallas Mosaic GPU backend.

Warp-specialized like FlashAttention-3: one or two compute warpgroups, each owning
``BLOCK_Q = 64`` query rows, and one memory warpgroup that streams K blocks and Vᵀ blocks with
TMA into a ring of ``num_slots`` shared-memory slots, in the kernel's KV order. Barriers say when
a slot is full (TMA done) and when it is free (every compute warpgroup has consumed it).

Per KV block each compute warpgroup does Algorithm 1 exactly as ``pcast_jax.engine``'s scan
engine does (every line of it from :mod:`pcast_jax.block`):

* Z = (Q8 · K8ᵀ) · q_descale·k_descale·softmax_scale, an FP8 × FP8 → FP32 ``wgmma``;
* running max, α, P and the row sum ℓ in FP32 (exp, or exp2 with log2 S folded in);
* P8 = cast_E4M3(clamp(P·S, ±448)) written to shared memory, fenced with ``commit_smem``;
* P8 · V8 in a fresh FP32 accumulator (FP8 ``wgmma`` needs a K-major B operand, so V is stored
  transposed in HBM and the (d, block_kv) tile is passed transposed), then O = α·O + P8·V8;
* the number of P that were > 0 before the cast and 0 after it.

The epilogue writes O / (S·ℓ) (or O / ℓ) × v_descale, ℓ and the zero counts.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pcast_jax import block
from pcast_jax.config import KernelConfig

__all__ = ["BLOCK_Q", "mosaic_attention"]

#: Query rows per compute warpgroup (the wgmma M dimension).
BLOCK_Q = 64
_F8 = jnp.float8_e4m3fn


def _smem_transforms(minor_bytes: int):
    """Tiling + swizzle for an FP8 tile whose minor dimension spans ``minor_bytes`` bytes."""
    swizzle = 128 if minor_bytes % 128 == 0 else 64
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def mosaic_attention(
    q,
    k,
    v_t,
    params,
    *,
    config: KernelConfig,
    num_slots: int = 2,
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """Run the kernel on FP8 inputs already validated by ``pallas_kernels.fp8_attention``.

    Args:
      q: (batch, heads, q_len, d) float8_e4m3fn.
      k: (batch, kv_heads, N, d) float8_e4m3fn.
      v_t: (batch, kv_heads, d, N) float8_e4m3fn — V transposed.
      params: (4,) float32: [q_descale·k_descale·softmax_scale, v_descale, 0, 0].
      config: the P-cast semantics (multiply/exponent, order, block_kv, causal).
      num_slots: K/V shared-memory slots in the TMA ring (≥ 2).
      interpret: run under Mosaic GPU interpret mode (CPU); ``True`` or the interpreter's
        parameters (e.g. ``plgpu.InterpretGPUParams(detect_races=True)``).

    Returns:
      (out (batch, heads, q_len, d) f32, row_sum (batch, heads, q_len) f32,
      n_zeroed (batch, heads, q_len) f32 — integer-valued).
    """
    batch, heads, q_len, head_dim = q.shape
    _, kv_heads, _, n_kv = v_t.shape
    block_kv = config.block_kv
    group = heads // kv_heads
    compute_wgs = 2 if q_len % (2 * BLOCK_Q) == 0 else 1
    tile_q = compute_wgs * BLOCK_Q
    n_blocks = n_kv // block_kv
    slots = max(1, min(num_slots, n_blocks))
    causal = config.causal

    def kv_steps_for(q_tile):
        """KV blocks this CTA visits: all of them, or (causal) those left of its last row."""
        if not causal:
            return n_blocks
        return block.causal_kv_steps(n_kv - q_len + (q_tile + 1) * tile_q - 1, block_kv, n_blocks)

    def block_of(step, kv_steps):
        return block.kv_block(step, kv_steps, config)

    def body(q_ref, k_ref, vt_ref, params_ref, out_ref, rowsum_ref, nzero_ref, scoped):
        (q_smem, k_smem, vt_smem, p_smem, o_smem, l_smem, z_smem), barriers = scoped
        q_bar, k_bar, v_bar, k_free, v_free = barriers
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        q_tile = lax.axis_index("q_tile")
        wg = lax.axis_index("wg")
        kv_h = lax.div(h, jnp.array(group, h.dtype))
        kv_steps = kv_steps_for(q_tile)

        @pl.when(wg < compute_wgs)
        def _compute():
            if compute_wgs == 2:
                plgpu.set_max_registers(232, action="increase")
            q0 = q_tile * tile_q + wg * BLOCK_Q
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q0, BLOCK_Q)], q_smem.at[wg], q_bar.at[wg])
            score_scale = params_ref[0]
            v_descale = params_ref[1]
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
            ell = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout)
            nz = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout)
            o = plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(q_bar.at[wg])

            def step(s, carry):
                m, ell, o, nz = carry
                slot = lax.rem(s, jnp.array(slots, s.dtype))
                blk = block_of(s, kv_steps)

                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                acc = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                z = acc * score_scale  # line 3
                if causal:
                    rows = plgpu.broadcasted_iota(
                        jnp.int32, (BLOCK_Q, block_kv), 0, layout=plgpu.Layout.WGMMA
                    )
                    cols = plgpu.broadcasted_iota(
                        jnp.int32, (BLOCK_Q, block_kv), 1, layout=plgpu.Layout.WGMMA
                    )
                    visible = block.visible(rows + (n_kv - q_len + q0), cols + blk * block_kv)
                    z = jnp.where(visible, z, -jnp.inf)
                st = block.online_softmax(m, ell, z, config)  # lines 4-8
                p_smem.at[wg][...] = block.cast_p(st.ps, config)  # line 9
                plgpu.commit_smem()
                nz = nz + jnp.where(block.zeroed(st.ps, config), 1.0, 0.0).sum(axis=1)

                plgpu.barrier_wait(v_bar.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[wg], vt_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                pv_block = pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                o = block.accumulate(o, st.alpha, pv_block, st.unscale, config)  # line 10
                return st.m, st.row_sum, o, nz

            m, ell, o, nz = lax.fori_loop(0, kv_steps, step, (m, ell, o, nz))
            o_smem.at[wg][...] = block.finalize(o, ell, config) * v_descale  # line 12
            l_smem.at[wg][...] = ell
            z_smem.at[wg][...] = nz
            plgpu.commit_smem()
            rows = pl.ds(q0, BLOCK_Q)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[b, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(l_smem.at[wg], rowsum_ref.at[b, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(z_smem.at[wg], nzero_ref.at[b, h, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            if compute_wgs == 2:  # hand registers to the compute warpgroups (3 x 128 threads)
                plgpu.set_max_registers(40, action="decrease")

            def load(step, slot):
                cols = pl.ds(block_of(step, kv_steps) * block_kv, block_kv)
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

    def entry(q_ref, k_ref, vt_ref, params_ref, out_ref, rowsum_ref, nzero_ref):
        scratch = (
            plgpu.SMEM((compute_wgs, BLOCK_Q, head_dim), _F8, transforms=_smem_transforms(head_dim)),
            plgpu.SMEM((slots, block_kv, head_dim), _F8, transforms=_smem_transforms(head_dim)),
            plgpu.SMEM((slots, head_dim, block_kv), _F8, transforms=_smem_transforms(block_kv)),
            plgpu.SMEM((compute_wgs, BLOCK_Q, block_kv), _F8, transforms=_smem_transforms(block_kv)),
            plgpu.SMEM((compute_wgs, BLOCK_Q, head_dim), jnp.float32),
            plgpu.SMEM((compute_wgs, BLOCK_Q), jnp.float32),
            plgpu.SMEM((compute_wgs, BLOCK_Q), jnp.float32),
        )
        barriers = (
            plgpu.Barrier(num_barriers=compute_wgs),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=slots),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=slots),
        )
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, vt_ref, params_ref, out_ref, rowsum_ref, nzero_ref, scoped),
            scratch,
            barriers,
            collective_axes="wg",
        )

    stats = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    kernel = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((batch, heads, q_len, head_dim), jnp.float32), stats, stats),
        grid=(batch, heads, q_len // tile_q),
        grid_names=("batch", "heads", "q_tile"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=_interpret_params(interpret),
        kernel_name=f"pcast_fp8_attention_{config.scale_mode}_{config.order}",
    )
    return kernel(q, k, v_t, params)
