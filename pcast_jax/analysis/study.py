"""Is my model safe under kernel X? The analysis of a captured trace, in numbers and in words.

:func:`analyze` takes a :class:`~pcast_jax.analysis.capture.Trace` and kernel configurations and
returns an :class:`Analysis`: per sequence, layer and head the sink statistics
(:func:`~pcast_jax.analysis.heads.sink_statistics`) and every configuration's P-cast metrics
(:func:`~pcast_jax.analysis.heads.head_metrics`: output error, zeroed fraction and mass, and every
further per-row count or mass the engine reports); optionally, given the model as a function from
a configuration to logits, the end-to-end effect (KL, top-1 agreement, perplexity).

Judgements, each stated in the report:

* **Sink head**: a head whose sinks receive at least :data:`SINK_MASS_MIN` of the attention
  (mean over query rows and sequences).
* **Verdict of a kernel**: its zeroed mass per head (the exact softmax mass the cast zeroes; mean
  over sequences), averaged over all heads, against ``mass_limit``: ``"loses mass"`` when the mean
  minus z standard errors (over heads, 95 % two-sided Student t) is above the limit, ``"safe"``
  when the mean plus z s.e. is below it, else ``"within noise"`` (:func:`pcast_jax.stats.decide`).
* **Safe scale**: the smallest S of :data:`~pcast_jax.analysis.heads.SCALE_GRID` at which a
  forward-order kernel (running max at the sink) zeroes at most ``mass_limit`` of the mass in
  every head: measured on the trace's logits (``sink_statistics``' ``underflow_mass``), no
  Gaussian assumption.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Callable, Sequence

import numpy as np

from pcast_jax import stats as _stats
from pcast_jax.analysis.capture import Trace
from pcast_jax.analysis.heads import SCALE_GRID, E2EMetrics, analyze_trace, compare_logits, sink_statistics
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_f32, check_int
from pcast_jax.presets import get_preset, preset_for, resolve

__all__ = ["SINK_MASS_MIN", "Analysis", "analyze", "kernel_for"]

#: A head is a sink head when its sinks receive at least this share of the attention.
SINK_MASS_MIN = 0.5
#: Per-head quantities that are bookkeeping, not results (left out of the per-config means).
_BOOKKEEPING = ("rows_used", "ref_sq", "frac_zeroed_pooled")
_VERDICTS = {True: "loses mass", False: "safe", None: "within noise"}


def kernel_for(config: str | KernelConfig, head_dim: int) -> KernelConfig:
    """A preset name at its KV tile for ``head_dim`` (:func:`pcast_jax.presets.preset_for`); a
    :class:`KernelConfig` equal to a preset of the same name likewise; any other config as given."""
    if isinstance(config, str):
        return preset_for(config, head_dim)
    cfg = resolve(config)
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
      configs: the configurations, at the trace's head dim.
      lengths: ``[B]`` tokens of each sequence.
      stats: sink statistics, each ``[B, L, H]`` (``sink_positions [B, L, H, k]``,
        ``underflow_mass [B, L, H, len(SCALE_GRID)]``).
      heads: per-head P-cast metrics, each ``[C, B, L, H]``.
      mass_limit: the zeroed-mass limit of the verdicts and the safe scale.
      e2e: ``{config name: E2EMetrics}`` when the model was given, else None.
      e2e_fp32: the FP32 model's own metrics (its perplexity), or None.
      seconds: wall time of the analysis (without the end-to-end runs).
    """

    layers: tuple[str, ...]
    configs: tuple[KernelConfig, ...]
    lengths: np.ndarray
    stats: dict
    heads: dict
    mass_limit: float
    e2e: dict | None = None
    e2e_fp32: E2EMetrics | None = None
    seconds: float = 0.0

    @property
    def config_names(self) -> list[str]:
        return [c.name for c in self.configs]

    def sink_heads(self) -> np.ndarray:
        """``[L, H]`` bool: the sink heads (sink mass ≥ :data:`SINK_MASS_MIN`, mean over sequences)."""
        return _nanmean(self.stats["sink_mass"], axis=0) >= SINK_MASS_MIN

    def head_mean(self, metric: str) -> np.ndarray:
        """``[C, L, H]``: a per-head metric averaged over sequences."""
        return _nanmean(self.heads[metric], axis=1)

    def worst_underflow_mass(self) -> np.ndarray:
        """``[len(SCALE_GRID)]``: per scale, the largest forward-order zeroed mass of any head."""
        return np.nanmax(_nanmean(self.stats["underflow_mass"], axis=0), axis=(0, 1))

    def safe_scale(self) -> float | None:
        """The smallest S of ``SCALE_GRID`` keeping every head's forward-order zeroed mass ≤ the limit."""
        for scale, mass in zip(SCALE_GRID, self.worst_underflow_mass()):
            if mass <= self.mass_limit:
                return float(scale)
        return None

    def config_rows(self) -> list[dict]:
        """One row per configuration: every per-head metric's mean over heads (and its s.e.), the
        worst head's zeroed mass, how many heads exceed the limit, the verdict."""
        rows = []
        n_heads = self.heads["zeroed_mass"].shape[2] * self.heads["zeroed_mass"].shape[3]
        z = _stats.z_value(n_heads)
        for ci, cfg in enumerate(self.configs):
            row = {"config": cfg.name}
            for metric in self.heads:
                if metric in _BOOKKEEPING:
                    continue
                per_head = self.head_mean(metric)[ci].ravel()
                per_head = per_head[np.isfinite(per_head)]
                row[f"{metric}_mean"], row[f"{metric}_sem"] = _stats.mean_sem(per_head)
            mass = self.head_mean("zeroed_mass")[ci]
            layer, head = np.unravel_index(np.nanargmax(mass), mass.shape)
            row.update(zeroed_mass_max=float(mass[layer, head]), worst_layer=self.layers[layer],
                       worst_head=int(head), heads_over_limit=int(np.sum(mass > self.mass_limit)),
                       heads=n_heads)
            row["verdict"] = _VERDICTS[_stats.decide(row["zeroed_mass_mean"], row["zeroed_mass_sem"],
                                                     self.mass_limit, z)]
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
        end-to-end metrics over config when present (needs the ``data`` extra)."""
        xr = _optional("xarray")
        dims = ("sequence", "layer", "head")
        data = {m: (("config",) + dims, np.asarray(v)) for m, v in self.heads.items()}
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
                  "length": ("sequence", self.lengths)}
        return xr.Dataset(data, coords=coords, attrs={"mass_limit": self.mass_limit,
                                                      "sink_mass_min": SINK_MASS_MIN})

    def summary_lines(self) -> list[str]:
        """The answer in words, first: sinks, each kernel's loss and verdict, the safe scale, end to end."""
        sink = self.sink_heads()
        n_layers, n_heads = sink.shape
        delta = _nanmean(self.stats["delta"], axis=0)[sink]
        sigma = _nanmean(self.stats["sigma"], axis=0)[sink]
        seq = f"{len(self.lengths)} sequence{'s' if len(self.lengths) > 1 else ''} of {int(self.lengths.max())} tokens"
        if sink.any():
            verb = "has" if sink.sum() == 1 else "have"
            sinks = (f"{int(sink.sum())} of {sink.size} heads {verb} a sink (one key takes ≥ {SINK_MASS_MIN:.0%} of "
                     f"the attention; median Δ = {np.median(delta):.1f} logits, σ = {np.median(sigma):.1f})")
        else:
            sinks = f"none of the {sink.size} heads has a sink (no key takes ≥ {SINK_MASS_MIN:.0%} of the attention)"
        lines = [f"On this model ({n_layers} layers × {n_heads} heads, {seq}), {sinks}.", ""]
        for row in self.config_rows():
            lines.append(
                f"- `{row['config']}` zeroes {_pct(row['frac_zeroed_mean'])} of the non-sink P, "
                f"{_pct(row['zeroed_mass_mean'])} of the attention mass (mean over heads); more than "
                f"{_pct(self.mass_limit)} in {row['heads_over_limit']} of {row['heads']} heads (worst "
                f"{_pct(row['zeroed_mass_max'])}, {row['worst_layer']} head {row['worst_head']}); relative "
                f"output error {row['rel_mse_mean']:.2e}. Verdict: **{row['verdict']}** "
                f"(zeroed mass {row['zeroed_mass_mean']:.2e} {_stats.fmt_se(row['zeroed_mass_sem'])} vs limit "
                f"{self.mass_limit:g})." + _saturation_words(row))
        lines.append("")
        scale = self.safe_scale()
        if scale is None:
            lines.append(f"No scale up to S = {SCALE_GRID[-1]} keeps every head's forward-order zeroed mass "
                         f"≤ {_pct(self.mass_limit)}: use reverse KV order or a dynamic scale.")
        else:
            lines.append(f"Safe static scale: a forward-order kernel keeps every head's zeroed mass ≤ "
                         f"{_pct(self.mass_limit)} from S = {scale:g} on.")
        if self.e2e is not None:
            parts = [f"`{name}` KL {m.kl:.2e} nats/token, top-1 {m.top1_agree:.1%}, perplexity {m.perplexity:.3f}"
                     for name, m in self.e2e.items()]
            lines.append(f"End to end (FP32 perplexity {self.e2e_fp32.perplexity:.3f}): " + "; ".join(parts) + ".")
        return lines


def _saturation_words(row: dict) -> str:
    """`` It also saturates …`` when the engine reports saturation and the kernel has any."""
    mass = row.get("saturated_mass_mean", 0.0)
    if not mass > 0:
        return ""
    return (f" It also saturates {_pct(row['frac_saturated_mean'])} of the visible P (sinks included), "
            f"carrying {_pct(mass)} of the mass: P·S above the format's max is clipped.")


def _nanmean(x, axis=None):
    """``np.nanmean`` without the warning for an all-NaN slice (a head with no usable row stays NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "n/a (no usable row)"
    return f"{x:.1%}" if x >= 0.001 or x == 0 else f"{x:.1e}"


def _optional(module: str):
    from pcast_jax.sweep.spec import _optional as optional

    return optional(module)


def analyze(trace: Trace, configs: Sequence[str | KernelConfig], *, num_sinks: int = 1, min_keys: int = 16,
            mass_limit: float = 1e-3, logits_fn: Callable | None = None,
            progress: Callable[[str], None] | None = None) -> Analysis:
    """Sink statistics and every configuration's per-head P-cast metrics on ``trace``.

    Args:
      trace: a :class:`Trace` (from :class:`~pcast_jax.analysis.capture.Recorder` or
        :func:`~pcast_jax.analysis.capture.load_trace`).
      configs: preset names (run at the trace's head dim, :func:`kernel_for`) or KernelConfigs.
      num_sinks, min_keys: as :func:`~pcast_jax.analysis.heads.sink_statistics`.
      mass_limit: zeroed attention mass a head may lose (verdicts, safe scale), in (0, 1).
      logits_fn: optional ``logits_fn(config) -> [B, T, V]`` logits of the model on
        ``trace.tokens`` with every attention through ``config`` (``None``: exact FP32); given,
        the end-to-end metrics are computed (needs ``trace.tokens``).
      progress: optional ``(line) -> None`` called with one line per stage.

    Returns:
      :class:`Analysis`.
    """
    if not isinstance(trace, Trace):
        raise PcastError(f"trace must be a Trace (Recorder.trace() or load_trace), got {type(trace).__name__}")
    if isinstance(configs, (str, KernelConfig)) or not len(configs):
        raise PcastError("configs must be a non-empty list of preset names or KernelConfigs")
    mass_limit = check_f32("mass_limit", mass_limit, positive=True)
    if mass_limit >= 1:
        raise PcastError(f"mass_limit={mass_limit} must be below 1 (a share of the attention mass)")
    min_keys = check_int("min_keys", min_keys, min_value=1)
    head_dim = trace.q.shape[-1]
    kernels = tuple(kernel_for(c, head_dim) for c in configs)
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise PcastError(f"configs must have distinct names; got {names}")
    if logits_fn is not None and trace.tokens is None:
        raise PcastError("logits_fn needs the trace's tokens (Recorder.trace(tokens=...))")
    say = progress or (lambda _line: None)
    start = time.perf_counter()
    per_seq_stats, per_seq_heads = [], []
    n_seq = trace.num_sequences
    for b in range(n_seq):
        q, k, v = trace.sequence(b)
        say(f"sequence {b + 1}/{n_seq}: sink statistics ({trace.num_layers} layers, {q.shape[1]} tokens)")
        st = sink_statistics(q, k, num_sinks=num_sinks, min_keys=min(min_keys, q.shape[1]))
        done = iter(range(1, len(kernels) + 1))

        def config_line(name, b=b, done=done):
            say(f"sequence {b + 1}/{n_seq}: config {next(done)}/{len(kernels)} {name} "
                f"({time.perf_counter() - start:.1f} s)")

        per_seq_heads.append(analyze_trace((q, k, v), kernels, st["sink_positions"], min_keys=min_keys,
                                           progress=config_line))
        per_seq_stats.append(st)
    stats = {name: np.stack([s[name] for s in per_seq_stats]) for name in per_seq_stats[0]}
    heads = {name: np.stack([h[name] for h in per_seq_heads], axis=1) for name in per_seq_heads[0]}
    if not np.isfinite(heads["zeroed_mass"]).any():
        raise PcastError(f"no head has a query row that sees its sink and min_keys={min_keys} other keys: "
                         "record more tokens or lower min_keys")
    seconds = time.perf_counter() - start
    e2e = fp32 = None
    if logits_fn is not None:
        e2e = {}
        say("end to end: FP32")
        ref = logits_fn(None)
        fp32 = compare_logits(ref, ref, trace.tokens, lengths=trace.lengths)
        for i, cfg in enumerate(kernels):
            say(f"end to end: config {i + 1}/{len(kernels)} {cfg.name}")
            e2e[cfg.name] = compare_logits(ref, logits_fn(cfg), trace.tokens, lengths=trace.lengths)
    return Analysis(layers=trace.layers, configs=kernels, lengths=trace.lengths, stats=stats, heads=heads,
                    mass_limit=mass_limit, e2e=e2e, e2e_fp32=fp32, seconds=seconds)
