"""TensorRT-LLM FP8 attention: XQA (decode) and fmha_v2 (context)."""

from __future__ import annotations

import math

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int, check_positive

#: TensorRT-LLM XQA (SM90) keys per CTA tile, ``gemm0CtaTileNbTokens`` in cpp/kernels/xqa/mha_sm90.cu.
XQA_CTA_TILE_TOKENS = 64


def xqa_nb_sub_seq(*, batch: int, nb_k_heads: int, sms: int, max_seq_len: int, env: int | None = None) -> int:
    """Sub-sequences (CTAs per request and KV head) of TensorRT-LLM XQA's SM90 multi-block launch.

    cpp/kernels/xqa/mha_sm90.cu, ``launchHopperF8MHA``, the ``nbSubSeqPerSeq`` lambda (NVIDIA/TensorRT-LLM
    commit 014dadc): ``XQA_NB_SUB_SEQ`` (``env`` here) when set and > 0, else
    ``min(max(1, (uint32_t) round(multiProcessorCount * 3 / (batchSize * nbKHeads) * 0.25f)),
    divUp(maxSeqLen, gemm0CtaTileNbTokens))``. ``multiProcessorCount * 3 / (batchSize * nbKHeads)`` is
    C integer division (all three are integers) before the float factor 0.25, and ``round`` rounds
    halves away from zero. (The older ``mha.cu`` launcher has no 3 × 0.25: SMs / (batch · KV heads).)
    """
    batch = check_int("batch", batch, min_value=1)
    nb_k_heads = check_int("nb_k_heads", nb_k_heads, min_value=1)
    sms = check_int("sms", sms, min_value=1)
    max_seq_len = check_int("max_seq_len", max_seq_len, min_value=1)
    if env is not None and check_int("env", env) > 0:
        return int(env)
    per_cta = (sms * 3) // (batch * nb_k_heads) * 0.25
    return min(max(1, math.floor(per_cta + 0.5)), -(-max_seq_len // XQA_CTA_TILE_TOKENS))


#: The launch the ``trtllm_xqa_multiblock`` preset stands for (an assumption, not a constant of the
#: source): an H100 SXM (132 SMs), batch 2 × 8 KV heads (Llama-3-8B/70B GQA), KV length ≥ 384, no
#: XQA_NB_SUB_SEQ: ``xqa_nb_sub_seq`` gives 6 sub-sequences (batch 1 gives 12, batch 4 gives 3).
XQA_DECODE_LAUNCH = {"batch": 2, "nb_k_heads": 8, "sms": 132, "max_seq_len": 4096}

#: KV tile B by head dim. TensorRT-LLM fmha_v2's FP8 context kernel as FlashInfer generates it
#: (flashinfer-ai/flashinfer commit fb28d72, flashinfer/jit/attention/fmha_v2/fmha_library.py): on SM90 the
#: kernel is warp-specialized for head_size ≥ 32 (line 183), and the e4m3 branch (line 265) sets
#: kv_loop_step = 256 at d ≤ 64 (line 267) and at d ≤ 128 (line 274), 128 above (line 289; FP8 pads a head
#: dim above 128 to 256, lines 238-241). The non-warp-specialized path (other SMs, lines 302-323) is not
#: modelled.
TILES_BY_HEAD_DIM: dict[str, dict[int, int]] = {name: {64: 256, 128: 256, 256: 128}
                                                 for name in ("trtllm_fmha_v2", "trtllm_fmha_v2_nonexp2f",
                                                              "trtllm_fmha_v2_skip")}


def skip_softmax_threshold(scale_factor: float, kv_len: int) -> float:
    """λ of fmha_v2's and trtllm-gen's skip-softmax: ``skip_softmax_threshold_scale_factor`` / KV length.

    fmha_v2 sets ``softmax.skip_softmax_threshold = params.skip_softmax_threshold_scale_factor /
    actual_kv_seqlen`` per head (FlashInfer commit fb28d72, ``csrc/fmha_v2/fmha/warpspec/compute.h``
    lines 282-286); FlashInfer documents the trtllm-gen knob the same way (``flashinfer/prefill.py``
    lines 4722-4830). Both are off unless the caller passes a factor.
    """
    scale_factor = check_positive("scale_factor", scale_factor)
    kv_len = check_int("kv_len", kv_len, min_value=1)
    lam = scale_factor / kv_len
    if lam >= 1.0:
        raise PcastError(f"scale_factor={scale_factor:g} / kv_len={kv_len} = {lam:g} must be below 1 "
                         "(skip_softmax_threshold)")
    return lam


#: The skip-softmax setting ``trtllm_fmha_v2_skip`` stands for (an assumption: the knob is off by default):
#: scale factor 4 at a KV length of 4096, λ = 2^-10.
FMHA_V2_SKIP = {"scale_factor": 4.0, "kv_len": 4096}

PRESETS: dict[str, KernelConfig] = {
    # TensorRT-LLM XQA (SM90): cpp/kernels/xqa/mha_sm90.cu iterates idxIter = 0 .. nbIters
    # (forward) and scales acc by kE4M3_MAX = 448 after the row sum; output × 1/448. Tile:
    # gemm0CtaTileNbTokens = gemm0WarpGrpTileNbTokens (64) × gemm0NbGmmaGrps (1) = 64 keys.
    # One CTA per (request, KV head): multi-block mode off (see trtllm_xqa_multiblock).
    "trtllm_xqa": KernelConfig(order="forward", scale=448.0, scale_mode="multiply", block_kv=64),
    # TensorRT-LLM XQA in multi-block mode (its decode default, ALLOW_MULTI_BLOCK_MODE): launchHopperF8MHA
    # runs nbSubSeqPerSeq CTAs per (request, KV head) (xqa_nb_sub_seq, above); CTA idxSubSeq takes tiles
    # idxKTile = idxKTileInit + idxIter · nbSubSeq (strided, each CTA forward with its own max), and
    # the last CTA merges the partial results (mha_sm90.cu). nbSubSeq depends on the launch: the
    # preset takes it for XQA_DECODE_LAUNCH (6 sub-sequences), an assumed launch.
    "trtllm_xqa_multiblock": KernelConfig(
        order="forward", scale=448.0, scale_mode="multiply", block_kv=XQA_CTA_TILE_TOKENS,
        kv_splits=xqa_nb_sub_seq(**XQA_DECODE_LAUNCH), split_layout="strided",
    ),
    # TensorRT-LLM fmha_v2 FP8 context attention, as vendored by FlashInfer (commit fb28d72, csrc/fmha_v2):
    # Softmax_fp_quant_scale<e4m3_t> = 256 (fmha/numeric_types.h lines 48-53), folded into the exponent as
    # max − log 256 (fmha/warpspec/epilogue.h ~lines 817-825), so ℓ sums the ×256 values; forward KV order
    # (compute.h line 351); no lazy rescale. A learned sink enters the denominator only, multiplied by 256
    # in the e4m3 epilogue (epilogue.h lines 1152-1164). Its optional skip-softmax (a tile skipped when
    # exp(local max − running max) < λ/N for every row of the warpgroup, compute.h lines 282-285, adding to
    # neither O nor ℓ) is off by default (trtllm_fmha_v2_skip turns it on). B = 256 at d = 128
    # (TILES_BY_HEAD_DIM).
    "trtllm_fmha_v2": KernelConfig(order="forward", scale=256.0, scale_mode="exponent", block_kv=256),
    # The same kernel on its non-exp2f path (EXP2F_OPTIMIZATION off: ALiBi or logit soft-capping,
    # fmha/warpspec/kernel_traits.h line 204): P is still S·exp(s − m) (expf(p − (max − logf(256))) in the
    # e4m3 Softmax's compute_and_update_scale, epilogue.h), but the e4m3 epilogue adds the learned sink as
    # expf(sink − max + log2f(256)) = e^8·exp(sink − max) instead of 2^8·exp(sink − max) (epilogue.h lines
    # 1152-1163): the sink weighs (e/2)^8 ≈ 11.6× what ℓ's scale says (sink_prescale="exp"). ALiBi and
    # soft-capping themselves change the logits, which a workload's scores stand for; not modelled here.
    "trtllm_fmha_v2_nonexp2f": KernelConfig(order="forward", scale=256.0, scale_mode="exponent", block_kv=256,
                                            sink_prescale="exp"),
    # fmha_v2 with skip-softmax on (ENABLE_SKIP_SOFTMAX kernels; FlashInfer commit fb28d72,
    # csrc/fmha_v2/fmha/warpspec/epilogue.h lines 743-806): each row compares exp(local max − global max)
    # with λ, global max being the running max *before* this tile (line 772; line 778 updates it after);
    # the votes are ANDed over a warp (__all_sync, line 792) and over the warpgroup (atomicAnd on one vote
    # word behind a 128-thread named barrier, lines 795-799), and a skipped tile returns before the
    # exponentials, adding to neither O nor ℓ (line 804). The first KV tile is never skipped (line 754;
    # the model's rows have m = −inf there and do not vote). block_q = 64: the rows of one warpgroup (its
    # wgmma M; an assumption that each of the two compute warpgroups owns its own 64 query rows). λ from
    # FMHA_V2_SKIP (an assumed setting).
    "trtllm_fmha_v2_skip": KernelConfig(order="forward", scale=256.0, scale_mode="exponent", block_kv=256, block_q=64,
                                        skip_softmax_threshold=skip_softmax_threshold(**FMHA_V2_SKIP)),
}
