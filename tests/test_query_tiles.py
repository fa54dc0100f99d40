"""Query tiles: the tile-amax P scale and skip-softmax, in both engines, the oracle, the closed form and
the Triton kernel.

``scale_mode="tile_amax"`` shares one scale max/amax(P) among the ``block_q`` rows of a query tile
(aiter's Triton MHA FP8); ``skip_softmax_threshold`` λ drops a KV block from a tile when every row of
it votes exp(block max − running max) < λ (TensorRT-LLM fmha_v2 / FlashInfer trtllm-gen). The oracle
(``tests/oracle.py``) writes both from those definitions without the package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.workloads import sink_qkv
from pcast_jax import engine, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS

import oracle

Q, N, D = 100, 300, 16  # 100 rows: the last query tile of 32 (or 128) rows is partial
CONFIGS = (
    KernelConfig(scale_mode="tile_amax", block_q=32),
    KernelConfig(scale_mode="tile_amax", block_q=32, causal=True, order="reverse", rescale_threshold=4.0),
    KernelConfig(scale_mode="tile_amax", block_q=16, kv_splits=2, split_layout="strided", skip_softmax_threshold=0.01),
    PRESETS["aiter_mha_fp8_mi300"],
    PRESETS["trtllm_fmha_v2_skip"].replace(block_kv=64),
    KernelConfig(skip_softmax_threshold=0.01, block_q=1, causal=True, kv_splits=3),
)
SINK = 11.0  # the learned sink of the init_max presets


@functools.lru_cache(maxsize=None)
def _scores():
    """Paper §3.1 scores with a stretch of keys 9 logits lower (blocks for skip-softmax to drop)."""
    s, v, mask = oracle.sink_scores(np.random.default_rng(0), q=Q, n=N, d=D, delta=9.0)
    s[:, 100:180] -= 9.0
    return s, v, mask


def _sink(cfg):
    return SINK if cfg.sink_mode == "init_max" else None


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_both_implementations_match_the_oracle(cfg):
    s, v, mask = _scores()
    ref = oracle.attention(s, v, count_mask=mask, sink_logit=_sink(cfg), **oracle.config_kwargs(cfg))
    for impl in engine.IMPLEMENTATIONS:
        r = engine.attention(s, v, cfg, implementation=impl, count_mask=mask, sink_logit=_sink(cfg))
        err = np.abs(np.asarray(r.out, np.float64) - ref.out) - (3e-6 * np.abs(ref.out).max() + ref.out_slack)
        assert err.max() <= 0, f"{cfg.name} [{impl}]: off the oracle by {err.max():.3g}"
        np.testing.assert_allclose(np.asarray(r.row_sum), ref.row_sum, rtol=2e-6)
        assert np.abs(np.asarray(r.n_zeroed) - ref.n_zeroed).max() <= ref.zeroed_slack.max()


def test_skipping_drops_mass_and_tiles_vote_together():
    """The workload makes blocks to skip; a tile of rows skips less than rows deciding alone, and a
    skipped block is renormalised away (ℓ smaller, no zeroed P from it)."""
    s, v, _ = _scores()
    ell = {bq: np.asarray(engine.attention(s, v, KernelConfig(skip_softmax_threshold=0.01, block_q=bq)).row_sum)
           for bq in (1, 32)}
    exact = np.asarray(engine.attention(s, v, KernelConfig()).row_sum)
    assert np.all(ell[1] <= ell[32]) and np.all(ell[32] <= exact)
    assert np.any(ell[1] < exact * (1 - 1e-4))


def test_a_tile_shares_one_scale_and_padding_rows_raise_it_to_max():
    """Changing one row moves the outputs of its tile's other rows only; a fully masked row moves
    none; the last partial tile (zero-Q padding rows, P = 1) casts at S = max like a static S = 448."""
    s, v, _ = _scores()
    cfg = KernelConfig(scale_mode="tile_amax", block_q=32)
    base = np.asarray(engine.attention(s, v, cfg).out)
    s2 = s.copy()
    s2[5, 200] = s[5].max() - 0.5  # row 5 (tile 0) gets P ≈ 0.6 in block 3: the tile's amax there moves
    moved = np.any(np.asarray(engine.attention(s2, v, cfg).out) != base, axis=-1)
    assert moved[5] and moved[:32].sum() > 1 and not moved[32:].any()
    s3 = s.copy()
    s3[7] = -np.inf  # a row that sees nothing: P = 0, no amax
    out3 = np.asarray(engine.attention(s3, v, cfg).out)
    assert np.all(out3[7] == 0) and np.array_equal(np.delete(out3, 7, 0), np.delete(base, 7, 0))
    static = np.asarray(engine.attention(s, v, KernelConfig(scale=448.0)).out)
    np.testing.assert_allclose(base[96:], static[96:], rtol=1e-5, atol=1e-6)
    assert not np.allclose(base[:96], static[:96], rtol=1e-5, atol=1e-6)


def _aiter_loop(s, v, sink, *, pad_p):
    """The query rows ``s`` (q ≤ 128, one query tile) of aiter's Triton MHA FP8 forward on MI300, written
    from its source (ROCm/aiter @e404860, ``_triton_kernels/attention/mha.py`` lines 685-692, 212-260,
    877-878) with the tile's other rows padding whose P is ``pad_p(sink)`` on each key: m starts at the
    sink and ℓ at 1; per 64-key block the tile's amax is the largest P of its rows and of the padding,
    P·240/amax is cast to E4M3FNUZ and the product multiplied by amax/240; O/ℓ at the end."""
    s = s.astype(np.float64)
    m, ell, acc = np.full(s.shape[0], sink), np.ones(s.shape[0]), np.zeros((s.shape[0], v.shape[1]))
    for j in range(0, s.shape[1], 64):
        z = s[:, j:j + 64]
        m_new = np.maximum(m, z.max(axis=1))
        p = np.exp(z - m_new[:, None])
        a = np.exp(m - m_new)
        amax = max(p.max(), pad_p(sink), 1e-9)
        p8 = (p * (240.0 / amax)).astype(ml_dtypes.float8_e4m3fnuz).astype(np.float64)
        ell = a * ell + p.sum(axis=1)
        acc = a[:, None] * acc + (p8 @ v[j:j + 64]) * (amax / 240.0)
        m = m_new
    return acc / ell[:, None]


@pytest.mark.parametrize("sink", [11.0, -1.5])
@pytest.mark.parametrize("q", [1, 100])  # decode; a prefill whose one query tile of 128 rows is partial
def test_padding_rows_of_a_tile_start_at_the_learned_sink(q, sink):
    """aiter starts every row of a query tile at m = s_L, the zero-Q padding rows too, so their P is
    exp(−max(s_L, 0)), not 1: both implementations ≡ the oracle (which runs a filling row like any row),
    ≡ the same call with the padding made real zero-logit rows, and, for one row, ≡ a direct NumPy loop
    of the kernel; the old model (padding P = 1) is far from it."""
    cfg = PRESETS["aiter_mha_fp8_mi300"]
    rng = np.random.default_rng(3)
    s, v, mask = oracle.sink_scores(rng, q=q, n=N, d=D, delta=6.0)
    ref = oracle.attention(s, v, count_mask=mask, sink_logit=sink, **oracle.config_kwargs(cfg))
    full = np.concatenate([s, np.zeros((cfg.block_q - q, N), np.float32)])  # the padding as real rows
    ref_full = oracle.attention(full, v, sink_logit=sink, **oracle.config_kwargs(cfg))
    # float64 twins: the same operations; the tile amax may differ in its last bits (a sum order)
    np.testing.assert_allclose(ref.out, ref_full.out[:q], rtol=1e-12, atol=1e-12)
    scale = np.abs(ref.out).max()
    for impl in engine.IMPLEMENTATIONS:
        r = engine.attention(s, v, cfg, implementation=impl, count_mask=mask, sink_logit=sink)
        out = np.asarray(r.out, np.float64)
        # float32 against float64: a few float32 ulps of the output's scale, plus the codes a near-tie
        # may flip (the oracle's slack)
        err = np.abs(out - ref.out) - (3e-6 * scale + ref.out_slack)
        assert err.max() <= 0, f"[{impl}]: off the oracle by {err.max():.3g}"
        r_full = engine.attention(full, v, cfg, implementation=impl, sink_logit=sink)
        np.testing.assert_allclose(out, np.asarray(r_full.out)[:q], rtol=0, atol=3e-6 * scale)
    direct = _aiter_loop(s, v, sink, pad_p=lambda m0: np.exp(-max(m0, 0.0)))  # a zero-Q row started at s_L
    np.testing.assert_allclose(ref.out, direct, rtol=0, atol=1e-9 * scale)  # float64 twins of one loop
    if sink > 0:  # the gap is material: the old model (padding P = 1) moves the output far beyond that
        old = _aiter_loop(s, v, sink, pad_p=lambda m0: 1.0)
        assert np.abs(old - direct).max() > 100 * 3e-6 * scale


def test_skip_softmax_loses_at_most_its_closed_form():
    """The lost share 1 − ℓ/ℓ_exact (the max is never skipped, so both hold it at one max) stays below
    :func:`theory.skip_softmax_lost_mass_bound` and reaches 98 % of it on the worst case: every
    non-maximum block's keys just below λ against the maximum, alone in the first block."""
    lam, b, n = 2.0**-10, 64, 512
    cfg = KernelConfig(skip_softmax_threshold=lam, block_q=1, block_kv=b)

    def lost(scores):
        vv = np.zeros((scores.shape[1], 1), np.float32)
        ell = np.asarray(engine.attention(scores, vv, cfg).row_sum, np.float64)
        return 1.0 - ell / np.asarray(engine.attention(scores, vv, KernelConfig(block_kv=b)).row_sum, np.float64)

    worst = np.full((1, n), np.log(lam) - 0.01, np.float32)
    worst[0, :b] = -40.0
    worst[0, 0] = 0.0
    bound = float(theory.skip_softmax_lost_mass_bound(lam, n=n, block_kv=b))
    assert 0.98 * bound <= lost(worst)[0] <= bound * (1 + 1e-5)
    s, _, _ = _scores()
    sink_lost = lost(s)
    assert 0 < sink_lost.max() <= float(theory.skip_softmax_lost_mass_bound(lam, n=N, block_kv=b)) * (1 + 1e-5)


def test_the_threshold_is_a_number_of_the_program():
    """Configs that differ only in λ share one program (one compile), and compute with λ bound as a
    traced argument the bits they compute with λ as a constant."""
    s, v, _ = _scores()
    a, b = (PRESETS["trtllm_fmha_v2_skip"].replace(block_kv=64, skip_softmax_threshold=lam) for lam in (0.01, 0.002))
    assert a.program() == b.program() and a.numbers() != b.numbers()
    f = jax.jit(lambda nums, s, v: engine.attention(s, v, a.program().bind(nums)).out)
    for cfg in (a, b):
        constant = jax.jit(lambda s, v, cfg=cfg: engine.attention(s, v, cfg).out)
        np.testing.assert_array_equal(np.asarray(f(cfg.numbers(), s, v)), np.asarray(constant(s, v)))
    assert f._cache_size() == 1


@pytest.mark.parametrize("fields, name", [
    ({"skip_softmax_threshold": 1.0}, "skip_softmax_threshold"),
    ({"skip_softmax_threshold": -0.1}, "skip_softmax_threshold"),
    ({"skip_softmax_threshold": float("nan")}, "skip_softmax_threshold"),
    ({"skip_softmax_threshold": "0.1"}, "skip_softmax_threshold"),
    ({"scale_mode": "tile_amax"}, "block_q"),
    ({"skip_softmax_threshold": 0.1}, "block_q"),
    ({"scale_mode": "tile_amax", "block_q": -1}, "block_q"),
    ({"scale_mode": "tile_amax", "block_q": 1.5}, "block_q"),
    ({"scale_mode": "tile_amax", "block_q": 64, "p_format": "mxfp8"}, "p_format"),
])
def test_bad_values_name_the_field(fields, name):
    with pytest.raises(PcastError, match=name):
        KernelConfig(**fields)


def test_bad_theory_threshold_names_it():
    with pytest.raises(PcastError, match="threshold"):
        theory.skip_softmax_lost_mass_bound(1.5)


def test_the_fingerprint_has_both_axes_among_its_candidates():
    """Both axes are fitted fields, with the presets' values among the candidates (tests/test_fingerprint.py
    identifies the presets that set them)."""
    from pcast_jax.fingerprint.fit import FIELDS, NOT_FITTED, candidate_values, fittable_presets

    assert {"block_q", "skip_softmax_threshold"} <= set(FIELDS) - set(NOT_FITTED)
    assert {"aiter_mha_fp8_mi355", "trtllm_fmha_v2_skip"} <= set(fittable_presets())
    assert (PRESETS["aiter_mha_fp8_mi355"].block_q,) in candidate_values("tile")
    assert (PRESETS["trtllm_fmha_v2_skip"].skip_softmax_threshold,) in candidate_values("skip")


def test_fields_act_only_where_they_act():
    """block_q is 0 where no query tile acts, and neither field is written where it is 0: existing
    configs keep their dicts (and sweep fingerprints)."""
    assert KernelConfig(block_q=64) == KernelConfig() and "block_q" not in KernelConfig().to_dict()
    assert "skip_softmax_threshold" not in KernelConfig().to_dict()
    cfg = PRESETS["trtllm_fmha_v2_skip"]
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg and KernelConfig.from_string(cfg.to_string()) == cfg


def test_triton_kernel_runs_both_axes_like_the_simulator():
    """Interpret mode, two query tiles of 64 rows (one program each) at three sink strengths: the
    tile-amax scale and the tile's skip vote in the kernel equal the simulator's, and the vote skips."""
    w = sink_qkv(jax.random.key(7), deltas=(5.0, 12.0), heads=1, kv_heads=1, q_len=128, n=320, head_dim=64)
    cfg = KernelConfig(scale_mode="tile_amax", block_q=64, skip_softmax_threshold=2.0**-10)
    kwargs = {"scale": 8.0 * w.softmax_scale}
    out, stats = pk.fp8_attention(w.q, w.k, w.v, config=cfg, implementation="triton", interpret=True,
                                  return_stats=True, **kwargs)
    ref = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg, **kwargs)
    np.testing.assert_array_equal(np.asarray(stats.n_zeroed), np.asarray(ref.n_zeroed))
    v_max = float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref.out), rtol=2e-6, atol=2e-6 * v_max)
    np.testing.assert_allclose(np.asarray(stats.row_sum), np.asarray(ref.row_sum), rtol=2e-6)
    unskipped = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg.replace(skip_softmax_threshold=0.0), **kwargs)
    assert np.any(np.asarray(stats.row_sum) < np.asarray(unskipped.row_sum) * (1 - 1e-6))
    with pytest.raises(PcastError, match="block_q=64 with q_len=96"):
        pk.fp8_attention(w.q[:, :, :96], w.k, w.v, config=cfg, implementation="triton", interpret=True, **kwargs)
    with pytest.raises(PcastError, match="scale_mode='tile_amax' not supported by the mosaic backend"):
        pk.fp8_attention(w.q, w.k, w.v, config=cfg, implementation="mosaic", interpret=True, **kwargs)


def test_analysis_chunks_never_split_a_query_tile():
    """The per-head analysis simulates chunks of query rows; with query tiles a chunk is whole tiles,
    so chunks small enough to split a 128-row tile give the bits of one chunk holding every row."""
    from pcast_jax.analysis import heads
    from pcast_jax.analysis.plan import Chunking, rows_per_chunk, whole_tiles

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((256, 1, 16)).astype(np.float32) for _ in range(3))
    q[..., 0], k[:2, :, 0] = 3.0, 25.0  # a sink ~19 logits above the rest: tiles without it zero only at S = 448
    positions = np.zeros((1, 1), np.int32)
    cfg = PRESETS["aiter_mha_fp8_mi355"]
    whole = heads.head_metrics(q, k, v, cfg, positions, min_keys=8)
    chunking = Chunking(chunk_bytes=48 * 256 * 32)  # 32 rows per chunk before rounding to tiles
    assert whole_tiles(rows_per_chunk(256, 256, chunking.chunk_bytes), cfg) == 128
    chunked = heads.head_metrics(q, k, v, cfg, positions, min_keys=8, chunking=chunking)
    assert 0.1 < whole["frac_zeroed_row_mean"][0] < 0.9  # split tiles (each with padding rows: S = 448) would zero 99 %
    for name in ("frac_zeroed", "frac_zeroed_row_mean", "zeroed_mass"):
        np.testing.assert_array_equal(chunked[name], whole[name], err_msg=name)
    np.testing.assert_allclose(chunked["mse"], whole["mse"], rtol=1e-6)  # sums of other shapes
    masses = heads.scale_masses((q[None], k[None], v[None]), cfg, (1.0,), positions[None], min_keys=8)
    np.testing.assert_array_equal(masses["zeroed_mass"][0, 0], whole["zeroed_mass"])


def _same_to_rounding(chunked: dict, whole: dict) -> None:
    """Masses to FP32 rounding; the MSE to what FP32 rounding of the outputs (about 1e-6 of them, summed over
    blocks in another order) moves a mean of (O - O_ref)^2 by: 1e-6 · sqrt(MSE · mean O_ref^2)."""
    for metric in ("zeroed_mass", "saturated_mass"):
        np.testing.assert_allclose(chunked[metric], whole[metric], rtol=1e-5, atol=1e-12, err_msg=metric)
    for metric, power in (("mse", whole["ref_sq"]), ("rel_mse", 1.0)):
        bound = 1e-6 * np.sqrt(whole[metric] * power)
        np.testing.assert_array_less(np.abs(chunked[metric] - whole[metric]), bound + 1e-30, err_msg=metric)


@pytest.mark.parametrize("name", ["fwd_s1", "rev_s256", "fa3_splitkv", "cudnn_fp8", "aiter_mha_fp8_mi355"])
def test_analysis_chunks_visit_only_the_keys_a_causal_kernel_visits(name):
    """A chunk of query rows simulates the kernel on the KV blocks up to its last row only (split-KV too, where
    that leaves its splits as they are: 2 blocks of 224 keys in 8 splits); the metrics are those of one chunk
    of whole rows to FP32 rounding, the counts exactly."""
    from pcast_jax.analysis import heads
    from pcast_jax.analysis.plan import Chunking, keys_visited, rows_per_chunk, whole_tiles

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((256, 2, 16)).astype(np.float32) for _ in range(3))
    q[..., 0], k[:1, :, 0] = 2.5, 12.0  # a sink ~30 logits above the rest
    positions = np.zeros((2, 1), np.int32)
    cfg = PRESETS[name]
    whole = heads.head_metrics(q, k, v, cfg, positions, min_keys=8)
    chunking = Chunking(chunk_bytes=48 * 256 * 64)  # 64 rows per chunk, before rounding to tiles
    step = whole_tiles(rows_per_chunk(256, 256, chunking.chunk_bytes), cfg)
    visited = keys_visited(cfg.replace(causal=True), step, 256)
    assert visited < 256
    chunked = heads.head_metrics(q, k, v, cfg, positions, min_keys=8, chunking=chunking)
    for name in ("frac_zeroed", "frac_zeroed_row_mean"):
        np.testing.assert_array_equal(chunked[name], whole[name], err_msg=name)
    assert np.any(whole["frac_zeroed"] > 0)
    _same_to_rounding(chunked, whole)


@pytest.mark.parametrize("layout, visited", [("contiguous", 256), ("strided", 64)])
def test_a_split_kv_chunk_keeps_every_block_where_its_splits_would_change(layout, visited):
    """Split-KV over 16 blocks of 16 keys in 4 splits: a chunk of 64 rows sees 4 blocks. Contiguous splits of
    those 4 alone would be one block each, where the whole row's splits are 4 blocks each (block 0 to 3 all
    in split 0): the chunk keeps every key. Strided splits put block s in split s either way: the chunk
    takes its 4 blocks. Either way the metrics are those of whole rows."""
    from pcast_jax.analysis import heads
    from pcast_jax.analysis.plan import Chunking, keys_visited

    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((256, 2, 16)).astype(np.float32) for _ in range(3))
    q[..., 0], k[:1, :, 0] = 2.5, 12.0
    positions = np.zeros((2, 1), np.int32)
    cfg = PRESETS["fa3_splitkv"].replace(block_kv=16, kv_splits=4, split_layout=layout, name=f"split4_{layout}")
    whole = heads.head_metrics(q, k, v, cfg, positions, min_keys=8)
    chunking = Chunking(chunk_bytes=48 * 256 * 64)  # 64 rows per chunk
    assert keys_visited(cfg.replace(causal=True), 64, 256) == visited
    chunked = heads.head_metrics(q, k, v, cfg, positions, min_keys=8, chunking=chunking)
    for name in ("frac_zeroed", "frac_zeroed_row_mean"):
        np.testing.assert_array_equal(chunked[name], whole[name], err_msg=name)
    assert np.any(whole["frac_zeroed"] > 0)
    _same_to_rounding(chunked, whole)


def test_a_row_split_schedule_overstates_a_per_query_tile_split_on_causal_prefill():
    """FlashAttention-3 divides each query tile's visible blocks among its splits (``hopper/block.h``
    ``get_n_block_min_max``); the simulator cuts one schedule per row from all blocks. A per-tile split is the
    row schedule on the tile's own keys (its blocks up to its diagonal), so the float64 oracle computes both:
    on causal prefill at 4,096 tokens a forward S = 1 contiguous split (8 × 64 keys) zeroes 1.5–2.5× more mass
    per row under the row schedule (the factor the analysis states beside every split-KV config), the engine
    equals the oracle's row schedule, and on a decode row (one tile that sees every block) the two agree."""
    n, m = 4096, 128
    s, v, mask = oracle.sink_scores(np.random.default_rng(0), q=n, n=n, d=D, delta=7.0)
    cfg = KernelConfig(kv_splits=8, block_kv=64, causal=True)
    kw = oracle.config_kwargs(cfg)
    row = oracle.attention(s, v, count_mask=mask, **kw).zeroed_mass
    tile = np.concatenate([oracle.attention(s[t:t + m, :t + m], v[:t + m], count_mask=mask[:t + m], **kw).zeroed_mass
                           for t in range(0, n, m)])
    assert 1.5 < row.mean() / tile.mean() < 2.5, (row.mean(), tile.mean())
    ours = np.asarray(engine.attention(s, v, cfg, count_mask=mask).zeroed_mass, np.float64)
    # float32 against float64: zeroed P decided by the same codes but at near-ties; masses agree to 1e-4
    np.testing.assert_allclose(ours.mean(), row.mean(), rtol=1e-4)
    last = oracle.attention(s[-1:], v, count_mask=mask, **kw)  # decode: the last row alone, every block
    np.testing.assert_allclose(last.zeroed_mass, row[-1:], rtol=1e-12)


def test_the_analysis_states_the_split_schedule_caveat_on_prefill():
    from test_analysis import character_trace

    from pcast_jax.analysis import analyze

    trace = character_trace("sink at 0", T=320)
    result = analyze(trace, [PRESETS["vllm_triton_fp8_3d"], KernelConfig(kv_splits=2, name="split2"),
                             KernelConfig(name="plain")])
    text = "\n".join(result.summary_lines())
    assert "`vllm_triton_fp8_3d` is a decode kernel; on these prefill rows" in text
    assert text.count("Note: its splits are cut from each row's blocks") == 1  # split2 only, not plain
