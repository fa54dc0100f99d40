"""Workloads: synthetic attention sinks (§3.1, §6) and scores from given Q/K/V.

A synthetic sink instance is drawn from one PRNG key: non-sink scores s ~ N(0, σ²) for every query
row and key, sink keys get Δ added to the same kind of draw (so a sink score is Δ + σz, the paper's
convention behind m_global = Δ + δk, Eq. (3)), and V ~ N(0, σ_V²). The key does not depend on Δ, so
one seed gives the same draws at every Δ (common random numbers: curves over Δ are smooth and
paired comparisons are exact).

The draws are JAX's threefry2x32 normals, bit for bit, with the hash unrolled
(:func:`threefry_unrolled`): on CPU, JAX lowers threefry as a loop over its five four-round groups
with the rotations as loop data, which XLA cannot fuse into one pass; the unrolled form is the one
JAX itself emits on other platforms: the same bits 2.5× and the normals 1.5× faster on CPU (CPU time).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jax_random

from pcast_jax.errors import PcastError, check_finite, check_int, check_positive

__all__ = ["SinkWorkload", "Instance", "make_instance", "sink_mask", "threefry_unrolled", "SIGMA_MAX",
           "SIGMA_V_MAX", "DELTA_MAX"]

#: Largest σ (2^16): scores of ~6σ times log2 e stay below 2^20, so float32's rounding of an
#: exponent-mode kernel's exp2 argument (≤ 2^-4) stays within the FP8 step and every preset's metrics
#: are finite (at 1e10 FA3's split-KV merge gives NaN): a sweep measures the cast, not float32.
SIGMA_MAX = 2.0**16
#: Largest |Δ| a sweep accepts (2^125): scores times log2 e, and the split-KV merge's sum of two
#: such, stay finite in float32 (at 1.2e38 FA3's split-KV merge gives NaN).
DELTA_MAX = 2.0**125
#: Largest σ_V: the MSE sums squares of ~10 σ_V over up to ~1e6 outputs, finite in float32.
SIGMA_V_MAX = 1e15


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SinkWorkload:
    """Shape and statistics of a synthetic sink workload (Δ is passed separately, it may be traced).

    Attributes:
      n: KV length N.
      q_len: query rows per instance (the paper uses 32).
      d: head dimension of V (the paper uses 128).
      k_sink: number of sink tokens (ignored when ``sink_positions`` is given).
      sink_positions: explicit sink key positions for multi-sink patterns; default the first k_sink.
      sigma: non-sink score standard deviation σ.
      sigma_v: standard deviation of V entries.
      sink_logit: a learned sink (gpt-oss ``sinks``: one logit per head, a softmax column with no
        value row) beside or instead of the token sinks: None (none), a number Δ_L (the sink's logit
        above the non-sink mean, which is 0, so in the units of Δ; |Δ_L| ≤ :data:`DELTA_MAX`), or
        ``"delta"``: Δ_L is the Δ the instance is drawn at (sweep Δ_L with ``k_sink=0``). Where the kernel puts it is
        ``KernelConfig.sink_mode``.
    """

    n: int = 4096
    q_len: int = 32
    d: int = 128
    k_sink: int = 4
    sink_positions: tuple[int, ...] | None = None
    sigma: float = 1.0
    sigma_v: float = 1.0
    sink_logit: float | str | None = None

    def __post_init__(self):
        for name in ("n", "q_len", "d"):  # NumPy integers become ints (JSON-able, hashable alike)
            object.__setattr__(self, name, check_int(name, getattr(self, name), min_value=1))
        check_positive("sigma", self.sigma, float32=True, max_abs=SIGMA_MAX)
        check_positive("sigma_v", self.sigma_v, float32=True, max_abs=SIGMA_V_MAX)
        for name in ("sigma", "sigma_v"):
            if isinstance(getattr(self, name), np.generic):
                object.__setattr__(self, name, float(getattr(self, name)))
        if isinstance(self.sink_logit, str) and self.sink_logit != "delta":
            raise PcastError(f"sink_logit={self.sink_logit!r} must be None, a number or 'delta'")
        if self.sink_logit is not None and self.sink_logit != "delta":
            # the bound of Δ, whose units it has: past it an exponent-mode kernel's log2(e)·(s − m) overflows
            object.__setattr__(self, "sink_logit", check_finite("sink_logit", self.sink_logit, float32=True,
                                                                max_abs=DELTA_MAX))
        if self.sink_positions is None:
            object.__setattr__(self, "k_sink", check_int("k_sink", self.k_sink, min_value=0, max_value=self.n))
        else:
            if isinstance(self.sink_positions, (str, bytes)) or not hasattr(self.sink_positions, "__iter__"):
                raise PcastError(f"sink_positions={self.sink_positions!r} must be a sequence of key "
                                 f"positions in [0, n={self.n})")
            pos = tuple(check_int("sink_positions", p, min_value=0) for p in self.sink_positions)
            if len(set(pos)) != len(pos):
                raise PcastError(f"sink_positions={pos} has duplicates")
            if any(p < 0 or p >= self.n for p in pos):
                raise PcastError(f"sink_positions={pos} must lie in [0, n={self.n})")
            object.__setattr__(self, "sink_positions", pos)
            object.__setattr__(self, "k_sink", len(pos))

    @property
    def positions(self) -> tuple[int, ...]:
        return self.sink_positions if self.sink_positions is not None else tuple(range(self.k_sink))


def sink_mask(workload: SinkWorkload) -> np.ndarray:
    """(N,) bool, True at the sink keys."""
    m = np.zeros(workload.n, bool)
    m[list(workload.positions)] = True
    return m


class Instance(NamedTuple):
    """One attention instance: scores (q_len, N), V (N, d) (None when not drawn), which keys are sinks
    (N,), and the learned sink logit (a scalar, or None without one)."""

    scores: jax.Array
    v: jax.Array
    is_sink: jax.Array
    sink_logit: jax.Array | None = None


# --------------------------------------------------------------------------------------------
# threefry2x32 with the hash unrolled: the same bits as JAX's, one fusion on CPU
# --------------------------------------------------------------------------------------------

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 hash (20 rounds, Salmon et al. 2011) as JAX computes it, written out."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r)))
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _random_bits(key, bit_width, shape):
    """JAX's partitionable threefry bits (counter = flat index, 64-bit, xor of both words)."""
    impl = jax_random.threefry_prng_impl
    size = math.prod(shape)
    if bit_width != 32 or not shape or size >= 2**32 or not jax.config.jax_threefry_partitionable:
        return impl.random_bits(key, bit_width, shape)
    counts = jax.lax.iota(np.uint32, size).reshape(shape)  # the low word; the high word is 0
    b1, b2 = _threefry2x32(key[0], key[1], jnp.zeros(shape, np.uint32), counts)
    return b1 ^ b2


_UNROLLED = jax_random.define_prng_impl(
    key_shape=(2,), seed=jax_random.threefry_prng_impl.seed, split=jax_random.threefry_prng_impl.split,
    random_bits=_random_bits, fold_in=jax_random.threefry_prng_impl.fold_in, name="threefry2x32_unrolled",
    tag="fry_u")


def threefry_unrolled(key):
    """``key`` (a threefry2x32 key, raw uint32 or typed) as a key that draws the same bits, unrolled.

    Any other key is returned as it is. The bits are JAX's exactly; normals drawn from them go through
    JAX's own erf_inv transform, whose last bits XLA:CPU may round differently in another compiled
    program (a few ulps), so a sweep's draws are reproducible program for program, not bit for bit
    against ``jax.random.normal`` with the plain key.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return key
        key = jax.random.key_data(key)
    elif key.dtype != jnp.uint32 or key.shape != (2,) or jax.config.jax_default_prng_impl != "threefry2x32":
        return key
    return jax.random.wrap_key_data(key, impl=_UNROLLED)


def make_instance(key, workload: SinkWorkload, delta, *, draw_v: bool = True) -> Instance:
    """Draw one synthetic sink instance. ``delta`` may be a traced scalar (vmap over Δ).

    A concrete ``delta`` must be finite in float32 (NaN or ±inf would silently poison every row).
    ``draw_v=False`` leaves V out (``v`` is None; the scores are the same draws either way): for
    the metrics that average over V instead of sampling it.
    """
    w = workload
    if not isinstance(w, SinkWorkload):
        raise PcastError(f"workload must be a SinkWorkload, got {type(w).__name__}")
    if not isinstance(delta, jax.core.Tracer):
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                d32 = np.asarray(delta, np.float32)
        except (TypeError, ValueError):
            raise PcastError(f"delta={delta!r} must be a real number") from None
        if not np.all(np.isfinite(d32)):
            raise PcastError(f"delta={delta!r} must be finite in float32 (|delta| < 3.4e38, not NaN)")
    ks, kv = (threefry_unrolled(k) for k in jax.random.split(key))
    scores = w.sigma * jax.random.normal(ks, (w.q_len, w.n), jnp.float32)
    is_sink = jnp.asarray(sink_mask(w))
    scores = scores + jnp.where(is_sink, jnp.asarray(delta, jnp.float32), 0.0)
    v = w.sigma_v * jax.random.normal(kv, (w.n, w.d), jnp.float32) if draw_v else None
    sink = None if w.sink_logit is None else jnp.asarray(delta if w.sink_logit == "delta" else w.sink_logit,
                                                           jnp.float32)
    return Instance(scores, v, is_sink, sink)
