"""``pcast sweep``: run a seed × Δ × N × config sweep and print the means (± standard error).

Every chunk lands on disk as it finishes (``--out``, by default ``sweeps/<fingerprint>`` under the
current directory), so an interrupted sweep resumes where it stopped when the same command is run
again.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from pcast_jax.commands._distributed import MAX_INIT_TIMEOUT_S, add_distributed_arguments, init_from_args
from pcast_jax.config import PRESETS
from pcast_jax.engine import ENGINES
from pcast_jax.errors import PcastError, check_f32
from pcast_jax.stats import mean_sem

DEFAULT_CONFIGS = "fwd_s1,rev_s1,fwd_s448,fwd_s256,rev_s256"
#: (metric, column title, multiplier, format) of the printed table.
COLUMNS = (
    ("mse", "MSE", 1.0, "{:.3e} ± {:.1e}"),
    ("frac_zeroed", "frac. zeroed %", 100.0, "{:.2f} ± {:.2f}"),
    ("nonsink_mass", "non-sink mass %", 100.0, "{:.2f} ± {:.2f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated preset names (default {DEFAULT_CONFIGS}; see `pcast presets`)")
    parser.add_argument("--delta", default="7",
                        help="sink strengths Δ: one value, a list 5,7,9, or start:stop:step with stop "
                             "included (4:13:1 is 4, 5, …, 13) (default 7)")
    parser.add_argument("--n", default="4096", help="KV lengths N, comma-separated (default 4096)")
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
    parser.add_argument("--engine", default="fast", help="simulator engine: fast or scan (default fast)")
    parser.add_argument("--chunk-size", default=None,
                        help="seeds per compiled call (default: as many as the memory budget allows)")
    parser.add_argument("--no-expected-mse", action="store_true",
                        help="skip the V-averaged mse_expected metric")
    parser.add_argument("--out", default=None,
                        help="output folder (default sweeps/<fingerprint> under the current directory); "
                             "rerunning into the same folder resumes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_distributed_arguments(parser)


# --------------------------------------------------------------------------------------------
# Option parsing: every error names the option.
# --------------------------------------------------------------------------------------------


def _int(option: str, text: str, *, min_value: int | None = None) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise PcastError(f"{option}={text!r} must be an integer") from None
    if min_value is not None and value < min_value:
        raise PcastError(f"{option}={text!r} must be >= {min_value}")
    return value


def _float(option: str, text: str, *, positive: bool = False, max_abs: float | None = None) -> float:
    """A number that is finite in float32 (the simulator's type), > 0 with ``positive``, |x| ≤ ``max_abs``."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise PcastError(f"{option}={text!r} must be a number") from None
    if not math.isfinite(value):
        raise PcastError(f"{option}={text!r} must be finite")
    param = option.lstrip("-").replace("-", "_")
    try:
        check_f32(param, value, positive=positive, max_abs=max_abs)
    except PcastError as exc:
        raise PcastError(f"{option}={text!r}: {exc}") from None
    return value


def _items(option: str, text: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise PcastError(f"{option}={text!r} must be a comma-separated list without empty items")
    return items


def parse_deltas(text: str, option: str = "--delta") -> tuple[float, ...]:
    """``"7"``, ``"5,7,9"`` or ``"start:stop:step"`` (stop included) → Δ values."""
    text = str(text).strip()
    if ":" not in text:
        return tuple(_float(option, t) for t in _items(option, text))
    parts = text.split(":")
    if len(parts) != 3:
        raise PcastError(f"{option}={text!r} must be start:stop:step (e.g. 4:13:1)")
    start, stop, step = (_float(option, p) for p in parts)
    if step <= 0:
        raise PcastError(f"{option}={text!r}: step must be > 0")
    if stop < start:
        raise PcastError(f"{option}={text!r}: stop must be >= start")
    count = math.floor((stop - start) / step + 1e-9) + 1
    if count > 10_000:
        raise PcastError(f"{option}={text!r} gives {count} values; at most 10000")
    return tuple(round(start + i * step, 12) for i in range(count))


def spec_from_args(args: argparse.Namespace):
    """The :class:`~pcast_jax.sweep.SweepSpec` the options describe."""
    from pcast_jax.sweep import SweepSpec
    from pcast_jax.workloads import SIGMA_MAX, SIGMA_V_MAX

    configs = tuple(_items("--configs", args.configs))
    for c in configs:
        if c not in PRESETS:
            raise PcastError(f"--configs: {c!r} is not a preset; choose from {', '.join(PRESETS)}")
    engine = str(args.engine).strip()
    if engine not in ENGINES:
        raise PcastError(f"--engine={args.engine!r} must be one of {', '.join(ENGINES)}")
    ns = tuple(_int("--n", t, min_value=1) for t in _items("--n", args.n))
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
        engine=engine,
        expected_mse=not args.no_expected_mse,
    )


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def format_table(result) -> list[str]:
    """One line per (N, config, Δ): mean ± standard error of MSE, frac. zeroed, non-sink mass."""
    spec = result.spec
    head = ["N", "config", "delta"] + [title for _, title, _, _ in COLUMNS]
    rows = []
    for n in spec.ns:
        for c in spec.config_names:
            for delta in spec.deltas:
                cells = [str(n), c, f"{delta:g}"]
                for metric, _, mult, fmt in COLUMNS:
                    x = result.get(metric, config=c, n=n, delta=delta).astype(np.float64) * mult
                    cells.append(fmt.format(*mean_sem(x)))
                rows.append(cells)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    align = [">", "<", ">"] + [">"] * len(COLUMNS)

    def line(cells):
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)).rstrip()

    return [line(head)] + [line(r) for r in rows]


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


def run(args: argparse.Namespace) -> int:
    from pcast_jax.sweep import run_sweep

    spec = spec_from_args(args)  # every option is checked before any work starts
    chunk_size = None if args.chunk_size is None else _int("--chunk-size", args.chunk_size, min_value=1)
    if args.out is not None and not str(args.out).strip():
        raise PcastError(f"--out={args.out!r} must name a folder (it would write into the current one)")
    init_timeout = getattr(args, "init_timeout", None)
    if init_timeout is not None:
        _float("--init-timeout", init_timeout, positive=True, max_abs=MAX_INIT_TIMEOUT_S)
    out = Path(args.out) if args.out is not None else Path("sweeps") / spec.fingerprint()
    say = _Printer()
    resuming = (out / "spec.json").exists()
    info = init_from_args(args)  # None unless a multi-process run was asked for
    if info is not None and info.process_id != 0:  # every process computes; process 0 reports
        run_sweep(spec, out, chunk_size=chunk_size, progress=False)
        return 0
    where = "" if info is None else f" on {info.num_processes} processes ({info.global_devices} devices)"
    say(f"pcast sweep: {len(spec.configs)} configs x {len(spec.deltas)} delta x {len(spec.ns)} N x "
          f"{spec.seeds} seeds (q_len={spec.q_len}, d={spec.d}, k_sink={spec.k_sink}, sigma={spec.sigma:g}, "
          f"engine={spec.engine}){where}{' - resuming' if resuming else ''}", flush=True)
    start = time.perf_counter()
    result = run_sweep(spec, out, chunk_size=chunk_size, progress=False if args.no_progress else None)
    elapsed = time.perf_counter() - start
    for line in format_table(result):
        say(line)
    instances = len(spec.ns) * spec.seeds
    say(f"{instances} instances x {len(spec.deltas)} delta x {len(spec.configs)} configs in {elapsed:.1f} s; "
          f"mean ± standard error over {spec.seeds} seeds")
    say(f"results: {out / 'results.npz'}, {out / 'summary.csv'} (spec.json and chunks/ beside them)")
    return 0
