"""What JAX's own FP8 attention does to P: cuDNN's FP8 SDPA, answered from what a JAX user passes it.

``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(q, k, v, ..., fp8_params=...,
use_fp8=True)`` (jax-ml/jax, the ``FP8Params`` dict of 17 entries, present from jax 0.5 on) runs cuDNN's
FP8 SDPA and passes it ``fp8_params["scale_s"]`` as the P scale. Whether that scale reaches P depends on
the engine cuDNN runs, which depends on the GPU (:data:`pcast_jax.presets.cudnn.ENGINES`, every answer
names it):

* Blackwell (``sm100``) and Blackwell GeForce (``sm120``): cuDNN's open FP8 kernels cast P at a baked
  S = 16 in the exponent with a lazy rescale τ = 4 in log2 units and ignore ``scale_s``; a learned sink
  joins the denominator after the KV loop (presets ``cudnn_sm100_fp8``, ``cudnn_sm120_fp8``). There is
  no scale_s to choose; the answer is what the kernel does at its own S.
* Hopper (``sm90``): no open FP8 kernel exists; the closed engine is modelled by the test reference it
  was held to: forward order, 128-key blocks, a learned sink as the initial running max, P·scale_s cast,
  τ = 0 (``cudnn_fp8_tau0``). ``rescale_threshold`` (τ in nats, ``CUDNN_RESCALE_THRESHOLD``) given without
  a GPU asks the same reference at that τ, with S_eff = scale_s·2^-τ.

That XLA's cuDNN call reaches these engines (and not another closed one) is an assumption, stated in every
answer. JAX passes no learned sink itself (Transformer Engine does); the ``sinks`` here answer for a model
that has them.

:func:`predict` takes those arguments and returns the matching
:class:`~pcast_jax.config.KernelConfig`, the closed-form and simulated zeroed and saturated
fractions and masses per head, and, where scale_s reaches P, the scale_s that avoids saturation. With
``trace=`` (a recorded :class:`~pcast_jax.analysis.Trace` of the user's model) it answers on the model
instead: the kernel simulated on the trace at every power-of-two ``scale_s`` where scale_s reaches P (else
at the kernel's own S), the worst head's zeroed and clipped mass (the criterion of ``pcast analyze``,
:func:`pcast_jax.criterion.meets_criterion`), the KL of the model run through it when given, and the
``scale_s`` to pass where there is one (:class:`JaxFP8Scan`). ``pcast jax-fp8`` is the same question from
the command line.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pcast_jax.config import KernelConfig
from pcast_jax.criterion import MASS_LIMIT, check_mass_limit
from pcast_jax.errors import PcastError, check_finite, check_int, check_positive

__all__ = ["DEFAULT_GPU", "GPUS", "JaxFP8Prediction", "JaxFP8Scan", "NO_THEORY", "cudnn_config", "gpu_engine",
           "predict", "scale_s_from", "theory_text"]

#: GPU generations JAX's cuDNN FP8 attention runs on, by name and compute capability, to the key of
#: :data:`pcast_jax.presets.cudnn.ENGINES`.
GPUS = {"hopper": "sm90", "sm90": "sm90", "blackwell": "sm100", "sm100": "sm100", "sm120": "sm120"}
#: The generation assumed when none is given (and said so in every answer).
DEFAULT_GPU = "blackwell"
_GPU_WORDS = {"sm90": "Hopper (sm90)", "sm100": "Blackwell (sm100)", "sm120": "Blackwell GeForce (sm120)"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Engine:
    """What :func:`gpu_engine` finds: the kernel at scale_s = 1, whether scale_s reaches P, in words."""

    config: KernelConfig
    scale_s_reaches_p: bool
    words: str


def gpu_engine(gpu: str | None = None, rescale_threshold: float | None = None, *, mxfp8: bool = False,
               names: tuple[str, str] = ("gpu", "rescale_threshold")) -> _Engine:
    """The cuDNN engine JAX's FP8 attention runs for ``gpu``, as its config at scale_s = 1, whether
    ``scale_s`` reaches P, and the GPU and the engine in words.

    ``gpu`` (:data:`GPUS`) picks the engine of :data:`pcast_jax.presets.cudnn.ENGINES`; neither ``gpu``
    nor ``rescale_threshold``: :data:`DEFAULT_GPU`. ``rescale_threshold`` (τ in nats) asks cuDNN's older
    test reference at that τ (the closed engines' model); it is refused with a GPU whose engine bakes its
    own τ or runs another. ``mxfp8``: the MXFP8 SDPA, whose open SM100 kernel casts P as the per-tensor
    one; the older reference's MXFP8 (S = 16 fixed, no compensation) with ``rescale_threshold``.
    ``names``: the two parameters as the caller spells them in errors.
    """
    from pcast_jax.presets import cudnn, get_preset

    gpu_name, tau_name = names
    if gpu is not None and (not isinstance(gpu, str) or gpu.lower() not in GPUS):
        raise PcastError(f"{gpu_name}={gpu!r} must be one of hopper, blackwell (or sm90, sm100, sm120)")
    if not isinstance(mxfp8, bool):
        raise PcastError(f"mxfp8={mxfp8!r} must be True or False")
    if rescale_threshold is not None:
        tau = check_finite(tau_name, rescale_threshold)
        if tau < 0:
            raise PcastError(f"{tau_name}={tau!r} must be >= 0 (nats)")
        if gpu is not None:
            arch = GPUS[gpu.lower()]
            engine = cudnn.ENGINES[arch]
            if not engine.scale_s_reaches_p:
                raise PcastError(f"{tau_name}={tau:g} with {gpu_name}={gpu!r}: that GPU's engine ({engine.words}) "
                                 f"bakes τ = {cudnn.OPEN_RESCALE_THRESHOLD:g} in log2 units; a τ in nats asks the "
                                 "older test reference: give it without a GPU")
            if tau != cudnn.TAU_BY_GPU[arch]:
                raise PcastError(f"{tau_name}={tau:g} contradicts {gpu_name}={gpu!r}, whose reference runs τ = "
                                 f"{cudnn.TAU_BY_GPU[arch]:g} ({cudnn.TAU_SOURCE[arch]}): give one of them")
        else:
            return _Engine(config=cudnn_config(1.0, rescale_threshold=tau, mxfp8=mxfp8), scale_s_reaches_p=not mxfp8,
                           words=f"no GPU given: cuDNN's older test reference (fp8_ref.py at 3929da2, the closed "
                                 f"engines' model) at τ = {tau:g} nats as given")
    default = gpu is None
    arch = GPUS[(gpu or DEFAULT_GPU).lower()]
    engine = cudnn.ENGINES[arch]
    if mxfp8 and arch != "sm100":
        raise PcastError(f"mxfp8=True with {gpu_name}={gpu or DEFAULT_GPU!r}: the MXFP8 SDPA read from source runs on "
                         "Blackwell (sm100); give that GPU, or rescale_threshold for the older reference")
    words = (f"{_GPU_WORDS[arch]}{', the default' if default else ''}: {engine.words}"
             + ("" if not engine.scale_s_reaches_p else f"; τ = {cudnn.TAU_BY_GPU[arch]:g} nats "
                f"({cudnn.TAU_SOURCE[arch]})"))
    return _Engine(config=get_preset(engine.preset), scale_s_reaches_p=engine.scale_s_reaches_p, words=words)


#: Head dims cuDNN's FP8 SDPA takes through JAX (``fused_attention_stablehlo.py``, the FP8 checks at
#: lines 370-377, commit cec06d1): ≤ 256 and a multiple of 16 for inference; training needs 128.
_MAX_HEAD_DIM = 256


def scale_s_from(fp8_params) -> float:
    """``fp8_params["scale_s"]`` as a float (a scalar array or number), PcastError naming it otherwise."""
    if not hasattr(fp8_params, "__getitem__") or isinstance(fp8_params, (str, bytes)):
        raise PcastError(f"fp8_params must be the dict JAX's FP8 attention takes (FP8Params), got "
                         f"{type(fp8_params).__name__}")
    try:
        value = fp8_params["scale_s"]
    except (KeyError, IndexError, TypeError):
        raise PcastError("fp8_params has no 'scale_s' entry: the P scale cuDNN's FP8 attention applies "
                         "(jax._src.cudnn.fused_attention_stablehlo.FP8Params)") from None
    if isinstance(value, (int, float, complex, str, bytes)) or value is None:
        return check_positive("fp8_params['scale_s']", value)  # a str, complex or 10**400 named here
    arr = np.asarray(value)
    if arr.size != 1:
        raise PcastError(f"fp8_params['scale_s'] must be one number, got shape {arr.shape}")
    if arr.dtype.kind not in "biufV":  # V: ml_dtypes' bfloat16 and float8 kinds
        raise PcastError(f"fp8_params['scale_s'] must be a real number, got an array of {arr.dtype}")
    return check_positive("fp8_params['scale_s']", float(arr.astype(np.float64).reshape(())))


def cudnn_config(scale_s: float = 1.0, *, rescale_threshold: float = 4.0, mxfp8: bool = False) -> KernelConfig:
    """The :class:`KernelConfig` of cuDNN's older FP8 test reference (the closed engines' model) for a
    caller's ``scale_s`` and a threshold τ (nats).

    ``mxfp8=True``: the MXFP8 variant, whose P is plain E4M3 at a fixed S = 16 with no 2^-τ
    compensation (``scale_s`` ignored). See :mod:`pcast_jax.presets.cudnn` for the sources.
    """
    from pcast_jax.presets import cudnn

    tau = check_finite("rescale_threshold", rescale_threshold)
    base = cudnn.PRESETS["cudnn_mxfp8" if mxfp8 else "cudnn_fp8"]
    scale = base.scale if mxfp8 else check_positive("scale_s", scale_s)
    cfg = base.replace(scale=scale, rescale_threshold=tau)
    return dataclasses.replace(cfg, name=f"cudnn_{'mxfp8' if mxfp8 else 'fp8'}_s{scale:g}_tau{tau:g}")


@dataclasses.dataclass(frozen=True)
class JaxFP8Prediction:
    """What cuDNN's FP8 attention does to P for one call, per head.

    Attributes:
      config: the kernel's :class:`KernelConfig` (at the caller's scale_s where it reaches P).
      sinks: (H,) the learned sink logits asked about (NaN-free; 0-length when none).
      theory_frac_zeroed: (H,) non-sink P zeroed by the sink as the initial running max,
        :func:`pcast_jax.theory.learned_sink_collapse_fraction` at the kernel's applied S; NaN for a
        head without a learned sink, or a kernel that adds the sink after the KV loop, where that closed
        form does not apply (:meth:`summary` and ``pcast jax-fp8`` say so in words).
      frac_zeroed, zeroed_mass, frac_saturated, saturated_mass: (H,) simulated on N(0, σ²)
        logits (the kernel's simulator, mean over ``seeds`` draws), with their standard errors in
        ``sem``.
      max_scaled_p: the largest P·S the lazy rescale allows (:func:`pcast_jax.theory.max_scaled_p`).
      safe_scale_s: where scale_s reaches P, the largest power-of-two scale_s that never saturates at
        this τ (:func:`pcast_jax.theory.saturation_free_scale`), and ``safe_critical_delta`` the
        learned-sink logit at which half the non-sink P would still be zeroed with it; None where the
        engine ignores scale_s.
      gpu: the GPU and the engine the answer is about, in words (:func:`gpu_engine`).
      scale_s: the scale_s the caller passes; ``scale_s_reaches_p`` whether the engine applies it.
    """

    config: KernelConfig
    sinks: np.ndarray
    theory_frac_zeroed: np.ndarray
    frac_zeroed: np.ndarray
    zeroed_mass: np.ndarray
    frac_saturated: np.ndarray
    saturated_mass: np.ndarray
    sem: dict
    max_scaled_p: float
    safe_scale_s: float | None
    safe_critical_delta: float | None
    seq_len: int
    seeds: int
    gpu: str = ""
    scale_s: float = 1.0
    scale_s_reaches_p: bool = True

    def summary(self) -> str:
        """The answer in words, one line per finding."""
        c = self.config
        fmt = c.p_format.upper()
        lines = [f"GPU: {self.gpu}."] if self.gpu else []
        if self.scale_s_reaches_p:
            unit = "" if not c.rescale_threshold else (" nats" if c.rescale_unit == "natural" else " (log2)")
            lines.append(f"cuDNN FP8 attention with scale_s = {c.scale:g}, tau = {c.rescale_threshold:g}{unit}: P is "
                         f"cast to {fmt} at S_eff = {c.effective_scale:g}, {c.order} order, {c.block_kv}-key blocks.")
        else:
            lines.append(f"cuDNN FP8 attention: P is cast to {fmt} at the kernel's own S = {c.effective_scale:g} "
                         f"({c.scale_mode} mode), whatever scale_s is (scale_s = {self.scale_s:g} is accepted and "
                         f"ignored); {c.order} order, {c.block_kv}-key blocks, lazy rescale tau = "
                         f"{c.rescale_threshold:g} ({c.rescale_unit}).")
        if self.max_scaled_p > c.fmt.max:
            lines.append(f"A running max lagging by up to tau lets P*S reach {self.max_scaled_p:.4g} > {c.fmt.max:g}: "
                         "the cast can saturate there while the row sum keeps the unclipped value.")
        else:
            lines.append(f"P*S stays at or below {self.max_scaled_p:.4g} <= {c.fmt.max:g}: nothing saturates.")
        for h, sink in enumerate(self.sinks):
            what = "no learned sink" if np.isneginf(sink) else f"sink logit {sink:g}"
            lines.append(f"head {h}: {what}: {100 * self.frac_zeroed[h]:.1f}% of non-sink P zeroed "
                         f"({theory_text(self.theory_frac_zeroed[h])}), carrying "
                         f"{100 * self.zeroed_mass[h]:.2f}% of the probability; "
                         f"{100 * self.frac_saturated[h]:.3f}% saturated.")
        if self.safe_scale_s is None:
            lines.append("No scale_s to choose: this engine does not apply it to P."
                         + (" A learned sink joins only its denominator, after the KV loop, so it sets no running "
                            "max that could zero P." if c.sink_mode == "epilogue" else ""))
        else:
            lines.append(f"Safe choice: scale_s = {self.safe_scale_s:g} (the largest power of two that cannot "
                         f"saturate at this tau); half the non-sink P is then zeroed only from a sink logit of "
                         f"{self.safe_critical_delta:.2f} on.")
        return "\n".join(lines)


#: What the closed form says for a head without a learned sink, or a kernel that adds it after the loop.
NO_THEORY = ("theory: n/a, its closed form is for a learned sink as the initial running max (no sink here, or "
             "one added after the KV loop)")


def theory_text(frac: float) -> str:
    """``theory 12.3%``, or :data:`NO_THEORY` where there is no closed form (NaN)."""
    return NO_THEORY if math.isnan(frac) else f"theory {100 * frac:.1f}%"


def predict(*, fp8_params=None, scale_s: float | None = None, head_dim: int | None = None,
            seq_len: int | None = None, sinks=None, rescale_threshold: float | None = None, gpu: str | None = None,
            mxfp8: bool = False, q_len: int | None = None, sigma: float | None = None, seeds: int | None = None,
            base_seed: int | None = None, trace=None, logits_fn=None, mass_limit: float | None = None,
            min_keys: int | None = None, progress=None):
    """Predict what cuDNN's FP8 attention (JAX's ``use_fp8=True``) does to P for these arguments.

    Without ``trace``: on synthetic N(0, σ²) logits with the given learned sinks
    (:class:`JaxFP8Prediction`). With ``trace``: on the recorded model, every power-of-two ``scale_s``
    simulated where the engine applies it, else the kernel at its own S (:class:`JaxFP8Scan`).

    Args:
      fp8_params: the ``fp8_params`` dict passed to JAX's FP8 attention (its ``"scale_s"`` is read);
        or give ``scale_s`` directly (JAX's own tests build every scale from ones: 1). With a trace,
        the scale_s used now (added to the candidates where it reaches P, and its row named in the answer).
      gpu: ``"hopper"``, ``"blackwell"`` or ``"sm120"`` (``"sm90"``, ``"sm100"``): the engine
        (:func:`gpu_engine`); default :data:`DEFAULT_GPU`.
      rescale_threshold: τ in nats (``CUDNN_RESCALE_THRESHOLD``) of cuDNN's older test reference; without
        ``gpu`` it asks that reference at this τ; refused with a GPU whose engine does otherwise.
      mxfp8: the MXFP8 SDPA variant (on Blackwell the open kernel casts P as the per-tensor one).
      head_dim: the head dim (default 128; ≤ 256, a multiple of 16: what JAX accepts for FP8 inference).
      seq_len: KV length N (default 4096).
      sinks: learned sink logits, one per head (a number, a sequence, an array, or a ``.npy`` path),
        in the units of the scaled logits above the non-sink mean; None: one head without a sink.
      q_len, sigma, seeds, base_seed: the synthetic logits the simulation draws (N(0, σ²); defaults 32,
        1, 8, 0); the seeds run one after another, and one seed's logits (heads × q_len × seq_len)
        must fit the memory budget (:func:`pcast_jax.sweep.check_memory`).
      trace: a :class:`~pcast_jax.analysis.Trace` (or a trace file's path) of the model; the synthetic
        arguments above are then refused (the trace has its own).
      logits_fn: with a trace, ``logits_fn(config) -> logits`` of the model on ``trace.tokens``
        (as :func:`pcast_jax.analysis.analyze` takes it): adds KL and top-1 agreement per candidate.
      mass_limit, min_keys: with a trace, the criterion's limit (default
        :data:`pcast_jax.criterion.MASS_LIMIT`) and the rows counted
        (default 16), as :func:`pcast_jax.analysis.analyze`.
      progress: with a trace, optional ``(line) -> None`` called per stage.
    """
    if fp8_params is not None and scale_s is not None:
        raise PcastError("give fp8_params or scale_s, not both")
    given_s = scale_s_from(fp8_params) if fp8_params is not None else scale_s
    if given_s is not None:  # before any work: a trace is read and scanned only for a scale that can run
        given_s = check_positive("scale_s", given_s, float32=True)
    engine = gpu_engine(gpu, rescale_threshold, mxfp8=mxfp8)
    synthetic = {"head_dim": head_dim, "seq_len": seq_len, "sinks": sinks, "q_len": q_len, "sigma": sigma,
                 "seeds": seeds, "base_seed": base_seed}
    if trace is not None:
        extra = [k for k, v in synthetic.items() if v is not None]
        if extra:
            raise PcastError(f"{', '.join(extra)}: synthetic logits' arguments, but trace= was given (the trace "
                             "has its own heads, lengths and sinks); give one or the other")
        if mxfp8 and engine.scale_s_reaches_p is False and rescale_threshold is not None:
            raise PcastError("mxfp8=True with a trace and rescale_threshold: the older MXFP8 reference fixes "
                             "S = 16 (pcast analyze TRACE --configs cudnn_mxfp8 analyses it)")
        return _predict_trace(trace, given_s, engine, logits_fn=logits_fn,
                              mass_limit=MASS_LIMIT if mass_limit is None else mass_limit,
                              min_keys=16 if min_keys is None else min_keys, progress=progress)
    extra = [k for k, v in (("logits_fn", logits_fn), ("mass_limit", mass_limit), ("min_keys", min_keys),
                            ("progress", progress)) if v is not None]
    if extra:
        raise PcastError(f"{', '.join(extra)}: only with trace= (the model's recorded Q/K/V)")
    return _predict_synthetic(1.0 if given_s is None else given_s, engine,
                              head_dim=128 if head_dim is None else head_dim,
                              seq_len=4096 if seq_len is None else seq_len, sinks=sinks,
                              q_len=32 if q_len is None else q_len, sigma=1.0 if sigma is None else sigma,
                              seeds=8 if seeds is None else seeds, base_seed=0 if base_seed is None else base_seed)


def _check_head_dim(head_dim: int, what: str = "head_dim") -> int:
    head_dim = check_int(what, head_dim, min_value=16, max_value=_MAX_HEAD_DIM)
    if head_dim % 16:
        raise PcastError(f"{what}={head_dim}: cuDNN's FP8 attention takes head dims that are multiples of 16 "
                         f"(≤ {_MAX_HEAD_DIM})")
    return head_dim


def _predict_synthetic(s, engine: _Engine, *, head_dim, seq_len, sinks, q_len, sigma, seeds,
                       base_seed) -> JaxFP8Prediction:
    from pcast_jax import theory

    head_dim = _check_head_dim(head_dim)
    seq_len = check_int("seq_len", seq_len, min_value=1, max_value=1 << 20)
    seeds = check_int("seeds", seeds, min_value=2, max_value=4096)
    q_len = check_int("q_len", q_len, min_value=1, max_value=1 << 20)
    base_seed = check_int("base_seed", base_seed, min_value=0, max_value=2**32 - 1)
    cfg = engine.config
    if engine.scale_s_reaches_p:
        cfg = dataclasses.replace(cfg.replace(scale=s), name=f"cudnn_fp8_s{s:g}_tau{cfg.rescale_threshold:g}")
    sink_arr = _sinks(sinks)
    from pcast_jax.sweep.plan import check_memory

    heads = max(sink_arr.size, 1)
    check_memory(f"predict's simulation ({heads} heads × q_len={q_len} × seq_len={seq_len} logits, one seed "
                 "at a time)", heads * q_len * seq_len * _BYTES_PER_LOGIT)
    frac, lz, fs, ls, sem = _simulate(cfg, sink_arr, seq_len=seq_len, q_len=q_len, d=head_dim, sigma=sigma,
                                      seeds=seeds, base_seed=base_seed)
    if sink_arr.size and cfg.sink_mode == "init_max":
        theory_frac = np.asarray(theory.learned_sink_collapse_fraction(sink_arr, cfg.effective_scale, sigma=sigma),
                                 np.float64)
    else:  # no sink, or one added after the loop: the initial-max closed form does not apply
        theory_frac = np.full(max(sink_arr.size, 1), np.nan)
    unit, comp = cfg.rescale_unit, cfg.rescale_compensation
    safe = critical = None
    if engine.scale_s_reaches_p:
        safe = float(theory.saturation_free_scale(cfg.rescale_threshold, unit=unit, compensation=comp))
        safe_eff = safe * (2.0 ** -cfg.rescale_threshold if comp == "pow2" else 1.0)
        critical = float(theory.learned_sink_critical_delta(safe_eff))
    return JaxFP8Prediction(
        config=cfg, sinks=sink_arr if sink_arr.size else np.full(1, -np.inf), theory_frac_zeroed=theory_frac,
        frac_zeroed=frac, zeroed_mass=lz, frac_saturated=fs, saturated_mass=ls, sem=sem,
        max_scaled_p=float(theory.max_scaled_p(cfg.scale, cfg.rescale_threshold, unit=unit, compensation=comp)),
        safe_scale_s=safe, safe_critical_delta=critical, seq_len=seq_len, seeds=seeds, gpu=engine.words,
        scale_s=float(s), scale_s_reaches_p=engine.scale_s_reaches_p)


@dataclasses.dataclass(frozen=True)
class JaxFP8Scan:
    """What cuDNN's FP8 attention does to P on a recorded model, per candidate ``scale_s``.

    Attributes:
      config: the kernel at ``scale_s = 1`` (the engine of the GPU).
      gpu: the GPU and the engine the answer is about, in words (:func:`gpu_engine`).
      scan: :class:`~pcast_jax.analysis.study.ScaleScan`: per candidate ``scale``, i.e. ``scale_s``
        (``applied_scale`` = the S P is cast at), the worst head's zeroed and clipped mass, the heads
        failing, whether it meets the criterion; ``recommended`` the smallest that does. Where the engine
        ignores scale_s, one row: the kernel at its own S.
      given_scale_s: the scale_s asked about (None: none given).
      mass_limit: the criterion's limit.
      e2e: ``{scale: E2EMetrics}`` of the model run through the kernel at each candidate (with
        ``logits_fn``), else None; ``e2e_fp32`` the FP32 model's own.
      shape: ``(layers, heads, sequences, longest length)`` of the trace.
      scale_s_reaches_p: whether the engine applies scale_s to P.
    """

    config: KernelConfig
    gpu: str
    scan: object
    given_scale_s: float | None
    mass_limit: float
    e2e: dict | None
    e2e_fp32: object
    shape: tuple[int, int, int, int]
    scale_s_reaches_p: bool = True

    @property
    def recommended(self) -> float | None:
        """The ``scale_s`` to pass (None: none meets the criterion, or the engine ignores scale_s)."""
        return self.scan.recommended if self.scale_s_reaches_p else None

    def rows(self) -> list[dict]:
        """One row per candidate: ``scale_s`` (None where the engine ignores it), ``s_eff``, the masses,
        ``heads_over_limit``, ``meets`` (and ``kl``, ``top1_agree`` with a model)."""
        out = []
        for r in self.scan.rows:
            row = {"scale_s": r["scale"] if self.scale_s_reaches_p else None, "s_eff": r["applied_scale"],
                   "zeroed_mass_max": r["zeroed_mass_max"], "saturated_mass_max": r["saturated_mass_max"],
                   "heads_over_limit": r["heads_over_limit"], "meets": r["meets"]}
            if self.e2e is not None:
                m = self.e2e[r["scale"]]
                row.update(kl=m.kl, top1_agree=m.top1_agree, perplexity=m.perplexity)
            out.append(row)
        return out

    def answer(self) -> str:
        """The last line: the exact argument to pass and why, or that none passes, or that there is none."""
        from pcast_jax.criterion import mass_text

        limit = mass_text(self.mass_limit)
        if not self.scale_s_reaches_p:
            (row,) = self.rows()
            verdict = "meets" if row["meets"] else "fails"
            text = (f"No scale_s to pass: this engine casts P at its own S = {row['s_eff']:g} whatever scale_s is; "
                    f"there the worst head loses {mass_text(row['zeroed_mass_max'])} and clips "
                    f"{mass_text(row['saturated_mass_max'])}, so the kernel {verdict} the criterion (≤ {limit}) on "
                    "this trace")
            if not row["meets"]:
                text += "; no argument of JAX's FP8 attention changes that (pcast analyze TRACE compares kernels)"
            if self.e2e is not None:
                text += f"; KL {row['kl']:.2e} nats/token, top-1 agreement {row['top1_agree']:.1%}"
            return text + "."
        rows = {r["scale_s"]: r for r in self.rows()}
        if self.recommended is None:
            least = min(rows.values(), key=lambda r: max(r["zeroed_mass_max"], r["saturated_mass_max"]))
            return (f"No scale_s passes: from {min(rows):g} to {max(rows):g} none keeps the worst head's zeroed and "
                    f"clipped mass ≤ {limit} on this trace (closest: scale_s = {least['scale_s']:g}, which loses "
                    f"{mass_text(least['zeroed_mass_max'])} and clips {mass_text(least['saturated_mass_max'])}); "
                    "cuDNN's FP8 attention cannot serve this model within the limit at any static scale_s; a kernel "
                    "in reverse order or with a dynamic scale can (pcast analyze TRACE).")
        best = rows[self.recommended]
        text = (f"Pass fp8_params['scale_s'] = {self.recommended:g} (P multiplied by {best['s_eff']:g}): the smallest "
                "power of two whose simulated kernel keeps the worst head's zeroed mass "
                f"({mass_text(best['zeroed_mass_max'])}) and clipped mass ({mass_text(best['saturated_mass_max'])}) "
                f"≤ {limit} on this trace")
        below = [r for s, r in rows.items() if s < self.recommended]
        if below:
            prev = below[-1]
            text += (f"; at scale_s = {prev['scale_s']:g} the worst head loses {mass_text(prev['zeroed_mass_max'])}"
                     f" and clips {mass_text(prev['saturated_mass_max'])}")
        if self.e2e is not None:
            text += f"; KL {best['kl']:.2e} nats/token, top-1 agreement {best['top1_agree']:.1%}"
        return text + "."

    def summary(self) -> str:
        """The answer in words: the GPU and its engine, the trace, the criterion, one line per candidate, the
        answer."""
        from pcast_jax.criterion import criterion_words, mass_text

        c = self.config
        layers, heads, seqs, tokens = self.shape
        where = (f"simulated on the trace ({layers} layer{'s' if layers > 1 else ''} × {heads} heads, {seqs} "
                 f"sequence{'s' if seqs > 1 else ''} of up to {tokens} tokens)")
        if self.scale_s_reaches_p:
            unit = "nats" if c.rescale_unit == "natural" else "log2"
            cast = (f"P cast to {c.p_format.upper()} at S_eff = scale_s·2^-{c.rescale_threshold:g} ({unit}), "
                    f"{c.order} order, {c.block_kv}-key blocks; {where} at each scale_s.")
        else:
            given = ("" if self.given_scale_s is None
                     else f" (scale_s = {self.given_scale_s:g} given: accepted and ignored)")
            cast = (f"P cast to {c.p_format.upper()} at the kernel's own S = {c.effective_scale:g}{given}, {c.order} "
                    f"order, {c.block_kv}-key blocks, lazy rescale τ = {c.rescale_threshold:g} ({c.rescale_unit}); "
                    f"{where}.")
        lines = [f"GPU: {self.gpu}.", f"JAX's cuDNN FP8 attention: {cast}", criterion_words(self.mass_limit)]
        if self.e2e is not None:
            lines.append(f"End to end: KL against the FP32 model (perplexity {self.e2e_fp32.perplexity:.3f}) on the "
                         "trace's tokens.")
        for r in self.rows():
            if r["scale_s"] is None:
                head = f"  S = {r['s_eff']:g} (the kernel's own)"
            else:
                mark = " (given)" if r["scale_s"] == self.given_scale_s else ""
                head = f"  scale_s = {r['scale_s']:g}{mark}: S_eff = {r['s_eff']:g}"
            line = (f"{head}: worst head loses {mass_text(r['zeroed_mass_max'])}, clips "
                    f"{mass_text(r['saturated_mass_max'])}, {r['heads_over_limit']} heads fail: "
                    f"{'meets' if r['meets'] else 'fails'} the criterion")
            if self.e2e is not None:
                line += f"; KL {r['kl']:.2e}, top-1 {r['top1_agree']:.1%}"
            lines.append(line)
        lines.append(self.answer())
        return "\n".join(lines)


def _predict_trace(trace, given_s, engine: _Engine, *, logits_fn, mass_limit, min_keys, progress) -> JaxFP8Scan:
    """:func:`predict` on a trace: the cuDNN kernel at every candidate scale_s (:func:`scale_candidates`
    and the one given) where the engine applies it, else at its own S, judged by the criterion of
    :func:`pcast_jax.analysis.analyze`."""
    import os

    from pcast_jax.analysis import StreamedTrace, Trace, load_trace
    from pcast_jax.analysis.study import end_to_end, scale_candidates, scale_scan, trace_sinks

    if isinstance(trace, (str, os.PathLike)):
        from pcast_jax import fileio

        if not os.path.isdir(trace):  # a trace folder is read one layer at a time
            fileio.check_regular(trace, what=f"trace file {trace}")
        trace = load_trace(trace)
    if not isinstance(trace, (Trace, StreamedTrace)):
        raise PcastError(f"trace must be a Trace (Recorder.trace() or load_trace) or a trace file, got "
                         f"{type(trace).__name__}")
    _check_head_dim(trace.head_dim, "the trace's head dim")
    mass_limit = check_mass_limit(mass_limit)
    min_keys = check_int("min_keys", min_keys, min_value=1)
    if logits_fn is not None and trace.tokens is None:
        raise PcastError("logits_fn needs the trace's tokens (Recorder.trace(tokens=...))")
    family = engine.config
    if engine.scale_s_reaches_p:
        family = dataclasses.replace(family, name=f"cudnn_fp8_tau{family.rescale_threshold:g}")
        scales = set(scale_candidates(family))
        if given_s is not None:
            scales.add(float(given_s))
    else:
        scales = {family.scale}
    say = progress or (lambda _line: None)
    positions = trace_sinks(trace, progress=say)
    say(f"scale_s: {len(scales)} candidate{'s' if len(scales) > 1 else ''} in one pass")
    scan = scale_scan(trace, family, sink_positions=positions, scales=sorted(scales),
                      min_keys=min_keys, mass_limit=mass_limit)
    e2e = fp32 = None
    if logits_fn is not None:
        label = "scale_s" if engine.scale_s_reaches_p else "S"
        configs = [family.replace(scale=s, name=f"{label}={s:g}") for s in sorted(scales)]
        fp32, by_name = end_to_end(trace, configs, logits_fn, progress=say)
        e2e = {cfg.scale: by_name[cfg.name] for cfg in configs}
    shape = (trace.num_layers, trace.num_heads, trace.num_sequences, int(np.max(trace.lengths)))
    return JaxFP8Scan(config=family, gpu=engine.words, scan=scan, given_scale_s=given_s, mass_limit=mass_limit,
                      e2e=e2e, e2e_fp32=fp32, shape=shape, scale_s_reaches_p=engine.scale_s_reaches_p)


def _sinks(sinks) -> np.ndarray:
    """(H,) float64 sink logits from a number, a sequence, an array or a ``.npy`` file; (0,) for None."""
    if sinks is None:
        return np.zeros(0)
    if isinstance(sinks, str):
        sinks = _read_sinks_file(sinks)
    try:
        raw = np.asarray(sinks)
        if raw.dtype.kind in "cSUO":  # complex, text, objects: never silently cut to a real part
            raise TypeError
        arr = raw.astype(np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise PcastError(f"sinks={_short(sinks)} must be real numbers (one learned sink logit per head)") from None
    if arr.size == 0 or arr.size > 4096:
        raise PcastError(f"sinks must hold 1 to 4096 logits (one per head), got {arr.size}")
    if not np.all(np.isfinite(arr)) or np.any(np.abs(arr) > 1e4):
        raise PcastError("sinks must be finite logits with |value| <= 1e4")
    return arr


#: Largest ``.npy`` file of sink logits read (4096 float64 logits and the header fit easily).
_SINKS_FILE_MAX_BYTES = 1 << 16


def _read_sinks_file(path: str) -> np.ndarray:
    """Sink logits from a ``.npy`` file (a regular file, bounded, no pickles); PcastError naming it."""
    from pcast_jax import fileio

    return fileio.load_npy(path, what=f"sinks file {path!r}", max_bytes=_SINKS_FILE_MAX_BYTES)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


#: Bytes the simulation holds per logit of one seed (the scores, P, its scaled and cast copies, the
#: masks, the statistics' temporaries): peak memory measured at 48 and 37 bytes per logit on CPU
#: (q_len 32, seq_len 65536 and 262144); the bound leaves room above that.
_BYTES_PER_LOGIT = 64


def _simulate(cfg: KernelConfig, sinks: np.ndarray, *, seq_len, q_len, d, sigma, seeds, base_seed):
    """Mean and standard error over seeds of the simulator's loss metrics, per head's sink."""
    import jax
    import jax.numpy as jnp

    from pcast_jax import metrics
    from pcast_jax.workloads import SinkWorkload, make_instance

    w = SinkWorkload(n=seq_len, q_len=q_len, d=d, k_sink=0, sigma=sigma)
    heads = jnp.asarray(sinks if sinks.size else np.zeros(1), jnp.float32)
    has_sink = bool(sinks.size)

    def one(key, sink):
        inst = make_instance(key, w, 0.0, draw_v=False)
        if has_sink:
            inst = inst._replace(sink_logit=sink)
        m = metrics.evaluate(inst, (cfg,), sampled=False, expected=False)
        return jnp.stack([m[k][0] for k in ("frac_zeroed", "zeroed_mass", "frac_saturated", "saturated_mass")])

    keys = jax.random.split(jax.random.PRNGKey(base_seed), seeds)
    per_seed = jax.vmap(one, (None, 0))  # every head of one seed at once; the seeds one after another, so
    # the memory held is one seed's (what predict checks against the budget), whatever ``seeds`` is
    vals = np.asarray(jax.jit(lambda ks, hs: jax.lax.map(lambda key: per_seed(key, hs), ks))(keys, heads),
                      np.float64)  # (seeds, H, 4)
    mean = vals.mean(axis=0)
    sem = vals.std(axis=0, ddof=1) / math.sqrt(seeds)
    names = ("frac_zeroed", "zeroed_mass", "frac_saturated", "saturated_mass")
    return (*(mean[:, i] for i in range(4)), {k: sem[:, i] for i, k in enumerate(names)})
