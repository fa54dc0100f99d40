"""The public entry point :func:`fp8_attention`, its validation, and the matching simulator run.

``fp8_attention`` checks every input (a :class:`~pcast_jax.errors.PcastError` names the bad
parameter), folds q_descale·k_descale·softmax_scale into one FP32 scalar and v_descale into the
per-channel V factors (:func:`v_channel_factors`, computed here, outside the attention loop),
dispatches to the Mosaic GPU kernel (Hopper) or the Triton kernel, and merges split-KV partial
results. :func:`simulate_fp8_attention` runs
``pcast_jax.engine.attention`` on exactly the scores and V the kernel sees, so the two can be
compared value for value.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mosaic_gpu, tiling, triton_gpu
from pcast_jax import block
from pcast_jax import engine as _engine
from pcast_jax.config import KernelConfig
from pcast_jax.engine import check_implementation
from pcast_jax.errors import PcastError, check_choice, check_int, check_positive
from pcast_jax.presets import resolve

__all__ = [
    "BACKENDS",
    "KernelStats",
    "fp8_attention",
    "kv_tile",
    "quantize_fp8",
    "quantize_qkv",
    "simulate_fp8_attention",
    "v_channel_factors",
]

BACKENDS = ("mosaic", "triton")
#: Each backend's module: it owns its limits (``check_limits``) and its kernel.
_KERNELS = {"mosaic": mosaic_gpu, "triton": triton_gpu}
_F8 = jnp.dtype(jnp.float8_e4m3fn)
#: Widest KV tile either backend runs (the wgmma N of Q·Kᵀ; Triton's largest tile so far).
MAX_KV_TILE = 256


class KernelStats(NamedTuple):
    """Per-row statistics a kernel returns next to its output (shapes (batch, heads, q_len)).

    Attributes:
      row_sum: ℓ at the end of the KV loop (holds S in the exponent mode, like the simulator's);
        with split-KV the merged Σ_s exp(m_s − m)·ℓ_s of :func:`pcast_jax.block.merge_splits`.
      n_zeroed: how many P were > 0 before the E4M3 cast and 0 after it (unmasked keys, all splits).
    """

    row_sum: jax.Array
    n_zeroed: jax.Array


# --------------------------------------------------------------------------------------------
# Quantization helpers
# --------------------------------------------------------------------------------------------


def quantize_fp8(x):
    """Per-tensor E4M3 quantization exactly as ``pcast_jax.engine.quantize_per_tensor``.

    Returns ``(x8, descale)``: x8 in float8_e4m3fn with x ≈ x8 · descale, descale = amax / 448
    (1 for an all-zero tensor).
    """
    x8, descale = _engine.quantize_per_tensor(x, "e4m3")
    return x8.astype(jnp.float8_e4m3fn), descale


def quantize_qkv(q, k, v):
    """Quantize Q, K, V per tensor; returns ``(q8, k8, v8, descales)``.

    ``descales`` is a dict with ``q_descale``, ``k_descale``, ``v_descale``, ready to be passed as
    ``fp8_attention(q8, k8, v8, config=..., **descales)``.

    Raises:
      PcastError: a concrete input holds NaN or ±inf (its descale would be NaN or inf).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_finite_input(name, x)
    q8, dq = quantize_fp8(q)
    k8, dk = quantize_fp8(k)
    v8, dv = quantize_fp8(v)
    return q8, k8, v8, {"q_descale": dq, "k_descale": dk, "v_descale": dv}


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def kv_tile(backend: str, block_kv: int) -> int:
    """Keys of the MMA tile with which ``backend`` computes a KV block of ``block_kv`` keys.

    Any block_kv up to the widest tile runs: the kernel masks the tile's keys past the block (see
    :mod:`pallas_kernels.tiling`), so m and α still update once per ``block_kv`` keys.
    """
    check_choice("backend", backend, BACKENDS)
    check_int("block_kv", block_kv, min_value=1)
    return tiling.kv_tile(backend, block_kv)


def _check_array(name: str, x, ndim: int):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise PcastError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(dtype) != _F8:
        raise PcastError(
            f"{name}.dtype={jnp.dtype(dtype).name} is not supported: must be float8_e4m3fn "
            "(quantize with pallas_kernels.quantize_qkv)"
        )
    if len(shape) != ndim:
        raise PcastError(f"{name}.shape={tuple(shape)} must have {ndim} dimensions")


def _check_descale(name: str, value):
    """A descale: a number or 0-d array, finite in float32 and > 0.

    Concrete arrays (what :func:`quantize_qkv` returns) are checked eagerly, like numbers; traced
    values (inside ``jit``/``grad``) cannot be read without a host sync and pass unchecked.
    """
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return check_positive(name, value, float32=True)
    if isinstance(value, (bool, np.bool_)) or jnp.ndim(value) != 0:
        raise PcastError(f"{name}={value!r} must be a positive scalar (float or 0-d array)")
    if isinstance(value, jax.core.Tracer):
        return value  # unchecked: see the docstring
    arr = np.asarray(value)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise PcastError(f"{name} (array of dtype {arr.dtype}) must be a positive number")
    check_positive(name, float(arr), float32=True)
    return value


def _check_finite_input(name: str, x) -> None:
    """Refuse a concrete array holding NaN or ±inf (traced arrays pass unchecked)."""
    if isinstance(x, jax.core.Tracer):
        return
    try:
        ok = bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32))))
    except (TypeError, ValueError):
        raise PcastError(f"{name} must be an array of real numbers") from None
    if not ok:
        raise PcastError(f"{name} holds NaN or inf (or values beyond float32's range); "
                         "FP8 quantization needs finite input")


def _validate(q, k, v, cfg: KernelConfig, backend: str, softmax_scale, num_slots: int, v_transposed: bool):
    """All checks; returns the head dim and N. Raises PcastError naming the parameter."""
    check_choice("implementation", backend, BACKENDS)
    _check_array("q", q, 4)
    _check_array("k", k, 4)
    _check_array("v", v, 4)
    batch, heads, q_len, head_dim = q.shape
    kb, kv_heads, n_kv, kd = k.shape
    v_expected = (kb, kv_heads, kd, n_kv) if v_transposed else tuple(k.shape)
    if tuple(v.shape) != v_expected:
        layout = "(batch, kv_heads, d, N) with v_transposed=True" if v_transposed else "k.shape"
        raise PcastError(f"v.shape={tuple(v.shape)} must equal {v_expected} ({layout})")
    if kb != batch:
        raise PcastError(f"k.shape={tuple(k.shape)} has batch {kb} but q.shape={tuple(q.shape)} has {batch}")
    if kd != head_dim:
        raise PcastError(f"k.shape={tuple(k.shape)} has head dim {kd} but q has {head_dim}")
    if heads % kv_heads:
        raise PcastError(f"q heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups)")
    if softmax_scale is not None:
        check_positive("scale", softmax_scale)

    # P-cast semantics the simulator models but the kernels do not run: refused, never ignored (each field
    # declares which kernels refuse it: KernelConfig.refusal)
    why = cfg.refusal(backend)
    if why is not None:
        raise PcastError(why)
    if cfg.causal and q_len > n_kv:
        raise PcastError(f"q_len={q_len} must be <= N={n_kv} with causal=True (bottom-right aligned)")

    block_kv = cfg.block_kv
    tile = tiling.kv_tile(backend, block_kv)
    if tile > MAX_KV_TILE:
        raise PcastError(f"block_kv={block_kv} not supported by the {backend} backend: it needs a {tile}-key tile, "
                         f"the widest it runs is {MAX_KV_TILE} keys")
    _KERNELS[backend].check_limits(cfg, q_len=q_len, head_dim=head_dim, n_kv=n_kv, num_slots=num_slots)
    return head_dim, n_kv


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def v_channel_factors(v_t, v_descale, cfg: KernelConfig):
    """Per-channel V factors, ``(batch, kv_heads, 2, d)`` float32, that both kernels read.

    Row 0 multiplies each FP8 product P8·V8 before the accumulator takes it, row 1 the output:

    * FP32 accumulator: 1 and v_descale (the descale applied after the epilogue, as before);
    * f16 accumulator: the f16 rounding acts on P8·V as the simulator sees V (V8·v_descale), and with
      ``v_channel_max`` on P8·(V/c), c = :func:`pcast_jax.block.v_channel_scale` of V8·v_descale:
      row 0 is v_descale / c and row 1 is c (v_descale and 1 without a channel scale).

    c needs the maximum of each channel over the whole KV length, which one KV block does not see:
    it is computed here, from the V the kernel is given, before the attention loop (SageAttention2++
    likewise quantizes V per channel outside its attention kernel, ``quant_v_scale_max = 2.25`` in
    ``sageattention/core.py``). The kernel applies the factor to the FP8 product rather than to V
    (V/c is not an FP8 value); this equals P8·(V/c) up to FP32 rounding before the f16 rounding.
    """
    f32 = jnp.float32
    vd = jnp.asarray(v_descale, f32)
    ones = jnp.ones(v_t.shape[:2] + v_t.shape[2:3], f32)  # (batch, kv_heads, d)
    if cfg.accumulator != "f16":
        return jnp.stack([ones, ones * vd], axis=-2)
    c = block.v_channel_scale(jnp.swapaxes(v_t, -1, -2).astype(f32) * vd, cfg)
    if c is None:
        return jnp.stack([ones * vd, ones], axis=-2)
    return jnp.stack([vd / c, c], axis=-2)


def _check_sinks(sinks, heads: int):
    """``(heads,)`` float32 learned sink logits, or None; PcastError naming ``sinks`` otherwise."""
    if sinks is None:
        return None
    arr = jnp.asarray(sinks)
    if arr.shape != (heads,) or not jnp.issubdtype(arr.dtype, jnp.floating):
        raise PcastError(f"sinks must be a floating-point array of shape (heads,) = ({heads},), one learned sink "
                         f"logit per query head; got {arr.dtype} {arr.shape}")
    if not isinstance(arr, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(arr))):
        raise PcastError("sinks contains NaN or inf: learned sink logits must be finite")
    # traced (under jax.jit): a non-finite sink makes its head's rows NaN, as in the simulator
    return jnp.where(jnp.isfinite(arr), arr, jnp.nan).astype(jnp.float32)


@functools.partial(
    jax.jit, static_argnames=("config", "backend", "interpret", "softmax_scale", "num_slots", "v_transposed")
)
def _run(q, k, v, q_descale, k_descale, v_descale, sinks, *, config, backend, interpret, softmax_scale, num_slots,
         v_transposed):
    f32 = jnp.float32
    score_scale = jnp.asarray(q_descale, f32) * jnp.asarray(k_descale, f32) * softmax_scale
    params = jnp.stack([score_scale, f32(0), f32(0), f32(0)])
    v_t = v if v_transposed else jnp.swapaxes(v, -1, -2)
    v_factors = v_channel_factors(v_t, v_descale, config)
    n_keys = k.shape[2]
    schedule = jnp.asarray(block.split_schedule(tiling.n_blocks(n_keys, config.block_kv), config))
    # zero keys after N so that every tile the kernel reads is in bounds (they are masked there)
    pad = tiling.padded_keys(n_keys, config.block_kv, tiling.kv_tile(backend, config.block_kv)) - n_keys
    if pad:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v_t = jnp.pad(v_t, ((0, 0), (0, 0), (0, 0), (0, pad)))
    if backend == "mosaic":
        o, m, row_sum, n_zeroed = mosaic_gpu.mosaic_attention(
            q, k, v_t, v_factors, schedule, params, config=config, n_keys=n_keys, num_slots=num_slots,
            interpret=interpret, sinks=sinks,
        )
    else:
        o, m, row_sum, n_zeroed = triton_gpu.triton_attention(
            q, k, v_t, v_factors, schedule, params, config=config, n_keys=n_keys, interpret=interpret, sinks=sinks
        )
    n_zeroed = jnp.sum(n_zeroed, axis=0).astype(jnp.int32)
    if config.kv_splits == 1:  # the kernel finalised its one run
        return o[0], KernelStats(row_sum[0], n_zeroed)
    # split-KV: line 12 per split and the FP32 log-sum-exp merge (a learned sink enters it once), then
    # the V descale per channel
    sink_rows = None if sinks is None else jnp.broadcast_to(sinks[None, :, None], m.shape[1:])
    out, row_sum, _ = block.merge_splits(m, row_sum, o, config, sink=sink_rows)
    out_factor = jnp.repeat(v_factors[:, :, 1], q.shape[1] // k.shape[1], axis=1)[:, :, None, :]
    return out * out_factor, KernelStats(row_sum, n_zeroed)


def fp8_attention(
    q,
    k,
    v,
    *,
    config: str | KernelConfig,
    implementation: str = "mosaic",
    interpret: bool = False,
    scale: float | None = None,
    q_descale=1.0,
    k_descale=1.0,
    v_descale=1.0,
    return_stats: bool = False,
    v_transposed: bool = False,
    num_slots: int = 2,
    sinks=None,
):
    """FP8 attention forward whose P-cast follows ``config`` (Algorithm 1 of the paper).

    Output = softmax(Q·Kᵀ · q_descale·k_descale·scale) · V · v_descale, computed block by
    block in the config's KV order with P cast to E4M3 after scaling by S (``scale_mode``
    "multiply", "exponent" or "dynamic"; an f16 P·V accumulator if ``config.accumulator`` says so).

    Args:
      q: (batch, heads, q_len, d) float8_e4m3fn.
      k: (batch, kv_heads, N, d) float8_e4m3fn; heads must be a multiple of kv_heads (GQA).
      v: like k, or (batch, kv_heads, d, N) with ``v_transposed=True`` (the layout both kernels
        read; otherwise it is transposed here).
      config: preset name or :class:`~pcast_jax.config.KernelConfig`. Any ``block_kv`` whose tile
        (:func:`kv_tile`) is at most 256 keys, e.g. FlashAttention-3's 224 and 160 or FlashInfer's
        192: the running max and α update once per ``block_kv`` keys, as in the simulator; N need
        not be a multiple of it (the last block is padded with masked keys). An f16 accumulator
        rounds every ``f16_round_keys`` keys (0 or a multiple of 32; a power of two with Triton)
        and scales V per channel with
        ``v_channel_max`` (:func:`v_channel_factors`). Split-KV (``kv_splits > 1``, either
        ``split_layout``) runs one program per split over the blocks of
        :func:`pcast_jax.block.split_schedule`; the per-split O, m and ℓ are merged here by
        :func:`pcast_jax.block.merge_splits` (the combine step of flash-decoding).
      implementation: ``"mosaic"`` (Pallas Mosaic GPU, Hopper wgmma + TMA) or ``"triton"``.
      interpret: run the kernel in Pallas interpret mode (works on CPU).
      scale: the logit scale, 1/√d by default, as in :func:`jax.nn.dot_product_attention`.
      q_descale, k_descale, v_descale: per-tensor dequantization scales (floats or 0-d arrays).
      return_stats: also return :class:`KernelStats` (ℓ and the per-row count of zeroed P).
      v_transposed: v is already (batch, kv_heads, d, N).
      num_slots: K/V shared-memory slots in the Mosaic GPU TMA ring (2–8).
      sinks: optional learned sink logits (gpt-oss ``sinks``), ``(heads,)``: one per query head, in
        the units of the scaled logits, placed as ``config.sink_mode`` says (the initial running max
        of split 0, every block's max, or the final denominator; :mod:`pcast_jax.block`).

    Returns:
      out (batch, heads, q_len, d) float32, or ``(out, KernelStats)`` with ``return_stats``.
    """
    cfg = resolve(config)
    backend, softmax_scale = implementation, scale
    if not isinstance(interpret, bool):
        raise PcastError(f"interpret={interpret!r} must be True or False")
    head_dim, _ = _validate(q, k, v, cfg, backend, softmax_scale, num_slots, v_transposed)
    q_descale = _check_descale("q_descale", q_descale)
    k_descale = _check_descale("k_descale", k_descale)
    v_descale = _check_descale("v_descale", v_descale)
    if not interpret and not isinstance(q, jax.core.Tracer) and jax.default_backend() != "gpu":
        raise PcastError(
            f"implementation={backend!r} without interpret needs a CUDA GPU (default backend is "
            f"{jax.default_backend()!r}); pass interpret=True to run the kernel on CPU"
        )
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    sink_arr = _check_sinks(sinks, q.shape[1])
    out, stats = _run(
        q, k, v, q_descale, k_descale, v_descale, sink_arr,
        config=cfg, backend=backend, interpret=interpret, softmax_scale=scale,
        num_slots=num_slots, v_transposed=v_transposed,
    )
    return (out, stats) if return_stats else out


# --------------------------------------------------------------------------------------------
# The simulator on the same inputs
# --------------------------------------------------------------------------------------------


def simulate_fp8_attention(
    q,
    k,
    v,
    *,
    config: str | KernelConfig,
    scale: float | None = None,
    q_descale=1.0,
    k_descale=1.0,
    v_descale=1.0,
    implementation: str = "scan",
    count_mask=None,
    sinks=None,
) -> _engine.AttentionResult:
    """``pcast_jax.engine.attention`` on the scores and V an FP8 kernel sees (no kernel involved).

    Scores = (Q8 · K8ᵀ in FP32) · (q_descale·k_descale·scale) and V = V8 · v_descale, the
    same path as ``pcast_jax.engine.prepare_qkv`` for ``qkv="e4m3"``; K/V heads are repeated for GQA. Arrays
    in the result carry the (batch, heads) leading dimensions. ``implementation``: the simulator's,
    ``"scan"`` (default, block by block like the kernel) or ``"xla"``.
    """
    cfg = resolve(config)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _simulate(
        q, k, v, q_descale, k_descale, v_descale, count_mask, _check_sinks(sinks, q.shape[1]),
        config=cfg, softmax_scale=scale, implementation=check_implementation(implementation),
    )


@functools.partial(jax.jit, static_argnames=("config", "softmax_scale", "implementation"))
def _simulate(q, k, v, q_descale, k_descale, v_descale, count_mask, sinks, *, config, softmax_scale,
              implementation):
    q, k, v = (jnp.asarray(a).astype(jnp.float32) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    f32 = jnp.float32
    score_scale = jnp.asarray(q_descale, f32) * jnp.asarray(k_descale, f32) * softmax_scale
    scores = jnp.einsum("bhqd,bhnd->bhqn", q, k, precision=jax.lax.Precision.HIGHEST) * score_scale
    v_seen = v * jnp.asarray(v_descale, f32)
    sink_logit = None if sinks is None else jnp.broadcast_to(sinks, scores.shape[:2])
    return _engine.attention(scores, v_seen, config, implementation=implementation, count_mask=count_mask,
                             sink_logit=sink_logit)
