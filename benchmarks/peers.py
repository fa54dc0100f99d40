"""Straightforward vectorized peers of the sweep's Table 2 work: the code a user would write instead.

Algorithm 1 as written in the paper, block by block (B = 64), batched over seeds, one config at a
time, for the paper's five configs at Table 2's operating point (N = 4096, Δ = 7, q = 32, d = 128,
four sinks, σ = σ_V = 1), with the sweep's metrics per (seed, config): the sampled ``mse`` against
the FP32 softmax reference, ``frac_zeroed``, ``zeroed_mass``, ``frac_saturated``, ``saturated_mass``
and ``nonsink_mass``. Each peer draws its own scores and V (its library's normal sampler), so its
numbers have the sweep's distribution, not its bits.

* :func:`numpy_peer` — NumPy with ``ml_dtypes.float8_e4m3fn`` for line 9's cast (always available).
* :func:`torch_peer` — PyTorch, eager, ``torch.float8_e4m3fn`` casts (when torch is installed: the
  optional extra ``pip install -e '.[peers]'``; never a dependency of the package).

Nothing here imports ``pcast_jax``: the peers are independent of the code they are compared with.
"""

from __future__ import annotations

import numpy as np

#: (name, order, S) of the paper's five configs (§6.2): multiply mode, ℓ from pre-cast P, B = 64.
CONFIGS = (("fwd_s1", "forward", 1.0), ("rev_s1", "reverse", 1.0), ("fwd_s448", "forward", 448.0),
           ("fwd_s256", "forward", 256.0), ("rev_s256", "reverse", 256.0))
METRICS = ("mse", "frac_zeroed", "zeroed_mass", "frac_saturated", "saturated_mass", "nonsink_mass")
E4M3_MAX = 448.0


def _algorithm1(xp, z, v, is_sink, block, cast):
    """Every config's metrics for a batch of instances; ``xp`` is numpy or torch (the same code).

    ``z``: (S, q, N) float32 scores, ``v``: (S, N, d) float32, ``is_sink``: (N,) bool.
    Returns metric → (S, len(CONFIGS)) float64 NumPy array.
    """
    n = z.shape[-1]
    nb = n // block
    kw = {"keepdims": True} if xp is np else {"keepdim": True}
    e = xp.exp(z - (z.max(-1, **kw) if xp is np else z.amax(-1, **kw)))
    p_ref = e / e.sum(-1, **kw)
    o_ref = p_ref @ v
    nonsink = (p_ref * ~is_sink).sum(-1).mean(-1)
    out = {k: [] for k in METRICS}
    for _, order, scale in CONFIGS:
        shape = z.shape[:-1]
        m = xp.full(shape, -np.inf, dtype=z.dtype) if xp is np else xp.full(shape, -float("inf"))
        ell, o = xp.zeros_like(m), xp.zeros_like(o_ref)
        n_zero, zero_mass, n_sat, sat_mass = (xp.zeros_like(m) for _ in range(4))
        steps = range(nb) if order == "forward" else range(nb - 1, -1, -1)
        for j in steps:
            zj, vj, sink_j = z[..., j * block:(j + 1) * block], v[:, j * block:(j + 1) * block], is_sink[
                j * block:(j + 1) * block]
            m_new = xp.maximum(m, zj.max(-1) if xp is np else zj.amax(-1))
            alpha = xp.exp(m - m_new)
            p = xp.exp(zj - m_new[..., None])  # line 7
            ps = p * scale
            p8 = cast(ps)  # line 9: FP8 E4M3, saturating
            ell = alpha * ell + p.sum(-1)  # ℓ from the pre-cast P
            o = alpha[..., None] * o + p8 @ vj  # line 10, FP32 accumulator
            zero = (ps > 0) & (p8 == 0) & ~sink_j
            sat = ps > E4M3_MAX
            n_zero = n_zero + zero.sum(-1)
            zero_mass = alpha * zero_mass + (p * zero).sum(-1)
            n_sat = n_sat + sat.sum(-1)
            sat_mass = alpha * sat_mass + (p * sat).sum(-1)
            m = m_new
        o = o / (scale * ell)[..., None]
        counted = float(n - int(is_sink.sum()))
        out["mse"].append(((o - o_ref) ** 2).mean((-2, -1)))
        out["frac_zeroed"].append(n_zero.sum(-1) / (counted * z.shape[-2]))
        out["zeroed_mass"].append((zero_mass / ell).mean(-1))
        out["frac_saturated"].append(n_sat.sum(-1) / float(n * z.shape[-2]))
        out["saturated_mass"].append((sat_mass / ell).mean(-1))
        out["nonsink_mass"].append(nonsink)
    stack = np.stack if xp is np else (lambda xs, axis: xp.stack(xs, axis).numpy())
    return {k: np.asarray(stack(vals, axis=-1), np.float64) for k, vals in out.items()}


def sink_mask(n: int, k_sink: int = 4) -> np.ndarray:
    is_sink = np.zeros(n, bool)
    is_sink[:k_sink] = True
    return is_sink


def numpy_metrics(z, v, is_sink, block: int = 64) -> dict[str, np.ndarray]:
    """Algorithm 1 in NumPy for a batch of given instances (z (S, q, N), v (S, N, d) float32)."""
    import ml_dtypes

    def cast(ps):
        return np.minimum(ps, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)

    return _algorithm1(np, z, v, is_sink, block, cast)


def numpy_peer(seeds: int, *, seed: int = 0, batch: int = 16, n: int = 4096, q: int = 32, d: int = 128,
               delta: float = 7.0, k_sink: int = 4) -> dict[str, np.ndarray]:
    """``seeds`` instances drawn with NumPy (``default_rng(seed)``), ``batch`` at a time: metric → (seeds, 5)."""
    rng = np.random.default_rng(seed)
    is_sink = sink_mask(n, k_sink)
    parts = []
    for start in range(0, seeds, batch):
        s = min(batch, seeds - start)
        z = rng.standard_normal((s, q, n), dtype=np.float32)
        z[..., is_sink] += np.float32(delta)
        v = rng.standard_normal((s, n, d), dtype=np.float32)
        parts.append(numpy_metrics(z, v, is_sink))
    return {k: np.concatenate([p[k] for p in parts]) for k in METRICS}


def torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return hasattr(torch, "float8_e4m3fn")


def torch_peer(seeds: int, *, seed: int = 0, batch: int = 16, n: int = 4096, q: int = 32, d: int = 128,
               delta: float = 7.0, k_sink: int = 4, threads: int | None = None) -> dict[str, np.ndarray]:
    """The same in PyTorch (eager, CPU, ``torch.float8_e4m3fn`` casts): metric → (seeds, 5).

    ``threads``: torch's intra-op threads for the call (default: as set). On a loaded machine one
    thread can be many times faster than torch's default (its threads wait for each other on
    every small op), so the benchmark times both and keeps the best.
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _torch_run(torch, seeds, seed, batch, n, q, d, delta, k_sink)
    finally:
        torch.set_num_threads(before)


def _torch_run(torch, seeds, seed, batch, n, q, d, delta, k_sink):
    gen = torch.Generator().manual_seed(seed)
    is_sink = torch.from_numpy(sink_mask(n, k_sink))

    def cast(ps):
        return ps.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)

    parts = []
    with torch.inference_mode():
        for start in range(0, seeds, batch):
            s = min(batch, seeds - start)
            z = torch.randn((s, q, n), generator=gen)
            z[..., is_sink] += delta
            v = torch.randn((s, n, d), generator=gen)
            parts.append(_algorithm1(torch, z, v, is_sink, 64, cast))
    return {k: np.concatenate([p[k] for p in parts]) for k in METRICS}


def peers() -> dict:
    """name → peer function, the ones this machine can run."""
    out = {"numpy_ml_dtypes": numpy_peer}
    if torch_available():
        import functools
        import os

        out["torch_eager"] = torch_peer
        if (os.cpu_count() or 1) > 1:
            out["torch_eager_1thread"] = functools.partial(torch_peer, threads=1)
    return out
