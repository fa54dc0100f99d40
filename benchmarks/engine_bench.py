"""Engine benchmark: the scan and the xla implementation on the same sweep, in one run.

Workload (Table 2's operating point): 64 seeds × the paper's five configs at N = 4096, Δ = 7,
q_len = 32, d = 128, B = 64. Every timing excludes the first call (compilation) and is the median
of ``--repeats`` calls (wall clock; process CPU time beside it, which is steadier on a busy machine).

Rows:

* ``sweep chunk`` — ``sweep.compute_chunk``: the draws (threefry normals for scores and V) and
  ``metrics.evaluate`` for every config, exactly what ``run_sweep`` does per chunk.
* ``sweep chunk, 10 deltas`` — Δ = 4..13 on the same draws (one instance = one (seed, Δ)): the
  draws are paid once per seed, so the engine's share of the time is much larger.
* ``sweep chunk, V-free`` — the same with d = 1: V has one column (N normals instead of N·d; the
  scores of a seed do not depend on d), so ``mse`` is meaningless but ``mse_expected``,
  ``frac_zeroed`` and the masses are the d = 128 values. This is what a sweep that needs no
  sampled-V MSE costs.
* ``engine only`` — ``metrics.evaluate`` on instances drawn beforehand: once vmapped over the
  64 instances (one batched program) and once one instance at a time (``lax.map``).
* ``draws only`` and ``P·V dot`` — the floor set by the random draws (one instance at a time, as
  the sweep draws them, summed on the spot), and a plain batched
  (q, N) × (N, d) product of the same shapes for an achieved-GFLOP/s reference.

"GFLOP/s" counts only the P·V products (2·q·N·d per instance and config), so it says how close a
row runs to the matrix-multiply rate of the machine. "fast/scan speed-up" is the scan row's median
time over the fast row's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import metrics
from pcast_jax.presets import tagged
from pcast_jax.sweep import SweepSpec, compute_chunk, instance_key
from pcast_jax.workloads import make_instance

CONFIGS = tuple(tagged("paper"))


def _block(x):
    return jax.block_until_ready(x)


def measure(fn, repeats: int) -> dict:
    """Median wall and CPU seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    _block(fn())
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        _block(fn())
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "min_wall_s": min(walls)}


def run(*, seeds: int, n: int, q_len: int, d: int, repeats: int) -> list[dict]:
    pv_gflop = 2.0 * q_len * n * d * len(CONFIGS) * seeds / 1e9
    rows = []

    def add(name, engine, timing, instances=seeds, pv=True):
        rows.append({"row": name, "engine": engine, **timing, "instances_per_s": instances / timing["wall_s"],
                     "pv_gflops": pv_gflop * instances / seeds / timing["wall_s"] if pv else None})

    spec = dict(configs=CONFIGS, deltas=(7.0,), ns=(n,), seeds=seeds, q_len=q_len, d=d, expected_mse=False)
    for eng in ("scan", "xla"):
        s = SweepSpec(implementation=eng, **spec)
        add("sweep chunk", eng, measure(lambda s=s: compute_chunk(s, n, 0, seeds), repeats))
    deltas = tuple(float(x) for x in range(4, 14))
    for eng in ("scan", "xla"):  # Δ = 4..13 on the same draws: the engine's share grows tenfold
        s = SweepSpec(implementation=eng, **{**spec, "deltas": deltas})
        add("sweep chunk, 10 deltas", eng, measure(lambda s=s: compute_chunk(s, n, 0, seeds), repeats),
            instances=seeds * len(deltas))
    s = SweepSpec(implementation="xla", **{**spec, "expected_mse": True})
    add("sweep chunk + mse_expected", "xla", measure(lambda: compute_chunk(s, n, 0, seeds), repeats))
    s = SweepSpec(implementation="xla", **{**spec, "d": 1, "expected_mse": True})
    add("sweep chunk, V-free (d=1)", "xla", measure(lambda: compute_chunk(s, n, 0, seeds), repeats), pv=False)

    workload = SweepSpec(**spec).workload(n)
    def drawn(k):
        return make_instance(instance_key(0, n, k), workload, 7.0)

    def draw_cost(k):  # reduced at once, so the draws are not written out to memory
        inst = drawn(k)
        return jnp.sum(inst.scores) + jnp.sum(inst.v)

    keys = jnp.arange(seeds, dtype=jnp.uint32)
    draws_only = jax.jit(lambda ks: jax.lax.map(draw_cost, ks))
    add("draws only, one at a time", "-", measure(lambda: draws_only(keys), repeats), pv=False)
    draw = jax.jit(lambda ks: jax.lax.map(drawn, ks))
    inst = _block(draw(keys))
    is_sink = np.asarray(inst.is_sink[0])  # a constant, as in the sweep
    for eng in ("scan", "fast"):
        def one(scores, v, eng=eng):
            return metrics.evaluate(inst._replace(scores=scores, v=v, is_sink=is_sink), CONFIGS,
                                    implementation="scan" if eng == "scan" else "xla", expected=False)

        batched = jax.jit(jax.vmap(one))
        looped = jax.jit(lambda sc, v, one=one: jax.lax.map(lambda a: one(*a), (sc, v)))
        add("engine only, vmapped", eng, measure(partial(batched, inst.scores, inst.v), repeats))
        add("engine only, one at a time", eng, measure(partial(looped, inst.scores, inst.v), repeats))

    a = jnp.ones((seeds * len(CONFIGS), q_len, n), jnp.float32)
    b = jnp.ones((seeds * len(CONFIGS), n, d), jnp.float32)
    dot = jax.jit(partial(jnp.einsum, "bqn,bnd->bqd", precision=jax.lax.Precision.HIGHEST))
    add("P·V dot alone", "-", measure(lambda: dot(a, b), repeats))
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    scan = {r["row"]: r["wall_s"] for r in rows if r["engine"] == "scan"}
    head = ("row", "engine", "median s", "cpu s", "inst/s", "P·V GFLOP/s", "fast/scan speed-up")
    table = []
    for r in rows:
        ratio = f"{scan[r['row']] / r['wall_s']:.2f}x" if r["engine"] == "xla" and r["row"] in scan else ""
        table.append((r["row"], r["engine"], f"{r['wall_s']:.3f}", f"{r['cpu_s']:.3f}",
                      f"{r['instances_per_s']:.1f}", "-" if r["pv_gflops"] is None else f"{r['pv_gflops']:.1f}",
                      ratio))
    widths = [max(len(x[i]) for x in (head, *table)) for i in range(len(head))]
    return ["  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(x, widths)))
            for x in (head, *table)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--q-len", type=int, default=32)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (the median of at least three calls)")
    print(f"engine benchmark: {args.seeds} seeds x {len(CONFIGS)} configs, N={args.n}, q_len={args.q_len}, "
          f"d={args.d}, delta=7; jax {jax.__version__} on {jax.devices()[0].platform} "
          f"({len(jax.devices())} device(s))", flush=True)
    rows = run(seeds=args.seeds, n=args.n, q_len=args.q_len, d=args.d, repeats=args.repeats)
    for line in format_rows(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
