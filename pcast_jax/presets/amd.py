"""FP8 attention on AMD GPUs (ROCm): FlashAttention's Triton backend, vLLM's ROCm Triton attention,
aiter's Triton MHA and FlyDSL's gfx950 FP8 flash attention.

MI300 (gfx942) runs FP8 as ``float8_e4m3fnuz`` (exponent bias 8, max 240, no −0 or inf: values at or
below 2^-11 round to zero, one binade further down than E4M3FN's 2^-10); MI355 (gfx950) runs OCP
``float8_e4m3fn``. Below saturation a FNUZ cast of x equals an FN cast of 2x halved, so a P-cast at scale S
on MI300 zeroes what an FN cast at 2S zeroes: FNUZ zeroes *less*, the collapse threshold moves up from
10 ln 2 to 11 ln 2; it saturates sooner, at 240 instead of 448.

aiter's own Triton MHA FP8 scales each BLOCK_M × BLOCK_N tile of P by FP8_MAX / amax(tile): one scale,
not a power of two, shared by every query row of the tile (``scale_mode="tile_amax"`` with ``block_q``).

Not modelled as presets:

* vLLM's ROCm Triton attention with a calibrated ``prob_scale`` other than 1: expressible as a
  config (:func:`vllm_rocm_flash_config`), not a preset, since the value is the checkpoint's.
* The FP8_MAX clamp of vLLM's FP8 output path (``USE_FP8_OUT``) acts on O, not on P.

aiter's unified attention (the ROCm port of vLLM's) is ``vllm_triton_fp8_rocm`` in :mod:`.vllm`.
"""

from __future__ import annotations

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_positive

#: GPU generation → the FP8 type the kernels below cast P to (see each preset's note for the source).
FP8_FORMAT_BY_GPU = {"mi300": "e4m3fnuz", "mi355": "e4m3"}

# FlashAttention's ROCm Triton backend: upstream flash_attn/flash_attn_interface.py imports flash_attn_2 from
# aiter's flash_attn_triton_amd when FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE. Read in ROCm/aiter at commit
# e404860, aiter/ops/triton/_triton_kernels/flash_attn_triton_amd/fwd_prefill.py:
# - forward KV order: `for start_n in tl.range(block_min, block_max, BLOCK_N, ...)` (line 321);
# - BLOCK_N: autotuning is on by default (FLASH_ATTENTION_TRITON_AMD_AUTOTUNE defaults to "1", utils.py
#   lines 121-126); get_fwd_prefill_configs then offers gfx942 BLOCK_N 64 only (lines 145-170) and gfx950
#   64 in three of its four configs, 128 in the fourth (lines 102-144); with autotuning off both get 64
#   (lines 42-55). B = 64 (on MI355 an assumption: the autotuner's pick is not in the source);
# - exact per-tile max m_ij = max(m_i, rowmax(qk)) (line 464), ℓ from the FP32 P before any cast (line 479):
#   scale_mode "multiply";
# - P is cast to V's FP8 type with no scale, `tl.dot(p.to(v.type.element_ty), v) * v_descale` (line 614):
#   S = 1. The scaled branch (compute_fp8_scaling_factors) sits behind FP8_P_DESCALE (lines 606-612),
#   which the launcher passes as False (line 1942);
# - Q/K/V descales default to 1.0 with a warning when not given (lines 1730-1747).
# The FP8 type: utils.py lines 71-76 recommend float8_e4m3fnuz for float8_e4m3fn on gfx942 (the launcher
# warns on another dtype, fwd_prefill.py lines 1723-1728); gfx950 has no replacement (OCP e4m3).
# Assumption: the caller passes the recommended dtype. The kernel takes no learned sink: sink_mode keeps
# its default.
_FA_TRITON_AMD = dict(order="forward", scale=1.0, scale_mode="multiply", block_kv=64)

# vLLM's ROCm Triton flash attention (vllm-project/vllm commit 00158f9,
# vllm/attention/ops/triton_flash_attention.py), run with kv_cache_dtype="fp8" and fp8_scales =
# (q_scale, k_scale, v_scale, prob_scale):
# - _attn_fwd_inner walks `for start_n in range(block_min, block_max, BLOCK_N)` (forward; full blocks first,
#   then the masked ones, both ascending), exact per-tile max, l_ij = sum(p) before the scale;
# - `if USE_FP8: p *= p_descale` then `acc += tl.dot(p.to(V_block_ptr.type.element_ty), v)`, with
#   p_descale = 1 / p_scale set in _attention.forward: S = 1 / prob_scale, multiply mode; the epilogue
#   multiplies acc by p_scale · v_scale (attn_fwd, acc_scale);
# - the FP8 type is current_platform.fp8_dtype() (float8_e4m3fnuz on MI300, float8_e4m3fn on MI355, as
#   current_platform.is_fp8_fnuz() says: vLLM's platform code was not re-read, an assumption);
# - BLOCK_N is autotuned over get_cdna_autotune_configs(): 64 in five of its eight configs, 128 in two,
#   32 in one. B = 64 is an assumption.
# The scale vLLM hands the kernel: vLLM's kv-cache scale loader
# (vllm/model_executor/layers/quantization/kv_cache.py, BaseKVCacheMethod.process_weights_after_loading)
# keeps prob_scale = 1.0 when the checkpoint has none (it then warns "Using uncalibrated q_scale 1.0 and/or
# prob_scale 1.0 with fp8 attention") and doubles a checkpoint's prob_scale on FNUZ platforms.
_VLLM_ROCM_FLASH = dict(order="forward", scale_mode="multiply", block_kv=64)

# aiter's Triton MHA FP8 (aiter.ops.triton.mha, FP8 Q/K/V; ROCm/aiter commit e404860,
# aiter/ops/triton/_triton_kernels/attention/mha.py unless said otherwise):
# - forward KV order: `for start_n in tl.range(block_min, block_max, BLOCK_N, ...)` (line 135);
# - exact per-tile max m_ij = max(m_i, rowmax(qk)) (line 212), p = exp2(qk − m_ij) with log2 e folded into qk
#   (lines 180, 215), ℓ from that FP32 p before any scale (lines 223, 251);
# - per tile: scale_p, descale_p = _compute_fp8_scaling_factors(p, FP8_MAX) (line 257), then
#   acc += tl.dot((p * scale_p).to(fp8), v) * descale_p * descale_v (lines 258-260); the helper
#   (aiter/ops/triton/utils/_triton/mha_kernel_utils.py lines 9-15) takes x_amax = max |p| over the whole
#   BLOCK_M × BLOCK_N tile, floored at 1e-9, scale FP8_MAX / x_amax and descale x_amax / FP8_MAX: scale_mode
#   "tile_amax"; the epilogue multiplies acc by 1 / l_i (lines 877-878);
# - FP8_MAX = torch.finfo(q.dtype).max (aiter/ops/triton/attention/mha.py line 118): 240 for
#   float8_e4m3fnuz (MI300), 448 for float8_e4m3fn (MI355); P is cast to V's type, assumed the same as Q's;
# - a learned sink is the initial running max, m_i = sink · log2 e and l_i = 1 (lines 685-692): "init_max";
# - Q rows past the query length are loaded as 0 (line 708): the padding rows of a partial last tile;
# - BLOCK_M = 128, BLOCK_N = 64: the "default" forward entry of aiter/ops/triton/configs/gfx942-MHA-DEFAULT.json
#   and gfx950-MHA-DEFAULT.json, which _get_config (line 949) returns for FP8 without dropout or positional
#   encoding at head dims above 64 (gfx950's "small_head" entry for 16 < d ≤ 64 has the same tile). No
#   autotuning on this path.
_AITER_MHA = dict(order="forward", scale_mode="tile_amax", block_q=128, block_kv=64, sink_mode="init_max")

# FlyDSL's gfx950 FP8 flash attention (ROCm/FlyDSL, main at commit 11c4174, called directly:
# kernels/attention/flash_attn_fp8_gfx950.py build_flash_attn_dualwave_swp_fp8_module, line 37; helpers in
# kernels/attention/flash_attn_utils.py):
# - forward KV order: `for j in range(t0, t_end, 2)` (flash_attn_fp8_gfx950.py line 266), two BLOCK_N = 64
#   tiles per step under one merged max and correction ("BN128", line 118; _merge_tile_max): B = 128;
# - P = exp2((s − m)·softmax_scale·log2 e) (sub_m and exp2, lines 196-198), ℓ sums that FP32 P (line 199),
#   and P is cast to FP8 with no scale (cast_p_fp8_direct, line 200; cvt_pk_fp8_f32 in _pack_fp8_i32x8,
#   utils lines 4689-4697, OCP e4m3 on gfx950): S = 1;
# - lazy rescale: lazy_correct_o (called at lines 301 and 329) keeps the running max while
#   (m_tile − m_row)·scale ≤ DUALWAVE_SWP_RESCALE_THRESHOLD = 8.0 (utils lines 5206-5212, 2038): τ = 8 in
#   log2 units. Assumption: the kernel skips the rescale only when every row of a wave is within τ (a wave
#   ballot) and otherwise moves each row to its tile max; the preset applies the per-row rule.
# - the FP8 kernel takes no learned sink (no sink argument in flash_attn_fp8_gfx950.py).
# ROCm/FlyDSL PR #1020 (head 6de2a37, not in main at 11c4174): P scaled by 2^headroom before the cast, the
# bias riding the exp2 FMA's addend so ℓ sums the scaled P (exponent mode), headroom = log2 448 − τ with the
# lazy rescale and log2 448 without it (flash_attn_utils.py lines 5113-5128 at 6de2a37); the FP8 default
# becomes the eager rescale (flash_attn_interface.py lines 809-812): S = 448, not a power of two.
_FLYDSL_FP8 = dict(order="forward", scale_mode="exponent", block_kv=128, p_format="e4m3")

PRESETS: dict[str, KernelConfig] = {
    # FlyDSL's gfx950 FP8 flash attention as in main (11c4174): S = 1, lazy rescale τ = 8 (log2): a lagging
    # max lets P reach 2^8 = 256 < 448 (no saturation), while everything 10 binades below the max is zeroed.
    "flydsl_fp8_gfx950": KernelConfig(**_FLYDSL_FP8, scale=1.0, rescale_threshold=8.0),
    # The same kernel with PR #1020 (6de2a37): eager rescale for FP8 and P scaled by 448 in the exponent.
    "flydsl_fp8_gfx950_pr1020": KernelConfig(**_FLYDSL_FP8, scale=448.0),
    # FlashAttention's ROCm Triton backend on MI300 (gfx942, float8_e4m3fnuz): forward, B = 64, S = 1.
    "fa_triton_amd_mi300": KernelConfig(**_FA_TRITON_AMD, p_format=FP8_FORMAT_BY_GPU["mi300"]),
    # The same on MI355 (gfx950, OCP float8_e4m3fn); B = 64 assumed (its autotuner may pick 128). The same
    # semantics as the paper's fwd_s1.
    "fa_triton_amd_mi355": KernelConfig(**_FA_TRITON_AMD, p_format=FP8_FORMAT_BY_GPU["mi355"]),
    # vLLM's ROCm Triton flash attention on MI300 with a checkpoint that has no prob_scale (S = 1 / 1.0 = 1):
    # the same semantics as fa_triton_amd_mi300 at B = 64; they part once prob_scale is calibrated
    # (vllm_rocm_flash_config) or the autotuner picks BLOCK_N 128.
    "vllm_rocm_flash_fp8": KernelConfig(**_VLLM_ROCM_FLASH, scale=1.0, p_format=FP8_FORMAT_BY_GPU["mi300"]),
    # aiter's Triton MHA FP8 on MI300 (float8_e4m3fnuz, FP8_MAX 240): one scale per 128 × 64 tile.
    "aiter_mha_fp8_mi300": KernelConfig(**_AITER_MHA, p_format=FP8_FORMAT_BY_GPU["mi300"]),
    # The same on MI355 (float8_e4m3fn, FP8_MAX 448).
    "aiter_mha_fp8_mi355": KernelConfig(**_AITER_MHA, p_format=FP8_FORMAT_BY_GPU["mi355"]),
    # aiter's gfx950 ASM MLA decode for FP8 Q and FP8 KV, one query token, 16 query heads per KV head
    # (ROCm/aiter commit e404860, hsa/gfx950/mla/mla_asm.csv line 14: qType fp8, kvType fp8, Gqa 16, qSeqLen 1
    # → mla_a8w8_qh16_qseqlen1_gqaratio16.co). The kernel is a closed code object; ROCm/aiter PR #5535
    # (2026-09-15) reports that it casts P to FP8 with S = 1 (one logit at 0 and 2,047 at −7 with V = 1 give
    # 0.3496; ×448 before the cast, 0.9964). Assumptions: the forward KV order (the PR's case zeroes the keys
    # seen after the max, as a forward walk does), the 64-key tile and OCP E4M3 P (gfx950's FP8 type); under
    # them it casts as fa_triton_amd_mi355 does.
    "aiter_mla_asm_fp8_gfx950": KernelConfig(**_FA_TRITON_AMD, p_format=FP8_FORMAT_BY_GPU["mi355"]),
}


def vllm_rocm_flash_scale(prob_scale: float | None, *, gpu: str = "mi300") -> float:
    """The P scale S vLLM's ROCm Triton flash attention casts with, from a checkpoint's ``prob_scale``.

    ``None`` (the checkpoint has none) → S = 1. Otherwise the loader doubles ``prob_scale`` on FNUZ
    platforms (``gpu="mi300"``) and the kernel multiplies P by 1 / ``prob_scale``: S = 1 / (2·prob_scale) on
    MI300, 1 / prob_scale on MI355. Sources beside ``_VLLM_ROCM_FLASH`` in this module.
    """
    check_choice("gpu", gpu, tuple(FP8_FORMAT_BY_GPU))
    if prob_scale is None:
        return 1.0
    prob_scale = check_positive("prob_scale", prob_scale, float32=True)
    loaded = 2.0 * prob_scale if FP8_FORMAT_BY_GPU[gpu] == "e4m3fnuz" else prob_scale
    scale = 1.0 / loaded
    if not 2.0**-100 <= scale <= 2.0**100:
        what = "1/(2·prob_scale)" if loaded != prob_scale else "1/prob_scale"
        raise PcastError(f"prob_scale={prob_scale!r} gives the P scale {what} = {scale!r} on gpu={gpu!r}, outside "
                         f"[2^-100, 2^100]")
    return scale


def vllm_rocm_flash_config(prob_scale: float | None, *, gpu: str = "mi300", block_kv: int = 64) -> KernelConfig:
    """vLLM's ROCm Triton flash attention as a config for a checkpoint's ``prob_scale`` on ``gpu``.

    S from :func:`vllm_rocm_flash_scale`, the FP8 type from :data:`FP8_FORMAT_BY_GPU`, ``block_kv`` the
    autotuned BLOCK_N (64, 128 or 32). ``vllm_rocm_flash_config(None)`` equals the ``vllm_rocm_flash_fp8``
    preset. The name records the inputs, e.g. ``vllm_rocm_flash_mi300_prob0.25``.
    """
    scale = vllm_rocm_flash_scale(prob_scale, gpu=gpu)
    cfg = KernelConfig(**{**_VLLM_ROCM_FLASH, "block_kv": block_kv}, scale=scale, p_format=FP8_FORMAT_BY_GPU[gpu])
    suffix = "" if prob_scale is None else f"_prob{prob_scale:g}"
    return cfg.replace(name=f"vllm_rocm_flash_{gpu}{suffix}")
