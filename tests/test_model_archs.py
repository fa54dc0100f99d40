"""The architectures of Hugging Face transformers the loader reads: Llama 3.x RoPE scaling, qwen3, mistral, gemma2,
gemma3_text, on tiny random checkpoints the tests write, each held to an independent float64 NumPy forward written
here from transformers' definitions (v5.25.0, cited in ``pcast_jax.models.hf_loader.HF_ARCHITECTURES``); it shares
no code with the package. gpt_oss and the multimodal gemma3 are refused by name.

Tolerance: the package's forward runs in float32 (unit roundoff 2^-24 ≈ 6e-8); a logit passes through two layers of
at most eight chained products of ≤ 48 terms, norms and a softmax, so its error is a few hundred roundoffs of
max|logit| at most, ~1e-5 relative; 2e-4 · max|logit| leaves that margin twenty-fold, and every feature checked
moves the logits by more than ten times the tolerance when left out (asserted beside each case).
"""

import json
import math

import numpy as np
import pytest
from test_model_files import D_MODEL, FFN, HD, HKV, HQ, VOCAB, L, hf_weights, write_safetensors

from pcast_jax.errors import PcastError
from pcast_jax.models import forward, load_model

TOKENS = np.array([5, 17, 250, 3, 99, 42, 7, 200, 1, 64, 128, 33])
RTOL = 2e-4

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
#: name → (model_type, config.json fields beyond the common ones)
CASES = {
    "llama3": ("llama", {"rope_scaling": LLAMA3}),
    "llama3_v5": ("llama", {"rope_parameters": dict(LLAMA3, rope_theta=5000.0)}),
    "qwen3": ("qwen3", {}),
    "qwen3_sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral": ("mistral", {"sliding_window": 4}),
    "gemma2": ("gemma2", {"sliding_window": 4, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                          "final_logit_softcapping": 5.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 5, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                               "rope_theta": 1_000_000.0, "rope_local_base_freq": 100.0,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
}


def config_json(arch: str, extra: dict) -> dict:
    gemma = arch.startswith("gemma")
    cfg = {"model_type": arch, "hidden_size": D_MODEL, "intermediate_size": FFN, "num_hidden_layers": L,
           "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": HD, "rms_norm_eps": 1e-5,
           "vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": gemma,
           ("hidden_activation" if gemma else "hidden_act"): "gelu_pytorch_tanh" if gemma else "silu"}
    if "rope_parameters" not in extra:
        cfg["rope_theta"] = 10000.0
    cfg.update(extra)
    return cfg


def weights(arch: str, seed: int = 0) -> dict:
    """Random weights under transformers' names (llama's, plus what the family adds); a gemma norm weight w
    scales by 1 + w, so it is drawn near 0."""
    rng = np.random.default_rng(seed + 100)
    gemma = arch.startswith("gemma")
    out = hf_weights("llama", tied=gemma, seed=seed)

    def norm(n):
        return (rng.normal(size=n) * 0.1).astype(np.float32) + (0.0 if gemma else 1.0)

    if gemma:
        out = {k: v - 1 if k.endswith("norm.weight") else v for k, v in out.items()}
    for i in range(L):
        p = f"model.layers.{i}."
        if gemma:
            out.update({p + "pre_feedforward_layernorm.weight": norm(D_MODEL),
                        p + "post_feedforward_layernorm.weight": norm(D_MODEL)})
        if arch in ("qwen3", "gemma3_text"):
            out.update({p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD)})
    return out


def inv_freq(base: float, rope: dict | None) -> np.ndarray:
    """RoPE frequencies as transformers' rope functions define them (default, linear, llama3)."""
    freq = 1.0 / base ** (np.arange(0, HD, 2) / HD)
    kind = (rope or {}).get("rope_type", "default")
    if kind == "linear":
        return freq / rope["factor"]
    if kind == "llama3":
        out = []
        old = rope["original_max_position_embeddings"]
        for f in freq:
            wavelength = 2 * math.pi / f
            if wavelength < old / rope["high_freq_factor"]:
                out.append(f)
            elif wavelength > old / rope["low_freq_factor"]:
                out.append(f / rope["factor"])
            else:
                s = (old / wavelength - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
                out.append((1 - s) * f / rope["factor"] + s * f)
        return np.array(out)
    return freq


def layer_types(arch: str, cfg: dict) -> list:
    if "layer_types" in cfg:
        return cfg["layer_types"]
    if arch == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if arch == "gemma3_text":
        return ["sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) else "full_attention"
                for i in range(L)]
    if arch == "mistral" and cfg.get("sliding_window"):
        return ["sliding_attention"] * L
    if arch == "qwen3" and cfg.get("use_sliding_window"):
        return ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(L)]
    return ["full_attention"] * L


def reference(weights: dict, cfg: dict, tokens) -> np.ndarray:
    """float64 logits [T, V] of a transformers decoder-only model, from its definition."""
    arch = cfg["model_type"]
    gemma = arch.startswith("gemma")
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    n = len(tokens)
    eps = cfg["rms_norm_eps"]

    def rms(x, g):
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        return y * (1.0 + g) if gemma else y * g

    def rotation(base, rope):
        ang = np.arange(n)[:, None] * inv_freq(base, rope)[None]
        return np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]

    def rope_apply(x, cs):
        cos, sin = cs
        return x * cos + np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1) * sin

    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    global_rot = rotation(theta, params or cfg.get("rope_scaling"))
    local_rot = rotation(cfg["rope_local_base_freq"], None) if arch == "gemma3_text" else global_rot
    types = layer_types(arch, cfg)
    scaling = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else HD ** -0.5
    softcap = cfg.get("attn_logit_softcapping")

    def act(x):
        if gemma:
            return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        return x / (1 + np.exp(-x))

    x = W["model.embed_tokens.weight"][tokens] * (math.sqrt(D_MODEL) if gemma else 1.0)
    for i in range(L):
        p = f"model.layers.{i}."
        sliding = types[i] == "sliding_attention"
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(n, HQ, HD)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(n, HKV, HD)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(n, HKV, HD)
        if p + "self_attn.q_norm.weight" in W:
            q, k = rms(q, W[p + "self_attn.q_norm.weight"]), rms(k, W[p + "self_attn.k_norm.weight"])
        rot = local_rot if sliding else global_rot
        q, k = rope_apply(q, rot), rope_apply(k, rot)
        out = np.zeros((n, HQ, HD))
        for hh in range(HQ):
            kv = hh // (HQ // HKV)
            s = q[:, hh] @ k[:, kv].T * scaling
            if softcap:
                s = softcap * np.tanh(s / softcap)
            for a in range(n):
                for b in range(n):
                    if b > a or (sliding and b <= a - cfg["sliding_window"]):
                        s[a, b] = -np.inf
            pr = np.exp(s - s.max(1, keepdims=True))
            out[:, hh] = (pr / pr.sum(1, keepdims=True)) @ v[:, kv]
        attn = out.reshape(n, HQ * HD) @ W[p + "self_attn.o_proj.weight"].T
        if gemma:
            x = x + rms(attn, W[p + "post_attention_layernorm.weight"])
            h = rms(x, W[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + attn
            h = rms(x, W[p + "post_attention_layernorm.weight"])
        mlp = (act(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T
        x = x + (rms(mlp, W[p + "post_feedforward_layernorm.weight"]) if gemma else mlp)
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    logits = rms(x, W["model.norm.weight"]) @ head.T
    cap = cfg.get("final_logit_softcapping")
    return cap * np.tanh(logits / cap) if cap else logits


def write_checkpoint(folder, arch: str, extra: dict, seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config_json(arch, extra)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = weights(arch, seed)
    write_safetensors(folder / "model.safetensors", tensors)
    return folder, cfg, tensors


#: per case, a config.json change that leaves out what the case adds (the reference must move far)
WITHOUT = {
    "llama3": {"rope_scaling": None}, "llama3_v5": {"rope_parameters": {"rope_theta": 5000.0}},
    "qwen3_sliding": {"use_sliding_window": False}, "mistral": {"sliding_window": None},
    "gemma2": {"attn_logit_softcapping": None, "sliding_window": 1000}, "gemma3": {"rope_local_base_freq": 1e6},
}


@pytest.mark.parametrize("case", list(CASES))
def test_architectures_match_an_independent_numpy_forward(tmp_path, case):
    arch, extra = CASES[case]
    folder, cfg_json, tensors = write_checkpoint(tmp_path / case, arch, extra)
    cfg, params = load_model(folder)
    assert cfg.architecture == arch
    want = reference(tensors, cfg_json, TOKENS)
    got = np.asarray(forward(params, cfg, TOKENS))
    tol = RTOL * np.abs(want).max()  # the module docstring derives it
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    if case in WITHOUT:  # what the case adds matters: leaving it out moves the logits far beyond the tolerance
        other = reference(tensors, dict(cfg_json, **WITHOUT[case]), TOKENS)
        assert np.abs(other - want).max() > 10 * tol
    if case == "qwen3":  # the q/k norm matters
        plain = {k: v for k, v in tensors.items()}
        for name in plain:
            if "_norm" in name and "self_attn" in name:
                plain[name] = np.ones_like(plain[name])
        assert np.abs(reference(plain, cfg_json, TOKENS) - want).max() > 10 * tol


def test_window_and_soft_cap_reach_every_hook(tmp_path):
    """gemma2 through FP8Attention without the cast, and through the Recorder: the same logits; the trace
    carries each layer's window (W − 1) and soft cap, and Q with the model's query scale folded in."""
    from pcast_jax.analysis import Recorder
    from pcast_jax.models import FP8Attention, extract_qkv

    arch, extra = CASES["gemma2"]
    folder, cfg_json, tensors = write_checkpoint(tmp_path / "g2", arch, extra, seed=4)
    cfg, params = load_model(folder)
    assert cfg.layer_windows == (3, -1) and cfg.attn_softcap == 3.0
    want = reference(tensors, cfg_json, TOKENS)
    tol = RTOL * np.abs(want).max()
    exact = FP8Attention(config="fwd_s1", p_cast=False)
    np.testing.assert_allclose(np.asarray(forward(params, cfg, TOKENS, attention_fn=exact)), want, rtol=0, atol=tol)
    rec = Recorder()
    np.testing.assert_allclose(np.asarray(forward(params, cfg, TOKENS, attention_fn=rec.hook())), want, rtol=0,
                               atol=tol)
    trace = rec.trace(tokens=TOKENS)
    assert trace.local_window_size.tolist() == [3, -1]
    np.testing.assert_array_equal(trace.logits_soft_cap, [3.0, 3.0])
    q = np.asarray(extract_qkv(params, cfg, TOKENS).q)
    np.testing.assert_array_equal(trace.q[0, 0], q[0])  # layer 0: the same float32 operations
    # layer 1 follows each attention's own float32 rounding of layer 0 (the same tolerance as the logits)
    np.testing.assert_allclose(trace.q[1, 0], q[1], rtol=0, atol=RTOL * np.abs(q[1]).max())

    def plain(q, k, v, layer, valid=None):
        return q

    with pytest.raises(PcastError, match="does not take window="):
        forward(params, cfg, TOKENS, attention_fn=plain)


def test_model_report_refuses_what_it_would_analyse_wrong(tmp_path):
    from pcast_jax.models.fp8_study import _check_full_causal

    arch, extra = CASES["mistral"]
    cfg, _ = load_model(write_checkpoint(tmp_path / "m", arch, extra)[0])
    with pytest.raises(PcastError, match="local windows of 4 keys at 12 tokens.*pcast analyze"):
        _check_full_causal(cfg, 12)
    _check_full_causal(cfg, 4)  # a window that does not bind at 4 tokens: full causal attention


@pytest.mark.parametrize("override,message", [
    ({"model_type": "gpt_oss"}, "'gpt_oss' is not supported: its MLP is a mixture of experts.*supported: llama"),
    ({"model_type": "gemma3"}, "'gemma3' is not supported: a multimodal checkpoint.*gemma3_text"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn', not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "key 'low_freq_factor' = None"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu' is not supported for llama"),
    ({"layer_types": ["sliding_attention"], "model_type": "mistral", "sliding_window": 4}, "'layer_types' must list 2"),
])
def test_what_the_forward_would_not_reproduce_is_refused_by_name(tmp_path, override, message):
    folder, _, _ = write_checkpoint(tmp_path / "x", "llama", {})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(override)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PcastError, match=message) as info:
        load_model(folder)
    assert "config.json" in str(info.value)
