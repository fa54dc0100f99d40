"""cuDNN's FP8 scaled dot-product attention: what Transformer Engine's ``fp8_dpa`` and JAX's own
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., fp8_params=..., use_fp8=True)`` run.

The kernel is closed; its semantics are read from cuDNN's own reference (NVIDIA/cudnn-frontend commit
3929da2, ``test/python/sdpa/fp8_ref.py``), which the library's tests hold the kernel to:

* B = 128 keys per block (line 74), forward order;
* a learned sink is the initial running max, m = s_L and ℓ = 1 (lines 79-81): sink_mode ``"init_max"``;
* lazy rescale: the running max moves only when a block's max exceeds it by more than τ, compared with
  the logits themselves (natural-log units, line 105); until then P = exp(s − m_old) may reach e^τ
  (line 117); when it moves, O and ℓ are rescaled (lines 110-115);
* ℓ sums the FP32 P before the scale and the cast (line 120): multiply mode;
* the cast is ``(P·S_eff).to(fp8)`` with S_eff = ``s_scale``·2^-τ (lines 123-125), so a lag of τ nats lets
  P·S_eff reach (e/2)^τ·s_scale; the output is ``o / l.clamp(min=1)`` (line 131).

The P scale is the caller's ``scale_s``: JAX's own unit test passes 1 (:data:`JAX_TEST_SCALE_S`), cuDNN's
harness 32 (:data:`HARNESS_SCALE_S`); each has a preset at τ = 4 (SM100) and τ = 0 (Hopper and older).

Assumptions: the test default τ = 4 (``test/python/sdpa/fp8.py`` line 319) stands for the kernel's on SM100
(``CUDNN_RESCALE_THRESHOLD`` overrides it, ``include/cudnn_frontend/graph_properties.h`` lines 23-37; the
tests draw τ from {0, 2, 4} on SM100 and use τ = 0 elsewhere, ``test_mhas_v2.py`` lines 659-664); the
cast inside the closed kernel saturates (``cvt.rn.satfinite``, as every Hopper/Blackwell kernel here;
the PyTorch reference's own cast would give NaN past 480).
"""

from __future__ import annotations

from pcast_jax.config import KernelConfig


def _cudnn(scale: float, tau: float, name: str, *, compensation: str = "pow2") -> KernelConfig:
    return KernelConfig(order="forward", scale=scale, scale_mode="multiply", block_kv=128, sink_mode="init_max",
                        rescale_threshold=tau, rescale_unit="natural", rescale_compensation=compensation,
                        name=name)


#: The P scale JAX's own cuDNN FP8 test passes: its FP8 metas are built from ``jnp.ones``
#: (jax-ml/jax ``tests/fused_attention_stablehlo_test.py``, lines 690-693 at commit cec06d1), so
#: ``fp8_params["scale_s"]`` = 1.
JAX_TEST_SCALE_S = 1.0
#: The P scale cuDNN's own FP8 test harness passes: ``s_amax = 1.0`` (cudnn-frontend commit 3929da2,
#: ``test/python/sdpa/fp8.py`` line 363) and ``s_scale = get_fp8_scale_factor(s_amax, e4m3)`` (line 372), i.e.
#: 128 / 2^⌈log2 1⌉ × 0.25 = 32 (``test/python/sdpa/helpers.py`` lines 170-182: largest power of two 128 for
#: e4m3, fudge factor 0.25).
HARNESS_SCALE_S = 32.0
#: The lazy-rescale threshold τ (nats) by GPU generation, as cuDNN's reference tests set it: on SM100 drawn
#: from {0, 2, 4} with the reference's default 4 (``test/python/test_mhas_v2.py`` lines 659-660,
#: ``fp8.py`` line 319), elsewhere (Hopper) 0 (``test_mhas_v2.py`` lines 661-662). The kernel itself is closed;
#: that its own τ matches is an assumption.
TAU_BY_GPU = {"sm100": 4.0, "sm90": 0.0}
#: Where each τ of :data:`TAU_BY_GPU` is read (cudnn-frontend commit 3929da2).
TAU_SOURCE = {"sm100": "cudnn-frontend test/python/test_mhas_v2.py lines 659-660, test/python/sdpa/fp8.py line 319",
              "sm90": "cudnn-frontend test/python/test_mhas_v2.py lines 661-662"}

PRESETS: dict[str, KernelConfig] = {
    # cuDNN FP8 SDPA on SM100 with the reference's default τ = 4 (nats) and the scale_s JAX's tests pass (1):
    # S_eff = 2^-4, so non-sink P collapses from Δ ≈ 10 ln 2 + ln(2^-4) ≈ 4.2 on.
    "cudnn_fp8": _cudnn(JAX_TEST_SCALE_S, TAU_BY_GPU["sm100"], "cudnn_fp8"),
    # cuDNN FP8 SDPA without a lazy rescale (τ = 0, what the reference tests use off SM100, e.g. Hopper),
    # scale_s = 1: S_eff = 1, collapse from Δ ≈ 10 ln 2 ≈ 6.9.
    "cudnn_fp8_tau0": _cudnn(JAX_TEST_SCALE_S, TAU_BY_GPU["sm90"], "cudnn_fp8_tau0"),
    # cuDNN FP8 SDPA on SM100 (τ = 4 nats) with the scale_s cuDNN's own harness passes (32): S_eff = 32·2^-4 = 2,
    # so non-sink P collapses from Δ ≈ 10 ln 2 + ln 2 ≈ 7.6 on; the lag lets P·S_eff reach (e/2)^4·32 ≈ 109 < 448.
    "cudnn_fp8_s32": _cudnn(HARNESS_SCALE_S, TAU_BY_GPU["sm100"], "cudnn_fp8_s32"),
    # The same scale_s = 32 off SM100 (τ = 0, Hopper): S_eff = 32, collapse from Δ ≈ 15 ln 2 ≈ 10.4.
    "cudnn_fp8_s32_tau0": _cudnn(HARNESS_SCALE_S, TAU_BY_GPU["sm90"], "cudnn_fp8_s32_tau0"),
    # The MXFP8 reference (test/python/sdpa/mxfp8_ref.py lines 67, 72-76, 96, 112-115): τ = 4 nats, P cast
    # to plain E4M3 (not micro-scaled) with a fixed S = 16 and no 2^-τ compensation: P·S reaches 16·e^4 ≈ 874.
    "cudnn_mxfp8": _cudnn(16.0, 4.0, "cudnn_mxfp8", compensation="none"),
    # Transformer Engine fp8_dpa (NVIDIA/TransformerEngine commit d0067d0): S comes from a delayed-scaling
    # recipe even under current scaling (transformer_engine/pytorch/attention/dot_product_attention/
    # dot_product_attention.py lines 1011-1027), sf = (fp8_max / amax) / 2^margin (quantization.py line
    # 1111), margin 0, amax history 1 (lines 239-244): S = 448 once amax_S ≈ 1 (our inference: cuDNN
    # defines amax_S). With τ = 0 (off SM100).
    "te_fp8_dpa": _cudnn(448.0, 0.0, "te_fp8_dpa"),
}


def delayed_scale(amax: float, *, margin: int = 0, fmt_max: float = 448.0) -> float:
    """Transformer Engine's delayed-scaling scale factor for S: (fmt_max / amax) / 2^margin.

    ``amax`` is the largest |P| the recipe's amax history holds (≈ 1 for a softmax), so S ≈ 448.
    Transformer Engine ``transformer_engine/pytorch/quantization.py`` line 1111 (commit d0067d0).
    """
    from pcast_jax.errors import check_int, check_positive

    amax = check_positive("amax", amax, float32=True)
    margin = check_int("margin", margin, min_value=-126, max_value=126)
    return (check_positive("fmt_max", fmt_max) / amax) / 2.0**margin
