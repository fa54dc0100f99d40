"""NVIDIA Model Optimizer's NVFP4 fake-quantization of P."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    # NVFP4 fake-quant of P inside NVIDIA Model Optimizer's Triton flash attention (NVIDIA/Model-Optimizer,
    # commit a2fbac7b): modelopt/torch/kernels/common/attention/triton_fa.py walks kv_start = 0, BLOCK_N,
    # ... (forward, line 359), takes P = exp2(S − m_new) with the running max (line 433, unnormalized),
    # sums the row from the unquantized P (lines 434-436: ℓ unscaled, multiply mode) and, with
    # p_qdq="nvfp4", fake-quantizes P before P·V (lines 440-451) through _p_qdq_nvfp4
    # (modelopt/torch/kernels/quantization/attention/bmm2_qdq.py lines 38-61: 16 keys per block along the
    # key axis) → nvfp4_scalar_qdq (kernels/quantization/common/nvfp4_quant.py): block scale
    # E4M3(min(amax_b / (6 g), 448)) · g (lines 122-125, saturating at 448), elements rounded to E2M1 at
    # x / scale, a zero scale zeroing the block (line 101). g = p_qdq_amax / (6·448) with p_qdq_amax = 1
    # by default (triton_fa.py lines 1241, 1345), so E4M3(amax_b / (6 g)) = E4M3(amax_b · 448): exactly
    # the block scale of P·S with S = 6·448 and second level 1 here. B = 32: every autotuned forward
    # config has BLOCK_N = 32 (triton_fa.py lines 84-87). Not modelled: the kernel first rounds P to V's
    # dtype (bf16/fp16, lines 447-450) before the fake-quant; P here stays FP32 up to the NVFP4 cast.
    # (The offline quantizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py clamps block scales to
    # [2^-9, 448] and so never zeroes a block; it is not what runs on P.)
    "nvfp4_fakequant": KernelConfig(order="forward", scale=448.0 * 6.0, scale_mode="multiply", block_kv=32,
                                    p_format="nvfp4"),
}
