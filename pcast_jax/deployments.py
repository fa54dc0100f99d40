"""From a deployment to the kernel it runs: the table of data, and the doctor's answer over it.

A deployment is what a user configures — an engine, its attention backend, the GPU architecture, the
KV-cache dtype and the checkpoint's attention scales — not a preset. The table (:data:`DEPLOYMENTS`,
:func:`find`, the capabilities) lives in :mod:`pcast_jax.deployment_table`, data without JAX, and is
re-exported here; this module reads a checkpoint's scales and simulates. :func:`diagnose`
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
from pcast_jax.deployment_table import (
    BACKENDS,
    DEPLOYMENTS,
    ENGINES,
    FP8_KV_CACHE_DTYPES,
    GPUS,
    KNOBS,
    KV_CACHE_DTYPES,
    MODEL_DTYPE_KV,
    MODEL_DTYPE_ROWS,
    SUPPORTS,
    UNREAD,
    Capabilities,
    Deployment,
    Knob,
    ModelDtypeKV,
    ModelFeatures,
    Support,
    find,
)
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import get_preset, resolve
from pcast_jax.stats import mean_sem

__all__ = ["no_fp8_p_advice", "Capabilities", "ModelFeatures", "Support", "SUPPORTS", "UNREAD",
           "Deployment", "DEPLOYMENTS", "ENGINES", "BACKENDS", "GPUS", "KV_CACHE_DTYPES", "FP8_KV_CACHE_DTYPES",
           "MODEL_DTYPE_KV", "MODEL_DTYPE_ROWS", "ModelDtypeKV", "Knob", "KNOBS", "find", "checkpoint_scales",
           "layer_groups", "PROB_SCALE_DEFAULT", "MAX_SCALE_VALUES",
           "scale_from_knob", "knob_from_scale", "knob_setting", "configured", "SCALE_RANGE", "Diagnosis", "diagnose",
           ]

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
    family = config.replace(scale=1.0)
    for row in DEPLOYMENTS:
        if row.knob == "none":
            continue
        for name in row.presets:
            preset = resolve(name, head_dim=head_dim)
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
                "gpus": list(self.deployment.gpus), "kv_cache_dtypes": list(self.deployment.kv_cache_dtypes),
                "presets": list(self.deployment.presets),
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
        base = resolve(name, head_dim=head_dim)
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
