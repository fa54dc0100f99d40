"""A Pallas FP8 attention kernel against the simulator

Runs ``pallas_kernels.fp8_attention`` — the Pallas FP8 (E4M3) attention forward whose P-cast
follows a :class:`pcast_jax.KernelConfig` — on FP8 Q/K/V with attention sinks, for two presets,
with both backends (Mosaic GPU and Triton). Without a GPU the kernels run in Pallas interpret
mode on the CPU. Each output is compared with ``pallas_kernels.simulate_fp8_attention``, the
simulator on the same FP8 values, as ``tests/test_pallas.py`` compares them: the per-row count of
P values the cast zeroed must be identical, the softmax denominators and the outputs equal to
FP32 rounding (|out − sim| ≤ 2e-6·max|V| + 2e-6·|sim| in interpret mode). The script prints the
largest differences and how many P each kernel zeroed, and fails if any comparison does.

Run it with::

    .venv/bin/python examples/05_pallas_vs_simulator.py [--out DIR] [--presets fwd_s1,rev_s256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.workloads import sink_qkv

#: q_descale·k_descale·softmax_scale = 1/√d and v_descale = 2: powers of two, so kernel and
#: simulator see bit-identical scores and V (the descales tests/test_pallas.py uses).
DESCALES = {"q_descale": 0.5, "k_descale": 0.25, "v_descale": 2.0}
SCALE_FACTOR = 8.0
RTOL, ATOL_PER_V = 2e-6, 2e-6  # interpret mode: only the summation order of ℓ and P8·V differs
DELTAS = (7.0, 10.0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for comparison.json (default: a temp dir)")
    parser.add_argument("--presets", default="fwd_s1,rev_s256", help="comma-separated preset names")
    parser.add_argument("--backends", default="mosaic,triton", help="comma-separated: mosaic, triton")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example05_"))
    out.mkdir(parents=True, exist_ok=True)
    interpret = jax.default_backend() != "gpu"

    # One batch element per sink strength Δ: (batch, heads, T, d) FP8 arrays.
    w = sink_qkv(jax.random.key(1234), deltas=DELTAS, heads=1, kv_heads=1, q_len=64, n=256, head_dim=128)
    kwargs = {"softmax_scale": SCALE_FACTOR * w.softmax_scale, **DESCALES}
    v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
    print(f"Q/K/V: {w.q.dtype}, q {tuple(w.q.shape)}, k/v {tuple(w.k.shape)}; delta = {DELTAS}; "
          f"{'interpret mode on ' + jax.default_backend() if interpret else 'on the GPU'}")

    report, failures = [], []
    for preset in args.presets.split(","):
        sim = pk.simulate_fp8_attention(w.q, w.k, w.v, config=preset, **kwargs)
        for backend in args.backends.split(","):
            o, stats = pk.fp8_attention(w.q, w.k, w.v, config=preset, backend=backend, interpret=interpret,
                                        return_stats=True, **kwargs)
            o, ref = np.asarray(o), np.asarray(sim.out)
            err = np.abs(o - ref)
            zeroed = np.asarray(stats.n_zeroed).sum(axis=(1, 2))  # per Δ
            within = np.all(np.isfinite(o)) and np.all(err <= ATOL_PER_V * v_max + RTOL * np.abs(ref))
            row_sum_rel = np.abs(np.asarray(stats.row_sum) / np.asarray(sim.row_sum) - 1)
            row = {"preset": preset, "backend": backend, "max_abs_diff": float(err.max()),
                   "max_abs_diff_per_max_v": float(err.max() / v_max),
                   "row_sum_max_rel_diff": float(row_sum_rel.max()), "zeroed_per_delta": zeroed.tolist(),
                   "zero_counts_equal": bool(np.array_equal(np.asarray(stats.n_zeroed), np.asarray(sim.n_zeroed))),
                   "outputs_equal": bool(within),
                   "row_sums_equal": bool(row_sum_rel.max() <= RTOL)}
            report.append(row)
            print(f"{preset:>9} {backend:>6}: max |kernel - simulator| = {row['max_abs_diff']:.2e} "
                  f"({row['max_abs_diff_per_max_v']:.1e} of max|V|), P zeroed at delta {DELTAS}: "
                  f"{', '.join(map(str, row['zeroed_per_delta']))}; zero counts "
                  f"{'identical' if row['zero_counts_equal'] else 'DIFFER'}")
            if not (row["outputs_equal"] and row["row_sums_equal"] and row["zero_counts_equal"]):
                failures.append(f"{preset}/{backend}")
    (out / "comparison.json").write_text(json.dumps(report, indent=2))
    if failures:
        raise SystemExit(f"kernel and simulator differ for {', '.join(failures)} (see {out / 'comparison.json'})")
    print(f"OK: {len(report)} kernel runs equal the simulator (zero counts identical, outputs to FP32 rounding)")


if __name__ == "__main__":
    main()
