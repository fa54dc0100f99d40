"""A multi-process ``pcast sweep`` fails like one program: every way one process ends ends them all.

Each test starts real ``pcast sweep`` processes (two, CPU, a tiny sweep) on one local coordinator,
breaks the run one way — Ctrl-C, a killed worker or coordinator, a taken port, a duplicate process
id, different device counts — and checks every process: it ends within the bound the flags set
(``--heartbeat-timeout`` once running, ``--init-timeout`` while starting, plus slack for a loaded
machine), its stderr ends with one ``pcast: error:`` line and holds no native crash text, and it
exits with the documented status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcast_jax.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PEER_FAILED, PcastError

from cases import subprocess_env

HEARTBEAT_S = 5
INIT_S = 30
SLACK_S = 15  # start-up of the survivor's exit and a loaded CI machine
# Long enough (2000 chunks) that a failure lands mid-run; tiny instances, so each call is fast.
SWEEP = ["sweep", "--configs", "fwd_s1", "--delta", "7", "--n", "64", "--seeds", "4000", "--q-len", "4",
         "--d", "8", "--k-sink", "2", "--chunk-size", "2", "--no-progress", "--heartbeat-timeout", str(HEARTBEAT_S)]
NATIVE = ("Fatal Python error", "Aborted", "Check failed", "Check failure", "Traceback", "Segmentation fault")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, tmp: Path) -> dict:
    # the runtime's last words are kept in TMPDIR
    return {**subprocess_env(devices), "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}


def _start(out: Path, port: int, process_id: int, *, devices: int = 1, init_s: float = INIT_S,
           sweep=SWEEP, stdout=subprocess.DEVNULL, num_processes: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pcast_jax.cli", *sweep, "--out", str(out), "--init-timeout", str(init_s),
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
           "--process-id", str(process_id)]
    return subprocess.Popen(cmd, env=_env(devices, out.parent), stdout=stdout, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it, whatever the suite inherited (a suite started under
    nohup or as a background job ignores SIGINT, and a command that inherits that keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def launched():
    """Every process a test starts; whatever is still running at the end is killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait_for_chunks(out: Path, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "chunks").is_dir() or not any((out / "chunks").glob("*.npz")):
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a process ended before the run started: {p.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail("the run wrote no chunk in time")
        time.sleep(0.05)


def _worker(proc: subprocess.Popen) -> int:
    """The process that runs JAX under a multi-process ``pcast sweep`` (its only child)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _ended(proc: subprocess.Popen, since: float, bound: float) -> tuple[int, str]:
    """Wait for ``proc``; it must end within ``bound`` seconds of ``since``. (exit status, stderr)."""
    try:
        _, err = proc.communicate(timeout=max(0.1, since + bound - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running {bound:g} s after the failure; stderr:\n{err[-2000:]}")
    return proc.returncode, err


def _assert_one_line(rc: int, err: str, code: int, *phrases: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, f"exit {rc} with nothing on stderr"
    assert lines[-1].startswith("pcast: error:"), err[-2000:]
    assert sum(line.startswith("pcast: error:") for line in lines) == 1, err[-2000:]
    for bad in NATIVE:
        assert bad not in err, f"{bad!r} in stderr:\n{err[-2000:]}"
    for phrase in phrases:
        assert phrase in lines[-1], lines[-1]
    assert rc == code, f"exit {rc}, expected {code}: {lines[-1]}"


def test_healthy_run_is_relayed_unchanged(tmp_path, launched):
    """The supervising process adds nothing to a run that works: exit 0, the table, an empty stderr."""
    port, out = _free_port(), tmp_path / "out"
    tiny = [a if a != "4000" else "4" for a in SWEEP]
    launched += [_start(out, port, i, sweep=tiny, stdout=subprocess.PIPE) for i in range(2)]
    t0 = time.monotonic()
    for i, p in enumerate(launched):
        stdout, err = p.communicate(timeout=INIT_S + 60)
        assert p.returncode == 0, err[-2000:]
        assert not err.strip(), err[-2000:]
        if i == 0:
            assert "frac. zeroed %" in stdout and "on 2 processes" in stdout, stdout
    assert (out / "results.npz").is_file()
    assert time.monotonic() - t0 < INIT_S + 60


@pytest.mark.slow
@pytest.mark.parametrize("victim, signum", [(1, signal.SIGINT), (0, signal.SIGTERM)])
def test_ctrl_c_or_sigterm_on_one_process_ends_every_process(tmp_path, launched, victim, signum):
    port, out = _free_port(), tmp_path / "out"
    launched += [_start(out, port, i) for i in range(2)]
    _wait_for_chunks(out, launched)
    t0 = time.monotonic()
    launched[victim].send_signal(signum)
    other = 1 - victim
    said = "was interrupted (Ctrl-C, SIGINT)" if signum == signal.SIGINT else "was stopped by SIGTERM"
    rc, err = _ended(launched[victim], t0, SLACK_S)
    _assert_one_line(rc, err, EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum,
                     f"process {victim} of 2 {said}")
    rc, err = _ended(launched[other], t0, HEARTBEAT_S + SLACK_S)
    # The survivor names the stopped process (its notice), or the coordinator it lost with it.
    _assert_one_line(rc, err, EXIT_PEER_FAILED, f"process {other} of 2")
    assert f"process {victim} of 2 {said}" in err or "lost the coordinator" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_worker_ends_every_process(tmp_path, launched, victim):
    """SIGKILL of the process running JAX (as the OOM killer does): no notice, no cleanup."""
    port, out = _free_port(), tmp_path / "out"
    launched += [_start(out, port, i) for i in range(2)]
    _wait_for_chunks(out, launched)
    t0 = time.monotonic()
    os.kill(_worker(launched[victim]), signal.SIGKILL)
    rc, err = _ended(launched[victim], t0, SLACK_S)
    _assert_one_line(rc, err, 128 + signal.SIGKILL, f"process {victim} of 2", "killed by SIGKILL")
    rc, err = _ended(launched[1 - victim], t0, HEARTBEAT_S + SLACK_S)
    _assert_one_line(rc, err, EXIT_PEER_FAILED, f"process {1 - victim} of 2", "lost")
    if victim == 0:
        assert "lost the coordinator" in err, err[-2000:]
        # The runtime's own words are not lost: the line names the file that holds them.
        log = Path(err.split("details in ", 1)[1].split(")")[0])
        assert log.parent == tmp_path and "Terminating process" in log.read_text()


@pytest.mark.slow
def test_hung_process_is_given_up_after_the_heartbeat_timeout(tmp_path, launched):
    """A worker that stops answering (SIGSTOP: as a process stuck in the kernel) sends no heartbeat."""
    port, out = _free_port(), tmp_path / "out"
    launched += [_start(out, port, i) for i in range(2)]
    _wait_for_chunks(out, launched)
    t0 = time.monotonic()
    os.kill(_worker(launched[1]), signal.SIGSTOP)
    rc, err = _ended(launched[0], t0, HEARTBEAT_S + SLACK_S)
    _assert_one_line(rc, err, EXIT_PEER_FAILED, "process 0 of 2: lost process 1: it sent no heartbeat for "
                     f"--heartbeat-timeout={HEARTBEAT_S} s")
    # No lower bound on the time since SIGSTOP: the timeout runs from the last heartbeat received, which a
    # loaded machine may have delivered well before the signal (an earlier 3.9 s < 5 − 1 s was such a case).


@pytest.mark.slow
def test_killed_pcast_process_ends_every_process(tmp_path, launched):
    """SIGKILL of the ``pcast`` process itself: its worker follows it, and the other process stops."""
    port, out = _free_port(), tmp_path / "out"
    launched += [_start(out, port, i) for i in range(2)]
    _wait_for_chunks(out, launched)
    worker = _worker(launched[1])
    t0 = time.monotonic()
    os.kill(launched[1].pid, signal.SIGKILL)
    rc, err = _ended(launched[0], t0, HEARTBEAT_S + SLACK_S)
    _assert_one_line(rc, err, EXIT_PEER_FAILED, "process 0 of 2", "process 1 of 2 was killed")
    deadline = time.monotonic() + SLACK_S
    while Path(f"/proc/{worker}").exists() and Path(f"/proc/{worker}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the killed process's worker is still running"
        time.sleep(0.1)


def test_coordinator_port_in_use_is_refused(tmp_path, launched):
    """Process 0 refuses the taken port at once; process 1, answered by the stranger, gives up at --init-timeout."""
    init_s = 5
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        launched += [_start(tmp_path / "out", port, i, init_s=init_s) for i in range(2)]
        rc, err = _ended(launched[0], t0, SLACK_S)
        _assert_one_line(rc, err, EXIT_ERROR, "process_id=0", f"port {port} is already in use")
        rc, err = _ended(launched[1], t0, init_s + SLACK_S)
    _assert_one_line(rc, err, EXIT_ERROR, "did not start within timeout_s=5")


@pytest.mark.slow
def test_second_process_zero_is_refused_and_the_run_goes_on(tmp_path, launched):
    port, out = _free_port(), tmp_path / "out"
    launched += [_start(out, port, i) for i in range(2)]
    deadline = time.monotonic() + INIT_S
    while True:  # the first process 0 serves the coordinator
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the coordinator never started"
            time.sleep(0.1)
    t0 = time.monotonic()
    launched.append(_start(tmp_path / "other", port, 0))
    rc, err = _ended(launched[2], t0, INIT_S + SLACK_S)
    _assert_one_line(rc, err, EXIT_ERROR, f"port {port} is already in use", "process_id=0")
    for p in launched[:2]:  # the run goes on to its end (with its programs cached it may be there already)
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"the running processes were disturbed: {err[-2000:]}"


@pytest.mark.slow
def test_duplicate_process_id_ends_every_process(tmp_path, launched):
    """Two processes started as process 1: JAX's runtime ends process 0 and one of them; the other
    never joins and gives up at --init-timeout. The sweep is one no pair finishes before the duplicate
    connects, however slowly it starts: it is caught while starting or mid-run, and ends the run alike."""
    init_s = 10
    port, out = _free_port(), tmp_path / "out"
    endless = [a if a != "4000" else "400000" for a in SWEEP]  # minutes of work
    t0 = time.monotonic()
    launched += [_start(out, port, i, init_s=init_s, sweep=endless) for i in (0, 1, 1)]
    rc, err = _ended(launched[0], t0, INIT_S + SLACK_S)
    _assert_one_line(rc, err, EXIT_PEER_FAILED, "process 0 of 2", "two processes were started with --process-id 1")
    outcomes = [_ended(p, t0, init_s + HEARTBEAT_S + SLACK_S) for p in launched[1:]]
    codes = sorted(rc for rc, _ in outcomes)
    assert codes in ([EXIT_ERROR, EXIT_PEER_FAILED], [EXIT_PEER_FAILED, EXIT_PEER_FAILED]), outcomes
    for rc, err in outcomes:
        _assert_one_line(rc, err, rc, "process_id=1" if rc == EXIT_ERROR else "process 1 of 2")


def test_a_duplicate_id_among_three_is_named(tmp_path, launched):
    """Ids 0, 1, 1 of three: the process whose id is taken over names it; the others time out saying
    each id must be given to exactly one process. Every process ends with one line."""
    init_s = 10
    port, out = _free_port(), tmp_path / "out"
    t0 = time.monotonic()
    for i in (0, 1, 1):
        launched.append(_start(out, port, i, init_s=init_s, num_processes=3))
        time.sleep(1.0)  # the second process 1 connects after the first
    outcomes = [_ended(p, t0, init_s + HEARTBEAT_S + SLACK_S) for p in launched]
    named = [err for rc, err in outcomes if "two processes were started with --process-id 1" in err]
    assert len(named) == 1, outcomes
    for rc, err in outcomes:
        _assert_one_line(rc, err, rc)
        assert "ALREADY_EXISTS" not in err.splitlines()[-1], err[-2000:]
        if "two processes were started" not in err:
            assert "each id given to exactly one process" in err, err[-2000:]


def test_different_device_counts_are_refused_on_every_process(tmp_path, launched):
    port, out = _free_port(), tmp_path / "out"
    t0 = time.monotonic()
    launched += [_start(out, port, 0, devices=1), _start(out, port, 1, devices=2)]
    for p in launched:
        rc, err = _ended(p, t0, INIT_S + SLACK_S)
        _assert_one_line(rc, err, EXIT_ERROR, "different numbers of local devices (process 0: 1, process 1: 2)")
    assert not (out / "chunks").exists() or not any((out / "chunks").iterdir())


# Lines as JAX's runtime writes them when it ends a process (from a lost-coordinator abort).
NATIVE_END = (b"W1201 09:37:12.940856   12218 preemption_sync_manager.cc:147] Failed to retrieve preemption notice\n"
              b"Additional GRPC error information from remote target coordination_service:\n"
              b"=== Source Location Trace: === \n"
              b"F1201 09:37:12.940921   12218 client.h:86] Terminating process because the JAX distributed service "
              b"detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. "
              b"Either the leader task was preempted/died/restarted unexpectedly\n"
              b"*** Check failure stack trace: ***\n"
              b"    @     0x7f8d85f3d7d4  absl::log_internal::LogMessage::SendToLog()\n")


def test_relay_leaves_out_native_lines_and_keeps_everything_else(capfd):
    from pcast_jax.commands._distributed import _relay

    own = [b"pcast sweep: 1 configs on 2 processes\n", b" 10%|#  | 1/10\r", b" 20%|## | 2/10\r"]
    read_fd, write_fd = os.pipe()
    sent = own[0] + NATIVE_END + b"".join(own[1:]) + b"pcast: error: the end\nno newline"
    os.write(write_fd, sent)
    os.close(write_fd)
    transcript: list[bytes] = []
    assert _relay(read_fd, transcript)  # it saw the command's own error line
    err = capfd.readouterr().err
    assert err == b"".join(own + [b"pcast: error: the end\nno newline"]).decode()
    assert b"".join(transcript) == sent


@pytest.mark.parametrize("status, says", [
    (b"UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted",
     "lost the coordinator (process 0)"),
    (b"ABORTED: 3 unexpectedly tried to connect with a different incarnation. It has likely restarted.",
     "process 3 connected twice: two processes were started with --process-id 3"),
    (b"UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.",
     "lost process 1: it sent no heartbeat for --heartbeat-timeout=7 s"),
    (b"UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats): /job:w/replica:0/task:2",
     "lost process 2: it sent no heartbeat"),
    (b"INTERNAL: something new", "the distributed runtime failed (INTERNAL: something new)"),
])
def test_native_end_is_named_from_the_fatal_line(status, says):
    from argparse import Namespace

    from pcast_jax.commands._distributed import _native_cause

    text = NATIVE_END.replace(b"UNAVAILABLE: Failed to send RPC to coordination service. "
                              b"Either the leader task was preempted/died/restarted unexpectedly", status)
    assert says in _native_cause(text.decode(), Namespace(heartbeat_timeout=7.0))


def test_a_process_that_already_ran_jax_is_never_forked(monkeypatch):
    """Called from Python after JAX work (a notebook, a test), the multi-process command runs
    unsupervised in the calling process: a forked copy of a threaded process can deadlock."""
    import argparse

    import jax.numpy as jnp

    from pcast_jax.commands import _distributed

    jnp.zeros(2).block_until_ready()  # the backend (and its threads) started
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked a process whose JAX runtime runs"))
    args = argparse.Namespace(coordinator="127.0.0.1:1", num_processes=2, process_id=1, distributed=False,
                              init_timeout=5.0, heartbeat_timeout=5.0)
    assert _distributed.supervise(args) is None
    bad = argparse.Namespace(**{**vars(args), "process_id": 2})
    with pytest.raises(PcastError, match="process_id=2 must be <= 1"):  # checked before anything else
        _distributed.supervise(bad)


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_stdout_carries_only_the_requested_output_on_every_process(tmp_path, launched, fmt):
    """The runtime's own lines (Gloo's "[Gloo] Rank N is connected ...") never reach stdout."""
    import csv
    import io
    import json

    port, out = _free_port(), tmp_path / "out"
    tiny = [a if a != "4000" else "4" for a in SWEEP] + ["--format", fmt]
    launched += [_start(out, port, i, sweep=tiny, stdout=subprocess.PIPE) for i in range(2)]
    outputs = []
    for p in launched:
        stdout, err = p.communicate(timeout=INIT_S + 60)
        assert p.returncode == 0, err[-2000:]
        assert "[Gloo]" not in stdout + err, (stdout[-2000:], err[-2000:])  # stderr: the supervisor drops them
        outputs.append(stdout)
    rows = json.loads(outputs[0]) if fmt == "json" else list(csv.DictReader(io.StringIO(outputs[0])))
    assert len(rows) == 1 and rows[0]["config"] == "fwd_s1" and float(rows[0]["mse_mean"]) > 0, rows
    assert outputs[1].strip() in ("", outputs[0].strip()), outputs[1][-2000:]  # nothing, or the same result
