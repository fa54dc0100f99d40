"""``dot_product_attention`` with ``jax.nn.dot_product_attention``'s conventions, through the kernel.

A drop-in for a model's attention: the same arguments as ``jax.nn.dot_product_attention`` (and
tokamax's ``implementation=`` selector), plus ``config``, the FP8 kernel whose P-cast to simulate::

    out = pcast_jax.dot_product_attention(q, k, v, mask=mask, is_causal=True, config="fa3")

* Layouts: ``query`` ``(B, T, N, H)`` or ``(T, N, H)``; ``key`` and ``value`` ``(B, S, K, H)`` or
  ``(S, K, H)`` with ``N`` a multiple of ``K`` (grouped-query attention: query head ``n`` reads
  KV head ``n // (N / K)``). The output has the query's shape and dtype.
* ``bias`` is added to the logits and ``mask`` (boolean, True = attend) removes keys; both
  broadcast to ``(B, N, T, S)``. Masked logits become the most negative float32, as in
  ``jax.nn``: a row with every key masked averages V uniformly instead of producing NaN.
* ``is_causal``: query ``i`` sees keys ``≤ S − T + i`` (bottom-right aligned, as FlashAttention
  and the simulated kernels do; for ``T == S`` this is ``jax.nn``'s mask). A config with
  ``causal=True`` is causal too.
* ``config=None`` is exact FP32 attention (equal to ``jax.nn.dot_product_attention`` to FP32
  rounding); a preset name or :class:`~pcast_jax.config.KernelConfig` runs the simulated kernel
  per head: its KV order, block size, scale S and mode, cast, accumulator, and (``qkv="e4m3"``) E4M3
  Q/K/V with one scale per tensor or per head.
* ``implementation``: ``"xla"`` (default: the fast engine, vectorized), ``"scan"`` (the
  block-by-block reference engine), or a Pallas FP8 kernel, ``"mosaic"`` (Hopper) or ``"triton"``
  (run in interpret mode when no GPU is present). The kernels take E4M3 Q/K/V (quantized here per
  tensor) and accept neither ``bias`` nor ``mask``.

Gradients (``gradient=``). The cast of P is piecewise constant, so its own derivative is useless;
the forward value is always the kernel's, and the backward pass is one of:

* ``"ste"`` (default) — straight-through: the gradient of exact FP32 attention on the same inputs
  (every cast of P and of Q/K/V treated as the identity).
* ``"smooth"`` — the gradient of a smooth surrogate of the kernel: its block order, running max
  and scale S kept, each cast replaced by the soft underflow gate P·σ((ln(P·S) − ln r)/τ), r the
  format's round-to-zero boundary (2^-10 for E4M3, Prop. 1) and τ = ``smooth_temperature``. It sees
  P-collapse: a logit whose P the kernel zeroes gets (almost) no gradient through the values.
  A block-scaled P (MXFP8, MXFP4, NVFP4) is gated per scale block instead: at the element boundary
  under the block's scale (its largest P·S over the element format's max) and, for NVFP4, at the
  block scale's own underflow (UE4M3), which zeroes the whole block.
  Needs a static scale (not ``"dynamic"``); Q/K/V casts are straight-through.

jit, vmap and grad compose with it; the implementation and gradient choices are static.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import block, engine
from pcast_jax.config import KernelConfig, resolve
from pcast_jax.errors import PcastError, check_choice, check_positive

__all__ = ["IMPLEMENTATIONS", "GRADIENTS", "attention_fn", "dot_product_attention", "kernel_inputs"]

IMPLEMENTATIONS = ("xla", "scan", "mosaic", "triton")
GRADIENTS = ("ste", "smooth")
_KERNELS = ("mosaic", "triton")
_MASKED = float(np.finfo(np.float32).min)  # what jax.nn puts in masked logits


def _check_inputs(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        dt = getattr(x, "dtype", None)
        if dt is None or not jnp.issubdtype(dt, jnp.floating):
            raise PcastError(f"{name} must be a floating-point array, got {getattr(dt, 'name', type(x).__name__)}")
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise PcastError(f"query, key and value must all be (B, T, N, H) or all (T, N, H); got query.shape="
                         f"{query.shape}, key.shape={key.shape}, value.shape={value.shape}")
    if key.shape != value.shape:
        raise PcastError(f"key.shape={key.shape} and value.shape={value.shape} must be equal")
    if query.shape[-1] != key.shape[-1]:
        raise PcastError(f"head dims differ: query.shape={query.shape}, key.shape={key.shape}")
    if query.ndim == 4 and query.shape[0] != key.shape[0]:
        raise PcastError(f"batch sizes differ: query.shape={query.shape}, key.shape={key.shape}")
    n, k = query.shape[-2], key.shape[-2]
    if n % k:
        raise PcastError(f"query heads N={n} must be a multiple of key/value heads K={k} (grouped-query attention)")
    if 0 in query.shape or 0 in key.shape:
        raise PcastError(f"empty attention: query.shape={query.shape}, key.shape={key.shape}")


def _as_bnth(x):
    """(B, T, N, H) → (B, N, T, H) in float32."""
    return jnp.swapaxes(jnp.asarray(x, jnp.float32), 1, 2)


def _broadcast_4d(name: str, x, shape, dtype):
    x = jnp.asarray(x, dtype)
    try:
        return jnp.broadcast_to(x, shape)
    except ValueError:
        raise PcastError(f"{name}.shape={x.shape} does not broadcast to (B, N, T, S) = {shape}") from None


def _repeat_kv(x, n_heads: int):
    return jnp.repeat(x, n_heads // x.shape[1], axis=1)


def kernel_inputs(q, k, v, cfg: KernelConfig | None, scale: float):
    """Logits (B, N, T, S) and V (B, N, S, H) as the kernel sees them, for Q (B, N, T, H) and K, V (B, K, S, H).

    E4M3 Q/K/V when ``cfg.qkv == "e4m3"`` (one scale per tensor or per (batch, head)); KV heads are
    repeated for grouped-query attention.
    """
    n_heads = q.shape[1]
    if cfg is not None and cfg.qkv == "e4m3":
        (q, dq), (k, dk), (v, dv) = (engine.quantize_qkv(x, cfg.qkv_granularity) for x in (q, k, v))
        dk, dv = (_repeat_kv(jnp.broadcast_to(d, (d.shape[0], x.shape[1], 1, 1)), n_heads) for d, x in
                  ((dk, k), (dv, v)))
        logits = jnp.einsum("bnth,bnsh->bnts", q, _repeat_kv(k, n_heads), precision="highest")
        return logits * (dq * dk * scale), _repeat_kv(v, n_heads) * dv
    logits = jnp.einsum("bnth,bnsh->bnts", q, _repeat_kv(k, n_heads), precision="highest")
    return logits * scale, _repeat_kv(v, n_heads)


def _masked(logits, bias, mask, causal: bool):
    if bias is not None:
        logits = logits + bias
    t, s = logits.shape[-2:]
    valid = mask
    if causal:
        c = block.causal_mask(t, s)
        valid = c if valid is None else valid & c
    return logits if valid is None else jnp.where(valid, logits, _MASKED)


def _exact(q, k, v, bias, mask, scale, causal):
    """Exact FP32 attention (B, N, T, H): the reference, and the straight-through backward."""
    logits, vv = kernel_inputs(q, k, v, None, scale)
    probs = jax.nn.softmax(_masked(logits, bias, mask, causal), axis=-1)
    return jnp.einsum("bnts,bnsh->bnth", probs, vv, precision="highest")


def _simulated(q, k, v, bias, mask, cfg: KernelConfig, scale, engine_name: str):
    logits, vv = kernel_inputs(q, k, v, cfg, scale)
    logits = _masked(logits, bias, mask, cfg.causal)
    return engine.attention(logits, vv, cfg.replace(causal=False), engine=engine_name).out


def _soft_gate_cast(scale: float, threshold: float, temperature: float):
    """P → P·σ((ln(P·S) − ln r)/τ): the cast's underflow as a smooth gate (rounding as identity)."""

    def cast_fn(p):
        x = p * scale
        pos = x > 0
        safe = jnp.where(pos, x, 1.0)
        gate = jax.nn.sigmoid((jnp.log(safe) - math.log(threshold)) / temperature)
        return jnp.where(pos, p * gate, 0.0)

    return cast_fn


def _soft_block_gate_cast(scale: float, bf, temperature: float):
    """P → P·g per scale block of a block-scaled format (rounding as identity).

    x = P·S; a = the largest x of its block of ``bf.block`` keys, the block scale taken as
    a / max_e without its rounding (max_e the element format's largest value). The element gate
    σ((ln x − ln(r_e·a/max_e))/τ) sits at the element's round-to-zero boundary r_e under that scale
    (x ≤ a/24 for NVFP4; for MX the power-of-two scale puts it within a factor 2 of r_e·a/max_e),
    and for NVFP4 the block-scale gate σ((ln(a/6) − ln r_s)/τ) at UE4M3's round-to-zero boundary
    r_s = 2^-10 zeroes a whole block (an E8M0 scale has no zero).
    """
    el = bf.element
    log_elem = math.log(el.round_to_zero / el.max)
    log_scale_zero = None if bf.is_mx else math.log(float(bf.scale_fmt.round_to_zero))

    def cast_fn(p):
        x = p * scale
        xb = x.reshape(x.shape[:-1] + (x.shape[-1] // bf.block, bf.block))
        a = jnp.max(xb, axis=-1, keepdims=True)
        pos = xb > 0
        safe = jnp.where(pos, xb, 1.0)
        log_a = jnp.log(jnp.where(a > 0, a, 1.0))
        gate = jax.nn.sigmoid((jnp.log(safe) - log_a - log_elem) / temperature)
        if log_scale_zero is not None:
            gate = gate * jax.nn.sigmoid((log_a - math.log(el.max) - log_scale_zero) / temperature)
        return jnp.where(pos, xb / scale * gate, 0.0).reshape(p.shape)

    return cast_fn


def _smooth(q, k, v, bias, mask, cfg: KernelConfig, scale, temperature: float):
    """The smooth surrogate's output (B, N, T, H): effective weights with the gated cast, times V."""
    logits, vv = kernel_inputs(q, k, v, None, scale)  # Q/K/V casts straight-through
    logits = _masked(logits, bias, mask, cfg.causal)
    bf = cfg.block_format
    if bf is not None:
        gate = _soft_block_gate_cast(cfg.scale, bf, temperature)
    else:
        gate = _soft_gate_cast(cfg.scale, cfg.fmt.round_to_zero, temperature)
    static = cfg.replace(scale=1.0, scale_mode="multiply", causal=False, qkv="f32", accumulator="f32")
    w = engine.effective_weights(logits, static, cast_fn=gate)
    return jnp.einsum("bnts,bnsh->bnth", w, vv, precision="highest")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attend(q, k, v, bias, mask, cfg, scale, engine_name, gradient, temperature):
    return _simulated(q, k, v, bias, mask, cfg, scale, engine_name)


def _attend_fwd(q, k, v, bias, mask, cfg, scale, engine_name, gradient, temperature):
    return _simulated(q, k, v, bias, mask, cfg, scale, engine_name), (q, k, v, bias, mask)


def _attend_bwd(cfg, scale, engine_name, gradient, temperature, res, g):
    q, k, v, bias, mask = res
    if gradient == "ste":
        def surrogate(q, k, v, bias):
            return _exact(q, k, v, bias, mask, scale, cfg.causal)
    else:
        def surrogate(q, k, v, bias):
            return _smooth(q, k, v, bias, mask, cfg, scale, temperature)
    _, vjp = jax.vjp(surrogate, q, k, v, bias)
    return (*vjp(g), None)  # the mask is not differentiable


_attend.defvjp(_attend_fwd, _attend_bwd)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, config: str | KernelConfig | None = None,
                          implementation: str | None = None, gradient: str = "ste",
                          smooth_temperature: float = 0.2):
    """Scaled dot-product attention as an FP8 kernel computes it (module docstring for details).

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``.
      key, value: ``(B, S, K, H)`` or ``(S, K, H)``, ``N`` a multiple of ``K``.
      bias: optional, added to the logits; broadcastable to ``(B, N, T, S)``.
      mask: optional boolean, True where a query may attend; broadcastable to ``(B, N, T, S)``.
      scale: logit scale (default ``1/√H``).
      is_causal: bottom-right aligned causal mask.
      config: ``None`` (exact FP32), a preset name or a :class:`KernelConfig`.
      implementation: ``"xla"`` (default), ``"scan"``, ``"mosaic"`` or ``"triton"``.
      gradient: ``"ste"`` (straight-through, default) or ``"smooth"``.
      smooth_temperature: τ of the smooth gradient's underflow gate, in units of the logits.

    Returns:
      The attention output, shaped and typed like ``query``.
    """
    _check_inputs(query, key, value)
    impl = "xla" if implementation is None else implementation
    check_choice("implementation", impl, IMPLEMENTATIONS)
    check_choice("gradient", gradient, GRADIENTS)
    if not isinstance(is_causal, bool):
        raise PcastError(f"is_causal={is_causal!r} must be True or False")
    head_dim = query.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_positive("scale", scale)
    temperature = check_positive("smooth_temperature", smooth_temperature)
    cfg = None if config is None else resolve(config)
    if cfg is not None and (is_causal or cfg.causal):
        cfg = cfg.replace(causal=True, name=cfg.name)
    if cfg is not None and gradient == "smooth" and cfg.scale_mode == "dynamic":
        raise PcastError(f"gradient='smooth' needs a static scale; config={cfg.name!r} is dynamic "
                         "(use gradient='ste')")
    if cfg is None and impl in _KERNELS:
        raise PcastError(f"implementation={impl!r} is an FP8 kernel: it needs a config (config=None is exact FP32)")

    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
        bias = None if bias is None else jnp.asarray(bias)[None] if jnp.ndim(bias) == 4 else bias
        mask = None if mask is None else jnp.asarray(mask)[None] if jnp.ndim(mask) == 4 else mask
    q, k, v = _as_bnth(query), _as_bnth(key), _as_bnth(value)
    b, n, t, _ = q.shape
    s = k.shape[2]
    shape = (b, n, t, s)
    bias4 = None if bias is None else _broadcast_4d("bias", bias, shape, jnp.float32)
    mask4 = None if mask is None else _broadcast_4d("mask", mask, shape, bool)

    if impl in _KERNELS:
        out = _kernel(q, k, v, bias4, mask4, cfg, scale, impl)
    elif cfg is None:
        out = _exact(q, k, v, bias4, mask4, scale, is_causal)
    else:
        out = _attend(q, k, v, jnp.zeros((), jnp.float32) if bias4 is None else bias4, mask4, cfg, scale,
                      "fast" if impl == "xla" else "scan", gradient, temperature)
    out = jnp.swapaxes(out, 1, 2).astype(query.dtype)
    return out[0] if unbatched else out


def _kernel(q, k, v, bias, mask, cfg: KernelConfig, scale: float, backend: str):
    """A Pallas FP8 kernel on per-tensor E4M3 Q/K/V (interpret mode without a GPU)."""
    import pallas_kernels as pk

    if bias is not None or mask is not None:
        raise PcastError(f"implementation={backend!r}: the Pallas kernels take neither bias nor mask "
                         "(use implementation='xla' or 'scan')")
    if cfg.qkv == "e4m3" and cfg.qkv_granularity == "head":
        raise PcastError(f"implementation={backend!r}: the Pallas kernels take one E4M3 descale per tensor; "
                         f"config={cfg.name!r} has qkv_granularity='head' (use implementation='xla' or 'scan')")
    q8, k8, v8, descales = pk.quantize_qkv(q, k, v)
    interpret = jax.default_backend() != "gpu"
    return pk.fp8_attention(q8, k8, v8, config=cfg, backend=backend, softmax_scale=scale,
                            interpret=interpret, **descales)


_FLAX_KWARGS = {"broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic", "dtype", "precision",
                "module", "is_causal"}


def attention_fn(config: str | KernelConfig | None = None, *, implementation: str | None = None,
                 gradient: str = "ste", smooth_temperature: float = 0.2):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` (and ``flax.linen``) through ``config``.

    ``nnx.MultiHeadAttention(..., attention_fn=pcast_jax.nn.attention_fn("fa3"))`` makes the
    layer's attention the simulated kernel (:func:`dot_product_attention`); ``config=None`` is exact
    FP32. Dropout is refused (a kernel simulation is deterministic), and so are keyword arguments
    this function does not know, rather than being ignored.
    """
    cfg = None if config is None else resolve(config)
    check_choice("gradient", gradient, GRADIENTS)

    def fn(query, key, value, bias=None, mask=None, **kwargs):
        unknown = sorted(set(kwargs) - _FLAX_KWARGS)
        if unknown:
            raise PcastError(f"attention_fn got keyword argument(s) {', '.join(unknown)} it does not support")
        if kwargs.get("dropout_rate", 0.0) > 0.0 and not kwargs.get("deterministic", True):
            raise PcastError("attention_fn: attention dropout is not simulated (set dropout_rate=0 or "
                             "deterministic=True)")
        out = dot_product_attention(query, key, value, bias, mask, is_causal=bool(kwargs.get("is_causal", False)),
                                    config=cfg, implementation=implementation, gradient=gradient,
                                    smooth_temperature=smooth_temperature)
        dtype = kwargs.get("dtype")
        return out if dtype is None else out.astype(dtype)

    return fn
