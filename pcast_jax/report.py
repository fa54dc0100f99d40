"""Writing reports: number formatting, markdown tables, CSV, PNG (matplotlib, Agg) and JSON files.

One module, over 600 lines: every published number and file goes through it (formatters, tables, CSV,
JSON, figures), so that :func:`check_published` guards each writer.

No published number hides: :func:`check_published` (called by :func:`write_csv`,
:func:`markdown_table` and :func:`save_figure`) turns a non-finite value, a missing cell, a bare
"—" or a number rendered as ``nan``/``inf`` into a :class:`~pcast_jax.errors.PcastError` naming
the table and the row's config. A value that is legitimately not applicable must say why in words
(e.g. ``"n/a: one forward pass zeroes nothing"``). The number formatters render a non-finite
value as ``nan``/``inf`` (never a dash), so a bad number in a sentence is caught the same way.

Files are written atomically (temporary file in the same folder, then rename), so an interrupted
run never leaves a half-written report. Figures use matplotlib's object API with the Agg canvas:
no pyplot global state, no display needed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

from pcast_jax.errors import PcastError
from pcast_jax.fileio import atomic_write

__all__ = [
    "check_out_dir",
    "check_out_file",
    "fmt_num",
    "fmt_sci",
    "fmt_pct",
    "fmt_pct_sig",
    "fmt_sci_pm",
    "fmt_ratio",
    "fmt_signed",
    "fmt_cell",
    "ratio",
    "markdown_table",
    "cell_table",
    "check_published",
    "write_text",
    "write_csv",
    "csv_text",
    "write_json",
    "json_value",
    "new_figure",
    "label_log_axis",
    "save_figure",
    "sweep_figure",
    "library_versions",
]


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------


def _bad(x) -> bool:
    return x is None or (isinstance(x, float) and not math.isfinite(x))


#: The cell of a value the paper does not give.
NOT_IN_PAPER = "n/a: not in the paper"


def _num(x) -> float:
    """``x`` as a float; None (a missing value) as NaN, which :func:`check_published` rejects."""
    return float("nan") if x is None else float(x)


def words_or(fmt):
    """``fmt`` for numbers; a string (a not-applicable value said in words) shown as it is."""
    def shown(x, *args, **kw):
        return x if isinstance(x, str) else fmt(x, *args, **kw)

    shown.__doc__ = fmt.__doc__
    shown.__name__ = fmt.__name__
    return shown


@words_or
def fmt_num(x, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals (a non-finite or missing value shows as ``nan``/``inf``)."""
    return f"{_num(x):.{digits}f}"


@words_or
def fmt_sci(x, digits: int = 2) -> str:
    """Scientific notation (``5.65e-05``)."""
    return f"{_num(x):.{digits}e}"


@words_or
def fmt_pct(x, digits: int = 1) -> str:
    """A fraction in [0, 1] as a percentage (``0.223`` → ``22.3%``)."""
    return f"{100.0 * _num(x):.{digits}f}%"


@words_or
def fmt_pct_sig(x, se=None) -> str:
    """A fraction as a percentage to 3 significant digits, with ``± se`` to 2 when given
    (``0.01234, 0.00041`` → ``1.23% ± 0.041%``)."""
    x = float("nan") if x is None else x
    return f"{100 * x:.3g}%" + ("" if se is None else f" ± {100 * se:.2g}%")


@words_or
def fmt_sci_pm(x, se) -> str:
    """Scientific notation with its standard error (``5.65e-05 ± 1.2e-06``)."""
    return f"{fmt_sci(x)} ± {fmt_sci(se, 1)}"


@words_or
def fmt_ratio(x, digits: int = 2) -> str:
    """A ratio with a multiplication sign (``3.4×``)."""
    return f"{_num(x):.{digits}f}×"


@words_or
def fmt_signed(x, digits: int = 1, unit: str = "") -> str:
    """A difference with its sign (``+1.2 pp``)."""
    return f"{_num(x):+.{digits}f}{(' ' + unit) if unit else ''}"


# --------------------------------------------------------------------------------------------
# The check at every writer: no published number hides
# --------------------------------------------------------------------------------------------

#: A number rendered non-finite by Python's formatting (``nan``, ``-inf``, ``nan%``, ``inf×``).
_NONFINITE_TEXT = re.compile(r"(?<![A-Za-z_])[-+−]?(?:nan|inf)(?![A-Za-z_])")
#: Row keys that identify a row's config in an error message, in this order.
_IDENTITY = ("experiment", "config", "preset", "implementation", "label", "model", "format", "phase", "layer",
             "head", "n", "delta", "nb_sub_seq", "claim")


def _row_name(row: dict, index: int) -> str:
    ident = [f"{k}={row[k]}" for k in _IDENTITY if k in row and not _bad(row[k])]
    return f"row {index}" + (f" ({', '.join(ident[:4])})" if ident else "")


def _problem(v) -> str | None:
    """Why a cell value may not be published, or None when it may."""
    if v is None:
        return "is missing"
    try:
        import numpy as np

        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, np.ndarray):
            return None if np.all(np.isfinite(v)) else "holds a non-finite value"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(v, float) and not math.isfinite(v):
        return f"is {v!r}"
    if isinstance(v, str):
        if v.strip() in ("—", "-", "–"):
            return "is a bare dash (say in words why it is not applicable)"
        if _NONFINITE_TEXT.search(v):
            return f"shows a non-finite number ({v!r})"
    return None


#: What a CSV cell says for a column that a row does not have (a table mixing kinds of rows).
NO_SUCH_COLUMN = "n/a: not a column of this row"


def check_published(table: str, rows: Sequence[dict], columns: Sequence[str] | None = None, *,
                    absent_ok: bool = False) -> None:
    """Raise a PcastError naming ``table``, the row's config and the column for the first cell of
    ``rows`` (in ``columns``, default each row's own keys) that is missing (a key present with
    value None, or absent unless ``absent_ok``), non-finite, a bare dash or text showing a
    non-finite number. A not-applicable value must say why in words."""
    for i, row in enumerate(rows):
        for key in (columns if columns is not None else row):
            if absent_ok and key not in row:
                continue
            why = _problem(row.get(key))
            if why:
                raise PcastError(f"table {table}: {_row_name(row, i)}: column {key!r} {why}; a published "
                                 "number must be finite, or say in words why it is not applicable")


def ratio(a, b) -> float:
    """a / b, NaN when either is missing or b is zero (a NaN no writer publishes)."""
    if _bad(a) or _bad(b) or float(b) == 0.0:
        return float("nan")
    return float(a) / float(b)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[dict], columns: Sequence, *, align: str | None = None,
                   name: str = "(markdown)") -> str:
    """A GitHub markdown table; every cell is checked by :func:`check_published` (table ``name``).

    Args:
      rows: one dict per row.
      columns: objects with ``key``, ``header`` and ``fmt`` (a callable value → str), or
        ``(key, header)`` / ``(key, header, fmt)`` tuples.
      align: one character per column, ``l`` or ``r`` (default: first column left, rest right).
      name: the table's name in an error message.
    """
    cols = []
    for c in columns:
        if isinstance(c, tuple):
            key, header, fmt = (c + (str,))[:3]
        else:
            key, header, fmt = c.key, c.header, c.fmt
        cols.append((key, header, fmt))
    if align is None:
        align = "l" + "r" * (len(cols) - 1)
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    rule = "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"
    lines = [head, rule]
    keys = [key for key, _, _ in cols]
    check_published(name, rows, keys)
    for r in rows:
        shown = {key: str(fmt(r.get(key))) for key, _, fmt in cols}
        check_published(name, [{**r, **shown}], keys)
        lines.append("| " + " | ".join(shown[k].replace("|", "\\|") for k in keys) + " |")
    return "\n".join(lines)


def fmt_cell(v) -> str:
    """One cell of a table of analysis rows: yes/no, integers as such, floats to four significant digits
    (scientific below 1e-3 and from 1e5), "–" if not finite (which :func:`check_published` refuses), text
    as it is."""
    import numpy as np

    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return "–"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def cell_table(rows: Sequence[dict], columns: Sequence[str] | None = None, name: str = "whatif") -> str:
    """A GitHub markdown table of ``rows`` (dicts) restricted to ``columns`` (default: the first row's
    keys), the keys as headers and every cell through :func:`fmt_cell`; a non-finite value is an error
    naming the row (:func:`check_published`). Ends with a newline; no rows: ``(no rows)``."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    return markdown_table(rows, [(c, c, fmt_cell) for c in columns], name=name) + "\n"


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def check_out_dir(out, option: str = "--out") -> Path:
    """``out`` as a report folder to be written, or a PcastError naming ``option`` — before any work.

    Refused: an existing file (the report is a folder of files), a path under a file, a folder that
    exists and cannot be written, or one whose nearest existing parent cannot be written. Nothing is
    created here.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise PcastError(f"{option}={str(out)!r} is an existing file; the report is a folder of files: name a folder")
    return _check_writable_under(path, (path, *path.absolute().parents), option)


def check_out_file(out, option: str = "--out") -> Path:
    """``out`` as a file to be written (replaced if it exists), or a PcastError naming ``option`` — before
    any work: a folder, a path under a file, or one whose nearest existing parent cannot be written."""
    path = Path(out)
    if path.is_dir():
        raise PcastError(f"{option}={str(out)!r} is a folder; name a file")
    return _check_writable_under(path, path.absolute().parents, option)


def _check_writable_under(path: Path, folders, option: str) -> Path:
    for folder in folders:
        if folder.exists():
            if not folder.is_dir():
                raise PcastError(f"{option}={str(path)!r} lies under {str(folder)!r}, which is not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PcastError(f"{option}={str(path)!r}: {str(folder)!r} is not writable")
            break
    return path


def _atomic(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path, text: str) -> Path:
    """Write a UTF-8 text file atomically."""
    return _atomic(Path(path), text.encode("utf-8"))


def _csv_value(v):
    if isinstance(v, bool):  # what pandas.read_csv parses as a boolean
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    try:  # numpy scalars
        import numpy as np

        if isinstance(v, np.generic):
            return _csv_value(v.item())
    except ImportError:  # pragma: no cover
        pass
    return v


def write_csv(path, rows: Iterable[dict], columns: Sequence[str] | None = None, *, tidy: bool = False) -> Path:
    """Write rows (dicts) as CSV with full float precision, booleans as ``true``/``false``.

    ``columns`` fixes the column order; by default every key in first-seen order. Every cell is
    checked first (:func:`check_published`, the table named by the file's stem): a None,
    non-finite or dashed value is an error, never an empty cell; a column a row does not have at
    all (a table of two kinds of rows) reads :data:`NO_SUCH_COLUMN`, or is an error with
    ``tidy=True`` (one kind of row per table: each row has every column).
    """
    return write_text(path, csv_text(rows, columns, table=Path(path).stem, tidy=tidy))


def csv_text(rows: Iterable[dict], columns: Sequence[str] | None = None, *, table: str = "rows",
             tidy: bool = False) -> str:
    """The CSV :func:`write_csv` writes, as a string (``table`` names the rows in its errors)."""
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
    check_published(table, rows, columns, absent_ok=not tidy)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_csv_value(r[k]) if k in r else NO_SUCH_COLUMN for k in columns])
    return buf.getvalue()


def json_value(x):
    """``x`` as plain JSON data: non-finite floats → None, NumPy scalars → Python, paths → str."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        try:
            return json_value(x.item())
        except (TypeError, ValueError):
            pass
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path, obj) -> Path:
    """Write JSON (indented, UTF-8) atomically; non-finite floats become null."""
    return write_text(path, json.dumps(json_value(obj), indent=1, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def new_figure(*, nrows: int = 1, ncols: int = 1, figsize=(7.0, 4.5), height_ratios=None,
               sharex: bool = False):
    """A matplotlib Figure on the Agg canvas (no pyplot) and its axes.

    Returns ``(figure, axes)``; ``axes`` is a single Axes for 1×1, else an array.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    kw = {"height_ratios": height_ratios} if height_ratios is not None else {}
    axes = fig.subplots(nrows, ncols, sharex=sharex, gridspec_kw=kw or None, squeeze=True)
    return fig, axes


def label_log_axis(axis, subs=(1.0, 2.0, 5.0)) -> None:
    """Major ticks at 1-2-5 × 10^k on a log axis, each labelled (``5×10⁻⁶``; plain ``0.5``, ``2``, ``300``
    from 0.01 to 10⁴); unlabelled minors."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(value, _pos):
        if value <= 0:
            return ""
        if 1e-2 <= value < 1e4:  # a number one reads as such: 0.5, 2, 300 (not 2×10⁰)
            return f"{value:g}"
        exp = math.floor(math.log10(value) + 1e-9)
        mant = value / 10.0**exp
        if abs(mant - 1.0) < 1e-6:
            return rf"$10^{{{exp}}}$"
        return rf"${mant:g}\times10^{{{exp}}}$"

    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.set_minor_formatter(NullFormatter())


#: The file formats :func:`save_figure` writes, by the path's extension.
FIGURE_FORMATS = ("png", "pdf", "svg")


def figure_format(path) -> str:
    """The format a figure file gets from its extension (:data:`FIGURE_FORMATS`), or a PcastError."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        raise PcastError(f"{str(path)!r}: a figure file ends in {', '.join('.' + f for f in FIGURE_FORMATS)} "
                         "(the extension picks the format)")
    return fmt


def save_figure(fig, path, *, dpi: int = 150) -> Path:
    """Save a figure atomically as PNG, PDF or SVG (by the extension of ``path``), after checking that
    every plotted line is finite (a non-finite point would silently break the line: a PcastError
    naming the figure and line). PDF and SVG carry no creation date, so a rerun writes the same file."""
    import numpy as np

    fmt = figure_format(path)
    for ax in fig.axes:
        for line in ax.get_lines():
            data = np.concatenate([np.asarray(line.get_xdata(), np.float64).ravel(),
                                   np.asarray(line.get_ydata(), np.float64).ravel()])
            if not np.all(np.isfinite(data)):
                raise PcastError(f"figure {Path(path).stem}: line {line.get_label()!r} of panel "
                                 f"{ax.get_title() or ax.get_ylabel()!r} has a non-finite point; a published "
                                 "number must be finite")
    buf = io.BytesIO()
    metadata = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}.get(fmt)
    fig.savefig(buf, format=fmt, dpi=dpi, metadata=metadata)
    return _atomic(Path(path), buf.getvalue())


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes", "scipy", "matplotlib", "pcast_jax")


def library_versions(packages: Sequence[str] = _PACKAGES) -> dict[str, str | None]:
    """Installed versions of the libraries a result depends on (None when absent), and Python's."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["platform"] = f"{platform.system()} {platform.machine()}"
    out["python_implementation"] = sys.implementation.name
    return out


# --------------------------------------------------------------------------------------------
# Sweep figures (``pcast plot``)
# --------------------------------------------------------------------------------------------

#: The colour of each paper configuration, as in the reproduction figures; other configs take the
#: tab10 colours in order.
CONFIG_COLORS: dict[str, str] = {
    "fwd_s1": "#d62728",
    "rev_s1": "#ff7f0e",
    "fwd_s448": "#9467bd",
    "fwd_s256": "#2ca02c",
    "rev_s256": "#1f77b4",
}
#: Marker, line style and drawing order of each paper configuration. Forward and Reverse S = 256 give
#: nearly the same numbers: Reverse is a wide solid line with open circles, Forward a dashed line with
#: small squares drawn on top of it, so both stay visible where they overlap.
CONFIG_STYLES: dict[str, dict] = {
    "fwd_s1": {"marker": "o", "linestyle": "-", "zorder": 3},
    "rev_s1": {"marker": "v", "linestyle": "-", "zorder": 3},
    "fwd_s448": {"marker": "^", "linestyle": "-", "zorder": 3},
    "rev_s256": {"marker": "o", "linestyle": "-", "zorder": 3, "lw": 2.6, "ms": 7, "mfc": "none"},
    "fwd_s256": {"marker": "s", "linestyle": "--", "zorder": 4, "lw": 1.3, "ms": 3.5},
}
_OTHER_COLORS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#ff7f0e", "#2ca02c",
                 "#d62728", "#9467bd")
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
#: The coordinates a sweep figure can put on x, colour or facet by; the sizes get a log x axis.
SWEEP_COORDS = ("delta", "n", "config")
SIZE_COORDS = ("n",)


def _sweep_values(result, coord: str, configs: Sequence[str]) -> list:
    spec = result.spec
    return {"delta": list(spec.deltas), "n": list(spec.ns), "config": list(configs)}[coord]


def _value_text(coord: str, v) -> str:
    return str(v) if coord == "config" else f"{'N' if coord == 'n' else 'Δ'} = {v:g}"


def _no_values(y: str):
    """Raise: metric ``y`` has no finite value to draw (saying which sweep flag leaves it out)."""
    why = {"mse": "--no-sampled-mse", "mse_expected": "--no-expected-mse"}.get(y)
    raise PcastError(f"y={y!r} has no finite values in this sweep" + (f" (was it run with {why}?)" if why else ""))


def sweep_figure(result, *, x: str = "delta", y: str = "mse", configs: Sequence[str] | None = None,
                 log_y: bool | None = None, log_x: bool | None = None, hue: str = "config",
                 col: str | None = None):
    """A figure of one sweep metric (mean over seeds, ± one standard error shaded) against Δ or N.

    ``hue`` colours the lines by a coordinate (config, n or delta; a paper config keeps its colour
    and marker, numbers take the viridis colours in order); ``col`` draws one panel per value of
    another. The coordinate left over gives one line style per value. Axis labels are the long
    names with units (:func:`pcast_jax.metrics.axis_label`). ``log_x`` defaults to a log axis for a
    size (N), ``log_y`` to a log axis for the MSE metrics (where every value is > 0). An ``x`` with
    one value in the sweep is an error naming the coordinate that has several. Returns the Figure.
    """
    import numpy as np

    from pcast_jax.errors import check_choice
    from pcast_jax.metrics import axis_label
    from pcast_jax.stats import mean_sem

    spec = result.spec
    check_choice("x", x, ("delta", "n"))
    check_choice("y", y, tuple(result.data))
    check_choice("hue", hue, SWEEP_COORDS)
    if col is not None:
        check_choice("col", col, SWEEP_COORDS)
    used = [x, hue] + ([col] if col else [])
    if len(set(used)) != len(used):
        raise PcastError(f"x={x!r}, hue={hue!r} and col={col!r} must name different coordinates")
    names = list(spec.config_names) if configs is None else list(configs)
    for c in names:
        check_choice("config", c, spec.config_names)
    if not any(np.isfinite(result.get(y, config=c)).any() for c in names):
        _no_values(y)
    xs = np.asarray(_sweep_values(result, x, names), np.float64)
    if len(xs) < 2:
        other = next((c for c in ("delta", "n") if c != x and len(_sweep_values(result, c, names)) > 1), None)
        raise PcastError(f"x={x!r}: this sweep has one {x} value ({xs[0]:g}), so a line against it would be a "
                         "single point" + (f"; try --x {other}" if other else
                                           "; plot a sweep over several Δ or N"))
    rest = next((c for c in SWEEP_COORDS if c not in used), None)
    if log_y is None:
        log_y = y.startswith("mse")
    if log_x is None:
        log_x = x in SIZE_COORDS
    panels = _sweep_values(result, col, names) if col else [None]
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig, axes = new_figure(nrows=nrows, ncols=ncols, figsize=(2.0 + 4.2 * ncols, 1.4 + 3.4 * nrows))
    axes = np.atleast_1d(axes).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    hues = _sweep_values(result, hue, names)
    if hue == "config":
        others = iter(_OTHER_COLORS)
        color = {c: CONFIG_COLORS.get(c) or next(others, "#333333") for c in hues}
        style = {c: CONFIG_STYLES.get(c, {"marker": _MARKERS[i % len(_MARKERS)]}) for i, c in enumerate(hues)}
    else:
        from matplotlib import colormaps

        cmap = colormaps["viridis"]
        color = {v: cmap(i / max(1, len(hues) - 1) * 0.9) for i, v in enumerate(hues)}
        style = {v: {"marker": _MARKERS[i % len(_MARKERS)]} for i, v in enumerate(hues)}
    rests = _sweep_values(result, rest, names) if rest else [None]
    plotted = 0
    for ax, panel in zip(axes, panels):
        for j, r in enumerate(rests):
            for h in hues:
                at = {x: None, hue: h, **({rest: r} if rest else {}), **({col: panel} if col else {})}
                stats = []
                for v in xs:
                    at[x] = int(v) if x == "n" else float(v)
                    stats.append(mean_sem(result.get(y, config=at["config"], n=at["n"],
                                                     delta=at["delta"]).astype(np.float64)))
                m, se = (np.array(t) for t in zip(*stats))
                if not np.isfinite(m).any():
                    continue
                label = _value_text(hue, h) if len(rests) == 1 else f"{_value_text(hue, h)}, {_value_text(rest, r)}"
                kw = {"ms": 4, "lw": 1.5, "zorder": 3, **style[h]}
                if len(rests) > 1:
                    kw["linestyle"] = _LINESTYLES[j % len(_LINESTYLES)]
                ax.plot(xs, m, color=color[h], label=label, **kw)
                lo = np.maximum(m - se, m * 1e-3) if log_y else m - se
                ax.fill_between(xs, lo, m + se, color=color[h], alpha=0.15, lw=0)
                plotted += 1
        if log_y:
            ax.set_yscale("log")
            label_log_axis(ax.yaxis)
        if log_x:
            ax.set_xscale("log", base=2 if x == "n" else 10)
            if x == "n":
                from matplotlib.ticker import NullLocator

                ax.xaxis.set_minor_locator(NullLocator())
        if len(xs) <= 16:
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
        ax.set_xlabel(axis_label(x))
        ax.set_ylabel(axis_label(y))
        if col:
            ax.set_title(_value_text(col, panel), fontsize=10)
        ax.grid(alpha=0.3, which="both")
    if not plotted:
        _no_values(y)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(handles, labels, fontsize=8, ncol=2 if len(labels) > 4 else 1)
    fixed = [_value_text(c, _sweep_values(result, c, names)[0]) for c in ("n", "delta")
             if c not in used and len(_sweep_values(result, c, names)) == 1]
    parts = fixed + [f"q_len = {spec.q_len}", f"d = {spec.d}", f"k_sink = {spec.k_sink}", f"{spec.seeds} seeds",
                     "bands: ± one standard error"]
    import textwrap

    width = int(30 + 25 * ncols)
    fig.suptitle("\n".join(textwrap.wrap(f"{y} vs {x} ({', '.join(parts)})", width)), fontsize=10)
    return fig
