"""The P-collapse probes (:func:`collapse_probes`): Q, K and V whose outputs read what the cast lost, per Δ.

What each head, query row, key and V column reads is in :mod:`pcast_jax.testing`'s docs; this module builds
the probes, their exact float64 output and the share of the weaker keys' mass each witness stands for, and
writes and reads them back (``pcast probe write``). NumPy only.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pcast_jax.errors import PcastError, check_int
from pcast_jax.fingerprint.probes import KernelArguments, amax_entry, e4m3_values, key_entry, read_probes_file

__all__ = ["DELTAS", "N_KEYS", "REPLICATES", "MIN_HEAD_DIM", "FORMAT_TAG", "PROBES", "INERT_SINK", "WITNESS_SPAN",
           "V_ONES", "V_DOMINANT", "V_WEAKER", "V_AMAX", "V_WITNESS", "CollapseProbes", "collapse_probes",
           "witness_weights"]

#: Sink strengths Δ of the probes by default: the dominant key's lead over the weaker keys' median.
DELTAS = tuple(float(d) for d in range(2, 15))
#: KV length of the probes by default: many KV blocks of any tile, and every split schedule.
N_KEYS = 4096
#: Replicates (batch elements, each its own draw of the weaker keys) by default: the s.e. is over them.
REPLICATES = 16
#: Smallest head dim: four V columns of readings and at least twelve witnesses (one V column each).
MIN_HEAD_DIM = 16
#: Marks an ``.npz`` written by :meth:`CollapseProbes.save` (and its layout version).
FORMAT_TAG = "pcast_p_collapse_probes_v1"
#: What each head of the probes reads: head 0 a dominant key at the front, head 1 (``sinks=True``) a learned sink.
PROBES = ("dominant key", "learned sink")
#: Learned sink logit of head 0 with ``sinks=True``: exp(−64) is 0 beside any key.
INERT_SINK = -64.0
#: |V| of the random columns is clipped here; V's amax entry is the next 448·2^k.
_V_CLIP = 4.0
# Q/K dims: Δ (coarse, fine), the weaker keys' ln U (coarse, fine)
_DELTA_DIMS, _NOISE_DIMS = (0, 1), (2, 3)
#: V's columns: all ones, the dominant key alone, the weaker keys alone, V's amax; the witnesses from V_WITNESS on.
V_ONES, V_DOMINANT, V_WEAKER, V_AMAX, V_WITNESS = 0, 1, 2, 3, 4
#: The witnesses' weights U span (2·e^-WITNESS_SPAN, 2): below, the weaker keys hold under e^-24 of their mass.
WITNESS_SPAN = 12.0



@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CollapseProbes(KernelArguments):
    """The probes' Q, K, V (and sinks) in ``jax.nn``'s [batch, tokens, heads, dim] layout, and their exact output.

    Attributes:
      q: (2·replicates, len(deltas), heads, head_dim) float32, exact in E4M3; the first half of the batch
        reads the witnesses, the second the random V.
      k, v: (2·replicates, n_keys, heads, head_dim) float32, exact in E4M3.
      sinks: (heads,) float32 learned sink logits (``INERT_SINK``, 0), or None.
      exact: the float64 reference output, q's shape (softmax with the sink column, times V).
      witness_share: (replicates, witnesses): the share of the weaker keys' mass each witness stands for
        (:func:`witness_weights`).
      scale: the softmax scale the kernel applies to q·kᵀ.
      causal: whether the kernel masks causally (bottom-right aligned).
      deltas: the sink strength Δ of each query row.
      seed: what drew the weaker keys and the random V.
    """

    exact: np.ndarray
    witness_share: np.ndarray
    scale: float
    causal: bool
    deltas: tuple[float, ...]
    seed: int

    @property
    def n_keys(self) -> int:
        return int(self.k.shape[1])

    @property
    def replicates(self) -> int:
        return int(self.q.shape[0]) // 2

    def save(self, path) -> None:
        """Writes the probes as an ``.npz`` (atomically) that :meth:`load` and ``pcast probe check`` read."""
        self.save_arrays(path, tag=FORMAT_TAG, scale=np.float64(self.scale), causal=np.bool_(self.causal),
                         seed=np.int64(self.seed), deltas=np.asarray(self.deltas, np.float64))

    @classmethod
    def load(cls, path) -> "CollapseProbes":
        """The probes in ``path`` (written by :meth:`save`), rebuilt from their parameters and compared
        array by array; PcastError naming the file when it is not such probes."""
        return read_probes_file(path, tag=FORMAT_TAG, writer="pcast probe write", rebuild=_rebuild,
                                differs="what 'pcast probe write' writes for its parameters")


def _rebuild(data: dict, what: str) -> CollapseProbes:
    """The probes a file's parameters give (:func:`~pcast_jax.fingerprint.probes.read_probes_file`)."""
    try:
        params = dict(head_dim=int(data["q"].shape[-1]), scale=float(data["scale"]), causal=bool(data["causal"]),
                      sinks="sinks" in data, n_keys=int(data["k"].shape[1]),
                      deltas=tuple(float(d) for d in data["deltas"]), replicates=int(data["q"].shape[0]) // 2,
                      seed=int(data["seed"]))
    except (KeyError, TypeError, ValueError, IndexError):
        raise PcastError(f"{what} lacks q, k, scale, causal, deltas or seed") from None
    try:
        return collapse_probes(**params)
    except PcastError as exc:
        raise PcastError(f"{what}: {exc}") from None


def _check_deltas(deltas) -> tuple[float, ...]:
    if isinstance(deltas, (str, bytes)) or not isinstance(deltas, (tuple, list, np.ndarray)) or not len(deltas):
        raise PcastError(f"deltas={deltas!r} must hold at least one sink strength (a tuple of numbers in [0, 30])")
    out = []
    for d in deltas:
        if isinstance(d, bool) or not isinstance(d, (int, float, np.integer, np.floating)) or not 0 <= float(d) <= 30:
            raise PcastError(f"deltas={tuple(deltas)!r}: each Δ must be a number in [0, 30]")
        out.append(float(d))
    if len(set(out)) != len(out):
        raise PcastError(f"deltas={tuple(deltas)!r} must not repeat a Δ")
    return tuple(out)


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as two E4M3 values whose float32 sum is within 2^-8 relative of it (coarse + fine)."""
    coarse = e4m3_values(x)
    return coarse, e4m3_values(np.asarray(x, np.float64) - coarse)


def _exact(q, k, v, sinks, scale: float, causal: bool) -> np.ndarray:
    """softmax(scale·q·kᵀ, sink column included)·v in float64 (q, k, v in the probes' layout)."""
    q64, k64, v64 = (np.moveaxis(np.asarray(a, np.float64), 2, 1) for a in (q, k, v))  # (B, H, len, D)
    z = scale * np.einsum("bhtd,bhnd->bhtn", q64, k64)
    t, n = z.shape[-2:]
    if causal:
        visible = np.arange(n)[None, :] <= (n - t + np.arange(t))[:, None]
        z = np.where(visible, z, -np.inf)
    top = z.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[None, :, None, None]
        top = np.maximum(top, sink)
    w = np.exp(z - top)
    ell = w.sum(axis=-1, keepdims=True) + (0.0 if sinks is None else np.exp(sink - top))
    return np.moveaxis(np.einsum("bhtn,bhnd->bhtd", w / ell, v64), 1, 2)


def witness_weights(count: int, offsets) -> tuple[np.ndarray, np.ndarray]:
    """The witnesses' weights U (replicate × witness) and the share of the weaker keys' mass each stands for.

    The weaker keys' U is uniform on (0, 2), so the keys with U in (a, b) hold (b² − a²)/4 of their mass.
    Witness i of a replicate sits at U_i = 2·e^-WITNESS_SPAN·(i + o)/count (o the replicate's offset in
    [0, 1)) and stands for the keys from the midpoint (in ln U) to its lower neighbour up to the midpoint
    to its upper one (the first up to 2, the last down to 0): a zero there counts that share as zeroed.
    """
    o = np.asarray(offsets, np.float64)[:, None]
    ln_u = math.log(2.0) - WITNESS_SPAN * (np.arange(count)[None, :] + o) / count
    mid = (ln_u[:, 1:] + ln_u[:, :-1]) / 2
    upper = np.concatenate([np.full_like(o, 2.0), np.exp(mid)], axis=1)
    lower = np.concatenate([np.exp(mid), np.zeros_like(o)], axis=1)
    return np.exp(ln_u), (upper**2 - lower**2) / 4


def collapse_probes(head_dim: int, *, scale: float | None = None, causal: bool = False, sinks: bool = False,
                    n_keys: int = N_KEYS, deltas=DELTAS, replicates: int = REPLICATES,
                    seed: int = 0) -> CollapseProbes:
    """The probes of :func:`~pcast_jax.testing.check_p_collapse` for head dim ``head_dim`` (:mod:`pcast_jax.testing`).

    Args:
      head_dim: the kernel's head dim (at least :data:`MIN_HEAD_DIM`).
      scale: the softmax scale the kernel applies (``jax.nn``'s 1/√head_dim when None). A power of two
        keeps the logits exact in float32; another rounds them once, as the kernel does.
      causal: the kernel masks causally (bottom-right aligned).
      sinks: the kernel takes learned sink logits: a second head reads a sink at logit 0.
      n_keys: KV length (64 to 65,536).
      deltas: the sink strengths Δ, one query row each (numbers in [0, 30]).
      replicates: batch elements, each its own draw (2 to 256): the standard errors are over them.
      seed: what draws the weaker keys and the random V.
    """
    d = check_int("head_dim", head_dim, min_value=MIN_HEAD_DIM, max_value=1 << 12)
    n = check_int("n_keys", n_keys, min_value=64, max_value=1 << 16)
    reps = check_int("replicates", replicates, min_value=2, max_value=256)
    seed = check_int("seed", seed, min_value=0, max_value=2**31 - 1)
    deltas = _check_deltas(deltas)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) or not (
            math.isfinite(float(scale)) and 2.0**-20 <= float(scale) <= 2.0**20):
        raise PcastError(f"scale={scale!r} must be a finite number in [2^-20, 2^20]")
    scale = float(scale)
    if not isinstance(causal, bool) or not isinstance(sinks, bool):
        raise PcastError(f"causal={causal!r} and sinks={sinks!r} must be True or False")
    rng = np.random.default_rng(seed)
    heads = 2 if sinks else 1
    kappa = key_entry(scale)
    per_logit = 1.0 / (scale * kappa)  # Q entry per unit of logit (1 for a power-of-two scale)
    spare_q, spare_k = d - 1, d - 2
    t, batch = len(deltas), 2 * reps
    q = np.zeros((batch, t, heads, d), np.float32)
    k = np.zeros((batch, n, heads, d), np.float32)
    v = np.zeros((batch, n, heads, d), np.float32)
    coarse, fine = _split(-np.asarray(deltas) * per_logit)
    q[:, :, :, _DELTA_DIMS[0]] = coarse[None, :, None]
    q[:, :, :, _DELTA_DIMS[1]] = fine[None, :, None]
    q[:, :, :, _NOISE_DIMS[0]] = q[:, :, :, _NOISE_DIMS[1]] = e4m3_values(per_logit)
    # the weaker keys' weights e^-Δ·U, U stratified on (0, 2) in a shuffled order, each replicate its own;
    # the witnesses (one V column each) at the U of witness_weights, at random key positions
    strata = (np.arange(n)[None, :] + rng.uniform(size=(batch, 1))) / n
    weights = 2.0 * np.take_along_axis(strata, rng.permuted(np.tile(np.arange(n), (batch, 1)), axis=1), axis=1)
    witness_u, share = witness_weights(d - V_WITNESS, rng.uniform(size=batch))
    where = np.stack([rng.choice(np.arange(1, n), d - V_WITNESS, replace=False) for _ in range(batch)])
    np.put_along_axis(weights, where, witness_u, axis=1)
    u_coarse, u_fine = _split(np.log(weights))
    weaker = np.ones((heads, n), bool)
    weaker[0, 0] = False  # head 0: key 0 is the dominant key (logit 0: every dim of its row is 0)
    for h in range(heads):
        k[:, weaker[h], h, _DELTA_DIMS[0]] = k[:, weaker[h], h, _DELTA_DIMS[1]] = kappa
        k[:, weaker[h], h, _NOISE_DIMS[0]] = u_coarse[:, weaker[h]] * kappa
        k[:, weaker[h], h, _NOISE_DIMS[1]] = u_fine[:, weaker[h]] * kappa
        v[:, :, h, V_DOMINANT] = ~weaker[h]
        v[:, :, h, V_WEAKER] = weaker[h]
    v[:, :, :, V_ONES] = 1.0
    b = np.arange(reps)[:, None]
    v[b, where[:reps], :, V_WITNESS + np.arange(d - V_WITNESS)[None, :]] = 1.0
    v[reps:, :, :, V_WITNESS:] = e4m3_values(np.clip(rng.standard_normal((reps, n, 1, d - V_WITNESS)),
                                                    -_V_CLIP, _V_CLIP))
    v[:, -1, :, V_AMAX] = amax_entry(_V_CLIP)
    q[:, :, :, spare_q] = amax_entry(float(np.abs(q).max()))
    k[:, -1, :, spare_k] = amax_entry(float(np.abs(k).max()))
    sink_arr = np.asarray((INERT_SINK, 0.0), np.float32) if sinks else None
    return CollapseProbes(q=q, k=k, v=v, sinks=sink_arr, exact=_exact(q, k, v, sink_arr, scale, causal),
                          witness_share=share[:reps], scale=scale,
                          causal=causal, deltas=deltas, seed=seed)
