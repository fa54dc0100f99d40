"""The sweep engine: seed × Δ × N × config grids, chunked, sharded over devices and processes, resumable.

An instance is one (N, seed): its scores and V are drawn from
``fold_in(fold_in(key(base_seed), N), seed)`` — independent of Δ, chunking and device count — and
every Δ and config is evaluated on those same draws (common random numbers). A chunk is one
compiled call over a range of seeds and a group of Δ values; every instance runs through the same
compiled loop body and only the per-device shard axis is vmapped, so results do not depend on the
chunking, the device count or the process count. Finished chunks are written atomically to
``out_dir/chunks/``; a rerun with the same spec resumes from them.

Modules: :mod:`~pcast_jax.sweep.spec` (spec, result, identity), :mod:`~pcast_jax.sweep.plan`
(layout and chunk list), :mod:`~pcast_jax.sweep.compute` (the compiled chunk),
:mod:`~pcast_jax.sweep.store` (files), :mod:`~pcast_jax.sweep.progress` (the progress bar), and
the two drivers :mod:`~pcast_jax.sweep.local` and :mod:`~pcast_jax.sweep.multihost`.
"""

from __future__ import annotations

import os

import jax

from pcast_jax.errors import PcastError, check_int, check_positive
from pcast_jax.sweep.compute import compute_chunk
from pcast_jax.sweep.local import run_sweep_local
from pcast_jax.sweep.multihost import ProcessInfo, init_distributed, process_info, run_sweep_distributed
from pcast_jax.sweep.plan import check_memory, plan_layout
from pcast_jax.sweep.spec import (
    SIMULATOR_VERSION,
    SweepResult,
    SweepSpec,
    check_spec,
    estimate_instance_bytes,
    instance_key,
)
from pcast_jax.sweep.store import load_result

__all__ = ["SweepSpec", "SweepResult", "run_sweep", "plan_layout", "check_memory", "compute_chunk", "instance_key",
           "estimate_instance_bytes", "load_result", "SIMULATOR_VERSION", "ProcessInfo", "init_distributed",
           "process_info", "run_sweep_distributed"]


def run_sweep(
    spec: SweepSpec,
    out_dir: str | os.PathLike | None = None,
    *,
    chunk_size: int | None = None,
    devices=None,
    progress: bool | None = None,
    memory_budget: int | None = None,
) -> SweepResult:
    """Run (or resume) a sweep. With ``out_dir`` every chunk lands on disk as it finishes.

    Args:
      spec: what to sweep.
      out_dir: folder for spec.json, chunks/, results.npz, summary.csv; None keeps it in memory.
        A folder holding a different sweep is refused; the same sweep resumes.
      chunk_size: seeds per compiled call (default: as many as ``memory_budget`` allows). Results
        do not depend on it. On resume the saved layout is used.
      devices: devices to shard the seed axis over (default all ``jax.devices()``). With several
        processes (:func:`init_distributed`) and no ``devices``, every process calls this alike
        and the sweep runs over all processes' devices (:func:`run_sweep_distributed`).
      progress: show a progress bar (default: when stderr is a terminal).
      memory_budget: bytes one chunk may use (default half the accelerator memory, or a quarter
        of the host RAM on CPU).

    Returns:
      The :class:`SweepResult`.

    Raises:
      PcastError: bad arguments, a chunk that cannot fit the memory budget, or an output folder
        that cannot be written or holds another sweep — all before any chunk is computed.
    """
    check_spec(spec)
    _check_run_args(out_dir, chunk_size, progress, memory_budget)
    if devices is None and jax.process_count() > 1:  # multi-process runtime: shard over every process
        return run_sweep_distributed(spec, out_dir, chunk_size=chunk_size, progress=progress,
                                     memory_budget=memory_budget)
    return run_sweep_local(spec, out_dir, chunk_size=chunk_size, devices=devices, progress=progress,
                           memory_budget=memory_budget)


def _check_run_args(out_dir, chunk_size, progress, memory_budget) -> None:
    """Every argument of :func:`run_sweep` checked before any work (PcastError naming it)."""
    if out_dir is not None:
        if not isinstance(out_dir, (str, os.PathLike)):
            raise PcastError(f"out_dir={out_dir!r} must be a path (str or os.PathLike) or None")
        if not str(os.fspath(out_dir)).strip():
            raise PcastError(f"out_dir={out_dir!r} must name a folder (it would write into the current one)")
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, min_value=1)
    if progress is not None and not isinstance(progress, bool):
        raise PcastError(f"progress={progress!r} must be True, False or None")
    if memory_budget is not None:
        check_positive("memory_budget", memory_budget)
