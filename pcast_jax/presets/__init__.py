"""Every kernel preset, one module per kernel family, each preset beside the source file and line it
follows; this module is the one registry.

========================  =================================================================
module                    presets
========================  =================================================================
``paper``                 the paper's five configurations (§6.2, Table 2)
``flashattention``        FlashAttention-3, FA3 split-KV, FlashAttention-4 and its 2026 versions
``flashinfer``            FlashInfer SM90 prefill, SM100 CuTe-DSL FMHA, SM120 prims
``trtllm``                TensorRT-LLM XQA (one CTA, multi-block) and fmha_v2
``sageattention``         SageAttention2, 2++ and 3
``hpc_ops``               Tencent hpc-ops before and after the paper
``cudnn``                 cuDNN FP8 / MXFP8 SDPA (JAX's and Transformer Engine's FP8 attention)
``vllm``                  vLLM's Triton unified attention and its FlashAttention-4 fork
``sglang``                SGLang's Triton decode
``amd``                   FlashAttention's ROCm Triton backend, vLLM's ROCm Triton attention (MI300, MI355)
``modelopt``              NVIDIA Model Optimizer's NVFP4 P fake-quantization
``research``              designs no released kernel runs (per-block 2^k, MXFP8 P)
========================  =================================================================

A preset's identity is its semantics (:class:`~pcast_jax.config.KernelConfig` equality), so moving
it between modules changes no sweep fingerprint.
"""

from __future__ import annotations

import dataclasses

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import (
    amd,
    cudnn,
    flashattention,
    flashinfer,
    hpc_ops,
    modelopt,
    paper,
    research,
    sageattention,
    sglang,
    trtllm,
    vllm,
)
from pcast_jax.presets.trtllm import XQA_CTA_TILE_TOKENS, XQA_DECODE_LAUNCH, xqa_nb_sub_seq

__all__ = ["get_preset", "preset_for", "resolve",
           "PAPER_CONFIGS", "KERNEL_PRESETS", "BLOCK_SCALED_PRESETS", "KERNELS_2026", "AMD_PRESETS", "PRESETS",
           "FAMILIES", "TILES_BY_HEAD_DIM", "MMA_PROMOTION", "MMA_ACC_BITS_HOPPER", "mma_model", "XQA_CTA_TILE_TOKENS",
           "XQA_DECODE_LAUNCH", "xqa_nb_sub_seq"]

#: The paper's five configurations (§6.2, Table 2): Q, K, V in FP32, ℓ from pre-cast P, B = 64.
PAPER_CONFIGS: dict[str, KernelConfig] = dict(paper.PRESETS)

_TABLE3 = {**flashattention.PRESETS, **flashinfer.PRESETS, **trtllm.PRESETS, **sageattention.PRESETS,
           **hpc_ops.PRESETS, **research.PRESETS}
#: Production kernels of the paper's Table 3 era, each following its public source (see the notes in
#: each entry). Tiles are those at head dim 128; :func:`preset_for` resolves them for
#: another head dim.
KERNEL_PRESETS: dict[str, KernelConfig] = {name: _TABLE3[name] for name in (
    "fa3", "fa4", "flashinfer_sm90", "trtllm_xqa", "trtllm_xqa_multiblock", "fa3_splitkv", "sageattn2",
    "sageattn2pp", "hpc_ops_prior", "hpc_ops", "dynamic_pow2")}

#: Presets with a block-scaled P (simulator only: the Pallas kernels run E4M3 P alone), each citing
#: the source it follows.
BLOCK_SCALED_PRESETS: dict[str, KernelConfig] = {**sageattention.BLOCK_SCALED, **modelopt.BLOCK_SCALED,
                                                 **research.BLOCK_SCALED}

#: The FP8 attention served and trained with in 2026: learned sinks, lazy rescale, cuDNN, Blackwell.
KERNELS_2026: dict[str, KernelConfig] = {**cudnn.KERNELS_2026, **flashattention.KERNELS_2026,
                                         **vllm.KERNELS_2026, **flashinfer.KERNELS_2026,
                                         **trtllm.KERNELS_2026, **sglang.KERNELS_2026}

#: FP8 attention on AMD GPUs (ROCm): MI300's E4M3FNUZ and MI355's E4M3, each citing its source.
AMD_PRESETS: dict[str, KernelConfig] = dict(amd.PRESETS)

PRESETS: dict[str, KernelConfig] = {**PAPER_CONFIGS, **KERNEL_PRESETS, **BLOCK_SCALED_PRESETS, **KERNELS_2026,
                                    **AMD_PRESETS}

#: Kernel family (module) → the names of its presets, in registry order.
FAMILIES: dict[str, tuple[str, ...]] = {}
for _module in (paper, flashattention, flashinfer, trtllm, sageattention, hpc_ops, cudnn, vllm, sglang, amd, modelopt,
                research):
    _names = {**getattr(_module, "PRESETS", {}), **getattr(_module, "BLOCK_SCALED", {}),
              **getattr(_module, "KERNELS_2026", {})}
    FAMILIES[_module.__name__.rsplit(".", 1)[1]] = tuple(n for n in PRESETS if n in _names)
assert sorted(n for names in FAMILIES.values() for n in names) == sorted(PRESETS), "a preset without a family"

#: KV tile B by head dim, read from each kernel's source (the FP8 forward path at that head dim).
TILES_BY_HEAD_DIM: dict[str, dict[int, int]] = {**flashattention.TILES_BY_HEAD_DIM, **flashinfer.TILES_BY_HEAD_DIM,
                                                 **trtllm.TILES_BY_HEAD_DIM}

#: Where each kernel adds its FP8 P·V MMA results into exact FP32 registers, i.e. the
#: ``mma_promote_keys`` its accumulator model takes: ``"never"`` (0: O lives in the wgmma accumulator
#: across KV blocks) or ``"tile"`` (``block_kv``: a fresh accumulator per KV tile, added to FP32 O).
#: Read from source; kernels missing here were not read (FlashInfer SM90: its mainloop's PV
#: accumulation not re-read; FlashAttention-4: Blackwell tcgen05, outside the Hopper model;
#: SageAttention2++: its f16 accumulator is its own model).
MMA_PROMOTION: dict[str, str] = {
    # FlashAttention-3, hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp (commit 0251105a): clear(tOrO) once
    # (line 1166), then every n_block's P·V is flash::gemm</*zero_init=*/false>(tiled_mma_pv, ..., tOrO)
    # into the same accumulator (line 1182), rescaled in place by softmax.rescale_o (1178 / 1205).
    "fa3": "never",
    "fa3_splitkv": "never",  # the same mainloop per split
    # TensorRT-LLM XQA, cpp/kernels/xqa/mha_sm90.cu: rescaleGemm1AccForNewRowMax_sync(..., acc, ...)
    # rescales the gemm1 accumulator `acc` before each tile's X·V wgmma accumulates into it (its own
    # comment: "if first tile, no need to rescale acc"); line numbers not read.
    "trtllm_xqa": "never",
    "trtllm_xqa_multiblock": "never",  # per CTA
    # SageAttention2 on SM90: sageattention/core.py line 151 picks pv_accum_dtype="fp32+fp32" ("PV
    # accumulation is done in FP32 (actually FP22), but added to a FP32 buffer", line 688);
    # csrc/qattn/qk_int_sv_f8_cuda_sm90.cu (commit d1a57a5): a fresh RO_temp per KV tile (line 328,
    # first wgmma with scale-d 0 at 333, one wgmma per 32 keys at 337), RO += RO_temp in FP32 at 353.
    "sageattn2": "tile",
    # hpc-ops prefill FP8 (commit 6e2eced, since 82d80e8 "SM90 fp8 double-O accumulator"):
    # src/attention/prefill/kernels.cuh lines 1376-1403: each KV tile's P·V wgmma starts a fresh tOr
    # (ScaleOut::Zero, line 1378) and tYr(i) += tOr(i) adds it to the FP32 output (line 1403).
    "hpc_ops": "tile",
    # Before that commit (e363e86, the S = 1 kernel): kernels.cuh clear(tYr) once (line 1297), then every
    # tile's wgmma accumulates into tYr itself with ScaleOut::One (lines 1266, 1400-1401).
    "hpc_ops_prior": "never",
}
#: Other promotion intervals in the wild: DeepGEMM's SM90 FP8 GEMM promotes the wgmma accumulator into
#: FP32 registers every BLOCK_K = 128 (deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh lines
#: 249 and 303, "Promote with scales", commit 54e2261); this package's Pallas Mosaic kernel uses a fresh
#: accumulator per KV block (pallas_kernels/mosaic_gpu.py, ``plgpu.ACC`` per block, then
#: ``block.accumulate``): ``"tile"``.
#: Mantissa bits of the default accumulator model: "around 14 bits" (DeepSeek-V3 technical report
#: §3.3.2, measured on H800; an assumption until ``benchmarks/gpu_check.sh`` fits it on Hopper).
MMA_ACC_BITS_HOPPER = 14


def mma_model(name: str, bits: int = MMA_ACC_BITS_HOPPER) -> KernelConfig:
    """A MODEL variant of preset ``name`` with the FP8 MMA accumulator of ``bits`` mantissa bits.

    The promotion interval follows :data:`MMA_PROMOTION` (``"never"`` → 0, ``"tile"`` → the preset's
    ``block_kv``); the name gains ``_mma{bits}``. Not part of :data:`PRESETS`: the bit count is an
    assumption until a GPU measures it. Presets whose path was not read raise :class:`PcastError`.
    """
    cfg = get_preset(name)
    if name not in MMA_PROMOTION:
        raise PcastError(f"preset={name!r}: its MMA accumulation path was not read from source; presets with "
                         f"one: {', '.join(MMA_PROMOTION)}")
    promote = 0 if MMA_PROMOTION[name] == "never" else cfg.block_kv
    return dataclasses.replace(cfg, mma_acc_bits=bits, mma_promote_keys=promote, name=f"{name}_mma{bits}")


def get_preset(name: str) -> KernelConfig:
    """Look up a preset by name (see :data:`pcast_jax.presets.PRESETS`)."""
    check_choice("preset", name, tuple(PRESETS))
    return PRESETS[name]


def preset_for(name: str, head_dim: int) -> KernelConfig:
    """A preset with its KV tile resolved for ``head_dim`` (:data:`TILES_BY_HEAD_DIM`).

    Presets without a head-dim table, or head dims the table lacks, keep their tile. The name stays
    ``name``, the one a user passed (it keys tables and data sets); the tile that runs is the
    returned config's ``block_kv``.
    """
    cfg = get_preset(name)
    check_int("head_dim", head_dim, min_value=1)
    tiles = TILES_BY_HEAD_DIM.get(name, {})
    dims = sorted(d for d in tiles if d >= head_dim)
    if not dims or tiles[dims[0]] == cfg.block_kv:
        return cfg
    return dataclasses.replace(cfg, block_kv=tiles[dims[0]], name=name)


def resolve(config: str | KernelConfig) -> KernelConfig:
    """A preset name or a :class:`KernelConfig` → :class:`KernelConfig`."""
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return get_preset(config)
    raise PcastError(f"config={config!r} must be a preset name or a KernelConfig")
