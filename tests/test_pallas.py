"""Pallas FP8 kernels ≡ the scan implementation of ``pcast_jax.engine``, on the same FP8 values.

Each kernel test class has ``INTERPRET = False`` (runs on a CUDA GPU, skipped without one) and
an ``...Interpret`` subclass that runs the same tests in Pallas interpret mode on CPU.

Inputs come from ``pallas_kernels.workloads.sink_qkv``: Q8·K8ᵀ accumulates exactly in FP32, and
the descales in ``DESCALES`` are powers of two, so kernel and simulator see bit-identical scores
and V. In interpret mode both then run the same XLA CPU operations per element; only the
summation order of ℓ and of P8·V differs, hence:

* the per-row count of zeroed P must be identical;
* outputs agree to FP32 rounding: |out − ref| ≤ ``2e-6·max|V| + 2e-6·|ref|`` (about 16 ulp; the
  largest difference seen is about 4e-7·max|V|).

On a GPU the kernel's exp/exp2 differ from XLA's by ulps, so a rare P lands on the other side of
an E4M3 rounding boundary: the GPU variant allows a few flipped P per row block and a looser,
fractional output tolerance (``_GPU_TOL``).
"""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.workloads import sink_qkv
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, get_preset, preset_for, tagged

import oracle
from cases import FULL, gpu_bench

HAS_GPU = jax.default_backend() == "gpu"
DELTAS = (5.0, 7.0, 10.0)
# q_descale·k_descale·softmax_scale = 1/√d and v_descale = 2: exact powers of two.
DESCALES = {"q_descale": 0.5, "k_descale": 0.25, "v_descale": 2.0}
SCALE_FACTOR = 8.0  # softmax_scale = 8/√d
_INTERPRET_RTOL = 2e-6
_INTERPRET_ATOL_PER_V = 2e-6
_GPU_TOL = {"rtol": 1e-3, "atol_per_v": 1e-3, "fraction": 0.999, "loose_atol_per_v": 5e-2, "flips": 8}
_F8 = jnp.float8_e4m3fn
#: f16 accumulator: at least this fraction of outputs equal to FP32 rounding; the rest (f16 rounding
#: midpoints decided apart, see assert_matches) within one f16 step of every rounding.
_F16_TOL = {"fraction": 0.98}
#: v_descale values for the f16 accumulator tests (V8 spans E4M3, so |V| reaches 448·v_descale).
F16_V_DESCALES = (0.05, 0.3, 2.0, 30.0)


def _assert_f16_close(out, ref, v_max, cfg, *, interpret=True):
    """Outputs of an f16 accumulator: ``_F16_TOL["fraction"]`` equal to FP32 rounding (the GPU's
    tolerance on a GPU), all within one f16 step (2^-10 relative) at each f16 rounding of a block:
    (B / keys per rounding) · 2^-10 · max|V| (each block's weights sum to at most 1)."""
    out, ref = np.asarray(out), np.asarray(ref)
    err = np.abs(out - ref)
    atol, rtol = (_INTERPRET_ATOL_PER_V, _INTERPRET_RTOL) if interpret else (_GPU_TOL["atol_per_v"], _GPU_TOL["rtol"])
    tight = atol * v_max + rtol * np.abs(ref)
    roundings = cfg.block_kv // (cfg.f16_round_keys or cfg.block_kv)
    assert np.mean(err <= tight) >= _F16_TOL["fraction"], f"{np.mean(err > tight):.2%} outputs differ"
    assert err.max() <= roundings * 2.0**-10 * v_max + tight.max(), f"max error {err.max() / v_max:.3g}·max|V|"


@functools.lru_cache(maxsize=None)
def _workload(q_len: int = 64, n: int = 256, *, deltas=DELTAS, heads: int = 1, kv_heads: int = 1, head_dim=128):
    """Sink Q/K/V, one batch element per Δ (small: interpret mode is slow)."""
    return sink_qkv(
        jax.random.key(1234), deltas=deltas, heads=heads, kv_heads=kv_heads, q_len=q_len, n=n,
        head_dim=head_dim,
    )


HEAD_DIMS = (64, 128)
#: Keys of the registry test: no preset's block divides it (64, 128, 160, 192, 224), so the last
#: block is padded with masked keys, in the kernel as in the simulator.
N_RAGGED = 300


def _registry_cases(full: bool = FULL) -> list[tuple[str, int]]:
    """(preset, head dim) for every paper config and kernel preset with an element P format, at
    the preset's own KV block for that head dim (``preset_for``), at d = 64 and 128.

    A preset whose semantics equal an earlier case's at that head dim (configs compare by
    semantics: trtllm_xqa is the paper's fwd_s448, hpc_ops_prior its fwd_s1) is that case and
    is not run twice. A new preset is a new case with no edit here.

    Without ``full`` (``make test``, CI) each preset runs at one of its head dims, taken in turn, so
    both head dims are run (tests/test_conformance.py holds every preset through both kernels to
    the oracle at d = 64 as well).
    """
    cases = []
    for head_dim in HEAD_DIMS:
        seen = set()
        for name in (*tagged("paper"), *tagged("table3")):
            cfg = preset_for(name, head_dim)
            if cfg.block_format is None and cfg not in seen:
                seen.add(cfg)
                cases.append((name, head_dim))
    if full:
        return cases
    subset = []
    for i, name in enumerate(dict.fromkeys(name for name, _ in cases)):
        mine = [c for c in cases if c[0] == name]
        subset.append(mine[i % len(mine)])
    return subset


def test_the_registry_subset_covers_every_preset_and_head_dim():
    full, subset = _registry_cases(full=True), _registry_cases(full=False)
    assert set(subset) <= set(full)
    assert {name for name, _ in subset} == {name for name, _ in full}
    assert {h for _, h in subset} == set(HEAD_DIMS)


class TestMosaicKernel:
    """The Mosaic GPU kernel on a Hopper GPU (skipped without one)."""

    BACKEND = "mosaic"
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not HAS_GPU:
            pytest.skip("needs a CUDA GPU; the Interpret subclass runs this test on CPU")

    # -- helpers ------------------------------------------------------------------------------

    def run_kernel(self, w, cfg, **kwargs):
        kwargs = {"scale": SCALE_FACTOR * w.softmax_scale, **DESCALES, **kwargs}
        return pk.fp8_attention(
            w.q, w.k, w.v, config=cfg, implementation=self.BACKEND, interpret=self.INTERPRET,
            return_stats=True, **kwargs,
        )

    def simulate(self, w, cfg, **kwargs):
        kwargs = {"scale": SCALE_FACTOR * w.softmax_scale, **DESCALES, **kwargs}
        return pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg, **kwargs)

    def assert_matches(self, out, stats, ref, v_max, cfg=None):
        """Kernel ≡ simulator: zero counts identical, outputs equal to FP32 rounding.

        With an f16 accumulator and a V descale or channel scale that is not a power of two, the
        kernel scales its exact FP8 product where the simulator scales V, so the value rounded to
        f16 differs by FP32 rounding and lands on the other side of an f16 rounding midpoint now and
        then: ``_F16_TOL`` (most outputs equal to FP32 rounding, all within one f16 step per rounding).
        """
        assert out.shape == ref.out.shape and out.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(out)))
        if self.INTERPRET:
            np.testing.assert_array_equal(np.asarray(stats.n_zeroed), np.asarray(ref.n_zeroed))
            chex.assert_trees_all_close(stats.row_sum, ref.row_sum, rtol=_INTERPRET_RTOL, atol=0.0)
        else:
            flips = np.abs(np.asarray(stats.n_zeroed) - np.asarray(ref.n_zeroed))
            assert flips.max() <= _GPU_TOL["flips"], f"zero counts differ by up to {flips.max()}"
            chex.assert_trees_all_close(stats.row_sum, ref.row_sum, rtol=1e-5, atol=0.0)
        if cfg is not None and cfg.accumulator == "f16":
            _assert_f16_close(out, ref.out, v_max, cfg, interpret=self.INTERPRET)
        elif self.INTERPRET:
            chex.assert_trees_all_close(
                out, ref.out, rtol=_INTERPRET_RTOL, atol=_INTERPRET_ATOL_PER_V * v_max
            )
        else:
            err = np.abs(np.asarray(out) - np.asarray(ref.out))
            bound = _GPU_TOL["atol_per_v"] * v_max + _GPU_TOL["rtol"] * np.abs(np.asarray(ref.out))
            assert np.mean(err <= bound) >= _GPU_TOL["fraction"], f"max error {err.max()}"
            assert err.max() <= _GPU_TOL["loose_atol_per_v"] * v_max, f"max error {err.max()}"

    def check_config(self, cfg, *, q_len=64, n=256, **workload):
        w = _workload(q_len, n, **workload)
        out, stats = self.run_kernel(w, cfg)
        ref = self.simulate(w, cfg)
        v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
        self.assert_matches(out, stats, ref, v_max, cfg)
        return w, out, stats

    # -- kernel ≡ simulator ------------------------------------------------------------------

    @pytest.mark.parametrize("name,head_dim", _registry_cases())
    def test_preset_matches_simulator_and_oracle(self, name, head_dim):
        """Every preset at its own KV block (FA3: 224 at d = 128, 160 at d = 64; FlashInfer: 192):
        kernel ≡ scan implementation at Δ = 7 and 10, and ≡ the float64 oracle at Δ = 7, over N = 300 keys."""
        cfg = preset_for(name, head_dim)
        w, out, stats = self.check_config(cfg, n=N_RAGGED, deltas=(7.0, 10.0), head_dim=head_dim)
        self.assert_matches_oracle(w, cfg, out, stats)
        if name in tagged("paper"):  # the comparison exercises the P-cast: at Δ = 10 each zeroes some P
            assert int(jnp.sum(stats.n_zeroed[-1])) > 0

    @pytest.mark.parametrize(
        "name,q_len,n",
        [
            ("fwd_s1", 64, 512),  # one query tile, offset N − q_len = 448
            pytest.param("fa3", 256, 256, marks=pytest.mark.slow),  # two tiles, different KV counts
        ],
    )
    def test_causal_matches_simulator(self, name, q_len, n):
        cfg = get_preset(name).replace(causal=True)
        _, out, _ = self.check_config(cfg, q_len=q_len, n=n, deltas=(7.0,))
        # bottom-right aligned: the last query row sees every key, the first only N − q_len + 1
        full = get_preset(name)
        w = _workload(q_len, n, deltas=(7.0,))
        out_full, _ = self.run_kernel(w, full)
        v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
        tol = 1e-5 * v_max
        np.testing.assert_allclose(np.asarray(out[..., -1, :]), np.asarray(out_full[..., -1, :]), rtol=0, atol=tol)
        assert np.max(np.abs(np.asarray(out[..., 0, :]) - np.asarray(out_full[..., 0, :]))) > 100 * tol

    def assert_matches_oracle(self, w, cfg, out, stats, v_descale=DESCALES["v_descale"]):
        """Kernel ≡ tests/oracle.py on batch element and head 0, within the oracle's slack for
        values at a rounding midpoint; returns the oracle's result."""
        q = np.asarray(w.q.astype(jnp.float32), np.float64)[0, 0]
        k = np.asarray(w.k.astype(jnp.float32), np.float64)[0, 0]
        v = np.asarray(w.v.astype(jnp.float32), np.float64)[0, 0] * v_descale
        scores = (q @ k.T) * DESCALES["q_descale"] * DESCALES["k_descale"] * SCALE_FACTOR * w.softmax_scale
        ref = oracle.attention(scores, v, **oracle.config_kwargs(cfg))
        gpu = 0.0 if self.INTERPRET else _GPU_TOL["atol_per_v"] * float(np.max(np.abs(v)))
        tol = 2e-6 * np.max(np.abs(ref.out)) + ref.out_slack + gpu
        err = np.abs(np.asarray(out)[0, 0] - ref.out)
        assert np.all(err <= tol), f"max excess {np.max(err - tol):.3g}"
        flips = np.abs(np.asarray(stats.n_zeroed)[0, 0] - ref.n_zeroed)
        assert np.all(flips <= ref.zeroed_slack + (0 if self.INTERPRET else _GPU_TOL["flips"]))
        return ref

    @pytest.mark.parametrize("name,causal", [("fwd_s1", False), ("fa3", True)])
    def test_matches_the_independent_oracle(self, name, causal):
        """Kernel ≡ tests/oracle.py (float64 Algorithm 1 sharing no code with the kernel)."""
        cfg = get_preset(name).replace(causal=causal)
        w = _workload(deltas=(7.0,))
        out, stats = self.run_kernel(w, cfg)
        ref = self.assert_matches_oracle(w, cfg, out, stats)
        assert ref.n_zeroed.sum() > 0

    @pytest.mark.parametrize("layout,causal", [("contiguous", False), ("strided", True)])
    def test_split_kv_matches_simulator_and_oracle(self, layout, causal):
        """Split-KV: 3 splits over 4 KV blocks (contiguous: one split has none; strided: two idle a
        step), each its own Algorithm-1 run with its own running max, merged in FP32 by log-sum-exp.
        Only the split holding the sink runs under the sink's max: fewer P are zeroed than in one run."""
        cfg = get_preset("fwd_s1").replace(
            block_kv=128, kv_splits=3, split_layout=layout, causal=causal
        )
        w, out, stats = self.check_config(cfg, n=512, deltas=(7.0,))
        ref = self.assert_matches_oracle(w, cfg, out, stats)
        assert ref.n_zeroed.sum() > 0
        _, one_run = self.run_kernel(w, cfg.replace(kv_splits=1))
        assert int(jnp.sum(stats.n_zeroed)) < int(jnp.sum(one_run.n_zeroed))

    def test_non_power_of_two_descales(self):
        """Descales from per-tensor quantization (amax/448): the scores still match exactly."""
        w = _workload(deltas=(7.0,))
        cfg = get_preset("fwd_s256")
        v32 = jax.random.normal(jax.random.key(7), w.v.shape, jnp.float32) * 3.0
        v8, v_descale = pk.quantize_fp8(v32)
        kwargs = {"q_descale": 0.3, "k_descale": 0.7, "v_descale": v_descale}
        w = w._replace(v=v8)
        out, stats = self.run_kernel(w, cfg, **kwargs)
        ref = self.simulate(w, cfg, **kwargs)
        v_max = float(v_descale) * float(jnp.max(jnp.abs(v8.astype(jnp.float32))))
        self.assert_matches(out, stats, ref, v_max)

    @pytest.mark.parametrize("v_descale", F16_V_DESCALES)
    def test_sageattn2pp_matches_simulator_and_oracle(self, v_descale):
        """SageAttention2++ as the kernel runs it: V scaled per channel to |V/c| <= 2.25 before the
        f16 accumulator, rounded to f16 after every 32 keys; on V8 that spans E4M3 (quantize_fp8),
        where an f16 accumulator at V's own scale overflows for large v_descale."""
        cfg = get_preset("sageattn2pp")
        assert cfg.f16_round_keys == 32 and cfg.v_channel_max == 2.25
        w = _workload(deltas=(7.0,))
        v8, _ = pk.quantize_fp8(jax.random.normal(jax.random.key(7), w.v.shape, jnp.float32))
        w = w._replace(v=v8)
        out, stats = self.run_kernel(w, cfg, v_descale=v_descale)
        ref = self.simulate(w, cfg, v_descale=v_descale)
        v_max = v_descale * float(jnp.max(jnp.abs(v8.astype(jnp.float32))))
        self.assert_matches(out, stats, ref, v_max, cfg)
        self.assert_matches_oracle(w, cfg, out, stats, v_descale=v_descale)  # within its f16 slack
        # the comparison tells the semantics apart: the simulator without the channel scale, or
        # rounding once per block, differs from the kernel in far more outputs than _F16_TOL allows
        for field in ({"v_channel_max": 0.0}, {"f16_round_keys": 0}):
            other = self.simulate(w, cfg.replace(**field), v_descale=v_descale)
            with pytest.raises(AssertionError, match="outputs differ|max error"):
                _assert_f16_close(out, other.out, v_max, cfg, interpret=self.INTERPRET)

    def test_gqa_equals_repeated_heads(self):
        w = _workload(deltas=(7.0,), heads=2, kv_heads=1)
        cfg = get_preset("rev_s1")
        out, _ = self.run_kernel(w, cfg)
        rep = w._replace(k=jnp.repeat(w.k, 2, axis=1), v=jnp.repeat(w.v, 2, axis=1))
        out_rep, _ = self.run_kernel(rep, cfg)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out_rep))

    def test_gqa_distinct_kv_heads(self):
        """4 query heads over 2 different KV heads: query head h must read KV head h // 2."""
        w = _workload(deltas=(7.0,), heads=4, kv_heads=2)
        assert not np.array_equal(np.asarray(w.v[:, 0], np.float32), np.asarray(w.v[:, 1], np.float32))
        cfg = get_preset("fwd_s256")
        out, stats = self.run_kernel(w, cfg)
        ref = self.simulate(w, cfg)  # repeats KV head j for query heads 2j, 2j + 1
        v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
        self.assert_matches(out, stats, ref, v_max)
        # the heads that share a KV head differ from those that do not
        assert float(jnp.max(jnp.abs(out[:, 0] - out[:, 2]))) > 1e-2 * v_max

    def test_gqa_split_kv_with_channel_scale(self):
        """4 query heads over 2 KV heads with per-channel V factors of their own, and 2 KV splits:
        the merge multiplies each query head's output by its KV head's channel scale."""
        w = _workload(deltas=(7.0,), heads=4, kv_heads=2)
        cfg = get_preset("sageattn2pp").replace(kv_splits=2)
        v_t = jnp.swapaxes(w.v, -1, -2)
        factors = np.asarray(pk.api.v_channel_factors(v_t, DESCALES["v_descale"], cfg))
        assert not np.array_equal(factors[:, 0], factors[:, 1])  # the two KV heads scale apart
        self.check_config(cfg, deltas=(7.0,), heads=4, kv_heads=2)

    def test_v_transposed_input(self):
        w = _workload(deltas=(7.0,))
        cfg = get_preset("fwd_s1")
        out, _ = self.run_kernel(w, cfg)
        out_t, _ = self.run_kernel(w._replace(v=jnp.swapaxes(w.v, -1, -2)), cfg, v_transposed=True)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out_t))


class TestMosaicKernelInterpret(TestMosaicKernel):
    """The Mosaic GPU kernel in Pallas interpret mode (CPU)."""

    INTERPRET = True

    @pytest.mark.slow
    def test_ring_of_three_slots(self):
        """More TMA slots change the schedule, not the numbers."""
        w = _workload(128, 512, deltas=(7.0,))  # two compute warpgroups, 4 KV steps, ring wraps
        cfg = get_preset("fa3").replace(block_kv=128)
        out2, s2 = self.run_kernel(w, cfg)
        out3, s3 = self.run_kernel(w, cfg, num_slots=3)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(out3))
        np.testing.assert_array_equal(np.asarray(s2.n_zeroed), np.asarray(s3.n_zeroed))


class TestTritonKernel(TestMosaicKernel):
    """The Triton kernel on a GPU (skipped without one)."""

    BACKEND = "triton"
    INTERPRET = False


class TestTritonKernelInterpret(TestTritonKernel):
    """The Triton kernel in Pallas interpret mode (CPU)."""

    INTERPRET = True


# ----------------------------------------------------------------------------------------------
# Lowering for Hopper without a GPU
# ----------------------------------------------------------------------------------------------

_HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def _lower_for_hopper(backend, cfg, *, q_len=128, n=512, head_dim=128, heads=4, kv_heads=2):
    q = jax.ShapeDtypeStruct((2, heads, q_len, head_dim), _F8)
    kv = jax.ShapeDtypeStruct((2, kv_heads, n, head_dim), _F8)
    fn = functools.partial(pk.fp8_attention, config=cfg, implementation=backend, return_stats=True)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=_HOPPER)):
        return jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(
    "name,causal,q_len,head_dim",
    [
        ("fwd_s1", False, 128, 128),
        ("rev_s256", False, 64, 128),
        ("fwd_s448", True, 256, 128),
        ("rev_s1", True, 128, 64),
        ("fa3", True, 128, 128),  # B = 224 (one compute warpgroup: two need 232,960 B of SMEM)
        ("fa3", False, 128, 64),  # B = 160
        ("flashinfer_sm90", False, 256, 128),  # B = 192
        ("sageattn2pp", False, 128, 128),
        ("sageattn2pp", True, 64, 64),
        ("dynamic_pow2", True, 64, 128),
        ("trtllm_xqa_multiblock", False, 64, 128),
        ("fa3_splitkv", True, 128, 128),
    ],
)
@pytest.mark.every_half
def test_mosaic_lowers_for_hopper(name, causal, q_len, head_dim):
    """Each preset at its own KV block for the head dim, over N = 512 keys (a multiple of none of
    224, 192, 160: the last block padded)."""
    cfg = preset_for(name, head_dim).replace(causal=causal)
    text = _lower_for_hopper("mosaic", cfg, q_len=q_len, head_dim=head_dim).as_text()
    assert "custom_call @mosaic_gpu" in text
    # FP8 × FP8 → FP32 wgmma, the saturating E4M3 cast, TMA loads and mbarriers are all emitted;
    # Q·Kᵀ is one wgmma N = block_kv wide per 32 channels, P8·V one N = d wide per 32 keys
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", text))
    assert wgmma == {str(cfg.block_kv), str(head_dim)}
    assert "cvt.rn.satfinite.e4m3x2.f32" in text
    # the TMA load: an NVVM op up to jax 0.11 (cp.async.bulk.tensor.shared.cluster.global), inline
    # PTX from jax 0.12 (cp.async.bulk.tensor.5d.shared::cta.global.mbarrier::complete_tx::bytes)
    assert re.search(r"cp\.async\.bulk\.tensor\.(\dd\.)?shared(\.|::)(cluster|cta)\.global", text)
    assert "mbarrier.try_wait.parity" in text


def _triton_module_text(lowered) -> str:
    """The Triton IR inside the lowered custom call, as text."""
    from jax._src.lib.mlir import ir  # the MLIR bindings jax ships
    from jaxlib.triton import dialect as triton_dialect

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        calls.append(child)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    assert len(calls) == 1
    payload = ir.StringAttr(calls[0].attributes["mhlo.backend_config"]["ir"]).value_bytes
    with ir.Context() as ctx:
        triton_dialect.register_dialect(ctx)
        return str(ir.Module.parse(payload))


@pytest.mark.parametrize(
    "name,causal,head_dim",
    [
        ("fwd_s1", False, 128),  # B = 64
        ("fa3", True, 128),  # B = 224 on a 256-key tile
        ("fa3", False, 64),  # B = 160 on a 256-key tile
        ("flashinfer_sm90", True, 128),  # B = 192 on a 256-key tile
        ("dynamic_pow2", False, 128),
        ("trtllm_xqa_multiblock", False, 128),
        ("fa3_splitkv", True, 128),
    ],
)
@pytest.mark.every_half
def test_triton_lowers_for_hopper(name, causal, head_dim):
    cfg = preset_for(name, head_dim).replace(causal=causal)
    lowered = _lower_for_hopper("triton", cfg, head_dim=head_dim)
    assert "custom_call @__gpu$xla.gpu.triton" in lowered.as_text()
    ir_text = _triton_module_text(lowered)
    fp8_dot = r"tt\.dot .*: tensor<(\d+)x(\d+)xf8E4M3FN> \* tensor<(\d+)x(\d+)xf8E4M3FN> -> tensor<\d+x\d+xf32>"
    dots = re.findall(fp8_dot, ir_text)
    assert len(dots) == 2, "expected Q·Kᵀ and P8·V as FP8 × FP8 → FP32 dots"
    tile = pk.kv_tile("triton", cfg.block_kv)
    assert tile >= cfg.block_kv and tile & (tile - 1) == 0
    (_, qk_k, _, qk_n), (_, pv_k, _, pv_n) = ((int(x) for x in dot) for dot in dots)
    assert (qk_k, qk_n, pv_k, pv_n) == (head_dim, tile, tile, head_dim)  # the block's keys on one tile
    assert re.search(r"tt\.fp_to_fp .*rounding = rtne.*-> tensor<\d+x\d+xf8E4M3FN>", ir_text)


@pytest.mark.every_half
@pytest.mark.parametrize("backend", pk.BACKENDS)
def test_split_kv_lowers_for_hopper_with_an_odd_step_count(backend):
    """6 KV blocks over 2 contiguous splits: 3 steps each, read from the schedule inside the kernel."""
    cfg = get_preset("fa3").replace(block_kv=128, kv_splits=2)
    text = _lower_for_hopper(backend, cfg, n=768).as_text()
    assert ("custom_call @mosaic_gpu" if backend == "mosaic" else "custom_call @__gpu$xla.gpu.triton") in text


@pytest.mark.every_half
@pytest.mark.parametrize("block_kv,round_keys", [(64, 32), (128, 64), (128, 0)])
def test_triton_f16_accumulator_lowers_for_hopper(block_kv, round_keys):
    """SageAttention2++'s P·V: one FP8 dot per f16 rounding group, each rounded to f16 and back."""
    cfg = get_preset("sageattn2pp").replace(block_kv=block_kv, f16_round_keys=round_keys)
    ir_text = _triton_module_text(_lower_for_hopper("triton", cfg))
    groups = block_kv // (round_keys or block_kv)
    fp8_dot = r"tt\.dot .*: tensor<\d+x(\d+)xf8E4M3FN> \* tensor<(\d+)x\d+xf8E4M3FN> -> tensor<\d+x\d+xf32>"
    dots = re.findall(fp8_dot, ir_text)
    assert len(dots) == 1 + groups, "expected Q·Kᵀ and one P8·V dot per f16 rounding group"
    assert [int(k) for k, _ in dots[1:]] == [block_kv // groups] * groups  # each P8·V covers its keys
    to_f16 = re.findall(r"arith\.truncf .*to tensor<\d+x\d+xf16>", ir_text)
    assert len(to_f16) >= groups


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def _arrays(q_shape=(1, 2, 64, 128), kv_shape=(1, 1, 256, 128), dtype=_F8):
    return jnp.zeros(q_shape, dtype), jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype)


def _call(q, k, v, config=None, **kwargs):
    """fp8_attention in interpret mode; the default config is fa3 at a tile both backends run."""
    config = get_preset("fa3").replace(block_kv=128) if config is None else config
    kwargs.setdefault("interpret", True)
    return pk.fp8_attention(q, k, v, config=config, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"implementation": "cuda"}, r"implementation='cuda' is not one of"),
        ({"config": "nope"}, r"preset='nope' is not one of"),
        (
            {"config": get_preset("fwd_s1").replace(block_kv=260)},
            r"block_kv=260 not supported by the mosaic backend: it needs a 288-key tile, the widest it runs is 256",
        ),
        (
            {"config": get_preset("fwd_s1").replace(block_kv=257), "implementation": "triton"},
            r"block_kv=257 not supported by the triton backend: it needs a 512-key tile",
        ),
        (
            {"config": get_preset("sageattn2pp").replace(block_kv=192, f16_round_keys=96), "implementation": "triton"},
            r"f16_round_keys=96 not supported by the triton backend: .* a power of two",
        ),
        ({"config": get_preset("fa3").replace(p_format="e5m2")}, r"p_format='e5m2'"),
        ({"config": get_preset("fa3").replace(scale=1024.0, overflow="nan")}, r"overflow='nan' with scale=1024"),
        ({"scale": 0.0}, r"scale=0.0 must be > 0"),
        ({"q_descale": -1.0}, r"q_descale=-1.0 must be > 0"),
        ({"v_descale": jnp.ones(3)}, r"v_descale=.* must be a positive scalar"),
        ({"num_slots": 1}, r"num_slots=1 must be >= 2"),
        (
            {"config": get_preset("sageattn2pp").replace(block_kv=128, f16_round_keys=16)},
            r"f16_round_keys=16 not supported by the kernels: one FP8 MMA covers a multiple of 32 keys",
        ),
        ({"interpret": "yes"}, r"interpret='yes' must be True or False"),
    ],
)
def test_bad_arguments(kwargs, match):
    q, k, v = _arrays()
    with pytest.raises(PcastError, match=match):
        _call(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "arrays,kwargs,match",
    [
        (_arrays(dtype=jnp.bfloat16), {}, r"q\.dtype=bfloat16 is not supported: must be float8_e4m3fn"),
        ((jnp.zeros((2, 64, 128), _F8),) + _arrays()[1:], {}, r"q\.shape=\(2, 64, 128\) must have 4 dimensions"),
        (_arrays()[:2] + (jnp.zeros((1, 1, 128, 128), _F8),), {}, r"v\.shape=\(1, 1, 128, 128\) must equal"),
        (_arrays(kv_shape=(2, 1, 256, 128)), {}, r"has batch 2"),
        (_arrays(kv_shape=(1, 1, 256, 64)), {}, r"head dim 64 but q has 128"),
        (_arrays(q_shape=(1, 3, 64, 128), kv_shape=(1, 2, 256, 128)), {}, r"heads=3 must be a multiple of kv_heads=2"),
        (_arrays(q_shape=(1, 2, 32, 128)), {}, r"q_len=32 not supported by the mosaic backend: must be a multiple"),
        (_arrays(q_shape=(1, 2, 64, 256), kv_shape=(1, 1, 256, 256)), {}, r"head_dim=256 not supported by the mosaic"),
        (_arrays(q_shape=(1, 2, 24, 128)), {"implementation": "triton"},
         r"q_len=24 not supported by the triton backend"),
        (_arrays(q_shape=(1, 2, 512, 128)), {"config": get_preset("fa3").replace(block_kv=128, causal=True)},
         r"q_len=512 must be"),
        (_arrays(), {"v_transposed": True}, r"v\.shape=\(1, 1, 256, 128\) must equal \(1, 1, 128, 256\)"),
        (
            _arrays(q_shape=(1, 2, 128, 128), kv_shape=(1, 1, 1024, 128)),
            {"config": get_preset("fa3").replace(block_kv=256), "num_slots": 3},
            r"block_kv=256 with head_dim=128 and num_slots=3 needs \d+ bytes of shared memory",
        ),
    ],
)
def test_bad_inputs(arrays, kwargs, match):
    with pytest.raises(PcastError, match=match):
        _call(*arrays, **kwargs)


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if c.block_format is not None])
def test_block_scaled_presets_are_refused(name):
    """The presets the registry test does not run: a block-scaled P is simulator-only."""
    with pytest.raises(PcastError, match=rf"p_format='{PRESETS[name].p_format}' not supported by the kernels"):
        _call(*_arrays(), config=name, implementation="triton")


@pytest.mark.parametrize("backend", pk.BACKENDS)
def test_any_block_kv_runs_on_a_tile_of_its_own(backend):
    """Semantic blocks the backend has no MMA tile for (100: not a multiple of 32; 96 on Triton) run
    on a wider tile with the extra keys masked: the same as the simulator at that block, and not the
    same as at the tile's width (the running max updates once per 100 keys)."""
    w = _workload(64, 250, deltas=(7.0,))
    kwargs = {"scale": SCALE_FACTOR * w.softmax_scale, **DESCALES}
    for block_kv in (100, 96):
        cfg = get_preset("rev_s1").replace(block_kv=block_kv)  # reverse: P-cast depends on the blocks
        tile = pk.kv_tile(backend, block_kv)
        out, stats = pk.fp8_attention(w.q, w.k, w.v, config=cfg, implementation=backend, interpret=True,
                                      return_stats=True, **kwargs)
        ref = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg, **kwargs)
        np.testing.assert_array_equal(np.asarray(stats.n_zeroed), np.asarray(ref.n_zeroed))
        v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
        chex.assert_trees_all_close(out, ref.out, rtol=_INTERPRET_RTOL, atol=_INTERPRET_ATOL_PER_V * v_max)
        if tile != block_kv:
            at_tile = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg.replace(block_kv=tile), **kwargs)
            assert not np.array_equal(np.asarray(at_tile.n_zeroed), np.asarray(stats.n_zeroed))


def test_without_interpret_needs_a_gpu():
    q, k, v = _arrays()
    if HAS_GPU:
        assert _call(q, k, v, interpret=False).shape == q.shape
    else:
        with pytest.raises(PcastError, match=r"needs a CUDA GPU .* pass interpret=True"):
            _call(q, k, v, interpret=False)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def check_pallas_page(scope: dict, printed: str, folder) -> None:
    """docs/guides/pallas.md, after tests/test_docs.py ran its block (interpret mode on CPU): FA3 at its
    own 224-key block equals the simulator on the same values."""
    out, stats, sim = scope["out"], scope["stats"], scope["sim"]
    assert out.shape == scope["q"].shape and bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(np.asarray(stats.n_zeroed), np.asarray(sim.n_zeroed))
    v_max = float(jnp.max(jnp.abs(scope["v"])))
    chex.assert_trees_all_close(out, sim.out, rtol=_INTERPRET_RTOL if not HAS_GPU else 1e-3,
                                atol=(_INTERPRET_ATOL_PER_V if not HAS_GPU else 1e-3) * v_max)


def test_quantize_qkv_matches_engine_quantization():
    from pcast_jax import engine

    x = jax.random.normal(jax.random.key(3), (2, 64, 32), jnp.float32) * 5.0
    q8, k8, v8, descales = pk.quantize_qkv(x, 2 * x, x + 1)
    for x8, d, src in ((q8, "q_descale", x), (k8, "k_descale", 2 * x), (v8, "v_descale", x + 1)):
        ref8, ref_d = engine.quantize_per_tensor(src)
        assert x8.dtype == _F8
        np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32)), np.asarray(ref8))
        assert float(descales[d]) == float(ref_d)
        assert float(jnp.max(jnp.abs(x8.astype(jnp.float32)))) == 448.0


def test_sink_workload_scores_are_sink_shaped():
    w = _workload(64, 512)
    q = w.q.astype(jnp.float32)
    k = w.k.astype(jnp.float32)
    scores = jnp.einsum("bhqd,bnd->bhqn", q, k[:, 0], precision="highest") * w.softmax_scale
    non_sink = np.asarray(scores[..., ~w.is_sink])
    assert abs(non_sink.mean()) < 0.1 and 0.85 < non_sink.std() < 1.15
    gap = np.asarray(scores[..., w.is_sink].mean(axis=(1, 2, 3)) - non_sink.mean(axis=(1, 2, 3)))
    np.testing.assert_allclose(gap, DELTAS, atol=0.35)
    np.testing.assert_allclose(w.delta, DELTAS, rtol=1e-3)
    # every product sits on the 2^-6 grid: the FP32 accumulation is exact in any order
    prods = np.asarray(q[0, 0, :4, None, :] * k[0, 0, None, :, :])
    assert np.all(prods * 64 == np.round(prods * 64))
    assert math.isclose(w.softmax_scale, 1 / math.sqrt(128))


# ----------------------------------------------------------------------------------------------
# The prepared GPU script: its CPU-checkable parts
# ----------------------------------------------------------------------------------------------


def test_gpu_bench_arguments():
    bench = gpu_bench()
    args = bench.parse_args([])
    assert args.seq_lens == [4096, 16384] and args.part == "all" and args.backends == ["mosaic", "triton"]
    smoke = bench.parse_args(["--cpu-smoke", "--part", "table2"])
    assert smoke.cpu_smoke and smoke.seq_lens == [256] and smoke.part == "table2"
    for bad in (["--seq-lens", "100"], ["--reps", "0"], ["--backends", "cuda"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_gpu_bench_table2_smoke(capsys):
    """Table 2 at a tiny size in interpret mode: kernel MSE = simulator MSE, same zero counts."""
    bench = gpu_bench()
    rows = bench.run_table2(bench.parse_args(["--cpu-smoke", "--part", "table2", "--backends", "triton"]))
    assert [r["config"] for r in rows] == list(tagged("paper"))
    for r in rows:
        assert r["zeroed_kernel"] == r["zeroed_simulator"]
        assert r["mse_kernel"] == pytest.approx(r["mse_simulator"], rel=1e-5)
    fwd_s1 = next(r for r in rows if r["config"] == "fwd_s1")
    rev_s256 = next(r for r in rows if r["config"] == "rev_s256")
    assert fwd_s1["zeroed_kernel"] > 100 * max(rev_s256["zeroed_kernel"], 1)
    assert "FAILED" not in capsys.readouterr().out


@pytest.mark.slow
def test_mosaic_ring_has_no_races():
    """The interpreter's race detector sees no unsynchronized SMEM access in the TMA ring.

    Two compute warpgroups and the memory warpgroup share 2 K/Vᵀ slots over 4 KV steps (and over
    the 1–2 steps of each of 3 strided KV splits with f16 rounding groups of 32 keys); the
    interpreter also checks that every barrier phase is observed (it rejects the kernel if the
    producer skips a wait on a "slot free" barrier).
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state

    from pallas_kernels import api, mosaic_gpu
    from pcast_jax import block

    w = _workload(128, 512, deltas=(7.0,))
    params = jnp.array([w.softmax_scale, 0.0, 0.0, 0.0], jnp.float32)
    v_t = jnp.swapaxes(w.v, -1, -2)
    for cfg in (
        get_preset("fa3").replace(block_kv=128),
        get_preset("fwd_s1").replace(block_kv=128, causal=True),
        get_preset("sageattn2pp").replace(block_kv=128, kv_splits=3, split_layout="strided"),
    ):
        out = mosaic_gpu.mosaic_attention(
            w.q, w.k, v_t, api.v_channel_factors(v_t, 1.0, cfg), jnp.asarray(block.split_schedule(4, cfg)), params,
            config=cfg, interpret=plgpu.InterpretGPUParams(detect_races=True),
        )
        jax.block_until_ready(out)
        assert not gpu_callbacks.get_races().races_found
