"""The child process of :func:`~pallas_kernels.machine_code.xla_build.xla_compile`.

``python -m pallas_kernels.machine_code.xla_worker SPEC.json OUTDIR`` compiles the kernel the spec
names for an abstract H100; XLA reads its dump flags once per process, so each compile gets a
fresh one, started with the environment that says where the dumps go.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pallas_kernels.machine_code.lowering import KernelShape, lower_for_hopper
from pallas_kernels.machine_code.xla_build import H100_TARGET_CONFIG
from pcast_jax.config import KernelConfig


def compile_spec(spec_path: str, out: str) -> None:
    """Compile in this (fresh) process for an abstract H100 and leave the dumps under ``out``."""
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
    cfg = KernelConfig(**spec["config"])
    lower_for_hopper(spec["backend"], cfg, KernelShape(**spec["shape"]), sharding=sharding).compile()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pallas_kernels.machine_code.xla_worker SPEC.json OUTDIR (used by xla_compile)")
    compile_spec(sys.argv[1], sys.argv[2])
