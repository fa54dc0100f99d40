"""How a sweep is cut into work: the chunk layout, the list of chunks, and the multi-process calls.

A chunk is ``chunk_size`` seeds × one group of ``delta_group`` Δ values × one N. Both drivers walk
the same :func:`units` list, so chunk files are interchangeable between single- and multi-process
runs with the same layout.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import numpy as np

from pcast_jax.errors import PcastError, check_int, check_positive
from pcast_jax.sweep.spec import SweepSpec, estimate_instance_bytes

__all__ = ["Unit", "default_budget", "check_memory", "plan_layout", "plan_process_layout", "units", "plan_calls",
           "seed_indices", "call_seeds"]


class Unit(NamedTuple):
    """One chunk of a sweep: N = ``spec.ns[ni]``, Δ group ``group``, seed chunk ``chunk``.

    ``bounds`` is (s0, s1, d0, d1): seeds [s0, s1) (before ``seed_offset``) and Δ indices [d0, d1).
    """

    ni: int
    group: int
    chunk: int
    bounds: tuple[int, int, int, int]


def default_budget() -> int:
    """Bytes one chunk may use: half the first device's memory, or a quarter of the host RAM on CPU."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may not implement it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"] * 0.5)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(total * 0.25)


def check_memory(what: str, nbytes: int, *, budget: int | None = None) -> int:
    """``nbytes``, or a PcastError naming ``what``, its size and the budget when it needs more.

    The one memory bound of the package for work sized by its input: ``budget`` defaults to
    :func:`default_budget` (half the device's memory, a quarter of the host's on CPU). Call it with
    the bytes the work will hold at once, before any of it is allocated.
    """
    limit = default_budget() if budget is None else int(budget)
    if nbytes > limit:
        raise PcastError(f"{what} needs {nbytes / 2**30:.3g} GiB of memory; the budget is "
                         f"{limit / 2**30:.3g} GiB (half the device's memory, a quarter of the host's on CPU)")
    return int(nbytes)


#: Bytes one (seed, Δ, config) adds to a chunk: its metrics as float32, twice (device and host copy).
_OUTPUT_BYTES = 2 * 4 * 16


def _balanced(total: int, most: int) -> int:
    """The smallest size that covers ``total`` in as few pieces of at most ``most`` as possible.

    Even pieces (20 as 10 + 10, not 16 + 4) mean one compiled shape instead of two.
    """
    pieces = -(-total // most)
    return -(-total // pieces)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def plan_layout(spec: SweepSpec, *, n_devices: int, chunk_size: int | None = None,
                memory_budget: int | None = None) -> dict:
    """Seeds per chunk and Δ values per group so that one chunk fits ``memory_budget`` bytes.

    Args:
      spec: the sweep.
      n_devices: devices one chunk is sharded over.
      chunk_size: seeds per chunk; by default as many as fit (at most 1024, balanced, a multiple
        of ``n_devices`` when that still fits).
      memory_budget: bytes one chunk may use (default :func:`default_budget`).

    Returns:
      ``{"chunk_size": int, "delta_group": int}``.

    Raises:
      PcastError: before anything runs, when a single (seed, Δ) instance or the given
        ``chunk_size`` does not fit the budget.
    """
    if memory_budget is None:
        budget = default_budget()
    else:
        budget = int(check_positive("memory_budget", memory_budget))
    worst = max(estimate_instance_bytes(spec, n) for n in spec.ns)
    step = worst * spec.micro_batch  # one step of the compiled chunk holds micro_batch seeds' instances
    if step * n_devices > budget:
        times = f" x micro_batch={spec.micro_batch}" if spec.micro_batch > 1 else ""
        raise PcastError(
            f"one instance at N={max(spec.ns)} needs ~{worst / 2**30:.2f} GiB per device{times} but the memory "
            f"budget is {budget / 2**30:.2f} GiB; lower n, q_len or the number of configs, or raise memory_budget")
    # The chunk loops over its seeds and Δ values (one step live at a time): what grows with them is
    # the metrics they return, a few bytes each; the chunk stays within one step plus those. Δ groups
    # stay as large as budget // step allows (all of them, unless the budget is tight on purpose).
    group = _balanced(len(spec.deltas), max(1, min(len(spec.deltas), budget // (step * n_devices))))
    per_seed = _OUTPUT_BYTES * len(spec.configs) * group * n_devices
    fit = max(1, (budget - step * n_devices) // per_seed)  # seeds per chunk that fit
    if chunk_size is None:
        chunk_size = _balanced(spec.seeds, min(fit, spec.seeds, 1024))
        if chunk_size >= n_devices:  # a multiple of the device count, when that still fits
            rounded = _round_up(chunk_size, n_devices)
            chunk_size = rounded if rounded <= fit else chunk_size
    else:
        check_int("chunk_size", chunk_size, min_value=1)
        if chunk_size > fit:
            raise PcastError(f"chunk_size={chunk_size} would need ~{chunk_size * per_seed / 2**30:.2f} GiB; "
                             f"at most {fit} seeds per chunk fit the memory budget of {budget / 2**30:.2f} GiB")
    return {"chunk_size": int(chunk_size), "delta_group": int(group)}


def plan_process_layout(spec: SweepSpec, *, local_devices: int, num_processes: int,
                        chunk_size: int | None = None, memory_budget: int | None = None) -> dict:
    """The layout of a multi-process run: one host's :func:`plan_layout`, balanced over the processes.

    Chunks are laid out as a single-process run on one host lays them out, so the results match
    it bit for bit. Without ``chunk_size`` the chunk is capped so that every process gets at least
    one chunk per (N, Δ group).
    """
    layout = plan_layout(spec, n_devices=local_devices, chunk_size=chunk_size, memory_budget=memory_budget)
    if chunk_size is None and num_processes > 1:
        balanced = _round_up(math.ceil(spec.seeds / num_processes), local_devices)
        if balanced < layout["chunk_size"]:
            layout = plan_layout(spec, n_devices=local_devices, chunk_size=balanced, memory_budget=memory_budget)
    return layout


def units(spec: SweepSpec, layout: dict) -> list[Unit]:
    """Every chunk of the sweep under ``layout``, ordered by N, then Δ group, then seeds."""
    cs, gs = int(layout["chunk_size"]), int(layout["delta_group"])
    out = []
    for ni in range(len(spec.ns)):
        for g in range(math.ceil(len(spec.deltas) / gs)):
            d0, d1 = g * gs, min(len(spec.deltas), (g + 1) * gs)
            for c in range(math.ceil(spec.seeds / cs)):
                s0, s1 = c * cs, min(spec.seeds, (c + 1) * cs)
                out.append(Unit(ni, g, c, (s0, s1, d0, d1)))
    return out


def plan_calls(todo: list[Unit], missing: np.ndarray, num_processes: int) -> list[list[Unit]]:
    """The missing chunks in calls of at most ``num_processes``, one (N, Δ group, seed count) per call.

    Slot p of a call is process p's chunk; a call with fewer chunks than processes is padded by
    :func:`call_seeds`.
    """
    calls, current, key = [], [], None
    for unit, miss in zip(todo, missing):
        if not miss:
            continue
        s0, s1 = unit.bounds[:2]
        k = (unit.ni, unit.group, s1 - s0)
        if current and (k != key or len(current) == num_processes):
            calls.append(current)
            current = []
        current.append(unit)
        key = k
    if current:
        calls.append(current)
    return calls


def seed_indices(spec: SweepSpec, start: int, stop: int, length: int) -> np.ndarray:
    """Seed indices of seeds [start, stop) as uint32, the last repeated up to ``length`` entries.

    The repeats are padding: they are computed like any seed and dropped afterwards.
    """
    seeds = (np.arange(start, stop) + spec.seed_offset).astype(np.uint32)
    return np.concatenate([seeds, np.repeat(seeds[-1:], length - len(seeds))])


def call_seeds(spec: SweepSpec, call: list[Unit], *, num_processes: int, local_devices: int) -> tuple[np.ndarray, int]:
    """The global seed vector of one multi-process call and its slot length (rows per process).

    Slot p holds process p's chunk, padded to a multiple of ``local_devices · spec.micro_batch``
    exactly as a single-process run pads it; slots past the end of ``call`` repeat the first chunk.
    """
    s0, s1 = call[0].bounds[:2]
    slot = _round_up(s1 - s0, local_devices * spec.micro_batch)
    parts = []
    for p in range(num_processes):
        u0, u1 = (call[p] if p < len(call) else call[0]).bounds[:2]
        parts.append(seed_indices(spec, u0, u1, slot))
    return np.concatenate(parts), slot
