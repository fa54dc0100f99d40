"""The paper's tables and figures, one thin module each, run by ``pcast reproduce``.

Installed as ``pcast_experiments`` (the folder ``experiments/`` of the source tree). Each module
(``table1``, ``table2``, ``figure1_dp``, ``figure2_delta``, ``figure3_n``, ``appendix_a``,
``appendix_b``, ``table3_kernels``) declares the sweep it needs and the paper's printed values,
and returns a :class:`~pcast_experiments.common.Section`; :mod:`pcast_experiments.registry` runs
them and writes the report, and :mod:`pcast_experiments.command` adds ``pcast reproduce`` to the
command line. Each is also a script: ``python -m pcast_experiments.table2 --quick``. The names
below load on first use, so the command line can import :mod:`pcast_experiments.command` without
importing JAX.
"""

import importlib

__all__ = ["EXPERIMENTS", "reproduce", "Context", "Section", "Finding", "Sizes", "FULL", "QUICK"]

_HOME = {"EXPERIMENTS": ".registry", "reproduce": ".registry", "Context": ".common", "Section": ".common",
         "Finding": ".common", "Sizes": ".common", "FULL": ".common", "QUICK": ".common"}


def __getattr__(name: str):
    """Load a public name from its module on first use."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the not yet loaded public ones included."""
    return sorted(set(globals()) | set(__all__))
