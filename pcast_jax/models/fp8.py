"""FP8 attention on a real model: the kernel-faithful simulator as the model's attention.

Three layers of use:

* :class:`FP8Attention` — an ``attention_fn`` hook for :func:`pcast_jax.models.forward` that runs
  :func:`pcast_jax.engine.attention` (Algorithm 1 of the paper, the configuration's order, scale,
  block size and cast) for every query head, causal, with query head ``h`` reading KV head
  ``h // (Hq / Hkv)``. With ``config.qkv == "f32"`` (every preset) only the P-cast is simulated,
  as in the paper's §6; with ``config.replace(qkv="e4m3")`` Q, K and V are also quantized to E4M3
  with one scale per tensor (``amax / 448`` over the whole layer input: all heads and tokens), or
  one per attention head with ``qkv_granularity="head"`` as well.
* :func:`head_metrics` / :func:`analyze_trace` — per layer and head, on recorded Q/K/V traces:
  output MSE against exact FP32 attention, relative MSE, and the fraction of non-sink P the cast
  zeroes.
* :func:`end_to_end` — every attention of the forward replaced by the simulation: perplexity,
  KL(FP32 ‖ FP8) of the next-token distributions and top-1 agreement with the FP32 model.

Batches: the hook takes one sequence ``[T, H, D]`` or a batch ``[B, T, H, D]``, with an optional
``valid`` padding mask (``[T]`` / ``[B, T]``, True at real tokens, right padding); the forward
passes it when given ``lengths``. Each sequence is its own kernel call: causal on its own, keys at
padded positions masked out, and E4M3 Q/K/V scales taken over its real tokens only, so on the same
Q/K/V a sequence gets the same output in any batch as alone. Through a whole compiled forward,
XLA may round a batched program differently in the last FP32 bit, and where a P sits on an E4M3
rounding boundary the cast turns that into one E4M3 step, which later layers carry on: SmolLM2 at
128 tokens under ``rev_s256`` in a batch of two (no padding at all) moves logits by up to 0.09
and the KL by 0.2 % against the sequence run alone, while FP32 and ``fwd_s1`` stay bit-identical.
:func:`compare_logits` and :func:`end_to_end` take ``[B, T]`` tokens with ``lengths`` and score
real positions only.

Definitions used in the reports
-------------------------------
* **Non-sink position** of a head: every key position except the head's ``num_sinks`` sink
  positions from :func:`pcast_jax.models.sink_statistics` (by default the single key receiving the
  most attention).
* **Fraction of non-sink P zeroed** (``frac_zeroed``): for each query row ``i``, the share of its
  non-sink causal keys ``j ≤ i`` whose P was positive before the cast and 0 after it; averaged
  over the rows that see every sink and at least ``min_keys`` non-sink keys (the rows that
  :func:`sink_statistics` averages over, so the two are comparable). ``frac_zeroed_pooled``
  pools the counts of all rows instead.
* **zeroed_mass**: exact FP32 softmax probability carried by the zeroed positions, averaged over
  the same rows.
* **MSE**: mean over rows and head dimensions of ``(O − O_ref)²``, O_ref the exact FP32 causal
  attention on the FP32 Q/K/V; **relative MSE** = MSE / mean(O_ref²) (V of a real model is not
  unit-variance, so the absolute MSE is not comparable with the paper's σ_V = 1 numbers).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax import engine as _engine
from pcast_jax.config import QKV_GRANULARITIES, KernelConfig, get_preset, preset_for, resolve
from pcast_jax.errors import PcastError, check_choice, check_int
from pcast_jax.models.gguf_loader import LlamaConfig
from pcast_jax.models.llama import _check_scored, _validate, _validate_lengths, expand_kv, forward, scored_positions
from pcast_jax.nn import dot_product_attention, kernel_inputs

__all__ = [
    "QKV_GRANULARITIES",
    "FP8Attention",
    "heads_attention",
    "head_metrics",
    "analyze_trace",
    "HEAD_METRICS",
    "E2EMetrics",
    "compare_logits",
    "end_to_end",
]

#: What :func:`head_metrics` returns per head (see the module docstring).
HEAD_METRICS = ("mse", "ref_sq", "rel_mse", "frac_zeroed", "frac_zeroed_pooled", "zeroed_mass",
                "rows_used")
_HIGHEST = jax.lax.Precision.HIGHEST


def _scores_and_values(q, k, v, cfg: KernelConfig):
    """Per-head logits ``[Hq, T, T]`` (1/√D applied, no mask) and values ``[Hq, T, D]``.

    Exactly what :func:`pcast_jax.nn.dot_product_attention` feeds the kernel (FP32 Q/K/V, or E4M3
    with the scales of ``cfg.qkv_granularity``), for one sequence in the model's ``[T, H, D]`` layout.
    """
    logits, v_seen = kernel_inputs(*(jnp.swapaxes(x, 0, 1)[None] for x in (q, k, v)), cfg,
                                   1.0 / math.sqrt(q.shape[2]))
    return logits[0], v_seen[0]


def heads_attention(q, k, v, config: str | KernelConfig, *, count_mask=None,
                    engine: str = "fast") -> _engine.AttentionResult:
    """The simulated kernel on every query head of one layer (full causal self-attention).

    Args:
      q: ``[T, Hq, D]`` post-RoPE queries (unscaled); k, v: ``[T, Hkv, D]``.
      config: preset name or :class:`KernelConfig`; its ``causal`` flag is forced on and the mask
        has ``q_offset = 0`` (query i sits at position i, since q_len = N = T). With
        ``config.qkv == "e4m3"`` Q/K/V are quantized with ``config.qkv_granularity`` scales.
      count_mask: optional ``[Hq, T]`` bool, the positions counted as zeroed (non-sink keys).
      engine: ``"fast"`` (vmapped over heads) or ``"scan"`` (the block-by-block reference).

    Returns:
      :class:`pcast_jax.engine.AttentionResult` with a leading head axis (``out [Hq, T, D]``).
    """
    cfg = dataclasses.replace(resolve(config), causal=True)
    check_choice("engine", engine, _engine.ENGINES)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise PcastError(f"q must be [T, Hq, D] and k, v [T, Hkv, D] with Hq a multiple of Hkv; "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    scores, v_seen = _scores_and_values(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                        jnp.asarray(v, jnp.float32), cfg)

    def one(s, vh, cm):
        return _engine.attention(s, vh, cfg, engine=engine, count_mask=cm, q_offset=0)

    if count_mask is None:
        return jax.vmap(lambda s, vh: one(s, vh, None))(scores, v_seen)
    return jax.vmap(one)(scores, v_seen, jnp.asarray(count_mask, bool))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Attention:
    """``attention_fn`` hook: every attention of the forward through the FP8 kernel simulator.

    Frozen and hashable, so two hooks with the same settings share one compiled forward (the hook
    is a static jit argument of :func:`pcast_jax.models.forward`).

    Attributes:
      config: the kernel's semantics (``causal`` is forced on). Presets keep Q/K/V in FP32
        (P-cast only); ``config.replace(qkv="e4m3")`` adds FP8 Q/K/V, with one scale per layer
        input or, with ``qkv_granularity="head"``, one per head.
      engine: ``"fast"`` (default) or ``"scan"``.
      p_cast: ``False`` skips the kernel: exact FP32 causal softmax on the scores and values the
        kernel would see (with ``qkv="e4m3"``: the Q/K/V quantization floor alone).
    """

    config: KernelConfig
    engine: str = "fast"
    p_cast: bool = True
    #: the preset the config came from (set when ``config`` is a preset name): its KV tile is then
    #: resolved for the head dim at each call (:func:`pcast_jax.config.preset_for`)
    preset: str = ""

    def __post_init__(self):
        if isinstance(self.config, str) and not self.preset:
            object.__setattr__(self, "preset", self.config)
        if self.preset:
            get_preset(self.preset)
        object.__setattr__(self, "config", dataclasses.replace(resolve(self.config), causal=True))
        check_choice("engine", self.engine, _engine.ENGINES)
        if not isinstance(self.p_cast, bool):
            raise PcastError(f"p_cast={self.p_cast!r} must be True or False")

    @classmethod
    def from_preset(cls, name: str | KernelConfig, *, fp8_qkv: bool = False,
                    qkv_granularity: str = "tensor", **kwargs) -> "FP8Attention":
        """Hook for a preset; ``fp8_qkv=True`` also quantizes Q/K/V to E4M3.

        A convenience that sets the config's ``qkv`` and ``qkv_granularity`` fields (``"tensor"``:
        one scale per layer input, ``"head"``: one per head). The hook's label is the preset's
        name, with ``+qkv8`` (per tensor) or ``+qkv8h`` (per head) appended when Q/K/V are
        quantized; the label is for display only.
        """
        cfg = resolve(name)
        check_choice("qkv_granularity", qkv_granularity, QKV_GRANULARITIES)
        if fp8_qkv:
            suffix = "+qkv8h" if qkv_granularity == "head" else "+qkv8"
            cfg = cfg.replace(qkv="e4m3", qkv_granularity=qkv_granularity, name=cfg.name + suffix)
        if isinstance(name, str):
            kwargs.setdefault("preset", name)
        return cls(config=cfg, **kwargs)

    def config_for(self, head_dim: int) -> KernelConfig:
        """The config this hook runs at ``head_dim``: a preset's KV tile for that head dim (the name
        gains ``_d{head_dim}`` when the tile changes), everything else as :attr:`config`."""
        if not self.preset:
            return self.config
        tiled = preset_for(self.preset, head_dim)
        if tiled.block_kv == self.config.block_kv:
            return self.config
        return dataclasses.replace(self.config, block_kv=tiled.block_kv, name=f"{self.config.name}_d{head_dim}")

    @property
    def name(self) -> str:
        return self.config.name

    def __call__(self, q, k, v, layer=None, valid=None):
        """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` → ``[T, Hq, D]`` (or all with a leading batch ``B``).

        ``valid`` (optional ``[T]`` / ``[B, T]`` bool, True at real tokens; right padding) masks
        the keys at padded positions; ``layer`` is ignored. The kernel path is
        :func:`pcast_jax.nn.dot_product_attention` (causal, the config's Q/K/V precision), the
        same function a user's own model calls, once per sequence (its own Q/K/V scales).
        """
        del layer
        q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        if q.ndim not in (3, 4) or k.ndim != q.ndim or v.shape != k.shape or q.shape[:-2] != k.shape[:-2] \
                or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
            raise PcastError(f"q must be [T, Hq, D] and k, v [T, Hkv, D] (or all [B, ...]) with Hq a "
                             f"multiple of Hkv; got {q.shape}, {k.shape}, {v.shape}")
        if valid is not None:
            valid = jnp.asarray(valid)
            if valid.shape != q.shape[:-2] or valid.dtype != jnp.bool_:
                raise PcastError(f"valid must be a bool array of shape {q.shape[:-2]} (True at real "
                                 f"tokens), got {valid.dtype} {valid.shape}")
        if q.ndim == 4:
            if valid is None:
                return jax.vmap(lambda a, b, c: self._sequence(a, b, c, None))(q, k, v)
            return jax.vmap(self._sequence)(q, k, v, valid)
        return self._sequence(q, k, v, valid)

    def _sequence(self, q, k, v, valid):
        """One sequence ``[T, H, D]``: padded positions zeroed (so E4M3 scales see real tokens only)."""
        mask = None
        if valid is not None:
            q, k, v = (jnp.where(valid[:, None, None], x, 0.0) for x in (q, k, v))
            mask = valid[None, None, :]  # (1, 1, S): keys at padded positions removed
        cfg = self.config_for(q.shape[-1])
        if not self.p_cast:
            return _exact_on_kernel_inputs(q, k, v, cfg, mask)
        return dot_product_attention(q, k, v, mask=mask, is_causal=True, config=cfg,
                                     implementation="scan" if self.engine == "scan" else "xla")


def _exact_on_kernel_inputs(q, k, v, cfg: KernelConfig, mask):
    """Exact FP32 causal softmax on the scores and values the kernel would see, ``[T, Hq, D]``."""
    scores, v_seen = _scores_and_values(q, k, v, cfg)
    if mask is not None:  # key 0 is always real, so no causal row is left empty
        scores = jnp.where(mask[0], scores, -jnp.inf)
    return jnp.swapaxes(_engine.reference_attention(scores, v_seen, causal=True, q_offset=0), 0, 1)


# --------------------------------------------------------------------------------------------
# Per layer and head, on recorded traces
# --------------------------------------------------------------------------------------------


def _reference(q, k, v):
    """Exact FP32 causal attention per head: ``[Hq, T, D]``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k = expand_kv(k, num_heads)
    v = expand_kv(v, num_heads)
    s = jnp.einsum("thd,shd->hts", q, k, precision=_HIGHEST) / math.sqrt(head_dim)
    return _engine.reference_attention(s, jnp.swapaxes(v, 0, 1), causal=True, q_offset=0)


@functools.partial(jax.jit, static_argnames=("config", "min_keys"))
def _layer_metrics(q, k, v, sink_positions, *, config: KernelConfig, min_keys: int):
    num_tokens = q.shape[0]
    positions = jnp.arange(num_tokens)
    is_sink = jnp.any(positions[None, :, None] == sink_positions[:, None, :], axis=-1)  # [Hq, T]
    res = heads_attention(q, k, v, config, count_mask=~is_sink)
    ref = _reference(q, k, v)
    err = jnp.mean(jnp.square(res.out - ref), axis=(1, 2))
    ref_sq = jnp.mean(jnp.square(ref), axis=(1, 2))
    counted = res.n_counted.astype(jnp.float32)  # [Hq, T]: non-sink causal keys per row
    valid = (positions[None, :] >= jnp.max(sink_positions, axis=-1)[:, None]) & (counted >= min_keys)
    n_rows = jnp.sum(valid, axis=-1)
    per_row = res.n_zeroed / jnp.maximum(counted, 1.0)

    def row_mean(x):
        return jnp.where(n_rows > 0, jnp.sum(jnp.where(valid, x, 0.0), axis=-1)
                         / jnp.maximum(n_rows, 1), jnp.nan)

    pooled = jnp.sum(res.n_zeroed, axis=-1) / jnp.maximum(jnp.sum(res.n_counted, axis=-1), 1)
    return {
        "mse": err, "ref_sq": ref_sq, "rel_mse": err / ref_sq,
        "frac_zeroed": row_mean(per_row), "frac_zeroed_pooled": pooled.astype(jnp.float32),
        "zeroed_mass": row_mean(res.zeroed_mass), "rows_used": n_rows.astype(jnp.int32),
    }


def head_metrics(q, k, v, config: str | KernelConfig, sink_positions, *,
                 min_keys: int = 16) -> dict[str, np.ndarray]:
    """Per-head P-cast metrics of one layer (definitions in the module docstring).

    Args:
      q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (one layer of :func:`extract_qkv`).
      config: preset name or :class:`KernelConfig` (its fields say whether and how Q/K/V are
        quantized).
      sink_positions: ``[Hq, k]`` int, each head's sink positions (``sink_statistics``).
      min_keys: rows with fewer non-sink keys are left out of the row means.

    Returns:
      dict of ``[Hq]`` numpy arrays, keys :data:`HEAD_METRICS`.
    """
    cfg = dataclasses.replace(resolve(config), causal=True)
    min_keys = check_int("min_keys", min_keys, min_value=1)
    sink_positions = jnp.asarray(sink_positions, jnp.int32)
    if sink_positions.ndim != 2 or sink_positions.shape[0] != np.shape(q)[1]:
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [Hq, k] with "
                         f"Hq={np.shape(q)[1]}")
    out = _layer_metrics(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                         jnp.asarray(v, jnp.float32), sink_positions, config=cfg,
                         min_keys=min_keys)
    return {name: np.asarray(val) for name, val in out.items()}


def analyze_trace(trace, configs: Sequence[str | KernelConfig], sink_positions, *,
                  min_keys: int = 16, progress=None) -> dict[str, np.ndarray]:
    """:func:`head_metrics` for every configuration and layer of a trace.

    Args:
      trace: :class:`pcast_jax.models.QKVTrace` of one sequence (``q [L, T, Hq, D]``).
      configs: preset names or :class:`KernelConfig` objects.
      sink_positions: ``[L, Hq, k]`` from :func:`sink_statistics`.
      progress: optional callable ``(config_name) -> None`` called before each configuration.

    Returns:
      dict metric → ``[n_configs, L, Hq]`` numpy array (keys :data:`HEAD_METRICS`).
    """
    q, k, v = trace
    if np.ndim(q) != 4:
        raise PcastError(f"trace.q must be [L, T, Hq, D] (one sequence); got shape {np.shape(q)}")
    sink_positions = np.asarray(sink_positions)
    if sink_positions.shape[:2] != (np.shape(q)[0], np.shape(q)[2]):
        raise PcastError(f"sink_positions.shape={sink_positions.shape} must be [L, Hq, k] = "
                         f"[{np.shape(q)[0]}, {np.shape(q)[2]}, k]")
    per_config = []
    for config in configs:
        cfg = resolve(config)
        if progress is not None:
            progress(cfg.name)
        layers = [head_metrics(q[layer], k[layer], v[layer], cfg, sink_positions[layer],
                               min_keys=min_keys)
                  for layer in range(np.shape(q)[0])]
        per_config.append({m: np.stack([x[m] for x in layers]) for m in HEAD_METRICS})
    return {m: np.stack([pc[m] for pc in per_config]) for m in HEAD_METRICS}


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


class E2EMetrics(NamedTuple):
    """Next-token quality of a model run against the FP32 model on the same tokens.

    Attributes:
      nll: mean next-token negative log-likelihood (nats).
      perplexity: exp(nll).
      kl: mean over predicted positions of KL(p_FP32 ‖ p_run) (nats).
      kl_max: largest per-position KL.
      top1_agree: fraction of positions whose argmax equals the FP32 model's.
    """

    nll: float
    perplexity: float
    kl: float
    kl_max: float
    top1_agree: float


@jax.jit
def _compare(ref_logits, logits, tokens, scored):
    """Pooled over the scored positions ``scored [..., T-1]`` of ``[..., T, V]`` logits."""
    ref_lp = jax.nn.log_softmax(ref_logits[..., :-1, :], axis=-1)
    lp = jax.nn.log_softmax(logits[..., :-1, :], axis=-1)
    n = jnp.maximum(jnp.sum(scored), 1)

    def mean(x):
        return jnp.sum(jnp.where(scored, x, 0.0)) / n

    nll = mean(-jnp.take_along_axis(lp, tokens[..., 1:, None], axis=-1)[..., 0])
    kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
    agree = (jnp.argmax(ref_lp, -1) == jnp.argmax(lp, -1)).astype(jnp.float32)
    return nll, mean(kl), jnp.max(jnp.where(scored, kl, -jnp.inf)), mean(agree)


def compare_logits(ref_logits, logits, tokens, *, lengths=None) -> E2EMetrics:
    """:class:`E2EMetrics` of ``logits [T, V]`` against ``ref_logits [T, V]`` on ``tokens [T]``.

    Position t predicts token t+1, so T − 1 positions are scored. KL(p‖q) = Σ p (log p − log q)
    in nats, computed from log-softmax (≥ 0 up to float32 rounding). A batch ``[B, T, V]`` /
    ``[B, T]`` pools every scored position of every sequence; with ``lengths [B]`` (right padding)
    only positions t with t + 1 < length are scored, whatever the logits hold elsewhere.
    """
    ref_logits = jnp.asarray(ref_logits, jnp.float32)
    logits = jnp.asarray(logits, jnp.float32)
    tokens = jnp.asarray(tokens, jnp.int32)
    if ref_logits.shape != logits.shape or ref_logits.ndim not in (2, 3) \
            or tokens.shape != logits.shape[:-1]:
        raise PcastError(f"ref_logits and logits must both be [T, V] (or [B, T, V]) and tokens [T] "
                         f"(or [B, T]); got {ref_logits.shape}, {logits.shape}, {tokens.shape}")
    if tokens.shape[-1] < 2:
        raise PcastError("tokens must hold at least 2 tokens (one predicted position)")
    lengths = _validate_lengths(lengths, tokens)
    _check_scored(lengths)
    if lengths is None:
        lengths = jnp.full(tokens.shape[:-1], tokens.shape[-1], jnp.int32)
    scored = scored_positions(lengths, tokens.shape[-1])
    nll, kl, kl_max, agree = (float(x) for x in _compare(ref_logits, logits, tokens, scored))
    return E2EMetrics(nll=nll, perplexity=math.exp(nll), kl=kl, kl_max=kl_max, top1_agree=agree)


def end_to_end(params, cfg: LlamaConfig, tokens, hooks: Sequence[FP8Attention], *,
               lengths=None, progress=None) -> tuple[E2EMetrics, dict[str, E2EMetrics]]:
    """Perplexity, KL and top-1 agreement of the model with each hook's FP8 attention.

    Args:
      params, cfg: the model (:func:`pcast_jax.models.load_model`).
      tokens: ``[T]`` int token ids (one sequence, T ≥ 2), or a batch ``[B, T]``.
      hooks: :class:`FP8Attention` hooks (names must be distinct).
      lengths: optional ``[B]`` real lengths of right-padded ``[B, T]`` tokens; the metrics pool
        the real positions of every sequence.
      progress: optional callable ``(name) -> None`` called before each run.

    Returns:
      ``(fp32, {hook name: metrics})``; ``fp32`` is the FP32 model against itself (KL 0,
      agreement 1) and carries its perplexity.
    """
    tokens = _validate(cfg, tokens, "adjacent")
    lengths = _validate_lengths(lengths, tokens)
    names = [h.name for h in hooks]
    if len(set(names)) != len(names):
        raise PcastError(f"hooks must have distinct names; got {names}")
    for hook in hooks:
        if not isinstance(hook, FP8Attention):
            raise PcastError(f"hooks must be FP8Attention objects, got {type(hook).__name__}")
    ref = forward(params, cfg, tokens, lengths=lengths)
    base = compare_logits(ref, ref, tokens, lengths=lengths)
    out = {}
    for hook in hooks:
        if progress is not None:
            progress(hook.name)
        logits = forward(params, cfg, tokens, attention_fn=hook, lengths=lengths)
        out[hook.name] = compare_logits(ref, logits, tokens, lengths=lengths)
    return base, out
