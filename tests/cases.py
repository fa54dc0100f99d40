"""Parameter lists shared by several test modules."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import pytest

from pcast_jax.config import KernelConfig

#: ``PCAST_JAX_TEST_FULL=1`` (``make test-full``): the tests that walk a cross product of presets and
#: axes walk all of it; without it (``make test``, CI) they walk a subset that still covers every preset
#: and every value of each axis (the conformance matrix, the Pallas kernels' registry test).
FULL = os.environ.get("PCAST_JAX_TEST_FULL", "0") not in ("", "0")
#: ``PCAST_JAX_TEST_HALF=1`` or ``2`` (``make test HALF=…``; CI runs one half per jax version): every other
#: case of each parametrized test function and every other unparametrized function of each module, alternating
#: between the halves — so the two halves together run every case once (``tests/conftest.py``). Tests marked
#: ``every_half`` run in each half (the conformance matrix, already a covering subset of its cross product,
#: whose turn the second half shifts by one cell; the Hopper lowering proofs). Empty: every case.
HALF_VAR = "PCAST_JAX_TEST_HALF"
HALF = os.environ.get(HALF_VAR, "").strip()


def subprocess_env(devices: int) -> dict[str, str]:
    """The environment of a JAX subprocess with ``devices`` CPU devices: this process's, with its
    ``XLA_FLAGS`` kept (a subprocess compiled for another ISA, e.g. ``--xla_cpu_max_isa``, computes other
    float32 bits than the reference it is held to bit for bit) and only the device count replaced; no
    proxy variable (gRPC would use it for the coordinator on 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]))
    return env


def distinct_configs(configs: dict[str, KernelConfig], by: Callable = lambda cfg: cfg) -> list:
    """One ``pytest.param`` per group of ``by(config)``, the first config of each, its id naming every config
    it stands for.

    Configs are equal when their semantics are (the name is a label), so grouping by the config itself
    leaves one test per behaviour: e.g. ``fwd_s1=hpc_ops_prior``.
    """
    groups: dict = {}
    for name, cfg in configs.items():
        groups.setdefault(by(cfg), []).append((name, cfg))
    return [pytest.param(members[0][1], id="=".join(n for n, _ in members)) for members in groups.values()]


def distinct_programs(configs: dict[str, KernelConfig]) -> list:
    """:func:`distinct_configs` grouped by compiled program (:meth:`KernelConfig.program`).

    Configs that differ only in their numbers (S, τ, the V channel max, λ) take the same operations; a
    test of how the operations are composed (one implementation against another, weights against
    outputs) needs one of them.
    """
    return distinct_configs(configs, by=KernelConfig.program)


def shared_program(make: Callable) -> Callable:
    """``make(config, *static)`` → a function of arrays, compiled once per config *program*.

    ``run = shared_program(make)``; ``run(cfg, *static)(*arrays)`` computes ``make(cfg, *static)(*arrays)``
    under ``jax.jit`` with ``cfg``'s numbers as traced arguments (:meth:`KernelConfig.program`), so configs
    that differ only in S, τ or the V channel max share one program (and JAX's persistent cache hits).
    """
    @functools.lru_cache(maxsize=None)
    def jitted(program, *static):
        return jax.jit(lambda nums, name, *arrays: make(program.bind(nums, name=name), *static)(*arrays),
                       static_argnums=1)

    def run(cfg: KernelConfig, *static):
        return functools.partial(jitted(cfg.program(), *static), cfg.numbers(), cfg.name)
    return run


def count_chunks(monkeypatch) -> list:
    """Record (N, first seed, end seed) of every chunk the local sweep driver computes from now on."""
    from pcast_jax.sweep import local

    calls = []
    real = local.compute_chunk

    def counting(spec, n, s0, s1, *args, **kw):
        calls.append((n, s0, s1))
        return real(spec, n, s0, s1, *args, **kw)

    monkeypatch.setattr(local, "compute_chunk", counting)
    return calls


def gpu_bench():
    """``benchmarks/gpu_bench.py`` (a script, not a package module) loaded as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
