"""Multi-process sweeps (jax.distributed on CPU with gloo): launched as real local processes.

Each worker is a fresh Python process with one CPU device; the coordinator listens on 127.0.0.1.
Every subprocess runs under a hard timeout, so a hung runtime fails the test instead of CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pcast_jax.commands._distributed import add_distributed_arguments, init_from_args
from pcast_jax.errors import PcastError
from pcast_jax.sweep import SweepSpec, init_distributed, load_result, run_sweep, run_sweep_distributed
from pcast_jax.sweep.store import claim_dir

from cases import subprocess_env

HARD_TIMEOUT_S = 150  # per group of workers; a healthy group finishes far sooner

WORKER = textwrap.dedent("""
    import argparse, json, logging, os, sys
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    import numpy as np
    from pcast_jax.commands._distributed import add_distributed_arguments, init_from_args
    from pcast_jax.errors import PcastError
    from pcast_jax.sweep import SweepSpec, run_sweep
    try:
        parser = argparse.ArgumentParser()
        add_distributed_arguments(parser)  # the command-line path: flags -> init_from_args
        info = init_from_args(parser.parse_args([
            "--coordinator", cfg["coordinator"], "--num-processes", str(cfg["num_processes"]),
            "--process-id", str(cfg["process_id"]), "--init-timeout", str(cfg["timeout_s"])]))
        print("INFO", json.dumps({"process_id": info.process_id, "num_processes": info.num_processes,
                                  "global_devices": info.global_devices}), flush=True)
        if cfg.get("spec") is not None:
            result = run_sweep(SweepSpec.from_dict(cfg["spec"]), cfg.get("out_dir"),
                               chunk_size=cfg.get("chunk_size"), progress=False)
            np.savez(cfg["dump"], **result.data)
        print("DONE", flush=True)
    except PcastError as exc:
        print("PCAST_ERROR", exc, flush=True)
        sys.exit(2)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    return {**subprocess_env(1), "PYTHONUNBUFFERED": "1"}


def _launch(tmp_path, n_procs: int, *, specs, out_dir=None, chunk_size=None, timeout_s=60.0,
            ids=None) -> list[dict]:
    """Start one worker per process id (``specs[i]`` for process i), wait for all under a hard timeout."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = _worker_env()
    procs = []
    for i in (range(n_procs) if ids is None else ids):
        cfg = {"coordinator": f"127.0.0.1:{port}", "num_processes": n_procs, "process_id": i,
               "timeout_s": timeout_s, "spec": None if specs[i] is None else specs[i].to_dict(),
               "out_dir": None if out_dir is None else str(out_dir), "chunk_size": chunk_size,
               "dump": str(tmp_path / f"result_p{i}.npz")}
        procs.append((i, subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    deadline = time.monotonic() + HARD_TIMEOUT_S
    runs = []
    try:
        for i, p in procs:
            try:
                output, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for _, q in procs:
                    q.kill()
                pytest.fail(f"worker {i} of {n_procs} still running after {HARD_TIMEOUT_S} s")
            runs.append({"id": i, "rc": p.returncode, "out": output,
                         "dump": tmp_path / f"result_p{i}.npz"})
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return runs


def _assert_ok(runs):
    for r in runs:
        assert r["rc"] == 0 and "DONE" in r["out"], f"worker {r['id']} failed (rc={r['rc']}):\n{r['out'][-3000:]}"


def _bits_equal(a: dict, b) -> bool:
    """Same metrics, bit for bit; same coordinates where both carry them (a results.npz's
    fingerprint tag and coordinate labels are not metrics; an in-memory result has neither)."""
    def split(d):
        keys = [k for k in (d.files if hasattr(d, "files") else d) if k != "fingerprint"]
        return ({k: d[k] for k in keys if not k.startswith("coord_")},
                {k: d[k] for k in keys if k.startswith("coord_")})

    (a, ca), (b, cb) = split(a), split(b)
    if ca and cb and (set(ca) != set(cb) or not all(np.array_equal(ca[k], cb[k]) for k in ca)):
        return False
    return set(a) == set(b) and all(
        np.asarray(a[k]).shape == np.asarray(b[k]).shape
        and np.array_equal(np.asarray(a[k]).view(np.uint32), np.asarray(b[k]).view(np.uint32)) for k in a)


# A tiny sweep: two Δ sharing each draw, six seeds in chunks of two, so three chunks: neither 2 nor 4
# processes divide them. Reference: the plain single-process run with the same chunk size.
SPEC = SweepSpec(configs=("fwd_s1", "rev_s256"), ns=(64,), deltas=(3.0, 7.0), seeds=6, q_len=4, d=8, k_sink=2)
CHUNK = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = run_sweep(SPEC, out, chunk_size=CHUNK, progress=False)
    return out, result


@pytest.mark.slow
def test_two_processes_match_single_process_and_resume_per_chunk(tmp_path, reference):
    ref_dir, ref = reference
    out = tmp_path / "out"
    runs = _launch(tmp_path, 2, specs=[SPEC, SPEC], out_dir=out, chunk_size=CHUNK)
    _assert_ok(runs)
    for r in runs:
        info = json.loads(r["out"].split("INFO ", 1)[1].splitlines()[0])
        assert (info["num_processes"], info["global_devices"]) == (2, 2)
        with np.load(r["dump"]) as z:  # every process returns the whole merged result
            assert _bits_equal(ref.data, z)
    with np.load(out / "results.npz") as z, np.load(ref_dir / "results.npz") as zr:
        assert _bits_equal(dict(zr), z)
    assert (out / "summary.csv").read_bytes() == (ref_dir / "summary.csv").read_bytes()
    chunk_files = sorted((out / "chunks").glob("*.npz"))
    assert [p.name for p in chunk_files] == sorted(p.name for p in (ref_dir / "chunks").glob("*.npz"))

    # Resume: drop two chunks (as if the processes computing them were killed) and the results.
    dropped = chunk_files[1:3]
    for p in dropped + [out / "results.npz", out / "summary.csv"]:
        p.unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in chunk_files if p not in dropped}
    runs = _launch(tmp_path, 2, specs=[SPEC, SPEC], out_dir=out, chunk_size=CHUNK)
    _assert_ok(runs)
    assert f"2 of {len(chunk_files)} chunks to compute in 1 calls" in runs[0]["out"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "chunks").glob("*.npz") if p.name in kept} == kept
    with np.load(out / "results.npz") as z:
        assert _bits_equal(ref.data, z)
    assert (out / "summary.csv").read_bytes() == (ref_dir / "summary.csv").read_bytes()
    # The files are a single-process run's: it resumes from them without computing anything new.
    before = {p.name: p.stat().st_mtime_ns for p in (out / "chunks").glob("*.npz")}
    assert _bits_equal(ref.data, run_sweep(SPEC, out, chunk_size=CHUNK, progress=False).data)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "chunks").glob("*.npz")} == before


@pytest.mark.slow
def test_four_processes_in_memory_pad_uneven_work(tmp_path, reference):
    _, ref = reference
    # No chunk size given: 6 seeds over 4 processes -> the balanced default, ceil(6 / 4) = 2 = CHUNK.
    # 3 chunks on 4 processes: one call whose last slot is padding.
    runs = _launch(tmp_path, 4, specs=[SPEC] * 4, out_dir=None, chunk_size=None)
    _assert_ok(runs)
    assert "3 of 3 chunks to compute in 1 calls" in runs[0]["out"]
    for r in runs:
        with np.load(r["dump"]) as z:
            assert _bits_equal(ref.data, z)


def test_mismatched_specs_are_refused_on_every_process(tmp_path):
    other = dataclasses.replace(SPEC, base_seed=1)
    runs = _launch(tmp_path, 2, specs=[SPEC, other], out_dir=tmp_path / "out")
    for r in runs:
        assert r["rc"] == 2, r["out"][-2000:]
        assert "PCAST_ERROR process 1 runs a different sweep spec than process 0" in r["out"]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_folder_of_another_sweep_is_refused_on_every_process(tmp_path):
    out = tmp_path / "out"
    other = dataclasses.replace(SPEC, seeds=7)
    claim_dir(out, other, {"chunk_size": 2, "delta_group": 2})
    saved = (out / "spec.json").read_bytes()
    runs = _launch(tmp_path, 2, specs=[SPEC, SPEC], out_dir=out)
    for r in runs:
        assert r["rc"] == 2, r["out"][-2000:]
        assert "holds a different sweep (fields that differ: seeds)" in r["out"]
    assert "process 0 of 2 failed" in runs[1]["out"]
    assert (out / "spec.json").read_bytes() == saved


def test_coordinator_that_never_answers_times_out_clearly():
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(PcastError, match=rf"coordinator='127.0.0.1:{port}' did not answer within timeout_s=2"):
        init_distributed(f"127.0.0.1:{port}", 2, 1, timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_missing_peer_times_out_clearly(tmp_path):
    t0 = time.monotonic()
    runs = _launch(tmp_path, 2, specs=[None, None], ids=[0], timeout_s=3)  # process 1 never starts
    assert runs[0]["rc"] == 2, runs[0]["out"][-2000:]
    assert "the distributed runtime did not start within timeout_s=3" in runs[0]["out"]
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("kwargs, match", [
    (dict(coordinator="127.0.0.1:1234"), "num_processes, process_id must be given too"),
    (dict(coordinator="127.0.0.1", num_processes=2, process_id=0), "must be 'HOST:PORT'"),
    (dict(coordinator="127.0.0.1:99999", num_processes=2, process_id=0), r"port must be an integer in \[1, 65535\]"),
    (dict(coordinator=":1234", num_processes=2, process_id=0), "must name a host"),
    (dict(coordinator="h:1", num_processes=0, process_id=0), "num_processes=0 must be >= 1"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), "process_id=2 must be <= 1"),
    (dict(coordinator="h:1", num_processes=2, process_id=1, timeout_s=0), "timeout_s=0 must be > 0"),
    (dict(coordinator="h:1", num_processes=2, process_id=1, heartbeat_timeout_s=-1),
     "heartbeat_timeout_s=-1 must be > 0"),
    (dict(coordinator="h:1", num_processes=2, process_id=1, heartbeat_timeout_s=1e9),
     "heartbeat_timeout_s=1000000000.0 must be <= 604800 in magnitude"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(PcastError, match=match):
        init_distributed(**kwargs)


def test_cli_arguments():
    before = signal.getsignal(signal.SIGINT)  # ignored when the tests were started under nohup or in the background
    parser = argparse.ArgumentParser()
    add_distributed_arguments(parser)
    assert init_from_args(parser.parse_args([])) is None  # single process: nothing started
    args = parser.parse_args(["--coordinator", "node0:4000", "--num-processes", "8", "--process-id", "3",
                              "--init-timeout", "30"])
    assert (args.coordinator, args.num_processes, args.process_id, args.init_timeout) == ("node0:4000", 8, 3, 30.0)
    with pytest.raises(PcastError, match="process_id=9 must be <= 7"):
        init_from_args(parser.parse_args(["--coordinator", "h:1", "--num-processes", "8",
                                          "--process-id", "9"]))
    with pytest.raises(PcastError, match="coordinator, num_processes must be given too"):
        init_from_args(parser.parse_args(["--process-id", "1"]))
    with pytest.raises(PcastError, match="heartbeat_timeout_s=0.0 must be > 0"):
        init_from_args(parser.parse_args(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1",
                                          "--heartbeat-timeout", "0"]))
    # Refused arguments change nothing in the calling process: no signal handlers taken over.
    assert signal.getsignal(signal.SIGINT) is before


_IGNORED_SIGINT_PROBE = """
import signal, sys
from pcast_jax.sweep import multihost
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
taken = multihost.take_signals(lambda *a: None)
print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, [signal.Signals(s).name for s in taken])
"""


def _ignoring_sigint(*argv):
    """Python run with ``argv`` as under nohup: SIGINT ignored before it starts (set, then exec)."""
    launch = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    return [sys.executable, "-c", launch, *argv]


def test_an_inherited_ignored_sigint_stays_ignored():
    """Under nohup or as a background job SIGINT arrives ignored: the run keeps it so, SIGTERM is still taken."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run(_ignoring_sigint("-c", _IGNORED_SIGINT_PROBE), capture_output=True, text=True,
                           env=env, timeout=120)
    assert probe.returncode == 0 and probe.stdout.split() == ["True", "['SIGTERM']"], probe
    cli = subprocess.run(_ignoring_sigint("-m", "pcast_jax.cli", "theory", "--delta", "5"), capture_output=True,
                         text=True, env=env, timeout=120)
    assert cli.returncode == 0 and "Traceback" not in cli.stderr and cli.stdout.strip(), cli


def test_single_process_call_matches_run_sweep(tmp_path, reference):
    """With one process the distributed driver is the plain sweep (same files, same bits)."""
    ref_dir, ref = reference
    result = run_sweep_distributed(SPEC, tmp_path / "out", chunk_size=CHUNK, progress=False)
    assert _bits_equal(ref.data, result.data)
    assert (tmp_path / "out" / "summary.csv").read_bytes() == (ref_dir / "summary.csv").read_bytes()
    assert _bits_equal(ref.data, load_result(tmp_path / "out").data)
