"""The FP8 MMA accumulator model (``KernelConfig.mma_acc_bits`` / ``mma_promote_keys``).

The config fields (validation, names, serialisation that leaves existing fingerprints alone), the
truncation against the independent oracle's own (frexp-based) truncation, both engines against
tests/oracle.py with the model on, checks that a wrong bit count or a wrong promotion path is
caught, the preset paths, the GPU script's fit on simulated kernel outputs, and the report section.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_oracle import assert_matches_oracle

from pcast_jax import block, engine
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import MMA_PROMOTION, PRESETS, get_preset, mma_model
from pcast_jax.sweep.spec import SweepSpec

import oracle
from cases import gpu_bench

Q, N, D = 8, 1000, 32


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_defaults_leave_configs_and_names_as_they_were():
    cfg = KernelConfig()
    assert cfg.mma_acc_bits == 0 and cfg.mma_promote_keys == 0
    assert cfg.to_dict()["mma_acc_bits"] == 0 and cfg.to_dict()["mma_promote_keys"] == 0  # every field written
    assert "mma" not in cfg.to_string() and cfg.name == "fwd_s1"
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"
    # where the model is off, the promotion interval does not act: normalised away
    assert KernelConfig(mma_promote_keys=64) == KernelConfig()


def test_fields_round_trip_and_name_the_model():
    cfg = KernelConfig(order="reverse", scale=256.0, block_kv=128, mma_acc_bits=14, mma_promote_keys=64)
    assert cfg.to_dict()["mma_acc_bits"] == 14 and cfg.to_dict()["mma_promote_keys"] == 64
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig.from_string(cfg.to_string()) == cfg
    assert KernelConfig.from_string("mma_acc_bits=14") == KernelConfig(mma_acc_bits=14)
    assert cfg.name.endswith("_acc14p64") and KernelConfig(mma_acc_bits=13).name.endswith("_acc13")
    assert "14-bit MMA accumulator model" in cfg.describe()
    assert cfg != cfg.replace(mma_promote_keys=0) != cfg.replace(mma_acc_bits=13)
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4, configs=(cfg,)).fingerprint() != \
        SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4, configs=(cfg.replace(mma_acc_bits=0),)).fingerprint()


@pytest.mark.parametrize("kwargs,param", [
    ({"mma_acc_bits": 24}, "mma_acc_bits"),
    ({"mma_acc_bits": -1}, "mma_acc_bits"),
    ({"mma_acc_bits": 1.5}, "mma_acc_bits"),
    ({"mma_acc_bits": 14, "mma_promote_keys": -32}, "mma_promote_keys"),
    ({"mma_acc_bits": 14, "mma_promote_keys": 48}, "mma_promote_keys"),
    ({"mma_acc_bits": 14, "block_kv": 128, "mma_promote_keys": 96}, "mma_promote_keys"),
    ({"mma_acc_bits": 14, "block_kv": 80}, "block_kv"),
    ({"mma_acc_bits": 14, "scale_mode": "dynamic"}, "scale_mode"),
    ({"mma_acc_bits": 14, "accumulator": "f16"}, "accumulator"),
    ({"mma_acc_bits": 14, "p_format": "nvfp4", "scale": 2688.0}, "p_format"),
])
def test_bad_fields_name_the_parameter(kwargs, param):
    with pytest.raises(PcastError, match=param):
        KernelConfig(**kwargs)


def test_block_pv_refuses_the_never_promoted_model():
    cfg = KernelConfig(mma_acc_bits=14)
    with pytest.raises(PcastError, match="mma_promote_keys"):
        block.block_pv(lambda lo, hi: jnp.zeros((2, 3)), cfg)


def test_presets_keep_their_semantics_and_model_variants_follow_the_source():
    assert all(c.mma_acc_bits == 0 for c in PRESETS.values())
    fa3 = mma_model("fa3")
    assert fa3.mma_acc_bits == 14 and fa3.mma_promote_keys == 0 and fa3.name == "fa3_mma14"
    assert dataclasses.replace(fa3, mma_acc_bits=0) == get_preset("fa3")
    hpc = mma_model("hpc_ops", bits=12)
    assert hpc.mma_promote_keys == hpc.block_kv and hpc.mma_acc_bits == 12
    # hpc-ops before its double-O accumulator commit accumulated every tile into O itself
    assert {MMA_PROMOTION[k] for k in ("fa3", "trtllm_xqa", "hpc_ops_prior")} == {"never"}
    assert mma_model("hpc_ops_prior").mma_promote_keys == 0
    assert {MMA_PROMOTION[k] for k in ("sageattn2", "hpc_ops")} == {"tile"}
    with pytest.raises(PcastError, match="preset='flashinfer_sm90'"):
        mma_model("flashinfer_sm90")


# --------------------------------------------------------------------------------------------
# The truncation, against the oracle's independent one
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 10, 13, 14, 22, 23])
def test_truncation_matches_the_oracle(rng, bits):
    x = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-20, 20, 5000)).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1.0, -1.0, 3.0, 2.0**-126, 3.4e38])])
    ours = np.asarray(block.truncate_mantissa(jnp.asarray(x), bits), np.float64)
    ref = oracle.truncate(x.astype(np.float64), bits)
    np.testing.assert_array_equal(ours, ref)
    assert np.all(np.abs(ours) <= np.abs(x))  # toward zero
    if bits < 23:
        assert np.any(ours != x)


# --------------------------------------------------------------------------------------------
# Both engines against the oracle with the model on
# --------------------------------------------------------------------------------------------

CASES = {
    "fwd_s1_acc14_never": PRESETS["fwd_s1"].replace(mma_acc_bits=14),
    "fa3_mma14": mma_model("fa3"),  # B = 224, never promoted, reverse, exponent mode
    "hpc_ops_mma14": mma_model("hpc_ops"),  # promoted per tile
    "rev_s256_acc10_p32": PRESETS["rev_s256"].replace(mma_acc_bits=10, mma_promote_keys=32),
    "xqa_multiblock_mma14": mma_model("trtllm_xqa_multiblock"),  # split-KV, never promoted
    "dynamic_acc12_p64": PRESETS["dynamic_pow2"].replace(mma_acc_bits=12, mma_promote_keys=64),
}


@functools.lru_cache(maxsize=None)
def _instances():
    rng = np.random.default_rng(13)
    return [oracle.sink_scores(rng, q=Q, n=N, d=D, delta=dl) for dl in (5.0, 7.0)]


@functools.lru_cache(maxsize=None)
def _run(cfg, engine_name):
    return jax.jit(lambda s, v, m: engine.attention(s, v, cfg, implementation=engine_name, count_mask=m))


@pytest.mark.parametrize("engine_name", engine.IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_engines_match_the_oracle_with_the_model(name, engine_name):
    cfg = CASES[name]
    for s, v, mask in _instances():
        ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
        assert_matches_oracle(_run(cfg, engine_name)(s, v, mask), ref)


def test_the_check_has_teeth():
    """Exact accumulation, one bit more or less, and the other promotion path all fail the check."""
    cfg = CASES["fwd_s1_acc14_never"]
    for s, v, mask in _instances():
        ref = oracle.attention(s, v, count_mask=mask, **oracle.config_kwargs(cfg))
        assert np.max(ref.out_slack) < 0.05 * np.max(np.abs(ref.out))
        for wrong in (cfg.replace(mma_acc_bits=0), cfg.replace(mma_acc_bits=13), cfg.replace(mma_acc_bits=15),
                      cfg.replace(mma_promote_keys=64)):
            with pytest.raises(AssertionError):
                assert_matches_oracle(_run(wrong, "scan")(s, v, mask), ref)


def test_the_model_moves_the_output_the_expected_way():
    """Truncation loses magnitude; the never-promoted chain loses more than per-tile promotion."""
    s, v, mask = _instances()[1]
    base = PRESETS["fwd_s1"]
    exact = np.asarray(engine.attention(s, v, base).out, np.float64)
    err = {}
    for promote in (0, 64):
        out = np.asarray(engine.attention(s, v, base.replace(mma_acc_bits=12, mma_promote_keys=promote)).out,
                         np.float64)
        err[promote] = np.mean((out - exact) ** 2)
    assert 0.0 < err[64] < err[0]


# --------------------------------------------------------------------------------------------
# The GPU script's fit, on simulated "kernel" outputs
# --------------------------------------------------------------------------------------------


def test_gpu_fit_recovers_the_bits_of_a_simulated_kernel():
    bench = gpu_bench()
    assert bench.parse_args(["--part", "mma"]).part == "mma"
    assert bench.MMA_FIT_BITS[0] == 0 and set(bench.MMA_FIT_BITS[1:]) == set(range(10, 24))
    rng = np.random.default_rng(3)
    s = rng.standard_normal((64, 1024)).astype(np.float32)  # flat scores, as the GPU step uses
    v = rng.standard_normal((1024, 32)).astype(np.float32)
    grid = (0, 10, 12, 14, 16, 23)
    sims = {b: np.asarray(engine.attention(s, v, bench.mma_fit_config(b)).out) for b in grid}
    assert bench.mma_fit_config(14).mma_promote_keys == 128
    for truth in (12, 14, 0):
        best, err = bench.fit_accumulator_bits(sims[truth], sims)
        assert best == truth and err[truth] == 0.0
        assert all(err[b] > 0.0 for b in grid if b not in (truth, 23, 0))
    # a kernel with noise far below the model's effect still fits to its bits
    noisy = sims[12] + 1e-7 * rng.standard_normal(sims[12].shape)
    assert bench.fit_accumulator_bits(noisy, sims)[0] == 12
    # 23 truncated bits lie within FP32 rounding of exact accumulation: the simpler model wins
    assert bench.fit_accumulator_bits(sims[23], sims)[0] == 0
    with pytest.raises(ValueError, match="shape"):
        bench.fit_accumulator_bits(sims[0][:3], sims)


@pytest.mark.slow
def test_gpu_fit_smoke_on_the_interpreted_kernel(capsys):
    """The GPU step end to end in interpret mode: the interpreter sums in FP32, so the fit is exact."""
    bench = gpu_bench()
    best, err = bench.run_mma(bench.parse_args(["--cpu-smoke", "--part", "mma"]))
    assert best == 0 and err[12] > 1e3 * err[0] and err[12] > err[14]
    assert "fitted accumulator: exact FP32" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# The report section
# --------------------------------------------------------------------------------------------


def test_section_writes_its_csv_and_a_finding(tmp_path, monkeypatch):
    from pcast_experiments import mma_accumulation as mod

    real = mod.measure
    monkeypatch.setattr(mod, "measure", lambda quick, log=None: real(quick=True, deltas=(3.0, 7.0), ns=(512,),
                                                                     log=log))
    md = mod.mma_section(tmp_path, quick=True)
    assert md.startswith("## ") and "**Finding.**" in md and "MODEL" in md
    lines = (tmp_path / "mma_accumulation.csv").read_text().splitlines()
    assert lines[0].split(",") == list(mod.COLUMNS) and len(lines) == 1 + 2 * len(mod.CONFIGS)
    rows = real(quick=True, deltas=(7.0,), ns=(512,), configs=("fwd_s1",))
    r = rows[0]
    assert r["mse_exact"] > 0 and r["acc_mse_never"] > 0 and r["acc_mse_tile"] > 0
    assert r["ratio_never"] == pytest.approx(r["mse_never"] / r["mse_exact"])
