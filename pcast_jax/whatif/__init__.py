"""Differentiable what-if analyses of the P-cast: surrogates of the FP8 cast, jax.grad and optax.

Every analysis works on the expected per-dimension output error given the scores,
MSE(Δ, σ, log2 S) = σ_V² · mean_rows Σ_j (W_j − P_j)² (Prop. 3 / Eq. (8), V i.i.d.), with W the
kernel's effective weights (:func:`pcast_jax.engine.effective_weights`) and P the exact softmax,
on the sweep's own draws: a what-if value at a point equals the sweep's ``mse_expected``. It is
jit-compiled, vectorised over seeds and differentiable in Δ, σ and log2 S through a surrogate of
the cast (:class:`Surrogate`). Modules: ``surrogates`` (the cast surrogates), ``objective``
(:class:`Scenario` and the expected MSE), one per analysis — ``validation``
(:func:`validate_gradients`), ``worst_case`` (:func:`worst_case_delta`), ``scale_search``
(:func:`optimal_scale`), ``calibration`` (:func:`calibrate_prop3`), ``dynamic``
(:func:`dynamic_vs_static`) — and ``study`` (:func:`run_study`, all of them at report size; the
report itself is rendered by ``pcast_experiments.whatif_report``). Every public name is re-exported here.
"""

from pcast_jax.whatif.calibration import MODELS, Prop3Calibration, calibrate_prop3
from pcast_jax.whatif.dynamic import DynamicComparison, dynamic_vs_static
from pcast_jax.whatif.objective import PARAMS, Scenario, expected_mse, expected_mse_scores, mse_and_grad
from pcast_jax.whatif.scale_search import OptimalScaleResult, optimal_scale
from pcast_jax.whatif.study import WhatIfStudy, run_study
from pcast_jax.whatif.surrogates import (
                                        ATOM_MODES,
                                        CAST_KINDS,
                                        LSB_MODES,
                                        PARTS,
                                        Surrogate,
                                        expected_squared_error,
                                        make_cast_fn,
)
from pcast_jax.whatif.validation import validate_gradients
from pcast_jax.whatif.worst_case import PAPER_TRANSITION, WorstDeltaResult, worst_case_delta

__all__ = [
    "CAST_KINDS",
    "LSB_MODES",
    "ATOM_MODES",
    "PARTS",
    "PARAMS",
    "PAPER_TRANSITION",
    "Surrogate",
    "Scenario",
    "expected_squared_error",
    "make_cast_fn",
    "expected_mse",
    "expected_mse_scores",
    "mse_and_grad",
    "validate_gradients",
    "worst_case_delta",
    "optimal_scale",
    "calibrate_prop3",
    "dynamic_vs_static",
    "run_study",
    "MODELS",
    "WorstDeltaResult",
    "OptimalScaleResult",
    "Prop3Calibration",
    "DynamicComparison",
    "WhatIfStudy",
]
