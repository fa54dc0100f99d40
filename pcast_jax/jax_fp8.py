"""What JAX's own FP8 attention does to P: cuDNN's FP8 SDPA, answered from what a JAX user passes it.

``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(q, k, v, ..., fp8_params=...,
use_fp8=True)`` (jax-ml/jax, the ``FP8Params`` dict of 17 entries, present from jax 0.5 on) runs cuDNN's
FP8 SDPA, whose P scale is ``fp8_params["scale_s"]`` (the forward reads ``scale_s``, ``descale_s`` and
the Q/K/V/O scales). What the kernel does with it is :mod:`pcast_jax.presets.cudnn`: forward order,
128-key blocks, a learned sink as the initial running max, and a lazy rescale τ (natural-log units)
compensated by S_eff = scale_s·2^-τ. JAX passes no learned sink itself (Transformer Engine does); the
``sinks`` here answer for a model that has them.

:func:`predict` takes those arguments and returns the matching
:class:`~pcast_jax.config.KernelConfig`, the closed-form and simulated zeroed and saturated
fractions and masses per head, and the scale_s that avoids saturation. ``pcast jax-fp8`` is the same
question from the command line.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_finite, check_int, check_positive

__all__ = ["JaxFP8Prediction", "NO_THEORY", "cudnn_config", "predict", "scale_s_from", "theory_text"]

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
    """The :class:`KernelConfig` of cuDNN's FP8 SDPA for a caller's ``scale_s`` and a threshold τ (nats).

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
      config: the kernel's :class:`KernelConfig`.
      sinks: (H,) the learned sink logits asked about (NaN-free; 0-length when none).
      theory_frac_zeroed: (H,) non-sink P zeroed by the sink as the initial running max,
        :func:`pcast_jax.theory.learned_sink_collapse_fraction` at S_eff = scale_s·2^-τ; NaN for
        a head without a learned sink, where that closed form does not apply (:meth:`summary`
        and ``pcast jax-fp8`` say so in words).
      frac_zeroed, zeroed_mass, frac_saturated, saturated_mass: (H,) simulated on N(0, σ²)
        logits (the kernel's simulator, mean over ``seeds`` draws), with their standard errors in
        ``sem``.
      max_scaled_p: the largest P·S_eff the lazy rescale allows (:func:`pcast_jax.theory.max_scaled_p`).
      safe_scale_s: the largest power-of-two scale_s that never saturates at this τ
        (:func:`pcast_jax.theory.saturation_free_scale`), and ``safe_critical_delta`` the learned-sink
        logit at which half the non-sink P would still be zeroed with it.
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
    safe_scale_s: float
    safe_critical_delta: float
    seq_len: int
    seeds: int

    def summary(self) -> str:
        """The answer in words, one line per finding."""
        c = self.config
        s_eff = c.effective_scale
        lines = [f"cuDNN FP8 attention with scale_s = {c.scale:g}, tau = {c.rescale_threshold:g} nats: "
                 f"P is cast to E4M3 at S_eff = {s_eff:g}, forward order, {c.block_kv}-key blocks."]
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
        lines.append(f"Safe choice: scale_s = {self.safe_scale_s:g} (the largest power of two that cannot saturate "
                     f"at this tau); half the non-sink P is then zeroed only from a sink logit of "
                     f"{self.safe_critical_delta:.2f} on.")
        return "\n".join(lines)


#: What the closed form says for a head without a learned sink.
NO_THEORY = "theory: n/a, its closed form is for a learned sink as the initial running max"


def theory_text(frac: float) -> str:
    """``theory 12.3%``, or :data:`NO_THEORY` where there is no closed form (NaN: no learned sink)."""
    return NO_THEORY if math.isnan(frac) else f"theory {100 * frac:.1f}%"


def predict(*, fp8_params=None, scale_s: float | None = None, head_dim: int = 128, seq_len: int = 4096,
            sinks=None, rescale_threshold: float = 4.0, mxfp8: bool = False, q_len: int = 32, sigma: float = 1.0,
            seeds: int = 8, base_seed: int = 0) -> JaxFP8Prediction:
    """Predict what cuDNN's FP8 attention (JAX's ``use_fp8=True``) does to P for these arguments.

    Args:
      fp8_params: the ``fp8_params`` dict passed to JAX's FP8 attention (its ``"scale_s"`` is read);
        or give ``scale_s`` directly (JAX's own tests build every scale from ones: 1).
      head_dim: the head dim (≤ 256, a multiple of 16: what JAX accepts for FP8 inference).
      seq_len: KV length N.
      sinks: learned sink logits, one per head (a number, a sequence, an array, or a ``.npy`` path),
        in the units of the scaled logits above the non-sink mean; None: one head without a sink.
      rescale_threshold: cuDNN's τ in nats (4: its reference's default; ``CUDNN_RESCALE_THRESHOLD``).
      mxfp8: the MXFP8 SDPA variant (fixed S = 16, no compensation).
      q_len, sigma, seeds, base_seed: the synthetic logits the simulation draws (N(0, σ²)); the seeds
        run one after another, and one seed's logits (heads × q_len × seq_len) must fit the memory
        budget (:func:`pcast_jax.sweep.check_memory`).
    """
    from pcast_jax import theory

    if fp8_params is not None and scale_s is not None:
        raise PcastError("give fp8_params or scale_s, not both")
    s = scale_s_from(fp8_params) if fp8_params is not None else (1.0 if scale_s is None else scale_s)
    head_dim = check_int("head_dim", head_dim, min_value=16, max_value=_MAX_HEAD_DIM)
    if head_dim % 16:
        raise PcastError(f"head_dim={head_dim}: cuDNN's FP8 attention takes head dims that are multiples of 16 "
                         f"(≤ {_MAX_HEAD_DIM})")
    seq_len = check_int("seq_len", seq_len, min_value=1, max_value=1 << 20)
    seeds = check_int("seeds", seeds, min_value=2, max_value=4096)
    q_len = check_int("q_len", q_len, min_value=1, max_value=1 << 20)
    base_seed = check_int("base_seed", base_seed, min_value=0, max_value=2**32 - 1)
    cfg = cudnn_config(s, rescale_threshold=rescale_threshold, mxfp8=mxfp8)
    sink_arr = _sinks(sinks)
    from pcast_jax.sweep.plan import check_memory

    heads = max(sink_arr.size, 1)
    check_memory(f"predict's simulation ({heads} heads × q_len={q_len} × seq_len={seq_len} logits, one seed "
                 "at a time)", heads * q_len * seq_len * _BYTES_PER_LOGIT)
    frac, lz, fs, ls, sem = _simulate(cfg, sink_arr, seq_len=seq_len, q_len=q_len, d=head_dim, sigma=sigma,
                                      seeds=seeds, base_seed=base_seed)
    theory_frac = np.asarray(theory.learned_sink_collapse_fraction(sink_arr, cfg.effective_scale, sigma=sigma),
                             np.float64) if sink_arr.size else np.full(1, np.nan)
    comp = cfg.rescale_compensation
    safe = float(theory.saturation_free_scale(cfg.rescale_threshold, unit="natural", compensation=comp))
    safe_eff = safe * (2.0 ** -cfg.rescale_threshold if comp == "pow2" else 1.0)
    return JaxFP8Prediction(
        config=cfg, sinks=sink_arr if sink_arr.size else np.full(1, -np.inf), theory_frac_zeroed=theory_frac,
        frac_zeroed=frac, zeroed_mass=lz, frac_saturated=fs, saturated_mass=ls, sem=sem,
        max_scaled_p=float(theory.max_scaled_p(cfg.scale, cfg.rescale_threshold, unit="natural", compensation=comp)),
        safe_scale_s=safe, safe_critical_delta=float(theory.learned_sink_critical_delta(safe_eff)),
        seq_len=seq_len, seeds=seeds)


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
