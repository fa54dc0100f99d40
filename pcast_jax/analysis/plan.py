"""How a layer's per-head passes are cut into compiled calls: chunks of query rows, the keys each visits, and
which configs share one program — as data (:func:`plan_layer`), with the memory budget an argument
(:class:`Chunking`).

A chunk of a head's query rows is simulated on the keys a causal kernel visits for them (:func:`keys_visited`),
in calls whose temporaries fit :attr:`Chunking.chunk_bytes`. The configs whose kernels multiply the same
operands (the same Q/K/V quantization) and take the same chunks of rows form a :class:`ProgramGroup` that shares
each chunk's product of Q and K; within it, one :class:`Program` per kernel family (configs that differ only
in ``scale``) and key count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Sequence

import numpy as np

from pcast_jax import block as _block
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int

__all__ = ["CHUNK_BYTES", "KERNEL_BYTES_PER_SCORE", "STAT_BYTES_PER_SCORE", "REFERENCE_BYTES_PER_SCORE", "Chunking",
           "DEFAULT_CHUNKING",
           "rows_per_chunk", "whole_tiles", "keys_visited", "keys_below", "row_chunks", "Job", "Program",
           "PlannedChunk", "ProgramGroup", "LayerPlan", "plan_layer"]

#: What one compiled call of the simulated kernel may hold at once (:attr:`Chunking.chunk_bytes`'s default).
#: XLA:CPU allocates a program's
#: temporaries in one block per call; glibc serves a block above 32 MiB (its largest mmap threshold)
#: with fresh pages from the kernel every time, which costs more than the arithmetic (measured: a
#: layer of 9 heads × 1,024 tokens spent 0.17 s of 0.19 s faulting in 254 MiB). Chunks of a head's
#: query rows whose temporaries stay below it reuse the freed memory: 2.5× faster per layer.
CHUNK_BYTES = 16 << 20
#: Bytes of temporaries per score of the simulated kernel, an upper bound measured from XLA's
#: ``memory_analysis`` (27 for a forward kernel, 43 for split-KV at 1,024 keys).
KERNEL_BYTES_PER_SCORE = 48
#: Bytes of temporaries per logit of the sink statistics' row chunks, an upper bound of XLA's
#: ``memory_analysis`` (49 at 64 and at 256 rows of 1,024 keys: the ``[rows, T, len(SCALE_GRID)]``
#: underflow masses are fused, never held).
STAT_BYTES_PER_SCORE = 64
#: Bytes of temporaries per score of the exact reference's row chunks (every head's ``[Hq, rows, T]`` softmax).
REFERENCE_BYTES_PER_SCORE = 8


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chunking:
    """How a layer's rows are cut into compiled calls (every per-head pass takes one; the default is the
    measured best on XLA:CPU)."""

    #: bytes of temporaries one compiled call may hold (:data:`CHUNK_BYTES`)
    chunk_bytes: int = CHUNK_BYTES
    #: each chunk of rows visits only the keys a causal kernel visits for them (:func:`keys_visited`); False:
    #: every key of the layer (what a whole row holds: the same numbers to FP32 rounding, more work)
    causal_keys: bool = True

    def __post_init__(self):
        check_int("chunk_bytes", self.chunk_bytes, min_value=1)
        if not isinstance(self.causal_keys, bool):
            raise PcastError(f"causal_keys={self.causal_keys!r} must be True or False")


#: The chunking every pass takes unless given one.
DEFAULT_CHUNKING = Chunking()


def rows_per_chunk(num_rows: int, num_keys: int, chunk_bytes: int = CHUNK_BYTES,
                   bytes_per_score: int = KERNEL_BYTES_PER_SCORE) -> int:
    """The query rows of one chunk: a power of two whose temporaries fit ``chunk_bytes``."""
    rows = max(1, chunk_bytes // (bytes_per_score * max(num_keys, 1)))
    return min(num_rows, 1 << (rows.bit_length() - 1))


def whole_tiles(rows: int, config: KernelConfig) -> int:
    """Rows per chunk rounded up to whole query tiles (``config.block_q``): the rows of a tile share one
    tile-amax scale and one skip-softmax vote, so a chunk (whose rows the kernel tiles from its first,
    at a multiple of the chunk) never splits a tile."""
    bq = config.block_q
    return rows if bq <= 1 else -(-rows // bq) * bq


def keys_visited(config: KernelConfig, row_end: int, num_keys: int) -> int:
    """The keys a causal kernel visits for query rows below ``row_end`` (the keys they see, :func:`_chunks`):
    its KV blocks up to the last row's diagonal, for split-KV only where that leaves every split as it is.

    A causal kernel does not visit a block past the diagonal of its query tile (FlashAttention-2/3
    ``n_block_max``, the Triton kernels' loop bound), so the per-head analysis simulates a chunk of rows on
    these keys only: the same blocks, without the fully masked ones a full row would add, which change no
    number but the rounding of sums over blocks (FP32). A split-KV kernel cuts its splits from every block
    of the row's keys (:func:`pcast_jax.block.split_schedule`): it gets the chunk's blocks alone only where
    their schedule gives each split the same of them in the same order as the schedule of every block does
    (:func:`_same_splits`: strided splits, or no more blocks than splits; the steps at which a split visits
    the masked blocks change nothing); elsewhere all ``num_keys``.
    """
    keys = keys_below(row_end, num_keys, config.block_kv)
    if config.kv_splits > 1 and not _same_splits(config, keys, num_keys):
        return num_keys
    return keys


@functools.lru_cache(maxsize=None)
def _same_splits(config: KernelConfig, keys: int, num_keys: int) -> bool:
    """Whether the split schedule of the first ``keys`` keys' blocks walks them as the schedule of all
    ``num_keys`` keys' blocks does: each split the same of them in the same order (the splits' other
    blocks are past the rows' diagonal, fully masked, and add nothing to the split or to the merge)."""
    seen, whole = -(-keys // config.block_kv), -(-num_keys // config.block_kv)

    def walks(n_blocks: int) -> list:
        return [row for row in ([int(b) for b in split if b < seen]
                                for split in _block.split_schedule(n_blocks, config)) if row]

    return walks(seen) == walks(whole)


def keys_below(row_end: int, num_keys: int, block: int = 1) -> int:
    """The keys ``0 .. row_end`` rounded up to whole blocks of ``block``, at most ``num_keys``: all that query
    rows below ``row_end`` see under a causal mask."""
    return min(num_keys, -(-row_end // block) * block)


def _chunk_end(row0: int, rows: int, step: int, length: int) -> int:
    """The last key + 1 that the query rows ``row0 .. row0 + rows`` may see: their end, or the real tokens'
    (``length``) rounded up to a whole chunk of ``step`` rows, so that the chunks of every length take the
    same few shapes."""
    return min(row0 + rows, -(-length // step) * step)


def _chunks(num_rows: int, step: int, length: int) -> list[tuple[int, int, int]]:
    """``(row0, rows, keys)`` of the query-row chunks of ``step`` rows (the last one ragged): each with the
    keys its rows see under a causal mask (:func:`keys_below`), ``length`` the real tokens."""
    return [(r0, rows, keys_below(_chunk_end(r0, rows, step, length), num_rows))
            for r0 in range(0, num_rows, step) for rows in (min(step, num_rows - r0),)]


#: A sample's chunks see their keys rounded up to whole eighths of the sequence, so that the chunks of any
#: sample take a few shapes (one compiled program each); the keys past a chunk's last row are masked.
_SAMPLE_KEY_PARTS = 8


def row_chunks(num_rows: int, step: int, length: int, sample=None) -> list[tuple]:
    """:func:`_chunks`, or for ``sample`` (sorted positions ``[n]``) its chunks of ``step`` positions: ``(positions
    [rows], rows, keys)``, the keys rounded up to whole eighths of ``num_rows`` (:data:`_SAMPLE_KEY_PARTS`)."""
    if sample is None:
        return _chunks(num_rows, step, length)
    unit = max(1, -(-num_rows // _SAMPLE_KEY_PARTS))
    out = []
    for i in range(0, len(sample), step):
        part = np.asarray(sample[i:i + step], np.int32)
        out.append((part, len(part), min(num_rows, -(-(int(part[-1]) + 1) // unit) * unit)))
    return out


#: A job of a chunk's program: ``("config", i)``, the metrics of the i-th config, or ``("family", i)``, the
#: masses of the i-th family's candidate scales.
Job = tuple[Literal["config", "family"], int]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Program:
    """One compiled call on a chunk: the jobs of one kernel family on the chunk's first ``keys`` keys."""

    keys: int
    jobs: tuple[Job, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannedChunk:
    """A chunk of query rows of every head: its first row (or a sample's positions), its rows, its first row's
    index among the rows simulated (``at``: the sample's reference holds those rows only), the keys of its Q·K
    product (the most any of its programs visits) and its programs."""

    row0: int | np.ndarray
    rows: int
    at: int
    keys: int
    programs: tuple[Program, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProgramGroup:
    """Jobs whose kernels multiply the same operands (``operands``: the config whose Q/K/V quantization they
    share) on the same chunks of ``step`` rows: one Q·K product per chunk and head for all of them."""

    operands: KernelConfig
    step: int
    jobs: tuple[Job, ...]
    chunks: tuple[PlannedChunk, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayerPlan:
    """:func:`plan_layer`'s answer: the program groups, in the order they run (every head's chunks per group)."""

    groups: tuple[ProgramGroup, ...]

    def keys_visited(self) -> int:
        """Σ over chunks and programs of rows × keys: the logits one head's programs read."""
        return sum(c.rows * p.keys for g in self.groups for c in g.chunks for p in c.programs)


def plan_layer(configs: Sequence[KernelConfig], families: Sequence[tuple[KernelConfig, ...]], *, num_tokens: int,
               length: int, sample=None, chunking: Chunking = DEFAULT_CHUNKING) -> LayerPlan:
    """The chunks, keys visited and program groups of one layer's per-head passes, as data.

    Args:
      configs: the configs whose metrics are computed (causal).
      families: per family its configs (the candidate scales; the first stands for the family).
      num_tokens, length: the layer's tokens and the real ones.
      sample: optional sorted query positions ``[n]``, the only rows simulated.
      chunking: the memory budget and which keys a chunk visits.
    """
    jobs = [(("config", i), cfg) for i, cfg in enumerate(configs)] + [(("family", i), fam[0])
                                                                       for i, fam in enumerate(families)]
    members: dict = {}  # the same operands and chunks of rows: one logits product per chunk for all of them
    for job, cfg in jobs:
        step = whole_tiles(rows_per_chunk(num_tokens, num_tokens, chunking.chunk_bytes), cfg)
        members.setdefault((cfg.qkv, cfg.qkv_granularity, step), []).append((job, cfg))
    groups = []
    for (_, _, step), group in members.items():
        chunks, at = [], 0
        for r0, rows, seen in row_chunks(num_tokens, step, length, sample):
            visited = [keys_visited(cfg, seen, num_tokens) if chunking.causal_keys else num_tokens
                       for _, cfg in group]
            programs: dict = {}  # one program per kernel family and key count
            for (job, cfg), keys in zip(group, visited):
                programs.setdefault((cfg.replace(scale=1.0), keys), []).append(job)
            chunks.append(PlannedChunk(row0=r0, rows=rows, at=at, keys=max(visited),
                                       programs=tuple(Program(keys=keys, jobs=tuple(j))
                                                      for (_, keys), j in programs.items())))
            at += rows
        groups.append(ProgramGroup(operands=group[0][1], step=step, jobs=tuple(j for j, _ in group),
                                   chunks=tuple(chunks)))
    return LayerPlan(groups=tuple(groups))
