"""``pcast jax-fp8``: what JAX's own FP8 attention (cuDNN FP8 SDPA) does to P for your arguments."""

from __future__ import annotations

import argparse
import json
import math


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale-s", type=float, default=1.0,
                        help="fp8_params['scale_s'], the P scale passed to JAX's FP8 attention (default 1: what "
                             "JAX's own tests pass)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--seq-len", type=int, default=4096, help="KV length N (default 4096)")
    parser.add_argument("--sinks", default=None,
                        help="learned sink logits, one per head: comma-separated numbers or a .npy file "
                             "(default: no learned sink)")
    parser.add_argument("--tau", type=float, default=4.0,
                        help="cuDNN's lazy-rescale threshold in nats (default 4, its reference's default)")
    parser.add_argument("--mxfp8", action="store_true", help="the MXFP8 SDPA variant (fixed S = 16)")
    parser.add_argument("--seeds", type=int, default=8, help="draws the simulated fractions average (default 8)")
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

    r = jax_fp8.predict(scale_s=args.scale_s, head_dim=args.head_dim, seq_len=args.seq_len, sinks=_sinks(args.sinks),
                        rescale_threshold=args.tau, mxfp8=args.mxfp8, seeds=args.seeds)
    if args.format == "text":
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
    print(json.dumps({"config": r.config.to_string(), "effective_scale": r.config.effective_scale,
                      "max_scaled_p": r.max_scaled_p, "safe_scale_s": r.safe_scale_s,
                      "safe_critical_delta": r.safe_critical_delta, "seq_len": r.seq_len, "seeds": r.seeds,
                      "heads": heads}, indent=2))
    return 0
