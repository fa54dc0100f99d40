"""The two implementations of Algorithm 1 that :mod:`pcast_jax.engine` runs, on the inputs it prepared.

* :func:`scan` — ``lax.scan`` over KV blocks in the kernel's order, Algorithm 1 line by line (the
  reference the Pallas kernels are checked against).
* :func:`xla` — the same numbers without the sequential loop (a cumulative max over block maxima, every
  block's P and its cast at once, one contraction with V); :func:`xla_weights` — its weights and
  statistics before the contraction.

Each takes the scores padded to a multiple of the block with masked keys, V, the counted keys, the config
the entry point bound once (:func:`pcast_jax.engine.bound`, taken as it is) and the learned sink per row,
and returns the fields of the engine's result as a tuple; the engine validates the inputs, names the
fields and refuses a non-finite output. Every line of kernel semantics they compute is
:mod:`pcast_jax.block`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import block, formats
from pcast_jax.config import BoundConfig, KernelConfig

__all__ = ["cast", "require_bound", "scan", "xla", "xla_weights"]


def require_bound(config, fn: str) -> BoundConfig:
    """``config`` if it is a :class:`~pcast_jax.config.BoundConfig`; else a TypeError naming the parameter and
    ``fn``: the engines take the config an entry point resolved and bound once, never a preset name or a
    config with its own numbers."""
    if not isinstance(config, BoundConfig):
        raise TypeError(f"config={config!r}: {fn} takes a BoundConfig, the config an entry point resolved and "
                        "bound once (engine.bound(pcast_jax.presets.resolve(config))), not "
                        f"{type(config).__name__}")
    return config


def cast(ps, cfg: KernelConfig):
    """Line 9 as the simulator sees it: the FP8 values widened to FP32.

    Returns ``(p8, scales)``: ``scales`` is None for an element format, else the per-block scales
    of a block-scaled format (:func:`block.cast_p`), multiplied back after P8·V. A saturating
    element cast is computed in float32 (:func:`formats.cast_arithmetic`, the same bits); any other goes
    through the FP8 type behind a barrier.
    """
    if cfg.block_format is not None:
        return jax.lax.optimization_barrier(block.cast_p(ps, cfg))
    if cfg.overflow == "satfinite" and cfg.fmt.name in formats.ARITHMETIC_CAST_FORMATS:
        return formats.cast_arithmetic(ps, cfg.fmt), None
    return jax.lax.optimization_barrier(block.cast_p(ps, cfg)).astype(jnp.float32), None


def _pv(p8, v):
    """Line 10's product P8 · V_j, exact FP32 products (the kernel's FP32 MMA accumulator)."""
    return jnp.einsum("...qb,...bd->...qd", p8, v, precision=jax.lax.Precision.HIGHEST)


def _blocks(x, block_kv: int, axis: int):
    """Split ``axis`` into (n_blocks, block_kv) and move n_blocks to the front."""
    axis = axis % x.ndim
    shape = x.shape[:axis] + (x.shape[axis] // block_kv, block_kv) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


def _f16_barrier(h):
    """Keeps XLA from folding the f32 → f16 → f32 round trip of an f16 accumulator."""
    return jax.lax.optimization_barrier(h)


def _split_order(x, cfg: KernelConfig, axis: int, fill):
    """Blocks (steps, splits, ...) in each split's visiting order (:func:`block.split_schedule`).

    One extra block filled with ``fill`` (masked) stands in for the idle steps of a short split.
    """
    xb = _blocks(x, cfg.block_kv, axis)  # (nb, ...)
    nb = xb.shape[0]
    xb = jnp.concatenate([xb, jnp.full((1,) + xb.shape[1:], fill, xb.dtype)], axis=0)
    return xb[block.split_schedule(nb, cfg).T]


def _channel_scale(v, cfg: KernelConfig):
    """V / c per channel for an f16 accumulator with ``v_channel_max`` (V and c=None otherwise)."""
    c = block.v_channel_scale(v, cfg)
    return (v, None) if c is None else (v / c[..., None, :], c)


def _visible(scores):
    """Keys that are not masked (:data:`pcast_jax.block.MASKED_BELOW`)."""
    return scores > block.MASKED_BELOW


def scan(scores, v, counted, cfg: BoundConfig, sink=None) -> tuple:
    """The scan implementation: Algorithm 1 block by block in the kernel's order (``lax.scan``), each split's
    blocks in its visiting order; line 12 per split, merged."""
    require_bound(cfg, "implementations.scan")
    v, c = _channel_scale(v, cfg)
    zb = _split_order(scores, cfg, -1, -jnp.inf)  # (steps, splits, ..., q, B)
    vb = _split_order(v, cfg, -2, 0.0)  # (steps, splits, ..., B, d)
    cb = _split_order(counted, cfg, -1, False)
    batch_q = (cfg.kv_splits,) + scores.shape[:-1]
    d = v.shape[-1]
    sink_s = None if sink is None else jnp.broadcast_to(sink, batch_q)
    if sink_s is not None and cfg.sink_mode == "init_max":  # split 0 alone starts at the sink
        sink_s = sink_s.at[1:].set(-jnp.inf)

    norm = None
    if cfg.p_offset == "row_lse":  # the first pass over the row: its max and sum (one split)
        m_row, norm = (x[None] for x in block.row_normalizer(scores, sink))

    def step(carry, xs):
        m, ell, o, nz, lz, ns, ls = carry
        z, vj, cj = xs
        st = block.online_softmax(m, ell, z, cfg, sink_s, norm=norm, barrier=_f16_barrier)  # lines 4-8
        p8, sc = cast(st.ps, cfg)  # line 9
        o = block.accumulate_pv(o, st.alpha, lambda lo, hi: _pv(p8[..., lo:hi], vj[..., lo:hi, :]), st.unscale,
                                cfg, barrier=_f16_barrier, scales=sc)  # line 10

        def mass(mask):  # ΣP of the keys in mask, weighted like the block's ΣP in ℓ
            x = jnp.sum(jnp.where(mask, st.p, 0.0), axis=-1)
            return x if st.weight is None else st.weight * x

        zero = cj & block.zeroed(st.ps, cfg)
        nz = nz + jnp.sum(zero, axis=-1, dtype=jnp.int32)
        lz = st.alpha * lz + mass(zero)
        sat = _visible(z) & block.saturated(st.ps, cfg)
        ns = ns + jnp.sum(sat, axis=-1, dtype=jnp.int32)
        ls = st.alpha * ls + mass(sat)
        return (st.m, st.row_sum, o, nz, lz, ns, ls), None

    m0, l0 = block.sink_start(sink, batch_q[1:], cfg)  # the sink as initial max lives in split 0 only
    if norm is not None:
        m0 = m_row[0]
    rest = (cfg.kv_splits - 1,) + batch_q[1:]
    init = (
        jnp.concatenate([m0[None], jnp.full(rest, -jnp.inf, jnp.float32)]),
        jnp.concatenate([l0[None], jnp.zeros(rest, jnp.float32)]),
        jnp.zeros(batch_q + (d,), jnp.float32),
        jnp.zeros(batch_q, jnp.int32),
        jnp.zeros(batch_q, jnp.float32),
        jnp.zeros(batch_q, jnp.int32),
        jnp.zeros(batch_q, jnp.float32),
    )
    (m, ell, o, nz, lz, ns, ls), _ = jax.lax.scan(step, init, (zb, vb, cb))
    if cfg.kv_splits == 1:
        ell = block.add_sink(ell[0], m[0], sink, cfg, norm=None if norm is None else norm[0])
        out = block.finalize(o[0], ell, cfg)  # line 12
        lz, ls = lz[0], ls[0]
    else:  # line 12 per split, merged
        out, ell, (lz, ls) = block.merge_splits(m, ell, o, cfg, extra=(lz, ls), sink=sink)
    if c is not None:
        out = out * c[..., None, :]
    return (out, ell, jnp.sum(nz, axis=0), jnp.sum(counted, axis=-1, dtype=jnp.int32), block.row_share(lz, ell),
            jnp.sum(ns, axis=0), jnp.sum(_visible(scores), axis=-1, dtype=jnp.int32), block.row_share(ls, ell))


def _running_max(block_max, cfg: KernelConfig, m0=None, *, reverse: bool = False):
    """The running max after each block (last axis, in the visiting order): line 5 for every block.

    Without a lazy rescale it is a cumulative max (from the right in reverse order), with ``m0`` the
    max before the first block (a learned sink as initial max); with one it is the recurrence of
    :func:`pcast_jax.block.update_max`, a scan over the (few) block maxima. Either way it never
    decreases, so the final running max is its maximum.
    """
    if not cfg.rescale_threshold:
        m_run = jax.lax.cummax(block_max, axis=block_max.ndim - 1, reverse=reverse)
        return m_run if m0 is None else jnp.maximum(m_run, m0[..., None])
    if m0 is None:
        m0 = jnp.full(block_max.shape[:-1], -jnp.inf, block_max.dtype)

    def step(m, bm):
        m = block.update_max(m, bm, cfg)
        return m, m

    _, m_run = jax.lax.scan(step, m0, jnp.moveaxis(block_max, -1, 0), reverse=reverse)
    return jnp.moveaxis(m_run, 0, -1)


def _skip_blocks(z, m_run, m0, cfg: KernelConfig, *, reverse: bool, row_axis: int):
    """``z`` (..., blocks, B) with the blocks skip-softmax skips masked (:func:`block.skip_rows`), from the
    running max before each block: the one after the block visited before it (``m0`` or −inf first).

    A skipped block's max lies below that running max, so it never moved the running max: ``m_run``
    (computed with every block) holds as it is.
    """
    if not cfg.skip_softmax_threshold:
        return z
    first = jnp.full(m_run.shape[:-1] + (1,), -jnp.inf, m_run.dtype) if m0 is None else m0[..., None]
    before = (jnp.concatenate([m_run[..., 1:], first], axis=-1) if reverse
              else jnp.concatenate([first, m_run[..., :-1]], axis=-1))
    return block.drop_skipped(z, block.skip_rows(jnp.max(z, axis=-1), before, cfg, row_axis=row_axis))


class _Stats(NamedTuple):
    """Per-row loss statistics decayed to the final running max (masses not yet divided by ℓ)."""

    n_zeroed: jax.Array
    zeroed: jax.Array
    n_saturated: jax.Array
    saturated: jax.Array


def _loss_stats(z, p, ps, counted, decay, cfg: KernelConfig, axes) -> _Stats:
    """Zeroed (over counted keys) and saturated (over visible keys) counts and decayed P sums."""
    zero = counted & block.zeroed(ps, cfg)
    sat = _visible(z) & block.saturated(ps, cfg)

    def mass(mask):
        return jnp.sum(decay * jnp.sum(jnp.where(mask, p, 0.0), axis=-1), axis=-1)

    return _Stats(jnp.sum(zero, axis=axes, dtype=jnp.int32), mass(zero),
                  jnp.sum(sat, axis=axes, dtype=jnp.int32), mass(sat))


def _fast_parts(scores, counted, cfg: KernelConfig, cast_fn=None, sink=None):
    """Everything of the xla implementation except the contraction with V (shared with the weights).

    Works in key order on a (..., q, n_blocks, B) view of the scores, so no data moves: the
    running max after each block in the kernel's order is a cumulative max of the block maxima
    (from the right in reverse order; :func:`_running_max`), and block b's contribution ends up
    multiplied by exp(m_b − m_final). Returns P8 (..., q, nb, B), the per-block factor w (..., q, nb)
    that multiplies it, ℓ (with a learned sink's term), the loss statistics (:class:`_Stats`) and
    the block scales of a block-scaled format (None otherwise, and with ``cast_fn``). ``cast_fn``
    replaces line 9's cast (default: the config's exact cast; a replacement returns the dequantized
    P); the zeroed count is that of the exact cast either way.
    """
    shape = scores.shape[:-1] + (scores.shape[-1] // cfg.block_kv, cfg.block_kv)
    z = scores.reshape(shape)
    sink_b = None if sink is None else sink[..., None]
    block_max = block.fold_sink(jnp.max(z, axis=-1), sink_b, cfg)  # (..., q, nb)
    m0 = sink if sink is not None and cfg.sink_mode == "init_max" else None
    norm = None
    if cfg.p_offset == "row_lse":  # the first pass over the row: the running max is the row's throughout
        m0, norm = block.row_normalizer(scores, sink)
        norm = norm[..., None]
    reverse = cfg.order == "reverse"
    m_run = _running_max(block_max, cfg, m0, reverse=reverse)
    z = _skip_blocks(z, m_run, m0, cfg, reverse=reverse, row_axis=-2)
    m_p = block.p_reference(block_max, m_run, cfg)
    p, ps, unscale = block.block_probs(z, m_p, cfg, norm=norm, barrier=_f16_barrier, row_axis=-2, sink=sink_b)
    p8, sc = cast(ps, cfg) if cast_fn is None else (cast_fn(ps), None)
    # α chain: block b's contribution is multiplied by exp(m_b − m_final) by the end (m_b the max its P
    # is taken against: the block's own with p_offset="block_max", β and the α chain in one factor)
    m_final = jnp.max(m_run, axis=-1)
    decay = block.alpha(m_p, m_final[..., None], cfg)  # (..., q, nb)
    ell = jnp.sum(decay * jnp.sum(p, axis=-1), axis=-1)
    if sink is not None:  # every mode: the sink's term at the final max (init_max: 1 decayed to it)
        w_sink = block.sink_weight(sink, m_final, cfg)
        ell = ell + (w_sink if norm is None else w_sink / norm[..., 0])  # row_lse: the sink's normalised share
    stats = _loss_stats(z, p, ps, counted.reshape(shape), decay, cfg, (-2, -1))
    w = decay if unscale is None else decay * unscale  # per block and row, multiplies P8
    return p8, w, ell, stats, sc


def _fast_split_parts(scores, counted, cfg: KernelConfig, cast_fn=None, sink=None):
    """:func:`_fast_parts` for split-KV: per split a running max in its visiting order.

    Returns P8 (..., q, splits, steps, B), the factor per block that multiplies it into its split's
    output (the α chain of its split and 2^-k), (m_s, ℓ_s) per split, the loss statistics per split
    (masses decayed to m_s), the schedule (:func:`block.split_schedule`) and the block scales.
    """
    b = cfg.block_kv
    nb = scores.shape[-1] // b
    sched = block.split_schedule(nb, cfg)  # (splits, steps)
    # a split with no block (more splits than blocks) keeps m_s = −inf and ℓ_s = 0, weight 0 in the merge:
    # left out, it adds no term (and no gathered copy of the scores, which cost 3× the rest per config)
    sched = sched[(sched < nb).any(axis=1)]

    def gather(x, fill):
        xb = x.reshape(x.shape[:-1] + (nb, b))
        xb = jnp.concatenate([xb, jnp.full(xb.shape[:-2] + (1, b), fill, xb.dtype)], axis=-2)
        return xb[..., sched, :]  # (..., q, splits, steps, B)

    z = gather(scores, -jnp.inf)
    sink_b = None if sink is None else sink[..., None, None]
    block_max = block.fold_sink(jnp.max(z, axis=-1), sink_b, cfg)  # (..., q, splits, steps)
    m0 = None
    if sink is not None and cfg.sink_mode == "init_max":  # split 0 alone starts at the sink
        m0 = jnp.full(block_max.shape[:-1], -jnp.inf, jnp.float32).at[..., 0].set(sink)
    m_run = _running_max(block_max, cfg, m0)
    z = _skip_blocks(z, m_run, m0, cfg, reverse=False, row_axis=-3)
    m_p = block.p_reference(block_max, m_run, cfg)  # row_lse takes one split: not here
    p, ps, unscale = block.block_probs(z, m_p, cfg, barrier=_f16_barrier, row_axis=-3,
                                       sink=sink_b if m0 is None else m0[..., None])
    p8, sc = cast(ps, cfg) if cast_fn is None else (cast_fn(ps), None)
    m_s = jnp.max(m_run, axis=-1)  # (..., q, splits)
    decay = block.alpha(m_p, m_s[..., None], cfg)  # (..., q, splits, steps)
    ell_s = jnp.sum(decay * jnp.sum(p, axis=-1), axis=-1)
    if m0 is not None:
        ell_s = ell_s.at[..., 0].add(block.sink_weight(sink, m_s[..., 0], cfg))
    stats = _loss_stats(z, p, ps, gather(counted, False), decay, cfg, (-3, -2, -1))
    w = decay if unscale is None else decay * unscale
    return p8, w, (m_s, ell_s), stats, sched, sc


def _merge_fast(m_s, ell_s, o_s, stats: _Stats, cfg, sink=None):
    """block.merge_splits on the xla implementation's (..., q, splits[, d]) layout; masses merged alike."""
    out, ell, (lz, ls) = block.merge_splits(
        jnp.moveaxis(m_s, -1, 0), jnp.moveaxis(ell_s, -1, 0), jnp.moveaxis(o_s, -2, 0), cfg,
        extra=(jnp.moveaxis(stats.zeroed, -1, 0), jnp.moveaxis(stats.saturated, -1, 0)), sink=sink)
    return out, ell, stats._replace(zeroed=block.row_share(lz, ell), saturated=block.row_share(ls, ell))


def _result(out, ell, stats: _Stats, scores, counted) -> tuple:
    """The fields of the engine's result from merged statistics (masses already shares of ℓ)."""
    return (out, ell, stats.n_zeroed, jnp.sum(counted, axis=-1, dtype=jnp.int32), stats.zeroed, stats.n_saturated,
            jnp.sum(_visible(scores), axis=-1, dtype=jnp.int32), stats.saturated)


def xla(scores, v, counted, cfg: BoundConfig, sink=None) -> tuple:
    """The xla implementation: every block's P and its cast at once against the running max after each block
    (:func:`_fast_parts`), then one product with V (per block where the accumulator rounds or scales)."""
    require_bound(cfg, "implementations.xla")
    v, c = _channel_scale(v, cfg)
    if cfg.kv_splits > 1:
        out, ell, stats = _fast_split_engine(scores, v, counted, cfg, sink)
    else:
        p8, w, ell, stats, sc = _fast_parts(scores, counted, cfg, sink=sink)
        if cfg.accumulator == "f32" and sc is None and not cfg.mma_acc_bits:  # one (q, N) x (N, d) product
            weighted = (p8 * w[..., None]).reshape(scores.shape)
            o = jnp.einsum("...qn,...nd->...qd", weighted, v, precision=jax.lax.Precision.HIGHEST)
        else:  # per block: rounded to f16, block scales multiplied back, or the promoted MMA model, then FP32
            vb = v.reshape(v.shape[:-2] + p8.shape[-2:] + v.shape[-1:])  # (..., nb, B, d)
            y = block.block_pv(lambda lo, hi: jnp.einsum(
                "...qnb,...nbd->...qnd", p8[..., lo:hi], vb[..., lo:hi, :], precision=jax.lax.Precision.HIGHEST),
                cfg, barrier=_f16_barrier, scales=sc)
            o = jnp.sum(w[..., None] * y, axis=-2)
        out = block.finalize(o, ell, cfg)
        stats = stats._replace(zeroed=block.row_share(stats.zeroed, ell),
                               saturated=block.row_share(stats.saturated, ell))
    if c is not None:
        out = out * c[..., None, :]
    return _result(out, ell, stats, scores, counted)


def _fast_split_engine(scores, v, counted, cfg: KernelConfig, sink=None):
    p8, w, (m_s, ell_s), stats, sched, sc = _fast_split_parts(scores, counted, cfg, sink=sink)
    b = cfg.block_kv
    vb = v.reshape(v.shape[:-2] + (-1, b) + v.shape[-1:])  # (..., nb, B, d)
    vb = jnp.concatenate([vb, jnp.zeros(vb.shape[:-3] + (1,) + vb.shape[-2:], vb.dtype)], axis=-3)
    vb = vb[..., sched, :, :]  # (..., splits, steps, B, d)
    y = block.block_pv(lambda lo, hi: jnp.einsum(
        "...qstb,...stbd->...qstd", p8[..., lo:hi], vb[..., lo:hi, :], precision=jax.lax.Precision.HIGHEST),
        cfg, barrier=_f16_barrier, scales=sc)
    o_s = jnp.sum(w[..., None] * y, axis=-2)  # (..., q, splits, d)
    return _merge_fast(m_s, ell_s, o_s, stats, cfg, sink)


def xla_weights(scores, counted, cfg: BoundConfig, n: int, cast_fn=None, sink=None) -> tuple:
    """The xla implementation's effective weights W (..., q_len, ``n``: padding dropped), output = W · V for an
    FP32 accumulator, and its per-row statistics: the fields of :class:`~pcast_jax.engine.WeightsResult`.
    ``cast_fn`` replaces line 9's cast (:func:`_fast_parts`)."""
    require_bound(cfg, "implementations.xla_weights")
    if cfg.kv_splits > 1:
        p8, w, (m_s, ell_s), stats, sched, sc = _fast_split_parts(scores, counted, cfg, cast_fn, sink)
        p8 = block.dequantize(p8, sc, cfg)
        # the merge is linear in each split's O_s: merging per-key one-hot "outputs" gives the weights
        eye = jnp.eye(m_s.shape[-1], dtype=jnp.float32)
        f, ell, stats = _merge_fast(m_s, ell_s, jnp.broadcast_to(eye, m_s.shape + eye.shape[-1:]), stats, cfg, sink)
        wk = p8 * (w * f[..., :, None])[..., None]  # (..., q, splits, steps, B)
        nb = scores.shape[-1] // cfg.block_kv
        pos = np.zeros(nb, np.int32)  # where block b sits in the flattened (splits, steps) schedule
        flat = sched.reshape(-1)
        pos[flat[flat < nb]] = np.nonzero(flat < nb)[0]
        wk = wk.reshape(wk.shape[:-3] + (-1, cfg.block_kv))[..., pos, :]
    else:
        p8, w, ell, stats, sc = _fast_parts(scores, counted, cfg, cast_fn, sink)
        p8 = block.dequantize(p8, sc, cfg)
        # times 1/(S ℓ), not divided by it: XLA rewrites x / broadcast(d) into x · broadcast(1/d) in
        # some programs and not in others (a sharded one), which differ in the last bit; written as
        # the multiply it is one program everywhere, with the bits of the rewritten one
        wk = p8 * w[..., None] * (1.0 / block.epilogue_divisor(ell, cfg))[..., None, None]  # (..., q, nb, B)
        stats = stats._replace(zeroed=block.row_share(stats.zeroed, ell),
                               saturated=block.row_share(stats.saturated, ell))
    weights = wk.reshape(wk.shape[:-2] + (-1,))[..., :n]
    return (weights, *_result(None, ell, stats, scores, counted)[1:])
