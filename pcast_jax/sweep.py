"""The sweep engine: seed × Δ × N × config grids, vmapped, chunked, sharded, resumable.

An instance is one (N, seed): its scores and V are drawn from the key
``fold_in(fold_in(key(base_seed), N), seed)`` — independent of Δ, chunking and device count — and
every Δ and every config is evaluated on those same draws (common random numbers: paired
comparisons are exact, curves over Δ are smooth, and the draws are paid once per seed, not once per
Δ × config). A chunk is one jit-compiled call, vmapped over a range of seeds (and over a group of
Δ values inside), with the seed axis sharded over all ``jax.devices()``. Finished chunks are written atomically to ``out_dir/chunks/``; a rerun with the
same spec resumes from them (a different spec in the same directory is refused), and the final
``results.npz`` + ``summary.csv`` are the same whatever the chunking, device count or interruptions.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import sys
import zipfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import __version__, metrics
from pcast_jax.config import KernelConfig, resolve
from pcast_jax.engine import ENGINES
from pcast_jax.fileio import atomic_write
from pcast_jax.errors import PcastError, check_choice, check_finite, check_int, check_positive
from pcast_jax.workloads import SinkWorkload, make_instance

__all__ = ["SweepSpec", "SweepResult", "run_sweep", "plan_layout", "compute_chunk", "instance_key", "estimate_instance_bytes", "load_result"]

_FORMAT_VERSION = 1
#: Bump whenever the simulator's numbers change (engine, workloads, metrics): saved chunks of an
#: older version then no longer match the fingerprint and are recomputed instead of resumed.
SIMULATOR_VERSION = 2  # 2: per-instance loops instead of vmap (last-bit changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """What to sweep. Every field is part of the result's identity (``fingerprint``).

    Attributes:
      configs: preset names or KernelConfigs (names must be unique).
      deltas: sink strengths Δ.
      ns: KV lengths N.
      seeds: number of seeds per (N, Δ); seed indices ``seed_offset .. seed_offset + seeds − 1``.
      seed_offset, base_seed: where the seed indices start, and the root PRNG seed.
      q_len, d, k_sink, sink_positions, sigma, sigma_v: the synthetic workload (:class:`SinkWorkload`).
      engine: ``"fast"`` or ``"scan"``.
      expected_mse: also compute ``mse_expected`` (cheap; NaN when off).
    """

    configs: tuple = ("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256")
    deltas: tuple = (7.0,)
    ns: tuple = (4096,)
    seeds: int = 20
    seed_offset: int = 0
    base_seed: int = 0
    q_len: int = 32
    d: int = 128
    k_sink: int = 4
    sink_positions: tuple | None = None
    sigma: float = 1.0
    sigma_v: float = 1.0
    engine: str = "fast"
    expected_mse: bool = True

    def __post_init__(self):
        cfgs = tuple(resolve(c) for c in _as_tuple(self.configs, "configs"))
        if not cfgs:
            raise PcastError("configs must name at least one config")
        names = [c.name for c in cfgs]
        if len(set(names)) != len(names):
            raise PcastError(f"configs must have unique names, got {names}")
        object.__setattr__(self, "configs", cfgs)
        deltas = tuple(check_finite("delta", d) for d in _as_tuple(self.deltas, "deltas"))
        for d in deltas:  # Δ is added to float32 scores: it must stay finite there
            if abs(d) > float(np.finfo(np.float32).max):
                raise PcastError(f"delta={d!r} must be finite in float32 (|delta| <= 3.4e38)")
        if not deltas:
            raise PcastError("deltas must hold at least one value")
        object.__setattr__(self, "deltas", deltas)
        ns = tuple(check_int("n", n, min_value=1) for n in _as_tuple(self.ns, "ns"))
        if not ns:
            raise PcastError("ns must hold at least one value")
        object.__setattr__(self, "ns", ns)
        check_int("seeds", self.seeds, min_value=1)
        # seed indices are uint32 PRNG data: seed_offset + seeds - 1 must fit in 32 bits
        check_int("seed_offset", self.seed_offset, min_value=0, max_value=2**32 - self.seeds)
        check_int("base_seed", self.base_seed, min_value=0, max_value=2**31 - 1)
        check_choice("engine", self.engine, ENGINES)
        if not isinstance(self.expected_mse, bool):
            raise PcastError(f"expected_mse={self.expected_mse!r} must be True or False")
        for n in ns:  # validates k_sink / sink_positions / sigma against every N
            self.workload(n)

    def workload(self, n: int) -> SinkWorkload:
        return SinkWorkload(n=n, q_len=self.q_len, d=self.d, k_sink=self.k_sink,
                            sink_positions=self.sink_positions, sigma=self.sigma, sigma_v=self.sigma_v)

    @property
    def config_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.configs)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["configs"] = [dataclasses.asdict(c) for c in self.configs]
        d["deltas"] = list(self.deltas)
        d["ns"] = list(self.ns)
        d["sink_positions"] = None if self.sink_positions is None else list(self.sink_positions)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SweepSpec":
        d = dict(d)
        d["configs"] = tuple(KernelConfig(**c) for c in d["configs"])
        d["deltas"] = tuple(d["deltas"])
        d["ns"] = tuple(d["ns"])
        if d.get("sink_positions") is not None:
            d["sink_positions"] = tuple(d["sink_positions"])
        return cls(**d)

    def fingerprint(self) -> str:
        """Identity of the results: the spec, the file format and the simulator version."""
        ident = {"spec": self.to_dict(), "format": _FORMAT_VERSION, "simulator": SIMULATOR_VERSION}
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _as_tuple(x, name):
    if isinstance(x, (str, KernelConfig)) or np.isscalar(x):
        return (x,)
    try:
        return tuple(x)
    except TypeError:
        raise PcastError(f"{name}={x!r} must be a value or a sequence of values") from None


def instance_key(base_seed: int, n, seed):
    """PRNG key of one instance: depends on (base_seed, N, seed) only — never on Δ or layout."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(base_seed), n), seed)


def estimate_instance_bytes(spec: SweepSpec, n: int) -> int:
    """Rough peak bytes one vmapped instance needs in the fast engine (scores, P, casts, V)."""
    per_cfg = 10 * spec.q_len * (n + 256) * 4
    return int(4 * (6 * spec.q_len * n + 3 * n * spec.d) + per_cfg * len(spec.configs)
               + (spec.q_len * n * 4 * 64 if spec.engine == "scan" else 0))


def _default_budget() -> int:
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


@dataclasses.dataclass
class SweepResult:
    """Metrics of a finished sweep: ``data[metric]`` has shape (len(ns), len(configs), len(deltas), seeds)."""

    spec: SweepSpec
    data: dict[str, np.ndarray]

    def get(self, metric: str, *, config: str, n: int | None = None, delta: float | None = None) -> np.ndarray:
        """Values of ``metric`` for one config (and optionally one N / Δ), seeds last."""
        check_choice("metric", metric, tuple(self.data))
        check_choice("config", config, self.spec.config_names)
        x = self.data[metric][:, self.spec.config_names.index(config)]
        if n is not None:
            check_choice("n", n, self.spec.ns)
            x = x[self.spec.ns.index(n)]
        if delta is not None:
            idx = [i for i, d in enumerate(self.spec.deltas) if math.isclose(d, delta)]
            if not idx:
                raise PcastError(f"delta={delta} is not in the sweep's deltas {self.spec.deltas}")
            x = x[..., idx[0], :]
        return x

    def mean(self, metric: str, **kw) -> np.ndarray:
        return np.mean(self.get(metric, **kw), axis=-1)

    def summary_rows(self) -> list[dict]:
        rows = []
        s = self.spec
        for ni, n in enumerate(s.ns):
            for ci, c in enumerate(s.config_names):
                for di, dlt in enumerate(s.deltas):
                    row = {"n": n, "config": c, "delta": dlt, "seeds": s.seeds}
                    for m, arr in self.data.items():
                        x = arr[ni, ci, di].astype(np.float64)
                        row[f"{m}_mean"] = float(np.mean(x))
                        row[f"{m}_sem"] = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")
                    rows.append(row)
        return rows

    def write_csv(self, path: str | os.PathLike) -> Path:
        rows = self.summary_rows()
        path = Path(path)

        def write(f):
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)

        _atomic_write(path, write, text=True)
        return path


# --------------------------------------------------------------------------------------------
# Chunk computation
# --------------------------------------------------------------------------------------------


def _loop_map(fn, xs):
    """``lax.map(fn, xs)`` as a while loop compiled the same way for every length of ``xs``.

    XLA simplifies loops it can see through: one it knows runs once is inlined, and indexing a
    length-1 array does not depend on the loop counter, so the whole body is hoisted out of the
    loop. Either changes fusion, and so the low-order bits. Here the trip count is hidden behind
    an optimization barrier and ``xs`` gets one unused extra element, so every element goes
    through the same compiled body.
    """
    count = xs.shape[0]
    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs))
    init = jax.tree.map(lambda s: jnp.zeros((count,) + s.shape, s.dtype), shapes)
    xs = jax.tree.map(lambda x: jnp.concatenate([x, x[-1:]]), xs)
    stop = jax.lax.optimization_barrier(jnp.int32(count))

    def body(state):
        i, acc = state
        y = fn(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), xs))
        return i + 1, jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), acc, y)

    _, out = jax.lax.while_loop(lambda state: state[0] < stop, body, (jnp.int32(0), init))
    return out


@partial(jax.jit, static_argnames=("spec", "n", "n_shards"))
def _chunk_metrics(seed_idx, deltas, *, spec: SweepSpec, n: int, n_shards: int = 1):
    """(C,) seeds × (D,) deltas → metric → (C, D, n_configs). One draw per seed, shared by every Δ.

    Every (seed, Δ) instance is computed by the same compiled loop body: a loop over Δ inside a
    loop over seeds (:func:`_loop_map`), not a vmap. XLA:CPU's code for reductions, divisions and
    exponentials depends on array shapes and on what gets fused, so a vmap over a batch whose size
    follows the chunk size or the device count changes low-order bits; the loops make the results
    bit-identical whatever the chunking, Δ grouping or device count (and are faster on CPU). The
    seed axis is split into ``n_shards`` rows (one per device of a sharded ``seed_idx``; C must be
    a multiple) and only that axis is vmapped, so each device loops over its own seeds.
    """
    workload = spec.workload(n)

    def per_seed(seed):
        base = make_instance(instance_key(spec.base_seed, n, seed), workload, 0.0)

        def per_delta(delta):
            inst = base._replace(scores=base.scores + jnp.where(base.is_sink, delta, 0.0))
            return metrics.evaluate(inst, spec.configs, engine=spec.engine, sigma_v=spec.sigma_v,
                                    expected=spec.expected_mse)

        return _loop_map(per_delta, deltas)

    rows = seed_idx.reshape(n_shards, -1)  # (shards, C / shards)
    out = jax.vmap(lambda row: _loop_map(per_seed, row))(rows)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def _mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices), ("i",))


def compute_chunk(spec: SweepSpec, n: int, seed_start: int, seed_stop: int, delta_idx=None,
                  devices=None) -> dict[str, np.ndarray]:
    """Metrics for seeds [seed_start, seed_stop) × the deltas ``delta_idx`` (default all) of N = n.

    Returns metric → (seed_stop − seed_start, len(delta_idx), len(configs)). The seed axis is
    sharded over ``devices``.
    """
    devices = list(devices or jax.devices())
    seeds = (np.arange(seed_start, seed_stop) + spec.seed_offset).astype(np.uint32)
    count = len(seeds)
    didx = np.arange(len(spec.deltas)) if delta_idx is None else np.asarray(delta_idx)
    deltas = np.asarray(spec.deltas, np.float32)[didx]
    pad = (-count) % len(devices)
    if pad:  # repeat the last seed; its copies are dropped below
        seeds = np.concatenate([seeds, np.repeat(seeds[-1:], pad)])
    if len(devices) > 1:
        sharding = jax.sharding.NamedSharding(_mesh(devices), jax.sharding.PartitionSpec("i"))
        seeds = jax.device_put(seeds, sharding)
        deltas = jax.device_put(deltas, jax.sharding.NamedSharding(_mesh(devices), jax.sharding.PartitionSpec()))
    out = _chunk_metrics(seeds, deltas, spec=spec, n=n, n_shards=len(devices))
    return {k: np.asarray(v)[:count] for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


_atomic_write = atomic_write  # kept under this name for the distributed driver


def _save_npz(path: Path, arrays: dict) -> None:
    _atomic_write(path, lambda f: np.savez(f, **arrays))


def _chunk_path(out: Path, n: int, g: int, c: int) -> Path:
    return out / "chunks" / f"n{n}_g{g:03d}_c{c:06d}.npz"


def _load_chunk(path: Path, fingerprint: str, bounds: tuple[int, int, int, int]):
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


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PcastError(f"out_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None


def _claim_dir(out: Path, spec: SweepSpec, layout: dict) -> dict:
    """Write or check out/spec.json; return the chunk layout to use (the saved one on resume)."""
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
    body = {"format_version": _FORMAT_VERSION, "fingerprint": spec.fingerprint(), "layout": layout,
            "spec": spec.to_dict(), "pcast_jax": __version__, "jax": jax.__version__}
    _atomic_write(manifest, lambda f: f.write(json.dumps(body, indent=1)), text=True)
    return layout


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
# Driver
# --------------------------------------------------------------------------------------------


def _balanced(total: int, most: int) -> int:
    """The smallest size that covers ``total`` in as few pieces of at most ``most`` as possible.

    Even pieces (20 as 10 + 10, not 16 + 4) mean one compiled shape instead of two.
    """
    pieces = -(-total // most)
    return -(-total // pieces)


def plan_layout(spec: SweepSpec, *, n_devices: int, chunk_size: int | None = None,
                memory_budget: int | None = None) -> dict:
    """Seeds per chunk and Δ values per group so that one chunk fits ``memory_budget`` bytes.

    Raises PcastError before anything runs when a single (seed, Δ) instance does not fit.
    """
    if memory_budget is None:
        budget = _default_budget()
    else:
        budget = int(check_positive("memory_budget", memory_budget))
    worst = max(estimate_instance_bytes(spec, n) for n in spec.ns)
    if worst * n_devices > budget:
        raise PcastError(
            f"one instance at N={max(spec.ns)} needs ~{worst / 2**30:.2f} GiB per device but the memory "
            f"budget is {budget / 2**30:.2f} GiB; lower n, q_len or the number of configs, or raise memory_budget")
    group = _balanced(len(spec.deltas), max(1, min(len(spec.deltas), budget // (worst * n_devices))))
    per_seed = worst * group
    fit = max(1, budget // per_seed)  # seeds per chunk that fit
    if chunk_size is None:
        chunk_size = _balanced(spec.seeds, min(fit, spec.seeds, 1024))
        if chunk_size >= n_devices:  # a multiple of the device count, when that still fits
            rounded = -(-chunk_size // n_devices) * n_devices
            chunk_size = rounded if rounded <= fit else chunk_size
    else:
        check_int("chunk_size", chunk_size, min_value=1)
        if chunk_size > fit:
            raise PcastError(f"chunk_size={chunk_size} would need ~{chunk_size * per_seed / 2**30:.2f} GiB; "
                             f"at most {fit} seeds per chunk fit the memory budget of {budget / 2**30:.2f} GiB")
    return {"chunk_size": int(chunk_size), "delta_group": int(group)}


def run_sweep(
    spec: SweepSpec,
    out_dir: str | os.PathLike | None = None,
    *,
    chunk_size: int | None = None,
    devices=None,
    progress: bool | None = None,
    memory_budget: int | None = None,
) -> SweepResult:
    """Run (or resume) a sweep. With ``out_dir`` every chunk lands on disk as it finishes.

    Args:
      spec: what to sweep.
      out_dir: folder for spec.json, chunks/, results.npz, summary.csv; None keeps it in memory.
        A folder holding a different sweep is refused; the same sweep resumes.
      chunk_size: seeds per jit call (default: as many as ``memory_budget`` allows). Results do not
        depend on it. On resume the saved layout is used.
      devices: devices to shard the seed axis over (default all ``jax.devices()``). With several
        processes (:func:`pcast_jax.distributed.init_distributed`) and no ``devices``, every process
        calls this alike and the sweep runs over all processes' devices
        (:func:`pcast_jax.distributed.run_sweep_distributed`).
      progress: show a progress bar (default: when stderr is a terminal).
      memory_budget: bytes one chunk may use (default half the accelerator memory, or a quarter
        of the host RAM on CPU).
    """
    if not isinstance(spec, SweepSpec):
        raise PcastError(f"spec must be a SweepSpec, got {type(spec).__name__}")
    if devices is None and jax.process_count() > 1:  # multi-process runtime: shard over every process
        from pcast_jax.distributed import run_sweep_distributed

        return run_sweep_distributed(spec, out_dir, chunk_size=chunk_size, progress=progress,
                                     memory_budget=memory_budget)
    devices = list(devices or jax.devices())
    layout = plan_layout(spec, n_devices=len(devices), chunk_size=chunk_size, memory_budget=memory_budget)
    out = None
    if out_dir is not None:
        out = Path(out_dir)
        _check_writable(out)
        layout = _claim_dir(out, spec, layout)
    fp = spec.fingerprint()
    cs, gs = layout["chunk_size"], layout["delta_group"]
    units = [(ni, g, c) for ni in range(len(spec.ns)) for g in range(math.ceil(len(spec.deltas) / gs))
             for c in range(math.ceil(spec.seeds / cs))]
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(units), desc="sweep", unit="chunk", file=sys.stderr)
    shape = (len(spec.ns), len(spec.configs), len(spec.deltas), spec.seeds)
    data = {m: np.full(shape, np.nan, np.float32) for m in metrics.METRICS}
    try:
        for ni, g, c in units:
            n = spec.ns[ni]
            s0, s1 = c * cs, min(spec.seeds, (c + 1) * cs)
            d0, d1 = g * gs, min(len(spec.deltas), (g + 1) * gs)
            bounds = (s0, s1, d0, d1)
            path = _chunk_path(out, n, g, c) if out is not None else None
            got = _load_chunk(path, fp, bounds) if path is not None else None
            if got is None:
                got = compute_chunk(spec, n, s0, s1, np.arange(d0, d1), devices)
                if path is not None:
                    _save_npz(path, {"fingerprint": np.array(fp), "bounds": np.array(bounds),
                                     **{f"m_{k}": v for k, v in got.items()}})
            for m, vals in got.items():  # vals: (seeds, deltas, configs)
                data[m][ni, :, d0:d1, s0:s1] = np.transpose(vals, (2, 1, 0))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    result = SweepResult(spec, data)
    if out is not None:
        _save_npz(out / "results.npz", data)
        result.write_csv(out / "summary.csv")
    return result
