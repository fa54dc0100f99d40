"""What a kernel's P-cast does to *your* model: capture Q/K/V, analyse per layer and head, report.

Model-agnostic (any JAX model whose attention goes through :func:`pcast_jax.dot_product_attention`,
Flax's ``attention_fn`` or a model hook); :mod:`pcast_jax.models` holds only what loads and runs
checkpoints.
"""

from pcast_jax.analysis.heads import (
    HEAD_METRICS,
    SCALE_GRID,
    SINK_SELECTIONS,
    E2EMetrics,
    analyze_trace,
    compare_logits,
    head_metrics,
    heads_attention,
    sink_statistics,
)

__all__ = ["HEAD_METRICS", "SCALE_GRID", "SINK_SELECTIONS", "E2EMetrics", "analyze_trace", "compare_logits",
           "head_metrics", "heads_attention", "sink_statistics"]
