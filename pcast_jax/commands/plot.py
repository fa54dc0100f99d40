"""``pcast plot SWEEP_DIR``: one metric of a finished sweep against Δ or N, as a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from pcast_jax.commands import _options

HELP = "Plot a finished sweep's metric against Δ or N (PNG, in the reproduction figures' style)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR", help="a finished sweep's folder (pcast sweep --out)")
    parser.add_argument("--x", default="delta", choices=("delta", "n"), help="horizontal axis (default delta)")
    parser.add_argument("--y", default="mse",
                        help="metric: mse, mse_expected, frac_zeroed, zeroed_mass or nonsink_mass (default mse)")
    parser.add_argument("--configs", default=None, help="comma-separated config names to draw (default all)")
    parser.add_argument("--scale", dest="y_scale", default="auto", choices=("auto", "log", "linear"),
                        help="vertical axis: log for the MSE metrics, else linear (default auto)")
    parser.add_argument("--out", default=None, metavar="FILE.png",
                        help="where the PNG goes (default SWEEP_DIR/plot_<y>_vs_<x>.png)")


def run(args: argparse.Namespace) -> int:
    from pcast_jax import report
    from pcast_jax.errors import PcastError
    from pcast_jax.metrics import METRICS
    from pcast_jax.sweep import load_result

    if args.y not in METRICS:
        raise PcastError(f"--y={args.y!r} is not a sweep metric; choose from {', '.join(METRICS)}")
    result = load_result(args.sweep_dir)
    configs = None
    if args.configs is not None:
        configs = _options.items("--configs", args.configs)
        unknown = [c for c in configs if c not in result.spec.config_names]
        if unknown:
            raise PcastError(f"--configs: {unknown} not in the sweep's configs {', '.join(result.spec.config_names)}")
    fig = report.sweep_figure(result, x=args.x, y=args.y, configs=configs,
                              log_y=None if args.y_scale == "auto" else args.y_scale == "log")
    out = Path(args.out) if args.out else Path(args.sweep_dir) / f"plot_{args.y}_vs_{args.x}.png"
    if out.suffix.lower() != ".png":
        raise PcastError(f"--out={str(out)!r} must end in .png")
    print(f"wrote {report.save_figure(fig, out)}")
    return 0
