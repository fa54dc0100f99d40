"""``pcast doctor``: from a deployment (engine, backend, GPU, checkpoint scales) to the kernel it runs,
what it does to P, a verdict over a Δ range and the one setting to change."""

from __future__ import annotations

import argparse
import json

from pcast_jax.commands import _options

HELP = "From a deployment (engine, backend, GPU, checkpoint) to its kernel, a P-collapse verdict and the fix."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, help="vllm, sglang, tensorrt-llm, jax, transformer-engine, "
                                                         "flash-attention, sageattention or aiter")
    parser.add_argument("--backend", required=True, help="the engine's attention backend (e.g. vllm: triton_attn, "
                                                          "flash_attn, flashinfer; jax: cudnn)")
    parser.add_argument("--gpu", required=True, help="GPU architecture: sm90, sm100, sm120, gfx942 or gfx950")
    parser.add_argument("--kv-cache-dtype", default="fp8", help="fp8 or fp8_e4m3 (default fp8)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a checkpoint folder: its q/k/v/prob_scale tensors are read (never the weights)")
    parser.add_argument("--prob-scale", type=float, default=None,
                        help="the prob_scale the engine uses (where it sets the P scale: S = 1/prob_scale)")
    parser.add_argument("--scale-s", type=float, default=None, help="the scale_s the caller passes (jax cudnn)")
    parser.add_argument("--delta", default="4:12:2",
                        help="sink strengths Δ to test: a value, a list or start:stop:step (default 4:12:2)")
    parser.add_argument("--learned-sink", action="store_true",
                        help="a learned sink logit (gpt-oss sinks) instead of four token sinks at the front")
    parser.add_argument("--seeds", default="4", help="draws per Δ, 2..256 (default 4)")
    _options.add_trace_arguments(parser, trace_does="the verdict and the fix on it, as pcast analyze computes "
                                                    "them, instead of over a Δ range",
                                 model_adds="adds KL, top-1 agreement and perplexity per kernel")
    parser.add_argument("--mass-limit", default="1e-3", metavar="X",
                        help="with --trace: the worst head's zeroed and clipped mass limit, in (0, 1) (default 1e-3)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    _options.add_progress_argument(parser, "with --trace: progress lines on stderr (layers done, rows, time left)",
                                   "on")


def run(args: argparse.Namespace) -> int:
    from pcast_jax import deployments, report
    from pcast_jax.errors import PcastError

    row = deployments.find(args.engine, args.backend, args.gpu, args.kv_cache_dtype)
    deltas = _options.floats("--delta", args.delta, max_count=64)
    seeds = _options.ints("--seeds", args.seeds, min_value=1)
    if len(seeds) != 1 or not 2 <= seeds[0] <= 256:
        raise PcastError(f"--seeds={args.seeds!r} must be one integer in [2, 256] (a verdict needs a standard error)")
    given = {k: v for k, v in (("prob_scale", args.prob_scale), ("scale_s", args.scale_s)) if v is not None}
    if len(given) > 1 or (given and row.knob not in given):
        names = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        through = "nothing (S is fixed by the kernel)" if row.knob == "none" else "--" + row.knob.replace("_", "-")
        raise PcastError(f"{names}: {row.engine} {row.backend} sets the P scale through {through}")
    knob_value = next(iter(given.values()), None)
    if knob_value is not None:
        deployments.scale_from_knob(row.knob, knob_value, row.knob_factor)  # refuses 0, NaN, negatives
    scales = deployments.checkpoint_scales(args.checkpoint) if args.checkpoint else {}
    if args.model is not None and args.trace is None:
        raise PcastError("--model needs --trace (the model's trace: its tokens run through the model)")
    if args.progress is not None and args.trace is None:
        raise PcastError("--progress/--no-progress: only with --trace (the analysis of a trace is what takes long)")
    if args.trace is not None:
        return _on_trace(args, row, knob_value, scales)
    diag = deployments.diagnose(row, knob_value=knob_value, scales=scales, deltas=deltas, seeds=seeds[0],
                                learned_sink=args.learned_sink)
    if args.format == "json":
        print(json.dumps(report.json_value(diag.to_dict()), indent=1, ensure_ascii=False))
        return 0
    _print_deployment(args, row, scales)
    print(f"  criterion: zeroed mass ≤ {deployments.ZEROED_MASS_LIMIT:g} and clipped mass ≤ "
          f"{deployments.CLIPPED_MASS_LIMIT:g} of the softmax (mean over query rows), at every Δ, decided when "
          f"mean ± {deployments.Z:g} s.e. over the seeds excludes the limit")
    print()
    print(report.markdown_table(diag.rows, [("preset", "preset"),
                                            ("scale", "S", lambda x: x if isinstance(x, str) else f"{x:g}"),
                                            ("delta", "Δ", lambda x: f"{x:g}"),
                                            ("zeroed_mass", "zeroed mass", report.fmt_sci),
                                            ("zeroed_mass_sem", "± s.e.", report.fmt_sci),
                                            ("clipped_mass", "clipped mass", report.fmt_sci),
                                            ("clipped_mass_sem", "± s.e.", report.fmt_sci),
                                            ("frac_zeroed", "non-sink P zeroed", report.fmt_pct),
                                            ("verdict", "vs limit")],
                                name="doctor"))
    print()
    word = {True: "safe", False: "P-collapse", None: "undecided"}[diag.safe]
    print(f"Verdict: {word} — {diag.advice}.")
    return 0


def _print_deployment(args: argparse.Namespace, row, scales: dict) -> None:
    print(f"{row.engine} {row.backend} on {args.gpu} runs: {', '.join(row.presets)}")
    print(f"  picked by: {row.source}")
    if row.note:
        print(f"  note: {row.note}")
    print(f"  P scale set by: {'the kernel (no knob)' if row.knob == 'none' else row.knob}")
    if args.checkpoint:
        for kind, found in scales.items():
            if found:
                vals = sorted(set(found.values()))
                print(f"  checkpoint {kind}: {len(found)} tensors, {vals[0]:g}"
                      f"{'' if len(vals) == 1 else f' … {vals[-1]:g}'}"
                      f"{'' if kind == row.knob else ' (not used for P by this backend)'}")
        if row.knob == "prob_scale" and not scales.get("prob_scale"):
            print("  checkpoint prob_scale: none — the engine uses 1.0 (S = 1)")


def _on_trace(args: argparse.Namespace, row, knob_value, scales: dict) -> int:
    """``--trace``: the deployment's kernels analysed on the model's trace (``analysis.diagnose_trace``)."""
    from pcast_jax import report
    from pcast_jax.analysis import diagnose_trace
    from pcast_jax.analysis.report import report_data
    from pcast_jax.commands.analyze import model_logits

    mass_limit = _options.number("--mass-limit", args.mass_limit, positive=True)
    trace = _options.read_trace("trace file", args.trace)
    logits_fn = None if args.model is None else model_logits(args.model, trace)
    diag = diagnose_trace(row, trace, knob_value=knob_value, scales=scales, mass_limit=mass_limit,
                          logits_fn=logits_fn, progress=_options.progress_lines(args.progress))
    if args.format == "json":
        data = {**diag.to_dict(), "analysis": report_data(diag.analysis)}
        print(json.dumps(report.json_value(data), indent=1, ensure_ascii=False))
        return 0
    _print_deployment(args, row, scales)
    print()
    print("\n".join(diag.analysis.summary_lines()))
    print(f"Verdict on this model: {'safe to serve' if diag.safe else 'not safe to serve'} — {diag.advice}.")
    return 0
