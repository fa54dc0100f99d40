"""The multi-process sweep driver: one sweep over many processes and hosts (``jax.distributed``).

One module, over 600 lines: the collectives that keep every process agreeing (a refusal, a failure, the
missing chunks, the merge) are one protocol and are read together.

Every process runs the same program: :func:`init_distributed` joins the runtime, then
:func:`run_sweep_distributed` (also reached through :func:`pcast_jax.sweep.run_sweep` once more
than one process runs) computes up to one chunk per process in each compiled call, over one mesh of
every process's devices. Process p's devices hold chunk p, laid out as a single-process run on one
such host lays it out, so results are bit-identical to a single-process run with the same chunk
size. Each process writes its own chunk files; process 0 reads what exists, tells every process
which chunks are missing, and merges the results. Every check that can fail on one process is
agreed through a small collective, so a refusal is raised on every process instead of leaving the
others waiting. Whatever else ends one process (Ctrl-C, SIGTERM, an error of its own) leaves a
notice that stops the others at once (:func:`watch_run`, :func:`exit_run`); a process that
vanishes without one is found by JAX's heartbeat (``heartbeat_timeout_s``).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import jax
import numpy as np
from jax._src import distributed as _jax_distributed
from jax.experimental import multihost_utils

from pcast_jax.errors import (  # the timeouts live there so that the command line's help needs no JAX
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    EXIT_INTERRUPTED,
    EXIT_PEER_FAILED,
    MAX_TIMEOUT_S,
    PcastError,
    check_int,
    check_positive,
)
from pcast_jax.sweep.compute import global_mesh, local_rows, start_global_call
from pcast_jax.sweep.plan import call_seeds, plan_calls, plan_process_layout, units
from pcast_jax.sweep.progress import progress_bar
from pcast_jax.sweep.spec import SweepResult, SweepSpec, check_spec, software_identity
from pcast_jax.sweep.store import (
    check_finite_metrics,
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

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_HEARTBEAT_TIMEOUT_S", "MAX_TIMEOUT_S", "ProcessInfo",
           "check_start_arguments", "exit_run", "init_distributed", "is_agreed", "peer_notice", "process_info",
           "run_sweep_distributed", "take_signals", "watch_run"]

_WATCH_INTERVAL_S = 0.25  # how often a process looks for another process's failure notice
_NOTICE_DIR = "pcast_failed/"  # key-value directory where a failing process leaves its one line
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


def check_start_arguments(coordinator=None, num_processes=None, process_id=None, *,
                          timeout_s: float = DEFAULT_TIMEOUT_S,
                          heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
    """Raise :class:`PcastError` unless :func:`init_distributed` accepts these arguments."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise PcastError(f"{', '.join(missing)} must be given too: pass coordinator, num_processes and "
                             "process_id together, or none of them to let JAX detect the cluster")
        _parse_coordinator(coordinator)
        check_int("num_processes", num_processes, min_value=1)
        check_int("process_id", process_id, min_value=0, max_value=num_processes - 1)
    check_positive("timeout_s", timeout_s, max_abs=MAX_TIMEOUT_S)
    check_positive("heartbeat_timeout_s", heartbeat_timeout_s, max_abs=MAX_TIMEOUT_S)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
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
      heartbeat_timeout_s: once running, a process silent this long counts as lost, and exiting
        processes wait at most this long for each other. JAX then ends every other process
        natively (an abort, which ``pcast sweep`` turns into one line: see
        :mod:`pcast_jax.commands._distributed`).
      local_device_ids: restrict this process to these local devices (JAX's default otherwise).

    Returns:
      This process's :class:`ProcessInfo`.

    Raises:
      PcastError: bad arguments, no cluster detected, the coordinator's port is taken (process 0
        checks it first: JAX's coordinator crashes the process when it cannot bind), or the
        timeout passed.
    """
    check_start_arguments(coordinator, num_processes, process_id, timeout_s=timeout_s,
                          heartbeat_timeout_s=heartbeat_timeout_s)
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if explicit:
        host, port = _parse_coordinator(coordinator)
    heartbeat_s = int(math.ceil(heartbeat_timeout_s))

    if jax.distributed.is_initialized():
        info = process_info(coordinator)
        if explicit and (info.num_processes, info.process_id) != (num_processes, process_id):
            raise PcastError(
                f"the distributed runtime already runs as process {info.process_id} of {info.num_processes}; "
                f"it cannot be restarted as process_id={process_id} of num_processes={num_processes}")
        return info

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout_s
    if explicit and process_id == 0:
        _check_port_free(port, coordinator)
    if explicit and process_id != 0:
        _wait_for_coordinator(host, port, deadline, coordinator=coordinator, process_id=process_id,
                              num_processes=num_processes, timeout_s=timeout_s)
    left = max(deadline - time.monotonic(), 0.5)
    kwargs = dict(initialization_timeout=int(math.ceil(left)) + _RUNTIME_GRACE_S,
                  heartbeat_timeout_seconds=heartbeat_s, shutdown_timeout_seconds=heartbeat_s)
    _RUN.update(process_id=process_id, num_processes=num_processes)
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
            "process joined; start all processes 0 .. num_processes-1, each id given to exactly one process, "
            "with the same coordinator and num_processes (this process must exit before retrying)")
    exc = outcome.get("error")
    if exc is not None:
        raise _start_error(exc, explicit=explicit, coordinator=coordinator, process_id=process_id) from exc
    info = process_info(coordinator)
    _RUN.update(process_id=info.process_id, num_processes=info.num_processes, running=True)
    # Registered after jax.distributed's own shutdown handler, so it runs first (atexit is LIFO): the
    # watcher stops asking the key-value store before the client is torn down under it.
    atexit.register(_stop_watching)
    _check_device_counts(info, max(deadline - time.monotonic(), 1.0))
    return info


def _check_device_counts(info: ProcessInfo, timeout_s: float) -> None:
    """Refuse, on every process alike, processes with different numbers of local devices.

    The sweep's collectives need the same count everywhere (they fail with a bare shape error
    otherwise), so the counts are compared through the runtime's key-value store first.
    """
    if info.num_processes == 1:
        return
    client = _jax_distributed.global_state.client
    client.key_value_set(f"pcast_devices/{info.process_id}", str(info.local_devices))
    try:
        counts = [int(client.blocking_key_value_get(f"pcast_devices/{p}", int(timeout_s * 1000)))
                  for p in range(info.num_processes)]
    except Exception as exc:  # noqa: BLE001 - a process vanished while starting
        raise PcastError(f"not every process reported its devices within the start-up timeout ({exc})") from None
    if len(set(counts)) > 1:
        raise _agreed(PcastError(
            "the processes have different numbers of local devices ("
            + ", ".join(f"process {p}: {c}" for p, c in enumerate(counts))
            + "); start every process with the same number of devices"))


def _check_port_free(port: int, coordinator: str) -> None:
    """Process 0: refuse a coordinator port that something already holds on this host.

    JAX's coordinator binds every address ([::]:PORT) and ends the process natively (a
    segmentation fault) when it cannot, so the bind is tried here first. A second process started
    as process 0 is refused here too: the first one holds the port.
    """
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator binds
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    continue  # the address family cannot bind here at all
                raise PcastError(
                    f"coordinator={coordinator!r}: port {port} is already in use on this host "
                    f"({exc.strerror}): another program holds it, or another process was started with "
                    "process_id=0 (each id must be given to exactly one process); choose a free port") from None


def duplicate_id_text(process_id) -> str:
    """What a process refused by the coordinator for connecting under a taken id says (one phrase)."""
    return (f"process {process_id} connected twice: two processes were started with --process-id {process_id} "
            "(each id must be given to exactly one process), or it restarted")


def _start_error(exc: BaseException, *, explicit: bool, coordinator, process_id=None) -> PcastError:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    low = text.lower()
    if "already_exists" in low or "incarnation" in low:
        return PcastError(duplicate_id_text(process_id))
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
# Failing together: every way one process ends, the others end too, each with one line
# --------------------------------------------------------------------------------------------

_RUN: dict = {"process_id": None, "num_processes": None, "running": False}  # running: connected
_EXIT_LOCK = threading.Lock()
_POLL_LOCK = threading.Lock()  # held while a thread asks the key-value store


def _stop_watching() -> None:
    """At a normal exit: no more key-value requests (one in flight is waited for, up to 5 s)."""
    if _POLL_LOCK.acquire(timeout=5.0):
        _RUN["running"] = False
        _POLL_LOCK.release()
    else:
        _RUN["running"] = False


def _who() -> str:
    pid, n = _RUN["process_id"], _RUN["num_processes"]
    return "this process" if pid is None else f"process {pid} of {n}"


def exit_run(code: int, message: str, *, notify: bool = True) -> NoReturn:
    """Print ``pcast: error: <message>`` and end this process now with exit status ``code``.

    Used wherever a multi-process run cannot go on. ``os._exit`` skips JAX's exit barrier, which
    would wait for processes that are gone and then abort natively. With ``notify`` the line is
    first left in the runtime's key-value store (for at most a second), so the other processes stop
    at once and name this process's failure (see :func:`watch_run`). Any thread may call it; the
    first call wins and later ones wait for the end.
    """
    if not _EXIT_LOCK.acquire(blocking=False):
        while True:
            time.sleep(3600)
    if notify and _RUN["running"]:
        notice = threading.Thread(target=_leave_notice, args=(message,), daemon=True)
        notice.start()
        notice.join(1.0)
        if _RUN["process_id"] == 0:  # the coordinator ends with this process: let the others read it first
            time.sleep(2 * _WATCH_INTERVAL_S)
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.write(2, f"pcast: error: {message}\n".encode(errors="replace"))
    os._exit(code)


def _leave_notice(message: str) -> None:
    try:
        _jax_distributed.global_state.client.key_value_set(f"{_NOTICE_DIR}{_RUN['process_id']}", message)
    except Exception:  # noqa: BLE001 - the coordinator may be gone; the others then see that instead
        pass


def watch_run(supervisor: int | None = None) -> None:
    """Make this process of a multi-process run stop at once, cleanly, when it or another one fails.

    Call it from the main thread before :func:`init_distributed` (the command line does); it turns off
    JAX's preemption service, which would otherwise take SIGTERM. Ctrl-C (SIGINT) and SIGTERM end this
    process through :func:`exit_run` (exit status 130 or 143) even while it waits in native code (one
    inherited as ignored stays ignored: :func:`take_signals`), and leave a notice for the other
    processes; a watcher thread ends this process with :data:`~pcast_jax.errors.EXIT_PEER_FAILED` as
    soon as another process leaves such a notice, or when the process ``supervisor`` (the one that
    started this one) is gone. Processes that end without a notice (killed, crashed, hung) are found by
    JAX's heartbeat (``heartbeat_timeout_s`` of :func:`init_distributed`), which aborts the others
    natively.
    """
    # JAX's preemption service would take SIGTERM over natively (as a notice to checkpoint, the run
    # going on); a sweep has no use for it: every finished chunk is already on disk.
    jax.config.update("jax_enable_preemption_service", False)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    take_signals(_on_signal)
    # The C-level handler writes each signal here at once; the main thread may be inside a native
    # call for minutes before Python's handler would run.
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_signals, args=(read_fd,), name="pcast-signals", daemon=True).start()
    threading.Thread(target=_watch_others, args=(supervisor,), name="pcast-peers", daemon=True).start()


def take_signals(handler) -> tuple[int, ...]:
    """Handle SIGINT and SIGTERM with ``handler``, except a signal this process inherited as ignored.

    A command started under ``nohup`` or as a background job of a shell inherits SIGINT ignored:
    whoever started it asked that Ctrl-C not reach it, so it keeps ignoring it. Returns the signals taken.
    """
    taken = tuple(s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN)
    for signum in taken:
        signal.signal(signum, handler)
    return taken


def _on_signal(signum, _frame=None) -> None:
    if _EXIT_LOCK.locked():  # this thread may be the one already exiting
        return
    if signum == signal.SIGINT:
        exit_run(EXIT_INTERRUPTED, f"{_who()} was interrupted (Ctrl-C, SIGINT); the run stops "
                                   "(finished chunks are kept)")
    exit_run(128 + signum, f"{_who()} was stopped by {signal.Signals(signum).name}; the run stops "
                           "(finished chunks are kept)")


def _watch_signals(read_fd: int) -> None:
    while True:
        for signum in os.read(read_fd, 64):
            if signum in (signal.SIGINT, signal.SIGTERM):
                _on_signal(signum)


def _watch_others(supervisor: int | None) -> None:
    while True:
        if supervisor is not None and os.getppid() != supervisor:
            exit_run(EXIT_PEER_FAILED, f"{_who()} was killed (its pcast process ended)")
        notice = peer_notice(wait_s=0)
        if notice is not None:
            exit_run(EXIT_PEER_FAILED, f"{_who()} stops because {notice}", notify=False)
        time.sleep(_WATCH_INTERVAL_S)


def peer_notice(wait_s: float = 1.0) -> str | None:
    """The line another process left when it failed (see :func:`exit_run`), waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        # Only a connected client may ask: a request during connect() ends the process natively.
        with _POLL_LOCK:
            client = _jax_distributed.global_state.client if _RUN["running"] else None
            try:
                notices = [] if client is None else client.key_value_dir_get(_NOTICE_DIR)
            except Exception:  # noqa: BLE001 - coordinator gone: nothing to read
                notices = []
        for key, message in notices:
            if key.rsplit("/", 1)[-1] != str(_RUN["process_id"]):
                return message
        if time.monotonic() >= deadline:
            return None
        time.sleep(_WATCH_INTERVAL_S)


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
        raise _agreed(error)
    for i, row in enumerate(rows):
        if row["failed"]:
            raise _agreed(PcastError(f"process {i} of {len(rows)} failed: {row['error']}"))
    return [r["data"] for r in rows]


def _agreed(exc: BaseException) -> BaseException:
    exc.pcast_agreed = True
    return exc


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` is raised on every process alike (decided through a collective check-point)."""
    return getattr(exc, "pcast_agreed", False)


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
                raise _agreed(PcastError(
                    f"process {i} runs a different {what} than process 0 ({key} {row[key]!r} vs {ref[key]!r}); "
                    "every process must be started with the same sweep arguments and software"
                    + (" and the same number of local devices" if key == "local_devices" else "")))


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
                                  for m, v in full.items()}, spec)
            return
        if pid < len(call):
            unit = call[pid]
            start = pid * slot
            vals = {m: local_rows(v, start, start + unit.bounds[1] - unit.bounds[0]) for m, v in outs.items()}
            check_finite_metrics(spec, unit, vals)  # a non-finite chunk is never written
            save_chunk(chunk_path(out, spec, unit), spec, unit, vals)
            if pid == 0:
                fill(data, unit, vals, spec)
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
