"""The kernels lowered for CUDA on an abstract Hopper device: no GPU, no CUDA install.

:func:`lower_for_hopper` gives the ``jax.stages.Lowered`` every builder starts from;
:func:`walk` and :func:`custom_call` find the kernel's custom call in it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import resolve

__all__ = ["HOPPER_DEVICE_KIND", "PRODUCTS", "KernelShape", "custom_call", "lower_for_hopper", "walk"]

#: The two matrix products of the kernel, in program order.
PRODUCTS = ("Q·Kᵀ", "P8·V")
#: Device kind of the abstract device the kernels are lowered for (sm_90a).
HOPPER_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
_F8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """Problem size the kernel is lowered for (the grid does not change the machine code)."""

    batch: int = 1
    heads: int = 2
    kv_heads: int = 1
    q_len: int = 128
    n: int = 512
    head_dim: int = 128

    def __post_init__(self):
        for name in ("batch", "heads", "kv_heads", "q_len", "n", "head_dim"):
            check_int(name, getattr(self, name), min_value=1)

    def label(self) -> str:
        return f"q{self.q_len} N{self.n} d{self.head_dim} h{self.heads}:{self.kv_heads}"


def lower_for_hopper(backend: str, config: str | KernelConfig, shape: KernelShape = KernelShape(), *,
                     sharding: jax.sharding.Sharding | None = None):
    """``fp8_attention(..., implementation=backend)`` lowered for CUDA on an abstract Hopper device.

    Returns the ``jax.stages.Lowered``; no GPU and no CUDA installation are needed. With a
    ``sharding`` (a mesh of an ahead-of-time CUDA topology) the inputs carry it and the platform
    comes from it, so the result compiles for that topology.
    """
    check_choice("backend", backend, pk.BACKENDS)
    cfg = resolve(config)
    q = jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.q_len, shape.head_dim), _F8, sharding=sharding)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.kv_heads, shape.n, shape.head_dim), _F8, sharding=sharding)
    fn = functools.partial(pk.fp8_attention, config=cfg, implementation=backend, return_stats=True)
    device = jax.sharding.AbstractDevice(device_kind=HOPPER_DEVICE_KIND, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        traced = jax.jit(fn).trace(q, kv, kv)
        return traced.lower() if sharding is not None else traced.lower(lowering_platforms=("cuda",))


def walk(op) -> Iterable:
    """Every operation nested in ``op``, in program order."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from walk(child.operation)


def custom_call(lowered, target: str):
    """The one ``stablehlo.custom_call`` of ``lowered`` whose target is ``target``."""
    from jax._src.lib.mlir import ir

    calls = []
    for op in walk(lowered.compiler_ir("stablehlo").operation):
        if op.operation.name == "stablehlo.custom_call":
            name = ir.StringAttr(op.attributes["call_target_name"]).value
            if name == target:
                calls.append(op)
    if len(calls) != 1:
        raise PcastError(f"expected one {target} custom call in the lowered module, found {len(calls)}")
    return calls[0]
