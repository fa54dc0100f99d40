"""Hopper machine code of the Pallas kernels, built on a machine without a GPU.

Each kernel is lowered by :func:`pallas_kernels.fp8_attention` for CUDA with an abstract Hopper
device (no GPU, no CUDA install; :mod:`~pallas_kernels.machine_code.lowering`) and compiled to a
cubin by one of two compilers:

* **the triton wheel** (``pip install triton==3.9.0``; about 1 GB installed, no torch needed) —
  Triton kernel only (:mod:`~pallas_kernels.machine_code.triton_build`, :func:`triton_report`):
  ``ptxas -v`` gives registers, spills and the stack frame, the PTX (through its ``.loc`` lines)
  the MMA instructions of each ``tt.dot``, and the SASS (``cuobjdump`` of the same wheel) what the
  tensor cores run: FP8 ``QGMMA``/``QMMA`` or ``HMMA``/``HGMMA`` on operands converted from E4M3.
  XLA compiles that custom call with the Triton it bundles, not with this wheel: a close stand-in.
* **XLA itself** (``pip install jax-cuda12-plugin==<jax version>``) — both kernels
  (:mod:`~pallas_kernels.machine_code.xla_build`, :func:`xla_report`): XLA compiles ahead of time
  for a described H100 with its own Triton and the ``mosaic_gpu_v2`` pipeline, i.e. the compilers
  a GPU run uses. The Mosaic GPU kernel can only be compiled this way: the CPU jaxlib registers the
  Mosaic GPU dialect and its serialization pass but not the pipeline to PTX
  (:mod:`~pallas_kernels.machine_code.mosaic_build`, :func:`mosaic_offline_blockers`).

The compilers' text is read by :mod:`~pallas_kernels.machine_code.parse`; every row of
:mod:`~pallas_kernels.machine_code.report` names the compiler that produced its figures
(:attr:`KernelReport.compiler`).
"""

from pallas_kernels.machine_code.lowering import HOPPER_DEVICE_KIND, PRODUCTS, KernelShape, lower_for_hopper
from pallas_kernels.machine_code.mosaic_build import (
    MOSAIC_PIPELINE_PASSES,
    mosaic_offline_blockers,
    mosaic_report,
    mosaic_wgmma,
)
from pallas_kernels.machine_code.parse import (
    ProductMMA,
    PtxasResources,
    SassSummary,
    parse_ptx_mma,
    parse_ptxas_log,
    parse_sass,
)
from pallas_kernels.machine_code.report import KernelReport, format_table
from pallas_kernels.machine_code.triton_build import (
    TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC,
    TritonBuild,
    TritonCall,
    compile_triton,
    triton_call,
    triton_report,
)
from pallas_kernels.machine_code.xla_build import H100_TARGET_CONFIG, XlaBuild, xla_available, xla_compile, xla_report

__all__ = [
    "H100_TARGET_CONFIG",
    "HOPPER_DEVICE_KIND",
    "MOSAIC_PIPELINE_PASSES",
    "PRODUCTS",
    "TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC",
    "KernelReport",
    "KernelShape",
    "ProductMMA",
    "PtxasResources",
    "SassSummary",
    "TritonBuild",
    "TritonCall",
    "XlaBuild",
    "compile_triton",
    "format_table",
    "lower_for_hopper",
    "mosaic_offline_blockers",
    "mosaic_report",
    "mosaic_wgmma",
    "parse_ptx_mma",
    "parse_ptxas_log",
    "parse_sass",
    "triton_call",
    "triton_report",
    "xla_available",
    "xla_compile",
    "xla_report",
]
