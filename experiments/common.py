"""What every experiment shares: problem sizes, the run context, the shared sweeps, result types.

An experiment is a thin declaration: it names the sweep it needs (a :class:`SweepSpec`), asks the
:class:`Context` for it (``ctx.sweep(name, spec)``, which runs it through
:func:`pcast_jax.sweep.run_sweep` with its chunks kept under ``DIR/sweeps/<name>`` so a rerun
resumes), and turns the result into a :class:`Section`: tables (written as CSV and markdown),
figures (PNG), and :class:`Finding` rows for the report's summary. No engine code lives here.

Sweeps are shared between experiments (the engine draws one instance per (N, seed) and evaluates
every Δ and config on it): Table 1 and Table 2's N = 4096 column come from Figure 2's Δ sweep,
Table 2 is a slice of Figure 3's N sweep, and Table 3 reuses the paper configurations that some
presets coincide with.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from pcast_jax import report
from pcast_jax.errors import PcastError
from pcast_jax.presets import tagged
from pcast_jax.sweep import SweepResult, SweepSpec, plan_layout, run_sweep

__all__ = [
    "PAPER_ORDER",
    "PAPER_LABELS",
    "PAPER_COLORS",
    "paper_line",
    "Sizes",
    "FULL",
    "QUICK",
    "Column",
    "Table",
    "Part",
    "Figure",
    "Finding",
    "Section",
    "Context",
    "spec_for",
    "delta_sweep",
    "length_sweep",
    "mse_by_length",
    "SINK_DELTA",
]

#: The paper's five configurations in its order (§6.2).
PAPER_ORDER: tuple[str, ...] = tuple(tagged("paper"))
#: The paper's labels for them (Table 2, Figures 2–3).
PAPER_LABELS: dict[str, str] = {
    "fwd_s1": "Forward, S=1",
    "rev_s1": "Reverse, S=1",
    "fwd_s448": "Forward, S=448",
    "fwd_s256": "Forward, S=256",
    "rev_s256": "Reverse, S=256",
}
#: One colour per configuration, the same in every figure.
PAPER_COLORS: dict[str, str] = {
    "fwd_s1": "#d62728",
    "rev_s1": "#ff7f0e",
    "fwd_s448": "#9467bd",
    "fwd_s256": "#2ca02c",
    "rev_s256": "#1f77b4",
}


def paper_line(config: str) -> dict:
    """Keyword arguments of a paper configuration's line (colour, label, marker, line style, width,
    drawing order: :data:`pcast_jax.report.CONFIG_STYLES`): Forward S=256 stays visible on top of
    Reverse S=256, which it nearly equals."""
    return {"color": PAPER_COLORS[config], "label": PAPER_LABELS[config], "ms": 4, "lw": 1.5,
            **report.CONFIG_STYLES[config]}


SINK_DELTA = 7.0  # Table 2, Figure 3, Table 3: Δ = 7


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes of one reproduction run (the paper's by default; :data:`QUICK` is smaller).

    Attributes:
      n_main: KV length of the Δ sweep (Figure 2, Table 1).
      deltas_fig2: Δ grid of Figure 2.
      deltas_table1: Δ rows of Table 1 (a subset of ``deltas_fig2``).
      ns_fig3: KV lengths of Figure 3 (``n_main`` is taken from the Δ sweep).
      ns_table2: KV lengths of Table 2 (a subset of ``ns_fig3``).
      seeds: seeds per (N, Δ) for the MSE sweeps.
      seeds_table1: seeds of Table 1 (the first ones of the Δ sweep).
      seeds_ttest: instances per paired t-test (Appendix B).
      ttest_points: the (Δ, N) points of Appendix B.
      ns_table3: KV lengths of Table 3's preset MSE.
      seeds_table3: seeds of Table 3. Its verdicts compare paired MSE ratios with a 5 % threshold
        while the S ≈ 448 kernels sit about 8 % above the S = 256 ones with a per-instance spread of
        tens of percent (the sinks' own rounding), so a verdict there is decided, the same on another
        seed set, only from about a thousand seeds; at a handful it is robustly "within noise".
      dp_points: grid points of Figure 1's dp(S) curve.
      q_len, d, k_sink, block_kv: the workload of §6.2.
    """

    n_main: int = 4096
    deltas_fig2: tuple[float, ...] = tuple(float(d) for d in range(4, 14))
    deltas_table1: tuple[float, ...] = (5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0)
    ns_fig3: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    ns_table2: tuple[int, ...] = (4096, 8192, 16384)
    seeds: int = 20
    seeds_table1: int = 12
    seeds_ttest: int = 100
    ttest_points: tuple[tuple[float, int], ...] = ((7.0, 4096), (7.0, 16384), (10.0, 16384), (12.0, 16384))
    ns_table3: tuple[int, ...] = (4096, 16384)
    seeds_table3: int = 1024
    dp_points: int = 8192
    q_len: int = 32
    d: int = 128
    k_sink: int = 4

    def __post_init__(self):
        if not set(self.deltas_table1) <= set(self.deltas_fig2):
            raise PcastError(f"deltas_table1={self.deltas_table1} must be a subset of deltas_fig2")
        if SINK_DELTA not in self.deltas_fig2:
            raise PcastError(f"deltas_fig2 must contain Δ = {SINK_DELTA}")
        if self.n_main not in self.ns_fig3 or not set(self.ns_table2) <= set(self.ns_fig3):
            raise PcastError("ns_fig3 must contain n_main and every N of ns_table2")
        if self.seeds_table1 > self.seeds:
            raise PcastError(f"seeds_table1={self.seeds_table1} must be <= seeds={self.seeds}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: The paper's sizes (§6.2–6.4, Appendix B).
FULL = Sizes()
#: ``--quick``: same report, fewer seeds and fewer KV lengths. At this size the jit compiles
#: dominate (one per distinct sweep and N), so the number of N values is what is cut: Appendix B's
#: points all sit at N = 4096 and are read from the Δ sweep, Table 3 runs N = 4096 only.
QUICK = Sizes(
    ns_fig3=(1024, 4096, 16384),
    ns_table2=(4096, 16384),
    seeds=8,
    seeds_table1=8,
    seeds_ttest=8,
    ttest_points=((7.0, 4096), (10.0, 4096), (12.0, 4096)),
    ns_table3=(4096,),
    seeds_table3=8,
    dp_points=2048,
)


# --------------------------------------------------------------------------------------------
# What an experiment returns
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a table: CSV key, markdown header, and how the markdown shows a value."""

    key: str
    header: str
    fmt: Callable[[object], str] = str


@dataclasses.dataclass
class Part:
    """One of the markdown tables a wide :class:`Table` is shown as: a caption, its rows and columns."""

    caption: str
    rows: list[dict]
    columns: list[Column]


@dataclasses.dataclass
class Table:
    """Rows written in full to ``<csv>.csv`` (one kind of row: every row has every column);
    ``columns`` is what the markdown shows.

    ``md_rows`` (optional) are the rows the markdown shows when they differ from the CSV rows
    (pre-formatted cells, one markdown row per configuration). ``parts`` (optional) shows the
    table in the markdown as several smaller tables instead (the CSV still holds every row).
    """

    csv: str
    rows: list[dict]
    columns: list[Column]
    caption: str = ""
    md_rows: list[dict] | None = None
    parts: list[Part] | None = None


@dataclasses.dataclass
class Figure:
    """A matplotlib figure saved as ``<png>.png`` and embedded with its caption."""

    png: str
    figure: object
    caption: str


@dataclasses.dataclass(frozen=True)
class Finding:
    """One claim of the paper checked against our run, for the summary at the top of the report.

    ``verdict`` is ``"yes"`` (reproduces), ``"partly"`` or ``"no"``.
    """

    claim: str
    paper: str
    ours: str
    verdict: str

    def __post_init__(self):
        if self.verdict not in ("yes", "partly", "no"):
            raise PcastError(f"verdict={self.verdict!r} is not one of 'yes', 'partly', 'no'")


@dataclasses.dataclass
class Section:
    """What one experiment contributes to the report."""

    name: str
    title: str
    intro: str
    tables: list[Table] = dataclasses.field(default_factory=list)
    figures: list[Figure] = dataclasses.field(default_factory=list)
    findings: list[Finding] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Run context: sizes, output folder, the shared sweeps
# --------------------------------------------------------------------------------------------


class Context:
    """Everything an experiment needs from the run: sizes, output folder, shared sweeps.

    Args:
      out_dir: the report folder; sweeps keep their chunks in ``out_dir/sweeps/<name>``.
      quick: use :data:`QUICK` sizes (sweep folders get a ``quick-`` prefix so a full and a quick
        run can share one report folder without mixing results).
      progress: show the sweep engine's progress bar (None: when stderr is a terminal).
      log: where one-line progress messages go.
    """

    def __init__(self, out_dir, *, quick: bool = False, progress: bool | None = None,
                 log: Callable[[str], None] = print):
        self.out_dir = Path(out_dir)
        self.quick = bool(quick)
        self.sizes = QUICK if quick else FULL
        self.progress = progress
        self.log = log
        self._sweeps: dict[str, SweepResult] = {}
        self.sweep_log: dict[str, dict] = {}
        self.current: str | None = None  # the experiment now running
        self.uses: dict[str, set[str]] = {}  # experiment -> sweeps it read

    def sweep(self, name: str, spec: SweepSpec) -> SweepResult:
        """Run (or resume, or reuse within this run) the sweep ``name`` declared by ``spec``."""
        self.uses.setdefault(self.current or "", set()).add(name)
        if name in self.sweep_log and self.current and self.current not in self.sweep_log[name]["used_by"]:
            self.sweep_log[name]["used_by"].append(self.current)
        if name in self._sweeps:
            if self._sweeps[name].spec.fingerprint() != spec.fingerprint():
                raise PcastError(f"sweep {name!r} was declared twice with different specs")
            return self._sweeps[name]
        folder = self.out_dir / "sweeps" / (("quick-" if self.quick else "") + name)
        resumed = (folder / "spec.json").exists()
        t0 = time.perf_counter()
        try:
            result = run_sweep(spec, out_dir=folder, progress=self.progress, chunk_size=_balanced_chunk_size(spec))
        except PcastError as exc:
            if "different sweep" in str(exc):
                raise PcastError(f"{exc} (pcast reproduce --fresh recomputes every sweep)") from None
            raise
        wall = time.perf_counter() - t0
        self._sweeps[name] = result
        self.sweep_log[name] = {
            "folder": str(folder), "fingerprint": spec.fingerprint(), "wall_s": round(wall, 3),
            "resumed_from_disk": resumed, "base_seed": spec.base_seed,
            "seed_indices": [spec.seed_offset, spec.seed_offset + spec.seeds - 1],
            "used_by": [self.current] if self.current else [], "spec": spec.to_dict()}
        return result


def _balanced_chunk_size(spec: SweepSpec) -> int:
    """The engine's seeds-per-chunk, evened out so that every chunk has the same size.

    Each distinct chunk shape is one more XLA compile (seconds on a CPU); the engine's default
    plan can leave a ragged last chunk (20 seeds as 16 + 4), which this avoids (10 + 10) without
    exceeding the planned memory per chunk.
    """
    n_devices = jax.device_count()
    planned = plan_layout(spec, n_devices=n_devices)["chunk_size"]
    chunks = math.ceil(spec.seeds / planned)
    size = math.ceil(spec.seeds / chunks)
    if size >= n_devices:
        size = math.ceil(size / n_devices) * n_devices
    return max(1, min(size, planned))


def spec_for(sizes: Sizes, **kw) -> SweepSpec:
    """A SweepSpec with the run's workload (q_len, d, k_sink) and the given fields."""
    base = dict(q_len=sizes.q_len, d=sizes.d, k_sink=sizes.k_sink)
    base.update(kw)
    return SweepSpec(**base)


def delta_sweep(ctx: Context) -> SweepResult:
    """Figure 2's grid (also Table 1 and Table 2's N = n_main column): Δ ∈ [4, 13], the five configs."""
    s = ctx.sizes
    return ctx.sweep("delta", spec_for(s, configs=PAPER_ORDER, deltas=s.deltas_fig2, ns=(s.n_main,),
                                    seeds=s.seeds, expected_mse=True))


def length_sweep(ctx: Context) -> SweepResult:
    """Figure 3's grid at Δ = 7 (also Table 2), minus N = n_main, which :func:`delta_sweep` has."""
    s = ctx.sizes
    ns = tuple(n for n in s.ns_fig3 if n != s.n_main)
    return ctx.sweep("length", spec_for(s, configs=PAPER_ORDER, deltas=(SINK_DELTA,), ns=ns,
                                     seeds=s.seeds, expected_mse=True))


def mse_by_length(ctx: Context, metric: str, config: str) -> dict[int, np.ndarray]:
    """N → per-seed values of ``metric`` for a paper config at Δ = 7, over Figure 3's N grid."""
    d = delta_sweep(ctx)
    ln = length_sweep(ctx)
    out = {}
    for n in ctx.sizes.ns_fig3:
        src = d if n == ctx.sizes.n_main else ln
        out[n] = np.asarray(src.get(metric, config=config, n=n, delta=SINK_DELTA), np.float64)
    return out
