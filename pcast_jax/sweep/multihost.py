"""The multi-process sweep driver: one sweep over many processes and hosts (``jax.distributed``).

Every process runs the same program: :func:`init_distributed` joins the runtime, then
:func:`run_sweep_distributed` (also reached through :func:`pcast_jax.sweep.run_sweep` once more
than one process runs) computes up to one chunk per process in each compiled call, over one mesh of
every process's devices. Process p's devices hold chunk p, laid out as a single-process run on one
such host lays it out, so results are bit-identical to a single-process run with the same chunk
size. Each process writes its own chunk files; process 0 reads what exists, tells every process
which chunks are missing, and merges the results. Every check that can fail on one process is
agreed through a small collective, so a refusal is raised on every process instead of leaving the
others waiting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from pcast_jax.cache import setup_compilation_cache
from pcast_jax.errors import PcastError, check_int, check_positive
from pcast_jax.sweep.compute import global_mesh, local_rows, start_global_call
from pcast_jax.sweep.plan import call_seeds, plan_calls, plan_process_layout, units
from pcast_jax.sweep.progress import progress_bar
from pcast_jax.sweep.spec import SweepResult, SweepSpec, check_spec, software_identity
from pcast_jax.sweep.store import (
    check_probes,
    chunk_path,
    claim_dir,
    empty_results,
    fill,
    load_result,
    merge,
    probe_path,
    save_chunk,
    scan,
    write_probe,
)

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "ProcessInfo", "init_distributed", "process_info",
           "run_sweep_distributed"]

#: Default seconds to wait for the coordinator and for every process to join.
DEFAULT_TIMEOUT_S = 300.0
#: Largest timeout accepted (one week): JAX's own deadline is a 32-bit count of seconds.
MAX_TIMEOUT_S = 7 * 86400.0
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

    Returns:
      This process's :class:`ProcessInfo`.

    Raises:
      PcastError: bad arguments, no cluster detected, the coordinator's port is taken, or the
        timeout passed.
    """
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
    timeout_s = check_positive("timeout_s", timeout_s, max_abs=MAX_TIMEOUT_S)

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


# --------------------------------------------------------------------------------------------
# Agreement between processes
# --------------------------------------------------------------------------------------------


def _allgather_json(obj) -> list:
    """Collective: every process's small JSON-able ``obj``, in process order."""
    blob = json.dumps(obj, separators=(",", ":")).encode()
    if len(blob) > _EXCHANGE_BYTES:
        raise PcastError(f"internal: {len(blob)}-byte message exceeds the {_EXCHANGE_BYTES}-byte exchange")
    buf = np.zeros(_EXCHANGE_BYTES, np.uint8)
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), _EXCHANGE_BYTES)
    return [json.loads(bytes(r).rstrip(b"\0")) for r in rows]


def _agree(error: BaseException | None, **data) -> list[dict]:
    """Collective check-point: if any process failed, every process raises; else every process's ``data``.

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


def _check_identity(spec: SweepSpec) -> None:
    """Refuse (on every process) unless every process runs the same spec with the same software."""
    rows = _agree(None, **software_identity(spec), local_devices=jax.local_device_count())
    ref = rows[0]
    for i, row in enumerate(rows[1:], start=1):
        for key in ("fingerprint", "pcast_jax", "jax", "jaxlib", "local_devices"):
            if row[key] != ref[key]:
                what = "sweep spec" if key == "fingerprint" else key
                raise PcastError(
                    f"process {i} runs a different {what} than process 0 ({key} {row[key]!r} vs {ref[key]!r}); "
                    "every process must be started with the same sweep arguments and software"
                    + (" and the same number of local devices" if key == "local_devices" else ""))


def _claim(out: Path | None, spec: SweepSpec, chunk_size, memory_budget) -> dict:
    """Process 0: choose the layout and claim the folder (the saved layout on resume)."""
    layout = plan_process_layout(spec, local_devices=jax.local_device_count(), num_processes=jax.process_count(),
                                 chunk_size=chunk_size, memory_budget=memory_budget)
    return layout if out is None else claim_dir(out, spec, layout)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_sweep_distributed(spec: SweepSpec, out_dir: str | os.PathLike | None = None, *,
                          chunk_size: int | None = None, progress: bool | None = None,
                          memory_budget: int | None = None) -> SweepResult:
    """Run (or resume) one sweep over every process's devices; every process calls it alike.

    The sweep is cut into the chunks a single-process run uses (``chunk_size`` seeds × one Δ
    group of one N). Each compiled call computes up to one missing chunk per process, with the seed
    axis sharded over a global 1-D mesh of every process's devices; process p's devices hold chunk
    p, laid out exactly as a single-process run on one such host lays it out, so every instance is
    computed by the same per-device program and the results are bit-identical. With ``out_dir``
    each process writes its chunk to ``chunks/`` (the single-process file format: a run can be
    resumed with any process count, including one) and process 0 merges everything into
    ``results.npz`` and ``summary.csv``; without it, each call's rows are gathered to every process.
    A chunk count that does not divide over the processes, or a chunk that does not divide over a
    process's devices, is padded (the padding is computed and dropped).

    Args:
      spec: the sweep; it must be the same on every process.
      out_dir: output folder shared by every process, or None.
      chunk_size: seeds per chunk (process 0's value counts; the saved layout on resume). By
        default as large as ``memory_budget`` allows on one host, capped so that every process
        gets a chunk.
      progress: progress bar on process 0 (default: when its stderr is a terminal).
      memory_budget: bytes one chunk may use on one process (default as in ``run_sweep``).

    Returns:
      The :class:`~pcast_jax.sweep.SweepResult`, on every process.

    Raises:
      PcastError: on every process, when the processes were given different specs or software, the
        folder holds another sweep or is not shared by every process, or one process failed.
    """
    check_spec(spec)
    setup_compilation_cache()
    pid, nproc = jax.process_index(), jax.process_count()
    _check_identity(spec)
    fp = spec.fingerprint()
    out = Path(out_dir) if out_dir is not None else None

    token = secrets.token_hex(8) if pid == 0 else ""
    layout, err = _guard(_claim, out, spec, chunk_size, memory_budget) if pid == 0 else (None, None)
    shared = _agree(err, layout=layout, token=token)[0]  # spec.json exists once this returns
    token = shared["token"]
    todo = units(spec, shared["layout"])
    data = empty_results(spec)

    missing = np.ones(len(todo), bool)
    if out is not None:
        _agree(_guard(write_probe, out, pid, token)[1])
        _agree(_guard(check_probes, out, nproc, token)[1] if pid == 0 else None)
        probe_path(out, pid, token).unlink(missing_ok=True)
        if pid == 0:
            scanned, err = _guard(scan, out, spec, todo, data)
            if err is None:
                missing = scanned
        _agree(err)
        missing = np.asarray(multihost_utils.broadcast_one_to_all(missing.astype(np.uint8)), np.uint8) > 0
    calls = plan_calls(todo, missing, nproc)
    local = jax.local_device_count()
    if pid == 0:
        logger.info("sweep %s: %d processes x %d devices, %d of %d chunks to compute in %d calls",
                    fp, nproc, local, int(missing.sum()), len(todo), len(calls))

    mesh = global_mesh()
    written = []  # process 0: chunks the other processes wrote, to merge at the end

    def dispatch(call):
        seeds, slot = call_seeds(spec, call, num_processes=nproc, local_devices=local)
        d0, d1 = call[0].bounds[2:]
        deltas = np.asarray(spec.deltas, np.float32)[d0:d1]
        return start_global_call(spec, spec.ns[call[0].ni], seeds, deltas, mesh), slot

    def finish(call, started):
        outs, slot = started
        if out is None:
            full = multihost_utils.process_allgather(outs, tiled=True)
            for p, unit in enumerate(call):
                start = p * slot
                fill(data, unit, {m: np.asarray(v)[start:start + unit.bounds[1] - unit.bounds[0]]
                                  for m, v in full.items()})
            return
        if pid < len(call):
            unit = call[pid]
            start = pid * slot
            vals = {m: local_rows(v, start, start + unit.bounds[1] - unit.bounds[0]) for m, v in outs.items()}
            save_chunk(chunk_path(out, spec, unit), spec, unit, vals)
            if pid == 0:
                fill(data, unit, vals)
        if pid == 0:
            written.extend(call[1:])

    err = None
    with progress_bar(progress if pid == 0 else False, len(calls), desc=f"sweep x{nproc}", unit="call") as advance:
        try:
            pending = None
            for call in calls:  # dispatch the next call before storing the previous one's rows
                started = (call, dispatch(call))
                if pending is not None:
                    finish(*pending)
                    advance()
                pending = started
            if pending is not None:
                finish(*pending)
                advance()
        except Exception as exc:  # noqa: BLE001 - agreed below so that no process waits forever
            err = exc
    _agree(err)  # every process has written its chunks once this returns
    if out is None:
        return SweepResult(spec, data)
    result, err = _guard(merge, out, spec, written, data) if pid == 0 else (None, None)
    _agree(err)
    return result if pid == 0 else load_result(out)
