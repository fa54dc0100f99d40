"""vLLM's FP8 attention paths: the Triton unified attention and vLLM's FlashAttention-4 fork."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

# vLLM Triton unified attention (TRITON_ATTN; vllm-project/vllm vllm/v1/attention/ops/
# triton_unified_attention.py at 0013943, _helpers.py at 86a153b): init_softmax_M sets the running max
# to the learned sink, M = sink, with L = 1 (sink_mode "init_max"); softmax_step is exact every tile,
# P = exp(S − M) with ℓ from FP32 P; acc += tl.dot(P.to(V.dtype), V) casts P to the FP8 KV dtype with no
# scale (S = 1) when Q is FP8 too (_cast_kv_tile hands back raw FP8 V only then); forward order;
# _get_tile_size gives 32 keys for 1-byte Q in both the 2-D and 3-D paths.
_VLLM = dict(order="forward", scale=1.0, scale_mode="multiply", block_kv=32, sink_mode="init_max")
#: Segments of the 3-D (split) path: not read from source (an assumption).
VLLM_SEGMENTS = 16

PRESETS: dict[str, KernelConfig] = {
    "vllm_triton_fp8": KernelConfig(**_VLLM),
    # The 3-D path: contiguous segments (tiles_per_segment = cdiv(seq_len, NUM_SEGMENTS·TILE)); only
    # segment 0 loads the sink, and reduce_segments carries it in segment 0's stored M and L.
    "vllm_triton_fp8_3d": KernelConfig(**_VLLM, kv_splits=VLLM_SEGMENTS),
    # The same on ROCm (MI300), where vLLM's current_platform.fp8_dtype() is float8_e4m3fnuz: max 240,
    # values at or below 2^-11 round to zero (the collapse threshold moves from 10 ln 2 to 11 ln 2).
    "vllm_triton_fp8_rocm": KernelConfig(**_VLLM, p_format="e4m3fnuz"),
    # vLLM's FlashAttention-4 fork (vllm-project/flash-attention commit 617264c, PR #166 = 16892023,
    # 2026-07-20): FA4's FP8 path with max_offset 8 (S = 256) and a rescale threshold τ = 0.75 (log2 units,
    # flash_attn/cute/flash_fwd_sm100.py lines 2030-2034): P̃ reaches 2^8.75 ≈ 430 < 448. Reverse order,
    # B = 128 and the epilogue sink as upstream FA4.
    "vllm_fa4": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128,
                             rescale_threshold=0.75),
}
