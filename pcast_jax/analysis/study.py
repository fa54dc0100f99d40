"""Is my model safe under kernel X? The analysis of a captured trace, in numbers and in words.

One module, over 600 lines: :class:`Analysis` and its words, the safe-scale scan and the trace diagnosis
read one set of per-head results; the criterion itself is :mod:`pcast_jax.criterion`.

:func:`analyze` takes a :class:`~pcast_jax.analysis.capture.Trace` and kernel configurations and
returns an :class:`Analysis`: per sequence, layer and head the sink statistics
(:func:`~pcast_jax.analysis.statistics.sink_statistics`) and every configuration's P-cast metrics
(:func:`~pcast_jax.analysis.heads.head_metrics`: output error, zeroed fraction and mass, and every
further per-row count or mass the engine reports); optionally, given the model as a function from
a configuration to logits, the end-to-end effect (KL, top-1 agreement, perplexity).

Judgements, each stated in the report, all on one criterion (:mod:`pcast_jax.criterion`, its worst-head
pooling: :func:`~pcast_jax.criterion.worst_head`):

* **Sink head**: a head whose sinks receive at least :data:`SINK_MASS_MIN` of the attention
  (mean over query rows and sequences).
* **The criterion**: per head, the zeroed mass (the exact softmax mass of non-sink keys the cast
  zeroes) and the clipped mass (the mass of keys whose P·S the cast saturates at the format's max),
  each a mean over the head's query rows and then over sequences; a kernel meets the criterion when
  the **worst head's** zeroed mass and the worst head's clipped mass are both at most ``mass_limit``.
* **Verdict of a kernel**: ``"safe to serve"`` when it meets the criterion, else what fails:
  ``"loses mass"`` (zeroed), ``"clips mass"`` (clipped), or both.
* **Safe scale**: per kernel family with a static scale (every analysed configuration that differs
  from another only in ``scale`` is one family), the kernel itself is simulated on the trace at
  ``scale`` = 1, 2, 4, … (:func:`scale_candidates`: up to the largest power of two whose applied
  scale stays within the P format's max), and the smallest candidate meeting the criterion is the
  recommendation; every candidate is a row of the scan, in the report. The candidates' zeroed and
  clipped masses come from the kernel's own statistics without the contraction with V
  (:func:`~pcast_jax.analysis.heads.scale_masses`, equal to the full kernel's bit for bit), in the same
  pass over the layers as the analysed configurations, on the same logits of each chunk of rows
  (:func:`~pcast_jax.analysis.heads.analyze_layers`); an analysed configuration's own rows
  are its scale's row, so its verdict and the scan cannot disagree. The recommendation is also
  given in the knob a deployment sets it through (:func:`pcast_jax.deployments.knob_setting`:
  cuDNN's ``scale_s``, vLLM ROCm's ``prob_scale``).
* **Sampled rows** (``analyze(..., rows=N)``): every per-head mean is a stratified sample's estimate with its
  standard error, and each head is judged by :func:`pcast_jax.stats.decide` against the same limit: the
  criterion is met where every head lies below it by more than z standard errors, failed where one lies
  above by more, else the verdict is :data:`~pcast_jax.criterion.WITHIN_NOISE_ROWS`; a scan recommends
  nothing where a smaller candidate is within noise.
* **Where the error comes from**: with E4M3 Q/K/V (``qkv="e4m3"``), ``rel_mse_qkv`` is the relative
  MSE of the same kernel with P in FP32 (its Q/K/V quantization alone), beside ``rel_mse``, the
  kernel's; the report says which dominates.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from pcast_jax import stats as _stats
from pcast_jax.analysis.capture import StreamedTrace, Trace
from pcast_jax.analysis.heads import analyze_layers, scale_masses
from pcast_jax.analysis.logit_metrics import E2EMetrics, compare_logits
from pcast_jax.analysis.rows import sample_rows
from pcast_jax.analysis.statistics import SCALE_GRID, find_sinks, pending_statistics
from pcast_jax.config import COMPUTED_SCALE_MODES, KernelConfig, scale_candidates
from pcast_jax.criterion import (
    MASS_LIMIT,
    SAFE,
    WITHIN_NOISE_ROWS,
    check_mass_limit,
    criterion_words,
    mass_text,
    meets_criterion,
    nanmean,
    worst_head,
)
from pcast_jax.errors import PcastError, check_int
from pcast_jax.presets import get_preset, preset_for, resolve

__all__ = ["SINK_MASS_MIN", "Analysis", "ScaleScan", "analyze", "kernel_for", "scale_candidates",
           "scale_scan", "trace_statistics", "trace_sinks", "end_to_end", "TraceDiagnosis", "diagnose_trace"]

#: A head is a sink head when its sinks receive at least this share of the attention.
SINK_MASS_MIN = 0.5
#: Per-head quantities left out of the per-config means: bookkeeping, and ``frac_zeroed`` (pooled over each
#: head's rows; the per-config table averages ``frac_zeroed_row_mean``, the mean of per-row fractions).
_BOOKKEEPING = ("rows_used", "ref_sq", "frac_zeroed")


@dataclasses.dataclass(frozen=True)
class ScaleScan:
    """One kernel family's safe-scale scan (the kernel simulated on the trace per candidate scale).

    Attributes:
      family: the family's configuration at ``scale = 1`` (named after its first analysed member).
      members: names of the analysed configurations in the family.
      rows: per candidate simulated, by scale: ``scale``, ``applied_scale``, ``knob_value`` (the scale in
        ``knob``), ``zeroed_mass_max``, ``saturated_mass_max``, ``heads_over_limit``, ``meets`` (the
        criterion).
      recommended: the smallest candidate meeting the criterion, or None when none does (or, with sampled rows,
        when a smaller candidate is within noise: ``within_noise``).
      knob: the knob a deployment sets the scale through (``"scale_s"``, ``"prob_scale"``; ``"scale"``,
        the config field, where none is known) and ``knob_where``, that deployment
        (:func:`pcast_jax.deployments.knob_setting`).
    """

    family: KernelConfig
    members: tuple[str, ...]
    rows: tuple[dict, ...]
    recommended: float | None
    knob: str = "scale"
    knob_where: str = ""
    within_noise: bool = False

    def knob_text(self, scale: float | None = None) -> str:
        """``scale_s = 256`` (the recommendation, or ``scale``'s row, in the knob)."""
        scale = self.recommended if scale is None else scale
        row = next(r for r in self.rows if r["scale"] == scale)
        return f"{self.knob} = {row['knob_value']:g}"


def kernel_for(config: str | KernelConfig, head_dim: int) -> KernelConfig:
    """A preset name at its KV tile for ``head_dim`` (:func:`pcast_jax.presets.preset_for`); a
    :class:`KernelConfig` equal to a preset of the same name likewise; any other config as given."""
    cfg = resolve(config, head_dim=head_dim)
    if isinstance(config, str):
        return cfg
    try:
        if get_preset(cfg.name) == cfg:
            return preset_for(cfg.name, head_dim)
    except PcastError:
        pass
    return cfg


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
    """What :func:`analyze` returns (plain NumPy data; see the module docstring).

    Attributes:
      layers: the trace's layer names (``L``).
      configs: the configurations, at the trace's head dim (each named as passed; its ``block_kv`` the KV
        tile that runs at that head dim).
      lengths: ``[B]`` tokens of each sequence.
      stats: sink statistics, each ``[B, L, H]`` (``sink_positions [B, L, H, k]``,
        ``underflow_mass [B, L, H, len(SCALE_GRID)]``).
      heads: per-head P-cast metrics, each ``[C, B, L, H]``.
      mass_limit: the limit of the criterion (zeroed and clipped mass of the worst head).
      scans: the safe-scale scan of each kernel family with a static scale.
      local_window_size: ``[L]`` each layer's local window (−1: none), as analysed.
      logits_soft_cap: ``[L]`` each layer's logit soft cap (0: none), as analysed; None: no layer has one.
      e2e: ``{config name: E2EMetrics}`` when the model was given, else None.
      e2e_fp32: the FP32 model's own metrics (its perplexity), or None.
      seconds: wall time of the analysis (without the end-to-end runs).
      rows: the query rows sampled per sequence, layer and head (:func:`analyze`'s ``rows``), or None: all.
      seed: the seed of the sample.
      heads_sem: with sampled rows, each per-head metric's standard error over the sampled rows, ``[C, B, L,
        H]`` (NaN with fewer than 2 rows), the sink statistics' rows sampled likewise; None: every row analysed.
    """

    layers: tuple[str, ...]
    configs: tuple[KernelConfig, ...]
    lengths: np.ndarray
    stats: dict
    heads: dict
    mass_limit: float
    scans: tuple[ScaleScan, ...] = ()
    local_window_size: np.ndarray | None = None
    logits_soft_cap: np.ndarray | None = None
    e2e: dict | None = None
    e2e_fp32: E2EMetrics | None = None
    seconds: float = 0.0
    rows: int | None = None
    seed: int = 0
    heads_sem: dict | None = None

    @property
    def config_names(self) -> list[str]:
        return [c.name for c in self.configs]

    def sink_heads(self) -> np.ndarray:
        """``[L, H]`` bool: the sink heads (sink mass ≥ :data:`SINK_MASS_MIN`, mean over sequences)."""
        return nanmean(self.stats["sink_mass"], axis=0) >= SINK_MASS_MIN

    def head_mean(self, metric: str) -> np.ndarray:
        """``[C, L, H]``: a per-head metric averaged over sequences."""
        return nanmean(self.heads[metric], axis=1)

    def worst_underflow_mass(self) -> np.ndarray:
        """``[len(SCALE_GRID)]``: per scale, the largest zeroed mass of any head that the closed form
        (running max at the sink's logit) predicts; a guide beside the scans, never the decision."""
        return np.nanmax(nanmean(self.stats["underflow_mass"], axis=0), axis=(0, 1))

    def safe_scale(self, config: str | None = None) -> float | None:
        """The recommended ``scale`` of the family of ``config`` (a name; default: the first family
        scanned): the smallest candidate whose simulated kernel meets the criterion, or None."""
        for scan in self.scans:
            if config is None or config in scan.members:
                return scan.recommended
        raise PcastError(f"safe_scale: config={config!r} has no scan (a static-scale config analysed here: "
                         f"{[m for sc in self.scans for m in sc.members]})")

    def worst(self, ci: int) -> dict:
        """Configuration ``ci``'s worst heads: zeroed and clipped mass (each head a mean over sequences),
        where, and how many heads fail the criterion."""
        sem = None if self.heads_sem is None else {m: a[ci] for m, a in self.heads_sem.items()}
        return worst_head({m: a[ci] for m, a in self.heads.items()}, self.mass_limit, self.layers, sem=sem,
                      z=self._z())

    def _z(self) -> float | None:
        """The quantile the sampled verdicts decide with (:func:`pcast_jax.stats.z_value` at the rows sampled)."""
        return None if self.rows is None else _stats.z_value(self.rows)

    def config_rows(self) -> list[dict]:
        """One row per configuration: every per-head metric's mean over heads (and its s.e.), the
        worst head's zeroed and clipped mass, how many heads fail the criterion, the verdict."""
        rows = []
        for ci, cfg in enumerate(self.configs):
            row = {"config": cfg.name, "block_kv": cfg.block_kv}
            for metric in self.heads:
                if metric in _BOOKKEEPING:
                    continue
                per_head = self.head_mean(metric)[ci].ravel()
                per_head = per_head[np.isfinite(per_head)]
                row[f"{metric}_mean"], row[f"{metric}_sem"] = _stats.mean_sem(per_head)
            row.update(self.worst(ci))
            del row["meets"]
            row["verdict"] = row.pop("verdict")
            if self.e2e is not None:
                m = self.e2e[cfg.name]
                row.update(kl=m.kl, kl_max=m.kl_max, top1_agree=m.top1_agree, perplexity=m.perplexity)
            rows.append(row)
        return rows

    def head_rows(self) -> list[dict]:
        """Tidy rows: one per (config, sequence, layer, head) with the sink statistics and every metric."""
        rows = []
        c, b, layers, h = self.heads["zeroed_mass"].shape
        for ci in range(c):
            for bi in range(b):
                for li in range(layers):
                    for hi in range(h):
                        row = {"config": self.configs[ci].name, "sequence": bi, "layer": self.layers[li],
                               "head": hi, "sink_position": int(self.stats["sink_positions"][bi, li, hi, 0])}
                        for name in ("delta", "sigma", "sink_mass"):
                            row[name] = float(self.stats[name][bi, li, hi])
                        for metric, arr in self.heads.items():
                            row[metric] = arr[ci, bi, li, hi].item()
                        for metric, arr in (self.heads_sem or {}).items():
                            row[f"{metric}_sem"] = arr[ci, bi, li, hi].item()
                        rows.append(row)
        return rows

    def to_dataframe(self):
        """The per-head rows (:meth:`head_rows`) as a pandas DataFrame (needs the ``data`` extra)."""
        pd = _optional("pandas")
        frame = pd.DataFrame(self.head_rows())
        frame["config"] = pd.Categorical(frame["config"], categories=self.config_names)
        return frame

    def to_xarray(self):
        """An ``xarray.Dataset``: every metric over (config, sequence, layer, head), every sink
        statistic over (sequence, layer, head) (``underflow_mass`` also over ``scale``), the
        end-to-end metrics over config when present (needs the ``data`` extra).

        Every dimension has a coordinate: ``config`` the names passed to :func:`analyze`
        (``ds.sel(config="fa3")``), with ``block_kv`` (the KV tile that ran at the trace's head dim)
        and ``config_spec`` beside it; ``sequence`` and ``head`` their indices (``length`` beside
        ``sequence``); ``layer`` the trace's layer names; ``scale`` :data:`SCALE_GRID`."""
        xr = _optional("xarray")
        dims = ("sequence", "layer", "head")
        data = {m: (("config",) + dims, np.asarray(v)) for m, v in self.heads.items()}
        data.update({f"{m}_sem": (("config",) + dims, np.asarray(v)) for m, v in (self.heads_sem or {}).items()})
        for name, arr in self.stats.items():
            name = f"sink_{name}" if name in data else name  # rows_used: the sink statistics' own
            if name == "sink_positions":
                data[name] = (dims + ("sink",), arr)
            elif name == "underflow_mass":
                data[name] = (dims + ("scale",), arr)
            else:
                data[name] = (dims, arr)
        if self.e2e is not None:
            for field in E2EMetrics._fields:
                data[f"e2e_{field}"] = (("config",), np.array([getattr(self.e2e[c], field)
                                                               for c in self.config_names]))
        coords = {"config": self.config_names, "layer": list(self.layers), "scale": list(SCALE_GRID),
                  "config_spec": ("config", [c.to_string() for c in self.configs]),
                  "block_kv": ("config", [c.block_kv for c in self.configs]),
                  "sequence": np.arange(len(self.lengths)), "head": np.arange(self.heads["zeroed_mass"].shape[-1]),
                  "length": ("sequence", self.lengths)}
        return xr.Dataset(data, coords=coords, attrs={"mass_limit": self.mass_limit,
                                                      "sink_mass_min": SINK_MASS_MIN})

    def criterion_line(self) -> str:
        """The criterion of every verdict and safe scale, in words."""
        return criterion_words(self.mass_limit)

    def summary_lines(self, *, fixed_scale: bool = False) -> list[str]:
        """The answer in words, first: sinks, the criterion, each kernel's verdict and why, the safe
        scales, end to end. ``fixed_scale``: the kernels' S is fixed (a deployment with no knob), so each
        scale scan is said as a what-if, not a setting."""
        sink = self.sink_heads()
        n_layers, n_heads = sink.shape
        delta = nanmean(self.stats["delta"], axis=0)[sink]
        sigma = nanmean(self.stats["sigma"], axis=0)[sink]
        seq = f"{len(self.lengths)} sequence{'s' if len(self.lengths) > 1 else ''} of {int(self.lengths.max())} tokens"
        if sink.any():
            verb = "has" if sink.sum() == 1 else "have"
            sinks = (f"{int(sink.sum())} of {sink.size} heads {verb} a sink (one key takes ≥ {SINK_MASS_MIN:.0%} of "
                     f"the attention; median Δ = {np.median(delta):.1f} logits, σ = {np.median(sigma):.1f})")
        else:
            sinks = f"none of the {sink.size} heads has a sink (no key takes ≥ {SINK_MASS_MIN:.0%} of the attention)"
        lines = [f"On this model ({n_layers} layers × {n_heads} heads, {seq}), {sinks}.", ""]
        windows = self.local_window_size
        if windows is not None and (windows >= 0).any():
            lines += [f"{int((windows >= 0).sum())} of {n_layers} layers attend within a local window "
                      f"({', '.join(sorted({str(int(w)) for w in windows if w >= 0}))} keys back); the analysis "
                      "sees what they see.", ""]
        caps = self.logits_soft_cap
        if caps is not None and (caps > 0).any():
            lines += [f"{int((caps > 0).sum())} of {n_layers} layers soft-cap their logits (cap·tanh(logit/cap), cap = "
                      f"{', '.join(sorted({f'{float(c):g}' for c in caps if c > 0}))}); the analysis sees the capped "
                      "logits.", ""]
        if self.e2e is not None:
            parts = [f"`{name}` KL {m.kl:.2e} nats/token, top-1 agreement {m.top1_agree:.1%}, perplexity "
                     f"{m.perplexity:.3f}" for name, m in self.e2e.items()]
            lines += [f"End to end (FP32 perplexity {self.e2e_fp32.perplexity:.3f}): " + "; ".join(parts) + ".", ""]
        lines += [self.criterion_line(), ""]
        if self.rows is not None:
            lines += [f"Sampled: {self.rows:,} random query rows of each sequence and layer (seed {self.seed}; the "
                      "same rows for every head, each on every key it sees); every mass is the sample's mean ± its "
                      f"standard error, and a verdict or safe scale is decided only where mean ± {self._z():.2f} s.e. "
                      f"keeps the limit outside (else *{WITHIN_NOISE_ROWS}*). The sinks are found from the sample.", ""]
        for cfg, row in zip(self.configs, self.config_rows()):
            lines.append(
                f"- `{row['config']}`: **{row['verdict']}**. Its worst head loses "
                f"{_pm(row, 'zeroed_mass_max')} of the mass to zeroed P ({row['worst_layer']} head "
                f"{row['worst_head']}) and clips "
                f"{_pm(row, 'saturated_mass_max')}; {row['heads_over_limit']} of {row['heads']} heads fail the "
                f"criterion{_noise_words(row)}. Mean over heads: {mass_text(row['zeroed_mass_mean'])} of the mass "
                f"zeroed ({mass_text(row['frac_zeroed_row_mean_mean'])} of the non-sink P, a mean of per-row "
                f"fractions), relative MSE {row['rel_mse_mean']:.2e}."
                + _share_words(cfg, row) + _split_words(cfg, int(self.lengths.max())))
        lines.append("")
        lines += [_scan_words(scan, self.mass_limit, fixed=fixed_scale) for scan in self.scans]
        if not self.scans:
            lines.append("No configuration analysed has a static scale to recommend.")
        return lines


#: Split-KV configs whose kernel runs on decode rows only (one query row per sequence): on the rows of a
#: prefill trace they are the decode kernel's split schedule applied to each row, not a kernel that runs.
DECODE_ONLY = ("sglang_triton_decode", "vllm_triton_fp8_3d")


def _split_words(cfg: KernelConfig, rows: int) -> str:
    """The caveat of a split-KV config on a causal prefill trace (more than one query row per sequence).

    The simulator cuts one split schedule per row from all the row's KV blocks
    (:func:`pcast_jax.block.split_schedule`). FlashAttention-3 instead divides each query tile's visible
    blocks among its splits (Dao-AILab/flash-attention @0251105 ``hopper/block.h`` lines 23-34: the tile's
    ``n_block_max`` at its diagonal; lines 47-54: ``num_n_blocks_per_split = ceil_div(n_block_max −
    n_block_min, num_splits)``), and the decode kernels (:data:`DECODE_ONLY`) do not run on prefill rows. The
    two agree on decode rows and where every tile sees every block; on causal prefill a forward S = 1
    contiguous split (8 splits of 64 keys; ``vllm_triton_fp8_3d``; ``sglang_triton_decode``) zeroes 1.8–1.95×
    more mass per row than the same kernel split per 128-row query tile at 4,096 tokens.
    """
    if cfg.kv_splits <= 1 or rows <= 1:
        return ""
    base = cfg.name.partition("@")[0]
    if base in DECODE_ONLY:
        return (f" Note: `{base}` is a decode kernel; on these prefill rows its numbers are its split schedule cut "
                "from each row's blocks, not what a prefill kernel does (a per-query-tile split zeroes about half "
                "as much on causal prefill).")
    return (" Note: its splits are cut from each row's blocks; a kernel that splits each query tile's visible "
            "blocks (FlashAttention-3) differs on causal prefill rows (for a forward S = 1 kernel this overstates "
            "the zeroed mass about 2×; for a reverse S = 256 kernel it is immaterial).")
def _noise_words(row: dict) -> str:
    """With sampled rows: how many heads the sample's error leaves undecided."""
    if not row.get("heads_within_noise"):
        return ""
    return f", {row['heads_within_noise']} within noise"


def _share_words(cfg: KernelConfig, row: dict) -> str:
    """With E4M3 Q/K/V: which part of the error dominates, the P-cast or the Q/K/V quantization."""
    if cfg.qkv != "e4m3":
        return ""
    total, qkv = row["rel_mse_mean"], row["rel_mse_qkv_mean"]
    part = "the Q/K/V quantization" if qkv >= total / 2 else "the P-cast"
    return (f" Its Q/K/V are quantized to E4M3: {part} dominates (relative MSE with P in FP32, Q/K/V quantization "
            f"alone: {qkv:.2e}; with the P-cast too: {total:.2e}).")


def _family_words(cfg: KernelConfig) -> str:
    words = f"{cfg.order} order, B = {cfg.block_kv}, {cfg.scale_mode} mode"
    if cfg.rescale_threshold:
        words += f", lazy rescale τ = {cfg.rescale_threshold:g} ({cfg.rescale_unit})"
    if cfg.p_format != "e4m3":
        words += f", P in {cfg.p_format}"
    return words


def _pm(row: dict, key: str) -> str:
    """A mass of a row as printed (:func:`mass_text`), with ``± s.e.`` where the row carries ``<key>_sem``."""
    return mass_text(row[key]) + (f" ± {mass_text(row[f'{key}_sem'])}" if f"{key}_sem" in row else "")


def _scan_words(scan: ScaleScan, limit: float, *, fixed: bool = False) -> str:
    names = ", ".join(f"`{m}`" for m in scan.members)
    if fixed:  # no knob reaches S: the scan is what the kernel would need, not a setting
        return "What-if only (this deployment fixes S; no setting reaches it): " + _scan_words(scan, limit)
    if scan.within_noise:
        row = next(r for r in scan.rows if r["meets"] is None)
        return (f"Safe static scale for {names} ({_family_words(scan.family)}): {WITHIN_NOISE_ROWS}. At `scale = "
                f"{row['scale']:g}` the worst head loses {_pm(row, 'zeroed_mass_max')} and clips "
                f"{_pm(row, 'saturated_mass_max')}: the sample's error keeps the limit inside.")
    if scan.recommended is None:
        top = scan.rows[-1]
        what = {"scale": "`scale`", "scale_s": "`scale_s`"}.get(scan.knob, f"S (set through `{scan.knob}`)")
        return (f"Safe static scale for {names} ({_family_words(scan.family)}): none. No {what} from 1 to "
                f"{top['scale']:g} meets the criterion (at {top['scale']:g} the worst head loses "
                f"{_pm(top, 'zeroed_mass_max')} and clips {_pm(top, 'saturated_mass_max')}): use the reverse "
                "KV order or a dynamic scale.")
    best = next(r for r in scan.rows if r["scale"] == scan.recommended)
    words = (f"Safe static scale for {names} ({_family_words(scan.family)}): `scale = {scan.recommended:g}`"
             f" (P multiplied by {best['applied_scale']:g}){_knob_words(scan)}, the smallest power of two whose "
             f"simulated kernel meets the criterion: worst head loses {_pm(best, 'zeroed_mass_max')}, clips "
             f"{_pm(best, 'saturated_mass_max')}")
    below = [r for r in scan.rows if r["scale"] < scan.recommended]
    if below:
        prev = below[-1]
        words += (f"; at `scale = {prev['scale']:g}` it loses {_pm(prev, 'zeroed_mass_max')} and clips "
                  f"{_pm(prev, 'saturated_mass_max')}")
    return words + "."


def _knob_words(scan: ScaleScan) -> str:
    """Where a deployment sets the scale through a knob: that knob's setting (cuDNN: ``scale_s``, whose
    P multiplier is scale_s·2^-τ; vLLM ROCm: ``prob_scale``, S = factor/prob_scale)."""
    if scan.knob == "scale":
        return ""
    return f"; in {scan.knob_where}'s knob: `{scan.knob_text()}`"




def _optional(module: str):
    from pcast_jax.sweep.spec import optional

    return optional(module)


def analyze(trace: Trace | StreamedTrace, configs: Sequence[str | KernelConfig], *, num_sinks: int = 1,
            min_keys: int = 16, mass_limit: float = MASS_LIMIT, logits_fn: Callable | None = None,
            progress: Callable[[str], None] | None = None, rows: int | None = None, seed: int = 0) -> Analysis:
    """Sink statistics and every configuration's per-head P-cast metrics on ``trace``.

    The trace is read one layer at a time (:meth:`Trace.layer`; a :class:`StreamedTrace` maps only that
    layer's files), and everything of a layer — sink statistics, exact reference, every kernel and every
    candidate scale — is computed before the next is read: memory holds one layer's q, k, v (float32) and
    its per-chunk temporaries, whatever the number of layers.

    Args:
      trace: a :class:`Trace` (from :class:`~pcast_jax.analysis.capture.Recorder` or
        :func:`~pcast_jax.analysis.capture.load_trace`) or a :class:`StreamedTrace` (a trace folder).
      configs: preset names (run at the trace's head dim, :func:`kernel_for`) or KernelConfigs.
      num_sinks, min_keys: as :func:`~pcast_jax.analysis.statistics.sink_statistics`.
      mass_limit: the limit of the one criterion (the worst head's zeroed and clipped mass), in (0, 1).
      logits_fn: optional ``logits_fn(config) -> [B, T, V]`` logits of the model on
        ``trace.tokens`` with every attention through ``config`` (``None``: exact FP32); given,
        the end-to-end metrics are computed (needs ``trace.tokens``).
      progress: optional ``(line) -> None`` called with one line per stage and per layer done (layers done,
        the rows analysed, the time so far and the time left at the pace so far).
      rows: analyse a simple random sample of this many query rows of each sequence and layer (the same rows
        for every head; :func:`~pcast_jax.analysis.rows.sample_rows`), each on every key it sees, so the
        kernel's running max is exact; every per-head mean is then the sample's, with its standard error
        (:attr:`Analysis.heads_sem`), and verdicts and safe scales are decided only where the error allows
        (:func:`pcast_jax.stats.decide` at :func:`pcast_jax.stats.z_value` of ``rows``; else
        :data:`~pcast_jax.criterion.WITHIN_NOISE_ROWS`). The sinks are found from the sample too. None
        (default): every row. A sequence of at most ``rows`` tokens is analysed whole.
      seed: the sample's seed (the rows of sequence ``b`` and layer ``l`` come from
        ``numpy.random.default_rng([seed, b, l])``).

    Returns:
      :class:`Analysis`.
    """
    if not isinstance(trace, (Trace, StreamedTrace)):
        raise PcastError(f"trace must be a Trace (Recorder.trace() or load_trace), got {type(trace).__name__}")
    if isinstance(configs, (str, KernelConfig)) or not len(configs):
        raise PcastError("configs must be a non-empty list of preset names or KernelConfigs")
    mass_limit = check_mass_limit(mass_limit)
    min_keys = check_int("min_keys", min_keys, min_value=1)
    if rows is not None:
        rows = check_int("rows", rows, min_value=2)
        rows = None if rows >= int(np.max(trace.lengths)) else rows  # every sequence whole: no sample
    seed = check_int("seed", seed, min_value=0, max_value=2**63 - 1)
    kernels = tuple(kernel_for(c, trace.head_dim) for c in configs)
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise PcastError(f"configs must have distinct names; got {names}")
    if rows is not None:
        tiled = [k.name for k in kernels if k.block_q > 1]
        if tiled:
            raise PcastError(f"rows={rows}: {', '.join(tiled)} share one scale or vote over a tile of query rows "
                             "(block_q > 1), which a sample of single rows does not reproduce; analyse every row "
                             "(rows=None) for them")
    if logits_fn is not None and trace.tokens is None:
        raise PcastError("logits_fn needs the trace's tokens (Recorder.trace(tokens=...))")
    say = progress or (lambda _line: None)
    start = time.perf_counter()
    families = _families(kernels)
    scanned = [(family, todo) for family, (_, todo) in families.items() if todo]
    stats, heads, masses = _stream(trace, kernels, scanned, num_sinks=num_sinks, min_keys=min_keys, rows=rows,
                                   seed=seed, say=say, start=start)
    heads_sem = {m[:-4]: a for m, a in heads.items() if m.endswith("_sem")} or None
    heads = {m: a for m, a in heads.items() if not m.endswith("_sem")}
    if not np.isfinite(heads["zeroed_mass"]).any():
        raise PcastError(f"no head has a query row that sees min_keys={min_keys} keys besides its sink: "
                         "record more tokens or lower min_keys")
    scans = _scale_scans(trace, kernels, families, heads, heads_sem, masses, stats["sink_positions"], min_keys,
                         mass_limit, rows)
    seconds = time.perf_counter() - start
    e2e = fp32 = None
    if logits_fn is not None:
        fp32, e2e = end_to_end(trace, kernels, logits_fn, progress=say)
    return Analysis(layers=trace.layers, configs=kernels, lengths=trace.lengths, stats=stats, heads=heads,
                    mass_limit=mass_limit, scans=scans, local_window_size=trace.local_window_size,
                    logits_soft_cap=trace.logits_soft_cap, e2e=e2e, e2e_fp32=fp32, seconds=seconds,
                    rows=rows, seed=seed, heads_sem=heads_sem)


def _sample(trace, rows: int | None, seed: int, sequence: int, layer: int):
    """The sorted query rows of ``sequence`` analysed in ``layer``: None (every row) without ``rows`` or where
    the sequence has no more real tokens than ``rows``, else :func:`~pcast_jax.analysis.rows.sample_rows`."""
    length = int(trace.lengths[sequence])
    if rows is None or rows >= length:
        return None
    return sample_rows(length, rows, np.random.default_rng([seed, sequence, layer]))


def _stream(trace, kernels, scanned: list, *, num_sinks: int, min_keys: int, rows: int | None, seed: int, say,
            start: float) -> tuple[dict, dict, list]:
    """Every layer of the trace read once, in order, and analysed before the next: per sequence its sink
    statistics (:func:`~pcast_jax.analysis.statistics.pending_statistics`, each sequence at its length) and every
    kernel and family scan (:func:`~pcast_jax.analysis.heads.analyze_layers`), on its sample of rows.

    Returns ``(stats {name: [B, L, H, ...]}, heads {metric: [C, B, L, H]} (with ``<metric>_sem`` where
    sampled), masses)``, ``masses`` per sequence ``{family: {name: [len(todo), L, H]}}``."""
    num_layers, num_seqs = trace.num_layers, trace.num_sequences
    stats = [[None] * num_layers for _ in range(num_seqs)]
    metrics = [[None] * num_layers for _ in range(num_seqs)]
    found = [[None] * num_layers for _ in range(num_seqs)]
    analysed = [int(trace.lengths[b]) if rows is None else min(rows, int(trace.lengths[b])) for b in range(num_seqs)]
    row_words = " + ".join(f"{n:,}" for n in analysed) + " rows" + (
        "" if rows is None else f" (sampled of {' + '.join(f'{int(n):,}' for n in trace.lengths)})")
    say(f"{num_layers} layers × {trace.num_heads} heads × {num_seqs} sequence{'s' if num_seqs > 1 else ''}: "
        f"{row_words} per head, {len(kernels)} configs ({', '.join(k.name for k in kernels)}) and {len(scanned)} "
        "scale scans, one layer at a time")
    for layer in range(num_layers):
        q, k, v = trace.layer(layer)
        params = _layer_parameters(trace, layer)
        for b in range(num_seqs):
            n = int(trace.lengths[b])
            sample = _sample(trace, rows, seed, b, layer)
            positions, finish = pending_statistics(q[None, b], k[None, b], num_sinks=num_sinks,
                                                   min_keys=min(min_keys, n), length=n, sample=sample, **params)
            if rows is not None:  # a sample is quick to compute and the layer large: one pass's copies at a time
                stats[b][layer] = finish()
            metrics[b][layer], found[b][layer] = analyze_layers(
                (q[None, b], k[None, b], v[None, b]), kernels, positions, families=scanned, min_keys=min_keys,
                length=n, sample=sample, **params)
            if rows is not None and sample is None:  # a sequence analysed whole among sampled ones: exact
                for part in (metrics[b][layer], *found[b][layer]):
                    part.update({f"{m}_sem": np.zeros_like(a, np.float32) for m, a in list(part.items())
                                 if m != "rows_used"})
            if rows is None:
                stats[b][layer] = finish()  # computed beside the kernels
        del q, k, v
        elapsed = time.perf_counter() - start
        left = elapsed / (layer + 1) * (num_layers - layer - 1)
        say(f"layer {layer + 1}/{num_layers} done ({trace.layers[layer]}; {row_words} × {trace.num_heads} heads): "
            f"{elapsed:.1f} s, about {left:.0f} s left")
    stacked = {name: np.stack([np.concatenate([s[name] for s in seq]) for seq in stats]) for name in stats[0][0]}
    heads = {name: np.stack([np.concatenate([m[name] for m in seq], axis=1) for seq in metrics], axis=1)
             for name in metrics[0][0]}
    masses = [{family: {name: np.concatenate([f[i][name] for f in seq], axis=1) for name in seq[0][i]}
               for i, (family, _) in enumerate(scanned)} for seq in found]
    return stacked, heads, masses


def trace_statistics(trace: Trace | StreamedTrace, *, num_sinks: int = 1, min_keys: int = 16,
                     progress: Callable[[str], None] | None = None) -> dict:
    """:func:`~pcast_jax.analysis.statistics.sink_statistics` of every sequence of ``trace``, each at its
    length and every layer within its window, one layer at a time: ``{name: [B, L, H, ...]}``."""
    say = progress or (lambda _line: None)
    per_layer = []
    for layer in range(trace.num_layers):
        say(f"layer {layer + 1}/{trace.num_layers}: sink statistics")
        q, k, _ = trace.layer(layer)
        per_layer.append([pending_statistics(q[None, b], k[None, b], num_sinks=num_sinks,
                                             min_keys=min(min_keys, int(trace.lengths[b])),
                                             length=int(trace.lengths[b]), **_layer_parameters(trace, layer))[1]()
                          for b in range(trace.num_sequences)])
    return {name: np.stack([np.concatenate([seqs[b][name] for seqs in per_layer]) for b in range(trace.num_sequences)])
            for name in per_layer[0][0]}


def trace_sinks(trace: Trace | StreamedTrace, *, num_sinks: int = 1,
                progress: Callable[[str], None] | None = None) -> np.ndarray:
    """``[B, L, H, num_sinks]``: :func:`trace_statistics`' ``sink_positions`` alone
    (:func:`~pcast_jax.analysis.statistics.find_sinks`), what a scan of candidate scales needs; one layer at a time."""
    say = progress or (lambda _line: None)
    per_layer = []
    for layer in range(trace.num_layers):
        say(f"layer {layer + 1}/{trace.num_layers}: sink positions")
        q, k, _ = trace.layer(layer)
        per_layer.append([find_sinks(q[None, b], k[None, b], num_sinks=num_sinks, length=int(trace.lengths[b]),
                                     **_layer_parameters(trace, layer)) for b in range(trace.num_sequences)])
    return np.stack([np.concatenate([seqs[b] for seqs in per_layer]) for b in range(trace.num_sequences)])


def end_to_end(trace: Trace, configs: Sequence[KernelConfig], logits_fn: Callable,
               progress: Callable[[str], None] | None = None) -> tuple[E2EMetrics, dict]:
    """The model through each config against itself in FP32 on ``trace.tokens``: the FP32 model's own
    :class:`E2EMetrics` and ``{config name: E2EMetrics}`` (``logits_fn`` as :func:`analyze` takes it)."""
    say = progress or (lambda _line: None)
    if trace.tokens is None:
        raise PcastError("logits_fn needs the trace's tokens (Recorder.trace(tokens=...))")
    say("end to end: FP32")
    ref = logits_fn(None)
    out = {}
    for i, cfg in enumerate(configs):
        say(f"end to end: config {i + 1}/{len(configs)} {cfg.name}")
        out[cfg.name] = compare_logits(ref, logits_fn(cfg), trace.tokens, lengths=trace.lengths)
    return compare_logits(ref, ref, trace.tokens, lengths=trace.lengths), out


def _families(kernels) -> dict:
    """The families of static-scale kernels (configs that differ only in ``scale``): ``{family at scale 1:
    (member indices, the candidate scales no member runs)}``."""
    members: dict = {}
    for ci, cfg in enumerate(kernels):
        if cfg.scale_mode not in COMPUTED_SCALE_MODES:  # a computed scale (dynamic, tile amax) has no S to scan
            members.setdefault(cfg.replace(scale=1.0), []).append(ci)
    out = {}
    for family, cis in members.items():
        run = {kernels[ci].scale for ci in cis}
        out[family] = tuple(cis), tuple(s for s in scale_candidates(family) if s not in run)
    return out


def _scale_scans(trace, kernels, families: dict, heads: dict, heads_sem: dict | None, masses: list,
                 sink_positions, min_keys: int, mass_limit: float, rows: int | None) -> tuple[ScaleScan, ...]:
    """The safe-scale scan of each family of static-scale kernels (module docstring): every candidate
    of :func:`scale_candidates`, an analysed member's own rows reused at its scale, the others' masses
    from :func:`_stream` (with their standard errors where the rows were sampled)."""
    scans = []
    for family, (members, todo) in families.items():
        known = {}
        for ci in members:
            known[kernels[ci].scale] = {m: a[ci] for m, a in heads.items()}
            known[kernels[ci].scale].update({f"{m}_sem": a[ci] for m, a in (heads_sem or {}).items()})
        for i, scale in enumerate(todo):
            known[scale] = {m: np.stack([seq[family][m][i] for seq in masses]) for m in masses[0][family]}
        scans.append(scale_scan(trace, family.replace(name=kernels[members[0]].name), sink_positions=sink_positions,
                                min_keys=min_keys, mass_limit=mass_limit, known=known,
                                members=tuple(kernels[ci].name for ci in members), rows=rows))
    return tuple(scans)


def scale_scan(trace: Trace | StreamedTrace, config: KernelConfig, *, sink_positions,
               scales: Sequence[float] | None = None, min_keys: int = 16, mass_limit: float = MASS_LIMIT,
               known: dict | None = None, members: tuple[str, ...] = (), rows: int | None = None) -> ScaleScan:
    """One kernel family simulated on ``trace`` at each candidate scale, judged by the worst-head criterion.

    Args:
      trace: the :class:`Trace` or :class:`StreamedTrace` (read one layer at a time).
      config: the kernel (its ``scale`` is replaced by each candidate; its name labels the scan).
      sink_positions: ``[B, L, H, k]`` from the sink statistics (:attr:`Analysis.stats`).
      scales: the candidates (default :func:`scale_candidates`).
      min_keys, mass_limit: as :func:`analyze`.
      known: ``{scale: {metric: [B, L, H]}}`` of scales already simulated by the full kernel (an
        analysed configuration), used as they are (with ``<metric>_sem`` where its rows were sampled); the
        others come from :func:`~pcast_jax.analysis.heads.scale_masses`, the same kernel's zeroed and clipped
        masses without the contraction with V, all candidates in one pass.
      members: the analysed configurations of the family (default: the config's name).
      rows: the rows ``known`` was sampled on (:func:`analyze`'s ``rows``; None: every row): each candidate
        is then judged within its standard error, and one within noise below the first that meets the
        criterion leaves no recommendation (``within_noise``).

    Returns:
      :class:`ScaleScan`, one row per candidate by scale; ``recommended`` the smallest meeting the
      criterion, or None.
    """
    known = known or {}
    scales = tuple(sorted({float(s) for s in (scale_candidates(config) if scales is None else scales)}))
    if not scales:
        raise PcastError("scales must hold at least one candidate scale")
    todo = [s for s in scales if s not in known]
    found = dict(known)
    if todo:
        per_layer = []
        for layer in range(trace.num_layers):
            q, k, v = trace.layer(layer)
            per_layer.append([scale_masses((q[None, b], k[None, b], v[None, b]), config, todo,
                                           sink_positions[b][layer:layer + 1], min_keys=min_keys,
                                           length=int(trace.lengths[b]), **_layer_parameters(trace, layer))
                              for b in range(trace.num_sequences)])
        for i, scale in enumerate(todo):  # [B, L, H] per mass
            found[scale] = {m: np.stack([np.concatenate([seqs[b][m][i] for seqs in per_layer])
                                         for b in range(trace.num_sequences)])
                            for m in ("zeroed_mass", "saturated_mass")}
    from pcast_jax.deployments import knob_setting

    z = None if rows is None else _stats.z_value(rows)
    out = []
    for scale in scales:
        masses = {m: a for m, a in found[scale].items() if not m.endswith("_sem")}
        sem = {m[:-4]: a for m, a in found[scale].items() if m.endswith("_sem")} or None
        worst = worst_head(masses, mass_limit, trace.layers, sem=sem, z=z)
        knob, value, where = knob_setting(config, scale, head_dim=trace.head_dim)
        row = {"scale": scale, "applied_scale": config.replace(scale=scale).effective_scale, "knob_value": value,
               "zeroed_mass_max": worst["zeroed_mass_max"], "saturated_mass_max": worst["saturated_mass_max"],
               "heads_over_limit": worst["heads_over_limit"], "meets": worst["meets"]}
        if sem is not None:
            row.update(zeroed_mass_max_sem=worst["zeroed_mass_max_sem"],
                       saturated_mass_max_sem=worst["saturated_mass_max_sem"])
        out.append(row)
    first = next((i for i, r in enumerate(out) if r["meets"] is not False), None)
    recommended = None if first is None or out[first]["meets"] is None else out[first]["scale"]
    return ScaleScan(family=config.replace(scale=1.0, name=config.name), members=members or (config.name,),
                     rows=tuple(out), recommended=recommended, knob=knob, knob_where=where,
                     within_noise=first is not None and out[first]["meets"] is None)


def _layer_parameters(trace, layer: int) -> dict:
    """What layer ``layer`` lets its queries see, as the per-layer passes of :mod:`~pcast_jax.analysis.rows`
    take it for a one-layer trace: its window, learned sinks and soft cap."""
    return {"local_window_size": [int(trace.local_window_size[layer])],
            "sinks": None if trace.sinks is None else trace.sinks[layer:layer + 1],
            "logits_soft_cap": None if trace.logits_soft_cap is None else trace.logits_soft_cap[layer:layer + 1]}


@dataclasses.dataclass(frozen=True, eq=False)
class TraceDiagnosis:
    """What :func:`diagnose_trace` returns: the deployment's kernels analysed on a model's trace.

    Attributes:
      deployment: the :class:`~pcast_jax.deployments.Deployment`.
      analysis: the :class:`Analysis` of its configs (each preset at the trace's head dim, with its knob);
        None where the backend cannot run the model or casts no P to FP8 (nothing is simulated).
      safe: True when every config meets the analysis' criterion on the trace (or no P is cast to FP8);
        None when the backend cannot run the model (no verdict).
      recommended: the knob value to set (None where the deployment has no knob, where it is already
        safe, or where no candidate scale meets the criterion for every preset of the deployment).
      advice: one sentence: what to do.
      layers: with the ``prob_scale`` knob and a checkpoint whose layers ``layers.N`` differ in it, per group
        of layers sharing one (None: none, the engine's default): ``{"prob_scale", "layers", "verdict"}``,
        the verdict of the group's config on those of the trace's layers (layer N of the trace is the
        checkpoint's ``layers.N``; a group with no such layer is left out).
      features: the model's features read from the trace
        (:class:`~pcast_jax.deployments.ModelFeatures`).
      cannot_run: why the backend cannot run the model (empty: nothing its capabilities refuse).
      unread: the model's features whose support by the backend was not read from source.
    """

    deployment: object
    analysis: Analysis | None
    safe: bool | None
    recommended: float | None
    advice: str
    layers: tuple[dict, ...] = ()
    features: object = None
    cannot_run: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The deployment and the answer (the analysis itself: :func:`pcast_jax.analysis.report.report_data`)."""
        d = self.deployment
        return {"engine": d.engine, "backend": d.backend, "gpus": list(d.gpus),
                "kv_cache_dtypes": list(d.kv_cache_dtypes), "presets": list(d.presets),
                "knob": d.knob, "source": d.source, "selection": d.selection, "note": d.note,
                "features": None if self.features is None else dataclasses.asdict(self.features),
                "cannot_run": list(self.cannot_run), "capabilities_not_read": list(self.unread),
                "safe": self.safe, "recommended": self.recommended, "advice": self.advice,
                "layers": [dict(g) for g in self.layers]}


def diagnose_trace(deployment, trace: Trace | StreamedTrace, *, knob_value: float | None = None,
                   scales: dict | None = None, mass_limit: float = MASS_LIMIT, logits_fn: Callable | None = None,
                   progress: Callable[[str], None] | None = None) -> TraceDiagnosis:
    """The doctor's question on a model: the deployment's kernels (:func:`pcast_jax.deployments.configured`,
    at the trace's head dim) analysed on ``trace`` (:func:`analyze`), and the knob value to set.

    First the model's features (:meth:`pcast_jax.deployments.ModelFeatures.of_trace`: soft-cap, windows,
    learned sinks, head dim, GQA ratio) are held to the backend's capabilities read from source: a backend
    that cannot run the model gets no verdict (``safe`` None, nothing simulated) and the advice says why and
    what the engine does instead where its source says. A backend that casts no P to FP8 is not simulated.

    The recommendation is the smallest candidate S (:func:`scale_candidates`) at which the scan of every
    preset of the deployment meets the criterion, written in the deployment's knob; it is computed only
    when the current setting does not meet it.
    """
    from pcast_jax import deployments

    features = deployments.ModelFeatures.of_trace(trace)
    cannot = tuple(deployment.cannot_run(features))
    unread = tuple(deployment.unread(features))
    where = f"{deployment.engine} {deployment.backend}"
    if cannot:
        instead = deployment.capabilities.instead
        advice = (f"{where} cannot run this model: {'; '.join(cannot)}"
                  + (f"; instead, {instead}" if instead else "; its source does not say what the engine does instead")
                  + f" (read from {deployment.capabilities.source}); no P-cast verdict for a kernel that cannot run "
                  "the model")
        return TraceDiagnosis(deployment, None, None, None, advice, features=features, cannot_run=cannot, unread=unread)
    if not deployment.casts_p:
        return TraceDiagnosis(deployment, None, True, None, deployments.no_fp8_p_advice(deployment),
                              features=features, unread=unread)
    configs = deployments.configured(deployment, knob_value=knob_value, scales=scales, head_dim=trace.head_dim)
    result = analyze(trace, configs, mass_limit=mass_limit, logits_fn=logits_fn, progress=progress)
    failing = [r["config"] for r in result.config_rows() if r["verdict"] != SAFE]
    fail = f"{', '.join(failing)} {'fails' if len(failing) == 1 else 'fail'} the criterion on this model"
    recommended = None
    if not failing:
        advice = f"every kernel of {where} meets the criterion on this model; nothing to change"
    elif deployment.knob == "none":
        advice = (f"{fail}, and {where} fixes S itself: no setting of this backend avoids it; use a backend whose "
                  "kernel passes (pcast doctor --trace with another --backend)")
    else:
        passing = [{r["scale"] for r in scan.rows if r["meets"]} for scan in result.scans]
        common = sorted(set.intersection(*passing)) if passing else []
        if common:
            recommended = deployments.knob_from_scale(deployment.knob, common[0], deployment.knob_factor)
            applied = sorted({r["applied_scale"] for scan in result.scans for r in scan.rows
                              if r["scale"] == common[0]})
            advice = (f"{fail}; set {deployment.knob} = {recommended:g} (P scaled by "
                      f"{' and '.join(f'{a:g}' for a in applied)}), the smallest power-of-two setting at which every "
                      f"kernel of {where} meets it on the trace")
        else:
            advice = (f"{fail}, and no power-of-two S the format allows meets it for every kernel of {where}; use a "
                      "backend whose kernel passes")
    layers = ()
    if deployment.knob == "prob_scale" and knob_value is None and (scales or {}).get("layers"):
        layers = _trace_layer_verdicts(result, deployments.layer_groups(scales), mass_limit)
    return TraceDiagnosis(deployment, result, not failing, recommended, advice, layers, features, (), unread)


def _trace_layer_verdicts(result: Analysis, groups, mass_limit: float) -> tuple[dict, ...]:
    """Per group of checkpoint layers with one ``prob_scale``: the verdict of the group's config(s) (one per
    preset, named ``preset@prob_scale=value``, or the preset's own name at the default) on the trace's layers
    with the group's indices."""
    out = []
    for value, names in groups:
        index = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
        index = [i for i in index if i < len(result.layers)]
        label = "" if value is None else f"prob_scale={value:g}"  # the preset's own name at the default
        members = [ci for ci, cfg in enumerate(result.configs) if cfg.name.partition("@")[2] == label]
        if not index or not members:
            continue
        worst = [worst_head({m: a[ci][:, index] for m, a in result.heads.items()}, mass_limit,
                        [result.layers[i] for i in index]) for ci in members]
        meets = all(meets_criterion(w["zeroed_mass_max"], w["saturated_mass_max"], mass_limit) for w in worst)
        out.append({"prob_scale": value, "layers": list(names), "trace_layers": [result.layers[i] for i in index],
                    "zeroed_mass_max": max(w["zeroed_mass_max"] for w in worst),
                    "saturated_mass_max": max(w["saturated_mass_max"] for w in worst),
                    "verdict": SAFE if meets else "fails"})
    return tuple(out)
