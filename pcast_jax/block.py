"""The per-block lines of Algorithm 1, written once for every engine and kernel.

One module, over 600 lines: each line of Algorithm 1 exists once, here, so that the engines and both
kernels run the same lines; splitting it would put the lines of one algorithm in several places.

Algorithm 1 of the paper, per query row and KV block j in the kernel's order::

    m_new = max(m, rowmax(Z_j));  α = exp(m − m_new)                         # lines 4–6
    P     = exp(Z_j − m_new);     ℓ = α ℓ + rowsum(P)                        # lines 7–8 (FP32)
    P8    = cast(P · S);          O = α O + P8 · V_j                         # lines 9–10
    return O / (S ℓ)                                                          # line 12

Each function below is one of those lines (its number in the docstring), with the config's scale
mode, format, overflow and accumulator, and what P is taken against (``p_offset``: the running max, the
block's own max with the block's ΣP and P8·V weighted by β = exp(m_block − m_new) after the product, or
the row's log-sum-exp) in the precision it is held in (``softmax``). The scan implementation, the xla
implementation and both Pallas kernels (Mosaic GPU and Triton) call these functions, so the arithmetic
exists in one place.

Conventions, so that the same code traces in XLA and lowers in both Pallas backends:

* Rank-generic: a block of scores is ``(..., B)`` and per-row values are ``(...)`` (the leading
  axes of the block). Per-row values meet a block through :func:`expand_rows`
  (``lax.broadcast_in_dim``, which Mosaic GPU's register layouts accept where ``x[..., None]`` is
  not); reductions run over the last axis.
* Only ``jnp`` ops that both Pallas backends lower: no ``isfinite``, ``floor`` or ``clip``
  (``== -inf``, int truncation of a positive value and ``minimum``/``maximum`` instead), and no
  optimization barrier (callers outside a kernel add it, see :func:`pcast_jax.formats.cast`).
* The P8 that line 10 multiplies is returned in the FP8 dtype itself; a simulator widens it.
* A config's numbers (S·2^-τ, log2 of it, τ in logits, the V channel max, ln λ) are read from
  ``cfg.numbers()`` alone, never from its fields: a :class:`~pcast_jax.config.BoundConfig` returns
  the bound (possibly traced) ones, so configs that differ only in numbers share one program.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax import formats
from pcast_jax.config import COMPUTED_SCALE_MODES, MMA_K, TILE_AMAX_FLOOR, KernelConfig
from pcast_jax.errors import PcastError

__all__ = [
    "LOG2E",
    "MASKED_BELOW",
    "BlockStep",
    "expand_rows",
    "safe_max",
    "update_max",
    "fold_sink",
    "sink_weight",
    "sink_start",
    "add_sink",
    "alpha",
    "tile_rows",
    "padding_max",
    "skip_rows",
    "drop_skipped",
    "p_reference",
    "block_weight",
    "row_normalizer",
    "hold_softmax",
    "block_probs",
    "block_step",
    "online_softmax",
    "cast_p",
    "dequantize",
    "zeroed",
    "saturated",
    "round_product",
    "block_pv",
    "block_product",
    "accumulate",
    "truncate_mantissa",
    "mma_chain",
    "accumulate_pv",
    "epilogue_divisor",
    "finalize",
    "row_share",
    "kv_block",
    "visible",
    "causal_mask",
    "causal_kv_steps",
    "split_schedule",
    "merge_splits",
    "v_channel_scale",
]

#: log2(e): the exponent mode computes exp(x) as exp2(x · log2 e), like the kernels.
LOG2E = math.log2(math.e)

#: Logits at or below −2^127 are masked keys, on every path: −inf, ``finfo(float32).min`` (what flax
#: puts in masked logits) and ``−0.7·finfo(float32).max`` (jax.nn's) alike. A masked key contributes
#: nothing (P = 0, as the kernels' −inf does), a running max that has seen only masked keys counts as
#: −inf (:func:`safe_max`), and a row with no visible key outputs 0 (:func:`finalize`), as
#: FlashAttention's epilogue does (``hopper/softmax.h``: ``inv_sum = sum == 0 ? 1 : 1 / sum``). Such a
#: value times log2 e overflows float32, which is why the bound sits here: a finite logit above it
#: is a real score.
MASKED_BELOW = -(2.0**127)


def expand_rows(row, shape):
    """Per-row values ``(...)`` broadcast over the last axis of ``shape`` ``(..., cols)``."""
    return lax.broadcast_in_dim(row, shape, tuple(range(row.ndim)))


def safe_max(m):
    """m with masked values (≤ :data:`MASKED_BELOW`, −inf included) replaced by 0.

    A row that has seen only masked keys then gives P = exp(masked − 0) = 0 and α = 0, never
    exp(−inf + inf) = NaN (the exponent mode's Z·log2 e − m·log2 e overflows for such values).
    """
    return jnp.where(m <= MASKED_BELOW, 0.0, m)


def update_max(m, block_max, cfg: KernelConfig):
    """Line 5: m_new = max(m, rowmax Z_j), or with a lazy rescale threshold τ (``rescale_threshold``)
    the old m unless the block's max exceeds it by more than τ (:attr:`KernelConfig.rescale_gap`).

    A first block (m = −inf) always sets the max; a fully masked block (max −inf) never does.
    """
    if not cfg.rescale_threshold:
        return jnp.maximum(m, block_max)
    return jnp.where(block_max - m > cfg.numbers().rescale_gap, jnp.maximum(m, block_max), m)


def fold_sink(block_max, sink, cfg: KernelConfig):
    """A block's max as a ``"block_max"`` kernel takes it: max(rowmax Z_j, s_L) where the block has a
    visible key (a block with none stays masked). Other sink modes, or no sink: unchanged."""
    if sink is None or cfg.sink_mode != "block_max":
        return block_max
    return jnp.where(block_max > MASKED_BELOW, jnp.maximum(block_max, sink), block_max)


def sink_weight(sink, m, cfg: KernelConfig):
    """What a learned sink logit s_L adds to ℓ under running max m: exp(s_L − m), or in the exponent
    mode exp2(s_L·log2 e − (m·log2 e − log2 S)) = S·exp(s_L − m) (ℓ holds S there, so the sink term
    carries it too, as FA3's vLLM fork and fmha_v2 scale it); with ``sink_prescale="exp"``
    exp(s_L − m + log2 S) = e^(log2 S)·exp(s_L − m) (fmha_v2's non-exp2f path). m = −inf (nothing
    visible) counts as 0."""
    m = safe_max(m)
    if cfg.scale_mode == "exponent" and cfg.sink_prescale == "exp":
        return jnp.exp(sink - m + cfg.numbers().log2_scale)
    if cfg.scale_mode == "exponent":
        return jnp.exp2(sink * LOG2E - (m * LOG2E - cfg.numbers().log2_scale))
    return jnp.exp(sink - m)


def sink_start(sink, shape, cfg: KernelConfig):
    """(m, ℓ) before the first block, per row of ``shape``: (s_L, its :func:`sink_weight` = 1 or S) for
    an ``"init_max"`` kernel with a sink, else (−inf, 0)."""
    if sink is None or cfg.sink_mode != "init_max":
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)
    m = jnp.broadcast_to(jnp.asarray(sink, jnp.float32), shape)
    return m, sink_weight(m, m, cfg)


def add_sink(row_sum, m, sink, cfg: KernelConfig, *, norm=None):
    """ℓ with the learned sink's term added once at the end (``"epilogue"`` and ``"block_max"``
    kernels; an ``"init_max"`` kernel put it in ℓ before the first block): ℓ + :func:`sink_weight`,
    divided by ``norm`` (ℓ_row of :func:`row_normalizer`) where P was normalised (``"row_lse"``)."""
    if sink is None or cfg.sink_mode == "init_max":
        return row_sum
    w = sink_weight(sink, m, cfg)
    return row_sum + (w if norm is None else w / norm)


def alpha(m_old, m_new, cfg: KernelConfig):
    """Line 6: α = exp(m_old − m_new) (the exp2 form in the exponent mode)."""
    if cfg.scale_mode == "exponent":
        return jnp.exp2((m_old - safe_max(m_new)) * LOG2E)
    return jnp.exp(m_old - safe_max(m_new))


def tile_rows(x, cfg: KernelConfig, *, row_axis: int = -1, pad=None, op=jnp.max):
    """Per-row values ``x`` (query rows along ``row_axis``) → each row's ``op`` over its query tile.

    The rows are tiled from the first, ``cfg.block_q`` at a time (row r in tile r // block_q, as a
    kernel's programs take them). A last partial tile is completed with padding rows holding
    ``pad()`` (a callable giving one row's values, broadcast; called only when there is such a tile).
    A kernel's program holds exactly one tile: one reduction over its rows.
    """
    bq = cfg.block_q
    ax = row_axis % x.ndim
    q = x.shape[ax]
    if bq == 1:
        return x
    if q == bq:
        return jnp.broadcast_to(op(x, axis=ax, keepdims=True), x.shape)
    extra = (-q) % bq
    if extra:
        shape = x.shape[:ax] + (extra,) + x.shape[ax + 1:]
        x = jnp.concatenate([x, jnp.broadcast_to(pad(), shape).astype(x.dtype)], axis=ax)
    tiles = x.reshape(x.shape[:ax] + (x.shape[ax] // bq, bq) + x.shape[ax + 1:])
    r = jnp.broadcast_to(op(tiles, axis=ax + 1, keepdims=True), tiles.shape).reshape(x.shape)
    return lax.slice_in_dim(r, 0, q, axis=ax)


def skip_rows(block_max, m, cfg: KernelConfig, *, row_axis: int = -1):
    """Skip-softmax (``skip_softmax_threshold`` λ): per row, whether its query tile skips the block.

    A row votes to skip when exp(rowmax Z_j − m) < λ against its running max m *before* the block
    (TensorRT-LLM fmha_v2 as FlashInfer vendors it, commit fb28d72, ``csrc/fmha_v2/fmha/warpspec/
    epilogue.h`` lines 770-779: ``local_max − global_max`` before ``local_max = max(local_max,
    global_max)``), or when it sees no key of the block; a row whose m is still −inf never votes to
    skip. The tile skips when every row votes (lines 787-805: ``__all_sync`` over a warp, then an
    ``atomicAnd`` over the warpgroup); padding rows of a partial tile do not block it. None without a
    threshold. ``block_max``, ``m``: ``(...)`` per row (raw rowmax Z_j, before any sink is folded in).
    """
    if not cfg.skip_softmax_threshold:
        return None
    log_lam = jnp.float32(cfg.numbers().skip_log_threshold)
    vote = (block_max <= MASKED_BELOW) | ((m > MASKED_BELOW) & (block_max - m < log_lam))
    votes = tile_rows(jnp.where(vote, 1.0, 0.0), cfg, row_axis=row_axis, pad=lambda: jnp.float32(1.0), op=jnp.min)
    return votes > 0.5


def drop_skipped(z, skip):
    """A block's scores with every key of a skipped row masked: P = 0, so the block adds to neither O
    nor ℓ and leaves the running max as it is (a skipped row's block max is below it). ``skip``: from
    :func:`skip_rows` (None: ``z``)."""
    return z if skip is None else jnp.where(expand_rows(skip, z.shape), -jnp.inf, z)


def p_reference(block_max, m_new, cfg: KernelConfig):
    """Line 7's offset, the max P = exp(Z − m) is taken against: the running max ``m_new`` (Algorithm 1;
    ``"row_lse"``, whose running max is the row's own from the start), or the block's own max
    ``block_max`` with ``p_offset="block_max"`` (JAX's TPU ragged paged attention: ``s_curr =
    exp(qk − m_curr)``, ``jax/experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py`` L538-539
    @cec06d1)."""
    return block_max if cfg.p_offset == "block_max" else m_new


def block_weight(m_ref, m_new, cfg: KernelConfig):
    """β = exp(m_block − m_new) that a ``"block_max"`` kernel multiplies the block's ΣP and P8·V by after
    the product (ibid. L553 ``beta``, L555 and L580-581); None for the other offsets (β = 1)."""
    if cfg.p_offset != "block_max":
        return None
    return alpha(m_ref, m_new, cfg)


def row_normalizer(z, sink=None):
    """The first pass of a ``"row_lse"`` kernel over the whole row ``z`` ``(..., N)``: (m_row, ℓ_row) =
    (rowmax Z, Σ exp(Z − m_row)) in FP32, with a learned ``sink`` logit (per row) one more column of
    the softmax (in the max and the sum); ℓ_row = 1 for a row with nothing (its P is 0)."""
    m = jnp.max(z, axis=-1)
    if sink is not None:
        m = jnp.maximum(m, sink)
    ell = jnp.sum(jnp.exp(z - expand_rows(safe_max(m), z.shape)), axis=-1)
    if sink is not None:
        ell = ell + jnp.exp(sink - safe_max(m))
    return m, jnp.where(ell == 0.0, 1.0, ell)


def hold_softmax(x, cfg: KernelConfig, *, barrier=None):
    """P (or P·S) as the softmax holds it: rounded to float16 (round to nearest even) with
    ``softmax="f16"``, as it is otherwise. ``barrier`` as in :func:`round_product` (callers outside a
    kernel pass ``jax.lax.optimization_barrier``, so that XLA keeps the f32 → f16 → f32 round trip)."""
    if cfg.softmax != "f16":
        return x
    h = x.astype(jnp.float16)
    if barrier is not None:
        h = barrier(h)
    return h.astype(jnp.float32)


def padding_max(sink, cfg: KernelConfig):
    """The running max of a padding row of a partial query tile (zero Q: logit 0 on each key it sees)
    once it has seen a key: line 5 from the max the row starts at, 0 with no sink.

    ``sink``: per row, the learned sink logit the row's running max starts at (``"init_max"``, −inf in a
    split that does not hold it) or folds into each block's max (``"block_max"``); None: no sink. aiter's
    Triton MHA starts every row of a query tile, padding rows included, at m = s_L (ROCm/aiter @e404860
    ``aiter/ops/triton/_triton_kernels/attention/mha.py`` lines 685-692, the padding rows' Q loaded as 0 at
    line 708), so such a row's P is exp(0 − max(s_L, 0)), not 1 (lines 212-215).
    """
    if sink is None or cfg.sink_mode == "epilogue":
        return jnp.float32(0.0)
    if cfg.sink_mode == "block_max":
        return jnp.maximum(sink, 0.0)
    return update_max(sink, jnp.zeros_like(sink), cfg)


def block_probs(z, m_new, cfg: KernelConfig, *, norm=None, barrier=None, row_axis: int = -1, sink=None):
    """Lines 7 and 9 before the cast: (P that ℓ sums, P·S that is cast, per-row unscale or None).

    ``z``: ``(..., B)`` scores of a block; ``m_new``: ``(...)`` the max P is taken against
    (:func:`p_reference`; −inf allowed). ``norm``: ``(...)`` ℓ_row of :func:`row_normalizer` that P is
    divided by (``"row_lse"``), or None. ``row_axis``: the query rows' axis of ``m_new`` (the tile-amax
    mode takes the max over tiles of them). ``sink``: per row (broadcastable to ``m_new``), the learned
    sink as :func:`padding_max` takes it, or None.

    * multiply mode: P = exp(Z − m), cast P·S (S in FP32 after the exponential);
    * exponent mode: P̃ = exp2(Z·log2 e − (m·log2 e − log2 S)), so ℓ sums the scaled values;
    * dynamic mode: per row the largest 2^k with rowmax(P)·2^k ≤ max of the format; the unscale
      factor 2^-k multiplies the block's P8·V before it is accumulated (exact). k = trunc(log2(max /
      rowmax P)) equals the floor, since the argument is ≥ log2(max) > 0 (P ≤ 1).
    * tile-amax mode: per query tile (:func:`tile_rows`) a = max(amax P, 10^-9), S = max / a and the
      unscale a / max, each one float32 division (aiter @e404860 ``aiter/ops/triton/utils/_triton/
      mha_kernel_utils.py`` lines 9-15, applied at ``_triton_kernels/attention/mha.py`` lines 256-259).
      Padding rows of a partial tile have P = exp(−:func:`padding_max`) wherever the tile's last real row
      sees a key: 1 without a learned sink.

    With ``softmax="f16"`` the exponential's result and then P·S are rounded to float16
    (:func:`hold_softmax`); ``barrier`` goes there.
    """
    m = expand_rows(safe_max(m_new), z.shape)
    if cfg.scale_mode == "exponent":
        p = hold_softmax(jnp.exp2(z * LOG2E - (m * LOG2E - cfg.numbers().log2_scale)), cfg, barrier=barrier)
        return p, p, None
    p = hold_softmax(jnp.exp(z - m), cfg, barrier=barrier)
    if norm is not None:
        p = p / expand_rows(norm, p.shape)
    if cfg.scale_mode == "multiply":
        return p, hold_softmax(p * jnp.float32(cfg.numbers().effective_scale), cfg, barrier=barrier), None
    if cfg.scale_mode == "tile_amax":
        def padding_row():  # Q = 0: logit 0 on each key the last real row sees, P = exp(0 − padding_max)
            seen = jnp.max(z, axis=-1) > MASKED_BELOW
            m_pad = jnp.broadcast_to(padding_max(sink, cfg), seen.shape)
            p_pad = jnp.where(seen, jnp.exp(-m_pad), 0.0)
            ax = row_axis % seen.ndim
            return lax.slice_in_dim(p_pad, seen.shape[ax] - 1, seen.shape[ax], axis=ax)

        amax = tile_rows(jnp.max(p, axis=-1), cfg, row_axis=row_axis, pad=padding_row)
        amax = jnp.maximum(amax, jnp.float32(TILE_AMAX_FLOOR))
        fmax = jnp.float32(cfg.fmt.max)
        return p, p * expand_rows(fmax / amax, p.shape), amax / fmax
    fmax = cfg.fmt.max
    p_max = jnp.max(p, axis=-1)
    k = jnp.log2(fmax / jnp.where(p_max > 0.0, p_max, 1.0)).astype(jnp.int32).astype(jnp.float32)
    s = jnp.exp2(jnp.minimum(jnp.maximum(k, 0.0), 126.0))
    s = jnp.where(p_max * s > fmax, s * 0.5, s)  # log2 may round up across a power of two
    return p, p * expand_rows(s, p.shape), 1.0 / s


class BlockStep(NamedTuple):
    """Lines 4–8 for one block: the new running max, α, ℓ, P before and after the scale, the factor
    that multiplies the block's P8·V (2^-k, β; None for 1), and β alone (:func:`block_weight`)."""

    m: object
    alpha: object
    row_sum: object
    p: object
    ps: object
    unscale: object
    weight: object = None


def block_step(m, row_sum, z, block_max, m_new, cfg: KernelConfig, *, norm=None, barrier=None,
               row_axis: int = -1, sink=None) -> BlockStep:
    """Lines 6–8 for a block whose max (sink folded in) and new running max are known: α, P against
    :func:`p_reference`, ℓ = α ℓ + β·rowsum(P) in FP32 (β of :func:`block_weight`, 1 but for
    ``"block_max"``); β also multiplies the block's P8·V (in ``unscale``). ``sink``: as
    :func:`block_probs` takes it."""
    a = alpha(m, m_new, cfg)
    m_p = p_reference(block_max, m_new, cfg)
    p, ps, unscale = block_probs(z, m_p, cfg, norm=norm, barrier=barrier, row_axis=row_axis, sink=sink)
    beta = block_weight(m_p, m_new, cfg)
    added = jnp.sum(p, axis=-1)
    if beta is not None:
        added = beta * added
        unscale = beta if unscale is None else unscale * beta
    return BlockStep(m_new, a, a * row_sum + added, p, ps, unscale, beta)


def online_softmax(m, row_sum, z, cfg: KernelConfig, sink=None, *, norm=None, barrier=None,
                   row_axis: int = -1) -> BlockStep:
    """Lines 4–8: a block skipped by skip-softmax (:func:`skip_rows`) has P = 0 in the rows of its query
    tile; m_new = max(m, rowmax Z) (:func:`update_max`, the sink folded in by a ``"block_max"`` kernel),
    then :func:`block_step`. ``norm``: ℓ_row of a ``"row_lse"`` kernel (whose ``m`` is the row's max
    from the start, so α = 1). ``row_axis``: the rows' axis of ``m``. ``sink``: per row, the learned sink
    logit (−inf in a split of an ``"init_max"`` kernel that does not hold it)."""
    z = drop_skipped(z, skip_rows(jnp.max(z, axis=-1), m, cfg, row_axis=row_axis))
    block_max = fold_sink(jnp.max(z, axis=-1), sink, cfg)
    return block_step(m, row_sum, z, block_max, update_max(m, block_max, cfg), cfg, norm=norm, barrier=barrier,
                      row_axis=row_axis, sink=sink)


def cast_p(ps, cfg: KernelConfig):
    """Line 9: P·S rounded to the config's P format (round to nearest even), in that FP8 dtype.

    ``"satfinite"`` clamps to ±max first, as Hopper's ``cvt.rn.satfinite`` does (and as both
    Pallas backends do on the GPU); ``"nan"`` casts directly (XLA: NaN past the format's range).

    Block-scaled formats (MXFP8, MXFP4, NVFP4) return ``(elements, scales)`` instead, both float32:
    the elements of P·S (``(..., B)``, values of E4M3/E2M1) and one scale per ``block`` keys
    (``(..., B / block)``), from :func:`pcast_jax.formats.block_quantize` with second level 1 (the
    row normalisation of the two-level NVFP4 scheme is S: 448·6 brings P = 1 to the top of
    E2M1 × E4M3). The scales are multiplied back after the P·V product (:func:`block_pv`).
    """
    bf = cfg.block_format
    if bf is not None:
        return formats.block_quantize(ps, bf, overflow=cfg.overflow)
    return formats.to_fp8(ps, cfg.fmt, overflow=cfg.overflow)


def dequantize(p8, scales, cfg: KernelConfig):
    """The P value line 10 effectively multiplies: elements × their block scale (P8 itself if None)."""
    if scales is None:
        return p8
    bs = cfg.block_format.block
    shape = p8.shape[:-1] + (p8.shape[-1] // bs, bs)
    return (p8.reshape(shape) * scales[..., None]).reshape(p8.shape)


def zeroed(ps, cfg: KernelConfig):
    """Line 9's loss: P·S > 0 that the cast sends to 0.

    Element formats: 0 < P·S ≤ half the smallest subnormal. Block-scaled formats: P·S > 0 whose
    element rounds to 0 under its block's scale, or whose block scale itself rounds to 0.
    """
    if cfg.block_format is not None:
        q, scales = cast_p(ps, cfg)
        return (ps > 0.0) & (dequantize(q, scales, cfg) == 0.0)
    return (ps > 0.0) & (ps <= cfg.fmt.round_to_zero)


def saturated(ps, cfg: KernelConfig):
    """Line 9's other loss: P·S beyond the largest value the cast can give, which it clips to it.

    Element formats: P·S > max (448 for E4M3, with ``"satfinite"``; the ``"nan"`` overflow turns
    it into NaN instead). Block-scaled formats: P·S above its block's largest element
    (element max × block scale). The tile-amax mode: none (its S maps the tile's amax to max, so P·S
    exceeds max only by float32 rounding, which the cast rounds back to max), and likewise a static S at
    most max without a lazy rescale (P ≤ 1). Only a lagging running max (``rescale_threshold``) or S
    above the format's max makes P·S > max at all; ℓ keeps the unclipped value either way.
    """
    if cfg.scale_mode == "tile_amax":  # S maps the tile's amax to max: P·S exceeds it by rounding alone
        return jnp.zeros(ps.shape, bool)
    fmax = jnp.float32(cfg.fmt.max)
    if cfg.block_format is None and cfg.scale_mode not in COMPUTED_SCALE_MODES:
        # without a lazy rescale P ≤ 1, so with S ≤ max P·S exceeds max only by exp2's float32 rounding (S = 448
        # in the exponent: FlyDSL PR #1020), which the cast rounds back to max as it rounds any value
        if not cfg.rescale_threshold:  # (whether it is 0 selects the program; its value may be bound)
            return (jnp.asarray(cfg.effective_scale) > fmax) & (ps > fmax)
    if cfg.block_format is not None:
        _, scales = cast_p(ps, cfg)
        bs = cfg.block_format.block
        top = jnp.repeat(scales, bs, axis=-1) * jnp.float32(cfg.block_format.element.max)
        return ps > top
    return ps > fmax


def round_product(pv, cfg: KernelConfig, *, carry=None, barrier=None):
    """A block's P8·V as the accumulator holds it: rounded to float16 for an f16 accumulator.

    ``carry``: the f16 partial sum of the key groups before ``pv`` in the block (see
    :func:`block_pv`); the f16 MMA adds them and rounds to float16 (round to nearest even).
    ``barrier``: a function applied to the float16 value before it is widened back; callers
    outside a kernel pass ``jax.lax.optimization_barrier`` so that XLA cannot fold the
    f32 → f16 → f32 round trip away (kernels cannot lower a barrier and pass none).
    """
    if cfg.accumulator == "f16":
        if carry is not None:
            pv = carry + pv
        h = pv.astype(jnp.float16)
        if barrier is not None:
            h = barrier(h)
        return h.astype(jnp.float32)
    return pv


def block_pv(product, cfg: KernelConfig, *, barrier=None, scales=None):
    """Line 10's P8·V_j as the accumulator produces it, from ``product(lo, hi)`` = P8[:, lo:hi]·V[lo:hi].

    FP32 accumulator: one exact product; with the MMA accumulator model (``mma_acc_bits``, promoted
    every ``mma_promote_keys`` keys) one :func:`mma_chain` per promotion group from a fresh (zero)
    accumulator, the groups added in FP32. f16 accumulator: one f16 MMA per ``f16_round_keys`` keys
    (all B keys when 0), each adding its exact product to the f16 partial sum of the block and
    rounding to float16 (:func:`round_product`); the block's f16 sum is what is added to FP32 O.

    Block-scaled formats (``scales`` ``(..., B / block)`` from :func:`cast_p`): the block-scaled
    MMA multiplies each scale back after its product, P·V = Σ_b scale_b · (P8_b · V_b), in FP32.
    """
    b = cfg.block_kv
    if scales is not None:
        bs = cfg.block_format.block
        acc = None
        for g in range(b // bs):
            pv = product(g * bs, (g + 1) * bs)
            pv = expand_rows(scales[..., g], pv.shape) * pv
            acc = pv if acc is None else acc + pv
        return acc
    if cfg.mma_acc_bits:
        if not cfg.mma_promote_keys:
            raise PcastError("mma_promote_keys=0 (never promoted): the MMA adds the block to α·O itself, "
                             "so line 10 is accumulate_pv, not block_pv")
        acc = None
        for lo in range(0, b, cfg.mma_promote_keys):  # each group a fresh MMA accumulator, summed in FP32
            y = mma_chain(None, product, lo, lo + cfg.mma_promote_keys, cfg)
            acc = y if acc is None else acc + y
        return acc
    if cfg.accumulator != "f16":
        return product(0, b)
    r = cfg.f16_round_keys or b
    acc = None
    for lo in range(0, b, r):
        acc = round_product(product(lo, lo + r), cfg, carry=acc, barrier=barrier)
    return acc


def v_channel_scale(v, cfg: KernelConfig):
    """Per-channel V scale of an f16 accumulator with ``v_channel_max`` (None without one).

    ``v``: ``(..., N, d)``. Returns ``(..., d)`` c = max_n |V[n, :]| / v_channel_max (1 for an
    all-zero channel): the kernel accumulates P8·(V/c) in f16 and multiplies the result by c after
    the accumulation (SageAttention2++: V quantized per channel to |V/c| ≤ 2.25 so that a 32-key f16
    MMA cannot overflow).
    """
    if cfg.accumulator != "f16" or not cfg.v_channel_max:
        return None
    amax = jnp.max(jnp.abs(v), axis=-2)
    return jnp.where(amax > 0.0, amax / jnp.float32(cfg.numbers().v_channel_max), 1.0)


def block_product(pv, unscale, cfg: KernelConfig):
    """Line 10's P8·V_j as it is added: :func:`round_product`, then × 2^-k in the dynamic mode.

    Rounding a value :func:`block_pv` already rounded to float16 leaves it unchanged.
    """
    pv = round_product(pv, cfg)
    if unscale is not None:
        pv = pv * expand_rows(unscale, pv.shape)
    return pv


def accumulate(o, a, pv, unscale, cfg: KernelConfig):
    """Line 10: O = α O + P8·V_j, with ``pv`` the FP32 product of the block."""
    return expand_rows(a, o.shape) * o + block_product(pv, unscale, cfg)


def truncate_mantissa(x, bits: int):
    """float32 ``x`` with its mantissa cut to ``bits`` explicit bits, toward zero (bits ≥ 23: ``x``).

    The low ``23 − bits`` bits of the float32 encoding are cleared, so normal and subnormal
    values alike lose their trailing bits (the magnitude never grows). Used by the simulator's MMA
    accumulator model only; the kernels' tensor cores do this themselves.
    """
    drop = 23 - bits
    if drop <= 0:
        return x
    mask = jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)


def mma_chain(acc, product, lo: int, hi: int, cfg: KernelConfig):
    """Line 10's P8·V for keys [lo, hi) as the FP8 MMA accumulator adds it, one K-step at a time.

    ``acc``: what the accumulator holds before (None: a fresh, zero accumulator); ``product(a, b)``
    = P8[:, a:b]·V[a:b] exact in FP32. Every MMA K-step (:data:`pcast_jax.config.MMA_K` = 32 keys)
    adds its product to the running sum and the sum keeps ``cfg.mma_acc_bits`` mantissa bits,
    truncated (:func:`truncate_mantissa`). A model: the bit count and the truncation are assumptions
    (DeepSeek-V3 technical report §3.3.2), not read from a kernel's source.
    """
    for k in range(lo, hi, MMA_K):
        part = product(k, k + MMA_K)
        acc = truncate_mantissa(part if acc is None else acc + part, cfg.mma_acc_bits)
    return acc


def accumulate_pv(o, a, product, unscale, cfg: KernelConfig, *, barrier=None, scales=None):
    """Line 10 from ``product(lo, hi)``: O = α O + P8·V_j, with the block's product as the MMA makes it.

    Never-promoted MMA accumulator model (``mma_acc_bits`` > 0, ``mma_promote_keys`` = 0): O lives
    in the MMA accumulator, so α·O (an FP32 multiply of the accumulator registers) is where the
    block's :func:`mma_chain` starts. Otherwise :func:`accumulate` of :func:`block_pv`.
    """
    if cfg.mma_acc_bits and not cfg.mma_promote_keys:
        return mma_chain(expand_rows(a, o.shape) * o, product, 0, cfg.block_kv, cfg)
    return accumulate(o, a, block_pv(product, cfg, barrier=barrier, scales=scales), unscale, cfg)


def epilogue_divisor(row_sum, cfg: KernelConfig):
    """Line 12's divisor: S·ℓ in the multiply mode; ℓ where ℓ holds S or S was undone per block; S alone
    where P was normalised before the cast (``p_offset="row_lse"``, ℓ = ΣP ≈ 1 is not divided again).

    A row with no visible key has ℓ = 0 (and O = 0): its divisor is 1, so its output is 0, as
    FlashAttention's epilogue gives (``inv_sum = sum == 0 ? 1 : 1 / sum``), never 0/0. Only an exact
    zero is replaced: a NaN ℓ (a NaN learned sink under ``jax.jit``) stays NaN in the output.
    """
    if cfg.p_offset == "row_lse":
        div = jnp.float32(cfg.numbers().effective_scale) * jnp.where(row_sum == 0.0, 0.0, 1.0)
    else:
        div = jnp.float32(cfg.numbers().effective_scale) * row_sum if cfg.scale_mode == "multiply" else row_sum
    return jnp.where(div == 0.0, 1.0, div)


def finalize(o, row_sum, cfg: KernelConfig):
    """Line 12: O / (S ℓ) (O / ℓ in the exponent and dynamic modes); 0 for a row with nothing visible."""
    return o / expand_rows(epilogue_divisor(row_sum, cfg), o.shape)


def row_share(x, row_sum):
    """x / ℓ per row, 0 where ℓ = 0 (a row with no visible key): e.g. the zeroed share of the mass.

    A NaN ℓ stays NaN (only an exact zero is replaced), as in :func:`epilogue_divisor`.
    """
    return x / jnp.where(row_sum == 0.0, 1.0, row_sum)


def kv_block(step, n_steps, cfg: KernelConfig):
    """Line 2's order: the KV block visited at ``step`` of ``n_steps`` (reverse: last block first).

    Works on Python ints, NumPy index arrays and traced integers alike.
    """
    return n_steps - 1 - step if cfg.order == "reverse" else step


def visible(q_pos, k_pos):
    """Causal visibility: key position ``k_pos`` is visible to the query at ``q_pos``."""
    return k_pos <= q_pos


def causal_mask(q_len: int, n: int, q_offset=None):
    """``(q_len, n)`` causal visibility, bottom-right aligned (query i at position N − q_len + i).

    ``q_offset`` overrides the position of query row 0.
    """
    off = n - q_len if q_offset is None else q_offset
    return visible(jnp.arange(q_len)[:, None] + off, jnp.arange(n)[None, :])


def causal_kv_steps(last_q_pos, block_kv: int, n_blocks: int):
    """How many KV blocks a causal tile visits: those holding a key ≤ its last query position."""
    return jnp.minimum(lax.div(last_q_pos, block_kv) + 1, n_blocks)


def split_schedule(n_blocks: int, cfg: KernelConfig) -> np.ndarray:
    """Split-KV: ``(kv_splits, steps)`` KV block that split s visits at step t (host-side, static).

    ``"contiguous"``: split s owns blocks [s·c, (s+1)·c) with c = ⌈n_blocks / kv_splits⌉
    (flash-decoding, FlashAttention-3 ``num_splits``); ``"strided"``: split s owns blocks s,
    s + kv_splits, s + 2·kv_splits, … (TensorRT-LLM XQA multi-block: ``idxKTile = idxKTileInit +
    idxIter · nbSubSeq`` in ``cpp/kernels/xqa/mha_sm90.cu``). Each split walks its own blocks in
    the config's order (:func:`kv_block`). A split with fewer blocks than ``steps`` idles at the end
    of its schedule: those entries hold ``n_blocks`` (a fully masked block). One schedule serves every
    row, cut from all ``n_blocks`` blocks: FlashAttention-3 cuts each query tile's from the blocks up to its
    diagonal (``hopper/block.h`` lines 23-34, 47-54 @0251105), which differs on causal prefill rows
    (:func:`pcast_jax.analysis.study.analyze` says so beside each split-KV config). ``kv_splits = 1`` gives
    the one-run order of :func:`kv_block`.
    """
    splits = cfg.kv_splits
    if cfg.split_layout == "contiguous":
        per = -(-n_blocks // splits)
        members = [range(s * per, min((s + 1) * per, n_blocks)) for s in range(splits)]
    else:
        members = [range(s, n_blocks, splits) for s in range(splits)]
    steps = max(1, max(len(m) for m in members))
    sched = np.full((splits, steps), n_blocks, np.int32)
    for s, m in enumerate(members):
        for t in range(len(m)):
            sched[s, t] = m[kv_block(t, len(m), cfg)]
    return sched


def merge_splits(m, row_sum, o, cfg: KernelConfig, extra=(), sink=None):
    """Split-KV epilogue: line 12 per split, then the FP32 log-sum-exp merge of the splits.

    The split axis leads: ``m``, ``row_sum`` ``(splits, ...)`` and ``o`` ``(splits, ..., d)``. With
    m = max_s m_s and w_s = exp(m_s − m)·ℓ_s (ℓ_s as the split holds it, so S cancels in the
    exponent mode), the output is Σ_s (w_s / Σ_s' w_s') · O_s / (S·ℓ_s) — each split finalised by its
    own divisor (:func:`epilogue_divisor`), weighted by its share of the merged row sum, as the
    flash-decoding combine kernels do with LSE_s = m_s + log ℓ_s. A split that saw no visible key
    (ℓ_s = 0) gets weight 0. Returns ``(out, ℓ, merged extra)`` with ℓ = Σ_s exp(m_s − m)·ℓ_s
    and each row statistic in ``extra`` (decayed to m_s like ℓ_s) merged the same way. A learned
    ``sink`` logit (per row) enters ℓ once here (:func:`add_sink`), at the merged max; an
    ``"init_max"`` kernel already holds it in split 0.
    """
    m_all = jnp.max(m, axis=0)
    a = alpha(m, m_all, cfg)  # exp(m_s − m); 0 for a split with m_s = −inf
    w = a * row_sum
    ell = add_sink(jnp.sum(w, axis=0), m_all, sink, cfg)
    o_s = o / expand_rows(epilogue_divisor(row_sum, cfg), o.shape)
    out = jnp.sum(expand_rows(row_share(w, ell), o.shape) * o_s, axis=0)
    return out, ell, tuple(jnp.sum(a * x, axis=0) for x in extra)
