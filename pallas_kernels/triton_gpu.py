"""FP8 attention forward on the Pallas Triton backend (the simpler, portable path).

One program per (batch, head, query block, KV split); it walks its KV blocks in the kernel's order
(one split: all of them; split-KV: its row of :func:`pcast_jax.block.split_schedule`) with a
``fori_loop`` and does Algorithm 1 per block exactly as ``pcast_jax.engine``'s scan implementation does
(every line of it from :mod:`pcast_jax.block`). A block of ``config.block_kv`` keys is computed on a
power-of-two tile (:func:`pallas_kernels.tiling.kv_tile`: 224, 192 and 160 on 256 keys), the extra
keys masked. With an f16 accumulator P8·V is one FP8 dot per
``f16_round_keys`` keys (``jnp.split`` of the P8 tile), scaled per V channel and rounded to f16
(:func:`pcast_jax.block.block_pv`). Both matmuls are FP8 × FP8 → FP32 ``tt.dot``s
with ``maxNumImpreciseAcc = 2^30``, so Triton emits FP8 wgmma on Hopper (below); V arrives
transposed, like the Mosaic GPU kernel, so the P·V operand is K-major. Triton schedules its own
pipelining (``num_stages``).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as pltriton
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling
from pcast_jax import block
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError

__all__ = ["triton_attention", "triton_block_q"]

_F8 = jnp.float8_e4m3fn


def _dot_nt(a, b):
    """a · bᵀ for FP8 a (m, k) and b (n, k), accumulated in FP32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------------
# FP8 wgmma on Hopper. Pallas lowers lax.dot_general to `tt.dot {maxNumImpreciseAcc = 0}`, and
# Triton's AccelerateMatmul then refuses MMAv3 for an f8 x f8 -> f32 dot: both products would run
# as mma.sync on E4M3 operands unpacked to F16 (see pallas_kernels/machine_code/ and tests/test_machine_code.py).
# `tl.dot` sets maxNumImpreciseAcc = 2^30 on sm_90 (accumulate in the wgmma accumulator, as the
# Mosaic GPU kernel and FlashAttention-3 do); this primitive lowers to the same tt.dot with that
# attribute. It needs Pallas Triton's lowering-rule table, a private module of jax (pinned in
# pyproject.toml); without it the kernel falls back to the plain dot (correct, but mma.sync).
# --------------------------------------------------------------------------------------------

#: maxNumImpreciseAcc of both tt.dots: what tl.dot sets for FP8 on sm_90.
MAX_NUM_IMPRECISE_ACC = 2**30

try:  # pragma: no branch
    from jax._src.lib.mlir import ir as _ir
    from jax._src.pallas.triton import lowering as _triton_lowering
    from jax.extend import core as _jax_core
    from jax.interpreters import mlir as _mlir
except ImportError:  # pragma: no cover - another jax layout
    _triton_lowering = None

if _triton_lowering is not None:
    _fp8_dot_nt_p = _jax_core.Primitive("pcast_fp8_dot_nt")
    _fp8_dot_nt_p.def_impl(_dot_nt)
    _fp8_dot_nt_p.def_abstract_eval(
        lambda a, b: jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32))
    _mlir.register_lowering(_fp8_dot_nt_p, _mlir.lower_fun(_dot_nt, multiple_results=False))

    @_triton_lowering.register_lowering(_fp8_dot_nt_p)
    def _fp8_dot_nt_lowering(ctx, a, b):
        out = _triton_lowering.triton_lowering_rules[lax.dot_general_p](
            ctx, a, b, dimension_numbers=(((1,), (1,)), ((), ())), precision=None,
            preferred_element_type=jnp.float32, out_sharding=None)
        dot = out.owner  # an FP32 result: the tt.dot itself, no cast after it
        if dot.name != "tt.dot":  # pragma: no cover - a different lowering of dot_general
            raise NotImplementedError(f"expected the FP8 product to lower to tt.dot, got {dot.name}")
        dot.attributes["maxNumImpreciseAcc"] = _ir.IntegerAttr.get(
            _ir.IntegerType.get_signless(32), MAX_NUM_IMPRECISE_ACC)
        return out

    def _dot_nt_wgmma(a, b):
        """:func:`_dot_nt` lowered with ``maxNumImpreciseAcc = 2^30`` (FP8 wgmma on Hopper)."""
        return _fp8_dot_nt_p.bind(a, b)
else:  # pragma: no cover
    _dot_nt_wgmma = _dot_nt


#: Most score elements per program (128 query rows × 128 keys): a 256-key tile halves the query
#: rows, else FA3's exponent mode at d = 128 (224 keys on a 256-key tile) spills 16 B at 8 warps
#: (``pcast kernels --sass``: 255 registers; 64 rows: no spills).
MAX_TILE_ELEMENTS = 128 * 128


def check_limits(cfg: KernelConfig, *, q_len: int, head_dim: int, n_kv: int, num_slots: int) -> None:
    """What this backend runs: head dims 32–256 (powers of two), q_len a multiple of 16, f16
    rounding groups of a power of two of keys, and query tiles (``block_q``: the tile-amax scale,
    skip-softmax) of 16, 32, 64 or 128 rows that divide q_len, one program each. Raises PcastError
    naming the parameter."""
    del n_kv, num_slots  # the Triton kernel pipelines by itself: no ring of KV tiles to size
    if head_dim not in (32, 64, 128, 256):
        raise PcastError(f"head_dim={head_dim} not supported by the triton backend: must be 32, 64, 128 or 256")
    if q_len % 16:
        raise PcastError(f"q_len={q_len} not supported by the triton backend: must be a multiple of 16")
    if cfg.block_q:
        tile = tiling.kv_tile("triton", cfg.block_kv)
        if cfg.block_q not in (16, 32, 64, 128) or cfg.block_q * tile > MAX_TILE_ELEMENTS:
            raise PcastError(f"block_q={cfg.block_q} not supported by the triton backend: one program holds the "
                             f"query tile, 16, 32, 64 or 128 rows with at most {MAX_TILE_ELEMENTS} scores on "
                             f"its {tile}-key KV tile")
        if q_len % cfg.block_q:
            raise PcastError(f"block_q={cfg.block_q} with q_len={q_len} not supported by the triton backend: the "
                             "last query tile would be partial (its zero-Q padding rows, which set its tile "
                             "amax and votes, are not run); q_len must be a multiple of block_q")
    keys = cfg.f16_round_keys
    if keys & (keys - 1):
        raise PcastError(f"f16_round_keys={keys} not supported by the triton backend: one P8·V dot per "
                         "rounding group must span a power of two of keys (32, 64, 128, ...)")


def triton_block_q(q_len: int, tile_kv: int = 128) -> int:
    """Query rows per program: the largest of 128, 64, 32, 16 that divides q_len, with at most
    :data:`MAX_TILE_ELEMENTS` scores per (rows × ``tile_kv`` keys) tile."""
    for block_q in (128, 64, 32, 16):
        if q_len % block_q == 0 and (block_q * tile_kv <= MAX_TILE_ELEMENTS or block_q == 16):
            return block_q
    raise ValueError(f"q_len={q_len} must be a multiple of 16")


def triton_attention(
    q,
    k,
    v_t,
    v_factors,
    schedule,
    params,
    *,
    config: KernelConfig,
    n_keys: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    sinks=None,
):
    """Run the kernel on FP8 inputs already validated by ``pallas_kernels.fp8_attention``.

    Arguments and results as :func:`pallas_kernels.mosaic_gpu.mosaic_attention` (``sinks``: optional
    ``(heads,)`` learned sink logits, placed by :mod:`pcast_jax.block`'s sink lines); ``num_warps``
    defaults to 8 for 128-row query blocks or d > 64 (the FP32 tiles need the registers), else 4.
    """
    batch, heads, q_len, head_dim = q.shape
    _, kv_heads, _, n_alloc = v_t.shape
    n_kv = n_alloc if n_keys is None else n_keys
    block_kv = config.block_kv  # the semantic block: m and α update once per block_kv keys
    tile = tiling.kv_tile("triton", block_kv)  # the power-of-two tile computing it (keys past block_kv masked)
    block_q = config.block_q or triton_block_q(q_len, tile)  # a query tile is one program
    group = heads // kv_heads
    n_blocks = tiling.n_blocks(n_kv, block_kv)
    masked = tiling.needs_mask(n_kv, config, tile)
    if num_warps is None:
        num_warps = 8 if block_q >= 128 or head_dim > 64 else 4
    causal = config.causal
    dot_nt = _dot_nt if interpret else _dot_nt_wgmma

    f16_acc = config.accumulator == "f16"
    group_keys = config.f16_round_keys or tile  # keys per P8·V product (f16: per rounding)
    splits = config.kv_splits

    has_sink = sinks is not None
    sinks = jnp.zeros((heads,), jnp.float32) if sinks is None else sinks

    def kernel(q_ref, k_ref, vt_ref, vf_ref, sched_ref, params_ref, sinks_ref, out_ref, m_ref, rowsum_ref,
               nzero_ref):
        q0 = lax.div(pl.program_id(2), splits) * block_q
        # the head's learned sink logit for every row of this program (None without one)
        sink = jnp.full((block_q,), sinks_ref[pl.program_id(1)], jnp.float32) if has_sink else None
        q_start = n_kv - q_len + q0  # position of this program's first query row
        if splits > 1:  # this split's blocks in its order; an idle step holds n_blocks (all masked)
            kv_steps = schedule.shape[1]
        elif causal:
            kv_steps = block.causal_kv_steps(q_start + block_q - 1, block_kv, n_blocks)
        else:
            kv_steps = n_blocks
        score_scale = params_ref[0]
        pv_factor = vf_ref[0, :][None, :]  # per V channel, see pallas_kernels.api.v_channel_factors
        out_factor = vf_ref[1, :][None, :]
        q8 = q_ref[...]

        def step(s, carry):
            m, ell, o, nz = carry
            blk = sched_ref[s] if splits > 1 else block.kv_block(s, kv_steps, config)
            blk_in = jnp.minimum(blk, n_blocks - 1)  # the block loaded (an idle step's is masked)
            start = blk_in * block_kv
            z = dot_nt(q8, k_ref[pl.ds(start, tile), :]) * score_scale  # line 3
            if masked:
                cols = lax.broadcasted_iota(jnp.int32, (block_q, tile), 1)
                rows = lax.broadcasted_iota(jnp.int32, (block_q,), 0) if causal else None
                z = jnp.where(tiling.key_mask(cols, rows, blk, n_kv, q_start, config), z, -jnp.inf)
            st = block.online_softmax(m, ell, z, config, sink)  # lines 4-8
            p8 = block.cast_p(st.ps, config)  # line 9
            nz = nz + jnp.sum(jnp.where(block.zeroed(st.ps, config), 1.0, 0.0), axis=1)
            p8_groups = jnp.split(p8, tile // group_keys, axis=1) if group_keys < tile else [p8]

            def product(lo, hi):  # P8[:, lo:hi] · V[lo:hi], one FP8 MMA (all B: the whole tile)
                pv = dot_nt(p8_groups[lo // group_keys], vt_ref[:, pl.ds(start + lo, group_keys)])
                return pv * pv_factor if f16_acc else pv

            o = block.accumulate(o, st.alpha, block.block_pv(product, config), st.unscale, config)  # line 10
            return st.m, st.row_sum, o, nz

        m0, ell0 = block.sink_start(sink, (block_q,), config)  # (s_L, 1 or S) for an initial-max kernel
        if splits > 1 and sink is not None:  # only split 0 starts from the sink
            first = lax.rem(pl.program_id(2), splits) == 0
            m0, ell0 = jnp.where(first, m0, -jnp.inf), jnp.where(first, ell0, 0.0)
        init = (m0, ell0, jnp.zeros((block_q, head_dim), jnp.float32), jnp.zeros((block_q,), jnp.float32))
        m, ell, o, nz = lax.fori_loop(0, kv_steps, step, init)
        # line 12 here with one split (the sink's term added once); split-KV leaves it to the merge
        if splits == 1:
            ell = block.add_sink(ell, m, sink, config)
        out_ref[...] = block.finalize(o, ell, config) * out_factor if splits == 1 else o
        m_ref[...] = m
        rowsum_ref[...] = ell
        nzero_ref[...] = nz

    # program i of the last grid axis: query block i // splits, KV split i % splits
    row_spec = pl.BlockSpec((None, None, None, block_q), lambda b, h, i: (i % splits, b, h, i // splits))
    stats = jax.ShapeDtypeStruct((splits, batch, heads, q_len), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, q_len // block_q * splits),
        in_specs=[
            pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i // splits, 0)),
            pl.BlockSpec((None, None, n_alloc, head_dim), lambda b, h, i: (b, h // group, 0, 0)),
            pl.BlockSpec((None, None, head_dim, n_alloc), lambda b, h, i: (b, h // group, 0, 0)),
            pl.BlockSpec((None, None, 2, head_dim), lambda b, h, i: (b, h // group, 0, 0)),
            pl.BlockSpec((None, schedule.shape[1]), lambda b, h, i: (i % splits, 0)),
            pl.BlockSpec((4,), lambda b, h, i: (0,)),
            pl.BlockSpec((heads,), lambda b, h, i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_q, head_dim), lambda b, h, i: (i % splits, b, h, i // splits, 0)),
            row_spec,
            row_spec,
            row_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, batch, heads, q_len, head_dim), jnp.float32), stats, stats, stats],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"pcast_fp8_attention_triton_{config.scale_mode}_{config.order}",
    )(q, k, v_t, v_factors, schedule, params, sinks)
