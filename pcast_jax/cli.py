"""The ``pcast`` command line: built-in sub-commands, and those other packages add.

Each built-in sub-command lives in ``pcast_jax/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int`` (its one-line help is in ``COMMANDS``). Other
installed packages add sub-commands through the entry-point group ``pcast_jax.commands``: the
entry point's name is the sub-command and its value a module with ``HELP`` (one line),
``add_arguments`` and ``run``. The project's experiments package adds ``pcast reproduce`` that
way, so the library never imports it. Modules are imported only when their sub-command runs (or
when ``pcast --help`` lists the added ones), so ``pcast --help`` stays fast: neither it nor any
sub-command's ``--help`` imports JAX (``tests/test_cli.py`` checks each in a fresh process).

Errors a user can cause (:class:`ValueError`, including :class:`pcast_jax.errors.PcastError`,
and :class:`OSError`) are printed as one line ``pcast: error: …`` with exit status 2, no traceback;
so is a sub-command whose package is missing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from importlib import metadata

from pcast_jax import cache

#: Built-in sub-commands and their one-line help.
COMMANDS: dict[str, str] = {
    "theory": "Closed forms of the paper for one (Δ, S): δk, F(Δ,S), Δc, underflow threshold, dp(S).",
    "sweep": "Run a seed × Δ × N × config sweep with the simulator; results land on disk as chunks finish.",
    "whatif": "Differentiable what-if analyses: worst Δ, optimal S, Prop. 3 calibration, dynamic scale.",
    "analyze": "Your model's captured Q/K/V trace: sinks, each kernel's P-cast loss per head, verdicts, safe scale.",
    "presets": "List the kernel presets and their P-cast configuration (--show NAME: one as key=value).",
    "plot": "Plot a finished sweep's metric against Δ or N (PNG, in the reproduction figures' style).",
    "kernels": "Compile the Pallas FP8 kernels for Hopper without a GPU: registers, spills, FP8 wgmma use.",
    "jax-fp8": "What JAX's own FP8 attention (cuDNN FP8 SDPA) does to P, on your model's trace or synthetic logits, "
               "and the scale_s to pass.",
    "doctor": "From a deployment (engine, backend, GPU, checkpoint) to its kernel, a P-collapse verdict and the fix.",
    "fingerprint": "Read a closed kernel's P-cast from its outputs on designed probes (probe, fit, --preset).",
    "probe": "P-collapse check of a kernel run elsewhere: write the probes, check its outputs (write, check).",
}
#: Entry-point group through which other packages add sub-commands.
ENTRY_POINT_GROUP = "pcast_jax.commands"
#: Sub-commands this project's other packages add, and which package: named in the error when the
#: package is not installed.
PROVIDED_ELSEWHERE: dict[str, str] = {"reproduce": "pcast_experiments", "model-report": "pcast_experiments"}


class _Formatter(argparse.HelpFormatter):
    def _format_args(self, action, default_metavar):
        if getattr(action, "comma_list", False):  # a comma list: nargs="+" only keeps the old spaced form
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # a value that starts with '-' and a digit is a value (--delta -2:2:1, --sigma -1e3), as
        # Python 3.13 reads it; no option of pcast starts with '-' and a digit
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):  # one line, exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandUnavailable(Exception):
    """A sub-command whose providing package is missing or cannot be imported."""


def added_commands() -> dict[str, metadata.EntryPoint]:
    """Sub-commands installed packages add (name → entry point); built-in names cannot be replaced."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in COMMANDS:
            found.setdefault(ep.name, ep)
    return found


def _load(name: str, added: dict[str, metadata.EntryPoint]):
    """The module of sub-command ``name``; :class:`CommandUnavailable` if it cannot be loaded."""
    if name in COMMANDS:
        return importlib.import_module(f"pcast_jax.commands.{name.replace('-', '_')}")
    ep = added.get(name)
    if ep is None:
        raise CommandUnavailable(f"'pcast {name}' comes with the {PROVIDED_ELSEWHERE[name]} package, which is "
                                 "not installed (pip install -e . in a source checkout installs it)")
    try:
        return ep.load()
    except ImportError as exc:
        raise CommandUnavailable(f"'pcast {name}' comes from {ep.value} (entry point in group "
                                 f"{ENTRY_POINT_GROUP}), which cannot be imported: {exc}") from None


def _help(name: str, added) -> str:
    """One-line help of an added sub-command (loads its module)."""
    try:
        return getattr(_load(name, added), "HELP", "")
    except CommandUnavailable as exc:
        return f"unavailable: {exc}"


def _version() -> str:
    """``pcast X (jax Y, jaxlib Z)``, read from the installed metadata (nothing is imported)."""
    def v(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"pcast {v('pcast_jax')} (jax {v('jax')}, jaxlib {v('jaxlib')})"


def build_parser(argv: list[str] | None = None, added: dict | None = None) -> argparse.ArgumentParser:
    """The ``pcast`` parser; only the sub-command named in ``argv`` gets its options.

    Raises:
      CommandUnavailable: ``argv`` names an added sub-command whose package is missing.
    """
    added = added_commands() if added is None else added
    parser = _Parser(prog="pcast", description="FP8 attention P-cast precision toolkit (pcast_jax).")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the persistent compilation cache (also: PCAST_JAX_COMPILATION_CACHE=0)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    names = list(COMMANDS) + list(added) + [n for n in PROVIDED_ELSEWHERE if n not in added]
    wanted = next((a for a in argv if a in names), None) if argv else None
    for name in names:
        help_text = COMMANDS.get(name)
        if help_text is None and wanted in (None, name):  # added commands: help from their module
            help_text = _help(name, added)
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            _load(name, added).add_arguments(p)
    return parser


def _undecodable(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(option, value) of each parsed text value that is not UTF-8: undecodable bytes of ``argv`` (a file name
    on a POSIX system) arrive as lone surrogates, which no file, report or JSON can hold."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                yield from _undecodable(chosen, args)
            continue
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    yield (action.option_strings[0] if action.option_strings else action.metavar or action.dest), value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    added = added_commands()
    try:
        parser = build_parser(argv, added)
    except CommandUnavailable as exc:
        print(f"pcast: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    cache.enable(enabled=False if args.no_compile_cache else None)
    if not args.command:
        parser.print_help()
        return 0
    bad = next(_undecodable(parser, args), None)
    if bad is not None:  # before any work: a file name is printed and written into reports
        print(f"pcast: error: {bad[0]}={bad[1]!r} is not UTF-8 text (a file name of bytes this system's "
              "encoding does not decode?); pcast reads names as UTF-8: rename the file", file=sys.stderr)
        return 2
    try:
        return int(_load(args.command, added).run(args) or 0)
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
