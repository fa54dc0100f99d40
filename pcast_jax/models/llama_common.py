"""The llama-family model's description, shared by its forward and both checkpoint loaders.

:class:`LlamaConfig` (the hyper-parameters, from GGUF fields or a Hugging Face ``config.json``) and
:func:`expected_shapes` (the parameter shapes both loaders check); NumPy only, so that reading a
checkpoint's description imports no JAX. Beyond llama and qwen2 it describes what the decoder-only
families of Hugging Face transformers add to the same block: RoPE scaling (``rope_scaling``), a
RoPE base of its own for local layers, RMSNorm of each query and key head (``qk_norm``), a local
window per layer (``layer_windows``), a logit soft cap on the attention and on the output, a query
scale other than 1/√D, an embedding scale, norms after the attention and the MLP
(``sandwich_norms``), the tanh GELU, learned attention sinks, a biased output projection and a
mixture of experts (gpt-oss).
"""

from __future__ import annotations

import dataclasses
import json

from pcast_jax.errors import PcastError

__all__ = ["LlamaConfig", "expected_shapes", "ROPE_SCALINGS", "ACTIVATIONS"]

#: RoPE frequency scalings: none, ``"linear"`` (every frequency / factor) and ``"llama3"`` (Llama 3.1's
#: by wavelength: kept above ``original_context / high_freq_factor``, / factor beyond
#: ``original_context / low_freq_factor``, interpolated between) and ``"yarn"`` (YaRN: a linear ramp between
#: the frequencies kept and those / factor over the dims ``beta_fast`` … ``beta_slow`` rotations mark, and
#: Q and K multiplied by the attention factor, ``0.1·ln(factor) + 1`` unless given).
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
#: MLP gate activations: SiLU (llama, qwen, mistral) and the tanh approximation of GELU (gemma).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Hyper-parameters of a llama-architecture model, read from GGUF fields.

    Attributes:
        num_layers: ``llama.block_count``.
        hidden_size: ``llama.embedding_length``.
        intermediate_size: ``llama.feed_forward_length`` (SwiGLU width).
        num_heads: ``llama.attention.head_count`` (query heads, Hq).
        num_kv_heads: ``llama.attention.head_count_kv`` (Hkv; query head h uses kv head
            ``h // (Hq // Hkv)``).
        head_dim: per-head dimension D (``llama.attention.key_length`` if present, else
            ``hidden_size // num_heads``).
        rope_base: ``llama.rope.freq_base``.
        rope_dim: ``llama.rope.dimension_count`` (rotated dims per head; equals head_dim here).
        rms_eps: ``llama.attention.layer_norm_rms_epsilon``.
        vocab_size: number of token embeddings.
        context_length: ``llama.context_length`` (longest sequence the model was trained for).
        tied_embeddings: True when the file has no ``output.weight`` and the token embedding
            matrix doubles as the output head.
        name: ``general.name``.
        architecture: ``general.architecture`` (``"llama"`` or ``"qwen2"``; for a Hugging Face
            checkpoint, ``model_type``).
        rope: RoPE convention of the stored Q/K weights: ``"adjacent"`` (llama GGUF, permuted for
            llama.cpp) or ``"half"`` (qwen2 GGUF: llama.cpp's NeoX RoPE; every Hugging Face file).
        qkv_bias: the Q/K/V projections carry biases (qwen2).
        rope_scaling: one of :data:`ROPE_SCALINGS`, applied to the layers without a local window
            (every layer when ``rope_local_base`` is 0).
        rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_context: its numbers
            (``factor``; for ``"llama3"`` also ``low_freq_factor``, ``high_freq_factor`` and
            ``original_max_position_embeddings``).
        rope_beta_fast, rope_beta_slow, rope_truncate, rope_attention_factor: YaRN's ``beta_fast``,
            ``beta_slow``, ``truncate`` (the ramp's ends rounded outwards) and ``attention_factor`` (0: the
            default ``0.1·ln(factor) + 1``).
        rope_local_base: RoPE base of the layers with a local window (gemma3's
            ``rope_local_base_freq``); 0: ``rope_base`` and the scaling on every layer.
        qk_norm: each query and key head is RMS-normed over its D dims before RoPE (qwen3, gemma3;
            parameters ``q_norm``, ``k_norm`` ``[L, D]``).
        layer_windows: one entry per layer, the local window ``w`` (query ``i`` sees keys
            ``i − w … i``; −1: none); empty: no layer has one. A Hugging Face ``sliding_window`` of
            ``W`` keys is ``w = W − 1``.
        attn_softcap: logit soft cap of the attention (``cap·tanh(logits / cap)``; 0: none).
        final_softcap: soft cap of the output logits (0: none).
        query_scale: the attention's logit scale (gemma's ``query_pre_attn_scalar ** -0.5``); 0:
            1/√D. The forward folds ``query_scale·√D`` into the queries, so a hook sees logits
            ``q·k / √D`` as always.
        embed_scale: the token embeddings are multiplied by it (gemma: √hidden_size).
        sandwich_norms: RMSNorm after the attention and after the MLP too (gemma2/3; parameters
            ``post_attn_norm`` and ``post_mlp_norm`` ``[L, d]``, and ``mlp_norm`` is the norm before
            the MLP).
        activation: the MLP's gate activation, one of :data:`ACTIVATIONS`.
        attn_sinks: each layer has a learned sink logit per query head (gpt-oss; parameter ``sinks``
            ``[L, Hq]``, in the units of the logits ``q·k / √D``).
        out_bias: the attention's output projection carries a bias (parameter ``bo`` ``[L, d]``).
        num_experts: the MLP is a mixture of that many experts (gpt-oss: a router with bias picks
            ``experts_per_token`` by logit and weights them by the softmax of those logits; each expert is
            ``(clamp(up) + 1) · glu(clamp(gate))`` with ``glu(x) = x·σ(swiglu_alpha·x)``, its gate and up
            interleaved in one projection, both with biases); 0: the dense SwiGLU MLP.
        experts_per_token, swiglu_alpha, swiglu_limit: the mixture's numbers (``swiglu_limit`` clamps the
            gate from above and the up projection on both sides).
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    rope_dim: int
    rms_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool
    name: str = ""
    architecture: str = "llama"
    rope: str = "adjacent"
    qkv_bias: bool = False
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_local_base: float = 0.0
    qk_norm: bool = False
    layer_windows: tuple[int, ...] = ()
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    query_scale: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    activation: str = "silu"
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 0.0
    attn_sinks: bool = False
    out_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                      "num_kv_heads", "head_dim", "rope_dim", "vocab_size", "context_length"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PcastError(f"{field}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise PcastError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.rope_dim != self.head_dim or self.head_dim % 2:
            raise PcastError(
                f"rope_dim={self.rope_dim} must equal head_dim={self.head_dim} and be even")
        for field in ("rms_eps", "rope_base"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise PcastError(f"{field}={value!r} must be a finite positive number")
        if self.rope not in ("adjacent", "half"):
            raise PcastError(f"rope={self.rope!r} is not one of ('adjacent', 'half')")
        for field, choices in (("rope_scaling", ROPE_SCALINGS), ("activation", ACTIVATIONS)):
            if getattr(self, field) not in choices:
                raise PcastError(f"{field}={getattr(self, field)!r} is not one of {choices}")
        for field in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "embed_scale"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise PcastError(f"{field}={value!r} must be a finite positive number")
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise PcastError(f"rope_low_freq_factor={self.rope_low_freq_factor} must be below "
                             f"rope_high_freq_factor={self.rope_high_freq_factor}")
        if isinstance(self.rope_original_context, bool) or not isinstance(self.rope_original_context, int) \
                or self.rope_original_context <= 0:
            raise PcastError(f"rope_original_context={self.rope_original_context!r} must be a positive integer")
        if self.num_experts and not (isinstance(self.experts_per_token, int) and not isinstance(
                self.experts_per_token, bool) and 1 <= self.experts_per_token <= self.num_experts):
            raise PcastError(f"experts_per_token={self.experts_per_token!r} must be an integer in "
                             f"[1, num_experts={self.num_experts}]")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise PcastError(f"num_experts={self.num_experts!r} must be an integer >= 0 (0: a dense MLP)")
        for field in ("rope_beta_fast", "rope_beta_slow", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise PcastError(f"{field}={value!r} must be a finite positive number")
        for field in ("rope_local_base", "attn_softcap", "final_softcap", "query_scale", "rope_attention_factor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise PcastError(f"{field}={value!r} must be a finite number >= 0 (0: none)")
        windows = tuple(self.layer_windows)
        if windows and (len(windows) != self.num_layers or any(
                isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in windows)):
            raise PcastError(f"layer_windows={self.layer_windows!r} must be empty or {self.num_layers} integers "
                             ">= -1 (one per layer; -1: no window)")
        object.__setattr__(self, "layer_windows", windows)
        for field in ("qk_norm", "sandwich_norms", "qkv_bias", "tied_embeddings", "rope_truncate", "attn_sinks",
                      "out_bias"):
            if not isinstance(getattr(self, field), bool):
                raise PcastError(f"{field}={getattr(self, field)!r} must be True or False")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_windows(self) -> bool:
        """Whether some layer has a local window."""
        return any(w >= 0 for w in self.layer_windows)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        raw = json.loads(text)
        if isinstance(raw, dict) and isinstance(raw.get("layer_windows"), list):
            raw["layer_windows"] = tuple(raw["layer_windows"])
        return cls(**raw)


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Flat parameter name → shape (the layer tensors per layer, without the leading L)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
              "layers.attn_norm": (d,), "layers.wq": (q_dim, d), "layers.wk": (kv_dim, d),
              "layers.wv": (kv_dim, d), "layers.wo": (d, q_dim), "layers.mlp_norm": (d,),
              "layers.w_gate": (f, d), "layers.w_up": (f, d), "layers.w_down": (d, f)}
    if cfg.qkv_bias:
        shapes.update({"layers.bq": (q_dim,), "layers.bk": (kv_dim,), "layers.bv": (kv_dim,)})
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (cfg.head_dim,), "layers.k_norm": (cfg.head_dim,)})
    if cfg.sandwich_norms:
        shapes.update({"layers.post_attn_norm": (d,), "layers.post_mlp_norm": (d,)})
    if cfg.attn_sinks:
        shapes["layers.sinks"] = (cfg.num_heads,)
    if cfg.out_bias:
        shapes["layers.bo"] = (d,)
    if cfg.num_experts:
        e = cfg.num_experts
        for key in ("layers.w_gate", "layers.w_up", "layers.w_down"):
            del shapes[key]
        shapes.update({"layers.router": (e, d), "layers.router_bias": (e,), "layers.experts_gate_up": (e, d, 2 * f),
                       "layers.experts_gate_up_bias": (e, 2 * f), "layers.experts_down": (e, f, d),
                       "layers.experts_down_bias": (e, d)})
    if not cfg.tied_embeddings:
        shapes["output"] = (cfg.vocab_size, d)
    return shapes
