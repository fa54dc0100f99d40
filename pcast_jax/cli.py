"""The ``pcast`` command line. Each sub-command lives in ``pcast_jax/commands/<name>.py`` and
exposes ``add_arguments(parser)`` and ``run(args) -> int`` (its one-line help is in ``COMMANDS``); modules are
imported only when their sub-command runs, so ``pcast --help`` stays fast.

Errors a user can cause (:class:`ValueError`, including :class:`pcast_jax.errors.PcastError`,
and :class:`OSError`) are printed as one line ``pcast: error: …`` with exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "theory": "Closed forms of the paper for one (Δ, S): δk, F(Δ,S), Δc, underflow threshold, dp(S).",
    "sweep": "Run a seed × Δ × N × config sweep with the simulator; results land on disk as chunks finish.",
    "reproduce": "Reproduce every table and figure of the paper into DIR/report.md.",
    "whatif": "Differentiable what-if analyses: worst Δ, optimal S, Prop. 3 calibration, dynamic scale.",
    "model-report": "Real-model (SmolLM2-135M) sink statistics, per-head P-cast error and perplexity.",
    "presets": "List the kernel presets and their P-cast configuration.",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load(name: str):
    return importlib.import_module(f"pcast_jax.commands.{name.replace('-', '_')}")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="pcast", description="FP8 attention P-cast precision toolkit (pcast_jax).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = None
    if argv:
        wanted = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            _load(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    try:
        return int(_load(args.command).run(args) or 0)
    except BrokenPipeError:  # output piped into `head` or similar: stop quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (ValueError, OSError) as exc:
        print(f"pcast: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pcast: interrupted; finished chunks are kept on disk", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
