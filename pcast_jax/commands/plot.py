"""``pcast plot SWEEP_DIR``: one metric of a finished sweep against Δ or N, as PNG, PDF or SVG."""

from __future__ import annotations

import argparse
from pathlib import Path

from pcast_jax.commands import _options
from pcast_jax.quantities import METRICS

HELP = "Plot a finished sweep's metric against Δ or N (PNG, PDF or SVG, in the reproduction figures' style)."
_COORDS = ("config", "n", "delta")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR", help="a finished sweep's folder (pcast sweep --out)")
    parser.add_argument("--x", default="delta", choices=("delta", "n"),
                        help="horizontal axis; it needs two or more values in the sweep (default delta)")
    parser.add_argument("--y", default="mse", help=f"metric: {', '.join(METRICS)} (default mse)")
    parser.add_argument("--configs", default=None, help="comma-separated config names to draw (default all)")
    parser.add_argument("--hue", default="config", choices=_COORDS,
                        help="coordinate the line colours follow (default config)")
    parser.add_argument("--col", default=None, choices=_COORDS,
                        help="coordinate to facet by: one panel per value (default one panel)")
    parser.add_argument("--scale", dest="y_scale", default="auto", choices=("auto", "log", "linear"),
                        help="vertical axis: log for the MSE metrics, else linear (default auto)")
    parser.add_argument("--x-scale", dest="x_scale", default="auto", choices=("auto", "log", "linear"),
                        help="horizontal axis: log for a size (N), linear for Δ (default auto)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="where the figure goes; .png, .pdf or .svg picks the format "
                             "(default SWEEP_DIR/plot_<y>_vs_<x>.png)")


def run(args: argparse.Namespace) -> int:
    from pcast_jax import report
    from pcast_jax.errors import PcastError
    from pcast_jax.sweep import load_result

    if args.y not in METRICS:
        raise PcastError(f"--y={args.y!r} is not a sweep metric; choose from {', '.join(METRICS)}")
    out = Path(args.out) if args.out else Path(args.sweep_dir) / f"plot_{args.y}_vs_{args.x}.png"
    try:
        report.figure_format(out)
    except PcastError:
        raise PcastError(f"--out={str(out)!r} must end in .png, .pdf or .svg (the extension picks the "
                         "format)") from None
    result = load_result(args.sweep_dir)
    configs = None
    if args.configs is not None:
        configs = _options.items("--configs", args.configs)
        unknown = [c for c in configs if c not in result.spec.config_names]
        if unknown:
            raise PcastError(f"--configs: {unknown} not in the sweep's configs {', '.join(result.spec.config_names)}")
    if args.x in (args.hue, args.col) or (args.col is not None and args.col == args.hue):
        raise PcastError(f"--x {args.x}, --hue {args.hue} and --col {args.col} must name different coordinates")

    def scale(v):
        return None if v == "auto" else v == "log"

    fig = report.sweep_figure(result, x=args.x, y=args.y, configs=configs, log_y=scale(args.y_scale),
                              log_x=scale(args.x_scale), hue=args.hue, col=args.col)
    print(f"wrote {report.save_figure(fig, out)}")
    return 0
