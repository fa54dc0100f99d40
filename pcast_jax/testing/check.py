"""The P-collapse check (:func:`check_p_collapse`): a kernel's outputs on the probes, the verdict and its report.

:func:`evaluate` reads a kernel's outputs on the probes (:mod:`pcast_jax.testing.probes`) into one
:class:`CollapseRow` per probe and Δ, judges them by :func:`pcast_jax.criterion.over_limits` and sets the
collapse Δ beside the closed form's Δc of the nearest preset; :func:`simulated_kernel` is a preset as the
kernel. JAX loads only when a check reads a fingerprint or runs the simulator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable

import numpy as np

from pcast_jax import report
from pcast_jax.criterion import CLIPPED_MASS_LIMIT, ZEROED_MASS_LIMIT, Z, over_limits
from pcast_jax.errors import PcastError
from pcast_jax.fingerprint.probes import check_kernel_output
from pcast_jax.report import fmt_sci_pm as _pm
from pcast_jax.stats import mean_sem
from pcast_jax.testing.probes import (
    DELTAS,
    N_KEYS,
    PROBES,
    REPLICATES,
    V_DOMINANT,
    V_ONES,
    V_WEAKER,
    V_WITNESS,
    CollapseProbes,
    collapse_probes,
)

__all__ = ["CollapseRow", "CollapseCheck", "evaluate", "read_fingerprint", "check_p_collapse",
           "assert_no_p_collapse", "simulated_kernel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseRow:
    """One probe at one Δ: what the kernel lost there, each a mean and its s.e. over the replicates.

    Attributes:
      probe: which probe (:data:`~pcast_jax.testing.probes.PROBES`).
      delta: the sink strength Δ.
      zeroed: the softmax mass the cast zeroed: the weaker keys' exact share times the share the
        witnesses that read 0 stand for (:func:`~pcast_jax.testing.probes.witness_weights`).
      lost_mass: exact − out on the all-ones V column (1 − out without a sink): what the output lost,
        rounding included (round-to-nearest moves up to ~10^-3 of the mass either way in E4M3).
      lost_weaker: the same on the weaker keys alone (their exact share − out), rounding included.
      lost_dominant: the mass lost on the dominant key (clipped, or S itself rounded); 0 for the
        learned-sink probe, whose dominant logit has no value row.
      output_error: RMS error of the random-V columns over the exact output's RMS.
      *_sem: the standard errors.
      verdict: ``"over"``, ``"under"`` or ``"within noise"``: :func:`pcast_jax.criterion.over_limits` on
        ``zeroed`` (the zeroed mass) and ``lost_dominant`` (the clipped mass).
    """

    probe: str
    delta: float
    zeroed: float
    zeroed_sem: float
    lost_mass: float
    lost_mass_sem: float
    lost_weaker: float
    lost_weaker_sem: float
    lost_dominant: float
    lost_dominant_sem: float
    output_error: float
    output_error_sem: float
    verdict: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseCheck:
    """What :func:`check_p_collapse` found: per-Δ readings, the verdict, the collapse Δ beside the closed form.

    Attributes:
      rows: one :class:`CollapseRow` per probe and Δ.
      safe: True when every row is decidedly under both limits, False when one is over, None when none is
        over but one is within noise.
      verdict: the verdict in words.
      collapse_delta: the smallest Δ of a row over a limit (None when none is).
      nearest_preset: the preset whose fields agree with every field the fingerprint decided, or None.
      nearest_note: how the nearest preset was found, or why there is none (``"no preset fits: …"``).
      fitted_config: the fingerprint's config (``KernelConfig.to_string()``), or None.
      closed_form_delta: Δc = 10 ln 2 + ln S − δ1 of the nearest preset (or the fitted config), or None.
      closed_form_note: what Δc is, or why there is none.
      head_dim, scale, causal, sinks, n_keys, replicates, seed: the probes'.
      seconds_kernel: the kernel call's seconds on the probes (None where it ran elsewhere: :func:`evaluate` on
        outputs read back); seconds_check: the whole check's.
    """

    rows: tuple[CollapseRow, ...]
    safe: bool | None
    verdict: str
    collapse_delta: float | None
    nearest_preset: str | None
    nearest_note: str
    fitted_config: str | None
    closed_form_delta: float | None
    closed_form_note: str
    head_dim: int
    scale: float
    causal: bool
    sinks: bool
    n_keys: int
    replicates: int
    seed: int
    seconds_kernel: float | None
    seconds_check: float

    def worst(self) -> CollapseRow:
        """The row with the largest lost mass."""
        return max(self.rows, key=lambda r: max(r.zeroed, r.lost_dominant))

    def summary(self) -> str:
        """The check as markdown: the verdict, the thresholds, the nearest preset, one table row per probe and Δ."""
        head = [f"**P-collapse check: {self.verdict}**", "",
                f"Criterion (`pcast doctor`'s): the zeroed mass (read by the witness keys) and the mass lost on "
                f"the dominant key (clipped), each ≤ {ZEROED_MASS_LIMIT:g} of the softmax at every Δ, decided when "
                f"mean ± {Z:g} s.e. "
                f"over {self.replicates} replicates excludes the limit, else within noise.",
                f"Probes: head dim {self.head_dim}, scale {report.fmt_num(self.scale, 4)}, {self.n_keys} keys, "
                f"{'causal (bottom-right), ' if self.causal else ''}"
                f"{'with a learned-sink probe, ' if self.sinks else ''}seed {self.seed}; kernel call "
                + ("not timed (it ran elsewhere)" if self.seconds_kernel is None
                   else f"{report.fmt_num(self.seconds_kernel, 2)} s")
                + f", check {report.fmt_num(self.seconds_check, 2)} s.",
                "Starts to collapse at: " + ("no Δ of the probes" if self.collapse_delta is None
                                             else f"Δ = {self.collapse_delta:g}")
                + "; closed form: " + (f"Δc = {report.fmt_num(self.closed_form_delta, 2)} ({self.closed_form_note})"
                                       if self.closed_form_delta is not None else self.closed_form_note) + ".",
                f"Nearest preset: {self.nearest_preset or 'none'} ({self.nearest_note}).", ""]
        table = [{"probe": r.probe, "delta": f"{r.delta:g}", "zeroed": _pm(r.zeroed, r.zeroed_sem),
                  "lost": _pm(r.lost_mass, r.lost_mass_sem), "weaker": _pm(r.lost_weaker, r.lost_weaker_sem),
                  "dominant": _pm(r.lost_dominant, r.lost_dominant_sem),
                  "error": _pm(r.output_error, r.output_error_sem), "verdict": r.verdict} for r in self.rows]
        cols = [("probe", "probe"), ("delta", "Δ"), ("zeroed", "zeroed mass"), ("lost", "lost mass"),
                ("weaker", "lost on weaker keys"),
                ("dominant", "lost on dominant"), ("error", "output error (RMS/RMS)"), ("verdict", "row")]
        return "\n".join(head) + report.markdown_table(table, cols, align="llrrrrrl", name="p_collapse")

    def to_dict(self) -> dict:
        """Plain values (JSON-ready)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        out["criterion"] = {"zeroed_mass_max": ZEROED_MASS_LIMIT, "clipped_mass_max": CLIPPED_MASS_LIMIT, "z": Z}
        return out


def _rows(probes: CollapseProbes, out: np.ndarray) -> list[CollapseRow]:
    exact, reps = probes.exact, probes.replicates
    lost = exact[..., :V_WITNESS] - out[..., :V_WITNESS]  # (2R, T, H, 4)
    # the witness half: the zeroed share of the weaker keys' mass, times their exact share
    zero = out[:reps, ..., V_WITNESS:] == 0  # (R, T, H, witnesses)
    zeroed = exact[:reps, ..., V_WEAKER] * np.einsum("rthw,rw->rth", zero, probes.witness_share)
    rand_out, rand_exact = out[reps:, ..., V_WITNESS:], exact[reps:, ..., V_WITNESS:]
    err = np.sqrt(np.sum((rand_out - rand_exact) ** 2, axis=-1) / np.sum(rand_exact**2, axis=-1))
    rows = []
    for h in range(out.shape[2]):
        for t, delta in enumerate(probes.deltas):
            total, weaker, dominant = (mean_sem(lost[:, t, h, c]) for c in (V_ONES, V_WEAKER, V_DOMINANT))
            zeroed_t, error = mean_sem(zeroed[:, t, h]), mean_sem(err[:, t, h])
            over = over_limits(zeroed_t, dominant)
            rows.append(CollapseRow(probe=PROBES[h], delta=delta, zeroed=zeroed_t[0], zeroed_sem=zeroed_t[1],
                                    lost_mass=total[0], lost_mass_sem=total[1], lost_weaker=weaker[0],
                                    lost_weaker_sem=weaker[1], lost_dominant=dominant[0],
                                    lost_dominant_sem=dominant[1], output_error=error[0], output_error_sem=error[1],
                                    verdict={True: "over", False: "under", None: "within noise"}[over]))
    return rows


def _closed_form(cfg) -> tuple[float | None, str]:
    """Δc of ``cfg`` for one dominant key (δ1 = 0), or None and why there is none."""
    from pcast_jax import numberline, theory

    if cfg.scale_mode not in ("multiply", "exponent") or cfg.p_format in numberline.BLOCK_FORMATS:
        return None, f"no closed form: the scale is computed per block or tile ({cfg.scale_mode}, {cfg.p_format})"
    if cfg.p_offset != "running_max":
        return None, f"no closed form: P is taken against {cfg.p_offset}, not the running max"
    s = cfg.effective_scale
    dc = float(theory.critical_delta(s, k_sink=1, fmt=cfg.p_format))
    where = ("every key cast against the dominant key" if cfg.order == "forward" else
             "in reverse order only the dominant key's own KV block is cast against it")
    return dc, (f"10 ln 2 + ln S with S = {report.fmt_num(s, 4)}, {cfg.p_format}: half the weaker keys' P zero "
                f"when cast against the dominant key; {where}")


def _nearest(fp, head_dim: int) -> tuple[str | None, str]:
    """The preset agreeing with every field the fingerprint read (its candidates where undetermined)."""
    from pcast_jax.presets import PRESETS, preset_for

    best, best_off, fits = None, None, []
    for name in PRESETS:
        cfg = preset_for(name, head_dim)
        off = [f for f, e in fp.fields.items()
               if not (e.note or "").startswith("not probed") and getattr(cfg, f) not in e.candidates]
        if not off:
            fits.append(name)
        if best_off is None or len(off) < len(best_off):
            best, best_off = name, off
    if fits:
        return fits[0], ("the fingerprint's fields agree with " + ", ".join(fits) + f" (residual "
                         f"{report.fmt_sci(fp.residual)})")
    return None, (f"no preset fits the fingerprint's config; closest {best}, which differs in "
                  f"{', '.join(best_off)}")


def evaluate(probes: CollapseProbes, outputs, *, fingerprint=None, fingerprint_error: str | None = None,
             seconds_kernel: float | None = None, started: float | None = None) -> CollapseCheck:
    """The check from a kernel's outputs on ``probes`` (and its :class:`~pcast_jax.fingerprint.Fingerprint`,
    when one was read): what ``pcast probe check`` prints."""
    t0 = time.perf_counter() if started is None else started
    out = check_kernel_output(outputs, shape=probes.out_shape, dtype=np.float64)
    rows = _rows(probes, out)
    over = [r for r in rows if r.verdict == "over"]
    unsure = [r for r in rows if r.verdict == "within noise"]
    safe = False if over else (None if unsure else True)
    collapse = min((r.delta for r in over), default=None)
    if over:
        parts = sorted({("zeroes the weaker keys" if r.zeroed >= r.lost_dominant else "clips the dominant key")
                        + f" ({r.probe})" for r in over})
        verdict = f"fails: P-collapse from Δ = {collapse:g}: the cast " + "; ".join(parts)
    elif unsure:
        verdict = (f"within noise: no row is over the limit, but {len(unsure)} are within {Z:g} s.e. of it "
                   f"(first at Δ = {min(r.delta for r in unsure):g}); rerun with more replicates")
    else:
        verdict = f"passes: at Δ = {min(probes.deltas):g}…{max(probes.deltas):g} the cast loses under the limit"
    cfg, fitted = None, None
    if fingerprint is not None:
        from pcast_jax.presets import preset_for

        nearest, note = _nearest(fingerprint, probes.head_dim)
        cfg = preset_for(nearest, probes.head_dim) if nearest else fingerprint.config
        fitted = fingerprint.config.to_string()
    else:
        nearest, note = None, fingerprint_error or "not read: no fingerprint"
        if fingerprint_error and fingerprint_error.startswith("outputs fit no candidate"):
            note = f"no preset fits: {fingerprint_error}"
    dc, dc_note = _closed_form(cfg) if cfg is not None else (None, "n/a: no preset or fitted config to take S from")
    if cfg is not None and nearest is None and dc is not None:
        dc_note += " (the fitted config's S: no preset fits)"
    return CollapseCheck(rows=tuple(rows), safe=safe, verdict=verdict, collapse_delta=collapse, nearest_preset=nearest,
                         nearest_note=note, fitted_config=fitted, closed_form_delta=dc, closed_form_note=dc_note,
                         head_dim=probes.head_dim, scale=probes.scale, causal=probes.causal,
                         sinks=probes.sinks is not None, n_keys=probes.n_keys, replicates=probes.replicates,
                         seed=probes.seed, seconds_kernel=seconds_kernel, seconds_check=time.perf_counter() - t0)


def read_fingerprint(kernel: Callable, *, head_dim: int, scale: float | None, causal: bool, sinks: bool):
    """``(Fingerprint, None)`` of ``kernel`` (:func:`pcast_jax.fingerprint.identify`), or ``(None, why not)``."""
    from pcast_jax.fingerprint import identify
    from pcast_jax.fingerprint.probes import MIN_HEAD_DIM as FP_MIN_HEAD_DIM

    if head_dim < FP_MIN_HEAD_DIM:
        return None, f"not read: the fingerprint's probes need head_dim ≥ {FP_MIN_HEAD_DIM}"
    try:
        return identify(kernel, head_dim=head_dim, scale=scale, causal=causal, sinks=sinks), None
    except PcastError as exc:
        return None, str(exc)


def check_p_collapse(kernel: Callable, *, head_dim: int, scale: float | None = None, causal: bool = False,
                     sinks: bool = False, n_keys: int = N_KEYS, deltas=DELTAS, replicates: int = REPLICATES,
                     seed: int = 0, fingerprint: bool = True) -> CollapseCheck:
    """Runs ``kernel`` on the P-collapse probes and returns what it lost, per Δ, with the doctor's verdict.

    Args:
      kernel: ``kernel(q, k, v)`` (``kernel(q, k, v, sinks)`` with ``sinks=True``) on NumPy float32 arrays in
        [batch, tokens, heads, head_dim] layout, returning the attention output in that layout (package docs).
      head_dim: the kernel's head dim.
      scale: the softmax scale the kernel applies (``jax.nn``'s 1/√head_dim when None).
      causal: the kernel masks causally (bottom-right aligned).
      sinks: the kernel takes learned sink logits, one per head.
      n_keys, deltas, replicates, seed: the probes' (:func:`collapse_probes`).
      fingerprint: also read the kernel's P-cast with :func:`pcast_jax.fingerprint.identify` (one more call
        on the fingerprint's probes, head_dim ≥ 36): the nearest preset and its closed-form Δc.

    Returns:
      A :class:`CollapseCheck`; ``str(check.summary())`` is its report.
    """
    if not callable(kernel):
        raise PcastError(f"kernel={kernel!r} must be callable as kernel(q, k, v)"
                         + (" or kernel(q, k, v, sinks)" if sinks else ""))
    if not isinstance(fingerprint, bool):
        raise PcastError(f"fingerprint={fingerprint!r} must be True or False")
    t0 = time.perf_counter()
    probes = collapse_probes(head_dim, scale=scale, causal=causal, sinks=sinks, n_keys=n_keys, deltas=deltas,
                             replicates=replicates, seed=seed)
    t1 = time.perf_counter()
    out = kernel(*probes.arrays())
    seconds = time.perf_counter() - t1
    fp, why = (read_fingerprint(kernel, head_dim=probes.head_dim, scale=probes.scale, causal=causal, sinks=sinks)
               if fingerprint else (None, "not read (fingerprint=False)"))
    return evaluate(probes, out, fingerprint=fp, fingerprint_error=why, seconds_kernel=seconds, started=t0)


def assert_no_p_collapse(kernel: Callable, **kwargs) -> CollapseCheck:
    """:func:`check_p_collapse`, raising AssertionError with its report unless the verdict passes.

    A verdict within noise fails too: the probes are seeded, so it is reproducible, and a pass must be decided.
    """
    check = check_p_collapse(kernel, **kwargs)
    if check.safe is not True:
        raise AssertionError("\n" + check.summary())
    return check


@functools.lru_cache(maxsize=64)
def _simulator(program, scale: float, with_sinks: bool):
    """One compiled simulator per program (configs that differ only in numbers share it)."""
    import jax

    from pcast_jax import engine

    def run(q, k, v, numbers, sinks):  # the config resolved once (simulated_kernel), bound here to traced numbers
        return engine.run_qkv(q, k, v, program.bind(numbers), scale=scale,
                              sink_logit=sinks if with_sinks else None).out

    return jax.jit(run)


def simulated_kernel(config, *, scale: float | None = None, causal: bool = False) -> Callable:
    """A kernel for :func:`check_p_collapse` that is the simulator running ``config`` (a preset name or a
    :class:`~pcast_jax.config.KernelConfig`): what that kernel would do, without a GPU. Configs that differ only
    in their numbers (S, τ, …) share one compiled program."""
    from pcast_jax.presets import resolve

    cfg = dataclasses.replace(resolve(config), causal=causal)
    program, numbers = cfg.program(), cfg.numbers()

    def kernel(q, k, v, sinks=None):
        d = np.shape(q)[-1]
        run = _simulator(program, float(1.0 / math.sqrt(d) if scale is None else scale), sinks is not None)
        q, k, v = (np.moveaxis(np.asarray(a, np.float32), 2, 1) for a in (q, k, v))
        sink = np.zeros(1, np.float32) if sinks is None else np.asarray(sinks, np.float32)
        return np.moveaxis(np.asarray(run(q, k, v, numbers, sink)), 1, 2)

    return kernel
