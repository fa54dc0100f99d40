"""``pcast analyze TRACE``: a captured Q/K/V trace → DIR/analysis.md (words first), analysis.json, CSVs,
figures; ``--format json`` prints the JSON report instead of the words."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcast_jax import report
from pcast_jax.commands import _options
from pcast_jax.criterion import MASS_LIMIT

DEFAULT_CONFIGS = "fwd_s1,fwd_s256,rev_s256,fa3,fa3_splitkv"
#: What ``--format`` prints.
FORMATS = ("text", "json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE",
                        help="trace file written by pcast_jax.analysis.Trace.save (.npz), or a trace folder written "
                             "by Trace.save_layers (read one layer at a time)")
    _options.add_kernel_arguments(parser, default_configs=DEFAULT_CONFIGS)
    parser.add_argument("--out", default="analysis", metavar="DIR",
                        help="report folder: analysis.md, analysis.json, analysis_*.csv and, with matplotlib "
                             "(the plots extra), analysis_decision.png and analysis_layers.png (default: analysis)")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="what is printed: text (the answer in words, default) or json (the report's "
                             "analysis.json: verdicts, per-config rows, safe scales, criterion; non-finite "
                             "numbers as null with the reason)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="the model the trace came from (a llama or qwen2 GGUF file, or a Hugging Face "
                             "checkpoint folder): adds KL, top-1 agreement and "
                             "perplexity per kernel, run on the trace's tokens")
    parser.add_argument("--mass-limit", default=f"{MASS_LIMIT:g}", metavar="X",
                        help="attention mass the worst head may lose to zeroed P, and may have clipped, for a "
                             f"kernel to be safe to serve; in (0, 1) (default {MASS_LIMIT:g})")
    parser.add_argument("--num-sinks", default="1", metavar="K", help="sink keys per head (default 1)")
    parser.add_argument("--rows", default=None, metavar="N",
                        help="analyse a random sample of N query rows per sequence, layer and head (every key kept): "
                             "every mass carries its standard error and a verdict is decided only where the error "
                             "allows (default: every row)")
    parser.add_argument("--seed", default=None, metavar="S", help="with --rows: the sample's seed (default 0)")
    _options.add_progress_argument(parser, "progress lines on stderr (layers done, rows, time left)", "on")


def run(args: argparse.Namespace) -> int:
    from pcast_jax.analysis import analyze, write_report
    from pcast_jax.analysis.report import NO_FIGURES
    from pcast_jax.errors import PcastError
    kernels = _options.kernels_from_args(args, default_configs=DEFAULT_CONFIGS)
    if args.configs is not None or not (args.config or args.config_file):
        names = _options.items("--configs", args.configs or DEFAULT_CONFIGS)
        kernels = names + kernels[len(names):]  # preset names: their tile for the trace's head dim
    mass_limit = _options.number("--mass-limit", args.mass_limit, positive=True)
    num_sinks = _options.integer("--num-sinks", args.num_sinks, min_value=1)
    rows = None if args.rows is None else _options.integer("--rows", args.rows, min_value=2)
    seed = 0 if args.seed is None else _options.integer("--seed", args.seed, min_value=0)
    if args.rows is None and args.seed is not None:
        raise PcastError(f"--seed={args.seed!r}: only with --rows (the seed of the sample of rows)")
    log = _options.progress_lines(args.progress)
    report.check_out_dir(args.out)
    trace = _options.read_trace("trace file", args.trace)
    logits_fn = None if args.model is None else model_logits(args.model, trace)
    result = analyze(trace, kernels, num_sinks=num_sinks, mass_limit=mass_limit, logits_fn=logits_fn,
                     progress=log, rows=rows, seed=seed)
    path = write_report(result, Path(args.out), title=f"P-cast analysis of {Path(args.trace).name}", what="--out")
    notes = [NO_FIGURES] if NO_FIGURES[1:] in path.read_text() else []  # the markdown says so too
    if args.format == "json":
        sys.stdout.write((path.parent / "analysis.json").read_text())
        for line in notes + [f"report written to {path}"]:
            print(line, file=sys.stderr)
        return 0
    print("\n".join(result.summary_lines()))
    for line in notes:
        print(line)
    print(f"report written to {path}")
    return 0


def _check_model_matches(cfg, trace, path) -> None:
    """The model must be the one that made the trace: its layers, heads, KV heads, head dim, vocabulary."""
    from pcast_jax.errors import PcastError

    L, hq, hkv, d = trace.num_layers, trace.num_heads, trace.num_kv_heads, trace.head_dim
    pairs = [("layers", cfg.num_layers, L), ("query heads", cfg.num_heads, hq), ("KV heads", cfg.num_kv_heads, hkv),
             ("head dim", cfg.head_dim, d)]
    wrong = [f"{name} {got} vs {want}" for name, got, want in pairs if got != want]
    if trace.tokens is not None and int(trace.tokens.max()) >= cfg.vocab_size:
        wrong.append(f"token id {int(trace.tokens.max())} vs vocabulary {cfg.vocab_size}")
    if wrong:
        raise PcastError(f"--model={str(path)!r} does not match the trace ({', '.join(wrong)}: model vs trace); "
                         "give the model the trace was recorded from")


def model_logits(path, trace):
    """``config -> logits`` of the model file on the trace's tokens (None: exact FP32)."""
    import jax
    import jax.numpy as jnp

    from pcast_jax.errors import PcastError
    from pcast_jax.models import FP8Attention, forward, load_model

    if trace.tokens is None:
        raise PcastError("--model needs a trace with tokens (Recorder.trace(tokens=...))")
    cfg, params = load_model(path)
    _check_model_matches(cfg, trace, path)
    exact = forward(params, cfg, trace.tokens, lengths=trace.lengths)  # checked once, before the analysis
    if not bool(jnp.all(jnp.isfinite(exact))):
        largest = max(float(jnp.max(jnp.abs(w))) for w in jax.tree_util.tree_leaves(params))
        raise PcastError(f"--model={str(path)!r}: its exact FP32 forward on the trace's tokens is not finite "
                         f"(largest |weight| = {largest:.3g}): the weights are out of float32's working range")

    def logits(config):
        if config is None:
            return exact
        return forward(params, cfg, trace.tokens, attention_fn=FP8Attention(config=config), lengths=trace.lengths)

    return logits
