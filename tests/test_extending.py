"""The guards docs/guides/extending.md names exist, and the steps it lists that no other test guarded."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pcast_jax import cli, deployments

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "extending.md"


def _named_guards() -> list[tuple[str, str]]:
    """(test file, test function) for every ``tests/test_x.py::test_y`` of the guide; ``::test_z`` alone
    is in the file named last."""
    out, last = [], None
    for path, name in re.findall(r"(tests/test_\w+\.py)?::(test_\w+)", GUIDE.read_text(encoding="utf-8")):
        last = path or last
        assert last, f"::{name} names no file before it"
        out.append((last, name))
    return out


def test_every_guard_the_extending_guide_names_exists():
    guards = _named_guards()
    assert len(guards) > 25
    for path, name in guards:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{path}::{name} (named in {GUIDE.name}) does not exist"


def test_doctor_help_names_every_engine_and_gpu(capsys):
    """``pcast doctor --help`` lists the engines and GPUs of the deployment table (its help is written by
    hand: a row with a new engine or GPU fails here until the help names it)."""
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for engine in sorted({row.engine for row in deployments.DEPLOYMENTS}):
        assert re.search(rf"(?<![\w-]){re.escape(engine)}(?![\w-])", text), engine
    for gpu in deployments.GPUS:
        assert re.search(rf"\b{gpu}\b", text), gpu


def test_argparse_lives_only_in_the_command_modules():
    """argparse is imported by the command line (``pcast_jax/cli.py``, ``pcast_jax/commands/``) and the
    experiments' command modules alone, never by the library."""
    allowed = {"pcast_jax/cli.py", "experiments/command.py", "experiments/model_command.py"}
    importers = []
    for folder in ("pcast_jax", "pallas_kernels", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            if "argparse" in names and rel not in allowed and not rel.startswith("pcast_jax/commands/"):
                importers.append(rel)
    assert not importers, importers
