"""The paper's five configurations (§6.2, Table 2)."""

from __future__ import annotations

from pcast_jax.config import KernelConfig


def _paper(order: str, scale: float) -> KernelConfig:
    return KernelConfig(order=order, scale=scale, scale_mode="multiply", block_kv=64)


#: The paper's five configurations (§6.2, Table 2): Q, K, V in FP32, ℓ from pre-cast P, B = 64.
PRESETS: dict[str, KernelConfig] = {
    "fwd_s1": _paper("forward", 1.0),
    "rev_s1": _paper("reverse", 1.0),
    "fwd_s448": _paper("forward", 448.0),
    "fwd_s256": _paper("forward", 256.0),
    "rev_s256": _paper("reverse", 256.0),
}
