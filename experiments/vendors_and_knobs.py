"""Every vendor's FP8 attention and every P knob — our own analysis, beyond the paper.

Three studies on the paper's synthetic sink workload (N(0, 1) logits, four token sinks at the front,
Q/K/V in FP32 so the P-cast is isolated; expected MSE, which averages V out):

1. **Every preset of the registry at Table 3's operating point** (N, q_len, d, k_sink of Table 3,
   Δ = 7 and 10), grouped by kernel family (:data:`pcast_jax.presets.FAMILIES`): zeroed fraction of
   non-sink P, zeroed and clipped mass, MSE relative to the exact output's mean square, and a verdict
   on the doctor's criterion (:mod:`pcast_jax.criterion`'s worst-Δ pooling, :data:`~pcast_jax.criterion.MASS_LIMIT`)
   decided with its standard error over seeds
   (:func:`verdict`). A preset the workload cannot run is listed with the reason.
2. **The new scale axes against Δ**: aiter's tile-amax scale at its BLOCK_M (128), at one tile of the
   call's rows and per row (``block_q = 1``), beside the per-row power-of-two ``dynamic_pow2``, the
   local-max control (``tpu_ragged_paged_fp8p``, ``p_offset="block_max"``), ``fa3`` and the unscaled
   AMD FlashAttention path; the paired costs of the tile's cross-row sharing (tile / per-row) and of
   its non-power-of-two scale (per-row amax / per-row 2^k); closed forms where one exists.
3. **The INT8 / UINT8 diffuse-row collapse**: rows of N equal logits through ``tensorrt_int8`` and
   ``litert_uint8`` (P normalised before the cast) for N across the vanishing length, beside
   :func:`pcast_jax.theory.diffuse_row_gain` and :func:`pcast_jax.theory.diffuse_row_vanishing_length`.

The MSE relative to the exact output is a paired ratio on the same seeds: the config's MSE over the
MSE of :data:`ZERO_OUTPUT`, a config whose cast zeroes every P, so that its output is 0 and its MSE
is the exact output's mean square σ_V² Σ_j W_j² (averaged over query rows).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pcast_jax import report, theory
from pcast_jax.config import KernelConfig
from pcast_jax.criterion import CLIPPED_MASS_LIMIT, ZEROED_MASS_LIMIT, over_limit, worst_delta
from pcast_jax.errors import PcastError
from pcast_jax.metrics import expected_is_exact
from pcast_jax.presets import FAMILIES, PRESETS, TAGS, get_preset, preset_for
from pcast_jax.stats import fmt_pm, mean_sem, paired_ratio, z_value
from pcast_jax.sweep import SweepResult, SweepSpec, run_sweep

from .common import FULL as PAPER_SIZES
from .table3_kernels import DELTAS as TABLE3_DELTAS

__all__ = ["NAME", "TITLE", "FILES", "Sizes", "FULL", "QUICK", "ZERO_OUTPUT", "axes", "DIFFUSE_PRESETS",
           "verdict", "vendors_and_knobs_section"]

NAME = "vendors_and_knobs"
TITLE = "Every vendor's FP8 attention and every P knob (our own analysis, beyond the paper)"
FILES = {
    f"{NAME}_presets.csv": "every preset of the registry by family at Table 3's operating point (Δ = 7 and 10): "
                           "zeroed fraction of non-sink P, zeroed and clipped mass, MSE / exact output's mean "
                           "square (paired ± s.e.), the verdict on the doctor's mass criterion, or why it did not run",
    f"{NAME}_presets.png": "zeroed mass of every preset at Δ = 7 and 10, by family, the criterion's line",
    f"{NAME}_axes.csv": "the scale axes per (config, Δ): zeroed fraction and relative MSE ± s.e., the closed form "
                        "where one exists, the paired costs of tile-amax's cross-row sharing and non-power-of-two "
                        "scale",
    f"{NAME}_axes.png": "zeroed fraction and relative MSE vs Δ: tile-amax (three query tiles), dynamic 2^k, local "
                        "max, FA3, AMD's unscaled path; closed forms dashed",
    f"{NAME}_diffuse.csv": "rows of N equal logits through the INT8 / UINT8 presets: simulated gain and zeroed "
                           "fraction, the closed form's gain, the vanishing length, the online-P gain",
    f"{NAME}_diffuse.png": "output gain of a diffuse row vs N, simulation and closed form, vanishing lengths marked",
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Sizes of the three studies; the workload (q_len, d, k_sink) is Table 3's.

    Attributes:
      seeds: seeds per (config, Δ) of studies 1 and 2 (Table 3 runs 1,024).
      n: KV length N of studies 1 and 2 (Table 3's first).
      deltas: the Δ grid of study 2.
      diffuse_ns: the row lengths of study 3.
    """

    seeds: int
    n: int
    deltas: tuple
    diffuse_ns: tuple
    q_len: int = PAPER_SIZES.q_len
    d: int = PAPER_SIZES.d
    k_sink: int = PAPER_SIZES.k_sink


#: Every row length across both vanishing lengths (254 and 512), then a few beyond.
_DIFFUSE_NS = (*range(1, 641), 768, 1024, 2048)
FULL = Sizes(seeds=PAPER_SIZES.seeds_table3, n=PAPER_SIZES.ns_table3[0],
             deltas=tuple(float(x) for x in range(0, 15)), diffuse_ns=_DIFFUSE_NS)
QUICK = Sizes(seeds=256, n=PAPER_SIZES.ns_table3[0], deltas=(0.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0,
                                                            14.0), diffuse_ns=_DIFFUSE_NS)

#: A config whose cast zeroes every P (S = 2^-100: P·S is below every format's smallest step), so its
#: output is 0 and its MSE the exact output's mean square: the denominator of the relative MSE.
ZERO_OUTPUT = KernelConfig(scale=2.0**-100, name="zero_output")

_TILE, _TILE_ROWS, _TILE_ROW = "aiter_mha_fp8_mi355", "aiter_mi355_tile_rows", "aiter_mi355_per_row"
_POW2, _LOCAL, _FA3, _AMD = "dynamic_pow2", "tpu_ragged_paged_fp8p", "fa3", "fa_triton_amd_mi355"


def axes(sz: "Sizes") -> tuple[tuple[str, KernelConfig, str], ...]:
    """Study 2's configs at the workload's head dim and query rows: (label, config, what it shows)."""
    tile = preset_for(_TILE, sz.d)
    return (
        ("tile-amax, BLOCK_M = 128 (aiter MI355)", tile, "the preset: one scale per 128 × 64 tile"),
        ("tile-amax, one tile of the rows", tile.replace(block_q=sz.q_len, name=_TILE_ROWS),
         "one scale shared by every real row of a KV block, no padding rows"),
        ("tile-amax per row (block_q = 1)", tile.replace(block_q=1, name=_TILE_ROW),
         "a per-row, non-power-of-two amax scale"),
        ("dynamic 2^k per row", preset_for(_POW2, sz.d), "a per-row power-of-two scale (§7.4)"),
        ("local max (TPU ragged paged, FP8 P)", preset_for(_LOCAL, sz.d),
         "P against each block's own max: the collapse-free control"),
        ("FA3 (reverse, S = 256)", preset_for(_FA3, sz.d), "the paper's best kernel"),
        ("AMD FA Triton, MI355 (forward, S = 1)", preset_for(_AMD, sz.d), "no P scale at all"),
    )


#: Study 3's presets: the fixed-point P formats of a normalised softmax.
DIFFUSE_PRESETS = ("tensorrt_int8", "litert_uint8")


def _run(spec: SweepSpec, out: Path, tag: str, quick: bool) -> SweepResult:
    folder = out / "sweeps" / (("quick-" if quick else "") + f"{NAME}-{tag}-{spec.fingerprint()[:8]}")
    return run_sweep(spec, out_dir=folder, progress=False)


def _spec(sz: Sizes, configs, deltas, *, sampled: bool = False) -> SweepSpec:
    return SweepSpec(configs=(ZERO_OUTPUT, *configs), deltas=deltas, ns=(sz.n,), seeds=sz.seeds, q_len=sz.q_len,
                     d=sz.d, k_sink=sz.k_sink, sampled_mse=sampled)


def _mse_metric(cfg) -> str:
    """``mse_expected`` where it has the sampled MSE's mean (an FP32 accumulator), else the sampled ``mse``."""
    return "mse_expected" if expected_is_exact(cfg) else "mse"


def _dtag(delta: float) -> str:
    return f"d{delta:g}"


# --------------------------------------------------------------------------------------------
# 1. Every preset at Table 3's operating point
# --------------------------------------------------------------------------------------------

def verdict(zeroed: list[tuple[float, float]], clipped: list[tuple[float, float]], seeds: int) -> str:
    """The doctor's criterion on one preset's (mean, s.e.) zeroed and clipped mass at each Δ.

    ``"fails: zeroes"`` / ``"fails: clips"`` (or both) when some mass is decidedly above its limit
    (:data:`~pcast_jax.criterion.ZEROED_MASS_LIMIT`, :data:`~pcast_jax.criterion.CLIPPED_MASS_LIMIT`),
    ``"passes"`` when every one is decidedly below it, else ``"within noise at n seeds"``; each comparison
    :func:`pcast_jax.criterion.over_limit` with z the 95 % Student-t quantile at ``seeds`` − 1 degrees of freedom.
    """
    z = z_value(seeds)
    over_z = [over_limit(m, se, ZEROED_MASS_LIMIT, z) for m, se in zeroed]
    over_c = [over_limit(m, se, CLIPPED_MASS_LIMIT, z) for m, se in clipped]
    failed = [word for word, over in (("zeroes", over_z), ("clips", over_c)) if worst_delta(over)]
    if failed:
        return "fails: " + " and ".join(failed)
    if worst_delta(over_z + over_c) is False:
        return "passes"
    return f"within noise at {seeds} seeds"


def _workload_note(cfg: KernelConfig, sz: Sizes) -> str:
    """What of a preset this workload does not exercise, or how it meets it."""
    notes = []
    if cfg.sink_mode != "epilogue" or cfg.sink_prescale != "exp2":
        notes.append(f"its learned-sink placement ({cfg.sink_mode}, prescale {cfg.sink_prescale}) does not act: "
                     "token sinks only")
    if cfg.block_q > sz.q_len:
        notes.append(f"block_q = {cfg.block_q} > {sz.q_len} rows: one tile padded with zero-Q rows, whose P = 1 "
                     + ("makes every tile's amax 1 (S = the format's max)" if cfg.scale_mode == "tile_amax" else
                        "does not block a skip"))
    if cfg.p_offset == "row_lse":
        notes.append("P normalised before the cast: order and tile do not act")
    if cfg.kv_splits > 1:
        notes.append(f"{cfg.kv_splits} {cfg.split_layout} KV splits")
    if not expected_is_exact(cfg):
        notes.append("accumulator error the expected MSE does not see: sampled MSE, from a sweep drawing V on the "
                     "same seeds")
    return "; ".join(notes) or "none"


def _presets_study(sz: Sizes, out: Path, quick: bool) -> list[dict]:
    """One row per preset of the registry, by family; a preset the workload refuses says why."""
    configs = {name: preset_for(name, sz.d) for name in PRESETS}  # each kernel's tile at the head dim
    ran, not_run = [], {}
    for name, cfg in configs.items():
        try:
            _spec(sz, (cfg,), TABLE3_DELTAS)
            ran.append(cfg)
        except PcastError as exc:
            not_run[name] = str(exc)
    results: dict[str, SweepResult] = {}
    for sampled in (False, True):
        group = tuple(c for c in ran if expected_is_exact(c) != sampled)
        if group:
            res = _run(_spec(sz, group, TABLE3_DELTAS, sampled=sampled), out, "presets" + "-v" * sampled, quick)
            results.update(dict.fromkeys((c.name for c in group), res))
    rows = []
    for family, names in FAMILIES.items():
        for name in names:
            cfg = configs[name]
            row = {"family": family, "preset": name, "tag": TAGS[name], "n": sz.n, "seeds": sz.seeds,
                   "describe": cfg.describe(), "block_kv": cfg.block_kv}
            if name in not_run:
                row.update(ran=False, not_run=not_run[name], workload_note="n/a: not run",
                           verdict=f"not run: {not_run[name]}")
                rows.append(row)
                continue
            res, metric = results[name], _mse_metric(cfg)
            row.update(ran=True, not_run="no: it ran", workload_note=_workload_note(cfg, sz), mse_metric=metric)
            zeroed, clipped = [], []
            for delta in TABLE3_DELTAS:
                t = _dtag(delta)
                get = {k: res.get(k, config=name, n=sz.n, delta=delta) for k in
                       ("frac_zeroed", "zeroed_mass", "saturated_mass")}
                row[f"frac_zeroed_{t}"], row[f"frac_zeroed_sem_{t}"] = mean_sem(get["frac_zeroed"])
                row[f"zeroed_mass_{t}"], row[f"zeroed_mass_sem_{t}"] = mean_sem(get["zeroed_mass"])
                row[f"clipped_mass_{t}"], row[f"clipped_mass_sem_{t}"] = mean_sem(get["saturated_mass"])
                row[f"rel_mse_{t}"], row[f"rel_mse_sem_{t}"] = paired_ratio(
                    res.get(metric, config=name, n=sz.n, delta=delta),
                    res.get(metric, config=ZERO_OUTPUT.name, n=sz.n, delta=delta))
                zeroed.append((row[f"zeroed_mass_{t}"], row[f"zeroed_mass_sem_{t}"]))
                clipped.append((row[f"clipped_mass_{t}"], row[f"clipped_mass_sem_{t}"]))
            row["verdict_z"] = z_value(sz.seeds)
            row["verdict"] = verdict(zeroed, clipped, sz.seeds)
            rows.append(row)
    keys = [k for r in rows if r["ran"] for k in r]
    for row in rows:  # a row that did not run says so in every column it has no number for
        if not row["ran"]:
            for key in keys:
                row.setdefault(key, "n/a: not run")
    return rows


# --------------------------------------------------------------------------------------------
# 2. The scale axes against Δ
# --------------------------------------------------------------------------------------------

def _axes_theory(cfg: KernelConfig, delta: float, sz: Sizes) -> float | str:
    """The closed form of a study-2 config's zeroed fraction, or why there is none."""
    if cfg.p_offset == "block_max" or (cfg.order == "reverse" and cfg.kv_splits == 1):
        # only the sink's own KV block takes P against the sink's max (Thm. 4's sink-block leak)
        return float(theory.sink_block_collapse_fraction(delta, cfg.effective_scale, n=sz.n, block_kv=cfg.block_kv,
                                                         k_sink=sz.k_sink, fmt=cfg.p_format))
    if cfg.scale_mode == "tile_amax" and cfg.block_q > sz.q_len:  # padded tile: amax 1, S = the format's max
        return float(theory.collapse_fraction_spread(delta, cfg.fmt.max, k_sink=sz.k_sink, fmt=cfg.p_format))
    if cfg.scale_mode == "multiply" and cfg.order == "forward":
        return float(theory.collapse_fraction_spread(delta, cfg.scale, k_sink=sz.k_sink, fmt=cfg.p_format))
    return "n/a: no closed form (a scale computed from each block's P)"


def _axes_study(sz: Sizes, out: Path, quick: bool) -> list[dict]:
    studied = axes(sz)
    res = _run(_spec(sz, tuple(c for _, c, _ in studied), sz.deltas), out, "axes", quick)

    def mse(name, delta):
        return res.get("mse_expected", config=name, n=sz.n, delta=delta)

    rows = []
    for label, cfg, shows in studied:
        for delta in sz.deltas:
            fz, fz_se = mean_sem(res.get("frac_zeroed", config=cfg.name, n=sz.n, delta=delta))
            zm, zm_se = mean_sem(res.get("zeroed_mass", config=cfg.name, n=sz.n, delta=delta))
            rel, rel_se = paired_ratio(mse(cfg.name, delta), mse(ZERO_OUTPUT.name, delta))
            rows.append({"label": label, "config": cfg.name, "shows": shows, "describe": cfg.describe(),
                         "block_kv": cfg.block_kv, "block_q": cfg.block_q, "delta": delta, "n": sz.n,
                         "seeds": sz.seeds, "frac_zeroed": fz, "frac_zeroed_sem": fz_se, "zeroed_mass": zm,
                         "zeroed_mass_sem": zm_se, "rel_mse": rel, "rel_mse_sem": rel_se,
                         "theory_frac_zeroed": _axes_theory(cfg, delta, sz)})
    # the two costs, paired on the same seeds: cross-row sharing (tile / per row), non-power-of-two (amax / 2^k)
    costs = {"sharing_cost": ((_TILE, _TILE_ROWS), _TILE_ROW), "pow2_cost": ((_TILE_ROW,), _POW2)}
    for row in rows:
        for key, (nums, den) in costs.items():
            if row["config"] in nums:
                row[key], row[key + "_sem"] = paired_ratio(mse(row["config"], row["delta"]), mse(den, row["delta"]))
            else:
                row[key] = row[key + "_sem"] = f"n/a: {' and '.join(nums)} only"
    return rows


# --------------------------------------------------------------------------------------------
# 3. The diffuse-row collapse of the fixed-point P formats
# --------------------------------------------------------------------------------------------

def _diffuse_study(sz: Sizes) -> list[dict]:
    """Rows of N equal logits (V = 1, so the output is the row's gain) through each INT8 / UINT8 preset."""
    from pcast_jax import engine

    ns = np.asarray(sz.diffuse_ns)
    width = int(ns.max())
    scores = np.where(np.arange(width)[None, :] < ns[:, None], 0.25, -np.inf).astype(np.float32)
    ones = np.ones((width, 1), np.float32)
    rows = []
    for name in DIFFUSE_PRESETS:
        cfg = get_preset(name)
        sim = engine.attention(scores, ones, cfg)
        online = engine.attention(scores, ones, cfg.replace(p_offset="running_max", name=f"{name}_online"))
        gain = np.asarray(theory.diffuse_row_gain(ns, cfg.scale, fmt=cfg.p_format))
        vanish = int(theory.diffuse_row_vanishing_length(cfg.scale, fmt=cfg.p_format))
        for i, n in enumerate(ns):
            rows.append({"preset": name, "p_format": cfg.p_format, "scale": cfg.scale, "n": int(n),
                         "gain": float(np.asarray(sim.out)[i, 0]), "theory_gain": float(gain[i]),
                         "frac_zeroed": float(np.asarray(sim.n_zeroed)[i]) / int(n),
                         "vanishing_length": vanish, "past_vanishing_length": bool(n >= vanish),
                         "online_gain": float(np.asarray(online.out)[i, 0])})
    return rows


# --------------------------------------------------------------------------------------------
# Figures, findings, the section
# --------------------------------------------------------------------------------------------

_COLORS = ("#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b")


def _presets_figure(rows: list[dict], path: Path) -> None:
    ran = [r for r in rows if r["ran"]]
    fig, ax = report.new_figure(figsize=(11.0, 4.8))
    x = np.arange(len(ran))
    floor = 1e-7  # a zeroed mass of 0 drawn at the axis' floor
    for j, (delta, marker) in enumerate(zip(TABLE3_DELTAS, ("o", "s"))):
        t = _dtag(delta)
        ax.plot(x + 0.15 * (j - 0.5), [max(r[f"zeroed_mass_{t}"], floor) for r in ran], marker, ls="none", ms=5,
                label=f"Δ = {delta:g}")
    ax.axhline(ZEROED_MASS_LIMIT, color="k", ls="--", lw=0.9, label=f"criterion ({ZEROED_MASS_LIMIT:g})")
    edges = [i for i in range(1, len(ran)) if ran[i]["family"] != ran[i - 1]["family"]]
    for e in edges:
        ax.axvline(e - 0.5, color="0.8", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 30.0)
    ax.set_xticks(x)
    ax.set_xticklabels([r["preset"] for r in ran], rotation=90, fontsize=6.5)
    ax.set_ylabel("zeroed mass (0 drawn at 1e-7)")
    ax.set_title(f"Every preset at Table 3's operating point (N = {ran[0]['n']}), by family", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    report.save_figure(fig, path)


def _axes_figure(rows: list[dict], path: Path) -> None:
    fig, (left, right) = report.new_figure(ncols=2, figsize=(11.0, 4.4))
    labels = dict.fromkeys((r["config"], r["label"]) for r in rows)
    for (config, label), color in zip(labels, _COLORS):
        sel = [r for r in rows if r["config"] == config]
        xs = [r["delta"] for r in sel]
        left.plot(xs, [100 * r["frac_zeroed"] for r in sel], "o-", ms=3.5, lw=1.2, color=color, label=label)
        right.plot(xs, [r["rel_mse"] for r in sel], "o-", ms=3.5, lw=1.2, color=color, label=label)
        pts = [(r["delta"], r["theory_frac_zeroed"]) for r in sel if not isinstance(r["theory_frac_zeroed"], str)]
        if pts:
            left.plot([p[0] for p in pts], [100 * p[1] for p in pts], "x", ms=5, color="k")
    left.plot([], [], "kx", ms=5, label="closed form")
    left.set_ylabel("non-sink P zeroed (%)")
    right.set_ylabel("MSE / exact output's mean square")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("sink strength Δ")
        ax.grid(alpha=0.3)
    left.legend(fontsize=6.5, loc="upper left")
    fig.suptitle("Scale axes vs Δ: tile-amax, dynamic 2^k, local max, FA3", fontsize=10)
    report.save_figure(fig, path)


def _diffuse_figure(rows: list[dict], path: Path) -> None:
    fig, ax = report.new_figure(figsize=(7.0, 4.2))
    for name, color in zip(DIFFUSE_PRESETS, ("#1f77b4", "#d62728")):
        sel = [r for r in rows if r["preset"] == name]
        ns = [r["n"] for r in sel]
        cfg = get_preset(name)
        dense = np.arange(1, max(ns) + 1)
        ax.plot(ns, [r["gain"] for r in sel], "o", ms=2.5, mfc="none", mew=0.6, color=color,
                label=f"{name}: simulated")
        ax.plot(dense, np.asarray(theory.diffuse_row_gain(dense, cfg.scale, fmt=cfg.p_format)), "-", lw=0.8,
                color=color, label=f"{name}: diffuse_row_gain (every N)")
        ax.axvline(sel[0]["vanishing_length"], color=color, ls=":", lw=1.0)
    ax.set_xscale("log")
    ax.set_xlabel("N (equal logits in the row); dotted: the vanishing length ⌈S / r⌉")
    ax.set_ylabel("output gain g(N, S)")
    ax.set_title("Diffuse row through a normalised INT8 / UINT8 P", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    report.save_figure(fig, path)


def _write_figures(presets, axes, diffuse, out: Path) -> str:
    """The three figures; a line saying why not when matplotlib is missing (the ``plots`` extra)."""
    try:
        _presets_figure(presets, out / f"{NAME}_presets.png")
        _axes_figure(axes, out / f"{NAME}_axes.png")
        _diffuse_figure(diffuse, out / f"{NAME}_diffuse.png")
    except ImportError as exc:
        return f"Figures not drawn: {exc} (install the `plots` extra)."
    return "\n\n".join(f"![{what}]({NAME}_{what}.png)" for what in ("presets", "axes", "diffuse"))


def _at(rows, config, delta):
    return next(r for r in rows if r["config"] == config and r["delta"] == delta)


def _findings(presets: list[dict], axes: list[dict], diffuse: list[dict], sz: Sizes) -> list[str]:
    pct = report.fmt_pct
    ran = [r for r in presets if r["ran"]]
    counts = {v: sum(r["verdict"].startswith(v) for r in ran) for v in ("passes", "fails", "within noise")}
    t7, t10 = (_dtag(d) for d in TABLE3_DELTAS)
    worst = sorted(ran, key=lambda r: -r[f"frac_zeroed_{t7}"])[:4]
    fails7 = sorted({r["family"] for r in ran if r["verdict"].startswith("fails")})
    lines = [
        f"**Every preset at Table 3's operating point.** Of {len(presets)} presets, {len(ran)} ran; "
        f"{counts['passes']} pass the doctor's criterion (zeroed and clipped mass ≤ {ZEROED_MASS_LIMIT:g} at "
        f"Δ = 7 and 10), {counts['fails']} fail, {counts['within noise']} are within noise at {sz.seeds} seeds. "
        f"Failing families: {', '.join(fails7) or 'none'}. Most non-sink P zeroed at Δ = 7: "
        + ", ".join(f"`{r['preset']}` {pct(r[f'frac_zeroed_{t7}'])}" for r in worst) + "."]
    not_run = [r for r in presets if not r["ran"]]
    if not_run:
        lines.append("Not run: " + "; ".join(f"`{r['preset']}` ({r['not_run']})" for r in not_run) + ".")
    big = max(sz.deltas)
    lines.append(
        f"**Tile-amax.** With {sz.q_len} query rows aiter's BLOCK_M = 128 tile is padded with zero-Q rows whose "
        f"P = 1 fixes every tile's amax at 1: its scale is the format's max, a static S = 448, and at Δ = {big:g} "
        f"it zeroes {pct(_at(axes, _TILE, big)['frac_zeroed'])} of non-sink P (closed form Forward S = 448: "
        f"{pct(_at(axes, _TILE, big)['theory_frac_zeroed'])}); one tile of the real rows "
        f"{pct(_at(axes, _TILE_ROWS, big)['frac_zeroed'])}, per row {pct(_at(axes, _TILE_ROW, big)['frac_zeroed'])}, "
        f"dynamic 2^k {pct(_at(axes, _POW2, big)['frac_zeroed'])}.")
    def cost(config, key, pick):
        r = pick((r for r in axes if r["config"] == config), key=lambda r: r[key])
        return f"{fmt_pm(r[key], r[key + '_sem'], 3, '×')} at Δ = {r['delta']:g}"

    d7 = TABLE3_DELTAS[0]
    lines.append(
        f"**What tile-amax costs** (MSE ratios paired on {sz.seeds} seeds). Sharing one scale across the tile's rows, "
        f"against the per-row amax scale: the padded BLOCK_M tile up to {cost(_TILE, 'sharing_cost', max)}, one tile "
        f"of the {sz.q_len} real rows up to {cost(_TILE_ROWS, 'sharing_cost', max)}, "
        f"{fmt_pm(_at(axes, _TILE_ROWS, d7)['sharing_cost'], _at(axes, _TILE_ROWS, d7)['sharing_cost_sem'], 3, '×')} "
        f"at Δ = {d7:g}: under a weak sink a row whose largest P in a block is far below the tile's amax is cast at "
        "a scale another row set. The per-row amax scale not being a power of two, against the per-row 2^k scale: "
        f"from {cost(_TILE_ROW, 'pow2_cost', min)} (448 / amax uses up to a binade a 2^k scale leaves empty) to "
        f"{cost(_TILE_ROW, 'pow2_cost', max)} "
        f"({fmt_pm(_at(axes, _TILE_ROW, d7)['pow2_cost'], _at(axes, _TILE_ROW, d7)['pow2_cost_sem'], 3, '×')} at "
        f"Δ = {d7:g}, about the 7–9 % by which Table 3's S ≈ 448 kernels trail the S = 256 ones).")
    local, fa3 = _at(axes, _LOCAL, big), _at(axes, _FA3, big)
    bound = (local["block_kv"] - sz.k_sink) / (sz.n - sz.k_sink)
    lines.append(
        f"**Local max is the control.** `tpu_ragged_paged_fp8p` zeroes at most "
        f"{pct(max(r['frac_zeroed'] for r in axes if r['config'] == _LOCAL), 3)} over Δ = {min(sz.deltas):g}…"
        f"{big:g}, never above the sink block's share (B − k)/(N − k) = {pct(bound, 2)}: the keys in the sink's own "
        f"KV block (closed form at Δ = {big:g}: {pct(local['theory_frac_zeroed'], 3)}), as in FA3's reverse order "
        f"({pct(fa3['frac_zeroed'], 3)} at Δ = {big:g} of its B = {fa3['block_kv']} block's share "
        f"{pct((fa3['block_kv'] - sz.k_sink) / (sz.n - sz.k_sink), 2)}; closed form "
        f"{pct(fa3['theory_frac_zeroed'], 3)}).")
    parts = []
    for name in DIFFUSE_PRESETS:
        sel = [r for r in diffuse if r["preset"] == name]
        err = max(abs(r["gain"] - r["theory_gain"]) for r in sel)
        first = min((r["n"] for r in sel if r["gain"] == 0), default=None)
        top = max(sel, key=lambda r: r["gain"])
        parts.append(f"`{name}` (S = {sel[0]['scale']:g}) vanishes from N = {sel[0]['vanishing_length']} (simulated "
                     f"gain 0 from N = {first if first is not None else 'none of the grid'}; largest |simulated − "
                     f"closed form| {err:.1e}) and just before it is amplified: gain {top['gain']:.3f} at N = "
                     f"{top['n']}, where S/N rounds up to 1")
    lines.append("**Diffuse rows through an INT8 / UINT8 P.** " + "; ".join(parts) + ". A fused kernel casting the "
                 "unnormalised online P keeps such a row (gain "
                 + ", ".join(f"{r['online_gain']:.4g}" for r in diffuse if r["n"] == max(sz.diffuse_ns)) + ").")
    return lines


def _presets_md(rows: list[dict]) -> str:
    t7, t10 = (_dtag(d) for d in TABLE3_DELTAS)
    md = [{"family": r["family"], "preset": r["preset"], "verdict": r["verdict"],
           **{f"z_{t}": report.fmt_pct_sig(r[f"frac_zeroed_{t}"], r[f"frac_zeroed_sem_{t}"]) for t in (t7, t10)},
           **{f"m_{t}": report.fmt_pct_sig(r[f"zeroed_mass_{t}"], r[f"zeroed_mass_sem_{t}"]) for t in (t7, t10)},
           **{f"c_{t}": report.fmt_pct_sig(r[f"clipped_mass_{t}"], r[f"clipped_mass_sem_{t}"]) for t in (t7, t10)},
           **{f"r_{t}": report.fmt_sci_pm(r[f"rel_mse_{t}"], r[f"rel_mse_sem_{t}"]) for t in (t7,)}} for r in rows]
    cols = [("family", "family"), ("preset", "preset")]
    for t, d in zip((t7, t10), TABLE3_DELTAS):
        cols += [(f"z_{t}", f"zeroed Δ={d:g}"), (f"m_{t}", f"zeroed mass Δ={d:g}"), (f"c_{t}", f"clipped Δ={d:g}")]
    cols += [(f"r_{t7}", "MSE / exact Δ=7"), ("verdict", "verdict")]
    return report.markdown_table(md, cols, name=f"{NAME}_presets")


def _axes_md(rows: list[dict], deltas) -> str:
    md = []
    for config, label in dict.fromkeys((r["config"], r["label"]) for r in rows):
        sel = {r["delta"]: r for r in rows if r["config"] == config}
        md.append({"label": label, **{f"z{d:g}": report.fmt_pct(sel[d]["frac_zeroed"], 2) for d in deltas},
                   **{f"r{d:g}": report.fmt_sci(sel[d]["rel_mse"]) for d in deltas}})
    cols = [("label", "config")] + [(f"z{d:g}", f"zeroed Δ={d:g}") for d in deltas] + \
        [(f"r{d:g}", f"MSE/exact Δ={d:g}") for d in deltas]
    return report.markdown_table(md, cols, name=f"{NAME}_axes")


def vendors_and_knobs_section(out_dir, quick: bool = False, log=None, sizes: Sizes | None = None) -> str:
    """Run the three studies, write their CSV and PNG files into ``out_dir``; return the markdown section."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sz = sizes or (QUICK if quick else FULL)
    say = log or (lambda line: None)
    say("vendors and knobs: every preset at Table 3's operating point")
    presets = _presets_study(sz, out, quick)
    say("vendors and knobs: the scale axes vs delta")
    axes = _axes_study(sz, out, quick)
    say("vendors and knobs: diffuse rows through INT8 / UINT8 P")
    diffuse = _diffuse_study(sz)
    report.write_csv(out / f"{NAME}_presets.csv", presets)
    report.write_csv(out / f"{NAME}_axes.csv", axes)
    report.write_csv(out / f"{NAME}_diffuse.csv", diffuse)
    figures = _write_figures(presets, axes, diffuse, out)
    shown = [d for d in (0.0, 4.0, 7.0, 10.0, max(sz.deltas)) if d in sz.deltas]
    z = z_value(sz.seeds)
    return "\n".join([
        f"## {TITLE}",
        "",
        "Our own analysis, beyond the paper: the presets follow the kernels' sources (`pcast_jax/presets/`, each "
        "citing file and line; assumptions stated there); the closed forms are in `pcast_jax.theory`. Table 3's "
        f"workload (N(0, 1) logits, {sz.k_sink} token sinks, {sz.q_len} query rows, d = {sz.d}, Q/K/V in FP32) at "
        f"N = {sz.n} with {sz.seeds} seeds (Table 3 runs {PAPER_SIZES.seeds_table3}), expected MSE (V averaged out). "
        "\"MSE / exact\" is the paired ratio of a config's MSE to the exact output's mean square (the MSE of a "
        "config whose cast zeroes every P, on the same draws).",
        "",
        "\n\n".join(_findings(presets, axes, diffuse, sz)),
        "",
        figures,
        "",
        f"**Every preset, by family.** Verdict: the doctor's criterion (`pcast doctor`): zeroed and clipped mass "
        f"each ≤ {ZEROED_MASS_LIMIT:g} of the softmax at Δ = 7 and 10, a comparison decided only when the limit lies "
        f"outside mean ± z·s.e. (z = {z:.2f}, the 95 % Student-t quantile at {sz.seeds} seeds), else *within noise*. "
        "Workload notes (what of a preset this workload does not exercise) are in the CSV.",
        "",
        _presets_md(presets),
        "",
        "**The scale axes against Δ** (zeroed fraction of non-sink P, MSE / exact); the CSV has every Δ, the s.e., the "
        "closed forms and the paired costs.",
        "",
        _axes_md(axes, shown),
        "",
        "Data: " + ", ".join(f"[`{f}`]({f})" for f in FILES if f.endswith(".csv")) + ".",
    ])

