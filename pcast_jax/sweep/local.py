"""The single-process sweep driver: every chunk in turn on this process's devices."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from pcast_jax.sweep.compute import compute_chunk
from pcast_jax.sweep.plan import plan_layout, units
from pcast_jax.sweep.progress import progress_bar
from pcast_jax.sweep.spec import SweepResult, SweepSpec, check_spec
from pcast_jax.sweep.store import chunk_path, claim_dir, empty_results, fill, save_chunk, scan, write_results

__all__ = ["run_sweep_local"]


def run_sweep_local(
    spec: SweepSpec,
    out_dir: str | os.PathLike | None = None,
    *,
    chunk_size: int | None = None,
    devices=None,
    progress: bool | None = None,
    memory_budget: int | None = None,
) -> SweepResult:
    """Run (or resume) a sweep in this process, the seed axis of each chunk sharded over ``devices``.

    Arguments as :func:`pcast_jax.sweep.run_sweep`. With ``out_dir`` the chunks already on disk
    are read first and only the missing ones are computed, each written as soon as it finishes.
    """
    check_spec(spec)
    devices = list(devices or jax.devices())
    layout = plan_layout(spec, n_devices=len(devices), chunk_size=chunk_size, memory_budget=memory_budget)
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        layout = claim_dir(out, spec, layout)
    todo = units(spec, layout)
    data = empty_results(spec)
    missing = np.ones(len(todo), bool) if out is None else scan(out, spec, todo, data)
    with progress_bar(progress, len(todo), desc="sweep", unit="chunk", done=int((~missing).sum())) as advance:
        for unit in (u for u, miss in zip(todo, missing) if miss):
            s0, s1, d0, d1 = unit.bounds
            got = compute_chunk(spec, spec.ns[unit.ni], s0, s1, np.arange(d0, d1), devices)
            fill(data, unit, got, spec)  # checked before it is saved: a non-finite chunk is never written
            if out is not None:
                save_chunk(chunk_path(out, spec, unit), spec, unit, got)
            advance()
    return SweepResult(spec, data) if out is None else write_results(out, spec, data)
