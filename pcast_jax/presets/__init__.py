"""Every kernel preset, one module per kernel family, each preset beside the source file and line it
follows; this module is the one registry.

========================  =================================================================
module                    presets
========================  =================================================================
``paper``                 the paper's five configurations (§6.2, Table 2)
``flashattention``        FlashAttention-3, FA3 split-KV, FlashAttention-4 and its 2026 versions
``flashinfer``            FlashInfer SM90 prefill, SM100 CuTe-DSL (FMHA and paged prefill), SM120 prims
``trtllm``                TensorRT-LLM XQA (one CTA, multi-block) and fmha_v2 (exp2f, non-exp2f, skip-softmax)
``sageattention``         SageAttention2, 2++ and 3
``hpc_ops``               Tencent hpc-ops before and after the paper
``cudnn``                 cuDNN FP8 / MXFP8 SDPA: the open SM100 / SM120 kernels and the older test reference
                          (JAX's and Transformer Engine's FP8 attention)
``vllm``                  vLLM's Triton unified attention and its FlashAttention-4 fork
``sglang``                SGLang's Triton decode
``amd``                   FlashAttention's ROCm Triton backend, vLLM's ROCm Triton attention, aiter's Triton
                          MHA (MI300, MI355) and gfx950 ASM MLA decode, FlyDSL's gfx950 FP8 flash attention
``modelopt``              NVIDIA Model Optimizer's NVFP4 P fake-quantization
``research``              designs no released kernel runs (per-block 2^k, MXFP8 P)
``tpu``                   JAX's TPU ragged paged attention (P against each block's own max), FP8-cast
``tensorrt``              TensorRT's ``IAttention`` with an INT8-quantized softmax
``litert``                LiteRT's quantized softmax (UINT8-like P, scale 1/256) as qwix models it
========================  =================================================================

A preset's identity is its semantics (:class:`~pcast_jax.config.KernelConfig` equality), so moving
it between modules changes no sweep fingerprint. Its name is its key in its module's ``PRESETS``, written
once: the registry names each config by its key. Each preset has a tag (:data:`TAGS`) naming the study
that runs it; :func:`tagged` gives a study its presets.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import (
    amd,
    cudnn,
    flashattention,
    flashinfer,
    hpc_ops,
    litert,
    modelopt,
    paper,
    research,
    sageattention,
    sglang,
    tensorrt,
    tpu,
    trtllm,
    vllm,
)
from pcast_jax.presets.trtllm import XQA_CTA_TILE_TOKENS, XQA_DECODE_LAUNCH, xqa_nb_sub_seq

__all__ = ["get_preset", "preset_for", "resolve", "tagged", "Tag", "TAGS", "PRESETS", "FAMILIES",
           "TILES_BY_HEAD_DIM", "MMA_PROMOTION", "MMA_ACC_BITS_HOPPER", "mma_model", "XQA_CTA_TILE_TOKENS",
           "XQA_DECODE_LAUNCH", "xqa_nb_sub_seq"]

_MODULES = (paper, flashattention, flashinfer, trtllm, sageattention, hpc_ops, cudnn, vllm, sglang, amd, modelopt,
            research, tpu, tensorrt, litert)

#: The study a preset belongs to, which selects the presets it runs (:func:`tagged`):
#:
#: * ``"paper"``: the paper's five configurations (§6.2, Table 2): Q, K, V in FP32, ℓ from pre-cast P, B = 64;
#: * ``"table3"``: production kernels of the paper's Table 3, each following its public source (tiles at
#:   head dim 128; :func:`preset_for` resolves another head dim);
#: * ``"block_scaled"``: a block-scaled P (simulator only: the Pallas kernels run E4M3 P alone);
#: * ``"sinks_and_rescale"``: learned sinks, the lazy rescale, cuDNN, Blackwell: the FP8 attention served
#:   and trained with in 2026;
#: * ``"amd"``: FP8 attention on AMD GPUs (ROCm): MI300's E4M3FNUZ and MI355's E4M3;
#: * ``"p_knobs"``: P-precision knobs beyond a scale: P against each block's own max (the collapse-free
#:   control), fixed-point INT8 / UINT8 P of a normalised softmax, skip-softmax.
Tag = Literal["paper", "table3", "block_scaled", "sinks_and_rescale", "amd", "p_knobs"]

#: Preset name → its :data:`Tag`, in registry order (the order of :data:`PRESETS`, :data:`FAMILIES` and
#: every listing). A preset's source and its citation live in its family module; the tag, not the module,
#: says which study runs it.
TAGS: dict[str, Tag] = {
    **dict.fromkeys(("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"), "paper"),
    **dict.fromkeys(("fa3", "fa4", "flashinfer_sm90", "trtllm_xqa", "trtllm_xqa_multiblock", "fa3_splitkv", "sageattn2",
                     "sageattn2pp", "hpc_ops_prior", "hpc_ops", "dynamic_pow2"), "table3"),
    **dict.fromkeys(("sageattn3", "nvfp4_fakequant", "mxfp8_p"), "block_scaled"),
    **dict.fromkeys(("cudnn_sm100_fp8", "cudnn_sm100_fp8_e5m2", "cudnn_sm120_fp8",
                     "cudnn_fp8", "cudnn_fp8_tau0", "cudnn_fp8_s32", "cudnn_fp8_s32_tau0", "cudnn_mxfp8", "te_fp8_dpa",
                     "fa4_pr2109", "fa4_pr2717", "vllm_triton_fp8", "vllm_triton_fp8_3d", "vllm_triton_fp8_rocm",
                     "vllm_fa4", "flashinfer_sm100_cutedsl", "flashinfer_sm100_cutedsl_paged", "flashinfer_sm120",
                     "flashinfer_sm120_pr5020", "trtllm_fmha_v2", "trtllm_fmha_v2_nonexp2f", "sglang_triton_decode"),
                    "sinks_and_rescale"),
    **dict.fromkeys(("fa_triton_amd_mi300", "fa_triton_amd_mi355", "vllm_rocm_flash_fp8", "aiter_mha_fp8_mi300",
                     "aiter_mha_fp8_mi355", "aiter_mla_asm_fp8_gfx950", "flydsl_fp8_gfx950",
                     "flydsl_fp8_gfx950_pr1020"), "amd"),
    **dict.fromkeys(("trtllm_fmha_v2_skip", "tpu_ragged_paged_fp8p", "tensorrt_int8", "litert_uint8"), "p_knobs"),
}
assert set(TAGS.values()) == set(get_args(Tag)), "a tag without presets"



def _register(presets: dict[str, KernelConfig]) -> dict[str, KernelConfig]:
    """A family's ``PRESETS`` registered: each config named by its key, the one place a preset's name is
    written (the modules leave ``name`` out). The module's dict is updated in place, so its own look-ups
    (``cudnn.PRESETS["cudnn_fp8"]``) carry the name too."""
    presets.update({key: dataclasses.replace(cfg, name=key) for key, cfg in presets.items() if cfg.name != key})
    return presets


_BY_NAME: dict[str, KernelConfig] = {name: cfg for module in _MODULES
                                     for name, cfg in _register(module.PRESETS).items()}
assert sorted(_BY_NAME) == sorted(TAGS), f"presets without a tag or tags without a preset: {set(_BY_NAME) ^ set(TAGS)}"

#: Every preset by name, in registry order.
PRESETS: dict[str, KernelConfig] = {name: _BY_NAME[name] for name in TAGS}

#: Kernel family (module) → the names of its presets, in registry order.
FAMILIES: dict[str, tuple[str, ...]] = {
    module.__name__.rsplit(".", 1)[1]: tuple(n for n in PRESETS if n in module.PRESETS) for module in _MODULES}


def tagged(tag: Tag) -> dict[str, KernelConfig]:
    """The presets with ``tag`` (:data:`TAGS`), in registry order."""
    check_choice("tag", tag, get_args(Tag))
    return {name: PRESETS[name] for name, t in TAGS.items() if t == tag}


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


def resolve(config: str | KernelConfig, *, head_dim: int | None = None) -> KernelConfig:
    """A preset name or a :class:`KernelConfig` → :class:`KernelConfig`: the one resolution of a caller's
    config, made once by each entry point (the engines take its result bound, :func:`pcast_jax.engine.bound`).

    With ``head_dim`` a preset name gets its KV tile for that head dim (:func:`preset_for`); a
    :class:`KernelConfig` is used as it is.
    """
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return get_preset(config) if head_dim is None else preset_for(config, head_dim)
    raise PcastError(f"config={config!r} must be a preset name or a KernelConfig")
