"""cuDNN's FP8 scaled dot-product attention: the open kernels of cudnn-frontend, and the older test
reference that stands for the closed engines.

**The open kernels** (NVIDIA/cudnn-frontend, ``python/cudnn/sdpa/fwd/kernels/``, CuTe-DSL "FROST"
engines; each fact cited at the commit its file was read at):

* SM100 per-tensor FP8, ``sm100/prefill_d128_fp8.py`` at commit 0341681 (d = 64 and 128, lines 88-98; the
  d192, d256 and d512 siblings carry the same constant): P is cast as P·2^P_CAST_LOG2_SCALE with
  ``P_CAST_LOG2_SCALE = 4.0`` riding the exp2 argument, so the row sum accumulates the scaled P and
  O/ℓ cancels it (lines 176-187): S = 16 in the exponent, scale_mode ``"exponent"``. ``descale_s`` /
  ``scale_s`` are "accepted and ignored (P is cast unscaled ...)" (lines 11-12): the caller's scale_s
  never reaches P. The lazy-rescale skip bounds P by 2^RESCALE_THRESHOLD with RESCALE_THRESHOLD 4.0
  for FP8 (line 178; ``config_sm100.py`` ``rescale_threshold(dtype_qkv)``: 4.0 for E4M3 / E5M2, commit
  3d44fdb), so the cast peaks at 2^(4+4) = 256 < 448 (the comment's invariant
  RESCALE_THRESHOLD + P_CAST_LOG2_SCALE ≤ log2 448, line 186): τ = 4 in **log2** units. P is stored as
  E4M3 when Q/K/V are E4M3 and as E5M2 when they are E5M2 (lines 161-168). 128 P columns per KV step
  (line 23; ``TILE_N = 128`` in ``config_sm100.py``'s ``CfgD256`` and ``CfgD512`` too). On cc 10.0, 32 of
  every 128 P columns take a polynomial exp2 (lines 23-31; not modelled: its relative error is
  ~1e-4, far below the cast's). The learned sink: "the sink denominator term is scaled up to match"
  (lines 184-185): a denominator term after the KV loop, sink_mode ``"epilogue"``.
* The MXFP8 sibling, ``sm100/prefill_d128_mxfp8.py`` at commit 00fc162: the block scales cover Q/K/V,
  not P; P is cast element-wise with the same baked 2^4 bias (lines 183-192) to E4M3 or E5M2 as Q/K/V
  (lines 167-175): the same P semantics as the per-tensor kernel.
* cuDNN's test reference was rewritten to mirror these kernels (``test/python/sdpa/fp8_ref.py`` at commit
  07b111f, ``compute_ref``): KV blocks walked in ascending order (line 153), the running max compared
  in log2 units, ``m_block − m_old > rescale_threshold·ln 2`` (lines 157-159), ℓ from FP32 P (line
  174), the cast ``(p·s_scale·2^-τ).to(fp8)`` (lines 147, 177-178; the kernels' tests pass
  s_scale = 2^(4+4), so 2^4 reaches P), and ``sink_in_max=False`` adding the sink to the row sum after
  the loop "(the FROST SM100 kernels)" (lines 131-132, 192-196). The forward order of the SM100 kernels
  is read from this mirror.
* SM120 per-tensor FP8, ``sm120/prefill_fp8.py`` at commit 020f739: a right-to-left KV walk (line 9; the
  loop's ``kv_tile_idx -= 1``): **reverse** order; the same baked P bias 2^4 with "NOT cuDNN's Scale_S;
  that pair is accepted and ignored" and the lazy rescale 2^4 (lines 103-113), the row sum de-scaled by
  the exact 2^-4 before the sink joins the denominator (lines 50-52, 108-110); P cast to the input FP8
  type (lines 41-42); KV tile 128 or 64 (line 49; ``config_sm120.fp8_tile_choice`` picks by shape: 128
  is assumed). Its ``__call__`` docstring says "descale_s/scale_s are unsupported on this cell (P is cast
  unscaled, like SM100)"; the module docstring's older bullet "``Scale_S`` multiplies P immediately before
  the cast" (lines 29-30) contradicts the code at this commit, which we follow.
* No open SM90 FP8 kernel exists (``kernels/sm90/`` holds an f16 d512 kernel only).

**The older reference** (commit 3929da2, ``test/python/sdpa/fp8_ref.py``), which cuDNN's tests held the
closed engines to before the rewrite, and which the ``cudnn_fp8*`` / ``cudnn_mxfp8`` / ``te_fp8_dpa``
presets follow:

* B = 128 keys per block (line 74), forward order;
* a learned sink is the initial running max, m = s_L and ℓ = 1 (lines 79-81): sink_mode ``"init_max"``;
* lazy rescale: the running max moves only when a block's max exceeds it by more than τ, compared with
  the logits themselves (natural-log units, line 105); until then P = exp(s − m_old) may reach e^τ
  (line 117); when it moves, O and ℓ are rescaled (lines 110-115);
* ℓ sums the FP32 P before the scale and the cast (line 120): multiply mode;
* the cast is ``(P·S_eff).to(fp8)`` with S_eff = ``s_scale``·2^-τ (lines 123-125), so a lag of τ nats lets
  P·S_eff reach (e/2)^τ·s_scale; the output is ``o / l.clamp(min=1)`` (line 131).

Which engine a call reaches: JAX (``jax._src.cudnn.fused_attention_stablehlo``) and Transformer Engine
reach cuDNN through its C++ graph API; the open engines register when Python imports ``cudnn.sdpa``.
Whether XLA's call reaches them or a closed engine is not known (an assumption either way);
:data:`ENGINES` says, per GPU, which engine the answers here are about and whether ``scale_s`` reaches P.

Assumptions of the older reference: its default τ = 4 (``test/python/sdpa/fp8.py`` line 319) for SM100
(``CUDNN_RESCALE_THRESHOLD`` overrides it, ``include/cudnn_frontend/graph_properties.h`` lines 23-37; the
tests drew τ from {0, 2, 4} on SM100 and used τ = 0 elsewhere, ``test_mhas_v2.py`` lines 659-664); the
cast inside a closed kernel saturates (``cvt.rn.satfinite``, as every Hopper/Blackwell kernel here;
the PyTorch reference's own cast would give NaN past 480).
"""

from __future__ import annotations

import dataclasses

from pcast_jax.config import KernelConfig

#: The baked P bias of the open kernels, log2 S (``P_CAST_LOG2_SCALE``, sources in the module docstring).
P_CAST_LOG2_SCALE = 4.0
#: Their lazy-rescale threshold for FP8 Q/K/V, in log2 units (``config_sm100.rescale_threshold``).
OPEN_RESCALE_THRESHOLD = 4.0


def _open(order: str, *, p_format: str = "e4m3") -> KernelConfig:
    """An open cudnn-frontend FP8 kernel: S = 2^4 in the exponent, τ = 4 (log2), 128-key tiles, the sink
    in the denominator after the KV loop."""
    return KernelConfig(order=order, scale=2.0**P_CAST_LOG2_SCALE, scale_mode="exponent", block_kv=128,
                        rescale_threshold=OPEN_RESCALE_THRESHOLD, rescale_unit="log2", sink_mode="epilogue",
                        p_format=p_format)


def _cudnn(scale: float, tau: float, *, compensation: str = "pow2") -> KernelConfig:
    return KernelConfig(order="forward", scale=scale, scale_mode="multiply", block_kv=128, sink_mode="init_max",
                        rescale_threshold=tau, rescale_unit="natural", rescale_compensation=compensation)


#: The P scale JAX's own cuDNN FP8 test passes: its FP8 metas are built from ``jnp.ones``
#: (jax-ml/jax ``tests/fused_attention_stablehlo_test.py``, lines 690-693 at commit cec06d1), so
#: ``fp8_params["scale_s"]`` = 1.
JAX_TEST_SCALE_S = 1.0
#: The P scale cuDNN's own FP8 test harness passes: ``s_amax = 1.0`` (cudnn-frontend commit 3929da2,
#: ``test/python/sdpa/fp8.py`` line 363) and ``s_scale = get_fp8_scale_factor(s_amax, e4m3)`` (line 372), i.e.
#: 128 / 2^⌈log2 1⌉ × 0.25 = 32 (``test/python/sdpa/helpers.py`` lines 170-182: largest power of two 128 for
#: e4m3, fudge factor 0.25).
HARNESS_SCALE_S = 32.0
#: The older reference's lazy-rescale threshold τ (nats) by GPU generation, as cuDNN's tests set it before
#: the open kernels (commit 3929da2): on SM100 drawn from {0, 2, 4} with the reference's default 4
#: (``test/python/test_mhas_v2.py`` lines 659-660, ``fp8.py`` line 319), elsewhere (Hopper) 0
#: (``test_mhas_v2.py`` lines 661-662). That a closed engine's own τ matches is an assumption; the open
#: SM100 kernels bake :data:`OPEN_RESCALE_THRESHOLD` in log2 units instead.
TAU_BY_GPU = {"sm100": 4.0, "sm90": 0.0}
#: Where each τ of :data:`TAU_BY_GPU` is read (cudnn-frontend commit 3929da2).
TAU_SOURCE = {"sm100": "cudnn-frontend test/python/test_mhas_v2.py lines 659-660, test/python/sdpa/fp8.py line 319",
              "sm90": "cudnn-frontend test/python/test_mhas_v2.py lines 661-662"}

PRESETS: dict[str, KernelConfig] = {
    # The open SM100 FP8 kernels (d64-d512, per-tensor FP8 and MXFP8 alike, E4M3 Q/K/V): forward, B = 128,
    # S = 16 in the exponent whatever scale_s is, τ = 4 (log2), the learned sink in the epilogue.
    "cudnn_sm100_fp8": _open("forward"),
    # The same with E5M2 Q/K/V: P is cast to E5M2 (prefill_d128_fp8.py lines 165-167).
    "cudnn_sm100_fp8_e5m2": _open("forward", p_format="e5m2"),
    # The open SM120 per-tensor FP8 kernel (commit 020f739): the same P, walked right to left; B = 128 assumed.
    "cudnn_sm120_fp8": _open("reverse"),
    # The older reference (commit 3929da2; the closed engines' model, see ENGINES) at its SM100 default
    # τ = 4 (nats) and the scale_s JAX's tests pass (1):
    # S_eff = 2^-4, so non-sink P collapses from Δ ≈ 10 ln 2 + ln(2^-4) ≈ 4.2 on.
    "cudnn_fp8": _cudnn(JAX_TEST_SCALE_S, TAU_BY_GPU["sm100"]),
    # The older reference without a lazy rescale (τ = 0, what its tests use off SM100, e.g. Hopper),
    # scale_s = 1: S_eff = 1, collapse from Δ ≈ 10 ln 2 ≈ 6.9.
    "cudnn_fp8_tau0": _cudnn(JAX_TEST_SCALE_S, TAU_BY_GPU["sm90"]),
    # The older reference at τ = 4 nats with the scale_s cuDNN's own harness passed (32): S_eff = 32·2^-4 = 2,
    # so non-sink P collapses from Δ ≈ 10 ln 2 + ln 2 ≈ 7.6 on; the lag lets P·S_eff reach (e/2)^4·32 ≈ 109 < 448.
    "cudnn_fp8_s32": _cudnn(HARNESS_SCALE_S, TAU_BY_GPU["sm100"]),
    # The same scale_s = 32 off SM100 (τ = 0, Hopper): S_eff = 32, collapse from Δ ≈ 15 ln 2 ≈ 10.4.
    "cudnn_fp8_s32_tau0": _cudnn(HARNESS_SCALE_S, TAU_BY_GPU["sm90"]),
    # The older MXFP8 reference (commit 3929da2, test/python/sdpa/mxfp8_ref.py lines 67, 72-76, 96,
    # 112-115): τ = 4 nats, P cast to plain E4M3 (not micro-scaled) with a fixed S = 16 and no 2^-τ
    # compensation: P·S reaches 16·e^4 ≈ 874. (The open MXFP8 kernel casts P as cudnn_sm100_fp8 does.)
    "cudnn_mxfp8": _cudnn(16.0, 4.0, compensation="none"),
    # Transformer Engine fp8_dpa (NVIDIA/TransformerEngine commit d0067d0): S comes from a delayed-scaling
    # recipe even under current scaling (transformer_engine/pytorch/attention/dot_product_attention/
    # dot_product_attention.py lines 1011-1027), sf = (fp8_max / amax) / 2^margin (quantization.py line
    # 1111), margin 0, amax history 1 (lines 239-244): S = 448 once amax_S ≈ 1 (our inference: cuDNN
    # defines amax_S). With τ = 0 (off SM100).
    "te_fp8_dpa": _cudnn(448.0, 0.0),
}



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Engine:
    """The cuDNN engine an answer for one GPU is about, and whether the caller's ``scale_s`` reaches P."""

    #: the preset that models it at scale_s = 1
    preset: str
    #: True when P is cast at scale_s (times the 2^-τ compensation), False when the kernel ignores scale_s
    scale_s_reaches_p: bool
    #: which engine, in words, with the assumption it rests on
    words: str


#: GPU (``sm90``, ``sm100``, ``sm120``) → the engine the answers are about. Open kernels where cudnn-frontend
#: has one (their facts in the module docstring); Hopper has none, so its answer is about the older
#: reference the closed engine was tested against.
ENGINES: dict[str, Engine] = {
    "sm90": Engine(preset="cudnn_fp8_tau0", scale_s_reaches_p=True,
                   words="cuDNN's closed SM90 FP8 engine (cudnn-frontend has no open SM90 FP8 kernel), modelled by "
                         "the test reference it was held to (fp8_ref.py at 3929da2: P·scale_s cast, τ = 0); an "
                         "assumption"),
    "sm100": Engine(preset="cudnn_sm100_fp8", scale_s_reaches_p=False,
                    words="cuDNN's open SM100 FP8 kernels (cudnn-frontend sm100/prefill_d*_fp8.py and _mxfp8.py at "
                          "0341681: P cast at the baked S = 16, scale_s accepted and ignored, τ = 4 log2); that "
                          "XLA's cuDNN call reaches these and not a closed engine is an assumption"),
    "sm120": Engine(preset="cudnn_sm120_fp8", scale_s_reaches_p=False,
                    words="cuDNN's open SM120 FP8 kernel (cudnn-frontend sm120/prefill_fp8.py at 020f739: reverse "
                          "order, P cast at the baked S = 16, scale_s ignored, τ = 4 log2); that XLA's cuDNN call "
                          "reaches it and not a closed engine is an assumption"),
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
