"""Record the Q, K, V that a JAX model's attention layers see, and save them as a trace file.

A :class:`Recorder` hands out the same three entry points the package already has, each of which
records its inputs (post-RoPE, exactly as the kernel would see them) and then runs the attention
as before::

    rec = Recorder()
    out = rec.dot_product_attention(q, k, v, is_causal=True)          # instead of pcast_jax's
    layer = nnx.MultiHeadAttention(..., attention_fn=rec.attention_fn())  # Flax
    logits = forward(params, cfg, tokens, attention_fn=rec.hook())     # pcast_jax.models hooks
    trace = rec.trace()                                                # Trace [L, B, T, H, D]
    trace.save("trace.npz")

Recording works eagerly and under ``jax.jit`` / ``vmap`` (through ``jax.debug.callback``). What a
layer is:

* ``rec.hook(...)``: the model's layer index (the hook's ``layer`` argument);
* ``rec.attention_fn(...)``: one layer per function the recorder hands out (one per Flax layer
  built with it), named ``name`` or ``layer<i>`` in the order they were made;
* ``rec.dot_product_attention``: one layer per call, in call order (``call<i>``), so record one
  forward pass.

Calls that hit the same layer again (a second batch, or each sequence of a vmapped model) add
sequences to it. Only causal self-attention is analysed, so a call must be causal (``is_causal`` or a
causal config; hooks are causal by contract) with as many keys as queries; a ``bias`` is refused
(the analysis would not see it). A ``scale`` other than 1/√D is folded into the recorded Q, so the
trace's logits are always ``q·k / √D``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax.errors import PcastError

__all__ = ["Trace", "Recorder", "load_trace", "TRACE_DIMS"]

#: The axes of a trace's ``q``, ``k`` and ``v``.
TRACE_DIMS = ("layer", "sequence", "token", "head", "dim")
_FORMAT = "pcast_jax.trace/1"


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Post-RoPE attention inputs of every layer of causal self-attention.

    Attributes:
      q: ``[L, B, T, Hq, D]`` float32 queries (logits are ``q·k / √D``).
      k, v: ``[L, B, T, Hkv, D]`` float32; query head ``h`` reads KV head ``h // (Hq / Hkv)``.
      lengths: ``[B]`` real tokens of each sequence (right padding beyond).
      layers: ``L`` layer names.
      tokens: optional ``[B, T]`` token ids (what an end-to-end comparison runs the model on).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    lengths: np.ndarray
    layers: tuple[str, ...]
    tokens: np.ndarray | None = None

    def __post_init__(self):
        _check_trace(self, "Trace")

    @property
    def num_layers(self) -> int:
        return self.q.shape[0]

    @property
    def num_sequences(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[3]

    def sequence(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of sequence ``index``, ``[L, length, H, D]`` each (its real tokens only)."""
        n = int(self.lengths[index])
        return self.q[:, index, :n], self.k[:, index, :n], self.v[:, index, :n]

    def save(self, path) -> Path:
        """Write the trace as an ``.npz`` file (axes :data:`TRACE_DIMS`, lengths and layer names
        named inside it); returns the path."""
        from pcast_jax.fileio import atomic_write

        path = Path(path)
        arrays = {"format": np.array(_FORMAT), "dims": np.array(TRACE_DIMS), "q": self.q, "k": self.k,
                  "v": self.v, "lengths": self.lengths, "layers": np.array(self.layers)}
        if self.tokens is not None:
            arrays["tokens"] = self.tokens
        return atomic_write(path, lambda f: np.savez(f, **arrays))


def _check_trace(trace: Trace, where: str) -> None:
    """Shapes, dtypes and finiteness of a trace; a PcastError naming ``where`` and the field."""
    for name in ("q", "k", "v"):
        arr = np.asarray(getattr(trace, name))
        if arr.ndim != 5 or not np.issubdtype(arr.dtype, np.floating):
            raise PcastError(f"{where}: field {name!r} must be a float array [layer, sequence, token, head, "
                             f"dim], got {arr.dtype} {arr.shape}")
        object.__setattr__(trace, name, arr.astype(np.float32, copy=False))
    q, k, v = trace.q, trace.k, trace.v
    if k.shape != v.shape or k.shape[:3] != q.shape[:3] or k.shape[4] != q.shape[4] or q.shape[3] % k.shape[3]:
        raise PcastError(f"{where}: fields 'k' {k.shape} and 'v' {v.shape} do not match 'q' {q.shape} "
                         "(same layers, sequences, tokens, head dim; query heads a multiple of KV heads)")
    if min(q.shape) < 1 or q.shape[2] < 2:
        raise PcastError(f"{where}: field 'q' {q.shape} needs at least one layer, sequence and head and 2 tokens")
    for name in ("q", "k", "v"):
        if not np.all(np.isfinite(getattr(trace, name))):
            raise PcastError(f"{where}: field {name!r} holds a non-finite value")
    lengths = np.asarray(trace.lengths)
    if lengths.shape != (q.shape[1],) or not np.issubdtype(lengths.dtype, np.integer) \
            or lengths.min() < 2 or lengths.max() > q.shape[2]:
        raise PcastError(f"{where}: field 'lengths' must be {q.shape[1]} integers in [2, {q.shape[2]}], "
                         f"got {lengths.dtype} {lengths.tolist()}")
    object.__setattr__(trace, "lengths", lengths.astype(np.int64))
    layers = tuple(str(x) for x in np.asarray(trace.layers).reshape(-1))
    if len(layers) != q.shape[0] or len(set(layers)) != len(layers):
        raise PcastError(f"{where}: field 'layers' must hold {q.shape[0]} distinct names, got {list(layers)}")
    object.__setattr__(trace, "layers", layers)
    if trace.tokens is not None:
        tokens = np.asarray(trace.tokens)
        if tokens.shape != q.shape[1:3] or not np.issubdtype(tokens.dtype, np.integer):
            raise PcastError(f"{where}: field 'tokens' must be integers of shape {q.shape[1:3]}, "
                             f"got {tokens.dtype} {tokens.shape}")
        object.__setattr__(trace, "tokens", tokens)


def load_trace(path) -> Trace:
    """Read a trace written by :meth:`Trace.save`; a damaged file raises a PcastError naming it and the field."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            fields = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise PcastError(f"trace file {path}: not found") from None
    except (OSError, ValueError, EOFError) as exc:
        raise PcastError(f"trace file {path}: not a readable .npz trace ({exc})") from None
    for name in ("format", "q", "k", "v", "lengths", "layers"):
        if name not in fields:
            raise PcastError(f"trace file {path}: field {name!r} is missing (write traces with Trace.save)")
    if str(fields["format"]) != _FORMAT:
        raise PcastError(f"trace file {path}: field 'format' is {str(fields['format'])!r}, expected {_FORMAT!r}")
    if "dims" in fields and tuple(str(x) for x in fields["dims"]) != TRACE_DIMS:
        raise PcastError(f"trace file {path}: field 'dims' is {fields['dims'].tolist()}, expected {list(TRACE_DIMS)}")
    trace = Trace.__new__(Trace)
    for name in ("q", "k", "v", "lengths", "layers"):
        object.__setattr__(trace, name, fields[name])
    object.__setattr__(trace, "tokens", fields.get("tokens"))
    _check_trace(trace, f"trace file {path}")
    return trace


class Recorder:
    """Records the Q/K/V of every attention call made through it (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict = {}      # layer key -> list of (q, k, v, lengths) numpy, batched
        self._order: list = []        # layer keys in first-seen order
        self._made = 0                # attention_fn layers handed out
        self._calls = 0               # dot_product_attention calls seen
        self._hooks: dict = {}

    # -- the three entry points ------------------------------------------------------------

    def dot_product_attention(self, query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                              key_value_seq_lengths=None, config=None, **kwargs):
        """:func:`pcast_jax.dot_product_attention` (same arguments) that records its inputs first."""
        from pcast_jax import nn

        with self._lock:
            name = f"call{self._calls}"
            self._calls += 1
        causal = is_causal or _config_causal(config)
        self._record(name, query, key, value, bias=bias, scale=scale, causal=causal,
                     lengths=key_value_seq_lengths)
        return nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                        key_value_seq_lengths=key_value_seq_lengths, config=config, **kwargs)

    def attention_fn(self, config=None, *, name: str | None = None, **kwargs):
        """:func:`pcast_jax.nn.attention_fn` (same arguments) that records; one layer per function."""
        from pcast_jax import nn

        inner = nn.attention_fn(config, **kwargs)
        with self._lock:
            layer_name = name if name is not None else f"layer{self._made}"
            self._made += 1
        causal_config = _config_causal(config)

        def fn(query, key, value, bias=None, mask=None, **kw):
            self._record(layer_name, query, key, value, bias=bias, scale=None,
                         causal=bool(kw.get("is_causal", False)) or causal_config, lengths=None)
            return inner(query, key, value, bias, mask, **kw)

        return fn

    def hook(self, attention_fn=None):
        """An ``attention_fn`` hook for :func:`pcast_jax.models.forward`: records ``q, k, v`` of
        each layer, then runs ``attention_fn`` (default: exact causal attention). The same object
        for the same ``attention_fn``, so the model's compiled forward is reused."""
        key = attention_fn
        if key not in self._hooks:
            self._hooks[key] = functools.partial(_recording_hook, self, attention_fn)
        return self._hooks[key]

    # -- results -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget everything recorded (the functions handed out keep their layer names)."""
        jax.effects_barrier()
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._calls = 0

    def trace(self, *, tokens=None) -> Trace:
        """The recorded calls as a :class:`Trace`; ``tokens [B, T]`` optionally ride along."""
        jax.effects_barrier()
        with self._lock:
            order = sorted(self._order, key=_layer_sort_key)
            if not order:
                raise PcastError("Recorder.trace: nothing was recorded (run the model through the recorder's "
                                 "dot_product_attention, attention_fn or hook first)")
            stacked = {}
            for name in order:
                parts = self._entries[name]
                stacked[name] = [np.concatenate([p[i] for p in parts]) for i in range(4)]
        shapes = {name: tuple(x.shape for x in arrays[:3]) for name, arrays in stacked.items()}
        first = order[0]
        for name in order:
            if shapes[name] != shapes[first]:
                raise PcastError(f"Recorder.trace: layer {_layer_label(name)} recorded q/k/v of shapes "
                                 f"{shapes[name]}, layer {_layer_label(first)} {shapes[first]}; every layer must "
                                 "see the same sequences (record one forward pass, or call clear() between)")
        lengths = stacked[first][3]
        q, k, v = (np.stack([stacked[name][i] for name in order]) for i in range(3))
        if tokens is not None:
            tokens = np.asarray(tokens)
            tokens = tokens[None] if tokens.ndim == 1 else tokens
        return Trace(q=q, k=k, v=v, lengths=lengths, layers=tuple(_layer_label(n) for n in order), tokens=tokens)

    # -- recording ---------------------------------------------------------------------------

    def _record(self, name, query, key, value, *, bias, scale, causal: bool, lengths, valid=None):
        if bias is not None:
            raise PcastError(f"Recorder: layer {_layer_label(name)} got a bias; the analysis sees q·k/√D only, "
                             "so a biased attention cannot be recorded")
        if not causal:
            raise PcastError(f"Recorder: layer {_layer_label(name)} is not causal; the analysis is of causal "
                             "self-attention (pass is_causal=True)")
        query, key, value = (jnp.asarray(x) for x in (query, key, value))
        if query.ndim == 3:
            query, key, value = query[None], key[None], value[None]
        if query.shape[1] != key.shape[1]:
            raise PcastError(f"Recorder: layer {_layer_label(name)} has {query.shape[1]} queries and {key.shape[1]} "
                             "keys; only self-attention (as many keys as queries, no decode step) is recorded")
        head_dim = query.shape[-1]
        if scale is not None:
            query = query * (jnp.asarray(scale, jnp.float32) * math.sqrt(head_dim))
        batch, num_tokens = query.shape[:2]
        if valid is not None:
            lengths = jnp.sum(jnp.asarray(valid, jnp.int32), axis=-1).reshape(batch)
        elif lengths is None:
            lengths = jnp.full((batch,), num_tokens, jnp.int32)
        index = jnp.asarray(0 if isinstance(name, str) else name, jnp.int32)  # a hook's layer may be traced
        jax.debug.callback(functools.partial(self._store, name if isinstance(name, str) else None), index,
                           query.astype(jnp.float32), key.astype(jnp.float32), value.astype(jnp.float32),
                           jnp.asarray(lengths, jnp.int32))

    def _store(self, name, index, q, k, v, lengths):
        name = name if name is not None else int(np.asarray(index))
        with self._lock:
            if name not in self._entries:
                self._entries[name] = []
                self._order.append(name)
            self._entries[name].append(tuple(np.array(x) for x in (q, k, v, lengths)))


def _recording_hook(recorder: Recorder, attention_fn, q, k, v, layer, valid=None):
    """The hook :meth:`Recorder.hook` returns: record ``[T, H, D]`` q/k/v under the layer index, then attend."""
    recorder._record(layer, q, k, v, bias=None, scale=None, causal=True, lengths=None,
                     valid=None if valid is None else jnp.asarray(valid)[None])
    if attention_fn is None:
        from pcast_jax import nn

        mask = None if valid is None else jnp.asarray(valid, bool)[None, None, :]
        return nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    if valid is None:
        return attention_fn(q, k, v, layer)
    return attention_fn(q, k, v, layer, valid=valid)


def _config_causal(config) -> bool:
    if config is None:
        return False
    from pcast_jax.presets import resolve

    return bool(resolve(config).causal)


def _layer_sort_key(name):
    return (0, name, "") if isinstance(name, int) else (1, 0, name)


def _layer_label(name) -> str:
    if isinstance(name, str):
        return name
    try:
        return f"layer{int(np.asarray(name))}"
    except jax.errors.TracerArrayConversionError:
        return "(a hooked layer)"
