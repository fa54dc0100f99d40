"""Fingerprint benchmark: ``pcast_jax.fingerprint.identify`` on a black box that costs 0.1 s a call.

The black box is a preset through the simulator, padded with a sleep to ``--call-seconds`` (0.1 s) a
call. Times, in one process: the first ``identify`` (the simulator compiles its programs for the
candidates' shapes) and a second one on another preset (warm: the candidates it shares with the first
are cached). Reports black-box calls, seconds and candidates simulated; writes
``results/fingerprint_benchmark.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="fa3,hpc_ops", help="black boxes, in order (default fa3,hpc_ops)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--call-seconds", type=float, default=0.1)
    parser.add_argument("--out", default="results/fingerprint_benchmark.json")
    args = parser.parse_args(argv)
    rows = []
    for i, name in enumerate(args.presets.split(",")):
        t0 = time.perf_counter()
        fp = fingerprint.identify(black_box(name, args.head_dim, args.call_seconds), head_dim=args.head_dim)
        seconds = time.perf_counter() - t0
        cfg = get_preset(name)
        right = all((e.value == getattr(cfg, f)) if e.determined else (getattr(cfg, f) in e.candidates)
                    for f, e in fp.fields.items())
        rows.append({"preset": name, "warm": i > 0, "calls": fp.calls, "seconds": seconds,
                     "seconds_calls": fp.seconds_calls, "candidates": fp.candidates, "right": bool(right)})
        print(f"identify({name}): {fp.calls} call(s), {seconds:.1f} s ({fp.seconds_calls:.2f} s in the black box), "
              f"{fp.candidates} candidates, {'right' if right else 'WRONG'}", flush=True)
    report.write_json(args.out, {"rows": rows, "head_dim": args.head_dim, "call_seconds": args.call_seconds})
    return {"rows": rows, "max_seconds": float(np.max([r["seconds"] for r in rows]))}


if __name__ == "__main__":
    main()
