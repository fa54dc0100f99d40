"""TensorRT's attention layer (``IAttention``, TensorRT 10.15) with an INT8-quantized softmax.

From the TensorRT 10.15 operator documentation (``docs/_static/operators/Attention.html``; C++
``nvinfer1::IAttention``): the layer is BMM1 → normalization (softmax by default) → BMM2; the optional
``normalizationQuantizeToType`` is ``kFP8`` or ``kINT8`` and ``normalizationQuantizeScale`` (a graph
input) is "the quantization scale for the attention normalization output". TensorRT's quantize is
roundWithTiesToEven(clip(x / scale, −128, 127)) (developer guide, "Working with INT8"), so P8 = that of
P · S with S = 1 / ``normalizationQuantizeScale``: ``p_format="int8"``.

Assumptions, since the fused kernel is closed:

* the quantized value is the **normalised** softmax (the "normalization output" of the graph this layer
  stands for): ``p_offset="row_lse"``, output Σ P8·V / S. A fused kernel that quantizes the unnormalised
  online P instead would be ``p_offset="running_max"`` with the same format;
* S = 127: a scale calibrated on a softmax's amax 1 (symmetric INT8, amax / 127). Every normalised P
  below 0.5/127 ≈ 0.0039 is zeroed, so a diffuse row of N ≥ 254 equal logits outputs 0
  (:func:`pcast_jax.theory.diffuse_row_gain`);
* order and block do not act on a normalised P (forward, 64).
"""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    "tensorrt_int8": KernelConfig(order="forward", scale=127.0, scale_mode="multiply", block_kv=64, p_format="int8",
                                  p_offset="row_lse"),
}
