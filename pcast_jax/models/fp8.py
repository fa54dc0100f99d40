"""FP8 attention on a real model: the kernel-faithful simulator as the model's attention.

The hook, :class:`FP8Attention`, and the end-to-end comparison, :func:`end_to_end`, of a loaded
model. The per-head metrics of a trace (:func:`head_metrics`, :func:`analyze_trace`,
:func:`heads_attention`) and :func:`compare_logits` are model-agnostic and live in
:mod:`pcast_jax.analysis.heads` and :mod:`pcast_jax.analysis.logit_metrics` (re-exported here; the metrics'
definitions are in the first's docstring).

Batches: the hook takes one sequence ``[T, H, D]`` or a batch ``[B, T, H, D]``, with an optional
``valid`` padding mask (``[T]`` / ``[B, T]``, True at real tokens, right padding); the forward
passes it when given ``lengths``. Each sequence is its own kernel call: causal on its own, keys at
padded positions masked out, and E4M3 Q/K/V scales taken over its real tokens only, so on the same
Q/K/V a sequence gets the same output in any batch as alone. Through a whole compiled forward,
XLA may round a batched program differently in the last FP32 bit, and where a P sits on an E4M3
rounding boundary the cast turns that into one E4M3 step, which later layers carry on: SmolLM2 at
128 tokens under ``rev_s256`` in a batch of two (no padding at all) moves logits by up to 0.09
and the KL by 0.2 % against the sequence run alone, while FP32 and ``fwd_s1`` stay bit-identical.
:func:`compare_logits` and :func:`end_to_end` take ``[B, T]`` tokens with ``lengths`` and score
real positions only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from pcast_jax import engine as _engine
from pcast_jax.analysis.heads import HEAD_METRICS, analyze_trace, head_metrics, heads_attention, scores_and_values
from pcast_jax.analysis.logit_metrics import E2EMetrics, compare_logits, validate_lengths
from pcast_jax.config import QKV_GRANULARITIES, QKV_PRECISIONS, KernelConfig
from pcast_jax.engine import check_implementation
from pcast_jax.errors import PcastError, check_choice
from pcast_jax.models.llama import forward, validate_tokens
from pcast_jax.models.llama_common import LlamaConfig
from pcast_jax.nn import dot_product_attention
from pcast_jax.nn_common import causal_keys
from pcast_jax.presets import get_preset, preset_for, resolve

__all__ = [
    "QKV_GRANULARITIES",
    "FP8Attention",
    "heads_attention",
    "head_metrics",
    "analyze_trace",
    "HEAD_METRICS",
    "E2EMetrics",
    "compare_logits",
    "end_to_end",
]



@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Attention:
    """``attention_fn`` hook: every attention of the forward through the FP8 kernel simulator.

    Frozen and hashable, so two hooks with the same settings share one compiled forward (the hook
    is a static jit argument of :func:`pcast_jax.models.forward`).

    Attributes:
      config: the kernel's semantics (``causal`` is forced on). Presets keep Q/K/V in FP32
        (P-cast only); ``config.replace(qkv="e4m3")`` adds FP8 Q/K/V, with one scale per layer
        input or, with ``qkv_granularity="head"``, one per head.
      implementation: ``"xla"`` (default, the vectorized simulator) or ``"scan"`` (block by block).
      p_cast: ``False`` skips the kernel: exact FP32 causal softmax on the scores and values the
        kernel would see (with ``qkv="e4m3"``: the Q/K/V quantization floor alone).
    """

    config: KernelConfig
    implementation: str = "xla"
    p_cast: bool = True
    #: the preset the config came from (set when ``config`` is a preset name): its KV tile is then
    #: resolved for the head dim at each call (:func:`pcast_jax.presets.preset_for`)
    preset: str = ""

    def __post_init__(self):
        if isinstance(self.config, str) and not self.preset:
            object.__setattr__(self, "preset", self.config)
        if self.preset:
            get_preset(self.preset)
        cfg = resolve(self.config)
        object.__setattr__(self, "config", cfg.replace(causal=True, name=cfg.name))
        object.__setattr__(self, "implementation", check_implementation(self.implementation))
        if not isinstance(self.p_cast, bool):
            raise PcastError(f"p_cast={self.p_cast!r} must be True or False")

    @classmethod
    def from_preset(cls, name: str | KernelConfig, *, qkv: str = "f32", qkv_granularity: str = "tensor",
                    **kwargs) -> "FP8Attention":
        """Hook for a preset; ``qkv="e4m3"`` also quantizes Q/K/V to E4M3.

        A convenience that sets the config's ``qkv`` and ``qkv_granularity`` fields (``"tensor"``:
        one scale per layer input, ``"head"``: one per head). The hook's label is the preset's
        name, with ``+qkv8`` (per tensor) or ``+qkv8h`` (per head) appended when Q/K/V are
        quantized; the label is for display only.
        """
        cfg = resolve(name)
        check_choice("qkv_granularity", qkv_granularity, QKV_GRANULARITIES)
        check_choice("qkv", qkv, QKV_PRECISIONS)
        if qkv == "e4m3":
            suffix = "+qkv8h" if qkv_granularity == "head" else "+qkv8"
            cfg = cfg.replace(qkv="e4m3", qkv_granularity=qkv_granularity, name=cfg.name + suffix)
        if isinstance(name, str):
            kwargs.setdefault("preset", name)
        return cls(config=cfg, **kwargs)

    def config_for(self, head_dim: int) -> KernelConfig:
        """The config this hook runs at ``head_dim``: a preset's KV tile for that head dim (the name
        stays :attr:`name`; the tile is its ``block_kv``), everything else as :attr:`config`."""
        if not self.preset:
            return self.config
        tiled = preset_for(self.preset, head_dim)
        if tiled.block_kv == self.config.block_kv:
            return self.config
        return dataclasses.replace(self.config, block_kv=tiled.block_kv, name=self.config.name)

    @property
    def name(self) -> str:
        return self.config.name

    def __call__(self, q, k, v, layer=None, valid=None, window=None, soft_cap: float = 0.0, sinks=None):
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` → ``[T, Hq, D]`` (or all with a leading batch ``B``).

        ``valid`` (optional ``[T]`` / ``[B, T]`` bool, True at real tokens; right padding) masks
        the keys at padded positions; ``layer`` is ignored; ``window`` (an int, traced or not; −1 or
        None: none) masks the keys more than ``window`` positions back (the layer's local window);
        ``soft_cap`` (0: none) is the layer's logit soft cap, the kernel's ``logits_soft_cap``; ``sinks``
        (``[Hq]``) its learned sink logits, placed as the config's ``sink_mode`` says. The kernel path is
        :func:`pcast_jax.nn.dot_product_attention` (causal, the config's Q/K/V precision), the
        same function a user's own model calls, once per sequence (its own Q/K/V scales).
        """
        del layer
        q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        if q.ndim not in (3, 4) or k.ndim != q.ndim or v.shape != k.shape or q.shape[:-2] != k.shape[:-2] \
                or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
            raise PcastError(f"q must be [T, Hq, D] and k, v [T, Hkv, D] (or all [B, ...]) with Hq a "
                             f"multiple of Hkv; got {q.shape}, {k.shape}, {v.shape}")
        if valid is not None:
            valid = jnp.asarray(valid)
            if valid.shape != q.shape[:-2] or valid.dtype != jnp.bool_:
                raise PcastError(f"valid must be a bool array of shape {q.shape[:-2]} (True at real "
                                 f"tokens), got {valid.dtype} {valid.shape}")
        if q.ndim == 4:
            if valid is None:
                return jax.vmap(lambda a, b, c: self._sequence(a, b, c, None, window, soft_cap, sinks))(q, k, v)
            return jax.vmap(lambda a, b, c, d: self._sequence(a, b, c, d, window, soft_cap, sinks))(q, k, v, valid)
        return self._sequence(q, k, v, valid, window, soft_cap, sinks)

    def _sequence(self, q, k, v, valid, window=None, soft_cap: float = 0.0, sinks=None):
        """One sequence ``[T, H, D]``: padded positions zeroed (so E4M3 scales see real tokens only).

        A config with query tiles (``block_q``: rows that share a tile-amax scale or a skip-softmax
        vote) keeps the padded rows' Q as given: a kernel run on the padded batch tiles them with the
        real rows, so what they hold reaches the real rows' output (zeroed, they would raise their
        tiles' amax to 1).
        """
        mask = None
        cfg = self.config_for(q.shape[-1])
        if valid is not None:
            keep = valid[:, None, None]
            q = q if cfg.block_q else jnp.where(keep, q, 0.0)
            k, v = (jnp.where(keep, x, 0.0) for x in (k, v))
            mask = valid[None, None, :]  # (1, 1, S): keys at padded positions removed
        if window is not None:  # (1, T, S): and those beyond the local window
            mask = causal_keys(q.shape[0], valid, window)[None]
        if not self.p_cast:
            return _exact_on_kernel_inputs(q, k, v, cfg, mask, soft_cap, sinks)
        return dot_product_attention(q, k, v, mask=mask, is_causal=True, config=cfg, implementation=self.implementation,
                                     logits_soft_cap=soft_cap or None, sinks=sinks)


def _exact_on_kernel_inputs(q, k, v, cfg: KernelConfig, mask, soft_cap: float = 0.0, sinks=None):
    """Exact FP32 causal softmax on the scores and values the kernel would see (soft-capped when
    ``soft_cap`` is set, with the learned ``sinks`` ``[Hq]``), ``[T, Hq, D]``."""
    scores, v_seen = scores_and_values(q, k, v, cfg)
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if mask is not None:  # key 0 is always real, so no causal row is left empty
        scores = jnp.where(mask[0], scores, -jnp.inf)
    sink = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    out = _engine.reference_attention(scores, v_seen, causal=True, q_offset=0, sink_logit=sink)
    # a padded query whose window holds only padded keys sees nothing: it outputs 0, as the kernel's rows do
    tokens = scores.shape[-1]
    seen = jnp.any(jnp.isfinite(jnp.where(jnp.tril(jnp.ones((tokens, tokens), bool)), scores, -jnp.inf)), axis=-1)
    return jnp.swapaxes(jnp.where(seen[..., None], out, 0.0), 0, 1)


def end_to_end(params, cfg: LlamaConfig, tokens, hooks: Sequence[FP8Attention], *,
               lengths=None, progress=None) -> tuple[E2EMetrics, dict[str, E2EMetrics]]:
    """Perplexity, KL and top-1 agreement of the model with each hook's FP8 attention.

    Args:
      params, cfg: the model (:func:`pcast_jax.models.load_model`).
      tokens: ``[T]`` int token ids (one sequence, T ≥ 2), or a batch ``[B, T]``.
      hooks: :class:`FP8Attention` hooks (names must be distinct).
      lengths: optional ``[B]`` real lengths of right-padded ``[B, T]`` tokens; the metrics pool
        the real positions of every sequence.
      progress: optional callable ``(name) -> None`` called before each run.

    Returns:
      ``(fp32, {hook name: metrics})``; ``fp32`` is the FP32 model against itself (KL 0,
      agreement 1) and carries its perplexity.
    """
    tokens = validate_tokens(cfg, tokens, "adjacent")
    lengths = validate_lengths(lengths, tokens)
    names = [h.name for h in hooks]
    if len(set(names)) != len(names):
        raise PcastError(f"hooks must have distinct names; got {names}")
    for hook in hooks:
        if not isinstance(hook, FP8Attention):
            raise PcastError(f"hooks must be FP8Attention objects, got {type(hook).__name__}")
    ref = forward(params, cfg, tokens, lengths=lengths)
    base = compare_logits(ref, ref, tokens, lengths=lengths)
    out = {}
    for hook in hooks:
        if progress is not None:
            progress(hook.name)
        logits = forward(params, cfg, tokens, attention_fn=hook, lengths=lengths)
        out[hook.name] = compare_logits(ref, logits, tokens, lengths=lengths)
    return base, out
