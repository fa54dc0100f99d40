"""A P-collapse test for an attention kernel's own test suite: one call, NumPy arrays in and out.

::

    from pcast_jax.testing import assert_no_p_collapse

    def test_my_kernel_keeps_p():
        assert_no_p_collapse(my_kernel, head_dim=128)

The kernel is any callable ``kernel(q, k, v)`` (``kernel(q, k, v, sinks)`` with ``sinks=True``) that takes
NumPy float32 arrays in ``jax.nn``'s layout — q ``[batch, q_tokens, heads, head_dim]``, k and v
``[batch, kv_tokens, heads, head_dim]``, sinks ``[heads]`` learned sink logits in the units of the scaled
logits — and returns softmax(scale·q·kᵀ)·v as ``[batch, q_tokens, heads, head_dim]`` in any array type
NumPy reads (the same calling convention as :func:`pcast_jax.fingerprint.identify`). A PyTorch, Triton,
CUDA or JAX kernel is wrapped in one line (convert, transpose, call, convert back). With ``causal=True``
the kernel masks causally, bottom-right aligned (query row i of T sees keys j ≤ N − T + i).

**The probes** (:func:`collapse_probes`, one kernel call): each batch element is one replicate (its own
draw), each query row one sink strength Δ (default 2, 3, …, 14), over ``n_keys`` keys (4,096 by
default: many KV blocks and every split schedule). Key 0 is the *dominant key* at logit 0; the other
N − 1 keys are *weaker*, at logit −Δ + ln U with U uniform on (0, 2) (stratified): their unnormalised
weights e^-Δ·U are uniform within every cell of the P format's grid, so round-to-nearest adds no bias
and what the V = 1 output loses is what the cast zeroed or clipped. V's columns read the parts
directly: column 0 is all ones (the exact output is 1: the lost mass is 1 − out), column 1 the
dominant key alone, column 2 the weaker keys alone, column 3 holds V's amax, the others are E4M3-rounded
N(0, 1) values for the output error against an exact float64 reference. Q and K are exact in E4M3
(each logit a short exact sum of E4M3 products) and each tensor's amax is 448·2^k, so a kernel's own
per-tensor FP8 quantization of Q, K and V changes nothing (as in :mod:`pcast_jax.fingerprint.probes`).
With ``sinks=True`` a second head has a learned sink at logit 0 and every key weaker (the sink is the
dominant one; head 0's sink is inert at −64).

**The verdict** is the doctor's criterion (:func:`pcast_jax.criterion.over_limits`): at each Δ the
mass lost on the weaker keys (what the cast zeroed) and on the dominant key (what it clipped), each a
mean ± s.e. over the replicates, must be decidedly under 10^-3 (mean + 2 s.e. below it); over it at
any Δ fails, anything else is *within noise*. :func:`check_p_collapse` returns it as a
:class:`CollapseCheck` with the Δ at which the kernel starts to collapse, the closed form's threshold
Δc = 10 ln 2 + ln S − δ1 (:func:`pcast_jax.theory.critical_delta`, δ1 = 0 for one dominant key) for the
nearest preset, and that preset read by the fingerprint (:func:`pcast_jax.fingerprint.identify`) where
the outputs fit one. ``pcast probe`` does the same for a kernel run elsewhere.

Importing this module imports neither JAX nor the simulator: they load when a check needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable

import numpy as np

from pcast_jax import report
from pcast_jax.criterion import CLIPPED_MASS_LIMIT, ZEROED_MASS_LIMIT, Z, over_limits
from pcast_jax.errors import PcastError, check_int
from pcast_jax.fingerprint.probes import amax_entry, e4m3_values, key_entry
from pcast_jax.report import fmt_sci_pm as _pm
from pcast_jax.stats import mean_sem

__all__ = ["DELTAS", "N_KEYS", "REPLICATES", "MIN_HEAD_DIM", "FORMAT_TAG", "PROBES", "CollapseProbes",
           "CollapseRow", "CollapseCheck", "collapse_probes", "evaluate", "check_p_collapse",
           "assert_no_p_collapse", "simulated_kernel"]

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
# Q/K dims: Δ (coarse, fine), the weaker keys' ln U (coarse, fine); V columns of the readings
_DELTA_DIMS, _NOISE_DIMS = (0, 1), (2, 3)
_ONES, _DOMINANT, _WEAKER, _V_AMAX, _WITNESS = 0, 1, 2, 3, 4
#: The witnesses' weights U span (2·e^-WITNESS_SPAN, 2): below, the weaker keys hold under e^-24 of their mass.
WITNESS_SPAN = 12.0


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CollapseProbes:
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

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    sinks: np.ndarray | None
    exact: np.ndarray
    witness_share: np.ndarray
    scale: float
    causal: bool
    deltas: tuple[float, ...]
    seed: int

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    @property
    def n_keys(self) -> int:
        return int(self.k.shape[1])

    @property
    def replicates(self) -> int:
        return int(self.q.shape[0]) // 2

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of the kernel's output on the probes: q's shape."""
        return tuple(self.q.shape)

    def arrays(self) -> tuple:
        """``(q, k, v)`` or ``(q, k, v, sinks)``: the kernel's arguments."""
        return (self.q, self.k, self.v) if self.sinks is None else (self.q, self.k, self.v, self.sinks)

    def _params(self) -> dict:
        return {"head_dim": self.head_dim, "scale": self.scale, "causal": self.causal, "sinks": self.sinks is not None,
                "n_keys": self.n_keys, "deltas": self.deltas, "replicates": self.replicates, "seed": self.seed}

    def save(self, path) -> None:
        """Writes the probes as an ``.npz`` (atomically) that :meth:`load` and ``pcast probe check`` read."""
        from pcast_jax.fileio import atomic_write

        arrays = {"q": self.q, "k": self.k, "v": self.v, "format": np.array(FORMAT_TAG),
                  "scale": np.float64(self.scale), "causal": np.bool_(self.causal), "seed": np.int64(self.seed),
                  "deltas": np.asarray(self.deltas, np.float64)}
        if self.sinks is not None:
            arrays["sinks"] = self.sinks
        atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path) -> "CollapseProbes":
        """The probes in ``path`` (written by :meth:`save`), rebuilt from their parameters and compared
        array by array; PcastError naming the file when it is not such probes."""
        from pcast_jax.fileio import load_npz

        what = f"probes file {str(path)!r}"
        data = load_npz(path, what=what, max_bytes=1 << 30)
        tag = data.get("format")
        if tag is None or tag.shape != () or str(tag) != FORMAT_TAG:
            raise PcastError(f"{what} was not written by 'pcast probe write' (no format tag {FORMAT_TAG!r})")
        try:
            params = dict(head_dim=int(data["q"].shape[-1]), scale=float(data["scale"]), causal=bool(data["causal"]),
                          sinks="sinks" in data, n_keys=int(data["k"].shape[1]),
                          deltas=tuple(float(d) for d in data["deltas"]), replicates=int(data["q"].shape[0]) // 2,
                          seed=int(data["seed"]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise PcastError(f"{what} lacks q, k, scale, causal, deltas or seed") from None
        try:
            fresh = collapse_probes(**params)
        except PcastError as exc:
            raise PcastError(f"{what}: {exc}") from None
        for name, want in zip(("q", "k", "v", "sinks"), fresh.arrays()):
            got = data.get(name)
            if got is None or got.shape != want.shape or not np.array_equal(got, want):
                raise PcastError(f"{what}: {name} is not what 'pcast probe write' writes for its parameters "
                                 "(edited, or another version)")
        return fresh


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
    """The probes of :func:`check_p_collapse` for a kernel of head dim ``head_dim`` (see the module's docs).

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
    witness_u, share = witness_weights(d - _WITNESS, rng.uniform(size=batch))
    where = np.stack([rng.choice(np.arange(1, n), d - _WITNESS, replace=False) for _ in range(batch)])
    np.put_along_axis(weights, where, witness_u, axis=1)
    u_coarse, u_fine = _split(np.log(weights))
    weaker = np.ones((heads, n), bool)
    weaker[0, 0] = False  # head 0: key 0 is the dominant key (logit 0: every dim of its row is 0)
    for h in range(heads):
        k[:, weaker[h], h, _DELTA_DIMS[0]] = k[:, weaker[h], h, _DELTA_DIMS[1]] = kappa
        k[:, weaker[h], h, _NOISE_DIMS[0]] = u_coarse[:, weaker[h]] * kappa
        k[:, weaker[h], h, _NOISE_DIMS[1]] = u_fine[:, weaker[h]] * kappa
        v[:, :, h, _DOMINANT] = ~weaker[h]
        v[:, :, h, _WEAKER] = weaker[h]
    v[:, :, :, _ONES] = 1.0
    b = np.arange(reps)[:, None]
    v[b, where[:reps], :, _WITNESS + np.arange(d - _WITNESS)[None, :]] = 1.0
    v[reps:, :, :, _WITNESS:] = e4m3_values(np.clip(rng.standard_normal((reps, n, 1, d - _WITNESS)),
                                                    -_V_CLIP, _V_CLIP))
    v[:, -1, :, _V_AMAX] = amax_entry(_V_CLIP)
    q[:, :, :, spare_q] = amax_entry(float(np.abs(q).max()))
    k[:, -1, :, spare_k] = amax_entry(float(np.abs(k).max()))
    sink_arr = np.asarray((INERT_SINK, 0.0), np.float32) if sinks else None
    return CollapseProbes(q=q, k=k, v=v, sinks=sink_arr, exact=_exact(q, k, v, sink_arr, scale, causal),
                          witness_share=share[:reps], scale=scale,
                          causal=causal, deltas=deltas, seed=seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseRow:
    """One probe at one Δ: what the kernel lost there, each a mean and its s.e. over the replicates.

    Attributes:
      probe: which probe (:data:`PROBES`).
      delta: the sink strength Δ.
      zeroed: the softmax mass the cast zeroed: the weaker keys' exact share times the share the
        witnesses that read 0 stand for (:func:`witness_weights`).
      lost_mass: exact − out on the all-ones V column (1 − out without a sink): what the output lost,
        rounding included (round-to-nearest moves up to ~10^-3 of the mass either way in E4M3).
      lost_weaker: the same on the weaker keys alone (their exact share − out), rounding included.
      lost_dominant: the mass lost on the dominant key (clipped, or S itself rounded); 0 for the
        learned-sink probe, whose dominant logit has no value row.
      output_error: RMS error of the random-V columns over the exact output's RMS.
      *_sem: the standard errors.
      verdict: ``"over"``, ``"under"`` or ``"within noise"``: :func:`pcast_jax.criterion.over_limits` on
        ``zeroed`` (the zeroed mass) and ``lost_dominant`` (the clipped mass).
    """

    probe: str
    delta: float
    zeroed: float
    zeroed_sem: float
    lost_mass: float
    lost_mass_sem: float
    lost_weaker: float
    lost_weaker_sem: float
    lost_dominant: float
    lost_dominant_sem: float
    output_error: float
    output_error_sem: float
    verdict: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseCheck:
    """What :func:`check_p_collapse` found: per-Δ readings, the verdict, the collapse Δ beside the closed form.

    Attributes:
      rows: one :class:`CollapseRow` per probe and Δ.
      safe: True when every row is decidedly under both limits, False when one is over, None when none is
        over but one is within noise.
      verdict: the verdict in words.
      collapse_delta: the smallest Δ of a row over a limit (None when none is).
      nearest_preset: the preset whose fields agree with every field the fingerprint decided, or None.
      nearest_note: how the nearest preset was found, or why there is none (``"no preset fits: …"``).
      fitted_config: the fingerprint's config (``KernelConfig.to_string()``), or None.
      closed_form_delta: Δc = 10 ln 2 + ln S − δ1 of the nearest preset (or the fitted config), or None.
      closed_form_note: what Δc is, or why there is none.
      head_dim, scale, causal, sinks, n_keys, replicates, seed: the probes'.
      seconds_kernel: the kernel call's seconds on the probes (None where it ran elsewhere: :func:`evaluate` on
        outputs read back); seconds_check: the whole check's.
    """

    rows: tuple[CollapseRow, ...]
    safe: bool | None
    verdict: str
    collapse_delta: float | None
    nearest_preset: str | None
    nearest_note: str
    fitted_config: str | None
    closed_form_delta: float | None
    closed_form_note: str
    head_dim: int
    scale: float
    causal: bool
    sinks: bool
    n_keys: int
    replicates: int
    seed: int
    seconds_kernel: float | None
    seconds_check: float

    def worst(self) -> CollapseRow:
        """The row with the largest lost mass."""
        return max(self.rows, key=lambda r: max(r.zeroed, r.lost_dominant))

    def summary(self) -> str:
        """The check as markdown: the verdict, the thresholds, the nearest preset, one table row per probe and Δ."""
        head = [f"**P-collapse check: {self.verdict}**", "",
                f"Criterion (`pcast doctor`'s): the zeroed mass (read by the witness keys) and the mass lost on "
                f"the dominant key (clipped), each ≤ {ZEROED_MASS_LIMIT:g} of the softmax at every Δ, decided when "
                f"mean ± {Z:g} s.e. "
                f"over {self.replicates} replicates excludes the limit, else within noise.",
                f"Probes: head dim {self.head_dim}, scale {report.fmt_num(self.scale, 4)}, {self.n_keys} keys, "
                f"{'causal (bottom-right), ' if self.causal else ''}"
                f"{'with a learned-sink probe, ' if self.sinks else ''}seed {self.seed}; kernel call "
                + ("not timed (it ran elsewhere)" if self.seconds_kernel is None
                   else f"{report.fmt_num(self.seconds_kernel, 2)} s")
                + f", check {report.fmt_num(self.seconds_check, 2)} s.",
                "Starts to collapse at: " + ("no Δ of the probes" if self.collapse_delta is None
                                             else f"Δ = {self.collapse_delta:g}")
                + "; closed form: " + (f"Δc = {report.fmt_num(self.closed_form_delta, 2)} ({self.closed_form_note})"
                                       if self.closed_form_delta is not None else self.closed_form_note) + ".",
                f"Nearest preset: {self.nearest_preset or 'none'} ({self.nearest_note}).", ""]
        table = [{"probe": r.probe, "delta": f"{r.delta:g}", "zeroed": _pm(r.zeroed, r.zeroed_sem),
                  "lost": _pm(r.lost_mass, r.lost_mass_sem), "weaker": _pm(r.lost_weaker, r.lost_weaker_sem),
                  "dominant": _pm(r.lost_dominant, r.lost_dominant_sem),
                  "error": _pm(r.output_error, r.output_error_sem), "verdict": r.verdict} for r in self.rows]
        cols = [("probe", "probe"), ("delta", "Δ"), ("zeroed", "zeroed mass"), ("lost", "lost mass"),
                ("weaker", "lost on weaker keys"),
                ("dominant", "lost on dominant"), ("error", "output error (RMS/RMS)"), ("verdict", "row")]
        return "\n".join(head) + report.markdown_table(table, cols, align="llrrrrrl", name="p_collapse")

    def to_dict(self) -> dict:
        """Plain values (JSON-ready)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        out["criterion"] = {"zeroed_mass_max": ZEROED_MASS_LIMIT, "clipped_mass_max": CLIPPED_MASS_LIMIT, "z": Z}
        return out


def _check_out(probes: CollapseProbes, out, what: str) -> np.ndarray:
    try:
        arr = np.asarray(out)
    except Exception as exc:  # noqa: BLE001 - whatever the kernel returned
        raise PcastError(f"{what} is not an array ({exc})") from None
    if arr.dtype.kind not in "fiu" and arr.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raise PcastError(f"{what}.dtype={arr.dtype} must be a floating-point type (the attention output)")
    if arr.shape != probes.out_shape:
        raise PcastError(f"{what}.shape={arr.shape} must be the probes' query shape {probes.out_shape} "
                         "[batch, q_tokens, heads, head_dim]")
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise PcastError(f"{what} holds {int(bad.sum())} NaN or inf values (first at {idx}): a kernel's output on "
                         "the probes must be finite")
    return arr


def _rows(probes: CollapseProbes, out: np.ndarray) -> list[CollapseRow]:
    exact, reps = probes.exact, probes.replicates
    lost = exact[..., :_WITNESS] - out[..., :_WITNESS]  # (2R, T, H, 4)
    # the witness half: the zeroed share of the weaker keys' mass, times their exact share
    zero = out[:reps, ..., _WITNESS:] == 0  # (R, T, H, witnesses)
    zeroed = exact[:reps, ..., _WEAKER] * np.einsum("rthw,rw->rth", zero, probes.witness_share)
    rand_out, rand_exact = out[reps:, ..., _WITNESS:], exact[reps:, ..., _WITNESS:]
    err = np.sqrt(np.sum((rand_out - rand_exact) ** 2, axis=-1) / np.sum(rand_exact**2, axis=-1))
    rows = []
    for h in range(out.shape[2]):
        for t, delta in enumerate(probes.deltas):
            total, weaker, dominant = (mean_sem(lost[:, t, h, c]) for c in (_ONES, _WEAKER, _DOMINANT))
            zeroed_t, error = mean_sem(zeroed[:, t, h]), mean_sem(err[:, t, h])
            over = over_limits(zeroed_t, dominant)
            rows.append(CollapseRow(probe=PROBES[h], delta=delta, zeroed=zeroed_t[0], zeroed_sem=zeroed_t[1],
                                    lost_mass=total[0], lost_mass_sem=total[1], lost_weaker=weaker[0],
                                    lost_weaker_sem=weaker[1], lost_dominant=dominant[0],
                                    lost_dominant_sem=dominant[1], output_error=error[0], output_error_sem=error[1],
                                    verdict={True: "over", False: "under", None: "within noise"}[over]))
    return rows


def _closed_form(cfg) -> tuple[float | None, str]:
    """Δc of ``cfg`` for one dominant key (δ1 = 0), or None and why there is none."""
    from pcast_jax import numberline, theory

    if cfg.scale_mode not in ("multiply", "exponent") or cfg.p_format in numberline.BLOCK_FORMATS:
        return None, f"no closed form: the scale is computed per block or tile ({cfg.scale_mode}, {cfg.p_format})"
    if cfg.p_offset != "running_max":
        return None, f"no closed form: P is taken against {cfg.p_offset}, not the running max"
    s = cfg.effective_scale
    dc = float(theory.critical_delta(s, k_sink=1, fmt=cfg.p_format))
    where = ("every key cast against the dominant key" if cfg.order == "forward" else
             "in reverse order only the dominant key's own KV block is cast against it")
    return dc, (f"10 ln 2 + ln S with S = {report.fmt_num(s, 4)}, {cfg.p_format}: half the weaker keys' P zero "
                f"when cast against the dominant key; {where}")


def _nearest(fp, head_dim: int) -> tuple[str | None, str]:
    """The preset agreeing with every field the fingerprint read (its candidates where undetermined)."""
    from pcast_jax.presets import PRESETS, preset_for

    best, best_off, fits = None, None, []
    for name in PRESETS:
        cfg = preset_for(name, head_dim)
        off = [f for f, e in fp.fields.items()
               if not (e.note or "").startswith("not probed") and getattr(cfg, f) not in e.candidates]
        if not off:
            fits.append(name)
        if best_off is None or len(off) < len(best_off):
            best, best_off = name, off
    if fits:
        return fits[0], ("the fingerprint's fields agree with " + ", ".join(fits) + f" (residual "
                         f"{report.fmt_sci(fp.residual)})")
    return None, (f"no preset fits the fingerprint's config; closest {best}, which differs in "
                  f"{', '.join(best_off)}")


def evaluate(probes: CollapseProbes, outputs, *, fingerprint=None, fingerprint_error: str | None = None,
             seconds_kernel: float | None = None, started: float | None = None) -> CollapseCheck:
    """The check from a kernel's outputs on ``probes`` (and its :class:`~pcast_jax.fingerprint.Fingerprint`,
    when one was read): what ``pcast probe check`` prints."""
    t0 = time.perf_counter() if started is None else started
    out = _check_out(probes, outputs, "outputs")
    rows = _rows(probes, out)
    over = [r for r in rows if r.verdict == "over"]
    unsure = [r for r in rows if r.verdict == "within noise"]
    safe = False if over else (None if unsure else True)
    collapse = min((r.delta for r in over), default=None)
    if over:
        parts = sorted({("zeroes the weaker keys" if r.zeroed >= r.lost_dominant else "clips the dominant key")
                        + f" ({r.probe})" for r in over})
        verdict = f"fails: P-collapse from Δ = {collapse:g}: the cast " + "; ".join(parts)
    elif unsure:
        verdict = (f"within noise: no row is over the limit, but {len(unsure)} are within {Z:g} s.e. of it "
                   f"(first at Δ = {min(r.delta for r in unsure):g}); rerun with more replicates")
    else:
        verdict = f"passes: at Δ = {min(probes.deltas):g}…{max(probes.deltas):g} the cast loses under the limit"
    cfg, fitted = None, None
    if fingerprint is not None:
        from pcast_jax.presets import preset_for

        nearest, note = _nearest(fingerprint, probes.head_dim)
        cfg = preset_for(nearest, probes.head_dim) if nearest else fingerprint.config
        fitted = fingerprint.config.to_string()
    else:
        nearest, note = None, fingerprint_error or "not read: no fingerprint"
        if fingerprint_error and fingerprint_error.startswith("outputs fit no candidate"):
            note = f"no preset fits: {fingerprint_error}"
    dc, dc_note = _closed_form(cfg) if cfg is not None else (None, "n/a: no preset or fitted config to take S from")
    if cfg is not None and nearest is None and dc is not None:
        dc_note += " (the fitted config's S: no preset fits)"
    return CollapseCheck(rows=tuple(rows), safe=safe, verdict=verdict, collapse_delta=collapse, nearest_preset=nearest,
                         nearest_note=note, fitted_config=fitted, closed_form_delta=dc, closed_form_note=dc_note,
                         head_dim=probes.head_dim, scale=probes.scale, causal=probes.causal,
                         sinks=probes.sinks is not None, n_keys=probes.n_keys, replicates=probes.replicates,
                         seed=probes.seed, seconds_kernel=seconds_kernel, seconds_check=time.perf_counter() - t0)


def read_fingerprint(kernel: Callable, *, head_dim: int, scale: float | None, causal: bool, sinks: bool):
    """``(Fingerprint, None)`` of ``kernel`` (:func:`pcast_jax.fingerprint.identify`), or ``(None, why not)``."""
    from pcast_jax.fingerprint import identify
    from pcast_jax.fingerprint.probes import MIN_HEAD_DIM as FP_MIN_HEAD_DIM

    if head_dim < FP_MIN_HEAD_DIM:
        return None, f"not read: the fingerprint's probes need head_dim ≥ {FP_MIN_HEAD_DIM}"
    try:
        return identify(kernel, head_dim=head_dim, scale=scale, causal=causal, sinks=sinks), None
    except PcastError as exc:
        return None, str(exc)


def check_p_collapse(kernel: Callable, *, head_dim: int, scale: float | None = None, causal: bool = False,
                     sinks: bool = False, n_keys: int = N_KEYS, deltas=DELTAS, replicates: int = REPLICATES,
                     seed: int = 0, fingerprint: bool = True) -> CollapseCheck:
    """Runs ``kernel`` on the P-collapse probes and returns what it lost, per Δ, with the doctor's verdict.

    Args:
      kernel: ``kernel(q, k, v)`` (``kernel(q, k, v, sinks)`` with ``sinks=True``) on NumPy float32 arrays in
        [batch, tokens, heads, head_dim] layout, returning the attention output in that layout (module docs).
      head_dim: the kernel's head dim.
      scale: the softmax scale the kernel applies (``jax.nn``'s 1/√head_dim when None).
      causal: the kernel masks causally (bottom-right aligned).
      sinks: the kernel takes learned sink logits, one per head.
      n_keys, deltas, replicates, seed: the probes' (:func:`collapse_probes`).
      fingerprint: also read the kernel's P-cast with :func:`pcast_jax.fingerprint.identify` (one more call
        on the fingerprint's probes, head_dim ≥ 36): the nearest preset and its closed-form Δc.

    Returns:
      A :class:`CollapseCheck`; ``str(check.summary())`` is its report.
    """
    if not callable(kernel):
        raise PcastError(f"kernel={kernel!r} must be callable as kernel(q, k, v)"
                         + (" or kernel(q, k, v, sinks)" if sinks else ""))
    if not isinstance(fingerprint, bool):
        raise PcastError(f"fingerprint={fingerprint!r} must be True or False")
    t0 = time.perf_counter()
    probes = collapse_probes(head_dim, scale=scale, causal=causal, sinks=sinks, n_keys=n_keys, deltas=deltas,
                             replicates=replicates, seed=seed)
    t1 = time.perf_counter()
    out = kernel(*probes.arrays())
    seconds = time.perf_counter() - t1
    fp, why = (read_fingerprint(kernel, head_dim=probes.head_dim, scale=probes.scale, causal=causal, sinks=sinks)
               if fingerprint else (None, "not read (fingerprint=False)"))
    return evaluate(probes, out, fingerprint=fp, fingerprint_error=why, seconds_kernel=seconds, started=t0)


def assert_no_p_collapse(kernel: Callable, **kwargs) -> CollapseCheck:
    """:func:`check_p_collapse`, raising AssertionError with its report unless the verdict passes.

    A verdict within noise fails too: the probes are seeded, so it is reproducible, and a pass must be decided.
    """
    check = check_p_collapse(kernel, **kwargs)
    if check.safe is not True:
        raise AssertionError("\n" + check.summary())
    return check


@functools.lru_cache(maxsize=64)
def _simulator(program, scale: float, with_sinks: bool):
    """One compiled simulator per program (configs that differ only in numbers share it)."""
    import jax

    from pcast_jax import engine

    def run(q, k, v, numbers, sinks):  # the config resolved once (simulated_kernel), bound here to traced numbers
        return engine.run_qkv(q, k, v, program.bind(numbers), scale=scale,
                              sink_logit=sinks if with_sinks else None).out

    return jax.jit(run)


def simulated_kernel(config, *, scale: float | None = None, causal: bool = False) -> Callable:
    """A kernel for :func:`check_p_collapse` that is the simulator running ``config`` (a preset name or a
    :class:`~pcast_jax.config.KernelConfig`): what that kernel would do, without a GPU. Configs that differ only
    in their numbers (S, τ, …) share one compiled program."""
    from pcast_jax.presets import resolve

    cfg = dataclasses.replace(resolve(config), causal=causal)
    program, numbers = cfg.program(), cfg.numbers()

    def kernel(q, k, v, sinks=None):
        d = np.shape(q)[-1]
        run = _simulator(program, float(1.0 / math.sqrt(d) if scale is None else scale), sinks is not None)
        q, k, v = (np.moveaxis(np.asarray(a, np.float32), 2, 1) for a in (q, k, v))
        sink = np.zeros(1, np.float32) if sinks is None else np.asarray(sinks, np.float32)
        return np.moveaxis(np.asarray(run(q, k, v, numbers, sink)), 1, 2)

    return kernel
