"""The dynamic per-block power-of-two scale (the paper's future work, §7.4) against static scales.

:func:`dynamic_vs_static` runs one sweep over Δ and N with the dynamic config and the static ones
on shared draws, and tabulates the paired per-seed ratios (:class:`DynamicComparison`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.presets import resolve
from pcast_jax.stats import mean_sem
from pcast_jax.sweep import SweepSpec, run_sweep
from pcast_jax.whatif import progress

__all__ = ["DynamicComparison", "dynamic_vs_static"]

#: Progress steps of one :func:`dynamic_vs_static` call.
STEPS = 2


@dataclasses.dataclass
class DynamicComparison:
    """Paired comparison of a dynamic-scale config with static ones on shared draws.

    ``table`` rows: one per (N, Δ) with the mean ``metric`` of every config, the paired ratio
    dynamic/static (mean of per-seed ratios) with its standard error, and the fractions zeroed.
    """

    metric: str
    configs: tuple
    dynamic: str
    ns: tuple
    deltas: tuple
    seeds: int
    table: list
    seconds: float

    def rows(self) -> list[dict]:
        return list(self.table)


def dynamic_vs_static(*, dynamic="dynamic_pow2", statics=("fwd_s256", "fwd_s448"), deltas=None,
                      ns=(1024, 4096, 16384), seeds: int = 8, metric: str = "mse_expected", q_len: int = 32,
                      d: int = 128, k_sink: int = 4, base_seed: int = 0, out_dir=None) -> DynamicComparison:
    """Sweep the dynamic per-block 2^k scale against static scales (default 256 and 448).

    One :func:`~pcast_jax.sweep.run_sweep` over Δ ∈ [4, 13] (step 1) × ``ns`` × seeds; every config
    sees the same draws, so the per-seed ratios are paired. ``metric``: ``"mse_expected"`` (the
    expected MSE over V, low variance) or ``"mse"`` (one V draw, the paper's measurement).
    """
    dyn = resolve(dynamic)
    if dyn.scale_mode != "dynamic":
        raise PcastError(f"dynamic={dyn.name!r} must have scale_mode='dynamic' (e.g. 'dynamic_pow2')")
    statics = tuple(resolve(s) for s in ((statics,) if isinstance(statics, (str, KernelConfig)) else statics))
    if not statics:
        raise PcastError("statics must name at least one static-scale config")
    for s in statics:
        if s.scale_mode == "dynamic":
            raise PcastError(f"statics: {s.name!r} is dynamic; give static-scale configs")
    check_choice("metric", metric, ("mse_expected", "mse"))
    deltas = tuple(float(x) for x in (np.arange(4.0, 13.01, 1.0) if deltas is None else np.atleast_1d(deltas)))
    ns = tuple(check_int("ns", int(x) if isinstance(x, (np.integer,)) else x, min_value=k_sink + 1)
               for x in np.atleast_1d(ns).tolist())
    check_int("seeds", seeds, min_value=2, max_value=1 << 20)
    t0 = time.perf_counter()
    spec = SweepSpec(configs=(dyn,) + statics, deltas=deltas, ns=ns, seeds=seeds, q_len=q_len, d=d,
                     k_sink=k_sink, base_seed=base_seed, expected_mse=True, sampled_mse=(metric == "mse"))
    progress.plan(STEPS)
    progress.stage(f"dynamic: sweep of {len(spec.configs)} configs x {len(deltas)} Δ x {len(ns)} N "
                   f"x {seeds} seeds")
    res = run_sweep(spec, out_dir=out_dir, progress=False)
    progress.stage("dynamic: paired ratios")
    table = []
    for n in ns:
        for dl in deltas:
            row = {"n": n, "delta": dl}
            dv = np.asarray(res.get(metric, config=dyn.name, n=n, delta=dl), np.float64)
            row[dyn.name] = float(dv.mean())
            row[f"frac_zeroed_{dyn.name}"] = float(res.mean("frac_zeroed", config=dyn.name, n=n, delta=dl))
            for s in statics:
                sv = np.asarray(res.get(metric, config=s.name, n=n, delta=dl), np.float64)
                ratio = dv / sv
                row[s.name] = float(sv.mean())
                row[f"ratio_vs_{s.name}"], row[f"ratio_vs_{s.name}_sem"] = mean_sem(ratio)
                row[f"frac_zeroed_{s.name}"] = float(res.mean("frac_zeroed", config=s.name, n=n, delta=dl))
            table.append(row)
    return DynamicComparison(metric=metric, configs=spec.config_names, dynamic=dyn.name, ns=ns, deltas=deltas,
                             seeds=seeds, table=table, seconds=time.perf_counter() - t0)
