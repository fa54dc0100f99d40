"""The "vendors and knobs" reproduce section: every preset at Table 3's operating point, the scale axes
against Δ, the INT8 / UINT8 diffuse-row collapse.

The section runs once at a tiny size; its CSV files are held to what it states: every preset of the
registry in the vendor table (or a reason), verdicts that apply the stated criterion to their own numbers
(recomputed here with scipy's t quantile), the local-max control zeroing only inside the sink's KV block,
aiter's padded tile scale equal to a static S = 448, and the diffuse rows equal to the closed form and to
an independent NumPy computation of the fixed-point cast.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from scipy import stats

from pcast_jax.presets import FAMILIES, PRESETS

TINY_DELTAS = (0.0, 7.0, 14.0)


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    from pcast_experiments import vendors_and_knobs as vk

    out = tmp_path_factory.mktemp("vendors_and_knobs")
    sizes = vk.Sizes(seeds=3, n=256, deltas=TINY_DELTAS, diffuse_ns=(16, 253, 254, 255, 300, 511, 512, 513, 700),
                     q_len=4, d=16)
    md = vk.vendors_and_knobs_section(out, sizes=sizes)
    tables = {}
    for what in ("presets", "axes", "diffuse"):
        with open(out / f"{vk.NAME}_{what}.csv") as fh:
            tables[what] = list(csv.DictReader(fh))
    return vk, out, md, tables, sizes


def test_the_section_is_registered_and_writes_its_files(section):
    from pcast_experiments import registry

    vk, out, md, _, _ = section
    module, func = registry.EXTRA_SECTIONS["vendors_and_knobs"]
    assert module == ".vendors_and_knobs" and func == "vendors_and_knobs_section"
    for f in vk.FILES:
        assert (out / f).stat().st_size > 0, f
    assert md.startswith("## ") and "beyond the paper" in md and "nan" not in md.lower()


def test_every_preset_is_in_the_vendor_table_by_family_or_says_why(section):
    rows = section[3]["presets"]
    assert [r["preset"] for r in rows] == [n for names in FAMILIES.values() for n in names]
    assert sorted(r["preset"] for r in rows) == sorted(PRESETS)
    for r in rows:
        assert r["preset"] in FAMILIES[r["family"]], r["preset"]
        if r["ran"] != "true":
            assert r["not_run"] and r["verdict"].startswith("not run: "), r["preset"]


def test_verdicts_apply_the_stated_criterion_to_their_own_numbers(section):
    from pcast_jax.criterion import CLIPPED_MASS_LIMIT, ZEROED_MASS_LIMIT

    rows = [r for r in section[3]["presets"] if r["ran"] == "true"]
    seen = set()
    for r in rows:
        z = stats.t.ppf(0.975, int(r["seeds"]) - 1)
        assert float(r["verdict_z"]) == pytest.approx(z)
        over = {"zeroes": [], "clips": []}
        for t in ("d7", "d10"):
            for word, key, limit in (("zeroes", "zeroed_mass", ZEROED_MASS_LIMIT),
                                     ("clips", "clipped_mass", CLIPPED_MASS_LIMIT)):
                m, se = float(r[f"{key}_{t}"]), float(r[f"{key}_sem_{t}"])
                over[word].append(True if m - z * se > limit else
                                  False if m + z * se < limit or (se == 0 and m <= limit) else None)
        failed = [w for w, o in over.items() if True in o]
        expect = ("fails: " + " and ".join(failed) if failed else
                  "passes" if all(o is False for o in over["zeroes"] + over["clips"]) else
                  f"within noise at {r['seeds']} seeds")
        assert r["verdict"] == expect, r["preset"]
        seen.add(expect.split(":")[0])
    by_name = {r["preset"]: r for r in rows}
    assert by_name["fwd_s1"]["verdict"] == "fails: zeroes" and by_name["fa3"]["verdict"] == "passes"
    assert {"passes", "fails"} <= seen


def test_aiters_padded_tile_scales_like_a_static_fp8_max(section):
    """Fewer query rows than BLOCK_M: the zero-Q padding rows set every tile's amax to 1, so the scale is
    448 and the cast zeroes exactly what forward S = 448 at the same tile zeroes."""
    rows = {r["preset"]: r for r in section[3]["presets"]}
    aiter, s448 = rows["aiter_mha_fp8_mi355"], rows["fwd_s448"]
    assert aiter["block_kv"] == s448["block_kv"] == "64"
    for t in ("d7", "d10"):
        assert aiter[f"frac_zeroed_{t}"] == s448[f"frac_zeroed_{t}"]
        assert aiter[f"zeroed_mass_{t}"] == s448[f"zeroed_mass_{t}"]


def test_aiters_mla_decode_preset_gets_the_unscaled_amd_paths_numbers_and_verdict(section):
    """The gfx950 ASM MLA decode preset (S = 1, forward, B = 64, OCP E4M3: its source notes say why) casts as
    FlashAttention's ROCm Triton path on MI355 does, so the study gives both the same numbers and verdict."""
    rows = {r["preset"]: r for r in section[3]["presets"]}
    mla, fa = rows["aiter_mla_asm_fp8_gfx950"], rows["fa_triton_amd_mi355"]
    assert PRESETS["aiter_mla_asm_fp8_gfx950"] == PRESETS["fa_triton_amd_mi355"]
    assert mla["family"] == "amd" and mla["ran"] == "true"
    for col in ("frac_zeroed_d7", "zeroed_mass_d7", "frac_zeroed_d10", "zeroed_mass_d10", "verdict"):
        assert mla[col] == fa[col], col


def test_local_max_zeroes_only_inside_the_sinks_block(section):
    _, _, _, tables, sz = section
    rows = tables["axes"]
    local = [r for r in rows if r["config"] == "tpu_ragged_paged_fp8p"]
    share = (int(local[0]["block_kv"]) - sz.k_sink) / (sz.n - sz.k_sink)
    assert [float(r["delta"]) for r in local] == list(TINY_DELTAS)
    assert all(float(r["frac_zeroed"]) <= share for r in local)
    top = local[-1]  # at Δ = 14 almost every key of the sink's block is zeroed: the closed form's share
    assert float(top["frac_zeroed"]) == pytest.approx(float(top["theory_frac_zeroed"]), abs=0.03)
    unscaled = next(r for r in rows if r["config"] == "fa_triton_amd_mi355" and float(r["delta"]) == 14.0)
    assert float(unscaled["frac_zeroed"]) > 0.9  # the collapse the control avoids
    for r in rows:  # the costs sit on the tile-amax rows and nowhere else
        has = {k: not r[k].startswith("n/a") for k in ("sharing_cost", "pow2_cost")}
        assert has == {"sharing_cost": r["config"] in ("aiter_mha_fp8_mi355", "aiter_mi355_tile_rows"),
                       "pow2_cost": r["config"] == "aiter_mi355_per_row"}, r["config"]
        assert math.isfinite(float(r["rel_mse"])) and float(r["rel_mse"]) > 0


def test_diffuse_rows_equal_the_closed_form_and_an_independent_cast(section):
    rows = section[3]["diffuse"]
    assert {r["preset"] for r in rows} == {"tensorrt_int8", "litert_uint8"}
    lo_hi = {"int8": (-128.0, 127.0), "uint8": (0.0, 255.0)}
    for r in rows:
        n, s = int(r["n"]), float(r["scale"])
        q = np.clip(np.round(np.float32(s) / np.float32(n)), *lo_hi[r["p_format"]])  # half to even, as the cast
        assert float(r["gain"]) == pytest.approx(n * float(q) / s, rel=1e-6, abs=1e-7), (r["preset"], n)
        assert float(r["theory_gain"]) == pytest.approx(float(r["gain"]), rel=1e-6, abs=1e-7)
        assert (float(r["gain"]) == 0.0) == (n >= int(r["vanishing_length"])) == (r["past_vanishing_length"] == "true")
        assert float(r["frac_zeroed"]) == (1.0 if n >= int(r["vanishing_length"]) else 0.0)
    assert {r["preset"]: int(r["vanishing_length"]) for r in rows} == {"tensorrt_int8": 254, "litert_uint8": 512}
