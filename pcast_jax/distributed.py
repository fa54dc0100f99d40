"""Scale-out: one sweep over many processes and hosts with JAX's multi-process runtime.

Every process runs the same program (SPMD, one controller per process): :func:`init_distributed`
joins the processes through :func:`jax.distributed.initialize`, and :func:`run_sweep_distributed`
(also reached through :func:`pcast_jax.sweep.run_sweep` once more than one process is running)
lays the seed axis of each jit call over one global mesh of every process's devices.

The work is cut into the chunks a single-process run uses (``chunk_size`` seeds × one Δ group of
one N). One call computes up to one chunk per process: process p's devices hold chunk p, laid out
exactly as a single-process run on one such host lays it out, so each instance goes through the
same per-device program and the merged ``results.npz`` / ``summary.csv`` are bit-identical to a
single-process run with the same chunk size. (XLA may round differently for a different batch
shape, so bit-identity is only promised for the same layout — which ``spec.json`` records.)
Each process writes its own chunk files (``out_dir/chunks/``, the single-process format) and
process 0 merges them.

Resume works per chunk: process 0 reads what is on disk (from runs with any process count,
including single-process ones), broadcasts which chunks are missing, and every process computes
the same list of calls over only those — chunks finished by any process are never recomputed.

The output folder must be one folder shared by every process (NFS, Lustre, ...); that is checked
before anything is computed. Every check that can fail on one process is agreed through a small
collective, so a refusal (a different spec on one process, a folder holding another sweep, a
folder that is not shared) is raised on every process instead of leaving the others waiting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from pcast_jax import __version__
from pcast_jax.errors import PcastError, check_int, check_positive

# JAX and the sweep engine are imported inside the functions, so the command line can add these
# options without loading JAX.

__all__ = [
    "ProcessInfo",
    "init_distributed",
    "process_info",
    "add_distributed_arguments",
    "init_from_args",
    "run_sweep_distributed",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300.0
_RUNTIME_GRACE_S = 60  # JAX's own start-up deadline sits this far past ours, so ours fires first
_EXCHANGE_BYTES = 4096
_MESSAGE_CHARS = 1500

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the multi-process runtime."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    coordinator: str | None = None


def process_info(coordinator: str | None = None) -> ProcessInfo:
    """This process's :class:`ProcessInfo` (single-process when the runtime was never started)."""
    import jax

    return ProcessInfo(process_id=jax.process_index(), num_processes=jax.process_count(),
                       local_devices=jax.local_device_count(), global_devices=jax.device_count(),
                       coordinator=coordinator)


# --------------------------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------------------------


def _parse_coordinator(coordinator) -> tuple[str, int]:
    if not isinstance(coordinator, str) or ":" not in coordinator:
        raise PcastError(f"coordinator={coordinator!r} must be 'HOST:PORT' (e.g. 'node0:12345')")
    host, _, port = coordinator.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):  # [IPv6]:port
        host = host[1:-1]
    if not host:
        raise PcastError(f"coordinator={coordinator!r} must name a host before ':PORT'")
    try:
        port_num = int(port)
    except ValueError:
        raise PcastError(f"coordinator={coordinator!r}: the port must be an integer in [1, 65535]") from None
    if not 1 <= port_num <= 65535:
        raise PcastError(f"coordinator={coordinator!r}: the port must be an integer in [1, 65535]")
    return host, port_num


def _wait_for_coordinator(host: str, port: int, deadline: float, *, coordinator: str, process_id: int,
                          num_processes: int, timeout_s: float) -> None:
    """Poll until something accepts TCP connections at the coordinator, or raise at the deadline."""
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PcastError(
                f"coordinator={coordinator!r} did not answer within timeout_s={timeout_s:g} "
                f"(process_id={process_id} of num_processes={num_processes}; last attempt: {last}); "
                "start process 0 on that host with the same coordinator, and check the host name, the "
                "port and that no firewall blocks it")
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(left, 0.05))):
                return
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     local_device_ids=None) -> ProcessInfo:
    """Join the multi-process JAX runtime (:func:`jax.distributed.initialize`); call before any JAX work.

    With no ``coordinator``/``num_processes``/``process_id`` the cluster is detected by JAX (SLURM,
    Open MPI, Cloud TPU, ``JAX_COORDINATOR_ADDRESS``…); otherwise all three are required, the same
    ``coordinator`` ('HOST:PORT' of process 0) and ``num_processes`` on every process and a distinct
    ``process_id`` in [0, num_processes). CPU collectives use gloo. Calling it again with the same
    arguments returns the running runtime's :class:`ProcessInfo`.

    Args:
      coordinator: 'HOST:PORT' where process 0 serves the coordinator.
      num_processes: total number of processes (≥ 1).
      process_id: this process's id.
      timeout_s: seconds to wait for the coordinator and for every process to join. Past it a
        :class:`PcastError` is raised; the runtime cannot be restarted in the same process, so the
        process should then exit.
      local_device_ids: restrict this process to these local devices (JAX's default otherwise).

    Raises:
      PcastError: bad arguments, no cluster detected, the coordinator's port is taken, or the
        timeout passed.
    """
    import jax

    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    explicit = any(v is not None for v in given.values())
    if explicit:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise PcastError(f"{', '.join(missing)} must be given too: pass coordinator, num_processes and "
                             "process_id together, or none of them to let JAX detect the cluster")
        host, port = _parse_coordinator(coordinator)
        check_int("num_processes", num_processes, min_value=1)
        check_int("process_id", process_id, min_value=0, max_value=num_processes - 1)
    timeout_s = check_positive("timeout_s", timeout_s)

    if jax.distributed.is_initialized():
        info = process_info(coordinator)
        if explicit and (info.num_processes, info.process_id) != (num_processes, process_id):
            raise PcastError(
                f"the distributed runtime already runs as process {info.process_id} of {info.num_processes}; "
                f"it cannot be restarted as process_id={process_id} of num_processes={num_processes}")
        return info

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout_s
    if explicit and process_id != 0:
        _wait_for_coordinator(host, port, deadline, coordinator=coordinator, process_id=process_id,
                              num_processes=num_processes, timeout_s=timeout_s)
    left = max(deadline - time.monotonic(), 0.5)
    kwargs = dict(initialization_timeout=int(math.ceil(left)) + _RUNTIME_GRACE_S)
    if explicit:
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids

    outcome: dict = {}

    def start():
        try:
            jax.distributed.initialize(**kwargs)
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = exc

    # jax.distributed.initialize blocks in native code and, past its own deadline, ends the whole
    # process; waiting on it from here lets the deadline surface as a PcastError instead.
    worker = threading.Thread(target=start, name="pcast-distributed-init", daemon=True)
    worker.start()
    worker.join(left)
    if worker.is_alive():
        who = (f"process_id={process_id} of num_processes={num_processes}, coordinator={coordinator!r}"
               if explicit else "cluster-detected settings")
        raise PcastError(
            f"the distributed runtime did not start within timeout_s={timeout_s:g} ({who}): not every "
            "process joined; start all processes 0 .. num_processes-1 with the same coordinator and "
            "num_processes (this process must exit before retrying)")
    exc = outcome.get("error")
    if exc is not None:
        raise _start_error(exc, explicit=explicit, coordinator=coordinator) from exc
    return process_info(coordinator)


def _start_error(exc: BaseException, *, explicit: bool, coordinator) -> PcastError:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    low = text.lower()
    if not explicit and isinstance(exc, ValueError) and "defined" in low:
        return PcastError("no cluster was detected (SLURM, Open MPI, Cloud TPU, JAX_COORDINATOR_ADDRESS); "
                          "pass coordinator, num_processes and process_id")
    if "before any jax calls" in low or "backend" in low:
        return PcastError("init_distributed must run before any JAX computation in this process "
                          f"(jax.distributed.initialize: {text})")
    if "rpc server" in low or "bind" in low or "address already in use" in low:
        return PcastError(f"coordinator={coordinator!r}: process 0 could not serve on that port ({text}); "
                          "choose a free port")
    return PcastError(f"jax.distributed.initialize failed: {text}")


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


# --------------------------------------------------------------------------------------------
# Agreement between processes
# --------------------------------------------------------------------------------------------


def _allgather_json(obj) -> list:
    """Collective: every process's small JSON-able ``obj``, in process order."""
    import jax
    from jax.experimental import multihost_utils

    blob = json.dumps(obj, separators=(",", ":")).encode()
    if len(blob) > _EXCHANGE_BYTES:
        raise PcastError(f"internal: {len(blob)}-byte message exceeds the {_EXCHANGE_BYTES}-byte exchange")
    buf = np.zeros(_EXCHANGE_BYTES, np.uint8)
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), _EXCHANGE_BYTES)
    return [json.loads(bytes(r).rstrip(b"\0")) for r in rows]


def _agree(error: BaseException | None, **data) -> list[dict]:
    """Collective check-point: if any process failed, every process raises; else all ``data``.

    The failing process re-raises its own exception; the others raise a PcastError naming it.
    """
    msg = "" if error is None else (str(error) or type(error).__name__)[:_MESSAGE_CHARS]
    rows = _allgather_json({"error": msg, "failed": error is not None, "data": data})
    if error is not None:
        raise error
    for i, row in enumerate(rows):
        if row["failed"]:
            raise PcastError(f"process {i} of {len(rows)} failed: {row['error']}")
    return [r["data"] for r in rows]


def _guard(fn, *a, **kw):
    """(value, None) or (None, exception) — so the exception can be agreed before it is raised."""
    try:
        return fn(*a, **kw), None
    except Exception as exc:  # noqa: BLE001 - re-raised by _agree on this process
        return None, exc


# --------------------------------------------------------------------------------------------
# Chunks and calls
# --------------------------------------------------------------------------------------------


def _units(spec, chunk_size: int, delta_group: int) -> list[tuple[int, int, int, tuple[int, int, int, int]]]:
    """(ni, group, chunk, bounds) of every chunk, in the order ``run_sweep`` uses."""
    units = []
    for ni in range(len(spec.ns)):
        for g in range(math.ceil(len(spec.deltas) / delta_group)):
            d0, d1 = g * delta_group, min(len(spec.deltas), (g + 1) * delta_group)
            for c in range(math.ceil(spec.seeds / chunk_size)):
                s0, s1 = c * chunk_size, min(spec.seeds, (c + 1) * chunk_size)
                units.append((ni, g, c, (s0, s1, d0, d1)))
    return units


def _plan_calls(units: list, missing: np.ndarray, num_processes: int) -> list[list]:
    """Missing chunks in groups of at most ``num_processes`` with one (N, Δ group, length) per call.

    Slot p of a call is process p's chunk; a call with fewer chunks than processes pads the rest.
    """
    calls, current, key = [], [], None
    for unit, miss in zip(units, missing):
        if not miss:
            continue
        ni, g, _, (s0, s1, _, _) = unit
        k = (ni, g, s1 - s0)
        if current and (k != key or len(current) == num_processes):
            calls.append(current)
            current = []
        current.append(unit)
        key = k
    if current:
        calls.append(current)
    return calls


def _global_mesh():
    """1-D mesh over every device, each process's devices contiguous (so slot p is process p's)."""
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.asarray(devices), ("i",))


@lru_cache(maxsize=8)
def _sharded_chunk_fn(mesh):
    """The sweep's chunk function with its output rows kept where the input seeds live."""
    import jax

    from pcast_jax import sweep as _sweep

    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    return jax.jit(_sweep._chunk_metrics, static_argnames=("spec", "n", "n_shards"), out_shardings=rows)


def _local_rows(arr, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the row-sharded global ``arr``; they must lie on this process's devices."""
    pieces = {}
    for shard in arr.addressable_shards:
        first = shard.index[0].start or 0
        block = np.asarray(shard.data)
        for k in range(block.shape[0]):
            pieces[first + k] = block[k]
    return np.stack([pieces[r] for r in range(start, stop)])


def _fill(data: dict, ni: int, bounds, vals: dict) -> None:
    s0, s1, d0, d1 = bounds
    for m, v in vals.items():  # v: (seeds, deltas, configs) -> data[m]: (ns, configs, deltas, seeds)
        data[m][ni, :, d0:d1, s0:s1] = np.transpose(v, (2, 1, 0))


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _identity(spec) -> dict:
    import jax
    import jaxlib

    return {"fingerprint": spec.fingerprint(), "pcast_jax": __version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "local_devices": jax.local_device_count()}


def _check_identity(spec) -> None:
    """Refuse (on every process) unless every process runs the same spec with the same software."""
    rows = _agree(None, **_identity(spec))
    ref = rows[0]
    for i, row in enumerate(rows[1:], start=1):
        for key in ("fingerprint", "pcast_jax", "jax", "jaxlib", "local_devices"):
            if row[key] != ref[key]:
                what = "sweep spec" if key == "fingerprint" else key
                raise PcastError(
                    f"process {i} runs a different {what} than process 0 ({key} {row[key]!r} vs {ref[key]!r}); "
                    "every process must be started with the same sweep arguments and software"
                    + (" and the same number of local devices" if key == "local_devices" else ""))


def _choose_layout(spec, chunk_size, memory_budget) -> dict:
    """Process 0's layout: a single host's (so chunks match a one-process run), balanced over processes.

    Without ``chunk_size`` the chunk is capped so that every process gets at least one chunk per
    (N, Δ group).
    """
    import jax

    from pcast_jax import sweep as _sweep

    local, nproc = jax.local_device_count(), jax.process_count()
    layout = _sweep.plan_layout(spec, n_devices=local, chunk_size=chunk_size, memory_budget=memory_budget)
    if chunk_size is None and nproc > 1:
        balanced = -(-math.ceil(spec.seeds / nproc) // local) * local
        if balanced < layout["chunk_size"]:
            layout = _sweep.plan_layout(spec, n_devices=local, chunk_size=balanced, memory_budget=memory_budget)
    return layout


def _claim(out: Path | None, spec, chunk_size, memory_budget) -> dict:
    """Process 0: choose the layout, check the folder, write or check spec.json (saved layout on resume)."""
    from pcast_jax import sweep as _sweep

    layout = _choose_layout(spec, chunk_size, memory_budget)
    if out is None:
        return layout
    _sweep._check_writable(out)
    return _sweep._claim_dir(out, spec, layout)


def _probe_path(out: Path, pid: int) -> Path:
    return out / "chunks" / f".probe_p{pid:04d}"


def _write_probe(out: Path, token: str) -> None:
    import jax

    from pcast_jax import sweep as _sweep

    try:
        _sweep._atomic_write(_probe_path(out, jax.process_index()), lambda f: f.write(token), text=True)
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable on process {jax.process_index()}: "
                         f"{exc.strerror or exc}") from None


def _check_probes(out: Path, token: str) -> None:
    import jax

    unseen = []
    for p in range(jax.process_count()):
        try:
            ok = _probe_path(out, p).read_text() == token
        except OSError:
            ok = False
        if not ok:
            unseen.append(p)
    if unseen:
        raise PcastError(
            f"out_dir={str(out)!r} is not one folder shared by every process: process 0 cannot see the files "
            f"written there by process(es) {unseen}; use a path on a shared file system (NFS, Lustre, ...)")


def _scan(out: Path, spec, fp: str, units: list, data: dict) -> np.ndarray:
    """Process 0: load every finished chunk into ``data``; True where a chunk is still missing."""
    from pcast_jax import sweep as _sweep

    missing = np.ones(len(units), bool)
    for k, (ni, g, c, bounds) in enumerate(units):
        got = _sweep._load_chunk(_sweep._chunk_path(out, spec.ns[ni], g, c), fp, bounds)
        if got is not None:
            _fill(data, ni, bounds, got)
            missing[k] = False
    return missing


def _merge(out: Path, spec, fp: str, units: list, data: dict, computed: list[int]) -> None:
    """Process 0: read the chunks the other processes wrote, then write results.npz and summary.csv."""
    from pcast_jax import sweep as _sweep

    for k in computed:
        ni, g, c, bounds = units[k]
        path = _sweep._chunk_path(out, spec.ns[ni], g, c)
        got = _sweep._load_chunk(path, fp, bounds)
        if got is None:
            raise PcastError(f"chunk file {path.name} is missing or unreadable on process 0; "
                             f"out_dir={str(out)!r} must be one folder shared by every process")
        _fill(data, ni, bounds, got)
    _sweep._save_npz(out / "results.npz", data)
    _sweep.SweepResult(spec, data).write_csv(out / "summary.csv")


def run_sweep_distributed(spec, out_dir: str | os.PathLike | None = None, *, chunk_size: int | None = None,
                          progress: bool | None = None, memory_budget: int | None = None):
    """Run (or resume) one sweep over every process's devices; every process calls it alike.

    The sweep is cut into the chunks a single-process run uses (``chunk_size`` seeds × one Δ
    group of one N). Each jit call computes up to one missing chunk per process, with the seed axis
    sharded over a global 1-D mesh of every process's devices; process p's devices hold chunk p,
    laid out exactly as a single-process run on one such host lays it out, so every instance is
    computed by the same per-device program and the results are bit-identical. With ``out_dir``
    each process writes its chunk to ``chunks/`` (the single-process file format: a run can be
    resumed with any process count, including one) and process 0 merges everything into
    ``results.npz`` and ``summary.csv``; without it, each call's rows are gathered to every process.
    A chunk count that does not divide over the processes, or a chunk that does not divide over a
    process's devices, is padded (the padding is computed and dropped).

    Args:
      spec: the :class:`pcast_jax.sweep.SweepSpec`; it must be the same on every process.
      out_dir: output folder shared by every process, or None.
      chunk_size: seeds per chunk (process 0's value counts; the saved layout on resume). By
        default as large as ``memory_budget`` allows on one host, capped so that every process
        gets a chunk.
      progress: progress bar on process 0 (default: when its stderr is a terminal).
      memory_budget: bytes one chunk may use on one process (default as in ``run_sweep``).

    Returns:
      The :class:`pcast_jax.sweep.SweepResult`, on every process.

    Raises:
      PcastError, on every process: the processes were given different specs or software, the
      folder holds another sweep or is not shared by every process, or one process failed.
    """
    import jax
    from jax.experimental import multihost_utils

    from pcast_jax import metrics
    from pcast_jax import sweep as _sweep

    if not isinstance(spec, _sweep.SweepSpec):
        raise PcastError(f"spec must be a SweepSpec, got {type(spec).__name__}")
    pid, nproc = jax.process_index(), jax.process_count()
    _check_identity(spec)
    fp = spec.fingerprint()
    out = Path(out_dir) if out_dir is not None else None

    token = secrets.token_hex(8) if pid == 0 else ""
    layout, err = _guard(_claim, out, spec, chunk_size, memory_budget) if pid == 0 else (None, None)
    shared = _agree(err, layout=layout, token=token)[0]  # spec.json exists once this returns
    cs, gs, token = int(shared["layout"]["chunk_size"]), int(shared["layout"]["delta_group"]), shared["token"]
    units = _units(spec, cs, gs)
    shape = (len(spec.ns), len(spec.configs), len(spec.deltas), spec.seeds)
    data = {m: np.full(shape, np.nan, np.float32) for m in metrics.METRICS}

    missing = np.ones(len(units), bool)
    if out is not None:
        _agree(_guard(_write_probe, out, token)[1])
        _agree(_guard(_check_probes, out, token)[1] if pid == 0 else None)
        _probe_path(out, pid).unlink(missing_ok=True)
        if pid == 0:
            scanned, err = _guard(_scan, out, spec, fp, units, data)
            if err is None:
                missing = scanned
        _agree(err)
        missing = np.asarray(multihost_utils.broadcast_one_to_all(missing.astype(np.uint8)), np.uint8) > 0
    calls = _plan_calls(units, missing, nproc)
    if pid == 0:
        logger.info("sweep %s: %d processes x %d devices, %d of %d chunks to compute in %d calls",
                    fp, nproc, jax.local_device_count(), int(missing.sum()), len(units), len(calls))

    mesh = _global_mesh()
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    fn = _sharded_chunk_fn(mesh)
    local, n_devices = jax.local_device_count(), jax.device_count()
    index = {u[:3]: k for k, u in enumerate(units)}
    computed: list[int] = []

    def dispatch(call):
        ni, _, _, (s0, s1, d0, d1) = call[0]
        slot = -(-(s1 - s0) // local) * local
        parts = []
        for p in range(nproc):  # slot p: process p's chunk, padded like a single-process chunk
            u0, u1 = call[p][3][:2] if p < len(call) else call[0][3][:2]
            seeds = (np.arange(u0, u1) + spec.seed_offset).astype(np.uint32)
            parts.append(np.concatenate([seeds, np.repeat(seeds[-1:], slot - len(seeds))]))
        seeds = np.concatenate(parts)
        deltas = np.asarray(spec.deltas, np.float32)[d0:d1]
        seeds_g = jax.make_array_from_callback(seeds.shape, rows, lambda idx: seeds[idx])
        deltas_g = jax.make_array_from_callback(deltas.shape, replicated, lambda idx: deltas[idx])
        return fn(seeds_g, deltas_g, spec=spec, n=spec.ns[ni], n_shards=n_devices), slot

    def finish(call, started):
        outs, slot = started
        if out is None:
            full = multihost_utils.process_allgather(outs, tiled=True)
            for p, (ni, _, _, bounds) in enumerate(call):
                n_seeds = bounds[1] - bounds[0]
                _fill(data, ni, bounds, {m: np.asarray(v)[p * slot: p * slot + n_seeds] for m, v in full.items()})
            return
        if pid < len(call):
            ni, g, c, bounds = call[pid]
            start = pid * slot
            vals = {m: _local_rows(v, start, start + bounds[1] - bounds[0]) for m, v in outs.items()}
            _sweep._save_npz(_sweep._chunk_path(out, spec.ns[ni], g, c),
                             {"fingerprint": np.array(fp), "bounds": np.array(bounds),
                              **{f"m_{k}": v for k, v in vals.items()}})
            if pid == 0:
                _fill(data, ni, bounds, vals)
        if pid == 0:
            computed.extend(index[u[:3]] for u in call[1:])

    show = (sys.stderr.isatty() if progress is None else progress) and pid == 0
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(calls), desc=f"sweep x{nproc}", unit="call", file=sys.stderr)
    err = None
    try:
        pending = None
        for call in calls:  # dispatch the next call before storing the previous one's rows
            started = (call, dispatch(call))
            if pending is not None:
                finish(*pending)
                if bar is not None:
                    bar.update(1)
            pending = started
        if pending is not None:
            finish(*pending)
            if bar is not None:
                bar.update(1)
    except Exception as exc:  # noqa: BLE001 - agreed below so that no process waits forever
        err = exc
    finally:
        if bar is not None:
            bar.close()
    _agree(err)  # every process has written its chunks once this returns
    if out is None:
        return _sweep.SweepResult(spec, data)
    _agree(_guard(_merge, out, spec, fp, units, data, computed)[1] if pid == 0 else None)
    return _sweep.SweepResult(spec, data) if pid == 0 else _sweep.load_result(out)
