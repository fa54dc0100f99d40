"""Pages written from the code at build time, so no table in the docs can drift from what it shows.

* ``_generated/presets/<family>.md``: every preset of each family of :data:`pcast_jax.presets.FAMILIES`,
  its fields, the source citation written beside it in its family module, and its KV tile by head dim.
* ``_generated/examples.md``: each ``examples/*.py`` (its docstring as text, then the file).
* ``_generated/exports.md``: the names ``import pcast_jax`` offers and where each is documented.
* ``_generated/metrics.md``: every metric and coordinate of a sweep, and the trace analysis's own metrics
  (:data:`pcast_jax.quantities.QUANTITIES`).
* ``_generated/deployments.md``: every row of :data:`pcast_jax.deployments.DEPLOYMENTS` with its citations.

A file is rewritten only when its text changes, so an unchanged page is not rebuilt.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
OUT = DOCS / "_generated"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _cell(value) -> str:
    return str(value).replace("|", "\\|")


def _citation(lines: list[str], name: str) -> tuple[int, str]:
    """The line of preset ``name``'s entry in its module and the comment written above (and beside) it."""
    (at,) = [i for i, line in enumerate(lines) if re.match(rf'\s*"{re.escape(name)}"\s*:', line)]
    comment = _comment_above(lines, at)
    if "#" in lines[at]:
        comment.append(lines[at].split("#", 1)[1].strip())
    for shared in re.findall(r"\*\*(\w+)", lines[at]):  # fields shared by several presets, cited there
        where = [i for i, line in enumerate(lines) if re.match(rf"{shared}\s*[:=]", line)]
        if where:
            comment = [f"(`{shared}`, line {where[0] + 1}:)", *_comment_above(lines, where[0]), *comment]
    if not comment:  # a table whose entries share one note: the note above the table
        opening = next(i for i in range(at, -1, -1) if lines[i][:1].isalpha())
        comment = [f"(the table at line {opening + 1}:)", *_comment_above(lines, opening)]
    return at + 1, " ".join(comment)


def _comment_above(lines: list[str], at: int) -> list[str]:
    comment = []
    i = at - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        comment.insert(0, lines[i].lstrip().lstrip("#:").strip())
        i -= 1
    return comment


def preset_pages() -> list[str]:
    from pcast_jax.config import KernelConfig
    from pcast_jax.presets import FAMILIES, PRESETS, TILES_BY_HEAD_DIM

    defaults = {f.name: f.default for f in dataclasses.fields(KernelConfig) if f.name != "name"}
    written = []
    for family, names in FAMILIES.items():
        module = importlib.import_module(f"pcast_jax.presets.{family}")
        lines = inspect.getsource(module).splitlines()
        rel = Path(module.__file__).resolve().relative_to(ROOT).as_posix()
        doc = inspect.getdoc(module) or family
        cfgs = {n: PRESETS[n] for n in names}
        shown = [f for f in defaults if any(getattr(c, f) != defaults[f] for c in cfgs.values())]
        for always in ("order", "scale", "scale_mode", "block_kv", "p_format"):
            if always not in shown:
                shown.insert(0, always)
        shown.sort(key=list(defaults).index)
        out = [f"# {family}", "", f"```{{py:module}} pcast_jax.presets.{family}", "```", "", doc.splitlines()[0], "",
               f"Module {{py:mod}}`pcast_jax.presets.{family}` (`{rel}`), {len(names)} preset(s). Written at "
               "build time from the presets themselves.", "",
               "## Fields", "",
               "Every field that differs from its default in one of these presets; the others keep their "
               "defaults: " + ", ".join(f"`{f}={defaults[f]!r}`" for f in defaults if f not in shown) + ".", "",
               "| preset | " + " | ".join(f"`{f}`" for f in shown) + " |",
               "|---|" + "---|" * len(shown)]
        for n, c in cfgs.items():
            out.append(f"| `{n}` | " + " | ".join(_cell(getattr(c, f)) for f in shown) + " |")
        tiled = [n for n in names if n in TILES_BY_HEAD_DIM]
        if tiled:
            dims = sorted({d for n in tiled for d in TILES_BY_HEAD_DIM[n]})
            out += ["", "## KV tile (`block_kv`) by head dim", "",
                    "What {py:func}`pcast_jax.presets.preset_for` runs at each head dim (other presets keep "
                    "their `block_kv` at every head dim).", "",
                    "| preset | " + " | ".join(f"d = {d}" for d in dims) + " |", "|---|" + "---|" * len(dims)]
            for n in tiled:
                out.append(f"| `{n}` | " + " | ".join(str(TILES_BY_HEAD_DIM[n].get(d, "")) for d in dims) + " |")
        out += ["", "## Sources", ""]
        for n in names:
            line, text = _citation(lines, n)
            out += [f"`{n}`", f": `{rel}:{line}` — `{PRESETS[n].to_string()}`", "",
                    f"  {text or '(no source note beside this preset)'}", ""]
        _write(OUT / "presets" / f"{family}.md", "\n".join(out).rstrip() + "\n")
        written.append(family)
    summary = ["# Preset families", "", "Every preset of {py:data}`pcast_jax.presets.PRESETS`, by family "
               "({py:data}`pcast_jax.presets.FAMILIES`); each page is generated from the presets at build time.",
               "", "| family | presets |", "|---|---|"]
    summary += [f"| [{f}]({f}.md) | " + ", ".join(f"`{n}`" for n in FAMILIES[f]) + " |" for f in written]
    summary += ["", "```{toctree}", ":hidden:", "", *written, "```"]
    _write(OUT / "presets" / "index.md", "\n".join(summary) + "\n")
    return written


def examples_page() -> int:
    files = sorted((ROOT / "examples").glob("*.py")) if (ROOT / "examples").is_dir() else []
    out = ["# Examples", ""]
    if not files:
        out += ["There is no `examples/` folder in this checkout yet: no examples to show."]
    else:
        out += [f"Each file of `examples/` ({len(files)}), as it is in the repository; run one with "
                "`.venv/bin/python examples/NAME.py`.", ""]
    for path in files:
        source = path.read_text(encoding="utf-8")
        try:
            doc = ast.get_docstring(ast.parse(source)) or ""
        except SyntaxError:
            doc = ""
        out += [f"## `{path.name}`", "", doc or "(no module docstring)", "",
                f"```{{literalinclude}} ../../examples/{path.name}", ":language: python", "```", ""]
    _write(OUT / "examples.md", "\n".join(out).rstrip() + "\n")
    return len(files)


def exports_page() -> None:
    import pcast_jax

    rows = []
    for name, module in pcast_jax._EXPORTS.items():
        if module is None:
            rows.append(f"| `pcast_jax.{name}` | module | {{py:mod}}`pcast_jax.{name}` |")
        else:
            obj = getattr(pcast_jax, name)
            kind = "class" if inspect.isclass(obj) else "func" if callable(obj) else "data"
            rows.append(f"| `pcast_jax.{name}` | {kind} | {{py:{kind}}}`{module}.{name}` |")
    text = "\n".join(["| name | kind | documented as |", "|---|---|---|", *rows]) + "\n"
    _write(OUT / "exports.md", text)


def metrics_page() -> None:
    from pcast_jax.quantities import QUANTITIES

    rows = [f"| `{name}` | {q.kind} | {q.long_name} | {q.units or '—'} | {q.direction} | {q.description} |"
            for name, q in QUANTITIES.items()]
    head = ["| name | kind | long name | unit | better | meaning |", "|---|---|---|---|---|---|"]
    _write(OUT / "metrics.md", "\n".join(head + rows) + "\n")


def deployments_page() -> int:
    """Every deployment row: what it runs, the knob, the KV-cache dtypes, the selection line, the kernel's
    entry, the capabilities read and the note, each as the table holds it."""
    from pcast_jax.deployment_table import DEPLOYMENTS, MODEL_DTYPE_KV, UNREAD

    out = []
    for d in DEPLOYMENTS:
        runs = ", ".join(f"`{n}`" for n in d.presets) if d.presets else "no FP8 P-cast"
        out += [f"**{d.engine} · {d.backend} · {', '.join(d.gpus)}**", "",
                f"- runs: {runs}; P scale set by: {'the kernel (no knob)' if d.knob == 'none' else f'`{d.knob}`'}; "
                f"KV cache: {', '.join(f'`{k}`' for k in d.kv_cache_dtypes)}",
                f"- selected by: {_cell(d.selection)}", f"- kernel entry: {_cell(d.source)}"]
        cap = d.capabilities
        if cap != UNREAD:
            dims = ", ".join(map(str, cap.head_dims)) or (f"≥ {cap.min_head_dim}" if cap.min_head_dim else "not read")
            out.append(f"- can run: soft-cap {cap.soft_cap}, sliding window {cap.sliding_window}, learned sinks "
                       f"{cap.learned_sinks}, head dims {dims} — {_cell(cap.source)}"
                       + (f"; instead: {_cell(cap.instead)}" if cap.instead else ""))
        else:
            out.append("- can run: not read from source")
        if d.note:
            out.append(f"- note: {_cell(d.note)}")
        out.append("")
    out += ["With the KV cache in the model dtype (`--kv-cache-dtype auto`) these backends cast no P to FP8, on every "
            "GPU of their rows above; any other row is refused with `auto`:", ""]
    for entry in MODEL_DTYPE_KV:
        out += [f"- {entry.engine} · {', '.join(entry.backends)}: {_cell(entry.note)} Selected by: "
                f"{_cell(entry.selection)}"]
    _write(OUT / "deployments.md", "\n".join(out).rstrip() + "\n")
    return len(DEPLOYMENTS)


def setup(app):
    metrics_page()
    deployments_page()
    preset_pages()
    examples_page()
    exports_page()
    return {"parallel_read_safe": True, "parallel_write_safe": True}
