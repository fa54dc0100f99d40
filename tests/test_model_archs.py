"""The architectures of Hugging Face transformers the loader reads: Llama 3.x RoPE scaling, qwen3, mistral, gemma2,
gemma3_text, gpt_oss (sinks, YaRN, mixture of experts), on tiny random checkpoints the tests write, each held to an
independent float64 NumPy forward written here from transformers' definitions (v5.25.0, cited in
``pcast_jax.models.hf_loader.HF_ARCHITECTURES``); it shares no code with the package. The multimodal gemma3 and
quantized checkpoints are refused by name.

Tolerance: the package's forward runs in float32 (unit roundoff 2^-24 ≈ 6e-8); a logit passes through two layers of
at most eight chained products of ≤ 48 terms, norms and a softmax, so its error is a few hundred roundoffs of
max|logit| at most, ~1e-5 relative; 2e-4 · max|logit| leaves that margin twenty-fold, and every feature checked
moves the logits by more than ten times the tolerance when left out (asserted beside each case).
"""

import json
import math

import numpy as np
import pytest
from test_model_files import D_MODEL, FFN, HD, HKV, HQ, VOCAB, L, analyze_recorded, hf_weights, write_safetensors

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
    "gpt_oss": ("gpt_oss", {"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 100.0,
                            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 8.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 16}}),
}
EXPERTS = 4


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
    out = hf_weights("qwen2" if arch == "gpt_oss" else "llama", tied=gemma, seed=seed)  # gpt_oss: Q/K/V biases

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
        if arch == "gpt_oss":
            for name in ("gate_proj", "up_proj", "down_proj"):
                del out[p + f"mlp.{name}.weight"]

            def w(*shape, scale=0.3):
                return (rng.normal(size=shape) * scale).astype(np.float32)

            out.update({p + "self_attn.o_proj.bias": w(D_MODEL), p + "self_attn.sinks": w(HQ, scale=1.0),
                        p + "mlp.router.weight": w(EXPERTS, D_MODEL), p + "mlp.router.bias": w(EXPERTS),
                        p + "mlp.experts.gate_up_proj": w(EXPERTS, D_MODEL, 2 * FFN, scale=0.6),
                        p + "mlp.experts.gate_up_proj_bias": w(EXPERTS, 2 * FFN),
                        p + "mlp.experts.down_proj": w(EXPERTS, FFN, D_MODEL),
                        p + "mlp.experts.down_proj_bias": w(EXPERTS, D_MODEL)})
    return out


def inv_freq(base: float, rope: dict | None) -> np.ndarray:
    """RoPE frequencies as transformers' rope functions define them (default, linear, llama3, yarn)."""
    freq = 1.0 / base ** (np.arange(0, HD, 2) / HD)
    kind = (rope or {}).get("rope_type", "default")
    if kind == "linear":
        return freq / rope["factor"]
    if kind == "yarn":  # the dims between the beta_fast and beta_slow rotation counts ramp from kept to / factor
        def dim_at(rotations):
            return HD * math.log(rope["original_max_position_embeddings"] / (rotations * 2 * math.pi)) \
                / (2 * math.log(base))

        low, high = max(dim_at(rope["beta_fast"]), 0), min(dim_at(rope["beta_slow"]), HD - 1)
        assert not rope.get("truncate", True)
        kept = 1 - np.clip((np.arange(HD // 2) - low) / (high - low), 0, 1)
        return freq / rope["factor"] * (1 - kept) + freq * kept
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
    if arch == "gpt_oss":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
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
        mag = 0.1 * math.log(rope["factor"]) + 1 if (rope or {}).get("rope_type") == "yarn" else 1.0
        return (mag * np.concatenate([np.cos(ang)] * 2, -1)[:, None],
                mag * np.concatenate([np.sin(ang)] * 2, -1)[:, None])

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
        q, k, v = ((h @ W[p + f"self_attn.{x}_proj.weight"].T + W.get(p + f"self_attn.{x}_proj.bias", 0.0))
                   .reshape(n, heads, HD) for x, heads in (("q", HQ), ("k", HKV), ("v", HKV)))
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
            sink = W[p + "self_attn.sinks"][hh] if arch == "gpt_oss" else -np.inf
            top = np.maximum(s.max(1, keepdims=True), sink)
            pr = np.exp(s - top)
            out[:, hh] = (pr / (pr.sum(1, keepdims=True) + np.exp(sink - top))) @ v[:, kv]
        attn = out.reshape(n, HQ * HD) @ W[p + "self_attn.o_proj.weight"].T + W.get(p + "self_attn.o_proj.bias", 0.0)
        if gemma:
            x = x + rms(attn, W[p + "post_attention_layernorm.weight"])
            h = rms(x, W[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + attn
            h = rms(x, W[p + "post_attention_layernorm.weight"])
        if arch == "gpt_oss":
            mlp = moe(h, W, p, cfg)
        else:
            mlp = (act(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) \
                @ W[p + "mlp.down_proj.weight"].T
        x = x + (rms(mlp, W[p + "post_feedforward_layernorm.weight"]) if gemma else mlp)
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    logits = rms(x, W["model.norm.weight"]) @ head.T
    cap = cfg.get("final_logit_softcapping")
    return cap * np.tanh(logits / cap) if cap else logits


def moe(h, W, p, cfg) -> np.ndarray:
    """gpt-oss's experts token by token: the top-k router logits' softmax weighs each chosen expert's
    (clamp(up) + 1)·glu(clamp(gate)), gate and up interleaved in one biased projection."""
    out = np.zeros_like(h)
    alpha, limit = cfg.get("swiglu_alpha", 1.702), cfg.get("swiglu_limit", 7.0)
    for t in range(h.shape[0]):
        logits = W[p + "mlp.router.weight"] @ h[t] + W[p + "mlp.router.bias"]
        chosen = np.argsort(-logits)[:cfg["num_experts_per_tok"]]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        for e, weight in zip(chosen, weights / weights.sum()):
            gu = h[t] @ W[p + "mlp.experts.gate_up_proj"][e] + W[p + "mlp.experts.gate_up_proj_bias"][e]
            gate, up = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)
            y = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[t] += weight * (y @ W[p + "mlp.experts.down_proj"][e] + W[p + "mlp.experts.down_proj_bias"][e])
    return out


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
    "gpt_oss": {"rope_scaling": None, "sliding_window": 1000},
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


@pytest.mark.parametrize("case", ["gemma2", "gpt_oss"])
def test_windows_soft_caps_and_sinks_reach_every_hook(tmp_path, case):
    """gemma2 (window, soft cap, query scale) and gpt_oss (window, sinks) through FP8Attention without the cast
    and through the Recorder: the reference's logits; the trace carries each layer's window (W − 1), soft cap
    and sinks, and Q as the model's attention sees it."""
    from pcast_jax.analysis import Recorder
    from pcast_jax.models import FP8Attention, extract_qkv

    arch, extra = CASES[case]
    folder, cfg_json, tensors = write_checkpoint(tmp_path / case, arch, extra, seed=4)
    cfg, params = load_model(folder)
    assert cfg.layer_windows == (3, -1)
    want = reference(tensors, cfg_json, TOKENS)
    tol = RTOL * np.abs(want).max()
    exact = FP8Attention(config="fwd_s1", p_cast=False)
    np.testing.assert_allclose(np.asarray(forward(params, cfg, TOKENS, attention_fn=exact)), want, rtol=0, atol=tol)
    rec = Recorder()
    np.testing.assert_allclose(np.asarray(forward(params, cfg, TOKENS, attention_fn=rec.hook())), want, rtol=0,
                               atol=tol)
    trace = rec.trace(tokens=TOKENS)
    assert trace.local_window_size.tolist() == [3, -1]
    if case == "gemma2":
        np.testing.assert_array_equal(trace.logits_soft_cap, [3.0, 3.0])
        assert trace.sinks is None
    else:
        assert trace.logits_soft_cap is None
        np.testing.assert_array_equal(trace.sinks, np.stack([tensors[f"model.layers.{i}.self_attn.sinks"]
                                                             for i in range(L)]))
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
    ({"model_type": "phi3"}, "'phi3' is not supported \\(supported: llama, qwen2, qwen3, mistral, gemma2, "
                             "gemma3_text, gpt_oss\\)"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "'quantization_config' \\('mxfp4'\\) is not supported"),
    ({"model_type": "gemma3"}, "'gemma3' is not supported: a multimodal checkpoint.*gemma3_text"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope', not supported"),
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


@pytest.mark.parametrize("case", ["gemma2", "gpt_oss"])
def test_pcast_analyze_with_a_windowed_model_runs_end_to_end(tmp_path, capsys, case):
    """A right-padded batch recorded through the hook, then `pcast analyze TRACE --model FOLDER`: the windowed
    layer is analysed as it attends, and the end-to-end forward stays finite where a padded query's window
    holds only padded keys (that row outputs 0 and is not scored)."""
    analyze_recorded(tmp_path, write_checkpoint(tmp_path / case, *CASES[case])[0])
    printed = capsys.readouterr().out
    assert "1 of 2 layers attend within a local window (3 keys back)" in printed
    assert "End to end (FP32 perplexity" in printed and "`rev_s256` KL" in printed
