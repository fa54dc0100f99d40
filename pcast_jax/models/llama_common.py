"""The llama-architecture model's description, shared by its forward and both checkpoint loaders.

:class:`LlamaConfig` (the hyper-parameters, from GGUF fields or a Hugging Face ``config.json``) and
:func:`expected_shapes` (the parameter shapes both loaders check); NumPy only, so that reading a
checkpoint's description imports no JAX.
"""

from __future__ import annotations

import dataclasses
import json

from pcast_jax.errors import PcastError

__all__ = ["LlamaConfig", "expected_shapes"]


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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        return cls(**json.loads(text))


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
    if not cfg.tied_embeddings:
        shapes["output"] = (cfg.vocab_size, d)
    return shapes
