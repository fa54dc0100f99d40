"""The Mosaic GPU kernel: its FP8 wgmma from the lowered module, and what keeps it from a cubin here.

The CPU jaxlib registers the Mosaic GPU dialect and its serialization pass, so the kernel lowers
and its inline PTX can be read, but not the pipeline that takes it to PTX and a cubin: that is
built into the ``mosaic_gpu_v2`` custom call of the CUDA PJRT plugin
(:mod:`pallas_kernels.machine_code.xla_build` drives it without a GPU).
"""

from __future__ import annotations

import re
from collections import Counter

import jax

from pallas_kernels.machine_code.lowering import PRODUCTS, KernelShape, custom_call, lower_for_hopper, walk
from pallas_kernels.machine_code.parse import ProductMMA, product_mma
from pallas_kernels.machine_code.report import KernelReport
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import resolve

__all__ = ["MOSAIC_PIPELINE_PASSES", "mosaic_offline_blockers", "mosaic_report", "mosaic_wgmma"]

_MOSAIC_TARGET = "mosaic_gpu_v2"

#: Passes of the ``mosaic_gpu_v2`` custom call's pipeline (jaxlib/mosaic/gpu/custom_call.cc) that
#: take the lowered module to PTX and a cubin.
MOSAIC_PIPELINE_PASSES = (
    "mosaic-gpu-resolve-trivial-locations",
    "arith-expand",
    "mosaic-gpu-sink-memref-descriptors",
    "convert-nvgpu-to-nvvm",
    "gpu-kernel-outlining",
    "convert-vector-to-scf",
    "convert-scf-to-cf",
    "convert-nvvm-to-llvm",
    "expand-strided-metadata",
    "nvvm-attach-target",
    "lower-affine",
    "convert-arith-to-llvm",
    "convert-index-to-llvm",
    "convert-gpu-to-nvvm",
    "mosaic-byval-insertion",
    "mosaic-llvm-attr-insertion",
    "mosaic-convert-gpu-to-llvm",
    "reconcile-unrealized-casts",
    "ensure-debug-info-scope-on-llvm-func",
    "mosaic-gpu-module-to-assembly",
    "convert-math-to-llvm",
    "mosaic-gpu-assembly-to-binary",
    "gpu-launch-lowering",
    "convert-to-llvm",
)


def mosaic_offline_blockers() -> tuple[str, ...]:
    """Passes of the Mosaic GPU pipeline the installed jaxlib cannot run from Python (empty: it could).

    The CPU jaxlib ships the Mosaic GPU dialect and its serialization pass (so the kernel
    lowers), but the pipeline that takes the module to PTX and a cubin is built only into the
    ``mosaic_gpu_v2`` custom call of the CUDA PJRT plugin, where XLA runs it while compiling
    (:func:`~pallas_kernels.machine_code.xla_build.xla_report` drives it without a GPU).
    """
    from jax._src.lib.mlir import ir, passmanager

    try:  # registers upstream GPU passes (gpu-kernel-outlining, nvvm-attach-target, …)
        import jaxlib.mlir._mlir_libs._mlirGPUPasses  # noqa: F401
    except ImportError:
        pass
    missing = []
    with ir.Context():
        for name in MOSAIC_PIPELINE_PASSES:
            try:
                passmanager.PassManager.parse(f"builtin.module({name})")
            except Exception:  # MLIRError / ValueError: not a registered pass
                missing.append(name)
    return tuple(missing)


def mosaic_wgmma(lowered) -> tuple[ProductMMA, ...]:
    """The ``wgmma`` instructions (inline PTX) each product of the lowered Mosaic kernel issues.

    Instructions are grouped by the source location of the ``plgpu.wgmma`` call that emitted
    them, in program order: Q·Kᵀ first, then P8·V.
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import core as mgpu_core

    call = custom_call(lowered, _MOSAIC_TARGET)
    payload = ir.StringAttr(call.attributes["mhlo.backend_config"]["module"]).value_bytes
    groups: dict[str, Counter] = {}
    with jax_mlir.make_ir_context() as ctx:
        ctx.allow_unregistered_dialects = True
        # its types (memrefs of barriers) do not parse unregistered; without this the parse failed
        # ("invalid memref element type") depending on what the process had lowered before
        mgpu_core.dialect.register_dialect(ctx)
        module = mgpu_core._run_serde_pass(ir.Module.parse(payload), serialize=False)
        for op in walk(module.operation):
            if op.operation.name != "llvm.inline_asm":
                continue
            asm = ir.StringAttr(op.attributes["asm_string"]).value
            for instr in re.findall(r"wgmma\.mma_async[.\w]*", asm):
                groups.setdefault(str(op.location), Counter())[instr] += 1
    if len(groups) != len(PRODUCTS):
        raise PcastError(f"expected wgmma from {len(PRODUCTS)} call sites in the Mosaic module, found {len(groups)}")
    return tuple(product_mma(name, ops) for name, ops in zip(PRODUCTS, groups.values()))


def mosaic_report(config: str | KernelConfig, shape: KernelShape = KernelShape()) -> KernelReport:
    """The Mosaic kernel's row: its FP8 wgmma per product from the lowered module.

    Registers, spills, stack and shared memory stay ``None`` while
    :func:`mosaic_offline_blockers` is not empty (always, with the CPU jaxlib).
    """
    cfg = resolve(config)
    products = mosaic_wgmma(lower_for_hopper("mosaic", cfg, shape))
    missing = mosaic_offline_blockers()
    note = ""
    if missing:
        key = [p for p in ("convert-gpu-to-nvvm", "convert-nvvm-to-llvm", "mosaic-gpu-module-to-assembly",
                           "mosaic-gpu-assembly-to-binary") if p in missing]
        note = (f"mosaic: no cubin from the CPU jaxlib, which registers {len(MOSAIC_PIPELINE_PASSES) - len(missing)} "
                f"of the {len(MOSAIC_PIPELINE_PASSES)} passes of the mosaic_gpu_v2 pipeline (missing {', '.join(key)}, "
                "…); they are built into the CUDA PJRT plugin's custom call: use --xla (jax-cuda12-plugin)")
    return KernelReport(
        backend="mosaic",
        config=cfg.name,
        shape=shape.label(),
        num_warps=None,
        num_stages=None,
        registers=None,
        spill_stores=None,
        spill_loads=None,
        stack_frame=None,
        shared=None,
        products=products,
        sass_fp8_mma=None,
        sass_other_mma=None,
        e4m3_unpacks=None,
        compiler=f"jax {jax.__version__} Mosaic GPU lowering (inline PTX; not assembled)",
        note=note,
    )

