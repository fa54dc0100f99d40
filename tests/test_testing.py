"""``pcast_jax.testing``: the P-collapse check a kernel author runs, on the simulator and on NumPy kernels.

The NumPy kernels below import nothing from the package (ml_dtypes does the casts): each reproduces one
of the AMD cases as its pull request describes it, broken and fixed.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pcast_jax import testing
from pcast_jax.presets import PRESETS, preset_for

#: The vendors study's verdicts (``pcast_experiments.vendors_and_knobs``, QUICK sizes: 256 seeds, N = 4096,
#: Δ = 7 and 10, d = 128), as its presets table wrote them.
VENDORS_FAIL = {
    "fwd_s1", "rev_s1", "fa4_pr2109", "flashinfer_sm100_cutedsl", "flashinfer_sm100_cutedsl_paged", "flashinfer_sm120",
    "sageattn3", "hpc_ops_prior", "cudnn_fp8", "cudnn_fp8_tau0", "cudnn_fp8_s32", "cudnn_fp8_s32_tau0", "cudnn_mxfp8",
    "vllm_triton_fp8", "vllm_triton_fp8_3d", "vllm_triton_fp8_rocm", "sglang_triton_decode", "fa_triton_amd_mi300",
    "fa_triton_amd_mi355", "vllm_rocm_flash_fp8", "nvfp4_fakequant", "mxfp8_p", "tensorrt_int8", "litert_uint8",
    "cudnn_sm100_fp8", "flydsl_fp8_gfx950", "aiter_mla_asm_fp8_gfx950"}
#: Presets whose verdict on these probes differs from the vendors study's, and why.
DIFFERS = {
    "mxfp8_p": "the E8M0 block scale clips block maxima whose mantissa exceeds 1.75 among the weaker keys; the probes "
               "read clipping on the dominant key only (on the weaker keys it is one reading with rounding)",
    "fa4_pr2109": "its lazy rescale lets the sink's P exceed 1 when the sink's lead over the running max is under τ: "
                  "Table 3's N(0, 1) keys reach ~3.5 above their median, so at its Δ = 7 the jump is ~4.5 nats, "
                  "here Δ − ln 2 ≈ 6.3",
    "sageattn3": "NVFP4: zeroing depends on each 16-key block's own scale; the witnesses leave it within noise",
    "nvfp4_fakequant": "NVFP4: as sageattn3",
    "cudnn_sm120_fp8": "its zeroed mass at Δ = 10 (8.9e-4 in the vendors study) lies next to the limit: the probes' "
                       "replicates leave it within noise",
    "fa4_pr2717": "reverse order zeroes only the dominant key's own block, which few witnesses sample: within noise",
}


def test_the_verdict_tables_name_presets():
    assert set(VENDORS_FAIL) <= set(PRESETS) and set(DIFFERS) <= set(PRESETS)


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in DIFFERS])
def test_every_preset_through_the_simulator_gets_the_vendors_verdict(name):
    """At the vendors study's Δ = 7 and 10 (one compiled program per program class: simulated_kernel)."""
    kernel = testing.simulated_kernel(preset_for(name, 128))
    check = testing.check_p_collapse(kernel, head_dim=128, deltas=(7.0, 10.0), fingerprint=False)
    assert check.safe is (name not in VENDORS_FAIL), check.summary()


# --------------------------------------------------------------------------------------------
# Independent NumPy kernels: the three AMD cases
# --------------------------------------------------------------------------------------------

F8 = ml_dtypes.float8_e4m3fn


def _cast(x):
    return np.asarray(x, np.float32).astype(F8).astype(np.float32)


def numpy_kernel(q, k, v, *, scale, s=1.0, partition=0, normalised=True, block=128):
    """Forward-order FP8 attention in [batch, tokens, heads, dim]: P = exp(z − m)·S cast to E4M3 against the
    running max, O/(S·ℓ), the max rebased every block (an eager rescale). ``partition``: P normalised within
    each partition of that many keys before the cast, partitions merged by their log-sum-exp (aiter #5642);
    ``normalised=False`` casts exp(z − partition max)·S instead and divides by the partition's ℓ after the
    product (the fixed variant: an assumption, the fix's code was not read)."""
    f32 = np.float32
    qt, kt, vt = (np.moveaxis(np.asarray(a, f32), 2, 1) for a in (q, k, v))
    z = (f32(scale) * np.einsum("bhtd,bhnd->bhtn", qt, kt)).astype(f32)
    n = z.shape[-1]
    if partition:
        outs, lses = [], []
        for lo in range(0, n, partition):
            zp = z[..., lo:lo + partition]
            mp = zp.max(axis=-1, keepdims=True)
            w = np.exp(zp - mp)
            ell = w.sum(axis=-1, keepdims=True)
            p8 = _cast(w / ell * f32(s)) / f32(s) if normalised else _cast(w * f32(s)) / f32(s) / ell
            outs.append(np.einsum("bhtn,bhnd->bhtd", p8, vt[..., lo:lo + partition, :]))
            lses.append(mp + np.log(ell))
        lse = np.stack(lses)
        wts = np.exp(lse - lse.max(axis=0))
        out = sum(w * o for w, o in zip(wts, outs)) / wts.sum(axis=0)
        return np.moveaxis(out, 1, 2).astype(f32)
    m = np.full(z.shape[:-1], -np.inf, f32)
    ell = np.zeros(z.shape[:-1], f32)
    o = np.zeros(z.shape[:-1] + (vt.shape[-1],), f32)
    for lo in range(0, n, block):
        zb = z[..., lo:lo + block]
        m_new = np.maximum(m, zb.max(axis=-1))
        alpha = np.exp(m - m_new).astype(f32)
        p = np.exp(zb - m_new[..., None]).astype(f32)
        ell = alpha * ell + p.sum(axis=-1)
        o = alpha[..., None] * o + np.einsum("bhtn,bhnd->bhtd", _cast(p * f32(s)), vt[..., lo:lo + block, :])
        m = m_new
    return np.moveaxis(o / (ell[..., None] * f32(s)), 1, 2).astype(f32)


def test_the_numpy_kernel_reproduces_aiter_5535():
    """One logit at 0, 2,047 at −7, V = 1: S = 1 gives ~0.35, ×448 before the cast ~0.996."""
    q = np.zeros((1, 1, 1, 16), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 2048, 1, 16), np.float32)
    k[:, 1:, :, 0] = -7.0
    v = np.ones((1, 2048, 1, 16), np.float32)
    assert numpy_kernel(q, k, v, scale=1.0)[0, 0, 0, 0] == pytest.approx(0.3496, abs=2e-3)
    assert numpy_kernel(q, k, v, scale=1.0, s=448.0)[0, 0, 0, 0] == pytest.approx(0.9964, abs=2e-3)


def test_the_aiter_mla_preset_reproduces_aiter_5535_as_the_numpy_kernel_does():
    """The gfx950 ASM MLA decode preset (S = 1, forward, B = 64) on the PR's case, against the independent NumPy
    kernel at the same tile: both zero the 2,047 keys at −7 (e^-7 ≈ 9.1e-4 lies 7 % below the E4M3 rounding
    midpoint 2^-10 ≈ 9.8e-4, so exp's last-ulp differences cannot move it) and divide 1 by ℓ = 1 + 2047·e^-7."""
    q = np.zeros((1, 1, 1, 16), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 2048, 1, 16), np.float32)
    k[:, 1:, :, 0] = -7.0
    v = np.ones((1, 2048, 1, 16), np.float32)
    got = testing.simulated_kernel("aiter_mla_asm_fp8_gfx950", scale=1.0)(q, k, v)
    want = numpy_kernel(q, k, v, scale=1.0, block=PRESETS["aiter_mla_asm_fp8_gfx950"].block_kv)
    # ℓ is a float32 sum of 2,048 positive terms: summed in another order it differs by at most 2048·2^-24
    # ≈ 1.2e-4 of itself, and so does the output (V = 1).
    np.testing.assert_allclose(got, want, rtol=1.3e-4, atol=0)
    assert got[0, 0, 0, 0] == pytest.approx(1.0 / (1.0 + 2047.0 * np.exp(-7.0)), rel=1.3e-4)


#: The fixes as the pull requests ship them. FlyDSL #1020 (ROCm/FlyDSL at 6de2a37,
#: kernels/attention/flash_attn_utils.py lines 5113-5128: P·2^headroom with headroom = log2 448, less the lazy
#: rescale's threshold when that path runs; flash_attn_interface.py lines 809-812: FP8 defaults to the eager
#: rescale) and aiter #5535 (×448 before the cast) both make S = 448: the closed form's Δc = 10 ln 2 + ln 448
#: ≈ 13.0 for one dominant key, so each fix passes to Δ = 12 and still collapses at Δ = 14, as the paper says
#: any static S ≤ 448 must. aiter #5642's fix takes P against each partition's own max (an assumption: the
#: fix's code was not read), so only the dominant key's partition is cast against it: it passes to Δ = 14.
CASES = {  # name: (broken kernel options, fixed kernel options, Δ range the fix passes, whether Δ = 14 fails)
    "aiter_5535_s1": (dict(s=1.0), dict(s=448.0), (2.0, 12.0), True),
    "aiter_5642_partition": (dict(partition=256), dict(partition=256, normalised=False, s=256.0), (2.0, 14.0),
                             False),
    "flydsl_1020_s448": (dict(s=1.0), dict(s=448.0), (2.0, 12.0), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_amd_case_is_caught_and_its_fix_passes(case):
    from pcast_jax import theory

    broken, fixed, (lo, hi), beyond_fails = CASES[case]
    bad = testing.check_p_collapse(lambda q, k, v: numpy_kernel(q, k, v, scale=1 / 8, **broken), head_dim=64,
                                   fingerprint=False)
    assert bad.safe is False and bad.collapse_delta is not None, bad.summary()
    good = testing.check_p_collapse(lambda q, k, v: numpy_kernel(q, k, v, scale=1 / 8, **fixed), head_dim=64,
                                    deltas=tuple(float(d) for d in np.arange(lo, hi + 1)), fingerprint=False)
    assert good.safe is True, good.summary()
    if beyond_fails:  # S = 448: Δc ≈ 13.0 lies between the last Δ the fix passes and 14
        assert hi < float(theory.critical_delta(448.0, k_sink=1, fmt="e4m3")) < 14.0
        past = testing.check_p_collapse(lambda q, k, v: numpy_kernel(q, k, v, scale=1 / 8, **fixed), head_dim=64,
                                        deltas=(14.0,), fingerprint=False)
        assert past.safe is False, past.summary()


# --------------------------------------------------------------------------------------------
# The opt-in pytest plugin: the fixture p_collapse in a kernel author's own test file
# --------------------------------------------------------------------------------------------

pytest_plugins = ["pytester"]

#: A kernel author's test file: one line loads the plugin; an S = 1 forward kernel (its own NumPy, one KV
#: block: key 0 is the row max) and an exact one, each through the fixture.
KERNEL_TEST_FILE = '''
import ml_dtypes
import numpy as np

pytest_plugins = ["pcast_jax.testing.pytest_plugin"]


def attention(q, k, v, *, fp8_s=None):
    z = np.einsum("bthd,bnhd->bhtn", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    ell = p.sum(axis=-1, keepdims=True)
    if fp8_s is not None:  # P·S cast to E4M3 before the product, as an FP8 kernel does
        p = (p * fp8_s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / fp8_s
    return np.einsum("bhtn,bnhd->bthd", p / ell, v)


def test_s1_kernel(p_collapse):
    p_collapse(lambda q, k, v: attention(q, k, v, fp8_s=1.0), head_dim=16, n_keys=512, fingerprint=False)


def test_exact_kernel(p_collapse):
    check = p_collapse(attention, head_dim=16, n_keys=512, fingerprint=False)
    assert check.safe is True
'''


def test_the_fixture_fails_a_collapsing_kernel_with_the_report(pytester):
    pytester.makepyfile(test_kernel=KERNEL_TEST_FILE)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA", "--junitxml=junit.xml")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    failure = text[text.index("_ test_s1_kernel _"):text.index("Captured P-collapse check call")]
    # the report is the failure's message, with no traceback into the check
    assert "**P-collapse check: fails: P-collapse from Δ = " in failure, failure
    assert "pcast_jax" not in failure.replace("pcast_jax.testing.pytest_plugin", ""), failure
    # the passing test's report is kept as its section (-rA prints it)
    passed = text[text.index("_ test_exact_kernel _"):]
    assert "P-collapse check: passes" in passed, passed
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="p_collapse" value="passes:' in junit and 'name="p_collapse" value="fails:' in junit, junit


def test_the_plugin_is_opt_in(pytester):
    """Installing pcast_jax registers no plugin: without the pytest_plugins line the fixture is unknown."""
    pytester.makepyfile(test_kernel=KERNEL_TEST_FILE.replace('pytest_plugins = ["pcast_jax.testing.pytest_plugin"]',
                                                             ""))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*fixture 'p_collapse' not found*"])


# --------------------------------------------------------------------------------------------
# pcast probe: the same check for a kernel run elsewhere, through files
# --------------------------------------------------------------------------------------------


def test_pcast_probe_writes_the_probes_and_checks_outputs_as_the_api_does(tmp_path, capsys):
    import json

    from pcast_jax import cli

    probes = tmp_path / "probes.npz"
    assert cli.main(["probe", "write", "--head-dim", "64", "--n-keys", "1024", "--delta", "2:14:2",
                     "--out", str(probes)]) == 0
    capsys.readouterr()
    with np.load(probes) as z:
        q, k, v = z["q"], z["k"], z["v"]
    for options, status in ((dict(s=1.0), 1), (dict(s=448.0), 0)):
        np.savez(tmp_path / "out.npz", out=numpy_kernel(q, k, v, scale=1 / 8, **options))
        assert cli.main(["probe", "check", str(probes), str(tmp_path / "out.npz"), "--format", "json"]) == status
        got = json.loads(capsys.readouterr().out)
        want = testing.check_p_collapse(lambda q, k, v: numpy_kernel(q, k, v, scale=1 / 8, **options), head_dim=64,
                                        n_keys=1024, deltas=(2, 4, 6, 8, 10, 12, 14), fingerprint=False)
        assert got["safe"] is want.safe and got["verdict"] == want.verdict
        # the same probes and outputs: the same readings, to JSON's round trip of a float64
        assert got["rows"] == [r.to_dict() for r in want.rows]
    assert cli.main(["probe", "check", str(probes), str(tmp_path / "out.npz")]) == 0
    assert capsys.readouterr().out.startswith("**P-collapse check: passes")


def test_pcast_probe_check_names_the_nearest_preset_from_the_fingerprint_files(tmp_path, capsys):
    """The simulator running fwd_s1 as the kernel: the fingerprint's fields agree with fwd_s1, S = 1, Δc = 10 ln 2."""
    from pcast_jax import cli, fingerprint

    kernel = testing.simulated_kernel("fwd_s1")
    probes = testing.collapse_probes(64, n_keys=1024, deltas=(4.0, 10.0))
    probes.save(tmp_path / "p.npz")
    np.savez(tmp_path / "o.npz", out=kernel(*probes.arrays()))
    ps = fingerprint.probes(64)
    ps.save(tmp_path / "fp.npz")
    np.savez(tmp_path / "fo.npz", out=kernel(ps.q, ps.k, ps.v))
    assert cli.main(["probe", "check", str(tmp_path / "p.npz"), str(tmp_path / "o.npz"), "--fingerprint",
                     str(tmp_path / "fp.npz"), str(tmp_path / "fo.npz")]) == 1
    out = capsys.readouterr().out
    assert "fails: P-collapse from Δ = 10" in out, out
    assert "fwd_s1" in out.split("Nearest preset:")[1].split("\n")[0], out
    assert "Δc = 6.93 " in out, out  # 10 ln 2 = 6.931…


# --------------------------------------------------------------------------------------------
# Both Pallas kernels in interpret mode as the kernel under test
# --------------------------------------------------------------------------------------------

#: KV length of the Pallas probes: 8 KV blocks of fwd_s1 (64 keys), 4 of fa3 (160: 3.2 blocks, the last partial).
PALLAS_N_KEYS = 512


def pallas_kernel(backend: str, cfg, *, interpret: bool):
    """``kernel(q, k, v)`` as a kernel author wraps a Pallas kernel: jax.nn's layout to (batch, heads, tokens,
    dim), Q/K/V quantized per tensor to E4M3 (lossless on the probes), the query rows padded with zeros to
    the kernels' 64-row query tile and dropped again."""
    import jax.numpy as jnp

    import pallas_kernels

    def kernel(q, k, v):
        rows = q.shape[1]
        q = np.pad(q, ((0, 0), (0, -rows % 64), (0, 0), (0, 0)))
        q8, k8, v8, descales = pallas_kernels.quantize_qkv(*(jnp.swapaxes(jnp.asarray(x), 1, 2) for x in (q, k, v)))
        out = pallas_kernels.fp8_attention(q8, k8, v8, config=cfg, implementation=backend, interpret=interpret,
                                           **descales)
        return np.swapaxes(np.asarray(out), 1, 2)[:, :rows]

    return kernel


@pytest.mark.parametrize("name", ["fwd_s1", "fa3"])
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_both_pallas_kernels_get_the_simulators_verdict(backend, name):
    """fwd_s1 (S = 1, forward: collapses) and fa3 (S = 448·2^-8 as an exponent, reverse: passes) on each
    kernel, compiled on a GPU (benchmarks/gpu_check.sh), else in interpret mode: the verdict and collapse Δ
    the simulator gets for the same preset."""
    import jax

    on_gpu = jax.default_backend() == "gpu"
    cfg = preset_for(name, 64)
    got = testing.check_p_collapse(pallas_kernel(backend, cfg, interpret=not on_gpu), head_dim=64,
                                   n_keys=PALLAS_N_KEYS, fingerprint=False)
    want = testing.check_p_collapse(testing.simulated_kernel(cfg), head_dim=64, n_keys=PALLAS_N_KEYS,
                                    fingerprint=False)
    assert got.safe is want.safe is (name == "fa3"), got.summary()
    assert got.collapse_delta == want.collapse_delta
    for g, w in zip(got.rows, want.rows):
        # the kernels zero exactly the P the simulator zeroes (tests/test_pallas.py): the witnesses read the same
        assert g.zeroed == w.zeroed and g.verdict == w.verdict, (g, w)
        if not on_gpu:  # the V = 1 column: float32 sums of ≤ 512 terms in another order, each within 512·2^-24
            assert abs(g.lost_mass - w.lost_mass) <= PALLAS_N_KEYS * 2.0**-24, (g, w)
