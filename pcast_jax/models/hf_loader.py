"""Hugging Face checkpoints of llama and qwen2 models: ``config.json`` + ``*.safetensors`` (sharded or not).

A folder holding ``config.json`` and either ``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps every tensor to (any other ``*.safetensors`` files are
read when there is neither). The safetensors format is read here directly (an 8-byte header
length, a JSON header, raw little-endian data): F32, F16 and BF16 tensors, memory-mapped, each
checked against the config's shape before it is read. Weights keep the Hugging Face layout:
``[out, in]`` projections and Q/K for RoPE on the halves of each head (``rope = "half"``).
Anything the forward would not reproduce (``rope_scaling``, another activation, a llama
``attention_bias``) is refused naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pcast_jax.errors import PcastError
from pcast_jax.models.llama_common import LlamaConfig, expected_shapes

__all__ = ["HF_ARCHITECTURES", "is_hf_checkpoint", "read_hf_checkpoint"]

#: ``model_type`` values read, and whether the Q/K/V projections carry biases.
HF_ARCHITECTURES = {"llama": False, "qwen2": True}
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": None}
_MAX_HEADER = 100 * 2**20

#: Flat parameter name → Hugging Face tensor name (``{i}``: the layer).
_HF_NAMES = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "output": "lm_head.weight",
    "layers.attn_norm": "model.layers.{i}.input_layernorm.weight",
    "layers.wq": "model.layers.{i}.self_attn.q_proj.weight", "layers.wk": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.wv": "model.layers.{i}.self_attn.v_proj.weight", "layers.wo": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.bq": "model.layers.{i}.self_attn.q_proj.bias", "layers.bk": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.bv": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.w_gate": "model.layers.{i}.mlp.gate_proj.weight", "layers.w_up": "model.layers.{i}.mlp.up_proj.weight",
    "layers.w_down": "model.layers.{i}.mlp.down_proj.weight",
}


def is_hf_checkpoint(path) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` (a Hugging Face checkpoint)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def _config(folder: Path) -> LlamaConfig:
    where = f"{folder / 'config.json'}"
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PcastError(f"{where}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise PcastError(f"{where}: must hold a JSON object")

    def get(key, default=None, *, kind=int):
        if key not in raw or raw[key] is None:
            if default is None:
                raise PcastError(f"{where}: field {key!r} is missing")
            return default
        value = raw[key]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and value > 0 and (kind is float or float(value).is_integer()))
        if not ok:
            raise PcastError(f"{where}: field {key!r} = {value!r} must be a finite positive "
                             f"{'number' if kind is float else 'integer'}")
        return kind(value)

    arch = raw.get("model_type")
    if arch not in HF_ARCHITECTURES:
        raise PcastError(f"{where}: field 'model_type' = {arch!r} is not supported "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if raw.get("rope_scaling") not in (None, {}):
        raise PcastError(f"{where}: field 'rope_scaling' = {raw['rope_scaling']!r} is not supported (plain RoPE only)")
    if raw.get("hidden_act", "silu") != "silu":
        raise PcastError(f"{where}: field 'hidden_act' = {raw['hidden_act']!r} is not supported (silu only)")
    if arch == "llama" and raw.get("attention_bias", False):
        raise PcastError(f"{where}: field 'attention_bias' = true is not supported for llama")
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    if hidden % heads and "head_dim" not in raw:
        raise PcastError(f"{where}: field 'hidden_size' = {hidden} is not a multiple of "
                         f"'num_attention_heads' = {heads}")
    kv_heads = get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise PcastError(f"{where}: field 'num_attention_heads' = {heads} is not a multiple of "
                         f"'num_key_value_heads' = {kv_heads}")
    head_dim = get("head_dim", hidden // heads)
    tied = raw.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise PcastError(f"{where}: field 'tie_word_embeddings' = {tied!r} must be true or false")
    return LlamaConfig(
        num_layers=get("num_hidden_layers"), hidden_size=hidden, intermediate_size=get("intermediate_size"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_base=get("rope_theta", 10000.0, kind=float),
        rope_dim=head_dim, rms_eps=get("rms_norm_eps", kind=float), vocab_size=get("vocab_size"),
        context_length=get("max_position_embeddings"), tied_embeddings=tied, name=str(raw.get("_name_or_path", "")),
        architecture=arch, rope="half", qkv_bias=HF_ARCHITECTURES[arch])


def _header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise PcastError(f"safetensors file {path}: field 'header length' is truncated")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, _MAX_HEADER):
            raise PcastError(f"safetensors file {path}: field 'header length' = {length} exceeds the file")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PcastError(f"safetensors file {path}: field 'header' is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PcastError(f"safetensors file {path}: field 'header' must be a JSON object")
    return header, 8 + length


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {str(name): folder / str(file) for name, file in weight_map.items()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise PcastError(f"{index}: field 'weight_map' is missing or damaged ({exc})") from None
    files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() \
        else sorted(folder.glob("*.safetensors"))
    if not files:
        raise PcastError(f"Hugging Face checkpoint {folder}: no *.safetensors file")
    out = {}
    for file in files:
        out.update({name: file for name in _header(file)[0] if name != "__metadata__"})
    return out


def _read_tensor(file: Path, name: str, shape: tuple[int, ...], headers: dict) -> np.ndarray:
    if file not in headers:
        if not file.is_file():
            raise PcastError(f"safetensors file {file} (holding {name!r}) does not exist")
        headers[file] = _header(file)
    header, start = headers[file]
    entry = header.get(name)
    where = f"safetensors file {file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise PcastError(f"{where} is missing")
    dtype = entry.get("dtype")
    if dtype not in _DTYPES:
        raise PcastError(f"{where}: field 'dtype' = {dtype!r} is not read (F32, F16 or BF16)")
    if tuple(entry.get("shape", ())) != shape:
        raise PcastError(f"{where}: field 'shape' = {entry.get('shape')}, expected {list(shape)}")
    offsets = entry.get("data_offsets")
    itemsize = 4 if dtype == "F32" else 2
    count = int(np.prod(shape))
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)
            and 0 <= offsets[0] and offsets[1] - offsets[0] == count * itemsize
            and start + offsets[1] <= file.stat().st_size):
        raise PcastError(f"{where}: field 'data_offsets' = {offsets} does not hold {count} {dtype} values "
                         "inside the file")
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + offsets[0], shape=(count * itemsize,))
    if dtype == "BF16":
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.view(_DTYPES[dtype]).astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise PcastError(f"{where} holds a non-finite value")
    return values.reshape(shape)


def read_hf_checkpoint(folder) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """(config, flat name → float32 array) of a Hugging Face llama or qwen2 checkpoint folder."""
    folder = Path(folder)
    cfg = _config(folder)
    files = _tensor_files(folder)
    headers: dict = {}
    flat = {}
    for key, shape in expected_shapes(cfg).items():
        per_layer = key.startswith("layers.")
        names = [_HF_NAMES[key].format(i=i) for i in range(cfg.num_layers)] if per_layer else [_HF_NAMES[key]]
        arrays = []
        for name in names:
            if name not in files:
                raise PcastError(f"Hugging Face checkpoint {folder}: tensor {name!r} is in no safetensors file")
            arrays.append(_read_tensor(files[name], name, shape, headers))
        flat[key] = np.stack(arrays) if per_layer else arrays[0]
    return cfg, flat
