"""Read a black-box FP8 attention kernel's P-cast from its outputs on designed probes.

``probes`` (:mod:`pcast_jax.fingerprint.probes`) builds Q/K/V whose outputs expose the cast;
``identify`` calls a kernel on them and ``fit`` (:mod:`pcast_jax.fingerprint.fit`) finds the
:class:`~pcast_jax.config.KernelConfig` whose simulation reproduces the outputs, field by field, with
the evidence (:mod:`pcast_jax.fingerprint.result`).
"""

from pcast_jax.fingerprint.fit import FIELDS, GROUPS, explain_preset, fit, identify, simulate_outputs
from pcast_jax.fingerprint.probes import ProbeSet, probes
from pcast_jax.fingerprint.result import FieldEvidence, Fingerprint

__all__ = ["probes", "ProbeSet", "identify", "fit", "simulate_outputs", "explain_preset", "Fingerprint",
           "FieldEvidence", "FIELDS", "GROUPS"]
