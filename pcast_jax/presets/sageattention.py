"""SageAttention 2, 2++ and 3 (thu-ml/SageAttention)."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    # SageAttention2 (thu-ml/SageAttention, commit d1a57a5) as sageattention/core.py line 151 runs it on
    # SM90: csrc/qattn/attn_utils.cuh folds S_FP8_OFFSET = 8.807 (2^8.807 ≈ 448) into the exponent;
    # forward order. B = 128: CTA_K = 128 in csrc/qattn/qk_int_sv_f8_cuda_sm90.cu lines 687 and 863 (both
    # SM90 FP8 entry points). Its INT8 per-block Q/K quantization is not modelled (P-cast isolated).
    "sageattn2": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=128
    ),
    # SageAttention2++ (pv_accum_dtype="fp32+fp16", what sageattention/core.py line 149 picks on SM89):
    # core.py keeps P at 448 and cuts the V range to 2.25 (quant_v_scale_max, lines 805-807): V is
    # quantized per channel with scale amax/2.25 and the scale multiplied back after the accumulation,
    # so the FP16 PV accumulator cannot overflow. B = 64: CTA_K = 64 in
    # csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_fuse_v_scale_attn_inst_buf.cu line 125 (the kernel core.py
    # line 819 calls). f16_round_keys = 32: csrc/qattn/attn_utils.cuh lines 908-970 chain one
    # mma_sync_m16n16k32_row_col_f8f8f16 per 32 keys of the block into the f16 accumulator (kInit for the
    # first, kInplaceUpdate after), which is mma.sync m16n8k32 ... .f16.e4m3.e4m3.f16 (csrc/mma.cuh line
    # 577), and add the block's f16 result to the FP32 output (lines 969-971). The paper's "S = 112" is
    # not in the released code; we follow the code.
    "sageattn2pp": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=64, accumulator="f16",
        f16_round_keys=32, v_channel_max=2.25,
    ),
    # SageAttention3's P is block-scaled (NVFP4): simulator only.
    # SageAttention3 (thu-ml/SageAttention, commit d1a57a5, sageattention3_blackwell/sageattn3/blackwell/):
    # softmax_fused.h computes P̃ = exp2(Z·log2e·scale − (m·log2e·scale + log2(1/(448·6)))) (lines 32,
    # 71-75), i.e. the row maximum brought to 448·6 = 2688 in the exponent (fp8_scalexfp4_scale), the
    # row sum accumulating P̃ (exponent mode, epilogue O/ℓ); per 16 keys the scale AbsMaxP =
    # exp2(max_b·log2e·scale − max_scaled + log2(1/6)) (line 79) = block max of P̃ / 6 (≤ 448, UE4M3 in
    # the block-scaled MMA), P̃ divided by it (line 135) and cast to E2M1. Reverse order:
    # mainloop_tma_ws.h starts at n_block = n_block_max - 1 (line 509) and walks down,
    # for (; n_block >= 0; --n_block), in the producer (line 536) and the consumer (lines 670, 817, 865).
    # B = 128: launch.h line 105 instantiates Flash_fwd_kernel_traits<Headdim, 128, 128, ...>, whose third
    # argument is kBlockN (kernel_traits.h lines 71, 80). The kernel divides P̃ by the FP32 scale and
    # multiplies by its E4M3 rounding in the MMA; we divide by the E4M3 value (Model Optimizer's order),
    # a difference below one E2M1 step. Q/K/V stay FP32 (P-cast isolated).
    "sageattn3": KernelConfig(order="reverse", scale=448.0 * 6.0, scale_mode="exponent", block_kv=128,
                              p_format="nvfp4"),
}
