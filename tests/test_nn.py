"""pcast_jax.dot_product_attention: jax.nn's conventions, the kernel's forward, documented gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pcast_jax as pj
from pcast_jax import engine, nn
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError

B, T, S, N, K, H = 2, 8, 200, 4, 2, 16  # GQA: 4 query heads over 2 KV heads; S not a block multiple


def _qkv(seed=0, *, t=T, s=S, sink=7.0):
    """Random (B, T, N, H) queries and (B, S, K, H) keys/values; key 0 is a sink: every query's logit
    on it is ``sink`` (non-sink logits are about N(0, 1.2))."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, t, N, H)).at[..., 0].set(2.0)
    k = jax.random.normal(kk, (B, s, K, H))
    k = k.at[:, 0].set(0.0).at[:, 0, :, 0].set(sink * np.sqrt(H) / 2.0)
    v = jax.random.normal(kv, (B, s, K, H))
    return q, k, v


def test_exact_equals_jax_nn_with_gqa_bias_mask_and_causal():
    q, k, v = _qkv(t=S)  # T == S: jax.nn's causal mask is the bottom-right one
    bias = 0.3 * jax.random.normal(jax.random.PRNGKey(5), (1, N, S, S))
    mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.8, (B, 1, S, S))
    cases = ({}, {"bias": bias}, {"mask": mask}, {"is_causal": True}, {"bias": bias, "mask": mask, "is_causal": True})
    for kw in cases:
        ours = pj.dot_product_attention(q, k, v, **kw)
        ref = jax.nn.dot_product_attention(q, k, v, **kw)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-5, atol=2e-6, err_msg=str(list(kw)))
    unbatched = pj.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    np.testing.assert_allclose(np.asarray(unbatched), np.asarray(jax.nn.dot_product_attention(
        q[0], k[0], v[0], is_causal=True)), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("config", ["fwd_s1", "fa3", "sageattn2pp"])
@pytest.mark.parametrize("implementation", ["xla", "scan"])
def test_preset_equals_the_engine_head_by_head(config, implementation):
    q, k, v = _qkv()
    out = pj.dot_product_attention(q, k, v, config=config, implementation=implementation)
    assert out.shape == q.shape and out.dtype == q.dtype
    name = "xla" if implementation == "xla" else "scan"
    tiled = pj.preset_for(config, H)  # a preset name runs the tile of the input's head dim
    for b in range(B):
        for n in range(N):
            logits = q[b, :, n] @ k[b, :, n // (N // K)].T / np.sqrt(H)
            ref = engine.attention(logits, v[b, :, n // (N // K)], tiled, implementation=name).out
            np.testing.assert_allclose(np.asarray(out[b, :, n]), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_causal_alignment_top_left_by_default_bottom_right_on_request_and_config_causal_counts():
    q, k, v = _qkv()  # T = 8 < S = 200
    # the default is jax.nn's top-left mask, with or without a config
    np.testing.assert_allclose(np.asarray(pj.dot_product_attention(q, k, v, is_causal=True)),
                               np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)), rtol=2e-5, atol=2e-6)
    top = pj.dot_product_attention(q, k, v, is_causal=True, config="rev_s256")
    logits = q[0, :, 0] @ k[0, :, 0].T / np.sqrt(H)
    ref_top = engine.attention(logits, v[0, :, 0], pj.get_preset("rev_s256").replace(causal=True), q_offset=0).out
    np.testing.assert_allclose(np.asarray(top[0, :, 0]), np.asarray(ref_top), rtol=1e-5, atol=1e-6)
    # bottom-right: the kernels' alignment (query i at position S - T + i), also through a causal config
    out = pj.dot_product_attention(q, k, v, is_causal=True, config="rev_s256", causal_alignment="bottom_right")
    via_config = pj.dot_product_attention(q, k, v, config=pj.get_preset("rev_s256").replace(causal=True),
                                          causal_alignment="bottom_right")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(via_config))
    ref = engine.attention(logits, v[0, :, 0], pj.get_preset("rev_s256").replace(causal=True)).out
    np.testing.assert_allclose(np.asarray(out[0, :, 0]), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # the last query row sees every key: equal to the non-causal output there
    full = pj.dot_product_attention(q, k, v, config="rev_s256")
    np.testing.assert_allclose(np.asarray(out[:, -1]), np.asarray(full[:, -1]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out[:, 0]), np.asarray(full[:, 0]), atol=1e-3)
    assert not np.allclose(np.asarray(top[:, -1]), np.asarray(out[:, -1]), atol=1e-3)


@pytest.mark.parametrize("config", ["fwd_s1", "fa3", "sageattn2pp", "fa3_splitkv", "dynamic_pow2"])
def test_fully_masked_row_outputs_zero_under_a_config_and_averages_like_jax_nn_without(config):
    q, k, v = _qkv()
    mask = jnp.ones((B, 1, T, S), bool).at[:, :, 0].set(False)
    out = pj.dot_product_attention(q, k, v, mask=mask, config=config)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(np.asarray(out[:, 0]), 0.0)  # the kernel's epilogue: nothing visible -> 0
    exact = pj.dot_product_attention(q, k, v, mask=mask)
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(exact), np.asarray(ref), rtol=2e-5, atol=2e-6)
    assert float(jnp.max(jnp.abs(exact[:, 0]))) > 1e-3  # jax.nn averages V there


def test_jit_and_vmap():
    q, k, v = _qkv()
    eager = pj.dot_product_attention(q, k, v, config="fa3")
    jitted = jax.jit(lambda q, k, v: pj.dot_product_attention(q, k, v, config="fa3"))(q, k, v)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-7)
    stacked = jax.vmap(lambda q, k, v: pj.dot_product_attention(q, k, v, config="fa3"))(
        q[:, None], k[:, None], v[:, None])
    np.testing.assert_allclose(np.asarray(stacked[:, 0]), np.asarray(eager), rtol=1e-6, atol=1e-7)


def _loss(config, gradient="ste"):
    """A linear read-out of the output, so the cotangent does not depend on the forward value."""
    def f(q, k, v):
        out = pj.dot_product_attention(q, k, v, config=config, gradient=gradient)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(w * out)
    return f


def test_ste_gradient_is_the_exact_attention_gradient():
    q, k, v = _qkv()
    g_ste = jax.grad(_loss("fwd_s1"), argnums=(0, 1, 2))(q, k, v)
    g_exact = jax.grad(_loss(None), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ste, g_exact):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _check_smooth_gradient_against_finite_differences(cfg, sink: float, seed: int):
    """The backward pass of ``gradient="smooth"`` is the true derivative of the smooth surrogate
    (directional derivatives along random directions, central differences)."""
    q, k, v = _qkv(t=4, s=128, sink=sink)

    def surrogate(q, k, v):  # the forward the smooth gradient differentiates, on (B, N, T, H) inputs
        out = jnp.swapaxes(nn._smooth(q, k, v, None, None, cfg, 1 / np.sqrt(H), 0.2), 1, 2)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(w * out)

    grads = jax.grad(_loss(cfg, "smooth"), argnums=(0, 1, 2))(q, k, v)
    rng = np.random.default_rng(seed)
    for i, (x, g) in enumerate(zip((q, k, v), grads)):
        u = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        eps = 1e-2

        def shifted(sign, i=i, u=u, eps=eps):
            xs = [q, k, v]
            xs[i] = xs[i] + sign * eps * u
            return surrogate(*(nn._as_bnth(z) for z in xs))

        fd = (float(shifted(1.0)) - float(shifted(-1.0))) / (2 * eps)
        assert abs(float(jnp.vdot(g, u)) - fd) <= 2e-2 * abs(fd) + 1e-3, (i, float(jnp.vdot(g, u)), fd)


def test_smooth_gradient_matches_finite_differences_of_the_surrogate():
    _check_smooth_gradient_against_finite_differences(pj.get_preset("fwd_s1"), sink=5.0, seed=1)


def test_smooth_gradient_sees_p_collapse_where_ste_does_not():
    """Forward S = 1 at Δ = 9 zeroes most non-sink P: smooth gives the values of keys whose P is
    zeroed for every query almost no gradient; the straight-through estimate does not see it."""
    q, k, v = _qkv(sink=9.0)
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) / np.sqrt(H)
    p = jax.nn.softmax(logits, axis=-1) / jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1, keepdims=True)
    # P relative to the row max (the sink, seen first in forward order) well below 2^-10 everywhere
    gone = jnp.all((p < 2.0**-11).reshape(B, K, N // K * T, S), axis=2)  # (B, K, S)
    gone = jnp.swapaxes(gone, 1, 2)  # (B, S, K), like v's leading axes
    assert 0.3 < float(jnp.mean(gone)) < 0.99
    g_ste = jax.grad(_loss("fwd_s1", "ste"), argnums=2)(q, k, v)
    g_smooth = jax.grad(_loss("fwd_s1", "smooth"), argnums=2)(q, k, v)
    mass = lambda g: float(jnp.sum(jnp.where(gone[..., None], jnp.abs(g), 0.0)))  # noqa: E731
    assert mass(g_smooth) < 0.05 * mass(g_ste)
    # with S = 256 nothing underflows and the two gradients agree closely
    g_ste256 = jax.grad(_loss("fwd_s256", "ste"), argnums=2)(q, k, v)
    g_smooth256 = jax.grad(_loss("fwd_s256", "smooth"), argnums=2)(q, k, v)
    np.testing.assert_allclose(np.asarray(g_smooth256), np.asarray(g_ste256), rtol=0.05, atol=1e-3)


def test_triton_kernel_implementation_equals_the_simulator_on_fp8_inputs():
    q, k, v = (jnp.tile(x, (1, 1, 1, 2)) for x in _qkv(t=16, s=128))  # head dim 32: the kernel's smallest
    out = pj.dot_product_attention(q, k, v, config="fwd_s1", implementation="triton")
    sim = pj.dot_product_attention(q, k, v, config=pj.get_preset("fwd_s1").replace(qkv="e4m3"),
                                   implementation="scan")
    np.testing.assert_allclose(np.asarray(out), np.asarray(sim), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,needle", [
    ({"key_heads": 3}, "multiple of key/value heads"),
    ({"mask": jnp.ones((3, 3), bool)}, "mask.shape"),
    ({"implementation": "cudnn"}, "implementation"),
    ({"gradient": "exact"}, "gradient"),
    ({"config": "dynamic_pow2", "gradient": "smooth"}, "static scale"),
    ({"implementation": "triton"}, "needs a config"),
    ({"implementation": "triton", "config": "fwd_s1", "mask": jnp.ones((1, 1, 1, 1), bool)}, "take no mask"),
    ({"implementation": "triton", "config": "fwd_s1", "key_value_seq_lengths": jnp.array([9])},
     "take no key_value_seq_lengths"),
    ({"implementation": "triton", "config": "fwd_s1", "is_causal": True}, "causal_alignment='bottom_right'"),
    ({"mask": jnp.zeros((1, 1, 16, 128))}, "mask must be boolean.*bias="),
    ({"query_seq_lengths": jnp.array([1.5])}, "query_seq_lengths must be an integer array"),
    ({"key_value_seq_lengths": jnp.array([3, 4])}, r"key_value_seq_lengths must be .*\(1,\)"),
    ({"local_window_size": (2, -1)}, "local_window_size"),
    ({"local_window_size": "wide"}, "local_window_size"),
    ({"causal_alignment": "left"}, "causal_alignment"),
    ({"config": "fa9"}, "preset='fa9'"),
    ({"implementation": "mosaic", "config": KernelConfig(qkv="e4m3", qkv_granularity="head")},
     "one E4M3 descale per tensor"),
    ({"scale": -1.0}, "scale"),
])
def test_bad_input_names_the_parameter(kwargs, needle):
    kwargs = dict(kwargs)
    kh = kwargs.pop("key_heads", K)
    q = jnp.ones((1, 16, 6 if kh == 3 else N, H))
    k = jnp.ones((1, 128, 4 if kh == 3 else K, H))
    with pytest.raises(PcastError, match=needle):
        pj.dot_product_attention(q, k, k, **kwargs)


def test_flax_nnx_attention_fn():
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(1), (2, 64, 32)).at[:, 0].mul(12.0)

    def layer(fn=None):
        kw = {} if fn is None else {"attention_fn": fn}
        return nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0), **kw)

    exact = pj.nn.attention_fn(None)
    # outputs reach |12| (token 0 is scaled up): FP32 rounding of jax.nn's and our einsums is ~1e-6 there
    np.testing.assert_allclose(np.asarray(layer(exact)(x, is_causal=True)), np.asarray(layer()(x, is_causal=True)),
                               rtol=1e-5, atol=1e-5)
    fp8 = layer(pj.nn.attention_fn("fwd_s1"))(x, is_causal=True)
    assert bool(jnp.all(jnp.isfinite(fp8))) and not np.allclose(np.asarray(fp8), np.asarray(layer()(x, is_causal=True)))
    grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(layer(pj.nn.attention_fn("fwd_s1")))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    with pytest.raises(PcastError, match="input_positions"):
        pj.nn.attention_fn("fwd_s1")(x[:, :, None], x[:, :, None], x[:, :, None], input_positions=0)


# --- block-scaled P (MXFP8, NVFP4, SageAttention3): both gradients ------------------------------


@pytest.mark.parametrize("config", ["nvfp4_fakequant", "mxfp8_p", "sageattn3"])
def test_block_scaled_gradients_are_finite_and_ste_is_exact_attention(config):
    q, k, v = _qkv(t=4, s=128)
    g_exact = jax.grad(_loss(None), argnums=(0, 1, 2))(q, k, v)
    g_ste = jax.grad(_loss(config, "ste"), argnums=(0, 1, 2))(q, k, v)
    g_smooth = jax.grad(_loss(config, "smooth"), argnums=(0, 1, 2))(q, k, v)
    for a, b, c in zip(g_ste, g_exact, g_smooth):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        assert bool(jnp.all(jnp.isfinite(c))) and float(jnp.max(jnp.abs(c))) > 0


def test_block_scaled_smooth_gradient_matches_finite_differences_of_the_surrogate():
    """NVFP4 (both gates: element and block scale; MX runs the same code without the scale gate)."""
    cfg = pj.get_preset("nvfp4_fakequant").replace(scale=64.0)  # some block scales near underflow
    _check_smooth_gradient_against_finite_differences(cfg, sink=9.0, seed=2)


def test_block_scaled_smooth_gradient_sees_the_block_scale_collapse():
    """NVFP4 without the row normalization (S = 1) at Δ = 9: a block whose largest P is below
    6·2^-10 gets a zero UE4M3 scale, so most non-sink values lose their gradient under the smooth
    surrogate; with the 448·6 normalization (Model Optimizer) no scale underflows and only the
    element floor (x ≤ a/24, tiny P) is gated, so smooth and straight-through nearly agree."""
    q, k, v = _qkv(sink=9.0)
    s1 = pj.KernelConfig(p_format="nvfp4", scale=1.0, block_kv=64)

    def nonsink_mass(config, gradient):
        g = jax.grad(_loss(config, gradient), argnums=2)(q, k, v)
        return float(jnp.sum(jnp.abs(g[:, 1:])))

    # the exact forward of S = 1 does zero most non-sink P here (what the gradient should see)
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) / np.sqrt(H)
    res = engine.attention(logits.reshape(-1, T, S)[0], v[0, :, 0], s1, count_mask=jnp.arange(S) > 0)
    assert float(jnp.mean(res.n_zeroed / res.n_counted)) > 0.5
    assert nonsink_mass(s1, "smooth") < 0.3 * nonsink_mass(s1, "ste")
    assert nonsink_mass("nvfp4_fakequant", "smooth") > 0.85 * nonsink_mass("nvfp4_fakequant", "ste")


def _jax_nn_cases():
    """Inputs both jax.nn.dot_product_attention and ours accept: every argument of jax.nn's."""
    b, t, s = 2, 24, 40
    mask = np.array(jax.random.bernoulli(jax.random.PRNGKey(7), 0.7, (b, 1, t, s)))
    mask[0, 0, 5] = False  # one row with every key masked
    bias = np.asarray(0.5 * jax.random.normal(jax.random.PRNGKey(8), (1, N, t, s)), np.float32)
    lens_q, lens_kv = np.array([20, 24], np.int32), np.array([31, 40], np.int32)
    return {
        "plain": {}, "bias": {"bias": bias}, "mask": {"mask": mask}, "causal_T<S": {"is_causal": True},
        "causal_mask_bias": {"is_causal": True, "mask": mask, "bias": bias},
        "kv_lengths": {"key_value_seq_lengths": lens_kv},
        "q_and_kv_lengths": {"query_seq_lengths": lens_q, "key_value_seq_lengths": lens_kv, "is_causal": True},
        "window_int": {"local_window_size": 3}, "window_pair": {"local_window_size": (4, 1), "is_causal": True},
        "scale": {"scale": 0.37},
    }


@pytest.mark.parametrize("name", ["plain", "bias", "mask", "causal_T<S", "causal_mask_bias", "kv_lengths",
                                  "q_and_kv_lengths", "window_int", "window_pair", "scale"])
def test_config_none_equals_jax_nn_on_every_argument(name):
    kw = _jax_nn_cases()[name]
    q, k, v = _qkv(t=24, s=40)
    ours = pj.dot_product_attention(q, k, v, **kw)
    ref = jax.nn.dot_product_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-5, atol=2e-6)
    out, lse = pj.dot_product_attention(q, k, v, return_residual=True, **kw)
    ref_out, ref_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-6)
    assert lse.shape == ref_lse.shape
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-5, atol=2e-5)
    # under a config the same arguments run the kernel: finite, and the FP32-Q/K/V kernel is near
    fp8 = pj.dot_product_attention(q, k, v, config="fa3", **kw)
    assert bool(jnp.all(jnp.isfinite(fp8)))


def test_traced_scale_under_jit_works_and_gets_a_gradient():
    q, k, v = _qkv()
    f = jax.jit(lambda s: jnp.sum(pj.dot_product_attention(q, k, v, scale=s, config="fa3") ** 2))
    direct = jnp.sum(pj.dot_product_attention(q, k, v, scale=0.2, config="fa3") ** 2)
    np.testing.assert_allclose(float(f(jnp.float32(0.2))), float(direct), rtol=1e-6)
    g = jax.grad(f)(jnp.float32(0.2))
    assert bool(jnp.isfinite(g)) and float(g) != 0.0


def test_attention_weights_take_the_drop_ins_window_and_lengths():
    """probs · V with a local window and key lengths is jax.nn's output with the same arguments."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32) for _ in range(3))
    kv_lens = jnp.array([6, 4], jnp.int32)
    probs, kernel = pj.attention_weights(q, k, local_window_size=(2, 0), key_value_seq_lengths=kv_lens,
                                         is_causal=True, config="fwd_s1")
    want = jax.nn.dot_product_attention(q, k, v, local_window_size=(2, 0), key_value_seq_lengths=kv_lens,
                                        is_causal=True)
    got = jnp.einsum("bnts,bsnh->btnh", probs, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert float(jnp.max(jnp.abs(jnp.triu(probs[0, 0], 1)))) == 0.0  # causal
    assert float(jnp.max(jnp.abs(probs[0, 0, 5, :3]))) == 0.0  # the window hides keys more than 2 back
    assert kernel.shape == probs.shape


def test_implementation_cudnn_names_the_simulated_presets():
    q = jnp.ones((1, 4, 1, 8), jnp.float32)
    with pytest.raises(PcastError, match="implementation='cudnn'.*cudnn_fp8_tau0.*cudnn_fp8"):
        pj.dot_product_attention(q, q, q, implementation="cudnn", config="fa3")


def test_sinks_a_jitted_caller_closes_over_are_checked_and_used():
    """A concrete sinks array captured by a jitted function: the same output as passing it, and a NaN in
    it is refused when the function is traced (no TracerBoolConversionError)."""
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 16)), jnp.float32)
    sinks = jnp.array([1.0, -2.0], jnp.float32)
    direct = pj.dot_product_attention(q, q, q, sinks=sinks, config="fa3")
    closed = jax.jit(lambda x: pj.dot_product_attention(x, x, x, sinks=sinks, config="fa3"))(q)
    np.testing.assert_allclose(np.asarray(closed), np.asarray(direct), rtol=1e-6, atol=1e-7)
    bad = jnp.array([1.0, jnp.nan], jnp.float32)
    with pytest.raises(PcastError, match="sinks contains NaN"):
        jax.jit(lambda x: pj.dot_product_attention(x, x, x, sinks=bad, config="fa3"))(q)


def test_logits_soft_cap_is_applied_before_the_mask_on_every_path():
    """cap·tanh(logits/cap) after the scale and bias, before the mask (tokamax's logits_soft_cap): the
    exact path equals a float64 NumPy softmax of the capped logits, a config equals the independent
    oracle run on those capped logits, a key a bias hides stays hidden, and the cap is checked."""
    import oracle

    q, k, v = _qkv(t=S, sink=12.0)
    cap = 6.0
    hidden = np.zeros((S, S), np.float32)
    hidden[:, 5] = np.finfo(np.float32).min  # a key the bias hides
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    group = N // K
    want_exact, want_kernel, raw = [], [], []
    for b in range(B):
        heads_exact, heads_kernel, heads_raw = [], [], []
        for n in range(N):
            s = qn[b, :, n] @ kn[b, :, n // group].T / np.sqrt(H)
            visible = (np.arange(S)[None, :] <= np.arange(S)[:, None]) & (np.arange(S)[None, :] != 5)
            for logits, out in ((cap * np.tanh(s / cap), heads_exact), (s, heads_raw)):
                seen = np.where(visible, logits, -np.inf)
                p = np.exp(seen - seen.max(1, keepdims=True))
                out.append((p / p.sum(1, keepdims=True)) @ vn[b, :, n // group])
            heads_kernel.append(oracle.attention(cap * np.tanh(s / cap), vn[b, :, n // group], visible=visible,
                                                 **oracle.config_kwargs(pj.get_preset("fwd_s1"))).out)
        want_exact.append(np.stack(heads_exact, 1))
        want_kernel.append(np.stack(heads_kernel, 1))
        raw.append(np.stack(heads_raw, 1))
    exact = nn.dot_product_attention(q, k, v, hidden, is_causal=True, logits_soft_cap=cap)
    np.testing.assert_allclose(np.asarray(exact), np.stack(want_exact), rtol=1e-4, atol=1e-5)
    assert np.abs(np.stack(raw) - np.stack(want_exact)).max() > 0.05  # the cap changes the output
    kernel = nn.dot_product_attention(q, k, v, hidden, is_causal=True, logits_soft_cap=cap, config="fwd_s1")
    np.testing.assert_allclose(np.asarray(kernel), np.stack(want_kernel), rtol=2e-3, atol=2e-3)
    probs, _ = nn.attention_weights(q, k, hidden, is_causal=True, logits_soft_cap=cap)
    assert float(jnp.max(probs[..., 5])) == 0.0  # hidden under the cap too
    for bad in (0.0, -1.0, float("nan"), jnp.ones(2)):
        with pytest.raises(PcastError, match="logits_soft_cap"):
            nn.dot_product_attention(q, k, v, logits_soft_cap=bad)
    with pytest.raises(PcastError, match="take no logits_soft_cap"):
        nn.dot_product_attention(q, k, v, logits_soft_cap=cap, config="fwd_s1", implementation="triton")


def _count_calls(monkeypatch, owner, name: str, calls: dict) -> None:
    """Count the calls of ``owner.name`` under ``calls[name]``, wherever the package imported it by name."""
    import sys

    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    calls[name] = 0
    holders = [owner] + [m for n, m in list(sys.modules.items())
                         if n.startswith(("pcast_jax", "pallas_kernels")) and getattr(m, name, None) is real]
    for holder in holders:
        monkeypatch.setattr(holder, name, counted)


def test_a_call_resolves_and_binds_its_config_once(monkeypatch):
    """Each entry point resolves the caller's config once (presets.resolve: one preset look-up) and binds it
    once (engine.bound, one KernelConfig.bind); the engine takes the bound config as it is, never resolving or
    binding again (engine.attention_qkv resolved it three times before)."""
    from pcast_jax import presets

    calls: dict = {}
    for owner, name in ((presets, "resolve"), (presets, "get_preset"), (engine, "bound"), (KernelConfig, "bind")):
        _count_calls(monkeypatch, owner, name, calls)
    q, k, v = (x[:1, :, :2, :] for x in _qkv(t=4, s=8))
    entries = {"dot_product_attention": lambda q, k, v: nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                 config="fa3"),
               "dot_product_attention scan": lambda q, k, v: nn.dot_product_attention(q, k, v, config="fa3",
                                                                                      implementation="scan"),
               "attention_weights": lambda q, k, v: nn.attention_weights(q, k, is_causal=True, config="fa3"),
               "engine.attention_qkv": lambda q, k, v: engine.attention_qkv(q[0, :, 0], k[0, :, 0], v[0, :, 0],
                                                                            "fa3")}
    for entry, call in entries.items():
        for name in calls:
            calls[name] = 0
        jax.eval_shape(call, q, k, v)  # traced once, nothing compiled or run: every call the Python makes
        assert calls == {"resolve": 1, "get_preset": 1, "bound": 1, "bind": 1}, entry
