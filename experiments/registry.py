"""The list of experiments, and the driver that runs them and writes the report folder.

``reproduce(out_dir)`` runs every experiment (or a subset) in the paper's order, then writes
``report.md`` (summary of what reproduces, each table with the paper beside ours, each figure),
one CSV per table plus ``findings.csv``, one PNG per figure, and ``run.json`` (sizes, every
SweepSpec, seeds, library versions, wall and CPU time per experiment and per sweep).
"""

from __future__ import annotations

import datetime as _dt
import importlib
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from pcast_jax import report
from pcast_jax.errors import PcastError

from .common import Context, Section

__all__ = ["EXPERIMENTS", "reproduce", "FILE_DESCRIPTIONS"]

#: Experiment name → module (relative to this package), in the paper's order.
EXPERIMENTS: dict[str, str] = {
    "table1": ".table1",
    "table2": ".table2",
    "figure1_dp": ".figure1_dp",
    "figure2_delta": ".figure2_delta",
    "figure3_n": ".figure3_n",
    "appendix_a": ".appendix_a",
    "appendix_b": ".appendix_b",
    "table3_kernels": ".table3_kernels",
}

#: Studies beyond the paper, appended after its tables and figures on a full run (not with --only).
#: Each entry: name → (module relative to this package, function); the function takes
#: (out_dir, quick=..., log=...) and returns the section's markdown (a ``##`` heading first),
#: writing its own CSV/PNG files, which the module describes in its ``FILES`` dict (file → what it holds).
#: An ImportError (an optional extra missing) skips the section with a note saying how to install it.
EXTRA_SECTIONS: dict[str, tuple[str, str]] = {
    "real_model": (".model_report", "model_section"),
    "whatif": (".whatif_report", "whatif_section"),
    "formats": (".formats_report", "formats_section"),
    "mma_accumulation": (".mma_accumulation", "mma_section"),
    "sinks_and_rescale": (".sinks_and_rescale", "sinks_and_rescale_section"),
    "vendors_and_knobs": (".vendors_and_knobs", "vendors_and_knobs_section"),
}
DEFAULT_EXTRAS = ("real_model",)

#: What each file of the report folder holds (also written into report.md).
FILE_DESCRIPTIONS: dict[str, str] = {
    "report.md": "this report",
    "findings.csv": "the summary table: each checked claim, the paper's value, ours, verdict",
    "table1.csv": "Table 1 per Δ: frac. zeroed S=1/S=256, non-sink mass, info loss (ours, paper, "
                  "difference), Eq. (7) and its spread-integrated form, exact zeroed mass; all fractions in "
                  "[0, 1] (columns *_frac)",
    "table2.csv": "Table 2 per (config, N): empirical MSE and mse_expected with standard errors, the paper's "
                  "MSE, ours/paper ratios, ±15% flags",
    "table2_ratios.csv": "Table 2's ratio row per N: Fwd S=1 / best of the other four (empirical and expected), "
                         "the best config, the paper's ratio and ours/paper",
    "figure1_dp.csv": "dp(S) on Figure 1's grid (S, dp, power of two?, overflow?)",
    "figure1_dp.png": "Figure 1, the dp(S) sawtooth",
    "figure2_delta.csv": "Figure 2 per (config, Δ): MSE ± s.e., expected MSE, frac. zeroed, zeroed mass, "
                         "non-sink mass",
    "figure2_delta.png": "Figure 2, MSE vs Δ with the diagnostic panel",
    "figure3_n.csv": "Figure 3 per (config, N): MSE ± s.e., expected MSE, frac. zeroed, non-sink mass, "
                     "Fwd S=1 / Fwd S=256 improvement, the paper's Table 2 MSE where it has one",
    "figure3_n.png": "Figure 3, MSE vs N (log-log)",
    "appendix_a.csv": "Appendix A: dp(S) for 2^k and the paper's examples, ours vs paper; normal coverage 2^-6/S",
    "appendix_b.csv": "Appendix B per (Δ, N): MSE of Fwd/Rev S=256, mean paired difference (and as a "
                      "fraction of the MSE, relative_diff_frac), t, p, significance, the paper's values",
    "table3_kernels.csv": "Table 3 per (kernel, phase, N): the prefill preset and the decode (split-KV) preset "
                          "or why there is none, order, S, tile B and its source, splits; fraction zeroed "
                          "(*_frac) and MSE ± s.e. at Δ = 7 and 10, zeroed vs one forward pass and MSE / best "
                          "(paired ratios ± s.e.), the scale-penalty decision; the paper's verdict, ours (or "
                          "\"within noise at n seeds\"), and the finding where they differ",
    "table3_xqa_subseq.csv": "Table 3's XQA decode row at each nbSubSeq (CTAs per request and KV head): the "
                             "launches that give it on 132 SMs, zeroed fractions, paired ratios ± s.e., verdict",
    "run.json": "exact configuration: sizes, every SweepSpec (as a dict) with its fingerprint and folder, "
                "seeds, library versions, devices, wall and CPU time per experiment and per sweep",
    "sweeps/": "the sweep engine's folders (spec.json, chunks/, results.npz, summary.csv): a rerun "
               "resumes from them; delete them (or pass --fresh) to recompute",
}

_VERDICT_MARK = {"yes": "✓ reproduces", "partly": "~ partly", "no": "✗ does not"}
PAPER_TITLE = ("P-Cast Precision in FP8 Attention: Sink-Induced Collapse and the Optimality of S = 2^8 "
               "(R. Lau, arXiv:2606.06521)")


def _load(name: str):
    if name not in EXPERIMENTS:
        raise PcastError(f"experiment={name!r} is not one of {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name], __package__)


def _select(only: Sequence[str] | None) -> list[str]:
    if not only:
        return list(EXPERIMENTS)
    names = []
    for item in only:
        for name in str(item).split(","):
            name = name.strip()
            if name:
                _load(name)
                if name not in names:
                    names.append(name)
    if not names:
        raise PcastError("only= names no experiment")
    return [n for n in EXPERIMENTS if n in names]


def _clear_sweeps(out: Path, quick: bool) -> None:
    """Remove this mode's sweep folders (those holding a spec.json) under ``out/sweeps``."""
    root = out / "sweeps"
    if not root.is_dir():
        return
    for d in root.iterdir():
        if d.is_dir() and (d / "spec.json").exists() and d.name.startswith("quick-") == quick:
            shutil.rmtree(d)


def reproduce(out_dir, *, quick: bool = False, only: Sequence[str] | None = None,
              progress: bool | None = None, fresh: bool = False,
              extras: Sequence[str] | None = None,
              log: Callable[[str], None] = print) -> Path:
    """Run the experiments and write the report folder; returns the path of ``report.md``.

    Args:
      out_dir: report folder (created). Sweep chunks are kept in ``out_dir/sweeps`` and reused.
      quick: reduced seeds and sizes (:data:`pcast_experiments.common.QUICK`).
      only: experiment names (default all, in the paper's order).
      progress: the sweep engine's progress bar (None: when stderr is a terminal).
      fresh: delete this mode's sweep folders first, recomputing everything.
      extras: names from :data:`EXTRA_SECTIONS` (studies beyond the paper) appended after the
        experiments, with ``only`` and ``quick`` too (None: :data:`DEFAULT_EXTRAS` on a full run, none
        with ``only`` or ``quick``; the what-if section adds about two minutes on 2 cores, so it is
        opt-in); they run at their reduced sizes here (``pcast model-report`` and ``pcast whatif
        report`` give the full ones).
      log: receives one line per finished experiment.
    """
    import jax

    names = _select(only)
    if extras is None:
        extras = () if (only or quick) else DEFAULT_EXTRAS
    for name in extras:
        if name not in EXTRA_SECTIONS:
            raise PcastError(f"extras={name!r} is not one of {', '.join(EXTRA_SECTIONS)}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PcastError(f"out={str(out)!r} cannot be created: {exc.strerror or exc}") from None
    if fresh:
        _clear_sweeps(out, quick)
    ctx = Context(out, quick=quick, progress=progress, log=log)
    started = _dt.datetime.now(_dt.timezone.utc)
    t_all, c_all = time.perf_counter(), time.process_time()
    log(f"pcast reproduce: {'QUICK (reduced sizes)' if quick else 'full paper sizes'}, "
        f"{len(names)} experiment(s) → {out}/ on {jax.device_count()} {jax.default_backend()} device(s)")
    sections: list[Section] = []
    timings: dict[str, dict] = {}
    for i, name in enumerate(names, 1):
        mod = _load(name)
        before = set(ctx.sweep_log)
        t0, c0 = time.perf_counter(), time.process_time()
        ctx.current = name
        section = mod.run(ctx)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        sections.append(section)
        timings[name] = {"title": section.title, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                         "sweeps_used": sorted(ctx.uses.get(name, ())),
                         "sweeps_computed": sorted(set(ctx.sweep_log) - before)}
        log(f"[{i}/{len(names)}] {section.title:<66} {wall:6.1f} s")
    extra_md, extra_files, descriptions = [], [], dict(FILE_DESCRIPTIONS)
    if extras:
        for name in extras:
            module, func = EXTRA_SECTIONS[name]
            t0, c0 = time.perf_counter(), time.process_time()
            before = _file_stamps(out)
            try:
                mod = importlib.import_module(module, __package__)
                md = getattr(mod, func)(out, quick=True, log=log)
                descriptions.update(getattr(mod, "FILES", {}))
            except ImportError as exc:
                md = f"## {name.replace('_', ' ').capitalize()}\n\nSkipped: {exc}\n"
            wall = time.perf_counter() - t0
            extra_md.append(md)
            timings[name] = {"title": md.splitlines()[0].lstrip("# ").strip(), "wall_s": round(wall, 3),
                             "cpu_s": round(time.process_time() - c0, 3), "sweeps_used": [],
                             "sweeps_computed": [], "files": _changed_files(out, before)}
            extra_files += [f for f in timings[name]["files"] if f not in extra_files]
            log(f"[extra] {timings[name]['title']:<64} {wall:6.1f} s")
    t_write = time.perf_counter()
    files = _write_outputs(out, ctx, sections) + extra_files
    write_s = time.perf_counter() - t_write
    total = time.perf_counter() - t_all
    meta = {
        "command": "pcast reproduce" + (" --quick" if quick else "") + (f" --only {','.join(names)}" if only else ""),
        "argv": sys.argv,
        "paper": PAPER_TITLE,
        "mode": "quick" if quick else "full",
        "started_utc": started.isoformat(timespec="seconds"),
        "wall_s_total": round(total, 3),
        "cpu_s_total": round(time.process_time() - c_all, 3),
        "wall_s_writing_report": round(write_s, 3),
        "experiments": timings,
        "sizes": ctx.sizes.to_dict(),
        "sweeps": ctx.sweep_log,
        "versions": report.library_versions(),
        "devices": [str(d) for d in jax.devices()],
        "files": files,
    }
    report.write_json(out / "run.json", meta)
    _write_markdown(out, ctx, sections, meta, extra_md, descriptions)
    log(f"done in {total:.1f} s. Report: {out / 'report.md'}")
    return out / "report.md"


def _file_stamps(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}


def _changed_files(out: Path, before: dict[str, int]) -> list[str]:
    """Files of ``out`` written since ``before`` (an extra section's CSV and PNG files)."""
    return sorted(name for name, stamp in _file_stamps(out).items() if before.get(name) != stamp)


def _write_outputs(out: Path, ctx: Context, sections: list[Section]) -> list[str]:
    files = []
    for sec in sections:
        for tab in sec.tables:
            report.write_csv(out / f"{tab.csv}.csv", tab.rows, tidy=True)
            files.append(f"{tab.csv}.csv")
        for fig in sec.figures:
            report.save_figure(fig.figure, out / f"{fig.png}.png")
            files.append(f"{fig.png}.png")
    findings = [{"experiment": sec.name, "claim": f.claim, "paper": f.paper, "ours": f.ours,
                 "verdict": f.verdict} for sec in sections for f in sec.findings]
    report.write_csv(out / "findings.csv", findings, ["experiment", "claim", "paper", "ours", "verdict"])
    files.append("findings.csv")
    return files


def _write_markdown(out: Path, ctx: Context, sections: list[Section], meta: dict,
                    extra_md: Sequence[str] = (), descriptions: dict[str, str] = FILE_DESCRIPTIONS) -> None:
    v = meta["versions"]
    lines = [f"# Reproduction: {PAPER_TITLE}", ""]
    if ctx.quick:
        lines += ["> **QUICK MODE** — reduced seeds and sequence lengths (see `run.json` → `sizes`). "
                  "Numbers are noisier and some columns of the paper are not run; verdicts below are "
                  "for this reduced run. Run `pcast reproduce` without `--quick` for the paper's sizes.", ""]
    resumed = [k for k, sw in meta["sweeps"].items() if sw.get("resumed_from_disk")]
    reuse = (f"; {len(resumed)} of {len(meta['sweeps'])} sweeps resumed from an earlier run's chunks in "
             "`sweeps/`" if resumed else "")
    lines += [f"Generated by `{meta['command']}` on {meta['started_utc']} in {meta['wall_s_total']:.1f} s "
              f"wall ({meta['cpu_s_total']:.1f} s CPU{reuse}) on {', '.join(meta['devices'])}; jax {v.get('jax')}, "
              f"numpy {v.get('numpy')}, ml_dtypes {v.get('ml_dtypes')}, Python {v.get('python')}. "
              "Every number below is in the CSV files beside this report; the exact configuration of every "
              "sweep is in `run.json`. All simulations keep Q, K, V in FP32 (the paper's isolation of the "
              "P-cast), B = 64 unless a kernel preset says otherwise.", ""]
    findings = [(sec, f) for sec in sections for f in sec.findings]
    counts = {k: sum(f.verdict == k for _, f in findings) for k in ("yes", "partly", "no")}
    lines += ["## Summary — what reproduces and what does not", "",
              f"{counts['yes']} of {len(findings)} checked claims reproduce, {counts['partly']} partly, "
              f"{counts['no']} do not. Each verdict uses the tolerance stated in its section.", ""]
    rows = [{"v": _VERDICT_MARK[f.verdict], "claim": f"{f.claim} ([§](#{_anchor(sec.title)}))",
             "paper": f.paper, "ours": f.ours} for sec, f in findings]
    lines += [report.markdown_table(rows, [("v", "verdict"), ("claim", "claim"), ("paper", "paper"),
                                           ("ours", "ours")], align="llll", name="findings"), ""]
    for sec in sections:
        lines += [f"## {sec.title}", "", sec.intro, ""]
        for fig in sec.figures:
            lines += [f"![{sec.title}]({fig.png}.png)", "", f"*{fig.caption}*", ""]
        for tab in sec.tables:
            if tab.columns:
                if tab.caption:
                    lines += [tab.caption, ""]
                for part in tab.parts or ():
                    lines += [part.caption, "", report.markdown_table(part.rows, part.columns, name=tab.csv), ""]
                if not tab.parts:
                    lines += [report.markdown_table(tab.md_rows if tab.md_rows is not None else tab.rows,
                                                    tab.columns, name=tab.csv), ""]
            lines += [f"Data: [`{tab.csv}.csv`]({tab.csv}.csv)", ""]
        if sec.notes:
            lines += [f"- {n}" for n in sec.notes] + [""]
        t = meta["experiments"].get(sec.name, {})
        if t:
            lines += [f"<sub>{sec.name}: {t['wall_s']:.1f} s wall; sweeps: "
                      f"{', '.join(t['sweeps_used']) or 'none (closed forms)'}</sub>", ""]
    if extra_md:
        lines += ["---", "", "*Studies beyond the paper: what it could not do.*", ""]
        lines += [md.strip() + "\n" for md in extra_md]
    lines += ["## Files", ""]
    lines += [f"- `{name}` — {desc}" for name, desc in descriptions.items()
              if name in ("report.md", "run.json", "sweeps/", "findings.csv") or name in meta["files"]]
    lines.append("")
    report.write_text(out / "report.md", "\n".join(lines))


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    out = []
    for ch in title.lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)
