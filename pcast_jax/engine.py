"""The kernel-faithful simulator: what an FP8 attention kernel computes, block by block.

Two engines compute the same thing:

* :func:`attention` with ``implementation="scan"`` — ``lax.scan`` over KV blocks in the kernel's
  order, Algorithm 1 line by line (running max m, correction α, row sum ℓ from pre-cast P, P-cast,
  P8·V, epilogue). This is the reference the Pallas kernels are checked against.
* ``implementation="xla"`` (the default) — the same numbers without the
  sequential loop: the running maximum after each block is a cumulative max over block maxima, so
  every block's P and its cast are computed at once, and the α chain collapses to one factor
  exp(m_b − m_final) per block. One batched contraction replaces the per-block updates. It equals
  the scan implementation to FP32 rounding (the α products are rounded in a different order); the cast
  inputs, and so every zeroed P, are identical.

Scores are logits with the softmax scale already applied, shape ``(..., q_len, N)``; V is
``(..., N, d)``. Leading dimensions broadcast (vmap is the usual way to batch). A score of −inf, or
any value ≤ −2^127 (``finfo(float32).min`` included, :data:`pcast_jax.block.MASKED_BELOW`), is a
masked key: it contributes nothing, and a row with every key masked outputs 0 with ℓ = 0 and a
zeroed mass of 0, as the kernels do.

This module is the driver: each entry point (:func:`attention`, :func:`attention_qkv`,
:func:`weights_and_stats`) resolves a caller's config once (:func:`pcast_jax.presets.resolve`) and binds it
once (:func:`bound`); :func:`run`, :func:`run_qkv` and :func:`run_weights` take that bound config as it is
(a caller that resolved and bound its config already calls them), validate and pad the inputs and run one
of the two implementations (``pcast_jax.implementations``), naming their results and refusing a non-finite
output.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import block, formats, implementations
from pcast_jax.config import QKV_GRANULARITIES, BoundConfig, KernelConfig, Numbers
from pcast_jax.errors import PcastError, check_choice, check_int, check_positive
from pcast_jax.presets import resolve

__all__ = [
    "AttentionResult",
    "attention",
    "attention_qkv",
    "bound",
    "run",
    "run_qkv",
    "run_weights",
    "effective_weights",
    "weights_and_stats",
    "WeightsResult",
    "reference_attention",
    "reference_probs",
    "quantize_per_tensor",
    "quantize_qkv",
    "prepare_qkv",
    "round_scores",
    "IMPLEMENTATIONS",
    "Implementation",
    "check_implementation",
]

#: What computes :func:`attention`: ``"xla"`` (vectorized, the default) or ``"scan"`` (block by block).
Implementation = Literal["xla", "scan"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)


def check_implementation(value) -> str:
    """``value`` if it is one of :data:`IMPLEMENTATIONS`, else a :class:`PcastError` naming it."""
    check_choice("implementation", value, IMPLEMENTATIONS)
    return value


class AttentionResult(NamedTuple):
    """What the simulated kernel returns, per query row.

    Attributes:
      out: (q_len, d) kernel output O / (S ℓ) (or O / ℓ for the exponent and dynamic modes).
      row_sum: (q_len,) ℓ as the kernel holds it at the end (scaled in the exponent mode).
      n_zeroed: (q_len,) how many counted positions had P > 0 but cast to 0.
      n_counted: (q_len,) how many counted, unmasked positions there were.
      zeroed_mass: (q_len,) exact softmax probability carried by the zeroed positions.
      n_saturated: (q_len,) how many visible positions had P·S above the format's max (clipped by
        the cast; only a lagging running max or S > max gives any), over every visible key.
      n_visible: (q_len,) how many visible (unmasked) positions there were.
      saturated_mass: (q_len,) exact softmax probability carried by the saturated positions.
    """

    out: jax.Array
    row_sum: jax.Array
    n_zeroed: jax.Array
    n_counted: jax.Array
    zeroed_mass: jax.Array
    n_saturated: jax.Array
    n_visible: jax.Array
    saturated_mass: jax.Array


# --------------------------------------------------------------------------------------------
# Layout: pad N to a multiple of block_kv with masked keys; causal and count masks.
# --------------------------------------------------------------------------------------------


def _real_array(name: str, x, *, boolean: bool = False):
    """``x`` as float32; complex, boolean (unless ``boolean``), string and object inputs raise PcastError."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as exc:
            raise PcastError(f"{name} must be an array of real numbers ({exc})") from None
        dt = x.dtype
    dt = np.dtype(dt)
    if boolean and dt == np.bool_:
        return jnp.asarray(x, bool)
    if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise PcastError(f"{name}.dtype={dt} is not supported: must be a real floating-point or integer type")
    return jnp.asarray(x, jnp.float32)


def _concrete(*xs) -> bool:
    """True when no argument is traced (eager call): values can then be checked on the host."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _sink_rows(sink_logit, rows_shape):
    """A learned sink logit per row of ``rows_shape`` (``(..., q_len)``), or None.

    ``sink_logit`` is one logit per attention head (or instance): a scalar, or an array that
    broadcasts against the leading dimensions ``rows_shape[:-1]``; it is the same for every query row.
    """
    if sink_logit is None:
        return None
    s = _real_array("sink_logit", sink_logit)
    try:
        s = jnp.broadcast_to(s[..., None], tuple(rows_shape))
    except ValueError:
        raise PcastError(f"sink_logit.shape={s.shape} must broadcast against the leading (head) dimensions "
                         f"{tuple(rows_shape[:-1])} of the scores (one logit per head)") from None
    if _concrete(s) and not bool(jnp.all(jnp.isfinite(s))):
        raise PcastError("sink_logit contains NaN or inf: a learned sink logit must be finite")
    # Under jax.jit nothing can be refused: a non-finite sink makes its rows NaN in every config (an
    # inf sink would otherwise give 0 or NaN depending on where the kernel puts it).
    return jnp.where(jnp.isfinite(s), s, jnp.nan)


def _batch_shape(param: str, *shapes) -> tuple[int, ...]:
    try:
        return jnp.broadcast_shapes(*shapes)
    except ValueError:
        raise PcastError(f"{param}: leading (batch) dimensions {' vs '.join(map(str, shapes))} "
                         "do not broadcast") from None


def _prepare(scores, v, cfg: KernelConfig, count_mask, q_offset):
    scores = _real_array("scores", scores)
    v = _real_array("v", v)
    if scores.ndim < 2 or v.ndim < 2:
        raise PcastError(f"scores must be (..., q_len, N) and v (..., N, d); got {scores.shape} and {v.shape}")
    q_len, n = scores.shape[-2:]
    if v.shape[-2] != n:
        raise PcastError(f"v has {v.shape[-2]} keys but scores has N={n} (v.shape={v.shape})")
    if q_len == 0 or n == 0 or v.shape[-1] == 0:
        raise PcastError(f"empty attention: scores.shape={scores.shape}, v.shape={v.shape}")
    _batch_shape("scores and v", scores.shape[:-2], v.shape[:-2])
    if q_offset is not None and _concrete(q_offset):  # positions are int32: q_offset + q_len must fit
        q_offset = check_int("q_offset", q_offset, min_value=0, max_value=2**31 - 1 - q_len)
    valid = block.causal_mask(q_len, n, q_offset) if cfg.causal else jnp.ones((q_len, n), bool)
    if count_mask is None:
        counted = valid
    else:
        cm = _real_array("count_mask", count_mask, boolean=True).astype(bool)
        if cm.ndim < 1 or cm.shape[-1] != n:
            raise PcastError(f"count_mask.shape={cm.shape} must be (N,) = ({n},) (or (..., N))")
        _batch_shape("count_mask and scores", cm.shape[:-1], scores.shape[:-2])
        counted = valid & cm[..., None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    if _concrete(scores, v):  # eager call: refuse values that would silently give NaN
        if bool(jnp.any(jnp.isnan(scores) | (scores == jnp.inf))):
            raise PcastError("scores contain NaN or +inf: logits must be finite (-inf marks a masked key)")
        if not bool(jnp.all(jnp.isfinite(v))):
            raise PcastError("v contains NaN or inf: values must be finite")
    pad = (-n) % cfg.block_kv
    if pad:
        widths = [(0, 0)] * (scores.ndim - 1) + [(0, pad)]
        scores = jnp.pad(scores, widths, constant_values=-jnp.inf)
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, pad), (0, 0)])
        cw = [(0, 0)] * (counted.ndim - 1) + [(0, pad)]
        counted = jnp.pad(counted, cw, constant_values=False)
    counted = jnp.broadcast_to(counted, scores.shape)
    return scores, v, counted


class WeightsResult(NamedTuple):
    """The xla implementation's effective weights and per-row statistics (see :func:`weights_and_stats`).

    Attributes:
      weights: (..., q_len, N) W, the kernel output being W · V (FP32 accumulator).
      row_sum, n_zeroed, n_counted, zeroed_mass, n_saturated, n_visible, saturated_mass: as in
        :class:`AttentionResult`.
    """

    weights: jax.Array
    row_sum: jax.Array
    n_zeroed: jax.Array
    n_counted: jax.Array
    zeroed_mass: jax.Array
    n_saturated: jax.Array
    n_visible: jax.Array
    saturated_mass: jax.Array


def weights_and_stats(scores, config, *, count_mask=None, q_offset: int | None = None,
                      cast_fn=None, sink_logit=None) -> WeightsResult:
    """:func:`effective_weights` together with ℓ and the zeroed counts of :func:`attention`.

    Everything the xla implementation knows before the contraction with V: for an FP32 accumulator the
    output is ``weights @ v`` (equal to :func:`attention`'s to FP32 rounding), so several configs
    can share one matrix product with V (what :func:`pcast_jax.metrics.evaluate` does).
    """
    return run_weights(scores, bound(resolve(config)), count_mask=count_mask, q_offset=q_offset, cast_fn=cast_fn,
                       sink_logit=sink_logit)


def run_weights(scores, config: BoundConfig, *, count_mask=None, q_offset: int | None = None,
                cast_fn=None, sink_logit=None) -> WeightsResult:
    """:func:`weights_and_stats` for a config an entry point bound once (:func:`bound`), taken as it is."""
    cfg = implementations.require_bound(config, "engine.run_weights")
    n = jnp.shape(scores)[-1]
    scores, _, counted = _prepare(scores, jnp.zeros((n, 1)), cfg, count_mask, q_offset)
    sink = _sink_rows(sink_logit, scores.shape[:-1])
    return WeightsResult(*implementations.xla_weights(scores, counted, cfg, n, cast_fn, sink))


def effective_weights(scores, config, *, q_offset: int | None = None, cast_fn=None, sink_logit=None):
    """(..., q_len, N) weights W with kernel output = W · V when the accumulator is FP32.

    W = P8 · exp(m_b − m_final) / (S ℓ) per key (in key order, padding dropped). With V entries
    i.i.d. of variance σ_V², the expected per-dimension squared error given the scores is
    σ_V² Σ_j (W_j − P_j)² (P the exact softmax) — Prop. 3 / Eq. (8) with the quantization noise of
    the surviving P kept, and the collapse term Σ_{j∈Z} P_j² as the special case W_j = 0.
    """
    return weights_and_stats(scores, config, q_offset=q_offset, cast_fn=cast_fn, sink_logit=sink_logit).weights


def attention(
    scores,
    v,
    config: str | KernelConfig,
    *,
    implementation: str = "xla",
    count_mask=None,
    q_offset: int | None = None,
    sink_logit=None,
) -> AttentionResult:
    """Simulate the kernel's attention for precomputed scores.

    Args:
      scores: (..., q_len, N) float32 logits (softmax scale applied).
      v: (..., N, d) values as the kernel sees them (already dequantized if FP8).
      config: a preset name or :class:`KernelConfig`.
      implementation: ``"xla"`` (vectorized, the default) or ``"scan"`` (block by block, the
        reference); they agree to FP32 rounding.
      count_mask: optional (N,) bool, positions counted in ``n_zeroed``/``zeroed_mass``
        (e.g. the non-sink positions); all positions by default.
      q_offset: position of query row 0 for the causal mask (default N − q_len).
      sink_logit: optional learned sink logit s_L (gpt-oss ``sinks``), in the units of the scores:
        a scalar or one per head (broadcasting against ``scores.shape[:-2]``). It is a softmax column
        with no value row, placed as ``config.sink_mode`` says.
    """
    return run(scores, v, bound(resolve(config)), implementation=implementation, count_mask=count_mask,
               q_offset=q_offset, sink_logit=sink_logit)


def run(scores, v, config: BoundConfig, *, implementation: str = "xla", count_mask=None, q_offset: int | None = None,
        sink_logit=None) -> AttentionResult:
    """:func:`attention` for a config an entry point bound once (:func:`bound`), taken as it is: the engines
    never look a name up or bind numbers again."""
    cfg = implementations.require_bound(config, "engine.run")
    impl = check_implementation(implementation)
    scores, v, counted = _prepare(scores, v, cfg, count_mask, q_offset)
    sink = _sink_rows(sink_logit, scores.shape[:-1])
    # The never-promoted MMA accumulator model truncates O itself after every 32 keys, a chain through
    # every block that the xla implementation's one weighted sum cannot express: both engines run the scan.
    chained = cfg.mma_acc_bits and not cfg.mma_promote_keys
    fn = implementations.scan if impl == "scan" or chained else implementations.xla
    return _check_output(AttentionResult(*fn(scores, v, counted, cfg, sink)), v, cfg)


def bound(config: KernelConfig, *, causal: bool | None = None) -> BoundConfig:
    """A resolved config (:func:`pcast_jax.presets.resolve`) as the engines compute with it: its program
    bound to its numbers, as values the compiler cannot see through (a :class:`BoundConfig` as it is).
    ``causal`` sets the causal mask (a caller that masks the scores itself passes False).

    A config whose numbers are constants of the program then computes exactly what the same program
    computes with them as traced arguments (:meth:`KernelConfig.program`): XLA would otherwise fold
    and fuse the constants, changing the last bits. Called once per call, by the entry point, inside
    the program it runs in (the barrier is an operation of that program).
    """
    if isinstance(config, BoundConfig):
        return config if causal is None or causal == config.causal else config.replace(causal=causal)
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config={config!r}: engine.bound takes a resolved KernelConfig "
                        "(pcast_jax.presets.resolve resolves a preset name, once, at the entry point)")
    program = config.program()
    if causal is not None and causal != config.causal:
        program = dataclasses.replace(program, causal=causal)
    nums = Numbers(*jax.lax.optimization_barrier(tuple(jnp.float32(x) for x in config.numbers())))
    return program.bind(nums, name=config.name)


def _check_output(res: AttentionResult, v, cfg: KernelConfig) -> AttentionResult:
    """An eager call's result, or a PcastError saying why its output is not finite (never a silent inf).

    A config with ``overflow='nan'`` asks for NaN where P·S ≥ 464 (ml_dtypes' cast): only inf is refused there.
    """
    ok = ~jnp.isinf(res.out) if cfg.overflow == "nan" else jnp.isfinite(res.out)
    if not _concrete(res.out) or bool(jnp.all(ok)):
        return res
    acc = "f16" if cfg.accumulator == "f16" else "float32"
    raise PcastError(f"v (max |v| = {float(jnp.max(jnp.abs(v))):.3g}) gives a non-finite output for "
                     f"config={cfg.name!r}: the accumulator of P*V ({acc}) overflowed; scale v down "
                     "(the output is linear in v)")


def reference_probs(scores, *, causal: bool = False, q_offset: int | None = None, sink_logit=None):
    """Exact FP32 softmax of the scores (the reference's P / ℓ).

    With a learned ``sink_logit`` (as in :func:`attention`) the softmax runs over [s_L, scores] and
    the sink's column is dropped: each row then sums to 1 − (the sink's share).
    """
    scores = jnp.asarray(scores, jnp.float32)
    if causal:
        scores = jnp.where(block.causal_mask(*scores.shape[-2:], q_offset), scores, -jnp.inf)
    sink = _sink_rows(sink_logit, scores.shape[:-1])
    if sink is None:
        return jax.nn.softmax(scores, axis=-1)
    m = jnp.maximum(jnp.max(scores, axis=-1), sink)
    e = jnp.exp(scores - m[..., None])
    return e / (jnp.exp(sink - m) + jnp.sum(e, axis=-1))[..., None]


def reference_attention(scores, v, *, causal: bool = False, q_offset: int | None = None, sink_logit=None):
    """FP32 softmax attention, the reference every MSE is measured against."""
    p = reference_probs(scores, causal=causal, q_offset=q_offset, sink_logit=sink_logit)
    return jnp.einsum("...qn,...nd->...qd", p, jnp.asarray(v, jnp.float32), precision=jax.lax.Precision.HIGHEST)


# --------------------------------------------------------------------------------------------
# Q/K/V inputs
# --------------------------------------------------------------------------------------------


def quantize_per_tensor(x, fmt="e4m3"):
    """Per-tensor FP8 quantization as production kernels do: scale = amax / max_fmt.

    Returns ``(x8, descale)`` with x8 the FP8-rounded values (float32 storage) of x / descale.
    An all-zero tensor gets descale 1.
    """
    f = formats.get_format(fmt)
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x))
    descale = jnp.where(amax > 0, amax / f.max, 1.0).astype(jnp.float32)
    return formats.cast(x / descale, f, overflow="satfinite"), descale


def quantize_qkv(x, granularity: str = "tensor"):
    """E4M3 round trip of Q, K or V (..., len, d): one scale per tensor, or per leading index.

    ``granularity`` is ``KernelConfig.qkv_granularity``: ``"tensor"`` (:func:`quantize_per_tensor`)
    or ``"head"`` (one scale per index of the leading dims, i.e. per (batch, head) of a
    (batch, heads, len, d) array). Returns ``(x8, descale)``, descale shaped to broadcast against
    x: (1, …, 1) or (..., 1, 1).
    """
    check_choice("granularity", granularity, QKV_GRANULARITIES)
    if granularity == "tensor":
        x8, d = quantize_per_tensor(x)
        return x8, jnp.reshape(d, (1,) * x.ndim)
    lead = x.shape[:-2]
    x8, d = jax.vmap(quantize_per_tensor)(x.reshape((-1,) + x.shape[-2:]))
    return x8.reshape(x.shape), d.reshape(lead + (1, 1))


def round_scores(scores):
    """The scaled logits rounded to float32 once, behind a barrier, as the kernel's registers hold them.

    Without it XLA:CPU may contract the scale multiply into a consumer's subtraction (one FMA), so
    within one jitted program Z − m is not 0 for a row's maximum and its P not exactly exp(0) = 1:
    the result then depends on what else the program holds (an MXFP8 block whose maximum P becomes
    1 − 2^-21 takes half the scale and saturates at 448·2^-9 = 0.875).
    """
    return jax.lax.optimization_barrier(scores)


def prepare_qkv(q, k, v, config, *, scale: float | None = None):
    """Scores and V as the kernel sees them for Q (..., q_len, d), K and V (..., N, d).

    With ``config.qkv == "e4m3"`` Q, K, V are quantized to E4M3 (:func:`quantize_qkv`, one scale
    per tensor, or per leading index with ``qkv_granularity="head"``); the scores are the FP8×FP8
    products accumulated in FP32 times q_descale·k_descale·scale, and V is the dequantized
    FP8 value (its descale applied to the values, which equals applying it to the output).
    ``scale`` is the logit scale (default 1/√d), as in :func:`jax.nn.dot_product_attention`.
    """
    return _prepare_qkv(q, k, v, resolve(config), scale)


def _prepare_qkv(q, k, v, cfg: KernelConfig, scale):
    """:func:`prepare_qkv` for a resolved config (only its Q/K/V fields are read: bound or not)."""
    q, k, v = (_real_array(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise PcastError(f"q, k, v must be (..., len, d); got q.shape={q.shape}, k.shape={k.shape}, "
                         f"v.shape={v.shape}")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise PcastError(f"empty q, k or v: q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}")
    _batch_shape("q, k and v", q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if scale is not None:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise PcastError(f"scale={scale!r} must be a real number > 0") from None
        check_positive("scale", scale)
    if q.shape[-1] != k.shape[-1]:
        raise PcastError(f"q and k head dims differ: q.shape={q.shape}, k.shape={k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise PcastError(f"k and v lengths differ: k.shape={k.shape}, v.shape={v.shape}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if cfg.qkv == "e4m3":
        (q8, dq), (k8, dk), (v8, dv) = (quantize_qkv(x, cfg.qkv_granularity) for x in (q, k, v))
        s = jnp.einsum("...qd,...nd->...qn", q8, k8, precision=jax.lax.Precision.HIGHEST)
        return round_scores(s * (dq * dk * scale)), v8 * dv
    s = jnp.einsum("...qd,...nd->...qn", q, k, precision=jax.lax.Precision.HIGHEST)
    return round_scores(s * scale), v


def attention_qkv(q, k, v, config, *, scale=None, implementation: str = "xla", count_mask=None,
                  q_offset=None, sink_logit=None) -> AttentionResult:
    """:func:`attention` from Q, K, V (see :func:`prepare_qkv` for the FP8 Q/K/V path)."""
    return run_qkv(q, k, v, bound(resolve(config)), scale=scale, implementation=implementation,
                   count_mask=count_mask, q_offset=q_offset, sink_logit=sink_logit)


def run_qkv(q, k, v, config: BoundConfig, *, scale=None, implementation: str = "xla", count_mask=None,
            q_offset=None, sink_logit=None) -> AttentionResult:
    """:func:`attention_qkv` for a config an entry point bound once (:func:`bound`), taken as it is."""
    cfg = implementations.require_bound(config, "engine.run_qkv")
    scores, v_seen = _prepare_qkv(q, k, v, cfg, scale)
    return run(scores, v_seen, cfg, implementation=check_implementation(implementation),
               count_mask=count_mask, q_offset=q_offset, sink_logit=sink_logit)
