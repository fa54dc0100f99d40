"""Designs no released kernel runs: the paper's future work and the OCP rule applied to P."""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    # The paper's future work (§7.4): per-block power-of-two scale chosen from the block's max P.
    "dynamic_pow2": KernelConfig(order="forward", scale_mode="dynamic", block_kv=64),
    # MXFP8 P (OCP Microscaling Formats v1.0, §5–6: 32 E4M3 elements per E8M0 scale
    # 2^(⌊log2 amax⌋ − 8)). No released attention kernel with an MXFP8 P was found: this is the OCP
    # rule applied to P with S = 1, forward order, B = 64 (the MX scale makes S nearly irrelevant).
    "mxfp8_p": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=64, p_format="mxfp8"),
}
