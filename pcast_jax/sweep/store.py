"""The on-disk store of a sweep: ``spec.json``, ``chunks/``, ``results.npz`` and ``summary.csv``.

A folder belongs to one sweep (its fingerprint, in ``spec.json``, with the chunk layout). Each
finished chunk is one ``.npz`` written atomically, holding the fingerprint and its bounds; a file
that does not match exactly is recomputed, never read. Nothing here runs a computation.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import jax
import numpy as np

from pcast_jax import __version__, metrics
from pcast_jax.errors import PcastError
from pcast_jax.fileio import atomic_write
from pcast_jax.sweep.plan import Unit
from pcast_jax.sweep.spec import FORMAT_VERSION, SweepResult, SweepSpec

__all__ = ["claim_dir", "chunk_path", "save_chunk", "load_chunk", "empty_results", "fill", "scan", "merge",
           "write_results", "load_result", "write_probe", "check_probes", "probe_path"]


def _save_npz(path: Path, arrays: dict) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None


def claim_dir(out: Path, spec: SweepSpec, layout: dict) -> dict:
    """Make sure ``out`` is writable and belongs to ``spec``; return the layout to use.

    A new folder gets ``spec.json`` (with ``layout``); a folder of the same sweep keeps its saved
    layout, which is returned so that a resumed run cuts the same chunks.

    Raises:
      PcastError: the folder cannot be written, its spec.json is unreadable, or it holds another sweep.
    """
    out = Path(out)
    _check_writable(out)
    manifest = out / "spec.json"
    if manifest.exists():
        try:
            saved = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise PcastError(f"out_dir={str(out)!r}: spec.json is unreadable ({exc})") from None
        if saved.get("fingerprint") != spec.fingerprint():
            old = saved.get("spec", {})
            new = spec.to_dict()
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise PcastError(
                f"out_dir={str(out)!r} holds a different sweep (fields that differ: {', '.join(diff) or '?'}); "
                "refusing to mix results — use another output folder or delete this one")
        return saved["layout"]
    body = {"format_version": FORMAT_VERSION, "fingerprint": spec.fingerprint(), "layout": layout,
            "spec": spec.to_dict(), "pcast_jax": __version__, "jax": jax.__version__}
    atomic_write(manifest, lambda f: f.write(json.dumps(body, indent=1)), text=True)
    return layout


# --------------------------------------------------------------------------------------------
# Chunk files
# --------------------------------------------------------------------------------------------


def chunk_path(out: Path, spec: SweepSpec, unit: Unit) -> Path:
    """Where ``unit``'s chunk file lives."""
    return Path(out) / "chunks" / f"n{spec.ns[unit.ni]}_g{unit.group:03d}_c{unit.chunk:06d}.npz"


def save_chunk(path: Path, fingerprint: str, bounds: tuple[int, int, int, int], vals: dict) -> None:
    """Write one chunk's metrics (each (seeds, deltas, configs)) atomically, tagged with its identity."""
    _save_npz(path, {"fingerprint": np.array(fingerprint), "bounds": np.array(bounds),
                     **{f"m_{k}": v for k, v in vals.items()}})


def load_chunk(path: Path, fingerprint: str, bounds: tuple[int, int, int, int]) -> dict[str, np.ndarray] | None:
    """A finished chunk's metrics, or None when absent or not exactly this chunk of this sweep."""
    try:
        with np.load(path) as z:
            if str(z["fingerprint"]) != fingerprint or tuple(int(b) for b in z["bounds"]) != bounds:
                return None
            got = {k[2:]: z[k] for k in z.files if k.startswith("m_")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    s0, s1, d0, d1 = bounds  # every metric, each (seeds, deltas, configs): else recompute
    if set(got) != set(metrics.METRICS) or any(v.shape[:2] != (s1 - s0, d1 - d0) for v in got.values()):
        return None
    return got


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def empty_results(spec: SweepSpec) -> dict[str, np.ndarray]:
    """metric → NaN array shaped (len(ns), len(configs), len(deltas), seeds), to be filled by chunks."""
    shape = (len(spec.ns), len(spec.configs), len(spec.deltas), spec.seeds)
    return {m: np.full(shape, np.nan, np.float32) for m in metrics.METRICS}


def fill(data: dict[str, np.ndarray], unit: Unit, vals: dict[str, np.ndarray]) -> None:
    """Copy one chunk's metrics (each (seeds, deltas, configs)) into the result arrays ``data``."""
    s0, s1, d0, d1 = unit.bounds
    for m, v in vals.items():  # data[m]: (ns, configs, deltas, seeds)
        data[m][unit.ni, :, d0:d1, s0:s1] = np.transpose(v, (2, 1, 0))


def scan(out: Path, spec: SweepSpec, todo: list[Unit], data: dict) -> np.ndarray:
    """Fill ``data`` from every valid chunk file in ``out``; True where a chunk is still missing."""
    fp = spec.fingerprint()
    missing = np.ones(len(todo), bool)
    for k, unit in enumerate(todo):
        got = load_chunk(chunk_path(out, spec, unit), fp, unit.bounds)
        if got is not None:
            fill(data, unit, got)
            missing[k] = False
    return missing


def write_results(out: Path, spec: SweepSpec, data: dict) -> SweepResult:
    """Write ``results.npz`` and ``summary.csv`` for the complete ``data``."""
    result = SweepResult(spec, data)
    _save_npz(Path(out) / "results.npz", data)
    result.write_csv(Path(out) / "summary.csv")
    return result


def merge(out: Path, spec: SweepSpec, written: list[Unit], data: dict) -> SweepResult:
    """Read the chunks ``written`` by other processes into ``data``, then :func:`write_results`.

    Raises:
      PcastError: a chunk file is missing or invalid (the folder is not shared by every process).
    """
    fp = spec.fingerprint()
    for unit in written:
        path = chunk_path(out, spec, unit)
        got = load_chunk(path, fp, unit.bounds)
        if got is None:
            raise PcastError(f"chunk file {path.name} is missing or unreadable on process 0; "
                             f"out_dir={str(out)!r} must be one folder shared by every process")
        fill(data, unit, got)
    return write_results(out, spec, data)


def load_result(out_dir: str | os.PathLike) -> SweepResult:
    """Read a finished sweep's ``results.npz`` (with its spec)."""
    out = Path(out_dir)
    path = out / "results.npz"
    if not path.exists():
        raise PcastError(f"out_dir={str(out)!r} has no results.npz (sweep not finished?)")
    saved = json.loads((out / "spec.json").read_text())
    spec = SweepSpec.from_dict(saved["spec"])
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    return SweepResult(spec, data)


# --------------------------------------------------------------------------------------------
# Shared-folder check (multi-process runs)
# --------------------------------------------------------------------------------------------


def probe_path(out: Path, process_id: int) -> Path:
    """The probe file process ``process_id`` writes to show the folder is shared."""
    return Path(out) / "chunks" / f".probe_p{process_id:04d}"


def write_probe(out: Path, process_id: int, token: str) -> None:
    """Write ``token`` to this process's probe file (PcastError when the folder is not writable)."""
    try:
        atomic_write(probe_path(out, process_id), lambda f: f.write(token), text=True)
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable on process {process_id}: "
                         f"{exc.strerror or exc}") from None


def check_probes(out: Path, num_processes: int, token: str) -> None:
    """Raise unless every process's probe file is visible here and holds ``token``."""
    unseen = []
    for p in range(num_processes):
        try:
            ok = probe_path(out, p).read_text() == token
        except OSError:
            ok = False
        if not ok:
            unseen.append(p)
    if unseen:
        raise PcastError(
            f"out_dir={str(out)!r} is not one folder shared by every process: process 0 cannot see the files "
            f"written there by process(es) {unseen}; use a path on a shared file system (NFS, Lustre, ...)")
