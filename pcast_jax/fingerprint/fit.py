"""Fit a kernel's P-cast to its outputs on the probes: candidate configs through the simulator.

One module, over 600 lines: the field groups of the search narrow one another in order (each group's
candidates crossed while the others stay at the best so far), so they read as one sequence.

Each candidate is a :class:`~pcast_jax.config.KernelConfig` run by :func:`pcast_jax.engine.attention`
on the probes' logits; its residual is the RMS of |o − s| / (|o| + |s|) over the output elements
either side holds nonzero, so a probability read at e^-17 weighs as much as the dominant key's. The
fields are searched in groups, each group's candidates crossed while the other fields stay at the best so far:

========================  ================================================  =====================
group                     fields                                            first decided by
========================  ================================================  =====================
``cast``                  scale, scale_mode, p_format                       ``ladder`` rows alone
``walk``                  order, block_kv                                   every row
``split``                 kv_splits, split_layout                           every row
``rescale``               rescale_threshold, rescale_unit, rescale_comp.    every row
``sink``                  sink_mode (probes with sinks only)                every row
``accumulator``           accumulator, f16_round_keys, v_channel_max        every row
``tile``                  block_q (the query tile)                          every row
``skip``                  skip_softmax_threshold                            every row
``offset``                p_offset, softmax                                 every row
========================  ================================================  =====================

The ``cast`` group is first decided on the ``ladder`` rows alone (every tile, order and split
gives them the same output), with P against the running max and with P normalised before the cast
(``p_offset="row_lse"``, which the ladder tells apart; a block's own max is the running max there),
its best candidates kept; then each pass searches the groups in the order of the table, ``cast``
last, twice, stopping at the first exact fit. The ``tile``, ``skip`` and ``offset`` groups
(:data:`AXIS_GROUPS`) come in only where the others leave a residual above the exact-fit floor
(a kernel without those axes is searched as before they existed), after the groups they exclude.
A candidate that turns a query-tile axis on (the tile-amax scale, a skip threshold) starts from a
tile of :data:`_START_BLOCK_Q` rows, which the ``tile`` group then reads (the ``tile`` and
``tile_reverse`` rows differ within a tile).
Then each field's evidence is read from every group's candidates around the best: the best residual
among those with another value of the field (the runner-up) and which probe family it missed most.
A value whose candidate fits within :func:`tolerance` of the best stays a candidate: a field with
more than one is *undetermined*. Configs that are one function across groups are added to the
evidence: P against each block's own max is P against the running max of one-block splits; the
tile-amax scale over a tile beyond the probes' rows is the multiply mode at the format's max
(:func:`_amax_twin`). Of the ``skip`` group around a config that skips nothing, λ is looked at from
the smallest up to the first that misses (a larger λ skips more).

The ``walk`` group is first narrowed by a read: the tiles whose predicted collapse pattern best
matches the ``walk`` rows (``_read_walk``), :data:`WALK_KEPT` of them in both orders, are the
ones simulated; the others are ruled out by that read alone.

When that search does not fit exactly, it is run again from what it found with the cast of each
other scale mode and P format that fits the ladder rows alike (at most :data:`RESTARTS` more), the
fields a wrong cast drags along searched first (:data:`RESTART_PASSES`): a block-scaled P (MXFP8) and
the per-block 2^k scale read the same on one block and part only on many, and a per-block dynamic
scale read as the fixed one leaves an f16 accumulator absorbing the difference.

Candidate values are a grid (powers of two for S, tiles in steps of 16 up to 256, 1–16 splits, τ
of 0.75–8, query tiles of 16–128 rows, λ from 2^-12 to 2^-2 in steps of 4×, the INT8 and UINT8 P
formats among the others) joined with every value a preset in :data:`pcast_jax.presets.PRESETS` uses,
so a preset added later is among the candidates. Each candidate is one program compiled without the backend's
optimizations (:data:`COMPILER_OPTIONS`); its output is cached per probe set and config, so fitting
many kernels on the same probes simulates each candidate once.

Not fitted (:data:`NOT_FITTED`, listed in every :class:`~pcast_jax.fingerprint.result.Fingerprint`):
what the probes cannot see or :class:`~pcast_jax.config.KernelConfig` has no field for. A kernel that
differs there shows it only in the residual.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from pcast_jax import numberline
from pcast_jax.config import COMPUTED_SCALE_MODES, KNOBS, MMA_K, KernelConfig, Unfitted, choices
from pcast_jax.errors import PcastError, check_int
from pcast_jax.fingerprint.probes import (
    FAMILIES,
    LADDER_KEYS,
    N_KEYS,
    OUTPUT_DTYPES,
    ROWS,
    SEGMENTS,
    WALK_ROWS,
    ProbeSet,
    check_kernel_output,
    probes,
)
from pcast_jax.fingerprint.result import RESIDUAL_FLOOR, FieldEvidence, Fingerprint

__all__ = ["identify", "fit", "check_outputs", "simulate_outputs", "explain_preset", "fittable_presets", "GROUPS",
           "FIELDS", "FIT_LIMIT", "NOT_FITTED", "UNFITTED_FIELDS", "tolerance", "candidate_values"]

#: The search groups, searched in this order after ``cast``; each field declares its group (or why it is
#: not fitted) where :class:`~pcast_jax.config.KernelConfig` declares it (``knob(fit=...)``).
GROUP_ORDER = ("cast", "walk", "split", "rescale", "sink", "accumulator", "tile", "skip", "offset")
#: Field groups, in :data:`GROUP_ORDER`: each group's fields in declaration order.
GROUPS: dict[str, tuple[str, ...]] = {g: tuple(f for f, spec in KNOBS.items() if spec.fit == g) for g in GROUP_ORDER}
FIELDS: tuple[str, ...] = tuple(f for fields in GROUPS.values() for f in fields)
_LABELS = {f.name for f in dataclasses.fields(KernelConfig) if not f.compare}
#: What the fit does not read, and why: reported in every fingerprint (``Fingerprint.not_fitted``): what ℓ
#: sums (no field selects it), then each field that declares itself not fitted (:class:`~pcast_jax.config.Unfitted`).
NOT_FITTED: dict[str, str] = {
    "row_sum": "what ℓ sums: every KernelConfig sums the pre-cast P (no field selects the cast P), so a kernel "
               "summing the cast values is fitted as the nearest pre-cast config and shows only in the residual",
    **{f: spec.fit.why for f, spec in KNOBS.items() if isinstance(spec.fit, Unfitted) and f not in _LABELS},
}
#: Config fields no candidate sets (a kernel using them is fitted as the nearest config without them).
UNFITTED_FIELDS: tuple[str, ...] = tuple(f for f, spec in KNOBS.items()
                                         if isinstance(spec.fit, Unfitted) and spec.fit.excluded)
#: Largest best residual that still counts as a fit: beyond it the outputs fit no candidate.
FIT_LIMIT = 0.05
#: Candidates of the ``cast`` group kept (by their ladder residual) for the search over every row.
CAST_KEPT = 12
#: Searches started from other ladder-tied casts when the first does not fit exactly.
RESTARTS = 2
#: Groups of the query-tile axes and of what P is taken against: searched only where the others leave a
#: residual (:func:`_descend`).
AXIS_GROUPS = ("tile", "skip", "offset")
#: Group order of a search restarted from another cast: the fields a wrong cast pulled along (an f16
#: accumulator, a τ, a sink placement absorbing its error) before the order, tile and split.
RESTART_PASSES = ("accumulator", "sink", "rescale", "walk", "split", "tile", "skip", "offset", "cast")
#: Tiles kept (in both orders) by the ``walk`` rows' collapse pattern for simulation.
WALK_KEPT = 4

#: P formats, each once by its own name (no alias).
_P_FORMATS = tuple(dict.fromkeys(f.name for f in numberline.FORMATS.values())) + tuple(numberline.BLOCK_FORMATS)
#: P formats of the computed scales (``dynamic``, ``tile_amax``): the element formats that are not integers.
_AMAX_FORMATS = tuple(dict.fromkeys(f.name for f in numberline.FORMATS.values() if not f.is_integer))
#: Scale modes with a static S (the others compute theirs per block).
_STATIC_MODES = tuple(m for m in choices("scale_mode") if m not in COMPUTED_SCALE_MODES)
_TILES = tuple(range(16, 257, 16))
_SPLITS = (2, 3, 4, 6, 8, 16)
_TAUS = (0.75, 1.0, 2.0, 4.0, 8.0)
#: Query tiles (``block_q``): 128 stands for every tile beyond the probes' 64 rows (one padded tile).
_QUERY_TILES = (16, 32, 64, 128)
#: Skip-softmax thresholds λ.
_SKIPS = tuple(2.0**-k for k in (2, 4, 6, 8, 10, 12))
#: The query tile a candidate that turns a query-tile axis on starts from (the ``tile`` group reads it).
_START_BLOCK_Q = 64


def tolerance(best: float) -> float:
    """Largest residual of a candidate that fits as well as the best one (``best``): 2·best + floor."""
    return 2.0 * best + RESIDUAL_FLOOR


def fittable_presets() -> dict[str, KernelConfig]:
    """The presets whose values seed the candidates: every preset of the registry (each field a preset
    sets is a candidate field, but the MMA accumulator model: :data:`UNFITTED_FIELDS`)."""
    from pcast_jax.presets import PRESETS

    return dict(PRESETS)


def _grid(group: str) -> set[tuple]:
    """The grid part of a group's candidates: choices from the fields' declared types, numbers from the
    grids above; a group with no grid of its own crosses its fields' choices."""
    d = {f: getattr(KernelConfig(), f) for f in GROUPS[group]}  # the group's defaults
    if group == "cast":
        scales = sorted({2.0**k for k in range(-8, 13)} | {c.scale for c in fittable_presets().values()})
        grid = {(s, m, p) for s in scales for m in _STATIC_MODES for p in _P_FORMATS}
        grid |= {(1.0, m, p) for m in COMPUTED_SCALE_MODES for p in _AMAX_FORMATS}
        # the tile-amax scale of a tile beyond the probes' rows (_amax_twin): the format's max
        return grid | {(numberline.get_format(p).max, "multiply", p) for p in _AMAX_FORMATS}
    if group == "walk":
        return {(o, b) for o in choices("order") for b in _TILES}
    if group == "split":
        return {tuple(d.values())} | {(n, lay) for n in _SPLITS for lay in choices("split_layout")}
    if group == "rescale":
        return {tuple(d.values())} | {(t, u, c) for t in _TAUS for u in choices("rescale_unit")
                                      for c in choices("rescale_compensation")}
    if group == "accumulator":  # FP32, and f16 rounded once per block or per MMA of 32 keys
        return {(a, keys, d["v_channel_max"]) for a in choices("accumulator")
                for keys in ((0,) if a == d["accumulator"] else (0, MMA_K))}
    if group == "tile":
        return {(0,)} | {(b,) for b in _QUERY_TILES}
    if group == "skip":
        return {(0.0,)} | {(lam,) for lam in _SKIPS}
    return set(itertools.product(*(choices(f) for f in GROUPS[group])))


def candidate_values(group: str) -> list[tuple]:
    """The candidate value tuples of one group's fields (:data:`GROUPS`): the grid and the registry's."""
    seen = {tuple(getattr(c, f) for f in GROUPS[group]) for c in fittable_presets().values()}
    return sorted(_grid(group) | seen, key=repr)


def _variant(cfg: KernelConfig, group: str, values: tuple) -> KernelConfig | None:
    """``cfg`` with one group's fields set to ``values`` (None when that combination is not a valid config)."""
    changes = dict(zip(GROUPS[group], values))
    if group == "rescale" and changes["rescale_compensation"] == "pow2":
        # keep the P scale the kernel applies: S·2^-τ is what the ladder read
        changes["scale"] = cfg.effective_scale * 2.0 ** changes["rescale_threshold"]
    if group == "cast" and cfg.rescale_compensation == "pow2":
        changes["scale"] = changes["scale"] * 2.0**cfg.rescale_threshold
    tiled = changes.get("scale_mode", cfg.scale_mode) == "tile_amax" or changes.get("skip_softmax_threshold",
                                                                                    cfg.skip_softmax_threshold)
    if tiled and not changes.get("block_q", cfg.block_q):  # a query-tile axis turned on: the tile to start from
        changes["block_q"] = _START_BLOCK_Q
    try:
        return dataclasses.replace(cfg, name="", **changes)
    except PcastError:
        return None


def _variants(cfg: KernelConfig, *changes: tuple) -> KernelConfig | None:
    """``cfg`` with several groups' values set in turn (:func:`_variant`; None when one is not valid)."""
    for group, values in changes:
        cfg = _variant(cfg, group, values) if cfg is not None else None
    return cfg


@functools.lru_cache(maxsize=8)
def _inputs(key: tuple) -> dict:
    """Logits (F, H, T, N) and values (F, H, N, D) of the probes ``key`` names, and the ladder part."""
    from pcast_jax import engine

    head_dim, scale, causal, sinks, seed = key
    ps = probes(head_dim, scale=scale, causal=causal, sinks=sinks, seed=seed)
    q, k, v = (np.moveaxis(a, 2, 1) for a in (ps.q, ps.k, ps.v))  # (F, H, len, D)
    scores, v_seen = engine.prepare_qkv(q, k, v, KernelConfig(), scale=ps.scale)
    sink = None if ps.sinks is None else ps.sinks
    return {"all": (scores, v_seen, sink),
            "ladder": (scores[:1, :1], v_seen[:1, :1], None if sink is None else sink[:1])}


_SIM_CACHE: dict = {}
_SIM_CACHE_MAX = 4096
#: XLA options of the candidates' programs (per program: nothing global changes). Each program is
#: compiled for one use, so compiling is most of a fit's time: without the backend's optimizations a
#: program compiles about 3x faster and runs the same arithmetic (its outputs agree with the optimized
#: program's to a unit in the last place, far below :data:`RESIDUAL_FLOOR`).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
#: Candidates simulated by one program: the simulator specializes on every field, so no two
#: candidates share a compiled program, but one program computing several shares its compile's fixed
#: cost and the work the candidates have in common (the logits' block maxima, the exponentials).
BATCH = 12


def _programs(key: tuple, part: str, cfgs: list[KernelConfig]) -> list[np.ndarray]:
    """The outputs of ``cfgs`` on the probes, computed by one compiled program."""
    import jax

    from pcast_jax import engine

    scores, v, sink = _inputs(key)[part]

    def run(scores, v, sink):
        return [engine.attention(scores, v, cfg, sink_logit=sink).out for cfg in cfgs]

    program = jax.jit(run).lower(scores, v, sink).compile(COMPILER_OPTIONS)
    return [np.asarray(out) for out in program(scores, v, sink)]


def _simulate_all(key: tuple, part: str, cfgs) -> None:
    """Caches every candidate's output on the probes (F, H, T, D) (or the ladder part), :data:`BATCH`
    candidates a program: None for one the simulator refuses or whose output is not finite (an f16
    accumulator that overflows)."""
    todo = [c for c in dict.fromkeys(cfgs) if (key, part, c) not in _SIM_CACHE]
    for i in range(0, len(todo), BATCH):
        chunk = todo[i:i + BATCH]
        try:
            outs = _programs(key, part, chunk)
        except PcastError:  # one of them is refused: each alone
            outs = []
            for cfg in chunk:
                try:
                    outs += _programs(key, part, [cfg])
                except PcastError:
                    outs.append(None)
        for cfg, out in zip(chunk, outs):
            if len(_SIM_CACHE) >= _SIM_CACHE_MAX:
                _SIM_CACHE.pop(next(iter(_SIM_CACHE)))
            _SIM_CACHE[(key, part, cfg)] = out if out is not None and np.all(np.isfinite(out)) else None


def _simulate(key: tuple, part: str, cfg: KernelConfig) -> np.ndarray | None:
    """One candidate's cached output (:func:`_simulate_all`)."""
    if (key, part, cfg) not in _SIM_CACHE:
        _simulate_all(key, part, [cfg])
    return _SIM_CACHE[(key, part, cfg)]


def output_dtype_name(dtype) -> str:
    """The :data:`OUTPUT_DTYPES` name of ``dtype`` (a name or a dtype); PcastError naming ``output_dtype``."""
    if isinstance(dtype, str) and dtype in OUTPUT_DTYPES:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    for name, known in OUTPUT_DTYPES.items():
        if dt == np.dtype(known):
            return name
    raise PcastError(f"output_dtype={dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")


def check_outputs(ps: ProbeSet, outputs, *, what: str = "outputs") -> np.ndarray:
    """The kernel's outputs on ``ps`` as float32 (F, T, H, D): :func:`~.probes.check_kernel_output`'s checks, and
    never zero everywhere nor on the ladder's dominant key; PcastError naming ``what`` otherwise."""
    out = check_kernel_output(outputs, shape=ps.out_shape, dtype=np.float32, what=what,
                              where=lambda idx: f"probe family {FAMILIES[idx[0]]!r}")
    if not out.any():
        raise PcastError(f"{what} is zero everywhere: a kernel's output on the probes never is (an unlaunched "
                         "kernel or an unfilled buffer?); nothing is read from it")
    dominant = out[FAMILIES.index("ladder"), :, 0, 0]  # key 0 at the row's max: its P is 1, never cast to 0
    if not dominant.all():
        rows = np.flatnonzero(dominant == 0)
        raise PcastError(f"{what} is zero on the ladder's dominant key (family 'ladder', head 0, column 0) in "
                         f"{rows.size} of {dominant.size} rows (first row {int(rows[0])}): a kernel that zeroes a "
                         "row's largest probability outputs nothing to read (an unfilled buffer?); nothing is read")
    return out


def _relative_errors(out: np.ndarray, sim: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per family: Σ r² and the count of elements where either side is nonzero, r = |o − s| / (|o| + |s|).

    Each output element weighs alike, whatever its size: a probability read at e^-17 that the cast
    zeroed counts as much as the dominant key's (r = 1 where one side is 0 and the other is not).
    """
    o, s = out.astype(np.float64), sim.astype(np.float64)
    den = np.abs(o) + np.abs(s)
    live = den > 0
    r = np.where(live, np.abs(o - s) / np.where(live, den, 1.0), 0.0)
    axes = tuple(range(1, o.ndim))
    return np.sum(r * r, axis=axes), np.sum(live, axis=axes)


class _Scorer:
    """Residuals of candidates against one set of outputs, per probe family: the RMS relative error
    over the output elements either side holds nonzero (``_relative_errors``)."""

    def __init__(self, ps: ProbeSet, out: np.ndarray, output_dtype: str = "float32"):
        self.key = ps.key
        self.dtype = OUTPUT_DTYPES[output_dtype]
        self.out = {"all": np.moveaxis(out, 2, 1), "ladder": np.moveaxis(out, 2, 1)[:1, :1]}
        self.seen: dict[KernelConfig, tuple[float, np.ndarray]] = {}

    def _errors(self, cfg: KernelConfig, part: str):
        sim = _simulate(self.key, part, cfg)
        if sim is None:  # the candidate's own output is not finite here: it cannot be the kernel
            n = self.out[part].shape[0]
            return np.ones(n), np.ones(n)
        if self.dtype is not np.float32:  # the kernel's output type, rounded as it rounds
            top = float(ml_dtypes.finfo(self.dtype).max)
            sim = np.clip(sim, -top, top).astype(self.dtype).astype(np.float32)
        return _relative_errors(self.out[part], sim)

    def simulate(self, cfgs, part: str = "all") -> None:
        """Simulates the candidates not yet seen together (:func:`_simulate_all`)."""
        _simulate_all(self.key, part, [c for c in cfgs if part != "all" or c not in self.seen])

    def residual(self, cfg: KernelConfig, part: str = "all") -> float:
        if part == "all" and cfg in self.seen:
            return self.seen[cfg][0]
        sq, n = self._errors(cfg, part)
        r = math.sqrt(float(sq.sum()) / max(int(n.sum()), 1))
        if part == "all":
            self.seen[cfg] = (r, np.sqrt(sq / np.maximum(n, 1)))
        return r

    def family_residuals(self, cfg: KernelConfig) -> np.ndarray:
        self.residual(cfg)
        return self.seen[cfg][1]


def _blocks(cfg: KernelConfig) -> int:
    return -(-N_KEYS // cfg.block_kv)


def _group_candidates(best: KernelConfig, group: str, values=None) -> list[KernelConfig]:
    out = []
    for vals in values if values is not None else candidate_values(group):
        if group == "split" and vals[0] > _blocks(best):
            continue  # more splits than blocks: each runs one block, as kv_splits = n_blocks does
        cfg = _variant(best, group, vals)
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out


def _search(scorer: _Scorer, best: KernelConfig, group: str, values=None) -> KernelConfig:
    cands = [best] + _group_candidates(best, group, values)
    scorer.simulate(cands)
    # a tie keeps the config the search holds (its neighbours are simulated already), else the plainer
    return min(cands, key=lambda c: (scorer.residual(c), c != best, _simplicity(c)))


def _skip_candidates(scorer: _Scorer, best: KernelConfig, tol: float) -> list[KernelConfig]:
    """The ``skip`` neighbours of a ``best`` that skips nothing, smallest λ first, up to the first that
    fits worse than ``tol``: a larger λ skips every block a smaller one skips, and more."""
    out: list[KernelConfig] = []
    for cfg in _group_candidates(best, "skip", sorted(candidate_values("skip"))):
        if cfg != best:
            out.append(cfg)
            if scorer.residual(cfg) > tol:
                break
    return out


def _descend(scorer: _Scorer, best: KernelConfig, passes: list[str], values: dict) -> KernelConfig:
    """Searches each group of ``passes`` in turn around the best so far, twice; stops at an exact fit
    (the evidence then looks at every group around it, so a field an early stop left is still weighed).

    The :data:`AXIS_GROUPS` come in only where the other groups leave a residual: each once around
    their best, then every group again where one of them moved it (a kernel without those axes
    searches what it did without them)."""
    def rounds(best, groups):
        for _ in range(2):
            for group in groups:
                best = _search(scorer, best, group, values.get(group))
                if scorer.residual(best) <= RESIDUAL_FLOOR:
                    return best
        return best

    best = rounds(best, [g for g in passes if g not in AXIS_GROUPS])
    if scorer.residual(best) <= RESIDUAL_FLOOR:
        return best
    moved, axes = best, [g for g in passes if g in AXIS_GROUPS]
    scorer.simulate([c for g in axes for c in _group_candidates(best, g, values.get(g))])  # one program
    for group in axes:
        moved = _search(scorer, moved, group, values.get(group))
    return best if moved == best else rounds(moved, passes)


def _simplicity(cfg: KernelConfig) -> tuple:
    """Ties go to the plainer config: defaults first, then smaller numbers."""
    default = KernelConfig(causal=cfg.causal)
    return (sum(getattr(cfg, f) != getattr(default, f) for f in FIELDS), cfg.kv_splits, cfg.rescale_threshold,
            repr(cfg))


def fit(ps: ProbeSet, outputs, *, output_dtype=None, calls: int = 0, seconds_calls: float = 0.0) -> Fingerprint:
    """The P-cast fields that reproduce ``outputs``, a kernel's output on the probes ``ps``.

    Args:
      ps: the probes (:func:`pcast_jax.fingerprint.probes.probes`).
      outputs: the kernel's output on them, (batch, tokens, heads, head_dim) as the queries.
      output_dtype: the type the kernel returned its output in (:data:`OUTPUT_DTYPES`: ``"bfloat16"``,
        ``"float16"``, ``"e4m3"`` …): each candidate's output is rounded to it before comparing.
        Default: ``outputs``' own dtype when it is one of those, else float32.
      calls: how many black-box calls produced ``outputs`` (reported).
      seconds_calls: seconds those calls took (reported).

    Raises:
      PcastError: outputs of the wrong shape or dtype, non-finite outputs, or outputs that fit no
        candidate (best residual above :data:`FIT_LIMIT`; the message names it and the best config).
    """
    if not isinstance(ps, ProbeSet):
        raise PcastError(f"probes={type(ps).__name__} must be a ProbeSet (pcast_jax.fingerprint.probes)")
    t0 = time.perf_counter()
    if output_dtype is None:
        dt = getattr(outputs, "dtype", None)
        names = [n for n, d in OUTPUT_DTYPES.items() if dt is not None and np.dtype(dt) == np.dtype(d)]
        output_dtype = names[0] if names else "float32"
    output_dtype = output_dtype_name(output_dtype)
    out = check_outputs(ps, outputs)
    scorer = _Scorer(ps, out, output_dtype)
    groups = [g for g in GROUPS if g != "sink" or ps.sinks is not None]
    passes = groups[1:] + groups[:1]  # the cast read from the ladder first, searched again on every row last
    start = KernelConfig(causal=ps.causal)
    # the reads count zeros: an 8-bit output type zeroes small outputs itself, so they are not made
    reads = np.dtype(OUTPUT_DTYPES[output_dtype]).itemsize > 1
    # the cast is read on the ladder with P against the running max (a block's own max is the same there:
    # one live block) and with P normalised before the cast, which the ladder tells apart
    values, values_lse = _read_cast(ps, out) if reads else (None, None)
    cast = _group_candidates(start, "cast", values)
    cast += _group_candidates(start.replace(p_offset="row_lse"), "cast", values_lse)
    scorer.simulate(cast, "ladder")
    cast = sorted(cast, key=lambda c: (scorer.residual(c, "ladder"), _simplicity(c)))
    kept = [tuple(getattr(c, f) for f in GROUPS["cast"]) for c in cast[:CAST_KEPT]]
    best = cast[0]
    ladder_r = scorer.residual(best, "ladder")
    if ladder_r > FIT_LIMIT:  # one block, no order, tile or split: every kernel the candidates model fits here
        raise PcastError(f"outputs fit no candidate: the best residual on the ladder rows is {ladder_r:.3g} "
                         f"(> {FIT_LIMIT:g}) for {best.to_string()}; the kernel does something the candidates "
                         "do not model")
    walk = _read_walk(ps, out) if reads else None
    kept_values = {"cast": kept, "walk": walk}
    # other starts: the ladder's best of each other (scale mode, P format) that fits the ladder alike
    tied = [c for c in cast if scorer.residual(c, "ladder") <= tolerance(ladder_r)]
    starts, classes = [], set()
    for c in tied:
        if (c.scale_mode, c.p_format) not in classes:
            classes.add((c.scale_mode, c.p_format))
            starts.append(c)
    found = None
    for start_cfg in starts[:1 + RESTARTS]:
        if found is None:
            best = _descend(scorer, start_cfg, passes, kept_values)
        else:  # what the first search found, with this cast; the fields a cast drags along first
            cast_vals = tuple(getattr(start_cfg, f) for f in GROUPS["cast"])
            best = _descend(scorer, _variant(found, "cast", cast_vals) or start_cfg,
                            [g for g in RESTART_PASSES if g in groups], kept_values)
        if found is None or scorer.residual(best) < scorer.residual(found):
            found = best
        if scorer.residual(found) <= RESIDUAL_FLOOR:
            break
    best = found
    best_r = scorer.residual(best)
    if best_r > FIT_LIMIT:
        raise PcastError(f"outputs fit no candidate: the best residual is {best_r:.3g} (> {FIT_LIMIT:g}) for "
                         f"{best.to_string()}; the kernel does something the candidates do not model")
    fields: dict[str, FieldEvidence] = {}
    tol = tolerance(best_r)
    # the config holds the plainest of what fits alike, and the evidence is read around it: a class of
    # configs that are one function can span two groups (E4M3FNUZ at S/2 is E4M3 at S, whose S·2^τ with
    # the 2^-τ compensation is one more), so the neighbours of each plainer member are looked at too
    cands: list[KernelConfig] = []
    for _ in range(3):
        for group in groups:
            near = (_skip_candidates(scorer, best, tol) if group == "skip" and not best.skip_softmax_threshold
                    else _group_candidates(best, group, kept_values.get(group)))
            cands += [c for c in near if c not in cands]
        scorer.simulate(cands)
        plain = min([best] + [c for c in cands if scorer.residual(c) <= tol], key=_simplicity)
        if plain == best:
            break
        cands.append(best)
        best = plain
    # every config that fits alike with its 2^-τ compensation turned (the same applied scale S·2^-τ):
    # the class E4M3 at S = E4M3FNUZ at S/2 = S·2^τ compensated spans the cast and rescale groups
    twins = [_variant(c, "rescale", (c.rescale_threshold, c.rescale_unit, "pow2"))
             for c in [best] + cands if c.rescale_threshold and c.rescale_compensation == "none"
             and scorer.residual(c) <= tol]
    # P against each block's own max is P against the running max of splits of one block each
    for c in [best] + [c for c in cands if scorer.residual(c) <= tol]:
        if c.p_offset == "block_max" and c.kv_splits == 1:
            twins.append(_variants(c, ("offset", ("running_max", c.softmax)), ("split", (_blocks(c), "contiguous"))))
        elif c.p_offset == "running_max" and c.kv_splits == _blocks(c) > 1:
            twins.append(_variants(c, ("split", (1, "contiguous")), ("offset", ("block_max", c.softmax))))
    twins += [_amax_twin(c) for c in [best] + cands if scorer.residual(c) <= tol]
    cands += [t for t in twins if t is not None and t not in cands]
    scorer.simulate(cands)
    cands = [c for c in cands if c != best]
    for group in groups:
        for field in GROUPS[group]:  # over every group's candidates: S·2^-τ is one function of S and τ
            fields[field] = _evidence(scorer, best, cands, field, tol)
    runner_cfg, runner_r = None, math.inf
    for c in cands:
        r = scorer.residual(c)
        if r < runner_r:
            runner_cfg, runner_r = c, r
    best_r = scorer.residual(best)
    for field in FIELDS:
        if field not in fields:  # sink_mode without sinks in the probes
            fields[field] = FieldEvidence(field=field, value=getattr(best, field), determined=False,
                                          candidates=tuple(sorted({c[0] for c in candidate_values("sink")})),
                                          probe="", residual=best_r, runner_up=None, runner_up_residual=math.inf,
                                          note="not probed: the probes have no learned sink (sinks=False)")
    return Fingerprint(config=best, fields=fields, residual=best_r, runner_up=runner_cfg,
                       runner_up_residual=runner_r, calls=calls, seconds_calls=seconds_calls,
                       seconds_fit=time.perf_counter() - t0, candidates=len(scorer.seen),
                       probe_key=ps.key, not_fitted=dict(NOT_FITTED))


def _amax_twin(cfg: KernelConfig) -> KernelConfig | None:
    """The config ``cfg`` is on the probes through a query tile beyond their rows, or None: one padded
    tile, whose padding rows hold P = 1 without a learned sink (``pcast_jax.block.padding_max``), so its
    amax is 1 and the tile-amax scale is the format's max: the multiply mode at S = max (simulated like
    every candidate: on sink heads that start the running max, the two part)."""
    beyond = _QUERY_TILES[-1]
    if cfg.scale_mode == "tile_amax" and cfg.block_q > ROWS and not cfg.skip_softmax_threshold:
        return _variant(cfg, "cast", (cfg.fmt.max, "multiply", cfg.p_format))
    if (cfg.scale_mode == "multiply" and cfg.p_format in _AMAX_FORMATS and cfg.scale == cfg.fmt.max
            and not cfg.skip_softmax_threshold):
        return _variants(cfg, ("cast", (1.0, "tile_amax", cfg.p_format)), ("tile", (beyond,)))
    return None


def _read_cast(ps: ProbeSet, out: np.ndarray) -> tuple[list[tuple], list[tuple]]:
    """The ``cast`` candidates whose S agrees with where the ladder's values stop surviving: those for P
    against the running max, and those for P normalised before the cast (``p_offset="row_lse"``).

    A ladder key at Δ below the row's max survives an element format's cast iff e^-Δ·S exceeds the
    format's round-to-zero bound r (2^-10 for E4M3, 1/2 for INT8): the surviving and the collapsed reads
    bracket S between r·e^Δ_survived and r·e^Δ_collapsed (a factor 2 of slack either side). A normalised
    P is e^-Δ/ℓ, so there Δ + ln ℓ (ℓ of the row, known from its logits) stands in for Δ. Block-scaled
    formats take their own scale per block, so their S is kept from the registry and the grid's 1 (for a
    normalised P, from the registry's presets that normalise it alone).
    """
    scores = np.asarray(_inputs(ps.key)["ladder"][0])[0, 0].astype(np.float64)  # (T, N)
    z = scores - scores[:, :1]  # Δ = −z ≥ 0; the dead keys' e^z is 0
    alive = np.abs(out[0, :, 0, :LADDER_KEYS]) > 0
    delta = -z[:, 1:LADDER_KEYS]
    log_ell = np.log(np.sum(np.exp(z), axis=1, keepdims=True))
    registry = {(c.scale, c.p_format) for c in fittable_presets().values()}
    registry_lse = {(c.scale, c.p_format) for c in fittable_presets().values() if c.p_offset == "row_lse"}
    reads = []
    for d in (delta, delta + log_ell):
        surv, dead = d[alive[:, 1:]], d[~alive[:, 1:]]
        reads.append((surv.max() if surv.size else None, dead.min() if dead.size else None))
    keep, keep_lse = [], []
    for vals in candidate_values("cast"):
        scale, mode, fmt = vals
        bf = numberline.BLOCK_FORMATS.get(fmt)
        if mode in COMPUTED_SCALE_MODES:
            keep.append(vals)
            continue
        if bf is not None:
            if scale == 1.0 or (scale, fmt) in registry:
                keep.append(vals)
            if (scale, fmt) in registry_lse:
                keep_lse.append(vals)
            continue
        r = numberline.get_format(fmt).round_to_zero
        for (surv_max, dead_min), kept in zip(reads, (keep, keep_lse)):
            lo = r * math.exp(surv_max) / 2 if surv_max is not None else 0.0
            hi = r * math.exp(dead_min) * 2 if dead_min is not None else math.inf
            if lo <= scale <= hi:
                kept.append(vals)
    return keep, keep_lse


def _read_walk(ps: ProbeSet, out: np.ndarray) -> list[tuple] | None:
    """The ``walk`` candidates (order, tile) whose collapse pattern best matches the ``walk`` rows, or
    None when those rows show no collapse (a scale so large, or a dynamic one, that nothing is zeroed).

    In a walk row with readers at Δ_R = 17 below the dominant segment s, a reader segment reads 0 when
    the cast saw the dominant's max: in forward order every key from the start of s's block on, in
    reverse order every key up to the end of it. Each (order, tile) predicts that pattern; the
    :data:`WALK_KEPT` tiles with the fewest mismatches, in both orders, are simulated.
    """
    rows = np.arange(1, WALK_ROWS, 2)  # Δ_R = 17
    seg = rows // 2
    width = N_KEYS // SEGMENTS
    observed = out[1, rows, 0, :SEGMENTS] == 0  # (rows, segments)
    others = np.arange(SEGMENTS)[None, :] != seg[:, None]
    if not observed[others].any():
        return None
    first = np.arange(SEGMENTS) * width
    last = first + width - 1
    if ps.causal:  # keys past a row's position are masked: they read 0 in any config
        visible_to = N_KEYS - ps.out_shape[1] + rows
        masked = first[None, :] > visible_to[:, None]
    else:
        masked = np.zeros_like(observed)
    scored = []
    for order, tile in candidate_values("walk"):
        start = (seg * width // tile) * tile
        if order == "forward":
            zero = first[None, :] >= start[:, None]
        else:
            zero = last[None, :] <= (start + tile - 1)[:, None]
        scored.append((int(np.sum((zero | masked) != observed, where=others)), tile))
    ranked = sorted(set(scored))
    tiles = []
    for _, tile in ranked:
        if tile not in tiles:
            tiles.append(tile)
    return [(o, t) for t in tiles[:WALK_KEPT] for o in choices("order")]


def _evidence(scorer: _Scorer, best: KernelConfig, cands: list[KernelConfig], field: str,
              tol: float) -> FieldEvidence:
    value = getattr(best, field)
    best_r = scorer.residual(best)
    left = {value}
    runner, runner_r = None, math.inf
    for c in cands:
        other = getattr(c, field)
        if other == value:
            continue
        r = scorer.residual(c)
        if r <= tol:
            left.add(other)
        if r < runner_r:
            runner, runner_r = c, r
    probe, determined = "", True
    if runner is not None:
        gap = np.abs(scorer.family_residuals(runner) - scorer.family_residuals(best))
        probe = FAMILIES[int(np.argmax(gap))]
    note = ""
    if field == "kv_splits" and value == _blocks(best):
        more = {n for n, _ in candidate_values("split") if n > value}
        if more:
            left |= more
            note = f"every split count from {value} runs one block of the probes' {value} per split"
    if field == "block_q" and value > ROWS:
        left.add(value)
        determined = False
        note = f"every query tile beyond the probes' {ROWS} rows is one padded tile"
    if field in GROUPS["walk"] and best.p_offset == "row_lse":
        left |= {v[GROUPS["walk"].index(field)] for v in candidate_values("walk")}
        note = "P normalised before the cast is the same in every order and tile"
    return FieldEvidence(field=field, value=value, determined=determined and len(left) == 1, note=note,
                         candidates=tuple(sorted(left, key=repr)), probe=probe, residual=best_r,
                         runner_up=None if runner is None else getattr(runner, field), runner_up_residual=runner_r)


def identify(fn: Callable, *, head_dim: int, scale: float | None = None, causal: bool = False, sinks: bool = False,
             seed: int = 0, output_dtype=None, max_calls: int = 4) -> Fingerprint:
    """Reads a black-box FP8 attention's P-cast from its outputs on designed probes.

    Args:
      fn: ``fn(q, k, v)`` (or ``fn(q, k, v, sinks)`` with ``sinks=True``) returning
        softmax(scale·q·kᵀ)·v as the kernel computes it, all in ``jax.nn``'s (batch, tokens, heads,
        dim) layout; it gets NumPy float32 arrays and may return any array type NumPy reads.
      head_dim: the kernel's head dim.
      scale: the softmax scale ``fn`` applies (``jax.nn``'s 1/√head_dim when None).
      causal: ``fn`` masks causally (bottom-right aligned).
      sinks: ``fn`` takes learned sink logits, one per head.
      seed: the probes' seed.
      output_dtype: the type ``fn`` rounds its output to (see :func:`fit`; default: what it returns).
      max_calls: most calls of ``fn`` allowed (the probes go in one batched call).

    Returns:
      A :class:`~pcast_jax.fingerprint.result.Fingerprint`: the config, each field's evidence, the residuals.
    """
    max_calls = check_int("max_calls", max_calls, min_value=1)
    if not callable(fn):
        raise PcastError(f"fn={fn!r} must be callable as fn(q, k, v){' or fn(q, k, v, sinks)' if sinks else ''}")
    ps = probes(head_dim, scale=scale, causal=causal, sinks=sinks, seed=seed)
    t0 = time.perf_counter()
    out = fn(*ps.arrays())
    try:
        out = np.asarray(out)
    except Exception as exc:  # noqa: BLE001 - whatever fn returned
        raise PcastError(f"outputs: fn returned {type(out).__name__}, not an array ({exc})") from None
    seconds = time.perf_counter() - t0
    return fit(ps, out, output_dtype=output_dtype, calls=1, seconds_calls=seconds)



def simulate_outputs(ps: ProbeSet, config) -> np.ndarray:
    """A config's (or preset's) output on the probes, in their (batch, tokens, heads, dim) layout."""
    from pcast_jax import engine
    from pcast_jax.presets import resolve

    cfg = resolve(config)
    q, k, v = (np.moveaxis(a, 2, 1) for a in (ps.q, ps.k, ps.v))
    out = engine.attention_qkv(q, k, v, cfg, scale=ps.scale, sink_logit=ps.sinks).out
    return np.moveaxis(np.asarray(out), 1, 2)


def explain_preset(name: str, *, head_dim: int = 64, sinks: bool = False) -> Fingerprint:
    """The fit of preset ``name``'s own simulated outputs (its tile for ``head_dim``): which of its
    fields the probes decide and which they leave open."""
    from pcast_jax.presets import preset_for

    cfg = dataclasses.replace(preset_for(name, head_dim), causal=False)
    unfitted = [f for f in UNFITTED_FIELDS if getattr(cfg, f)]
    if unfitted:
        raise PcastError(f"preset={name!r} sets {unfitted[0]}={getattr(cfg, unfitted[0])!r}, which no candidate of "
                         f"the fit sets: {NOT_FITTED[unfitted[0]]}")
    ps = probes(head_dim, sinks=sinks)
    return fit(ps, simulate_outputs(ps, cfg), calls=0)
