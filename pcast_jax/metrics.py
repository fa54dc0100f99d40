"""Precision metrics of a simulated kernel against the FP32 softmax reference (Table 1, Table 2).

Every metric is a mean over the instance's query rows:

* ``mse`` — mean over rows and dimensions of (O_kernel − O_ref)² (Table 2, Figures 2–3); NaN when
  the sweep does not sample V (``SweepSpec(sampled_mse=False)``).
* ``mse_expected`` — σ_V² Σ_j (W_j − P_j)², the expected per-dimension squared error given the
  scores, averaged over V (:func:`pcast_jax.engine.effective_weights`). Same mean as ``mse``, much
  lower variance, no V draw needed; it covers the P-cast only (not an f16 accumulator or FP8 V).
* ``frac_zeroed`` — fraction of non-sink P values that were > 0 and cast to 0 (Table 1, Eq. (7)).
* ``zeroed_mass`` — exact softmax probability carried by those zeroed values.
* ``frac_saturated`` — fraction of visible P values (sinks included) whose P·S exceeded the
  format's max and were clipped by the cast (a lagging running max, ``rescale_threshold``, or S above
  the max; ℓ keeps the unclipped value).
* ``saturated_mass`` — exact softmax probability carried by those saturated values.
* ``nonsink_mass`` — exact softmax probability on non-sink keys (Table 1): of the FP32 reference the
  config is compared with, so it depends on the config through ``causal`` only. A learned sink
  (``instance.sink_logit``) is a softmax column of its own: its share is not non-sink mass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pcast_jax import engine as _engine
from pcast_jax.config import KernelConfig
from pcast_jax.engine import check_implementation
from pcast_jax.errors import PcastError
from pcast_jax.presets import resolve
from pcast_jax.quantities import CONFIG_METRICS, METRICS, QUANTITIES, Quantity, axis_label, describe

__all__ = ["METRICS", "CONFIG_METRICS", "Quantity", "QUANTITIES", "describe", "axis_label",
           "evaluate", "expected_is_exact"]

def expected_is_exact(config: KernelConfig | str) -> bool:
    """Whether ``mse_expected`` has the same mean as ``mse`` for ``config``.

    True when the output is W·V exactly (FP32 accumulator, no MMA accumulator model): then the
    V-averaged error σ_V² Σ(W − P)² is the expectation of the sampled one given the scores. An f16
    accumulator or the MMA model adds an error that ``mse_expected`` does not see.
    """
    cfg = resolve(config)
    return cfg.accumulator == "f32" and not cfg.mma_acc_bits


def evaluate(instance, configs: tuple[KernelConfig | str, ...], *, implementation: str = "xla",
             sigma_v: float = 1.0, expected: bool = True, sampled: bool = True) -> dict[str, jnp.ndarray]:
    """All metrics of one instance for every config; values shaped (len(configs),).

    ``instance`` has ``scores`` (q_len, N), ``v`` (N, d) and ``is_sink`` (N,). ``nonsink_mass`` is
    given per config so every metric has the same shape. ``expected=False`` skips
    ``mse_expected`` (reported as NaN then, never as a made-up number). A causal config is
    compared with the causal FP32 reference, and its ``nonsink_mass`` is that reference's.

    With the xla implementation, a config with an FP32 accumulator has output W·V
    (:func:`pcast_jax.engine.weights_and_stats`), so its error is (W − P)·V: the weights are
    computed once for ``mse`` and ``mse_expected``, and all such configs share one matrix product
    with V (no separate reference product, no cancellation between two outputs).

    ``sampled=False`` skips ``mse`` (NaN) and never touches V (``instance.v`` may be None): every
    config's statistics then come from :func:`pcast_jax.engine.weights_and_stats`, which needs
    the xla implementation. The other metrics equal the sampled evaluation's: the zeroed fraction and the
    masses bit for bit, ``mse_expected`` to float32 rounding (XLA may fuse its sums differently
    without the product; most values, and at Table 2's shapes all of the paper's configs', agree
    bit for bit).
    """
    scores, v, is_sink = instance.scores, instance.v, instance.is_sink
    sink = getattr(instance, "sink_logit", None)
    impl = check_implementation(implementation)
    if not sampled and impl != "xla":
        raise PcastError(f"sampled=False takes every metric from the xla implementation's weights; "
                         f"implementation={impl!r} needs V (use implementation='xla', or sample V)")
    if sampled and v is None:
        raise PcastError("instance.v is None: mse needs V (draw it, or pass sampled=False)")
    count_mask = ~is_sink
    probs = {}

    def reference(causal: bool):
        if causal not in probs:
            probs[causal] = _engine.reference_probs(scores, causal=causal, sink_logit=sink)
        return probs[causal]

    def nonsink(causal: bool):
        return jnp.mean(jnp.sum(jnp.where(is_sink, 0.0, reference(causal)), axis=-1))
    rows = {k: [None] * len(configs) for k in METRICS}
    shared = []  # (config index, W − P) of the configs whose error is (W − P)·V
    for i, cfg in enumerate(configs):
        cfg = _engine.bound(resolve(cfg))  # resolved and bound once, for every engine call below
        p_ref = reference(cfg.causal)
        shares_product = impl == "xla" and expected_is_exact(cfg)
        if shares_product or not sampled:  # output = W·V exactly, or no V: what the weights say
            r = _engine.run_weights(scores, cfg, count_mask=count_mask, sink_logit=sink)
            diff = r.weights - p_ref
            if sampled:
                shared.append((i, diff))
            else:
                rows["mse"][i] = jnp.float32(jnp.nan)
                if shares_product:  # materialized, as the product with V makes it: the sums fuse alike
                    diff = jax.lax.optimization_barrier(diff)
        else:
            r = _engine.run(scores, v, cfg, implementation=impl, count_mask=count_mask, sink_logit=sink)
            o_ref = jnp.einsum("qn,nd->qd", p_ref, v, precision="highest")
            rows["mse"][i] = jnp.mean((r.out - o_ref) ** 2)
            diff = _engine.run_weights(scores, cfg, sink_logit=sink).weights - p_ref if expected else None
        if expected:
            rows["mse_expected"][i] = sigma_v**2 * jnp.mean(jnp.sum(diff**2, axis=-1))
        else:
            rows["mse_expected"][i] = jnp.float32(jnp.nan)
        rows["frac_zeroed"][i] = jnp.sum(r.n_zeroed) / jnp.maximum(jnp.sum(r.n_counted), 1)
        rows["zeroed_mass"][i] = jnp.mean(r.zeroed_mass)
        rows["frac_saturated"][i] = jnp.sum(r.n_saturated) / jnp.maximum(jnp.sum(r.n_visible), 1)
        rows["saturated_mass"][i] = jnp.mean(r.saturated_mass)
        rows["nonsink_mass"][i] = nonsink(cfg.causal)
    if shared:
        err = jnp.einsum("cqn,nd->cqd", jnp.stack([d for _, d in shared]), v, precision="highest")
        for (i, _), e in zip(shared, err):
            rows["mse"][i] = jnp.mean(e**2)
    return {k: jnp.stack([jnp.asarray(x, jnp.float32) for x in vals]) for k, vals in rows.items()}
