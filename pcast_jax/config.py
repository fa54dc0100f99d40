"""What an FP8 attention kernel does at the P-cast: :class:`KernelConfig` (presets: :mod:`pcast_jax.presets`).

One module, over 600 lines: :class:`KernelConfig` is one definition — its fields, each declared once with
everything derived from it, the rules between them (:data:`RULES`), its names, dicts and strings, and the
bound form the engines take (:class:`BoundConfig`, a subclass that :meth:`KernelConfig.bind` makes); how a
field is declared, checked and read from text, knowing no field, is ``pcast_jax.knob``.

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
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

from pcast_jax import numberline
from pcast_jax.errors import F32_MAX, PcastError, check_positive
from pcast_jax.knob import (
    PALLAS_KERNELS,
    Knob,
    Refusal,
    Unfitted,
    declared_knobs,
    field_types,
    format_named,
    knob,
    one_of,
    parse_field,
    ranged_int,
    real_number,
)

__all__ = ["KernelConfig", "Numbers", "BoundConfig", "Knob", "knob", "Unfitted", "Refusal", "Rule", "KNOBS", "RULES",
           "NUMERIC_FIELDS", "PALLAS_KERNELS", "choices", "declared_knobs",
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


# ------------------------------------------------------------------------------------------------
# The fields' own checks and words (how a field is declared: pcast_jax.knob)
# ------------------------------------------------------------------------------------------------

def _num(x) -> str:
    """A number as a name writes it: ``repr`` without a trailing ``.0`` (``256``, ``2.25``, ``0.001``)."""
    return repr(x).removesuffix(".0")


def _words(spec: str | Callable | None, cfg, field: str) -> str:
    """A field's part of the name (or phrase of the description) in ``cfg`` (:class:`Knob`)."""
    if spec is None:
        return ""
    if callable(spec):
        return spec(cfg)
    value = getattr(cfg, field)
    return spec.format(_num(value) if isinstance(value, float) else value) if value != _FIELD_DEFAULTS[field] else ""


def _check_scale(value) -> float:
    scale = check_positive("scale", value)
    if not SCALE_MIN <= scale <= SCALE_MAX:
        raise PcastError(f"scale={value!r} must lie in [2^-100, 2^100] "
                         "(S, 1/S and S·ℓ must stay finite, nonzero float32 numbers)")
    return scale


def _check_causal(value) -> bool:
    if not isinstance(value, bool):
        raise PcastError(f"causal={value!r} must be True or False")
    return value


def _check_v_channel_max(value) -> float:
    v_max = real_number("v_channel_max", value, "a number >= 0")
    if not (math.isfinite(v_max) and 0.0 <= v_max <= F32_MAX):
        raise PcastError(f"v_channel_max={value!r} must be a number >= 0, finite in float32")
    return v_max


def _check_rescale_threshold(value) -> float:
    tau = real_number("rescale_threshold", value, f"a number in [0, {RESCALE_THRESHOLD_MAX:g}]")
    if not (math.isfinite(tau) and 0.0 <= tau <= RESCALE_THRESHOLD_MAX):
        raise PcastError(f"rescale_threshold={value!r} must be a number in "
                         f"[0, {RESCALE_THRESHOLD_MAX:g}] (0: the running max follows every block)")
    return tau


def _check_skip(value) -> float:
    lam = real_number("skip_softmax_threshold", value, "a number in [0, 1)")
    if not (math.isfinite(lam) and 0.0 <= lam < 1.0):
        raise PcastError(f"skip_softmax_threshold={value!r} must be a number in [0, 1) "
                         "(0: no tile is skipped; λ ≥ 1 would skip a block that raises the running max)")
    if lam and not np.float32(lam) > 0:  # rounds to 0 in float32: ln λ would be −inf
        raise PcastError(f"skip_softmax_threshold={lam!r} must be 0 or a positive float32 number")
    return lam


def _check_name(value) -> str:
    if not isinstance(value, str):
        raise PcastError(f"name={value!r} must be a string")
    if len(value) > 200 or not value.isprintable():  # it labels one-line errors and table cells
        raise PcastError(f"name={value[:40]!r} must be one printable line of at most 200 characters")
    return value


def _tile_words(c) -> str:
    """What turns a query tile on, as a config names it (the tile-amax scale or skip-softmax)."""
    if c.scale_mode == "tile_amax":
        return "scale_mode='tile_amax'"
    return f"skip_softmax_threshold={c.skip_softmax_threshold:g}"


_COMPUTED_NAME = {"dynamic": "sdyn", "tile_amax": "samax"}



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
    order: Order = knob("forward", at=0, name=lambda c: {"forward": "fwd", "reverse": "rev"}[c.order],
                        says=lambda c: c.order, fit="walk")
    #: KV block size B. N that is not a multiple is padded with masked keys.
    block_kv: int = knob(_DEFAULT_BLOCK_KV, at=3, name="b{}", says=lambda c: f"B={c.block_kv}",
                         check=ranged_int("block_kv", 1), fit="walk")
    #: Bottom-right aligned causal mask (query i of q_len sits at position N − q_len + i).
    causal: bool = knob(False, at=10, name="causal", says="causal", check=_check_causal,
                        fit=Unfitted("given, not read: the caller says whether the kernel masks causally "
                                     "(identify(causal=...)), and the candidates are masked alike"))

    # --- The P scale S and where it goes ----------------------------------------------------------
    #: The static P scale S, in [2^-100, 2^100]. The ``"dynamic"`` mode ignores it.
    scale: float = knob(1.0, at=1, check=_check_scale, acts=lambda c: c.scale_mode not in COMPUTED_SCALE_MODES,
                        name=lambda c: _COMPUTED_NAME.get(c.scale_mode) or "s" + _num(c.scale),
                        says=lambda c: {"dynamic": "dynamic 2^k", "tile_amax": f"tile amax per {c.block_q} query rows"}
                        .get(c.scale_mode) or f"S={c.scale:g} ({c.scale_mode})",
                        stand_in=lambda v: 1.0, feeds=("effective_scale", "log2_scale"), fit="cast")
    #: ``"multiply"`` (P·S after the exponential, ℓ from unscaled P), ``"exponent"`` (S folded into
    #: the exponent, so ℓ holds S) or ``"dynamic"`` (per row and block the largest 2^k keeping
    #: rowmax(P)·2^k ≤ the format's max); see the module docstring.
    scale_mode: ScaleMode = knob("multiply", at=2, name=lambda c: "exp" if c.scale_mode == "exponent" else "",
                                 fit="cast")

    # --- The cast itself --------------------------------------------------------------------------
    #: Format of the P-cast: an element format (``"e4m3"``, ``"e5m2"``, ``"e2m1"``, …) with the one
    #: scale S, or a block-scaled format (``"mxfp8"``, ``"mxfp4"``: 32 keys per E8M0 scale;
    #: ``"nvfp4"``: 16 keys per UE4M3 scale) applied to P·S along the key axis, each block's scale
    #: multiplied back after its P·V product. Block-scaled formats need blocks that tile ``block_kv``,
    #: the multiply or exponent scale mode and the FP32 accumulator. A dtype (``jnp.float8_e5m2``,
    #: ``ml_dtypes.float8_e4m3fn``) is stored as its format's name.
    p_format: str = knob("e4m3", at=4, name="{}", says="P in {}", check=format_named("p_format", numberline.P_FORMATS),
                         fit="cast", refused=(Refusal(
                             PALLAS_KERNELS, lambda c: c.p_format not in ("e4m3", "e4m3fn", "float8_e4m3fn"),
                             lambda c: f"p_format={c.p_format!r} not supported by the kernels: must be 'e4m3' (E5M2, "
                                       "E2M1 and the block-scaled MXFP8/MXFP4/NVFP4 P formats are simulator-only)"),))
    #: ``"satfinite"`` (Hopper cvt.rn.satfinite; what kernels do) or ``"nan"``.
    overflow: str = knob("satfinite", at=5, name="{}", check=one_of("overflow", numberline.OVERFLOW_MODES),
                         fit=Unfitted("a NaN output is refused, so only the saturating cast is read"),
                         refused=(Refusal(PALLAS_KERNELS, lambda c: c.overflow == "nan" and c.scale_mode != "dynamic"
                                          and c.scale > c.fmt.max,
                                          lambda c: f"overflow='nan' with scale={c.scale:g} > 448 not supported: the "
                                                    "kernels saturate (cvt.rn.satfinite); use overflow='satfinite'"),))

    # --- The P·V product and its accumulator -----------------------------------------------------
    #: ``"f32"``, or ``"f16"``: each block's P8·V product is rounded to float16 before it is added to
    #: the FP32 output (SageAttention2++'s ``fp32+fp16`` PV accumulation). A dtype is accepted.
    accumulator: Accumulator = knob("f32", at=6, name="{}acc", says="{} PV accumulator",
                                    check=format_named("accumulator", ACCUMULATORS), fit="accumulator")
    #: With the f16 accumulator, how many keys one f16 MMA covers: P8·V is rounded to float16 after
    #: every ``f16_round_keys`` keys and the block's f16 result added to the FP32 output. 0 = once per
    #: block.
    f16_round_keys: int = knob(0, at=7, name="r{}", check=ranged_int("f16_round_keys", 0), fit="accumulator",
                               acts=lambda c: c.accumulator != "f32" and c.f16_round_keys != c.block_kv,
                               refused=(Refusal(PALLAS_KERNELS, lambda c: c.f16_round_keys % MMA_K,
                                                lambda c: f"f16_round_keys={c.f16_round_keys} not supported by the "
                                                          f"kernels: one FP8 MMA covers a multiple of {MMA_K} keys "
                                                          f"(use 0, {MMA_K}, {2 * MMA_K}, ...)"),))
    #: With the f16 accumulator, V is scaled per channel so that max|V| = this value before the f16
    #: accumulation and the scale multiplied back after it (SageAttention2++ ``quant_v_scale_max``).
    #: 0 = V as it is.
    v_channel_max: float = knob(0.0, at=8, name="v{}", check=_check_v_channel_max, fit="accumulator",
                                acts=lambda c: c.accumulator != "f32",
                                stand_in=lambda v: float(bool(v)), feeds=("v_channel_max",))
    #: A *model* (not measured on a GPU) of the FP8 tensor core's "FP32" P·V accumulator: 0 = exact
    #: FP32. b in 1..23: the MMA's running partial sum keeps b explicit mantissa bits, truncated toward
    #: zero after every K-step of :data:`MMA_K` = 32 keys (assumption from the DeepSeek-V3 technical
    #: report §3.3.2, "retains around 14 bits"; SageAttention's ``sageattention/core.py`` calls it
    #: "FP32 (actually FP22)"). Needs the FP32 accumulator, an element P format and ``block_kv`` a
    #: multiple of 32.
    mma_acc_bits: int = knob(
        0, at=12, check=ranged_int("mma_acc_bits", 0, MMA_ACC_BITS_MAX),
        name=lambda c: f"acc{c.mma_acc_bits}" + (f"p{c.mma_promote_keys}" if c.mma_promote_keys else "")
        if c.mma_acc_bits else "",
        says=lambda c: f"{c.mma_acc_bits}-bit MMA accumulator model, " + (
            f"promoted to FP32 every {c.mma_promote_keys} keys" if c.mma_promote_keys else "never promoted")
        if c.mma_acc_bits else "",
        fit=Unfitted("the tensor core's accumulator model is not among the candidates", excluded=True),
        refused=(Refusal(PALLAS_KERNELS, lambda c: c.mma_acc_bits,
                         lambda c: f"mma_acc_bits={c.mma_acc_bits} is a simulator model of the tensor core's "
                                   "accumulator: the kernels run the hardware's own (use mma_acc_bits=0 and compare "
                                   "the kernel with simulate_fp8_attention under the model)"),))
    #: With ``mma_acc_bits``, after how many keys the partial sum is promoted into exact FP32 registers.
    #: 0 = never: O lives in the MMA accumulator across all KV blocks (FlashAttention-3, TensorRT-LLM
    #: XQA, hpc-ops before its double-O accumulator); k > 0: a multiple of 32 dividing ``block_kv``
    #: (``block_kv`` = one fresh accumulator per KV tile: hpc-ops now, SageAttention2 on SM90 with
    #: ``pv_accum_dtype="fp32+fp32"``, this package's Pallas kernels; DeepGEMM promotes every 128).
    #: The never-promoted form cannot take the dynamic scale mode.
    mma_promote_keys: int = knob(0, words_of="mma_acc_bits", check=ranged_int("mma_promote_keys", 0),
                                 acts=lambda c: c.mma_acc_bits,
                                 fit=Unfitted("where the MMA accumulator model promotes: the model is not fitted"))

    # --- Q, K and V as the kernel multiplies them -------------------------------------------------
    #: ``"f32"`` keeps Q, K, V exact (isolates the P-cast, as the paper does); ``"e4m3"`` quantizes
    #: them to E4M3 (scale = amax/max_E4M3) as production kernels do. A dtype is accepted.
    qkv: QKVPrecision = knob(
        "f32", at=9, check=format_named("qkv", QKV_PRECISIONS),
        name=lambda c: ("qkv8h" if c.qkv_granularity == "head" else "qkv8") if c.qkv == "e4m3" else "",
        says=lambda c: f"{c.qkv} QKV per {c.qkv_granularity}" if c.qkv != "f32" else "",
        fit=Unfitted("the kernel's own Q/K/V quantization: the probes are exact in E4M3 with power-of-two "
                     "per-tensor scales, so it is lossless on them"))
    #: Where the E4M3 Q/K/V scales live when ``qkv == "e4m3"``: ``"tensor"`` (one per tensor) or
    #: ``"head"`` (one per attention head). Ignored for FP32 Q/K/V.
    qkv_granularity: QKVGranularity = knob("tensor", words_of="qkv", acts=lambda c: c.qkv != "f32", saved="acts",
                                           fit=Unfitted("where E4M3 Q/K/V scales live: Q/K/V quantization is not "
                                                        "read (qkv)"))

    # --- Split-KV (flash-decoding, multi-block) ---------------------------------------------------
    #: The KV blocks are dealt over this many independent Algorithm-1 runs (1 = one run per row), merged
    #: at the end by the FP32 log-sum-exp merge (:func:`pcast_jax.block.merge_splits`).
    kv_splits: int = knob(
        1, at=11, check=ranged_int("kv_splits", 1),
        name=lambda c: f"split{c.kv_splits}" + ("s" if c.split_layout == "strided" else "") if c.kv_splits > 1 else "",
        says=lambda c: f"{c.kv_splits} {c.split_layout} KV splits" if c.kv_splits > 1 else "", fit="split")
    #: ``"contiguous"`` (split s gets a contiguous range of ⌈n_blocks/kv_splits⌉ blocks: FlashAttention-3
    #: ``num_splits``, FlashInfer split-KV) or ``"strided"`` (block b goes to split b mod kv_splits:
    #: TensorRT-LLM XQA multi-block). Each split visits its blocks in ``order``.
    split_layout: SplitLayout = knob("contiguous", words_of="kv_splits", acts=lambda c: c.kv_splits > 1, fit="split")

    # --- Learned sinks ----------------------------------------------------------------------------
    #: Where a learned sink logit s_L goes (one per head, a softmax column with no value row):
    #: ``"epilogue"`` — only in the final denominator, ℓ += exp(s_L − m) (times S where ℓ holds S), the
    #: running max never sees it (FlashInfer, TensorRT-LLM XQA / fmha_v2, FA3's vLLM fork, FA4,
    #: SGLang); ``"init_max"`` — as the initial running max, m = s_L and ℓ = 1 before the first block
    #: (vLLM's Triton unified attention, cuDNN's FP8 SDPA); ``"block_max"`` — folded into every
    #: block's max, ℓ gets it once (vllm-gaudi). Split-KV: ``"init_max"`` and ``"epilogue"`` act in
    #: split 0 only; ``"block_max"`` folds it into every split's max. Without a sink logit it does
    #: not act.
    sink_mode: SinkMode = knob(
        "epilogue", at=13, acts=lambda c: c.p_offset != "row_lse", fit="sink",
        name=lambda c: "sink" + {"init_max": "init", "block_max": "block"}[c.sink_mode] if c.sink_mode != "epilogue"
        else "",
        says=lambda c: "learned sink as " + ("the initial running max" if c.sink_mode == "init_max" else
                                             "every block max") if c.sink_mode != "epilogue" else "")

    # --- Lazy rescale -----------------------------------------------------------------------------
    #: τ ≥ 0 (0 = Algorithm 1: the running max follows every block). With τ > 0 the running max is
    #: raised only when a block's max exceeds it by more than τ (in ``rescale_unit``); until then
    #: P = exp(Z − m) may exceed 1 and P·S may saturate, while ℓ keeps the unclipped P (FA4,
    #: FlashInfer SM100 CuTe-DSL, cuDNN).
    rescale_threshold: float = knob(
        0.0, at=14, check=_check_rescale_threshold, fit="rescale",
        name=lambda c: "tau" + _num(c.rescale_threshold) + ("n" if c.rescale_unit == "natural" else "")
        + ("c" if c.rescale_compensation == "pow2" else "") if c.rescale_threshold else "",
        says=lambda c: f"lazy rescale τ={c.rescale_threshold:g} ({c.rescale_unit})" + (
            f", P scale S·2^-{c.rescale_threshold:g}" if c.rescale_compensation == "pow2" else "")
        if c.rescale_threshold else "",
        stand_in=lambda v: float(bool(v)), feeds=("effective_scale", "log2_scale", "rescale_gap"))
    #: ``"log2"`` (τ compares (max − m)·log2 e, as FA4 does) or ``"natural"`` (cuDNN).
    rescale_unit: RescaleUnit = knob("log2", words_of="rescale_threshold", acts=lambda c: c.rescale_threshold,
                                     fit="rescale")
    #: ``"none"``, or ``"pow2"``: the P scale applied is S·2^-τ (cuDNN), so the largest P·S a lagging
    #: max allows is S·e^τ·2^-τ (natural units).
    rescale_compensation: RescaleCompensation = knob("none", words_of="rescale_threshold", fit="rescale",
                                                     acts=lambda c: c.rescale_threshold)

    # --- The learned sink's prescale ---------------------------------------------------------------
    #: In the exponent mode, how the sink's term in ℓ takes the prescale log2 S that every P carries:
    #: ``"exp2"`` — exp2(s_L·log2 e − m·log2 e + log2 S) = S·exp(s_L − m), what ℓ holds (exact);
    #: ``"exp"`` — exp(s_L − m + log2 S) = e^(log2 S)·exp(s_L − m), TensorRT-LLM fmha_v2's e4m3 epilogue
    #: on its non-exp2f path (ALiBi or logit soft-capping): e^8 instead of 2^8 at S = 256, the sink
    #: weighted (e/2)^8 ≈ 11.6× too much. Other scale modes: ``"exp2"`` (normalised; nothing to take).
    sink_prescale: SinkPrescale = knob(
        "exp2", at=15, name="sinkexp", says="learned sink's prescale as e^(log2 S)", saved="set",
        acts=lambda c: c.scale_mode == "exponent",
        fit=Unfitted("how a learned sink's logit is weighted when P is scaled in the exponent (2^x, or e^x as "
                     "fmha_v2's non-exp2f path does): every candidate weights it 2^x, so a kernel weighting it e^x "
                     "fits no candidate on probes with sinks"))
    # --- Query tiles: the tile-amax scale and skip-softmax ---------------------------------------
    #: Query rows per tile (BLOCK_M): the rows that share one ``"tile_amax"`` scale and one skip-softmax
    #: vote. A call's rows are tiled from its first row (row r in tile r // block_q); a last partial tile
    #: is padded with rows whose Q is zero (aiter loads them as 0): their logits are 0, so their P is 1
    #: on every key the tile's last real row sees, which raises the tile's amax to 1 (they never block a
    #: skip). A causally hidden or masked key has P = 0 and raises no amax; a row with nothing visible
    #: in the tile changes no other row's scale and votes to skip. 0 where neither axis acts; ≥ 1 with
    #: ``scale_mode="tile_amax"`` or a skip threshold (1: per row).
    block_q: int = knob(0, at=16, name="q{}", check=ranged_int("block_q", 0), saved="set", fit="tile",
                        acts=lambda c: c.scale_mode == "tile_amax" or c.skip_softmax_threshold,
                        refused=(Refusal(("mosaic",), lambda c: c.block_q,
                                         lambda c: f"{_tile_words(c)} not supported by the mosaic backend: its tile "
                                                   f"of block_q={c.block_q} query rows needs a reduction across a "
                                                   "warpgroup's rows, which this kernel does not do (use "
                                                   "implementation='triton')"),))
    #: λ in [0, 1) (0 = no tile is skipped). Skip-softmax (TensorRT-LLM fmha_v2 ``ENABLE_SKIP_SOFTMAX``,
    #: FlashInfer trtllm-gen ``skip_softmax_threshold_scale_factor`` / KV length; BLASST, arXiv
    #: 2512.12087): a KV block is skipped for a query tile when every row of it has
    #: exp(rowmax Z_j − m) < λ, with m its running max *before* the block; a skipped block adds to
    #: neither O nor ℓ (renormalised, not zeroed) and leaves m as it is. For λ < 1 the test against the
    #: max after the block's update decides the same; a row whose running max is still −inf never votes
    #: to skip. Like S, a number of the program (:meth:`program`).
    skip_softmax_threshold: float = knob(
        0.0, at=17, name="skip{}", check=_check_skip, saved="set", fit="skip",
        says=lambda c: f"skip-softmax λ={c.skip_softmax_threshold:g} per {c.block_q} query rows"
        if c.skip_softmax_threshold else "",
        stand_in=lambda v: 0.5 * bool(v), feeds=("skip_log_threshold",))
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
    p_offset: POffset = knob(
        "running_max", at=18, saved="set", fit="offset",
        name=lambda c: {"running_max": "", "block_max": "blockmax", "row_lse": "rowlse"}[c.p_offset],
        says=lambda c: {"running_max": "", "block_max": "P against the block's own max",
                        "row_lse": "P normalised before the cast"}[c.p_offset],
        refused=(Refusal(PALLAS_KERNELS, lambda c: c.p_offset == "row_lse",
                         lambda c: "p_offset='row_lse' not supported by the kernels: P normalised before the cast "
                                   "needs the row's whole max and sum first, a second pass over K that these "
                                   "one-pass kernels do not make (simulator-only)"),))
    #: ``"f32"``, or ``"f16"``: P is computed and held in float16 before the cast (trtllm-gen's
    #: ``use_fp16_softmax``): the exponential's FP32 result rounded to float16, then P·S rounded to
    #: float16, then cast; ℓ sums the float16 P in FP32. Needs P·S ≤ 65504 (S·2^-τ… ≤ the float16
    #: max, no lazy rescale).
    softmax: SoftmaxPrecision = knob("f32", at=19, name="{}softmax", says="P held in {}", saved="set", fit="offset")

    # --- Label ------------------------------------------------------------------------------------
    #: A label for reports, not part of the identity: two configs are equal (and hash alike) when their
    #: semantics are, whatever their names. Empty → :meth:`default_name`.
    name: str = knob("", compare=False, check=_check_name,
                     fit=Unfitted("a label, not semantics"))

    def __post_init__(self):
        """Each field's own check (:class:`Knob`), in the order declared; each field that does not act
        normalised to its default; then every rule between fields (:data:`RULES`), in order."""
        for field, spec in KNOBS.items():
            object.__setattr__(self, field, spec.check(getattr(self, field)))
        for rule in RULES:
            if rule.broken(self):
                raise PcastError(rule.says(self))
        for field, spec in KNOBS.items():
            if spec.acts is not None and not spec.acts(self):
                object.__setattr__(self, field, _FIELD_DEFAULTS[field])
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

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
        return "_".join(filter(None, (_words(spec.name, self, f) for f, spec in _WORDS)))

    def to_dict(self) -> dict:
        """Every field as a plain value; :meth:`from_dict` reads it back.

        ``qkv_granularity`` is written only where it acts (E4M3 Q/K/V); ``sink_prescale``, ``block_q``,
        ``skip_softmax_threshold``, ``p_offset`` and ``softmax`` only where they differ from their defaults
        (where they act): two configs that compute the same thing have one dict, and so one sweep
        fingerprint, and a config that sets none of them keeps the dict it had before they existed.
        """
        return {f: getattr(self, f) for f, spec in KNOBS.items()
                if spec.saved == "always" or (spec.acts(self) if spec.saved == "acts"
                                              else getattr(self, f) != _FIELD_DEFAULTS[f])}

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
        hints = field_types(cls)
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
            values[key] = parse_field(key, raw, hints[key])
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

            f = jax.jit(lambda s, v, nums: engine.run(s, v, cfg.program().bind(nums)).out)
            f(scores, v, cfg.numbers())   # one program for every config with cfg's program
        """
        stand_ins = {f: KNOBS[f].stand_in(getattr(self, f)) for f in NUMERIC_FIELDS}
        if all(getattr(self, f) == x for f, x in stand_ins.items()) and self.name == self.default_name():
            return self  # a program already (what bind() checks)
        return dataclasses.replace(self, name="", **stand_ins)

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
        """The config in words: order, scale, block, then what differs from the defaults."""
        return ", ".join(filter(None, (_words(spec.says, self, f) for f, spec in _WORDS)))

    def refusal(self, kernel: str) -> str | None:
        """Why Pallas kernel ``kernel`` (:data:`PALLAS_KERNELS`) refuses this config's semantics, or None:
        the first declared :class:`Refusal` that holds (a kernel's other limits are its own)."""
        for spec in KNOBS.values():
            for r in spec.refused:
                if kernel in r.kernels and r.when(self):
                    return r.why(self)
        return None


def choices(field: str) -> tuple:
    """The values a ``Literal`` field of :class:`KernelConfig` takes (``choices("order")``: forward, reverse)."""
    hint = typing.get_type_hints(KernelConfig)[field]
    if typing.get_origin(hint) is not Literal:
        raise PcastError(f"KernelConfig.{field} is not a Literal field: its values are not a list of choices")
    return typing.get_args(hint)


#: Every field's :class:`Knob`, in declaration order (the order fields are checked in).
KNOBS: dict[str, Knob] = declared_knobs(KernelConfig)
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelConfig)}
#: Fields with words in the default name and description, in the order they are written.
_WORDS = sorted(((f, spec) for f, spec in KNOBS.items() if spec.at is not None), key=lambda item: item[1].at)
#: The fields :meth:`KernelConfig.numbers` carries (a :class:`BoundConfig` holds them as NaN).
NUMERIC_FIELDS: tuple[str, ...] = tuple(f for f, spec in KNOBS.items() if spec.stand_in is not None)


class Rule(NamedTuple):
    """A rule between fields: ``broken(config)`` → :class:`PcastError` ``says(config)``."""

    broken: Callable[[KernelConfig], Any]
    says: Callable[[KernelConfig], str]


def _row_lse_needs(field: str, value) -> Rule:
    return Rule(lambda c: c.p_offset == "row_lse" and getattr(c, field) != value,
                lambda c: f"p_offset='row_lse' (P normalised before the cast, output O/S) needs {field}={value!r}, "
                          f"got {getattr(c, field)!r}")


def _tiles(c: KernelConfig) -> bool:
    """A query-tile axis acts (the tile-amax scale or skip-softmax)."""
    return c.scale_mode == "tile_amax" or bool(c.skip_softmax_threshold)


def _not_with_tiles(changed: str, c: KernelConfig) -> str:
    what = "scale_mode='tile_amax'" if c.scale_mode == "tile_amax" else "skip-softmax"
    return (f"{changed}={getattr(c, changed)!r} with {what} is not modelled: use "
            f"{changed}={_FIELD_DEFAULTS[changed]!r} or neither query-tile axis")


#: Every rule between fields, checked in this order once each field has passed its own check (on the
#: values as given, before the fields that do not act are normalised).
RULES: tuple[Rule, ...] = (
    Rule(lambda c: c.f16_round_keys and c.block_kv % c.f16_round_keys,
         lambda c: f"f16_round_keys={c.f16_round_keys} must divide block_kv={c.block_kv}"),
    # the MMA accumulator model
    Rule(lambda c: c.mma_acc_bits and c.accumulator != "f32",
         lambda c: f"mma_acc_bits={c.mma_acc_bits} needs accumulator='f32' (the f16 accumulator is its own "
                   "model: f16_round_keys)"),
    Rule(lambda c: c.mma_acc_bits and c.block_format is not None,
         lambda c: f"mma_acc_bits={c.mma_acc_bits} is not modelled with the block-scaled p_format="
                   f"{c.p_format!r}: use an element format"),
    Rule(lambda c: c.mma_acc_bits and c.block_kv % MMA_K,
         lambda c: f"block_kv={c.block_kv} must be a multiple of the MMA K = {MMA_K} keys with "
                   f"mma_acc_bits={c.mma_acc_bits}"),
    Rule(lambda c: c.mma_acc_bits and c.mma_promote_keys and (c.mma_promote_keys % MMA_K
                                                              or c.block_kv % c.mma_promote_keys),
         lambda c: f"mma_promote_keys={c.mma_promote_keys} must be a multiple of {MMA_K} that divides "
                   f"block_kv={c.block_kv} (or 0: never promoted)"),
    Rule(lambda c: c.mma_acc_bits and not c.mma_promote_keys and c.scale_mode in COMPUTED_SCALE_MODES,
         lambda c: f"scale_mode={c.scale_mode!r} needs mma_promote_keys > 0 with mma_acc_bits: its per-block "
                   "inverse scale multiplies the block's product outside the MMA accumulator"),
    # the lazy rescale
    Rule(lambda c: c.rescale_threshold and c.rescale_compensation == "pow2" and c.scale_mode in COMPUTED_SCALE_MODES,
         lambda c: f"rescale_compensation='pow2' scales a static S; scale_mode={c.scale_mode!r} has none"),
    Rule(lambda c: not SCALE_MIN <= c.effective_scale <= SCALE_MAX,
         lambda c: f"scale·2^-rescale_threshold = {c.effective_scale!r} must lie in [2^-100, 2^100]"),
    # query tiles
    Rule(lambda c: _tiles(c) and not c.block_q,
         lambda c: f"block_q=0 with {_tile_words(c)}: a query tile needs block_q >= 1 rows (1: each row on its own)"),
    # what P is taken against and its precision
    Rule(lambda c: c.fmt.is_integer and c.overflow != "satfinite",
         lambda c: f"overflow={c.overflow!r}: p_format={c.p_format!r} is an integer format, which clips to its "
                   "range (use overflow='satfinite')"),
    Rule(lambda c: c.p_offset != "running_max" and c.rescale_threshold,
         lambda c: f"p_offset={c.p_offset!r} takes P against a max that never lags: "
                   f"rescale_threshold={c.rescale_threshold:g} must be 0"),
    *(_row_lse_needs(field, value) for field, value in (("scale_mode", "multiply"), ("kv_splits", 1),
                                                         ("softmax", "f32"), ("mma_acc_bits", 0))),
    Rule(lambda c: (c.p_offset != "running_max" or c.softmax != "f32") and _tiles(c),
         lambda c: _not_with_tiles("p_offset" if c.p_offset != "running_max" else "softmax", c)),
    Rule(lambda c: c.softmax == "f16" and c.rescale_threshold,
         lambda c: f"softmax='f16' with rescale_threshold={c.rescale_threshold:g}: a lagging max lets P exceed 1 "
                   "and P·S overflow float16 (not modelled); use rescale_threshold=0"),
    Rule(lambda c: c.softmax == "f16" and c.scale_mode not in COMPUTED_SCALE_MODES and c.effective_scale > F16_MAX,
         lambda c: f"scale={c.scale!r} with softmax='f16': P·S is held in float16, so S must be at most "
                   f"{F16_MAX:g}"),
    # block-scaled P formats
    Rule(lambda c: c.block_format is not None and c.block_kv % c.block_format.block,
         lambda c: f"p_format={c.p_format!r} scales blocks of {c.block_format.block} keys, which must tile "
                   f"block_kv={c.block_kv}"),
    Rule(lambda c: c.block_format is not None and c.scale_mode in COMPUTED_SCALE_MODES,
         lambda c: f"p_format={c.p_format!r} carries its own block scales: scale_mode={c.scale_mode!r} is not "
                   "supported with it"),
    Rule(lambda c: c.block_format is not None and c.accumulator != "f32",
         lambda c: f"p_format={c.p_format!r} needs accumulator='f32' (the block scale is multiplied back into the "
                   "FP32 accumulator)"),
)


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
        for name in NUMERIC_FIELDS:
            if getattr(program, name):  # a stand-in that is not 0: a number the program computes with
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
        numeric = sorted(set(changes) & set(NUMERIC_FIELDS))
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
