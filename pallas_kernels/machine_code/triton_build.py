"""The Triton kernel built by the triton wheel: the custom call's IR through TTGIR and PTX to a cubin.

The Triton IR Pallas hands XLA (the ``ir`` payload of the ``__gpu$xla.gpu.triton`` custom call)
goes through the wheel's pipeline (TTIR → TTGIR → LLVM → PTX) for ``GPUTarget("cuda", 90, 32)``
and the ``ptxas`` it bundles. XLA compiles that custom call with the Triton it bundles, not with
this wheel: a close stand-in.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path

from pallas_kernels.machine_code.lowering import PRODUCTS, KernelShape, custom_call, lower_for_hopper, walk
from pallas_kernels.machine_code.parse import (
    ProductMMA,
    PtxasResources,
    SassSummary,
    parse_ptx_mma,
    parse_ptxas_log,
    parse_sass,
)
from pallas_kernels.machine_code.report import KernelReport
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int
from pcast_jax.presets import resolve

__all__ = [
    "TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC",
    "TritonBuild",
    "TritonCall",
    "compile_triton",
    "triton_call",
    "triton_modules",
    "triton_report",
]

#: What Triton's own ``tl.dot`` sets on sm_90 for an FP8 × FP8 → FP32 dot (accumulate in the
#: FP8 wgmma's accumulator over all of K, as the Mosaic kernel does).
TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC = 2**30
_TRITON_TARGET = "__gpu$xla.gpu.triton"


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

    call = custom_call(lowered, _TRITON_TARGET)
    config = call.attributes["mhlo.backend_config"]
    payload = ir.StringAttr(config["ir"]).value_bytes
    with ir.Context() as ctx:
        triton_dialect.register_dialect(ctx)
        module = ir.Module.parse(payload)
        dots = [op for op in walk(module.operation) if op.operation.name == "tt.dot"]
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


def triton_modules():
    """The parts of the triton wheel a build uses; one PcastError saying how to install it if it is missing."""
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
    triton, triton_ir, GPUTarget, Language, get_ptxas, sm_arch, make_backend, knobs = triton_modules()
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

