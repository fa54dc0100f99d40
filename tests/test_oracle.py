"""Every preset against the independent float64 Algorithm 1 (tests/oracle.py).

The scan implementation, the xla implementation and both Pallas kernels share ``pcast_jax.block``; these tests
check that shared code against an implementation that shares nothing with the package. The
oracle itself is checked first against the FP8 number line of ml_dtypes (every code) and the
paper's facts (126 positive values, max 448, round-to-zero at 2^-10).

Pass criteria: zeroed counts identical (up to values within float32 rounding of the round-to-zero
boundary, which the oracle counts), outputs within 3e-6·max|out| plus the slack the oracle reports
for values within float32 rounding of an FP8 (or f16) rounding midpoint.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

from pcast_jax import engine
from pcast_jax.config import KernelConfig
from pcast_jax.presets import PRESETS, mma_model

import oracle
from cases import distinct_configs, shared_program

OUT_RTOL = 3e-6  # FP32 rounding of ℓ and O over up to 6 blocks of 192 keys (2.2e-6 seen for B = 192)
Q, N, D = 8, 1000, 32  # N is a multiple of neither 64, 128, 192 nor 224: padded keys
DELTAS = (5.0, 7.0, 10.0)


#: Every preset, plus causal, reverse-causal, f16 and nan-overflow variants the presets lack.
CASES = distinct_configs({
    **PRESETS,
    "fwd_s1_causal": PRESETS["fwd_s1"].replace(causal=True),
    "rev_s256_causal": PRESETS["rev_s256"].replace(causal=True),
    "fa3_causal_b128": PRESETS["fa3"].replace(causal=True, block_kv=128),
    "fa3_causal_b224": PRESETS["fa3"].replace(causal=True),
    # split-KV: both layouts, both orders, every scale mode, an f16 accumulator, causal, and more
    # splits than blocks (idle splits)
    "fwd_s1_split4": PRESETS["fwd_s1"].replace(kv_splits=4),
    "fwd_s1_split3s": PRESETS["fwd_s1"].replace(kv_splits=3, split_layout="strided"),
    "rev_s256_split5_causal": PRESETS["rev_s256"].replace(kv_splits=5, causal=True),
    "rev_s256_split4s": PRESETS["rev_s256"].replace(kv_splits=4, split_layout="strided"),
    "fa3_split3s": PRESETS["fa3"].replace(kv_splits=3, split_layout="strided", block_kv=128),
    "dynamic_split7": PRESETS["dynamic_pow2"].replace(kv_splits=7),
    "sageattn2pp_split4s": PRESETS["sageattn2pp"].replace(kv_splits=4, split_layout="strided"),
    "fwd_s448_split32s": PRESETS["fwd_s448"].replace(kv_splits=32, split_layout="strided"),
    "fwd_s448_split32": PRESETS["fwd_s448"].replace(kv_splits=32),
    "sageattn2pp_per_block_f16": PRESETS["sageattn2pp"].replace(f16_round_keys=0),
    "sageattn2pp_unscaled_v": PRESETS["sageattn2pp"].replace(v_channel_max=0.0),
    "rev_s64_b128_f16": KernelConfig(order="reverse", scale=64.0, block_kv=128, accumulator="f16"),
    "fwd_s512_nan": KernelConfig(scale=512.0, overflow="nan"),
    "fwd_s256_e5m2": KernelConfig(scale=256.0, p_format="e5m2"),
    # the FP8 MMA accumulator model (a model until a GPU fits it): never promoted and per tile
    "fa3_mma14": mma_model("fa3"),
    "hpc_ops_mma14": mma_model("hpc_ops"),
})


# --------------------------------------------------------------------------------------------
# The oracle's own number line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)])
def test_oracle_number_line_is_every_finite_code(name, dtype):
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    finite = np.unique(np.abs(codes[np.isfinite(codes)]))
    np.testing.assert_array_equal(oracle.LINES[name].values, finite)


def test_oracle_number_line_matches_the_paper():
    vals = oracle.E4M3.values
    assert len(vals) - 1 == 126 and vals[-1] == 448.0 and vals[1] == 2.0**-9
    assert vals[8] == 2.0**-6  # smallest normal
    r, _ = oracle.round_fp8(np.array([2.0**-10, np.nextafter(2.0**-10, 1), 464.0, 465.0, 1e6]), oracle.E4M3, "nan")
    assert r[0] == 0 and r[1] == 2.0**-9 and r[2] == 448.0 and np.isnan(r[3]) and np.isnan(r[4])


def test_oracle_rounding_equals_ml_dtypes_on_random_values(rng):
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 3, 20000),
                        (oracle.E4M3.values[1:] + oracle.E4M3.values[:-1]) / 2])  # every midpoint
    x = x.astype(np.float32).astype(np.float64)
    ours, _ = oracle.round_fp8(x, oracle.E4M3, "nan")
    ref = x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(ours, ref)


# --------------------------------------------------------------------------------------------
# Engines against the oracle
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _instances(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [oracle.sink_scores(rng, q=Q, n=N, d=D, delta=dl) for dl in DELTAS]


_compiled = shared_program(lambda cfg, engine_name: lambda s, v, m: engine.attention(
    s, v, cfg, implementation=engine_name, count_mask=m))


def assert_matches_oracle(res, ref: oracle.OracleResult):
    out = np.asarray(res.out, np.float64)
    tol = OUT_RTOL * np.max(np.abs(ref.out)) + ref.out_slack
    bad = np.abs(out - ref.out) > tol
    assert not bad.any(), (f"{bad.sum()} outputs off; worst {np.max(np.abs(out - ref.out) - tol):.3g} past the "
                           f"tolerance")
    dz = np.abs(np.asarray(res.n_zeroed) - ref.n_zeroed)
    assert np.all(dz <= ref.zeroed_slack), f"zeroed counts differ: {dz.max()} (slack {ref.zeroed_slack.max()})"
    np.testing.assert_allclose(np.asarray(res.row_sum), ref.row_sum, rtol=1e-5)
    assert np.all(np.abs(np.asarray(res.zeroed_mass, np.float64) - ref.zeroed_mass) <= ref.mass_tolerance())


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
@pytest.mark.parametrize("cfg", CASES)
def test_engine_matches_the_oracle(cfg, engine_name):
    run = _compiled(cfg, engine_name)
    for s, v, mask in _instances():
        ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
        assert_matches_oracle(run(s, v, mask), ref)


def test_oracle_slack_is_small_and_the_check_has_teeth():
    """The slack the oracle allows is far below one FP8 step, and a wrong order is caught."""
    s, v, mask = _instances()[1]  # Δ = 7: forward S = 1 zeroes most non-sink P
    cfg = PRESETS["fwd_s1"]
    ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
    assert np.max(ref.out_slack) < 1e-3 * np.max(np.abs(ref.out))
    assert ref.n_zeroed.sum() > 0.5 * mask.sum() * Q
    wrong = _compiled(PRESETS["rev_s1"], "scan")(s, v, mask)
    with pytest.raises(AssertionError):
        assert_matches_oracle(wrong, ref)


def test_split_check_has_teeth():
    """The oracle's split merge is checked: a wrong layout or no split at all is caught."""
    s, v, mask = _instances()[1]
    cfg = PRESETS["fwd_s1"].replace(kv_splits=4, split_layout="strided")
    ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
    for wrong in (cfg.replace(split_layout="contiguous"), PRESETS["fwd_s1"]):
        with pytest.raises(AssertionError):
            assert_matches_oracle(_compiled(wrong, "xla")(s, v, mask), ref)
