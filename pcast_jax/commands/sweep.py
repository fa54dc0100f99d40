"""``pcast sweep``: run a seed × Δ × N × config sweep and print the means (± standard error).

Every chunk lands on disk as it finishes (``--out``, by default ``sweeps/<fingerprint>`` under the
current directory), so an interrupted sweep resumes where it stopped when the same command is run
again.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

from pcast_jax.commands import _options
from pcast_jax.commands._distributed import (
    MAX_INIT_TIMEOUT_S,
    add_distributed_arguments,
    failing_together,
    init_from_args,
    supervise,
    wants_distributed,
)
from pcast_jax.errors import PcastError
from pcast_jax.stats import summary_cells

DEFAULT_CONFIGS = "fwd_s1,rev_s1,fwd_s448,fwd_s256,rev_s256"
#: (metric, column title, multiplier, format) of the printed table.
COLUMNS = (
    ("mse", "MSE", 1.0, "{:.3e} ± {:.1e}"),
    ("mse_expected", "MSE (V-averaged)", 1.0, "{:.3e} ± {:.1e}"),
    ("frac_zeroed", "frac. zeroed %", 100.0, "{:.2f} ± {:.2f}"),
    ("nonsink_mass", "non-sink mass %", 100.0, "{:.2f} ± {:.2f}"),
)
#: --format choices.
FORMATS = ("table", "csv", "json", "md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options.add_kernel_arguments(parser, default_configs=DEFAULT_CONFIGS)
    parser.add_argument("--delta", default="7", help=f"sink strengths Δ: {_options.RANGE_HELP} (default 7)")
    parser.add_argument("--n", default="4096", help=f"KV lengths N: {_options.RANGE_HELP} (default 4096)")
    parser.add_argument("--seeds", default="20", help="seeds per (N, Δ) (default 20)")
    parser.add_argument("--seed-offset", default="0", help="index of the first seed (default 0)")
    parser.add_argument("--base-seed", default="0", help="root PRNG seed (default 0)")
    parser.add_argument("--q-len", default="32", help="query rows per instance (default 32)")
    parser.add_argument("--d", default="128", help="head dimension of V (default 128)")
    parser.add_argument("--k-sink", default="4", help="number of sink tokens at the start (default 4)")
    parser.add_argument("--sink-positions", default=None,
                        help="explicit sink positions, e.g. 0,1,2,3,2048 (overrides --k-sink)")
    parser.add_argument("--sigma", default="1", help="standard deviation σ of the non-sink scores (default 1)")
    parser.add_argument("--sigma-v", default="1", help="standard deviation of the V entries (default 1)")
    parser.add_argument("--sink-logit", default=None,
                        help="a learned sink (one logit, no value row) above the non-sink mean: a number, or 'delta' "
                             "to sweep it as Δ (with --k-sink 0); placed as each config's sink_mode says")
    parser.add_argument("--implementation", default="xla",
                        help="what computes the simulated kernel: xla (vectorized, default) or scan (block by block)")
    parser.add_argument("--micro-batch", default="auto",
                        help="seeds per vmapped step of the compiled chunk (default auto: 1 on CPU, one seed at a "
                             "time; on a GPU or TPU the largest power of two whose instances take 1/8 of the "
                             "device's memory, at most 256; part of the results' identity)")
    parser.add_argument("--chunk-size", default=None,
                        help="seeds per compiled call (default: as many as the memory budget allows)")
    parser.add_argument("--no-expected-mse", action="store_true",
                        help="skip the V-averaged mse_expected metric")
    parser.add_argument("--no-sampled-mse", action="store_true",
                        help="draw no V and skip the sampled-V mse (about 3x the instances/s; mse_expected has "
                             "the same mean with lower variance; --implementation xla only)")
    parser.add_argument("--metrics", default=None,
                        help=f"comma-separated metrics to print (default {','.join(DEFAULT_METRICS)}, "
                             "mse_expected for mse without sampled V; "
                             "any of the sweep's metrics)")
    parser.add_argument("--format", default="table", choices=FORMATS,
                        help="printed output: an aligned table, csv, json or a markdown table (default table); "
                             "with csv/json/md only the data goes to stdout")
    parser.add_argument("--out", default=None,
                        help="output folder (default sweeps/<fingerprint> under the current directory); "
                             "rerunning into the same folder resumes")
    _options.add_progress_argument(parser)
    add_distributed_arguments(parser)


# --------------------------------------------------------------------------------------------
# Option parsing: every error names the option (shared with the other commands: _options).
# --------------------------------------------------------------------------------------------

_int = _options.integer
_float = _options.number
_items = _options.items


def parse_deltas(text: str, option: str = "--delta") -> tuple[float, ...]:
    """``"7"``, ``"5,7,9"`` or ``"start:stop:step"`` (stop included) → Δ values."""
    return _options.floats(option, text)


def spec_from_args(args: argparse.Namespace, *, backend_ready: bool = True):
    """The :class:`~pcast_jax.sweep.SweepSpec` the options describe.

    ``backend_ready=False`` (a multi-process run before its runtime starts: no JAX backend may be
    touched yet) checks every option but puts 1 for ``--micro-batch auto``; the spec is built again
    once the runtime runs.
    """
    from pcast_jax.engine import IMPLEMENTATIONS
    from pcast_jax.sweep import SweepSpec
    from pcast_jax.workloads import SIGMA_MAX, SIGMA_V_MAX

    configs = tuple(_options.kernels_from_args(args, default_configs=DEFAULT_CONFIGS))
    implementation = str(args.implementation).strip()
    if implementation not in IMPLEMENTATIONS:
        raise PcastError(f"--implementation={args.implementation!r} must be one of {', '.join(IMPLEMENTATIONS)}")
    if args.no_sampled_mse and implementation != "xla":
        raise PcastError(f"--no-sampled-mse takes every metric from the xla implementation's weights; "
                         f"--implementation={implementation} needs V (use --implementation xla)")
    ns = _options.ints("--n", args.n, min_value=1)
    sink_positions = None
    if args.sink_positions is not None:
        sink_positions = tuple(_int("--sink-positions", t, min_value=0)
                               for t in _items("--sink-positions", args.sink_positions))
        for n in ns:
            bad = [p for p in sink_positions if p >= n]
            if bad:
                raise PcastError(f"--sink-positions: {bad} not below N={n} (positions must lie in [0, N))")
    k_sink = _int("--k-sink", args.k_sink, min_value=0)
    if sink_positions is None and k_sink > min(ns):
        raise PcastError(f"--k-sink={k_sink} exceeds the smallest N={min(ns)}")
    return SweepSpec(
        configs=configs,
        deltas=parse_deltas(args.delta),
        ns=ns,
        seeds=_int("--seeds", args.seeds, min_value=1),
        seed_offset=_int("--seed-offset", args.seed_offset, min_value=0),
        base_seed=_int("--base-seed", args.base_seed, min_value=0),
        q_len=_int("--q-len", args.q_len, min_value=1),
        d=_int("--d", args.d, min_value=1),
        k_sink=k_sink,
        sink_positions=sink_positions,
        sigma=_float("--sigma", args.sigma, positive=True, max_abs=SIGMA_MAX),
        sigma_v=_float("--sigma-v", args.sigma_v, positive=True, max_abs=SIGMA_V_MAX),
        implementation=implementation,
        expected_mse=not args.no_expected_mse,
        sampled_mse=not args.no_sampled_mse,
        micro_batch=(None if backend_ready else 1) if args.micro_batch.strip() == "auto" else _int(
            "--micro-batch", args.micro_batch, min_value=1),
        sink_logit=_sink_logit(args.sink_logit),
    )


def _sink_logit(text: str | None):
    """``--sink-logit``: None, ``"delta"`` or a finite number."""
    if text is None or text.strip() == "delta":
        return None if text is None else "delta"
    return _float("--sink-logit", text)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


#: Printed when --metrics is not given: the sampled MSE, or the V-averaged one when V is not sampled.
DEFAULT_METRICS = ("mse", "frac_zeroed", "nonsink_mass")


def parse_metrics(text: str | None, spec=None) -> tuple[str, ...]:
    """``--metrics``: the sweep metrics to print (default :data:`DEFAULT_METRICS`).

    With ``spec``, a metric the sweep does not compute is refused (it would print NaN), and the
    default's ``mse`` becomes ``mse_expected`` for a sweep without sampled V.
    """
    from pcast_jax.metrics import METRICS

    off = {}
    if spec is not None:
        if not spec.sampled_mse:
            off["mse"] = "--no-sampled-mse"
        if not spec.expected_mse:
            off["mse_expected"] = "--no-expected-mse"
    if text is None:
        swap = {"mse": "mse_expected"} if "mse" in off else {}
        return tuple(m for m in (swap.get(m, m) for m in DEFAULT_METRICS) if m not in off)
    chosen = tuple(_items("--metrics", text))
    for m in chosen:
        if m not in METRICS:
            raise PcastError(f"--metrics: {m!r} is not a sweep metric; choose from {', '.join(METRICS)}")
        if m in off:
            raise PcastError(f"--metrics: {m!r} is not computed with {off[m]}")
    return chosen


def _column(metric: str):
    return next((c for c in COLUMNS if c[0] == metric), (metric, metric, 1.0, "{:.3e} ± {:.1e}"))


def summary_rows(result, metrics: tuple[str, ...] | None = None) -> list[dict]:
    """One dict per (N, config, Δ): the seed count and ``{metric}_mean`` / ``{metric}_sem`` (fractions as such)."""
    metrics = parse_metrics(None, result.spec) if metrics is None else metrics
    spec = result.spec
    rows = []
    for n in spec.ns:
        for c in spec.config_names:
            for delta in spec.deltas:
                row = {"n": n, "config": c, "delta": delta, "seeds": spec.seeds}
                for m in metrics:  # one seed has no standard error: None (JSON null, an empty CSV cell)
                    row[f"{m}_mean"], row[f"{m}_sem"] = summary_cells(result.get(m, config=c, n=n, delta=delta))
                rows.append(row)
    return rows


def _cell(fmt: str, mean: float | None, err: float | None, mult: float) -> str:
    """``mean ± err`` in ``fmt``; ``± n/a`` when there is no standard error (one seed)."""
    if mean is None:
        return "n/a"
    if err is None:
        return fmt.split(" ± ")[0].format(mean * mult) + " ± n/a"
    return fmt.format(mean * mult, err * mult)


def format_table(result, metrics: tuple[str, ...] | None = None) -> list[str]:
    """One line per (N, config, Δ): mean ± standard error of each metric (default MSE, frac. zeroed, non-sink mass)."""
    cols = [_column(m) for m in (parse_metrics(None, result.spec) if metrics is None else metrics)]
    head = ["N", "config", "delta"] + [title for _, title, _, _ in cols]
    rows = []
    for r in summary_rows(result, tuple(c[0] for c in cols)):
        cells = [str(r["n"]), r["config"], f"{r['delta']:g}"]
        for metric, _, mult, fmt in cols:
            cells.append(_cell(fmt, r[f"{metric}_mean"], r[f"{metric}_sem"], mult))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    align = [">", "<", ">"] + [">"] * len(cols)

    def line(cells):
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)).rstrip()

    return [line(head)] + [line(r) for r in rows]


def format_rows(result, metrics: tuple[str, ...], fmt: str) -> list[str]:
    """The summary as ``fmt`` (``table``, ``csv``, ``json`` or ``md``), one string per output line.

    CSV and JSON hold the raw numbers (fractions stay fractions); the markdown table shows them
    like the aligned table.
    """
    if fmt == "table":
        return format_table(result, metrics)
    rows = summary_rows(result, metrics)
    if fmt == "json":
        from pcast_jax import report

        return [json.dumps([{k: report.json_value(v) for k, v in r.items()} for r in rows], indent=1)]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().splitlines()
    from pcast_jax import report

    cols = [("n", "N"), ("config", "config"), ("delta", "Δ", lambda x: f"{x:g}")]
    for metric, title, mult, f in (_column(m) for m in metrics):
        cols.append((metric, title, lambda r, _m=metric, _k=mult, _f=f: _cell(_f, r[f"{_m}_mean"], r[f"{_m}_sem"], _k)))
    md_rows = [{**r, **{m: r for m in metrics}} for r in rows]
    return report.markdown_table(md_rows, cols, align="rlr" + "r" * len(metrics)).splitlines()


class _Printer:
    """Prints lines until the output is closed (``| head``); after that the work goes on silently.

    A closed pipe must never skip the sweep: results are still computed and written to disk.
    """

    def __init__(self):
        self.closed = False

    def __call__(self, line: str = "", *, flush: bool = False) -> None:
        if self.closed:
            return
        try:
            print(line, flush=flush)
        except BrokenPipeError:
            self.closed = True
            try:  # the interpreter's final flush of the dead pipe must not fail either
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass


def _nondefault(spec) -> str:
    """The run-shaping options the banner names when they are not at their defaults."""
    return (("" if spec.micro_batch == 1 else f", micro_batch={spec.micro_batch}")
            + ("" if spec.sampled_mse else ", no sampled V"))


def run(args: argparse.Namespace) -> int:
    from pcast_jax.sweep import run_sweep

    distributed = wants_distributed(args)
    spec = spec_from_args(args, backend_ready=not distributed)  # every option is checked before any work
    metrics = parse_metrics(args.metrics, spec)
    fmt = args.format
    chunk_size = None if args.chunk_size is None else _int("--chunk-size", args.chunk_size, min_value=1)
    if args.out is not None and not str(args.out).strip():
        raise PcastError(f"--out={args.out!r} must name a folder (it would write into the current one)")
    for option in ("init_timeout", "heartbeat_timeout"):
        if getattr(args, option, None) is not None:
            _float(f"--{option.replace('_', '-')}", getattr(args, option), positive=True,
                   max_abs=MAX_INIT_TIMEOUT_S)
    out = Path(args.out) if args.out is not None else Path("sweeps") / spec.fingerprint()
    say = _Printer()
    note = say if fmt == "table" else (lambda line="", **kw: print(line, file=sys.stderr, **kw))
    resuming = (out / "spec.json").exists()
    tty = sys.stderr.isatty()
    # A multi-process run works in a child process, so that a native end of JAX's runtime (a lost
    # process or coordinator) still ends with one line; this process relays it and exits.
    supervisor = supervise(args) if distributed else None
    info = init_from_args(args, supervisor=supervisor)  # None unless a multi-process run was asked for
    if distributed:  # --micro-batch auto asks the backend, which only the running runtime may start
        spec = spec_from_args(args)
        out = Path(args.out) if args.out is not None else Path("sweeps") / spec.fingerprint()
        resuming = (out / "spec.json").exists()
    with failing_together(info):  # an error only this process has ends it at once, and so the others
        if info is not None and info.process_id != 0:  # every process computes; process 0 reports
            run_sweep(spec, out, chunk_size=chunk_size, progress=False)
            return 0
        if resuming:  # a folder that would be refused is refused before the banner says it resumes
            from pcast_jax.sweep.store import check_dir

            check_dir(out, spec)
        where = "" if info is None else f" on {info.num_processes} processes ({info.global_devices} devices)"
        note(f"pcast sweep: {len(spec.configs)} configs x {len(spec.deltas)} delta x {len(spec.ns)} N x "
              f"{spec.seeds} seeds (q_len={spec.q_len}, d={spec.d}, k_sink={spec.k_sink}, "
             f"{'' if spec.sink_logit is None else f'sink_logit={spec.sink_logit}, '}sigma={spec.sigma:g}, "
              f"implementation={spec.implementation}{_nondefault(spec)}){where}"
              f"{' - resuming' if resuming else ''}", flush=True)
        start = time.perf_counter()
        progress = args.progress
        if progress is None and info is not None:  # stderr is a pipe now: ask the terminal this process had
            progress = tty
        result = run_sweep(spec, out, chunk_size=chunk_size, progress=progress)
        elapsed = time.perf_counter() - start
        for line in format_rows(result, metrics, fmt):
            say(line)
        instances = len(spec.ns) * spec.seeds
        note(f"{instances} instances x {len(spec.deltas)} delta x {len(spec.configs)} configs in {elapsed:.1f} s; "
              f"mean ± standard error over {spec.seeds} seeds")
        note(f"results: {out / 'results.npz'}, {out / 'summary.csv'} (spec.json and chunks/ beside them)")
        return 0
