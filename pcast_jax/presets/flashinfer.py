"""FlashInfer FP8 attention kernels."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

#: FlashInfer SM90 FP8: include/flashinfer/attention/hopper/quantization/prefill_sm90.cuh,
#: SingleFP8PrefillWithKVCacheDispatched (commit 1211b4c): CTA_KV = 128 at d = 64, 192 at d = 128, 128
#: at d = 256 (the paged-KV batch path, BatchFP8PrefillWithPagedKVCacheDispatched, uses 128 everywhere).
TILES_BY_HEAD_DIM: dict[str, dict[int, int]] = {"flashinfer_sm90": {64: 128, 128: 192, 256: 128}}

PRESETS: dict[str, KernelConfig] = {
    # FlashInfer SM90 FP8 prefill: include/flashinfer/attention/hopper/variants.cuh multiplies P by
    # p_scale = max_E4M3 = 448 after exp; mainloop_mma.cuh walks kv_tile_idx downward (reverse) and
    # the epilogue uses v_scale / p_scale. The paper's Table 2 label "Forward, S=448 — FlashInfer/TRT"
    # implies forward; the source (and the paper's Table 3) say reverse, which we follow.
    # B = 192 at d = 128 (single-request prefill, TILES_BY_HEAD_DIM).
    "flashinfer_sm90": KernelConfig(
        order="reverse", scale=448.0, scale_mode="multiply", block_kv=192
    ),
    # FlashInfer SM100 CuTe-DSL FMHA, the cute_dsl/attention/fmha path (flashinfer-ai/flashinfer commit fb28d72,
    # flashinfer/cute_dsl/attention/fmha/fmha.py): with skip-correction on, the rescale threshold is
    # τ = 8 in log2 units (line 337; compared at lines 2333-2335 as (new − old)·scale_log2 > 8) and the P
    # prescale is ⌊log2 448 − 8⌋ = 0 (line 341): S = 1; compile.py line 119 hard-wires skip-correction on.
    # Forward KV order (lines 1126-1167); MMA tile 128 × 128 (compile.py line 113). A learned sink enters
    # the epilogue only (lines 3062-3071), without the prescale factor (1 here, so consistent).
    "flashinfer_sm100_cutedsl": KernelConfig(order="forward", scale=1.0, scale_mode="exponent", block_kv=128,
                                             rescale_threshold=8.0),
    # FlashInfer's other SM100 CuTe-DSL path: the paged BatchPrefillWithPagedKVCacheWrapper(backend="cute-dsl")
    # (commit fb28d72, flashinfer/prefill.py line 1729 → flashinfer/cute_dsl/attention/prefill.py). Its softmax
    # role (cute_dsl/attention/roles/softmax.py lines 265-338) takes P = exp2(s·scale − m·scale) against a
    # running max raised every KV tile (no lazy rescale) with no P prescale: S = 1, forward over the KV
    # tiles. With S = 1 it zeroes like flashinfer_sm100_cutedsl for a sink in block 0, but without the lag
    # nothing saturates. Assumptions: the 128-key tile (the FMHA path's) and the learned sink in the
    # epilogue (its sink handling was not read).
    "flashinfer_sm100_cutedsl_paged": KernelConfig(order="forward", scale=1.0, scale_mode="exponent", block_kv=128),
    # FlashInfer SM120 "prims" FP8 prefill (commit 17e0960): no P prescale before the saturating cast, S = 1.
    # Read: the class constants and cast helpers; not read: the softmax loop, so the forward order and the
    # 128-key tile are assumptions.
    "flashinfer_sm120": KernelConfig(order="forward", scale=1.0, scale_mode="exponent", block_kv=128),
    # The same kernel with PR #5020's P_FP8_PRESCALE_LOG2 = 8.0 (commit 02dff91; S = 256 in the exponent).
    # The PR was open when read; the same assumptions on order and tile.
    "flashinfer_sm120_pr5020": KernelConfig(order="forward", scale=256.0, scale_mode="exponent", block_kv=128),
}
