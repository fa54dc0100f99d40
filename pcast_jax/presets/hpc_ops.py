"""Tencent hpc-ops FP8 prefill, before and after the paper."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    # Tencent hpc-ops prefill FP8, before the paper (commit e363e86): src/attention/prefill/kernels.cuh
    # walks itile_seq_kv forward with no P scale (S = 1); gSum from unscaled P. B = 128: the kTileN
    # template argument of AttentionKVCachePrefillFp8Config in
    # src/attention/prefill/warp_spec_with_kvcache_fp8_dim128.cu lines 55-56 (head dim 128).
    "hpc_ops_prior": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=128),
    # Tencent hpc-ops prefill FP8, updated (commit 6e2eced): kernels.cuh line 1347,
    # tAttr(i) *= kFp8PrefillPScale (256.0f, line 20), after exp; epilogue × vscale / 256; forward order.
    # B = 128: kTileN = 128 in src/attention/prefill/warp_spec_with_kvcache_fp8_dim128.cu line 119.
    "hpc_ops": KernelConfig(order="forward", scale=256.0, scale_mode="multiply", block_kv=128),
}
