"""Pure-JAX llama-family forward pass with a pluggable attention function.

The forward pass is ``embed -> L x [RMSNorm -> GQA attention with RoPE -> residual -> RMSNorm ->
SwiGLU MLP -> residual] -> RMSNorm -> output head``; the layers run under one ``lax.scan`` over
stacked layer parameters, and the whole pass is ``jax.jit``-compiled.

Attention hook (``attention_fn``)
---------------------------------
``attention_fn(q, k, v, layer) -> out`` replaces the softmax attention inside every layer:

* ``q``: ``[T, Hq, D]`` float32, post-RoPE, **not** scaled by 1/sqrt(D);
* ``k``, ``v``: ``[T, Hkv, D]`` float32 (``k`` post-RoPE); query head ``h`` reads KV head
  ``h // (Hq // Hkv)`` (see :func:`expand_kv`);
* ``layer``: int32 scalar layer index — a *traced* value (the layers run under ``lax.scan``),
  so use it with ``jnp.where``/``lax.switch``/indexing, not Python ``if``;
* returns ``out``: ``[T, Hq, D]``.

The hook must apply the 1/sqrt(D) scale and the causal mask itself (as a kernel does). It always
sees one sequence: batched tokens ``[B, T]`` are handled with ``jax.vmap`` around the per-sequence
pass. Pass the same callable object across calls to reuse the compiled code (it is a static jit
argument). For trace extraction, ``forward_with_aux`` lets the hook return ``(out, aux)``; the
``aux`` pytrees are stacked over layers by the scan.

Batches of different lengths (padding)
--------------------------------------
Sequences of a batch ``[B, T]`` may be right-padded: ``lengths [B]`` says how many tokens of each
row are real (the rest are padding, any valid token ids). A hook whose signature has a ``valid``
parameter is then called as ``attention_fn(q, k, v, layer, valid=valid)`` with ``valid [T]`` bool,
True at the sequence's real tokens, and must mask the keys where it is False (as
:func:`causal_attention` and :class:`pcast_jax.models.FP8Attention` do). A hook without ``valid``
is called as before; since right padding comes after every real token, a causal hook never lets a
real query see it anyway. RoPE positions start at 0 in every row. The logits at padded positions
are computed but meaningless: :func:`next_token_loss` and the metrics of
:mod:`pcast_jax.models.fp8` take the same ``lengths`` and score real positions only.

Local windows, soft caps and sinks
----------------------------------
A model whose layers have local windows (``cfg.layer_windows``: mistral, gemma2/3, qwen3 with
``use_sliding_window``) calls its hook with ``window=w`` too, an int32 scalar (traced, like
``layer``): query ``i`` sees keys ``i − w … i``, −1 none. One with an attention soft cap
(``cfg.attn_softcap``: gemma2) calls it with ``soft_cap=cap``, a Python float: the logits are
``cap·tanh(logits / cap)`` before the mask. One with learned sinks (``cfg.attn_sinks``: gpt-oss)
calls it with ``sinks=`` ``[Hq]`` (traced), a softmax column per query head with no value row. A
hook that does not take what the model passes is refused naming the argument
(:func:`hook_arguments`), never run without it. A query scale other than 1/√D (``cfg.query_scale``)
is folded into ``q`` before the hook, so every hook's logits are ``q·k / √D``. The families of
:mod:`pcast_jax.models.hf_loader` add what :class:`LlamaConfig` describes around the same block
(q/k norm, sandwich norms, the tanh GELU, gpt-oss's experts, biased output projection).

RoPE convention
---------------
GGUF files store llama Q/K weights permuted for llama.cpp, so RoPE must rotate **adjacent** pairs
``(2i, 2i+1)`` with angle ``pos * base^(-2i/D)``. ``rope="half"`` rotates ``(i, i + D/2)`` (the
Hugging Face layout, and llama.cpp's NeoX RoPE of qwen2 GGUF files); with permuted llama GGUF
weights it is wrong and raises the loss sharply. The default, ``rope=None``, is the model's own
convention, ``cfg.rope``, which the loaders set. qwen2 models (``cfg.qkv_bias``) add a bias to
the Q, K and V projections (``params["layers"]["bq"|"bk"|"bv"]``).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcast_jax.analysis.logit_metrics import check_scored as _check_scored
from pcast_jax.analysis.logit_metrics import scored_positions
from pcast_jax.analysis.logit_metrics import validate_lengths as _validate_lengths
from pcast_jax.analysis.rows import expand_kv
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.models.llama_common import LlamaConfig
from pcast_jax.nn_common import causal_keys

__all__ = [
    "ROPE_CONVENTIONS",
    "AttentionFn",
    "rms_norm",
    "rope_angles",
    "apply_rope",
    "expand_kv",
    "causal_attention",
    "takes_valid",
    "takes",
    "hook_arguments",
    "valid_mask",
    "forward",
    "forward_with_aux",
    "scored_positions",
    "next_token_loss",
    "greedy_generate",
]

ROPE_CONVENTIONS = ("adjacent", "half")
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
_HIGHEST = lax.Precision.HIGHEST


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_angles(num_tokens: int, head_dim: int, base: float, cfg: LlamaConfig | None = None) -> jax.Array:
    """Rotation angles ``[T, D/2]``: position ``t`` times frequency ``base^(-2i/D)``, scaled as
    ``cfg.rope_scaling`` says when ``cfg`` is given."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if cfg is not None:
        inv_freq = _scaled_frequencies(inv_freq, cfg)
    return jnp.arange(num_tokens, dtype=jnp.float32)[:, None] * inv_freq[None, :]


def _scaled_frequencies(inv_freq: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """``inv_freq`` under ``cfg.rope_scaling``: ``"linear"`` divides every frequency by the factor;
    ``"llama3"`` keeps wavelengths below ``context / high_freq_factor``, divides those above
    ``context / low_freq_factor`` and blends between with weight
    ``s = (context / wavelength − low) / (high − low)``: ``(1 − s)·f / factor + s·f``."""
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "yarn":
        return _yarn_frequencies(inv_freq, cfg)
    if cfg.rope_scaling != "llama3":
        return inv_freq
    context, low, high = cfg.rope_original_context, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    return jnp.where(wavelength < context / high, inv_freq,
                     jnp.where(wavelength > context / low, inv_freq / factor, blended))


def apply_rope(x: jax.Array, angles: jax.Array, *, rope: str = "adjacent") -> jax.Array:
    """Rotate ``x [T, H, D]`` by ``angles [T, D/2]``.

    Args:
        x: queries or keys, ``[T, H, D]``.
        angles: from :func:`rope_angles`.
        rope: ``"adjacent"`` rotates pairs (2i, 2i+1) (GGUF/llama.cpp layout); ``"half"``
            rotates pairs (i, i + D/2) (Hugging Face layout).
    """
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if rope == "adjacent":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    if rope == "half":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    raise PcastError(f"rope={rope!r} is not one of {ROPE_CONVENTIONS}")


def _yarn_frequencies(inv_freq: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """YaRN: the dims before the one that turns ``beta_fast`` times over the original context keep their
    frequency, those after the one turning ``beta_slow`` times take frequency / factor, a linear ramp between
    (the ends rounded outwards when ``rope_truncate``)."""
    dim = cfg.head_dim

    def dim_of(rotations):
        return dim * math.log(cfg.rope_original_context / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

    low, high = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)


def rope_magnitude(cfg: LlamaConfig) -> float:
    """What RoPE multiplies Q and K by after rotating: YaRN's attention factor (``rope_attention_factor``, else
    ``0.1·ln(factor) + 1`` for a factor above 1), else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer=None, valid=None, window=None,
                     soft_cap: float = 0.0, sinks=None) -> jax.Array:
    """Exact float32 causal softmax attention with GQA, the default ``attention_fn``.

    ``softmax(q k^T / sqrt(D) + causal mask) v`` per query head; ``q [T, Hq, D]``,
    ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``. ``layer`` is ignored. ``valid`` (optional ``[T]``
    bool, True at real tokens) also masks the keys at padded positions; ``window`` (int, −1 or
    None: none) those more than ``window`` positions back; ``soft_cap`` (0: none) caps the logits
    at ``cap·tanh(logits / cap)`` first; ``sinks`` (``[Hq]`` learned sink logits) add a softmax column
    with no value row.
    """
    del layer
    num_tokens, num_heads, head_dim = q.shape
    k = expand_kv(k, num_heads)
    v = expand_kv(v, num_heads)
    scores = jnp.einsum("thd,shd->hts", q, k, precision=_HIGHEST) / math.sqrt(head_dim)
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = causal_keys(num_tokens, valid, window)
    scores = jnp.where(mask[None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.asarray(sinks, jnp.float32)[:, None]
        top = jnp.maximum(jnp.max(scores, axis=-1), sink)
        e = jnp.exp(scores - top[..., None])
        probs = e / (jnp.exp(sink - top) + jnp.sum(e, axis=-1))[..., None]
    # a padded query whose window holds only padded keys sees nothing: it outputs 0 (its logits are not scored)
    probs = jnp.where(jnp.any(mask, axis=-1)[None, :, None], probs, 0.0)
    return jnp.einsum("hts,shd->thd", probs, v, precision=_HIGHEST)


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight.T`` for a GGUF-layout ``[out, in]`` weight."""
    return jnp.einsum("ti,oi->to", x, weight, precision=_HIGHEST)


def takes(attention_fn, name: str) -> bool:
    """Whether a hook takes the keyword ``name``: its signature has it (or ``**kwargs``)."""
    try:
        params = inspect.signature(attention_fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def takes_valid(attention_fn) -> bool:
    """Whether a hook takes the padding mask: its signature has ``valid`` (or ``**kwargs``)."""
    return takes(attention_fn, "valid")


def hook_arguments(cfg: LlamaConfig, attention_fn) -> tuple[str, ...]:
    """The keywords besides ``valid`` the forward passes ``attention_fn`` for this model (``window``,
    ``soft_cap``, ``sinks``); a PcastError naming the hook and the argument when it does not take one."""
    needed = (("window",) if cfg.has_windows else ()) + (("soft_cap",) if cfg.attn_softcap else ()) \
        + (("sinks",) if cfg.attn_sinks else ())
    for name in needed:
        if not takes(attention_fn, name):
            what = {"window": f"local windows (layer_windows={list(cfg.layer_windows)})",
                    "soft_cap": f"an attention logit soft cap ({cfg.attn_softcap})",
                    "sinks": "learned attention sinks"}[name]
            raise PcastError(f"attention_fn {getattr(attention_fn, '__name__', type(attention_fn).__name__)} "
                             f"does not take {name}=, and this {cfg.architecture} model has {what}; a hook for it "
                             f"must take {name}= (see pcast_jax.models.llama)")
    return needed


def valid_mask(lengths, num_tokens: int) -> jax.Array:
    """``[..., T]`` bool, True at the first ``lengths`` positions of each row (the real tokens)."""
    return jnp.arange(num_tokens) < jnp.asarray(lengths, jnp.int32)[..., None]


def _hidden_states(params, cfg: LlamaConfig, tokens, attention_fn, rope: str, with_aux: bool,
                   valid=None):
    """Final normed hidden states ``[T, d]`` (and stacked aux) of one token sequence ``[T]``.

    ``valid [T]`` (right padding, True at real tokens) goes to hooks that take it.
    """
    extra = hook_arguments(cfg, attention_fn)
    pass_valid = valid is not None and takes_valid(attention_fn)
    windows = jnp.asarray(cfg.layer_windows or (-1,) * cfg.num_layers, jnp.int32)

    def hook(q, k, v, layer, sinks=None):
        kwargs = {"valid": valid} if pass_valid else {}
        if "window" in extra:
            kwargs["window"] = windows[layer]
        if "soft_cap" in extra:
            kwargs["soft_cap"] = cfg.attn_softcap
        if "sinks" in extra:
            kwargs["sinks"] = sinks
        return attention_fn(q, k, v, layer, **kwargs)

    num_tokens = tokens.shape[0]
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    angles = rope_angles(num_tokens, hd, cfg.rope_base, cfg)
    # local layers with a RoPE base of their own (gemma3) rotate unscaled at that base
    local_angles = rope_angles(num_tokens, hd, cfg.rope_local_base) if cfg.rope_local_base else None
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale != 1.0:
        x = x * jnp.float32(cfg.embed_scale)
    activation = jax.nn.silu if cfg.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    magnitude = rope_magnitude(cfg)

    def layer_step(x, scanned):
        layer_params, layer = scanned
        h = rms_norm(x, layer_params["attn_norm"], cfg.rms_eps)
        q, k, v = (_linear(h, layer_params[w]) for w in ("wq", "wk", "wv"))
        if cfg.qkv_bias:  # qwen2: Q/K/V projections with biases
            q, k, v = q + layer_params["bq"], k + layer_params["bk"], v + layer_params["bv"]
        q = q.reshape(num_tokens, hq, hd)
        k = k.reshape(num_tokens, hkv, hd)
        v = v.reshape(num_tokens, hkv, hd)
        if cfg.qk_norm:  # qwen3, gemma3: each head normed before RoPE
            q = rms_norm(q, layer_params["q_norm"], cfg.rms_eps)
            k = rms_norm(k, layer_params["k_norm"], cfg.rms_eps)
        layer_angles = angles if local_angles is None else jnp.where(windows[layer] >= 0, local_angles, angles)
        q = apply_rope(q, layer_angles, rope=rope)
        k = apply_rope(k, layer_angles, rope=rope)
        if magnitude != 1.0:  # YaRN scales cos and sin, so Q and K
            q, k = q * jnp.float32(magnitude), k * jnp.float32(magnitude)
        if cfg.query_scale:  # the model's logit scale, folded so that hooks divide by √D as always
            q = q * jnp.float32(cfg.query_scale * math.sqrt(hd))
        result = hook(q, k, v, layer, layer_params.get("sinks"))
        out, aux = result if with_aux else (result, None)
        out = _linear(out.reshape(num_tokens, hq * hd), layer_params["wo"])
        if cfg.out_bias:
            out = out + layer_params["bo"]
        if cfg.sandwich_norms:
            out = rms_norm(out, layer_params["post_attn_norm"], cfg.rms_eps)
        x = x + out
        h = rms_norm(x, layer_params["mlp_norm"], cfg.rms_eps)
        if cfg.num_experts:
            mlp = _experts(h, layer_params, cfg)
        else:
            mlp = activation(_linear(h, layer_params["w_gate"])) * _linear(h, layer_params["w_up"])
            mlp = _linear(mlp, layer_params["w_down"])
        if cfg.sandwich_norms:
            mlp = rms_norm(mlp, layer_params["post_mlp_norm"], cfg.rms_eps)
        x = x + mlp
        return x, aux

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    x, aux = lax.scan(layer_step, x, (params["layers"], layer_ids))
    return rms_norm(x, params["final_norm"], cfg.rms_eps), aux


def _experts(h: jax.Array, p: dict, cfg: LlamaConfig) -> jax.Array:
    """The mixture of experts ``[T, d]`` (``cfg.num_experts``; every expert computed, the chosen weighted)."""
    logits = _linear(h, p["router"]) + p["router_bias"]
    top, chosen = lax.top_k(logits, cfg.experts_per_token)
    weights = jnp.sum(jax.nn.one_hot(chosen, cfg.num_experts) * jax.nn.softmax(top, axis=-1)[..., None], axis=1)
    gate_up = jnp.einsum("td,edf->tef", h, p["experts_gate_up"], precision=_HIGHEST) + p["experts_gate_up_bias"]
    gate = jnp.minimum(gate_up[..., 0::2], cfg.swiglu_limit)
    up = jnp.clip(gate_up[..., 1::2], -cfg.swiglu_limit, cfg.swiglu_limit)
    hidden = (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
    out = jnp.einsum("tef,efd->ted", hidden, p["experts_down"], precision=_HIGHEST) + p["experts_down_bias"]
    return jnp.einsum("te,ted->td", weights, out, precision=_HIGHEST)


def _head(params, cfg: LlamaConfig, hidden: jax.Array) -> jax.Array:
    weight = params["embed"] if cfg.tied_embeddings else params["output"]
    logits = _linear(hidden, weight)
    if cfg.final_softcap:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def rope_of(cfg: LlamaConfig, rope: str | None) -> str:
    """The RoPE convention to run: ``rope`` when given, else the model's own (``cfg.rope``)."""
    return cfg.rope if rope is None and isinstance(cfg, LlamaConfig) else (rope or "adjacent")


def validate_tokens(cfg: LlamaConfig, tokens, rope: str) -> jax.Array:
    """``tokens`` ([T] or [B, T] integers in the vocabulary, T within the context) as int32; ``rope`` checked."""
    if not isinstance(cfg, LlamaConfig):
        raise PcastError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
    check_choice("rope", rope, ROPE_CONVENTIONS)
    if isinstance(tokens, (list, tuple)):
        tokens = np.asarray(tokens)
    if tokens.ndim not in (1, 2) or tokens.shape[-1] < 1:
        raise PcastError(f"tokens must have shape [T] or [B, T] with T >= 1, got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise PcastError(f"tokens must be integers, got dtype {tokens.dtype}")
    if tokens.shape[-1] > cfg.context_length:
        raise PcastError(
            f"tokens length T={tokens.shape[-1]} must be <= context_length={cfg.context_length}")
    try:
        host = np.asarray(tokens)
    except jax.errors.TracerArrayConversionError:
        host = None  # traced inside a caller's jit: values cannot be checked here
    if host is not None and (host.min() < 0 or host.max() >= cfg.vocab_size):
        raise PcastError(f"tokens must lie in [0, {cfg.vocab_size - 1}]")
    return jnp.asarray(tokens, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "attention_fn", "rope", "with_aux"))
def _forward_jit(params, tokens, lengths, *, cfg, attention_fn, rope, with_aux):
    def one(seq, length):
        valid = None if length is None else valid_mask(length, seq.shape[0])
        hidden, aux = _hidden_states(params, cfg, seq, attention_fn, rope, with_aux, valid)
        return _head(params, cfg, hidden), aux

    if tokens.ndim == 2:
        if lengths is None:
            return jax.vmap(lambda seq: one(seq, None))(tokens)
        return jax.vmap(one)(tokens, lengths)
    return one(tokens, lengths)


def forward(params, cfg: LlamaConfig, tokens, *, attention_fn: AttentionFn | None = None,
            rope: str | None = None, lengths=None) -> jax.Array:
    """Logits of a llama model.

    Args:
        params: from :func:`pcast_jax.models.load_model`.
        cfg: the model's :class:`LlamaConfig`.
        tokens: int token ids, ``[T]`` or ``[B, T]``.
        attention_fn: ``(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], layer) -> [T,Hq,D]``; default
            :func:`causal_attention`. See the module docstring for the contract.
        rope: ``"adjacent"``, ``"half"`` or None (default: ``cfg.rope``, the file's convention).
        lengths: optional real length of each right-padded sequence, ``[B]`` ints in [1, T]
            (a scalar for ``[T]`` tokens); ``None``: every token is real. Keys at padded positions
            are masked out; each sequence is causal on its own.

    Returns:
        float32 logits ``[T, V]`` (or ``[B, T, V]``); with ``lengths``, those at padded positions
        are meaningless (the metrics skip them).
    """
    rope = rope_of(cfg, rope)
    tokens = validate_tokens(cfg, tokens, rope)
    lengths = _validate_lengths(lengths, tokens)
    logits, _ = _forward_jit(params, tokens, lengths, cfg=cfg,
                             attention_fn=attention_fn or causal_attention, rope=rope, with_aux=False)
    return logits


def forward_with_aux(params, cfg: LlamaConfig, tokens, *, attention_fn, rope: str | None = None,
                     lengths=None):
    """Like :func:`forward`, but ``attention_fn`` returns ``(out, aux)``.

    Returns:
        ``(logits, aux)`` where every leaf of ``aux`` gains a leading ``num_layers`` axis
        (after the batch axis, for ``[B, T]`` tokens).
    """
    if attention_fn is None:
        raise PcastError("attention_fn must be a callable returning (out, aux)")
    rope = rope_of(cfg, rope)
    tokens = validate_tokens(cfg, tokens, rope)
    lengths = _validate_lengths(lengths, tokens)
    return _forward_jit(params, tokens, lengths, cfg=cfg, attention_fn=attention_fn, rope=rope,
                        with_aux=True)


@functools.partial(jax.jit, static_argnames=("cfg", "attention_fn", "rope"))
def _loss_jit(params, tokens, lengths, *, cfg, attention_fn, rope):
    def one(seq, length):
        valid = None if length is None else valid_mask(length, seq.shape[0])
        hidden, _ = _hidden_states(params, cfg, seq, attention_fn, rope, False, valid)
        logits = _head(params, cfg, hidden[:-1])
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_probs, seq[1:, None], axis=-1)[:, 0]

    if lengths is None:
        nll = jax.vmap(lambda seq: one(seq, None))(tokens) if tokens.ndim == 2 else one(tokens, None)
        return jnp.mean(nll)
    nll = jax.vmap(one)(tokens, lengths) if tokens.ndim == 2 else one(tokens, lengths)
    scored = scored_positions(lengths, tokens.shape[-1])
    return jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.maximum(jnp.sum(scored), 1)


def next_token_loss(params, cfg: LlamaConfig, tokens, *, attention_fn: AttentionFn | None = None,
                    rope: str | None = None, lengths=None) -> jax.Array:
    """Mean next-token negative log-likelihood in nats: ``-mean_t log p(x_{t+1} | x_{<=t})``.

    Args: as :func:`forward`; needs ``T >= 2``. With ``lengths``, only the positions whose next
        token is real are scored (``length - 1`` per sequence; at least one in the batch).

    Returns:
        float32 scalar (mean over all predicted positions and sequences, pooled).
    """
    rope = rope_of(cfg, rope)
    tokens = validate_tokens(cfg, tokens, rope)
    if tokens.shape[-1] < 2:
        raise PcastError(f"tokens length T={tokens.shape[-1]} must be >= 2 for a next-token loss")
    lengths = _validate_lengths(lengths, tokens)
    _check_scored(lengths)
    return _loss_jit(params, tokens, lengths, cfg=cfg, attention_fn=attention_fn or causal_attention,
                     rope=rope)


@functools.partial(jax.jit, static_argnames=("cfg", "attention_fn", "rope"))
def _next_token_jit(params, buffer, position, *, cfg, attention_fn, rope):
    hidden, _ = _hidden_states(params, cfg, buffer, attention_fn, rope, False)
    last = lax.dynamic_slice_in_dim(hidden, position - 1, 1, axis=0)
    return jnp.argmax(_head(params, cfg, last)[0]).astype(jnp.int32)


def greedy_generate(params, cfg: LlamaConfig, tokenizer, prompt: str, n_new: int, *,
                    attention_fn: AttentionFn | None = None, rope: str | None = None,
                    stop_at_eos: bool = True) -> str:
    """Greedy (argmax) continuation of ``prompt``; returns only the new text.

    The sequence lives in a fixed buffer (padded to a multiple of 32 tokens) so one compiled
    forward serves every step; causal masking keeps the padding from affecting earlier tokens.
    An ``attention_fn`` therefore sees the padded length T; it must be causal. No KV cache:
    every step recomputes the whole buffer (fine for tens of tokens on a 135M model).
    """
    n_new = check_int("n_new", n_new, min_value=1, max_value=cfg.context_length)
    rope = rope_of(cfg, rope)
    check_choice("rope", rope, ROPE_CONVENTIONS)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise PcastError("prompt must encode to at least one token")
    total = len(ids) + n_new
    if total > cfg.context_length:
        raise PcastError(f"len(prompt tokens) + n_new = {total} must be <= {cfg.context_length}")
    buffer_len = min(-(-total // 32) * 32, cfg.context_length)
    buffer = np.zeros(buffer_len, dtype=np.int32)
    buffer[: len(ids)] = ids
    fn = attention_fn or causal_attention
    new_ids: list[int] = []
    for position in range(len(ids), total):
        token = int(_next_token_jit(params, jnp.asarray(buffer), position, cfg=cfg,
                                    attention_fn=fn, rope=rope))
        if stop_at_eos and token == tokenizer.eos_id:
            break
        buffer[position] = token
        new_ids.append(token)
    return tokenizer.decode(new_ids)
