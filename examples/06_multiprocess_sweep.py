"""A sweep over two processes on one machine

Starts the same ``pcast sweep`` command twice, as process 0 and process 1 of a two-process run
(``--coordinator 127.0.0.1:PORT --num-processes 2 --process-id i``), each with one CPU device.
JAX's multi-process runtime joins them; the seeds are cut into chunks that the processes compute
side by side, each writes its chunk files into the shared ``--out`` folder and process 0 merges
them into ``results.npz`` and ``summary.csv``. On a cluster the same command runs once per host
(or under SLURM with ``--distributed``). The script then loads the merged result with
:func:`pcast_jax.load_result`, prints it, and reruns the same sweep in this one process with the
same chunk size to show the documented guarantee: the two results are identical bit for bit.

Run it with::

    .venv/bin/python examples/06_multiprocess_sweep.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import pcast_jax as pj

CHUNK = 2
SWEEP = ["sweep", "--configs", "fwd_s1,rev_s256", "--delta", "5,7", "--n", "256", "--seeds", "8",
         "--q-len", "8", "--d", "16", "--chunk-size", str(CHUNK), "--no-progress"]
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, num_processes: int = 2) -> list[str]:
    """Run the sweep as ``num_processes`` local processes; return each one's stdout."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # gRPC would use a proxy
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "pcast_jax.cli", *SWEEP, "--out", str(out),
                               "--coordinator", coordinator, "--num-processes", str(num_processes),
                               "--process-id", str(i), "--init-timeout", "60"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(num_processes)]
    outputs = []
    try:
        for i, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
            if p.returncode != 0:
                raise SystemExit(f"process {i} exited with status {p.returncode}:\n{stderr[-2000:]}")
            outputs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="parent of the sweep folder (default: a temp dir)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example06_"))
    out.mkdir(parents=True, exist_ok=True)
    sweep_dir = out / "sweep_2proc"

    outputs = launch(sweep_dir)
    print("process 0 printed:")
    print(outputs[0].rstrip())

    merged = pj.load_result(sweep_dir)
    chunks = sorted((sweep_dir / "chunks").glob("*.npz"))
    print(f"merged result: {len(chunks)} chunk files from 2 processes, metrics {sorted(merged.data)}")
    for config in merged.spec.config_names:
        frac = merged.mean("frac_zeroed", config=config, n=256)
        print(f"{config:>9}: fraction of non-sink P zeroed at delta {merged.spec.deltas}: "
              f"{', '.join(f'{x:.3f}' for x in frac)}")

    single = pj.run_sweep(merged.spec, chunk_size=CHUNK, progress=False)  # the same sweep, one process
    same = set(merged.data) == set(single.data) and all(
        np.array_equal(np.asarray(merged.data[m], np.float32).view(np.uint32),
                       np.asarray(single.data[m], np.float32).view(np.uint32)) for m in single.data)
    if not same:
        raise SystemExit("the two-process result differs from the single-process one")
    print(f"OK: the 2-process sweep in {sweep_dir} equals a 1-process run bit for bit")


if __name__ == "__main__":
    main()
