"""Record the Q, K, V of a PyTorch model's attention as a :class:`~pcast_jax.analysis.capture.Trace`.

Two ways in, both recording a call after it has run::

    from pcast_jax.analysis.torch_capture import TorchRecorder

    rec = TorchRecorder()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=rec.register())  # transformers
    model(input_ids, attention_mask=attention_mask)
    rec.trace(tokens=input_ids, attention_mask=attention_mask).save("trace.npz")

    with rec.sdpa():                        # any model that calls F.scaled_dot_product_attention
        my_model(x)

:meth:`TorchRecorder.register` registers an attention function with transformers' ``AttentionInterface`` under a
name of its own (pass it as ``attn_implementation``); transformers calls it in every layer with the layer's
module, ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``, the mask it built, and what the layer carries:
``scaling``, ``sliding_window``, ``softcap`` and gpt-oss's learned sinks ``s_aux``. It attends exactly in float32
(softmax of ``scaling·q·k``, soft-capped, masked, with the sink column) and records. :meth:`TorchRecorder.sdpa`
wraps ``torch.nn.functional.scaled_dot_product_attention`` for as long as the ``with`` block runs, one layer per
call in call order. torch and transformers are imported only inside these methods.

What a call saw becomes the trace's parameters by :func:`trace_from_calls`, plain NumPy: the real tokens of each
sequence (right padding), the layer's local window (transformers' ``sliding_window`` ``W``: keys ``j > i − W``,
the trace's window ``W − 1``), its soft cap, its sinks, and the scale folded into Q so that the trace's logits are
``q·k / √D``. A mask that is not causal self-attention over right-padded sequences within one window (left
padding, a mask that differs between heads, a decode step, cross-attention, dropout) is refused naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import numpy as np

from pcast_jax.analysis.capture import Trace
from pcast_jax.errors import PcastError

__all__ = ["AttentionCall", "TorchRecorder", "trace_from_calls"]

_NAMES = itertools.count()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionCall:
    """One attention call as PyTorch made it, in NumPy.

    Attributes:
      layer: the layer's name (calls with the same name add sequences to one layer).
      q: ``[B, Hq, T, D]`` queries as the call got them (transformers' layout).
      k, v: ``[B, Hkv, T, D]``.
      visible: ``[B, T, T]`` bool, key ``j`` visible to query ``i`` by the call's mask (all heads alike), or None:
        causal within ``sliding_window``.
      scaling: the logit scale the call applied (``None``: 1/√D).
      sliding_window: transformers' window ``W`` (keys ``j > i − W``), or None.
      softcap: the logit soft cap (``cap·tanh(logits / cap)``), or None.
      sinks: ``[Hq]`` learned sink logits (``s_aux``), or None.
    """

    layer: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    visible: np.ndarray | None = None
    scaling: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: np.ndarray | None = None

    def __post_init__(self):
        for name in ("q", "k", "v"):
            x = np.asarray(getattr(self, name), np.float32)
            if x.ndim != 4:
                raise PcastError(f"AttentionCall {self.layer}: {name} must be [batch, heads, tokens, dim], got "
                                 f"{x.shape}")
            object.__setattr__(self, name, x)
        if self.k.shape[2] != self.q.shape[2]:
            raise PcastError(f"AttentionCall {self.layer}: {self.q.shape[2]} queries and {self.k.shape[2]} keys; "
                             "only self-attention (as many keys as queries, no decode step) is recorded")
        if self.visible is not None:
            vis = np.asarray(self.visible, bool)
            b, t = self.q.shape[0], self.q.shape[2]
            if vis.shape != (b, t, t):
                raise PcastError(f"AttentionCall {self.layer}: visible must be [{b}, {t}, {t}], got {vis.shape}")
            object.__setattr__(self, "visible", vis)


def trace_from_calls(calls, *, tokens=None, attention_mask=None) -> Trace:
    """The :class:`Trace` of recorded attention calls (layers in the order first seen; NumPy only).

    ``attention_mask [B, T]`` (1 at real tokens, right padding; the model's input) gives each sequence's real
    tokens; without it they are read from the calls' masks (the keys some query sees), which transformers may
    leave open at padded rows."""
    layers: dict[str, list] = {}
    offset: dict[str, int] = {}
    real = None if attention_mask is None else np.asarray(attention_mask).astype(bool)
    for call in calls:
        start = offset.get(call.layer, 0)
        offset[call.layer] = start + call.q.shape[0]
        lengths = None
        if real is not None:
            if real.ndim != 2 or real.shape[1] != call.q.shape[2] or offset[call.layer] > real.shape[0]:
                raise PcastError(f"TorchRecorder.trace: attention_mask {real.shape} does not match the calls of "
                                 f"layer {call.layer} (q {call.q.shape})")
            lengths = real[start:offset[call.layer]].sum(axis=1)
            if any(not real[start + b, :n].all() for b, n in enumerate(lengths)):
                raise PcastError("TorchRecorder.trace: attention_mask is not right padding (ones, then zeros); pad "
                                 "on the right (tokenizer.padding_side = 'right')")
        layers.setdefault(call.layer, []).append(_layer_parts(call, lengths))
    if not layers:
        raise PcastError("TorchRecorder.trace: nothing was recorded (run the model with attn_implementation="
                         "rec.register(), or inside `with rec.sdpa():`)")
    stacked = []
    for name, parts in layers.items():
        windows = {p[4] for p in parts}
        caps = {p[5] for p in parts}
        sinks = [p[6] for p in parts]
        if len(windows) > 1 or len(caps) > 1 or any(not np.array_equal(s, sinks[0]) for s in sinks):
            raise PcastError(f"TorchRecorder.trace: layer {name} was called with different windows, soft caps or "
                             "sinks; a trace records one of each per layer")
        stacked.append((*(np.concatenate([p[i] for p in parts]) for i in range(4)), windows.pop(), caps.pop(),
                        sinks[0]))
    lengths = stacked[0][3]
    for name, layer in zip(layers, stacked):
        if layer[0].shape != stacked[0][0].shape or not np.array_equal(layer[3], lengths):
            raise PcastError(f"TorchRecorder.trace: layer {name} saw q {layer[0].shape} and lengths "
                             f"{layer[3].tolist()}, the first layer {stacked[0][0].shape} and {lengths.tolist()}; "
                             "every layer must see the same sequences (record one forward pass)")
    sinks = np.stack([layer[6] for layer in stacked])
    caps = np.array([layer[5] for layer in stacked], np.float32)
    if tokens is not None:
        tokens = np.asarray(tokens)
        tokens = tokens[None] if tokens.ndim == 1 else tokens
    return Trace(q=np.stack([x[0] for x in stacked]), k=np.stack([x[1] for x in stacked]),
                 v=np.stack([x[2] for x in stacked]), lengths=lengths, layers=tuple(layers), tokens=tokens,
                 local_window_size=np.array([x[4] for x in stacked], np.int64),
                 sinks=sinks if np.isfinite(sinks).any() else None, logits_soft_cap=caps if caps.any() else None)


def _layer_parts(call: AttentionCall, lengths=None):
    """``(q, k, v [B, T, H, D], lengths [B], window, cap, sinks [Hq])`` of one call, its visibility checked on
    the real rows (``lengths``, else the keys some query sees)."""
    batch, heads, tokens, dim = call.q.shape
    window = -1 if call.sliding_window is None else int(call.sliding_window) - 1
    idx = np.arange(tokens)
    causal = (idx[None, :] <= idx[:, None]) & ((window < 0) | (idx[:, None] - idx[None, :] <= window))
    visible = np.broadcast_to(causal, (batch, tokens, tokens)) if call.visible is None else call.visible
    if lengths is None:
        lengths = np.max(np.where(visible.any(axis=1), idx + 1, 0), axis=-1)
    for b in range(batch):
        real = idx < lengths[b]
        rebuilt = causal & real[None, :]
        if lengths[b] < 2 or not np.array_equal(visible[b][real], rebuilt[real]):
            raise PcastError(f"TorchRecorder: layer {call.layer} sequence {b}: its mask is not causal "
                             f"self-attention over right-padded tokens within the layer's window "
                             f"(sliding_window={call.sliding_window}) — left padding, a bidirectional or "
                             "per-head mask, or fewer than 2 real tokens; pad on the right (tokenizer.padding_side "
                             "= 'right')")
    scaling = 1.0 / math.sqrt(dim) if call.scaling is None else float(call.scaling)
    q = call.q * np.float32(scaling * math.sqrt(dim))  # the trace's logits are q·k/√D
    sinks = np.full(heads, -np.inf, np.float32) if call.sinks is None else np.asarray(call.sinks, np.float32)
    if sinks.shape != (heads,):
        raise PcastError(f"TorchRecorder: layer {call.layer}: s_aux must hold one sink per query head ({heads}), "
                         f"got {sinks.shape}")
    cap = 0.0 if call.softcap is None else float(np.float32(call.softcap))
    return (*(np.swapaxes(x, 1, 2) for x in (q, call.k, call.v)), lengths.astype(np.int64), window, cap, sinks)


class TorchRecorder:
    """Records PyTorch attention calls (module docstring); :meth:`trace` gives the :class:`Trace`."""

    def __init__(self):
        self.calls: list[AttentionCall] = []
        self._layers: dict = {}

    def trace(self, *, tokens=None, attention_mask=None) -> Trace:
        """The calls recorded so far as a :class:`Trace`; ``tokens [B, T]`` (a tensor or array) ride along, and
        the model's ``attention_mask [B, T]`` says which tokens are real (:func:`trace_from_calls`)."""
        tokens, attention_mask = (x.detach().cpu().numpy() if hasattr(x, "detach") else x
                                  for x in (tokens, attention_mask))
        return trace_from_calls(self.calls, tokens=tokens, attention_mask=attention_mask)

    def clear(self) -> None:
        self.calls.clear()
        self._layers.clear()

    def _layer_name(self, module) -> str:
        index = getattr(module, "layer_idx", None)
        if index is not None:
            return f"layer{int(index)}"
        return self._layers.setdefault(id(module), f"call{len(self._layers)}")

    def register(self, name: str | None = None) -> str:
        """Register this recorder's attention with transformers' ``AttentionInterface``; returns the name to pass
        as ``attn_implementation`` (``from_pretrained``, ``from_config`` or ``model.set_attn_implementation``)."""
        from transformers import AttentionInterface

        name = name or f"pcast_record_{next(_NAMES)}"
        AttentionInterface.register(name, self._attention)
        return name

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                   softcap=None, s_aux=None, **kwargs):
        """transformers' attention-function contract: ``(out [B, T, Hq, D], weights)``, exact in float32."""
        import torch

        if dropout:
            raise PcastError(f"TorchRecorder: dropout={dropout} (a model in training mode); call model.eval()")
        heads, kv_heads, tokens = query.shape[1], key.shape[1], query.shape[2]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        k = key.float().repeat_interleave(heads // kv_heads, dim=1)
        v = value.float().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.matmul(query.float(), k.transpose(2, 3)) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        visible = _visible(attention_mask, query.shape[0], tokens, key.shape[2], sliding_window, query.device)
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        if s_aux is not None:
            sink = s_aux.float().reshape(1, -1, 1, 1).expand(query.shape[0], -1, tokens, 1)
            weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(logits, dim=-1)
        out = torch.matmul(weights, v).to(query.dtype).transpose(1, 2).contiguous()
        self.calls.append(AttentionCall(
            layer=self._layer_name(module), q=_numpy(query), k=_numpy(key), v=_numpy(value),
            visible=_numpy(visible), scaling=scale, sliding_window=sliding_window, softcap=softcap,
            sinks=None if s_aux is None else _numpy(s_aux)))
        return out, None

    @contextlib.contextmanager
    def sdpa(self):
        """Inside the block, ``torch.nn.functional.scaled_dot_product_attention`` records every call (one layer
        per call in call order) and then runs as before."""
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention

        def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, **kwargs):
            out = original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa, **kwargs)
            if not is_causal and attn_mask is None:
                raise PcastError("TorchRecorder.sdpa: a call without is_causal=True or a mask is not causal; the "
                                 "analysis is of causal self-attention")
            if dropout_p:
                raise PcastError(f"TorchRecorder.sdpa: dropout_p={dropout_p}; record in eval mode")
            q = query if query.ndim == 4 else query[None]
            k, v = (x if x.ndim == 4 else x[None] for x in (key, value))
            visible = None
            if attn_mask is not None:
                visible = _visible(attn_mask, q.shape[0], q.shape[2], k.shape[2], None, q.device)
                if is_causal:
                    visible = visible & _visible(None, q.shape[0], q.shape[2], k.shape[2], None, q.device)
            self.calls.append(AttentionCall(layer=f"call{len(self.calls)}", q=_numpy(q), k=_numpy(k), v=_numpy(v),
                                            visible=None if visible is None else _numpy(visible), scaling=scale))
            return out

        F.scaled_dot_product_attention = recording
        try:
            yield self
        finally:
            F.scaled_dot_product_attention = original


def _visible(mask, batch: int, tokens: int, keys: int, sliding_window, device):
    """``[B, T, S]`` bool of a transformers / SDPA mask (bool: True attends; float: added, −inf or the dtype's
    minimum hides), one for all heads; None: causal within ``sliding_window``."""
    import torch

    if mask is None:
        i = torch.arange(tokens, device=device)[:, None]
        j = torch.arange(keys, device=device)[None, :]
        causal = j <= i
        if sliding_window is not None:
            causal = causal & (j > i - sliding_window)
        return causal[None].expand(batch, tokens, keys)
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    while visible.ndim < 4:
        visible = visible[None]
    visible = visible.expand(batch, -1, tokens, keys)
    if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
        raise PcastError("TorchRecorder: the attention mask differs between heads; a trace records one visibility "
                         "per layer")
    return visible[:, 0]


def _numpy(x) -> np.ndarray:
    out = x.detach().cpu()
    return (out.float() if out.is_floating_point() else out).numpy()
