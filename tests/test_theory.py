"""The paper's closed forms: known values, Monte Carlo, gradients, Appendix A, Theorems 6–7, CLI."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, stats

from pcast_jax import cli, formats, theory
from pcast_jax.errors import PcastError

LN2 = math.log(2.0)

# Paper, Table 1 (N = 4096, k_sink = 4): Δ, frac. zeroed S=1, non-sink mass, info loss, S=256 (%).
TABLE1 = np.array([
    [5, 22.3, 88.0, 19.6, 0.0],
    [6, 51.6, 74.0, 38.2, 0.0],
    [7, 82.0, 51.7, 42.4, 0.0],
    [8, 94.8, 32.2, 30.5, 0.3],
    [9, 99.5, 13.9, 13.9, 2.3],
    [10, 100.0, 5.8, 5.8, 11.7],
    [12, 100.0, 0.8, 0.8, 67.9],
])


@pytest.fixture(autouse=True)
def _strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


def expected_max_reference(k):
    """E[max of k N(0,1)] by adaptive float64 quadrature (independent of the module's grid)."""
    def integrand(x):
        return x * k * stats.norm.pdf(x) * stats.norm.cdf(x) ** (k - 1)

    peak = [math.sqrt(2 * math.log(k))] if k > 1 else None
    return integrate.quad(integrand, -15, 15, limit=500, epsabs=1e-13, points=peak)[0]


# ------------------------------------------------------------------------------------------
# δk, Eq. (3).
# ------------------------------------------------------------------------------------------
def test_delta_k_known_values():
    assert abs(float(theory.delta_k(1))) < 1e-6
    assert abs(float(theory.delta_k(2)) - 1 / math.sqrt(math.pi)) < 1e-6
    # δ3 = 3/(2√π) exactly
    assert abs(float(theory.delta_k(3)) - 1.5 / math.sqrt(math.pi)) < 1e-6
    assert round(float(theory.delta_k(4)), 4) == 1.0294


@pytest.mark.parametrize("k", [4, 5, 10, 64, 1000, 4092, 10**6, 10**9])
def test_delta_k_matches_quadrature(k):
    assert abs(float(theory.delta_k(k)) - expected_max_reference(k)) < 1e-6


def test_delta_k_matches_monte_carlo(rng):
    for k in (2, 4, 16):
        m = rng.standard_normal((200_000, k)).max(axis=1)
        se = m.std() / math.sqrt(m.size)
        assert abs(float(theory.delta_k(k)) - m.mean()) < 4 * se


def test_delta_k_is_below_asymptotic_and_increasing():
    ks = np.array([2.0, 4, 8, 64, 4092, 1e6])
    exact = np.asarray(theory.delta_k(ks))
    assert np.all(np.diff(exact) > 0)
    assert np.all(exact < np.asarray(theory.delta_k_asymptotic(ks)))
    assert abs(float(theory.delta_k_asymptotic(4)) - math.sqrt(2 * math.log(4))) < 1e-6


def test_delta_k_jit_and_grad_in_k():
    jitted = jax.jit(theory.delta_k)(jnp.float32(4.0))
    assert abs(float(jitted) - float(theory.delta_k(4))) < 1e-6
    g = float(jax.grad(theory.delta_k)(4.0))
    fd = (float(theory.delta_k(4.05)) - float(theory.delta_k(3.95))) / 0.1
    assert g > 0 and abs(g - fd) < 1e-3


# ------------------------------------------------------------------------------------------
# Collapse fraction, Eq. (6)–(7), and its spread-integrated version.
# ------------------------------------------------------------------------------------------
def test_collapse_fraction_is_eq7():
    d4 = expected_max_reference(4)
    for delta, scale in [(5, 1), (7, 1), (7, 256), (12, 256), (9, 448)]:
        expect = stats.norm.cdf(delta + d4 - 10 * LN2 - math.log(scale))
        assert abs(float(theory.collapse_fraction(delta, scale)) - expect) < 2e-6
    # σ generalisation: Φ((Δ + σ δk − 10 ln2 − ln S)/σ)
    expect = stats.norm.cdf((9 + 2 * d4 - 10 * LN2) / 2)
    assert abs(float(theory.collapse_fraction(9.0, 1.0, sigma=2.0)) - expect) < 2e-6


def test_threshold_and_fraction_are_consistent():
    # at Δc the spread version is E[Φ(M − δ4)], the same for every S and σ and close to 1/2
    rng = np.random.default_rng(7)
    m = rng.standard_normal((400_000, 4)).max(axis=1)
    at_dc = stats.norm.cdf(m - expected_max_reference(4)).mean()
    for sigma in (0.5, 1.0, 2.0):
        for scale in (1.0, 256.0, 448.0):
            dc = theory.critical_delta(scale, sigma=sigma)
            assert abs(float(theory.collapse_fraction(dc, scale, sigma=sigma)) - 0.5) < 1e-5
            spread = float(theory.collapse_fraction_spread(dc, scale, sigma=sigma))
            assert abs(spread - at_dc) < 1e-3 and abs(spread - 0.5) < 0.01
            assert abs(float(theory.underflow_threshold(dc, scale, sigma=sigma))) < 1e-5
    assert abs(float(theory.critical_delta(256.0)) - (18 * LN2 - expected_max_reference(4))) < 1e-5


def test_underflow_threshold_against_the_cast():
    """Prop. 1: scores just below the Eq. (6) threshold give P·S that casts to zero, just above do not."""
    for delta, scale in [(7.0, 1.0), (10.0, 256.0), (12.0, 448.0), (6.0, 0.5)]:
        m = delta + float(theory.delta_k(4))
        t = float(theory.underflow_threshold(delta, scale))
        s = np.array([t - 1e-3, t + 1e-3], np.float64)
        p_scaled = np.float32(np.exp(s - m) * scale)
        out = np.asarray(formats.cast(p_scaled, "e4m3"))
        assert out[0] == 0 and out[1] > 0
        assert abs(float(theory.underflow_p_threshold(scale)) * scale / 2.0**-10 - 1) < 1e-6


def test_spread_version_matches_simulated_cast():
    """Sink and non-sink scores drawn, P = exp(s − m)·S cast to E4M3, zeros counted."""
    rng = np.random.default_rng(1)
    rows, k, n_nonsink = 2000, 4, 1024
    for delta, scale in [(6.0, 1.0), (7.0, 1.0), (10.0, 256.0)]:
        sinks = delta + rng.standard_normal((rows, k))
        s = rng.standard_normal((rows, n_nonsink))
        m = np.maximum(sinks.max(axis=1, keepdims=True), s.max(axis=1, keepdims=True))
        p = (np.exp(s - m) * scale).astype(np.float32)
        measured = float((np.asarray(formats.cast(p, "e4m3")) == 0).mean())
        spread = float(theory.collapse_fraction_spread(delta, scale))
        plug_in = float(theory.collapse_fraction(delta, scale))
        se = math.sqrt(measured * (1 - measured) / rows) + 1e-4  # rows dominate the variance
        assert abs(spread - measured) < 4 * se
        assert abs(spread - measured) < abs(plug_in - measured)


@pytest.mark.parametrize("fn", [theory.collapse_fraction, theory.collapse_fraction_spread])
def test_fraction_gradients_match_central_differences(fn):
    def f(delta, sigma, log_scale):
        return fn(delta, jnp.exp(log_scale), sigma=sigma)

    with jax.enable_x64(True):
        args = (jnp.float64(7.0), jnp.float64(1.3), jnp.float64(math.log(40.0)))
        grads = jax.grad(f, argnums=(0, 1, 2))(*args)
        h = 1e-5
        for i, g in enumerate(grads):
            up = list(args)
            dn = list(args)
            up[i] = up[i] + h
            dn[i] = dn[i] - h
            fd = (float(f(*up)) - float(f(*dn))) / (2 * h)
            assert abs(float(g) - fd) < 1e-7 + 1e-6 * abs(fd), (i, float(g), fd)
        assert abs(float(grads[0]) + float(grads[2])) < 1e-12  # F depends on Δ − ln S only
    # float32 default path too
    g32 = jax.grad(lambda d: fn(d, 256.0))(10.0)
    fd32 = (float(fn(10.05, 256.0)) - float(fn(9.95, 256.0))) / 0.1
    assert abs(float(g32) - fd32) < 2e-3


def test_smooth_functions_jit_like_eager():
    cases = [
        (theory.collapse_fraction, (7.0, 256.0)),
        (theory.collapse_fraction_spread, (7.0, 1.0)),
        (theory.critical_delta, (256.0,)),
        (theory.underflow_threshold, (7.0, 256.0)),
        (theory.reverse_underflow_prob, (4096.0, 1.0)),
        (theory.non_sink_mass, (7.0,)),
        (theory.dp, (300.0,)),
    ]
    for fn, args in cases:
        eager = float(fn(*args))
        jitted = float(jax.jit(fn)(*[jnp.float32(a) for a in args]))
        assert abs(eager - jitted) <= 1e-6 * max(1.0, abs(eager)), fn.__name__


def test_traced_bad_values_pass_through():
    out = jax.jit(theory.collapse_fraction)(jnp.float32(jnp.nan), jnp.float32(1.0))
    assert np.isnan(float(out))


# ------------------------------------------------------------------------------------------
# Table 1.
# ------------------------------------------------------------------------------------------
def test_table1_frac_zeroed_within_a_few_points():
    tab = theory.table1_closed_form(TABLE1[:, 0], k_sink=4, n=4096)
    s1, s256 = 100 * tab["frac_zeroed_s1"], 100 * tab["frac_zeroed_s256"]
    assert np.max(np.abs(s1 - TABLE1[:, 1])) <= 6.0
    assert np.max(np.abs(s256 - TABLE1[:, 4])) <= 6.0
    # integrating over the sink-max spread tightens the agreement to ~1 point
    s1s, s256s = 100 * tab["frac_zeroed_s1_spread"], 100 * tab["frac_zeroed_s256_spread"]
    assert np.max(np.abs(s1s - TABLE1[:, 1])) <= 2.0
    assert np.max(np.abs(s256s - TABLE1[:, 4])) <= 2.0
    assert np.max(np.abs(s1s - TABLE1[:, 1])) < np.max(np.abs(s1 - TABLE1[:, 1]))
    # non-sink mass (per-row average) and info loss
    assert np.max(np.abs(100 * tab["non_sink_mass"] - TABLE1[:, 2])) <= 3.0
    assert np.max(np.abs(100 * tab["info_loss"] - TABLE1[:, 3])) <= 3.0
    # the peak of the info loss sits at Δ = 6–7 as the paper says
    assert TABLE1[np.argmax(tab["info_loss"]), 0] in (6, 7)


def test_non_sink_mass_against_monte_carlo():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3000, 4096))
    a = np.exp(z[:, 4:]).sum(axis=1)
    for delta in (5.0, 8.0, 11.0):
        b = np.exp(delta + z[:, :4]).sum(axis=1)
        share = a / (a + b)
        se = share.std() / math.sqrt(share.size)
        assert abs(float(theory.non_sink_mass(delta)) - share.mean()) < 4 * se + 2e-3
    mean_field = float(theory.non_sink_mass(7.0, per_row=False))
    assert abs(mean_field - 4092 / (4092 + 4 * math.exp(7.0))) < 1e-6


# ------------------------------------------------------------------------------------------
# Prop. 3 and Theorem 4.
# ------------------------------------------------------------------------------------------
def test_mse_collapse_value_and_monte_carlo():
    p = jnp.array([1.0, 1.0, 2.0, 4.0])
    mask = jnp.array([True, False, True, False])
    assert abs(float(theory.mse_collapse(p, mask, 2.0)) - 4.0 * (1 + 4) / 64) < 1e-6
    rng = np.random.default_rng(3)
    d, draws = 64, 4000
    v = rng.standard_normal((draws, 4, d)) * 0.5
    err = np.einsum("j,njd->nd", np.where(np.asarray(mask), np.asarray(p), 0.0), v) / 8.0
    measured = (err**2).mean()
    assert abs(measured - float(theory.mse_collapse(p, mask, 0.5))) < 0.03 * measured
    g = jax.grad(lambda s: theory.mse_collapse(p, mask, s))(0.5)
    assert abs(float(g) - 2 * 0.5 * 5 / 64) < 1e-6
    batched = theory.mse_collapse(jnp.stack([p, 2 * p]), jnp.stack([mask, mask]), 1.0)
    np.testing.assert_allclose(np.asarray(batched), [5 / 64, 5 / 64], rtol=1e-6)


def test_reverse_underflow_eq14():
    for n, scale in [(4096, 256.0), (10**6, 256.0), (8192, 1.0)]:
        m = math.sqrt(2 * math.log(n - 4))
        expect = stats.norm.cdf(m - 10 * LN2 - math.log(scale))
        got = float(theory.reverse_underflow_prob(n, scale))
        assert abs(got - expect) <= 1e-5 * expect
    assert float(theory.reverse_underflow_prob(10**6, 256.0)) < 1e-12  # Theorem 4's guarantee
    assert abs(float(theory.pre_sink_max(4096)) - math.sqrt(2 * math.log(4092))) < 1e-6
    # Eq. (11) upper-bounds the exact expected max, hence the probability
    for n in (512, 4096, 65536):
        assert float(theory.delta_k(n - 4)) < float(theory.pre_sink_max(n))
        assert (float(theory.reverse_underflow_prob(n, 1.0, max_model="mean"))
                < float(theory.reverse_underflow_prob(n, 1.0)))


def test_reverse_underflow_distribution_matches_simulation():
    """Last pre-sink block: running max over all N − k tokens, P = exp(s − m) cast at S = 1."""
    rng = np.random.default_rng(4)
    s = rng.standard_normal((400, 4092))
    p = np.exp(s - s.max(axis=1, keepdims=True)).astype(np.float32)
    measured = float((np.asarray(formats.cast(p, "e4m3")) == 0).mean())
    model = float(theory.reverse_underflow_prob(4096, 1.0, max_model="distribution"))
    assert abs(model - measured) < 0.12 * measured


@pytest.mark.parametrize("block_kv", [64, 224])
def test_reverse_s256_zeroes_only_the_sink_block_as_the_closed_form_says(block_kv):
    """Reverse + S = 256 through the simulator: nothing zeroed before the sink's block, and in it the
    share (B − k)/(N − k) · F(Δ, 256) of all non-sink keys (Theorem 4's gap)."""
    from pcast_jax import engine
    from pcast_jax.presets import PRESETS

    rows, n, k = 1024, 512, 4  # the per-row fraction is skewed: enough rows for its s.e. to hold
    rng = np.random.default_rng(block_kv)
    cfg = PRESETS["rev_s256"].replace(block_kv=block_kv)
    v = rng.standard_normal((n, 8)).astype(np.float32)
    in_block = np.zeros(n, bool)
    in_block[k:block_kv] = True
    before = np.ones(n, bool)
    before[:block_kv] = False
    deltas = np.array([10.0, 12.0])
    s = rng.standard_normal((2, rows, n))
    s[..., :k] += deltas[:, None, None]
    s = s.astype(np.float32)
    assert int(np.sum(engine.attention(s, v, cfg, count_mask=before).n_zeroed)) == 0
    block = np.asarray(engine.attention(s, v, cfg, count_mask=in_block).n_zeroed) / (n - k)  # (2, rows)
    for delta, got in zip(deltas, block):
        model = float(theory.sink_block_collapse_fraction(delta, 256.0, n=n, block_kv=block_kv, k_sink=k))
        se = got.std(ddof=1) / math.sqrt(rows)
        assert abs(got.mean() - model) < 4 * se + 1e-5, (delta, got.mean(), model)
    # the closed form: the block's share of the non-sink keys times F integrated over the sink max
    f = float(theory.collapse_fraction_spread(12.0, 256.0))
    assert float(theory.sink_block_collapse_fraction(12.0, n=n, block_kv=block_kv)) == pytest.approx(
        (block_kv - k) / (n - k) * f, rel=1e-6)
    # one block holds every key (B ≥ N): all non-sink keys share the sink's block
    assert float(theory.sink_block_collapse_fraction(30.0, n=50, block_kv=block_kv)) == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------------------
# Prop. 5, dp(S), Theorems 6–7.
# ------------------------------------------------------------------------------------------
def test_is_bit_exact_scale():
    powers = [2.0**k for k in range(-126, 127)]
    assert all(bool(theory.is_bit_exact_scale(s)) for s in powers[::5])
    assert np.all(np.asarray(theory.is_bit_exact_scale(jnp.asarray(powers[100:150], jnp.float32))))
    for s in (3.0, 448.0, 100.0, 1.5, 0.3, 2.0**127, 2.0**-127):
        assert not bool(theory.is_bit_exact_scale(s)), s


def _random_float32(rng, count):
    bits = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


def test_prop5_on_random_float32():
    rng = np.random.default_rng(5)
    x = np.concatenate([_random_float32(rng, 200_000), rng.standard_normal(50_000).astype(np.float32)])
    for k in range(-20, 21):
        exact, in_range = theory.scaling_exactness(x, 2.0**k)
        assert in_range.mean() > 0.5
        assert exact[in_range].all(), k
    for scale in (3.0, 100.0, 448.0, 0.3):
        exact, in_range = theory.scaling_exactness(x, scale)
        assert (~exact[in_range]).mean() > 0.5, scale
    # JAX's float32 multiply (the simulator's) is the same IEEE product on the in-range values
    exact, in_range = theory.scaling_exactness(x, 448.0)
    xr = x[in_range]
    np.testing.assert_array_equal(np.asarray(jnp.asarray(xr) * jnp.float32(448.0)), xr * np.float32(448.0))


def test_dp_appendix_a():
    got = theory.dp_table([3, 100, 250, 300, 448, 512])
    np.testing.assert_array_equal(np.round(got, 3), [0.083, 0.080, 0.064, 0.107, 0.071, 0.25])
    np.testing.assert_array_equal(theory.dp_table(2.0 ** np.arange(9)), np.full(9, 2.0**-4))
    # Remark 3 for S > 448; 32/S is the [256, 512) binade inside [0, 448]
    s = np.array([449.0, 462.0, 470.0, 600.0, 1024.0])
    np.testing.assert_allclose(theory.dp_table(s), np.maximum(32 / s, 2 * (1 - 448 / s)), rtol=1e-15)
    # the §5 footnote: S below the normal range is all subnormal, dp = 2^-9 / S
    np.testing.assert_allclose(theory.dp_table([2.0**-8, 0.01]), 2.0**-9 / np.array([2.0**-8, 0.01]))


def test_dp_equals_max_lsb_below_s():
    """Def. 1 brute force with formats.lsb: the largest LSB on [0, S) sits just below S."""
    rng = np.random.default_rng(6)
    s = np.concatenate([np.exp(rng.uniform(math.log(2.0**-9), math.log(448), 500)),
                        2.0 ** np.arange(-8, 9)]).astype(np.float32)
    just_below = np.nextafter(s, np.float32(0))
    brute = np.asarray(formats.lsb(just_below, "e4m3"), np.float64) / s.astype(np.float64)
    np.testing.assert_array_equal(theory.dp_table(s.astype(np.float64)), brute)
    np.testing.assert_allclose(np.asarray(theory.dp(jnp.asarray(s))), brute, rtol=1e-6)
    above = np.array([450.0, 500.0, 512.0, 3000.0], np.float32)
    np.testing.assert_allclose(np.asarray(theory.dp(jnp.asarray(above))), theory.dp_table(above), rtol=1e-6)


def test_theorem6_exhaustive():
    target = 2.0**-4
    k = np.arange(-6, 13)
    dps = theory.dp_table(2.0**k)
    assert np.all(dps[(k >= 0) & (k <= 8)] == target)  # (i)
    assert np.all(dps[(k >= -5) & (k <= 8)] == target)  # (i) holds down to 2^-5
    assert dps[k == -6][0] == 2.0**-3  # at 2^-6 the top cell is subnormal-spaced
    assert np.all(dps[k >= 9] > target)  # (iii) on powers of two
    grid = np.geomspace(2.0**-6, 4096.0, 40_001)
    pw = 2.0 ** np.arange(-6, 13)
    grid = np.concatenate([grid, np.nextafter(pw, 0), np.nextafter(pw, np.inf)])
    non_pw = grid[(np.frexp(grid)[0] != 0.5) & (grid >= 2.0**-6) & (grid <= 4096.0)]
    low, high = non_pw[non_pw <= 448], non_pw[non_pw > 448]
    assert np.all(theory.top_lsb_table(low) * 16 > low)  # (ii), exact: dp(S) > 2^-4
    assert np.all(theory.dp_table(high) > target)  # (iii)
    assert all(theory.theorem6_holds().values())


def test_theorem7_characterization():
    c = theory.characterize_s256()
    assert c.unique == (256.0,)
    assert c.c2 == tuple(2.0**k for k in range(9))
    assert c.c3 == 256.0 and c.best_coverage_in_c2 == 256.0
    assert len(c.c1) == 31
    # §5.3: 448 covers more of the normal range than 256, but fails (C1) and (C2)
    assert float(theory.normal_coverage(448.0)) < float(theory.normal_coverage(256.0)) == 2.0**-14
    assert not bool(theory.is_bit_exact_scale(448.0)) and theory.dp_table(448.0) > 2.0**-4
    assert abs(theory.dp_table(448.0) / theory.dp_table(256.0) - 8 / 7) < 1e-12  # the 14% of §5


# ------------------------------------------------------------------------------------------
# Bad inputs.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, param", [
    (lambda: theory.delta_k(0), "k"),
    (lambda: theory.delta_k(float("nan")), "k"),
    (lambda: theory.collapse_fraction(float("nan"), 1.0), "delta"),
    (lambda: theory.collapse_fraction(7.0, 0.0), "scale"),
    (lambda: theory.collapse_fraction(7.0, -256.0), "scale"),
    (lambda: theory.collapse_fraction(7.0, float("inf")), "scale"),
    (lambda: theory.collapse_fraction(7.0, 1.0, k_sink=0), "k_sink"),
    (lambda: theory.collapse_fraction(7.0, 1.0, sigma=0.0), "sigma"),
    (lambda: theory.collapse_fraction_spread(7.0, 1.0, sigma=-1.0), "sigma"),
    (lambda: theory.collapse_fraction(7.0, 1.0, fmt="e3m4"), "fmt"),
    (lambda: theory.critical_delta(np.float32(0.0)), "scale"),
    (lambda: theory.underflow_threshold(np.inf, 1.0), "delta"),
    (lambda: theory.pre_sink_max(4, k_sink=4), "n"),
    (lambda: theory.reverse_underflow_prob(4096, 256.0, max_model="bogus"), "max_model"),
    (lambda: theory.reverse_underflow_prob(4096, 0.0), "scale"),
    (lambda: theory.sink_block_collapse_fraction(10.0, block_kv=2), "block_kv"),
    (lambda: theory.sink_block_collapse_fraction(10.0, n=4), "n"),
    (lambda: theory.dp(0.0), "scale"),
    (lambda: theory.dp_table([1.0, -2.0]), "scale"),
    (lambda: theory.normal_coverage(-1.0), "scale"),
    (lambda: theory.is_bit_exact_scale(0.0), "scale"),
    (lambda: theory.scaling_exactness(np.ones(3, np.float32), float("nan")), "scale"),
    (lambda: theory.mse_collapse(jnp.ones(3), jnp.ones(3, bool), -1.0), "sigma_v"),
    (lambda: theory.mse_collapse(jnp.ones(3), jnp.ones(4, bool), 1.0), "zeroed_mask"),
    (lambda: theory.non_sink_mass(7.0, n=3), "n"),
    (lambda: theory.table1_closed_form([5.0, float("nan")]), "delta"),
])
def test_bad_inputs_name_the_parameter(call, param):
    with pytest.raises(PcastError, match=rf"^{param}\b|\b{param}\b"):
        call()


# ------------------------------------------------------------------------------------------
# CLI.
# ------------------------------------------------------------------------------------------
def _cli_values(capsys, *args):
    """Run ``pcast theory`` and return {label: (reference, value text, meaning)}."""
    assert cli.main(["theory", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("pcast theory:")
    values = {}
    for line in lines[1:]:
        label, ref, value, meaning = re.split(r"\s{2,}", line.strip())
        values[label] = (ref, value, meaning)
    return values


def _num(values, label):
    return float(values[label][1])


def test_cli_theory_scale_1(capsys):
    v = _cli_values(capsys, "--delta", "7", "--scale", "1")
    assert abs(_num(v, "F(delta,S)") - 0.864) < 0.005
    assert abs(_num(v, "F(delta,S)") - float(theory.collapse_fraction(7.0, 1.0))) < 1e-6
    assert abs(_num(v, "F_spread(delta,S)") - float(theory.collapse_fraction_spread(7.0, 1.0))) < 1e-6
    assert abs(_num(v, "delta_k") - 1.0294) < 1e-4
    assert abs(_num(v, "delta_c") - (10 * LN2 - _num(v, "delta_k"))) < 1e-5
    assert abs(_num(v, "P_threshold") / 2.0**-10 - 1) < 1e-6
    assert _num(v, "dp(S)") == 0.0625
    assert v["power_of_two"][1] == "yes"
    assert "Eq. (7)" in v["F(delta,S)"][0] and "Eq. (3)" in v["delta_k"][0]
    assert "Eq. (14)" in v["reverse_underflow"][0] and "Eq. (6)" in v["s_threshold"][0]
    assert "Eq. (17)" in v["dp(S)"][0] and "Prop. 5" in v["power_of_two"][0]
    assert all(meaning for _, _, meaning in v.values())
    assert 0 < _num(v, "reverse_underflow") < 0.01


def test_cli_theory_scale_256_and_448(capsys):
    v = _cli_values(capsys, "--delta", "7", "--scale", "256")
    assert abs(_num(v, "delta_c") - 11.447) < 0.002
    assert _num(v, "F(delta,S)") < 1e-4
    assert abs(_num(v, "s_threshold") - (7 - 11.4473)) < 1e-3
    assert _num(v, "reverse_underflow") < 1e-12
    w = _cli_values(capsys, "--delta", "7", "--scale", "448", "--ksink", "2", "--sigma", "1.5")
    assert round(_num(w, "dp(S)"), 3) == 0.071
    assert w["power_of_two"][1] == "no"
    expect = float(theory.critical_delta(448.0, k_sink=2, sigma=1.5))
    assert abs(_num(w, "delta_c") - expect) < 1e-5
    x = _cli_values(capsys, "--delta", "7", "--scale", "512")
    assert _num(x, "dp(S)") == 0.25 and "Eq. (18)" in x["dp(S)"][0]


@pytest.mark.parametrize("args", [["--delta", "7", "--scale", "448", "--ksink", "2"], ["--fmt", "mxfp8"],
                                  ["--fmt", "mxfp4", "--scale", "64"]])
def test_cli_theory_json_gives_the_same_numbers(capsys, args):
    text = _cli_values(capsys, *args)
    assert cli.main(["theory", *args, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["scale"] == (float(args[args.index("--scale") + 1]) if "--scale" in args else 256.0)
    assert list(doc["quantities"]) == list(text)
    for label, (ref, value, meaning) in text.items():
        got = doc["quantities"][label]
        assert (got["reference"], got["meaning"]) == (ref, meaning)
        if value in ("yes", "no"):
            assert got["value"] is (value == "yes")
        elif value.startswith("never"):
            assert got["value"] is None
        else:
            assert isinstance(got["value"], float) and got["value"] == pytest.approx(float(value), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--scale", "0"], "scale=0.0 must be >= 2^-100"),
    (["--scale", "nan"], "scale"),
    (["--sigma", "0"], "sigma"),
    (["--ksink", "0"], "k_sink"),
    (["--n", "4"], "n="),
    (["--delta", "inf"], "delta"),
])
def test_cli_theory_bad_input(capsys, args, message):
    assert cli.main(["theory", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def check_paper_page(scope: dict, printed: str, folder) -> None:
    """docs/guides/paper.md, after tests/test_docs.py ran its block: the values its comments state."""
    assert printed.split() == ["1.0294", "0.864", "5.90", "11.45", "True", "True", "True"], printed
