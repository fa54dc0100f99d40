"""Fixtures shared by the test modules.

Shared helpers that are not fixtures live in plain modules beside this file (pytest puts this
folder on ``sys.path``): ``oracle.py`` (the independent float64 Algorithm 1), ``cases.py``
(parameter lists) and ``model_extra.py`` (the guard for the real-model extra).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest


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
