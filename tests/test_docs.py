"""Every Python block of README.md and docs/**/*.md runs, and every ``pcast`` line parses.

* One test per page, over the pages found (a new page is covered with no edit here): the page's
  ```python blocks run in order in one shared namespace, in a temporary working folder.
* A block is left out only with a comment line directly above its fence,
  ``<!-- not-run: REASON -->``; the reason must be given, and the count of such blocks is held low.
* Every shell line of a page (in a ```sh, ```bash or ```console block) that starts with ``pcast `` or
  ``.venv/bin/pcast `` is parsed by the real ``pcast`` parser (parsed only, never run), so a renamed,
  removed flag fails here; so is every inline ```pcast …``` in the text that
  passes an option and holds no placeholder (``[...]``, ``{a,b}``, ``…``); one without options must name a sub-command.
* A page whose printed values matter has a check in the test file of its subject (``PAGE_CHECKS``),
  called with the page's namespace and output after its blocks ran.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = ("_build", "_generated")  # written by the docs build, not pages of their own
NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")
SHELL = ("sh", "bash", "console", "shell")
PCAST = re.compile(r"^(?:\.venv/bin/)?pcast(?:\s|$)")
#: Blocks allowed to carry a not-run mark, in all the pages together (GPU-only or very long cases).
MAX_NOT_RUN = 3

#: page -> "test module:function" holding the assertions on what the page's blocks print and make.
PAGE_CHECKS = {
    "docs/guides/own_model.md": "test_analysis:check_own_model_page",
    "docs/guides/pallas.md": "test_pallas:check_pallas_page",
    "docs/guides/sinks_and_rescale.md": "test_sinks_and_rescale:check_sinks_and_rescale_page",
    "docs/guides/paper.md": "test_theory:check_paper_page",
    "docs/guides/fingerprint.md": "test_fingerprint:check_fingerprint_page",
}


def pages() -> list[Path]:
    found = [p for p in DOCS.rglob("*.md") if not set(p.relative_to(DOCS).parts) & set(GENERATED)]
    return [ROOT / "README.md", *sorted(found)]


def fences(path: Path):
    """(language, first line number of the code, code, not-run reason or None) for each fenced block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        mark = NOT_RUN.match(lines[i - 1].strip()) if i else None
        end = i + 1
        while end < len(lines) and not lines[end].startswith(opening[1]):
            end += 1
        yield opening[2], i + 2, "\n".join(lines[i + 1:end]) + "\n", (mark[1].strip() if mark else None)
        i = end + 1


def python_blocks(path: Path):
    return [(line, code, reason) for lang, line, code, reason in fences(path) if lang == "python"]


def pcast_lines(path: Path):
    """(line number, argv) of each shell line of the page that runs ``pcast``."""
    found = []
    for lang, first, code, _ in fences(path):
        if lang not in SHELL:
            continue
        joined, start = "", None
        for n, raw in enumerate(code.splitlines(), first):
            line = raw.strip()
            if line.startswith("$ "):
                line = line[2:]
            start = n if not joined else start
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            joined += line
            if PCAST.match(joined):
                found.append((start, shlex.split(joined, comments=True)[1:]))
            joined = ""
    return found


def pcast_spans(path: Path):
    """(line number, argv) of each inline ``pcast …`` code span of the page's text (not its blocks)."""
    found = []
    in_block = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            continue
        for span in re.findall(r"`((?:\.venv/bin/)?pcast [^`]+)`", line):
            if not re.search(r"[\[\]{}…|]|\.\.\.", span):
                found.append((n, shlex.split(span)[1:]))
    return found


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", pages(), ids=_id)
def test_page_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(page)
    for line, _code, reason in blocks:
        assert reason is None or reason, f"{_id(page)}:{line}: a not-run mark must say why"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code, reason in blocks:
        if reason is None:
            # padded so that a traceback names the page's own line
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)  # noqa: S102 - our docs
    check = PAGE_CHECKS.get(_id(page))
    if check:
        module, function = check.split(":")
        getattr(importlib.import_module(module), function)(namespace, capsys.readouterr().out, tmp_path)


def test_not_run_blocks_are_few_and_say_why():
    marked = [(_id(p), line, reason) for p in pages() for line, _, reason in python_blocks(p) if reason is not None]
    assert all(reason for _, _, reason in marked), marked
    assert len(marked) <= MAX_NOT_RUN, marked


def test_page_checks_name_pages_that_exist():
    for page, check in PAGE_CHECKS.items():
        assert (ROOT / page).is_file(), page
        module, function = check.split(":")
        assert callable(getattr(importlib.import_module(module), function)), check
        assert python_blocks(ROOT / page), f"{page} has no Python block to check"


def test_the_pages_are_found():
    found = {_id(p) for p in pages()}
    assert {"README.md", "docs/index.md", "docs/quickstart.md", "docs/guides/paper.md"} <= found
    assert not any(part in GENERATED for p in found for part in Path(p).parts)


@pytest.mark.parametrize("page", [p for p in pages() if pcast_lines(p) or pcast_spans(p)], ids=_id)
def test_page_pcast_lines_parse(page):
    from pcast_jax.cli import build_parser

    commands = set(build_parser([])._subparsers._group_actions[0].choices)
    for line, argv in pcast_lines(page) + pcast_spans(page):
        if not any(a.startswith("-") for a in argv):  # a command named in the text
            assert argv[0] in commands, f"{_id(page)}:{line}: pcast {shlex.join(argv)}: no such command"
            continue
        parser = build_parser(argv)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                parser.parse_args(argv)
        except SystemExit as exc:  # --help and --version end parsing with status 0
            assert exc.code == 0, f"{_id(page)}:{line}: pcast {shlex.join(argv)}: {out.getvalue().strip()}"
        assert "pcast: warning:" not in out.getvalue(), f"{_id(page)}:{line}: {out.getvalue().strip()}"


def test_a_renamed_flag_fails_the_parse():
    from pcast_jax.cli import build_parser

    argv = ["sweep", "--deltas", "5,7"]  # the old spelling of --delta
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        build_parser(argv).parse_args(argv)
    assert exc.value.code == 2


def _generator(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(DOCS / "_ext"))
    gen = importlib.import_module("generate_pages")
    monkeypatch.setattr(gen, "OUT", tmp_path / "_generated")
    return gen


def test_preset_pages_cover_every_preset_with_its_source_line(monkeypatch, tmp_path):
    from pcast_jax.presets import FAMILIES, PRESETS

    gen = _generator(monkeypatch, tmp_path)
    assert gen.preset_pages() == list(FAMILIES)
    for family, names in FAMILIES.items():
        text = (tmp_path / "_generated" / "presets" / f"{family}.md").read_text(encoding="utf-8")
        for name in names:
            cited = re.search(rf"^`{name}`\n: `pcast_jax/presets/{family}\.py:(\d+)` — `(.*)`\n\n  (.+)$", text, re.M)
            assert cited, (family, name)
            assert cited[2] == PRESETS[name].to_string() and "no source note" not in cited[3], (name, cited[3])
            source = (ROOT / "pcast_jax" / "presets" / f"{family}.py").read_text(encoding="utf-8").splitlines()
            assert f'"{name}"' in source[int(cited[1]) - 1], (name, cited[1])


def test_deployments_page_lists_every_row_with_its_citations(monkeypatch, tmp_path):
    """docs/guides/deployment.md includes a page written from the table: every row, in order, with its
    selection line, kernel entry and capabilities as the table holds them."""
    from pcast_jax.deployments import DEPLOYMENTS, MODEL_DTYPE_KV

    gen = _generator(monkeypatch, tmp_path)
    assert gen.deployments_page() == len(DEPLOYMENTS)
    text = (tmp_path / "_generated" / "deployments.md").read_text(encoding="utf-8")
    heads = re.findall(r"^\*\*(.+)\*\*$", text, re.M)
    assert heads == [f"{d.engine} · {d.backend} · {', '.join(d.gpus)}" for d in DEPLOYMENTS]
    for d in DEPLOYMENTS:
        assert f"- selected by: {d.selection.replace('|', chr(92) + '|')}" in text, d.selection
        if d.capabilities.source:
            assert d.capabilities.source.replace("|", "\\|") in text
    for entry in MODEL_DTYPE_KV:  # the rows of a KV cache in the model dtype, each cited
        assert f"- {entry.engine} · {', '.join(entry.backends)}: " in text and entry.selection in text
    assert "```{include} ../_generated/deployments.md" in (ROOT / "docs/guides/deployment.md").read_text("utf-8")


def test_examples_page_shows_each_example_or_says_there_is_none(monkeypatch, tmp_path):
    gen = _generator(monkeypatch, tmp_path)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.examples_page() == 0
    assert "no `examples/` folder" in (tmp_path / "_generated" / "examples.md").read_text(encoding="utf-8")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "01_first.py").write_text('"""What the first example shows."""\nprint(1)\n')
    assert gen.examples_page() == 1
    text = (tmp_path / "_generated" / "examples.md").read_text(encoding="utf-8")
    assert "What the first example shows." in text and "literalinclude} ../../examples/01_first.py" in text


def test_readme_links_point_at_files_that_exist():
    """README.md is not part of the Sphinx build (which checks the pages' own links): its links are checked here."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    assert [link for link in local if not (ROOT / link).is_file()] == []
