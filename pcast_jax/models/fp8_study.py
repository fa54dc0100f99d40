"""The real-model study: what the model report computes on SmolLM2-135M (or any model the loader reads), as plain data.

:func:`run_study` loads the model, records the FP32 model's Q/K/V on the analysis text, measures
the sink statistics, runs every configuration of :class:`ReportSizes` through the kernel
simulator per layer and head, and runs the whole model with each FP8 attention hook on the
held-out text. It returns a :class:`ModelStudy`: the arrays, the end-to-end metrics and the rows
of the report's CSV tables. Rendering (markdown, CSV files, figures) lives in
:mod:`pcast_experiments.model_report`.

Texts (both Python standard-library source, identical on every machine with the same Python):

* analysis text — :func:`pcast_jax.models.stdlib_text_tokens` from offset 0 (``argparse.py``):
  the FP32 model's Q/K/V traces and sink statistics come from it;
* held-out text — :data:`HELDOUT_FILES` (not among :data:`pcast_jax.models.STDLIB_FILES`), used
  only for the end-to-end metrics.

The decode view (:func:`decode_view`): the same traces read as a decode step does — the last
``decode_rows`` query positions, each against the whole KV cache before it (causal, bottom-right
aligned), per layer and head — under each kernel's prefill preset (one Algorithm-1 pass per row)
and its split-KV decode preset (:data:`DECODE_PAIRS`, tiles at the model's head dim). Q/K/V stay
FP32 there: the P-cast alone, as in the per-head analysis.

Each configuration is an :class:`~pcast_jax.models.fp8.FP8Attention` hook; its semantics are its
fields (the config's ``qkv`` and ``qkv_granularity``, ``p_cast``), its name only labels the rows.
Hooks that compute the same thing (equal hooks) are run once; the others point to it
(``same_as``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax.config import COMPUTED_SCALE_MODES, KernelConfig
from pcast_jax.errors import PcastError, check_int
from pcast_jax.models.fp8 import E2EMetrics, FP8Attention
from pcast_jax.presets import get_preset, preset_for, resolve, tagged

__all__ = ["HELDOUT_FILES", "MAX_TOKENS", "SCALES", "DECODE_PAIRS", "DECODE_METRICS", "ReportSizes", "FULL",
           "QUICK", "Stopwatch", "ModelStudy", "run_study", "heldout_tokens", "describe", "safe_ratio",
           "decode_pair_configs", "decode_view"]

#: End-to-end text: standard-library files that the analysis text never reaches.
HELDOUT_FILES = ("textwrap.py", "heapq.py", "fractions.py")
#: Longest sequence: the simulator holds a few [Hq, T, T] float32 arrays per layer (~0.6 GB each
#: at T = 4096).
MAX_TOKENS = 4096
#: The static scales whose theory columns the study computes.
SCALES = (1, 256)
_GRANULARITY_TEXT = {"tensor": "per tensor", "head": "per head"}


def _qkv8(preset: str, granularity: str) -> FP8Attention:
    """``preset`` with E4M3 Q/K/V (labelled ``<preset>+qkv8`` or ``+qkv8h``)."""
    return FP8Attention.from_preset(preset, qkv="e4m3", qkv_granularity=granularity)


def _exact_p(granularity: str, label: str) -> FP8Attention:
    """E4M3 Q/K/V with an exact FP32 softmax: the Q/K/V quantization floor, no P-cast."""
    return FP8Attention(config=KernelConfig(qkv="e4m3", qkv_granularity=granularity, name=label),
                        p_cast=False)


#: The decode view's kernels: (label, prefill preset, decode preset). The decode preset is a preset
#: name or a :class:`KernelConfig`; both take the prefill preset's tile at the model's head dim.
#: The last pair is hypothetical (a forward S = 1 kernel run multi-block): it shows what the
#: split does where the forward collapse is large.
DECODE_PAIRS: tuple[tuple[str, str, str | KernelConfig], ...] = (
    ("TensorRT-LLM XQA", "trtllm_xqa", "trtllm_xqa_multiblock"),
    ("FlashAttention-3", "fa3", "fa3_splitkv"),
    ("Fwd S=1 (hpc-ops prior), 8 strided splits: hypothetical", "hpc_ops_prior",
     get_preset("hpc_ops_prior").replace(kv_splits=8, split_layout="strided", name="hpc_ops_prior_split8s")),
)
#: What :func:`decode_view` returns per config, layer and head.
DECODE_METRICS = ("mse", "ref_sq", "frac_zeroed_row_mean", "zeroed_mass")


# the paper's configurations and the E4M3 kernels (block-scaled P formats are not in this study yet)
_PRESET_HOOKS = tuple(FP8Attention.from_preset(name) for name in (*tagged("paper"), *tagged("table3")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportSizes:
    """What one report run computes.

    Attributes:
      tokens: length of the analysis and the held-out sequence.
      head_configs: hooks of the per-head analysis (every preset, and Fwd S=1 / Rev S=256 with
        per-tensor E4M3 Q/K/V, labelled ``+qkv8``).
      e2e_configs: hooks of the end-to-end run: also E4M3 Q/K/V with one scale per head
        (``+qkv8h``) and FP8 Q/K/V with an exact FP32 softmax, no P-cast (``qkv8_exact_p`` /
        ``qkv8h_exact_p``): the Q/K/V floor.
      decode_rows: decode query rows of the decode view (the last positions of the analysis text).
      decode_pairs: the decode view's (label, prefill preset, decode preset) triples.
    """

    tokens: int = 1024
    head_configs: tuple[FP8Attention, ...] = _PRESET_HOOKS + (_qkv8("fwd_s1", "tensor"),
                                                              _qkv8("rev_s256", "tensor"))
    e2e_configs: tuple[FP8Attention, ...] = _PRESET_HOOKS + (
        _exact_p("tensor", "qkv8_exact_p"), _qkv8("fwd_s1", "tensor"), _qkv8("rev_s256", "tensor"),
        _exact_p("head", "qkv8h_exact_p"), _qkv8("fwd_s1", "head"), _qkv8("rev_s256", "head"))
    decode_rows: int = 32
    decode_pairs: tuple = DECODE_PAIRS


FULL = ReportSizes()
#: ``--quick``: 128 tokens, the two configurations the paper contrasts (and FP8 Q/K/V end to end);
#: the decode view of XQA alone, on the last 8 positions.
QUICK = ReportSizes(tokens=128,
                    head_configs=(FP8Attention.from_preset("fwd_s1"), FP8Attention.from_preset("rev_s256")),
                    e2e_configs=(FP8Attention.from_preset("fwd_s1"), FP8Attention.from_preset("rev_s256"),
                                 _qkv8("fwd_s1", "tensor")),
                    decode_rows=8, decode_pairs=DECODE_PAIRS[:1])


def _dedupe(hooks) -> dict[str, str]:
    """label → label of the first hook equal to it (itself if it is the first)."""
    first: dict[FP8Attention, str] = {}
    return {h.name: first.setdefault(h, h.name) for h in hooks}


def describe(hook: FP8Attention, head_dim: int | None = None) -> str:
    """What a hook computes, in words, from its fields (the kernel at ``head_dim``, then the Q/K/V precision)."""
    cfg = hook.config if head_dim is None else hook.config_for(head_dim)
    qkv = f"E4M3 Q/K/V ({_GRANULARITY_TEXT[cfg.qkv_granularity]})"
    if not hook.p_cast:
        return f"{qkv}, exact FP32 softmax: no P-cast" if cfg.qkv == "e4m3" else "exact FP32 attention"
    kernel = dataclasses.replace(cfg, qkv="f32", causal=False).describe()
    return kernel + (f", {qkv}" if cfg.qkv == "e4m3" else "")


def heldout_tokens(tokenizer, n_tokens: int) -> np.ndarray:
    """The first ``n_tokens`` tokens of :data:`HELDOUT_FILES` (each tokenized on its own)."""
    from pcast_jax.models.text import stdlib_source

    n_tokens = check_int("n_tokens", n_tokens, min_value=2)
    ids: list[int] = []
    for name in HELDOUT_FILES:
        ids.extend(tokenizer.encode(stdlib_source(name)))
        if len(ids) >= n_tokens:
            return np.asarray(ids[:n_tokens], dtype=np.int32)
    raise PcastError(f"tokens={n_tokens} must be <= {len(ids)} (tokens in {', '.join(HELDOUT_FILES)})")


class Stopwatch:
    """Wall and CPU (process) time per stage, and since it was made."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.stages: dict[str, tuple[float, float]] = {}
        self._t0 = time.perf_counter(), time.process_time()

    def stage(self, name: str, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` as the stage ``name`` (logged, timed); returns its result."""
        self.log(f"model-report: {name} …")
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        self.stages[name] = (time.perf_counter() - w, time.process_time() - c)
        return out

    def total(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the stopwatch was made."""
        return time.perf_counter() - self._t0[0], time.process_time() - self._t0[1]


def safe_ratio(a, b) -> float:
    """a / b, NaN unless both are finite and b > 0 (works on NumPy float32 sums too)."""
    a, b = float(a), float(b)
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def decode_pair_configs(pairs, head_dim: int) -> list[tuple[str, KernelConfig, KernelConfig]]:
    """(label, prefill config, decode config) per pair, both with the prefill preset's tile at ``head_dim``.

    A split-KV launch runs the kernel's own tile (:func:`pcast_jax.presets.preset_for`).
    """
    out = []
    for label, prefill, decode in pairs:
        block_kv = preset_for(prefill, head_dim).block_kv
        cfgs = []
        for c in (prefill, decode):
            cfg = resolve(c)
            if cfg.block_kv != block_kv:
                cfg = cfg.replace(block_kv=block_kv, name=cfg.name)
            cfgs.append(cfg)
        out.append((label, *cfgs))
    return out


@functools.partial(jax.jit, static_argnames=("config", "rows"))
def _decode_layer(q, k, v, sink_positions, *, config: KernelConfig, rows: int):
    """One layer's decode view: the last ``rows`` queries of ``q [T, Hq, D]`` against ``k, v [T, Hkv, D]``."""
    from pcast_jax import engine
    from pcast_jax.analysis.heads import scores_and_values

    num_tokens = q.shape[0]
    q_offset = num_tokens - rows
    scores, v_seen = scores_and_values(q[q_offset:], k, v, config)  # [Hq, rows, T], [Hq, T, D]
    positions = jnp.arange(num_tokens)
    counted = ~jnp.any(positions[None, :, None] == sink_positions[:, None, :], axis=-1)  # [Hq, T]
    cfg = config.replace(causal=True)
    res = jax.vmap(lambda s, vh, cm: engine.attention(s, vh, cfg, count_mask=cm, q_offset=q_offset))(
        scores, v_seen, counted)
    ref = engine.reference_attention(scores, v_seen, causal=True, q_offset=q_offset)
    frac = res.n_zeroed / jnp.maximum(res.n_counted, 1).astype(jnp.float32)
    return {"mse": jnp.mean(jnp.square(res.out - ref), axis=(1, 2)), "ref_sq": jnp.mean(jnp.square(ref), axis=(1, 2)),
            "frac_zeroed_row_mean": jnp.mean(frac, axis=-1), "zeroed_mass": jnp.mean(res.zeroed_mass, axis=-1)}


def decode_view(trace, configs, sink_positions, *, rows: int, progress=None) -> dict[str, np.ndarray]:
    """The decode-phase P-cast metrics of a trace: last-position queries against the whole KV cache.

    Args:
      trace: :class:`pcast_jax.models.QKVTrace` of one sequence (``q [L, T, Hq, D]``).
      configs: preset names or :class:`KernelConfig` objects (FP32 Q/K/V: the P-cast alone).
      sink_positions: ``[L, Hq, k]`` from :func:`pcast_jax.models.sink_statistics`; those keys are
        not counted in ``frac_zeroed_row_mean`` / ``zeroed_mass``.
      rows: decode query rows: positions ``T − rows .. T − 1``, each seeing keys ``0 ..`` itself.
      progress: optional callable ``(config_name) -> None`` called before each configuration.

    Returns:
      dict metric → ``[n_configs, L, Hq]`` (keys :data:`DECODE_METRICS`): MSE against exact FP32
      attention and its reference mean square, the fraction of non-sink P zeroed (mean over rows),
      the FP32 probability mass of the zeroed positions (mean over rows).
    """
    q, k, v = (np.asarray(x, np.float32) for x in trace)
    if q.ndim != 4:
        raise PcastError(f"trace.q must be [L, T, Hq, D] (one sequence); got shape {q.shape}")
    rows = check_int("rows", rows, min_value=1, max_value=q.shape[1])
    sink_positions = np.asarray(sink_positions, np.int32)
    if sink_positions.ndim != 3 or sink_positions.shape[:2] != (q.shape[0], q.shape[2]):
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [L, Hq, k] = "
                         f"[{q.shape[0]}, {q.shape[2]}, k]")
    per_config = []
    for config in configs:
        cfg = resolve(config)
        if cfg.qkv != "f32":
            raise PcastError(f"decode_view keeps Q/K/V in FP32; config {cfg.name!r} has qkv={cfg.qkv!r}")
        if progress is not None:
            progress(cfg.name)
        layers = [_decode_layer(q[i], k[i], v[i], sink_positions[i], config=cfg, rows=rows)
                  for i in range(q.shape[0])]
        per_config.append({m: np.stack([np.asarray(x[m]) for x in layers]) for m in DECODE_METRICS})
    return {m: np.stack([pc[m] for pc in per_config]) for m in DECODE_METRICS}


def _theory_columns(stats, tokens: int) -> dict[str, np.ndarray]:
    """Eq. (7) with σ = 1 and with the measured σ, and Thm. 4 at the measured σ, per head."""
    from pcast_jax import theory

    delta = np.asarray(stats["delta"], np.float64)
    sigma = np.asarray(stats["sigma"], np.float64)
    ok = np.isfinite(delta) & np.isfinite(sigma) & (sigma > 0)
    d = np.where(ok, delta, 0.0)
    s = np.where(ok, sigma, 1.0)
    cols = {}
    for scale in SCALES:
        # measured Δ is already max over the sink set minus the non-sink mean (Δ + δk), so k = 1
        cols[f"eq7_sigma1_s{scale}"] = np.asarray(theory.collapse_fraction(d, float(scale), k_sink=1,
                                                                           sigma=1.0))
        cols[f"eq7_sigma_s{scale}"] = np.asarray(theory.collapse_fraction(d, float(scale), k_sink=1,
                                                                          sigma=s))
    # reverse order: a non-sink P is zeroed before the sink block if it is more than
    # 10 ln2 + ln S below the pre-sink running max; rows have on average ~T/2 keys
    n_keys = max(tokens // 2, 3)
    cols["thm4_sigma1_s256"] = np.full(d.shape, float(theory.reverse_underflow_prob(
        n_keys, 256.0, k_sink=1, sigma=1.0, max_model="mean")))
    cols["thm4_sigma_s256"] = np.asarray(theory.reverse_underflow_prob(
        n_keys, 256.0, k_sink=1, sigma=s, max_model="mean"))
    return {k: np.where(ok, v, np.nan) for k, v in cols.items()}


@dataclasses.dataclass
class ModelStudy:
    """Everything :func:`run_study` measured.

    Attributes:
      sizes: what was run.
      model: the model's :class:`~pcast_jax.models.LlamaConfig`.
      stats: :func:`~pcast_jax.models.sink_statistics` of the analysis text (``[L, Hq]`` arrays).
      hooks: label → hook, for every configuration of the per-head and end-to-end runs.
      heads: label → metric → ``[L, Hq]`` per-head P-cast metrics (``HEAD_METRICS``).
      head_alias: label → label of the equal configuration whose numbers it shares.
      fp32: the FP32 model against itself (its perplexity) on the held-out text.
      e2e: label → :class:`~pcast_jax.models.fp8.E2EMetrics` of the model with that hook.
      e2e_alias: as ``head_alias``, for the end-to-end run.
      theory: Eq. (7) and Thm. 4 columns per head (``[L, Hq]`` arrays).
      clock: stage timings.
      decode: the decode view: (label, prefill config, decode config) triples and, per config name,
        metric → ``[L, Hq]`` (:func:`decode_view`).
      token_source: where the tokens came from when the caller gave them (``run_study``'s
        ``token_ids``), in words; empty for the standard-library texts.
    """

    sizes: ReportSizes
    model: object
    stats: dict
    hooks: dict[str, FP8Attention]
    heads: dict[str, dict[str, np.ndarray]]
    head_alias: dict[str, str]
    fp32: E2EMetrics
    e2e: dict[str, E2EMetrics]
    e2e_alias: dict[str, str]
    theory: dict[str, np.ndarray]
    clock: Stopwatch
    decode_pairs: list = dataclasses.field(default_factory=list)
    decode: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
    #: where the analysis and held-out tokens came from (words; empty: the standard-library texts)
    token_source: str = ""

    def is_p_cast_only(self, label: str) -> bool:
        """Whether the configuration keeps Q/K/V in FP32 and simulates the P-cast."""
        hook = self.hooks[label]
        return hook.p_cast and hook.config.qkv == "f32"

    def fixes_p_collapse(self, label: str) -> bool:
        """Whether the configuration's scale is computed from P (dynamic, tile amax) or a static S ≥ 256."""
        cfg = self.hooks[label].config
        return cfg.scale_mode in COMPUTED_SCALE_MODES or cfg.scale >= 256

    def head_rows(self) -> list[dict]:
        """One row per (configuration, layer, head): metrics and the head's sink statistics."""
        stats, rows = self.stats, []
        for name, m in self.heads.items():
            layers, heads = m["mse"].shape
            for layer in range(layers):
                for head in range(heads):
                    rows.append({
                        "config": name, "same_as": self.head_alias[name], "layer": layer, "head": head,
                        "sink_position": int(stats["sink_positions"][layer, head, 0]),
                        "delta": float(stats["delta"][layer, head]),
                        "sigma": float(stats["sigma"][layer, head]),
                        "sink_mass": float(stats["sink_mass"][layer, head]),
                        **{k: float(m[k][layer, head]) for k in ("mse", "ref_sq", "rel_mse", "frac_zeroed",
                                                                "frac_zeroed_row_mean", "zeroed_mass")},
                        "rows_used": int(m["rows_used"][layer, head]),
                    })
        return rows

    def layer_rows(self) -> list[dict]:
        """One row per layer: head means of the sink statistics and every configuration's metrics."""
        stats, heads = self.stats, self.heads
        layers = stats["delta"].shape[0]
        rows = []
        for layer in range(layers):
            row = {"layer": layer, "sink_position": _mode(stats["sink_positions"][layer, :, 0]),
                   "delta": float(np.nanmean(stats["delta"][layer])),
                   "sigma": float(np.nanmean(stats["sigma"][layer])),
                   "sink_mass": float(np.nanmean(stats["sink_mass"][layer]))}
            for name, m in heads.items():
                row[f"rel_mse_{name}"] = float(np.sum(m["mse"][layer]) / np.sum(m["ref_sq"][layer]))
                row[f"mse_{name}"] = float(np.mean(m["mse"][layer]))
                row[f"frac_zeroed_row_mean_{name}"] = float(np.nanmean(m["frac_zeroed_row_mean"][layer]))
                row[f"zeroed_mass_{name}"] = float(np.nanmean(m["zeroed_mass"][layer]))
            for a, b in (("fwd_s1", "rev_s256"), ("fwd_s256", "rev_s256"), ("rev_s1", "rev_s256"),
                         ("fwd_s1+qkv8", "rev_s256+qkv8")):
                if a in heads and b in heads:
                    row[f"ratio_{a}/{b}"] = safe_ratio(np.sum(heads[a]["mse"][layer]),
                                                       np.sum(heads[b]["mse"][layer]))
            rows.append(row)
        return rows

    def theory_rows(self) -> list[dict]:
        """One row per (layer, head): Δ, σ, the theory columns and the measured zeroed fractions."""
        stats, heads, th = self.stats, self.heads, self.theory
        layers, nh = stats["delta"].shape
        rows = []
        for layer in range(layers):
            for head in range(nh):
                row = {"layer": layer, "head": head,
                       "sink_position": int(stats["sink_positions"][layer, head, 0]),
                       "delta": float(stats["delta"][layer, head]),
                       "sigma": float(stats["sigma"][layer, head]),
                       "delta_over_sigma": float(stats["delta_sigma"][layer, head])}
                for scale in SCALES:
                    row[f"eq7_sigma1_s{scale}"] = float(th[f"eq7_sigma1_s{scale}"][layer, head])
                    row[f"eq7_sigma_s{scale}"] = float(th[f"eq7_sigma_s{scale}"][layer, head])
                    row[f"eq6_count_s{scale}"] = float(stats[f"underflow_s{scale}"][layer, head])
                    fwd = f"fwd_s{scale}"
                    if fwd in heads:
                        row[f"measured_{fwd}"] = float(heads[fwd]["frac_zeroed_row_mean"][layer, head])
                row["thm4_sigma1_s256"] = float(th["thm4_sigma1_s256"][layer, head])
                row["thm4_sigma_s256"] = float(th["thm4_sigma_s256"][layer, head])
                for name in ("rev_s1", "rev_s256"):
                    if name in heads:
                        row[f"measured_{name}"] = float(heads[name]["frac_zeroed_row_mean"][layer, head])
                rows.append(row)
        return rows

    def decode_rows(self) -> list[dict]:
        """The decode view, one row per (kernel, phase, layer, head): its metrics and the head's sink."""
        stats, rows = self.stats, []
        for label, prefill, decode in self.decode_pairs:
            for phase, cfg in (("prefill", prefill), ("decode", decode)):
                m = self.decode[cfg.name]
                layers, heads = m["mse"].shape
                for layer in range(layers):
                    for head in range(heads):
                        rows.append({
                            "kernel": label, "phase": phase, "config": cfg.name, "order": cfg.order,
                            "scale": cfg.scale, "block_kv": cfg.block_kv, "kv_splits": cfg.kv_splits,
                            "split_layout": cfg.split_layout if cfg.kv_splits > 1 else "",
                            "layer": layer, "head": head, "decode_rows": self.sizes.decode_rows,
                            "sink_position": int(stats["sink_positions"][layer, head, 0]),
                            "delta": float(stats["delta"][layer, head]),
                            "mse": float(m["mse"][layer, head]), "ref_sq": float(m["ref_sq"][layer, head]),
                            "rel_mse": safe_ratio(m["mse"][layer, head], m["ref_sq"][layer, head]),
                            "frac_zeroed_row_mean": float(m["frac_zeroed_row_mean"][layer, head]),
                            "zeroed_mass": float(m["zeroed_mass"][layer, head]),
                        })
        return rows

    def decode_summary(self) -> list[dict]:
        """Per (kernel, phase): relative MSE over all heads, median and mean fraction of non-sink P
        zeroed, and for the decode phase its ratios to the prefill phase and the share of heads
        where the split zeroes less."""
        out = []
        for label, prefill, decode in self.decode_pairs:
            p, d = self.decode[prefill.name], self.decode[decode.name]
            for phase, cfg, m in (("prefill", prefill, p), ("decode", decode, d)):
                row = {"kernel": label, "phase": phase, "config": cfg.name, "block_kv": cfg.block_kv,
                       "kv_splits": cfg.kv_splits, "split_layout": cfg.split_layout if cfg.kv_splits > 1 else "",
                       "rel_mse": safe_ratio(np.sum(m["mse"]), np.sum(m["ref_sq"])),
                       "median_frac_zeroed_row_mean": float(np.median(m["frac_zeroed_row_mean"])),
                       "mean_frac_zeroed_row_mean": float(np.mean(m["frac_zeroed_row_mean"])),
                       "mean_zeroed_mass": float(np.mean(m["zeroed_mass"]))}
                if phase == "decode":
                    row["mse_ratio_to_prefill"] = safe_ratio(np.sum(d["mse"]), np.sum(p["mse"]))
                    fd, fp = d["frac_zeroed_row_mean"], p["frac_zeroed_row_mean"]
                    row["zeroed_ratio_to_prefill"] = safe_ratio(np.mean(fd), np.mean(fp))
                    row["heads_less_zeroed_frac"] = float(np.mean(fd < fp))
                    row["heads_more_zeroed_frac"] = float(np.mean(fd > fp))
                out.append(row)
        return out

    def e2e_rows(self) -> list[dict]:
        """One row for FP32, then one per end-to-end configuration."""
        fp32 = self.fp32
        rows = [{"config": "fp32", "same_as": "fp32", "description": "exact FP32 attention",
                 "perplexity": fp32.perplexity, "nll": fp32.nll, "kl": 0.0, "kl_max": 0.0,
                 "top1_agree": 1.0, "ppl_change": 0.0}]
        for name, m in self.e2e.items():
            rows.append({"config": name, "same_as": self.e2e_alias[name],
                         "description": describe(self.hooks[name], self.model.head_dim), "perplexity": m.perplexity,
                         "nll": m.nll, "kl": m.kl, "kl_max": m.kl_max,
                         "top1_agree": m.top1_agree, "ppl_change": m.perplexity / fp32.perplexity - 1.0})
        return rows


def _mode(x) -> int:
    """The most frequent value of an integer array."""
    vals, counts = np.unique(np.asarray(x), return_counts=True)
    return int(vals[np.argmax(counts)])


def run_study(sizes: ReportSizes = FULL, *, log: Callable[[str], None] | None = None,
              clock: Stopwatch | None = None, model_path=None, token_ids=None,
              token_source: str = "token_ids") -> ModelStudy:
    """Run the real-model study (needs the model extra).

    Args:
      sizes: the sequence length and the configurations (:data:`FULL`, :data:`QUICK` or your own).
      model_path: the model (a llama or qwen2 GGUF file or Hugging Face checkpoint folder,
        :func:`pcast_jax.models.load_model`); default SmolLM2-135M-Instruct.
      token_ids: optional token ids (a 1-D sequence of at least ``sizes.tokens``) to run on instead
        of the standard-library texts, so no tokenizer is needed: the first ``sizes.tokens`` are the
        analysis text, the next ``sizes.tokens`` (when there are that many, else the same ones) the
        end-to-end text.
      token_source: what ``token_ids`` are, in words (errors and the report name it).
      log: one-line progress messages (default: none).
      clock: times the stages (default: a new :class:`Stopwatch` logging to ``log``).
    """
    from pcast_jax.models import extract_qkv, load_model, load_tokenizer, sink_statistics, stdlib_text_tokens
    from pcast_jax.models.fp8 import analyze_trace, end_to_end

    log = log or (lambda _line: None)
    clock = clock or Stopwatch(log)
    cfg, params = clock.stage("load model", load_model, model_path)
    source = ""
    if token_ids is None:
        tokenizer = load_tokenizer(model_path)
        analysis = stdlib_text_tokens(tokenizer, sizes.tokens)
        heldout = heldout_tokens(tokenizer, sizes.tokens)
    else:
        analysis, heldout, source = _given_tokens(token_ids, token_source, sizes.tokens, cfg.vocab_size)
    _check_full_causal(cfg, int(np.shape(analysis)[-1]))
    trace = clock.stage("FP32 forward + Q/K/V trace", extract_qkv, params, cfg, analysis)
    stats = clock.stage("sink statistics", sink_statistics, *trace, cfg)

    head_hooks = list(sizes.head_configs)
    head_alias = _dedupe(head_hooks)
    unique = [h for h in head_hooks if head_alias[h.name] == h.name]
    per_head = clock.stage(
        f"per-head P-cast metrics ({len(unique)} configurations × {cfg.num_layers} layers)",
        analyze_trace, trace, [h.config_for(cfg.head_dim) for h in unique], stats["sink_positions"],
        progress=lambda n: log(f"model-report:   per-head {n}"))
    index = {h.name: i for i, h in enumerate(unique)}
    heads = {h.name: {m: per_head[m][index[head_alias[h.name]]] for m in per_head} for h in head_hooks}

    e2e_hooks = list(sizes.e2e_configs)
    e2e_alias = _dedupe(e2e_hooks)
    e2e_unique = [h for h in e2e_hooks if e2e_alias[h.name] == h.name]
    fp32, e2e_raw = clock.stage(
        f"end-to-end forwards ({len(e2e_unique)} configurations)", end_to_end, params, cfg,
        heldout, e2e_unique, progress=lambda n: log(f"model-report:   end-to-end {n}"))
    e2e = {h.name: e2e_raw[e2e_alias[h.name]] for h in e2e_hooks}
    hooks = {h.name: h for h in head_hooks + e2e_hooks}

    pairs = decode_pair_configs(sizes.decode_pairs, cfg.head_dim)
    decode_cfgs = list({c.name: c for _, *cs in pairs for c in cs}.values())
    decode = {}
    if decode_cfgs:
        raw = clock.stage(
            f"decode view ({len(decode_cfgs)} configurations, last {sizes.decode_rows} positions)",
            decode_view, trace, decode_cfgs, stats["sink_positions"], rows=sizes.decode_rows,
            progress=lambda n: log(f"model-report:   decode {n}"))
        decode = {c.name: {m: raw[m][i] for m in raw} for i, c in enumerate(decode_cfgs)}
    return ModelStudy(sizes=sizes, model=cfg, stats=stats, hooks=hooks, heads=heads, head_alias=head_alias,
                      fp32=fp32, e2e=e2e, e2e_alias=e2e_alias, theory=_theory_columns(stats, sizes.tokens),
                      clock=clock, decode_pairs=pairs, decode=decode, token_source=source)


def _check_full_causal(cfg, tokens: int) -> None:
    """The study's per-head analysis is of full causal attention without a soft cap or sinks: a model whose
    local windows bind at ``tokens``, or with a logit soft cap or learned sinks, is refused naming the field
    and the way that carries them (a trace recorded through ``Recorder.hook``, analysed by ``pcast analyze``)."""
    binding = [w for w in cfg.layer_windows if 0 <= w < tokens - 1]
    if binding or cfg.attn_softcap or cfg.attn_sinks:
        what = (f"local windows of {sorted(set(binding))[0] + 1} keys at {tokens} tokens (layer_windows)" if binding
                else f"an attention logit soft cap of {cfg.attn_softcap} (attn_softcap)" if cfg.attn_softcap
                else "learned attention sinks (attn_sinks)")
        raise PcastError(f"model-report analyses full causal attention; this {cfg.architecture} model has {what}. "
                         "Record a trace through pcast_jax.analysis.Recorder().hook() (it carries each layer's "
                         "window and soft cap) and run `pcast analyze TRACE --model MODEL`")


def _given_tokens(token_ids, source: str, n: int, vocab_size: int):
    """(analysis, held-out, words) from caller-given ids: the first ``n``, then the next ``n`` or the same."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise PcastError(f"{source}: token ids must be a 1-D sequence of integers, got {ids.dtype} {ids.shape}")
    if len(ids) < n:
        raise PcastError(f"{source}: {len(ids)} token ids, fewer than the {n} tokens asked for (ask for fewer "
                         "tokens or give more ids)")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise PcastError(f"{source}: token id {int(ids.min() if ids.min() < 0 else ids.max())} is outside the "
                         f"model's vocabulary [0, {vocab_size})")
    ids = ids.astype(np.int32)
    if len(ids) >= 2 * n:
        return ids[:n], ids[n:2 * n], f"the first {n} tokens of {source} (end to end: the next {n})"
    return ids[:n], ids[:n], (f"the first {n} tokens of {source} (end to end on the same tokens: {source} holds "
                              f"fewer than {2 * n})")
