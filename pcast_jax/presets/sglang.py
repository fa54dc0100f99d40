"""SGLang's Triton decode attention with an FP8 KV cache."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

#: KV splits per request: SGLang's server default for ``--triton-attention-num-kv-splits`` (an assumption,
#: not read from the stored source).
SGLANG_KV_SPLITS = 8

KERNELS_2026: dict[str, KernelConfig] = {
    # sgl-project/sglang python/sglang/srt/layers/attention/triton_ops/decode_attention.py (at 03cd2ec), the
    # grouped (GQA) kernel: BLOCK_N = 32, exact softmax per tile, p.to(v.dtype) casts P to the FP8 KV dtype
    # with no scale (S = 1); contiguous splits (each split's length rounded up to a multiple of 32), forward
    # order within a split; a learned sink enters once in the stage-2 merge, e_sum += exp(sink − e_max): the
    # denominator only ("epilogue"). (The MHA kernel, BLOCK_N = 64, multiplies P·V in FP32: no P-cast.)
    "sglang_triton_decode": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=32,
                                         kv_splits=SGLANG_KV_SPLITS, name="sglang_triton_decode"),
}
