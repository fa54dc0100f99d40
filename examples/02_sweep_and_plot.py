"""A small sweep, its table and a figure

Runs one :class:`pcast_jax.SweepSpec` — three kernel presets (forward order with no scale,
reverse order and forward order with the static scale S = 256) over a few sink strengths Δ on
small synthetic sink workloads — with :func:`pcast_jax.run_sweep` into a results folder, loads
it back with :func:`pcast_jax.load_result`, prints mean ± standard error of the fraction of
non-sink P the cast zeroes and of the output MSE, and draws both against Δ with matplotlib,
beside Eq. (7)'s closed form for the two forward-order kernels. Running it again with the same
``--out`` resumes from the chunks on disk (nothing is recomputed).

Run it with::

    .venv/bin/python examples/02_sweep_and_plot.py [--out DIR] [--seeds 8]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import pcast_jax as pj  # noqa: E402

CONFIGS = ("fwd_s1", "rev_s256", "fwd_s256")
DELTAS = (3.0, 5.0, 7.0, 9.0, 11.0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder parent (default: a temp dir)")
    parser.add_argument("--seeds", type=int, default=8, help="instances per (config, Δ)")
    parser.add_argument("--n", type=int, default=1024, help="KV length N")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example02_"))
    out.mkdir(parents=True, exist_ok=True)

    spec = pj.SweepSpec(configs=CONFIGS, deltas=DELTAS, ns=(args.n,), seeds=args.seeds, q_len=16, d=64)
    pj.run_sweep(spec, out_dir=out / "sweep", progress=False)
    res = pj.load_result(out / "sweep")  # what another script (or `pcast plot`) would read

    print(f"sweep: {len(CONFIGS)} configs x {len(DELTAS)} deltas x {args.seeds} seeds, N = {args.n}, "
          f"q_len = {spec.q_len}, d = {spec.d}")
    print(f"{'config':>9} {'delta':>6} {'frac. zeroed':>18} {'MSE':>22}")
    for row in res.summary_rows():
        print(f"{row['config']:>9} {row['delta']:6.1f} "
              f"{row['frac_zeroed_mean']:8.4f} ± {row['frac_zeroed_sem'] or 0:7.4f} "
              f"{row['mse_mean']:10.3e} ± {row['mse_sem'] or 0:9.2e}")
        if not np.isfinite(row["mse_mean"]):
            raise SystemExit(f"non-finite MSE for {row['config']} at delta {row['delta']}")

    fig, (ax_z, ax_m) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    deltas = np.asarray(DELTAS)
    for config in CONFIGS:
        for ax, metric in ((ax_z, "frac_zeroed"), (ax_m, "mse")):
            x = res.get(metric, config=config, n=args.n)  # (delta, seed)
            sem = x.std(axis=-1, ddof=1) / np.sqrt(x.shape[-1])
            ax.errorbar(deltas, x.mean(axis=-1), yerr=sem, marker="o", capsize=3, label=config)
    fine = np.linspace(deltas[0], deltas[-1], 81)
    for scale, style in ((1.0, "k--"), (256.0, "k:")):
        frac = np.asarray(pj.theory.collapse_fraction(fine, scale))
        ax_z.plot(fine, frac, style, label=f"Eq. (7), fwd S = {scale:g}")
    ax_z.set(xlabel="sink strength Δ", ylabel="fraction of non-sink P zeroed", title="P-collapse")
    ax_m.set(xlabel="sink strength Δ", ylabel="output MSE", yscale="log", title="error vs exact attention")
    for ax in (ax_z, ax_m):
        ax.legend()
    figure = out / "sweep_delta.png"
    fig.savefig(figure, dpi=100)
    plt.close(fig)

    worst = res.mean("mse", config="fwd_s1", n=args.n) / res.mean("mse", config="rev_s256", n=args.n)
    print(f"MSE of fwd_s1 over rev_s256 per delta: {', '.join(f'{r:.2f}' for r in worst)}")
    print(f"OK: results in {out / 'sweep'}, figure {figure}")


if __name__ == "__main__":
    main()
