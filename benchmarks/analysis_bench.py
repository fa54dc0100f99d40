"""Analysis benchmark: ``pcast_jax.analysis.analyze`` on a 30-layer, 1,024-token trace (SmolLM2's shape).

Synthetic trace: 30 layers, one sequence of 1,024 tokens, 9 query heads over 3 KV heads, head dim 64,
Gaussian Q/K/V with a planted sink at key 0 in the later layers (the analysis' cost does not depend on
the values). Times, in one process: the first ``analyze`` call (compiles: one program per layer shape
and configuration) and the median of ``--repeats`` further calls (warm), wall clock and process CPU
time, for the default configurations of ``pcast analyze``; then the same for the JAX question on the
trace, ``jax_fp8.predict(trace=..., gpu="hopper")`` (cuDNN's FP8 attention simulated at every
power-of-two ``scale_s``, 9 candidates at τ = 0; what ``pcast jax-fp8 --trace`` computes). Writes
``results/analysis_benchmark.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from pcast_jax import jax_fp8
from pcast_jax.analysis import Trace, analyze
from pcast_jax.commands.analyze import DEFAULT_CONFIGS


def synthetic_trace(layers: int, tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(layers, 1, tokens, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(layers, 1, tokens, kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(layers, 1, tokens, kv_heads, head_dim)).astype(np.float32)
    q[layers // 3:, ..., 0] += 4.0          # later layers: every query looks along dim 0 ...
    k[layers // 3:, :, 0, :, 0] += 30.0     # ... where key 0 (the sink) sits (Δ ≈ 15 logits)
    return Trace(q=q, k=k, v=v, lengths=np.array([tokens]), layers=tuple(f"layer{i}" for i in range(layers)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="results/analysis_benchmark.json")
    args = parser.parse_args(argv)
    trace = synthetic_trace(args.layers, args.tokens, 9, 3, 64)
    configs = args.configs.split(",")

    def timed():
        wall, cpu = time.perf_counter(), time.process_time()
        result = analyze(trace, configs)
        return time.perf_counter() - wall, time.process_time() - cpu, result

    first_wall, first_cpu, result = timed()
    warm = [timed()[:2] for _ in range(args.repeats)]

    def scan():
        wall, cpu = time.perf_counter(), time.process_time()
        answer = jax_fp8.predict(trace=trace, gpu="hopper")
        return time.perf_counter() - wall, time.process_time() - cpu, answer

    scan_first_wall, scan_first_cpu, answer = scan()
    scan_warm = [scan()[:2] for _ in range(args.repeats)]
    out = {"layers": args.layers, "tokens": args.tokens, "heads": 9, "kv_heads": 3, "head_dim": 64,
           "configs": configs, "first_call_s": first_wall, "first_call_cpu_s": first_cpu,
           "warm_s": statistics.median(w for w, _ in warm), "warm_cpu_s": statistics.median(c for _, c in warm),
           "summary": result.summary_lines()[0],
           "jax_fp8_candidates": len(answer.rows()), "jax_fp8_first_call_s": scan_first_wall,
           "jax_fp8_first_call_cpu_s": scan_first_cpu, "jax_fp8_warm_s": statistics.median(w for w, _ in scan_warm),
           "jax_fp8_warm_cpu_s": statistics.median(c for _, c in scan_warm), "jax_fp8_answer": answer.answer()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
