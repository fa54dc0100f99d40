"""The paper's tables and figures, one thin module each, run by ``pcast reproduce``.

Each module (``table1``, ``table2``, ``figure1_dp``, ``figure2_delta``, ``figure3_n``,
``appendix_a``, ``appendix_b``, ``table3_kernels``) declares the sweep it needs and the paper's
printed values, and returns a :class:`~experiments.common.Section`; :mod:`experiments.registry`
runs them and writes the report. Each is also a script: ``python -m experiments.table2 --quick``.
"""

from experiments.common import FULL, QUICK, Context, Finding, Section, Sizes
from experiments.registry import EXPERIMENTS, reproduce

__all__ = ["EXPERIMENTS", "reproduce", "Context", "Section", "Finding", "Sizes", "FULL", "QUICK"]
