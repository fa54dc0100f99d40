"""Learned sinks, the lazy rescale and saturation, cuDNN (JAX's FP8 attention).

Held to the independent oracle (``tests/oracle.py``, which implements the sink placements and the
lazy rescale from their description, sharing no code with the package), and the closed forms of
``theory.py`` held to simulation: the three predictions of the learned-sink placement (KV order no
longer matters under the initial-max placement; S = 256 moves the threshold to 10 ln 2 + ln 256; split-KV
divides the collapse by the number of segments) and the saturation bound of a lagging running max.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import pcast_jax as pj
from pcast_jax import engine, jax_fp8, nn, presets, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS

import oracle
from cases import shared_program

Q, N, D = 8, 300, 16  # N not a multiple of any tile: padding is exercised
OUT_RTOL = 3e-6


@functools.lru_cache(maxsize=None)
def _instance(seed: int = 0, delta: float = 0.0, k_sink: int = 0, sigma: float = 1.0):
    rng = np.random.default_rng(seed)
    s, v, mask = oracle.sink_scores(rng, q=Q, n=N, d=D, delta=delta, k_sink=k_sink)
    return (s * np.float32(sigma)).astype(np.float32), v, mask


def _assert_matches_oracle(res, ref):
    out = np.asarray(res.out, np.float64)
    tol = OUT_RTOL * np.max(np.abs(ref.out)) + ref.out_slack
    assert not np.any(np.abs(out - ref.out) > tol), f"worst {np.max(np.abs(out - ref.out) - tol):.3g} past tolerance"
    assert np.all(np.abs(np.asarray(res.n_zeroed) - ref.n_zeroed) <= ref.zeroed_slack)
    np.testing.assert_allclose(np.asarray(res.row_sum), ref.row_sum, rtol=1e-5)
    assert np.all(np.abs(np.asarray(res.zeroed_mass, np.float64) - ref.zeroed_mass) <= ref.mass_tolerance())
    np.testing.assert_array_equal(np.asarray(res.n_saturated), ref.n_saturated)
    assert np.all(np.abs(np.asarray(res.saturated_mass, np.float64) - ref.saturated_mass)
                  <= ref.mass_tolerance("saturated"))


# (scale mode, lazy rescale) variant × sink placement × order × split layout: 18 configs in which every
# pair of values of two of these four meets (a pairwise covering; the whole product would be 108). The
# variant and the placement run through their 18 pairs; the split layout turns with both, the order
# with the placement and the scale mode.
_VARIANTS = [(mode, scale, tau, unit, comp)
             for (mode, scale) in (("multiply", 1.0), ("exponent", 256.0))
             for (tau, unit, comp) in ((0.0, "log2", "none"), (4.0, "log2", "none"), (4.0, "natural", "pow2"))]
_PLACEMENTS = ("epilogue", "init_max", "block_max")
_ORDERS = ("forward", "reverse")
_SPLITS = ((1, "contiguous"), (4, "contiguous"), (3, "strided"))
_CELLS = [(v, p, (p + v) % 3, (p + v // 3) % 2) for v in range(len(_VARIANTS)) for p in range(len(_PLACEMENTS))]
GRID = [
    KernelConfig(order=_ORDERS[o], scale=scale, scale_mode=mode, block_kv=32, sink_mode=_PLACEMENTS[p],
                 kv_splits=_SPLITS[sp][0], split_layout=_SPLITS[sp][1], rescale_threshold=tau, rescale_unit=unit,
                 rescale_compensation=comp)
    for v, p, sp, o in _CELLS
    for (mode, scale, tau, unit, comp) in (_VARIANTS[v],)
]


def test_the_grid_meets_every_pair_of_values():
    sizes = (len(_VARIANTS), len(_PLACEMENTS), len(_SPLITS), len(_ORDERS))
    for a, b in itertools.combinations(range(4), 2):
        assert {(c[a], c[b]) for c in _CELLS} == set(itertools.product(range(sizes[a]), range(sizes[b]))), (a, b)
    assert len({c.name for c in GRID}) == len(GRID) == 18


_run = shared_program(lambda cfg, engine_name: lambda s, v, m, sink: engine.attention(
    s, v, cfg, implementation=engine_name, count_mask=m, sink_logit=sink))


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
@pytest.mark.parametrize("cfg", GRID, ids=[c.name for c in GRID])
def test_sink_placements_and_lazy_rescale_match_the_oracle(cfg, engine_name):
    s, v, mask = _instance(1, delta=3.0, k_sink=2, sigma=2.0)  # wide logits: the lazy rescale saturates
    for sink in (1.5, 9.0):
        ref = oracle.attention(s, v, count_mask=mask, sink_logit=sink, **oracle.config_kwargs(cfg))
        _assert_matches_oracle(_run(cfg, engine_name)(s, v, mask, jnp.float32(sink)), ref)


def test_the_grid_saturates_and_zeroes_somewhere():
    """The grid above is not vacuous: some of its cells saturate and some zero most of the non-sink P."""
    s, v, mask = _instance(1, delta=3.0, k_sink=2, sigma=2.0)
    sat = [oracle.attention(s, v, count_mask=mask, sink_logit=1.5, **oracle.config_kwargs(c)).n_saturated.sum()
           for c in GRID if c.rescale_threshold and c.scale == 256.0]
    assert max(sat) > 0
    init = next(c for c in GRID if c.sink_mode == "init_max" and c.kv_splits == 1 and c.scale == 1.0)
    zeroed = oracle.attention(s, v, count_mask=mask, sink_logit=9.0, **oracle.config_kwargs(init))
    assert zeroed.n_zeroed.sum() > 0.3 * mask.sum() * Q


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_with_a_learned_sink_matches_the_oracle(preset):
    """Every preset, with one learned sink logit per head and a masked row, through the xla implementation."""
    cfg = PRESETS[preset]
    s, v, mask = _instance(2, delta=6.0, k_sink=3)
    s = s.copy()
    s[2] = -np.inf  # a row with nothing visible: output 0, whatever the placement
    res = _run(cfg, "xla")(s, v, mask, jnp.float32(7.0))
    assert np.all(np.isfinite(np.asarray(res.out))) and np.all(np.asarray(res.out[2]) == 0.0)
    ref = oracle.attention(s, v, count_mask=mask, sink_logit=7.0, **oracle.config_kwargs(cfg))
    out = np.asarray(res.out, np.float64)
    tol = OUT_RTOL * np.max(np.abs(ref.out)) + ref.out_slack
    if cfg.accumulator == "f16" or cfg.mma_acc_bits:  # their own rounding models: tests/test_fidelity.py
        tol = tol + 1e-3 * np.max(np.abs(ref.out))
    assert not np.any(np.abs(out - ref.out) > tol)
    assert np.all(np.abs(np.asarray(res.n_zeroed) - ref.n_zeroed) <= ref.zeroed_slack)


def test_reference_with_a_learned_sink_is_the_softmax_with_a_dropped_column():
    s, v, _ = _instance(3)
    sink = np.float32(2.5)
    full = np.concatenate([np.full((Q, 1), sink), s], axis=1).astype(np.float64)
    p = np.exp(full - full.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True))[:, 1:]
    np.testing.assert_allclose(np.asarray(engine.reference_probs(s, sink_logit=sink)), p, rtol=2e-5, atol=1e-9)
    # equal logits 0 under a sink of 2.5. A kernel whose running max holds the sink computes every P as
    # e^-2.5, which casts to one E4M3 value p8; ℓ = 1 + N·e^-2.5 holds the sink once, so its output is the
    # reference times p8 / P exactly. An epilogue kernel's P are e^0 = 1, exact: the reference itself.
    p = math.exp(-2.5)
    p8 = float(np.asarray(pj.formats.cast(np.float32(p), "e4m3")))
    assert p8 != pytest.approx(p, rel=1e-3)
    ref = np.asarray(engine.reference_attention(s * 0.0, v, sink_logit=sink))
    for mode, splits, factor in (("epilogue", 2, 1.0), ("init_max", 1, p8 / p), ("block_max", 2, p8 / p)):
        cfg = KernelConfig(sink_mode=mode, kv_splits=splits)
        for name in engine.IMPLEMENTATIONS:  # jitted: one program each, where eager dispatch compiles every op
            out = jax.jit(lambda s_, v_, c=cfg, i=name: engine.attention(s_, v_, c, implementation=i,
                                                                          sink_logit=sink).out)(s * 0.0, v)
            np.testing.assert_allclose(np.asarray(out), ref * factor, rtol=2e-5, atol=1e-8, err_msg=f"{mode} {name}")


# --------------------------------------------------------------------------------------------
# The three predictions of the initial-max placement (theory.learned_sink_collapse_fraction)
# --------------------------------------------------------------------------------------------


def _sweep_fraction(cfg, delta_l, *, n=4096, seeds=4):
    """Zeroed fraction of non-sink P (learned sink only) over ``seeds`` draws of N(0, 1) logits, and its count."""
    w = pj.SinkWorkload(n=n, q_len=32, d=16, k_sink=0, sink_logit=delta_l)
    zeroed, counted = 0, 0
    for seed in range(seeds):
        inst = pj.make_instance(jax.random.PRNGKey(seed), w, 0.0, draw_v=False)
        r = engine.weights_and_stats(inst.scores, cfg, sink_logit=inst.sink_logit)
        zeroed += int(jnp.sum(r.n_zeroed))
        counted += int(jnp.sum(r.n_counted))
    return zeroed / counted, counted


def test_initial_max_collapse_does_not_depend_on_kv_order():
    """Reverse order is no fix once the sink is the initial max: the zeroed sets are the same."""
    base = presets.get_preset("vllm_triton_fp8")
    s, v, mask = _instance(4)
    fwd = engine.attention(s, v, base, sink_logit=9.0)
    rev = engine.attention(s, v, base.replace(order="reverse"), sink_logit=9.0)
    np.testing.assert_array_equal(np.asarray(fwd.n_zeroed), np.asarray(rev.n_zeroed))
    assert int(jnp.sum(fwd.n_zeroed)) > 0.9 * Q * N
    # whereas token sinks at the same strength are fixed by reverse order (the paper's finding)
    s2, v2, mask2 = _instance(4, delta=9.0, k_sink=4)
    fwd_t = engine.attention(s2, v2, base, count_mask=mask2)
    rev_t = engine.attention(s2, v2, base.replace(order="reverse"), count_mask=mask2)
    assert int(jnp.sum(rev_t.n_zeroed)) < 0.1 * int(jnp.sum(fwd_t.n_zeroed))
    # and an epilogue kernel never puts the sink in its max: nothing zeroed by it
    epi = engine.attention(s, v, base.replace(sink_mode="epilogue"), sink_logit=9.0)
    assert int(jnp.sum(epi.n_zeroed)) < 0.01 * Q * N


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_s256_threshold_sits_at_10ln2_plus_ln256(order):
    """F_L = Φ(Δ_L − 10 ln 2 − ln S): half the non-sink P zeroed at Δ_L,c = 12.48 for S = 256, either order."""
    cfg = KernelConfig(order=order, scale=256.0, block_kv=128, sink_mode="init_max")
    crit = float(theory.learned_sink_critical_delta(256.0))
    assert crit == pytest.approx(10 * math.log(2) + math.log(256), abs=1e-5)
    for delta_l in (crit - 1.0, crit, crit + 1.0):
        frac, count = _sweep_fraction(cfg, delta_l)
        pred = float(theory.learned_sink_collapse_fraction(delta_l, 256.0))
        # rows share their draws: a generous 6 binomial standard errors plus 0.005 for the ties at 2^-10
        assert abs(frac - pred) < 6 * math.sqrt(pred * (1 - pred) / count) * 8 + 0.005, (delta_l, frac, pred)


@pytest.mark.parametrize("segments", [2, 4, 8])
def test_split_kv_divides_the_collapse_by_the_segments(segments):
    """Only segment 0 starts from the sink: F ≈ F_L / n_segments (vLLM's 3-D path)."""
    cfg = presets.get_preset("vllm_triton_fp8").replace(kv_splits=segments)
    one, _ = _sweep_fraction(cfg.replace(kv_splits=1), 9.0)
    split, _ = _sweep_fraction(cfg, 9.0)
    pred = float(theory.learned_sink_collapse_fraction(9.0, 1.0, n_segments=segments))
    assert one == pytest.approx(float(theory.learned_sink_collapse_fraction(9.0, 1.0)), abs=0.01)
    assert split == pytest.approx(pred, abs=0.01), (split, pred)
    # a block_max kernel (the sink folded into every block's max) keeps the whole collapse under splits
    folded, _ = _sweep_fraction(cfg.replace(sink_mode="block_max"), 9.0)
    assert folded == pytest.approx(one, abs=0.005)


def test_learned_sink_theory_is_differentiable():
    g = jax.grad(lambda d, s, sig: theory.learned_sink_collapse_fraction(d, s, sigma=sig), argnums=(0, 1, 2))
    gd, gs, gsig = g(7.0, 1.0, 1.0)
    assert float(gd) == pytest.approx(float(stats.norm.pdf(7.0 - 10 * math.log(2))), rel=1e-4)
    assert float(gs) == pytest.approx(-float(gd), rel=1e-4)  # d/dS at S = 1 is −φ(·)/S
    assert np.isfinite(float(gsig))


# --------------------------------------------------------------------------------------------
# Lazy rescale and saturation
# --------------------------------------------------------------------------------------------


def test_saturation_free_scale_reproduces_what_the_kernels_chose():
    """2^⌊log2 448 − τ⌋: FlashInfer CuTe-DSL's τ = 8 → 1, FA4 PR #2717's τ = 4 → 16, vLLM's FA4 fork's
    τ = 0.75 → 256; cuDNN's τ = 4 nats with its 2^-τ compensation → scale_s 128."""
    assert float(theory.saturation_free_scale(8.0)) == 1.0
    assert float(theory.saturation_free_scale(4.0)) == 16.0
    assert float(theory.saturation_free_scale(0.75)) == 256.0
    assert float(theory.saturation_free_scale(4.0, unit="natural", compensation="pow2")) == 128.0
    assert float(theory.max_scaled_p(256.0, 4.0)) == pytest.approx(4096.0)


def _staircase(gap_nats: float, block: int):
    """Two visible blocks per row: the second's max exceeds the first's by ``gap_nats`` (others far below)."""
    s = np.full((Q, 2 * block), -30.0, np.float32)
    s[:, 0] = 0.0
    s[:, block] = gap_nats
    return s


@pytest.mark.parametrize("preset", [n for n, c in PRESETS.items() if c.rescale_threshold])
def test_a_preset_saturates_exactly_when_its_bound_exceeds_the_format_max(preset):
    """Theory's max_scaled_p decides whether a lag just under τ can saturate; the simulator agrees, and the
    row sum keeps the unclipped P (so the output shrinks by the clipped share)."""
    cfg = PRESETS[preset]
    bound = float(theory.max_scaled_p(cfg.scale, cfg.rescale_threshold, unit=cfg.rescale_unit,
                                      compensation=cfg.rescale_compensation))
    s = _staircase(0.999 * cfg.rescale_gap, cfg.block_kv)
    if cfg.order == "reverse":
        s = s[:, ::-1].copy()
    v = np.ones((s.shape[1], 4), np.float32)
    r = engine.attention(s, v, cfg.replace(kv_splits=1))
    ref = oracle.attention(s, v, **oracle.config_kwargs(cfg.replace(kv_splits=1)))
    np.testing.assert_array_equal(np.asarray(r.n_saturated), ref.n_saturated)
    if bound * 0.999 > cfg.fmt.max:
        assert np.all(np.asarray(r.n_saturated) == 1)
        assert np.all(np.asarray(r.out) < 0.999)  # ℓ unclipped: the saturated key's share is lost
        assert float(jnp.min(r.saturated_mass)) > 0.5
    else:
        assert int(jnp.sum(r.n_saturated)) == 0


def test_fa4_history_saturation_metric_in_a_sweep():
    """FA4 with τ = 4 and S = 256 (PR #2109) saturates on wide logits; PR #2717 (S = 16) and the current
    FA4 (τ = 0) do not; old result folders without the saturation metrics still load."""
    spec = pj.SweepSpec(configs=("fa4_pr2109", "fa4_pr2717", "fa4"), deltas=(4.0,), ns=(1024,), seeds=2, q_len=8,
                        d=16, sigma=3.0, sampled_mse=False)
    from pcast_jax.sweep.compute import compute_chunk

    vals = compute_chunk(spec, 1024, 0, 2)
    sat = np.asarray(vals["frac_saturated"])  # (seeds, deltas, configs)
    assert np.all(sat[..., 0] > 0) and np.all(sat[..., 1:] == 0)
    assert {"frac_saturated", "saturated_mass"} <= set(vals)


def test_preset_registry_is_one_home_and_keeps_its_fingerprint():
    assert sorted(n for names in presets.FAMILIES.values() for n in names) == sorted(PRESETS)
    # a change to any of these presets' semantics (or to the results format) changes this fingerprint
    old = ("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256", "fa3", "fa4", "flashinfer_sm90", "trtllm_xqa",
           "trtllm_xqa_multiblock", "fa3_splitkv", "sageattn2", "sageattn2pp", "hpc_ops_prior", "hpc_ops",
           "dynamic_pow2", "sageattn3", "nvfp4_fakequant", "mxfp8_p")
    assert pj.SweepSpec(configs=old).fingerprint() == PINNED_FINGERPRINT
    for name in presets.tagged("sinks_and_rescale"):
        assert name not in old and PRESETS[name].name == name


def test_jax_fp8_prediction_matches_theory_and_names_bad_input():
    # the older reference (a τ in nats, no GPU): S_eff = scale_s·2^-τ, the sink as the initial max
    r = jax_fp8.predict(fp8_params={"scale_s": np.float32(1.0)}, sinks=[3.0, 5.0, 9.0], seq_len=2048, seeds=2,
                        rescale_threshold=4.0)
    assert r.scale_s_reaches_p and r.config.effective_scale == 2.0**-4
    np.testing.assert_allclose(r.frac_zeroed, r.theory_frac_zeroed, atol=0.02)
    assert r.safe_scale_s == 128.0 and r.max_scaled_p == pytest.approx(math.exp(4) / 16, rel=1e-5)
    assert "scale_s = 128" in r.summary()
    with pytest.raises(PcastError, match="scale_s"):
        jax_fp8.predict(fp8_params={"scale_q": 1.0})
    with pytest.raises(PcastError, match="head_dim"):
        jax_fp8.predict(head_dim=72)
    with pytest.raises(PcastError, match="sinks"):
        jax_fp8.predict(sinks=[float("nan")])
    # with scale_s = 448 (Transformer Engine's delayed scaling) a lag of 4 nats saturates on wide logits
    assert jax_fp8.predict(scale_s=448.0, seq_len=512, seeds=2, rescale_threshold=4.0).max_scaled_p > 448


@pytest.mark.parametrize("gpu, preset", [("blackwell", "cudnn_sm100_fp8"), ("sm120", "cudnn_sm120_fp8")])
def test_jax_fp8_on_the_open_kernels_says_scale_s_does_not_reach_p(gpu, preset):
    """cuDNN's open SM100 / SM120 FP8 kernels cast P at the baked S = 16 and ignore scale_s: the answer is the
    same at every scale_s (simulated, bit for bit), recommends none, and says which engine it is about."""
    kw = dict(sinks=[3.0, 9.0], seq_len=1024, seeds=2, gpu=gpu)
    one, big = jax_fp8.predict(scale_s=1.0, **kw), jax_fp8.predict(scale_s=256.0, **kw)
    assert one.config == big.config == PRESETS[preset] and not one.scale_s_reaches_p
    np.testing.assert_array_equal(one.zeroed_mass, big.zeroed_mass)
    np.testing.assert_array_equal(one.frac_saturated, big.frac_saturated)
    assert one.safe_scale_s is None and one.safe_critical_delta is None
    assert one.max_scaled_p == 256.0  # 2^(P_CAST_LOG2_SCALE + τ): the kernel's own bound, below 448
    # the sink joins the denominator only: nothing is zeroed by it, so no closed form for the initial max
    assert np.all(np.isnan(one.theory_frac_zeroed)) and np.all(one.frac_zeroed < 1e-3)
    text = big.summary()
    assert "scale_s = 256 is accepted and ignored" in text and "No scale_s to choose" in text
    assert "open" in text.splitlines()[0] and "assumption" in text.splitlines()[0]
    with pytest.raises(PcastError, match="bakes τ = 4 in log2 units"):
        jax_fp8.predict(rescale_threshold=4.0, gpu=gpu, seeds=2)


def test_the_open_kernels_bias_is_the_saturation_free_scale_of_their_tau():
    """The comment's invariant τ + log2 S ≤ log2 448: the baked S = 16 is the largest power of two a lag of
    τ = 4 (log2) cannot saturate."""
    from pcast_jax.presets import cudnn

    assert theory.saturation_free_scale(cudnn.OPEN_RESCALE_THRESHOLD) == 2.0**cudnn.P_CAST_LOG2_SCALE
    for name in ("cudnn_sm100_fp8", "cudnn_sm100_fp8_e5m2", "cudnn_sm120_fp8"):
        cfg = PRESETS[name]
        assert (cfg.scale, cfg.scale_mode, cfg.rescale_threshold, cfg.rescale_unit, cfg.sink_mode) == (
            16.0, "exponent", 4.0, "log2", "epilogue")


def test_drop_in_sinks_match_the_dropped_column_softmax_and_are_differentiable():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (1, 24, 2, 16))
    k = jax.random.normal(k2, (1, 24, 1, 16))
    v = jax.random.normal(k3, (1, 24, 1, 16))
    sinks = jnp.array([0.5, 6.0])
    out = nn.dot_product_attention(q, k, v, sinks=sinks, is_causal=True)
    logits = jnp.einsum("btnh,bsh->bnts", q, k[:, :, 0]) / 4.0
    logits = jnp.where(jnp.tril(jnp.ones((24, 24), bool)), logits, -jnp.inf)
    col = jnp.broadcast_to(sinks[None, :, None, None], (1, 2, 24, 1))
    p = jax.nn.softmax(jnp.concatenate([col, logits], -1), -1)[..., 1:]
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.einsum("bnts,bsh->btnh", p, v[:, :, 0])),
                               rtol=1e-5, atol=1e-6)
    sim = jax.jit(lambda s_: nn.dot_product_attention(q, k, v, sinks=s_, is_causal=True,
                                                      config="cudnn_fp8_tau0"))(sinks)
    assert bool(jnp.all(jnp.isfinite(sim)))
    g = jax.grad(lambda s_: jnp.sum(nn.dot_product_attention(q, k, v, sinks=s_, is_causal=True,
                                                            config="fwd_s256") ** 2))(sinks)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g[0])) > 0
    with pytest.raises(PcastError, match="sinks"):
        nn.dot_product_attention(q, k, v, sinks=jnp.zeros(3))
    with pytest.raises(PcastError, match="sinks"):
        nn.dot_product_attention(q, k, v, sinks=jnp.array([0.0, float("nan")]))
    # the Pallas kernels take the sinks too (interpret mode here): the simulator's numbers. Inputs are
    # multiples of 1/4 with amax 1.75 = 448·2^-8, so the kernels' per-tensor E4M3 quantization is exact.
    rng = np.random.default_rng(3)
    q64, k64, v64 = (jnp.asarray(np.where(np.arange(64) == 0, 1.75, rng.integers(-7, 8, shape) / 4.0), jnp.float32)
                     for shape in ((1, 64, 2, 64), (1, 64, 1, 64), (1, 64, 1, 64)))

    def drop_in(impl):  # jitted: one program each, where eager dispatch compiles every op
        return jax.jit(lambda s_: nn.dot_product_attention(q64, k64, v64, sinks=s_, config="vllm_triton_fp8",
                                                           implementation=impl))(sinks)

    sim = drop_in("scan")
    for impl in ("triton", "mosaic"):
        ker = drop_in(impl)
        np.testing.assert_allclose(np.asarray(ker), np.asarray(sim), rtol=1e-5, atol=1e-6, err_msg=impl)


def test_new_fields_validate_and_round_trip():
    cfg = PRESETS["cudnn_fp8"]
    assert KernelConfig.from_string(cfg.to_string()) == cfg
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig(rescale_threshold=0.0, rescale_unit="natural") == KernelConfig()  # τ = 0: unit idle
    for bad in ({"sink_mode": "middle"}, {"rescale_threshold": -1.0}, {"rescale_threshold": float("nan")},
                {"rescale_unit": "bits"}, {"rescale_compensation": "yes"}):
        with pytest.raises(PcastError, match=next(iter(bad))):
            KernelConfig(**bad)
    with pytest.raises(PcastError, match="sink_logit"):
        pj.SinkWorkload(sink_logit="half")
    s, v, _ = _instance(5)
    with pytest.raises(PcastError, match="sink_logit"):
        engine.attention(s, v, "fwd_s1", sink_logit=float("inf"))
    with pytest.raises(PcastError, match="sink_logit"):
        engine.attention(s[None].repeat(2, 0), v, "fwd_s1", sink_logit=np.zeros(3))


def test_e4m3fnuz_moves_the_threshold_by_ln2():
    """ROCm's FP8 (max 240, zero at or below 2^-11): the initial-max threshold is 11 ln 2 + ln S."""
    assert float(theory.learned_sink_critical_delta(1.0, fmt="e4m3fnuz")) == pytest.approx(11 * math.log(2), abs=1e-5)
    fnuz, _ = _sweep_fraction(PRESETS["vllm_triton_fp8_rocm"], 11 * math.log(2), n=2048, seeds=2)
    fn, _ = _sweep_fraction(PRESETS["vllm_triton_fp8"], 11 * math.log(2), n=2048, seeds=2)
    assert fnuz == pytest.approx(0.5, abs=0.03) and fn > 0.7
#: SweepSpec(configs=<the 19 presets above>), results format 2, configs compiled in groups of 8
PINNED_FINGERPRINT = "21a0ea62df3e8317"


def test_reproduce_section_writes_finite_tables_and_figures(tmp_path):
    from pcast_experiments import sinks_and_rescale as sar

    # two of study 3's presets: each preset adds to one compiled sweep, and every preset is computed elsewhere
    tiny = sar.Sizes(seeds=2, q_len=4, n=256, d=16, deltas_l=(5.0, 9.0, 13.0), sigmas=(1.0, 3.0), model_tokens=24,
                     presets=sar.PRESETS_STUDIED[:2])
    md = sar.sinks_and_rescale_section(tmp_path, sizes=tiny)
    for f in sar.FILES:
        assert (tmp_path / f).stat().st_size > 0, f
    assert "nan" not in md.lower() and "Order no longer fixes it" in md and "beyond the paper" in md
    import csv

    with open(tmp_path / f"{sar.NAME}_sinks.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["placement"] for r in rows} == {"init_max", "epilogue", "block_max"}
    assert all(0.0 <= float(r["frac_zeroed"]) <= 1.0 for r in rows)


def check_sinks_and_rescale_page(scope: dict, printed: str, folder) -> None:
    """docs/guides/sinks_and_rescale.md, after tests/test_docs.py ran its block: JAX's FP8 attention at
    scale_s = 1, three learned sinks."""
    r, ref = scope["r"], scope["ref"]
    assert not r.scale_s_reaches_p and r.safe_scale_s is None and r.frac_zeroed.shape == (3,)
    assert ref.safe_scale_s == 128.0 and ref.frac_zeroed.shape == (3,)


# --------------------------------------------------------------------------------------------
# The Pallas kernels: learned sinks and the lazy rescale, interpret mode and Hopper lowering
# --------------------------------------------------------------------------------------------

_KERNEL_CONFIGS = [
    KernelConfig(order="forward", block_kv=64, sink_mode="init_max"),
    KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=64, sink_mode="epilogue",
                 rescale_threshold=4.0),
    KernelConfig(order="forward", block_kv=64, sink_mode="init_max", kv_splits=2),
    KernelConfig(order="reverse", block_kv=64, sink_mode="block_max", kv_splits=3, split_layout="strided",
                 rescale_threshold=2.0, rescale_unit="natural", rescale_compensation="pow2", scale=64.0),
]


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_kernels_place_learned_sinks_and_lag_the_max_as_the_oracle_does(backend):
    import pallas_kernels as pk

    rng = np.random.default_rng(7)
    heads, q_len, n, d = 2, 64, 200, 64
    q, k, v = (jnp.asarray((rng.integers(-7, 8, shape) / 4.0).astype(np.float32)).astype(jnp.float8_e4m3fn)
               for shape in ((1, heads, q_len, d), (1, 1, n, d), (1, 1, n, d)))
    sinks = jnp.array([7.5, 1.0], jnp.float32)
    scale = 0.5
    scores = np.einsum("hqd,nd->hqn", np.asarray(q[0], np.float64), np.asarray(k[0, 0], np.float64)) * scale
    for cfg in _KERNEL_CONFIGS:
        out, stats = pk.fp8_attention(q, k, v, config=cfg, implementation=backend, interpret=True, scale=scale,
                                      sinks=sinks, return_stats=True)
        for h in range(heads):
            ref = oracle.attention(scores[h].astype(np.float32), np.asarray(v[0, 0], np.float32),
                                   sink_logit=float(sinks[h]), **oracle.config_kwargs(cfg))
            err = np.abs(np.asarray(out[0, h], np.float64) - ref.out) - (OUT_RTOL * np.max(np.abs(ref.out))
                                                                         + ref.out_slack)
            assert np.all(err <= 0), (backend, cfg.name, h, float(err.max()))
            assert np.all(np.abs(np.asarray(stats.n_zeroed[0, h]) - ref.n_zeroed) <= ref.zeroed_slack)


_HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


@pytest.mark.every_half
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("name", ["vllm_triton_fp8", "fa4_pr2109", "cudnn_fp8"])
def test_kernels_with_sinks_and_lazy_rescale_lower_for_hopper(backend, name):
    import pallas_kernels as pk

    cfg = PRESETS[name].replace(causal=True, block_kv=128 if backend == "mosaic" else PRESETS[name].block_kv)
    q = jax.ShapeDtypeStruct((1, 4, 128, 128), jnp.float8_e4m3fn)
    kv = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((4,), jnp.float32)
    fn = functools.partial(pk.fp8_attention, config=cfg, implementation=backend, return_stats=True)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=_HOPPER)):
        text = jax.jit(lambda q, k, v, s: fn(q, k, v, sinks=s)).trace(q, kv, kv, s).lower(
            lowering_platforms=("cuda",)).as_text()
    if backend == "mosaic":
        assert "custom_call @mosaic_gpu" in text and "cvt.rn.satfinite.e4m3x2.f32" in text
    else:
        assert "custom_call @__gpu$xla.gpu.triton" in text


def test_gpu_check_cudnn_step_runs_on_cpu_with_a_stand_in():
    """gpu_check.sh step (f): the harness (fp8_params, the E4M3-rounded comparison, the fit) on CPU, with
    the τ = 4 preset standing in for cuDNN; the real kernel needs a GPU."""
    from cases import gpu_bench

    bench = gpu_bench()
    params = bench.fp8_params(16.0)
    assert set(params) == set(bench.FP8_PARAM_KEYS) and len(params) == 17
    assert float(params["scale_s"].reshape(())) * float(params["descale_s"].reshape(())) == 1.0
    res = bench.run_cudnn(bench.parse_args(["--part", "cudnn", "--cpu-smoke"]))
    for scale_s in bench.CUDNN_SCALES:
        assert res[scale_s]["tau4"][1] == 0.0 < res[scale_s]["tau0"][1]



def test_mi300_zeroes_as_an_e4m3fn_cast_at_twice_the_scale():
    """Below saturation FNUZ(x) = FN(2x)/2: the MI300 preset's P-cast at S = 1 is MI355's at S = 2, bit for bit."""
    from pcast_jax.presets import amd

    s, v, mask = _instance(11, delta=7.0, k_sink=4)
    mi300 = engine.attention(s, v, "fa_triton_amd_mi300", count_mask=mask)
    fn_2s = engine.attention(s, v, PRESETS["fa_triton_amd_mi355"].replace(scale=2.0), count_mask=mask)
    mi355 = engine.attention(s, v, "fa_triton_amd_mi355", count_mask=mask)
    np.testing.assert_array_equal(np.asarray(mi300.out), np.asarray(fn_2s.out))
    np.testing.assert_array_equal(np.asarray(mi300.n_zeroed), np.asarray(fn_2s.n_zeroed))
    assert 0 < int(np.sum(mi300.n_zeroed)) < int(np.sum(mi355.n_zeroed))
    # the common vLLM case (no prob_scale in the checkpoint) is the preset; a calibrated one is S = 1/prob_scale,
    # halved again on FNUZ because vLLM's loader doubles prob_scale there
    assert amd.vllm_rocm_flash_config(None) == PRESETS["vllm_rocm_flash_fp8"]
    for p in (0.125, 0.3, 4.0):
        assert amd.vllm_rocm_flash_config(p, gpu="mi355").scale * p == pytest.approx(1.0, rel=1e-7)
        assert amd.vllm_rocm_flash_config(p).scale * 2 * p == pytest.approx(1.0, rel=1e-7)
    assert amd.vllm_rocm_flash_config(0.25, gpu="mi355", block_kv=128).p_format == "e4m3"
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(PcastError, match="prob_scale"):
            amd.vllm_rocm_flash_scale(bad)
    with pytest.raises(PcastError, match="gpu"):
        amd.vllm_rocm_flash_scale(1.0, gpu="mi250")


def test_sglang_split_count_follows_the_batch():
    from pcast_jax.presets.sglang import SGLANG_DECODE_LAUNCH, SGLANG_MAX_KV_SPLITS, sglang_num_kv_splits

    launch = SGLANG_DECODE_LAUNCH
    assert PRESETS["sglang_triton_decode"].kv_splits == sglang_num_kv_splits(**launch) == SGLANG_MAX_KV_SPLITS
    # batch 32 of 32 query / 8 KV heads on 132 SMs, 4096 keys: int(132 · log2(4096 / 64)) = 792 programs,
    # 32 · ⌈32 / 4⌉ = 256 token programs, ⌈792 / 256⌉ = 4 splits of 1024 keys
    assert sglang_num_kv_splits(**{**launch, "batch": 32}) == 4
    counts = [sglang_num_kv_splits(**{**launch, "batch": b}) for b in (1, 2, 8, 16, 32, 64, 128, 512)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1
    # without GQA every query head is its own program (token grid batch · heads): 64 × 8 heads = 16 × 32 heads
    assert sglang_num_kv_splits(**{**launch, "num_heads": 8, "batch": 64}) == sglang_num_kv_splits(
        **{**launch, "num_heads": 32, "num_kv_heads": 32, "batch": 16})
    with pytest.raises(PcastError, match="num_kv_heads"):
        sglang_num_kv_splits(**{**launch, "num_kv_heads": 64})


def test_the_non_exp2f_sink_prescale_weighs_the_sink_e_to_the_log2_s():
    """fmha_v2's non-exp2f path adds the sink as e^8·exp(s_L − m), its exp2f path as 2^8·exp(s_L − m): ℓ differs
    by exactly (e^8 − 2^8)·exp(s_L − m), and the config field is written (and fingerprinted) only where it acts."""
    from pcast_jax import block

    exact, nonexp2f = PRESETS["trtllm_fmha_v2"], PRESETS["trtllm_fmha_v2_nonexp2f"]
    m, sink = jnp.float32(3.0), jnp.float32(5.0)
    gap = float(block.sink_weight(sink, m, nonexp2f)) - float(block.sink_weight(sink, m, exact))
    assert gap == pytest.approx((math.exp(8.0) - 256.0) * math.exp(2.0), rel=1e-5)
    assert "sink_prescale" not in exact.to_dict() and nonexp2f.to_dict()["sink_prescale"] == "exp"
    assert KernelConfig.from_dict(nonexp2f.to_dict()) == nonexp2f
    # it acts in the exponent mode only
    assert exact.replace(scale_mode="multiply", sink_prescale="exp").sink_prescale == "exp2"
