"""The markdown report of an :class:`~pcast_jax.analysis.study.Analysis`: words first, then tables and figures.

Written through :mod:`pcast_jax.report` (atomic files; every published cell finite or a reason in
words): ``analysis.md``, ``analysis_configs.csv`` (one row per configuration),
``analysis_heads.csv`` (one row per configuration, sequence, layer and head),
``analysis_layers.png`` (sink mass per layer and head; zeroed mass per layer and configuration).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pcast_jax import report
from pcast_jax import stats as _stats
from pcast_jax.analysis.study import SINK_MASS_MIN, Analysis

__all__ = ["write_report", "NO_ROWS"]

#: What a per-head cell says when the head had no query row to average over.
NO_ROWS = "n/a: no query row sees the sink and min_keys other keys (statistics) or min_keys keys besides it (kernel)"
#: The y floor of the zeroed-mass panel (a mass of 0 is drawn there).
_MASS_FLOOR = 1e-9


def _config_cells(row: dict) -> dict:
    """A configuration row as published: a standard error over fewer than 2 heads says so in words."""
    return {k: (_stats.NO_SE if k.endswith("_sem") and isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def _cells(row: dict) -> dict:
    return {k: (NO_ROWS if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _figure(analysis: Analysis, path: Path) -> Path:
    fig, axes = report.new_figure(ncols=2, figsize=(11.0, 4.8))
    sink_mass = np.nan_to_num(np.nanmean(analysis.stats["sink_mass"], axis=0), nan=0.0)
    im = axes[0].imshow(sink_mass, aspect="auto", cmap="viridis", origin="lower", interpolation="nearest",
                        vmin=0.0, vmax=1.0)
    axes[0].set_xlabel("query head")
    axes[0].set_ylabel("layer")
    axes[0].set_title(f"attention mass on the sink (sink head: ≥ {SINK_MASS_MIN:g})", fontsize=10)
    fig.colorbar(im, ax=axes[0], label="sink mass")
    layers = np.arange(len(analysis.layers))
    mass = analysis.head_mean("zeroed_mass")  # [C, L, H]
    for ci, name in enumerate(analysis.config_names):
        per_layer = np.nan_to_num(np.nanmean(mass[ci], axis=1), nan=0.0)
        axes[1].plot(layers, np.maximum(per_layer, _MASS_FLOOR), marker="o", ms=3, label=name)
    axes[1].axhline(analysis.mass_limit, color="k", ls="--", lw=0.8, label="limit")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel(f"zeroed attention mass (mean over heads; 0 drawn at {_MASS_FLOOR:g})")
    axes[1].set_title("mass the P-cast zeroes, per layer", fontsize=10)
    axes[1].legend(fontsize=7)
    return report.save_figure(fig, path)


def write_report(analysis: Analysis, out_dir, *, title: str = "P-cast analysis") -> Path:
    """Write the report files into ``out_dir``; returns the markdown file's path."""
    out = Path(out_dir)
    rows = [_config_cells(r) for r in analysis.config_rows()]
    report.write_csv(out / "analysis_configs.csv", rows)
    report.write_csv(out / "analysis_heads.csv", [_cells(r) for r in analysis.head_rows()])
    _figure(analysis, out / "analysis_layers.png")
    columns = [("config", "config"), ("verdict", "verdict"),
               ("zeroed_mass_max", "worst head: zeroed mass", report.fmt_sci),
               ("saturated_mass_max", "worst head: clipped mass", report.fmt_sci),
               ("heads_over_limit", "heads failing", str),
               ("zeroed_mass_mean", "zeroed mass (mean over heads)", report.fmt_sci),
               ("frac_zeroed_mean", "non-sink P zeroed", report.fmt_pct),
               ("rel_mse_mean", "relative MSE", report.fmt_sci)]
    if any(c.qkv == "e4m3" for c in analysis.configs):
        columns.append(("rel_mse_qkv_mean", "relative MSE, P in FP32 (Q/K/V quantization alone)", report.fmt_sci))
    extra = [k for k in rows[0] if k.endswith("_mean") and k[:-5] not in
             ("frac_zeroed", "zeroed_mass", "rel_mse", "rel_mse_qkv", "mse")]
    columns += [(k, k[:-5].replace("_", " ") + " (mean)", report.fmt_sci) for k in extra]
    if analysis.e2e is not None:
        columns += [("kl", "KL (nats/token)", report.fmt_sci), ("top1_agree", "top-1 agreement", report.fmt_pct),
                    ("perplexity", "perplexity", lambda x: f"{x:.3f}")]
    scan_rows = [{"kernel": ", ".join(scan.members), "scale": f"{r['scale']:g}", "applied": f"{r['applied_scale']:g}",
                  "knob": (f"{scan.knob_where}: " if scan.knob_where else "") + scan.knob_text(r["scale"]),
                  "zeroed": r["zeroed_mass_max"], "clipped": r["saturated_mass_max"],
                  "failing": r["heads_over_limit"], "meets": "yes" if r["meets"] else "no"}
                 for scan in analysis.scans for r in scan.rows]
    scan_table = (report.markdown_table(scan_rows, [
        ("kernel", "kernel"), ("scale", "scale"), ("applied", "P multiplied by"), ("knob", "as the deployment sets it"),
        ("zeroed", "worst head: zeroed mass", report.fmt_sci), ("clipped", "worst head: clipped mass", report.fmt_sci),
        ("failing", "heads failing", str), ("meets", "meets the criterion")], name="analysis_scales")
        if scan_rows else "No configuration analysed has a static scale.")
    lines = [f"# {title}", "", *analysis.summary_lines(), "",
             "## Per configuration", "",
             analysis.criterion_line() + " Means over heads are beside the worst heads, for reference.", "",
             report.markdown_table(rows, columns, name="analysis_configs"), "",
             "## Safe scale", "",
             "Each kernel family with a static scale, simulated on this trace at scale = 1, 2, 4, … (the smallest "
             "that meets the criterion is the recommendation), each scale also in the knob a deployment sets it "
             "through:", "",
             scan_table, "",
             "## Per layer", "", "![sink mass and zeroed mass per layer](analysis_layers.png)", "",
             f"Per head: `analysis_heads.csv` (a head with no usable query row says `{NO_ROWS}`); per "
             f"configuration: `analysis_configs.csv`. Analysis time {analysis.seconds:.1f} s.", ""]
    return report.write_text(out / "analysis.md", "\n".join(lines))
