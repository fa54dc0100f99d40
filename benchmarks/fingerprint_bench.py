"""Fingerprint benchmark: ``pcast_jax.fingerprint.identify`` on a black box that costs 0.1 s a call.

The black box is a preset through the simulator, padded with a sleep to ``--call-seconds`` (0.1 s) a
call. Each preset is read in a fresh process: the first ``identify`` there is cold (JAX starts, every
candidate's program is compiled, the black box compiles its own), then a second one on the same
black box is warm (every candidate's output is cached: the fit's own work). Reports black-box calls,
seconds and candidates simulated; writes ``results/fingerprint_benchmark.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

import numpy as np

from pcast_jax import fingerprint, report
from pcast_jax.presets import get_preset


def black_box(name: str, head_dim: int, call_seconds: float):
    """``fn(q, k, v)``: preset ``name`` through the simulator, taking at least ``call_seconds`` a call."""
    cfg = get_preset(name)
    ps = fingerprint.probes(head_dim)

    def fn(q, k, v):
        t0 = time.perf_counter()
        out = fingerprint.simulate_outputs(dataclasses.replace(ps, q=q, k=k, v=v), cfg)
        time.sleep(max(0.0, call_seconds - (time.perf_counter() - t0)))
        return out

    return fn


def read(name: str, head_dim: int, call_seconds: float) -> list[dict]:
    """``identify`` on preset ``name``, cold then warm, in this process."""
    rows = []
    for warm in (False, True):
        t0, c0 = time.perf_counter(), time.process_time()
        fp = fingerprint.identify(black_box(name, head_dim, call_seconds), head_dim=head_dim)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        cfg = get_preset(name)
        right = all((e.value == getattr(cfg, f)) if e.determined else (getattr(cfg, f) in e.candidates)
                    for f, e in fp.fields.items())
        rows.append({"preset": name, "warm": warm, "calls": fp.calls, "seconds": seconds, "cpu_seconds": cpu,
                     "seconds_calls": fp.seconds_calls, "candidates": fp.candidates, "right": bool(right)})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="fa3,hpc_ops", help="black boxes, in order (default fa3,hpc_ops)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--call-seconds", type=float, default=0.1)
    parser.add_argument("--out", default="results/fingerprint_benchmark.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one preset, rows as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(read(args.one, args.head_dim, args.call_seconds)))
        return {}
    rows = []
    for name in args.presets.split(","):
        child = subprocess.run([sys.executable, __file__, "--one", name, "--head-dim", str(args.head_dim),
                                "--call-seconds", str(args.call_seconds)], capture_output=True, text=True,
                               check=True)
        for row in json.loads(child.stdout.strip().splitlines()[-1]):
            rows.append(row)
            print(f"identify({name}), {'warm' if row['warm'] else 'cold'}: {row['calls']} call(s), "
                  f"{row['seconds']:.1f} s ({row['cpu_seconds']:.1f} s CPU; "
                  f"{row['seconds_calls']:.2f} s in the black box), "
                  f"{row['candidates']} candidates, {'right' if row['right'] else 'WRONG'}", flush=True)
    report.write_json(args.out, {"rows": rows, "head_dim": args.head_dim, "call_seconds": args.call_seconds})
    return {"rows": rows, "max_seconds": float(np.max([r["seconds"] for r in rows if not r["warm"]]))}


if __name__ == "__main__":
    main()
