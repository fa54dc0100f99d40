"""Hopper machine code of the Pallas kernels, built on a machine without a GPU.

Each kernel is lowered by :func:`pallas_kernels.fp8_attention` for CUDA with an abstract Hopper
device (no GPU, no CUDA install) and compiled to a cubin by one of two compilers:

* **the triton wheel** (``pip install triton==3.9.0``; about 1 GB installed, no torch needed) —
  Triton kernel only: the Triton IR Pallas hands XLA (the ``ir`` payload of the
  ``__gpu$xla.gpu.triton`` custom call) goes through the wheel's pipeline (TTIR → TTGIR → LLVM →
  PTX) for ``GPUTarget("cuda", 90, 32)`` and the ``ptxas`` it bundles (:func:`triton_report`).
  ``ptxas -v`` gives registers, spills and the stack frame, the PTX (through its ``.loc`` lines)
  the MMA instructions of each ``tt.dot``, and the SASS (``cuobjdump`` of the same wheel) what the
  tensor cores run: FP8 ``QGMMA``/``QMMA`` or ``HMMA``/``HGMMA`` on operands converted from E4M3.
  XLA compiles that custom call with the Triton it bundles, not with this wheel: a close stand-in.
* **XLA itself** (``pip install jax-cuda12-plugin==<jax version>``, which brings the CUDA PJRT
  plugin, about 190 MB; no GPU, no CUDA libraries) — both kernels: XLA compiles ahead of time for
  a described H100 (:data:`H100_TARGET_CONFIG`) with its own Triton and the ``mosaic_gpu_v2``
  pipeline, i.e. the compilers a GPU run uses (:func:`xla_report`). The Mosaic GPU kernel can only
  be compiled this way: the CPU jaxlib registers the Mosaic GPU dialect and its serialization pass
  but not the pipeline to PTX (:func:`mosaic_offline_blockers`).

Every report names the compiler that produced its figures (:attr:`KernelReport.compiler`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import resolve

__all__ = [
    "PRODUCTS",
    "KernelReport",
    "KernelShape",
    "ProductMMA",
    "PtxasResources",
    "TritonBuild",
    "TritonCall",
    "compile_triton",
    "format_table",
    "lower_for_hopper",
    "mosaic_offline_blockers",
    "mosaic_report",
    "mosaic_wgmma",
    "parse_ptxas_log",
    "parse_sass",
    "triton_call",
    "triton_report",
    "xla_available",
    "xla_compile",
    "xla_report",
]

#: The two matrix products of the kernel, in program order.
PRODUCTS = ("Q·Kᵀ", "P8·V")
#: Device kind of the abstract device the kernels are lowered for (sm_90a).
HOPPER_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
#: What Triton's own ``tl.dot`` sets on sm_90 for an FP8 × FP8 → FP32 dot (accumulate in the
#: FP8 wgmma's accumulator over all of K, as the Mosaic kernel does).
TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC = 2**30
_TRITON_TARGET = "__gpu$xla.gpu.triton"
_MOSAIC_TARGET = "mosaic_gpu_v2"
_F8 = jnp.float8_e4m3fn


# --------------------------------------------------------------------------------------------
# Lowering without a GPU
# --------------------------------------------------------------------------------------------


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


def lower_for_hopper(backend: str, config: str | KernelConfig, shape: KernelShape = KernelShape()):
    """``fp8_attention(..., implementation=backend)`` lowered for CUDA on an abstract Hopper device.

    Returns the ``jax.stages.Lowered``; no GPU and no CUDA installation are needed.
    """
    check_choice("backend", backend, pk.BACKENDS)
    cfg = resolve(config)
    q = jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.q_len, shape.head_dim), _F8)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.kv_heads, shape.n, shape.head_dim), _F8)
    fn = functools.partial(pk.fp8_attention, config=cfg, implementation=backend, return_stats=True)
    device = jax.sharding.AbstractDevice(device_kind=HOPPER_DEVICE_KIND, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        return jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",))


def _walk(op) -> Iterable:
    """Every operation nested in ``op``, in program order."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from _walk(child.operation)


def _custom_calls(lowered, target: str) -> list:
    from jax._src.lib.mlir import ir

    calls = []
    for op in _walk(lowered.compiler_ir("stablehlo").operation):
        if op.operation.name == "stablehlo.custom_call":
            name = ir.StringAttr(op.attributes["call_target_name"]).value
            if name == target:
                calls.append(op)
    if len(calls) != 1:
        raise PcastError(f"expected one {target} custom call in the lowered module, found {len(calls)}")
    return calls


# --------------------------------------------------------------------------------------------
# Triton: the custom call's IR, compiled by the triton wheel
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """The Triton kernel Pallas hands XLA: TTIR text and the launch settings of the custom call."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    max_num_imprecise_acc: tuple[int, ...]  # of each tt.dot, in program order


def triton_call(lowered, *, max_num_imprecise_acc: int | None = None) -> TritonCall:
    """The ``__gpu$xla.gpu.triton`` custom call of ``lowered`` as TTIR text.

    ``max_num_imprecise_acc`` rewrites that attribute of every ``tt.dot`` (a what-if: Pallas
    emits 0, which keeps Triton from choosing an FP8 wgmma for an FP32 result).
    """
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    (call,) = _custom_calls(lowered, _TRITON_TARGET)
    config = call.attributes["mhlo.backend_config"]
    payload = ir.StringAttr(config["ir"]).value_bytes
    with ir.Context() as ctx:
        triton_dialect.register_dialect(ctx)
        module = ir.Module.parse(payload)
        dots = [op for op in _walk(module.operation) if op.operation.name == "tt.dot"]
        i32 = ir.IntegerType.get_signless(32)
        if max_num_imprecise_acc is not None:
            check_int("max_num_imprecise_acc", max_num_imprecise_acc, min_value=0, max_value=2**31 - 1)
            for dot in dots:
                dot.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(i32, max_num_imprecise_acc)
        imprecise = tuple(
            ir.IntegerAttr(d.attributes["maxNumImpreciseAcc"]).value if "maxNumImpreciseAcc" in d.attributes else 0
            for d in dots
        )
        text = str(module)
    return TritonCall(
        name=ir.StringAttr(config["name"]).value,
        ttir=text,
        num_warps=ir.IntegerAttr(config["num_warps"]).value,
        num_stages=ir.IntegerAttr(config["num_stages"]).value,
        max_num_imprecise_acc=imprecise,
    )


@dataclasses.dataclass(frozen=True)
class PtxasResources:
    """What ``ptxas -v`` reports for the kernel (bytes unless said otherwise)."""

    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    barriers: int


def parse_ptxas_log(log: str) -> PtxasResources:
    """Registers, stack frame, spills, static shared memory and barriers from ``ptxas -v``."""

    def first(pattern: str, default: int | None = 0) -> int:
        match = re.search(pattern, log)
        if match is None:
            if default is None:
                raise PcastError(f"ptxas -v output has no match for {pattern!r}:\n{log}")
            return default
        return int(match.group(1))

    return PtxasResources(
        registers=first(r"Used (\d+) registers", default=None),
        stack_frame=first(r"(\d+) bytes stack frame", default=None),
        spill_stores=first(r"(\d+) bytes spill stores", default=None),
        spill_loads=first(r"(\d+) bytes spill loads", default=None),
        static_smem=first(r"(\d+) bytes smem"),
        barriers=first(r"used (\d+) barriers"),
    )


_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")
_PTX_MMA = re.compile(r"\b(wgmma\.mma_async(?:\.[a-z0-9_]+)*|mma\.sync(?:\.[a-z0-9_]+)*)")
_PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s")
_PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', re.M)


def _is_fp8_type(instr: str) -> bool:
    """A PTX or SASS MMA whose operand types are FP8 (e4m3/e5m2)."""
    return re.search(r"e4m3|e5m2", instr, re.I) is not None


@dataclasses.dataclass(frozen=True)
class ProductMMA:
    """The tensor-core instructions one matrix product compiled to (PTX level).

    Attributes:
      product: "Q·Kᵀ" or "P8·V".
      kind: "wgmma" (Hopper warpgroup MMA, SASS HGMMA/QGMMA), "mma.sync" (per-warp MMA, SASS
        HMMA/QMMA) or "none".
      fp8: MMA instructions that take E4M3 (or E5M2) operands on the tensor core.
      converted: MMA instructions of the product on other types: its E4M3 operands were
        converted first (e.g. ``mma.sync…f16.f16`` fed by ``cvt.rn.f16x2.e4m3x2``).
      instructions: every MMA instruction of the product with its count.
    """

    product: str
    kind: str
    fp8: int
    converted: int
    instructions: tuple[tuple[str, int], ...] = ()


def _product_mma(product: str, instructions: Counter) -> ProductMMA:
    kind = ("wgmma" if any(i.startswith("wgmma") for i in instructions)
            else "mma.sync" if instructions else "none")
    fp8 = sum(n for i, n in instructions.items() if _is_fp8_type(i))
    return ProductMMA(product, kind, fp8, sum(instructions.values()) - fp8, tuple(sorted(instructions.items())))


def parse_ptx_mma(ptx: str, dot_lines: dict[int, str], source: str) -> tuple[ProductMMA, ...]:
    """MMA instructions of a PTX listing per product, attributed through its ``.loc`` lines.

    ``dot_lines`` maps a line of ``source`` (the file the compiler read, by name) to the product
    whose ``tt.dot`` sits on it. PTX keeps each instruction's source line exactly (the SASS line
    table does not: ptxas files a wgmma that reads registers under the line of their producer).
    MMAs on other lines are counted under "other".
    """
    files = {int(i) for i, path in _PTX_FILE.findall(ptx) if Path(path).name == Path(source).name}
    per_product: dict[str, Counter] = {name: Counter() for name in dot_lines.values()}
    line = None
    for text in ptx.splitlines():
        loc = _PTX_LOC.match(text)
        if loc:
            line = int(loc.group(2)) if int(loc.group(1)) in files else None
            continue
        for instr in _PTX_MMA.findall(text):
            per_product.setdefault(dot_lines.get(line, "other"), Counter())[instr] += 1
    return tuple(_product_mma(name, instrs) for name, instrs in per_product.items())


@dataclasses.dataclass(frozen=True)
class SassSummary:
    """Kernel-wide instruction counts of a SASS listing."""

    fp8_mma: int  # QGMMA/QMMA with E4M3 (or E5M2) operands
    other_mma: int  # HGMMA/HMMA/IMMA/…: tensor-core instructions on non-FP8 operands
    e4m3_unpacks: int  # F2FP…E4M3…UNPACK: E4M3 pairs widened to F16
    local_stores: int  # STL (spills and stack)
    local_loads: int  # LDL
    opcodes: Counter

    def mma_opcodes(self) -> dict[str, int]:
        return {op: n for op, n in self.opcodes.items() if _is_sass_mma(op)}


def _is_sass_mma(op: str) -> bool:
    return re.match(r"([A-Z]GMMA|HMMA|QMMA|IMMA|DMMA|BMMA)\b", op) is not None


def parse_sass(sass: str) -> SassSummary:
    """Count the instructions of a ``cuobjdump -sass`` / ``nvdisasm`` listing."""
    total: Counter = Counter(m.group(1) for m in map(_SASS_INSTR.search, sass.splitlines()) if m)
    mma = {op: n for op, n in total.items() if _is_sass_mma(op)}
    fp8 = sum(n for op, n in mma.items() if _is_fp8_type(op))
    return SassSummary(
        fp8_mma=fp8,
        other_mma=sum(mma.values()) - fp8,
        e4m3_unpacks=sum(n for op, n in total.items() if op.startswith("F2FP") and "E4M3" in op and "UNPACK" in op),
        local_stores=sum(n for op, n in total.items() if op.startswith("STL")),
        local_loads=sum(n for op, n in total.items() if op.startswith("LDL")),
        opcodes=total,
    )


@dataclasses.dataclass(frozen=True)
class TritonBuild:
    """One compile of a :class:`TritonCall`: every stage's text, the cubin and what they say."""

    call: TritonCall
    num_warps: int
    num_stages: int
    ttgir: str
    ptx: str
    cubin: bytes
    ptxas_log: str
    sass: str
    shared: int  # dynamic shared memory Triton allocates (bytes)
    resources: PtxasResources
    products: tuple[ProductMMA, ...]  # from the PTX, per tt.dot
    summary: SassSummary  # from the SASS, kernel-wide
    mma_versions: tuple[int, ...]  # versionMajor of each dot's MMA layout in the TTGIR, program order
    compiler: str


def _triton_modules():
    try:
        import triton
        from triton import knobs
        from triton._C.libtriton import ir as triton_ir
        from triton.backends.compiler import GPUTarget, Language
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
        from triton.compiler.compiler import make_backend
    except ImportError as exc:  # pragma: no cover - exercised only without the wheel
        raise PcastError(
            f"compiling the Triton kernel needs the triton wheel ({exc}); "
            "install it with: pip install triton==3.9.0"
        ) from None
    return triton, triton_ir, GPUTarget, Language, get_ptxas, sm_arch_from_capability, make_backend, knobs


def _mma_versions(ttgir: str) -> tuple[int, ...]:
    layouts = dict(re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir, re.M))
    versions = []
    for line in ttgir.splitlines():
        if re.search(r"=\s*(tt\.dot|ttng\.warp_group_dot)\s", line):
            enc = re.search(r"->\s*tensor<[^>]*,\s*(#mma\d*)>", line)
            versions.append(int(layouts[enc.group(1)]) if enc and enc.group(1) in layouts else 0)
    return tuple(versions)


def compile_triton(
    call: TritonCall,
    *,
    num_warps: int | None = None,
    num_stages: int | None = None,
    arch: int = 90,
    workdir: str | os.PathLike | None = None,
) -> TritonBuild:
    """Compile ``call`` with the triton wheel for ``sm_{arch}a`` down to a cubin and read it.

    ``num_warps``/``num_stages`` default to the custom call's (what XLA would use). The stages
    are Triton's own (``make_ttir`` … ``make_ptx``); ``ptxas`` runs with the flags Triton's
    ``make_cubin`` uses plus ``-v``, whose report is kept. ``workdir`` keeps the files (TTIR,
    TTGIR, PTX, cubin, SASS); by default a temporary directory is used and removed.
    """
    triton, triton_ir, GPUTarget, Language, get_ptxas, sm_arch, make_backend, knobs = _triton_modules()
    num_warps = call.num_warps if num_warps is None else check_int("num_warps", num_warps, min_value=1)
    num_stages = call.num_stages if num_stages is None else check_int("num_stages", num_stages, min_value=1)
    if num_warps & (num_warps - 1):
        raise PcastError(f"num_warps={num_warps} must be a power of two")
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="pcast_sass_") as tmp:
            return compile_triton(call, num_warps=num_warps, num_stages=num_stages, arch=arch, workdir=tmp)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)

    backend = make_backend(GPUTarget("cuda", arch, 32))
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True})
    ttir_path = work / f"{call.name}.ttir"
    ttir_path.write_text(call.ttir)
    dot_lines = {}
    for lineno, text in enumerate(call.ttir.splitlines(), start=1):
        if re.search(r"=\s*tt\.dot\s", text):
            # the first dot is Q·Kᵀ; every later one is P8·V (one per f16_round_keys group with an f16 accumulator)
            dot_lines[lineno] = PRODUCTS[0] if not dot_lines else PRODUCTS[1]
    if len(dot_lines) < len(PRODUCTS):
        raise PcastError(f"expected at least {len(PRODUCTS)} tt.dot (Q·Kᵀ, P8·V) in the Triton IR, "
                         f"found {len(dot_lines)}")

    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    module = triton_ir.parse_mlir_module(str(ttir_path), context)  # locations: lines of this file
    module.context = context
    stages: dict = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata: dict = {}
    module = stages["ttir"](module, metadata)
    module = stages["ttgir"](module, metadata)
    ttgir = str(module)  # make_llir rewrites the module in place
    llir = stages["llir"](module, metadata)
    ptx = stages["ptx"](llir, metadata)
    (work / f"{call.name}.ttgir").write_text(ttgir)
    ptx_path = work / f"{call.name}.ptx"
    ptx_path.write_text(ptx)

    ptxas = get_ptxas(arch)
    cubin_path = work / f"{call.name}.cubin"
    cmd = [ptxas.path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch(arch)}",
           str(ptx_path), "-o", str(cubin_path)]
    if not options.enable_fp_fusion:
        cmd.insert(2, "--fmad=false")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise PcastError(f"ptxas failed ({done.returncode}): {done.stderr.strip()}")
    log = done.stdout + done.stderr
    (work / f"{call.name}.ptxas.log").write_text(log)
    sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin_path)],
                          capture_output=True, text=True, check=True).stdout
    (work / f"{call.name}.sass").write_text(sass)
    return TritonBuild(
        call=call,
        num_warps=num_warps,
        num_stages=num_stages,
        ttgir=ttgir,
        ptx=ptx,
        cubin=cubin_path.read_bytes(),
        ptxas_log=log,
        sass=sass,
        shared=int(metadata.get("shared") or 0),
        resources=parse_ptxas_log(log),
        products=parse_ptx_mma(ptx, dot_lines, ttir_path.name),
        summary=parse_sass(sass),
        mma_versions=_mma_versions(ttgir),
        compiler=f"triton {triton.__version__} wheel, its {Path(ptxas.path).name} (CUDA {ptxas.version or '?'}); "
                 "a stand-in for the Triton that XLA bundles",
    )


# --------------------------------------------------------------------------------------------
# Mosaic GPU: what the lowered module fixes, and what keeps it from a cubin here
# --------------------------------------------------------------------------------------------

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
    (:func:`xla_report` drives it without a GPU).
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

    (call,) = _custom_calls(lowered, _MOSAIC_TARGET)
    payload = ir.StringAttr(call.attributes["mhlo.backend_config"]["module"]).value_bytes
    groups: dict[str, Counter] = {}
    with jax_mlir.make_ir_context() as ctx:
        ctx.allow_unregistered_dialects = True
        # its types (memrefs of barriers) do not parse unregistered; without this the parse failed
        # ("invalid memref element type") depending on what the process had lowered before
        mgpu_core.dialect.register_dialect(ctx)
        module = mgpu_core._run_serde_pass(ir.Module.parse(payload), serialize=False)
        for op in _walk(module.operation):
            if op.operation.name != "llvm.inline_asm":
                continue
            asm = ir.StringAttr(op.attributes["asm_string"]).value
            for instr in re.findall(r"wgmma\.mma_async[.\w]*", asm):
                groups.setdefault(str(op.location), Counter())[instr] += 1
    if len(groups) != len(PRODUCTS):
        raise PcastError(f"expected wgmma from {len(PRODUCTS)} call sites in the Mosaic module, found {len(groups)}")
    return tuple(_product_mma(name, ops) for name, ops in zip(PRODUCTS, groups.values()))


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One row of the report: a backend × config × warps × stages compiled for Hopper.

    Machine-code fields are ``None`` where no cubin could be built (``note`` says why).
    """

    backend: str
    config: str
    shape: str
    num_warps: int | None
    num_stages: int | None
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack_frame: int | None
    shared: int | None
    products: tuple[ProductMMA, ...]
    sass_fp8_mma: int | None
    sass_other_mma: int | None
    e4m3_unpacks: int | None
    compiler: str
    max_num_imprecise_acc: tuple[int, ...] = ()
    note: str = ""

    @property
    def mma_kind(self) -> str:
        kinds = {p.kind for p in self.products if p.product in PRODUCTS}
        return kinds.pop() if len(kinds) == 1 else "/".join(p.kind for p in self.products)

    def product(self, name: str) -> ProductMMA:
        return next(p for p in self.products if p.product == name)


def triton_report(
    config: str | KernelConfig,
    shape: KernelShape = KernelShape(),
    *,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_num_imprecise_acc: int | None = None,
    workdir: str | os.PathLike | None = None,
) -> tuple[KernelReport, TritonBuild]:
    """Lower the Triton kernel for Hopper, compile it with the triton wheel and report it."""
    cfg = resolve(config)
    call = triton_call(lower_for_hopper("triton", cfg, shape), max_num_imprecise_acc=max_num_imprecise_acc)
    build = compile_triton(call, num_warps=num_warps, num_stages=num_stages, workdir=workdir)
    res = build.resources
    report = KernelReport(
        backend="triton",
        config=cfg.name,
        shape=shape.label(),
        num_warps=build.num_warps,
        num_stages=build.num_stages,
        registers=res.registers,
        spill_stores=res.spill_stores,
        spill_loads=res.spill_loads,
        stack_frame=res.stack_frame,
        shared=build.shared + res.static_smem,
        products=build.products,
        sass_fp8_mma=build.summary.fp8_mma,
        sass_other_mma=build.summary.other_mma,
        e4m3_unpacks=build.summary.e4m3_unpacks,
        compiler=build.compiler,
        max_num_imprecise_acc=call.max_num_imprecise_acc,
    )
    return report, build


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


def _cell(value, unit: str = "") -> str:
    return "—" if value is None else f"{value}{unit}"


def format_table(reports: Iterable[KernelReport]) -> str:
    """The reports as an aligned text table, then one line per distinct compiler and note.

    Columns: registers per thread; spill stores/loads and stack frame (bytes, ``ptxas -v``);
    shared memory per CTA (bytes); the MMA kind of each product and its FP8 / converted-operand
    MMA instructions (PTX, per ``tt.dot``); the FP8 and other tensor-core instructions of the
    whole SASS; the E4M3→F16 unpacks in the SASS.
    """
    head = ("backend", "config", "shape", "warps", "stages", "regs", "spill st/ld", "stack", "smem",
            "MMA Q·Kᵀ", "MMA P8·V", "FP8 MMA QK/PV", "conv. MMA QK/PV", "SASS FP8/other MMA", "E4M3→F16",
            "compiler")
    rows, compilers, notes = [], [], []
    for r in reports:
        if r.compiler not in compilers:
            compilers.append(r.compiler)
        if r.note and r.note not in notes:
            notes.append(r.note)
        names = [p.product for p in r.products]
        if PRODUCTS[0] in names and PRODUCTS[1] in names:
            qk, pv = r.product(PRODUCTS[0]), r.product(PRODUCTS[1])
            kinds = (qk.kind, pv.kind)
            fp8, conv = f"{qk.fp8}/{pv.fp8}", f"{qk.converted}/{pv.converted}"
        else:  # the kernel's MMAs in total (no line information to split them by product)
            total = r.products[0]
            kinds = (total.kind, total.kind)
            fp8, conv = f"Σ {total.fp8}", f"Σ {total.converted}"
            note = "Σ: MMAs of the whole kernel (XLA's PTX carries no line information to split them by product)"
            if note not in notes:
                notes.append(note)
        spills = "—" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        sass_mma = "—" if r.sass_fp8_mma is None else f"{r.sass_fp8_mma}/{r.sass_other_mma}"
        rows.append((
            r.backend, r.config, r.shape, _cell(r.num_warps), _cell(r.num_stages), _cell(r.registers), spills,
            _cell(r.stack_frame), _cell(r.shared), *kinds, fp8, conv, sass_mma, _cell(r.e4m3_unpacks),
            f"[{compilers.index(r.compiler) + 1}]",
        ))
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    lines += [f"[{i}] {c}" for i, c in enumerate(compilers, start=1)]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The compilers a GPU run uses: XLA's, through the CUDA PJRT plugin, without a GPU
# --------------------------------------------------------------------------------------------

#: Target description of an H100 SXM for XLA's ahead-of-time compilation (the fields XLA's GPU
#: compiler reads; after ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``).
H100_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
_XLA_DUMP_FLAGS = "--xla_dump_emitter_re=ptx"  # dumps the PTX of every kernel


def xla_available() -> bool:
    """Whether the jax CUDA plugin (``jax-cuda12-plugin`` with its PJRT plugin) is installed.

    Then XLA can compile for an H100 here, without a GPU (:func:`xla_compile`).
    """
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin"))
    except (ImportError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class XlaBuild:
    """What XLA's own compile of the jitted kernel left in its dumps (see :func:`xla_compile`)."""

    backend: str
    kernel: str
    ptx: str
    ptxas_log: str  # Mosaic: XLA's own ptxas -v; Triton: XLA's PTX assembled with the wheel's ptxas
    sass: str
    shared: int
    threads: int
    compiler: str


def _xla_worker(spec_path: str, out: str) -> None:
    """Compile in this (fresh) process for an abstract H100 and leave the dumps under ``out``."""
    import json

    del out  # the dumps go where the environment says (set by xla_compile before jax is imported)
    spec = json.loads(Path(spec_path).read_text())
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    if spec["cuda_root"]:  # jax points this at /usr/local/cuda on import; Mosaic runs nvdisasm from it
        import jax._src.lib.mosaic_gpu  # noqa: F401

        os.environ["MOSAIC_GPU_CUDA_ROOT"] = spec["cuda_root"]
    topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=H100_TARGET_CONFIG,
                                        topology="1x1x1")
    sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
    shape = KernelShape(**spec["shape"])
    cfg = KernelConfig(**spec["config"])
    q = jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.q_len, shape.head_dim), _F8, sharding=sharding)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.kv_heads, shape.n, shape.head_dim), _F8, sharding=sharding)
    fn = functools.partial(pk.fp8_attention, config=cfg, implementation=spec["backend"], return_stats=True)
    device = jax.sharding.AbstractDevice(device_kind=HOPPER_DEVICE_KIND, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        lowered = jax.jit(fn).trace(q, kv, kv).lower()
    lowered.compile()


def xla_compile(backend: str, config: str | KernelConfig, shape: KernelShape = KernelShape(), *,
                workdir: str | os.PathLike | None = None, timeout: float = 600) -> XlaBuild:
    """Compile ``fp8_attention(..., implementation=backend)`` with XLA's GPU compiler for an H100, no GPU.

    Needs the jax CUDA plugin (``pip install jax-cuda12-plugin==<jax version>``): XLA compiles
    ahead of time for a described target (:data:`H100_TARGET_CONFIG`), with the Triton it bundles
    for the Triton custom call and the ``mosaic_gpu_v2`` pipeline for the Mosaic kernel, and
    assembles with the PTX compiler it links. The compile runs in a child process (XLA reads its
    dump flags once per process) and the dumps are read back:

    * Mosaic: the PTX, XLA's own ``ptxas -v`` report and the SASS (``nvdisasm`` from the triton
      wheel, when installed);
    * Triton: XLA's PTX of the kernel, assembled here with the triton wheel's ``ptxas`` (CUDA 12.9,
      which reads its PTX ISA 8.8) for ``-v`` and the SASS; XLA's PTX has no line information, so
      the MMAs are counted for the kernel as a whole.
    """
    import json
    import sys

    check_choice("backend", backend, pk.BACKENDS)
    if not xla_available():
        raise PcastError("compiling with XLA needs the jax CUDA plugin: pip install "
                         f"jax-cuda12-plugin=={jax.__version__}")
    cfg = resolve(config)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="pcast_xla_") as tmp:
            return xla_compile(backend, cfg, shape, workdir=tmp, timeout=timeout)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        _, _, _, _, get_ptxas, _, _, knobs = _triton_modules()
        cuda_root = str(Path(knobs.nvidia.nvdisasm.path).parent.parent)
    except PcastError:
        knobs = cuda_root = None
    spec = {"backend": backend, "config": dataclasses.asdict(cfg), "shape": dataclasses.asdict(shape),
            "cuda_root": cuda_root}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    (work / "mosaic").mkdir(exist_ok=True)  # Mosaic GPU writes its dumps only into an existing folder
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={work / 'xla'} {_XLA_DUMP_FLAGS}".strip(),
           "MOSAIC_GPU_DUMP_TO": str(work / "mosaic"), "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
           "MOSAIC_GPU_DUMP_SASS": "1"}
    root = Path(pk.__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "pallas_kernels.sass", "--xla-worker", str(spec_path), str(work)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise PcastError(f"XLA compile failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    from importlib import metadata

    xla = f"XLA of jax-cuda12-pjrt {metadata.version('jax-cuda12-pjrt')}"
    if backend == "mosaic":
        dump = work / "mosaic"
        ptxas_logs = sorted(dump.glob("*.ptxas"))
        if not ptxas_logs:
            raise PcastError(f"the Mosaic GPU pipeline left no ptxas report in {dump}")
        stem = str(ptxas_logs[0])[: -len(".ptxas")]
        ptx = Path(stem + ".ptx").read_text()
        sass_path = next((Path(stem + ext) for ext in (".sass", ".sass_ctrl") if Path(stem + ext).exists()),
                         Path(stem + ".sass"))
        resources = Path(stem + ".resources.txt").read_text() if Path(stem + ".resources.txt").exists() else ""
        smem = re.search(r"smem_scratch_bytes=(\d+)", resources)
        kernel = re.search(r"\.entry\s+(\w+)", ptx).group(1)
        threads = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)", ptx)
        return XlaBuild(backend, kernel, ptx, ptxas_logs[0].read_text(),
                        sass_path.read_text() if sass_path.exists() else "",
                        int(smem.group(1)) if smem else 0, int(threads.group(1)) if threads else 0,
                        f"{xla}: Mosaic GPU pipeline and the PTX compiler XLA links (ptxas -v as XLA ran it)")
    # Triton: the kernel's PTX from XLA's dump, its launch from the thunk sequence
    name = triton_call(lower_for_hopper("triton", cfg, shape)).name
    ptx = next((p.read_text() for p in sorted((work / "xla").glob("*.ptx"))
                if re.search(rf"\.entry\s+{re.escape(name)}\b", p.read_text())), None)
    if ptx is None:
        raise PcastError(f"XLA left no PTX for {name} in {work / 'xla'}")
    thunks = "".join(p.read_text() for p in (work / "xla").glob("*thunk_sequence.txt"))
    launch = re.search(rf"{re.escape(name)} grid: \[[^\]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)",
                       thunks)
    if knobs is None:
        raise PcastError("assembling XLA's PTX needs the triton wheel's ptxas: pip install triton==3.9.0")
    ptx_path = work / f"{name}.xla.ptx"
    ptx_path.write_text(ptx)
    cubin = work / f"{name}.xla.cubin"
    ptxas = knobs.nvidia.ptxas  # CUDA 12.9: reads PTX ISA 8.8, which XLA emits
    done = subprocess.run([ptxas.path, "-v", "-O3", "-warn-spills", "--gpu-name=sm_90a", str(ptx_path), "-o",
                           str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise PcastError(f"ptxas failed on XLA's PTX: {done.stderr.strip()[-2000:]}")
    sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return XlaBuild(backend, name, ptx, done.stdout + done.stderr, sass,
                    int(launch.group(4)) if launch else 0, int(launch.group(1)) if launch else 0,
                    f"{xla}: its bundled Triton to PTX; assembled by the triton wheel's ptxas (CUDA {ptxas.version})")


def _ptx_mma_total(ptx: str) -> ProductMMA:
    return _product_mma("all", Counter(_PTX_MMA.findall(ptx)))


def xla_report(backend: str, config: str | KernelConfig, shape: KernelShape = KernelShape(), *,
               workdir: str | os.PathLike | None = None) -> tuple[KernelReport, XlaBuild]:
    """:func:`xla_compile` as a report row (Triton: MMAs for the whole kernel, as "all")."""
    cfg = resolve(config)
    build = xla_compile(backend, cfg, shape, workdir=workdir)
    res = parse_ptxas_log(build.ptxas_log)
    summary = parse_sass(build.sass) if build.sass else None
    if backend == "mosaic":
        products = mosaic_wgmma(lower_for_hopper("mosaic", cfg, shape))
    else:
        products = (_ptx_mma_total(build.ptx),)
    warps = build.threads // 32 or None
    report = KernelReport(
        backend=backend,
        config=cfg.name,
        shape=shape.label(),
        num_warps=warps,
        num_stages=None,
        registers=res.registers,
        spill_stores=res.spill_stores,
        spill_loads=res.spill_loads,
        stack_frame=res.stack_frame,
        shared=build.shared + res.static_smem,
        products=products,
        sass_fp8_mma=summary.fp8_mma if summary else None,
        sass_other_mma=summary.other_mma if summary else None,
        e4m3_unpacks=summary.e4m3_unpacks if summary else None,
        compiler=build.compiler,
    )
    return report, build


if __name__ == "__main__":  # the child process of xla_compile
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "--xla-worker":
        _xla_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m pallas_kernels.sass --xla-worker SPEC.json OUTDIR (used by xla_compile)")
