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
import typing

import numpy as np

from pcast_jax import numberline
from pcast_jax.errors import F32_MAX, PcastError, check_choice, check_int, check_positive

__all__ = ["KernelConfig", "MMA_K", "MMA_PROMOTION", "MMA_ACC_BITS_HOPPER", "mma_model", "QKV_GRANULARITIES",
           "PRESETS", "TILES_BY_HEAD_DIM", "preset_for", "PAPER_CONFIGS", "KERNEL_PRESETS", "BLOCK_SCALED_PRESETS",
           "get_preset", "resolve"]

ORDERS = ("forward", "reverse")
SCALE_MODES = ("multiply", "exponent", "dynamic")
ACCUMULATORS = ("f32", "f16")
SCALE_MIN, SCALE_MAX = numberline.SCALE_MIN, numberline.SCALE_MAX  # S, 1/S and S·ℓ stay in float32
QKV_PRECISIONS = ("f32", "e4m3")
QKV_GRANULARITIES = ("tensor", "head")
SPLIT_LAYOUTS = ("contiguous", "strided")
#: Keys one FP8 tensor-core MMA instruction covers (its K): Hopper ``wgmma`` with 8-bit operands
#: has K × sizeof(e4m3) = 32 bytes (PTX ISA, wgmma shapes m64nNk32 for .e4m3/.e5m2); the
#: ``mma.sync`` FP8 shape is m16n8k32. The MMA accumulator model rounds after every MMA_K keys.
MMA_K = 32
#: Largest mantissa width of the MMA accumulator model (23 = FP32's, truncated instead of rounded).
MMA_ACC_BITS_MAX = 23


_DEFAULT_BLOCK_KV = 64


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelConfig:
    """P-cast semantics of one FP8 attention kernel; validated on construction.

    Attributes:
      order: KV block order, ``"forward"`` (0 → N) or ``"reverse"`` (N → 0).
      scale: the static P scale S, in [2^-100, 2^100]. ``"dynamic"`` mode ignores it.
      scale_mode: ``"multiply"``, ``"exponent"`` or ``"dynamic"`` (module docstring).
      block_kv: KV block size B. N that is not a multiple is padded with masked keys.
      p_format: format of the P-cast: an element format (``"e4m3"``, ``"e5m2"``, ``"e2m1"``) with the
        one scale S, or a block-scaled format (``"mxfp8"``, ``"mxfp4"``: 32 keys per E8M0 scale;
        ``"nvfp4"``: 16 keys per UE4M3 scale) applied to P·S along the key axis, each block's scale
        multiplied back after its P·V product. Block-scaled formats need blocks that tile
        ``block_kv``, the multiply or exponent scale mode and the FP32 accumulator.
      overflow: ``"satfinite"`` (Hopper cvt.rn.satfinite; what kernels do) or ``"nan"``.
      accumulator: ``"f32"``, or ``"f16"``: each block's P8·V product is rounded to float16 before
        it is added to the FP32 output (SageAttention2++'s ``fp32+fp16`` PV accumulation).
      qkv: ``"f32"`` keeps Q, K, V exact (isolates the P-cast, as the paper does); ``"e4m3"``
        quantizes Q, K and V to E4M3 (scale = amax/max_E4M3) as production kernels do.
      qkv_granularity: where the E4M3 Q/K/V scales live when ``qkv == "e4m3"``: ``"tensor"``
        (one scale per tensor) or ``"head"`` (one per attention head). Ignored for FP32 Q/K/V.
      causal: bottom-right aligned causal mask (query i of q_len sits at position N − q_len + i).
      kv_splits: split-KV (flash-decoding / multi-block) parallelism: the KV blocks are dealt over
        this many independent Algorithm-1 runs (1 = one run per row, as in the paper), merged at the
        end by the FP32 log-sum-exp merge (:func:`pcast_jax.block.merge_splits`).
      split_layout: ``"contiguous"`` (split s gets a contiguous range of ⌈n_blocks/kv_splits⌉ blocks,
        FlashAttention-3 ``num_splits``, FlashInfer split-KV) or ``"strided"`` (block b goes to split
        b mod kv_splits, TensorRT-LLM XQA multi-block mode). Each split visits its blocks in ``order``.
      f16_round_keys: with the f16 accumulator, how many keys one f16 MMA covers: P8·V is rounded to
        float16 after every ``f16_round_keys`` keys (the f16 partial sums chained inside the block)
        and the block's f16 result is added to the FP32 output. 0 = once per block.
      v_channel_max: with the f16 accumulator, V is scaled per channel (over the KV length) so that
        max|V| = this value before the f16 accumulation, and the scale is multiplied back after it
        (SageAttention2++ ``quant_v_scale_max``). 0 = V as it is.
      mma_acc_bits: a *model* (not yet measured on a GPU) of the FP8 tensor core's "FP32" P·V
        accumulator: 0 = exact FP32 (the paper's simulator). b in 1..23: the MMA's running P·V
        partial sum keeps b explicit mantissa bits, truncated toward zero after every MMA K-step of
        :data:`MMA_K` = 32 keys (assumption from the DeepSeek-V3 technical report §3.3.2: Hopper's
        FP8 GEMM accumulation "retains around 14 bits"; SageAttention's ``sageattention/core.py``
        calls it "FP32 (actually FP22)", i.e. 13 bits). Needs the FP32 accumulator, an element P
        format and a ``block_kv`` that is a multiple of 32.
      mma_promote_keys: with ``mma_acc_bits``, after how many keys the kernel promotes the MMA's
        partial sum into exact FP32 registers (a fresh MMA accumulator then starts at 0). 0 = never:
        O itself lives in the MMA accumulator across all KV blocks, α·O rescaled in place and every
        block's products added by the MMA (FlashAttention-3, TensorRT-LLM XQA, hpc-ops before its
        double-O accumulator). k > 0: a multiple of 32 that divides ``block_kv``; ``block_kv`` = one
        fresh accumulator per KV tile added to FP32 O (hpc-ops now, SageAttention2 on SM90 with
        ``pv_accum_dtype="fp32+fp32"``, this package's
        Pallas kernels); smaller k as DeepGEMM promotes every 128 keys. The 0 (never) form cannot
        take the dynamic scale mode (its 2^-k multiplies a block's product outside the MMA).
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
    kv_splits: int = 1
    split_layout: str = "contiguous"
    f16_round_keys: int = 0
    v_channel_max: float = 0.0
    mma_acc_bits: int = 0
    mma_promote_keys: int = 0
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        check_choice("order", self.order, ORDERS)
        scale = check_positive("scale", self.scale)
        if not SCALE_MIN <= scale <= SCALE_MAX:
            raise PcastError(f"scale={self.scale!r} must lie in [2^-100, 2^100] "
                             "(S, 1/S and S·ℓ must stay finite, nonzero float32 numbers)")
        object.__setattr__(self, "scale", scale)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        object.__setattr__(self, "block_kv", check_int("block_kv", self.block_kv, min_value=1, max_value=1 << 16))
        check_choice("p_format", self.p_format.lower() if isinstance(self.p_format, str) else self.p_format,
                     numberline.P_FORMATS)
        check_choice("overflow", self.overflow, numberline.OVERFLOW_MODES)
        check_choice("accumulator", self.accumulator, ACCUMULATORS)
        check_choice("qkv", self.qkv, QKV_PRECISIONS)
        check_choice("qkv_granularity", self.qkv_granularity, QKV_GRANULARITIES)
        if self.scale_mode == "dynamic":
            object.__setattr__(self, "scale", 1.0)
        if self.qkv == "f32":
            object.__setattr__(self, "qkv_granularity", "tensor")
        if not isinstance(self.causal, bool):
            raise PcastError(f"causal={self.causal!r} must be True or False")
        object.__setattr__(self, "kv_splits", check_int("kv_splits", self.kv_splits, min_value=1, max_value=1 << 16))
        check_choice("split_layout", self.split_layout, SPLIT_LAYOUTS)
        if self.kv_splits == 1:
            object.__setattr__(self, "split_layout", "contiguous")
        object.__setattr__(self, "f16_round_keys", check_int("f16_round_keys", self.f16_round_keys, min_value=0,
                                                             max_value=1 << 16))
        if self.f16_round_keys and self.block_kv % self.f16_round_keys:
            raise PcastError(f"f16_round_keys={self.f16_round_keys} must divide block_kv={self.block_kv}")
        if isinstance(self.v_channel_max, (bool, np.bool_)) or not isinstance(self.v_channel_max,
                                                                               (int, float, np.integer, np.floating)):
            raise PcastError(f"v_channel_max={self.v_channel_max!r} must be a number >= 0")
        v_max = float(self.v_channel_max)
        if not (math.isfinite(v_max) and 0.0 <= v_max <= F32_MAX):
            raise PcastError(f"v_channel_max={self.v_channel_max!r} must be a number >= 0, finite in float32")
        object.__setattr__(self, "v_channel_max", v_max)
        if self.accumulator == "f32" or self.f16_round_keys == self.block_kv:
            object.__setattr__(self, "f16_round_keys", 0)
        if self.accumulator == "f32":
            object.__setattr__(self, "v_channel_max", 0.0)
        self._check_mma()
        bf = self.block_format
        if bf is not None:
            if self.block_kv % bf.block:
                raise PcastError(f"p_format={self.p_format!r} scales blocks of {bf.block} keys, which must tile "
                                 f"block_kv={self.block_kv}")
            if self.scale_mode == "dynamic":
                raise PcastError(f"p_format={self.p_format!r} carries its own block scales: scale_mode='dynamic' "
                                 "is not supported with it")
            if self.accumulator != "f32":
                raise PcastError(f"p_format={self.p_format!r} needs accumulator='f32' (the block scale is "
                                 "multiplied back into the FP32 accumulator)")
        if not isinstance(self.name, str):
            raise PcastError(f"name={self.name!r} must be a string")
        if len(self.name) > 200 or not self.name.isprintable():  # it labels one-line errors and table cells
            raise PcastError(f"name={self.name[:40]!r} must be one printable line of at most 200 characters")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    def _check_mma(self) -> None:
        """Validates and normalises ``mma_acc_bits`` / ``mma_promote_keys`` (PcastError naming them)."""
        bits = check_int("mma_acc_bits", self.mma_acc_bits, min_value=0, max_value=MMA_ACC_BITS_MAX)
        object.__setattr__(self, "mma_acc_bits", bits)
        keys = check_int("mma_promote_keys", self.mma_promote_keys, min_value=0, max_value=1 << 16)
        if not bits:  # exact FP32: where the MMA would promote does not act
            object.__setattr__(self, "mma_promote_keys", 0)
            return
        if self.accumulator != "f32":
            raise PcastError(f"mma_acc_bits={bits} needs accumulator='f32' (the f16 accumulator is its own "
                             "model: f16_round_keys)")
        if self.block_format is not None:
            raise PcastError(f"mma_acc_bits={bits} is not modelled with the block-scaled p_format="
                             f"{self.p_format!r}: use an element format")
        if self.block_kv % MMA_K:
            raise PcastError(f"block_kv={self.block_kv} must be a multiple of the MMA K = {MMA_K} keys with "
                             f"mma_acc_bits={bits}")
        if keys and (keys % MMA_K or self.block_kv % keys):
            raise PcastError(f"mma_promote_keys={keys} must be a multiple of {MMA_K} that divides "
                             f"block_kv={self.block_kv} (or 0: never promoted)")
        if not keys and self.scale_mode == "dynamic":
            raise PcastError("scale_mode='dynamic' needs mma_promote_keys > 0 with mma_acc_bits: its per-block "
                             "2^-k multiplies the block's product outside the MMA accumulator")
        object.__setattr__(self, "mma_promote_keys", keys)

    def default_name(self) -> str:
        """``fwd_s1``-style label naming every field that differs from its default.

        Order and scale always appear; then ``_exp`` (exponent mode), ``_b128`` (block_kv),
        ``_e5m2`` (P format), ``_nan`` (overflow), ``_f16acc`` (with ``_r32`` for f16_round_keys and
        ``_v2.25`` for v_channel_max), ``_qkv8`` / ``_qkv8h`` (E4M3 Q/K/V per tensor / per head),
        ``_causal``, ``_split8`` / ``_split8s`` (kv_splits, contiguous / strided) and ``_acc14`` (the
        MMA accumulator model, never promoted) / ``_acc14p128`` (promoted every 128 keys). Two configs
        with different semantics never share a default name.
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
        if self.f16_round_keys:
            parts.append(f"r{self.f16_round_keys}")
        if self.v_channel_max:
            parts.append("v" + repr(self.v_channel_max).removesuffix(".0"))
        if self.qkv == "e4m3":
            parts.append("qkv8h" if self.qkv_granularity == "head" else "qkv8")
        if self.causal:
            parts.append("causal")
        if self.kv_splits > 1:
            parts.append(f"split{self.kv_splits}" + ("s" if self.split_layout == "strided" else ""))
        if self.mma_acc_bits:
            parts.append(f"acc{self.mma_acc_bits}" + (f"p{self.mma_promote_keys}" if self.mma_promote_keys else ""))
        return "_".join(parts)

    def to_dict(self) -> dict:
        """Every field as a plain value; :meth:`from_dict` reads it back.

        ``qkv_granularity`` is written only where it acts (E4M3 Q/K/V), so sweeps recorded before
        the field existed keep their fingerprints. Likewise ``kv_splits``, ``split_layout``,
        ``f16_round_keys``, ``v_channel_max``, ``mma_acc_bits`` and ``mma_promote_keys`` are written only
        when they differ from their defaults.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.qkv == "f32":
            del d["qkv_granularity"]
        for key in ("kv_splits", "split_layout", "f16_round_keys", "v_channel_max", "mma_acc_bits",
                    "mma_promote_keys"):
            if d[key] == _DEFAULTS[key]:
                del d[key]
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

    @classmethod
    def from_string(cls, text: str) -> "KernelConfig":
        """A config from ``"key=value,key=value"`` (``"name=mine,order=reverse,scale=64,accumulator=f16"``).

        Every field is a key; each value is read as its field's type (``scale=2^8.807`` and
        ``scale=2**-3`` are accepted for numbers, ``true``/``false``/``yes``/``no``/``1``/``0`` for flags,
        and a flag alone, ``causal``, means true). Fields not given keep their defaults. Unknown keys,
        values that do not parse or validate, and keys given twice raise :class:`PcastError` naming the key.
        """
        if not isinstance(text, str):
            raise PcastError(f"a kernel config string must be a str, got {text!r}")
        hints = _field_types(cls)
        values: dict = {}
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise PcastError(f"kernel config {text!r} must be key=value items separated by commas, "
                             f"keys among {', '.join(hints)}")
        for item in items:
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if key not in hints:
                raise PcastError(f"unknown KernelConfig field {key!r} in {text!r}; fields are {', '.join(hints)}")
            if key in values:
                raise PcastError(f"KernelConfig field {key!r} is given twice in {text!r}")
            if not sep:
                if hints[key] is not bool:
                    raise PcastError(f"KernelConfig field {key!r} needs a value ({key}=...) in {text!r}")
                raw = "true"
            values[key] = _parse_field(key, raw, hints[key])
        try:
            return cls(**values)
        except PcastError as exc:
            raise PcastError(f"kernel config {text!r}: {exc}") from None

    def to_string(self) -> str:
        """``"name=...,key=value,..."`` naming every field that differs from its default; :meth:`from_string`
        reads it back to an equal config with the same name."""
        parts = [f"name={self.name}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value == f.default:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, float):
                text = repr(value).removesuffix(".0")
            else:
                text = str(value)
            parts.append(f"{f.name}={text}")
        return ",".join(parts)

    @property
    def fmt(self) -> numberline.FP8Format:
        """The element format of the P-cast (E2M1/E4M3 for the block-scaled formats)."""
        bf = self.block_format
        return bf.element if bf is not None else numberline.get_format(self.p_format)

    @property
    def block_format(self) -> numberline.BlockFormat | None:
        """The block-scaled P format, or None for a plain element format with the one scale S."""
        return numberline.BLOCK_FORMATS.get(self.p_format.lower())

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
        if self.p_format != "e4m3":
            extra.append(f"P in {self.p_format}")
        if self.accumulator != "f32":
            extra.append(f"{self.accumulator} PV accumulator")
        if self.qkv != "f32":
            extra.append(f"{self.qkv} QKV per {self.qkv_granularity}")
        if self.causal:
            extra.append("causal")
        if self.kv_splits > 1:
            extra.append(f"{self.kv_splits} {self.split_layout} KV splits")
        if self.mma_acc_bits:
            where = (f"promoted to FP32 every {self.mma_promote_keys} keys" if self.mma_promote_keys
                     else "never promoted")
            extra.append(f"{self.mma_acc_bits}-bit MMA accumulator model, {where}")
        tail = (", " + ", ".join(extra)) if extra else ""
        return f"{self.order}, {s}, B={self.block_kv}{tail}"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelConfig)}


def _field_types(cls) -> dict[str, type]:
    """Field name → the type its string form is parsed to (the annotation, else the default's type)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: use the defaults
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        if not isinstance(t, type):
            t = type(f.default) if f.default is not dataclasses.MISSING else str
        out[f.name] = t
    return out


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _power(base: float, exp: float, sign: float) -> float:
    """``sign · base^exp`` for a finite base > 0 and a finite exponent; ValueError otherwise."""
    if not (0 < base < math.inf and math.isfinite(exp)):
        raise ValueError("not a power")
    return sign * base**exp


def _parse_field(key: str, raw: str, kind: type):
    """One value of :meth:`KernelConfig.from_string`, as ``kind``; PcastError naming ``key``."""
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise PcastError(f"{key}={raw!r} must be true or false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise PcastError(f"{key}={raw!r} must be an integer") from None
    if kind is float:
        text = raw.replace("**", "^").strip()
        sign = -1.0 if text.startswith("-") else 1.0  # -2^2 is -(2^2), as written in mathematics
        base, op, exp = text.lstrip("+-").partition("^")
        try:
            value = float(text) if not op else _power(float(base), float(exp), sign)
        except (ValueError, OverflowError):
            raise PcastError(f"{key}={raw!r} must be a number (e.g. 256, 0.5, 2^8.807; a power's base "
                             "> 0, both finite)") from None
        if not math.isfinite(value):
            raise PcastError(f"{key}={raw!r} must be finite")
        return value
    if kind is str:
        if not raw:
            raise PcastError(f"{key}= needs a value")
        return raw
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise PcastError(f"{key}={raw!r}: {exc}") from None


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

#: KV tile B by head dim, read from each kernel's source (the FP8 forward path at that head dim).
#: FlashAttention-3 (Dao-AILab/flash-attention, commit 0251105a): hopper/tile_size.h, tile_size_fwd_sm90(),
#: the element_size == 1 branch, lines 42-52: d ≤ 64 → 160 (line 43), d ≤ 96 → 128 (45), d ≤ 128 → 224
#: (47; 160 with paged non-TMA KV, 192 with V col-major or softcap with a local window), d ≤ 192 → 160
#: (49), d = 256 → 128 (51; 64 with a local window); causal does not change the FP8 tile. (vLLM's fork,
#: vllm-project/flash-attention commit 07602ad, which this table cited before, gives the same values
#: at lines 58-71; its decode path was not read.)
#: FlashInfer SM90 FP8: include/flashinfer/attention/hopper/quantization/prefill_sm90.cuh,
#: SingleFP8PrefillWithKVCacheDispatched (commit 1211b4c): CTA_KV = 128 at d = 64, 192 at d = 128, 128
#: at d = 256 (the paged-KV batch path, BatchFP8PrefillWithPagedKVCacheDispatched, uses 128 everywhere).
TILES_BY_HEAD_DIM: dict[str, dict[int, int]] = {
    "fa3": {64: 160, 96: 128, 128: 224, 192: 160, 256: 128},
    "flashinfer_sm90": {64: 128, 128: 192, 256: 128},
}
#: FlashAttention-3's split-KV path runs the same mainloop per split, and tile_size_fwd_sm90() takes no
#: split argument: the same tiles.
TILES_BY_HEAD_DIM["fa3_splitkv"] = TILES_BY_HEAD_DIM["fa3"]

#: TensorRT-LLM XQA (SM90) keys per CTA tile, ``gemm0CtaTileNbTokens`` in cpp/kernels/xqa/mha_sm90.cu.
XQA_CTA_TILE_TOKENS = 64


def xqa_nb_sub_seq(*, batch: int, nb_k_heads: int, sms: int, max_seq_len: int, env: int | None = None) -> int:
    """Sub-sequences (CTAs per request and KV head) of TensorRT-LLM XQA's SM90 multi-block launch.

    cpp/kernels/xqa/mha_sm90.cu, ``launchHopperF8MHA``, the ``nbSubSeqPerSeq`` lambda (NVIDIA/TensorRT-LLM
    commit 014dadc): ``XQA_NB_SUB_SEQ`` (``env`` here) when set and > 0, else
    ``min(max(1, (uint32_t) round(multiProcessorCount * 3 / (batchSize * nbKHeads) * 0.25f)),
    divUp(maxSeqLen, gemm0CtaTileNbTokens))``. ``multiProcessorCount * 3 / (batchSize * nbKHeads)`` is
    C integer division (all three are integers) before the float factor 0.25, and ``round`` rounds
    halves away from zero. (The older ``mha.cu`` launcher has no 3 × 0.25: SMs / (batch · KV heads).)
    """
    batch = check_int("batch", batch, min_value=1)
    nb_k_heads = check_int("nb_k_heads", nb_k_heads, min_value=1)
    sms = check_int("sms", sms, min_value=1)
    max_seq_len = check_int("max_seq_len", max_seq_len, min_value=1)
    if env is not None and check_int("env", env) > 0:
        return int(env)
    per_cta = (sms * 3) // (batch * nb_k_heads) * 0.25
    return min(max(1, math.floor(per_cta + 0.5)), -(-max_seq_len // XQA_CTA_TILE_TOKENS))


#: The launch the ``trtllm_xqa_multiblock`` preset stands for (an assumption, not a constant of the
#: source): an H100 SXM (132 SMs), batch 2 × 8 KV heads (Llama-3-8B/70B GQA), KV length ≥ 384, no
#: XQA_NB_SUB_SEQ: ``xqa_nb_sub_seq`` gives 6 sub-sequences (batch 1 gives 12, batch 4 gives 3).
XQA_DECODE_LAUNCH = {"batch": 2, "nb_k_heads": 8, "sms": 132, "max_seq_len": 4096}

#: Production kernels, each following its public source (see the notes in each entry). Tiles are
#: those at head dim 128; :func:`preset_for` resolves them for another head dim.
KERNEL_PRESETS: dict[str, KernelConfig] = {
    # FlashAttention-3 (Hopper): hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp walks n_block from
    # n_block_max - 1 down (reverse); hopper/softmax.h folds S = 2^8 into exp2 (Max_offset = 8 for
    # FP8), so the row sum holds scaled values. B = 224 at d = 128 (TILES_BY_HEAD_DIM).
    "fa3": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=224, name="fa3"),
    # FlashAttention-4 (Blackwell, CuTe DSL): flash_attn/cute/flash_fwd_sm100.py iterates
    # n_block = n_block_max - 1 - n_tile (reverse); softmax.py uses max_offset = 8 for 8-bit P.
    # B = 128: flash_attn/cute/interface.py line 318 (commit 0251105a), cfg = FwdConfig(128, 128, ...),
    # the base tile the SM100 path keeps (only SM80 / SM90 / SM120 replace it below that line).
    "fa4": KernelConfig(order="reverse", scale=256.0, scale_mode="exponent", block_kv=128, name="fa4"),
    # FlashInfer SM90 FP8 prefill: include/flashinfer/attention/hopper/variants.cuh multiplies P by
    # p_scale = max_E4M3 = 448 after exp; mainloop_mma.cuh walks kv_tile_idx downward (reverse) and
    # the epilogue uses v_scale / p_scale. The paper's Table 2 label "Forward, S=448 — FlashInfer/TRT"
    # implies forward; the source (and the paper's Table 3) say reverse, which we follow.
    # B = 192 at d = 128 (single-request prefill, TILES_BY_HEAD_DIM).
    "flashinfer_sm90": KernelConfig(
        order="reverse", scale=448.0, scale_mode="multiply", block_kv=192, name="flashinfer_sm90"
    ),
    # TensorRT-LLM XQA (SM90): cpp/kernels/xqa/mha_sm90.cu iterates idxIter = 0 .. nbIters
    # (forward) and scales acc by kE4M3_MAX = 448 after the row sum; output × 1/448. Tile:
    # gemm0CtaTileNbTokens = gemm0WarpGrpTileNbTokens (64) × gemm0NbGmmaGrps (1) = 64 keys.
    # One CTA per (request, KV head): multi-block mode off (see trtllm_xqa_multiblock).
    "trtllm_xqa": KernelConfig(order="forward", scale=448.0, scale_mode="multiply", block_kv=64, name="trtllm_xqa"),
    # TensorRT-LLM XQA in multi-block mode (its decode default, ALLOW_MULTI_BLOCK_MODE): launchHopperF8MHA
    # runs nbSubSeqPerSeq CTAs per (request, KV head) (xqa_nb_sub_seq, above); CTA idxSubSeq takes tiles
    # idxKTile = idxKTileInit + idxIter · nbSubSeq (strided, each CTA forward with its own max), and
    # the last CTA merges the partial results (mha_sm90.cu). nbSubSeq depends on the launch: the
    # preset takes it for XQA_DECODE_LAUNCH (6 sub-sequences), an assumed launch.
    "trtllm_xqa_multiblock": KernelConfig(
        order="forward", scale=448.0, scale_mode="multiply", block_kv=XQA_CTA_TILE_TOKENS,
        kv_splits=xqa_nb_sub_seq(**XQA_DECODE_LAUNCH), split_layout="strided",
        name="trtllm_xqa_multiblock",
    ),
    # FlashAttention-3 split-KV decode (flash_attn_interface num_splits > 1): each split takes a
    # contiguous range of ⌈n_blocks / num_splits⌉ KV blocks (hopper/block.h, n_block_min/max per
    # split), reverse within it, merged by hopper/flash_fwd_combine_kernel.h from per-split LSE.
    # num_splits = 8 is an assumption (the heuristic num_splits_heuristic picks it from the launch).
    "fa3_splitkv": KernelConfig(
        order="reverse", scale=256.0, scale_mode="exponent", block_kv=224, kv_splits=8, name="fa3_splitkv",
    ),
    # SageAttention2 (thu-ml/SageAttention, commit d1a57a5) as sageattention/core.py line 151 runs it on
    # SM90: csrc/qattn/attn_utils.cuh folds S_FP8_OFFSET = 8.807 (2^8.807 ≈ 448) into the exponent;
    # forward order. B = 128: CTA_K = 128 in csrc/qattn/qk_int_sv_f8_cuda_sm90.cu lines 687 and 863 (both
    # SM90 FP8 entry points). Its INT8 per-block Q/K quantization is not modelled (P-cast isolated).
    "sageattn2": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=128, name="sageattn2"
    ),
    # SageAttention2++ (pv_accum_dtype="fp32+fp16", what sageattention/core.py line 149 picks on SM89):
    # core.py keeps P at 448 and cuts the V range to 2.25 (quant_v_scale_max, lines 805-807): V is
    # quantized per channel with scale amax/2.25 and the scale multiplied back after the accumulation,
    # so the FP16 PV accumulator cannot overflow. B = 64: CTA_K = 64 in
    # csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_fuse_v_scale_attn_inst_buf.cu line 125 (the kernel core.py
    # line 819 calls). f16_round_keys = 32: csrc/qattn/attn_utils.cuh lines 908-970 chain one
    # mma_sync_m16n16k32_row_col_f8f8f16 per 32 keys of the block into the f16 accumulator (kInit for the
    # first, kInplaceUpdate after), which is mma.sync m16n8k32 ... .f16.e4m3.e4m3.f16 (csrc/mma.cuh line
    # 577), and add the block's f16 result to the FP32 output (lines 969-971). The paper's "S = 112" is
    # not in the released code; we follow the code.
    "sageattn2pp": KernelConfig(
        order="forward", scale=2.0**8.807, scale_mode="exponent", block_kv=64, accumulator="f16",
        f16_round_keys=32, v_channel_max=2.25, name="sageattn2pp",
    ),
    # Tencent hpc-ops prefill FP8, before the paper (commit e363e86): src/attention/prefill/kernels.cuh
    # walks itile_seq_kv forward with no P scale (S = 1); gSum from unscaled P. B = 128: the kTileN
    # template argument of AttentionKVCachePrefillFp8Config in
    # src/attention/prefill/warp_spec_with_kvcache_fp8_dim128.cu lines 55-56 (head dim 128).
    "hpc_ops_prior": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=128,
                                  name="hpc_ops_prior"),
    # Tencent hpc-ops prefill FP8, updated (commit 6e2eced): kernels.cuh line 1347,
    # tAttr(i) *= kFp8PrefillPScale (256.0f, line 20), after exp; epilogue × vscale / 256; forward order.
    # B = 128: kTileN = 128 in src/attention/prefill/warp_spec_with_kvcache_fp8_dim128.cu line 119.
    "hpc_ops": KernelConfig(order="forward", scale=256.0, scale_mode="multiply", block_kv=128, name="hpc_ops"),
    # The paper's future work (§7.4): per-block power-of-two scale chosen from the block's max P.
    "dynamic_pow2": KernelConfig(order="forward", scale_mode="dynamic", block_kv=64, name="dynamic_pow2"),
}

#: Presets with a block-scaled P (simulator only: the Pallas kernels run E4M3 P alone), each citing
#: the source it follows.
BLOCK_SCALED_PRESETS: dict[str, KernelConfig] = {
    # SageAttention3 (thu-ml/SageAttention, commit d1a57a5, sageattention3_blackwell/sageattn3/blackwell/):
    # softmax_fused.h computes P̃ = exp2(Z·log2e·scale − (m·log2e·scale + log2(1/(448·6)))) (lines 32,
    # 71-75), i.e. the row maximum brought to 448·6 = 2688 in the exponent (fp8_scalexfp4_scale), the
    # row sum accumulating P̃ (exponent mode, epilogue O/ℓ); per 16 keys the scale AbsMaxP =
    # exp2(max_b·log2e·scale − max_scaled + log2(1/6)) (line 79) = block max of P̃ / 6 (≤ 448, UE4M3 in
    # the block-scaled MMA), P̃ divided by it (line 135) and cast to E2M1. Reverse order:
    # mainloop_tma_ws.h starts at n_block = n_block_max - 1 (line 509) and walks down,
    # for (; n_block >= 0; --n_block), in the producer (line 536) and the consumer (lines 670, 817, 865).
    # B = 128: launch.h line 105 instantiates Flash_fwd_kernel_traits<Headdim, 128, 128, ...>, whose third
    # argument is kBlockN (kernel_traits.h lines 71, 80). The kernel divides P̃ by the FP32 scale and
    # multiplies by its E4M3 rounding in the MMA; we divide by the E4M3 value (Model Optimizer's order),
    # a difference below one E2M1 step. Q/K/V stay FP32 (P-cast isolated).
    "sageattn3": KernelConfig(order="reverse", scale=448.0 * 6.0, scale_mode="exponent", block_kv=128,
                              p_format="nvfp4", name="sageattn3"),
    # NVFP4 fake-quant of P inside NVIDIA Model Optimizer's Triton flash attention (NVIDIA/Model-Optimizer,
    # commit a2fbac7b): modelopt/torch/kernels/common/attention/triton_fa.py walks kv_start = 0, BLOCK_N,
    # ... (forward, line 359), takes P = exp2(S − m_new) with the running max (line 433, unnormalized),
    # sums the row from the unquantized P (lines 434-436: ℓ unscaled, multiply mode) and, with
    # p_qdq="nvfp4", fake-quantizes P before P·V (lines 440-451) through _p_qdq_nvfp4
    # (modelopt/torch/kernels/quantization/attention/bmm2_qdq.py lines 38-61: 16 keys per block along the
    # key axis) → nvfp4_scalar_qdq (kernels/quantization/common/nvfp4_quant.py): block scale
    # E4M3(min(amax_b / (6 g), 448)) · g (lines 122-125, saturating at 448), elements rounded to E2M1 at
    # x / scale, a zero scale zeroing the block (line 101). g = p_qdq_amax / (6·448) with p_qdq_amax = 1
    # by default (triton_fa.py lines 1241, 1345), so E4M3(amax_b / (6 g)) = E4M3(amax_b · 448): exactly
    # the block scale of P·S with S = 6·448 and second level 1 here. B = 32: every autotuned forward
    # config has BLOCK_N = 32 (triton_fa.py lines 84-87). Not modelled: the kernel first rounds P to V's
    # dtype (bf16/fp16, lines 447-450) before the fake-quant; P here stays FP32 up to the NVFP4 cast.
    # (The offline quantizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py clamps block scales to
    # [2^-9, 448] and so never zeroes a block; it is not what runs on P.)
    "nvfp4_fakequant": KernelConfig(order="forward", scale=448.0 * 6.0, scale_mode="multiply", block_kv=32,
                                    p_format="nvfp4", name="nvfp4_fakequant"),
    # MXFP8 P (OCP Microscaling Formats v1.0, §5–6: 32 E4M3 elements per E8M0 scale
    # 2^(⌊log2 amax⌋ − 8)). No released attention kernel with an MXFP8 P was found: this is the OCP
    # rule applied to P with S = 1, forward order, B = 64 (the MX scale makes S nearly irrelevant).
    "mxfp8_p": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=64, p_format="mxfp8",
                            name="mxfp8_p"),
}

PRESETS: dict[str, KernelConfig] = {**PAPER_CONFIGS, **KERNEL_PRESETS, **BLOCK_SCALED_PRESETS}

#: Where each kernel adds its FP8 P·V MMA results into exact FP32 registers, i.e. the
#: ``mma_promote_keys`` its accumulator model takes: ``"never"`` (0: O lives in the wgmma accumulator
#: across KV blocks) or ``"tile"`` (``block_kv``: a fresh accumulator per KV tile, added to FP32 O).
#: Read from source; kernels missing here were not read (FlashInfer SM90: its mainloop's PV
#: accumulation not re-read; FlashAttention-4: Blackwell tcgen05, outside the Hopper model;
#: SageAttention2++: its f16 accumulator is its own model).
MMA_PROMOTION: dict[str, str] = {
    # FlashAttention-3, hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp (commit 0251105a): clear(tOrO) once
    # (line 1166), then every n_block's P·V is flash::gemm</*zero_init=*/false>(tiled_mma_pv, ..., tOrO)
    # into the same accumulator (line 1182), rescaled in place by softmax.rescale_o (1178 / 1205).
    "fa3": "never",
    "fa3_splitkv": "never",  # the same mainloop per split
    # TensorRT-LLM XQA, cpp/kernels/xqa/mha_sm90.cu: rescaleGemm1AccForNewRowMax_sync(..., acc, ...)
    # rescales the gemm1 accumulator `acc` before each tile's X·V wgmma accumulates into it (its own
    # comment: "if first tile, no need to rescale acc"); line numbers not read.
    "trtllm_xqa": "never",
    "trtllm_xqa_multiblock": "never",  # per CTA
    # SageAttention2 on SM90: sageattention/core.py line 151 picks pv_accum_dtype="fp32+fp32" ("PV
    # accumulation is done in FP32 (actually FP22), but added to a FP32 buffer", line 688);
    # csrc/qattn/qk_int_sv_f8_cuda_sm90.cu (commit d1a57a5): a fresh RO_temp per KV tile (line 328,
    # first wgmma with scale-d 0 at 333, one wgmma per 32 keys at 337), RO += RO_temp in FP32 at 353.
    "sageattn2": "tile",
    # hpc-ops prefill FP8 (commit 6e2eced, since 82d80e8 "SM90 fp8 double-O accumulator"):
    # src/attention/prefill/kernels.cuh lines 1376-1403: each KV tile's P·V wgmma starts a fresh tOr
    # (ScaleOut::Zero, line 1378) and tYr(i) += tOr(i) adds it to the FP32 output (line 1403).
    "hpc_ops": "tile",
    # Before that commit (e363e86, the S = 1 kernel): kernels.cuh clear(tYr) once (line 1297), then every
    # tile's wgmma accumulates into tYr itself with ScaleOut::One (lines 1266, 1400-1401).
    "hpc_ops_prior": "never",
}
#: Other promotion intervals in the wild: DeepGEMM's SM90 FP8 GEMM promotes the wgmma accumulator into
#: FP32 registers every BLOCK_K = 128 (deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh lines
#: 249 and 303, "Promote with scales", commit 54e2261); this package's Pallas Mosaic kernel uses a fresh
#: accumulator per KV block (pallas_kernels/mosaic_gpu.py, ``plgpu.ACC`` per block, then
#: ``block.accumulate``): ``"tile"``.
#: Mantissa bits of the default accumulator model: "around 14 bits" (DeepSeek-V3 technical report
#: §3.3.2, measured on H800; an assumption until ``benchmarks/gpu_check.sh`` fits it on Hopper).
MMA_ACC_BITS_HOPPER = 14


def mma_model(name: str, bits: int = MMA_ACC_BITS_HOPPER) -> KernelConfig:
    """A MODEL variant of preset ``name`` with the FP8 MMA accumulator of ``bits`` mantissa bits.

    The promotion interval follows :data:`MMA_PROMOTION` (``"never"`` → 0, ``"tile"`` → the preset's
    ``block_kv``); the name gains ``_mma{bits}``. Not part of :data:`PRESETS`: the bit count is an
    assumption until a GPU measures it. Presets whose path was not read raise :class:`PcastError`.
    """
    cfg = get_preset(name)
    if name not in MMA_PROMOTION:
        raise PcastError(f"preset={name!r}: its MMA accumulation path was not read from source; presets with "
                         f"one: {', '.join(MMA_PROMOTION)}")
    promote = 0 if MMA_PROMOTION[name] == "never" else cfg.block_kv
    return dataclasses.replace(cfg, mma_acc_bits=bits, mma_promote_keys=promote, name=f"{name}_mma{bits}")


def get_preset(name: str) -> KernelConfig:
    """Look up a preset by name (see :data:`PRESETS`)."""
    check_choice("preset", name, tuple(PRESETS))
    return PRESETS[name]


def preset_for(name: str, head_dim: int) -> KernelConfig:
    """A preset with its KV tile resolved for ``head_dim`` (:data:`TILES_BY_HEAD_DIM`).

    Presets without a head-dim table, or head dims the table lacks, keep their tile; the name
    gains ``_d{head_dim}`` when the tile changes.
    """
    cfg = get_preset(name)
    check_int("head_dim", head_dim, min_value=1)
    tiles = TILES_BY_HEAD_DIM.get(name, {})
    dims = sorted(d for d in tiles if d >= head_dim)
    if not dims or tiles[dims[0]] == cfg.block_kv:
        return cfg
    return dataclasses.replace(cfg, block_kv=tiles[dims[0]], name=f"{name}_d{head_dim}")


def resolve(config: str | KernelConfig) -> KernelConfig:
    """A preset name or a :class:`KernelConfig` → :class:`KernelConfig`."""
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return get_preset(config)
    raise PcastError(f"config={config!r} must be a preset name or a KernelConfig")
