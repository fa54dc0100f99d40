"""Both kernels built by XLA itself, ahead of time for a described H100, on a machine without a GPU.

Needs the jax CUDA plugin (``pip install jax-cuda12-plugin==<jax version>``, which brings the CUDA
PJRT plugin, about 190 MB; no GPU, no CUDA libraries): XLA compiles for :data:`H100_TARGET_CONFIG`
with its own Triton and the ``mosaic_gpu_v2`` pipeline, i.e. the compilers a GPU run uses. The
compile runs in a child process (:mod:`pallas_kernels.machine_code.xla_worker`) and its dumps are
read back here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax

import pallas_kernels as pk
from pallas_kernels.machine_code.lowering import KernelShape, lower_for_hopper
from pallas_kernels.machine_code.mosaic_build import mosaic_wgmma
from pallas_kernels.machine_code.parse import parse_ptxas_log, parse_sass, ptx_mma_total
from pallas_kernels.machine_code.report import KernelReport
from pallas_kernels.machine_code.triton_build import triton_call, triton_modules
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice
from pcast_jax.presets import resolve

__all__ = ["H100_TARGET_CONFIG", "XlaBuild", "xla_available", "xla_compile", "xla_report"]

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
        _, _, _, _, get_ptxas, _, _, knobs = triton_modules()
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
    worker = [sys.executable, "-m", "pallas_kernels.machine_code.xla_worker", str(spec_path), str(work)]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=timeout)
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
        products = (ptx_mma_total(build.ptx),)
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


