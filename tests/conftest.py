"""Fixtures shared by the test modules.

Shared helpers that are not fixtures live in plain modules beside this file (pytest puts this
folder on ``sys.path``): ``oracle.py`` (the independent float64 Algorithm 1), ``cases.py``
(parameter lists) and ``model_extra.py`` (the guard for the real-model extra).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest

from pcast_jax import cache

from cases import HALF, HALF_VAR

#: The suite's compiled programs, kept between runs (most of a cold run is XLA compiling them).
TEST_CACHE_DIR = cache.default_cache_dir().parent / "test-jax-cache"
#: A folder past this size loses its least recently used entries, down to half of it, when a run starts.
TEST_CACHE_MAX_BYTES = 2 << 30


def pytest_configure(config):
    """Every program the suite compiles goes through JAX's persistent compilation cache.

    A test compiles small programs (a conformance cell about a dozen of 0.2 s each), so most of a
    cold run is XLA compiling; a rerun loads the same programs, verified
    (:class:`pcast_jax.cache.VerifiedCache`), from ``TEST_CACHE_DIR``
    (``~/.cache/pcast_jax/test-jax-cache``), apart from the user's own cache. The loaded program is
    the one XLA would compile: JAX's key covers the program, the JAX and jaxlib versions, the backend
    and the compile options. ``PCAST_JAX_COMPILATION_CACHE=0`` runs the suite without it (every
    program compiled); a path there puts it in that folder. The commands and examples the suite runs
    in child processes get the same folder through that variable (so a test run leaves the user's own
    cache as it was).

    JAX's own size limit (``jax_compilation_cache_max_size``) scans the whole folder on every write,
    which made a cold run of the suite slower the more it had written; the folder is trimmed here
    instead, once per run, before any worker starts.
    """
    path = cache._env_folder(TEST_CACHE_DIR)
    if path is None:
        cache.enable()  # off for this run
        return
    if not hasattr(config, "workerinput"):  # the controlling process, or a run without workers
        _trim(path, TEST_CACHE_MAX_BYTES)
    folder = cache.enable(path=path)
    if folder is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        # the commands and examples the suite runs use it too, for every program they compile
        os.environ[cache.ENV_VAR] = str(folder)
        os.environ[cache._MIN_TIME_VAR] = "0"


def _trim(folder: Path, max_bytes: int) -> None:
    """Remove the least recently used entries of ``folder`` down to ``max_bytes // 2`` once it exceeds ``max_bytes``."""
    try:
        entries = [(p.stat(), p) for p in folder.iterdir() if p.is_file()]
    except OSError:  # no folder yet (or not ours to read): nothing to trim
        return
    total = sum(st.st_size for st, _ in entries)
    if total <= max_bytes:
        return
    for st, p in sorted(entries, key=lambda e: max(e[0].st_atime, e[0].st_mtime)):
        if total <= max_bytes // 2:
            break
        p.unlink(missing_ok=True)
        total -= st.st_size


def pytest_collection_modifyitems(config, items):
    """In a halved run (:data:`cases.HALF`) keep every other case of each parametrized test function and every
    other unparametrized test function of each module, alternating, so the two halves together run each once."""
    if not HALF:
        return
    if HALF not in ("1", "2"):
        raise pytest.UsageError(f"{HALF_VAR}={HALF!r}: expected 1 or 2 (or unset: every case)")
    seen: dict[tuple, int] = {}
    keep, drop = [], []
    for item in items:
        if hasattr(item, "callspec"):  # a case: counted within its function
            key = (item.path, item.cls.__name__ if item.cls else None, getattr(item, "originalname", item.name))
        else:  # a function: counted within its module
            key = (item.path,)
        index = seen[key] = seen.get(key, -1) + 1
        whole = item.get_closest_marker("every_half") is not None
        (keep if whole or index % 2 == int(HALF) - 1 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh NumPy generator with a fixed seed (each test gets the same stream)."""
    return np.random.default_rng(0)


@pytest.fixture
def strict_rank_promotion():
    """Implicit rank promotion raises inside the test (catches broadcasting by accident)."""
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Release every compiled program when a test module ends.

    XLA:CPU maps memory regions for each executable it loads, and JAX keeps every executable a jitted
    function compiled. A test worker that runs many modules would otherwise reach the kernel's limit on
    a process's mappings (``vm.max_map_count``, 65530 by default), where XLA's compiler crashes with a
    segmentation fault (seen with two workers after ~20 minutes of the suite).
    """
    yield
    jax.clear_caches()
