"""Doctor benchmark: what a user waits for after ``pcast doctor``, without a trace.

In one process: for each deployment, the first :func:`pcast_jax.deployments.diagnose` (compiles: one
program for the verdict's sweep, one more for the candidate scan where a knob is recommended) and the
median of ``--repeats`` further calls (warm), wall clock. The first deployment has no knob (verdict only),
the second recommends ``scale_s`` (verdict and the candidate scan, one program). Writes
``results/doctor_benchmark.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pcast_jax import deployments

CASES = (("vllm", "triton_attn", "sm90"), ("jax", "cudnn", "sm90"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/doctor_benchmark.json")
    args = parser.parse_args(argv)
    rows = []
    for engine, backend, gpu in CASES:
        row = deployments.find(engine, backend, gpu)
        times = []
        for _ in range(1 + args.repeats):
            start = time.perf_counter()
            diag = deployments.diagnose(row)
            times.append(time.perf_counter() - start)
        rows.append({"deployment": f"{engine} {backend} {gpu}", "first_s": times[0],
                     "warm_median_s": statistics.median(times[1:]), "recommended": diag.recommended})
        print(f"{rows[-1]['deployment']:28s} first {times[0]:6.2f} s   warm median {rows[-1]['warm_median_s']:6.2f} s"
              f"   (recommends {diag.recommended})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main()
