"""FlashAttention-3 (Hopper) and FlashAttention-4 (Blackwell), as each version ran."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

#: KV tile B by head dim, read from each kernel's source (the FP8 forward path at that head dim).
#: FlashAttention-3 (Dao-AILab/flash-attention, commit 0251105a): hopper/tile_size.h, tile_size_fwd_sm90(),
#: the element_size == 1 branch, lines 42-52: d ≤ 64 → 160 (line 43), d ≤ 96 → 128 (45), d ≤ 128 → 224
#: (47; 160 with paged non-TMA KV, 192 with V col-major or softcap with a local window), d ≤ 192 → 160
#: (49), d = 256 → 128 (51; 64 with a local window); causal does not change the FP8 tile. (vLLM's fork,
#: vllm-project/flash-attention commit 07602ad, which this table cited before, gives the same values
#: at lines 58-71; its decode path was not read.)
TILES_BY_HEAD_DIM: dict[str, dict[int, int]] = {"fa3": {64: 160, 96: 128, 128: 224, 192: 160, 256: 128}}
#: FlashAttention-3's split-KV path runs the same mainloop per split, and tile_size_fwd_sm90() takes no
#: split argument: the same tiles.
TILES_BY_HEAD_DIM["fa3_splitkv"] = TILES_BY_HEAD_DIM["fa3"]

PRESETS: dict[str, KernelConfig] = {
    # FlashAttention-3 (Hopper): hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp walks n_block from
    # n_block_max - 1 down (reverse); hopper/softmax.h folds S = 2^8 into exp2 (Max_offset = 8 for
    # FP8), so the row sum holds scaled values. B = 224 at d = 128 (TILES_BY_HEAD_DIM).
    "fa3": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=224),
    # FlashAttention-4 (Blackwell, CuTe DSL): flash_attn/cute/flash_fwd_sm100.py iterates
    # n_block = n_block_max - 1 - n_tile (reverse); softmax.py uses max_offset = 8 for 8-bit P.
    # B = 128: flash_attn/cute/interface.py line 318 (commit 0251105a), cfg = FwdConfig(128, 128, ...),
    # the base tile the SM100 path keeps (only SM80 / SM90 / SM120 replace it below that line).
    # The FP8 path as it stands since PR #2731 (merged 2026-07-28, 849f660f): flash_fwd_sm100.py line 2182
    # max_offset = 8 (S = 256) and line 2190 a rescale threshold of 0 for FP8 (no lazy rescale); the
    # learnable sink enters the epilogue's denominator only, with the +8 of the exponent (lines 2730-2742,
    # split 0 only): sink_mode "epilogue". Earlier 2026 versions: fa4_pr2109, fa4_pr2717 below.
    "fa4": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128),
    # FlashAttention-3 split-KV decode (flash_attn_interface num_splits > 1): each split takes a
    # contiguous range of ⌈n_blocks / num_splits⌉ KV blocks (hopper/block.h, n_block_min/max per
    # split), reverse within it, merged by hopper/flash_fwd_combine_kernel.h from per-split LSE.
    # num_splits = 8 is an assumption (the heuristic num_splits_heuristic picks it from the launch).
    "fa3_splitkv": KernelConfig(
        order="reverse", scale=256.0, scale_mode="exponent", block_kv=224, kv_splits=8,
    ),
    # FlashAttention-4's FP8 forward as each 2026 version ran it (Dao-AILab/flash-attention,
    # flash_attn/cute/flash_fwd_sm100.py and softmax.py). The lazy rescale keeps the row max while
    # acc_scale = (old − new)·scale_log2 ≥ −τ (softmax.py lines 294-295, 326-327): τ in log2 units.
    # PR #2109 (merged 2026-04-17, b65ae6b1): the FP8 path with τ = 4 and max_offset 8 (S = 256). A row max
    # that lags by up to 4 (log2) lets P̃ = exp2(… + 8) reach 2^12 = 4096: the cast saturates at 448 while
    # ℓ keeps the unclipped sum (issues #2577, 2026-05-21, and #2716, 2026-07).
    "fa4_pr2109": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128,
                               rescale_threshold=4.0),
    # PR #2717 (merged 2026-07-19, 2409214a): τ = 4 kept, max_offset 4 for e4m3 (S = 16): P̃ ≤ 2^8 = 256 < 448.
    "fa4_pr2717": KernelConfig(order="reverse", scale=16.0, scale_mode="exponent", block_kv=128,
                               rescale_threshold=4.0),
}
