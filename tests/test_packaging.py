"""Packaging and the public surface: what a fresh install gets."""

from __future__ import annotations

import importlib
import pkgutil
import tomllib
from pathlib import Path

import pytest

import pcast_jax

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages explicitly (experiments/ is renamed): a new one must be listed."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    renamed = {folder: name for name, folder in conf.get("package-dir", {}).items()}
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in {"tests", "benchmarks", "build", ".venv"} or rel.parts[0].startswith("."):
            continue
        top = renamed.get(rel.parts[0], rel.parts[0])
        found.add(".".join((top, *rel.parts[1:])))
    assert found == listed


@pytest.mark.parametrize("name", pcast_jax.__all__)
def test_public_names_resolve(name):
    assert getattr(pcast_jax, name) is not None


def test_every_library_module_imports():
    """Every module of the library imports on its own (no cycle that only shows in some order)."""
    for pkg in ("pcast_jax", "pallas_kernels"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, prefix=f"{pkg}."):
            importlib.import_module(info.name)
