"""``pcast whatif <analysis>``: differentiable what-if analyses (see :mod:`pcast_jax.whatif`).

Analyses: ``validate`` (surrogate gradients vs exact finite differences), ``worst-delta`` (Adam
ascent on Δ), ``optimal-scale`` (Adam over log2 S, then exact powers of two), ``calibrate``
(Prop. 3's constant and δk fitted to simulations), ``dynamic`` (per-block 2^k scale vs static
scales) and ``report`` (all of them, markdown + figures).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from pcast_jax import report
from pcast_jax.errors import PcastError

ANALYSES = ("validate", "worst-delta", "optimal-scale", "calibrate", "dynamic", "report")


def _floats(option: str, text: str) -> tuple[float, ...]:
    """``"4,5,6"`` or ``"4:13:0.5"`` (start:stop:step, stop included) → floats."""
    try:
        if ":" in text:
            a, b, c = (float(x) for x in text.split(":"))
            if c <= 0 or b < a:
                raise ValueError
            return tuple(float(x) for x in np.arange(a, b + c / 2, c))
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PcastError(f"{option}={text!r} must be comma-separated numbers or start:stop:step") from None
    if not vals or not all(math.isfinite(v) for v in vals):
        raise PcastError(f"{option}={text!r} must hold finite numbers")
    return vals


def _ints(option: str, text: str) -> tuple[int, ...]:
    vals = _floats(option, text)
    if any(v != int(v) for v in vals):
        raise PcastError(f"{option}={text!r} must be integers")
    return tuple(int(v) for v in vals)


def _common(p: argparse.ArgumentParser, *, n: int = 4096, seeds: int = 8) -> None:
    p.add_argument("--n", type=int, default=n, help=f"KV length N (default {n})")
    p.add_argument("--q-len", dest="q_len", type=int, default=32, help="query rows per instance (default 32)")
    p.add_argument("--seeds", type=int, default=seeds, help=f"seeds (instances) averaged (default {seeds})")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")
    p.add_argument("--csv", default=None, help="also write the result rows to this CSV file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS")

    p = sub.add_parser("validate", help="surrogate gradients vs finite differences of the exact simulator")
    p.add_argument("--config", default="fwd_s1", help="kernel preset with a static scale (default fwd_s1)")
    p.add_argument("--param", default="delta", choices=("delta", "sigma", "log2_scale"),
                   help="parameter to differentiate (default delta)")
    p.add_argument("--points", default=None, help="points, e.g. 4:13:1 or 5,6,7 (default per parameter)")
    p.add_argument("--step", type=float, default=None, help="finite-difference half step h (default per parameter)")
    p.add_argument("--delta", type=float, default=7.0, help="Δ where Δ is not the parameter (default 7)")
    _common(p)

    p = sub.add_parser("worst-delta", help="Δ that maximises the MSE (Adam ascent on the smooth surrogate)")
    p.add_argument("--config", default="fwd_s1,fwd_s256",
                   help="comma-separated presets with a static scale (default fwd_s1,fwd_s256)")
    p.add_argument("--objective", default="total", choices=("total", "collapse"),
                   help="total expected MSE, or Prop. 3's collapse term only (default total)")
    p.add_argument("--range", dest="delta_range", default="4,13", help="Δ range lo,hi (default 4,13)")
    p.add_argument("--steps", type=int, default=60, help="Adam steps (default 60)")
    _common(p, seeds=4)

    p = sub.add_parser("optimal-scale", help="best static S: Adam over log2 S, then exact powers of two")
    p.add_argument("--config", default="fwd_s1", help="preset fixing order and block size (default fwd_s1)")
    p.add_argument("--delta", type=float, default=7.0, help="sink strength Δ (default 7)")
    p.add_argument("--scores", default=None,
                   help=".npy file of logits (q_len, N) or (batch, q_len, N) instead of the synthetic workload")
    p.add_argument("--surrogate", default="mean", choices=("mean", "staircase"),
                   help="LSB model of the smooth surrogate (default mean)")
    p.add_argument("--start", type=float, default=0.0, help="starting log2 S (default 0)")
    p.add_argument("--steps", type=int, default=150, help="Adam steps (default 150)")
    _common(p)

    p = sub.add_parser("calibrate", help="fit Prop. 3's constant c and δk to simulations")
    p.add_argument("--config", default="fwd_s1", help="kernel preset (default fwd_s1)")
    p.add_argument("--target", default="mse", choices=("mse", "mse_expected"),
                   help="simulated quantity fitted (default mse, one V draw as in the paper)")
    p.add_argument("--deltas", default="4:13:0.5", help="Δ grid (default 4:13:0.5)")
    p.add_argument("--steps", type=int, default=300, help="Adam steps per fit (default 300)")
    _common(p, seeds=16)

    p = sub.add_parser("dynamic", help="dynamic per-block 2^k scale vs static 256 and 448")
    p.add_argument("--ns", default="1024,4096,16384", help="KV lengths (default 1024,4096,16384)")
    p.add_argument("--deltas", default="4:13:1", help="Δ grid (default 4:13:1)")
    p.add_argument("--statics", default="fwd_s256,fwd_s448", help="static presets (default fwd_s256,fwd_s448)")
    p.add_argument("--metric", default="mse_expected", choices=("mse_expected", "mse"),
                   help="compared metric (default mse_expected)")
    p.add_argument("--q-len", dest="q_len", type=int, default=32, help="query rows per instance (default 32)")
    p.add_argument("--seeds", type=int, default=8, help="seeds (default 8)")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")
    p.add_argument("--csv", default=None, help="also write the result rows to this CSV file")

    p = sub.add_parser("report", help="all analyses: DIR/whatif.md, CSV tables and figures")
    p.add_argument("--out", default="whatif-report", help="output folder (default whatif-report)")
    p.add_argument("--quick", action="store_true", help="small sizes (N = 1024, q_len = 8, few seeds)")
    p.add_argument("--base-seed", dest="base_seed", type=int, default=0, help="root PRNG seed (default 0)")


def _write_csv(path, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` (atomically, through :func:`pcast_jax.report.write_csv`) and say so."""
    if not path or not rows:
        return
    print(f"wrote {report.write_csv(path, rows)}")


def run(args: argparse.Namespace) -> int:
    from pcast_jax import whatif
    from pcast_jax.workloads import SinkWorkload

    analysis = getattr(args, "analysis", None)
    if analysis is None:
        raise PcastError(f"give an analysis: one of {', '.join(ANALYSES)}")
    t0 = time.perf_counter()
    table = whatif.markdown_table
    if analysis == "validate":
        sc = whatif.Scenario(config=args.config, n=args.n, q_len=args.q_len, seeds=args.seeds,
                             base_seed=args.base_seed)
        points = _floats("--points", args.points) if args.points else None
        rows = whatif.validate_gradients(sc, param=args.param, points=points, step=args.step,
                                         base={"delta": args.delta} if args.param != "delta" else None)
        print(table(rows, ["point", "surrogate", "exact_mse", "value_rel_err", "exact_fd", "exact_fd_sem",
                           "surrogate_grad", "grad_rel_err", "trustworthy"]))
    elif analysis == "worst-delta":
        lo_hi = _floats("--range", args.delta_range)
        if len(lo_hi) != 2:
            raise PcastError(f"--range={args.delta_range!r} must be lo,hi")
        rows = []
        for cfg in (c.strip() for c in args.config.split(",") if c.strip()):
            r = whatif.worst_case_delta(cfg, args.n, objective=args.objective, delta_range=lo_hi, seeds=args.seeds,
                                        q_len=args.q_len, steps=args.steps, base_seed=args.base_seed)
            rows += r.rows()
        print(table(rows, ["config", "objective", "worst_delta", "local_peak", "exact_local_peak",
                           "exact_mse_at_peak", "exact_global_argmax", "delta_c", "peak_in_6_9", "finals"]))
    elif analysis == "optimal-scale":
        sur = whatif.Surrogate(lsb_mode=args.surrogate, atoms="representable")
        kw = dict(config=args.config, delta=args.delta, seeds=args.seeds, surrogate=sur, start_log2_scale=args.start,
                  steps=args.steps, base_seed=args.base_seed, curve_points=0)
        if args.scores:
            try:
                scores = np.load(args.scores, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise PcastError(f"--scores={args.scores!r} is not a readable .npy array ({exc})") from None
            r = whatif.optimal_scale(scores=scores, **kw)
        else:
            r = whatif.optimal_scale(SinkWorkload(n=args.n, q_len=args.q_len), **kw)
        rows = r.rows()
        print(f"{r.source}: Adam ({r.surrogate}) from log2 S = {r.start_log2_scale:g} ended at "
              f"log2 S = {r.continuous_log2_scale:.3f} (S = {2 ** r.continuous_log2_scale:.1f}); best neighbouring "
              f"power of two (exact) = {r.best_neighbour:g}; best power of two = {r.best_power:g}; "
              f"MSE(448)/MSE(256) = {r.at_448 / r.at_256:.4f}")
        print(table(rows, ["scale", "exact_mse", "rel_to_256", "dp", "normal_coverage"]))
    elif analysis == "calibrate":
        r = whatif.calibrate_prop3(args.config, args.n, deltas=_floats("--deltas", args.deltas), seeds=args.seeds,
                                   target=args.target, q_len=args.q_len, steps=args.steps, base_seed=args.base_seed)
        rows = r.rows()
        print(table(rows, ["model", "parameter", "mean", "sd_over_seeds", "boot95_lo", "boot95_hi"]))
    elif analysis == "dynamic":
        statics = tuple(s.strip() for s in args.statics.split(",") if s.strip())
        r = whatif.dynamic_vs_static(statics=statics, deltas=_floats("--deltas", args.deltas),
                                     ns=_ints("--ns", args.ns), seeds=args.seeds, metric=args.metric,
                                     q_len=args.q_len, base_seed=args.base_seed)
        rows = r.rows()
        print(table(rows))
    else:  # report
        out = Path(args.out)
        rep = whatif.report(quick=args.quick, out_dir=out, base_seed=args.base_seed)
        md_path = report.write_text(out / "whatif.md", rep.markdown)
        for path in rep.write_tables(out):
            print(f"wrote {path}")
        print(f"wrote {md_path} and {len(rep.figures)} figures")
        rows = []
    if analysis != "report":
        _write_csv(args.csv, rows)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0
