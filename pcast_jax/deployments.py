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
from pathlib import Path
from typing import Literal

import numpy as np

from pcast_jax.config import COMPUTED_SCALE_MODES, KernelConfig, scale_candidates
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import get_preset, preset_for
from pcast_jax.stats import decide, mean_sem

__all__ = ["Deployment", "DEPLOYMENTS", "ENGINES", "GPUS", "KV_CACHE_DTYPES", "KNOBS", "find", "checkpoint_scales",
           "scale_from_knob", "knob_from_scale", "knob_setting", "configured", "SCALE_RANGE", "Diagnosis", "diagnose",
           "ZEROED_MASS_LIMIT", "CLIPPED_MASS_LIMIT", "Z", "over_limits"]

#: GPU architectures: NVIDIA compute capabilities and AMD gfx targets.
GPUS = ("sm90", "sm100", "sm120", "gfx942", "gfx950")
#: KV-cache dtypes with an FP8 attention path (``fp8`` is vLLM's name for E4M3).
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
#: How a deployment sets the P scale S: ``"none"`` (fixed by the kernel), ``"prob_scale"`` (S = factor/prob_scale,
#: a checkpoint's calibrated scale) or ``"scale_s"`` (S = scale_s, the caller's argument).
Knob = Literal["none", "prob_scale", "scale_s"]
KNOBS = ("none", "prob_scale", "scale_s")
#: The verdict's criterion: the largest share of the softmax's mass the cast may zero (non-sink keys) and
#: clip (saturate), as a mean over query rows, at the worst Δ of the range.
ZEROED_MASS_LIMIT = 1e-3
CLIPPED_MASS_LIMIT = 1e-3
#: A row is over (or under) a limit when its mean ± Z·s.e. over the seeds excludes the limit; else it is
#: within noise, and the verdict says so instead of deciding.
Z = 2.0


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One row of :data:`DEPLOYMENTS`: what an engine's backend runs on a GPU generation."""

    #: the serving or training stack (``vllm``, ``sglang``, ``tensorrt-llm``, ``jax``, ...)
    engine: str
    #: its attention backend as the engine names it
    backend: str
    #: GPU architectures this row holds for (:data:`GPUS`)
    gpus: tuple[str, ...]
    #: the preset it runs, and for a backend with a second path (decode, split-KV) that one too
    presets: tuple[str, ...]
    #: how the P scale is set (:data:`KNOBS`)
    knob: str
    #: the engine's file (and lines where read) that picks this kernel; the kernel's own facts are cited
    #: beside its preset
    source: str
    #: what the user should know about this row (assumptions included)
    note: str = ""
    #: with the ``prob_scale`` knob, S = knob_factor / prob_scale (vLLM doubles a checkpoint's prob_scale on
    #: E4M3FNUZ GPUs: 0.5 there, :func:`pcast_jax.presets.amd.vllm_rocm_flash_scale`)
    knob_factor: float = 1.0

    def __post_init__(self):
        check_choice("knob", self.knob, KNOBS)
        for gpu in self.gpus:
            check_choice("gpu", gpu, GPUS)
        for name in self.presets:
            get_preset(name)


#: Every known deployment. Each kernel's semantics are cited where its preset is defined; ``source`` says
#: which file of the engine picks that kernel for the backend.
DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("vllm", "triton_attn", ("sm90", "sm100", "sm120"), ("vllm_triton_fp8", "vllm_triton_fp8_3d"),
               "none", "vllm-project/vllm vllm/v1/attention/backends/triton_attn.py; "
               "vllm/v1/attention/ops/triton_unified_attention.py (kernel_unified_attention)",
               "P is cast against the running max with S = 1; a checkpoint's prob_scale is not used for P here. "
               "The 3-D (split) path runs for long decodes."),
    Deployment("vllm", "triton_attn", ("gfx942",), ("vllm_triton_fp8_rocm",), "none",
               "vllm-project/vllm vllm/v1/attention/backends/triton_attn.py (current_platform.fp8_dtype() is "
               "float8_e4m3fnuz on MI300)", "E4M3FNUZ P: one binade less than E4M3, the collapse threshold "
               "moves by ln 2."),
    Deployment("vllm", "rocm_flash", ("gfx942",), ("vllm_rocm_flash_fp8",), "prob_scale",
               "vllm-project/vllm vllm/attention/ops/triton_flash_attention.py (attn_fwd: p *= p_descale; "
               "acc_scale = p_scale * v_scale), kv-cache scale loader (prob_scale *= 2 on fnuz)",
               "The one backend that scales P by the checkpoint's prob_scale: S = 1/(2·prob_scale) on MI300; "
               "without a calibrated prob_scale S = 1 (vLLM warns 'Using uncalibrated q_scale 1.0 and/or "
               "prob_scale 1.0 with fp8 attention'). Tile 64 is an assumption (autotuned).", knob_factor=0.5),
    Deployment("flash-attention", "triton_amd", ("gfx942",), ("fa_triton_amd_mi300",), "none",
               "Dao-AILab/flash-attention flash_attn/flash_attn_interface.py (FLASH_ATTENTION_TRITON_AMD_ENABLE "
               "imports aiter's flash_attn_triton_amd)", "FP8_P_DESCALE is hard-wired off: S = 1, E4M3FNUZ P."),
    Deployment("flash-attention", "triton_amd", ("gfx950",), ("fa_triton_amd_mi355",), "none",
               "Dao-AILab/flash-attention flash_attn/flash_attn_interface.py (aiter's flash_attn_triton_amd)",
               "FP8_P_DESCALE is hard-wired off: S = 1, E4M3 P."),
    Deployment("aiter", "triton_mha", ("gfx942",), ("aiter_mha_fp8_mi300",), "none",
               "ROCm/aiter aiter/ops/triton/mha.py (FP8 Q/K/V: the Triton MHA's FP8 forward, called directly)",
               "One scale FP8_MAX/amax(P) per 128-query × 64-key tile (FP8_MAX 240 on E4M3FNUZ), shared by the "
               "tile's rows; which serving engines route FP8 attention here is not read from their source."),
    Deployment("aiter", "triton_mha", ("gfx950",), ("aiter_mha_fp8_mi355",), "none",
               "ROCm/aiter aiter/ops/triton/mha.py (FP8 Q/K/V: the Triton MHA's FP8 forward, called directly)",
               "One scale FP8_MAX/amax(P) per 128-query × 64-key tile (FP8_MAX 448), shared by the tile's rows; "
               "which serving engines route FP8 attention here is not read from their source."),
    Deployment("vllm", "flash_attn", ("sm90",), ("fa3", "fa3_splitkv"), "none",
               "vllm-project/flash-attention (vLLM's FA3 fork, hopper/)",
               "FA3's FP8 path folds S = 256 into the exponent and walks KV blocks in reverse."),
    Deployment("vllm", "flash_attn", ("sm100",), ("vllm_fa4",), "none",
               "vllm-project/flash-attention PR #166 (vLLM's FA4 fork, flash_attn/cute/flash_fwd_sm100.py)",
               "S = 256 with a lazy rescale τ = 0.75 (log2)."),
    Deployment("vllm", "flashinfer", ("sm90",), ("flashinfer_sm90",), "none",
               "flashinfer-ai/flashinfer (SM90 FP8 prefill, as the preset cites)", ""),
    Deployment("sglang", "triton", ("sm90", "sm100", "sm120"), ("sglang_triton_decode",), "none",
               "sgl-project/sglang python/sglang/srt/layers/attention/triton_ops/decode_attention.py",
               "Decode with split KV; 8 splits is SGLang's maximum (the count is chosen per request)."),
    Deployment("tensorrt-llm", "xqa", ("sm90",), ("trtllm_xqa", "trtllm_xqa_multiblock"), "none",
               "NVIDIA/TensorRT-LLM XQA (decode; mha_sm90.cu as vendored by flashinfer)", ""),
    Deployment("tensorrt-llm", "fmha_v2", ("sm90",), ("trtllm_fmha_v2",), "none",
               "NVIDIA/TensorRT-LLM fmha_v2 (context; numeric_types.h Softmax_fp_quant_scale)", ""),
    Deployment("jax", "cudnn", ("sm90",), ("cudnn_fp8_tau0",), "scale_s",
               "jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py (dot_product_attention, use_fp8=True, "
               "fp8_params['scale_s'])", "Off SM100 cuDNN's reference runs τ = 0 (test_mhas_v2.py)."),
    Deployment("jax", "cudnn", ("sm100",), ("cudnn_fp8",), "scale_s",
               "jax-ml/jax jax/_src/cudnn/fused_attention_stablehlo.py (use_fp8=True, fp8_params['scale_s'])",
               "On SM100 cuDNN's lazy rescale τ = 4 (nats) scales P by scale_s·2^-4: pass 16× the S you want."),
    Deployment("transformer-engine", "fp8_dpa", ("sm90",), ("te_fp8_dpa",), "none",
               "NVIDIA/TransformerEngine dot_product_attention.py (fp8_dpa through cuDNN)",
               "S from the delayed-scaling recipe: 448 once the recorded amax of P is 1."),
    Deployment("flash-attention", "fa3", ("sm90",), ("fa3",), "none",
               "Dao-AILab/flash-attention hopper/ (flash_attn_interface, FP8 forward)", ""),
    Deployment("flash-attention", "fa4", ("sm100",), ("fa4",), "none",
               "Dao-AILab/flash-attention flash_attn/cute/ (flash_fwd_sm100.py)", ""),
    Deployment("sageattention", "sageattn2", ("sm90",), ("sageattn2",), "none",
               "thu-ml/SageAttention csrc/qattn/qk_int_sv_f8_cuda_sm90.cu", ""),
    Deployment("sageattention", "sageattn3", ("sm100", "sm120"), ("sageattn3",), "none",
               "thu-ml/SageAttention sageattention3_blackwell/", "NVFP4 P."),
)

#: The engines :data:`DEPLOYMENTS` knows.
ENGINES = tuple(dict.fromkeys(d.engine for d in DEPLOYMENTS))


def _known(rows) -> str:
    return "; ".join(f"{d.engine} {d.backend} on {','.join(d.gpus)}" for d in rows)


def find(engine: str, backend: str, gpu: str, kv_cache_dtype: str = "fp8") -> Deployment:
    """The row for this deployment; a :class:`PcastError` listing the known ones when there is none."""
    check_choice("gpu", gpu, GPUS)
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("engine", engine, ENGINES)
    rows = [d for d in DEPLOYMENTS if d.engine == engine]
    for d in rows:
        if d.backend == backend and gpu in d.gpus:
            return d
    raise PcastError(f"no known FP8 attention for engine={engine!r} backend={backend!r} gpu={gpu!r}; "
                     f"known for {engine}: {_known(rows)}")


_SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")


def checkpoint_scales(folder: str | os.PathLike) -> dict[str, dict[str, float]]:
    """The attention scales a checkpoint folder holds: ``{"prob_scale": {tensor name: value}, ...}``.

    Reads only tensors whose names end in ``q_scale``, ``k_scale``, ``v_scale`` or ``prob_scale`` (never
    the weights), from ``model.safetensors``, the shards ``model.safetensors.index.json`` names or else
    every ``*.safetensors`` file, through :mod:`pcast_jax.safetensors_files` (headers bounded, layout
    validated by the ``safetensors`` library; a pipe, an index entry outside the folder or a tensor in two
    files refused). A scale that is not one F32, F16 or BF16 number in :data:`SCALE_RANGE` is refused,
    naming the tensor and the file.
    """
    from pcast_jax import safetensors_files

    path = Path(folder)
    if not path.is_dir():
        raise PcastError(f"checkpoint={str(path)!r} is not a folder (a Hugging Face checkpoint folder with "
                         "*.safetensors files)")
    if not any(path.glob("*.safetensors")):
        raise PcastError(f"checkpoint={str(path)!r} holds no *.safetensors file")
    headers: dict = {}
    files = safetensors_files.tensor_files(path, headers)
    found: dict[str, dict[str, float]] = {name: {} for name in _SCALE_NAMES}
    for key in sorted(files):
        kind = next((n for n in _SCALE_NAMES if key == n or key.endswith("." + n)), None)
        if kind is None:
            continue
        file = files[key]
        if file not in headers:  # named by the index only
            headers[file] = safetensors_files.header(file)
        value = safetensors_files.read_tensor(file, key, headers)
        where = f"safetensors file {file}: tensor {key!r}"
        if value.size != 1:
            raise PcastError(f"{where}: field 'shape' = {list(value.shape)} must hold one number (a per-tensor scale)")
        found[kind][key] = _check_scale(f"{where}: value", float(value.reshape(-1)[0]))
    return found


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
    #: the checkpoint's scales read (kind → tensor → value), empty without a checkpoint
    scales: dict

    def to_dict(self) -> dict:
        return {"engine": self.deployment.engine, "backend": self.deployment.backend,
                "gpus": list(self.deployment.gpus), "presets": list(self.deployment.presets),
                "knob": self.deployment.knob, "source": self.deployment.source, "note": self.deployment.note,
                "rows": [dict(r) for r in self.rows], "safe": self.safe, "collapse_delta": self.collapse_delta,
                "recommended": self.recommended, "advice": self.advice, "scales": self.scales,
                "criterion": {"zeroed_mass_max": ZEROED_MASS_LIMIT, "clipped_mass_max": CLIPPED_MASS_LIMIT}}


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


def over_limits(zeroed: tuple[float, float], clipped: tuple[float, float]) -> bool | None:
    """The verdict's criterion on one row: is its zeroed or its clipped mass over the limit?

    ``zeroed`` and ``clipped`` are (mean, s.e.) over seeds. True when either mass is decidedly over its
    limit (:data:`ZEROED_MASS_LIMIT`, :data:`CLIPPED_MASS_LIMIT`: mean − Z·s.e. above it), False when both are
    decidedly under (mean + Z·s.e. below it), else None: within noise (:func:`pcast_jax.stats.decide`).
    """
    calls = [decide(zeroed[0], zeroed[1], ZEROED_MASS_LIMIT, Z), decide(clipped[0], clipped[1], CLIPPED_MASS_LIMIT, Z)]
    return True if True in calls else (False if calls == [False, False] else None)


def _passes(values) -> bool:
    """Every Δ's zeroed and clipped mass decided under its limit (mean + Z·s.e. below it)."""
    return all(over_limits(z, c) is False for z, c, _ in values)


def _over(row: dict) -> bool | None:
    """Is the row over a limit? True / False when mean ± Z·s.e. excludes the limits, else None."""
    return over_limits((row["zeroed_mass"], row["zeroed_mass_sem"]), (row["clipped_mass"], row["clipped_mass_sem"]))


def _configured(deployment: Deployment, knob_value: float | None, scales: dict,
                head_dim: int | None = None) -> list[tuple[KernelConfig, float | None]]:
    """Each preset of the deployment at each knob value in use, as ``(config, knob value)``: the value
    given, else the checkpoint's ``prob_scale`` values (the smallest and the largest), else the engine's
    default (the preset as it is: S = 1 without a calibrated scale); at ``head_dim``'s tile when given."""
    knob = deployment.knob
    values: list[float | None]
    if knob == "none":
        if knob_value is not None:
            raise PcastError(f"{deployment.engine} {deployment.backend} takes no P-scale knob (its S is fixed by "
                             "the kernel); leave the knob unset")
        values = [None]
    elif knob_value is not None:
        values = [_check_scale(knob, knob_value)]
    elif knob == "prob_scale" and scales.get("prob_scale"):
        found = sorted(set(scales["prob_scale"].values()))
        values = [found[0]] if len(found) == 1 else [found[0], found[-1]]
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
    its knob sets — ``knob_value``, else the checkpoint's ``prob_scale`` values in ``scales``
    (:func:`checkpoint_scales`; the smallest and the largest), else the engine's default. A preset at a
    knob value is named ``preset@knob=value``."""
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
      scales: :func:`checkpoint_scales` of the deployed checkpoint.
      deltas: sink strengths Δ to test (the verdict takes the worst).
      n, seeds: KV length and seeds (2 to 256) of the synthetic workload (q_len 8, d 16; four token sinks at the
        front, or a learned sink logit Δ with ``learned_sink``).

    Returns:
      A :class:`Diagnosis`: the criterion is :data:`ZEROED_MASS_LIMIT` and :data:`CLIPPED_MASS_LIMIT` on
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
    rows = []
    for cfg, (name, value) in zip(configs, labels):
        for d, (z, c, f) in sim[cfg.name].items():
            row = {"preset": name, "scale": _scale_label(cfg), "knob_value": value, "delta": d, "zeroed_mass": z[0],
                   "zeroed_mass_sem": z[1], "clipped_mass": c[0], "clipped_mass_sem": c[1], "frac_zeroed": f[0]}
            over = _over(row)
            row["verdict"] = {True: "over", False: "under", None: "within noise"}[over]
            rows.append(row)
    bad = [r for r in rows if r["verdict"] == "over"]
    unsure = [r for r in rows if r["verdict"] == "within noise"]
    safe = False if bad else (None if unsure else True)
    collapse = min((r["delta"] for r in bad), default=None)
    recommended = None
    if safe is None:
        advice = (f"undecided: no row is over the limit, but {len(unsure)} are within {Z:g} s.e. of it at "
                  f"{seeds} seeds (first at Δ = {min(r['delta'] for r in unsure):g}); rerun with more --seeds")
    elif safe:
        advice = (f"safe on this range: every kernel of {deployment.engine} {deployment.backend} keeps the zeroed "
                  f"and the clipped mass ≤ {ZEROED_MASS_LIMIT:g} of the softmax at Δ = {min(deltas):g}…"
                  f"{max(deltas):g}; nothing to change")
    elif knob == "none":
        advice = (f"P-collapse from Δ = {collapse:g}: {deployment.engine} {deployment.backend} fixes S itself, so no "
                  "setting of this backend avoids it; use a backend whose kernel passes (pcast doctor on another "
                  "--backend), or check on your model with pcast analyze")
    else:
        scales = sorted(s for s in {s for _, s in candidates}
                        if all((name, s) in candidates for name in deployment.presets))
        for s in scales:
            if all(_passes(by_config[candidates[(name, s)]].values()) for name in deployment.presets):
                recommended = knob_from_scale(knob, s, deployment.knob_factor)
                break
        what = "clips" if all(r["zeroed_mass"] <= ZEROED_MASS_LIMIT for r in bad) else "zeroes"
        if recommended is None:
            advice = (f"the cast {what} more than the limit from Δ = {collapse:g} and no power-of-two S from 1 to "
                      f"{scales[-1]:g} (beyond, P·S would pass the format's max) meets the criterion on every Δ; "
                      "narrow the Δ range to your model's (pcast analyze)")
        else:
            scale = scale_from_knob(knob, recommended, deployment.knob_factor)
            advice = (f"the cast {what} more than the limit from Δ = {collapse:g}; set {knob} = {recommended:g} "
                      f"(S = {scale:g}), the smallest power-of-two S whose simulation "
                      f"keeps both masses under the limit at every Δ by more than {Z:g} s.e.")
    return Diagnosis(deployment, tuple(rows), safe, collapse, recommended, advice, scales)
