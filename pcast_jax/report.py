"""Writing reports: number formatting, markdown tables, CSV, PNG (matplotlib, Agg) and JSON files.

Files are written atomically (temporary file in the same folder, then rename), so an interrupted
run never leaves a half-written report. Figures use matplotlib's object API with the Agg canvas:
no pyplot global state, no display needed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

from pcast_jax.fileio import atomic_write

__all__ = [
    "fmt_num",
    "fmt_sci",
    "fmt_pct",
    "fmt_ratio",
    "fmt_signed",
    "ratio",
    "markdown_table",
    "write_text",
    "write_csv",
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


def fmt_num(x, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals; ``—`` for missing or non-finite values."""
    if _bad(x):
        return "—"
    return f"{float(x):.{digits}f}"


def fmt_sci(x, digits: int = 2) -> str:
    """Scientific notation (``5.65e-05``); ``—`` for missing values."""
    if _bad(x):
        return "—"
    return f"{float(x):.{digits}e}"


def fmt_pct(x, digits: int = 1) -> str:
    """A fraction in [0, 1] as a percentage (``0.223`` → ``22.3%``)."""
    if _bad(x):
        return "—"
    return f"{100.0 * float(x):.{digits}f}%"


def fmt_ratio(x, digits: int = 2) -> str:
    """A ratio with a multiplication sign (``3.4×``)."""
    if _bad(x):
        return "—"
    return f"{float(x):.{digits}f}×"


def fmt_signed(x, digits: int = 1, unit: str = "") -> str:
    """A difference with its sign (``+1.2 pp``)."""
    if _bad(x):
        return "—"
    return f"{float(x):+.{digits}f}{(' ' + unit) if unit else ''}"


def ratio(a, b) -> float:
    """a / b, NaN when either is missing or b is zero."""
    if _bad(a) or _bad(b) or float(b) == 0.0:
        return float("nan")
    return float(a) / float(b)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[dict], columns: Sequence, *, align: str | None = None) -> str:
    """A GitHub markdown table.

    Args:
      rows: one dict per row.
      columns: objects with ``key``, ``header`` and ``fmt`` (a callable value → str), or
        ``(key, header)`` / ``(key, header, fmt)`` tuples.
      align: one character per column, ``l`` or ``r`` (default: first column left, rest right).
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
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append("—" if v is None else str(fmt(v)).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _atomic(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path, text: str) -> Path:
    """Write a UTF-8 text file atomically."""
    return _atomic(Path(path), text.encode("utf-8"))


def _csv_value(v):
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "" if not math.isfinite(v) else repr(v)
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    try:  # numpy scalars
        import numpy as np

        if isinstance(v, np.generic):
            return _csv_value(v.item())
    except ImportError:  # pragma: no cover
        pass
    return v


def write_csv(path, rows: Iterable[dict], columns: Sequence[str] | None = None) -> Path:
    """Write rows (dicts) as CSV with full float precision; missing values are empty cells.

    ``columns`` fixes the column order; by default every key in first-seen order.
    """
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_csv_value(r.get(k)) for k in columns])
    return write_text(path, buf.getvalue())


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
    """Major ticks at 1-2-5 × 10^k on a log axis, each labelled (``5×10⁻⁶``); unlabelled minors."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(value, _pos):
        if value <= 0:
            return ""
        exp = math.floor(math.log10(value) + 1e-9)
        mant = value / 10.0**exp
        if abs(mant - 1.0) < 1e-6:
            return rf"$10^{{{exp}}}$"
        return rf"${mant:g}\times10^{{{exp}}}$"

    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.set_minor_formatter(NullFormatter())


def save_figure(fig, path, *, dpi: int = 150) -> Path:
    """Save a figure as PNG atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
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
_OTHER_COLORS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#ff7f0e", "#2ca02c",
                 "#d62728", "#9467bd")
_LINESTYLES = ("-", "--", ":", "-.")
#: Axis labels of the sweep metrics and coordinates.
SWEEP_LABELS = {
    "delta": "sink strength Δ",
    "n": "KV length N",
    "mse": "MSE vs FP32 reference",
    "mse_expected": "expected MSE (V averaged)",
    "frac_zeroed": "fraction of non-sink P cast to zero",
    "zeroed_mass": "probability mass cast to zero (fraction)",
    "nonsink_mass": "non-sink probability mass (fraction)",
}


def sweep_figure(result, *, x: str = "delta", y: str = "mse", configs: Sequence[str] | None = None,
                 log_y: bool | None = None):
    """A figure of one sweep metric against Δ or N, one line per config (± one standard error, shaded).

    The other axis (N when ``x`` is Δ and the reverse) gives one line style per value. ``log_y``
    defaults to a log axis for the MSE metrics (where every value is > 0). Returns the Figure.
    """
    import numpy as np

    from pcast_jax.errors import PcastError, check_choice
    from pcast_jax.stats import mean_sem

    spec = result.spec
    check_choice("x", x, ("delta", "n"))
    check_choice("y", y, tuple(result.data))
    names = list(spec.config_names) if configs is None else list(configs)
    for c in names:
        check_choice("config", c, spec.config_names)
    xs = np.asarray(spec.deltas if x == "delta" else spec.ns, np.float64)
    others = spec.ns if x == "delta" else spec.deltas
    if log_y is None:
        log_y = y.startswith("mse")
    fig, ax = new_figure(figsize=(7.5, 4.8))
    colors = iter(_OTHER_COLORS)
    color = {c: CONFIG_COLORS.get(c) or next(colors, "#333333") for c in names}
    plotted = 0
    for j, other in enumerate(others):
        for c in names:
            stats = []
            for v in xs:
                key = {"n": other, "delta": float(v)} if x == "delta" else {"n": int(v), "delta": other}
                stats.append(mean_sem(result.get(y, config=c, **key).astype(np.float64)))
            m, se = (np.array(t) for t in zip(*stats))
            if not np.isfinite(m).any():
                continue
            label = c if len(others) == 1 else f"{c}, {'N' if x == 'delta' else 'Δ'} = {other:g}"
            ax.plot(xs, m, "o" + _LINESTYLES[j % len(_LINESTYLES)], color=color[c], label=label, ms=4, lw=1.5)
            lo = np.maximum(m - se, m * 1e-3) if log_y else m - se
            ax.fill_between(xs, lo, m + se, color=color[c], alpha=0.15, lw=0)
            plotted += 1
    if not plotted:
        why = {"mse": "--no-sampled-mse", "mse_expected": "--no-expected-mse"}.get(y)
        raise PcastError(f"y={y!r} has no finite values in this sweep"
                         + (f" (was it run with {why}?)" if why else ""))
    if log_y:
        ax.set_yscale("log")
        label_log_axis(ax.yaxis)
    if x == "n" and len(xs) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{int(v)}" for v in xs])
    elif len(xs) <= 16:
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
    ax.set_xlabel(SWEEP_LABELS.get(x, x))
    ax.set_ylabel(SWEEP_LABELS.get(y, y))
    fixed = (f"N = {spec.ns[0]}" if x == "delta" and len(spec.ns) == 1 else
             f"Δ = {spec.deltas[0]:g}" if x == "n" and len(spec.deltas) == 1 else "")
    parts = [p for p in (fixed, f"q_len = {spec.q_len}", f"d = {spec.d}", f"k_sink = {spec.k_sink}",
                         f"{spec.seeds} seeds") if p]
    ax.set_title(f"{y} vs {x} ({', '.join(parts)}; bands: ± one standard error)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2 if len(names) * len(others) > 4 else 1)
    return fig
