"""The report of an :class:`~pcast_jax.analysis.study.Analysis`: words first, then tables and figures.

Written through :mod:`pcast_jax.report` (every published cell finite or a reason in words), as a
set (:func:`pcast_jax.fileio.write_set`: all files or none, an error leaves the previous report as it
was): ``analysis.md``, ``analysis.json`` (:func:`report_data`: the same numbers, machine-readable),
``analysis_configs.csv`` (one row per configuration), ``analysis_heads.csv`` (one row per
configuration, sequence, layer and head), and two figures when matplotlib is installed (the
``plots`` extra; without it everything else is written and the report says which extra to
install): ``analysis_decision.png`` (the worst head's zeroed and clipped mass against each
static-scale kernel's ``scale``, the mass limit drawn) and ``analysis_layers.png`` (sink mass per
layer and head; zeroed mass per layer and configuration).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pcast_jax import fileio, report
from pcast_jax import stats as _stats
from pcast_jax.analysis.study import SINK_MASS_MIN, Analysis
from pcast_jax.criterion import WITHIN_NOISE_ROWS

__all__ = ["write_report", "report_data", "NO_ROWS", "NO_FIGURES", "JSON_FORMAT"]

#: What a per-head cell says when the head had no query row to average over.
NO_ROWS = "n/a: no query row sees the sink and min_keys other keys (statistics) or min_keys keys besides it (kernel)"
#: What the report says when matplotlib is missing (the figures are left out, nothing else).
NO_FIGURES = "figures left out: matplotlib is not installed (pip install 'pcast_jax[plots]')"
#: The ``format`` field of ``analysis.json``.
JSON_FORMAT = "pcast_jax.analysis/1"
#: The y floor of the mass panels (a mass of 0 is drawn there).
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


def _decision_figure(analysis: Analysis, path: Path) -> Path:
    """Per static-scale kernel family: the worst head's zeroed and clipped mass at each ``scale`` its scan
    simulated, the mass limit and the recommended scale drawn."""
    fig, ax = report.new_figure(figsize=(7.0, 4.5))
    for i, scan in enumerate(analysis.scans):
        scales = [r["scale"] for r in scan.rows]
        label = ", ".join(scan.members)
        # each later family thinner, with smaller markers: where two families agree, both stay visible
        width, size = max(3.0 - 0.7 * i, 0.8), max(7.0 - 1.5 * i, 2.5)
        line = ax.plot(scales, [max(r["zeroed_mass_max"], _MASS_FLOOR) for r in scan.rows], marker="o", ms=size,
                       lw=width, label=f"{label}: zeroed")[0]
        ax.plot(scales, [max(r["saturated_mass_max"], _MASS_FLOOR) for r in scan.rows], marker="s", ms=size,
                lw=width, ls="--", color=line.get_color(), label=f"{label}: clipped")
        if scan.recommended is not None:
            ax.axvline(scan.recommended, color=line.get_color(), ls=":", lw=1.0,
                       label=f"{label}: recommended scale = {scan.recommended:g}")
    ax.axhline(analysis.mass_limit, color="k", ls="-", lw=0.8, label=f"mass limit {analysis.mass_limit:g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("the kernel's scale knob S (`scale`; powers of two simulated by the scan)")
    ax.set_ylabel(f"worst head's attention mass (0 drawn at {_MASS_FLOOR:g})")
    ax.set_title("zeroed and clipped mass of the worst head against S", fontsize=10)
    ax.legend(fontsize=7)
    return report.save_figure(fig, path)


def _figures(analysis: Analysis, out: Path) -> list[str]:
    """Write the figures; returns the markdown lines that show them, or say why they are left out."""
    try:
        lines = []
        if analysis.scans:
            _decision_figure(analysis, out / "analysis_decision.png")
            lines += ["![worst head's zeroed and clipped mass against the scale](analysis_decision.png)", ""]
        _figure(analysis, out / "analysis_layers.png")
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise
        return [f"_{NO_FIGURES[0].upper()}{NO_FIGURES[1:]}._", ""]
    return lines + ["![sink mass and zeroed mass per layer](analysis_layers.png)", ""]


def _json_row(row: dict, reason) -> dict:
    """A row with every non-finite number as null and, under ``null_reasons``, why (``reason(key)``)."""
    out, why = {}, {}
    for key, value in row.items():
        value = report.json_value(value)
        if value is None and row[key] is not None:
            why[key] = reason(key)
        out[key] = value
    if why:
        out["null_reasons"] = why
    return out


def _row_reason(key: str) -> str:
    return _stats.NO_SE if key.endswith("_sem") else NO_ROWS


def _scan_row(row: dict) -> dict:
    """A scan row as JSON: its nulls with their reasons, ``meets`` null where the sample's error decides nothing."""
    out = _json_row(row, _row_reason)
    if row["meets"] is None:
        out.setdefault("null_reasons", {})["meets"] = f"{WITHIN_NOISE_ROWS} (the sample's error keeps the limit inside)"
    return out


def report_data(analysis: Analysis) -> dict:
    """The report as plain JSON data, with the numbers of ``analysis.md`` and ``analysis_configs.csv``
    (the same rows, unrounded): the summary in words, the criterion, the verdicts, one row per
    configuration (``block_kv``: the KV tile that ran), the safe-scale scans and their
    recommendations, the end-to-end metrics. A number that is not finite is ``null``, and the object
    holding it says why under ``null_reasons``."""
    sink = analysis.sink_heads()
    configs = []
    for cfg, row in zip(analysis.configs, analysis.config_rows()):
        configs.append(_json_row({**row, "config_spec": cfg.to_string()}, _row_reason))
    scans = []
    for scan in analysis.scans:
        entry = {"members": list(scan.members), "family": scan.family.to_string(), "recommended": scan.recommended,
                 "rows": [_scan_row(r) for r in scan.rows]}
        if scan.within_noise:
            entry["null_reasons"] = {"recommended": f"{WITHIN_NOISE_ROWS} (a candidate below the first that meets the "
                                                   "criterion is within the sample's error)"}
        elif scan.recommended is None:
            entry["null_reasons"] = {"recommended": f"no scale from 1 to {scan.rows[-1]['scale']:g} meets the "
                                                   "criterion"}
        scans.append(entry)
    data = {
        "format": JSON_FORMAT,
        "summary": [line for line in analysis.summary_lines() if line],
        "criterion": {"text": analysis.criterion_line(), "mass_limit": analysis.mass_limit, "statistic": "worst head",
                      "quantities": ["zeroed_mass_max", "saturated_mass_max"],
                      "per_head": "mean over the head's query rows, then over sequences"},
        "verdicts": {row["config"]: row["verdict"] for row in configs},
        "safe_scale": {scan["members"][0]: scan["recommended"] for scan in scans},
        "trace": {"layers": list(analysis.layers), "lengths": [int(n) for n in analysis.lengths],
                  "heads": int(sink.shape[1]), "sink_heads": int(sink.sum()), "sink_mass_min": SINK_MASS_MIN,
                  "local_window_size": [-1] * len(analysis.layers) if analysis.local_window_size is None
                  else [int(w) for w in analysis.local_window_size],
                  "logits_soft_cap": [0.0] * len(analysis.layers) if analysis.logits_soft_cap is None
                  else [float(c) for c in analysis.logits_soft_cap]},
        "configs": configs,
        "scans": scans,
        "end_to_end_fp32": None if analysis.e2e_fp32 is None else _json_row(analysis.e2e_fp32._asdict(), _row_reason),
        "seconds": analysis.seconds,
    }
    if analysis.e2e_fp32 is None:
        data["null_reasons"] = {"end_to_end_fp32": "no model was given (end-to-end metrics need it)"}
    return data


def write_report(analysis: Analysis, out_dir, *, title: str = "P-cast analysis", what: str = "out_dir") -> Path:
    """Write the report files into ``out_dir`` as a set (all or none; ``what`` names the folder in an
    error); returns the markdown file's path."""
    out = fileio.write_set(out_dir, lambda staging: _write_files(analysis, staging, title), what=what)
    return out / "analysis.md"


def _write_files(analysis: Analysis, out: Path, title: str) -> None:
    rows = [_config_cells(r) for r in analysis.config_rows()]
    report.write_csv(out / "analysis_configs.csv", rows)
    report.write_csv(out / "analysis_heads.csv", [_cells(r) for r in analysis.head_rows()])
    report.write_json(out / "analysis.json", report_data(analysis))
    figures = _figures(analysis, out)
    columns = [("config", "config"), ("block_kv", "KV tile B", str), ("verdict", "verdict"),
               ("zeroed_mass_max", "worst head: zeroed mass", report.fmt_sci),
               ("saturated_mass_max", "worst head: clipped mass", report.fmt_sci),
               *([("zeroed_mass_max_sem", "± s.e. (zeroed)", report.fmt_sci),
                  ("saturated_mass_max_sem", "± s.e. (clipped)", report.fmt_sci)] if analysis.rows is not None else []),
               ("heads_over_limit", "heads failing", str),
               ("zeroed_mass_mean", "zeroed mass (mean over heads)", report.fmt_sci),
               ("frac_zeroed_row_mean_mean", "non-sink P zeroed (mean of per-row fractions)", report.fmt_pct),
               ("rel_mse_mean", "relative MSE", report.fmt_sci)]
    if any(c.qkv == "e4m3" for c in analysis.configs):
        columns.append(("rel_mse_qkv_mean", "relative MSE, P in FP32 (Q/K/V quantization alone)", report.fmt_sci))
    extra = [k for k in rows[0] if k.endswith("_mean") and k[:-5] not in
             ("frac_zeroed_row_mean", "zeroed_mass", "rel_mse", "rel_mse_qkv", "mse")]
    columns += [(k, k[:-5].replace("_", " ") + " (mean)", report.fmt_sci) for k in extra]
    if analysis.e2e is not None:
        columns += [("kl", "KL (nats/token)", report.fmt_sci), ("top1_agree", "top-1 agreement", report.fmt_pct),
                    ("perplexity", "perplexity", lambda x: f"{x:.3f}")]
    scan_rows = [{"kernel": ", ".join(scan.members), "scale": f"{r['scale']:g}", "applied": f"{r['applied_scale']:g}",
                  "knob": (f"{scan.knob_where}: " if scan.knob_where else "") + scan.knob_text(r["scale"]),
                  "zeroed": r["zeroed_mass_max"], "clipped": r["saturated_mass_max"],
                  "failing": r["heads_over_limit"],
                  "meets": "within noise" if r["meets"] is None else "yes" if r["meets"] else "no"}
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
             "## Figures", "", *figures,
             f"Per head: `analysis_heads.csv` (a head with no usable query row says `{NO_ROWS}`); per "
             f"configuration: `analysis_configs.csv`; everything, machine-readable: `analysis.json`. Analysis time "
             f"{analysis.seconds:.1f} s.", ""]
    report.write_text(out / "analysis.md", "\n".join(lines))
