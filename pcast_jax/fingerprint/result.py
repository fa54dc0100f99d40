"""What :func:`~pcast_jax.fingerprint.fit.identify` found: the config, each field's evidence, the residuals."""

from __future__ import annotations

import dataclasses
import math

from pcast_jax import report
from pcast_jax.config import KernelConfig

#: Residual below which two candidates are the same function on the probes (float32 rounding).
RESIDUAL_FLOOR = 1e-5

__all__ = ["FieldEvidence", "Fingerprint"]


@dataclasses.dataclass(frozen=True)
class FieldEvidence:
    """How one :class:`~pcast_jax.config.KernelConfig` field was decided.

    Attributes:
      field: the field's name.
      value: its value in the fitted config.
      determined: True when no other value fits within the tolerance of the best residual.
      candidates: the values that fit (just ``value`` when determined).
      probe: the probe family (``ladder``, ``walk``, ``ramp``) the runner-up missed most.
      residual: the best candidate's residual.
      runner_up: the best other value of the field (None when the field had no other candidate).
      runner_up_residual: that candidate's residual (inf when none).
      note: why a field was not probed, else empty.
    """

    field: str
    value: object
    determined: bool
    candidates: tuple
    probe: str
    residual: float
    runner_up: object
    runner_up_residual: float
    note: str = ""

    @property
    def margin(self) -> float:
        """Runner-up residual over the best's (the floor of :data:`RESIDUAL_FLOOR`
        standing in for a best residual of 0)."""

        return self.runner_up_residual / max(self.residual, RESIDUAL_FLOOR)

    def describe(self) -> str:
        if self.note and self.runner_up is None and not self.determined:
            return f"{self.field}: undetermined ({self.note})"
        if self.determined:
            if self.runner_up is None:
                return f"{self.field} = {self.value!r} (no other candidate)"
            return (f"{self.field} = {self.value!r} (decided by the {self.probe} probes: the runner-up "
                    f"{self.runner_up!r} fits {report.fmt_ratio(min(self.margin, 1e6), 1)} worse)")
        why = f" ({self.note})" if self.note else ""
        return f"{self.field}: undetermined, candidates {', '.join(map(repr, self.candidates))} fit alike{why}"

    def to_dict(self) -> dict:
        return {"value": self.value, "determined": self.determined, "candidates": list(self.candidates),
                "probe": self.probe or None, "runner_up": self.runner_up,
                "runner_up_residual": None if math.isinf(self.runner_up_residual) else self.runner_up_residual,
                "margin": None if math.isinf(self.margin) else self.margin, "note": self.note or None}


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A black-box kernel's P-cast as read from its outputs on the probes.

    Attributes:
      config: the :class:`~pcast_jax.config.KernelConfig` whose simulation fits the outputs best; usable wherever a
        preset is. Undetermined fields hold the plainest of their candidates.
      fields: field name → :class:`FieldEvidence`.
      residual: ‖out − sim‖ / ‖out‖ of ``config`` over every probe row.
      runner_up: the best other config tried, and ``runner_up_residual`` its residual.
      calls: black-box calls made; ``seconds_calls`` their seconds, ``seconds_fit`` the fit's.
      candidates: configs simulated on every probe row.
      probe_key: (head_dim, scale, causal, sinks, seed) of the probes.
      not_fitted: what the fit does not read, name → why (:data:`pcast_jax.fingerprint.fit.NOT_FITTED`):
        a kernel that differs there shows it only in the residual.
    """

    config: KernelConfig
    fields: dict
    residual: float
    runner_up: KernelConfig | None
    runner_up_residual: float
    calls: int
    seconds_calls: float
    seconds_fit: float
    candidates: int
    probe_key: tuple
    not_fitted: dict = dataclasses.field(default_factory=dict)

    @property
    def undetermined(self) -> dict:
        """Field → candidates left, for every field the probes could not decide."""
        return {f: e.candidates for f, e in self.fields.items() if not e.determined}

    def summary(self) -> str:
        """The fit in words: the config, then one line per field."""
        lines = [f"fingerprint: {self.config.describe()}",
                 f"  config: {self.config.to_string()}",
                 f"  residual {report.fmt_sci(self.residual)}; runner-up "
                 + (f"{self.runner_up.to_string()} at {report.fmt_sci(self.runner_up_residual)}"
                    if self.runner_up is not None else "none"),
                 f"  {self.calls} call(s) of the kernel ({report.fmt_num(self.seconds_calls, 2)} s), fit "
                 f"{report.fmt_num(self.seconds_fit, 2)} s over {self.candidates} candidates"]
        lines += [f"  {e.describe()}" for e in self.fields.values()]
        lines += [f"  not fitted: {name} ({why})" for name, why in self.not_fitted.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain values (JSON-ready): the config's ``to_dict``, each field's evidence, the residuals."""
        head_dim, scale, causal, sinks, seed = self.probe_key
        return {"config": self.config.to_dict(), "config_string": self.config.to_string(),
                "residual": self.residual,
                "runner_up": None if self.runner_up is None else self.runner_up.to_string(),
                "runner_up_residual": None if math.isinf(self.runner_up_residual) else self.runner_up_residual,
                "fields": {f: e.to_dict() for f, e in self.fields.items()},
                "undetermined": {f: list(c) for f, c in self.undetermined.items()},
                "calls": self.calls, "seconds_calls": self.seconds_calls, "seconds_fit": self.seconds_fit,
                "candidates": self.candidates, "not_fitted": dict(self.not_fitted),
                "probes": {"head_dim": head_dim, "scale": scale, "causal": causal, "sinks": sinks, "seed": seed}}
