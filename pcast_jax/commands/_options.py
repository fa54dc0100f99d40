"""The flag vocabulary every ``pcast`` command shares, and its parsers.

* ``--configs a,b`` — preset names; ``--config SPEC`` — one kernel as ``key=value,...``
  (:meth:`~pcast_jax.config.KernelConfig.from_string`), repeatable; ``--config-file FILE.toml`` —
  kernels as ``[[kernel]]`` tables with the same keys.
* ``--delta`` and ``--n`` take one value, a list ``5,7,9`` or a range ``start:stop:step`` (stop
  included); an interval is ``lo:hi``.
* Every list-valued flag takes a comma list (``--configs fa3,fwd_s1``, ``--num-warps 4,8``); several
  values after one flag (``--configs fa3 fwd_s1``) are refused with the comma spelling.
* ``--progress/--no-progress`` on every long-running command (default: a bar, or progress lines,
  when stderr is a terminal; see each command's help).
* ``--format`` picks what is printed on stdout, ``--out`` where files go (a folder, or one file whose
  extension picks its format).
* A renamed flag is refused with a one-line hint to its new spelling (exit status 2).

Every error names the option.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_f32
from pcast_jax.fileio import load_toml
from pcast_jax.presets import PRESETS

RANGE_HELP = "one value, a list 5,7,9, or start:stop:step with stop included (4:13:1 is 4, 5, …, 13)"
CONFIG_HELP = ("one kernel as key=value pairs, e.g. 'name=mine,order=reverse,scale=64,block_kv=128,"
               "accumulator=f16' (every KernelConfig field; `pcast presets --show NAME` prints a preset "
               "in this form); repeatable")
CONFIG_FILE_HELP = "TOML file of kernels: [[kernel]] tables with the same keys as --config; repeatable"


def integer(option: str, text, *, min_value: int | None = None) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise PcastError(f"{option}={text!r} must be an integer") from None
    if min_value is not None and value < min_value:
        raise PcastError(f"{option}={text!r} must be >= {min_value}")
    return value


def number(option: str, text, *, positive: bool = False, max_abs: float | None = None) -> float:
    """A number that is finite in float32 (the simulator's type), > 0 with ``positive``, |x| ≤ ``max_abs``."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise PcastError(f"{option}={text!r} must be a number") from None
    if not math.isfinite(value):
        raise PcastError(f"{option}={text!r} must be finite")
    param = option.lstrip("-").replace("-", "_")
    try:
        check_f32(param, value, positive=positive, max_abs=max_abs)
    except PcastError as exc:
        raise PcastError(f"{option}={text!r}: {exc}") from None
    return value


def items(option: str, text) -> list[str]:
    """``"a,b,c"`` → ``["a", "b", "c"]``; an empty item is an error."""
    parts = [t.strip() for t in str(text).split(",")]
    if not parts or any(not t for t in parts):
        raise PcastError(f"{option}={text!r} must be a comma-separated list without empty items")
    return parts


def floats(option: str, text, *, max_count: int = 10_000) -> tuple[float, ...]:
    """``"7"``, ``"5,7,9"`` or ``"start:stop:step"`` (stop included) → floats."""
    text = str(text).strip()
    if ":" not in text:
        return tuple(number(option, t) for t in items(option, text))
    parts = text.split(":")
    if len(parts) != 3:
        raise PcastError(f"{option}={text!r} must be start:stop:step (e.g. 4:13:1) or a list 5,7,9")
    start, stop, step = (number(option, p) for p in parts)
    if step <= 0:
        raise PcastError(f"{option}={text!r}: step must be > 0")
    if stop < start:
        raise PcastError(f"{option}={text!r}: stop must be >= start")
    count = math.floor((stop - start) / step + 1e-9) + 1
    if count > max_count:
        raise PcastError(f"{option}={text!r} gives {count} values; at most {max_count}")
    digits = 9 - math.floor(math.log10(step))  # the step's own digits and nine more: 0.1·3 is 0.3
    vals = tuple(round(start + i * step, digits) for i in range(count))
    same = next((i for i in range(1, count) if np.float32(vals[i]) == np.float32(vals[i - 1])), None)
    if same is not None:  # the simulator's numbers are float32: two values there would be one
        raise PcastError(f"{option}={text!r}: step {step:g} is below float32's resolution near "
                         f"{vals[same]:.9g} ({vals[same - 1]:.9g} and {vals[same]:.9g} are one float32)")
    return vals


def ints(option: str, text, *, min_value: int | None = None) -> tuple[int, ...]:
    """Like :func:`floats`, for integers (``1024,4096`` or ``1024:4096:1024``)."""
    text = str(text).strip()
    if ":" not in text:
        return tuple(integer(option, t, min_value=min_value) for t in items(option, text))
    parts = text.split(":")
    if len(parts) != 3:
        raise PcastError(f"{option}={text!r} must be start:stop:step (e.g. 1024:4096:1024) or a list")
    start, stop, step = (integer(option, p) for p in parts)
    if step <= 0 or stop < start:
        raise PcastError(f"{option}={text!r}: step must be > 0 and stop >= start")
    if (stop - start) // step + 1 > 10_000:
        raise PcastError(f"{option}={text!r} gives more than 10000 values")
    vals = tuple(range(start, stop + 1, step))
    if min_value is not None and vals[0] < min_value:
        raise PcastError(f"{option}={text!r} must be >= {min_value}")
    return vals


def interval(option: str, text) -> tuple[float, float]:
    """``"lo:hi"`` → (lo, hi) with lo < hi."""
    parts = str(text).strip().split(":")
    if len(parts) != 2:
        raise PcastError(f"{option}={text!r} must be lo:hi (e.g. 4:13)")
    lo, hi = (number(option, p) for p in parts)
    if not lo < hi:
        raise PcastError(f"{option}={text!r}: lo must be < hi")
    return lo, hi


# --------------------------------------------------------------------------------------------
# Kernels: --configs, --config, --config-file
# --------------------------------------------------------------------------------------------


def preset_names(option: str, text) -> list[KernelConfig]:
    out = []
    for name in items(option, text):
        if name not in PRESETS:
            raise PcastError(f"{option}: {name!r} is not a preset; choose from {', '.join(PRESETS)} "
                             "(a kernel of your own goes in --config key=value,...)")
        out.append(PRESETS[name])
    return out


def kernel(option: str, text) -> KernelConfig:
    """One ``--config`` value: ``key=value,...``, or a single preset name."""
    text = str(text).strip()
    if "=" not in text:
        if text in PRESETS:
            return PRESETS[text]
        if "," in text:
            raise PcastError(f"{option}={text!r}: --config takes one kernel as key=value,...; "
                             "for a list of presets use --configs")
        raise PcastError(f"{option}={text!r} is neither a preset nor key=value,... "
                         f"(presets: {', '.join(PRESETS)})")
    try:
        return KernelConfig.from_string(text)
    except PcastError as exc:
        raise PcastError(f"{option}: {exc}") from None


def config_file(path) -> list[KernelConfig]:
    """Kernels of a TOML file: a list of ``[[kernel]]`` tables with :class:`KernelConfig`'s fields as keys."""
    path = Path(path)
    doc = load_toml(path, what=f"--config-file={str(path)!r}")  # bounded in size and depth
    tables = doc.get("kernel")
    extra = sorted(set(doc) - {"kernel"})
    if extra:
        raise PcastError(f"--config-file={str(path)!r}: unknown top-level key(s) {extra}; "
                         "write each kernel as a [[kernel]] table")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise PcastError(f"--config-file={str(path)!r} must hold at least one [[kernel]] table")
    out = []
    for i, table in enumerate(tables, 1):
        try:
            out.append(KernelConfig.from_dict(dict(table)))
        except (PcastError, TypeError) as exc:
            raise PcastError(f"--config-file={str(path)!r}, kernel {i}: {exc}") from None
    return out


def add_kernel_arguments(parser: argparse.ArgumentParser, *, default_configs: str | None) -> None:
    """``--configs``, ``--config`` (repeatable) and ``--config-file`` (repeatable)."""
    tail = f" (default {default_configs} when no kernel is given)" if default_configs else ""
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated preset names (see `pcast presets`){tail}")
    parser.add_argument("--config", action="append", default=None, metavar="SPEC", help=CONFIG_HELP)
    parser.add_argument("--config-file", action="append", default=None, metavar="FILE", help=CONFIG_FILE_HELP)


def kernels_from_args(args: argparse.Namespace, *, default_configs: str | None) -> list[KernelConfig]:
    """The kernels ``--configs``, ``--config`` and ``--config-file`` name, in that order.

    With none of them, ``default_configs``. Names must be unique.
    """
    out: list[KernelConfig] = []
    if args.configs is not None:
        out += preset_names("--configs", args.configs)
    for text in args.config or ():
        out.append(kernel("--config", text))
    for path in args.config_file or ():
        out += config_file(path)
    if not out and default_configs:
        out = preset_names("--configs", default_configs)
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PcastError(f"kernel name(s) {', '.join(map(repr, dup))} given more than once; "
                         "give each --config its own name=...")
    return out


# --------------------------------------------------------------------------------------------
# Renamed flags
# --------------------------------------------------------------------------------------------


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new: str = "", nargs=None, **kw):
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(f"pcast: error: {option_string} was renamed: use {self.new}\n")
        raise SystemExit(2)


def renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse the old spelling ``old`` with a one-line hint to ``new`` (exit status 2)."""
    parser.add_argument(old, action=_Renamed, new=new, dest=f"_renamed_{old.strip('-').replace('-', '_')}")


class _CommaList(argparse.Action):
    """A list flag: ``--flag a,b``; several values after the flag (``--flag a b``) are refused with
    the comma spelling. Each item is converted by ``item_type`` and checked against
    ``item_choices``; the result is a list."""

    comma_list = True  # the ``pcast`` help shows one METAVAR, not nargs="+"'s METAVAR [METAVAR ...]

    def __init__(self, option_strings, dest, *, item_type=str, item_choices=None, **kw):
        self.item_type, self.item_choices = item_type, item_choices
        super().__init__(option_strings, dest, nargs="+", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) > 1:
            raise argparse.ArgumentError(self, f"takes one comma list: {option_string} {','.join(values)}")
        out = []
        for text in values:
            try:
                parts = items(option_string, text)
            except PcastError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
            for part in parts:
                try:
                    value = self.item_type(part)
                except ValueError:
                    raise argparse.ArgumentError(self, f"{part!r} is not a valid {self.item_type.__name__}") from None
                if self.item_choices is not None and value not in self.item_choices:
                    raise argparse.ArgumentError(self, f"invalid choice: {part!r} (choose from "
                                                       f"{', '.join(map(str, self.item_choices))})")
                out.append(value)
        setattr(namespace, self.dest, out)


def add_list_argument(parser: argparse.ArgumentParser, flag: str, *, item_type=str, choices=None, **kw) -> None:
    """A flag taking a comma list (``--backends triton,mosaic``): the parsed value is a list."""
    parser.add_argument(flag, action=_CommaList, item_type=item_type, item_choices=choices, **kw)


def add_trace_arguments(parser: argparse.ArgumentParser, *, trace_does: str, model_adds: str) -> None:
    """``--trace TRACE`` (a :class:`~pcast_jax.analysis.Trace` file) and ``--model PATH`` (the model it came
    from), said as what the command does with each."""
    parser.add_argument("--trace", default=None, metavar="TRACE",
                        help=f"a trace of your model (pcast_jax.analysis.Trace.save, .npz, or a trace folder of "
                             f"Trace.save_layers, read one layer at a time): {trace_does}")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help=f"with --trace: the model it came from (GGUF file or Hugging Face folder): {model_adds}")


def read_trace(option: str, path):
    """The trace ``option`` names: a trace folder (:meth:`~pcast_jax.analysis.Trace.save_layers`, read one layer
    at a time) or an ``.npz`` file, which must be a regular file (a pipe would block the reader)."""
    from pcast_jax import fileio
    from pcast_jax.analysis import load_trace

    if not Path(path).is_dir():
        fileio.check_regular(path, what=f"{option} {path}")
    return load_trace(path)


def progress_lines(show: bool | None):
    """``(line) -> None`` printing each progress line on stderr, or doing nothing where ``show`` is False."""
    if show is False:
        return lambda _line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def add_progress_argument(parser: argparse.ArgumentParser, what: str = "a progress bar on stderr",
                          default: str = "when stderr is a terminal") -> None:
    """``--progress/--no-progress`` (``args.progress``: True, False or None for the default)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help=f"{what} (default: {default})")


def add_probe_arguments(parser: argparse.ArgumentParser, *, min_head_dim: int) -> None:
    """The kernel's calling convention for probes written to a file (``fingerprint probe``, ``probe write``):
    ``--head-dim``, ``--scale``, ``--causal``, ``--sinks``, ``--seed``."""
    parser.add_argument("--head-dim", dest="head_dim", type=int, required=True,
                        help=f"the kernel's head dim (>= {min_head_dim})")
    parser.add_argument("--scale", type=float, default=None,
                        help="softmax scale the kernel applies (default 1/sqrt(head dim), as jax.nn)")
    parser.add_argument("--causal", action="store_true", help="the kernel masks causally (bottom-right aligned)")
    parser.add_argument("--sinks", action="store_true", help="the kernel takes learned sink logits, one per head")
    parser.add_argument("--seed", type=int, default=0, help="seed of the probes (default 0)")
