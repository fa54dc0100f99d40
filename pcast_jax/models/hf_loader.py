"""Hugging Face checkpoints of llama and qwen2 models: ``config.json`` + ``*.safetensors`` (sharded or not).

A folder holding ``config.json`` and either ``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps every tensor to (any other ``*.safetensors`` files are
read when there is neither). Every JSON document (``config.json``, the index, each file's header) is
read with the bounds of :mod:`pcast_jax.fileio` (size, nesting depth); the ``safetensors`` library
validates each file's layout (offsets in order, not overlapping, inside the file; shapes whose size
overflows) before F32, F16 and BF16 tensors are memory-mapped, each checked against the config's
shape. A tensor found in two files and an index naming a file outside the folder are refused.
Weights keep the Hugging Face layout: ``[out, in]`` projections and Q/K for RoPE on the halves of
each head (``rope = "half"``). Anything the forward would not reproduce (``rope_scaling``, another
activation, a llama ``attention_bias`` or ``mlp_bias``, a qwen2 ``use_sliding_window``) is refused
naming the field; so is a model whose float32 weights exceed the memory budget
(:func:`pcast_jax.sweep.check_memory`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pcast_jax import fileio, safetensors_files
from pcast_jax.errors import PcastError
from pcast_jax.models.llama_common import LlamaConfig, expected_shapes

__all__ = ["HF_ARCHITECTURES", "is_hf_checkpoint", "read_hf_checkpoint"]

#: ``model_type`` values read, and whether the Q/K/V projections carry biases.
HF_ARCHITECTURES = {"llama": False, "qwen2": True}
#: Largest integer field of config.json (a count or size): int32, what the forward indexes with.
_MAX_FIELD = 2**31 - 1

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
    if not folder.is_dir():
        raise PcastError(f"Hugging Face checkpoint {folder}: not a folder")
    path = folder / "config.json"
    where = f"{path}"
    if not path.exists():
        raise PcastError(f"Hugging Face checkpoint {folder}: no config.json (a checkpoint folder holds "
                         "config.json and *.safetensors files)")
    raw = fileio.load_json(path, what=where)
    if not isinstance(raw, dict):
        raise PcastError(f"{where}: must hold a JSON object")

    def get(key, default=None, *, kind=int):
        if key not in raw or raw[key] is None:
            if default is None:
                raise PcastError(f"{where}: field {key!r} is missing")
            return default
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (isinstance(value, int) and value.bit_length() > 64):
            ok = False
        else:
            ok = math.isfinite(value) and value > 0 and \
                (kind is float or (float(value).is_integer() and value <= _MAX_FIELD))
        if not ok:
            shown = f"an integer of {value.bit_length()} bits" if isinstance(value, int) \
                and value.bit_length() > 64 else repr(value)
            raise PcastError(f"{where}: field {key!r} = {shown} must be a finite positive "
                             f"{'number' if kind is float else f'integer <= {_MAX_FIELD}'}")
        return kind(value)

    arch = raw.get("model_type")
    if arch not in HF_ARCHITECTURES:
        raise PcastError(f"{where}: field 'model_type' = {arch!r} is not supported "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if raw.get("rope_scaling") not in (None, {}):
        raise PcastError(f"{where}: field 'rope_scaling' = {raw['rope_scaling']!r} is not supported (plain RoPE only)")
    if raw.get("hidden_act", "silu") != "silu":
        raise PcastError(f"{where}: field 'hidden_act' = {raw['hidden_act']!r} is not supported (silu only)")
    # fields that change the model: refused where the forward would not reproduce them
    for key, archs in (("attention_bias", ("llama",)), ("mlp_bias", ("llama", "qwen2")),
                       ("use_sliding_window", ("qwen2", "llama"))):
        if arch in archs and raw.get(key, False) not in (False, None):
            raise PcastError(f"{where}: field {key!r} = {raw[key]!r} is not supported for {arch} "
                             "(the forward has no such layers)")
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
    cfg = LlamaConfig(
        num_layers=get("num_hidden_layers"), hidden_size=hidden, intermediate_size=get("intermediate_size"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_base=get("rope_theta", 10000.0, kind=float),
        rope_dim=head_dim, rms_eps=get("rms_norm_eps", kind=float), vocab_size=get("vocab_size"),
        context_length=get("max_position_embeddings"), tied_embeddings=tied, name=str(raw.get("_name_or_path", "")),
        architecture=arch, rope="half", qkv_bias=HF_ARCHITECTURES[arch])
    from pcast_jax.sweep.plan import check_memory

    per_layer = cfg.num_layers  # each "layers." tensor is stacked over the layers
    count = sum(math.prod(shape) * (per_layer if key.startswith("layers.") else 1)
                for key, shape in expected_shapes(cfg).items())
    check_memory(f"{where}: the model's float32 weights ({count} values, field 'num_hidden_layers' = "
                 f"{cfg.num_layers})", 4 * count)
    return cfg


def _read_tensor(file: Path, name: str, shape: tuple[int, ...], headers: dict) -> np.ndarray:
    return safetensors_files.read_tensor(file, name, headers, shape)


def read_hf_checkpoint(folder) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """(config, flat name → float32 array) of a Hugging Face llama or qwen2 checkpoint folder."""
    folder = Path(folder)
    cfg = _config(folder)
    headers: dict = {}
    files = safetensors_files.tensor_files(folder, headers)
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
