"""LiteRT's quantized softmax as google/qwix's ODML provider models it (uint8-like P, fixed scale).

Read in google/qwix at commit aa623ac, ``qwix/_src/providers/odml_ops.py`` L712-719: the ``Softmax`` op's
output has the fixed range (0, 255/256) because "the converter requires (scale, zero_point) = (1.0 /
256.0, −128)": int8 codes q with P = (q + 128)/256, i.e. round(P · 256) in 0 … 255 — ``p_format="uint8"``,
S = 256, on the **normalised** softmax output (an unfused softmax op whose output feeds the P·V matmul):
``p_offset="row_lse"``, output Σ P8·V / S.

Assumptions: rounding to nearest even (qwix's fake quantization rounds with ``jnp.round``; LiteRT's own
integer softmax kernels compute in fixed point and may round ties otherwise); order and block do not act on
a normalised P (forward, 64). Every P below 1/512 is zeroed: a diffuse row of N ≥ 512 equal logits outputs 0
(:func:`pcast_jax.theory.diffuse_row_gain`).
"""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    "litert_uint8": KernelConfig(order="forward", scale=256.0, scale_mode="multiply", block_kv=64, p_format="uint8",
                                 p_offset="row_lse"),
}
