"""Pallas GPU FP8 attention kernels whose P-cast follows a :class:`pcast_jax.config.KernelConfig`.

Two backends compute the same thing as the scan implementation of :mod:`pcast_jax.engine`:

* ``"mosaic"`` — Pallas Mosaic GPU for Hopper: TMA ring of K/Vᵀ slots, warp-specialized,
  FP8 ``wgmma`` for Q·Kᵀ and P8·V (:mod:`pallas_kernels.mosaic_gpu`);
* ``"triton"`` — Pallas Triton, FP8 ``dot`` (:mod:`pallas_kernels.triton_gpu`).

Use :func:`fp8_attention`; :func:`quantize_qkv` makes its FP8 inputs and descales and
:func:`simulate_fp8_attention` runs the simulator on the very same values.
"""

from pallas_kernels.api import (
    BACKENDS,
    KernelStats,
    fp8_attention,
    kv_tile,
    quantize_fp8,
    quantize_qkv,
    simulate_fp8_attention,
)

__all__ = [
    "BACKENDS",
    "KernelStats",
    "fp8_attention",
    "kv_tile",
    "quantize_fp8",
    "quantize_qkv",
    "simulate_fp8_attention",
]
