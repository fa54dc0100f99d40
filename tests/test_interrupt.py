"""A ``pcast sweep`` killed mid-run resumes to exactly the result of an uninterrupted run.

The test starts a real ``pcast sweep`` subprocess, kills it with SIGKILL as soon as its first
chunk is on disk (so no cleanup code runs), damages the folder the way crashes and stray copies
do — a truncated chunk, a chunk file holding another chunk's rows, a half-written ``.tmp`` file —
then reruns the same command. The resumed run must reuse the intact chunks, recompute the
damaged ones, and end with ``results.npz`` bit-identical to a run that was never interrupted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ARGS = ["--configs", "fwd_s1,rev_s256", "--delta", "5,7,9", "--n", "4096", "--seeds", "64",
        "--chunk-size", "4", "--no-progress"]
N_CHUNKS = 16  # 64 seeds / 4 per chunk, all three Δ in one group
TIMEOUT = 240


def _command(out: Path) -> list[str]:
    return [sys.executable, "-m", "pcast_jax.cli", "sweep", *ARGS, "--out", str(out)]


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen(_command(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _finish(proc: subprocess.Popen, what: str) -> str:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} did not finish within {TIMEOUT} s")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{err[-3000:]}"
    assert "Traceback" not in err
    return out


def _chunks(out: Path) -> list[Path]:
    return sorted((out / "chunks").glob("*.npz")) if (out / "chunks").exists() else []


def _kill_after_first_chunk(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not _chunks(out):
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before writing a chunk: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("no chunk written in time")
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path):
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    victim = _start(interrupted)
    uninterrupted = _start(reference)  # runs alongside, which also slows the victim down
    _kill_after_first_chunk(victim, interrupted)

    assert not (interrupted / "results.npz").exists(), "killed too late: the sweep had finished"
    done = _chunks(interrupted)
    assert 1 <= len(done) < N_CHUNKS
    kept = {p.name: p.stat().st_mtime_ns for p in done}

    # Damage: a truncated copy of a finished chunk where a missing chunk would be, a chunk file
    # holding another chunk's rows, and a half-written temporary file.
    missing = [f"n4096_g000_c{c:06d}.npz" for c in range(N_CHUNKS) if f"n4096_g000_c{c:06d}.npz" not in kept]
    assert len(missing) >= 1
    blob = done[0].read_bytes()
    truncated = interrupted / "chunks" / missing[0]
    truncated.write_bytes(blob[: len(blob) // 2])
    planted = []
    if len(missing) >= 2:
        shutil.copyfile(done[0], interrupted / "chunks" / missing[1])  # valid file, wrong bounds
        planted.append(missing[1])
    stray = interrupted / "chunks" / f".{missing[-1]}.abc123.tmp"
    stray.write_bytes(blob[:100])

    resumed = _finish(_start(interrupted), "the resumed sweep")
    assert "resuming" in resumed
    _finish(uninterrupted, "the uninterrupted sweep")

    got, want = _load(interrupted / "results.npz"), _load(reference / "results.npz")
    assert sorted(got) == sorted(want)
    assert str(got.pop("fingerprint")) == str(want.pop("fingerprint"))  # results.npz names its sweep
    coords = [k for k in want if k.startswith("coord_")]  # the N, config, delta and seed labels
    assert coords and all(np.array_equal(got.pop(k), want.pop(k)) for k in coords)
    for metric in want:
        assert got[metric].shape == (1, 2, 3, 64)
        assert np.array_equal(got[metric], want[metric], equal_nan=True), metric
        if metric != "mse_expected":
            assert np.isfinite(got[metric]).all(), metric
    assert (interrupted / "summary.csv").read_text() == (reference / "summary.csv").read_text()

    # intact chunks were reused, damaged ones rewritten whole, every chunk is now valid
    for name, mtime in kept.items():
        assert (interrupted / "chunks" / name).stat().st_mtime_ns == mtime, f"{name} was recomputed"
    assert len(_chunks(interrupted)) == N_CHUNKS
    for name in [missing[0], *planted]:
        c = int(name.split("_c")[1].split(".")[0])
        chunk = _load(interrupted / "chunks" / name)
        assert tuple(chunk["bounds"]) == (4 * c, 4 * c + 4, 0, 3)
        ref = _load(reference / "chunks" / name)
        for key in ref:
            assert np.array_equal(chunk[key], ref[key], equal_nan=ref[key].dtype.kind == "f"), (name, key)
