"""``pcast jax-fp8``: what JAX's own FP8 attention (cuDNN FP8 SDPA) does to P, on synthetic logits or on
your model's trace, and the ``scale_s`` to pass."""

from __future__ import annotations

import argparse
import json
import math
import sys

from pcast_jax.commands import _options
from pcast_jax.criterion import MASS_LIMIT

#: Arguments that describe synthetic logits only (refused with --trace, which has its own).
_SYNTHETIC = ("head_dim", "seq_len", "sinks", "seeds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options.add_trace_arguments(parser, trace_does="scan scale_s on it and print the one to pass",
                                 model_adds="adds KL and top-1 agreement per scale_s")
    parser.add_argument("--gpu", default=None,
                        help="hopper, blackwell or sm120 (sm90, sm100): the cuDNN engine the answer is about "
                             "(blackwell, sm120: the open kernels, which ignore scale_s; hopper: the closed "
                             "engine's test reference, tau 0); default blackwell, said in the output")
    parser.add_argument("--tau", type=float, default=None,
                        help="the lazy-rescale threshold in nats of cuDNN's older test reference "
                             "(CUDNN_RESCALE_THRESHOLD): without --gpu, asks that reference at this tau; refused "
                             "with a --gpu whose engine does otherwise")
    parser.add_argument("--scale-s", type=float, default=None,
                        help="fp8_params['scale_s'], the P scale passed to JAX's FP8 attention (default 1: what "
                             "JAX's own tests pass); with --trace, the one you pass now (a row of the scan)")
    parser.add_argument("--mass-limit", type=float, default=None,
                        help="with --trace: the mass the worst head may lose to zeroed P, and have clipped "
                             f"(default {MASS_LIMIT:g}, as pcast analyze)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; synthetic logits)")
    parser.add_argument("--seq-len", type=int, default=None, help="KV length N (default 4096; synthetic logits)")
    parser.add_argument("--sinks", default=None,
                        help="learned sink logits, one per head: comma-separated numbers or a .npy file "
                             "(default: no learned sink; synthetic logits)")
    parser.add_argument("--mxfp8", action="store_true",
                        help="the MXFP8 SDPA variant (blackwell: the open kernel casts P as the per-tensor one)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="draws the simulated fractions average (default 8; synthetic logits)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")


def _sinks(text: str | None):
    if text is None or text.endswith(".npy"):
        return text
    from pcast_jax.errors import PcastError

    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise PcastError(f"--sinks={text!r} must be comma-separated numbers or a .npy file") from None


def run(args: argparse.Namespace) -> int:
    from pcast_jax import jax_fp8
    from pcast_jax.errors import PcastError

    jax_fp8.gpu_engine(args.gpu, args.tau, mxfp8=args.mxfp8, names=("--gpu", "--tau"))  # refused here, naming them
    for flag, dest in (("--scale-s", "scale_s"), ("--mass-limit", "mass_limit")):  # before any work
        if getattr(args, dest) is not None:
            _options.number(flag, getattr(args, dest), positive=True)
    if args.mass_limit is not None and not args.mass_limit < 1:
        raise PcastError(f"--mass-limit={args.mass_limit!r} must be below 1 (a share of the attention mass)")
    if args.trace is None:
        given = [f"--{name.replace('_', '-')}" for name in ("model", "mass_limit") if getattr(args, name) is not None]
        if given:
            raise PcastError(f"{', '.join(given)}: only with --trace (your model's recorded Q/K/V)")
        r = jax_fp8.predict(scale_s=args.scale_s, head_dim=args.head_dim, seq_len=args.seq_len,
                            sinks=_sinks(args.sinks), rescale_threshold=args.tau, gpu=args.gpu, mxfp8=args.mxfp8,
                            seeds=args.seeds)
        return _print_synthetic(r, args.format)
    given = [f"--{name.replace('_', '-')}" for name in _SYNTHETIC if getattr(args, name) is not None]
    if given:
        raise PcastError(f"{', '.join(given)}: synthetic logits' options, but --trace was given (the trace has its "
                         "own heads, lengths and sinks)")
    if args.mxfp8 and args.tau is not None:
        raise PcastError("--mxfp8 with --trace and --tau: the older MXFP8 reference fixes S = 16, there is no "
                         "scale_s to choose (pcast analyze TRACE --configs cudnn_mxfp8 analyses it)")
    trace = _options.read_trace("trace file", args.trace)
    logits_fn = None
    if args.model is not None:
        from pcast_jax.commands.analyze import model_logits

        logits_fn = model_logits(args.model, trace)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    r = jax_fp8.predict(trace=trace, scale_s=args.scale_s, rescale_threshold=args.tau, gpu=args.gpu,
                        mxfp8=args.mxfp8, logits_fn=logits_fn, mass_limit=args.mass_limit, progress=say)
    if args.format == "text":
        print(r.summary())
        return 0
    from pcast_jax import report

    print(json.dumps(report.json_value({"gpu": r.gpu, "config": r.config.to_string(), "tau": r.config.rescale_threshold,
                                        "scale_s_reaches_p": r.scale_s_reaches_p,
                                        "mass_limit": r.mass_limit, "given_scale_s": r.given_scale_s,
                                        "candidates": r.rows(), "recommended_scale_s": r.recommended,
                                        "answer": r.answer()}), indent=2, ensure_ascii=False))
    return 0


def _print_synthetic(r, fmt: str) -> int:
    from pcast_jax import jax_fp8

    if fmt == "text":
        print(r.summary())
        return 0
    heads = []
    for h in range(len(r.sinks)):
        heads.append({"sink_logit": None if r.sinks[h] == float("-inf") else float(r.sinks[h]),
                      "theory_frac_zeroed": (jax_fp8.NO_THEORY if math.isnan(r.theory_frac_zeroed[h])
                                             else float(r.theory_frac_zeroed[h])),
                      **{k: float(getattr(r, k)[h]) for k in ("frac_zeroed", "zeroed_mass", "frac_saturated",
                                                               "saturated_mass")},
                      **{f"{k}_sem": float(v[h]) for k, v in r.sem.items()}})
    print(json.dumps({"gpu": r.gpu, "config": r.config.to_string(), "scale_s": r.scale_s,
                      "scale_s_reaches_p": r.scale_s_reaches_p, "effective_scale": r.config.effective_scale,
                      "max_scaled_p": r.max_scaled_p, "safe_scale_s": r.safe_scale_s,
                      "safe_critical_delta": r.safe_critical_delta, "seq_len": r.seq_len, "seeds": r.seeds,
                      "heads": heads}, indent=2))
    return 0
