"""The ``pcast sweep`` options that start the multi-process runtime (see "Scale-out" in the README)."""

from __future__ import annotations

import argparse

from pcast_jax.sweep.multihost import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, ProcessInfo, init_distributed

__all__ = ["add_distributed_arguments", "init_from_args", "MAX_INIT_TIMEOUT_S"]

#: Largest ``--init-timeout`` (seconds).
MAX_INIT_TIMEOUT_S = MAX_TIMEOUT_S


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id``, ``--init-timeout``."""
    group = parser.add_argument_group(
        "scale-out", "one sweep over several processes/hosts (jax.distributed); run the same command "
        "once per process, each with its own --process-id")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run; alone it lets JAX detect the cluster "
                            "(SLURM, Open MPI, Cloud TPU)")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address where process 0 serves the coordinator (implies --distributed)")
    group.add_argument("--num-processes", dest="num_processes", metavar="N", type=int, default=None,
                       help="total number of processes")
    group.add_argument("--process-id", dest="process_id", metavar="I", type=int, default=None,
                       help="this process's id, 0 .. N-1")
    group.add_argument("--init-timeout", dest="init_timeout", metavar="SECONDS", type=float,
                       default=DEFAULT_TIMEOUT_S,
                       help=f"seconds to wait for the coordinator and every process (default {DEFAULT_TIMEOUT_S:g})")


def init_from_args(args: argparse.Namespace) -> ProcessInfo | None:
    """Start the runtime when the parsed ``args`` ask for it; None for a single-process run."""
    explicit = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    if not getattr(args, "distributed", False) and all(v is None for v in explicit):
        return None
    return init_distributed(*explicit, timeout_s=getattr(args, "init_timeout", DEFAULT_TIMEOUT_S))
