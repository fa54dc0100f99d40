"""``pcast reproduce``: the sub-command this package adds to the ``pcast`` command line.

Declared in ``pyproject.toml`` under the entry-point group ``pcast_jax.commands``; the ``pcast``
CLI discovers it there (the library itself never imports this package). Like the built-in
commands it has ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; importing it is
cheap, the experiments load when the command runs. :func:`main` is the smaller command line of
each experiment module run as a script (``python -m pcast_experiments.table2 --quick``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Sequence

from pcast_jax.commands import _options

__all__ = ["HELP", "add_arguments", "run", "main"]

HELP = "Reproduce every table and figure of the paper into DIR/report.md."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pcast reproduce``."""
    parser.add_argument("--out", default="results", metavar="DIR",
                        help="report folder: report.md, *.csv, *.png, run.json, sweeps/ (default: results)")
    parser.add_argument("--quick", action="store_true",
                        help="same report at reduced seeds and sizes (about 15 s of compute on 2 CPU cores)")
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]",
                        help="run only these experiments (table1, table2, figure1_dp, figure2_delta, "
                             "figure3_n, appendix_a, appendix_b, table3_kernels); report.md then holds "
                             "only them")
    parser.add_argument("--extras", default=None, metavar="NAME[,NAME]",
                        help="studies beyond the paper to append, with --only and --quick too: real_model, whatif, "
                             "formats, mma_accumulation, sinks_and_rescale, vendors_and_knobs, or none (default: "
                             "real_model on a full run, none with --only or --quick; "
                             "whatif adds about two minutes, formats, mma_accumulation and vendors_and_knobs "
                             "about one each)")
    parser.add_argument("--fresh", action="store_true",
                        help="recompute every sweep instead of resuming from DIR/sweeps")
    _options.add_progress_argument(parser, "the sweeps' progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """Run the experiments of ``args`` and write the report folder."""
    from pcast_jax.errors import PcastError

    for module in ("matplotlib", "scipy"):
        if importlib.util.find_spec(module) is None:
            raise PcastError(f"pcast reproduce needs {module}: pip install 'pcast_jax[plots]'")
    from .registry import reproduce

    def log(line: str) -> None:
        print(line, flush=True)

    reproduce(args.out, quick=args.quick, only=args.only, progress=args.progress, fresh=args.fresh,
              extras=None if args.extras is None else [] if args.extras.strip() == "none"
              else [e.strip() for e in args.extras.split(",") if e.strip()],
              log=log)
    return 0


def main(names: Sequence[str] | None = None, argv: Sequence[str] | None = None) -> int:
    """Run experiments as a script: ``python -m pcast_experiments.table2 [--out DIR] [--quick]``."""
    p = argparse.ArgumentParser(description="Run paper experiments and write a report folder.")
    p.add_argument("--out", default="results", help="report folder (default: results)")
    p.add_argument("--quick", action="store_true", help="reduced seeds and sizes")
    args = p.parse_args(argv)
    from pcast_jax.errors import PcastError

    from .registry import reproduce

    try:
        reproduce(args.out, quick=args.quick, only=names)
    except PcastError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
