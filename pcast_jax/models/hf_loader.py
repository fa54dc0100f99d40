"""Hugging Face checkpoints of decoder-only models: ``config.json`` + ``*.safetensors`` (sharded or not).

``model_type`` llama (Llama 3.x's ``rope_scaling`` ``llama3`` too; ``linear`` and ``yarn``), qwen2,
qwen3 (q/k RMSNorm per head), mistral (sliding window), gemma2 and gemma3_text (attention and final logit soft caps,
local/global layers, ``query_pre_attn_scalar``, the ``(1 + w)`` RMSNorm folded into the weights at
load, the embedding scale √hidden_size, norms after the attention and the MLP, the tanh GELU); each
as transformers defines it (:data:`HF_ARCHITECTURES` cites the file). A Hugging Face
``sliding_window`` of ``W`` keys (query ``i`` sees keys ``j > i − W``) is the local window
``W − 1`` of :class:`LlamaConfig`. gpt_oss (learned sinks, alternating sliding layers, biased projections,
YaRN RoPE, its mixture of experts) is read in BF16/F16/F32; its MXFP4-quantized experts (a
``quantization_config``) are refused, as is the multimodal gemma3, by name.

A folder holding ``config.json`` and either ``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps every tensor to (any other ``*.safetensors`` files are
read when there is neither). Every JSON document (``config.json``, the index, each file's header) is
read with the bounds of :mod:`pcast_jax.fileio` (size, nesting depth); the ``safetensors`` library
validates each file's layout (offsets in order, not overlapping, inside the file; shapes whose size
overflows) before F32, F16 and BF16 tensors are memory-mapped, each checked against the config's
shape. A tensor found in two files and an index naming a file outside the folder are refused.
Weights keep the Hugging Face layout: ``[out, in]`` projections and Q/K for RoPE on the halves of
each head (``rope = "half"``). Anything the forward would not reproduce (a ``rope_type`` other than
default, linear and llama3, another activation, ``attention_bias`` or ``mlp_bias``, a qwen2
``use_sliding_window``) is refused naming the field; so is a model whose float32 weights exceed the memory budget
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

#: ``model_type`` values read → where transformers (v5.25.0, ``src/transformers/``) defines what the loader
#: and the forward reproduce.
HF_ARCHITECTURES = {
    "llama": "models/llama/modeling_llama.py; llama3 RoPE scaling: modeling_rope_utils.py:598-680",
    "qwen2": "models/qwen2/modeling_qwen2.py (Q/K/V biases)",
    "qwen3": "models/qwen3/modeling_qwen3.py:229-231, 245-246 (q/k RMSNorm per head before RoPE, sliding layers)",
    "mistral": "models/mistral/modeling_mistral.py:173 (sliding_window on every layer)",
    "gemma2": ("models/gemma2/modeling_gemma2.py:62 (1 + w) RMSNorm, 195-198 soft cap, 221 query_pre_attn_scalar, "
               "238 sliding layers, 320-326 sandwich norms, 380 embedding scale, 520-523 final soft cap"),
    "gemma3_text": ("models/gemma3/modeling_gemma3.py:132 (1 + w) RMSNorm, 290 query_pre_attn_scalar, 307 sliding "
                    "layers, 310-311 q/k norm, 468 embedding scale; RoPE per layer type: "
                    "configuration_gemma3.py:135-155"),
    "gpt_oss": ("models/gpt_oss/modeling_gpt_oss.py:68-113 experts, 116-129 router, 215-222 RoPE on the halves, "
                "241-247 sinks, 270-283 biased projections and sliding layers; configuration_gpt_oss.py:84-96 "
                "layer types and YaRN; YaRN: modeling_rope_utils.py:346-350, 368-500"),
}
#: ``model_type`` values refused by name, and why.
HF_REFUSED = {
    "gemma3": "a multimodal checkpoint; its text model (model_type 'gemma3_text') is read",
}
#: Families whose RMSNorm multiplies by ``1 + w`` (folded into the weights at load).
_OFFSET_NORMS = ("gemma2", "gemma3_text")
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
    "layers.q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.w_gate": "model.layers.{i}.mlp.gate_proj.weight", "layers.w_up": "model.layers.{i}.mlp.up_proj.weight",
    "layers.w_down": "model.layers.{i}.mlp.down_proj.weight",
    "layers.sinks": "model.layers.{i}.self_attn.sinks", "layers.bo": "model.layers.{i}.self_attn.o_proj.bias",
    "layers.router": "model.layers.{i}.mlp.router.weight", "layers.router_bias": "model.layers.{i}.mlp.router.bias",
    "layers.experts_gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
    "layers.experts_gate_up_bias": "model.layers.{i}.mlp.experts.gate_up_proj_bias",
    "layers.experts_down": "model.layers.{i}.mlp.experts.down_proj",
    "layers.experts_down_bias": "model.layers.{i}.mlp.experts.down_proj_bias",
}
#: Where the names of a model with sandwich norms (gemma2/3) differ: its ``post_attention_layernorm``
#: follows the attention, ``pre_feedforward_layernorm`` is the norm before the MLP.
_SANDWICH_NAMES = {
    "layers.post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers.post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
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
    if arch in HF_REFUSED:
        raise PcastError(f"{where}: field 'model_type' = {arch!r} is not supported: {HF_REFUSED[arch]} "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if arch not in HF_ARCHITECTURES:
        raise PcastError(f"{where}: field 'model_type' = {arch!r} is not supported "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")
    gemma = arch in _OFFSET_NORMS
    activation = raw.get("hidden_activation" if gemma else "hidden_act",
                         raw.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu"))
    allowed = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if activation not in (("gelu_pytorch_tanh",) if gemma else ("silu",)):  # gpt_oss: its experts' own gate
        key = "hidden_activation" if gemma and "hidden_activation" in raw else "hidden_act"
        raise PcastError(f"{where}: field {key!r} = {activation!r} is not supported for {arch} "
                         f"({'gelu_pytorch_tanh' if gemma else 'silu'} only)")
    if raw.get("quantization_config") not in (None, {}):
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) \
            else raw["quantization_config"]
        raise PcastError(f"{where}: field 'quantization_config' ({method!r}) is not supported: the weights are read in "
                         "F32, F16 or BF16 (a dequantized checkpoint)")
    # fields that change the model: refused where the forward would not reproduce them
    for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if raw.get(key, False) not in (False, None) and not (arch in ("qwen2", "gpt_oss") and key == "attention_bias"):
            raise PcastError(f"{where}: field {key!r} = {raw[key]!r} is not supported for {arch} "
                             "(the forward has no such layers)")
    if arch == "qwen2" and raw.get("use_sliding_window", False) not in (False, None):
        raise PcastError(f"{where}: field 'use_sliding_window' = {raw['use_sliding_window']!r} is not supported "
                         "for qwen2 (the forward has no such layers)")
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
    tied = raw.get("tie_word_embeddings", gemma)
    if not isinstance(tied, bool):
        raise PcastError(f"{where}: field 'tie_word_embeddings' = {tied!r} must be true or false")
    layers = get("num_hidden_layers")
    windows = _layer_windows(raw, arch, layers, where, get)
    extra = {}
    if gemma:
        softcaps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            default = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}[key] \
                if arch == "gemma2" else None
            value = raw.get(key, default)
            softcaps[key] = 0.0 if value is None else get(key, default, kind=float)
        extra = dict(attn_softcap=softcaps["attn_logit_softcapping"],
                     final_softcap=softcaps["final_logit_softcapping"],
                     query_scale=get("query_pre_attn_scalar", 256.0, kind=float) ** -0.5,
                     embed_scale=float(hidden) ** 0.5, sandwich_norms=True)
    if arch == "gpt_oss":
        bias = raw.get("attention_bias", True)
        if bias is not True:
            raise PcastError(f"{where}: field 'attention_bias' = {bias!r} is not supported for gpt_oss (biased "
                             "projections only)")
        experts = get("num_local_experts", 128)
        extra = dict(attn_sinks=True, out_bias=True, num_experts=experts,
                     experts_per_token=min(get("num_experts_per_tok", 4), experts),
                     swiglu_alpha=get("swiglu_alpha", 1.702, kind=float),
                     swiglu_limit=get("swiglu_limit", 7.0, kind=float))
        if get("num_experts_per_tok", 4) > experts:
            raise PcastError(f"{where}: field 'num_experts_per_tok' must be at most 'num_local_experts' = {experts}")
    cfg = LlamaConfig(
        num_layers=layers, hidden_size=hidden, intermediate_size=get("intermediate_size"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rope_dim=head_dim, rms_eps=get("rms_norm_eps", 1e-6 if gemma else None, kind=float),
        vocab_size=get("vocab_size"), context_length=get("max_position_embeddings"), tied_embeddings=tied,
        name=str(raw.get("_name_or_path", "")), architecture=arch, rope="half", qkv_bias=arch in ("qwen2", "gpt_oss"),
        qk_norm=arch in ("qwen3", "gemma3_text"), layer_windows=windows, activation=allowed[activation],
        **_rope_fields(raw, arch, where, get), **extra)
    from pcast_jax.sweep.plan import check_memory

    per_layer = cfg.num_layers  # each "layers." tensor is stacked over the layers
    count = sum(math.prod(shape) * (per_layer if key.startswith("layers.") else 1)
                for key, shape in expected_shapes(cfg).items())
    check_memory(f"{where}: the model's float32 weights ({count} values, field 'num_hidden_layers' = "
                 f"{cfg.num_layers})", 4 * count)
    return cfg


def _layer_windows(raw: dict, arch: str, layers: int, where: str, get) -> tuple[int, ...]:
    """Each layer's local window (``sliding_window`` − 1 on its sliding layers, −1 elsewhere), as transformers
    lays the layers out: ``layer_types`` when given, else mistral every layer, gemma2 every other from the
    first (gpt_oss too), gemma3 five of each six (``sliding_window_pattern``), qwen3 from ``max_window_layers`` on with
    ``use_sliding_window``; empty when no layer has one."""
    default = {"gemma2": 4096, "gemma3_text": 4096, "gpt_oss": 128}.get(arch)
    if arch in ("llama", "qwen2") or (arch == "qwen3" and not raw.get("use_sliding_window", False)) \
            or raw.get("sliding_window", default) is None:
        return ()
    window = get("sliding_window", default) - 1
    types = raw.get("layer_types")
    if types is None:
        if arch == "mistral":
            types = ["sliding_attention"] * layers
        elif arch in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif arch == "gemma3_text":
            pattern = get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:
            first = get("max_window_layers", layers) if "max_window_layers" in raw else 28
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers \
            or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise PcastError(f"{where}: field 'layer_types' must list {layers} of 'sliding_attention' or "
                         f"'full_attention', got {types!r}")
    windows = tuple(window if t == "sliding_attention" else -1 for t in types)
    return windows if any(w >= 0 for w in windows) else ()


def _rope_fields(raw: dict, arch: str, where: str, get) -> dict:
    """RoPE base, scaling and the local layers' base of ``LlamaConfig``, from ``rope_theta`` and
    ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5: one dict, or one per layer type)."""
    gemma3 = arch == "gemma3_text"
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict) or scaling is not None and not isinstance(scaling, dict):
        raise PcastError(f"{where}: fields 'rope_parameters' and 'rope_scaling' must be JSON objects or null")
    local = None
    if params and ("full_attention" in params or "sliding_attention" in params):
        local, params = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    base = {"rope_theta": get("rope_theta", 1_000_000.0 if gemma3 else 150000.0 if arch == "gpt_oss" else 10000.0,
                              kind=float)}
    if arch == "gpt_oss" and not params and not scaling:  # its config's default (configuration_gpt_oss.py:89-96)
        scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                   "original_max_position_embeddings": 4096}
    fields = _rope_scaling(dict(scaling or {}, **(params or {})), base["rope_theta"], where, "rope_parameters"
                           if params else "rope_scaling")
    if gemma3:
        local = dict(local or {})
        local.setdefault("rope_theta", get("rope_local_base_freq", 10000.0, kind=float))
        local_fields = _rope_scaling(local, 10000.0, where, "rope_parameters.sliding_attention")
        if local_fields["rope_scaling"] != "none":
            raise PcastError(f"{where}: field 'rope_parameters.sliding_attention' scales RoPE "
                             f"({local_fields['rope_scaling']!r}); only the global layers' RoPE is scaled here")
        fields["rope_local_base"] = local_fields["rope_base"]
    elif local:
        raise PcastError(f"{where}: field 'rope_parameters' is given per layer type for {arch}; one RoPE for every "
                         "layer is read (gemma3_text: one per layer type)")
    return fields


def _rope_scaling(params: dict, default_base: float, where: str, field: str) -> dict:
    """One RoPE dict (``rope_type`` or ``type``, ``rope_theta``, ``factor``, …) → ``LlamaConfig`` fields."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise PcastError(f"{where}: field {field!r} has rope_type {kind!r}, not supported (supported: default, "
                         "linear, llama3, yarn)")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
        raise PcastError(f"{where}: field {field!r}: YaRN's mscale / mscale_all_dim are not supported (give "
                         "attention_factor)")

    def number(key, default=None, *, integer=False):
        value = params.get(key, default)
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0 \
            and (not integer or float(value).is_integer() and value <= _MAX_FIELD)
        if not ok:
            raise PcastError(f"{where}: field {field!r} key {key!r} = {value!r} must be a finite positive "
                             f"{'integer' if integer else 'number'}")
        return int(value) if integer else float(value)

    fields = {"rope_base": number("rope_theta", default_base), "rope_scaling": "none"}
    if kind == "default":
        return fields
    fields.update(rope_scaling=kind, rope_factor=number("factor"))
    if kind == "llama3":
        fields.update(rope_low_freq_factor=number("low_freq_factor"), rope_high_freq_factor=number("high_freq_factor"),
                      rope_original_context=number("original_max_position_embeddings", integer=True))
    if kind == "yarn":
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise PcastError(f"{where}: field {field!r} key 'truncate' = {truncate!r} must be true or false")
        fields.update(rope_original_context=number("original_max_position_embeddings", integer=True),
                      rope_beta_fast=number("beta_fast", 32.0) if params.get("beta_fast") else 32.0,
                      rope_beta_slow=number("beta_slow", 1.0) if params.get("beta_slow") else 1.0,
                      rope_truncate=truncate, rope_attention_factor=number("attention_factor")
                      if params.get("attention_factor") is not None else 0.0)
    return fields


def _read_tensor(file: Path, name: str, shape: tuple[int, ...], headers: dict) -> np.ndarray:
    return safetensors_files.read_tensor(file, name, headers, shape)


def read_hf_checkpoint(folder) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """(config, flat name → float32 array) of a Hugging Face checkpoint folder (:data:`HF_ARCHITECTURES`);
    a ``(1 + w)`` RMSNorm's weights are returned as ``1 + w``, what the norm multiplies by."""
    folder = Path(folder)
    cfg = _config(folder)
    headers: dict = {}
    files = safetensors_files.tensor_files(folder, headers)
    names_of = dict(_HF_NAMES, **(_SANDWICH_NAMES if cfg.sandwich_norms else {}))
    flat = {}
    for key, shape in expected_shapes(cfg).items():
        per_layer = key.startswith("layers.")
        names = [names_of[key].format(i=i) for i in range(cfg.num_layers)] if per_layer else [names_of[key]]
        arrays = []
        for name in names:
            if name not in files:
                raise PcastError(f"Hugging Face checkpoint {folder}: tensor {name!r} is in no safetensors file")
            arrays.append(_read_tensor(files[name], name, shape, headers))
        flat[key] = np.stack(arrays) if per_layer else arrays[0]
        if cfg.architecture in _OFFSET_NORMS and key.endswith("norm"):
            flat[key] = np.float32(1.0) + flat[key]  # in float32, as the model computes it
    return cfg, flat
