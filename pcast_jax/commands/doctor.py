"""``pcast doctor``: from a deployment (engine, backend, GPU, checkpoint scales) to the kernel it runs,
whether it can run the model (with a trace), what it does to P, a verdict and the one setting to change."""

from __future__ import annotations

import argparse
import json

from pcast_jax.commands import _options

#: Defaults of the Δ range's options and of --mass-limit (None in the parser: a flag given is told from one not).
DEFAULT_DELTA, DEFAULT_SEEDS, DEFAULT_MASS_LIMIT = "4:12:2", "4", "1e-3"
#: The Δ range's options (flag, dest): refused with --trace, which has its own sinks.
_SYNTHETIC = (("--delta", "delta"), ("--learned-sink", "learned_sink"), ("--seeds", "seeds"))

HELP = ("From a deployment (engine, backend, GPU, checkpoint) to its kernel, whether it can run your model (with "
        "--trace), a P-collapse verdict and the fix.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pcast_jax import deployment_table as table  # data only: no JAX for --help

    parser.add_argument("--engine", required=True, help=f"the engine: {_words(table.ENGINES)}")
    backends = "; ".join(f"{engine}: {', '.join(names)}" for engine, names in table.BACKENDS.items())
    parser.add_argument("--backend", required=True,
                        help=f"the engine's attention backend ({backends}); an unknown one is refused with the known "
                             "ones listed")
    parser.add_argument("--gpu", required=True, help=f"GPU architecture: {_words(table.GPUS)}")
    parser.add_argument("--kv-cache-dtype", default="fp8",
                        help=f"{_words(table.KV_CACHE_DTYPES)} (default fp8; auto: the cache in the model dtype, "
                             "where the engine then casts no P to FP8); a backend that takes only some is refused "
                             "with the others")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a checkpoint folder: its q/k/v/prob_scale tensors are read (never the weights)")
    parser.add_argument("--prob-scale", type=float, default=None,
                        help="the prob_scale the engine uses, where it sets the P scale (vllm rocm_flash: S = "
                             "1/(2·prob_scale) on gfx942, whose FNUZ loader doubles it)")
    parser.add_argument("--scale-s", type=float, default=None,
                        help="the scale_s the caller passes, where it reaches P (jax cudnn on sm90; the open "
                             "sm100 / sm120 kernels ignore it)")
    parser.add_argument("--delta", default=None,
                        help="sink strengths Δ to test: a value, a list or start:stop:step (default 4:12:2)")
    parser.add_argument("--learned-sink", action="store_true", default=None,
                        help="a learned sink logit (gpt-oss sinks) instead of four token sinks at the front")
    parser.add_argument("--seeds", default=None, help="draws per Δ, 2..256 (default 4)")
    _options.add_trace_arguments(parser, trace_does="the verdict and the fix on it, as pcast analyze computes "
                                                    "them, instead of over a Δ range",
                                 model_adds="adds KL, top-1 agreement and perplexity per kernel")
    parser.add_argument("--mass-limit", default=None, metavar="X",
                        help="with --trace: the worst head's zeroed and clipped mass limit, in (0, 1) (default 1e-3)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    _options.add_progress_argument(parser, "with --trace: progress lines on stderr (layers done, rows, time left)",
                                   "on")


def _words(names) -> str:
    """``a, b or c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def run(args: argparse.Namespace) -> int:
    from pcast_jax import criterion, deployments, report
    from pcast_jax.errors import PcastError

    row = deployments.find(args.engine, args.backend, args.gpu, args.kv_cache_dtype)
    if args.trace is None and args.mass_limit is not None:
        raise PcastError("--mass-limit: only with --trace (the worst head's limit on your model's trace; the Δ "
                         "range's criterion is fixed)")
    if args.trace is not None:  # the trace has its own sinks: the Δ range's options would be ignored
        given = [flag for flag, dest in _SYNTHETIC if getattr(args, dest) is not None]
        if given:
            raise PcastError(f"{', '.join(given)}: options of the Δ range, but --trace was given (the trace has "
                             "its own sinks; its heads are analysed as they are)")
    deltas = _options.floats("--delta", DEFAULT_DELTA if args.delta is None else args.delta, max_count=64)
    seeds_text = DEFAULT_SEEDS if args.seeds is None else args.seeds
    seeds = _options.ints("--seeds", seeds_text, min_value=1)
    if len(seeds) != 1 or not 2 <= seeds[0] <= 256:
        raise PcastError(f"--seeds={seeds_text!r} must be one integer in [2, 256] (a verdict needs a standard error)")
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
                                learned_sink=bool(args.learned_sink))
    if args.format == "json":
        print(json.dumps(report.json_value(diag.to_dict()), indent=1, ensure_ascii=False))
        return 0
    _print_deployment(args, row, scales)
    if not row.casts_p:
        print(f"Verdict: no FP8 P — {diag.advice}.")
        return 0
    print(f"  criterion: zeroed mass ≤ {criterion.ZEROED_MASS_LIMIT:g} and clipped mass ≤ "
          f"{criterion.CLIPPED_MASS_LIMIT:g} of the softmax (mean over query rows), at every Δ, decided when "
          f"mean ± {criterion.Z:g} s.e. over the seeds excludes the limit")
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
    if diag.layers:
        print()
        print(report.markdown_table([{**g, "layers": _names(g["layers"]), "prob_scale": "none: default 1"
                                      if g["prob_scale"] is None else f"{g['prob_scale']:g}"} for g in diag.layers], [
            ("layers", "layers"), ("prob_scale", "prob_scale"),
            ("scale", "S", lambda x: x if isinstance(x, str) else f"{x:g}"), ("verdict", "worst vs limit")],
            name="doctor_layers"))
    print()
    word = {True: "safe", False: "P-collapse", None: "undecided"}[diag.safe]
    print(f"Verdict: {word} — {diag.advice}.")
    return 0


def _print_deployment(args: argparse.Namespace, row, scales: dict) -> None:
    runs = ", ".join(row.presets) if row.casts_p else "no FP8 P-cast (see the note)"
    print(f"{row.engine} {row.backend} on {args.gpu} with KV cache {args.kv_cache_dtype} runs: {runs}")
    print(f"  selected by: {row.selection}")
    print(f"  kernel entry: {row.source}")
    if row.note:
        print(f"  note: {row.note}")
    if row.casts_p:
        print(f"  P scale set by: {'the kernel (no knob)' if row.knob == 'none' else row.knob}")
    if args.checkpoint:
        for line in _checkpoint_lines(row, scales):
            print(f"  {line}")


def _checkpoint_lines(row, scales: dict) -> list[str]:
    """What the doctor says of a checkpoint's scales (:func:`pcast_jax.deployments.checkpoint_scales`)."""
    import numpy as np

    from pcast_jax import deployments

    lines = []
    for kind in ("q_scale", "k_scale", "v_scale", "prob_scale"):
        found = scales.get(kind) or {}
        if not found:
            continue
        values = np.concatenate([np.ravel(v) for v in found.values()])
        shaped = sorted({"per tensor" if isinstance(v, float) else f"per head ×{len(v)}" if np.ndim(v) == 1
                         else f"shape {list(np.shape(v))}" for v in found.values()})
        used = "sets P's scale here" if kind == row.knob else "not used for P by this backend"
        lines.append(f"checkpoint {kind}: {len(found)} tensors ({', '.join(shaped)}), {values.min():g}"
                     f"{'' if values.min() == values.max() else f' … {values.max():g}'} ({used})")
    through = {"prob_scale": "the checkpoint's prob_scale", "scale_s": "the caller's scale_s (cuDNN, where the "
               "kernel applies it)", "none": "nothing: the kernel fixes S"}[row.knob]
    lines.append(f"P's cast takes its scale from {through}; q/k/v scales (per tensor, per head or per token "
                 "and head) quantize Q, K and V only")
    missing = [layer for layer, value in scales.get("layers", {}).items() if value is None]
    if row.knob == "prob_scale" and missing:
        lines.append(f"layers without prob_scale: {_names(missing)} — the engine runs them at prob_scale "
                     f"{deployments.PROB_SCALE_DEFAULT:g} (S = 1), simulated as such")
    if scales.get("unindexed"):
        lines.append(f"scale tensors in a shard of the index but not in its weight_map (the engine reads every "
                     f"tensor of a listed shard, so they are read here too): {_names(scales['unindexed'])}")
    return lines


def _names(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _on_trace(args: argparse.Namespace, row, knob_value, scales: dict) -> int:
    """``--trace``: the deployment's kernels analysed on the model's trace (``analysis.diagnose_trace``)."""
    from pcast_jax import report
    from pcast_jax.analysis import diagnose_trace
    from pcast_jax.analysis.report import report_data
    from pcast_jax.commands.analyze import model_logits

    mass_limit = _options.number("--mass-limit", DEFAULT_MASS_LIMIT if args.mass_limit is None else args.mass_limit,
                                 positive=True)
    trace = _options.read_trace("trace file", args.trace)
    logits_fn = None if args.model is None else model_logits(args.model, trace)
    diag = diagnose_trace(row, trace, knob_value=knob_value, scales=scales, mass_limit=mass_limit,
                          logits_fn=logits_fn, progress=_options.progress_lines(args.progress))
    if args.format == "json":
        data = {**diag.to_dict(), "analysis": None if diag.analysis is None else report_data(diag.analysis)}
        print(json.dumps(report.json_value(data), indent=1, ensure_ascii=False))
        return 0
    _print_deployment(args, row, scales)
    print(f"  model (from the trace): {diag.features.words()}")
    if diag.cannot_run:
        print(f"  can it run this model: no — {'; '.join(diag.cannot_run)}")
        print(f"Verdict on this model: none — {diag.advice}.")
        return 0
    print("  can it run this model: nothing its source refuses"
          + (f" (not read from its source: whether it supports {', '.join(diag.unread)})" if diag.unread else ""))
    if diag.analysis is None:
        print(f"Verdict on this model: no FP8 P — {diag.advice}.")
        return 0
    print()
    print("\n".join(diag.analysis.summary_lines(fixed_scale=row.knob == "none")))
    for group in diag.layers:
        value = "none (the engine's default 1)" if group["prob_scale"] is None else f"{group['prob_scale']:g}"
        print(f"Layers {_names(group['layers'])} (prob_scale {value}): {group['verdict']} — worst head zeroes "
              f"{report.fmt_sci(group['zeroed_mass_max'])} and clips {report.fmt_sci(group['saturated_mass_max'])}.")
    word = "safe to serve" if diag.safe else "not safe to serve"
    print(f"Verdict on this model: {word} — {diag.advice}.")
    return 0
