"""The on-disk store of a sweep: ``spec.json``, ``chunks/``, ``results.npz`` and ``summary.csv``.

A folder belongs to one sweep (its fingerprint, in ``spec.json``, with the chunk layout).
``spec.json`` is created exclusively (:func:`~pcast_jax.fileio.create_exclusive`): of several runs
started into one new folder at the same moment exactly one claims it; the others read its
``spec.json`` and resume (same sweep) or are refused (another sweep). Each finished chunk is one
``.npz`` written atomically, holding the fingerprint, its place in the grid and its bounds; a file
that does not match the spec exactly (every axis length, dtype, metric set, coordinate) is removed
and recomputed, never read. ``results.npz`` carries the fingerprint and the axis coordinates too
(``coord_*``), and :func:`load_result` refuses one that does not match ``spec.json``. Nothing here runs a computation.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path

import jax
import numpy as np

from pcast_jax import __version__, metrics
from pcast_jax.errors import PcastError
from pcast_jax.fileio import atomic_write, clean_stale_temps, create_exclusive, load_json, load_npz, read_bounded
from pcast_jax.sweep.plan import Unit
from pcast_jax.sweep.spec import FORMAT_VERSION, SweepResult, SweepSpec

__all__ = ["claim_dir", "check_dir", "read_manifest", "check_layout", "chunk_path", "save_chunk", "load_chunk",
           "empty_results", "fill", "check_finite_metrics", "skipped_metrics", "scan", "merge", "write_results",
           "load_result", "write_probe", "check_probes", "probe_path", "COORD_PREFIX"]



def _save_npz(path: Path, arrays: dict) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        # unique per process and call: concurrent runs never remove each other's probe
        probe = out / f".write_probe.{os.getpid()}.{secrets.token_hex(6)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None


def check_layout(layout, spec: SweepSpec, where: str = "layout") -> dict:
    """``layout`` as ``{"chunk_size", "delta_group"}`` ints that cover ``spec``'s grid, or PcastError."""
    if not isinstance(layout, dict):
        raise PcastError(f"{where} must be an object with chunk_size and delta_group, got {layout!r}")
    got = {}
    for key, most in (("chunk_size", None), ("delta_group", len(spec.deltas))):
        v = layout.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 or (most and v > most):
            bound = f"an integer in [1, {most}]" if most else "an integer >= 1"
            raise PcastError(f"{where}: {key}={v!r} must be {bound}")
        got[key] = int(v)
    return got


def read_manifest(out: Path) -> dict:
    """``out/spec.json``, checked whole: readable, consistent with its own fingerprint.

    Returns:
      The manifest, with ``spec`` replaced by the parsed :class:`SweepSpec` and ``layout`` checked.

    Raises:
      PcastError: one line naming the file, whatever the damage.
    """
    path = Path(out) / "spec.json"
    if not path.exists():
        raise PcastError(f"out_dir={str(out)!r}: spec.json does not exist (not a sweep folder?)")
    try:
        saved = load_json(path, what=f"out_dir={str(out)!r}: spec.json")  # bounded in size and depth
    except PcastError as exc:
        raise PcastError(f"{exc}: spec.json is unreadable or damaged; delete the folder or use another one") from None
    version = saved.get("format_version") if isinstance(saved, dict) else None
    if isinstance(saved, dict) and version != FORMAT_VERSION:
        raise PcastError(f"out_dir={str(out)!r} holds results of format version {version!r}, and this pcast_jax "
                         f"reads version {FORMAT_VERSION}: results are recomputable: rerun with the same "
                         "parameters and another --out folder (or delete this one)")
    try:
        if not isinstance(saved, dict) or not isinstance(saved.get("spec"), dict):
            raise PcastError("it holds no sweep spec")
        spec = SweepSpec.from_dict(saved["spec"])
        if saved.get("fingerprint") != spec.fingerprint():
            raise PcastError(f"its fingerprint {saved.get('fingerprint')!r} does not match its spec "
                             f"({spec.fingerprint()})")
        layout = check_layout(saved.get("layout"), spec)
    except (PcastError, TypeError, KeyError, ValueError, AttributeError) as exc:
        raise PcastError(f"out_dir={str(out)!r}: spec.json is damaged: {exc}; delete the folder or use "
                         "another one") from None
    return {**saved, "spec": spec, "layout": layout}


def claim_dir(out: Path, spec: SweepSpec, layout: dict) -> dict:
    """Make sure ``out`` is writable and belongs to ``spec``; return the layout to use.

    A new folder gets ``spec.json`` (with ``layout``), created exclusively: when several runs
    claim one folder at once exactly one creates it, and every other one then reads it like an
    existing folder. There is no lock to go stale: a killed run leaves either no ``spec.json``
    or a complete one. A folder of the same sweep keeps its saved layout, which is returned so
    that a resumed run cuts the same chunks; temporary files left there by killed writers are
    removed.

    Raises:
      PcastError: the folder cannot be written, its spec.json is damaged, or it holds another sweep.
    """
    out = Path(out)
    _check_writable(out)
    manifest = out / "spec.json"
    body = {"format_version": FORMAT_VERSION, "fingerprint": spec.fingerprint(), "layout": layout,
            "spec": spec.to_dict(), "pcast_jax": __version__, "jax": jax.__version__}
    try:
        create_exclusive(manifest, lambda f: f.write(json.dumps(body, indent=1)), text=True)
        return layout
    except FileExistsError:
        pass
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None
    saved = _check_saved(out, spec)
    for folder in (out, out / "chunks"):
        clean_stale_temps(folder)
    return saved["layout"]


def check_dir(out: Path, spec: SweepSpec) -> dict:
    """The manifest of ``out``, a folder that holds ``spec.json``, if it may resume ``spec``.

    Nothing is left in it: the command line asks this before it says it resumes.

    Raises:
      PcastError: it is not writable, its spec.json is damaged, it holds another sweep, or one
        started under another jax version.
    """
    out = Path(out)
    _check_writable(out)
    return _check_saved(out, spec)


def _check_saved(out: Path, spec: SweepSpec) -> dict:
    saved = read_manifest(out)
    if saved["fingerprint"] != spec.fingerprint():
        old = saved["spec"].to_dict()
        new = spec.to_dict()
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        differ = ", ".join(diff) or "the simulator or file format version"
        raise PcastError(
            f"out_dir={str(out)!r} holds a different sweep (fields that differ: {differ}); "
            "refusing to mix results — use another output folder or delete this one")
    started = saved.get("jax")
    if started is not None and started != jax.__version__:
        raise PcastError(
            f"out_dir={str(out)!r} holds a sweep started under jax {started}, and this is jax {jax.__version__}: "
            "results are bit-identical within one jax version only, so chunks of two versions are never "
            f"mixed — resume under jax {started}, or use another output folder (load_result reads a "
            "finished folder under any version)")
    return saved


# --------------------------------------------------------------------------------------------
# Chunk files
# --------------------------------------------------------------------------------------------


def chunk_path(out: Path, spec: SweepSpec, unit: Unit) -> Path:
    """Where ``unit``'s chunk file lives."""
    return Path(out) / "chunks" / f"n{spec.ns[unit.ni]}_g{unit.group:03d}_c{unit.chunk:06d}.npz"


def _chunk_tags(spec: SweepSpec, unit: Unit) -> dict[str, np.ndarray]:
    """What identifies a chunk file: the sweep, its place in the grid and its coordinates."""
    d0, d1 = unit.bounds[2:]
    return {"fingerprint": np.array(spec.fingerprint()), "bounds": np.array(unit.bounds),
            "unit": np.array([unit.ni, unit.group, unit.chunk]), "n": np.array(spec.ns[unit.ni]),
            "deltas": np.asarray(spec.deltas[d0:d1], np.float64)}


def save_chunk(path: Path, spec: SweepSpec, unit: Unit, vals: dict) -> None:
    """Write one chunk's metrics (each (seeds, deltas, configs)) atomically, tagged with its identity."""
    _save_npz(path, {**_chunk_tags(spec, unit), **{f"m_{k}": v for k, v in vals.items()}})


def _npz_bound(spec: SweepSpec, shape: tuple[int, ...]) -> int:
    """Most bytes a store ``.npz`` of metric arrays shaped ``shape`` may inflate to: its arrays,
    its coordinates and tags, and 1 MiB of headers."""
    coords = 8 * (len(spec.ns) + len(spec.deltas) + spec.seeds) + 256 * len(spec.configs)
    return 4 * math.prod(shape) * len(metrics.METRICS) + coords + 2**20


def check_chunk(path: Path, spec: SweepSpec, unit: Unit) -> dict[str, np.ndarray] | str:
    """A chunk file's metrics, or why it cannot be trusted ("missing" when there is no file).

    Every tag must equal the spec's (fingerprint, grid place, bounds, N, Δ values) and the metrics
    must be exactly the sweep's metric set, each float32 of shape (seeds, deltas, configs).
    """
    want = _chunk_tags(spec, unit)
    s0, s1, d0, d1 = unit.bounds
    shape = (s1 - s0, d1 - d0, len(spec.configs))
    if not path.exists():
        return "missing"
    try:  # never inflates more than the chunk's own arrays (and a margin for its tags) need
        z = load_npz(path, what=f"chunk {path.name}", max_bytes=_npz_bound(spec, shape))
    except PcastError as exc:
        return f"unreadable ({exc})"
    files = set(z)
    for key, ref in want.items():
        if key not in files:
            return f"no {key!r} entry"
        got = z[key]
        same = (str(got) == str(ref)) if key == "fingerprint" else (
            got.shape == ref.shape and np.array_equal(got.astype(ref.dtype), ref))
        if not same:
            return f"{key} {got.tolist()!r} is not {ref.tolist()!r}"
    vals = {k[2:]: z[k] for k in files if k.startswith("m_")}
    extra = files - set(want) - {f"m_{m}" for m in metrics.METRICS}
    if set(vals) != set(metrics.METRICS) or extra:
        return f"entries {sorted(files)} are not the sweep's metrics {sorted(metrics.METRICS)}"
    for m, v in vals.items():
        if v.shape != shape or v.dtype != np.float32:
            return f"{m} is {v.dtype}{list(v.shape)}, expected float32{list(shape)}"
    return vals


def load_chunk(path: Path, spec: SweepSpec, unit: Unit) -> dict[str, np.ndarray] | None:
    """A finished chunk's metrics, or None when absent or not exactly this chunk of this sweep."""
    got = check_chunk(path, spec, unit)
    return None if isinstance(got, str) else got


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


#: Prefix of the coordinate entries of ``results.npz`` (``coord_n``, ``coord_config``, ``coord_delta``,
#: ``coord_seed``): the labels of the (N, config, Δ, seed) axes of every metric array.
COORD_PREFIX = "coord_"


def _result_shape(spec: SweepSpec) -> tuple[int, int, int, int]:
    return (len(spec.ns), len(spec.configs), len(spec.deltas), spec.seeds)


def empty_results(spec: SweepSpec) -> dict[str, np.ndarray]:
    """metric → NaN array shaped (len(ns), len(configs), len(deltas), seeds), to be filled by chunks."""
    return {m: np.full(_result_shape(spec), np.nan, np.float32) for m in metrics.METRICS}


def skipped_metrics(spec: SweepSpec) -> set[str]:
    """The metrics ``spec`` turns off: NaN by definition, never computed."""
    return ({"mse_expected"} if not spec.expected_mse else set()) | ({"mse"} if not spec.sampled_mse else set())


def check_finite_metrics(spec: SweepSpec, unit: Unit, vals: dict[str, np.ndarray]) -> None:
    """Refuse a chunk whose computed metrics hold NaN or inf, naming where and the parameters.

    The one place every sweep's numbers pass (computed or read back, one process or many): a
    non-finite metric is never written into a result. Accepted ranges keep every preset finite
    (tests/test_bad_input.py); a config of your own can still leave them (``overflow='nan'``).
    """
    skipped = skipped_metrics(spec)
    s0, _, d0, _ = unit.bounds
    for m, v in sorted(vals.items()):  # v: (seeds, deltas, configs)
        bad = np.argwhere(~np.isfinite(np.asarray(v))) if m not in skipped else ()
        if len(bad):
            s, d, c = bad[0]
            cfg = spec.configs[c]
            hint = " (its overflow='nan' cast turns P*S >= 464 into NaN)" if cfg.overflow == "nan" else ""
            raise PcastError(
                f"sweep metric {m} is {float(v[s, d, c])} for config={cfg.name!r}{hint} at N={spec.ns[unit.ni]}, "
                f"delta={spec.deltas[d0 + d]:g}, seed {spec.seed_offset + s0 + s} (sigma={spec.sigma:g}, "
                f"sigma_v={spec.sigma_v:g}): no result is written with a non-finite number")


def fill(data: dict[str, np.ndarray], unit: Unit, vals: dict[str, np.ndarray], spec: SweepSpec) -> None:
    """Copy one chunk's metrics (each (seeds, deltas, configs)) into the result arrays ``data``.

    The metrics are checked first (:func:`check_finite_metrics`).
    """
    check_finite_metrics(spec, unit, vals)
    s0, s1, d0, d1 = unit.bounds
    for m, v in vals.items():  # data[m]: (ns, configs, deltas, seeds)
        data[m][unit.ni, :, d0:d1, s0:s1] = np.transpose(v, (2, 1, 0))


def scan(out: Path, spec: SweepSpec, todo: list[Unit], data: dict) -> np.ndarray:
    """Fill ``data`` from every valid chunk file in ``out``; True where a chunk is still missing.

    A file that is there but does not match (damaged, another chunk's, another shape) is removed,
    so that it is recomputed and never read.
    """
    missing = np.ones(len(todo), bool)
    for k, unit in enumerate(todo):
        path = chunk_path(out, spec, unit)
        got = check_chunk(path, spec, unit)
        if isinstance(got, str):
            if got != "missing":
                try:
                    path.unlink()
                except OSError:
                    pass
            continue
        fill(data, unit, got, spec)
        missing[k] = False
    return missing


def write_results(out: Path, spec: SweepSpec, data: dict) -> SweepResult:
    """Write ``results.npz`` (tagged with the fingerprint) and ``summary.csv`` for the complete ``data``.

    Raises:
      PcastError: ``spec.json`` no longer holds this sweep (the folder was replaced meanwhile).
    """
    out = Path(out)
    if read_manifest(out)["fingerprint"] != spec.fingerprint():
        raise PcastError(f"out_dir={str(out)!r} was claimed by another sweep while this one ran; "
                         "its results are not written there")
    result = SweepResult(spec, data)
    coords = {f"{COORD_PREFIX}{k}": v for k, v in result.coordinates().items()}
    _save_npz(out / "results.npz", {**data, **coords, "fingerprint": np.array(spec.fingerprint())})
    result.write_csv(out / "summary.csv")
    return result


def merge(out: Path, spec: SweepSpec, written: list[Unit], data: dict) -> SweepResult:
    """Read the chunks ``written`` by other processes into ``data``, then :func:`write_results`.

    Raises:
      PcastError: a chunk file is missing or invalid (the folder is not shared by every process).
    """
    for unit in written:
        path = chunk_path(out, spec, unit)
        got = check_chunk(path, spec, unit)
        if isinstance(got, str):
            raise PcastError(f"chunk file {path.name} is {got if got == 'missing' else 'invalid: ' + got} "
                             f"on process 0; out_dir={str(out)!r} must be one folder shared by every process")
        fill(data, unit, got, spec)
    return write_results(out, spec, data)


def load_result(out_dir: str | os.PathLike) -> SweepResult:
    """Read a finished sweep's ``results.npz`` with its spec, checked against ``spec.json``.

    Raises:
      PcastError: no results yet, a damaged ``spec.json`` or ``results.npz``, or a ``results.npz``
        that does not belong to ``spec.json``'s sweep (other fingerprint, metrics, shapes or dtype).
    """
    out = Path(out_dir)
    path = out / "results.npz"
    if not path.exists():
        raise PcastError(f"out_dir={str(out)!r} has no results.npz (sweep not finished?)")
    saved = read_manifest(out)
    spec = saved["spec"]
    data = load_npz(path, what=f"{str(path)!r}", max_bytes=_npz_bound(spec, _result_shape(spec)))
    tag = data.pop("fingerprint", None)
    if tag is None or str(tag) != spec.fingerprint():
        raise PcastError(f"{str(path)!r} belongs to another sweep (fingerprint {str(tag)!r}) than its "
                         f"spec.json ({spec.fingerprint()}); refusing to mix results")
    want = {f"{COORD_PREFIX}{k}": v for k, v in SweepResult(spec, {}).coordinates().items()}

    def same(got, ref):
        return ref is not None and got.shape == ref.shape and got.dtype.kind == ref.dtype.kind and np.array_equal(
            got, ref)

    for key in [k for k in data if k.startswith(COORD_PREFIX)]:
        got, ref = data.pop(key), want.get(key)
        if not same(got, ref):
            raise PcastError(f"{str(path)!r}: coordinate {key[len(COORD_PREFIX):]!r} = {got.tolist()!r} is not "
                             f"spec.json's {None if ref is None else ref.tolist()!r}; refusing to mix results")
    if set(data) != set(metrics.METRICS):
        raise PcastError(f"{str(path)!r} holds {sorted(data)}, not the sweep's metrics {sorted(metrics.METRICS)}")
    shape = _result_shape(spec)
    for m, v in data.items():
        if v.shape != shape or v.dtype != np.float32:
            raise PcastError(f"{str(path)!r}: {m} is {v.dtype}{list(v.shape)}, but spec.json's sweep "
                             f"needs float32{list(shape)} (N, configs, deltas, seeds)")
    return SweepResult(spec, data)


# --------------------------------------------------------------------------------------------
# Shared-folder check (multi-process runs)
# --------------------------------------------------------------------------------------------


def probe_path(out: Path, process_id: int, token: str) -> Path:
    """The probe file process ``process_id`` of the run ``token`` writes to show the folder is shared."""
    return Path(out) / "chunks" / f".probe_p{process_id:04d}_{token}"


def write_probe(out: Path, process_id: int, token: str) -> None:
    """Write ``token`` to this process's probe file (PcastError when the folder is not writable)."""
    try:
        atomic_write(probe_path(out, process_id, token), lambda f: f.write(token), text=True)
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable on process {process_id}: "
                         f"{exc.strerror or exc}") from None


def check_probes(out: Path, num_processes: int, token: str) -> None:
    """Raise unless every process's probe file is visible here and holds ``token``."""
    unseen = []
    for p in range(num_processes):
        try:
            ok = read_bounded(probe_path(out, p, token), what="probe", max_bytes=len(token)) == token.encode()
        except PcastError:
            ok = False
        if not ok:
            unseen.append(p)
    if unseen:
        raise PcastError(
            f"out_dir={str(out)!r} is not one folder shared by every process: process 0 cannot see the files "
            f"written there by process(es) {unseen}; use a path on a shared file system (NFS, Lustre, ...)")
