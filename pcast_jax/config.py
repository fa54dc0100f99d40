"""What an FP8 attention kernel does at the P-cast: :class:`KernelConfig` and the presets.

Algorithm 1 of the paper, per query row and KV block j (in the kernel's order)::

    m_new = max(m, rowmax(Z_j));  α = exp(m − m_new)
    P     = exp(Z_j − m_new);     ℓ = α ℓ + rowsum(P)          # FP32, pre-cast P
    P8    = cast_E4M3(P · S);     O = α O + P8 · V_j           # FP8 × FP8 → FP32
    return O / (S ℓ)

``scale_mode`` says where S goes:

* ``"multiply"`` — P·S after the exponential, ℓ from unscaled P, epilogue O/(S·ℓ)
  (hpc-ops, FlashInfer, TensorRT-LLM XQA; the paper's simulator).
* ``"exponent"`` — S folded into the exponent, P̃ = exp2(Z·log2e − (m·log2e − log2 S)), so ℓ sums
  the scaled values and the epilogue is O/ℓ (FlashAttention-3/4, SageAttention).
* ``"dynamic"`` — per row and block, the largest power of two 2^k with rowmax(P)·2^k ≤ max_E4M3;
  each block's P8·V is multiplied by 2^-k (exact) before it is accumulated; ℓ unscaled. The paper's
  "future work" (§7.4); no released kernel does this. ``scale`` is ignored.
"""

from __future__ import annotations

import dataclasses
import math

from pcast_jax import formats
from pcast_jax.errors import PcastError, check_choice, check_int, check_positive

__all__ = ["KernelConfig", "QKV_GRANULARITIES", "PRESETS", "PAPER_CONFIGS", "KERNEL_PRESETS", "get_preset", "resolve"]

ORDERS = ("forward", "reverse")
SCALE_MODES = ("multiply", "exponent", "dynamic")
ACCUMULATORS = ("f32", "f16")
#: Bounds on S: S, 1/S and S·ℓ (ℓ ≤ N < 2^27) stay finite, nonzero float32 numbers.
SCALE_MIN, SCALE_MAX = 2.0**-100, 2.0**100
QKV_PRECISIONS = ("f32", "e4m3")
QKV_GRANULARITIES = ("tensor", "head")


_DEFAULT_BLOCK_KV = 64


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelConfig:
    """P-cast semantics of one FP8 attention kernel; validated on construction.

    Attributes:
      order: KV block order, ``"forward"`` (0 → N) or ``"reverse"`` (N → 0).
      scale: the static P scale S, in [2^-100, 2^100]. ``"dynamic"`` mode ignores it.
      scale_mode: ``"multiply"``, ``"exponent"`` or ``"dynamic"`` (module docstring).
      block_kv: KV block size B. N that is not a multiple is padded with masked keys.
      p_format: format of the P-cast (``"e4m3"`` or ``"e5m2"``).
      overflow: ``"satfinite"`` (Hopper cvt.rn.satfinite; what kernels do) or ``"nan"``.
      accumulator: ``"f32"``, or ``"f16"``: each block's P8·V product is rounded to float16 before
        it is added to the FP32 output (SageAttention2++'s ``fp32+fp16`` PV accumulation).
      qkv: ``"f32"`` keeps Q, K, V exact (isolates the P-cast, as the paper does); ``"e4m3"``
        quantizes Q, K and V to E4M3 (scale = amax/max_E4M3) as production kernels do.
      qkv_granularity: where the E4M3 Q/K/V scales live when ``qkv == "e4m3"``: ``"tensor"``
        (one scale per tensor) or ``"head"`` (one per attention head). Ignored for FP32 Q/K/V.
      causal: bottom-right aligned causal mask (query i of q_len sits at position N − q_len + i).
      name: a label for reports, not part of the identity: two configs are equal (and hash alike)
        when their semantics are, whatever their names. Empty → :meth:`default_name`.

    Fields that do not act in a mode are normalised, so equality is semantic: the dynamic mode
    sets ``scale`` to 1 and FP32 Q/K/V set ``qkv_granularity`` to ``"tensor"``.
    """

    order: str = "forward"
    scale: float = 1.0
    scale_mode: str = "multiply"
    block_kv: int = _DEFAULT_BLOCK_KV
    p_format: str = "e4m3"
    overflow: str = "satfinite"
    accumulator: str = "f32"
    qkv: str = "f32"
    qkv_granularity: str = "tensor"
    causal: bool = False
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        check_choice("order", self.order, ORDERS)
        scale = check_positive("scale", self.scale)
        if not SCALE_MIN <= scale <= SCALE_MAX:
            raise PcastError(f"scale={self.scale!r} must lie in [2^-100, 2^100] "
                             "(S, 1/S and S·ℓ must stay finite, nonzero float32 numbers)")
        object.__setattr__(self, "scale", scale)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        check_int("block_kv", self.block_kv, min_value=1, max_value=1 << 16)
        formats.get_format(self.p_format, param="p_format")
        check_choice("overflow", self.overflow, formats.OVERFLOW_MODES)
        check_choice("accumulator", self.accumulator, ACCUMULATORS)
        check_choice("qkv", self.qkv, QKV_PRECISIONS)
        check_choice("qkv_granularity", self.qkv_granularity, QKV_GRANULARITIES)
        if self.scale_mode == "dynamic":
            object.__setattr__(self, "scale", 1.0)
        if self.qkv == "f32":
            object.__setattr__(self, "qkv_granularity", "tensor")
        if not isinstance(self.causal, bool):
            raise PcastError(f"causal={self.causal!r} must be True or False")
        if not isinstance(self.name, str):
            raise PcastError(f"name={self.name!r} must be a string")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    def default_name(self) -> str:
        """``fwd_s1``-style label naming every field that differs from its default.

        Order and scale always appear; then ``_exp`` (exponent mode), ``_b128`` (block_kv),
        ``_e5m2`` (P format), ``_nan`` (overflow), ``_f16acc``, ``_qkv8`` / ``_qkv8h`` (E4M3 Q/K/V
        per tensor / per head) and ``_causal``. Two configs with different semantics never share a
        default name.
        """
        parts = [self.order[:3], "sdyn" if self.scale_mode == "dynamic" else "s" + repr(self.scale).removesuffix(".0")]
        if self.scale_mode == "exponent":
            parts.append("exp")
        if self.block_kv != _DEFAULT_BLOCK_KV:
            parts.append(f"b{self.block_kv}")
        if self.p_format != "e4m3":
            parts.append(self.p_format)
        if self.overflow != "satfinite":
            parts.append(self.overflow)
        if self.accumulator != "f32":
            parts.append(f"{self.accumulator}acc")
        if self.qkv == "e4m3":
            parts.append("qkv8h" if self.qkv_granularity == "head" else "qkv8")
        if self.causal:
            parts.append("causal")
        return "_".join(parts)

    def to_dict(self) -> dict:
        """Every field as a plain value; :meth:`from_dict` reads it back.

        ``qkv_granularity`` is written only where it acts (E4M3 Q/K/V), so sweeps recorded before
        the field existed keep their fingerprints.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.qkv == "f32":
            del d["qkv_granularity"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        """A config from :meth:`to_dict`'s form; an unknown key raises :class:`PcastError` naming it."""
        if not isinstance(d, dict):
            raise PcastError(f"a kernel config must be a mapping of field names to values, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PcastError(f"unknown KernelConfig field(s) {', '.join(map(repr, unknown))}; "
                             f"fields are {', '.join(sorted(known))}")
        return cls(**d)

    @property
    def fmt(self) -> formats.FP8Format:
        return formats.get_format(self.p_format)

    @property
    def log2_scale(self) -> float:
        return math.log2(self.scale)

    @property
    def scale_is_power_of_two(self) -> bool:
        """Prop. 5: ×S and ×(1/S) are exact in FP32 iff S = 2^k."""
        m, _ = math.frexp(self.scale)
        return m == 0.5

    def replace(self, **changes) -> "KernelConfig":
        """A copy with fields changed; its name is re-derived unless given.

        (``dataclasses.replace`` works too and keeps the label as it is.)
        """
        if "name" not in changes:
            changes["name"] = ""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        s = "dynamic 2^k" if self.scale_mode == "dynamic" else f"S={self.scale:g} ({self.scale_mode})"
        extra = []
        if self.accumulator != "f32":
            extra.append(f"{self.accumulator} PV accumulator")
        if self.qkv != "f32":
            extra.append(f"{self.qkv} QKV per {self.qkv_granularity}")
        if self.causal:
            extra.append("causal")
        tail = (", " + ", ".join(extra)) if extra else ""
        return f"{self.order}, {s}, B={self.block_kv}{tail}"


def _paper(order: str, scale: float, label: str) -> KernelConfig:
    return KernelConfig(order=order, scale=scale, scale_mode="multiply", block_kv=64, name=label)


#: The paper's five configurations (§6.2, Table 2): Q, K, V in FP32, ℓ from pre-cast P, B = 64.
PAPER_CONFIGS: dict[str, KernelConfig] = {
    "fwd_s1": _paper("forward", 1.0, "fwd_s1"),
    "rev_s1": _paper("reverse", 1.0, "rev_s1"),
    "fwd_s448": _paper("forward", 448.0, "fwd_s448"),
    "fwd_s256": _paper("forward", 256.0, "fwd_s256"),
    "rev_s256": _paper("reverse", 256.0, "rev_s256"),
}

#: Production kernels, each following its public source (see the notes in each entry).
KERNEL_PRESETS: dict[str, KernelConfig] = {
    # FlashAttention-3 (Hopper): hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp walks n_block from
    # n_block_max - 1 down (reverse); hopper/softmax.h folds S = 2^8 into exp2 (Max_offset = 8 for
    # FP8), so the row sum holds scaled values.
    "fa3": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128, name="fa3"),
    # FlashAttention-4 (Blackwell, CuTe DSL): flash_attn/cute/flash_fwd_sm100.py iterates
    # n_block = n_block_max - 1 - n_tile (reverse); softmax.py uses max_offset = 8 for 8-bit P.
    "fa4": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128, name="fa4"),
    # FlashInfer SM90 FP8 prefill: include/flashinfer/attention/hopper/variants.cuh multiplies P by
    # p_scale = max_E4M3 = 448 after exp; mainloop_mma.cuh walks kv_tile_idx downward (reverse) and
    # the epilogue uses v_scale / p_scale. The paper's Table 2 label "Forward, S=448 — FlashInfer/TRT"
    # implies forward; the source (and the paper's Table 3) say reverse, which we follow.
    "flashinfer_sm90": KernelConfig(
        order="reverse", scale=448.0, scale_mode="multiply", block_kv=128, name="flashinfer_sm90"
    ),
    # TensorRT-LLM XQA (SM90): cpp/kernels/xqa/mha_sm90.cu iterates idxIter = 0 .. nbIters
    # (forward) and scales acc by kE4M3_MAX = 448 after the row sum; output × 1/448.
    "trtllm_xqa": KernelConfig(order="forward", scale=448.0, scale_mode="multiply", block_kv=64, name="trtllm_xqa"),
    # SageAttention2: csrc/qattn/attn_utils.cuh folds S_FP8_OFFSET = 8.807 (2^8.807 ≈ 448) into the
    # exponent; forward order. Its INT8 per-block Q/K quantization is not modelled (P-cast isolated).
    "sageattn2": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=64, name="sageattn2"
    ),
    # SageAttention2++ (pv_accum_dtype="fp32+fp16"): sageattention/core.py keeps P at 448 and cuts
    # the V range to 2.25 (quant_v_scale_max) so the FP16 PV accumulator cannot overflow. The paper's
    # "S = 112" is not in the released code; we follow the code: S = 2^8.807 with an f16 accumulator.
    "sageattn2pp": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=64, accumulator="f16",
        name="sageattn2pp",
    ),
    # Tencent hpc-ops prefill FP8, before the paper: src/attention/prefill/kernels.cuh walks
    # itile_seq_kv forward with no P scale (S = 1); gSum from unscaled P.
    "hpc_ops_prior": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=64, name="hpc_ops_prior"),
    # Tencent hpc-ops prefill FP8, updated: kFp8PrefillPScale = 256.0f multiplies P after exp;
    # epilogue × vscale / 256; forward order.
    "hpc_ops": KernelConfig(order="forward", scale=256.0, scale_mode="multiply", block_kv=64, name="hpc_ops"),
    # The paper's future work (§7.4): per-block power-of-two scale chosen from the block's max P.
    "dynamic_pow2": KernelConfig(order="forward", scale_mode="dynamic", block_kv=64, name="dynamic_pow2"),
}

PRESETS: dict[str, KernelConfig] = {**PAPER_CONFIGS, **KERNEL_PRESETS}


def get_preset(name: str) -> KernelConfig:
    """Look up a preset by name (see :data:`PRESETS`)."""
    check_choice("preset", name, tuple(PRESETS))
    return PRESETS[name]


def resolve(config: str | KernelConfig) -> KernelConfig:
    """A preset name or a :class:`KernelConfig` → :class:`KernelConfig`."""
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return get_preset(config)
    raise PcastError(f"config={config!r} must be a preset name or a KernelConfig")
