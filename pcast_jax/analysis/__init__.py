"""What a kernel's P-cast does to *your* model: capture Q/K/V, analyse per layer and head, report.

Model-agnostic (any JAX model whose attention goes through :func:`pcast_jax.dot_product_attention`,
Flax's ``attention_fn`` or a :mod:`pcast_jax.models` hook); :mod:`pcast_jax.models` holds only what
loads and runs checkpoints.

* :mod:`~pcast_jax.analysis.capture` — :class:`Recorder`, :class:`Trace`, :class:`StreamedTrace` (a trace
  folder read one layer at a time), :func:`load_trace`;
* :mod:`~pcast_jax.analysis.statistics` — per layer and head: :func:`sink_statistics` (where the sinks are);
* :mod:`~pcast_jax.analysis.heads` — per layer and head: :func:`head_metrics`, :func:`analyze_trace`, run as
  :mod:`~pcast_jax.analysis.plan` plans each layer and :mod:`~pcast_jax.analysis.chunk` computes each chunk of
  rows (on :mod:`~pcast_jax.analysis.rows`' row geometry);
* :mod:`~pcast_jax.analysis.logit_metrics` — :func:`compare_logits`, end to end;
* :mod:`~pcast_jax.analysis.study` — :func:`analyze` (→ :class:`Analysis`: data frame, xarray, words);
  :func:`diagnose_trace`, a deployment's kernels on a trace (``pcast doctor --trace``);
* :mod:`~pcast_jax.analysis.report` — :func:`write_report` (markdown, JSON, CSV, figures); ``pcast analyze``.
"""

from pcast_jax.analysis.capture import (
    TRACE_DIMS,
    TRACE_DTYPES,
    Recorder,
    RecorderWarning,
    StreamedTrace,
    Trace,
    load_trace,
)
from pcast_jax.analysis.heads import HEAD_METRICS, analyze_trace, head_metrics, heads_attention
from pcast_jax.analysis.logit_metrics import E2EMetrics, compare_logits
from pcast_jax.analysis.report import write_report
from pcast_jax.analysis.statistics import SCALE_GRID, SINK_SELECTIONS, sink_statistics
from pcast_jax.analysis.study import SINK_MASS_MIN, Analysis, TraceDiagnosis, analyze, diagnose_trace

__all__ = ["TRACE_DIMS", "TRACE_DTYPES", "Recorder", "RecorderWarning", "Trace", "StreamedTrace", "load_trace",
           "HEAD_METRICS", "SCALE_GRID",
           "SINK_SELECTIONS", "E2EMetrics", "analyze_trace", "compare_logits", "head_metrics", "heads_attention",
           "sink_statistics", "write_report", "SINK_MASS_MIN", "Analysis", "analyze", "TraceDiagnosis",
           "diagnose_trace"]
