"""A P-collapse test for an attention kernel's own test suite: one call, NumPy arrays in and out.

::

    from pcast_jax.testing import assert_no_p_collapse

    def test_my_kernel_keeps_p():
        assert_no_p_collapse(my_kernel, head_dim=128)

The kernel is any callable ``kernel(q, k, v)`` (``kernel(q, k, v, sinks)`` with ``sinks=True``) that takes
NumPy float32 arrays in ``jax.nn``'s layout — q ``[batch, q_tokens, heads, head_dim]``, k and v
``[batch, kv_tokens, heads, head_dim]``, sinks ``[heads]`` learned sink logits in the units of the scaled
logits — and returns softmax(scale·q·kᵀ)·v as ``[batch, q_tokens, heads, head_dim]`` in any array type
NumPy reads (the same calling convention as :func:`pcast_jax.fingerprint.identify`). A PyTorch, Triton,
CUDA or JAX kernel is wrapped in one line (convert, transpose, call, convert back). With ``causal=True``
the kernel masks causally, bottom-right aligned (query row i of T sees keys j ≤ N − T + i).

**The probes** (:func:`collapse_probes`, one kernel call): each batch element is one replicate (its own
draw), each query row one sink strength Δ (default 2, 3, …, 14), over ``n_keys`` keys (4,096 by
default: many KV blocks and every split schedule). Key 0 is the *dominant key* at logit 0; the other
N − 1 keys are *weaker*, at logit −Δ + ln U with U uniform on (0, 2) (stratified): their unnormalised
weights e^-Δ·U are uniform within every cell of the P format's grid, so round-to-nearest adds no bias
and what the V = 1 output loses is what the cast zeroed or clipped. V's columns read the parts
directly: column 0 is all ones (the exact output is 1: the lost mass is 1 − out), column 1 the
dominant key alone, column 2 the weaker keys alone, column 3 holds V's amax, the others are E4M3-rounded
N(0, 1) values for the output error against an exact float64 reference. Q and K are exact in E4M3
(each logit a short exact sum of E4M3 products) and each tensor's amax is 448·2^k, so a kernel's own
per-tensor FP8 quantization of Q, K and V changes nothing (as in :mod:`pcast_jax.fingerprint.probes`).
With ``sinks=True`` a second head has a learned sink at logit 0 and every key weaker (the sink is the
dominant one; head 0's sink is inert at −64).

**The verdict** is the doctor's criterion (:func:`pcast_jax.criterion.over_limits`): at each Δ the
mass lost on the weaker keys (what the cast zeroed) and on the dominant key (what it clipped), each a
mean ± s.e. over the replicates, must be decidedly under 10^-3 (mean + 2 s.e. below it); over it at
any Δ fails, anything else is *within noise*. :func:`check_p_collapse` returns it as a
:class:`CollapseCheck` with the Δ at which the kernel starts to collapse, the closed form's threshold
Δc = 10 ln 2 + ln S − δ1 (:func:`pcast_jax.theory.critical_delta`, δ1 = 0 for one dominant key) for the
nearest preset, and that preset read by the fingerprint (:func:`pcast_jax.fingerprint.identify`) where
the outputs fit one. ``pcast probe`` does the same for a kernel run elsewhere.
:mod:`pcast_jax.testing.probes` builds the probes, :mod:`pcast_jax.testing.check` runs the kernel on them
and judges its outputs. Importing this package imports neither JAX nor the simulator: they load when a
check needs them.
"""

from pcast_jax.testing.check import (
    CollapseCheck,
    CollapseRow,
    assert_no_p_collapse,
    check_p_collapse,
    evaluate,
    simulated_kernel,
)
from pcast_jax.testing.probes import (
    DELTAS,
    FORMAT_TAG,
    MIN_HEAD_DIM,
    N_KEYS,
    PROBES,
    REPLICATES,
    CollapseProbes,
    collapse_probes,
)

__all__ = ["DELTAS", "N_KEYS", "REPLICATES", "MIN_HEAD_DIM", "FORMAT_TAG", "PROBES", "CollapseProbes",
           "CollapseRow", "CollapseCheck", "collapse_probes", "evaluate", "check_p_collapse",
           "assert_no_p_collapse", "simulated_kernel"]
