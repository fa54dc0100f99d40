"""Compile the Pallas FP8 kernels for Hopper without a GPU and print registers, spills and MMA use.

The same report as ``pcast kernels`` (options: ``--help``). Usage (repo root)::

    PYTHONPATH=. python benchmarks/sass_report.py
    PYTHONPATH=. python benchmarks/sass_report.py --backends triton --configs fa3 --num-warps 4,8
"""

from __future__ import annotations

import argparse
import sys

from pcast_jax.commands import kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=kernels.HELP)
    kernels.add_arguments(parser)
    try:
        return kernels.run(parser.parse_args(argv))
    except ValueError as exc:  # PcastError: one line, like the pcast CLI
        print(f"sass_report: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
