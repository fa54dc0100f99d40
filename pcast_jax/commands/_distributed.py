"""The ``pcast sweep`` options that start the multi-process runtime (see docs/guides/scale_out.md).

A multi-process run fails like one program: whatever ends one process (an error, Ctrl-C, a kill,
a lost coordinator) ends every process within ``--heartbeat-timeout`` seconds (``--init-timeout``
while starting), each with one ``pcast: error:`` line and a documented exit status
(:data:`~pcast_jax.errors.EXIT_ERROR`, :data:`~pcast_jax.errors.EXIT_PEER_FAILED`,
:data:`~pcast_jax.errors.EXIT_INTERRUPTED`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import signal
import sys
import tempfile
import typing

from pcast_jax.errors import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PEER_FAILED,
    MAX_TIMEOUT_S,
    PcastError,
)

if typing.TYPE_CHECKING:
    from pcast_jax.sweep.multihost import ProcessInfo

# pcast_jax.sweep.multihost (which imports JAX) is imported where a run starts, not here: `pcast sweep
# --help` only needs the options.

__all__ = ["add_distributed_arguments", "init_from_args", "failing_together", "supervise", "wants_distributed",
           "MAX_INIT_TIMEOUT_S"]

#: Largest ``--init-timeout`` and ``--heartbeat-timeout`` (seconds).
MAX_INIT_TIMEOUT_S = MAX_TIMEOUT_S
#: A native log line of JAX's runtime, e.g. ``F1201 09:27:36.863147   6646 client.h:86] ...``, or of
#: Gloo (``[Gloo] Rank 0 is connected to 1 peer ranks. ...``).
_NATIVE_LINE = re.compile(rb"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] |\[Gloo\] )")
#: A line the command itself writes (its messages, Python's logging, a progress bar).
_OWN_LINE = re.compile(rb"^(pcast|Traceback|WARNING|INFO|ERROR|DEBUG|CRITICAL)|\r")
#: Exit statuses the command itself chooses; any other status of the child is a native end.
_OWN_CODES = (0, EXIT_ERROR, EXIT_PEER_FAILED, EXIT_INTERRUPTED, 128 + signal.SIGTERM)


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id`` and the two timeouts."""
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
    group.add_argument("--heartbeat-timeout", dest="heartbeat_timeout", metavar="SECONDS", type=float,
                       default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                       help="once running, a process silent this long counts as lost and every process "
                            "stops; also the longest the processes wait for each other at exit "
                            f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")


def wants_distributed(args: argparse.Namespace) -> bool:
    """Whether the parsed ``args`` ask for a multi-process run."""
    explicit = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    return bool(getattr(args, "distributed", False)) or any(v is not None for v in explicit)


def init_from_args(args: argparse.Namespace, *, supervisor: int | None = None) -> ProcessInfo | None:
    """Start the runtime when the parsed ``args`` ask for it; None for a single-process run.

    A multi-process run also gets :func:`~pcast_jax.sweep.multihost.watch_run`: Ctrl-C, SIGTERM,
    another process's failure and the end of the process ``supervisor`` (see :func:`supervise`)
    end this process at once with one line.
    """
    if not wants_distributed(args):
        return None
    from pcast_jax.sweep.multihost import check_start_arguments, init_distributed, watch_run

    explicit, timeouts = _start_arguments(args)
    check_start_arguments(*explicit, **timeouts)  # bad arguments change nothing in this process
    watch_run(supervisor)
    _stdout_for_output_only()
    return init_distributed(*explicit, **timeouts)


def _stdout_for_output_only() -> None:
    """Point file descriptor 1 at stderr and keep the real stdout for Python's ``sys.stdout`` alone.

    The runtime's native code writes to descriptor 1 (Gloo's ``[Gloo] Rank N is connected to ...``
    on every process of a multi-process CPU run); stdout must carry only what the command prints
    (``--format json|csv`` is read by other programs). Those lines go to stderr, where the
    supervising process drops them (:data:`_NATIVE_LINE`).
    """
    out = sys.stdout
    out.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(real, "w"), encoding=getattr(out, "encoding", None) or "utf-8",
                                  errors=getattr(out, "errors", None) or "strict",
                                  line_buffering=bool(getattr(out, "line_buffering", False)))


def _start_arguments(args: argparse.Namespace) -> tuple[list, dict]:
    explicit = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    timeouts = dict(timeout_s=getattr(args, "init_timeout", DEFAULT_TIMEOUT_S),
                    heartbeat_timeout_s=getattr(args, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT_S))
    return explicit, timeouts


def _unsafe_to_fork() -> bool:
    """Whether this process already runs threads a fork would copy mid-work: Python threads, or
    JAX's runtime (its backend threads start with the first computation). Checked through
    ``jax._src.xla_bridge.backends_are_initialized`` (present in jax 0.11 and 0.12); where that
    is missing, Python's thread count alone decides."""
    import threading

    if threading.active_count() > 1:
        return True
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


@contextlib.contextmanager
def failing_together(info: ProcessInfo | None):
    """Run the body of a command; in a multi-process run, an error only this process has ends it at once.

    An error every process raised alike (agreed through the run's collectives) propagates as
    usual: every process reports it and they exit together. Any other error would leave the
    other processes waiting, so it is printed and this process ends now
    (:func:`~pcast_jax.sweep.multihost.exit_run`, which tells the others): exit status
    :data:`~pcast_jax.errors.EXIT_ERROR` for bad input or a file error; otherwise a collective
    failed because another process is gone, :data:`~pcast_jax.errors.EXIT_PEER_FAILED`, naming
    that process's own failure when it left a notice.
    """
    if info is None or info.num_processes == 1:
        yield
        return
    from pcast_jax.sweep.multihost import exit_run, is_agreed, peer_notice

    try:
        yield
    except Exception as exc:
        if is_agreed(exc):
            raise
        who = f"process {info.process_id} of {info.num_processes}"
        text = (str(exc).strip().splitlines() or [""])[0][:500]
        if isinstance(exc, (PcastError, OSError)):
            exit_run(EXIT_ERROR, f"{who} failed: {text}")
        notice = peer_notice()
        if notice is not None:
            exit_run(EXIT_PEER_FAILED, f"{who} stops because {notice}", notify=False)
        exit_run(EXIT_PEER_FAILED, f"{who} lost contact with another process of the run ({type(exc).__name__}: "
                                   f"{text}); the run stops (finished chunks are kept)")


def supervise(args: argparse.Namespace) -> int | None:
    """Run the rest of a multi-process command in a child process, so that it always ends with one line.

    JAX's runtime ends a process natively (an abort with a stack trace, or a crash) when it loses
    the coordinator, misses another process's heartbeat or fails its exit barrier; nothing in the
    process can catch that. So this process forks: the child returns from here (with this
    process's id, for :func:`init_from_args`) and does the work; this process forwards Ctrl-C and
    SIGTERM to it, relays its stderr without JAX's native log lines, and exits with its status —
    or, when the child ended natively, prints one ``pcast: error:`` line naming what happened and
    exits with :data:`~pcast_jax.errors.EXIT_PEER_FAILED`. The child's whole stderr is then kept
    in a log file the line names. Where processes cannot fork, or this process already runs
    threads (JAX's runtime started earlier, as when a command is called from Python after other
    JAX work: a forked copy of a threaded process can deadlock), returns None and does nothing:
    the command then runs unsupervised in this process. Bad arguments are refused before any fork.
    """
    from pcast_jax.sweep.multihost import check_start_arguments, take_signals

    explicit, timeouts = _start_arguments(args)
    check_start_arguments(*explicit, **timeouts)
    if not hasattr(os, "fork") or _unsafe_to_fork():
        return None
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        return parent
    os.close(write_fd)

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:  # it has just ended; its status follows
            pass

    take_signals(forward)
    transcript = collections.deque(maxlen=2000)
    saw_error = _relay(read_fd, transcript)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code in _OWN_CODES:
        sys.exit(code)
    if saw_error:  # the child reported its error, then ended natively at the exit barrier
        sys.exit(EXIT_ERROR)
    who = "this process" if getattr(args, "process_id", None) is None else \
        f"process {args.process_id} of {args.num_processes}"
    if code < 0 and -code not in (signal.SIGABRT, signal.SIGSEGV):  # killed from outside (kill, OOM)
        print(f"pcast: error: {who}: its worker was killed by {signal.Signals(-code).name}; the run stops "
              "(finished chunks are kept)", file=sys.stderr, flush=True)
        sys.exit(128 - code)
    log = _save_transcript(transcript)
    cause = _native_cause(b"".join(transcript).decode(errors="replace"), args)
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    print(f"pcast: error: {who}: {cause}; the run stops (finished chunks are kept; the runtime ended "
          f"it with {how}{'' if log is None else ', details in ' + log})", file=sys.stderr, flush=True)
    sys.exit(EXIT_PEER_FAILED)


def _relay(read_fd: int, transcript) -> bool:
    """Copy the child's stderr to ours until it closes, leaving out JAX's native log lines.

    A native line is dropped with the lines that continue it (up to the next line the command
    writes itself). Returns whether the child printed a ``pcast: error:`` line.
    """
    saw_error, native = False, False

    def relay(line: bytes) -> None:
        nonlocal saw_error, native
        transcript.append(line)
        if _NATIVE_LINE.match(line):
            native = True
        elif _OWN_LINE.search(line):
            native = False
        if not native:
            saw_error |= line.startswith(b"pcast: error:")
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            *lines, pending = re.split(rb"(?<=[\n\r])", pending + chunk)
            for line in lines:
                relay(line)
        if pending:  # a last line without its newline
            relay(pending)
    return saw_error


def _native_cause(text: str, args: argparse.Namespace) -> str:
    """What the runtime's last words (its fatal log line) say happened, in one phrase."""
    fatal = [line.split("] ", 1)[-1] for line in text.splitlines() if re.match(r"^F\d{4} ", line)]
    reason = (fatal[-1] if fatal else text).split("absl::Status:", 1)[-1].strip()
    low = reason.lower()
    heartbeat = getattr(args, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT_S)
    from pcast_jax.sweep.multihost import duplicate_id_text

    twice = re.search(r"(\d+) unexpectedly tried to connect with a different incarnation", reason)
    if twice:
        return duplicate_id_text(twice.group(1))
    if "already_exists" in low and "incarnation" in low:  # this process's id was taken over by another
        return duplicate_id_text(getattr(args, "process_id", None))
    if "heartbeat" in low:
        # The runtime lists the silent processes on the next line: "1", or "/job:…/task:1".
        listed = (re.findall(r"stopped sending heartbeats\):[ \t]*\n?([^\n]*)", text, re.I) or [""])[-1]
        tasks = re.findall(r"task:(\d+)", listed) or re.findall(r"\d+", listed)
        who = f"process {', '.join(tasks)}" if tasks else "another process of the run"
        return (f"lost {who}: it sent no heartbeat for --heartbeat-timeout={heartbeat:g} s "
                "(killed, crashed, hung or unreachable)")
    if "leader" in low or "coordination service" in low or "unavailable" in low:
        return "lost the coordinator (process 0): it stopped or was killed, or the network failed"
    if "barrier" in low:
        return f"not every process reached the end of the run within --heartbeat-timeout={heartbeat:g} s"
    return f"the distributed runtime failed ({(reason if fatal else 'no message')[:300]})"


def _save_transcript(transcript) -> str | None:
    try:
        fd, path = tempfile.mkstemp(prefix="pcast-process-", suffix=".log")
        with os.fdopen(fd, "wb") as f:
            f.writelines(transcript)
        return path
    except OSError:
        return None
