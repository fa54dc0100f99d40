"""Every quantity a sweep reports, one record each: name, long name, unit, meaning, direction.

A name means one thing wherever it appears: the trace analysis (:mod:`pcast_jax.analysis`) reports
``frac_zeroed`` with the sweep's pooling, and its one metric of another pooling,
``frac_zeroed_row_mean``, has its record here too (kind ``"analysis"``: no sweep computes it).

The sweep's metric list (:data:`METRICS`), the attributes of its xarray and pandas exports, the
choices and help of ``pcast plot --y`` and the metrics table of the documentation are all derived
from :data:`QUANTITIES`. Adding a metric: its record here, its computation in the block and the
engines (:mod:`pcast_jax.metrics`), and its check in the independent oracle. Needs no JAX (the
command line's help reads it).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pcast_jax.errors import PcastError

__all__ = ["Quantity", "QUANTITIES", "METRICS", "CONFIG_METRICS", "Kind", "Direction", "describe", "axis_label"]

#: ``"metric"``: computed per instance and config; ``"input"``: a metric of the workload alone (the
#: same for every config); ``"coordinate"``: an axis of the results; ``"analysis"``: a per-head metric of the
#: trace analysis only (:func:`pcast_jax.analysis.head_metrics`), not in a sweep's results.
Kind = Literal["metric", "input", "coordinate", "analysis"]
#: Which way is better for a metric: ``"lower"`` (an error or a loss), ``"none"`` (a description).
Direction = Literal["lower", "none"]


@dataclasses.dataclass(frozen=True)
class Quantity:
    """What one metric or coordinate of a sweep is.

    ``units`` follows the CF conventions: ``"1"`` for a fraction or any other dimensionless number,
    None for a label (a config name), which has no unit.
    """

    #: a short name for axes and table headers
    long_name: str
    #: the CF unit string (None for a label)
    units: str | None
    #: one or two sentences: what it measures
    description: str
    #: metric, input or coordinate (:data:`Kind`)
    kind: Kind = "metric"
    #: which way is better (:data:`Direction`)
    direction: Direction = "none"

    def __post_init__(self):
        assert self.kind in typing.get_args(Kind) and self.direction in typing.get_args(Direction)

    def attrs(self) -> dict[str, str]:
        """The attributes an xarray variable or a pandas column gets (``units`` left out for a label)."""
        out = {"long_name": self.long_name}
        if self.units is not None:
            out["units"] = self.units
        out["description"] = self.description
        return out


#: Every metric and coordinate of a sweep's results, metrics first in the order results list them.
#: V is in units of V (σ_V = 1 by default), so an MSE of outputs is in V²; scores and Δ are logits,
#: natural-log units of probability ratios (nats).
QUANTITIES: dict[str, Quantity] = {
    "mse": Quantity("output MSE vs FP32 reference", "V²",
                    "Mean over query rows and head dimensions of (O_kernel − O_ref)², O_ref the FP32 softmax "
                    "output; NaN when the sweep does not sample V.", direction="lower"),
    "mse_expected": Quantity("expected output MSE (V averaged)", "V²",
                             "σ_V² Σ_j (W_j − P_j)² averaged over query rows: the MSE's mean given the scores, "
                             "without the noise of the V draw; NaN when the sweep skips it.", direction="lower"),
    "frac_zeroed": Quantity("fraction of non-sink P cast to zero", "1",
                            "Fraction of the non-sink probabilities P > 0 that the FP8 cast sets to 0 (Eq. (7)), "
                            "pooled over the query rows: the zeroed count of all rows over their non-sink count "
                            "(in the trace analysis, over one head's rows).", direction="lower"),
    "frac_zeroed_row_mean": Quantity("mean over rows of the fraction of non-sink P cast to zero", "1",
                                     "Per head of a trace: each query row's fraction of its non-sink visible P > 0 "
                                     "that the FP8 cast sets to 0, averaged over the rows with at least min_keys "
                                     "non-sink visible keys (frac_zeroed pools the counts instead).",
                                     kind="analysis", direction="lower"),
    "zeroed_mass": Quantity("probability mass cast to zero", "1",
                            "Exact softmax probability carried by the non-sink values the cast sets to 0, "
                            "mean over query rows.", direction="lower"),
    "frac_saturated": Quantity("fraction of P saturated by the cast", "1",
                               "Fraction of visible P values (sinks included) whose P·S exceeded the format's "
                               "maximum and were clipped by the cast.", direction="lower"),
    "saturated_mass": Quantity("probability mass saturated by the cast", "1",
                               "Exact softmax probability carried by the saturated values, mean over query rows.",
                               direction="lower"),
    "nonsink_mass": Quantity("non-sink probability mass", "1",
                             "Exact softmax probability on non-sink keys in the FP32 reference (causal if the "
                             "config is), mean over query rows.", kind="input"),
    "n": Quantity("KV length N", "keys", "Number of keys (and values) each query row attends to.",
                  kind="coordinate"),
    "config": Quantity("kernel configuration", None, "Name of the simulated kernel configuration (a preset "
                                                       "name or KernelConfig.name).", kind="coordinate"),
    "config_spec": Quantity("kernel configuration (full)", None,
                            "The kernel configuration in KernelConfig.to_string form, which parses back to it.",
                            kind="coordinate"),
    "delta": Quantity("sink strength Δ", "nats",
                      "Logit added to every sink key's score: a sink score is Δ + σz, a non-sink score σz.",
                      kind="coordinate"),
    "seed": Quantity("seed index", "1", "Index of the random draw (scores, V); the same seed gives the same "
                                        "draws at every Δ.", kind="coordinate"),
}

#: The metrics of one config (computed by the kernel simulation), in results order.
CONFIG_METRICS: tuple[str, ...] = tuple(k for k, q in QUANTITIES.items() if q.kind == "metric")
#: Every metric a sweep stores: the config metrics, then the workload's own.
METRICS: tuple[str, ...] = CONFIG_METRICS + tuple(k for k, q in QUANTITIES.items() if q.kind == "input")


def describe(name: str) -> dict[str, str]:
    """``long_name``, ``units`` (absent for a label) and ``description`` of a metric or coordinate.

    Also a metric's summary columns: ``mse_mean`` and ``mse_sem`` describe as ``mse`` (mean or
    standard error over seeds, same unit).
    """
    base, kind = name, ""
    for suffix, word in (("_mean", "mean over seeds of "), ("_sem", "standard error over seeds of ")):
        if name.endswith(suffix) and name[: -len(suffix)] in METRICS:
            base, kind = name[: -len(suffix)], word
    if base not in QUANTITIES:
        raise PcastError(f"{name!r} is not a sweep metric or coordinate; known: {', '.join(QUANTITIES)}")
    q = QUANTITIES[base]
    if kind:
        q = Quantity(kind + q.long_name, q.units, f"{kind[0].upper()}{kind[1:]}{q.long_name}. {q.description}")
    return q.attrs()


def axis_label(name: str) -> str:
    """An axis label: the long name with the unit in brackets (none for a dimensionless number)."""
    a = describe(name)
    units = a.get("units")
    return a["long_name"] if units in (None, "1") else f"{a['long_name']} [{units}]"
