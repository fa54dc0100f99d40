"""``pcast whatif <analysis>``: differentiable what-if analyses (see :mod:`pcast_jax.whatif`).

Analyses: ``validate`` (surrogate gradients vs exact finite differences), ``worst-delta`` (Adam
ascent on Δ), ``optimal-scale`` (Adam over log2 S, then exact powers of two), ``calibrate``
(Prop. 3's constant and δk fitted to simulations), ``dynamic`` (per-block 2^k scale vs static
scales) and ``report`` (all of them, markdown + figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pcast_jax import report
from pcast_jax.commands import _options
from pcast_jax.errors import PcastError
from pcast_jax.fileio import load_npy, write_set

#: Largest ``--scores`` file read: 1 GiB (2^28 float32 logits).
MAX_SCORES_BYTES = 2**30
ANALYSES = ("validate", "worst-delta", "optimal-scale", "calibrate", "dynamic", "report")
#: --format choices of the analyses (``report`` writes a folder: --out DIR).
FORMATS = ("table", "csv", "json")
#: Entry-point group of the packages that render a report the library computes (``whatif``: the
#: experiments package's what-if report); the library never imports them.
REPORTS_GROUP = "pcast_jax.reports"


def _common(p: argparse.ArgumentParser, *, n: int = 4096, seeds: int = 8) -> None:
    p.add_argument("--n", type=int, default=n, help=f"KV length N (default {n})")
    p.add_argument("--q-len", dest="q_len", type=int, default=32, help="query rows per instance (default 32)")
    p.add_argument("--seeds", type=int, default=seeds, help=f"seeds (instances) averaged (default {seeds})")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")
    _output(p)


def _progress(p: argparse.ArgumentParser) -> None:
    _options.add_progress_argument(p, "progress on stderr; --progress: a bar even off a terminal",
                                   "a bar on a terminal, step lines elsewhere")


def _output(p: argparse.ArgumentParser) -> None:
    """``--format`` (what is printed), ``--out FILE`` (where the rows go; ``--csv FILE`` before) and progress."""
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="printed output: the table (default), or only the result rows as csv or json (the "
                        "other lines go to stderr)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the result rows to FILE; .csv or .json picks the format")
    _options.renamed(p, "--csv", "--out FILE.csv")
    _progress(p)


def _one_config(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--config", default="fwd_s1",
                   help=f"{what}: a preset name or one kernel as key=value,... (default fwd_s1)")


def _add(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS")

    p = _add(sub, "validate", "surrogate gradients vs finite differences of the exact simulator")
    _one_config(p, "kernel with a static scale")
    p.add_argument("--param", default="delta", choices=("delta", "sigma", "log2_scale"),
                   help="parameter to differentiate (default delta)")
    p.add_argument("--points", default=None,
                   help=f"points of the parameter: {_options.RANGE_HELP} (default per parameter)")
    p.add_argument("--step", type=float, default=None, help="finite-difference half step h (default per parameter)")
    p.add_argument("--delta", type=float, default=7.0, help="Δ where Δ is not the parameter (default 7)")
    _common(p)

    p = _add(sub, "worst-delta", "Δ that maximises the MSE (Adam ascent on the smooth surrogate)")
    _options.add_kernel_arguments(p, default_configs="fwd_s1,fwd_s256")
    p.add_argument("--objective", default="total", choices=("total", "collapse"),
                   help="total expected MSE, or Prop. 3's collapse term only (default total)")
    p.add_argument("--delta-range", default="4:13", help="interval of Δ searched, lo:hi (default 4:13)")
    p.add_argument("--steps", type=int, default=60, help="Adam steps (default 60)")
    _common(p, seeds=4)
    _options.renamed(p, "--range", "--delta-range lo:hi")

    p = _add(sub, "optimal-scale", "best static S: Adam over log2 S, then exact powers of two")
    _one_config(p, "kernel fixing order and block size")
    p.add_argument("--delta", type=float, default=7.0, help="sink strength Δ (default 7)")
    p.add_argument("--scores", default=None,
                   help=".npy file of logits (q_len, N) or (batch, q_len, N) instead of the synthetic workload")
    p.add_argument("--surrogate", default="mean", choices=("mean", "staircase"),
                   help="LSB model of the smooth surrogate (default mean)")
    p.add_argument("--start", type=float, default=0.0, help="starting log2 S (default 0)")
    p.add_argument("--steps", type=int, default=150, help="Adam steps (default 150)")
    _common(p)

    p = _add(sub, "calibrate", "fit Prop. 3's constant c and δk to simulations")
    _one_config(p, "kernel")
    p.add_argument("--target", default="mse", choices=("mse", "mse_expected"),
                   help="simulated quantity fitted (default mse, one V draw as in the paper)")
    p.add_argument("--delta", default="4:13:0.5", help=f"Δ grid: {_options.RANGE_HELP} (default 4:13:0.5)")
    p.add_argument("--steps", type=int, default=300, help="Adam steps per fit (default 300)")
    _common(p, seeds=16)
    _options.renamed(p, "--deltas", "--delta")

    p = _add(sub, "dynamic", "dynamic per-block 2^k scale vs static 256 and 448")
    p.add_argument("--n", default="1024,4096,16384", help=f"KV lengths: {_options.RANGE_HELP} "
                                                           "(default 1024,4096,16384)")
    p.add_argument("--delta", default="4:13:1", help=f"Δ grid: {_options.RANGE_HELP} (default 4:13:1)")
    _options.add_kernel_arguments(p, default_configs="fwd_s256,fwd_s448")
    p.add_argument("--metric", default="mse_expected", choices=("mse_expected", "mse"),
                   help="compared metric (default mse_expected)")
    p.add_argument("--q-len", dest="q_len", type=int, default=32, help="query rows per instance (default 32)")
    p.add_argument("--seeds", type=int, default=8, help="seeds (default 8)")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")
    _output(p)
    _options.renamed(p, "--ns", "--n")
    _options.renamed(p, "--deltas", "--delta")
    _options.renamed(p, "--statics", "--configs")

    p = _add(sub, "report", "all analyses: DIR/whatif.md, CSV tables and figures")
    p.add_argument("--out", default="whatif-report", help="output folder (default whatif-report)")
    p.add_argument("--quick", action="store_true", help="small sizes (N = 1024, q_len = 8, few seeds)")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")
    _progress(p)


def _out_format(path) -> str | None:
    """``--out FILE``'s format from its extension (checked before any work)."""
    if path is None:
        return None
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in ("csv", "json"):
        raise PcastError(f"--out={str(path)!r} must end in .csv or .json (the extension picks the format)")
    report.check_out_file(path)
    return ext


class _Printer:
    """What an analysis prints: with ``--format table`` everything on stdout; with csv or json only
    the result rows there, every other line on stderr."""

    def __init__(self, fmt: str):
        self.fmt = fmt

    def note(self, line: str) -> None:
        print(line, file=sys.stdout if self.fmt == "table" else sys.stderr)

    def table(self, rows: list[dict], columns=None) -> None:
        if self.fmt == "table":
            print(report.cell_table(rows, columns))
        elif self.fmt == "csv":
            print(report.csv_text(rows), end="")
        else:
            print(json.dumps(report.json_value(rows), indent=1, ensure_ascii=False))


def _write_rows(path, rows: list[dict], say) -> None:
    """Write ``rows`` to ``path`` (atomically; its extension picks CSV or JSON) and say so."""
    if not path or not rows:
        return
    write = report.write_csv if _out_format(path) == "csv" else report.write_json
    say(f"wrote {write(path, rows)}")


def _ratio(num: float, den: float) -> str:
    """``num / den`` to four places, or why there is none (never a division by zero or a bare nan)."""
    return f"{num / den:.4f}" if den > 0 else f"n/a (the exact MSE at S = 256 is {den:g}: nothing to compare)"


def _report_writer():
    """The what-if report's writer, ``(out_dir, *, quick, base_seed) -> (CSV names, figure count)``, from the
    package that renders it (entry point ``whatif`` of :data:`REPORTS_GROUP`)."""
    from importlib import metadata

    found = metadata.entry_points(group=REPORTS_GROUP, name="whatif")
    if not found:
        raise PcastError("'pcast whatif report' is rendered by the pcast_experiments package, which is not "
                         "installed (pip install -e . in a source checkout installs it)")
    try:
        return next(iter(found)).load()
    except ImportError as exc:
        raise PcastError(f"'pcast whatif report' is rendered by {next(iter(found)).value} (entry point in group "
                         f"{REPORTS_GROUP}), which cannot be imported: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from pcast_jax.whatif import progress

    analysis = getattr(args, "analysis", None)
    if analysis is None:
        raise PcastError(f"give an analysis: one of {', '.join(ANALYSES)}")
    t0 = time.perf_counter()
    printer = _Printer(getattr(args, "format", "table"))
    if analysis != "report":
        _out_format(args.out)
    else:
        report.check_out_dir(args.out)
    with progress.reporting(f"pcast whatif {analysis}", show=args.progress):
        rows = _run(args, analysis, printer)
    if analysis != "report":
        _write_rows(args.out, rows, printer.note)
    printer.note(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def _run(args: argparse.Namespace, analysis: str, printer: _Printer) -> list[dict]:
    from pcast_jax import whatif
    from pcast_jax.workloads import SinkWorkload

    table = printer.table
    if analysis == "validate":
        sc = whatif.Scenario(config=_options.kernel("--config", args.config), n=args.n, q_len=args.q_len,
                             seeds=args.seeds, base_seed=args.base_seed)
        points = _options.floats("--points", args.points) if args.points else None
        rows = whatif.validate_gradients(sc, param=args.param, points=points, step=args.step,
                                         base={"delta": args.delta} if args.param != "delta" else None)
        table(rows, ["point", "surrogate", "exact_mse", "value_rel_err", "exact_fd", "exact_fd_sem",
                           "surrogate_grad", "grad_rel_err", "trustworthy"])
    elif analysis == "worst-delta":
        lo_hi = _options.interval("--delta-range", args.delta_range)
        configs = _options.kernels_from_args(args, default_configs="fwd_s1,fwd_s256")
        rows = []
        for cfg in configs:
            r = whatif.worst_case_delta(cfg, args.n, objective=args.objective, delta_range=lo_hi, seeds=args.seeds,
                                        q_len=args.q_len, steps=args.steps, base_seed=args.base_seed)
            rows += r.rows()
        table(rows, ["config", "objective", "worst_delta", "local_peak", "exact_local_peak",
                           "exact_mse_at_peak", "exact_global_argmax", "delta_c", "peak_in_6_9", "finals"])
    elif analysis == "optimal-scale":
        sur = whatif.Surrogate(lsb_mode=args.surrogate, atoms="representable")
        kw = dict(config=_options.kernel("--config", args.config), delta=args.delta, seeds=args.seeds,
                  surrogate=sur, start_log2_scale=args.start, steps=args.steps, base_seed=args.base_seed,
                  curve_points=0)
        if args.scores:
            scores = load_npy(args.scores, what=f"--scores={args.scores!r}", max_bytes=MAX_SCORES_BYTES)
            r = whatif.optimal_scale(scores=scores, **kw)
        else:
            r = whatif.optimal_scale(SinkWorkload(n=args.n, q_len=args.q_len), **kw)
        rows = r.rows()
        printer.note(f"{r.source}: Adam ({r.surrogate}) from log2 S = {r.start_log2_scale:g} ended at "
              f"log2 S = {r.continuous_log2_scale:.3f} (S = {2 ** r.continuous_log2_scale:.1f}); best neighbouring "
              f"power of two (exact) = {r.best_neighbour:g}; best power of two = {r.best_power:g}; "
              f"MSE(448)/MSE(256) = {_ratio(r.at_448, r.at_256)}")
        table(rows, ["scale", "exact_mse", "rel_to_256", "dp", "normal_coverage"])
    elif analysis == "calibrate":
        r = whatif.calibrate_prop3(_options.kernel("--config", args.config), args.n,
                                   deltas=_options.floats("--delta", args.delta), seeds=args.seeds,
                                   target=args.target, q_len=args.q_len, steps=args.steps, base_seed=args.base_seed)
        rows = r.rows()
        table(rows, ["model", "parameter", "mean", "sd_over_seeds", "boot95_lo", "boot95_hi"])
    elif analysis == "dynamic":
        statics = tuple(_options.kernels_from_args(args, default_configs="fwd_s256,fwd_s448"))
        r = whatif.dynamic_vs_static(statics=statics, deltas=_options.floats("--delta", args.delta),
                                     ns=_options.ints("--n", args.n, min_value=1), seeds=args.seeds,
                                     metric=args.metric, q_len=args.q_len, base_seed=args.base_seed)
        rows = r.rows()
        table(rows)
    else:  # report
        out, written = Path(args.out), {}

        write_report = _report_writer()

        def write(staging: Path) -> None:  # the folder is written as a set: all files or none
            written["tables"], written["figures"] = write_report(staging, quick=args.quick, base_seed=args.base_seed)

        write_set(out, write, what="--out")
        for name in written["tables"]:
            print(f"wrote {out / name}")
        print(f"wrote {out / 'whatif.md'} and {written['figures']} figures")
        rows = []
    return rows
