"""Designed Q/K/V that read an FP8 attention kernel's P-cast from its outputs.

Every probe is a query row whose logits take a few chosen levels: each key's K row is one-hot (a
power of two ``κ`` in the dimension of its *class*), so the logit of key j in row i is
``scale · Q[i, class(j)] · κ``, one exact product. Q entries are E4M3 values and ``scale · κ`` is
a power of two whenever ``scale`` is, so the logits are exact in float32; each tensor holds one
entry of magnitude 448·2^k (its amax), so a kernel's own per-tensor E4M3 quantization of Q, K and
V (scale 448/amax, a power of two) changes nothing.

Five batch elements share N = :data:`N_KEYS` keys and :data:`ROWS` query rows:

* ``ladder`` — :data:`LADDER_KEYS` live keys in the first KV block of any tile (key 0 at logit 0,
  the others at known distances Δ below it), the rest *dead* (logit −120: exp underflows to 0 in
  float32, so they add nothing in any order, tile or split). V rows are one-hot: output column j
  reads P̃_j / (S·ℓ), the cast probability of key j itself. Δ_c = 10 ln 2 + ln S − δ, where values
  stop surviving, and the grid of the surviving values read S, its mode and the P format.
* ``walk`` — N keys in :data:`SEGMENTS` segments of equal width; a dominant segment at logit 0
  and the others at −Δ_R. Readers in blocks cast against the dominant collapse, readers cast
  against their own max survive: which ones did reads the order, the tile and the KV splits. V
  row j is nonzero on its segment only, with a value of 1 to 1.75 (an FP16 accumulator rounds the sums).
* ``ramp`` — the same segments with logits rising (or falling) by a step per segment: a running
  max that lags (a lazy rescale τ) leaves P > 1, P·S saturates; the staircase reads τ.
* ``tile`` — the first segment at logit 0 in every row, the others below it by Δ_i + c_s, Δ_i
  rising with the row i and c_s with the segment s: the rows of one query tile differ, so a scale
  shared by the tile's rows (its amax: the tile's smallest Δ_i) casts each row on another grid than
  its own, and the blocks every row of a tile holds below λ (skip-softmax) go missing from O and ℓ
  together; which rows share what reads ``block_q`` and λ. The segments after the first lie below
  the running max in forward order.
* ``tile_reverse`` — the same, mirrored (the last segment at 0): what ``tile`` reads, in reverse order.

With ``sinks=True`` the probes have four heads whose learned sink logits sit below, between and
above the probes' logits: where the sink enters (epilogue, initial max, every block's max) reads
its placement. Without it, one head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from pcast_jax.errors import PcastError, check_int

__all__ = ["ProbeSet", "probes", "FAMILIES", "N_KEYS", "SEGMENTS", "LADDER_KEYS", "SINK_LOGITS", "FORMAT_TAG",
           "KernelArguments", "read_probes_file",
           "e4m3_values", "key_entry", "amax_entry", "OUTPUT_DTYPES", "check_kernel_output",
           "MIN_HEAD_DIM", "ROWS", "WALK_ROWS"]

#: KV length of every probe: 32 segments of 16 keys; tiles up to 256 keys see at least two blocks.
N_KEYS = 512
#: Segments of the ``walk`` and ``ramp`` probes (a tile that is a multiple of 16 keys never splits one).
SEGMENTS = 32
#: Live keys of a ``ladder`` row (all inside the first block of any tile of at least 8 keys).
LADDER_KEYS = 8
#: Query rows per probe family: a query tile of up to 64 rows is read whole (a larger one is padded).
ROWS = 64
#: Rows of one ``walk`` pattern (two per segment); the later rows repeat it.
WALK_ROWS = 2 * SEGMENTS
#: The probe families, one batch element each, in batch order.
FAMILIES = ("ladder", "walk", "ramp", "tile", "tile_reverse")
#: Learned sink logit of each head with ``sinks=True``: head 0 inert, then below, between and above
#: the probes' logits (whose maximum is 0).
SINK_LOGITS = (-64.0, -3.0, 2.0, 6.0)
#: Logit of a dead key: exp(−120) underflows to 0 in float32.
DEAD_LOGIT = -120.0
#: Smallest head dim: the segments, the ladder's two dims per key, the dead class and the amax dims.
MIN_HEAD_DIM = SEGMENTS + 4
#: Marks an ``.npz`` written by :meth:`ProbeSet.save` (and its layout version).
FORMAT_TAG = "pcast_fingerprint_probes_v2"

_E4M3 = ml_dtypes.float8_e4m3fn
#: Values of the ``walk`` and ``ramp`` keys, cycling: E4M3 numbers up to 1.75 = 448·2^-8 whose
#: products with P̃ need more bits than an FP16 accumulator keeps when a segment's keys are summed.
_VALUES = np.array([1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75], np.float32)


def e4m3_values(x) -> np.ndarray:
    """``x`` rounded to E4M3 (float32 storage)."""
    return np.asarray(np.asarray(x, np.float32).astype(_E4M3).astype(np.float32))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class KernelArguments:
    """Q, K, V (and learned sink logits) a kernel is called on, in ``jax.nn``'s (batch, tokens, heads, dim)
    layout, as probes written to a file and read back: what :class:`ProbeSet` and the P-collapse probes
    (:class:`pcast_jax.testing.CollapseProbes`) share."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    sinks: np.ndarray | None

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of the kernel's output on the probes: the queries' shape."""
        return tuple(self.q.shape)

    def arrays(self) -> tuple:
        """``(q, k, v)`` or ``(q, k, v, sinks)``: the kernel's arguments."""
        return (self.q, self.k, self.v) if self.sinks is None else (self.q, self.k, self.v, self.sinks)

    def save_arrays(self, path, *, tag: str, **parameters) -> None:
        """Writes the arrays, the format ``tag`` and ``parameters`` as an ``.npz``, atomically."""
        from pcast_jax.fileio import atomic_write

        arrays = dict(zip(("q", "k", "v", "sinks"), self.arrays()), format=np.array(tag), **parameters)
        atomic_write(path, lambda f: np.savez(f, **arrays))


def read_probes_file(path, *, tag: str, writer: str, rebuild: Callable, differs: str):
    """The probes in ``path``: a file with the format ``tag`` that ``writer`` wrote, rebuilt from its parameters
    by ``rebuild(data, what)`` and compared array by array; PcastError naming the file otherwise (``differs``:
    what an array that is not the rebuilt one is not)."""
    from pcast_jax.fileio import load_npz

    what = f"probes file {str(path)!r}"
    data = load_npz(path, what=what, max_bytes=1 << 30)
    found = data.get("format")
    if found is None or found.shape != () or str(found) != tag:
        raise PcastError(f"{what} was not written by {writer!r} (no format tag {tag!r})")
    fresh = rebuild(data, what)
    for name, want in zip(("q", "k", "v", "sinks"), fresh.arrays()):
        got = data.get(name)
        if got is None or got.shape != want.shape or not np.array_equal(got, want):
            raise PcastError(f"{what}: {name} is not {differs} (edited, or another version)")
    return fresh


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ProbeSet(KernelArguments):
    """Crafted Q, K, V (and sink logits) in ``jax.nn``'s (batch, tokens, heads, dim) layout.

    Attributes:
      q: (5, ROWS, heads, head_dim) float32 queries, entries exact in E4M3.
      k: (5, N_KEYS, heads, head_dim) float32 keys, entries exact in E4M3.
      v: (5, N_KEYS, heads, head_dim) float32 values, entries exact in E4M3.
      sinks: (heads,) float32 learned sink logits, or None.
      scale: the softmax scale the kernel applies to q·kᵀ (``jax.nn``'s ``scale``).
      causal: whether the kernel masks causally (bottom-right aligned).
      seed: what jittered the ladder's distances.
    """

    scale: float
    causal: bool
    seed: int

    @property
    def heads(self) -> int:
        return int(self.q.shape[2])

    @property
    def key(self) -> tuple:
        """What identifies the probes (their arrays follow from it): the fit's candidate cache key."""
        return (self.head_dim, self.scale, self.causal, self.sinks is not None, self.seed)

    def save(self, path) -> None:
        """Writes the probes as an ``.npz`` (atomically) that :meth:`load` and ``pcast fingerprint fit`` read."""
        self.save_arrays(path, tag=FORMAT_TAG, scale=np.float64(self.scale), causal=np.bool_(self.causal),
                         seed=np.int64(self.seed))

    @classmethod
    def load(cls, path) -> "ProbeSet":
        """The probes in ``path`` (written by :meth:`save`); PcastError if the file is not such probes."""
        return read_probes_file(path, tag=FORMAT_TAG, writer="pcast fingerprint probe", rebuild=_rebuild,
                                differs="the probes 'pcast fingerprint probe' writes for its head dim, scale and seed")


def _rebuild(data: dict, what: str) -> ProbeSet:
    """The probes a file's parameters give (:func:`read_probes_file`)."""
    try:
        scale, causal, seed = float(data["scale"]), bool(data["causal"]), int(data["seed"])
        d = int(data["q"].shape[-1])
    except (KeyError, TypeError, ValueError, IndexError):
        raise PcastError(f"{what} lacks scale, causal, seed or q") from None
    try:
        return probes(d, scale=scale, causal=causal, sinks="sinks" in data, seed=seed)
    except PcastError as exc:  # the file's values out of range: name the file
        raise PcastError(f"{what}: {exc}") from None


def key_entry(scale: float) -> float:
    """K's entry: a power of two with scale·κ in [2^-0.5, 2^0.5) (exactly 1 for a power-of-two scale)."""
    return 2.0 ** round(-math.log2(scale))


def amax_entry(value: float) -> float:
    """The smallest 448·2^k ≥ ``value``: a tensor whose amax it is quantizes to E4M3 without loss."""
    return 448.0 * 2.0 ** math.ceil(math.log2(value / 448.0))


#: Output types a kernel may return, by name (besides any NumPy floating-point type); the fingerprint
#: rounds its simulated outputs to the one the kernel returned before comparing.
OUTPUT_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                 "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def check_kernel_output(outputs, *, shape: tuple[int, ...], dtype, what: str = "outputs",
                        where: Callable[[tuple[int, ...]], str] | None = None) -> np.ndarray:
    """A kernel's output on probes (these, or :mod:`pcast_jax.testing`'s) as ``dtype``; PcastError naming ``what``.

    The output must be an array of a floating-point type (:data:`OUTPUT_DTYPES` or a NumPy float) of the
    probes' query ``shape``, finite once cast to ``dtype``. ``where(index)`` says what the first non-finite
    value's index reads (the fingerprint's probe family); the callers add their own refusals.
    """
    try:
        out = np.asarray(outputs)
    except Exception as exc:  # noqa: BLE001 - anything that is not an array
        raise PcastError(f"{what} is not an array ({exc})") from None
    if out.dtype.kind != "f" and out.dtype not in [np.dtype(d) for d in OUTPUT_DTYPES.values()]:
        raise PcastError(f"{what}.dtype={out.dtype} must be a floating-point type (the attention output)")
    if out.shape != tuple(shape):
        raise PcastError(f"{what}.shape={out.shape} must be the probes' query shape {tuple(shape)} "
                         "[batch, q_tokens, heads, head_dim]")
    out = out.astype(dtype)
    bad = ~np.isfinite(out)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        at = f"{idx}, {where(idx)}" if where is not None else f"{idx}"
        raise PcastError(f"{what} holds {int(bad.sum())} NaN or inf values (first at {at}): a kernel's output on "
                         "the probes must be finite")
    return out


def _ladder_levels(rng) -> np.ndarray:
    """(ROWS, LADDER_KEYS) logits: key 0 at 0, the others from Δ = 0.3 to 22 below it (jittered)."""
    base = np.linspace(0.3, 22.0, ROWS * (LADDER_KEYS - 1))
    jitter = rng.uniform(-0.1, 0.1, base.shape)
    deltas = rng.permutation(base + jitter).reshape(ROWS, LADDER_KEYS - 1)
    return np.concatenate([np.zeros((ROWS, 1)), -deltas], axis=1)


def _walk_levels() -> np.ndarray:
    """(ROWS, SEGMENTS): the dominant segment at 0, the others at −Δ_R, two Δ_R per position.

    Δ_R = 5 survives a cast against the dominant (with rounding) for S ≥ 1 in E4M3; Δ_R = 17 collapses
    for S < e^17·2^-10 ≈ 2.4·10^4."""
    reader = (5.0, 17.0)
    out = np.empty((ROWS, SEGMENTS))
    for r in range(ROWS):
        out[r] = -reader[r % len(reader)]
        out[r, (r % WALK_ROWS) // len(reader)] = 0.0
    return out


def _ramp_levels() -> np.ndarray:
    """(ROWS, SEGMENTS): logits rising (even rows) or falling by a step per segment, top at 0."""
    steps = np.geomspace(1 / 64, 3.0, ROWS // 2)
    seg = np.arange(SEGMENTS)
    up = steps[:, None] * (seg[None, :] - (SEGMENTS - 1))
    down = steps[:, None] * -seg[None, :]
    out = np.empty((ROWS, SEGMENTS))
    out[0::2], out[1::2] = up, down
    return np.maximum(out, DEAD_LOGIT / 2)


def _tile_levels() -> np.ndarray:
    """(ROWS, SEGMENTS): the first segment at 0, segment s ≥ 1 at −(Δ_i + c_s) in row i, with Δ_i from
    0.3 to 6.3 (rising with the row, so a tile's smallest is its first row's) and c_s = (s − 1)/4."""
    delta = 0.3 + 6.0 * np.arange(ROWS) / (ROWS - 1)
    c = 0.25 * (np.arange(SEGMENTS) - 1)
    out = -(delta[:, None] + c[None, :])
    out[:, 0] = 0.0
    return out


def probes(head_dim: int, *, scale: float | None = None, causal: bool = False, sinks: bool = False,
           seed: int = 0) -> ProbeSet:
    """The probes for a kernel of head dim ``head_dim``.

    Args:
      head_dim: the kernel's head dim D (at least :data:`MIN_HEAD_DIM`).
      scale: the softmax scale the kernel applies (``jax.nn``'s default 1/√D when None). A power of
        two keeps the logits exact in float32; another scale rounds them once, as the kernel does.
      causal: the kernel masks causally (bottom-right aligned): the fit then simulates that mask.
      sinks: four heads with learned sink logits :data:`SINK_LOGITS` (the black box takes them as a
        fourth argument).
      seed: jitters the ladder's distances.
    """
    d = check_int("head_dim", head_dim, min_value=MIN_HEAD_DIM, max_value=1 << 12)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise PcastError(f"scale={scale!r} must be a real number > 0") from None
    if not (math.isfinite(scale) and 2.0**-20 <= scale <= 2.0**20):
        raise PcastError(f"scale={scale!r} must be a finite number in [2^-20, 2^20]")
    if not isinstance(causal, bool) or not isinstance(sinks, bool):
        raise PcastError(f"causal={causal!r} and sinks={sinks!r} must be True or False")
    seed = check_int("seed", seed, min_value=0, max_value=2**31 - 1)
    rng = np.random.default_rng(seed)
    heads = len(SINK_LOGITS) if sinks else 1
    kappa = key_entry(scale)
    per_logit = 1.0 / (scale * kappa)  # Q entry per unit of logit (1 for a power-of-two scale)
    spare_q, spare_k, dead_dim = d - 1, d - 2, d - 3  # dims no live key reads
    n_fam = len(FAMILIES)
    q = np.zeros((n_fam, ROWS, heads, d), np.float32)
    k = np.zeros((n_fam, N_KEYS, heads, d), np.float32)
    v = np.zeros((n_fam, N_KEYS, heads, d), np.float32)
    width = N_KEYS // SEGMENTS

    # ladder: live key j reads dims 2j (coarse) and 2j+1 (fine); the rest are dead
    lev = _ladder_levels(rng) * per_logit
    coarse = e4m3_values(np.trunc(lev))
    fine = e4m3_values(lev - coarse)
    for j in range(LADDER_KEYS):
        q[0, :, :, 2 * j] = coarse[:, j, None]
        q[0, :, :, 2 * j + 1] = fine[:, j, None]
        k[0, j, :, 2 * j] = k[0, j, :, 2 * j + 1] = kappa
        v[0, j, :, j] = 1.0
    k[0, LADDER_KEYS:, :, dead_dim] = kappa
    q[0, :, :, dead_dim] = e4m3_values(DEAD_LOGIT * per_logit)

    # walk, ramp and tile: key j reads the dim of its segment; V one-hot on the segment
    seg = np.arange(N_KEYS) // width
    tile = _tile_levels()
    for f, levels in ((1, _walk_levels()), (2, _ramp_levels()), (3, tile), (4, tile[:, ::-1])):
        q[f, :, :, :SEGMENTS] = e4m3_values(levels * per_logit)[:, None, :]
        k[f, np.arange(N_KEYS), :, seg] = kappa
        v[f, np.arange(N_KEYS), :, seg] = _VALUES[np.arange(N_KEYS) % len(_VALUES)][:, None]

    # each tensor's amax 448·2^k, where no live product reads it
    q[:, :, :, spare_q] = 448.0
    k[:, :, :, spare_k] = 0.0
    k[:, -1, :, spare_k] = amax_entry(kappa)
    v[0, -1, :, spare_k] = 1.75  # a dead key's value: 448·2^-8
    v[1:, :, :, spare_k] = 0.0
    v[1:, 0, :, spare_k] = 1.75  # a live key's: the column is read like any other
    sink_arr = np.asarray(SINK_LOGITS, np.float32) if sinks else None
    return ProbeSet(q=q, k=k, v=v, sinks=sink_arr, scale=scale, causal=causal, seed=seed)
