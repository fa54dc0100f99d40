"""What a sweep is and what it returns: :class:`SweepSpec`, :class:`SweepResult`, instance keys.

A sweep's identity is its spec plus the file format and simulator versions
(:meth:`SweepSpec.fingerprint`); saved chunks and folders are matched against it.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import jax
import jaxlib
import numpy as np

from pcast_jax import __version__
from pcast_jax.config import KernelConfig
from pcast_jax.engine import IMPLEMENTATIONS
from pcast_jax.errors import PcastError, check_choice, check_finite, check_int
from pcast_jax.fileio import atomic_write
from pcast_jax.presets import resolve
from pcast_jax.stats import summary_cells
from pcast_jax.workloads import DELTA_MAX, SinkWorkload

__all__ = ["FORMAT_VERSION", "SIMULATOR_VERSION", "SweepSpec", "SweepResult", "check_spec", "instance_key",
           "auto_micro_batch", "CONFIG_GROUP",
           "estimate_instance_bytes", "software_identity"]

#: Version of the files a sweep writes (spec.json, chunks, results.npz). A folder of another version
#: is refused (its results are recomputable), never read through a conversion.
FORMAT_VERSION = 2
#: Most configs compiled into one program: a chunk runs its configs in consecutive groups of this many
#: (:mod:`pcast_jax.sweep.compute`'s docstring has the compile times that set it). A sweep of more
#: configs has it in its fingerprint: its last bits depend on the groups.
CONFIG_GROUP = 8
#: Bump whenever the simulator's numbers change (engine, workloads, metrics): saved chunks of an
#: older version then no longer match the fingerprint and are recomputed instead of resumed.
SIMULATOR_VERSION = 3  # 2: per-instance loops instead of vmap (last-bit changes); 3: causal nonsink_mass from
#    the causal reference, block-scaled casts divide exactly (ties to even)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """What to sweep. Every field is part of the result's identity (``fingerprint``).

    Attributes:
      configs: preset names or KernelConfigs (names must be unique).
      deltas: sink strengths Δ.
      ns: KV lengths N.
      seeds: number of seeds per (N, Δ); seed indices ``seed_offset .. seed_offset + seeds − 1``.
      seed_offset: index of the first seed.
      base_seed: the root PRNG seed.
      q_len, d, k_sink, sink_positions, sigma, sigma_v, sink_logit: the synthetic workload
        (:class:`SinkWorkload`).
      implementation: ``"xla"`` (vectorized, the default) or ``"scan"`` (block by block), as in
        :func:`pcast_jax.engine.attention`.
      expected_mse: also compute ``mse_expected`` (cheap; NaN when off).
      sampled_mse: draw V and compute ``mse`` (True, the default). False: no V is drawn and no
        P·V product computed (``mse`` is NaN), about 3× the instances per second on CPU; every
        other metric is the same (``mse_expected``, same mean, lower variance, is usually the one
        to use then). Needs ``implementation="xla"``.
      micro_batch: seeds per step of the compiled chunk. 1: one seed at a time through a loop (what a
        CPU wants). M > 1: vmapped groups of exactly M seeds (fewer, larger steps for a GPU or TPU);
        results are bit-identical for every chunking and device count at a given M on one device
        kind, but their low-order bits differ from M = 1 (XLA compiles a batch's reductions
        differently). None (the default): :func:`auto_micro_batch` picks it from the default
        backend, 1 on CPU; the value picked is part of the spec (``spec.json``, the banner).
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
    implementation: str = "xla"
    expected_mse: bool = True
    micro_batch: int | None = None
    sampled_mse: bool = True
    sink_logit: float | str | None = None

    def __post_init__(self):
        cfgs = tuple(resolve(c) for c in _as_tuple(self.configs, "configs"))
        if not cfgs:
            raise PcastError("configs must name at least one config")
        names = [c.name for c in cfgs]
        if len(set(names)) != len(names):
            raise PcastError(f"configs must have unique names, got {names}")
        object.__setattr__(self, "configs", cfgs)
        # Δ is added to float32 scores: it must stay finite there (and through every preset's exp2)
        deltas = tuple(check_finite("delta", d, float32=True, max_abs=DELTA_MAX)
                       for d in _as_tuple(self.deltas, "deltas"))
        if not deltas:
            raise PcastError("deltas must hold at least one value")
        object.__setattr__(self, "deltas", deltas)
        ns = tuple(check_int("n", n, min_value=1) for n in _as_tuple(self.ns, "ns"))
        if not ns:
            raise PcastError("ns must hold at least one value")
        object.__setattr__(self, "ns", ns)
        # NumPy integers and floats become Python ones, so that the spec stays JSON-able; values
        # that already are Python numbers are kept as they are (the fingerprint does not change)
        object.__setattr__(self, "seeds", check_int("seeds", self.seeds, min_value=1, max_value=2**32))
        # seed indices are uint32 PRNG data: seed_offset + seeds - 1 must fit in 32 bits
        object.__setattr__(self, "seed_offset", check_int("seed_offset", self.seed_offset, min_value=0,
                                                          max_value=2**32 - self.seeds))
        object.__setattr__(self, "base_seed", check_int("base_seed", self.base_seed, min_value=0,
                                                        max_value=2**31 - 1))
        for name in ("q_len", "d", "k_sink", "sigma", "sigma_v"):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, np.floating):
                object.__setattr__(self, name, float(value))
        if self.sink_positions is not None and not isinstance(self.sink_positions, (str, bytes)) and \
                hasattr(self.sink_positions, "__iter__"):
            object.__setattr__(self, "sink_positions", tuple(
                int(p) if isinstance(p, np.integer) else p for p in self.sink_positions))
        check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        for name in ("expected_mse", "sampled_mse"):
            if not isinstance(getattr(self, name), bool):
                raise PcastError(f"{name}={getattr(self, name)!r} must be True or False")
        if not self.sampled_mse and self.implementation != "xla":
            raise PcastError(f"sampled_mse=False takes every metric from the xla implementation's weights; "
                             f"implementation={self.implementation!r} needs V (use implementation='xla')")
        if self.micro_batch is None:
            object.__setattr__(self, "micro_batch", auto_micro_batch(self))
        object.__setattr__(self, "micro_batch", check_int("micro_batch", self.micro_batch, min_value=1,
                                                          max_value=4096))
        for n in ns:  # validates k_sink / sink_positions / sigma / sink_logit against every N
            object.__setattr__(self, "sink_logit", self.workload(n).sink_logit)

    def workload(self, n: int) -> SinkWorkload:
        """The synthetic workload of KV length ``n``."""
        return SinkWorkload(n=n, q_len=self.q_len, d=self.d, k_sink=self.k_sink,
                            sink_positions=self.sink_positions, sigma=self.sigma, sigma_v=self.sigma_v,
                            sink_logit=self.sink_logit)

    @property
    def config_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.configs)

    def to_dict(self) -> dict:
        """JSON-able form (the inverse of :meth:`from_dict`)."""
        d = dataclasses.asdict(self)
        d["configs"] = [c.to_dict() for c in self.configs]
        d["deltas"] = list(self.deltas)
        d["ns"] = list(self.ns)
        d["sink_positions"] = None if self.sink_positions is None else list(self.sink_positions)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SweepSpec":
        d = dict(d)
        d["configs"] = tuple(KernelConfig.from_dict(c) for c in d["configs"])
        d["deltas"] = tuple(d["deltas"])
        d["ns"] = tuple(d["ns"])
        if d.get("sink_positions") is not None:
            d["sink_positions"] = tuple(d["sink_positions"])
        return cls(**d)

    def fingerprint(self) -> str:
        """Identity of the results: the spec, the file format and the simulator version."""
        ident = {"spec": self.to_dict(), "format": FORMAT_VERSION, "simulator": SIMULATOR_VERSION}
        if len(self.configs) > CONFIG_GROUP:  # more than one program: the last bits depend on the groups
            ident["config_group"] = CONFIG_GROUP
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


#: Share of an accelerator's memory one step of the compiled chunk may take (M seeds' instances).
MICRO_BATCH_MEMORY_SHARE = 0.125
#: Largest automatic micro-batch.
MICRO_BATCH_MAX = 256


def auto_micro_batch(spec: "SweepSpec", *, backend: str | None = None, memory_bytes: int | None = None) -> int:
    """The micro-batch a sweep gets when none is given: 1 on CPU, else the largest power of two M ≤ 256
    whose M instances (:func:`estimate_instance_bytes` at the largest N) take at most 1/8 of one
    device's memory, and no more than the seeds (rounded up to a power of two) need.

    ``backend`` and ``memory_bytes`` default to the default backend and its first device's
    ``bytes_limit`` (16 GiB assumed where the device does not report one).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return 1
    if memory_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        memory_bytes = int(stats.get("bytes_limit", 16 << 30))
    per = max(1, max(estimate_instance_bytes(spec, n) for n in spec.ns))
    fits = max(1, int(memory_bytes * MICRO_BATCH_MEMORY_SHARE) // per)
    need = 1 << max(0, (int(spec.seeds) - 1).bit_length())
    m = min(fits, need, MICRO_BATCH_MAX)
    return 1 << (m.bit_length() - 1)


def optional(module: str):
    """Import an optional dependency of the ``data`` extra, or say which extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PcastError(f"{module} is not installed; it comes with the data extra: "
                         "pip install 'pcast_jax[data]'") from None


def _as_tuple(x, name):
    if isinstance(x, (str, KernelConfig)) or np.isscalar(x):
        return (x,)
    try:
        return tuple(x)
    except TypeError:
        raise PcastError(f"{name}={x!r} must be a value or a sequence of values") from None


def check_spec(spec) -> SweepSpec:
    """``spec`` itself, or a PcastError when it is not a :class:`SweepSpec`."""
    if not isinstance(spec, SweepSpec):
        raise PcastError(f"spec must be a SweepSpec, got {type(spec).__name__}")
    return spec


def software_identity(spec: SweepSpec) -> dict:
    """The spec's fingerprint and the software versions: what every process of one sweep must share."""
    return {"fingerprint": spec.fingerprint(), "pcast_jax": __version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def instance_key(base_seed: int, n, seed):
    """PRNG key of one instance: depends on (base_seed, N, seed) only — never on Δ or layout."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(base_seed), n), seed)


def estimate_instance_bytes(spec: SweepSpec, n: int) -> int:
    """Peak bytes of the compiled chunk while it works on one (seed, Δ) instance at KV length ``n``.

    What XLA allocates for the chunk (arguments, outputs and temporaries, from
    ``compiled.memory_analysis()``) is five (q_len, N) float32 arrays of the instance, five more per
    config of the largest group (:data:`CONFIG_GROUP`: the groups' programs run one after another),
    and three (N, d) arrays for sampled V, whatever the number of seeds or Δ values (the chunk loops
    over them: one instance is live at a time, ``micro_batch`` of them with M > 1).
    This is that count with N padded by one 256-key block; ``tests/test_sweep.py`` holds it between
    1× and 1.6× XLA's own figure across shapes, configs and both engines.
    """
    rows = 4 * spec.q_len * (n + 256) * (5 + 5 * min(len(spec.configs), CONFIG_GROUP))
    v_bytes = 4 * 3 * (n + 256) * spec.d if spec.sampled_mse else 0
    return int(rows + v_bytes)


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
        """Mean over seeds of :meth:`get`."""
        return np.mean(self.get(metric, **kw), axis=-1)

    def coordinates(self) -> dict[str, np.ndarray]:
        """The labels of the four axes of every metric array: N, config name, Δ and seed index."""
        s = self.spec
        return {"n": np.asarray(s.ns, np.int64), "config": np.asarray(s.config_names, np.str_),
                "delta": np.asarray(s.deltas, np.float64),
                "seed": np.arange(s.seed_offset, s.seed_offset + s.seeds, dtype=np.int64)}

    def sink_positions(self) -> tuple[int, ...]:
        """The sink keys' positions: ``spec.sink_positions`` when given, else the first ``k_sink`` keys."""
        s = self.spec
        return tuple(s.sink_positions) if s.sink_positions is not None else tuple(range(s.k_sink))

    def workload_columns(self) -> dict:
        """The workload fields of the spec as flat columns (the sink positions as ``"0 1 2 3"``: the keys
        that are sinks, also when the spec gives only ``k_sink``; empty only when there are none)."""
        s = self.spec
        return {"q_len": s.q_len, "d": s.d, "k_sink": s.k_sink,
                "sink_positions": " ".join(map(str, self.sink_positions())),
                "sigma": s.sigma, "sigma_v": s.sigma_v, "base_seed": s.base_seed, "implementation": s.implementation,
                **({} if s.sink_logit is None else {"sink_logit": s.sink_logit})}

    def attrs(self) -> dict:
        """The results' description: the workload fields, the flags as booleans, the fingerprint and the
        versions (the file format and simulator versions the fingerprint covers; the pcast_jax, jax and
        jaxlib that build this description).

        ``sink_positions`` is an integer array of the sink keys (``spec.sink_positions`` or the first
        ``k_sink`` keys), empty when there are none: what indexing along ``n`` needs, and a type a
        netCDF attribute can hold.
        """
        work = self.workload_columns()
        work["sink_positions"] = np.asarray(self.sink_positions(), np.int64)
        ident = software_identity(self.spec)
        return {**work, "expected_mse": bool(self.spec.expected_mse), "sampled_mse": bool(self.spec.sampled_mse),
                "fingerprint": ident["fingerprint"], "format_version": FORMAT_VERSION,
                "simulator_version": SIMULATOR_VERSION, "pcast_jax_version": ident["pcast_jax"],
                "jax_version": ident["jax"], "jaxlib_version": ident["jaxlib"]}

    def to_dataframe(self):
        """Long format: one row per (N, config, Δ, seed) with every metric and the workload fields as columns.

        ``frame.attrs`` holds :meth:`attrs` and, under ``"variables"``, each metric's and coordinate's
        ``long_name``, ``units`` and ``description`` (:data:`pcast_jax.metrics.QUANTITIES`; also
        :func:`pcast_jax.metrics.describe`). Needs pandas (``pip install 'pcast_jax[data]'``).
        """
        from pcast_jax.metrics import describe

        pd = optional("pandas")
        c = self.coordinates()
        grid = np.meshgrid(*c.values(), indexing="ij")
        cols = {k: g.ravel() for k, g in zip(c, grid)}
        for m, arr in self.data.items():
            cols[m] = np.asarray(arr).ravel()
        for k, v in self.workload_columns().items():
            cols[k] = v
        frame = pd.DataFrame(cols)
        frame["config"] = pd.Categorical(frame["config"], categories=list(c["config"]))
        frame.attrs.update(self.attrs())
        frame.attrs["variables"] = {k: describe(k) for k in (*c, *self.data)}
        return frame

    def to_xarray(self):
        """An ``xarray.Dataset``: one variable per metric over the labelled dims (n, config, delta, seed).

        Every variable and coordinate carries ``long_name``, ``units`` (none on the string labels) and
        ``description`` (:data:`pcast_jax.metrics.QUANTITIES`); the Dataset's attributes are
        :meth:`attrs` (workload, boolean flags, fingerprint, versions). ``config_spec`` (along
        ``config``) holds each kernel in :meth:`~pcast_jax.config.KernelConfig.to_string` form. Needs
        xarray (``pip install 'pcast_jax[data]'``).
        """
        from pcast_jax.metrics import describe

        xr = optional("xarray")
        dims = ("n", "config", "delta", "seed")
        coords = {k: (k, v, describe(k)) for k, v in self.coordinates().items()}
        coords["config_spec"] = ("config", [k.to_string() for k in self.spec.configs], describe("config_spec"))
        return xr.Dataset({m: (dims, np.asarray(v), describe(m)) for m, v in self.data.items()}, coords=coords,
                          attrs=self.attrs())

    def summary_rows(self) -> list[dict]:
        """One row per (N, config, Δ): the seed count, every metric's mean and standard error, the workload."""
        rows = []
        s = self.spec
        work = self.workload_columns()
        for ni, n in enumerate(s.ns):
            for ci, c in enumerate(s.config_names):
                for di, dlt in enumerate(s.deltas):
                    row = {"n": n, "config": c, "delta": dlt, "seeds": s.seeds, **work}
                    for m, arr in self.data.items():
                        row[f"{m}_mean"], row[f"{m}_sem"] = summary_cells(arr[ni, ci, di])
                    rows.append(row)
        return rows

    def write_csv(self, path: str | os.PathLike) -> Path:
        """Write :meth:`summary_rows` to ``path`` as CSV (atomically)."""
        rows = self.summary_rows()
        path = Path(path)

        def write(f):
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)

        atomic_write(path, write, text=True)
        return path
