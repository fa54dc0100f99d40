"""The best static P scale: Adam over continuous log2 S, then the exact MSE at powers of two.

:func:`optimal_scale` works on the synthetic sink workload or on given score matrices (real
logits); besides the search it evaluates S = 256, S = 448, the neighbouring powers of two and a
dense exact curve over S ∈ [2^7, 2^9.2] (the dp(S) sawtooth in MSE form).
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcast_jax import formats, theory
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_finite, check_int, check_positive
from pcast_jax.presets import resolve
from pcast_jax.whatif import progress
from pcast_jax.whatif.objective import Scenario, check_scores, scores_mses, seed_mses, static_config
from pcast_jax.whatif.surrogates import Surrogate, as_surrogate
from pcast_jax.workloads import SinkWorkload

__all__ = ["OptimalScaleResult", "optimal_scale"]

#: Progress steps of one :func:`optimal_scale` call.
STEPS = 3


@dataclasses.dataclass
class OptimalScaleResult:
    """Outcome of :func:`optimal_scale` (S values, MSE values are exact means unless named)."""

    source: str  # "synthetic(...)" or "scores(...)"
    config: str
    surrogate: str
    start_log2_scale: float
    continuous_log2_scale: float  # where Adam ended
    continuous_surrogate_mse: float
    neighbours: dict  # {2^floor: exact MSE, 2^ceil: exact MSE}
    best_neighbour: float
    powers: dict  # {2^k: exact MSE} for every k in the range
    best_power: float
    at_256: float
    at_448: float
    at_continuous: float  # exact MSE at the continuous optimum (unrounded S)
    surrogate_at_256: float  # the search surrogate's MSE at S = 256 and 448 (does it see the gap?)
    surrogate_at_448: float
    parts: dict  # {S: (collapse, noise)} exact split at 256 and 448
    curve_scales: np.ndarray  # exact MSE vs S (dense, for the sawtooth figure)
    curve_values: np.ndarray
    seconds: float

    def rows(self) -> list[dict]:
        out = []
        for s, v in sorted(self.powers.items()):
            out.append({"scale": s, "log2_scale": math.log2(s), "exact_mse": v,
                        "rel_to_256": v / self.at_256 if self.at_256 else _NO_RATIO,
                        "dp": float(theory.dp(s)), "normal_coverage": float(theory.normal_coverage(s))})
        out.append({"scale": 448.0, "log2_scale": math.log2(448.0), "exact_mse": self.at_448,
                    "rel_to_256": self.at_448 / self.at_256 if self.at_256 else _NO_RATIO,
                    "dp": float(theory.dp(448.0)), "normal_coverage": float(theory.normal_coverage(448.0))})
        return out


#: What ``rel_to_256`` says when the exact MSE at S = 256 is 0 (every P exact: nothing to compare).
_NO_RATIO = "n/a: MSE at S=256 is 0"


@partial(jax.jit, static_argnames=("evaluate", "steps", "lr"))
def _descend_scale(l0, lo, hi, scores, *, evaluate, steps, lr):
    """Projected Adam descent on the mean surrogate MSE over log2 S."""
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05), b2=0.9, eps=1e-20)
    norm = jax.lax.stop_gradient(evaluate(l0, scores)) + 1e-30

    def step(carry, _):
        l2, st = carry
        g = jax.grad(lambda v: evaluate(v, scores) / norm)(l2)
        upd, st = opt.update(g, st, l2)
        l2 = jnp.clip(optax.apply_updates(l2, upd), lo, hi)
        return (l2, st), l2

    (l2, _), path = jax.lax.scan(step, (l0, opt.init(l0)), None, length=steps)
    return l2, evaluate(l2, scores), path


@partial(jax.jit, static_argnames=("evaluate",))
def _evaluate_many(log2_scales, scores, *, evaluate):
    return jax.lax.map(lambda l2: evaluate(l2, scores), log2_scales)


@dataclasses.dataclass(frozen=True)
class _Evaluator:
    """Hashable closure: mean MSE over the instances at a (traced) log2 S."""

    scenario: Scenario | None  # synthetic draws, or None: the scores argument is used
    config: KernelConfig
    surrogate: Surrogate
    part: str
    delta: float
    sigma: float
    sigma_v: float = 1.0

    def __call__(self, log2_scale, scores):
        if self.scenario is not None:
            return jnp.mean(seed_mses(jnp.float32(self.delta), jnp.float32(self.sigma), log2_scale,
                                       scenario=self.scenario, surrogate=self.surrogate, part=self.part))
        batch = max(1, min(scores.shape[0], (1 << 21) // (scores.shape[1] * scores.shape[2])))
        return jnp.mean(scores_mses(log2_scale, scores, config=self.config, surrogate=self.surrogate,
                                     part=self.part, sigma_v=self.sigma_v, batch_size=batch))


def optimal_scale(workload: SinkWorkload | None = None, *, scores=None, config="fwd_s1", delta: float = 7.0,
                  seeds: int = 4, exact_seeds: int | None = None, surrogate: Surrogate | str | None = None,
                  start_log2_scale: float = 0.0,
                  log2_range=(-2.0, 10.0), steps: int = 150, learning_rate: float = 0.25,
                  powers=range(0, 11), curve_points: int = 65, base_seed: int = 0) -> OptimalScaleResult:
    """Best static P-scale S for a workload: Adam over continuous log2 S, then exact powers of two.

    Either a synthetic ``workload`` (default: the paper's N = 4096, q_len = 32, k_sink = 4, with
    sink strength ``delta``) or a ``scores`` array (q_len, N) / (batch, q_len, N) of real logits.
    The config fixes the order and block size; its S is replaced by the search variable.

    1. Adam on log2 S with the smooth surrogate (default ``atoms="representable"``: the search
       assumes S is an E4M3 value, so the P = 1 atoms cost nothing below max).
    2. Exact MSE at the neighbouring powers of two 2^⌊·⌋, 2^⌈·⌉ → best neighbour; also every 2^k
       of ``powers``, S = 448, and the continuous optimum itself.
    3. An exact curve over S ∈ [2^7, 2^9.2] (the dp(S) sawtooth of §5 in MSE form).

    The search averages ``seeds`` instances; the exact evaluations use ``exact_seeds`` (default
    max(seeds, 32)): which sink P lands where in its cell scatters the per-seed MSE(448)/MSE(256)
    from about 0.6 to 2, so the 256-vs-448 gap needs tens of seeds.
    """
    cfg = resolve(config)
    static_config(cfg)
    sur = as_surrogate(surrogate if surrogate is not None else Surrogate(atoms="representable"))
    if sur.kind == "exact":
        raise PcastError("surrogate='exact' has no useful gradient; use 'smooth' (or 'ste')")
    check_finite("delta", delta)
    check_finite("start_log2_scale", start_log2_scale)
    try:
        lo, hi = (check_finite("log2_range", float(x)) for x in log2_range)
    except (TypeError, ValueError):
        raise PcastError(f"log2_range={log2_range!r} must be two numbers (lo, hi)") from None
    if not (lo < hi and -100 <= lo and hi <= 100):
        raise PcastError(f"log2_range={log2_range!r} must satisfy -100 <= lo < hi <= 100")
    if not lo <= start_log2_scale <= hi:  # the search stays in the range: so must its start
        raise PcastError(f"start_log2_scale={start_log2_scale!r} must lie in log2_range=({lo:g}, {hi:g})")
    check_int("steps", steps, min_value=1, max_value=100000)
    check_positive("learning_rate", learning_rate)
    check_int("curve_points", curve_points, min_value=0, max_value=100000)
    powers = [check_int("powers", k, min_value=-100, max_value=100) for k in powers]
    if not powers:
        raise PcastError("powers must hold at least one exponent k")
    if scores is not None and workload is not None:
        raise PcastError("give either workload or scores, not both")
    t0 = time.perf_counter()
    if scores is not None:
        arr = check_scores(scores)
        scenario = exact_scenario = None
        source = f"scores{tuple(arr.shape)}"
        sigma = 1.0
    else:
        w = workload or SinkWorkload()
        if not isinstance(w, SinkWorkload):
            raise PcastError(f"workload must be a SinkWorkload, got {type(w).__name__}")
        scenario = Scenario(config=cfg, n=w.n, q_len=w.q_len, k_sink=w.k_sink, sink_positions=w.sink_positions,
                            sigma_v=w.sigma_v, seeds=seeds, base_seed=base_seed)
        exact_seeds = max(seeds, 32) if exact_seeds is None else check_int("exact_seeds", exact_seeds, min_value=1)
        exact_scenario = scenario.replace(seeds=exact_seeds)
        arr = jnp.zeros((1, 1, 1), jnp.float32)
        source = f"synthetic(n={w.n}, q_len={w.q_len}, k_sink={w.k_sink}, delta={delta:g}, sigma={w.sigma:g})"
        sigma = w.sigma

    def evaluator(surr, part="total"):
        sc_ = exact_scenario if surr.kind == "exact" else scenario
        return _Evaluator(sc_, cfg, surr, part, float(delta), float(sigma))

    exact_sur = Surrogate(kind="exact")
    progress.plan(STEPS)
    progress.stage(f"optimal-scale {cfg.name}: Adam over log2 S ({sur.label})")
    l2, val, _ = _descend_scale(jnp.float32(start_log2_scale), jnp.float32(lo), jnp.float32(hi), arr,
                                evaluate=evaluator(sur), steps=int(steps), lr=float(learning_rate))
    l2 = float(l2)
    if not math.isfinite(l2):
        raise PcastError(f"the search over log2 S from start_log2_scale={start_log2_scale:g} ended at {l2} with "
                         f"surrogate={sur.label!r}: its MSE has no finite gradient there (try another start)")

    def ex(log2s, part="total"):
        xs = jnp.asarray(np.asarray(log2s, np.float32))
        return np.asarray(_evaluate_many(xs, arr, evaluate=evaluator(exact_sur, part)), np.float64)

    progress.stage(f"optimal-scale {cfg.name}: exact MSE at powers of two")
    ks = sorted(set(powers) | {math.floor(l2), math.ceil(l2)})
    pw = {2.0**k: float(v) for k, v in zip(ks, ex(ks))}
    nb = {2.0 ** math.floor(l2): pw[2.0 ** math.floor(l2)], 2.0 ** math.ceil(l2): pw[2.0 ** math.ceil(l2)]}
    extra = ex([8.0, math.log2(448.0), l2])
    sur_vals = np.asarray(_evaluate_many(jnp.asarray([8.0, math.log2(448.0)], jnp.float32), arr,
                                         evaluate=evaluator(sur)), np.float64)
    progress.stage(f"optimal-scale {cfg.name}: exact MSE curve ({curve_points} points)")
    curve_l2 = np.linspace(7.0, 9.2, curve_points) if curve_points else np.zeros(0)
    if curve_points:  # every E4M3 value in the range: the exact MSE dips there (P = 1 atoms)
        reps = formats.positive_values(cfg.p_format).astype(np.float64)
        curve_l2 = np.unique(np.concatenate([curve_l2, np.log2(reps[(reps >= 2.0**7) & (reps <= 2.0**9.2)])]))
    curve_v = ex(curve_l2) if curve_l2.size else np.zeros(0)
    split = [math.log2(256.0), math.log2(448.0)]
    coll, noise = ex(split, "collapse"), ex(split, "noise")
    parts = {256.0: (float(coll[0]), float(noise[0])), 448.0: (float(coll[1]), float(noise[1]))}
    in_range = {k: v for k, v in pw.items() if round(math.log2(k)) in powers}
    best_nb = min(nb, key=nb.get)
    return OptimalScaleResult(
        source=source, config=cfg.name, surrogate=sur.label, start_log2_scale=float(start_log2_scale),
        continuous_log2_scale=l2, continuous_surrogate_mse=float(val), neighbours=nb, best_neighbour=best_nb,
        powers=in_range, best_power=min(in_range, key=in_range.get),
        at_256=float(extra[0]), at_448=float(extra[1]), at_continuous=float(extra[2]),
        surrogate_at_256=float(sur_vals[0]), surrogate_at_448=float(sur_vals[1]), parts=parts,
        curve_scales=np.exp2(curve_l2), curve_values=curve_v, seconds=time.perf_counter() - t0)
