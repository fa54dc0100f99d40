"""``dot_product_attention`` with ``jax.nn.dot_product_attention``'s conventions, through the kernel.

A drop-in for a model's attention: the same arguments as ``jax.nn.dot_product_attention`` (and
tokamax's ``implementation=`` selector), plus ``config``, the FP8 kernel whose P-cast to simulate::

    out = pcast_jax.dot_product_attention(q, k, v, mask=mask, is_causal=True, config="fa3")

* Layouts: ``query`` ``(B, T, N, H)`` or ``(T, N, H)``; ``key`` and ``value`` ``(B, S, K, H)`` or
  ``(S, K, H)`` with ``N`` a multiple of ``K`` (grouped-query attention: query head ``n`` reads
  KV head ``n // (N / K)``). The output has the query's shape and dtype.
* ``bias`` is added to the logits and ``mask`` (boolean, True = attend; a float mask is refused,
  as jax.nn refuses it) removes keys; both broadcast to ``(B, N, T, S)``. ``query_seq_lengths``,
  ``key_value_seq_lengths`` and ``local_window_size`` mean what they mean in jax.nn.
* ``logits_soft_cap`` (tokamax's, Gemma 2's): the logits become ``cap·tanh(logits/cap)`` after the
  scale and the bias and before any mask, in every path (exact, simulated, smooth gradient, the
  residual); a key a bias hides (a logit ≤ −2^127) stays hidden.
* ``is_causal``: query ``i`` sees keys ``≤ i`` (top-left aligned, jax.nn's mask);
  ``causal_alignment="bottom_right"`` gives keys ``≤ S − T + i`` (FlashAttention's and the
  simulated kernels' alignment). The two agree for ``T == S``. A config with ``causal=True`` is
  causal as ``is_causal=True`` is.
* Masked keys. ``config=None`` is ``jax.nn``'s function: masked logits become a very negative
  float32, so a row with every key masked averages V. Under a config a masked key contributes
  nothing to the kernel — whether it is hidden by ``mask``, by the causal, window or length
  arguments, or by a ``bias`` of −inf or ``finfo(float32).min`` (any logit ≤ −2^127,
  :data:`pcast_jax.block.MASKED_BELOW`) — and a row with every key masked outputs 0, as the kernels'
  epilogue gives; nothing ever becomes NaN.
* ``config=None`` is exact FP32 attention (equal to ``jax.nn.dot_product_attention`` to FP32
  rounding); a preset name or :class:`~pcast_jax.config.KernelConfig` runs the simulated kernel
  per head: its KV order, block size, scale S and mode, cast, accumulator, and (``qkv="e4m3"``) E4M3
  Q/K/V with one scale per tensor or per head. A preset name takes the KV tile of the input's head
  dim (:func:`pcast_jax.presets.preset_for`: ``"fa3"`` runs B = 160 at H = 64, 224 at H = 128).
* ``implementation``: ``"xla"`` (default: vectorized), ``"scan"`` (the
  block-by-block reference engine), or a Pallas FP8 kernel, ``"mosaic"`` (Hopper) or ``"triton"``
  (run in interpret mode when no GPU is present). The kernels take E4M3 Q/K/V (quantized here per
  tensor) and accept no ``bias``, ``mask``, lengths or window (refused with a PcastError).

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
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import block, engine, nn_common
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_positive
from pcast_jax.presets import resolve

__all__ = ["IMPLEMENTATIONS", "GRADIENTS", "CAUSAL_ALIGNMENTS", "attention_fn", "attention_weights",
           "dot_product_attention", "kernel_inputs", "soft_capped"]

IMPLEMENTATIONS = ("xla", "scan", "mosaic", "triton")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
GRADIENTS = ("ste", "smooth")
_KERNELS = ("mosaic", "triton")
#: what jax.nn puts in masked float32 logits (``_get_large_negative``: −0.7 · finfo(float32).max)
_MASKED = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))


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


def _repeat_kv(x, n_heads: int):
    return jnp.repeat(x, n_heads // x.shape[1], axis=1)


def kernel_operands(q, k, v, cfg: KernelConfig | None, scale: float):
    """Q (B, N, T, H), K and V (B, N, S, H) as the kernel multiplies them, and the factor of Q·K.

    The factor is ``scale``; with E4M3 Q/K/V (``cfg.qkv == "e4m3"``: one scale per tensor or per
    (batch, head)) it carries the descales too, shaped (1, 1, 1, 1) or (B, N, 1, 1). KV heads are repeated for
    grouped-query attention. :func:`kernel_logits` makes the logits of any rows of them.
    """
    n_heads = q.shape[1]
    if cfg is not None and cfg.qkv == "e4m3":
        (q, dq), (k, dk), (v, dv) = (engine.quantize_qkv(x, cfg.qkv_granularity) for x in (q, k, v))
        dk, dv = (_repeat_kv(jnp.broadcast_to(d, (d.shape[0], x.shape[1], 1, 1)), n_heads) for d, x in
                  ((dk, k), (dv, v)))
        return q, _repeat_kv(k, n_heads), _repeat_kv(v, n_heads) * dv, dq * dk * scale
    return q, _repeat_kv(k, n_heads), _repeat_kv(v, n_heads), scale


def kernel_logits(q, k, factor):
    """The logits the kernel sees (rounded to float32 once) of :func:`kernel_operands`' Q and K."""
    return engine.round_scores(jnp.einsum("bnth,bnsh->bnts", q, k, precision="highest") * factor)


def kernel_inputs(q, k, v, cfg: KernelConfig | None, scale: float):
    """Logits (B, N, T, S) and V (B, N, S, H) as the kernel sees them, for Q (B, N, T, H) and K, V (B, K, S, H).

    E4M3 Q/K/V when ``cfg.qkv == "e4m3"`` (one scale per tensor or per (batch, head)); KV heads are
    repeated for grouped-query attention.
    """
    q, k, v, factor = kernel_operands(q, k, v, cfg, scale)
    return kernel_logits(q, k, factor), v


def soft_capped(logits, cap):
    """``cap·tanh(logits/cap)``: tokamax's ``logits_soft_cap`` (after the scale and bias, before the mask).

    ``cap``: None (the logits as they are), a number > 0, or a traced per-layer value where ≤ 0 means
    none. A logit ≤ −2^127 (:data:`pcast_jax.block.MASKED_BELOW`: a key a bias hides) stays as it is.
    """
    if cap is None:
        return logits
    if isinstance(cap, (int, float)):
        capped = cap * jnp.tanh(logits / cap)
    else:
        safe = jnp.where(cap > 0, cap, 1.0)
        capped = jnp.where(cap > 0, safe * jnp.tanh(logits / safe), logits)
    return jnp.where(logits <= block.MASKED_BELOW, logits, capped)


def _masked(logits, bias, visible, fill, soft_cap=None):
    """Logits + bias, soft-capped, with hidden keys set to ``fill`` (−inf for a kernel; jax.nn's value for the
    exact path)."""
    if bias is not None:
        logits = logits + bias
    logits = soft_capped(logits, soft_cap)
    return logits if visible is None else jnp.where(visible, logits, fill)


def _sink_rows(sinks, logits):
    """Per-head learned sink logits ``(N,)`` as the engine takes them: one per (batch, head), ``(B, N)``."""
    return None if sinks is None else jnp.broadcast_to(sinks, logits.shape[:2])


def _exact(q, k, v, bias, visible, scale, empty_rows_zero: bool, sinks=None, soft_cap=None):
    """Exact FP32 attention (B, N, T, H): the reference, and the straight-through backward.

    As ``jax.nn.dot_product_attention`` computes it: hidden logits get jax.nn's large negative value,
    so a row with nothing visible averages V. ``empty_rows_zero``: such rows give 0 instead (what a
    kernel gives, so the straight-through gradient is that of the function the forward computes).
    With learned ``sinks`` the softmax runs over [sink, logits] and drops the sink's column (a row
    with nothing visible then gives 0, its whole mass on the sink).
    """
    logits, vv = kernel_inputs(q, k, v, None, scale)
    logits = _masked(logits, bias, visible, _MASKED, soft_cap)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        probs = engine.reference_probs(logits, sink_logit=_sink_rows(sinks, logits))
    if empty_rows_zero and visible is not None:
        probs = probs * jnp.any(visible, axis=-1, keepdims=True)
    return jnp.einsum("bnts,bnsh->bnth", probs, vv, precision="highest")


def _simulated(q, k, v, bias, visible, cfg: KernelConfig, scale, engine_name: str, sinks=None, soft_cap=None):
    """The kernel's output (B, N, T, H): ``cfg`` (resolved at the entry point) bound once for the engine, which
    sees the visibility in the logits (so not causal itself)."""
    logits, vv = kernel_inputs(q, k, v, cfg, scale)
    logits = _masked(logits, bias, visible, -jnp.inf, soft_cap)
    return engine.run(logits, vv, engine.bound(cfg, causal=False), implementation=engine_name,
                      sink_logit=_sink_rows(sinks, logits)).out


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


def _smooth(q, k, v, bias, visible, cfg: KernelConfig, scale, temperature: float, sinks=None, soft_cap=None):
    """The smooth surrogate's output (B, N, T, H): effective weights with the gated cast, times V."""
    logits, vv = kernel_inputs(q, k, v, None, scale)  # Q/K/V casts straight-through
    logits = _masked(logits, bias, visible, -jnp.inf, soft_cap)
    bf = cfg.block_format
    if bf is not None:
        gate = _soft_block_gate_cast(cfg.effective_scale, bf, temperature)
    else:
        gate = _soft_gate_cast(cfg.effective_scale, cfg.fmt.round_to_zero, temperature)
    static = cfg.replace(scale=1.0, scale_mode="multiply", causal=False, qkv="f32", accumulator="f32",
                         rescale_compensation="none")
    w = engine.run_weights(logits, engine.bound(static), cast_fn=gate, sink_logit=_sink_rows(sinks, logits)).weights
    return jnp.einsum("bnts,bnsh->bnth", w, vv, precision="highest")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attend(q, k, v, bias, scale, sinks, visible, cfg, engine_name, gradient, temperature, soft_cap):
    return _simulated(q, k, v, bias, visible, cfg, scale, engine_name, sinks, soft_cap)


def _attend_fwd(q, k, v, bias, scale, sinks, visible, cfg, engine_name, gradient, temperature, soft_cap):
    out = _simulated(q, k, v, bias, visible, cfg, scale, engine_name, sinks, soft_cap)
    return out, (q, k, v, bias, scale, sinks, visible)


def _attend_bwd(cfg, engine_name, gradient, temperature, soft_cap, res, g):
    q, k, v, bias, scale, sinks, visible = res
    if gradient == "ste":
        def surrogate(q, k, v, bias, scale, sinks):
            return _exact(q, k, v, bias, visible, scale, True, sinks, soft_cap)
    else:
        def surrogate(q, k, v, bias, scale, sinks):
            return _smooth(q, k, v, bias, visible, cfg, scale, temperature, sinks, soft_cap)
    _, vjp = jax.vjp(surrogate, q, k, v, bias, scale, sinks)
    return (*vjp(g), None)  # the visibility mask is not differentiable


_attend.defvjp(_attend_fwd, _attend_bwd)


def _check_soft_cap(logits_soft_cap) -> float | None:
    """None, or a number > 0 (its float32 value): the cap of :func:`soft_capped`."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, jax.core.Tracer) or jnp.ndim(logits_soft_cap) != 0:
        raise PcastError(f"logits_soft_cap={logits_soft_cap!r} must be None or a number > 0 (a Python float, "
                         "not an array)")
    value = logits_soft_cap if isinstance(logits_soft_cap, numbers.Real) else float(logits_soft_cap)
    # a normal float32 (>= 1.18e-38, <= 3.4e38): below, the cap would be 0 there ("no cap"), above, inf
    return float(np.float32(check_positive("logits_soft_cap", value, float32=True)))


def _check_scale(scale, head_dim: int):
    """1/√H by default; a number > 0 (a Python float, its float32 value), or a traced scalar as it is."""
    if scale is None:
        return float(np.float32(1.0 / math.sqrt(head_dim)))
    if isinstance(scale, jax.core.Tracer):
        if jnp.shape(scale) != ():
            raise PcastError(f"scale must be a scalar, got shape {jnp.shape(scale)}")
        return jnp.asarray(scale, jnp.float32)
    if jnp.ndim(scale) != 0:
        raise PcastError(f"scale must be a scalar, got shape {jnp.shape(scale)}")
    return float(np.float32(check_positive("scale", float(scale))))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: str | None = None, return_residual: bool = False,
                          config: str | KernelConfig | None = None, gradient: str = "ste",
                          smooth_temperature: float = 0.2, causal_alignment: str = "top_left", sinks=None,
                          logits_soft_cap: float | None = None):
    """Scaled dot-product attention as an FP8 kernel computes it (module docstring for details).

    Every argument of ``jax.nn.dot_product_attention`` means what it means there; ``config``,
    ``gradient``, ``smooth_temperature``, ``causal_alignment`` and ``sinks`` are this package's, and
    ``logits_soft_cap`` means what it means in tokamax.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``.
      key, value: ``(B, S, K, H)`` or ``(S, K, H)``, ``N`` a multiple of ``K``.
      bias: optional, added to the logits; broadcastable to ``(B, N, T, S)``.
      mask: optional boolean, True where a query may attend; broadcastable to ``(B, N, T, S)``
        (an additive mask goes to ``bias``, as in jax.nn).
      scale: logit scale (default ``1/√H``); a traced scalar works under jit (and gets a gradient).
      is_causal: causal mask, aligned as ``causal_alignment`` says (top-left, as jax.nn, by default).
      query_seq_lengths, key_value_seq_lengths: optional ``(B,)`` integers: query rows and keys at
        or past the length are padding (padded query rows output 0, as in jax.nn).
      local_window_size: ``(left, right)`` (or one int for both): query ``i`` sees keys
        ``i − left … i + right``, as in jax.nn.
      implementation: ``"xla"`` (default), ``"scan"``, ``"mosaic"`` or ``"triton"``.
      return_residual: also return the log-sum-exp of the logits the kernel sees, ``(B, T, N)``
        (``(T, N)`` unbatched); −inf for a row with nothing visible under a config.
      config: ``None`` (exact FP32), a preset name (its KV tile resolved for the head dim ``H``,
        :func:`pcast_jax.presets.preset_for`) or a :class:`KernelConfig` (used as it is).
      gradient: ``"ste"`` (straight-through, default) or ``"smooth"``.
      smooth_temperature: τ of the smooth gradient's underflow gate, in units of the logits.
      causal_alignment: ``"top_left"`` (query ``i`` sees keys ``≤ i``: jax.nn's mask) or
        ``"bottom_right"`` (keys ``≤ S − T + i``: FlashAttention's and the simulated kernels'
        alignment, what a decode step against a KV cache wants). The two agree when ``T == S``.
      sinks: optional learned attention sinks (gpt-oss ``sinks``), ``(N,)``: one logit per query head,
        in the units of the scaled logits, a softmax column with no value row. The exact path
        (``config=None``) drops its column after the softmax; a config places it as its
        ``sink_mode`` says (epilogue, initial running max, every block max). Differentiable.
      logits_soft_cap: optional number > 0: the logits (scaled, bias added) become
        ``cap·tanh(logits/cap)`` before any mask, what the kernel then sees.

    Returns:
      The attention output, shaped and typed like ``query`` (and the residual with
      ``return_residual=True``).
    """
    _check_inputs(query, key, value)
    impl = "xla" if implementation is None else implementation
    if impl == "cudnn":
        raise PcastError("implementation='cudnn' asks jax.nn for cuDNN's own kernel, which this simulator does not "
                         "run; to see what cuDNN's FP8 attention does to P pass config='cudnn_fp8_tau0' (Hopper) "
                         "or config='cudnn_fp8' (Blackwell, τ = 4) with implementation='xla' (pcast doctor "
                         "--engine jax --backend cudnn says which)")
    check_choice("implementation", impl, IMPLEMENTATIONS)
    check_choice("gradient", gradient, GRADIENTS)
    check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    if not isinstance(is_causal, bool):
        raise PcastError(f"is_causal={is_causal!r} must be True or False")
    if not isinstance(return_residual, bool):
        raise PcastError(f"return_residual={return_residual!r} must be True or False")
    head_dim = query.shape[-1]
    scale = _check_scale(scale, head_dim)
    temperature = check_positive("smooth_temperature", smooth_temperature)
    soft_cap = _check_soft_cap(logits_soft_cap)
    # the one resolution of the call: a preset name gets the KV tile of the head dim (an unknown name: a
    # PcastError naming the presets); the engine path binds it once (_simulated), the kernels take it
    cfg = None if config is None else resolve(config, head_dim=head_dim)
    causal = is_causal or (cfg is not None and cfg.causal)
    if cfg is not None and gradient == "smooth" and cfg.scale_mode == "dynamic":
        raise PcastError(f"gradient='smooth' needs a static scale; config={cfg.name!r} is dynamic "
                         "(use gradient='ste')")
    if cfg is None and impl in _KERNELS:
        raise PcastError(f"implementation={impl!r} is an FP8 kernel: it needs a config (config=None is exact FP32)")
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise PcastError(f"mask must be boolean (True = attend), got dtype {jnp.asarray(mask).dtype}; an additive "
                         "mask (0 / -inf) goes to bias=, as in jax.nn.dot_product_attention")

    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
    q, k, v = _as_bnth(query), _as_bnth(key), _as_bnth(value)
    b, n, t, _ = q.shape
    s = k.shape[2]
    shape = (b, n, t, s)
    bias4 = None if bias is None else nn_common.broadcast_4d("bias", bias, shape, jnp.float32)
    mask4 = None if mask is None else nn_common.broadcast_4d("mask", mask, shape, bool)
    q_lens = nn_common.seq_lengths("query_seq_lengths", query_seq_lengths, b)
    kv_lens = nn_common.seq_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    window = nn_common.local_window(local_window_size)
    if sinks is not None:
        # a concrete array (also one a jitted caller closes over) is checked on the host; a traced one
        # cannot be, and a non-finite traced sink gives NaN rows (engine._sink_rows)
        concrete = None if isinstance(sinks, jax.core.Tracer) else np.asarray(sinks)
        sinks = jnp.asarray(sinks)
        if sinks.shape != (n,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise PcastError(f"sinks must be a floating-point array of shape (N,) = ({n},): one learned sink logit "
                             f"per query head; got {sinks.dtype} {sinks.shape}")
        sinks = sinks.astype(jnp.float32)
        if concrete is not None and not np.all(np.isfinite(concrete)):
            raise PcastError("sinks contains NaN or inf: learned sink logits must be finite")

    if impl in _KERNELS:
        if return_residual:
            raise PcastError(f"implementation={impl!r}: the Pallas kernels return no residual "
                             "(use implementation='xla' or 'scan')")
        others = {"bias": bias4, "mask": mask4, "query_seq_lengths": q_lens, "key_value_seq_lengths": kv_lens,
                  "local_window_size": window, "logits_soft_cap": soft_cap}
        given = [name for name, x in others.items() if x is not None]
        if given:
            raise PcastError(f"implementation={impl!r}: the Pallas kernels take no {', '.join(given)} "
                             "(use implementation='xla' or 'scan')")
        if causal and t != s and causal_alignment == "top_left":
            raise PcastError(f"implementation={impl!r} with is_causal=True and T={t} != S={s}: the kernels "
                             "align the causal mask bottom-right; pass causal_alignment='bottom_right' "
                             "(or use implementation='xla' or 'scan')")
        out = _kernel(q, k, v, cfg.replace(causal=True, name=cfg.name) if causal else cfg, scale, impl, sinks)
        out = jnp.swapaxes(out, 1, 2).astype(query.dtype)
        return out[0] if unbatched else out

    visible = nn_common.visibility(shape, mask4, causal, causal_alignment, q_lens, kv_lens, window)
    if cfg is None:
        out = _exact(q, k, v, bias4, visible, scale, False, sinks, soft_cap)
        if q_lens is not None:  # jax.nn zeroes the padded query rows
            out = out * (jnp.arange(t)[None, None, :, None] < q_lens[:, None, None, None])
    else:
        out = _attend(q, k, v, jnp.zeros((), jnp.float32) if bias4 is None else bias4, scale, sinks, visible, cfg,
                      impl, gradient, temperature, soft_cap)
    out = jnp.swapaxes(out, 1, 2).astype(query.dtype)
    out = out[0] if unbatched else out
    if not return_residual:
        return out
    logits, _ = kernel_inputs(q, k, v, cfg, scale)
    lse = jax.nn.logsumexp(_masked(logits, bias4, visible, _MASKED if cfg is None else -jnp.inf, soft_cap), axis=-1)
    if sinks is not None:  # the sink's column is part of the normaliser
        lse = jnp.logaddexp(lse, _sink_rows(sinks, logits)[..., None])
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2)).astype(query.dtype)  # (B, T, N)
    return out, (lse[0] if unbatched else lse)


def _kernel(q, k, v, cfg: KernelConfig, scale, backend: str, sinks=None):
    """A Pallas FP8 kernel on per-tensor E4M3 Q/K/V (interpret mode without a GPU)."""
    import pallas_kernels as pk

    if cfg.qkv == "e4m3" and cfg.qkv_granularity == "head":
        raise PcastError(f"implementation={backend!r}: the Pallas kernels take one E4M3 descale per tensor; "
                         f"config={cfg.name!r} has qkv_granularity='head' (use implementation='xla' or 'scan')")
    if isinstance(scale, jax.core.Tracer):
        raise PcastError(f"implementation={backend!r}: the Pallas kernels take a concrete scale (a number), "
                         "not a traced one (use implementation='xla' or 'scan')")
    q8, k8, v8, descales = pk.quantize_qkv(q, k, v)
    interpret = jax.default_backend() != "gpu"
    return pk.fp8_attention(q8, k8, v8, config=cfg, implementation=backend, scale=float(scale),
                            interpret=interpret, sinks=sinks, **descales)


_FLAX_KWARGS = {"broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic", "dtype", "precision",
                "module", "is_causal"}


def attention_weights(query, key, bias=None, mask=None, *, scale: float | None = None, is_causal: bool = False,
                      query_seq_lengths=None, key_value_seq_lengths=None,
                      local_window_size: int | tuple[int, int] | None = None,
                      config: str | KernelConfig | None = None, causal_alignment: str = "top_left",
                      logits_soft_cap: float | None = None):
    """The attention weights ``(B, N, T, S)`` before and after the kernel's P-cast.

    Returns ``(probs, kernel)``: ``probs`` the exact FP32 softmax (what ``flax`` sows as
    ``attention_weights``); ``kernel`` the simulated kernel's effective weights W — P8 times its
    block's α chain over S·ℓ, so that the output is W · V for an FP32 accumulator
    (:func:`pcast_jax.engine.effective_weights`) — or None with ``config=None``. Arguments as in
    :func:`dot_product_attention` (``query`` and ``key`` batched or not alike).
    """
    unbatched = jnp.ndim(query) == 3
    _check_inputs(query, key, key)
    check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise PcastError(f"mask must be boolean (True = attend), got dtype {jnp.asarray(mask).dtype}")
    if unbatched:
        query, key = query[None], key[None]
    head_dim = query.shape[-1]
    scale = _check_scale(scale, head_dim)
    soft_cap = _check_soft_cap(logits_soft_cap)
    cfg = None if config is None else resolve(config, head_dim=head_dim)
    causal = is_causal or (cfg is not None and cfg.causal)
    q, k = _as_bnth(query), _as_bnth(key)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias4 = None if bias is None else nn_common.broadcast_4d("bias", bias, shape, jnp.float32)
    mask4 = None if mask is None else nn_common.broadcast_4d("mask", mask, shape, bool)
    q_lens = nn_common.seq_lengths("query_seq_lengths", query_seq_lengths, shape[0])
    kv_lens = nn_common.seq_lengths("key_value_seq_lengths", key_value_seq_lengths, shape[0])
    window = nn_common.local_window(local_window_size)
    visible = nn_common.visibility(shape, mask4, causal, causal_alignment, q_lens, kv_lens, window)
    logits, _ = kernel_inputs(q, k, k, None, scale)
    probs = jax.nn.softmax(_masked(logits, bias4, visible, _MASKED, soft_cap), axis=-1)
    kernel = None
    if cfg is not None:
        klogits, _ = kernel_inputs(q, k, k, cfg, scale)
        kernel = engine.run_weights(_masked(klogits, bias4, visible, -jnp.inf, soft_cap),
                                    engine.bound(cfg, causal=False)).weights
    if unbatched:
        probs = probs[0]
        kernel = None if kernel is None else kernel[0]
    return probs, kernel


def _sow(module, name: str, value) -> None:
    """``module.sow`` into flax's intermediates collection (nnx.Intermediate, or linen's 'intermediates')."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - a module was passed, so flax is there
        nnx = None
    if nnx is not None and isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, name, value)
    else:
        module.sow("intermediates", name, value)


def attention_fn(config: str | KernelConfig | None = None, *, implementation: str | None = None,
                 gradient: str = "ste", smooth_temperature: float = 0.2, causal_alignment: str = "top_left",
                 logits_soft_cap: float | None = None):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` (and ``flax.linen``) through ``config``.

    ``nnx.MultiHeadAttention(..., attention_fn=pcast_jax.nn.attention_fn("fa3"))`` makes the
    layer's attention the simulated kernel (:func:`dot_product_attention`); ``config=None`` is exact
    FP32. A preset name gets the tile of the layer's head dim at each call. The mask means what flax
    means by it (nonzero = attend: flax's masks are float 0/1), also in ``decode=True`` mode. With
    ``sow_weights=True`` the layer sows ``attention_weights`` (the exact softmax, as flax does) and,
    under a config, ``attention_weights_kernel`` (the kernel's weights after the P-cast,
    :func:`attention_weights`). Dropout is refused (a kernel simulation is deterministic), and so are
    keyword arguments this function does not know, rather than being ignored. ``logits_soft_cap``
    caps every call's logits (:func:`dot_product_attention`).
    """
    if config is not None:  # refused now, not at the layer's first call; each call resolves it for its head dim
        resolve(config)
    check_choice("gradient", gradient, GRADIENTS)
    check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    _check_soft_cap(logits_soft_cap)

    def fn(query, key, value, bias=None, mask=None, **kwargs):
        unknown = sorted(set(kwargs) - _FLAX_KWARGS)
        if unknown:
            raise PcastError(f"attention_fn got keyword argument(s) {', '.join(unknown)} it does not support")
        if kwargs.get("dropout_rate", 0.0) > 0.0 and not kwargs.get("deterministic", True):
            raise PcastError("attention_fn: attention dropout is not simulated (set dropout_rate=0 or "
                             "deterministic=True)")
        if mask is not None:
            mask = jnp.asarray(mask).astype(jnp.bool_)  # flax: nonzero = attend
        is_causal = bool(kwargs.get("is_causal", False))
        out = dot_product_attention(query, key, value, bias, mask, is_causal=is_causal, config=config,
                                    implementation=implementation, gradient=gradient,
                                    smooth_temperature=smooth_temperature, causal_alignment=causal_alignment,
                                    logits_soft_cap=logits_soft_cap)
        module = kwargs.get("module")
        if module is not None:
            probs, kernel = attention_weights(query, key, bias, mask, is_causal=is_causal, config=config,
                                              causal_alignment=causal_alignment, logits_soft_cap=logits_soft_cap)
            _sow(module, "attention_weights", probs)
            if kernel is not None:
                _sow(module, "attention_weights_kernel", kernel)
        dtype = kwargs.get("dtype")
        return out if dtype is None else out.astype(dtype)

    return fn
