"""The deployment table, as data: (engine, backend, GPU, KV-cache dtype) → the preset(s) it runs.

One module, over 600 lines: it is data, one cited row per deployment (most of its lines are
:data:`DEPLOYMENTS`), beside the record types of its rows and the look-ups over them; cutting the rows
apart would scatter one table that is read and cited as a whole.

A deployment is what a user configures — an engine, its attention backend, the GPU architecture and the
KV-cache dtype — not a preset. :data:`DEPLOYMENTS` maps each known combination to the preset(s) of
:mod:`pcast_jax.presets` it runs, with the engine's line that makes the choice and the knob, if any, through
which a checkpoint or the caller sets the P scale S; :func:`find` looks a deployment up. A combination the
table lacks is refused with the known ones listed: the table is never guessed from.

This module is data and look-ups only: it imports no JAX (the command line builds ``pcast doctor``'s help
from it), and :mod:`pcast_jax.deployments` re-exports it beside the simulation that answers over it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import get_preset

__all__ = ["Capabilities", "ModelFeatures", "Support", "SUPPORTS", "UNREAD", "Deployment", "DEPLOYMENTS", "ENGINES",
           "BACKENDS", "GPUS", "KV_CACHE_DTYPES", "FP8_KV_CACHE_DTYPES", "MODEL_DTYPE_KV", "ModelDtypeKV", "KNOBS",
           "Knob", "MODEL_DTYPE_ROWS", "find"]

#: GPU architectures: NVIDIA compute capabilities and AMD gfx targets.
GPUS = ("sm90", "sm100", "sm120", "gfx942", "gfx950")
#: KV-cache dtypes with an FP8 attention path (``fp8`` is vLLM's and SGLang's name for E4M3): the rows of
#: :data:`DEPLOYMENTS` hold for these.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
#: The KV-cache dtypes a deployment is looked up with: an FP8 one, or ``auto`` (the cache in the model's dtype,
#: vLLM's and SGLang's default), whose rows are :data:`MODEL_DTYPE_KV`'s.
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)
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
    #: the KV-cache dtypes this row holds for (:data:`KV_CACHE_DTYPES`; ``auto`` only in the rows
    #: :func:`find` derives from :data:`MODEL_DTYPE_KV`)
    kv_cache_dtypes: tuple[str, ...] = FP8_KV_CACHE_DTYPES
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
#: Each engine's backends, as :data:`DEPLOYMENTS` names them.
BACKENDS = {engine: tuple(dict.fromkeys(d.backend for d in DEPLOYMENTS if d.engine == engine)) for engine in ENGINES}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelDtypeKV:
    """What an engine's backends do with a KV cache in the model's dtype (``kv_cache_dtype="auto"``): no P cast
    to FP8, read from the engine's source. A backend absent here is refused with ``auto`` (not read)."""

    #: the engine (:data:`ENGINES`)
    engine: str
    #: its backends this holds for
    backends: tuple[str, ...]
    #: where the engine keeps Q out of FP8 without an FP8 KV cache (file and symbol at a named commit)
    selection: str
    #: what the user should know (assumptions included)
    note: str

    def __post_init__(self):
        check_choice("engine", self.engine, ENGINES)
        for backend in self.backends:
            check_choice("backend", backend, BACKENDS[self.engine])
        if not self.selection:
            raise PcastError(f"{self.engine}: selection must cite where the engine keeps Q out of FP8")


#: The backends whose KV cache in the model's dtype (``auto``) is read to cast no P to FP8.
MODEL_DTYPE_KV: tuple[ModelDtypeKV, ...] = (
    ModelDtypeKV(
        engine="vllm", backends=("triton_attn", "rocm_aiter_unified_attn", "rocm_attn", "flash_attn", "flashinfer"),
        selection="vllm-project/vllm vllm/model_executor/layers/attention/attention.py at 0014ca6: "
                  "Attention.__init__ builds query_quant (Q to FP8) only when the backend's "
                  "supports_quant_query_input holds and kv_cache_dtype starts with 'fp8' (or is 'nvfp4'); with "
                  "'auto' the cache takes the model dtype (kv_cache_dtype_str_to_dtype) and forward passes Q as it is",
        note="With the KV cache in the model dtype neither Q nor K/V is FP8, so the backend runs its model-dtype "
             "attention and no P is cast to FP8. Assumption for the closed TRT-LLM-gen kernels (flashinfer on "
             "sm100): their model-dtype path casts P to the model dtype, not FP8."),
    ModelDtypeKV(
        engine="sglang", backends=("fa3",),
        selection="sgl-project/sglang python/sglang/srt/layers/attention/flashattention_backend.py at 003e7b7: "
                  "FlashAttentionBackend.forward_extend and forward_decode, q = q.to(self.kv_cache_dtype) only when "
                  "kv_cache_dtype_str != 'auto'",
        note="With the KV cache in the model dtype Q stays in the model dtype and FA3 runs its 16-bit path: no P "
             "is cast to FP8."),
    ModelDtypeKV(
        engine="sglang", backends=("flashinfer", "aiter"),
        selection="the FP8 rows' selection lines: these backends keep Q in the model dtype even with an FP8 KV "
                  "cache (sgl-project/sglang flashinfer_backend.py at 454e84d, q_data_type = model_runner.dtype; "
                  "aiter_backend.py at 25b38cc, the FP8 cache converted to q.dtype)",
        note="No FP8 P with an FP8 KV cache, so none with one in the model dtype."),
)


def _known(rows) -> str:
    return "; ".join(f"{d.engine} {d.backend} on {','.join(d.gpus)}" for d in rows)


def _model_dtype_rows() -> tuple[Deployment, ...]:
    """The rows :data:`MODEL_DTYPE_KV` gives: each FP8 row of its backends, casting no P, keyed by ``auto``."""
    out = []
    for entry in MODEL_DTYPE_KV:
        for d in DEPLOYMENTS:
            if d.engine == entry.engine and d.backend in entry.backends:
                out.append(dataclasses.replace(d, presets=(), knob="none", knob_factor=1.0, kv_cache_dtypes=("auto",),
                                               selection=entry.selection, note=entry.note))
    return tuple(out)


#: The rows for a KV cache in the model dtype (``auto``), derived from :data:`MODEL_DTYPE_KV`.
MODEL_DTYPE_ROWS = _model_dtype_rows()


def find(engine: str, backend: str, gpu: str, kv_cache_dtype: str = "fp8") -> Deployment:
    """The row for this deployment, keyed by all four: engine, backend, GPU and KV-cache dtype (``auto``: the
    rows of :data:`MODEL_DTYPE_ROWS`, which cast no P to FP8). A :class:`PcastError` lists the known ones when
    there is none, or names the KV-cache dtypes the row takes when ``kv_cache_dtype`` is not among them."""
    check_choice("gpu", gpu, GPUS)
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("engine", engine, ENGINES)
    rows = [d for d in DEPLOYMENTS + MODEL_DTYPE_ROWS if d.engine == engine and d.backend == backend and gpu in d.gpus]
    for d in rows:
        if kv_cache_dtype in d.kv_cache_dtypes:
            return d
    if rows:
        takes = sorted({k for d in rows for k in d.kv_cache_dtypes}, key=KV_CACHE_DTYPES.index)
        why = (" (the table has no row for its KV cache in the model dtype: not read from the engine's source, or "
               "the kernel is called directly with FP8 inputs)" if kv_cache_dtype == "auto" else "")
        raise PcastError(f"kv_cache_dtype={kv_cache_dtype!r}: {engine} {backend} on {gpu} is known with "
                         f"{', '.join(map(repr, takes))} only{why}")
    raise PcastError(f"no known FP8 attention for engine={engine!r} backend={backend!r} gpu={gpu!r}; "
                     f"known for {engine}: {_known([d for d in DEPLOYMENTS if d.engine == engine])}")
