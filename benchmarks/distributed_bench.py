"""Throughput of one sweep run by 1 process and by several local processes (jax.distributed, CPU).

For each process count P the script launches P fresh processes on this machine, each with one
CPU device; P = 1 is the plain single-process ``run_sweep`` (no distributed runtime), P > 1 joins
them through ``jax.distributed`` (coordinator on 127.0.0.1, gloo collectives). Each process runs
the sweep once to compile, then times ``--repeats`` more identical runs (in memory, so disk speed
does not count) and keeps the best. Printed per P: that wall time (slowest process), instances/s
(one instance = one (N, Δ, seed) evaluated under every config), speed-up over P = 1, and each
process's peak resident memory (``getrusage`` maxrss, which includes the compile run).

On a machine with few cores the gain is bounded by the cores: a single XLA CPU process already
spreads its large operations over the cores it finds, so P processes compete for the same cores.

Usage (repo root)::

    python benchmarks/distributed_bench.py                   # P = 1 and 2, Table 2 sizes, 32 seeds
    python benchmarks/distributed_bench.py --processes 1 2 4 --seeds 64 --n 8192
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _worker(cfg: dict) -> None:
    import resource

    from pcast_jax.sweep import SweepSpec, init_distributed, run_sweep

    if cfg["num_processes"] > 1:
        init_distributed(cfg["coordinator"], cfg["num_processes"], cfg["process_id"], timeout_s=cfg["timeout"])
    spec = SweepSpec.from_dict(cfg["spec"])
    t0 = time.perf_counter()
    result = run_sweep(spec, progress=False)  # compile (and warm every cache)
    first = time.perf_counter() - t0
    timed = []
    for _ in range(cfg["repeats"]):
        t0 = time.perf_counter()
        result = run_sweep(spec, progress=False)
        timed.append(time.perf_counter() - t0)
    print("BENCH " + json.dumps({
        "process_id": cfg["process_id"], "first_s": first, "timed_s": min(timed), "all_s": timed,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "mse_mean": float(result.data["mse"].mean())}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(spec_dict: dict, num_processes: int, timeout: float, repeats: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    port = _free_port()
    procs = []
    for pid in range(num_processes):
        cfg = {"coordinator": f"127.0.0.1:{port}", "num_processes": num_processes, "process_id": pid,
               "spec": spec_dict, "timeout": timeout, "repeats": repeats}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    rows = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            line = next((ln for ln in out.splitlines() if ln.startswith("BENCH ")), None)
            if p.returncode != 0 or line is None:
                raise SystemExit(f"a worker failed (exit {p.returncode}):\n{out[-3000:]}")
            rows.append(json.loads(line[6:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts (default 1 2)")
    parser.add_argument("--seeds", type=int, default=32, help="seeds (default 32)")
    parser.add_argument("--n", type=int, nargs="+", default=[4096], help="KV lengths N (default 4096)")
    parser.add_argument("--deltas", type=float, nargs="+", default=[7.0], help="sink strengths (default 7)")
    parser.add_argument("--q-len", type=int, default=32, help="query rows (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process; the best counts (default 3)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up (default 1800)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0

    from pcast_jax.sweep import SweepSpec

    spec = SweepSpec(ns=tuple(args.n), deltas=tuple(args.deltas), seeds=args.seeds, q_len=args.q_len)
    instances = len(spec.ns) * len(spec.deltas) * spec.seeds
    print(f"sweep: N={list(spec.ns)} Δ={list(spec.deltas)} seeds={spec.seeds} q_len={spec.q_len} d={spec.d} "
          f"configs={list(spec.config_names)} -> {instances} instances; cores on this machine: {os.cpu_count()}")
    print(f"{'P':>3} {'timed s':>9} {'inst/s':>9} {'vs P=1':>7} {'first s':>9}  peak RSS per process (MiB)")
    base = None
    for nproc in args.processes:
        rows = _run(spec.to_dict(), nproc, args.timeout, args.repeats)
        timed = max(r["timed_s"] for r in rows)
        rate = instances / timed
        base = base or (rate if nproc == 1 else None)
        ratio = f"{rate / base:7.2f}" if base else "      -"
        rss = " ".join(f"{r['maxrss_mib']:.0f}" for r in sorted(rows, key=lambda r: r["process_id"]))
        print(f"{nproc:>3} {timed:9.2f} {rate:9.2f} {ratio} {max(r['first_s'] for r in rows):9.2f}  {rss}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
