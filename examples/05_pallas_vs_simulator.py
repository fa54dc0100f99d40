"""A Pallas FP8 attention kernel against the simulator

Runs ``pallas_kernels.fp8_attention`` — the Pallas FP8 (E4M3) attention forward whose P-cast
follows a :class:`pcast_jax.KernelConfig` — on FP8 Q/K/V with attention sinks, for two presets,
with both backends (Mosaic GPU and Triton). Without a GPU the kernels run in Pallas interpret
mode on the CPU. Each output is compared with ``pallas_kernels.simulate_fp8_attention``, the
simulator on the same FP8 values, as ``tests/test_pallas.py`` compares them: the per-row count of
P values the cast zeroed must be identical, the softmax denominators and the outputs equal to
FP32 rounding (|out − sim| ≤ 2e-6·max|V| + 2e-6·|sim|) in interpret mode; on a GPU, where the
kernel's exp differs from XLA's by ulps, the tests' looser GPU rule applies. The script prints the
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

#: q_descale·k_descale·scale = 1/√d and v_descale = 2: powers of two, so kernel and
#: simulator see bit-identical scores and V (the descales tests/test_pallas.py uses).
DESCALES = {"q_descale": 0.5, "k_descale": 0.25, "v_descale": 2.0}
SCALE_FACTOR = 8.0
#: Interpret mode: only the summation order of ℓ and P8·V differs from the simulator.
INTERPRET_TOL = {"rtol": 2e-6, "atol_per_v": 2e-6, "fraction": 1.0, "loose_atol_per_v": 2e-6, "flips": 0,
                 "row_sum_rtol": 2e-6}
#: On a GPU the kernel's exp differs from XLA's by ulps, so a rare P lands on the other side of an
#: E4M3 rounding boundary (tests/test_pallas.py's GPU rule; not yet run on a GPU).
GPU_TOL = {"rtol": 1e-3, "atol_per_v": 1e-3, "fraction": 0.999, "loose_atol_per_v": 5e-2, "flips": 8,
           "row_sum_rtol": 1e-5}
DELTAS = (7.0, 10.0)


def compare(out, stats, sim, v_max: float, tol: dict) -> dict:
    """The kernel's output and statistics against the simulator's, by ``tol``'s rule."""
    out, ref = np.asarray(out), np.asarray(sim.out)
    err = np.abs(out - ref)
    tight = err <= tol["atol_per_v"] * v_max + tol["rtol"] * np.abs(ref)
    flips = np.abs(np.asarray(stats.n_zeroed) - np.asarray(sim.n_zeroed))
    row_sum_rel = np.abs(np.asarray(stats.row_sum) / np.asarray(sim.row_sum) - 1)
    return {"max_abs_diff": float(err.max()), "max_abs_diff_per_max_v": float(err.max() / v_max),
            "row_sum_max_rel_diff": float(row_sum_rel.max()), "zero_count_max_diff": int(flips.max()),
            "zeroed_per_delta": np.asarray(stats.n_zeroed).sum(axis=(1, 2)).tolist(),
            "outputs_equal": bool(np.all(np.isfinite(out)) and np.mean(tight) >= tol["fraction"]
                                  and err.max() <= tol["loose_atol_per_v"] * v_max),
            "row_sums_equal": bool(row_sum_rel.max() <= tol["row_sum_rtol"]),
            "zero_counts_equal": bool(flips.max() <= tol["flips"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for comparison.json (default: a temp dir)")
    parser.add_argument("--presets", default="fwd_s1,rev_s256", help="comma-separated preset names")
    parser.add_argument("--backends", default="mosaic,triton", help="comma-separated: mosaic, triton")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example05_"))
    out.mkdir(parents=True, exist_ok=True)
    interpret = jax.default_backend() != "gpu"
    tol = INTERPRET_TOL if interpret else GPU_TOL

    # One batch element per sink strength Δ: (batch, heads, T, d) FP8 arrays.
    w = sink_qkv(jax.random.key(1234), deltas=DELTAS, heads=1, kv_heads=1, q_len=64, n=256, head_dim=128)
    kwargs = {"scale": SCALE_FACTOR * w.softmax_scale, **DESCALES}
    v_max = DESCALES["v_descale"] * float(jnp.max(jnp.abs(w.v.astype(jnp.float32))))
    print(f"Q/K/V: {w.q.dtype}, q {tuple(w.q.shape)}, k/v {tuple(w.k.shape)}; delta = {DELTAS}; "
          f"{'interpret mode on ' + jax.default_backend() if interpret else 'on the GPU'}")

    report, failures = [], []
    for preset in args.presets.split(","):
        sim = pk.simulate_fp8_attention(w.q, w.k, w.v, config=preset, **kwargs)
        for backend in args.backends.split(","):
            o, stats = pk.fp8_attention(w.q, w.k, w.v, config=preset, implementation=backend, interpret=interpret,
                                        return_stats=True, **kwargs)
            row = {"preset": preset, "backend": backend, **compare(o, stats, sim, v_max, tol)}
            report.append(row)
            flips = row["zero_count_max_diff"]
            print(f"{preset:>9} {backend:>6}: max |kernel - simulator| = {row['max_abs_diff']:.2e} "
                  f"({row['max_abs_diff_per_max_v']:.1e} of max|V|), P zeroed at delta {DELTAS}: "
                  f"{', '.join(map(str, row['zeroed_per_delta']))}; zero counts "
                  f"{'identical' if flips == 0 else f'differ by up to {flips} per row'}")
            if not (row["outputs_equal"] and row["row_sums_equal"] and row["zero_counts_equal"]):
                failures.append(f"{preset}/{backend}")
    (out / "comparison.json").write_text(json.dumps(report, indent=2))
    if failures:
        raise SystemExit(f"kernel and simulator differ for {', '.join(failures)} (see {out / 'comparison.json'})")
    print(f"OK: {len(report)} kernel runs equal the simulator "
          f"({'zero counts identical, outputs to FP32 rounding' if interpret else 'within the GPU tolerance'})")


if __name__ == "__main__":
    main()
