"""What-if section of the reproduction report: the four differentiable analyses at reduced size.

A thin wrapper: :func:`pcast_jax.whatif.report` does the work and writes its tables and figures.
``pcast whatif report`` runs the full-size version.
"""

from __future__ import annotations

from pcast_jax import whatif

__all__ = ["whatif_section"]


def whatif_section(out_dir, quick: bool = True, log=None) -> str:
    """Run the what-if analyses (reduced size), write ``whatif_*.csv`` and figures into ``out_dir``.

    Returns the section's markdown, with its figures embedded and its CSV files listed.
    """
    if log is not None:
        log("what-if: surrogate validation, worst Δ, optimal S, Prop. 3 calibration, dynamic scale …")
    rep = whatif.report(quick=True, out_dir=out_dir)
    files = [p.name for p in rep.write_tables(out_dir)]
    md = [rep.markdown, ""]
    for fig in rep.figures:
        md += [f"![{fig.stem}]({fig.name})", ""]
    md.append("Data: " + ", ".join(f"[`{f}`]({f})" for f in files) + ". Full size: `pcast whatif report`.")
    return "\n".join(md)
