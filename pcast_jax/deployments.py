"""From a deployment to the kernel it runs: one table of data, and the doctor's answer over it.

A deployment is what a user configures — an engine, its attention backend, the GPU architecture, the
KV-cache dtype and the checkpoint's attention scales — not a preset. :data:`DEPLOYMENTS` maps each known
combination to the preset(s) of :mod:`pcast_jax.presets` it runs, with the engine's file that makes the
choice and the knob, if any, through which a checkpoint or the caller sets the P scale S. :func:`diagnose`
simulates each preset at the S that knob gives on the paper's sink workload over a Δ range, and, where
P-collapse shows, simulates the knob's candidate settings and recommends the smallest that keeps both the
zeroed and the clipped mass under the limit. ``pcast doctor`` prints it.

A combination the table lacks is refused with the known ones listed: the table is never guessed from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Literal

import numpy as np

from pcast_jax.config import COMPUTED_SCALE_MODES, KernelConfig, scale_candidates
from pcast_jax.criterion import (
    CLIPPED_MASS_LIMIT,
    ZEROED_MASS_LIMIT,
    Z,
    over_limits,
    verdict_word,
    worst_delta,
)
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import get_preset, preset_for
from pcast_jax.stats import mean_sem

__all__ = ["no_fp8_p_advice", "Capabilities", "ModelFeatures", "Support", "SUPPORTS", "UNREAD",
           "Deployment", "DEPLOYMENTS", "ENGINES", "GPUS", "KV_CACHE_DTYPES", "KNOBS", "find", "checkpoint_scales",
           "layer_groups", "PROB_SCALE_DEFAULT", "MAX_SCALE_VALUES",
           "scale_from_knob", "knob_from_scale", "knob_setting", "configured", "SCALE_RANGE", "Diagnosis", "diagnose",
           ]

#: GPU architectures: NVIDIA compute capabilities and AMD gfx targets.
GPUS = ("sm90", "sm100", "sm120", "gfx942", "gfx950")
#: KV-cache dtypes with an FP8 attention path (``fp8`` is vLLM's name for E4M3).
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
#: How a deployment sets the P scale S: ``"none"`` (fixed by the kernel), ``"prob_scale"`` (S = factor/prob_scale,
#: a checkpoint's calibrated scale) or ``"scale_s"`` (S = scale_s, the caller's argument).
Knob = Literal["none", "prob_scale", "scale_s"]
KNOBS = ("none", "prob_scale", "scale_s")


#: Whether a backend supports a model feature, as read from its source (``"unknown"``: not read).
Support = Literal["yes", "no", "unknown"]
SUPPORTS = ("yes", "no", "unknown")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a backend can run, read from its source and cited in ``source``: a model that needs what the
    backend lacks is not served by it, whatever its P-cast does."""

    #: logit soft-capping (Gemma-2 style ``cap·tanh(logit/cap)``)
    soft_cap: Support = "unknown"
    #: a sliding (local) attention window
    sliding_window: Support = "unknown"
    #: learned sink logits (gpt-oss ``sinks``)
    learned_sinks: Support = "unknown"
    #: the head dims it takes (empty: not read, or any in ``min_head_dim`` … 256)
    head_dims: tuple[int, ...] = ()
    #: the smallest head dim it takes (0: not read)
    min_head_dim: int = 0
    #: where these were read (file:line at a commit)
    source: str = ""
    #: what the engine does instead when the model needs what the backend lacks, where its source says
    instead: str = ""

    def __post_init__(self):
        for name in ("soft_cap", "sliding_window", "learned_sinks"):
            check_choice(name, getattr(self, name), SUPPORTS)
        for d in self.head_dims:
            check_int("head_dims", d, min_value=1)
        check_int("min_head_dim", self.min_head_dim, min_value=0)
        if any(getattr(self, n) != "unknown" for n in ("soft_cap", "sliding_window", "learned_sinks")) or \
                self.head_dims or self.min_head_dim:
            if not self.source:
                raise PcastError("Capabilities: source must cite where the capabilities were read")


#: A backend whose capabilities were not read.
UNREAD = Capabilities()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelFeatures:
    """What a model asks of an attention backend: read from its trace by :meth:`of_trace`."""

    #: some layer soft-caps its logits
    soft_cap: bool
    #: some layer has a sliding (local) window
    sliding_window: bool
    #: some head has a learned sink logit
    learned_sinks: bool
    #: the head dim
    head_dim: int
    #: query heads per KV head
    gqa_ratio: int

    @classmethod
    def of_trace(cls, trace) -> "ModelFeatures":
        """The features of a :class:`~pcast_jax.analysis.Trace` or ``StreamedTrace`` (its soft caps, windows, sinks and
        shapes; no layer is read)."""
        for name in ("num_heads", "num_kv_heads", "head_dim", "logits_soft_cap", "local_window_size", "sinks"):
            if not hasattr(trace, name):
                raise PcastError(f"trace={type(trace).__name__}: a Trace (Recorder.trace() or load_trace) is needed, "
                                 f"with {name!r}")
        cap, window, sinks = trace.logits_soft_cap, trace.local_window_size, trace.sinks
        return cls(soft_cap=cap is not None and bool(np.any(np.asarray(cap) > 0)),
                   sliding_window=window is not None and bool(np.any(np.asarray(window) >= 0)),
                   learned_sinks=sinks is not None and bool(np.any(np.isfinite(np.asarray(sinks)))),
                   head_dim=int(trace.head_dim), gqa_ratio=int(trace.num_heads) // int(trace.num_kv_heads))

    def words(self) -> str:
        """The features in one line."""
        yes = {True: "yes", False: "no"}
        return (f"logit soft-cap: {yes[self.soft_cap]}; sliding window: {yes[self.sliding_window]}; learned sinks: "
                f"{yes[self.learned_sinks]}; head dim {self.head_dim}; {self.gqa_ratio} query heads per KV head")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One row of :data:`DEPLOYMENTS`: what an engine's backend runs on a GPU generation."""

    #: the serving or training stack (``vllm``, ``sglang``, ``tensorrt-llm``, ``jax``, ...)
    engine: str
    #: its attention backend as the engine names it
    backend: str
    #: GPU architectures this row holds for (:data:`GPUS`)
    gpus: tuple[str, ...]
    #: the preset it runs, and for a backend with a second path (decode, split-KV) that one too; empty when
    #: the backend casts no P to FP8 (the note says why)
    presets: tuple[str, ...]
    #: how the P scale is set (:data:`KNOBS`)
    knob: str
    #: the kernel's entry in the engine (file and lines where read); the kernel's own facts are cited
    #: beside its preset
    source: str
    #: what the user should know about this row (assumptions included)
    note: str = ""
    #: with the ``prob_scale`` knob, S = knob_factor / prob_scale (vLLM doubles a checkpoint's prob_scale on
    #: E4M3FNUZ GPUs: 0.5 there, :func:`pcast_jax.presets.amd.vllm_rocm_flash_scale`)
    knob_factor: float = 1.0
    #: the engine's selection line: which backend runs, when Q is FP8, which kernel (file:line or symbol at
    #: a named commit; "not read" where it was not)
    selection: str = ""
    #: the KV-cache dtypes this row holds for (:data:`KV_CACHE_DTYPES`)
    kv_cache_dtypes: tuple[str, ...] = ("fp8", "fp8_e4m3")
    #: what the backend can run (:class:`Capabilities`)
    capabilities: Capabilities = UNREAD

    def __post_init__(self):
        check_choice("knob", self.knob, KNOBS)
        for gpu in self.gpus:
            check_choice("gpu", gpu, GPUS)
        for dtype in self.kv_cache_dtypes:
            check_choice("kv_cache_dtype", dtype, KV_CACHE_DTYPES)
        for name in self.presets:
            get_preset(name)
        if not self.selection:
            raise PcastError(f"{self.engine} {self.backend}: selection must cite the engine's selection line")
        if not self.presets and self.knob != "none":
            raise PcastError(f"{self.engine} {self.backend}: a row that casts no P to FP8 has no P-scale knob")

    @property
    def casts_p(self) -> bool:
        """True when the backend casts P to FP8 (it runs a preset)."""
        return bool(self.presets)

    def cannot_run(self, features: ModelFeatures) -> list[str]:
        """Why this backend cannot run a model with ``features`` (empty: nothing its capabilities refuse)."""
        if not isinstance(features, ModelFeatures):
            raise PcastError(f"features={features!r} must be a ModelFeatures (ModelFeatures.of_trace(trace))")
        cap, out = self.capabilities, []
        for name, words in (("soft_cap", "logit soft-capping"), ("sliding_window", "a sliding window"),
                            ("learned_sinks", "learned sinks")):
            if getattr(features, name) and getattr(cap, name) == "no":
                out.append(f"the model needs {words}, which {self.engine} {self.backend} does not support")
        if cap.head_dims and features.head_dim not in cap.head_dims:
            out.append(f"head dim {features.head_dim} is not among the head dims it takes "
                       f"({', '.join(map(str, cap.head_dims))})")
        if cap.min_head_dim and features.head_dim < cap.min_head_dim:
            out.append(f"head dim {features.head_dim} is below the smallest it takes ({cap.min_head_dim})")
        return out

    def unread(self, features: ModelFeatures) -> list[str]:
        """The model's features whose support by this backend was not read from source."""
        cap = self.capabilities
        return [words for name, words in (("soft_cap", "logit soft-capping"), ("sliding_window", "sliding windows"),
                                          ("learned_sinks", "learned sinks"))
                if getattr(features, name) and getattr(cap, name) == "unknown"]


_VLLM_TRITON_CAPS = Capabilities(
    soft_cap="yes", sliding_window="yes", learned_sinks="yes", min_head_dim=32,
    source="vllm-project/vllm vllm/v1/attention/backends/triton_attn.py at 001ceb3: supports_head_size "
           "head_size >= 32 (lines 197-198), supports_sink True (lines 205-206), sliding_window and "
           "logits_soft_cap taken by TritonAttentionImpl (lines 238-246)")
_VLLM_TRITON_SELECTION = (
    "vllm-project/vllm vllm/v1/attention/backends/triton_attn.py line 267 at 001ceb3: "
    "supports_quant_query_input = current_platform.is_cuda(), so vLLM's attention layer quantizes Q to FP8 "
    "(query_quant, for an fp8 / fp8_e4m3 KV cache) on CUDA only; the backend is TRITON_ATTN when chosen "
    "(--attention-backend) or by the platform's priority list")

_AITER_UNIFIED_SOURCE = "ROCm/aiter aiter.ops.triton.unified_attention (the ROCm port of vLLM's unified attention)"
_AITER_UNIFIED_SELECTION = (
    "vllm-project/vllm vllm/v1/attention/backends/rocm_aiter_unified_attn.py line 162 at 00e5aa0: "
    "supports_quant_query_input = True (the attention layer quantizes Q to FP8 for an FP8 KV cache); the kernel is "
    "aiter's unified_attention (line 159)")
_AITER_MHA_SOURCE = "ROCm/aiter aiter/ops/triton/mha.py (FP8 Q/K/V: the Triton MHA's FP8 forward, called directly)"
_AITER_MHA_SELECTION = ("ROCm/aiter aiter/ops/triton/attention/mha.py line 118 at e404860 (called directly: FP8 Q/K/V "
                        "select the FP8 forward, FP8_MAX = torch.finfo(q.dtype).max)")
_FA_TRITON_AMD_SELECTION = (
    "ROCm/aiter aiter/ops/triton/_triton_kernels/flash_attn_triton_amd/fwd_prefill.py line 1942 at e404860 (the "
    "launcher passes FP8_P_DESCALE=False; the FP8 path runs for FP8 Q/K/V, lines 1723-1747); FlashAttention's own "
    "switch (FLASH_ATTENTION_TRITON_AMD_ENABLE) not read at a commit")
_AITER_UNIFIED_CAPS = Capabilities(
    soft_cap="yes", sliding_window="yes", learned_sinks="yes", min_head_dim=32,
    source="vllm-project/vllm vllm/v1/attention/backends/rocm_aiter_unified_attn.py at 00e5aa0: supports_head_size "
           "head_size >= 32 (lines 65-66), supports_sink True (lines 73-74), window_size and softcap passed to the "
           "kernel (RocmAiterUnifiedAttentionImpl.forward)")

#: Every known deployment. Each kernel's semantics are cited where its preset is defined; ``selection`` says
#: where the engine picks the backend and its FP8 path, ``source`` which file runs the kernel.
DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("vllm", "triton_attn", ("sm90", "sm100", "sm120"), ("vllm_triton_fp8", "vllm_triton_fp8_3d"),
               "none", "vllm-project/vllm vllm/v1/attention/backends/triton_attn.py; "
               "vllm/v1/attention/ops/triton_unified_attention.py (kernel_unified_attention)",
               "Q is FP8 on CUDA, so P is cast against the running max with S = 1; a checkpoint's prob_scale is "
               "not used for P here. The 3-D (split) path runs for long decodes.",
               selection=_VLLM_TRITON_SELECTION, capabilities=_VLLM_TRITON_CAPS),
    Deployment("vllm", "triton_attn", ("gfx942", "gfx950"), (), "none",
               "vllm-project/vllm vllm/v1/attention/backends/triton_attn.py (unified_attention)",
               "No FP8 P by default: on ROCm TRITON_ATTN does not take an FP8 query (is_cuda() is False), so Q "
               "stays in the model dtype, and the kernel hands back raw FP8 V only for an FP8 Q (_cast_kv_tile, "
               "see the vllm_triton_fp8 preset): V is dequantized and P·V runs in the model dtype. "
               "(The FP8-Q path, E4M3FNUZ P on MI300, is the rocm_aiter_unified_attn row.) TRITON_ATTN is last in "
               "vLLM's ROCm priority list (vllm/platforms/rocm.py _get_backend_priorities at 001eda3).",
               selection=_VLLM_TRITON_SELECTION + "; unchanged at 6301388 (TritonAttentionImpl.__init__: "
                         "self.supports_quant_query_input = current_platform.is_cuda())",
               capabilities=_VLLM_TRITON_CAPS),
    Deployment("vllm", "rocm_aiter_unified_attn", ("gfx942",), ("vllm_triton_fp8_rocm",), "none",
               _AITER_UNIFIED_SOURCE,
               "Q is FP8 here, so P is cast with S = 1 to the platform's FP8 type, E4M3FNUZ on MI300 (which "
               "zeroes less than E4M3: the collapse threshold is 11 ln 2, max 240). Assumption: aiter's port "
               "keeps vLLM's kernel semantics (tile 32 for 1-byte Q). vLLM picks this backend when asked "
               "(--attention-backend ROCM_AITER_UNIFIED_ATTN) or when the backends before it in "
               "_get_backend_priorities (vllm/platforms/rocm.py at 001eda3: ROCM_ATTN, ROCM_AITER_FA) do not "
               "validate.",
               selection=_AITER_UNIFIED_SELECTION,
               capabilities=_AITER_UNIFIED_CAPS),
    Deployment("vllm", "rocm_aiter_unified_attn", ("gfx950",), ("vllm_triton_fp8",), "none",
               _AITER_UNIFIED_SOURCE,
               "Q is FP8 here, so P is cast with S = 1 to OCP E4M3 on MI355. Assumption: aiter's port keeps vLLM's "
               "kernel semantics (tile 32 for 1-byte Q).",
               selection=_AITER_UNIFIED_SELECTION,
               capabilities=_AITER_UNIFIED_CAPS),
    Deployment("vllm", "rocm_attn", ("gfx942", "gfx950"), (), "none",
               "vllm-project/vllm vllm/v1/attention/backends/rocm_attn.py (chunked_prefill_paged_decode: "
               "context_attention_fwd for prefill, ops.paged_attention_rocm or kernel_paged_attention_2d for decode)",
               "No FP8 P: Q stays in the model dtype, and every path dequantizes the FP8 KV cache to it: the prefill "
               "kernel (vllm/v1/attention/ops/prefix_prefill.py _fwd_kernel at 53285d9: v = (v_load·v_scale)"
               ".to(q.dtype), p = p.to(v.dtype)), the Triton decode (chunked_prefill_paged_decode.py "
               "kernel_paged_attention_2d at 69f87df: V dequantized to Q.dtype, tl.dot(p.to(V.dtype), V)) and the "
               "ROCm custom paged attention (csrc/rocm/attention.cu at 4388f06: P normalised per 256-token partition "
               "and stored as the model dtype, from_floatx4<scalar_t>; FP8 V converted by convert_b8x8_custom"
               "<scalar_t> before a 16-bit MFMA). The ROCm priority list puts ROCM_ATTN first "
               "(vllm/platforms/rocm.py _get_backend_priorities at 001eda3).",
               selection="vllm-project/vllm vllm/v1/attention/backends/rocm_attn.py at f65b079: RocmAttentionImpl "
                         "does not set supports_quant_query_input, so the AttentionImpl default False holds "
                         "(vllm/v1/attention/backend.py, its commit not pinned) and the attention layer does not "
                         "quantize Q; forward calls chunked_prefill_paged_decode",
               capabilities=Capabilities(
                   soft_cap="no", sliding_window="yes", learned_sinks="yes",
                   head_dims=(32, 64, 96, 128, 160, 192, 224, 256),
                   source="vllm-project/vllm vllm/v1/attention/backends/rocm_attn.py at f65b079: "
                          "get_supported_head_sizes 32 … 256; RocmAttentionImpl.forward passes sliding_window and "
                          "sinks to chunked_prefill_paged_decode but not logits_soft_cap, which __init__ stores and "
                          "the kernels never see (not refused: the cap is dropped)")),
    Deployment("vllm", "rocm_flash", ("gfx942",), ("vllm_rocm_flash_fp8",), "prob_scale",
               "vllm-project/vllm vllm/attention/ops/triton_flash_attention.py (attn_fwd: p *= p_descale; "
               "acc_scale = p_scale * v_scale), kv-cache scale loader (prob_scale *= 2 on fnuz)",
               "vLLM's V0 ROCm backend only: V1 has no such backend (vllm/platforms/rocm.py "
               "_get_backend_priorities at 001eda3 lists ROCM_ATTN, ROCM_AITER_FA, ROCM_AITER_UNIFIED_ATTN and "
               "TRITON_ATTN for attention; none runs triton_flash_attention.py). The one backend that scales P "
               "by the checkpoint's prob_scale: S = 1/(2·prob_scale) on MI300; without a calibrated prob_scale "
               "S = 1 (vLLM warns 'Using uncalibrated q_scale 1.0 and/or prob_scale 1.0 with fp8 attention'). "
               "Tile 64 is an assumption (autotuned).", knob_factor=0.5,
               selection="vllm-project/vllm vllm/attention/backends/rocm_flash_attn.py at 00df342 (V0), "
                         "ROCmFlashAttentionImpl.__init__: use_triton_flash_attn = envs.VLLM_USE_TRITON_FLASH_ATTN, "
                         "Triton by default, which imports triton_attention",
               capabilities=Capabilities(
                   soft_cap="no", sliding_window="no",
                   source="vllm-project/vllm vllm/attention/backends/rocm_flash_attn.py (V0), "
                          "ROCmFlashAttentionImpl.__init__ in the version the search index stores beside 00df342 "
                          "(its commit not pinned): ValueError 'ROCm Triton FlashAttention does not support "
                          "attention logits soft capping'; warning 'ROCm Triton FA does not currently support "
                          "sliding window attention'",
                   instead="the same error advises the ROCm CK FlashAttention backend, VLLM_USE_TRITON_FLASH_ATTN=0 "
                           "(no FP8 P-cast modelled for it)")),
    Deployment("flash-attention", "triton_amd", ("gfx942",), ("fa_triton_amd_mi300",), "none",
               "Dao-AILab/flash-attention flash_attn/flash_attn_interface.py (FLASH_ATTENTION_TRITON_AMD_ENABLE "
               "imports aiter's flash_attn_triton_amd)",
               "FP8_P_DESCALE is hard-wired off: S = 1, E4M3FNUZ P (which zeroes less than E4M3: the collapse "
               "threshold is 11 ln 2 instead of 10 ln 2; max 240).",
               selection=_FA_TRITON_AMD_SELECTION),
    Deployment("flash-attention", "triton_amd", ("gfx950",), ("fa_triton_amd_mi355",), "none",
               "Dao-AILab/flash-attention flash_attn/flash_attn_interface.py (aiter's flash_attn_triton_amd)",
               "FP8_P_DESCALE is hard-wired off: S = 1, E4M3 P.",
               selection=_FA_TRITON_AMD_SELECTION),
    Deployment("aiter", "triton_mha", ("gfx942",), ("aiter_mha_fp8_mi300",), "none",
               _AITER_MHA_SOURCE,
               "One scale FP8_MAX/amax(P) per 128-query × 64-key tile (FP8_MAX 240 on E4M3FNUZ), shared by the "
               "tile's rows; which serving engines route FP8 attention here is not read from their source.",
               selection=_AITER_MHA_SELECTION),
    Deployment("aiter", "triton_mha", ("gfx950",), ("aiter_mha_fp8_mi355",), "none",
               _AITER_MHA_SOURCE,
               "One scale FP8_MAX/amax(P) per 128-query × 64-key tile (FP8_MAX 448), shared by the tile's rows; "
               "which serving engines route FP8 attention here is not read from their source.",
               selection=_AITER_MHA_SELECTION),
    Deployment("aiter", "mla_decode_asm", ("gfx950",), ("aiter_mla_asm_fp8_gfx950",), "none",
               "ROCm/aiter aiter/mla.py mla_decode_fwd (line 523 at e404860) → the closed code object "
               "hsa/gfx950/mla/mla_a8w8_qh16_qseqlen1_gqaratio16.co",
               "MLA decode with FP8 Q and an FP8 latent KV cache, one query token, 16 query heads per KV head: P is "
               "cast to FP8 with S = 1 (ROCm/aiter PR #5535). Assumptions: forward order, 64-key tile (the kernel "
               "is closed). Which serving engines route DeepSeek-style MLA decode on MI355 here is not settled: "
               "SGLang's aiter backend (aiter_backend.py at 25b38cc) runs mla_decode_fwd with the persistent "
               "work metadata for an FP8 KV cache (SGLANG_AITER_MLA_PERSIST, default on), i.e. the _ps code "
               "object (mla_asm.csv line 9: mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co), whose P cast PR #5535 does "
               "not report; vLLM's not read.",
               selection="ROCm/aiter hsa/gfx950/mla/mla_asm.csv line 14 at e404860 (qType fp8, kvType fp8, Gqa 16, "
                         "ps 0, qSeqLen 1 → mla_a8w8_qh16_qseqlen1_gqaratio16.co)"),
    Deployment("flydsl", "flash_attn_fp8", ("gfx950",), ("flydsl_fp8_gfx950",), "none",
               "ROCm/FlyDSL kernels/attention/flash_attn_fp8_gfx950.py (the dual-wave FP8 forward, called directly)",
               "S = 1 with a lazy rescale τ = 8 (log2): P 10 binades below the running max is zeroed while ℓ "
               "keeps it (the 0.637-for-1.0 output of FlyDSL PR #1020's V = 1 test). flydsl_fp8_gfx950_pr1020 is "
               "that PR's fix (S = 448 in the exponent, eager rescale for FP8), not in main at 11c4174.",
               selection="ROCm/FlyDSL kernels/attention/flash_attn_fp8_gfx950.py line 37 at 11c4174 "
                         "(build_flash_attn_dualwave_swp_fp8_module: called directly with FP8 Q/K/V, gfx950 only)",
               capabilities=Capabilities(
                   learned_sinks="no", head_dims=(128,),
                   source="ROCm/FlyDSL kernels/attention/flash_attn_fp8_gfx950.py at 11c4174: the D = 128 launcher "
                          "(docstring of build_flash_attn_dualwave_swp_fp8_module, lines 53-58), no sink argument")),
    Deployment("vllm", "flash_attn", ("sm90",), ("fa3", "fa3_splitkv"), "none",
               "vllm-project/flash-attention (vLLM's FA3 fork, hopper/)",
               "FA3's FP8 path folds S = 256 into the exponent and walks KV blocks in reverse.",
               selection="vllm-project/vllm vllm/attention/utils/fa_utils.py lines 36-37 and 66-68 at 0fa99d4: "
                         "FA3 by default on capability 9.x, and flash_attn_supports_fp8() only for FA3 on 9.x"),
    Deployment("vllm", "flash_attn", ("sm100",), ("vllm_fa4",), "none",
               "vllm-project/flash-attention PR #166 (vLLM's FA4 fork, flash_attn/cute/flash_fwd_sm100.py)",
               "S = 256 with a lazy rescale τ = 0.75 (log2). Assumption: the vLLM build runs the FA4 fork for an "
               "FP8 KV cache on Blackwell; at 0fa99d4 vLLM's fa_utils allowed FP8 only on 9.x.",
               selection="vllm-project/vllm vllm/attention/utils/fa_utils.py lines 45-49 and 66-68 at 0fa99d4: "
                         "FA2 and no FP8 on capability 10.x there; the later vLLM selection of the FA4 fork for an "
                         "FP8 KV cache not read (that it runs is an assumption)"),
    Deployment("vllm", "flashinfer", ("sm90",), (), "none",
               "vllm-project/vllm vllm/v1/attention/backends/flashinfer.py (BatchPrefill/DecodeWithPagedKVCache"
               "Wrapper with a model-dtype query)",
               "No FP8 P by default: FlashInfer runs its FP8 attention only when Q is FP8, and vLLM's FlashInfer "
               "backend keeps Q in the model dtype unless TRT-LLM attention can run (Blackwell): the FP8 KV cache "
               "is read into a model-dtype P·V. (flashinfer_sm90 models FlashInfer's SM90 FP8 kernel, called "
               "with FP8 Q.)",
               selection="vllm-project/vllm vllm/v1/attention/backends/flashinfer.py lines 347-355 at 00a817a: "
                         "q_data_type = the FP8 KV dtype only when can_use_trtllm_attention(...), else the model "
                         "dtype; vllm/utils/flashinfer.py supports_trtllm_attention requires "
                         "is_device_capability_family(100) in the versions read",
               capabilities=Capabilities(
                   learned_sinks="no", head_dims=(64, 128, 256),
                   source="vllm-project/vllm vllm/v1/attention/backends/flashinfer.py at 00a817a: head sizes "
                          "64, 128, 256 (lines 167-169); NotImplementedError for attention sinks without TRT-LLM "
                          "attention (lines 370-375)",
                   instead="for sinks the error advises 'trtllm on blackwell or flash attention on earlier GPUs'")),
    Deployment("vllm", "flashinfer", ("sm100",), ("trtllm_fmha_v2",), "none",
               "flashinfer-ai/flashinfer flashinfer/decode.py trtllm_batch_decode_with_kv_cache (line 3073) and "
               "flashinfer/prefill.py trtllm_batch_context_with_kv_cache (line 5289) at fb28d72: TRT-LLM-gen FMHA "
               "cubins, downloaded from NVIDIA's artifactory (closed)",
               "Q is quantized to the FP8 KV dtype here (the one vLLM path fed FP8 Q), so the TRT-LLM-gen kernels "
               "run FP8 Q·K and P·V. Their P cast is closed: the launch passes no P scale "
               "(include/flashinfer/trtllm/fmha/kernelParams.h at fb28d72 holds mScaleSoftmaxLog2, mOutputScale, "
               "mScaleSfKv, mScaleSfO and the skip-softmax factor, lines 179-188). Assumption: they cast P as "
               "TensorRT-LLM's open FP8 context kernel fmha_v2 does (trtllm_fmha_v2: forward, S = 256 in the "
               "exponent); order, S, τ and tile are unread, so this verdict is the assumption's, to be settled by "
               "a fingerprint on an SM100 GPU.",
               selection="vllm-project/vllm vllm/utils/flashinfer.py at 487151d: supports_trtllm_attention "
                         "requires current_platform.is_device_capability_family(100); use_trtllm_attention returns "
                         "True when q_dtype == current_platform.fp8_dtype() ('Must use TRTLLM attention if query is "
                         "FP8 quantized'); vllm/v1/attention/backends/flashinfer.py lines 347-355 at 00a817a: "
                         "q_data_type = the FP8 KV dtype when can_use_trtllm_attention(...)",
               capabilities=Capabilities(
                   learned_sinks="yes", head_dims=(64, 128, 256),
                   source="vllm-project/vllm vllm/v1/attention/backends/flashinfer.py at 00a817a: head sizes 64, "
                          "128, 256 (lines 167-169); vllm/utils/flashinfer.py use_trtllm_attention at 487151d: "
                          "sinks run on TRT-LLM attention ('the only backend that supports them')")),
    Deployment("sglang", "triton", ("sm90", "sm100", "sm120"), ("sglang_triton_decode",), "none",
               "sgl-project/sglang python/sglang/srt/layers/attention/triton_ops/decode_attention.py",
               "Decode with split KV; 8 splits is SGLang's maximum (the count is chosen per request).",
               selection="sgl-project/sglang python/sglang/srt/layers/attention/triton_backend.py line 165 at "
                         "0085842 (TritonAttnBackend reads max_kv_splits); the --attention-backend triton choice "
                         "and when its query is FP8 not read"),
    Deployment("sglang", "flashinfer", ("sm90", "sm100", "sm120"), (), "none",
               "sgl-project/sglang python/sglang/srt/layers/attention/flashinfer_backend.py "
               "(BatchPrefill/DecodeWithPagedKVCacheWrapper planned with a model-dtype query)",
               "No FP8 P: SGLang plans FlashInfer's wrappers with the model dtype as the query dtype, and FlashInfer "
               "runs its FP8 attention only when Q is FP8, so the FP8 KV cache is read into a model-dtype P·V "
               "(as vLLM's FlashInfer backend off Blackwell).",
               selection="sgl-project/sglang python/sglang/srt/layers/attention/flashinfer_backend.py at 454e84d: "
                         "FlashInferIndicesUpdaterDecode.__init__ and FlashInferIndicesUpdaterPrefill.__init__ set "
                         "self.q_data_type = model_runner.dtype, passed as q_data_type to begin_forward "
                         "(call_begin_forward)",
               capabilities=Capabilities(
                   sliding_window="yes",
                   source="sgl-project/sglang python/sglang/srt/layers/attention/flashinfer_backend.py at 454e84d: "
                          "a second wrapper for sliding-window layers (WrapperDispatch.SLIDING_WINDOW, "
                          "update_sliding_window)")),
    Deployment("sglang", "aiter", ("gfx942", "gfx950"), (), "none",
               "sgl-project/sglang python/sglang/srt/layers/attention/aiter_backend.py (aiter mha_batch_prefill_func "
               "for extend, paged_attention_ragged for decode; MLA models: mla_decode_fwd / mla_prefill_fwd)",
               "No FP8 P for standard (non-MLA) attention: with an FP8 KV cache SGLang converts the cache to the "
               "query's (model) dtype before both kernels and runs paged_attention_ragged with kv_cache_dtype "
               "'auto' (its TODOs: 'remove it when mha_batch_prefill_func / paged_attention_ragged support "
               "fp8-kv'). Were the FP8 path of paged_attention_ragged used, it would normalise P within each "
               "256-token partition before an unscaled FP8 cast (ROCm/aiter csrc/cpp_itfs/pa/pa_kernels.cuh at "
               "e404860: T_PAR_SIZE 256 line 46, inv_sum_scale lines 586-588, __builtin_amdgcn_cvt_pk_fp8_f32 lines "
               "633-647; ROCm/aiter PR #5642): KernelConfig cannot express a P normalised per partition "
               "(p_offset='row_lse' normalises the whole row and takes no KV split), so no preset models it. MLA "
               "models take aiter's MLA kernels (the aiter mla_decode_asm row; not read for SGLang).",
               selection="sgl-project/sglang python/sglang/srt/layers/attention/aiter_backend.py at 25b38cc: "
                         "AiterAttnBackend.forward_extend and forward_decode, k_cache = k_cache.to(q.dtype) and "
                         "v_cache = v_cache.to(q.dtype) when self.kv_cache_dtype == fp8_dtype",
               capabilities=Capabilities(
                   soft_cap="yes",
                   source="sgl-project/sglang python/sglang/srt/layers/attention/aiter_backend.py at 25b38cc: "
                          "logits_soft_cap = layer.logit_cap passed to mha_batch_prefill_func (forward_extend) and "
                          "to paged_attention_ragged (forward_decode)")),
    Deployment("sglang", "fa3", ("sm90",), ("fa3", "fa3_splitkv"), "none",
               "sgl-project/sglang python/sglang/srt/layers/attention/flashattention_backend.py "
               "(flash_attn_with_kvcache, FA3 from sgl-kernel)",
               "With an FP8 KV cache and head dim ≤ 256 SGLang casts Q to the cache's FP8 type, so FA3's FP8 "
               "path runs: S = 256 in the exponent, reverse KV order; its split-KV decode splits as FA3's "
               "heuristic picks (fa3_splitkv's count is an assumption). Above head dim 256 Q stays in the model "
               "dtype and no P is cast to FP8.",
               selection="sgl-project/sglang python/sglang/srt/layers/attention/flashattention_backend.py at "
                         "003e7b7: FlashAttentionBackend.forward_extend and forward_decode, q = "
                         "q.to(self.kv_cache_dtype) when kv_cache_dtype_str != 'auto' and layer.head_dim <= 256",
               capabilities=Capabilities(
                   soft_cap="yes", sliding_window="yes",
                   source="sgl-project/sglang python/sglang/srt/layers/attention/flashattention_backend.py at "
                          "003e7b7: window_size and softcap=layer.logit_cap passed to flash_attn_with_kvcache in "
                          "forward_extend")),
    Deployment("tensorrt-llm", "xqa", ("sm90",), ("trtllm_xqa", "trtllm_xqa_multiblock"), "none",
               "NVIDIA/TensorRT-LLM XQA (decode; mha_sm90.cu as vendored by flashinfer)", "",
               selection="NVIDIA/TensorRT-LLM cpp/kernels/xqa/mha_sm90.cu launchHopperF8MHA at 014dadc (the FP8 "
                         "Hopper launcher); the engine's choice of XQA for decode not read"),
    Deployment("tensorrt-llm", "fmha_v2", ("sm90",), ("trtllm_fmha_v2",), "none",
               "NVIDIA/TensorRT-LLM fmha_v2 (context; numeric_types.h Softmax_fp_quant_scale)", "",
               selection="flashinfer-ai/flashinfer flashinfer/jit/attention/fmha_v2/fmha_library.py lines 183 and "
                         "265 at fb28d72 (the warp-specialized e4m3 context kernel generated for SM90); "
                         "TensorRT-LLM's own dispatch not read"),
    Deployment("tensorrt-llm", "fmha_v2", ("sm120",), ("trtllm_fmha_v2",), "none",
               "NVIDIA/TensorRT-LLM fmha_v2 (context), its non-warp-specialized FP8 path as vendored by flashinfer "
               "(csrc/fmha_v2/fmha/softmax.h)",
               "S = 256 in the exponent on this path too: apply_exp_with_mask takes max − logf(SOFTMAX_FP_QUANT_SCALE) "
               "(csrc/fmha_v2/fmha/softmax.h lines 1250-1255 and 2802-2807 at fb28d72; Softmax_fp_quant_scale<e4m3> "
               "= 256, fmha/numeric_types.h lines 48-53), in FlashInfer's vendored copy. Assumptions: that "
               "TensorRT-LLM's own fmha_v2 casts P alike on SM120 (its tree has a warp-specialized SM120 path, "
               "not read), the forward KV order and the 256-key tile of the SM90 warp-specialized kernel (the "
               "SM120 loop and tile were not read); that an FP8 KV cache runs the FP8 context kernel (Q in FP8) is "
               "not read.",
               selection="NVIDIA/TensorRT-LLM cpp/tensorrt_llm/common/attentionOp.h at 6a9c95e: AttentionOp "
                         "mUseTllmGen = (mSM >= 100) && (mSM != 120), so SM120 keeps the fmha_v2 runner "
                         "(FusedMHARunnerV2); flashinfer-ai/flashinfer flashinfer/prefill.py line 5728 at fb28d72 "
                         "(fmha_v2_prefill_sm120, FlashInfer's SM120 entry to the same kernels)"),
    Deployment("tensorrt-llm", "trtllm_gen", ("sm100",), ("trtllm_fmha_v2",), "none",
               "NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/trtllmGenKernels/fmha (TRT-LLM-gen FMHA: closed cubins)",
               "The same closed TRT-LLM-gen kernels as vLLM's FlashInfer backend on SM100: the P cast is not "
               "readable. Assumption: they cast P as the open fmha_v2 FP8 context kernel does (trtllm_fmha_v2: "
               "forward, S = 256 in the exponent); that an FP8 KV cache runs them with FP8 Q is not read either. "
               "The verdict is the assumption's, to be settled by a fingerprint on an SM100 GPU.",
               selection="NVIDIA/TensorRT-LLM cpp/tensorrt_llm/common/attentionOp.h at 6a9c95e: AttentionOp "
                         "mUseTllmGen = (mSM >= 100) && (mSM != 120) selects TRT-LLM-gen on SM100; the FP8 path "
                         "within it not read"),
    Deployment("tensorrt-llm", "fmha_v2_skip_softmax", ("sm90",), ("trtllm_fmha_v2_skip",), "none",
               "NVIDIA/TensorRT-LLM fmha_v2 (context) with skip-softmax, as vendored by flashinfer "
               "(csrc/fmha_v2/fmha/warpspec/epilogue.h, ENABLE_SKIP_SOFTMAX kernels)",
               "fmha_v2's FP8 context kernel (S = 256 in the exponent) with skip-softmax on: a KV tile whose "
               "exp(local max − running max) is below λ = factor / KV length for every row of a warpgroup adds to "
               "neither O nor ℓ. Off unless the caller passes a factor; the preset takes factor 4 at 4,096 keys "
               "(λ = 2^-10), an assumed setting.",
               selection="flashinfer-ai/flashinfer flashinfer/prefill.py at fb28d72: trtllm_fmha_v2_prefill (line "
                         "5995) takes skip_softmax_threshold_scale_factor: float = 0 (line 6021, off), threshold = "
                         "factor / seqlen (line 6111); TensorRT-LLM's own switch not read"),
    Deployment("jax", "cudnn", ("sm90",), ("cudnn_fp8_tau0",), "scale_s",
               "jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py (dot_product_attention, use_fp8=True, "
               "fp8_params['scale_s'])",
               "Answers about cuDNN's closed SM90 engine, modelled by its older test reference (τ = 0, P·scale_s "
               "cast): an assumption (cudnn-frontend has no open SM90 FP8 kernel).",
               selection="jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py lines 370-377 at cec06d1 (the FP8 "
                         "checks of use_fp8=True); which cuDNN engine XLA's graph reaches is closed (assumption)"),
    Deployment("jax", "cudnn", ("sm100",), ("cudnn_sm100_fp8",), "none",
               "jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py (use_fp8=True)",
               "Answers about cuDNN's open SM100 FP8 kernels, which cast P at a baked S = 16 and ignore scale_s "
               "(no knob reaches P); that XLA's cuDNN call reaches them and not a closed engine is an assumption. "
               "The capabilities are the open kernels'; what JAX's FP8 call passes them was not read.",
               selection="jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py lines 370-377 at cec06d1; "
                         "NVIDIA/cudnn-frontend python/cudnn/sdpa/fwd/kernels/sm100/prefill_d128_fp8.py lines "
                         "11-12 at 0341681 (scale_s accepted and ignored)",
               capabilities=Capabilities(
                   sliding_window="yes", learned_sinks="yes", head_dims=(64, 128, 192, 256, 512),
                   source="NVIDIA/cudnn-frontend python/cudnn/sdpa/fwd/kernels/sm100/prefill_d128_fp8.py at "
                          "0341681: d_flavor 64 or 128 (lines 95-97), MASK_SWA (lines 152-158), the sink "
                          "denominator term (lines 184-185); the sibling files prefill_d192_d128_fp8.py, "
                          "prefill_d256_fp8.py, prefill_d512_fp8.py for the larger head dims")),
    Deployment("jax", "cudnn", ("sm120",), ("cudnn_sm120_fp8",), "none",
               "jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py (use_fp8=True)",
               "Answers about cuDNN's open SM120 FP8 kernel (reverse order, baked S = 16, scale_s ignored); "
               "that XLA's cuDNN call reaches it is an assumption.",
               selection="jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py lines 370-377 at cec06d1; "
                         "NVIDIA/cudnn-frontend python/cudnn/sdpa/fwd/kernels/sm120/prefill_fp8.py lines 103-113 "
                         "at 020f739 (scale_s accepted and ignored)"),
    Deployment("transformer-engine", "fp8_dpa", ("sm90",), ("te_fp8_dpa",), "none",
               "NVIDIA/TransformerEngine dot_product_attention.py (fp8_dpa through cuDNN)",
               "S from the delayed-scaling recipe: 448 once the recorded amax of P is 1.",
               selection="NVIDIA/TransformerEngine transformer_engine/pytorch/attention/dot_product_attention/"
                         "dot_product_attention.py lines 1011-1027 at d0067d0 (fp8_dpa's scale from the recipe); "
                         "the cuDNN engine chosen is closed (assumption)"),
    Deployment("flash-attention", "fa3", ("sm90",), ("fa3",), "none",
               "Dao-AILab/flash-attention hopper/ (flash_attn_interface, FP8 forward)", "",
               selection="Dao-AILab/flash-attention hopper/tile_size.h tile_size_fwd_sm90() lines 42-52 at "
                         "0251105a (called directly: FP8 Q/K/V, element_size == 1, select the FP8 forward)"),
    Deployment("flash-attention", "fa4", ("sm100",), ("fa4",), "none",
               "Dao-AILab/flash-attention flash_attn/cute/ (flash_fwd_sm100.py)", "",
               selection="Dao-AILab/flash-attention flash_attn/cute/interface.py line 318 at 0251105a (called "
                         "directly; the SM100 forward config)"),
    Deployment("sageattention", "sageattn2", ("sm90",), ("sageattn2",), "none",
               "thu-ml/SageAttention csrc/qattn/qk_int_sv_f8_cuda_sm90.cu", "",
               selection="thu-ml/SageAttention sageattention/core.py line 151 at d1a57a5 (sageattn picks the SM90 "
                         "kernel, pv_accum_dtype fp32+fp32)"),
    Deployment("sageattention", "sageattn3", ("sm100", "sm120"), ("sageattn3",), "none",
               "thu-ml/SageAttention sageattention3_blackwell/", "NVFP4 P.",
               selection="thu-ml/SageAttention sageattention3_blackwell/sageattn3/blackwell/launch.h line 105 at "
                         "d1a57a5 (called directly)"),
)

#: The engines :data:`DEPLOYMENTS` knows.
ENGINES = tuple(dict.fromkeys(d.engine for d in DEPLOYMENTS))


def _known(rows) -> str:
    return "; ".join(f"{d.engine} {d.backend} on {','.join(d.gpus)}" for d in rows)


def find(engine: str, backend: str, gpu: str, kv_cache_dtype: str = "fp8") -> Deployment:
    """The row for this deployment; a :class:`PcastError` listing the known ones when there is none, or naming
    the KV-cache dtypes the row takes when ``kv_cache_dtype`` is not among them."""
    check_choice("gpu", gpu, GPUS)
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("engine", engine, ENGINES)
    rows = [d for d in DEPLOYMENTS if d.engine == engine]
    for d in rows:
        if d.backend == backend and gpu in d.gpus:
            if kv_cache_dtype not in d.kv_cache_dtypes:
                raise PcastError(f"kv_cache_dtype={kv_cache_dtype!r}: {engine} {backend} on {gpu} runs FP8 attention "
                                 f"with {', '.join(map(repr, d.kv_cache_dtypes))} only")
            return d
    raise PcastError(f"no known FP8 attention for engine={engine!r} backend={backend!r} gpu={gpu!r}; "
                     f"known for {engine}: {_known(rows)}")


_SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")
#: The most values one q/k/v scale tensor may hold (per head, per token and head).
MAX_SCALE_VALUES = 1 << 20
#: What vLLM does with a layer's ``prob_scale``, read from its source (vllm-project/vllm @190900b
#: ``vllm/model_executor/layers/quantization/kv_cache.py``): every attention layer's ``prob_scale`` starts at
#: −1.0, "not loaded" (L42); ``process_weights_after_loading`` doubles a loaded one on FNUZ GPUs (L110-113)
#: and sets a missing one to 1.0, not doubled (L114-115: the kernel's S = 1, the preset as it is), and
#: refuses one that is not a single number (L117-126). Its loader reads every tensor of each shard the
#: index names, listed in ``weight_map`` or not (vllm-project/vllm @0a1ee72
#: ``vllm/model_executor/model_loader/weight_utils.py``: ``filter_duplicate_safetensors_files`` keeps the
#: files ``weight_map`` names, ``safetensors_weights_iterator`` yields ``for name in f.keys()`` of each).
PROB_SCALE_DEFAULT = 1.0
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def _layer_of(name: str) -> str:
    """The attention layer a scale tensor belongs to: ``layers.N`` where the name holds it, else its prefix."""
    match = _LAYER.search(name)
    return f"layers.{match.group(2)}" if match else (name.rpartition(".")[0] or name)


def checkpoint_scales(folder: str | os.PathLike) -> dict:
    """The attention scales a checkpoint folder holds, and what the engine does where one is missing.

    Reads only tensors whose names end in ``q_scale``, ``k_scale``, ``v_scale`` or ``prob_scale`` (never
    the weights), from ``model.safetensors``, the shards ``model.safetensors.index.json`` names or else
    every ``*.safetensors`` file, through :mod:`pcast_jax.safetensors_files` (headers bounded, layout
    validated by the ``safetensors`` library; a pipe, an index entry outside the folder or a tensor in two
    files refused). A scale tensor in a shard the index names but missing from its ``weight_map`` is read
    too (vLLM's loader reads every tensor of a listed shard: :data:`PROB_SCALE_DEFAULT`) and named.

    Returns ``{"q_scale", "k_scale", "v_scale", "prob_scale": {tensor name: value}, "layers": {layer:
    prob_scale or None}, "unindexed": [tensor names]}``. A q/k/v scale is a number, or a list of numbers
    per head or per token and head (up to :data:`MAX_SCALE_VALUES`): read and shown, never used for P.
    ``prob_scale`` must be one number (vLLM refuses any other). ``layers``: every attention layer that holds
    a scale (``layers.N`` where the name says, and each layer of ``config.json``'s ``num_hidden_layers``),
    None where it has no ``prob_scale`` (the engine then uses :data:`PROB_SCALE_DEFAULT`). A value that is
    not finite and in :data:`SCALE_RANGE`, or of another dtype than F32, F16 or BF16, is refused, naming the
    tensor and the file.
    """
    from pcast_jax import fileio, safetensors_files

    path = Path(folder)
    if not path.is_dir():
        raise PcastError(f"checkpoint={str(path)!r} is not a folder (a Hugging Face checkpoint folder with "
                         "*.safetensors files)")
    if not any(path.glob("*.safetensors")):
        raise PcastError(f"checkpoint={str(path)!r} holds no *.safetensors file")
    headers: dict = {}
    files = dict(safetensors_files.tensor_files(path, headers))
    unindexed = []
    for file, (head, _) in headers.items():  # every tensor of each shard read, as the engine reads it
        for key in head:
            if key != "__metadata__" and key not in files:
                files[key] = file
                unindexed.append(key)
    found: dict[str, dict] = {name: {} for name in _SCALE_NAMES}
    for key in sorted(files):
        kind = next((n for n in _SCALE_NAMES if key == n or key.endswith("." + n)), None)
        if kind is None:
            continue
        file = files[key]
        if file not in headers:  # named by the index only
            headers[file] = safetensors_files.header(file)
        where = f"safetensors file {file}: tensor {key!r}"
        shape = headers[file][0].get(key, {}).get("shape")
        if isinstance(shape, list) and math.prod(shape) > MAX_SCALE_VALUES:
            raise PcastError(f"{where}: field 'shape' = {shape} holds more than {MAX_SCALE_VALUES} values "
                             "(a scale per tensor, per head or per token and head)")
        value = safetensors_files.read_tensor(file, key, headers)
        if value.size == 0 or (kind == "prob_scale" and value.size != 1):
            raise PcastError(f"{where}: field 'shape' = {list(value.shape)} must hold one number (a per-tensor "
                             f"scale{'; vLLM refuses any other prob_scale' if kind == 'prob_scale' else ''})")
        values = [_check_scale(f"{where}: value", float(x)) for x in value.reshape(-1)]
        found[kind][key] = values[0] if value.size == 1 else np.asarray(value, np.float64).tolist()
    layers: dict[str, float | None] = {}
    for kind in _SCALE_NAMES:
        for key in found[kind]:
            layers.setdefault(_layer_of(key), None)
    config = path / "config.json"
    if config.is_file():
        count = fileio.load_json(config, what=str(config))
        count = count.get("num_hidden_layers") if isinstance(count, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= 1 << 16:
            for i in range(count):
                layers.setdefault(f"layers.{i}", None)
    for key, value in found["prob_scale"].items():
        layers[_layer_of(key)] = value
    return {**found, "layers": dict(sorted(layers.items(), key=lambda kv: _layer_key(kv[0]))),
            "unindexed": sorted(k for k in unindexed if any(k == n or k.endswith("." + n) for n in _SCALE_NAMES))}


def _layer_key(layer: str):
    match = re.fullmatch(r"layers\.(\d+)", layer)
    return (0, int(match.group(1)), "") if match else (1, 0, layer)


def layer_groups(scales: dict) -> list[tuple[float | None, list[str]]]:
    """The checkpoint's layers (:func:`checkpoint_scales`) grouped by their ``prob_scale``: ``[(value, layers)]``
    in increasing value, None (no ``prob_scale``: the engine's default) last."""
    groups: dict[float | None, list[str]] = {}
    for layer, value in (scales or {}).get("layers", {}).items():
        groups.setdefault(value, []).append(layer)
    return sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0.0))


#: Range of a scale read or given (prob_scale, scale_s, q/k/v scales): S = factor/prob_scale then stays in
#: a kernel's scale range [2^-100, 2^100] for the factors of :data:`DEPLOYMENTS` (1 or 2).
SCALE_RANGE = (2.0**-90, 2.0**90)


def _check_scale(what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not (
            math.isfinite(float(value)) and SCALE_RANGE[0] <= float(value) <= SCALE_RANGE[1]):
        raise PcastError(f"{what}={value!r} must be a finite positive number in [2^-90, 2^90]")
    return float(value)


def scale_from_knob(knob: str, value: float, factor: float = 1.0) -> float:
    """The P scale S a knob's value sets: S = factor/prob_scale, or S = scale_s."""
    check_choice("knob", knob, KNOBS)
    if knob == "none":
        raise PcastError("this deployment has no P-scale knob")
    value = _check_scale(knob, value)
    return factor / value if knob == "prob_scale" else value


def knob_from_scale(knob: str, scale: float, factor: float = 1.0) -> float:
    """The knob's value that sets S (the inverse of :func:`scale_from_knob`)."""
    return scale_from_knob(knob, scale, factor) if knob == "prob_scale" else float(scale)


def knob_setting(config: KernelConfig, scale: float, *, head_dim: int | None = None) -> tuple[str, float, str]:
    """What a static ``scale`` of ``config``'s kernel is in the knob a deployment sets it through.

    The first row of :data:`DEPLOYMENTS` with a knob whose preset (at its tile for ``head_dim``) is
    ``config`` at some scale gives it: ``("scale_s", scale, "jax cudnn")`` for cuDNN (the config's
    ``scale`` is the caller's ``scale_s``; the kernel multiplies P by scale_s·2^-τ), ``("prob_scale",
    factor/scale, "vllm rocm_flash")``; any other kernel ``("scale", scale, "")``, the
    :class:`KernelConfig` field.
    """
    from pcast_jax.presets import preset_for

    family = config.replace(scale=1.0)
    for row in DEPLOYMENTS:
        if row.knob == "none":
            continue
        for name in row.presets:
            preset = get_preset(name) if head_dim is None else preset_for(name, head_dim)
            if preset.replace(scale=1.0) == family:
                return row.knob, knob_from_scale(row.knob, scale, row.knob_factor), f"{row.engine} {row.backend}"
    return "scale", float(scale), ""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer for one deployment: each preset's worst Δ and what the knob should be."""

    deployment: Deployment
    #: (preset, S simulated (or the computed scale mode), knob value or None, Δ, zeroed mass, clipped mass,
    #: zeroed fraction) per Δ
    rows: tuple[dict, ...]
    #: True when every preset stays under both limits at every Δ of the range (mean ± Z·s.e.), False when
    #: one row is over, None when no row is over but one is within noise of a limit
    safe: bool | None
    #: the smallest Δ at which a preset exceeds a limit, or None
    collapse_delta: float | None
    #: the knob value to set (None where there is no knob, or no candidate passes)
    recommended: float | None
    #: one sentence: what to do
    advice: str
    #: the checkpoint's scales read (:func:`checkpoint_scales`), empty without a checkpoint
    scales: dict
    #: per group of the checkpoint's layers with one ``prob_scale`` (where the knob is ``prob_scale`` and
    #: no value was given): ``{"prob_scale": value or None (none: the engine's default), "scale": S,
    #: "layers": [...], "verdict": "over" | "under" | "within noise"}``, the verdict the worst of its rows
    layers: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {"engine": self.deployment.engine, "backend": self.deployment.backend,
                "gpus": list(self.deployment.gpus), "presets": list(self.deployment.presets),
                "knob": self.deployment.knob, "source": self.deployment.source, "note": self.deployment.note,
                "rows": [dict(r) for r in self.rows], "safe": self.safe, "collapse_delta": self.collapse_delta,
                "recommended": self.recommended, "advice": self.advice, "scales": self.scales,
                "layers": [dict(g) for g in self.layers],
                "criterion": {"zeroed_mass_max": ZEROED_MASS_LIMIT, "clipped_mass_max": CLIPPED_MASS_LIMIT}}


def no_fp8_p_advice(deployment: Deployment) -> str:
    """What the doctor says for a deployment that casts no P to FP8 (``deployment.presets`` empty)."""
    return (f"{deployment.engine} {deployment.backend} casts no P to FP8 here, so the P-cast loses nothing; "
            "nothing to change for P (see the note for why)")


def _simulate(configs: list[KernelConfig], deltas: tuple[float, ...], *, n: int, seeds: int,
              learned_sink: bool) -> dict[str, dict[float, tuple]]:
    """(mean, s.e.) of the zeroed mass, of the clipped mass and of the zeroed fraction over the seeds,
    per config and Δ, on the sink workload."""
    from pcast_jax.sweep import SweepSpec, run_sweep

    kw = dict(k_sink=0, sink_logit="delta") if learned_sink else dict(k_sink=4)
    spec = SweepSpec(configs=tuple(configs), deltas=deltas, ns=(n,), seeds=seeds, q_len=8, d=16,
                     sampled_mse=False, expected_mse=False, **kw)
    res = run_sweep(spec, progress=False)
    out: dict[str, dict[float, tuple[float, float, float]]] = {}
    for cfg in configs:
        out[cfg.name] = {d: tuple(mean_sem(res.get(m, config=cfg.name, n=n, delta=d))
                                  for m in ("zeroed_mass", "saturated_mass", "frac_zeroed"))
                         for d in deltas}
    return out


def _scale_label(cfg: KernelConfig) -> float | str:
    """The row's S: the config's scale, or how the kernel computes it (``"dynamic"``: a power of two per row,
    ``"tile_amax"``: FP8_MAX/amax per query tile) where ``scale`` is not used."""
    return cfg.scale_mode if cfg.scale_mode in COMPUTED_SCALE_MODES else cfg.scale


def _passes(values) -> bool:
    """Every Δ's zeroed and clipped mass decided under its limit (mean + Z·s.e. below it)."""
    return all(over_limits(z, c) is False for z, c, _ in values)


def _over(row: dict) -> bool | None:
    """Is the row over a limit? True / False when mean ± Z·s.e. excludes the limits, else None."""
    return over_limits((row["zeroed_mass"], row["zeroed_mass_sem"]), (row["clipped_mass"], row["clipped_mass_sem"]))


def _configured(deployment: Deployment, knob_value: float | None, scales: dict,
                head_dim: int | None = None) -> list[tuple[KernelConfig, float | None]]:
    """Each preset of the deployment at each knob value in use, as ``(config, knob value)``: the value
    given, else each distinct ``prob_scale`` of the checkpoint's layers (None for layers without one: the
    engine's default, the preset as it is, S = 1), else the engine's default; at ``head_dim``'s tile when
    given."""
    knob = deployment.knob
    values: list[float | None]
    if knob == "none":
        if knob_value is not None:
            raise PcastError(f"{deployment.engine} {deployment.backend} takes no P-scale knob (its S is fixed by "
                             "the kernel); leave the knob unset")
        values = [None]
    elif knob_value is not None:
        values = [_check_scale(knob, knob_value)]
    elif knob == "prob_scale" and scales.get("layers"):
        values = [value for value, _ in layer_groups(scales)]  # None: a layer with none runs the default
    elif knob == "prob_scale" and scales.get("prob_scale"):
        values = sorted(set(scales["prob_scale"].values()))
    else:
        values = [None]
    out = []
    for name in deployment.presets:
        base = get_preset(name) if head_dim is None else preset_for(name, head_dim)
        for value in values:
            cfg = base if value is None else base.replace(
                scale=scale_from_knob(knob, value, deployment.knob_factor), name=f"{name}@{knob}={value:g}")
            out.append((cfg, value))
    return out


def configured(deployment: Deployment, *, knob_value: float | None = None, scales: dict | None = None,
               head_dim: int | None = None) -> list[KernelConfig]:
    """The configs the deployment runs: each preset (at ``head_dim``'s KV tile when given) with the P scale
    its knob sets — ``knob_value``, else each distinct ``prob_scale`` of the checkpoint's layers in ``scales``
    (:func:`checkpoint_scales`; layers without one at the engine's default), else the engine's default. A
    preset at a knob value is named ``preset@knob=value``; at the default it keeps its name."""
    if not isinstance(deployment, Deployment):
        raise PcastError(f"deployment={deployment!r} must be a Deployment (a row of DEPLOYMENTS: deployments.find)")
    return [cfg for cfg, _ in _configured(deployment, knob_value, scales or {}, head_dim)]


def diagnose(deployment: Deployment, *, knob_value: float | None = None, scales: dict | None = None,
             deltas: tuple[float, ...] = (4.0, 6.0, 8.0, 10.0, 12.0), n: int = 4096, seeds: int = 4,
             learned_sink: bool = False) -> Diagnosis:
    """Simulate the deployment's kernels on the paper's sink workload over ``deltas``; recommend the knob.

    Args:
      deployment: a row of :data:`DEPLOYMENTS` (:func:`find`).
      knob_value: the knob's value (``prob_scale`` or ``scale_s``); None: the checkpoint's ``prob_scale``
        values in ``scales``, else what the engine does without one (the preset as it is).
      scales: :func:`checkpoint_scales` of the deployed checkpoint: with the ``prob_scale`` knob each distinct
        layer ``prob_scale`` is simulated, and layers without one at the engine's default
        (:data:`PROB_SCALE_DEFAULT`); the verdict per group of layers is in ``Diagnosis.layers``.
      deltas: sink strengths Δ to test (the verdict takes the worst).
      n, seeds: KV length and seeds (2 to 256) of the synthetic workload (q_len 8, d 16; four token sinks at the
        front, or a learned sink logit Δ with ``learned_sink``).

    Returns:
      A :class:`Diagnosis`: the criterion is :mod:`pcast_jax.criterion`'s worst-Δ pooling on
      the mean over query rows at every Δ; the recommendation is the smallest power-of-two S (of
      :func:`pcast_jax.config.scale_candidates`, simulated in the verdict's program; as the
      knob's value) whose simulation meets it, computed only when the current setting does not.
    """
    if not isinstance(deployment, Deployment):
        raise PcastError(f"deployment={deployment!r} must be a Deployment (a row of DEPLOYMENTS: deployments.find)")
    scales = scales or {}
    if isinstance(deltas, (str, bytes)) or not isinstance(deltas, (tuple, list, np.ndarray)) or not len(deltas):
        raise PcastError(f"deltas={deltas!r} must hold at least one value (a tuple of numbers)")
    seeds = check_int("seeds", seeds, min_value=2, max_value=256)  # a verdict needs a standard error
    if not isinstance(learned_sink, bool):
        raise PcastError(f"learned_sink={learned_sink!r} must be True or False")
    if not deployment.casts_p:
        return Diagnosis(deployment, (), True, None, None, no_fp8_p_advice(deployment), scales)
    knob = deployment.knob
    configs, labels = [], []
    for cfg, value in _configured(deployment, knob_value, scales):
        configs.append(cfg)
        labels.append((cfg.name.partition("@")[0], value))
    candidates: dict = {}  # (preset, S) -> its config: the knob's candidate settings (scale_candidates)
    if knob != "none":
        for name in deployment.presets:
            base = get_preset(name)
            candidates.update({(name, s): base.replace(scale=s, name=f"{name}@S={s:g}")
                               for s in scale_candidates(base)})
    # one program for the verdict and the candidates (a candidate equal to a verdict config is that config)
    extra = [c for c in candidates.values() if c not in configs]
    sim = _simulate(configs + extra, tuple(float(d) for d in deltas), n=n, seeds=seeds, learned_sink=learned_sink)
    by_config = {cfg: sim[cfg.name] for cfg in configs + extra}
    rows, calls = [], []
    for cfg, (name, value) in zip(configs, labels):
        for d, (z, c, f) in sim[cfg.name].items():
            row = {"preset": name, "scale": _scale_label(cfg), "knob_value": value, "delta": d, "zeroed_mass": z[0],
                   "zeroed_mass_sem": z[1], "clipped_mass": c[0], "clipped_mass_sem": c[1], "frac_zeroed": f[0]}
            calls.append(_over(row))
            row["verdict"] = verdict_word(calls[-1])
            rows.append(row)
    bad = [r for r in rows if r["verdict"] == "over"]
    unsure = [r for r in rows if r["verdict"] == "within noise"]
    pooled = worst_delta(calls)  # the worst row decides
    safe = None if pooled is None else not pooled
    collapse = min((r["delta"] for r in bad), default=None)
    recommended = None
    if safe is None:
        advice = (f"no row is over the limit, but {len(unsure)} are within {Z:g} s.e. of it at "
                  f"{seeds} seeds (first at Δ = {min(r['delta'] for r in unsure):g}); rerun with more --seeds")
    elif safe:
        advice = (f"every kernel of {deployment.engine} {deployment.backend} keeps the zeroed "
                  f"and the clipped mass ≤ {ZEROED_MASS_LIMIT:g} of the softmax at Δ = {min(deltas):g}…"
                  f"{max(deltas):g}; nothing to change")
    elif knob == "none":
        advice = (f"from Δ = {collapse:g} on, and {deployment.engine} {deployment.backend} fixes S itself, so no "
                  "setting of this backend avoids it; use a backend whose kernel passes (pcast doctor on another "
                  "--backend), or check on your model with pcast analyze")
    else:
        candidate_scales = sorted(s for s in {s for _, s in candidates}
                                  if all((name, s) in candidates for name in deployment.presets))
        for s in candidate_scales:
            if all(_passes(by_config[candidates[(name, s)]].values()) for name in deployment.presets):
                recommended = knob_from_scale(knob, s, deployment.knob_factor)
                break
        what = "clips" if all(r["zeroed_mass"] <= ZEROED_MASS_LIMIT for r in bad) else "zeroes"
        if recommended is None:
            advice = (f"the cast {what} more than the limit from Δ = {collapse:g} and no power-of-two S from 1 to "
                      f"{candidate_scales[-1]:g} (beyond, P·S would pass the format's max) meets the criterion on "
                      "every Δ; narrow the Δ range to your model's (pcast analyze)")
        else:
            scale = scale_from_knob(knob, recommended, deployment.knob_factor)
            advice = (f"the cast {what} more than the limit from Δ = {collapse:g}; set {knob} = {recommended:g} "
                      f"(S = {scale:g}), the smallest power-of-two S whose simulation "
                      f"keeps both masses under the limit at every Δ by more than {Z:g} s.e.")
    layers = ()
    if knob == "prob_scale" and knob_value is None and scales.get("layers"):
        layers = tuple(_layer_verdict(value, names, [r for r in rows if r["knob_value"] == value],
                                      scale_from_knob(knob, value, deployment.knob_factor) if value is not None
                                      else _scale_label(get_preset(deployment.presets[0])))
                       for value, names in layer_groups(scales))
    return Diagnosis(deployment, tuple(rows), safe, collapse, recommended, advice, scales, layers)


def _layer_verdict(value: float | None, names: list[str], rows: list[dict], scale) -> dict:
    """One group of layers sharing a ``prob_scale``: the worst verdict of its rows."""
    verdicts = {r["verdict"] for r in rows}
    worst = "over" if "over" in verdicts else ("within noise" if "within noise" in verdicts else "under")
    return {"prob_scale": value, "knob_value": PROB_SCALE_DEFAULT if value is None else value, "scale": scale,
            "layers": list(names), "verdict": worst}
