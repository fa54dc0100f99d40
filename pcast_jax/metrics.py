"""Precision metrics of a simulated kernel against the FP32 softmax reference (Table 1, Table 2).

Every metric is a mean over the instance's query rows:

* ``mse`` — mean over rows and dimensions of (O_kernel − O_ref)² (Table 2, Figures 2–3).
* ``mse_expected`` — σ_V² Σ_j (W_j − P_j)², the expected per-dimension squared error given the
  scores, averaged over V (:func:`pcast_jax.engine.effective_weights`). Same mean as ``mse``, much
  lower variance, no V draw needed; it covers the P-cast only (not an f16 accumulator or FP8 V).
* ``frac_zeroed`` — fraction of non-sink P values that were > 0 and cast to 0 (Table 1, Eq. (7)).
* ``zeroed_mass`` — exact softmax probability carried by those zeroed values.
* ``nonsink_mass`` — exact softmax probability on non-sink keys (Table 1, config-independent).
"""

from __future__ import annotations

import jax.numpy as jnp

from pcast_jax import engine as _engine
from pcast_jax.config import KernelConfig

__all__ = ["METRICS", "CONFIG_METRICS", "evaluate"]

CONFIG_METRICS = ("mse", "mse_expected", "frac_zeroed", "zeroed_mass")
METRICS = CONFIG_METRICS + ("nonsink_mass",)


def evaluate(instance, configs: tuple[KernelConfig, ...], *, engine: str = "fast", sigma_v: float = 1.0,
             expected: bool = True) -> dict[str, jnp.ndarray]:
    """All metrics of one instance for every config; values shaped (len(configs),).

    ``instance`` has ``scores`` (q_len, N), ``v`` (N, d) and ``is_sink`` (N,). ``nonsink_mass`` is
    repeated per config so every metric has the same shape. ``expected=False`` skips
    ``mse_expected`` (reported as NaN then, never as a made-up number).
    """
    scores, v, is_sink = instance.scores, instance.v, instance.is_sink
    p_ref = _engine.reference_probs(scores)
    o_ref = jnp.einsum("qn,nd->qd", p_ref, v, precision="highest")
    nonsink = jnp.mean(jnp.sum(jnp.where(is_sink, 0.0, p_ref), axis=-1))
    rows = {k: [] for k in METRICS}
    for cfg in configs:
        r = _engine.attention(scores, v, cfg, engine=engine, count_mask=~is_sink)
        rows["mse"].append(jnp.mean((r.out - o_ref) ** 2))
        if expected:
            w = _engine.effective_weights(scores, cfg)
            rows["mse_expected"].append(sigma_v**2 * jnp.mean(jnp.sum((w - p_ref) ** 2, axis=-1)))
        else:
            rows["mse_expected"].append(jnp.float32(jnp.nan))
        rows["frac_zeroed"].append(jnp.sum(r.n_zeroed) / jnp.maximum(jnp.sum(r.n_counted), 1))
        rows["zeroed_mass"].append(jnp.mean(r.zeroed_mass))
        rows["nonsink_mass"].append(nonsink)
    return {k: jnp.stack([jnp.asarray(x, jnp.float32) for x in vals]) for k, vals in rows.items()}
