"""What an FP8 attention kernel does at the P-cast: :class:`KernelConfig` (presets: :mod:`pcast_jax.presets`).

Algorithm 1 of the paper, per query row and KV block j (in the kernel's order)::

    m_new = max(m, rowmax(Z_j));  α = exp(m − m_new)
    P     = exp(Z_j − m_new);     ℓ = α ℓ + rowsum(P)          # FP32, pre-cast P
    P8    = cast_E4M3(P · S);     O = α O + P8 · V_j           # FP8 × FP8 → FP32
    return O / (S ℓ)

``scale_mode`` says where S goes:

* ``"multiply"`` — P·S after the exponential, ℓ from unscaled P, epilogue O/(S·ℓ)
  (hpc-ops, FlashInfer, TensorRT-LLM XQA; the paper's simulator).
* ``"exponent"`` — S folded into the exponent, P̃ = exp2(Z·log2e − (m·log2e − log2 S)), so ℓ sums
  the scaled values and the epilogue is O/ℓ (FlashAttention-3/4, SageAttention).
* ``"dynamic"`` — per row and block, the largest power of two 2^k with rowmax(P)·2^k ≤ max_E4M3;
  each block's P8·V is multiplied by 2^-k (exact) before it is accumulated; ℓ unscaled. The paper's
  "future work" (§7.4); no released kernel does this. ``scale`` is ignored.
* ``"tile_amax"`` — per tile of ``block_q`` query rows × one KV block, S = max_fmt / amax(P) over the
  whole tile, shared by its rows and not a power of two; the tile's P8·V is multiplied by
  amax / max_fmt before it is accumulated; ℓ unscaled (aiter's Triton MHA FP8). ``scale`` is ignored.

A query tile (``block_q`` rows, the call's rows taken from the first) is also the unit of the
skip-softmax vote (``skip_softmax_threshold``): a KV block is skipped for the tile when every row of
it has exp(rowmax Z_j − m) < λ against its running max m before the block.

``p_offset`` says what P is taken against (the running max of line 7, the block's own max with the
block's product rescaled after the dot, or the row's log-sum-exp: P normalised before the cast), and
``softmax`` the precision P is held in before the cast (FP32 or float16).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, NamedTuple

import numpy as np

from pcast_jax import numberline
from pcast_jax.errors import F32_MAX, PcastError, check_choice, check_int, check_positive

__all__ = ["KernelConfig", "Numbers", "BoundConfig",
           "MMA_K", "QKV_GRANULARITIES", "SINK_MODES", "SINK_PRESCALES", "RESCALE_UNITS", "RESCALE_COMPENSATIONS",
           "P_OFFSETS", "SOFTMAX_PRECISIONS",
           "Order", "ScaleMode", "Accumulator", "QKVPrecision", "QKVGranularity", "SplitLayout", "SinkMode",
           "SinkPrescale", "RescaleUnit", "RescaleCompensation", "POffset", "SoftmaxPrecision", "scale_candidates",
           "COMPUTED_SCALE_MODES", "TILE_AMAX_FLOOR"]

#: KV block orders (:attr:`KernelConfig.order`).
Order = Literal["forward", "reverse"]
ORDERS: tuple[str, ...] = typing.get_args(Order)
#: Where S goes (:attr:`KernelConfig.scale_mode`).
ScaleMode = Literal["multiply", "exponent", "dynamic", "tile_amax"]
SCALE_MODES: tuple[str, ...] = typing.get_args(ScaleMode)
#: P·V accumulators (:attr:`KernelConfig.accumulator`).
Accumulator = Literal["f32", "f16"]
ACCUMULATORS: tuple[str, ...] = typing.get_args(Accumulator)
SCALE_MIN, SCALE_MAX = numberline.SCALE_MIN, numberline.SCALE_MAX  # S, 1/S and S·ℓ stay in float32
#: Q/K/V precisions (:attr:`KernelConfig.qkv`).
QKVPrecision = Literal["f32", "e4m3"]
QKV_PRECISIONS: tuple[str, ...] = typing.get_args(QKVPrecision)
#: Where E4M3 Q/K/V scales live (:attr:`KernelConfig.qkv_granularity`).
QKVGranularity = Literal["tensor", "head"]
QKV_GRANULARITIES: tuple[str, ...] = typing.get_args(QKVGranularity)
#: How split-KV deals blocks (:attr:`KernelConfig.split_layout`).
SplitLayout = Literal["contiguous", "strided"]
SPLIT_LAYOUTS: tuple[str, ...] = typing.get_args(SplitLayout)
#: Keys one FP8 tensor-core MMA instruction covers (its K): Hopper ``wgmma`` with 8-bit operands
#: has K × sizeof(e4m3) = 32 bytes (PTX ISA, wgmma shapes m64nNk32 for .e4m3/.e5m2); the
#: ``mma.sync`` FP8 shape is m16n8k32. The MMA accumulator model rounds after every MMA_K keys.
MMA_K = 32
#: Largest mantissa width of the MMA accumulator model (23 = FP32's, truncated instead of rounded).
MMA_ACC_BITS_MAX = 23
#: Where a kernel puts a learned sink logit s_L (gpt-oss ``sinks``: a softmax column with no value row).
SinkMode = Literal["epilogue", "init_max", "block_max"]
SINK_MODES: tuple[str, ...] = typing.get_args(SinkMode)
#: Units of the lazy-rescale threshold τ: log2 (FA4, FlashInfer CuTe-DSL: compared in the exp2 domain)
#: or natural (cuDNN: compared with the logits themselves).
RescaleUnit = Literal["log2", "natural"]
RESCALE_UNITS: tuple[str, ...] = typing.get_args(RescaleUnit)
#: ``"pow2"``: the P scale is S·2^-τ (cuDNN's compensation for a running max that lags by up to τ).
RescaleCompensation = Literal["none", "pow2"]
RESCALE_COMPENSATIONS: tuple[str, ...] = typing.get_args(RescaleCompensation)
#: How a learned sink's term in ℓ takes the exponent mode's prescale log2 S (:attr:`KernelConfig.sink_prescale`).
SinkPrescale = Literal["exp2", "exp"]
SINK_PRESCALES: tuple[str, ...] = typing.get_args(SinkPrescale)
#: Largest τ: exp(τ) (the most a stale P can exceed 1) stays finite in float32 in either unit.
RESCALE_THRESHOLD_MAX = 64.0
#: Scale modes whose scale is computed per block from P itself (``scale`` is ignored, ℓ unscaled, the
#: block's product multiplied back by the inverse scale).
COMPUTED_SCALE_MODES = ("dynamic", "tile_amax")
#: The floor of a tile's amax in the ``"tile_amax"`` mode (aiter's ``_compute_fp8_scaling_factors``:
#: ``x_amax = tl.where(x_amax <= 1e-9, 1e-9, x_amax)``), so an all-zero tile gets a finite scale.
TILE_AMAX_FLOOR = 1e-9
#: What P = exp(Z − offset) is taken against (:attr:`KernelConfig.p_offset`).
POffset = Literal["running_max", "block_max", "row_lse"]
P_OFFSETS: tuple[str, ...] = typing.get_args(POffset)
#: The precision P is computed and held in before the cast (:attr:`KernelConfig.softmax`).
SoftmaxPrecision = Literal["f32", "f16"]
SOFTMAX_PRECISIONS: tuple[str, ...] = typing.get_args(SoftmaxPrecision)
#: Largest finite float16: P·S held in float16 must stay below it.
F16_MAX = 65504.0


_DEFAULT_BLOCK_KV = 64


class Numbers(NamedTuple):
    """The numbers a config puts into Algorithm 1, as float32: what :meth:`KernelConfig.bind` takes.

    Every other field sets the program (its shapes and operations); these only the values it
    computes with, so configs that differ only in them share one compiled program when the numbers
    are passed in as traced arguments (:meth:`KernelConfig.program`).
    """

    #: :attr:`KernelConfig.effective_scale`, the S that multiplies P (and ℓ in the epilogue).
    effective_scale: Any
    #: :attr:`KernelConfig.log2_scale` (the exponent mode's log2 S).
    log2_scale: Any
    #: :attr:`KernelConfig.rescale_gap`, τ in natural-log units.
    rescale_gap: Any
    #: :attr:`KernelConfig.v_channel_max`.
    v_channel_max: Any
    #: :attr:`KernelConfig.skip_log_threshold`, ln λ of the skip-softmax test (−inf: no tile skipped).
    skip_log_threshold: Any = np.float32(-np.inf)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelConfig:
    """P-cast semantics of one FP8 attention kernel; validated on construction.

    Each field is documented where it is declared, grouped by what it describes. Fields that do not
    act in a mode are normalised, so equality is semantic: the dynamic mode sets ``scale`` to 1 and
    FP32 Q/K/V set ``qkv_granularity`` to ``"tensor"``.
    """

    # --- The walk over KV blocks (Algorithm 1's loop) ---------------------------------------------
    #: KV block order, ``"forward"`` (0 → N) or ``"reverse"`` (N → 0).
    order: Order = "forward"
    #: KV block size B. N that is not a multiple is padded with masked keys.
    block_kv: int = _DEFAULT_BLOCK_KV
    #: Bottom-right aligned causal mask (query i of q_len sits at position N − q_len + i).
    causal: bool = False

    # --- The P scale S and where it goes ----------------------------------------------------------
    #: The static P scale S, in [2^-100, 2^100]. The ``"dynamic"`` mode ignores it.
    scale: float = 1.0
    #: ``"multiply"`` (P·S after the exponential, ℓ from unscaled P), ``"exponent"`` (S folded into
    #: the exponent, so ℓ holds S) or ``"dynamic"`` (per row and block the largest 2^k keeping
    #: rowmax(P)·2^k ≤ the format's max); see the module docstring.
    scale_mode: ScaleMode = "multiply"

    # --- The cast itself --------------------------------------------------------------------------
    #: Format of the P-cast: an element format (``"e4m3"``, ``"e5m2"``, ``"e2m1"``, …) with the one
    #: scale S, or a block-scaled format (``"mxfp8"``, ``"mxfp4"``: 32 keys per E8M0 scale;
    #: ``"nvfp4"``: 16 keys per UE4M3 scale) applied to P·S along the key axis, each block's scale
    #: multiplied back after its P·V product. Block-scaled formats need blocks that tile ``block_kv``,
    #: the multiply or exponent scale mode and the FP32 accumulator. A dtype (``jnp.float8_e5m2``,
    #: ``ml_dtypes.float8_e4m3fn``) is stored as its format's name.
    p_format: str = "e4m3"
    #: ``"satfinite"`` (Hopper cvt.rn.satfinite; what kernels do) or ``"nan"``.
    overflow: str = "satfinite"

    # --- The P·V product and its accumulator -----------------------------------------------------
    #: ``"f32"``, or ``"f16"``: each block's P8·V product is rounded to float16 before it is added to
    #: the FP32 output (SageAttention2++'s ``fp32+fp16`` PV accumulation). A dtype is accepted.
    accumulator: Accumulator = "f32"
    #: With the f16 accumulator, how many keys one f16 MMA covers: P8·V is rounded to float16 after
    #: every ``f16_round_keys`` keys and the block's f16 result added to the FP32 output. 0 = once per
    #: block.
    f16_round_keys: int = 0
    #: With the f16 accumulator, V is scaled per channel so that max|V| = this value before the f16
    #: accumulation and the scale multiplied back after it (SageAttention2++ ``quant_v_scale_max``).
    #: 0 = V as it is.
    v_channel_max: float = 0.0
    #: A *model* (not measured on a GPU) of the FP8 tensor core's "FP32" P·V accumulator: 0 = exact
    #: FP32. b in 1..23: the MMA's running partial sum keeps b explicit mantissa bits, truncated toward
    #: zero after every K-step of :data:`MMA_K` = 32 keys (assumption from the DeepSeek-V3 technical
    #: report §3.3.2, "retains around 14 bits"; SageAttention's ``sageattention/core.py`` calls it
    #: "FP32 (actually FP22)"). Needs the FP32 accumulator, an element P format and ``block_kv`` a
    #: multiple of 32.
    mma_acc_bits: int = 0
    #: With ``mma_acc_bits``, after how many keys the partial sum is promoted into exact FP32 registers.
    #: 0 = never: O lives in the MMA accumulator across all KV blocks (FlashAttention-3, TensorRT-LLM
    #: XQA, hpc-ops before its double-O accumulator); k > 0: a multiple of 32 dividing ``block_kv``
    #: (``block_kv`` = one fresh accumulator per KV tile: hpc-ops now, SageAttention2 on SM90 with
    #: ``pv_accum_dtype="fp32+fp32"``, this package's Pallas kernels; DeepGEMM promotes every 128).
    #: The never-promoted form cannot take the dynamic scale mode.
    mma_promote_keys: int = 0

    # --- Q, K and V as the kernel multiplies them -------------------------------------------------
    #: ``"f32"`` keeps Q, K, V exact (isolates the P-cast, as the paper does); ``"e4m3"`` quantizes
    #: them to E4M3 (scale = amax/max_E4M3) as production kernels do. A dtype is accepted.
    qkv: QKVPrecision = "f32"
    #: Where the E4M3 Q/K/V scales live when ``qkv == "e4m3"``: ``"tensor"`` (one per tensor) or
    #: ``"head"`` (one per attention head). Ignored for FP32 Q/K/V.
    qkv_granularity: QKVGranularity = "tensor"

    # --- Split-KV (flash-decoding, multi-block) ---------------------------------------------------
    #: The KV blocks are dealt over this many independent Algorithm-1 runs (1 = one run per row), merged
    #: at the end by the FP32 log-sum-exp merge (:func:`pcast_jax.block.merge_splits`).
    kv_splits: int = 1
    #: ``"contiguous"`` (split s gets a contiguous range of ⌈n_blocks/kv_splits⌉ blocks: FlashAttention-3
    #: ``num_splits``, FlashInfer split-KV) or ``"strided"`` (block b goes to split b mod kv_splits:
    #: TensorRT-LLM XQA multi-block). Each split visits its blocks in ``order``.
    split_layout: SplitLayout = "contiguous"

    # --- Learned sinks ----------------------------------------------------------------------------
    #: Where a learned sink logit s_L goes (one per head, a softmax column with no value row):
    #: ``"epilogue"`` — only in the final denominator, ℓ += exp(s_L − m) (times S where ℓ holds S), the
    #: running max never sees it (FlashInfer, TensorRT-LLM XQA / fmha_v2, FA3's vLLM fork, FA4,
    #: SGLang); ``"init_max"`` — as the initial running max, m = s_L and ℓ = 1 before the first block
    #: (vLLM's Triton unified attention, cuDNN's FP8 SDPA); ``"block_max"`` — folded into every
    #: block's max, ℓ gets it once (vllm-gaudi). Split-KV: ``"init_max"`` and ``"epilogue"`` act in
    #: split 0 only; ``"block_max"`` folds it into every split's max. Without a sink logit it does
    #: not act.
    sink_mode: SinkMode = "epilogue"

    # --- Lazy rescale -----------------------------------------------------------------------------
    #: τ ≥ 0 (0 = Algorithm 1: the running max follows every block). With τ > 0 the running max is
    #: raised only when a block's max exceeds it by more than τ (in ``rescale_unit``); until then
    #: P = exp(Z − m) may exceed 1 and P·S may saturate, while ℓ keeps the unclipped P (FA4,
    #: FlashInfer SM100 CuTe-DSL, cuDNN).
    rescale_threshold: float = 0.0
    #: ``"log2"`` (τ compares (max − m)·log2 e, as FA4 does) or ``"natural"`` (cuDNN).
    rescale_unit: RescaleUnit = "log2"
    #: ``"none"``, or ``"pow2"``: the P scale applied is S·2^-τ (cuDNN), so the largest P·S a lagging
    #: max allows is S·e^τ·2^-τ (natural units).
    rescale_compensation: RescaleCompensation = "none"

    # --- The learned sink's prescale ---------------------------------------------------------------
    #: In the exponent mode, how the sink's term in ℓ takes the prescale log2 S that every P carries:
    #: ``"exp2"`` — exp2(s_L·log2 e − m·log2 e + log2 S) = S·exp(s_L − m), what ℓ holds (exact);
    #: ``"exp"`` — exp(s_L − m + log2 S) = e^(log2 S)·exp(s_L − m), TensorRT-LLM fmha_v2's e4m3 epilogue
    #: on its non-exp2f path (ALiBi or logit soft-capping): e^8 instead of 2^8 at S = 256, the sink
    #: weighted (e/2)^8 ≈ 11.6× too much. Other scale modes: ``"exp2"`` (normalised; nothing to take).
    sink_prescale: SinkPrescale = "exp2"
    # --- Query tiles: the tile-amax scale and skip-softmax ---------------------------------------
    #: Query rows per tile (BLOCK_M): the rows that share one ``"tile_amax"`` scale and one skip-softmax
    #: vote. A call's rows are tiled from its first row (row r in tile r // block_q); a last partial tile
    #: is padded with rows whose Q is zero (aiter loads them as 0): their logits are 0, so their P is 1
    #: on every key the tile's last real row sees, which raises the tile's amax to 1 (they never block a
    #: skip). A causally hidden or masked key has P = 0 and raises no amax; a row with nothing visible
    #: in the tile changes no other row's scale and votes to skip. 0 where neither axis acts; ≥ 1 with
    #: ``scale_mode="tile_amax"`` or a skip threshold (1: per row).
    block_q: int = 0
    #: λ in [0, 1) (0 = no tile is skipped). Skip-softmax (TensorRT-LLM fmha_v2 ``ENABLE_SKIP_SOFTMAX``,
    #: FlashInfer trtllm-gen ``skip_softmax_threshold_scale_factor`` / KV length; BLASST, arXiv
    #: 2512.12087): a KV block is skipped for a query tile when every row of it has
    #: exp(rowmax Z_j − m) < λ, with m its running max *before* the block; a skipped block adds to
    #: neither O nor ℓ (renormalised, not zeroed) and leaves m as it is. For λ < 1 the test against the
    #: max after the block's update decides the same; a row whose running max is still −inf never votes
    #: to skip. Like S, a number of the program (:meth:`program`).
    skip_softmax_threshold: float = 0.0
    # --- What P is taken against, and its precision before the cast --------------------------------
    #: What the exponential subtracts, P = exp(Z − offset): ``"running_max"`` (Algorithm 1: the running
    #: max after the block); ``"block_max"`` (the block's own max, so every block's largest P is 1: the
    #: block's P8·V and ΣP are multiplied by β = exp(m_block − m_new) after the product, as JAX's TPU
    #: ragged paged attention does; no block collapses under a sink in another block, the control);
    #: ``"row_lse"`` (the row's log-sum-exp: P = exp(Z − m_row)/ℓ_row, the normalised softmax from a
    #: first pass over the row, is what is cast, and the output is O/S: an unfused softmax whose output
    #: is quantized, TensorRT's and LiteRT's; a learned sink is one more column of that softmax, so
    #: ``sink_mode`` does not act and reads ``"epilogue"``). ``"row_lse"`` needs the multiply scale mode,
    #: one KV split, no lazy rescale, the FP32 softmax and no MMA accumulator model; ``"block_max"`` no
    #: lazy rescale.
    p_offset: POffset = "running_max"
    #: ``"f32"``, or ``"f16"``: P is computed and held in float16 before the cast (trtllm-gen's
    #: ``use_fp16_softmax``): the exponential's FP32 result rounded to float16, then P·S rounded to
    #: float16, then cast; ℓ sums the float16 P in FP32. Needs P·S ≤ 65504 (S·2^-τ… ≤ the float16
    #: max, no lazy rescale).
    softmax: SoftmaxPrecision = "f32"

    # --- Label ------------------------------------------------------------------------------------
    #: A label for reports, not part of the identity: two configs are equal (and hash alike) when their
    #: semantics are, whatever their names. Empty → :meth:`default_name`.
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        check_choice("order", self.order, ORDERS)
        scale = check_positive("scale", self.scale)
        if not SCALE_MIN <= scale <= SCALE_MAX:
            raise PcastError(f"scale={self.scale!r} must lie in [2^-100, 2^100] "
                             "(S, 1/S and S·ℓ must stay finite, nonzero float32 numbers)")
        object.__setattr__(self, "scale", scale)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        object.__setattr__(self, "block_kv", check_int("block_kv", self.block_kv, min_value=1, max_value=1 << 16))
        # a dtype (jnp.float8_e5m2, ml_dtypes.float8_e4m3fn, np.dtype(...)) is stored as its format's name
        for key, names in (("p_format", numberline.P_FORMATS), ("accumulator", ACCUMULATORS), ("qkv", QKV_PRECISIONS)):
            object.__setattr__(self, key, numberline.format_name(getattr(self, key), param=key, choices=names))
        check_choice("p_format", self.p_format.lower() if isinstance(self.p_format, str) else self.p_format,
                     numberline.P_FORMATS)
        check_choice("overflow", self.overflow, numberline.OVERFLOW_MODES)
        check_choice("accumulator", self.accumulator, ACCUMULATORS)
        check_choice("qkv", self.qkv, QKV_PRECISIONS)
        check_choice("qkv_granularity", self.qkv_granularity, QKV_GRANULARITIES)
        if self.scale_mode in COMPUTED_SCALE_MODES:
            object.__setattr__(self, "scale", 1.0)
        if self.qkv == "f32":
            object.__setattr__(self, "qkv_granularity", "tensor")
        if not isinstance(self.causal, bool):
            raise PcastError(f"causal={self.causal!r} must be True or False")
        object.__setattr__(self, "kv_splits", check_int("kv_splits", self.kv_splits, min_value=1, max_value=1 << 16))
        check_choice("split_layout", self.split_layout, SPLIT_LAYOUTS)
        if self.kv_splits == 1:
            object.__setattr__(self, "split_layout", "contiguous")
        object.__setattr__(self, "f16_round_keys", check_int("f16_round_keys", self.f16_round_keys, min_value=0,
                                                             max_value=1 << 16))
        if self.f16_round_keys and self.block_kv % self.f16_round_keys:
            raise PcastError(f"f16_round_keys={self.f16_round_keys} must divide block_kv={self.block_kv}")
        if isinstance(self.v_channel_max, (bool, np.bool_)) or not isinstance(self.v_channel_max,
                                                                               (int, float, np.integer, np.floating)):
            raise PcastError(f"v_channel_max={self.v_channel_max!r} must be a number >= 0")
        v_max = float(self.v_channel_max)
        if not (math.isfinite(v_max) and 0.0 <= v_max <= F32_MAX):
            raise PcastError(f"v_channel_max={self.v_channel_max!r} must be a number >= 0, finite in float32")
        object.__setattr__(self, "v_channel_max", v_max)
        if self.accumulator == "f32" or self.f16_round_keys == self.block_kv:
            object.__setattr__(self, "f16_round_keys", 0)
        if self.accumulator == "f32":
            object.__setattr__(self, "v_channel_max", 0.0)
        self._check_mma()
        self._check_sink_and_rescale()
        self._check_query_tiles()
        self._check_p_knobs()
        bf = self.block_format
        if bf is not None:
            if self.block_kv % bf.block:
                raise PcastError(f"p_format={self.p_format!r} scales blocks of {bf.block} keys, which must tile "
                                 f"block_kv={self.block_kv}")
            if self.scale_mode in COMPUTED_SCALE_MODES:
                raise PcastError(f"p_format={self.p_format!r} carries its own block scales: "
                                 f"scale_mode={self.scale_mode!r} is not supported with it")
            if self.accumulator != "f32":
                raise PcastError(f"p_format={self.p_format!r} needs accumulator='f32' (the block scale is "
                                 "multiplied back into the FP32 accumulator)")
        if not isinstance(self.name, str):
            raise PcastError(f"name={self.name!r} must be a string")
        if len(self.name) > 200 or not self.name.isprintable():  # it labels one-line errors and table cells
            raise PcastError(f"name={self.name[:40]!r} must be one printable line of at most 200 characters")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    def _check_sink_and_rescale(self) -> None:
        """Validates ``sink_mode`` and the lazy-rescale fields; unit and compensation normalised at τ = 0."""
        check_choice("sink_mode", self.sink_mode, SINK_MODES)
        tau = self.rescale_threshold
        if isinstance(tau, (bool, np.bool_)) or not isinstance(tau, (int, float, np.integer, np.floating)):
            raise PcastError(f"rescale_threshold={tau!r} must be a number in [0, {RESCALE_THRESHOLD_MAX:g}]")
        tau = float(tau)
        if not (math.isfinite(tau) and 0.0 <= tau <= RESCALE_THRESHOLD_MAX):
            raise PcastError(f"rescale_threshold={self.rescale_threshold!r} must be a number in "
                             f"[0, {RESCALE_THRESHOLD_MAX:g}] (0: the running max follows every block)")
        object.__setattr__(self, "rescale_threshold", tau)
        check_choice("rescale_unit", self.rescale_unit, RESCALE_UNITS)
        check_choice("rescale_compensation", self.rescale_compensation, RESCALE_COMPENSATIONS)
        check_choice("sink_prescale", self.sink_prescale, SINK_PRESCALES)
        if self.scale_mode != "exponent":  # only the exponent mode folds log2 S into the sink's term
            object.__setattr__(self, "sink_prescale", "exp2")
        if tau == 0.0:  # no lag: neither the unit nor a 2^-0 compensation acts
            object.__setattr__(self, "rescale_unit", "log2")
            object.__setattr__(self, "rescale_compensation", "none")
        if self.rescale_compensation == "pow2" and self.scale_mode in COMPUTED_SCALE_MODES:
            raise PcastError(f"rescale_compensation='pow2' scales a static S; scale_mode={self.scale_mode!r} "
                             "has none")
        s_eff = self.effective_scale
        if not SCALE_MIN <= s_eff <= SCALE_MAX:
            raise PcastError(f"scale·2^-rescale_threshold = {s_eff!r} must lie in [2^-100, 2^100]")

    def _check_query_tiles(self) -> None:
        """Validates ``skip_softmax_threshold`` and ``block_q`` (0 where neither the tile-amax scale nor a
        skip threshold acts, so equality stays semantic)."""
        lam = self.skip_softmax_threshold
        if isinstance(lam, (bool, np.bool_)) or not isinstance(lam, (int, float, np.integer, np.floating)):
            raise PcastError(f"skip_softmax_threshold={lam!r} must be a number in [0, 1)")
        lam = float(lam)
        if not (math.isfinite(lam) and 0.0 <= lam < 1.0):
            raise PcastError(f"skip_softmax_threshold={self.skip_softmax_threshold!r} must be a number in [0, 1) "
                             "(0: no tile is skipped; λ ≥ 1 would skip a block that raises the running max)")
        if lam and not math.isfinite(math.log(np.float32(lam))):
            raise PcastError(f"skip_softmax_threshold={lam!r} must be 0 or a positive float32 number")
        object.__setattr__(self, "skip_softmax_threshold", lam)
        block_q = check_int("block_q", self.block_q, min_value=0, max_value=1 << 16)
        if self.scale_mode != "tile_amax" and not lam:
            block_q = 0  # no query tile acts
        elif not block_q:
            why = "scale_mode='tile_amax'" if self.scale_mode == "tile_amax" else f"skip_softmax_threshold={lam:g}"
            raise PcastError(f"block_q=0 with {why}: a query tile needs block_q >= 1 rows (1: each row on its own)")
        object.__setattr__(self, "block_q", block_q)
    def _check_p_knobs(self) -> None:
        """Validates ``p_offset``, ``softmax`` and the fixed-point P formats (PcastError naming the field)."""
        check_choice("p_offset", self.p_offset, P_OFFSETS)
        check_choice("softmax", self.softmax, SOFTMAX_PRECISIONS)
        if self.fmt.is_integer and self.overflow != "satfinite":
            raise PcastError(f"overflow={self.overflow!r}: p_format={self.p_format!r} is an integer format, which "
                             "clips to its range (use overflow='satfinite')")
        if self.p_offset != "running_max" and self.rescale_threshold:
            raise PcastError(f"p_offset={self.p_offset!r} takes P against a max that never lags: "
                             f"rescale_threshold={self.rescale_threshold:g} must be 0")
        if self.p_offset == "row_lse":
            needs = (("scale_mode", "multiply"), ("kv_splits", 1), ("softmax", "f32"), ("mma_acc_bits", 0))
            for key, value in needs:
                if getattr(self, key) != value:
                    raise PcastError(f"p_offset='row_lse' (P normalised before the cast, output O/S) needs "
                                     f"{key}={value!r}, got {getattr(self, key)!r}")
            object.__setattr__(self, "sink_mode", "epilogue")  # the sink is a column of the normalised softmax
        if (self.p_offset != "running_max" or self.softmax != "f32") and self.block_q:
            what = "scale_mode='tile_amax'" if self.scale_mode == "tile_amax" else "skip-softmax"
            changed = "p_offset" if self.p_offset != "running_max" else "softmax"
            raise PcastError(f"{changed}={getattr(self, changed)!r} with {what} is not modelled: use "
                             f"{changed}={_FIELD_DEFAULTS[changed]!r} or neither query-tile axis")
        if self.softmax == "f16":
            if self.rescale_threshold:
                raise PcastError(f"softmax='f16' with rescale_threshold={self.rescale_threshold:g}: a lagging max "
                                 "lets P exceed 1 and P·S overflow float16 (not modelled); use rescale_threshold=0")
            if self.scale_mode != "dynamic" and self.effective_scale > F16_MAX:
                raise PcastError(f"scale={self.scale!r} with softmax='f16': P·S is held in float16, so S must "
                                 f"be at most {F16_MAX:g}")

    def _check_mma(self) -> None:
        """Validates and normalises ``mma_acc_bits`` / ``mma_promote_keys`` (PcastError naming them)."""
        bits = check_int("mma_acc_bits", self.mma_acc_bits, min_value=0, max_value=MMA_ACC_BITS_MAX)
        object.__setattr__(self, "mma_acc_bits", bits)
        keys = check_int("mma_promote_keys", self.mma_promote_keys, min_value=0, max_value=1 << 16)
        if not bits:  # exact FP32: where the MMA would promote does not act
            object.__setattr__(self, "mma_promote_keys", 0)
            return
        if self.accumulator != "f32":
            raise PcastError(f"mma_acc_bits={bits} needs accumulator='f32' (the f16 accumulator is its own "
                             "model: f16_round_keys)")
        if self.block_format is not None:
            raise PcastError(f"mma_acc_bits={bits} is not modelled with the block-scaled p_format="
                             f"{self.p_format!r}: use an element format")
        if self.block_kv % MMA_K:
            raise PcastError(f"block_kv={self.block_kv} must be a multiple of the MMA K = {MMA_K} keys with "
                             f"mma_acc_bits={bits}")
        if keys and (keys % MMA_K or self.block_kv % keys):
            raise PcastError(f"mma_promote_keys={keys} must be a multiple of {MMA_K} that divides "
                             f"block_kv={self.block_kv} (or 0: never promoted)")
        if not keys and self.scale_mode in COMPUTED_SCALE_MODES:
            raise PcastError(f"scale_mode={self.scale_mode!r} needs mma_promote_keys > 0 with mma_acc_bits: its "
                             "per-block inverse scale multiplies the block's product outside the MMA accumulator")
        object.__setattr__(self, "mma_promote_keys", keys)

    def default_name(self) -> str:
        """``fwd_s1``-style label naming every field that differs from its default.

        Order (``fwd`` or ``rev``, as the presets spell it: an unnamed forward S=256 config is
        ``fwd_s256``, like the preset) and scale always appear; then ``_exp`` (exponent mode),
        ``_b128`` (block_kv), ``_e5m2`` (P format), ``_nan`` (overflow), ``_f16acc`` (with ``_r32``
        for f16_round_keys and ``_v2.25`` for v_channel_max), ``_qkv8`` / ``_qkv8h`` (E4M3 Q/K/V per tensor / per head),
        ``_causal``, ``_split8`` / ``_split8s`` (kv_splits, contiguous / strided), ``_acc14`` (the
        MMA accumulator model, never promoted) / ``_acc14p128`` (promoted every 128 keys),
        ``_sinkinit`` / ``_sinkblock`` (sink_mode), ``_tau4`` (lazy rescale, log2 units; ``n`` for
        natural units, ``c`` for the 2^-τ compensation), ``_sinkexp`` (sink_prescale), ``_q128`` (block_q;
        ``samax`` in place of the scale for the tile-amax mode), ``_skip0.001`` (skip_softmax_threshold),
        ``_blockmax`` / ``_rowlse`` (p_offset) and ``_f16softmax`` (softmax). Two configs with
        different semantics never share a default name.
        """
        computed = {"dynamic": "sdyn", "tile_amax": "samax"}
        parts = [{"forward": "fwd", "reverse": "rev"}[self.order],
                 computed.get(self.scale_mode) or "s" + repr(self.scale).removesuffix(".0")]
        if self.scale_mode == "exponent":
            parts.append("exp")
        if self.block_kv != _DEFAULT_BLOCK_KV:
            parts.append(f"b{self.block_kv}")
        if self.p_format != "e4m3":
            parts.append(self.p_format)
        if self.overflow != "satfinite":
            parts.append(self.overflow)
        if self.accumulator != "f32":
            parts.append(f"{self.accumulator}acc")
        if self.f16_round_keys:
            parts.append(f"r{self.f16_round_keys}")
        if self.v_channel_max:
            parts.append("v" + repr(self.v_channel_max).removesuffix(".0"))
        if self.qkv == "e4m3":
            parts.append("qkv8h" if self.qkv_granularity == "head" else "qkv8")
        if self.causal:
            parts.append("causal")
        if self.kv_splits > 1:
            parts.append(f"split{self.kv_splits}" + ("s" if self.split_layout == "strided" else ""))
        if self.mma_acc_bits:
            parts.append(f"acc{self.mma_acc_bits}" + (f"p{self.mma_promote_keys}" if self.mma_promote_keys else ""))
        if self.sink_mode != "epilogue":
            parts.append("sink" + {"init_max": "init", "block_max": "block"}[self.sink_mode])
        if self.rescale_threshold:
            parts.append("tau" + repr(self.rescale_threshold).removesuffix(".0")
                         + ("n" if self.rescale_unit == "natural" else "")
                         + ("c" if self.rescale_compensation == "pow2" else ""))
        if self.sink_prescale != "exp2":
            parts.append("sinkexp")
        if self.block_q:
            parts.append(f"q{self.block_q}")
        if self.skip_softmax_threshold:
            parts.append("skip" + repr(self.skip_softmax_threshold))
        if self.p_offset != "running_max":
            parts.append({"block_max": "blockmax", "row_lse": "rowlse"}[self.p_offset])
        if self.softmax != "f32":
            parts.append(f"{self.softmax}softmax")
        return "_".join(parts)

    def to_dict(self) -> dict:
        """Every field as a plain value; :meth:`from_dict` reads it back.

        ``qkv_granularity`` is written only where it acts (E4M3 Q/K/V); ``sink_prescale``, ``block_q``,
        ``skip_softmax_threshold``, ``p_offset`` and ``softmax`` only where they differ from their defaults
        (where they act): two configs that compute the same thing have one dict, and so one sweep
        fingerprint, and a config that sets none of them keeps the dict it had before they existed.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.qkv == "f32":
            del d["qkv_granularity"]
        for key in _WRITTEN_WHEN_SET:
            if d[key] == _FIELD_DEFAULTS[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        """A config from :meth:`to_dict`'s form; an unknown key raises :class:`PcastError` naming it."""
        if not isinstance(d, dict):
            raise PcastError(f"a kernel config must be a mapping of field names to values, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PcastError(f"unknown KernelConfig field(s) {', '.join(map(repr, unknown))}; "
                             f"fields are {', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def from_string(cls, text: str) -> "KernelConfig":
        """A config from ``"key=value,key=value"`` (``"name=mine,order=reverse,scale=64,accumulator=f16"``).

        Every field is a key; each value is read as its field's type (``scale=2^8.807`` and
        ``scale=2**-3`` are accepted for numbers, ``true``/``false``/``yes``/``no``/``1``/``0`` for flags,
        and a flag alone, ``causal``, means true). Fields not given keep their defaults. Unknown keys,
        values that do not parse or validate, and keys given twice raise :class:`PcastError` naming the key.
        """
        if not isinstance(text, str):
            raise PcastError(f"a kernel config string must be a str, got {text!r}")
        hints = _field_types(cls)
        values: dict = {}
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise PcastError(f"kernel config {text!r} must be key=value items separated by commas, "
                             f"keys among {', '.join(hints)}")
        for item in items:
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if key not in hints:
                raise PcastError(f"unknown KernelConfig field {key!r} in {text!r}; fields are {', '.join(hints)}")
            if key in values:
                raise PcastError(f"KernelConfig field {key!r} is given twice in {text!r}")
            if not sep:
                if hints[key] is not bool:
                    raise PcastError(f"KernelConfig field {key!r} needs a value ({key}=...) in {text!r}")
                raw = "true"
            values[key] = _parse_field(key, raw, hints[key])
        try:
            return cls(**values)
        except PcastError as exc:
            raise PcastError(f"kernel config {text!r}: {exc}") from None

    def to_string(self) -> str:
        """``"name=...,key=value,..."`` naming every field that differs from its default; :meth:`from_string`
        reads it back to an equal config with the same name.

        A derived name (none was given) is left out, so that the config read back derives it again
        (and keeps its fingerprint); ``order`` is written when no field differs (``"order=forward"``).
        """
        parts = [] if self.name == self.default_name() else [f"name={self.name}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value == f.default:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, float):
                text = repr(value).removesuffix(".0")
            else:
                text = str(value)
            parts.append(f"{f.name}={text}")
        return ",".join(parts or [f"order={self.order}"])

    @property
    def fmt(self) -> numberline.FP8Format:
        """The element format of the P-cast (E2M1/E4M3 for the block-scaled formats)."""
        bf = self.block_format
        return bf.element if bf is not None else numberline.get_format(self.p_format)

    @property
    def block_format(self) -> numberline.BlockFormat | None:
        """The block-scaled P format, or None for a plain element format with the one scale S."""
        return numberline.BLOCK_FORMATS.get(self.p_format.lower())

    @property
    def effective_scale(self) -> float:
        """The P scale the kernel applies: S, or S·2^-τ with the ``"pow2"`` rescale compensation."""
        if self.rescale_compensation == "pow2":
            return self.scale * 2.0 ** -self.rescale_threshold
        return self.scale

    @property
    def log2_scale(self) -> float:
        """log2 of :attr:`effective_scale` (what the exponent mode adds in the exp2)."""
        return math.log2(self.effective_scale)

    @property
    def rescale_gap(self) -> float:
        """τ in the logits' natural-log units: τ·ln 2 for ``"log2"``, τ for ``"natural"`` (0: no lag)."""
        return self.rescale_threshold * (math.log(2.0) if self.rescale_unit == "log2" else 1.0)

    @property
    def skip_log_threshold(self) -> float:
        """ln λ of the skip-softmax test (−inf when ``skip_softmax_threshold`` is 0)."""
        return math.log(self.skip_softmax_threshold) if self.skip_softmax_threshold else -math.inf

    @property
    def scale_is_power_of_two(self) -> bool:
        """Prop. 5: ×S and ×(1/S) are exact in FP32 iff S = 2^k."""
        m, _ = math.frexp(self.scale)
        return m == 0.5

    def numbers(self) -> Numbers:
        """The config's :class:`Numbers`, computed on the host in float64 and rounded to float32 once, as
        a compiled program holding them as constants rounds them."""
        return Numbers(*(np.float32(x) for x in (self.effective_scale, self.log2_scale, self.rescale_gap,
                                                   self.v_channel_max, self.skip_log_threshold)))

    def program(self) -> "KernelConfig":
        """The config with its numbers replaced by stand-ins: configs with the same program compute
        with the same operations and differ only in their :meth:`numbers`.

        ``scale`` becomes 1; ``rescale_threshold`` and ``v_channel_max`` become 1 and
        ``skip_softmax_threshold`` 0.5 where they are not 0 (0 selects another program: no lag, V as it
        is, no tile skipped). Bind numbers to it under ``jax.jit``::

            f = jax.jit(lambda s, v, nums: engine.attention(s, v, cfg.program().bind(nums)).out)
            f(scores, v, cfg.numbers())   # one program for every config with cfg's program
        """
        return dataclasses.replace(self, scale=1.0, rescale_threshold=float(bool(self.rescale_threshold)),
                                   v_channel_max=float(bool(self.v_channel_max)),
                                   skip_softmax_threshold=0.5 * bool(self.skip_softmax_threshold), name="")

    def bind(self, numbers: Numbers, *, name: str | None = None) -> "BoundConfig":
        """This program with ``numbers`` (traced or concrete): a :class:`BoundConfig` labelled ``name``
        (default: the program's)."""
        if type(self) is not KernelConfig or self != self.program():
            raise PcastError("bind() takes a program (KernelConfig.program()), not a config with its own numbers")
        if not isinstance(numbers, Numbers):
            raise PcastError(f"numbers={numbers!r} must be a Numbers (KernelConfig.numbers())")
        return BoundConfig._make(self, numbers, self.name if name is None else name)

    def replace(self, **changes) -> "KernelConfig":
        """A copy with fields changed; its name is re-derived unless given.

        (``dataclasses.replace`` works too and keeps the label as it is.)
        """
        if "name" not in changes:
            changes["name"] = ""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        computed = {"dynamic": "dynamic 2^k", "tile_amax": f"tile amax per {self.block_q} query rows"}
        s = computed.get(self.scale_mode) or f"S={self.scale:g} ({self.scale_mode})"
        extra = []
        if self.p_format != "e4m3":
            extra.append(f"P in {self.p_format}")
        if self.accumulator != "f32":
            extra.append(f"{self.accumulator} PV accumulator")
        if self.qkv != "f32":
            extra.append(f"{self.qkv} QKV per {self.qkv_granularity}")
        if self.causal:
            extra.append("causal")
        if self.kv_splits > 1:
            extra.append(f"{self.kv_splits} {self.split_layout} KV splits")
        if self.mma_acc_bits:
            where = (f"promoted to FP32 every {self.mma_promote_keys} keys" if self.mma_promote_keys
                     else "never promoted")
            extra.append(f"{self.mma_acc_bits}-bit MMA accumulator model, {where}")
        if self.sink_mode != "epilogue":
            where = "the initial running max" if self.sink_mode == "init_max" else "every block max"
            extra.append(f"learned sink as {where}")
        if self.rescale_threshold:
            comp = f", P scale S·2^-{self.rescale_threshold:g}" if self.rescale_compensation == "pow2" else ""
            extra.append(f"lazy rescale τ={self.rescale_threshold:g} ({self.rescale_unit}){comp}")
        if self.sink_prescale != "exp2":
            extra.append("learned sink's prescale as e^(log2 S)")
        if self.skip_softmax_threshold:
            extra.append(f"skip-softmax λ={self.skip_softmax_threshold:g} per {self.block_q} query rows")
        if self.p_offset != "running_max":
            extra.append({"block_max": "P against the block's own max",
                          "row_lse": "P normalised before the cast"}[self.p_offset])
        if self.softmax != "f32":
            extra.append(f"P held in {self.softmax}")
        tail = (", " + ", ".join(extra)) if extra else ""
        return f"{self.order}, {s}, B={self.block_kv}{tail}"



#: The fields :meth:`KernelConfig.numbers` carries (a :class:`BoundConfig` holds them as NaN).
_NUMERIC_FIELDS = ("scale", "rescale_threshold", "v_channel_max", "skip_softmax_threshold")
#: Fields :meth:`KernelConfig.to_dict` writes only where they differ from their defaults.
_WRITTEN_WHEN_SET = ("sink_prescale", "block_q", "skip_softmax_threshold", "p_offset", "softmax")
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelConfig)}


class BoundConfig(KernelConfig):
    """A program (:meth:`KernelConfig.program`) with its :class:`Numbers`, which may be traced.

    It is a :class:`KernelConfig` everywhere the simulator takes one: the derived numbers
    (:attr:`effective_scale`, :attr:`log2_scale`, :attr:`rescale_gap`, :meth:`numbers`) are the bound
    ones. The numeric fields themselves are NaN where they are not 0 (their zero or non-zero still
    selects the program), so code that reads a field instead of a bound number computes NaN, never
    another config's value. Compared and hashed by identity; it cannot be saved (:meth:`to_dict`).
    """

    __slots__ = ("_program", "_numbers")
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @classmethod
    def _make(cls, program: KernelConfig, numbers: Numbers, name: str) -> "BoundConfig":
        self = object.__new__(cls)
        for f in dataclasses.fields(KernelConfig):
            object.__setattr__(self, f.name, getattr(program, f.name))
        object.__setattr__(self, "name", name)
        for name in _NUMERIC_FIELDS:
            if name == "scale" or getattr(program, name):
                object.__setattr__(self, name, math.nan)
        object.__setattr__(self, "_program", program)
        object.__setattr__(self, "_numbers", numbers)
        return self

    @property
    def effective_scale(self):
        return self._numbers.effective_scale

    @property
    def log2_scale(self):
        return self._numbers.log2_scale

    @property
    def rescale_gap(self):
        return self._numbers.rescale_gap

    @property
    def skip_log_threshold(self):
        return self._numbers.skip_log_threshold

    def numbers(self) -> Numbers:
        return self._numbers

    def program(self) -> KernelConfig:
        return self._program

    def replace(self, **changes) -> "BoundConfig":
        """The program with ``changes`` (no numeric field), bound to the same numbers."""
        numeric = sorted(set(changes) & set(_NUMERIC_FIELDS))
        if numeric:
            raise PcastError(f"a BoundConfig's numbers are bound: replace {numeric} on the config, then bind")
        name = changes.pop("name", self.name)
        return BoundConfig._make(self._program.replace(**changes).program(), self._numbers, name)

    def to_dict(self) -> dict:
        raise PcastError("a BoundConfig holds bound (possibly traced) numbers: save the config it was made from")


def scale_candidates(config: KernelConfig) -> tuple[float, ...]:
    """The ``scale`` values a safe-scale scan tries: 1, 2, 4, … up to the largest power of two whose
    applied scale (:attr:`KernelConfig.effective_scale`, S·2^-τ under cuDNN's compensation) is at
    most the P format's largest finite value (448 for E4M3: 1 … 256)."""
    applied_per_unit = config.replace(scale=1.0).effective_scale
    top = max(0, math.floor(math.log2(config.fmt.max / applied_per_unit)))
    return tuple(float(2 ** e) for e in range(top + 1))


def _field_types(cls) -> dict[str, type]:
    """Field name → the type its string form is parsed to (the annotation, else the default's type)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: use the defaults
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        if not isinstance(t, type):
            t = type(f.default) if f.default is not dataclasses.MISSING else str
        out[f.name] = t
    return out


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _power(base: float, exp: float, sign: float) -> float:
    """``sign · base^exp`` for a finite base > 0 and a finite exponent; ValueError otherwise."""
    if not (0 < base < math.inf and math.isfinite(exp)):
        raise ValueError("not a power")
    return sign * base**exp


def _parse_field(key: str, raw: str, kind: type):
    """One value of :meth:`KernelConfig.from_string`, as ``kind``; PcastError naming ``key``."""
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise PcastError(f"{key}={raw!r} must be true or false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise PcastError(f"{key}={raw!r} must be an integer") from None
    if kind is float:
        text = raw.replace("**", "^").strip()
        sign = -1.0 if text.startswith("-") else 1.0  # -2^2 is -(2^2), as written in mathematics
        base, op, exp = text.lstrip("+-").partition("^")
        try:
            value = float(text) if not op else _power(float(base), float(exp), sign)
        except (ValueError, OverflowError):
            raise PcastError(f"{key}={raw!r} must be a number (e.g. 256, 0.5, 2^8.807; a power's base "
                             "> 0, both finite)") from None
        if not math.isfinite(value):
            raise PcastError(f"{key}={raw!r} must be finite")
        return value
    if kind is str:
        if not raw:
            raise PcastError(f"{key}= needs a value")
        return raw
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise PcastError(f"{key}={raw!r}: {exc}") from None
