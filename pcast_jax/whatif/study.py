"""Every what-if analysis at report size, run together: the data a report renders.

:func:`run_study` runs the surrogate validation and the four analyses (several at a time, in
threads) and returns a :class:`WhatIfStudy`: each analysis's result and its rows as tables of
dicts. It renders nothing: the what-if report (markdown, CSV files, figures) is the application's,
``pcast_experiments.whatif_report`` (``pcast whatif report`` and the reproduction's what-if section).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import os
import time

from pcast_jax.errors import check_int, check_positive
from pcast_jax.whatif import calibration, dynamic, progress, scale_search, validation, worst_case
from pcast_jax.whatif.calibration import Prop3Calibration, calibrate_prop3
from pcast_jax.whatif.dynamic import DynamicComparison, dynamic_vs_static
from pcast_jax.whatif.objective import Scenario
from pcast_jax.whatif.scale_search import OptimalScaleResult, optimal_scale
from pcast_jax.whatif.surrogates import Surrogate
from pcast_jax.whatif.validation import validate_gradients
from pcast_jax.whatif.worst_case import WorstDeltaResult, worst_case_delta
from pcast_jax.workloads import SinkWorkload

__all__ = ["WhatIfStudy", "run_study"]


@dataclasses.dataclass(frozen=True)
class WhatIfStudy:
    """What :func:`run_study` computed.

    Attributes:
      quick: whether the reduced sizes ran.
      n, q_len: the workload's KV length and query rows.
      surrogates: the labels of the surrogates validated on Δ and σ, in order.
      validate_delta, validate_sigma, validate_log2_scale: :func:`validate_gradients` rows per parameter.
      worst: :class:`WorstDeltaResult` per (config, objective), configs outer, ``total`` before ``collapse``.
      optimal_mean, optimal_staircase: :func:`optimal_scale` with the mean-LSB surrogate from S = 1, and with
        the staircase surrogate started where the first stopped.
      calibration: :class:`Prop3Calibration` of ``fwd_s1``.
      dynamic: :class:`DynamicComparison` (dynamic 2^k scale vs static).
      seconds: wall time of each analysis; ``workers``: how many ran at once.
    """

    quick: bool
    n: int
    q_len: int
    surrogates: tuple[str, ...]
    validate_delta: list
    validate_sigma: list
    validate_log2_scale: list
    worst: list[WorstDeltaResult]
    optimal_mean: OptimalScaleResult
    optimal_staircase: OptimalScaleResult
    calibration: Prop3Calibration
    dynamic: DynamicComparison
    seconds: dict
    workers: int

    def tables(self) -> dict[str, list[dict]]:
        """Each table's rows by name (``validate``, ``worst_delta``, ``optimal_scale``, ``calibrate_prop3``,
        ``dynamic``, ``calibrate_curves``: per Δ the simulated target, each model's fit, the paper's curve
        and the zeroed fractions simulated and by Eq. (7))."""
        cal = self.calibration
        curves = []
        for i, dl in enumerate(cal.deltas):
            row = {"delta": float(dl), "simulated": float(cal.sim_mean[i])}
            row.update({f"fit_{m}": float(c[i]) for m, c in cal.model_mean.items()})
            row["paper_c1_deltak"] = float(cal.paper_curve[i])
            row["frac_zeroed_sim"] = float(cal.frac_sim[i])
            row["F_eq7_theory"] = float(cal.frac_theory[i])
            curves.append(row)
        return {"validate": self.validate_delta + self.validate_sigma + self.validate_log2_scale,
                "worst_delta": [r for w in self.worst for r in w.rows()],
                "optimal_scale": self.optimal_mean.rows(),
                "calibrate_prop3": cal.rows(),
                "dynamic": self.dynamic.rows(),
                "calibrate_curves": curves}


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(n=1024, q_len=8, seeds=4, calib_seeds=4, dyn_seeds=3, dyn_ns=(1024,), calib_steps=150,
                    steps=40, worst_configs=("fwd_s1", "fwd_s256"), curve_points=17, bootstrap=200)
    return dict(n=4096, q_len=32, seeds=8, calib_seeds=16, dyn_seeds=8, dyn_ns=(1024, 4096, 16384),
                calib_steps=300, steps=60, worst_configs=("fwd_s1", "rev_s1", "fwd_s448", "fwd_s256", "rev_s256"),
                curve_points=65, bootstrap=1000)


def run_study(*, quick: bool = False, base_seed: int = 0, workers: int | None = None,
              extra_steps: int = 0) -> WhatIfStudy:
    """Run the four analyses and the surrogate validation at report size.

    ``quick`` uses N = 1024, q_len = 8 and a few seeds (under a minute on 2 cores); the full size is
    the paper's workload (N = 4096, q_len = 32).

    ``workers``: how many analyses run at once in threads (default: the CPU count, at most 4). Their
    time is mostly XLA compiling one program per setting, which runs on one core, so two at a time
    halve the wait on a 2-core machine; each analysis computes exactly what it computes alone (its own
    programs, its own seeds), so the results do not depend on ``workers``.

    ``extra_steps``: progress steps a caller takes after the study (a report's figures), counted in
    the total fixed before the first analysis starts.
    """
    z = _sizes(bool(quick))
    workers = min(4, os.cpu_count() or 1) if workers is None else int(check_positive("workers", workers))
    extra_steps = check_int("extra_steps", extra_steps, min_value=0)
    n, q = z["n"], z["q_len"]

    sc = Scenario(config="fwd_s1", n=n, q_len=q, seeds=z["seeds"], base_seed=base_seed)
    surs = (Surrogate(), Surrogate(lsb_mode="staircase"), Surrogate(kind="ste"))
    surs_rep = tuple(dataclasses.replace(x, atoms="representable") for x in surs)
    wl = SinkWorkload(n=n, q_len=q)

    def optimal_pair():
        mean = optimal_scale(wl, seeds=z["seeds"], curve_points=z["curve_points"], base_seed=base_seed)
        stair = optimal_scale(wl, seeds=z["seeds"], curve_points=0, base_seed=base_seed,
                              start_log2_scale=mean.continuous_log2_scale,
                              surrogate=Surrogate(lsb_mode="staircase", atoms="representable"))
        return mean, stair

    # (name, function, progress steps), longest first as measured at the quick size (optimal scale
    # ~2x the others), so that two workers finish together
    jobs = [("optimal_scale", optimal_pair, 2 * scale_search.STEPS),
            ("validate_log2_scale", lambda: validate_gradients(sc, param="log2_scale", surrogates=surs_rep),
             validation.progress_steps(surs_rep)),
            ("calibrate_prop3", lambda: calibrate_prop3("fwd_s1", n, seeds=z["calib_seeds"], q_len=q,
                                                        steps=z["calib_steps"], bootstrap=z["bootstrap"],
                                                        base_seed=base_seed),
             calibration.progress_steps()),
            ("validate_delta", lambda: validate_gradients(sc, param="delta", surrogates=surs),
             validation.progress_steps(surs)),
            # dMSE/dσ is dominated by where each sink P lands in its cell: resolving it takes twice the seeds
            ("validate_sigma", lambda: validate_gradients(sc.replace(seeds=2 * z["seeds"]), param="sigma",
                                                          surrogates=surs, step=0.1),
             validation.progress_steps(surs))]
    for cfg in z["worst_configs"]:
        for obj in ("total", "collapse"):
            jobs.append((f"worst_delta {cfg} {obj}",
                         functools.partial(worst_case_delta, cfg, n, objective=obj, seeds=z["seeds"], q_len=q,
                                           steps=z["steps"], base_seed=base_seed), worst_case.STEPS))
    jobs.append(("dynamic", lambda: dynamic_vs_static(ns=z["dyn_ns"], seeds=z["dyn_seeds"], q_len=q,
                                                      base_seed=base_seed), dynamic.STEPS))
    # every step of every analysis, known before the first: the progress total never grows
    progress.fix(sum(j[2] for j in jobs) + extra_steps)
    out, times = _run_jobs([(name, fn) for name, fn, _ in jobs], workers)
    return WhatIfStudy(quick=bool(quick), n=n, q_len=q, surrogates=tuple(s.label for s in surs),
                       validate_delta=out["validate_delta"], validate_sigma=out["validate_sigma"],
                       validate_log2_scale=out["validate_log2_scale"],
                       worst=[out[f"worst_delta {cfg} {obj}"] for cfg in z["worst_configs"]
                              for obj in ("total", "collapse")],
                       optimal_mean=out["optimal_scale"][0], optimal_staircase=out["optimal_scale"][1],
                       calibration=out["calibrate_prop3"], dynamic=out["dynamic"], seconds=times, workers=workers)


def _run_jobs(jobs, workers: int) -> tuple[dict, dict]:
    """Run ``(name, fn)`` jobs, ``workers`` at a time; return ({name: result}, {name: seconds}).

    Each job runs in a copy of the caller's context (so it reports to the caller's progress). The
    first error stops the jobs not yet started; the ones running finish (a thread cannot be cut
    short), then the first error in job order is raised.
    """
    def timed(fn):
        t = time.perf_counter()
        return fn(), time.perf_counter() - t

    if workers <= 1:
        done = {name: timed(fn) for name, fn in jobs}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pcast-whatif") as pool:
            futs = {name: pool.submit(contextvars.copy_context().run, timed, fn) for name, fn in jobs}
            _, pending = concurrent.futures.wait(futs.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            concurrent.futures.wait([f for f in pending if not f.cancelled()])
            failed = [f.exception() for f in futs.values() if not f.cancelled() and f.exception() is not None]
            if failed:
                raise failed[0]
            done = {name: f.result() for name, f in futs.items()}
    return {k: v[0] for k, v in done.items()}, {k: v[1] for k, v in done.items()}
