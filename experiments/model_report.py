"""Real-model section of the reproduction report (SmolLM2-135M with simulated FP8 attention).

A thin wrapper: :func:`pcast_jax.models.fp8_report.build_report` does the work.
"""

from __future__ import annotations

from pcast_jax.models.fp8_report import FILES, build_report

__all__ = ["model_section", "FILES"]


def model_section(out_dir, quick: bool = False, log=None) -> str:
    """Run the real-model analysis, write its ``model_*.csv`` / ``model_*.png`` into ``out_dir``.

    Returns the section's markdown (starting with a ``##`` heading). Raises ImportError naming
    the install commands when the model extra is missing (callers may skip the section then).
    """
    return build_report(out_dir, quick=quick, level=2, log=log)
