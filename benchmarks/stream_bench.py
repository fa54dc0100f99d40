"""Real-size benchmark: a generated Llama-3-8B-shaped trace folder, streamed and sampled by ``analyze``.

The trace: 32 layers × 32 query heads over 8 KV heads × 8,192 tokens, d = 128, one sequence, Gaussian Q/K/V
with a planted sink at key 0 in the later two thirds of the layers (the cost does not depend on the
values), written layer by layer as a trace folder in bfloat16 (``pcast_jax.analysis.capture.save_layers``:
3.2 GB; 6.4 GB in float32, which would not be held in memory whole either). Then, in a fresh process so
that its peak resident memory is the analysis' own: ``analyze(load_trace(folder), <pcast analyze's five
default kernels>, rows=256)`` (every layer read once, memory-mapped; 256 rows of each layer sampled, every
key kept), timed, with the peak resident memory from ``resource.getrusage`` (``ru_maxrss``). Goal: at most
10 minutes and 4 GiB on a 2-core CPU. Writes ``results/stream_benchmark.json``; ``--layers`` and
``--tokens`` make it smaller, ``--keep`` keeps the folder for the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def write_trace(folder: Path, layers: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                dtype: str) -> None:
    from pcast_jax.analysis.capture import save_layers

    def layer(i: int):
        rng = np.random.default_rng(i)
        q = rng.normal(size=(1, tokens, heads, head_dim)).astype(np.float32)
        k = rng.normal(size=(1, tokens, kv_heads, head_dim)).astype(np.float32)
        v = rng.normal(size=(1, tokens, kv_heads, head_dim)).astype(np.float32)
        if i >= layers // 3:  # every query looks along dim 0, where key 0 (the sink) sits
            q[..., 0] += 2.0
            k[:, 0, :, 0] += 100.0  # Δ ≈ 2·100/√128 ≈ 18 logits
        return q, k, v

    save_layers(folder, layer, shape=(layers, 1, tokens, heads, kv_heads, head_dim), lengths=np.array([tokens]),
                layers=tuple(f"layer{i}" for i in range(layers)), dtype=dtype)


def analyse(folder: str, rows: int, configs: str) -> dict:
    """The measured part, run in its own process."""
    from pcast_jax.analysis import analyze, load_trace

    start = time.perf_counter()
    cpu = time.process_time()
    trace = load_trace(folder)
    result = analyze(trace, configs.split(","), rows=rows,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "verdicts": {r["config"]: r["verdict"] for r in result.config_rows()},
            "summary": result.summary_lines()[0]}


def main(argv=None) -> dict:
    from pcast_jax.commands.analyze import DEFAULT_CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--folder", default="results/stream_trace")
    parser.add_argument("--keep", action="store_true", help="keep the trace folder (and reuse one already there)")
    parser.add_argument("--out", default="results/stream_benchmark.json")
    parser.add_argument("--analyse", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.analyse is not None:
        print(json.dumps(analyse(args.analyse, args.rows, args.configs)))
        return {}
    folder = Path(args.folder)
    shape = dict(layers=args.layers, tokens=args.tokens, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim)
    made = 0.0
    if not (args.keep and (folder / "index.npz").is_file()):
        start = time.perf_counter()
        write_trace(folder, dtype=args.dtype, **shape)
        made = time.perf_counter() - start
    load = os.getloadavg()
    child = subprocess.run([sys.executable, __file__, "--analyse", str(folder), "--rows", str(args.rows),
                            "--configs", args.configs], stdout=subprocess.PIPE, check=True, text=True)
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    out = {**shape, "sequences": 1, "dtype": args.dtype, "rows": args.rows, "configs": args.configs.split(","),
           "trace_bytes": sum(p.stat().st_size for p in folder.iterdir()), "write_s": made,
           "load_average_before": load, "load_average_after": os.getloadavg(), "cpus": os.cpu_count(), **measured}
    if not args.keep:
        shutil.rmtree(folder)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
