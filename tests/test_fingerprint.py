"""``pcast_jax.fingerprint``: identify reads a black box's P-cast from its outputs on the probes.

Black boxes: every preset of the registry through the simulator (a preset added later is covered
with no edit here), and an independent NumPy FP8 attention written below (it imports nothing from
the package; ml_dtypes does the casts) over configs no preset has, with and without noise of its own.
One probe shape (head dim 64, with sinks for the presets, without for the NumPy kernel) is reused
by every test, so each candidate is simulated once per shape in the whole file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import ml_dtypes
import numpy as np
import pytest

from pcast_jax import cli, fingerprint
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.fingerprint.fit import UNFITTED_FIELDS, fittable_presets
from pcast_jax.presets import PRESETS, preset_for

from cases import FULL

HEAD_DIM = 64
SCALE = 1 / 8  # jax.nn's 1/sqrt(64): a power of two, so the logits are exact


def _agrees(fp, truth: dict) -> list[str]:
    """Fields where ``fp`` contradicts ``truth``: a determined value that differs, or an undetermined
    field whose candidates leave the true value out."""
    bad = []
    for field, want in truth.items():
        e = fp.fields[field]
        if (e.determined and e.value != want) or (not e.determined and want not in e.candidates):
            bad.append(f"{field}: true {want!r}, found {e.value!r} (determined={e.determined}, "
                       f"candidates {e.candidates})")
    return bad


# --------------------------------------------------------------------------------------------
# Every preset as a black box through the simulator
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sink_probes():
    return fingerprint.probes(HEAD_DIM, scale=SCALE, sinks=True)


#: ``make test`` reads every eighth preset (a rotating sample of families: fitting one is a search over
#: many compiled candidates); ``make test-full`` reads every preset of the registry that the candidates
#: express (``fingerprint.fit.fittable_presets``) and that sets no field of ``UNFITTED_FIELDS``.
_FITTABLE = [name for name, cfg in fittable_presets().items() if not any(getattr(cfg, f) for f in UNFITTED_FIELDS)]
IDENTIFIED_PRESETS = _FITTABLE if FULL else _FITTABLE[::8]


@pytest.mark.parametrize("name", IDENTIFIED_PRESETS)
def test_identify_recovers_every_preset(name, sink_probes):
    cfg = PRESETS[name]
    calls = []

    def black_box(q, k, v, sinks):
        calls.append(q.shape)
        return fingerprint.simulate_outputs(dataclasses.replace(sink_probes, q=q, k=k, v=v, sinks=sinks), cfg)

    fp = fingerprint.identify(black_box, head_dim=HEAD_DIM, scale=SCALE, sinks=True)
    assert len(calls) == fp.calls == 1
    truth = {f: getattr(cfg, f) for f in fingerprint.FIELDS}
    assert not _agrees(fp, truth), (name, _agrees(fp, truth))
    # the fitted config reproduces the black box on the probes
    assert fp.residual < 1e-5, (name, fp.residual)
    again = fingerprint.simulate_outputs(sink_probes, fp.config)
    want = fingerprint.simulate_outputs(sink_probes, cfg)
    assert np.allclose(again, want, rtol=1e-5, atol=1e-7), name
    # the tile changes these outputs in every preset (the order does not where each split runs one block)
    # but where P is normalised before the cast (one pass over the whole row: no tile acts)
    assert fp.fields["block_kv"].determined == (cfg.p_offset != "row_lse"), name


# --------------------------------------------------------------------------------------------
# An independent NumPy FP8 attention (imports nothing from pcast_jax)
# --------------------------------------------------------------------------------------------

_NP_FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e5m2": ml_dtypes.float8_e5m2}


#: Fixed-point P formats: round to the nearest integer (ties to even), clipped to the range.
_NP_INTEGERS = {"int8": (-128.0, 127.0), "uint8": (0.0, 255.0)}


def _cast(x, fmt):
    """Saturating round-to-nearest-even cast to ``fmt``, widened back to float32."""
    if fmt in _NP_INTEGERS:
        return np.clip(np.round(x), *_NP_INTEGERS[fmt]).astype(np.float32)
    dt = _NP_FORMATS[fmt]
    top = float(ml_dtypes.finfo(dt).max)
    return np.clip(x, -top, top).astype(dt).astype(np.float32)


def _quantize(x, top=448.0):
    """Per-tensor E4M3 quantization: x8 = cast(x·top/amax), returned dequantized (``top`` = 448 maps
    amax to E4M3's largest value; a kernel keeping a margin maps it lower)."""
    amax = np.float32(np.max(np.abs(x)))
    return _cast(x * (np.float32(top) / amax), "e4m3") * (amax / np.float32(top))


def numpy_fp8_attention(q, k, v, *, scale, tile, order="forward", s=1.0, mode="multiply", fmt="e4m3", splits=1,
                        qkv8=False, qkv_top=448.0, f16=False, causal=False, ell_cast=False, offset="running_max"):
    """Algorithm 1 in NumPy float32, (batch, tokens, heads, dim) in and out.

    Per split (contiguous ranges of ⌈blocks/splits⌉ tiles) the tiles run in ``order``: running max m,
    α = exp(m − m_new), P = exp(z − m_new) (``multiply``: P̃ = cast(P·s), ℓ sums P; ``exponent``:
    P̃ = cast(exp2(z·log2e − (m_new·log2e − log2 s))), ℓ sums the scaled values), O = α·O + P̃·V
    (rounded to float16 per tile with ``f16``); the splits merge by their maxima; O/(s·ℓ) or O/ℓ.
    ``qkv8`` quantizes Q, K, V per tensor to E4M3 first (amax to ``qkv_top``); ``causal`` masks key j
    from row i when j > N − T + i (bottom-right aligned); ``ell_cast`` sums the cast values into ℓ
    (P̃/s in the multiply mode) instead of the pre-cast P. ``fmt`` may be ``"int8"`` or ``"uint8"``
    (P·s rounded to an integer). ``offset="row_lse"`` (multiply mode, one split) casts the normalised
    P = exp(z − m_row)/ℓ_row of a first pass over the row and returns O/s; ``"block_max"`` takes P against
    the block's own max and multiplies the block's ΣP and P̃·V by β = exp(m_block − m_new).
    """
    f32 = np.float32
    if qkv8:
        q, k, v = _quantize(q, qkv_top), _quantize(k, qkv_top), _quantize(v, qkv_top)
    z = (np.einsum("bthd,bnhd->bhtn", q.astype(np.float64), k.astype(np.float64)).astype(f32) * f32(scale))
    if causal:
        t_len, n_len = z.shape[-2:]
        z = np.where(np.arange(n_len)[None, :] > n_len - t_len + np.arange(t_len)[:, None], -np.inf, z).astype(f32)
    vt = np.moveaxis(v, 2, 1).astype(f32)  # (b, h, n, d)
    n = z.shape[-1]
    tiles = [slice(i, min(i + tile, n)) for i in range(0, n, tile)]
    per = -(-len(tiles) // splits)
    parts = []
    log2e = f32(math.log2(math.e))
    if offset == "row_lse":
        m_row = z.max(axis=-1)
        ell_row = np.exp(z - m_row[..., None]).astype(f32).sum(axis=-1, dtype=f32)
    for start in range(0, len(tiles), per):
        mine = tiles[start:start + per]
        if order == "reverse":
            mine = mine[::-1]
        m = np.full(z.shape[:-1], -np.inf, f32)
        ell = np.zeros(z.shape[:-1], f32)
        o = np.zeros(z.shape[:-1] + (v.shape[-1],), f32)
        for t in mine:
            zb = z[..., t]
            m_new = np.maximum(m, zb.max(axis=-1))
            m_ref = np.where(np.isneginf(m_new), f32(0), m_new)  # a row with every key so far masked
            alpha = np.exp(m - m_ref).astype(f32)
            beta = f32(1.0)
            if offset == "row_lse":  # taken against the row's max from the start: nothing to rescale
                alpha = np.ones_like(alpha)
                p = (np.exp(zb - m_row[..., None]).astype(f32) / ell_row[..., None]).astype(f32)
                p8 = _cast(p * f32(s), fmt)
            elif offset == "block_max":
                b_max = zb.max(axis=-1)
                p = np.exp(zb - b_max[..., None]).astype(f32)
                p8 = _cast(p * f32(s), fmt)
                beta = np.exp(b_max - m_ref).astype(f32)
            elif mode == "multiply":
                p = np.exp(zb - m_ref[..., None]).astype(f32)
                p8 = _cast(p * f32(s), fmt)
            else:
                p = np.exp2(zb * log2e - (m_ref * log2e - f32(math.log2(s)))[..., None]).astype(f32)
                p8 = _cast(p, fmt)
            if ell_cast:
                p = p8 / f32(s) if mode == "multiply" else p8
            ell = alpha * ell + beta * p.sum(axis=-1, dtype=f32)
            pv = np.einsum("bhtn,bhnd->bhtd", p8.astype(np.float64), vt[..., t, :].astype(np.float64)).astype(f32)
            pv = (np.asarray(beta)[..., None] * pv).astype(f32)
            if f16:
                pv = pv.astype(np.float16).astype(f32)
            o = alpha[..., None] * o + pv
            m = m_new
        parts.append((m, ell, o))
    top = np.max([m for m, _, _ in parts], axis=0)
    ell = sum(np.exp(m - top).astype(f32) * e for m, e, _ in parts)
    o = sum(np.exp(m - top).astype(f32)[..., None] * x for m, _, x in parts)
    if offset == "row_lse":  # P was normalised before the cast: O/s
        ell = np.ones_like(ell)
    out = o / (ell[..., None] * (f32(s) if mode == "multiply" else f32(1.0)))
    return np.moveaxis(out, 1, 2).astype(f32)


#: Configs no preset has: an odd tile, S = 32, the other order, FNUZ, E5M2, two splits.
NUMPY_KERNELS = [
    dict(tile=48, order="reverse", s=32.0, mode="multiply", fmt="e4m3"),
    dict(tile=80, order="forward", s=32.0, mode="exponent", fmt="e4m3", splits=2),
    dict(tile=96, order="reverse", s=4.0, mode="multiply", fmt="e5m2"),
    dict(tile=112, order="forward", s=64.0, mode="multiply", fmt="e4m3fnuz"),
]


def _truth(kw: dict) -> dict:
    return {"order": kw["order"], "block_kv": kw["tile"], "scale": kw["s"], "scale_mode": kw["mode"],
            "p_format": kw["fmt"], "kv_splits": kw.get("splits", 1), "rescale_threshold": 0.0,
            "accumulator": "f16" if kw.get("f16") else "f32", "p_offset": kw.get("offset", "running_max")}


def test_numpy_kernels_are_no_preset():
    for kw in NUMPY_KERNELS:
        t = _truth(kw)
        cfg = KernelConfig(order=t["order"], block_kv=t["block_kv"], scale=t["scale"], scale_mode=t["scale_mode"],
                           p_format=t["p_format"], kv_splits=t["kv_splits"])
        assert cfg not in set(PRESETS.values()), kw


@pytest.mark.parametrize("kw", NUMPY_KERNELS if FULL else NUMPY_KERNELS[::3],
                         ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_identify_recovers_an_independent_numpy_kernel(kw):
    fp = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **kw), head_dim=HEAD_DIM,
                              scale=SCALE)
    assert not _agrees(fp, _truth(kw)), _agrees(fp, _truth(kw))
    for field in ("order", "block_kv"):
        assert fp.fields[field].determined, (field, fp.fields[field])
    assert fp.residual < 1e-3, fp.residual
    # S is read up to the classes that are one function here (FNUZ at S is E4M3 at 2S below 240)
    assert kw["s"] in fp.fields["scale"].candidates


#: Fixed-point P (no preset has these S) against a max of each kind: the block's own, the row's
#: log-sum-exp (the normalised P of a first pass is cast), the running max.
INTEGER_KERNELS = [
    dict(tile=32, order="reverse", s=128.0, mode="multiply", fmt="uint8", offset="row_lse"),
    dict(tile=64, order="forward", s=64.0, mode="multiply", fmt="int8", offset="block_max"),
    dict(tile=48, order="reverse", s=32.0, mode="multiply", fmt="int8"),
]


def test_the_numpy_kernel_is_the_simulator_on_integer_p_and_both_offsets(plain):
    """The oracle and the simulator agree on the probes where the fit needs them to: fixed-point P, P
    against the block's own max, P normalised before the cast."""
    ps, _ = plain
    for kw in INTEGER_KERNELS:
        cfg = KernelConfig(order=kw["order"], block_kv=kw["tile"], scale=kw["s"], p_format=kw["fmt"],
                           p_offset=kw.get("offset", "running_max"))
        assert cfg not in set(PRESETS.values()), kw
        want = numpy_fp8_attention(ps.q, ps.k, ps.v, scale=SCALE, **kw)
        got = fingerprint.simulate_outputs(ps, cfg)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-7), (kw, float(np.max(np.abs(got - want))))


@pytest.mark.parametrize("kw", INTEGER_KERNELS if FULL else INTEGER_KERNELS[:1], ids=lambda kw: kw["fmt"])
def test_identify_recovers_integer_p_and_where_it_is_taken(kw):
    fp = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **kw), head_dim=HEAD_DIM,
                              scale=SCALE)
    truth = _truth(kw)
    assert not _agrees(fp, truth), _agrees(fp, truth)
    assert fp.fields["p_offset"].determined and fp.residual < 1e-4, fp.summary()
    # the integer grid is read: no float format fits alike
    assert all(f in ("int8", "uint8") for f in fp.fields["p_format"].candidates), fp.fields["p_format"]


@pytest.mark.parametrize("noise", ["qkv8", "f16"])
def test_identify_stays_right_under_the_kernels_own_noise(noise):
    """E4M3 Q/K/V with per-tensor scales (lossless on the probes), or an FP16 accumulator: the fields
    are right or reported undetermined with the truth among the candidates."""
    kw = dict(tile=48, order="reverse", s=32.0, mode="multiply", fmt="e4m3", **{noise: True})
    fp = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **kw), head_dim=HEAD_DIM,
                              scale=SCALE)
    assert not _agrees(fp, _truth(kw)), _agrees(fp, _truth(kw))
    assert fp.fields["order"].determined and fp.fields["block_kv"].determined


def test_identify_says_undetermined_where_the_kernels_own_noise_hides_a_field():
    """Q/K/V quantized per tensor with a small margin (amax to 447, not 448: the scale is no longer a power
    of two, so each tensor comes back 448/447 too large and every logit moves by 0.45 %): where that
    noise covers a field's differences the field is reported undetermined with the truth among its
    candidates, never another value as decided."""
    kw = dict(tile=48, order="reverse", s=32.0, mode="multiply", fmt="e4m3", qkv8=True, qkv_top=447.0)
    fp = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **kw), head_dim=HEAD_DIM,
                              scale=SCALE)
    assert not _agrees(fp, _truth(kw)), _agrees(fp, _truth(kw))
    assert fp.residual > 1e3 * fingerprint.result.RESIDUAL_FLOOR, fp.residual  # the noise is seen, not fitted
    # the same kernel without the noise (NUMPY_KERNELS[0]): the fields the noise hid were decided there
    clean = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **NUMPY_KERNELS[0]),
                                 head_dim=HEAD_DIM, scale=SCALE)
    hidden = {f: e.candidates for f, e in fp.fields.items() if not e.determined and clean.fields[f].determined}
    assert hidden, fp.summary()
    for field, candidates in hidden.items():
        assert len(candidates) > 1 and clean.fields[field].value in candidates, (field, candidates)


# --------------------------------------------------------------------------------------------
# Causal masking, ℓ, the Pallas kernels as black boxes
# --------------------------------------------------------------------------------------------

#: A config both causal black boxes run: FlashAttention-3's at head dim 64 (reverse, B = 160, exponent, S = 256),
#: so the NumPy kernel's fit reuses the candidates the preset's simulated
CAUSAL_KW = dict(tile=160, order="reverse", s=256.0, mode="exponent", fmt="e4m3")


@pytest.mark.parametrize("box", ["preset", "numpy"])
def test_identify_reads_a_causal_kernel(box):
    cfg = dataclasses.replace(preset_for("fa3", HEAD_DIM), causal=True)
    assert (cfg.order, cfg.block_kv, cfg.scale, cfg.scale_mode) == ("reverse", 160, 256.0, "exponent")
    ps = fingerprint.probes(HEAD_DIM, scale=SCALE, causal=True)
    if box == "preset":
        def black_box(q, k, v):
            return fingerprint.simulate_outputs(dataclasses.replace(ps, q=q, k=k, v=v), cfg)
    else:
        def black_box(q, k, v):
            return numpy_fp8_attention(q, k, v, scale=SCALE, causal=True, **CAUSAL_KW)
    fp = fingerprint.identify(black_box, head_dim=HEAD_DIM, scale=SCALE, causal=True)
    assert fp.config.causal
    truth = _truth(CAUSAL_KW)
    assert not _agrees(fp, truth), _agrees(fp, truth)
    assert fp.fields["order"].determined and fp.fields["block_kv"].determined
    assert fp.residual < 1e-5, fp.residual
    if FULL:  # the mask is part of the fit: a causal black box read as a non-causal one fits nothing
        with pytest.raises(PcastError, match="outputs fit no candidate"):
            fingerprint.fit(fingerprint.probes(HEAD_DIM, scale=SCALE), black_box(*ps.arrays()))


@pytest.mark.skipif(not FULL, reason="make test-full: one more fit (the note itself is checked by the CLI test)")
def test_what_the_row_sum_holds_is_reported_as_not_fitted():
    """No KernelConfig field selects ℓ from the cast P: the fingerprint says so rather than read it, and a
    kernel that sums the cast values is not passed off as an exact fit."""
    kw = dict(NUMPY_KERNELS[0], ell_cast=True)
    fp = fingerprint.identify(lambda q, k, v: numpy_fp8_attention(q, k, v, scale=SCALE, **kw), head_dim=HEAD_DIM,
                              scale=SCALE)
    assert "row_sum" in fp.not_fitted and "pre-cast" in fp.not_fitted["row_sum"]
    assert "not fitted: row_sum" in fp.summary() and "row_sum" in fp.to_dict()["not_fitted"]
    assert not hasattr(KernelConfig(), "row_sum")
    assert fp.residual > 10 * fingerprint.result.RESIDUAL_FLOOR, fp.residual
    assert not _agrees(fp, {f: _truth(kw)[f] for f in ("order", "block_kv")})


def pallas_black_box(backend: str, cfg: KernelConfig):
    """``fn(q, k, v)``: a Pallas kernel in interpret mode, Q/K/V quantized per tensor to E4M3 as its
    caller would (lossless on the probes), in jax.nn's layout."""
    import jax.numpy as jnp

    import pallas_kernels

    def fn(q, k, v):
        q8, k8, v8, descales = pallas_kernels.quantize_qkv(*(jnp.swapaxes(jnp.asarray(x), 1, 2) for x in (q, k, v)))
        out = pallas_kernels.fp8_attention(q8, k8, v8, config=cfg, implementation=backend, interpret=True,
                                           scale=SCALE, **descales)
        return np.swapaxes(np.asarray(out), 1, 2)

    return fn


#: ``make test`` reads one preset through both kernels (the second fit reuses the first's candidates);
#: ``make test-full`` adds a forward order, split-KV and a lazy rescale with its compensation.
PALLAS_PRESETS = ["fa3", "hpc_ops", "trtllm_xqa_multiblock", "cudnn_fp8"] if FULL else ["fa3"]


@pytest.mark.parametrize("name", PALLAS_PRESETS)
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_identify_recovers_both_pallas_kernels(backend, name):
    cfg = preset_for(name, HEAD_DIM)
    fp = fingerprint.identify(pallas_black_box(backend, cfg), head_dim=HEAD_DIM, scale=SCALE)
    truth = {f: getattr(cfg, f) for f in fingerprint.FIELDS if f != "sink_mode"}  # no sinks in these probes
    assert not _agrees(fp, truth), (backend, name, _agrees(fp, truth))
    assert fp.fields["block_kv"].determined and fp.fields["order"].determined, fp.summary()
    assert fp.residual < 1e-4, fp.residual


# --------------------------------------------------------------------------------------------
# The probes themselves
# --------------------------------------------------------------------------------------------


def test_probes_are_exact_in_e4m3_and_survive_per_tensor_quantization(sink_probes):
    ps = sink_probes
    assert ps.q.shape == (5, 64, 4, HEAD_DIM) and ps.k.shape == ps.v.shape == (5, 512, 4, HEAD_DIM)
    for x in (ps.q, ps.k, ps.v):
        assert np.array_equal(x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), x)
        # amax = 448·2^k: the per-tensor quantization scale is a power of two, so it loses nothing
        assert math.log2(float(np.max(np.abs(x))) / 448.0).is_integer()
        assert np.array_equal(_quantize(x), x)
    # the logits are exact in float32: float64 products agree
    z64 = np.einsum("bthd,bnhd->bhtn", ps.q.astype(np.float64), ps.k.astype(np.float64)) * SCALE
    z32 = (np.einsum("bthd,bnhd->bhtn", ps.q, ps.k) * np.float32(SCALE)).astype(np.float64)
    assert np.array_equal(z64, z32)
    assert z64.max() == 0.0  # every row's maximum sits at 0


def test_probes_round_trip_through_their_file(tmp_path, sink_probes):
    sink_probes.save(tmp_path / "p.npz")
    back = fingerprint.ProbeSet.load(tmp_path / "p.npz")
    assert back.key == sink_probes.key
    assert all(np.array_equal(a, b) for a, b in zip(back.arrays(), sink_probes.arrays()))


# --------------------------------------------------------------------------------------------
# Bad input: one line naming what is wrong
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    ps = fingerprint.probes(HEAD_DIM, scale=SCALE)
    return ps, fingerprint.simulate_outputs(ps, "fwd_s1")


@pytest.mark.parametrize("case, match", [
    ("shape", r"outputs\.shape=\(5, 64, 1, 32\) must be"),
    ("dtype", r"outputs\.dtype=int32 must be a floating-point"),
    ("nan", r"outputs holds 1 NaN or inf values \(first at \(1, 2, 0, 3\), probe family 'walk'\)"),
    ("nothing fits", r"outputs fit no candidate: the best residual (on the ladder rows )?is"),
])
def test_fit_refuses_bad_outputs(plain, case, match):
    ps, out = plain
    if case == "shape":
        bad = out[..., :32]
    elif case == "dtype":
        bad = out.astype(np.int32)
    elif case == "nan":
        bad = out.copy()
        bad[1, 2, 0, 3] = np.nan
    else:
        bad = np.random.default_rng(0).uniform(-1, 1, out.shape).astype(np.float32)
    with pytest.raises(PcastError, match=match):
        fingerprint.fit(ps, bad)


def test_identify_refuses_bad_arguments():
    with pytest.raises(PcastError, match="head_dim=8"):
        fingerprint.probes(8)
    with pytest.raises(PcastError, match="max_calls=0"):
        fingerprint.identify(lambda q, k, v: q, head_dim=HEAD_DIM, max_calls=0)
    with pytest.raises(PcastError, match="fn=3 must be callable"):
        fingerprint.identify(3, head_dim=HEAD_DIM)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def test_cli_probe_then_fit_reads_the_kernel(tmp_path, capsys):
    kw = NUMPY_KERNELS[0]
    assert cli.main(["fingerprint", "probe", "--head-dim", str(HEAD_DIM), "--scale", str(SCALE),
                     "--out", str(tmp_path / "probes.npz")]) == 0
    data = np.load(tmp_path / "probes.npz")
    out = numpy_fp8_attention(data["q"], data["k"], data["v"], scale=SCALE, **kw)
    np.savez(tmp_path / "outputs.npz", out=out)
    capsys.readouterr()
    assert cli.main(["fingerprint", "fit", str(tmp_path / "probes.npz"), str(tmp_path / "outputs.npz"),
                     "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["config"]["order"] == "reverse" and got["config"]["block_kv"] == 48
    assert got["fields"]["block_kv"]["determined"] is True
    assert got["fields"]["block_kv"]["probe"] in ("walk", "ramp")
    # what ℓ sums has no KernelConfig field: reported as not fitted, never as read
    assert "pre-cast" in got["not_fitted"]["row_sum"] and "row_sum" not in got["config"]


@pytest.mark.parametrize("case, match", [
    ("not ours", r"probes file .* was not written by 'pcast fingerprint probe'"),
    ("edited", r"probes file .*: k is not the probes"),
    ("nan", r"pcast: error: outputs holds 1 NaN or inf values"),
    ("shape", r"pcast: error: outputs\.shape="),
    ("no out", r"outputs file .* holds a, b: save the kernel's output as 'out'"),
])
def test_cli_fit_refuses_bad_files_with_exit_2(tmp_path, capsys, plain, case, match):
    ps, out = plain
    ps.save(tmp_path / "probes.npz")
    probes_path, outputs = tmp_path / "probes.npz", {"out": out}
    if case == "not ours":
        np.savez(tmp_path / "other.npz", q=ps.q, k=ps.k, v=ps.v)
        probes_path = tmp_path / "other.npz"
    elif case == "edited":
        data = dict(np.load(probes_path))
        data["k"] = data["k"] * 2
        np.savez(tmp_path / "edited.npz", **data)
        probes_path = tmp_path / "edited.npz"
    elif case == "nan":
        bad = out.copy()
        bad[0, 0, 0, 0] = np.nan
        outputs = {"out": bad}
    elif case == "shape":
        outputs = {"out": out[:, :10]}
    else:
        outputs = {"a": out, "b": out}
    np.savez(tmp_path / "outputs.npz", **outputs)
    capsys.readouterr()
    assert cli.main(["fingerprint", "fit", str(probes_path), str(tmp_path / "outputs.npz")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_cli_preset_says_which_fields_its_probes_decide(capsys):
    assert cli.main(["fingerprint", "--preset", "fa3", "--head-dim", str(HEAD_DIM)]) == 0
    text = capsys.readouterr().out
    tile = preset_for("fa3", HEAD_DIM).block_kv
    assert "order = 'reverse'" in text and f"block_kv = {tile} " in text
    assert "sink_mode: undetermined (not probed" in text


@pytest.mark.skipif(not FULL, reason="make test-full: fits two cuDNN configs (minutes on 2 cores)")
def test_gpu_check_fingerprint_step_reads_a_simulated_cudnn(capsys):
    """benchmarks/gpu_check.sh step (g) on CPU: the cudnn_fp8 preset at scale_s 1 and 32 as a stand-in
    black box whose output is rounded to E4M3, as cuDNN returns it."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_bench

    from pcast_jax.jax_fp8 import cudnn_config

    found = gpu_bench.run_fingerprint(SimpleNamespace(cpu_smoke=True))
    assert set(found) == set(gpu_bench.FINGERPRINT_SCALES)
    for scale_s, fp in found.items():
        want = cudnn_config(scale_s)
        truth = {f: getattr(want, f) for f in ("order", "block_kv", "kv_splits", "rescale_threshold")}
        assert not _agrees(fp, truth), (scale_s, _agrees(fp, truth))
        # the P scale applied, S·2^-τ, is among what the scale's candidates give
        applied = {fp.config.replace(scale=s).effective_scale for s in fp.fields["scale"].candidates}
        assert want.effective_scale in applied, (scale_s, applied)
    printed = capsys.readouterr().out
    assert printed.count("cudnn_fp8 preset assumes: B=128") == 2


def check_fingerprint_page(scope: dict, printed: str, folder) -> None:
    """docs/guides/fingerprint.md, after tests/test_docs.py ran its blocks: what the page says they print."""
    lines = printed.splitlines()
    assert lines[0] == "order=reverse,block_kv=96,scale=32", lines[0]
    assert lines[1].startswith("order = 'reverse' (decided by the ") and "fits" in lines[1], lines[1]
    assert lines[2].startswith("block_kv = 96 (decided by the ") and "fits" in lines[2], lines[2]
    assert lines[3] == "1 call"
    undetermined = eval(lines[4])  # noqa: S307 - the page's own printed list
    assert "scale_mode" in undetermined and "order" not in undetermined and "block_kv" not in undetermined
    assert lines[5] == "True"  # the offline files give the same config
    fp = scope["fp"]
    assert 32.0 in fp.fields["scale"].candidates and fp.fields["p_format"].value == "e4m3"
