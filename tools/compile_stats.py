"""A pytest plugin that counts the XLA compilations of a test run and their seconds.

``PYTHONPATH=tools python -m pytest -p compile_stats -p no:cacheprovider -n 0 tests/FILE -q`` with
``PCAST_JAX_COMPILATION_CACHE=0`` (nothing loaded from a cache) prints, at the end, how many
programs XLA compiled and the seconds it spent compiling them (JAX's own
``/jax/core/compile/backend_compile_duration`` event): figures that do not depend on how busy the
machine's other cores are, unlike wall time. Run it without workers (``-n 0``): the listener lives in
the process that compiles.
"""

from __future__ import annotations

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_totals = {"count": 0, "seconds": 0.0}


def _listen(event: str, duration: float, **kwargs) -> None:
    if event == _EVENT:
        _totals["count"] += 1
        _totals["seconds"] += duration


def pytest_configure(config):
    jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"XLA compilations: {_totals['count']}, compile seconds: {_totals['seconds']:.1f}")
