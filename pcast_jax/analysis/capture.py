"""Record the Q, K, V that a JAX model's attention layers see, and save them as a trace file.

One module, over 600 lines: the three ways of recording (the drop-in, Flax, a model hook) and the two
ways of storing (an ``.npz``, a trace folder streamed one layer at a time) share the trace's one set of checks.

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
  built with it), named ``name`` or ``layer<i>`` in the order they were made (a ``name`` already
  handed out is refused: two layers never merge);
* ``rec.dot_product_attention``: the layer the call names (``name=``); else the model's layer that
  made the call — the object whose method called it (a Flax ``nnx.Module``, any class), named after
  its class in the order first seen (``Attention0``, ``Attention1``, …; a second call site in the same
  object adds ``_1``), so a second forward pass through the same objects adds sequences, not layers;
  else (a plain function) one layer per call in call order (``call<i>``), with a
  :class:`RecorderWarning` when one place in the code makes a second layer eagerly — right for one
  pass through a loop of layers, wrong for a second forward pass, which ``name=`` tells apart (a
  jitted forward replays the names it was traced with, so its later runs add sequences).

Calls that hit the same layer again (a second batch, or each sequence of a vmapped model) add
sequences to it. A call is recorded after it has run, so a call the attention refuses records
nothing. What the layer lets each query see is recorded as parameters: the real tokens of each
sequence (``Trace.lengths``, from ``query_seq_lengths``, ``key_value_seq_lengths`` or a padding
mask), the layer's local window (``Trace.local_window_size``, from ``local_window_size`` or a
banded mask), the drop-in's learned ``sinks`` (``Trace.sinks``) and the layer's ``logits_soft_cap``
(``Trace.logits_soft_cap``: the drop-in's or ``attention_fn``'s argument). Only causal self-attention
within one local window over right-padded sequences can be recorded; anything else is refused
naming the argument — a ``bias``, a non-causal call, a decode step (fewer queries than keys), a
``mask`` that differs between heads or hides keys another way — at once for an eager call, at
:meth:`Recorder.trace` under jit (where the call has already run; nothing of it is recorded). A
``scale`` other than 1/√D is folded into the recorded Q, so the trace's logits are always
``q·k / √D``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from pcast_jax.errors import F32_MAX, F32_TINY, PcastError

__all__ = ["Trace", "StreamedTrace", "Recorder", "RecorderWarning", "load_trace", "save_layers", "TRACE_DIMS",
           "TRACE_DTYPES",
           "LOGIT_MAX", "VALUE_RANGE"]

#: The axes of a trace's ``q``, ``k`` and ``v``.
TRACE_DIMS = ("layer", "sequence", "token", "head", "dim")
_FORMAT = "pcast_jax.trace/1"
#: The format of a trace folder (:meth:`Trace.save_layers`): ``index.npz`` and one ``.npy`` per layer and q/k/v.
_FOLDER_FORMAT = "pcast_jax.trace-layers/1"
_INDEX = "index.npz"
#: What a trace folder stores q, k, v in (read back as float32; bfloat16 as its 16 bits, ``<u2``).
TraceDtype = Literal["float32", "bfloat16", "float16"]
TRACE_DTYPES: tuple[str, ...] = get_args(TraceDtype)
#: Largest logit bound ``√D · max|q| · max|k|`` (≥ every |q·k/√D|) of a layer that is analysed, 2^40. The
#: analysis squares centred logits and sums them over a row's keys: (2·2^40)² · 2^24 keys = 2^106, 2^22
#: below float32's largest value (2^128), and the dot products' partial sums stay under √D · 2^40.
LOGIT_MAX = 2.0**40
#: Range of a layer's largest |v| that is analysed, [2^-32, 2^40]. The MSEs square outputs (convex
#: combinations of V rows) and sum them over rows and dims: (2·2^40)² · 2^36 = 2^118 stays finite, and
#: 2^-64 squares leave the relative errors' squares (~2^-104) above float32's smallest normal (2^-126).
VALUE_RANGE = (2.0**-32, 2.0**40)


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Post-RoPE attention inputs of every layer of causal self-attention.

    Attributes:
      q: ``[L, B, T, Hq, D]`` float32 queries (logits are ``q·k / √D``).
      k, v: ``[L, B, T, Hkv, D]`` float32; query head ``h`` reads KV head ``h // (Hq / Hkv)``.
      lengths: ``[B]`` real tokens of each sequence (right padding beyond).
      layers: ``L`` layer names.
      tokens: optional ``[B, T]`` token ids (what an end-to-end comparison runs the model on).
      local_window_size: ``[L]`` each layer's local window: query ``i`` sees keys ``i − w … i``
        (−1: none, full causal attention); None reads as every layer without one.
      sinks: optional ``[L, Hq]`` learned sink logits (gpt-oss ``sinks``: a softmax column with no
        key) of each layer and query head; −inf: the layer has none. None: no layer has any.
      logits_soft_cap: optional ``[L]`` each layer's logit soft cap (the logits are
        ``cap·tanh(logits/cap)``; 0: none). None: no layer has one.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    lengths: np.ndarray
    layers: tuple[str, ...]
    tokens: np.ndarray | None = None
    local_window_size: np.ndarray | None = None
    sinks: np.ndarray | None = None
    logits_soft_cap: np.ndarray | None = None

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

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[3]

    @property
    def num_tokens(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[4]

    def layer(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of layer ``index``, ``[B, T, H, D]`` float32 each (what the analysis reads, layer by layer)."""
        return self.q[index], self.k[index], self.v[index]

    def save_layers(self, folder, *, dtype: TraceDtype = "float32") -> Path:
        """Write the trace as a folder the analysis streams, one layer at a time (:class:`StreamedTrace`):
        ``index.npz`` (lengths, layer names, the layers' parameters, tokens) and per layer one ``.npy`` of
        ``[B, T, H, D]`` each for q, k, v in ``dtype`` (:data:`TRACE_DTYPES`; bfloat16 as its 16 bits).
        The folder is written as a set (all files or none); returns it."""
        return _save_layers(self, folder, dtype)

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
                  "v": self.v, "lengths": self.lengths, "layers": np.array(self.layers),
                  "local_window_size": self.local_window_size}
        if self.tokens is not None:
            arrays["tokens"] = self.tokens
        if self.sinks is not None:
            arrays["sinks"] = self.sinks
        if self.logits_soft_cap is not None:
            arrays["logits_soft_cap"] = self.logits_soft_cap
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
    _check_working_range(q, k, v, trace.layers, where)
    _check_fields(trace, q.shape, where)


def _check_fields(trace, shape: tuple[int, ...], where: str) -> None:
    """Every field of a trace but q, k, v, against its ``[L, B, T, Hq, D]`` shape; a PcastError naming the field."""
    lengths = np.asarray(trace.lengths)
    if lengths.shape != (shape[1],) or not np.issubdtype(lengths.dtype, np.integer) \
            or lengths.min() < 2 or lengths.max() > shape[2]:
        raise PcastError(f"{where}: field 'lengths' must be {shape[1]} integers in [2, {shape[2]}], "
                         f"got {lengths.dtype} {lengths.tolist()}")
    object.__setattr__(trace, "lengths", lengths.astype(np.int64))
    layers = tuple(str(x) for x in np.asarray(trace.layers).reshape(-1))
    if len(layers) != shape[0] or len(set(layers)) != len(layers):
        raise PcastError(f"{where}: field 'layers' must hold {shape[0]} distinct names, got {list(layers)}")
    object.__setattr__(trace, "layers", layers)
    if trace.tokens is not None:
        tokens = np.asarray(trace.tokens)
        if tokens.shape != shape[1:3] or not np.issubdtype(tokens.dtype, np.integer):
            raise PcastError(f"{where}: field 'tokens' must be integers of shape {shape[1:3]}, "
                             f"got {tokens.dtype} {tokens.shape}")
        object.__setattr__(trace, "tokens", tokens)
    windows = np.full(shape[0], -1, np.int64) if trace.local_window_size is None \
        else np.asarray(trace.local_window_size)
    if windows.shape != (shape[0],) or not np.issubdtype(windows.dtype, np.integer) or windows.min() < -1:
        raise PcastError(f"{where}: field 'local_window_size' must be {shape[0]} integers >= -1 (one per "
                         f"layer; -1: no window), got {windows.dtype} {windows.shape}")
    object.__setattr__(trace, "local_window_size", windows.astype(np.int64))
    if trace.sinks is not None:
        sinks = np.asarray(trace.sinks)
        if sinks.shape != (shape[0], shape[3]) or not np.issubdtype(sinks.dtype, np.floating) \
                or np.isnan(sinks).any() or np.isposinf(sinks).any():
            raise PcastError(f"{where}: field 'sinks' must be {shape[0]}×{shape[3]} learned sink logits (one per "
                             f"layer and query head; -inf: none), got {sinks.dtype} {sinks.shape}")
        if (np.abs(sinks[np.isfinite(sinks)]) > LOGIT_MAX).any():
            raise PcastError(f"{where}: field 'sinks' holds |sink logit| up to "
                             f"{np.abs(sinks[np.isfinite(sinks)]).max():.3g}; at most 2^40 = {LOGIT_MAX:.3g} is "
                             "analysed in float32 (like the logits q·k/√D)")
        object.__setattr__(trace, "sinks", sinks.astype(np.float32))
    if trace.logits_soft_cap is not None:
        caps = np.asarray(trace.logits_soft_cap)
        if caps.shape != (shape[0],) or not np.issubdtype(caps.dtype, np.floating) or not np.all(np.isfinite(caps)) \
                or caps.min() < 0:
            raise PcastError(f"{where}: field 'logits_soft_cap' must be {shape[0]} finite numbers >= 0 (one per "
                             f"layer; 0: none), got {caps.dtype} {caps.shape}")
        odd = caps[(caps != 0) & ((caps < F32_TINY) | (caps > F32_MAX))]  # 0 or inf in float32: not the cap
        if odd.size:
            raise PcastError(f"{where}: field 'logits_soft_cap' holds {float(odd[0])!r}; a cap must lie in "
                             f"[{F32_TINY:.4g}, {F32_MAX:.4g}] (a normal float32; 0: none)")
        object.__setattr__(trace, "logits_soft_cap", caps.astype(np.float32))


def _check_working_range(q, k, v, layers, where: str) -> None:
    """Each layer's logits and values inside float32's working range (:data:`LOGIT_MAX`, :data:`VALUE_RANGE`),
    checked on per-layer maxima (O(size), no T×T array); a PcastError naming the field and the layer."""
    names = [str(x) for x in np.asarray(layers).reshape(-1)]
    q_max, k_max, v_max = (np.abs(x).max(axis=(1, 2, 3, 4)).astype(np.float64) for x in (q, k, v))
    bound = math.sqrt(q.shape[4]) * q_max * k_max
    for i in range(q.shape[0]):
        label = repr(names[i]) if i < len(names) else str(i)
        if bound[i] > LOGIT_MAX:
            raise PcastError(f"{where}: fields 'q' and 'k' of layer {label} give logits up to {bound[i]:.3g} "
                             f"(√D·max|q|·max|k|, max|q| = {q_max[i]:.3g}, max|k| = {k_max[i]:.3g}); at most "
                             f"2^40 = {LOGIT_MAX:.3g} is analysed in float32 (it squares logits)")
        if not VALUE_RANGE[0] <= v_max[i] <= VALUE_RANGE[1]:
            raise PcastError(f"{where}: field 'v' of layer {label} has largest |v| = {v_max[i]:.3g}; it must lie in "
                             f"[2^-32, 2^40] = [{VALUE_RANGE[0]:.3g}, {VALUE_RANGE[1]:.3g}] for the MSEs "
                             "(squares of outputs) to stay finite and nonzero in float32")


def load_trace(path) -> Trace | StreamedTrace:
    """Read a trace written by :meth:`Trace.save` (an ``.npz`` file, read whole: a :class:`Trace`) or by
    :meth:`Trace.save_layers` (a folder, read one layer at a time as the analysis asks: a
    :class:`StreamedTrace`); a damaged file raises a PcastError naming it and the field."""
    from pcast_jax import fileio
    from pcast_jax.sweep.plan import default_budget

    path = Path(path)
    if path.is_dir():
        return _load_folder(path)
    # bounded: the file, each member's declared size and each header are checked before anything is
    # inflated (a truncated zip, a pickle, a pipe or a huge declared shape is one line naming the file)
    fields = fileio.load_npz(path, what=f"trace file {path}", max_bytes=default_budget())
    for name in ("format", "q", "k", "v", "lengths", "layers"):
        if name not in fields:
            raise PcastError(f"trace file {path}: field {name!r} is missing (write traces with Trace.save)")
    if str(fields["format"]) != _FORMAT:
        raise PcastError(f"trace file {path}: field 'format' is {str(fields['format'])!r}, expected {_FORMAT!r}")
    if "dims" in fields and (fields["dims"].ndim != 1 or tuple(str(x) for x in fields["dims"]) != TRACE_DIMS):
        raise PcastError(f"trace file {path}: field 'dims' is {fields['dims'].tolist()}, expected {list(TRACE_DIMS)}")
    trace = Trace.__new__(Trace)
    for name in ("q", "k", "v", "lengths", "layers"):
        object.__setattr__(trace, name, fields[name])
    object.__setattr__(trace, "tokens", fields.get("tokens"))
    object.__setattr__(trace, "local_window_size", fields.get("local_window_size"))
    object.__setattr__(trace, "sinks", fields.get("sinks"))
    object.__setattr__(trace, "logits_soft_cap", fields.get("logits_soft_cap"))
    _check_trace(trace, f"trace file {path}")
    return trace


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StreamedTrace:
    """A trace folder (:meth:`Trace.save_layers`) read one layer at a time: the fields of :class:`Trace` but
    q, k, v, which :meth:`layer` maps from the layer's files (read-only memory maps) into float32.

    Attributes:
      folder: the trace folder.
      dtype: what q, k, v are stored in (:data:`TRACE_DTYPES`).
      shape: ``(L, B, T, Hq, Hkv, D)``.
      lengths, layers, tokens, local_window_size, sinks, logits_soft_cap: as :class:`Trace` has them.
    """

    folder: Path
    dtype: TraceDtype
    shape: tuple[int, int, int, int, int, int]
    lengths: np.ndarray
    layers: tuple[str, ...]
    tokens: np.ndarray | None = None
    local_window_size: np.ndarray | None = None
    sinks: np.ndarray | None = None
    logits_soft_cap: np.ndarray | None = None

    def __post_init__(self):
        where = f"trace folder {self.folder}"
        if self.dtype not in TRACE_DTYPES:
            raise PcastError(f"{where}: field 'dtype' is {self.dtype!r}; one of {list(TRACE_DTYPES)}")
        layers, seqs, tokens, heads, kv_heads, dim = self.shape
        if min(self.shape) < 1 or tokens < 2 or heads % kv_heads:
            raise PcastError(f"{where}: field 'shape' {list(self.shape)} (layers, sequences, tokens, heads, KV "
                             "heads, dim) needs at least one of each, 2 tokens, query heads a multiple of KV heads")
        _check_fields(self, (layers, seqs, tokens, heads, dim), where)
        for i in range(layers):  # every file's header and size, before any analysis runs (nothing is read)
            for name in ("q", "k", "v"):
                self._map(i, name)

    num_layers = property(lambda self: self.shape[0])
    num_sequences = property(lambda self: self.shape[1])
    num_tokens = property(lambda self: self.shape[2])
    num_heads = property(lambda self: self.shape[3])
    num_kv_heads = property(lambda self: self.shape[4])
    head_dim = property(lambda self: self.shape[5])

    def _map(self, index: int, name: str) -> np.ndarray:
        from pcast_jax import fileio

        layers, seqs, tokens, heads, kv_heads, dim = self.shape
        path = self.folder / _layer_file(index, name)
        return fileio.map_npy(path, what=f"trace file {path}", shape=(seqs, tokens, heads if name == "q" else kv_heads,
                                                                       dim), dtype=_STORED[self.dtype])

    def layer(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of layer ``index``, ``[B, T, H, D]`` float32 each, read from its files now (nothing of
        another layer is held); a non-finite value or one outside float32's working range is refused naming
        the file."""
        out = []
        for name in ("q", "k", "v"):
            stored = self._map(index, name)
            if self.dtype == "bfloat16":
                stored = stored.view(_bfloat16())
            out.append(np.asarray(stored, np.float32))
            del stored  # the map is released: only the float32 copy stays
            if not np.all(np.isfinite(out[-1])):
                raise PcastError(f"trace file {self.folder / _layer_file(index, name)}: holds a non-finite value")
        _check_working_range(*(x[None] for x in out), [self.layers[index]], f"trace folder {self.folder}")
        return tuple(out)


#: The NumPy dtype each of :data:`TRACE_DTYPES` is stored as.
_STORED = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _layer_file(index: int, name: str) -> str:
    return f"layer{index:05d}_{name}.npy"


def _save_layers(trace, folder, dtype: str) -> Path:
    """:meth:`Trace.save_layers`: :func:`save_layers` of the trace's own layers."""
    return save_layers(folder, trace.layer, shape=(*trace.q.shape[:4], trace.k.shape[3], trace.q.shape[4]),
                       lengths=trace.lengths, layers=trace.layers, dtype=dtype, tokens=trace.tokens,
                       local_window_size=trace.local_window_size, sinks=trace.sinks,
                       logits_soft_cap=trace.logits_soft_cap)


def save_layers(folder, layer, *, shape: tuple[int, ...], lengths, layers, dtype: TraceDtype = "float32",
                tokens=None, local_window_size=None, sinks=None, logits_soft_cap=None) -> Path:
    """Write a trace folder (:meth:`Trace.save_layers`) one layer at a time: ``layer(i)`` returns layer ``i``'s
    ``(q, k, v)``, ``[B, T, Hq, D]`` and ``[B, T, Hkv, D]`` floats, called once per layer in order, so a trace
    larger than memory can be written. ``shape``: ``(L, B, T, Hq, Hkv, D)``; the other fields as
    :class:`Trace` has them (checked as it checks them). Written as a set (all files or none); returns the
    folder, which :func:`load_trace` reads as a :class:`StreamedTrace`."""
    from pcast_jax import fileio

    if dtype not in TRACE_DTYPES:
        raise PcastError(f"dtype={dtype!r} must be one of {list(TRACE_DTYPES)}")
    shape = tuple(int(x) for x in shape)
    if len(shape) != 6 or min(shape) < 1 or shape[2] < 2 or shape[3] % shape[4]:
        raise PcastError(f"shape={list(shape)} must be (layers, sequences, tokens, heads, KV heads, dim), each >= 1, "
                         "2 tokens or more, query heads a multiple of KV heads")
    meta = types.SimpleNamespace(lengths=lengths, layers=layers, tokens=tokens, local_window_size=local_window_size,
                                 sinks=sinks, logits_soft_cap=logits_soft_cap)
    _check_fields(meta, (*shape[:4], shape[5]), "save_layers")
    index = {"format": np.array(_FOLDER_FORMAT), "dims": np.array(TRACE_DIMS), "dtype": np.array(dtype),
             "shape": np.array(shape, np.int64), "lengths": meta.lengths, "layers": np.array(meta.layers),
             "local_window_size": meta.local_window_size}
    for name in ("tokens", "sinks", "logits_soft_cap"):
        if getattr(meta, name) is not None:
            index[name] = getattr(meta, name)

    def stored(x, name: str, label: str, want: tuple) -> np.ndarray:
        x = np.asarray(x)
        if x.shape != want or not np.issubdtype(x.dtype, np.floating):
            raise PcastError(f"save_layers: field {name!r} of layer {label!r} must be floats of shape {want}, got "
                             f"{x.dtype} {x.shape}")
        x = x.astype(np.float32, copy=False)
        if not np.all(np.isfinite(x)):
            raise PcastError(f"save_layers: field {name!r} of layer {label!r} holds a non-finite value")
        if dtype == "float32":
            return x
        with np.errstate(over="ignore"):  # refused below, naming the field
            cast = x.astype(_bfloat16() if dtype == "bfloat16" else np.float16)
        if not np.all(np.isfinite(cast)):
            raise PcastError(f"dtype={dtype!r}: field {name!r} of layer {label!r} holds a value beyond {dtype}'s "
                             f"largest ({float(np.abs(x).max()):.3g}); save it as float32")
        return cast.view(np.uint16) if dtype == "bfloat16" else cast

    def write(staging: Path) -> None:
        layers_, seqs, tokens_, heads, kv_heads, dim = shape
        for i in range(layers_):
            arrays = layer(i)
            label = meta.layers[i]
            for name, x in zip(("q", "k", "v"), arrays):
                want = (seqs, tokens_, heads if name == "q" else kv_heads, dim)
                np.save(staging / _layer_file(i, name), stored(x, name, label, want))
            del arrays
        np.savez(staging / _INDEX, **index)

    return fileio.write_set(folder, write, what="folder")


def _load_folder(folder: Path) -> StreamedTrace:
    """A trace folder's index read and checked, every layer file's header checked (:class:`StreamedTrace`)."""
    from pcast_jax import fileio

    where = f"trace folder {folder}"
    path = folder / _INDEX
    if not path.is_file():
        raise PcastError(f"{where} has no {_INDEX} (a folder is read as a trace written by Trace.save_layers)")
    fields = fileio.load_npz(path, what=f"trace file {path}", max_bytes=_INDEX_BYTES)
    for name in ("format", "dtype", "shape", "lengths", "layers"):
        if name not in fields:
            raise PcastError(f"trace file {path}: field {name!r} is missing (write trace folders with "
                             "Trace.save_layers)")
    if str(fields["format"]) != _FOLDER_FORMAT:
        raise PcastError(f"trace file {path}: field 'format' is {str(fields['format'])!r}, expected {_FOLDER_FORMAT!r}")
    if "dims" in fields and (fields["dims"].ndim != 1 or tuple(str(x) for x in fields["dims"]) != TRACE_DIMS):
        raise PcastError(f"trace file {path}: field 'dims' is {fields['dims'].tolist()}, expected {list(TRACE_DIMS)}")
    shape = fields["shape"]
    if shape.shape != (6,) or not np.issubdtype(shape.dtype, np.integer) or shape.min() < 1 or shape.max() > 2**31:
        raise PcastError(f"trace file {path}: field 'shape' must be 6 positive integers (layers, sequences, tokens, "
                         f"heads, KV heads, dim), got {shape.dtype} {shape.tolist()}")
    return StreamedTrace(folder=folder, dtype=str(fields["dtype"]), shape=tuple(int(x) for x in shape),
                         lengths=fields["lengths"], layers=fields["layers"], tokens=fields.get("tokens"),
                         local_window_size=fields.get("local_window_size"), sinks=fields.get("sinks"),
                         logits_soft_cap=fields.get("logits_soft_cap"))


#: Largest index file of a trace folder read (its tokens are the largest field: 2^24 of them in int64).
_INDEX_BYTES = 2**27


class RecorderWarning(UserWarning):
    """Calls of the drop-in that the recorder names by call order may not be one forward pass."""


class Recorder:
    """Records the Q/K/V of every attention call made through it (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict = {}      # layer key -> list of (q, k, v, lengths, windows) numpy, batched
        self._order: list = []        # layer keys in first-seen order
        self._refused: dict = {}      # layer key -> why a call under jit could not be recorded
        self._made = 0                # attention_fn layers handed out
        self._names: set = set()      # attention_fn layer names handed out
        self._calls = 0               # dot_product_attention layers named by call order
        self._callers: dict = {}      # drop-in caller (object or code site) -> (layer name, the object)
        self._per_class: dict = {}    # class name -> objects named after it
        self._warned = False          # the RecorderWarning was given
        self._hooks: dict = {}

    # -- the three entry points ------------------------------------------------------------

    def dot_product_attention(self, query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                              config=None, logits_soft_cap=None, name: str | None = None, **kwargs):
        """:func:`pcast_jax.dot_product_attention` (same arguments) that records its inputs once the
        call has run (a call it refuses records nothing); ``name`` names the layer (calls with the same
        name add sequences to it; default: the model's layer that made the call, module docstring)."""
        from pcast_jax import nn

        if name is not None and (not isinstance(name, str) or not name or name in self._names):
            raise PcastError(f"Recorder.dot_product_attention: name={name!r} " + (
                "is a layer of this recorder's attention_fn (two layers would merge into one)"
                if name in self._names else "must be a non-empty string"))
        causal = is_causal or _config_causal(config)
        _check_recordable("this call" if name is None else name, query, key, bias=bias, causal=causal, mask=mask)
        out = nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                       query_seq_lengths=query_seq_lengths,
                                       key_value_seq_lengths=key_value_seq_lengths,
                                       local_window_size=local_window_size, config=config,
                                       logits_soft_cap=logits_soft_cap, **kwargs)
        layer, undo = (name, None) if name is not None else self._caller_layer(
            sys._getframe(1), eager=not isinstance(query, jax.core.Tracer))
        try:
            self._record(layer, query, key, value, scale=scale, causal=causal, mask=mask,
                         query_lengths=query_seq_lengths, key_lengths=key_value_seq_lengths, window=local_window_size,
                         sinks=kwargs.get("sinks"), soft_cap=logits_soft_cap)
        except PcastError:
            if undo is not None:  # a refused call takes no name
                undo()
            raise
        return out

    def _caller_layer(self, frame, *, eager: bool):
        """The drop-in layer of a call made from ``frame`` (module docstring) and how to take it back; the
        warning is for eager calls (a jitted forward replays the names it was traced with)."""
        code, line = frame.f_code, frame.f_lineno
        owner = frame.f_locals.get("self") if code.co_varnames[:1] == ("self",) else None
        key = (id(owner), code, line) if owner is not None else (None, code, line)
        with self._lock:
            if key in self._callers:  # the same layer again: a later batch or forward pass
                return self._callers[key][0], None
            if owner is None:
                layer = f"call{self._calls}"
                self._calls += 1
                same_place = [n for (_, c, ln), (n, obj) in self._callers.items()
                              if obj is None and (c, ln) == (code, line)]
                key = (layer, code, line)  # each call from a plain function is a layer of its own
            else:
                seen = self._per_class.setdefault(type(owner).__name__, [])
                if not any(o is owner for o in seen):
                    seen.append(owner)
                base = f"{type(owner).__name__}{next(i for i, o in enumerate(seen) if o is owner)}"
                sites = sum(1 for (o, _, _), (_, obj) in self._callers.items() if o == id(owner) and obj is owner)
                layer = base if not sites else f"{base}_{sites}"
                while layer in self._names:
                    layer += "_"
                same_place = []
            self._callers[key] = (layer, owner)
        if same_place and eager and not self._warned:
            self._warned = True
            warnings.warn(f"Recorder.dot_product_attention: layers {same_place[0]} and {layer} come from the "
                          f"same place ({code.co_filename}:{line}, a plain function): calls without name= are layers "
                          "in call order, right for one forward pass through a loop of layers but not for a second "
                          "forward pass, whose calls become more layers instead of more sequences; pass name= to say "
                          "which layer a call is", RecorderWarning, stacklevel=3)

        def undo():
            with self._lock:
                if self._callers.get(key, (None,))[0] == layer:
                    del self._callers[key]
                    if owner is None and self._calls == int(layer[4:]) + 1:
                        self._calls -= 1
        return layer, undo

    def attention_fn(self, config=None, *, name: str | None = None, **kwargs):
        """:func:`pcast_jax.nn.attention_fn` (same arguments) that records; one layer per function
        (a ``name`` already handed out is refused: two layers never merge into one)."""
        from pcast_jax import nn

        inner = nn.attention_fn(config, **kwargs)
        with self._lock:
            if name is not None:
                if not isinstance(name, str) or not name or name in self._names:
                    raise PcastError(f"Recorder.attention_fn: name={name!r} " + (
                        "is already a layer of this recorder (two layers would merge into one); give each "
                        "layer its own name" if name in self._names else "must be a non-empty string"))
                layer_name = name
            else:
                while f"layer{self._made}" in self._names:
                    self._made += 1
                layer_name = f"layer{self._made}"
            self._made += 1
            self._names.add(layer_name)
        causal_config = _config_causal(config)

        def fn(query, key, value, bias=None, mask=None, **kw):
            causal = bool(kw.get("is_causal", False)) or causal_config
            bool_mask = None if mask is None else jnp.asarray(mask) != 0  # flax: nonzero = attend
            _check_recordable(layer_name, query, key, bias=bias, causal=causal, mask=mask)
            out = inner(query, key, value, bias, mask, **kw)
            self._record(layer_name, query, key, value, scale=None, causal=causal, mask=bool_mask,
                         soft_cap=kwargs.get("logits_soft_cap"))
            return out

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
            self._refused.clear()
            self._calls = 0
            self._callers.clear()
            self._per_class.clear()
            self._warned = False

    def trace(self, *, tokens=None) -> Trace:
        """The recorded calls as a :class:`Trace`; ``tokens [B, T]`` optionally ride along."""
        jax.effects_barrier()
        with self._lock:
            if self._refused:
                name, why = next(iter(self._refused.items()))
                raise PcastError(f"Recorder.trace: layer {_layer_label(name)} {why} (under jit the call ran; "
                                 "nothing of it was recorded)")
            first_seen = {name: i for i, name in enumerate(self._order)}  # named layers: in the order first seen
            order = sorted(self._order, key=lambda n: (0, n) if isinstance(n, int) else (1, first_seen[n]))
            if not order:
                raise PcastError("Recorder.trace: nothing was recorded (run the model through the recorder's "
                                 "dot_product_attention, attention_fn or hook first)")
            stacked = {}
            for name in order:
                parts = self._entries[name]
                shapes = sorted({p[0].shape[1:] for p in parts})
                if len(shapes) > 1:
                    raise PcastError(f"Recorder.trace: layer {_layer_label(name)} was called with q of shapes "
                                     f"{[list(x) for x in shapes]} (tokens, heads, dim); a trace holds sequences of "
                                     "one padded length per layer (pad the batches alike, or call clear() between)")
                stacked[name] = [np.concatenate([p[i] for p in parts]) for i in range(5)]
                learned = [p[5] for p in parts]
                if any(not np.array_equal(x, learned[0]) for x in learned):
                    raise PcastError(f"Recorder.trace: layer {_layer_label(name)} was called with different learned "
                                     "sinks (argument 'sinks'); a trace records one set per layer")
                stacked[name].append(learned[0])
                caps = sorted({float(p[6]) for p in parts})
                if len(caps) > 1:
                    raise PcastError(f"Recorder.trace: layer {_layer_label(name)} was called with soft caps {caps} "
                                     "(argument 'logits_soft_cap'; 0: none); a trace records one per layer")
                stacked[name].append(caps[0])
        shapes = {name: tuple(x.shape for x in arrays[:3]) for name, arrays in stacked.items()}
        first = order[0]
        lengths = stacked[first][3]
        for name in order:
            if shapes[name] != shapes[first] or not np.array_equal(stacked[name][3], lengths):
                raise PcastError(f"Recorder.trace: layer {_layer_label(name)} recorded q/k/v of shapes "
                                 f"{shapes[name]} and lengths {stacked[name][3].tolist()}, layer "
                                 f"{_layer_label(first)} {shapes[first]} and {lengths.tolist()}; every layer must "
                                 "see the same sequences (record one forward pass, or call clear() between)")
        windows = np.array([_layer_window(_layer_label(name), stacked[name][3], stacked[name][4]) for name in order])
        q, k, v = (np.stack([stacked[name][i] for name in order]) for i in range(3))
        if tokens is not None:
            tokens = np.asarray(tokens)
            tokens = tokens[None] if tokens.ndim == 1 else tokens
        sinks = np.stack([stacked[name][5] for name in order])
        caps = np.array([stacked[name][6] for name in order], np.float32)
        return Trace(q=q, k=k, v=v, lengths=lengths, layers=tuple(_layer_label(n) for n in order), tokens=tokens,
                     local_window_size=windows, sinks=sinks if np.isfinite(sinks).any() else None,
                     logits_soft_cap=caps if caps.any() else None)

    def save_layers(self, folder, *, tokens=None, dtype: TraceDtype = "float32") -> Path:
        """The recorded calls written as a trace folder the analysis streams (:meth:`Trace.save_layers`)."""
        return self.trace(tokens=tokens).save_layers(folder, dtype=dtype)

    # -- recording ---------------------------------------------------------------------------

    def _record(self, name, query, key, value, *, scale, causal: bool, mask=None, query_lengths=None,
                key_lengths=None, window=None, sinks=None, soft_cap=None):
        """Record a call that has run: its Q/K/V and what each query saw, as lengths and a window (and its
        soft cap: a number the call has already checked, in the units of the logits the trace keeps)."""
        from pcast_jax import nn_common

        query, key, value = (jnp.asarray(x) for x in (query, key, value))
        if query.ndim == 3:
            query, key, value = query[None], key[None], value[None]
        head_dim = query.shape[-1]
        if scale is not None:
            query = query * (jnp.asarray(scale, jnp.float32) * math.sqrt(head_dim))
        batch, num_tokens = query.shape[:2]
        heads = 1
        if mask is not None:
            mask = jnp.asarray(mask, bool)
            heads = mask.shape[-3] if mask.ndim >= 3 else 1
        shape = (batch, heads, num_tokens, num_tokens)
        visible = nn_common.visibility(
            shape, None if mask is None else nn_common.broadcast_4d("mask", mask, shape, bool), causal, "top_left",
            nn_common.seq_lengths("query_seq_lengths", query_lengths, batch),
            nn_common.seq_lengths("key_value_seq_lengths", key_lengths, batch), nn_common.local_window(window))
        lengths, windows, code = _visibility_parameters(visible)
        if not any(isinstance(x, jax.core.Tracer) for x in (code, query, key, value)):
            if int(code):
                raise PcastError(f"Recorder: layer {_layer_label(name)} {_REFUSALS[int(code)]}")
        learned = (jnp.full((query.shape[2],), -jnp.inf, jnp.float32) if sinks is None
                   else jnp.asarray(sinks, jnp.float32))
        index = jnp.asarray(0 if isinstance(name, str) else name, jnp.int32)  # a hook's layer may be traced
        # ordered: under the model's vmap over sequences the calls arrive in sequence order (an unordered
        # callback may run the batch's elements in any order, and the trace would pair them with the
        # wrong tokens)
        cap = 0.0 if soft_cap is None else float(np.float32(soft_cap))
        jax.debug.callback(functools.partial(self._store, name if isinstance(name, str) else None, cap), index,
                           query.astype(jnp.float32), key.astype(jnp.float32), value.astype(jnp.float32),
                           lengths, windows, learned, code, ordered=True)

    def _store(self, name, cap, index, q, k, v, lengths, windows, learned, code):
        name = name if name is not None else int(np.asarray(index))
        with self._lock:
            if int(code):
                self._refused.setdefault(name, _REFUSALS[int(code)])
                return
            if name not in self._entries:
                self._entries[name] = []
                self._order.append(name)
            self._entries[name].append((*(np.array(x) for x in (q, k, v, lengths, windows, learned)), cap))


#: Why a call's visibility cannot be recorded, by the code :func:`_visibility_parameters` returns.
_REFUSALS = {
    1: "got a mask that differs between heads; a trace records one visibility per layer (argument 'mask')",
    2: ("lets its queries see keys that causal self-attention over right-padded sequences, within one local "
        "window, does not (arguments 'mask', 'is_causal', 'local_window_size', lengths); the analysis would "
        "see other keys than the layer, so the call is not recorded"),
    3: "has a sequence with fewer than 2 real tokens (arguments 'mask', lengths): nothing to analyse",
}


def _visibility_parameters(visible):
    """``visible [B, N, T, T]`` bool → ``(lengths [B], windows [B], code)``: the real tokens of each sequence,
    the longest reach back of its queries when that is below ``length − 1`` (a binding local window; −1:
    none), and 0 when causal attention over those tokens within that window is exactly ``visible`` on
    every real query row, else the :data:`_REFUSALS` code."""
    same_heads = jnp.all(visible == visible[:, :1])
    vis = visible[:, 0]
    num_tokens = vis.shape[-1]
    idx = jnp.arange(num_tokens)
    lengths = jnp.max(jnp.where(jnp.any(vis, axis=1), idx + 1, 0), axis=-1)                 # [B]
    real_row = idx[None, :] < lengths[:, None]                                              # [B, T]
    reach = jnp.where(jnp.any(vis, axis=-1) & real_row, idx[None, :] - jnp.argmax(vis, axis=-1), 0)
    left = jnp.max(reach, axis=-1)
    windows = jnp.where(left < lengths - 1, left, -1)
    i, j = idx[:, None], idx[None, :]
    w = windows[:, None, None]
    rebuilt = (j <= i) & (j < lengths[:, None, None]) & ((w < 0) | (i - j <= w))
    exact = jnp.all(jnp.where(real_row[:, :, None], vis == rebuilt, True))
    code = jnp.where(~same_heads, 1, jnp.where(~exact, 2, jnp.where(jnp.min(lengths) < 2, 3, 0)))
    return lengths.astype(jnp.int32), windows.astype(jnp.int32), code.astype(jnp.int32)


def _layer_window(label: str, lengths, windows) -> int:
    """One layer's window from its sequences' (each binding window equal; a sequence whose queries all see
    back to key 0 is at most window + 1 long), else a PcastError naming ``local_window_size``."""
    binding = {int(w) for w in windows if w >= 0}
    if len(binding) > 1:
        raise PcastError(f"Recorder.trace: layer {label} was called with local windows {sorted(binding)}; a trace "
                         "records one local_window_size per layer")
    window = binding.pop() if binding else -1
    if window >= 0 and any(w < 0 and n - 1 > window for n, w in zip(lengths, windows)):
        raise PcastError(f"Recorder.trace: layer {label} has a local window of {window} in one call and none in "
                         "another (argument 'local_window_size'); a trace records one per layer")
    return window


def _check_recordable(name, query, key, *, bias, causal: bool, mask) -> None:
    """What the recorder refuses before the call runs: a bias, cross-attention, no causal mask."""
    label = _layer_label(name)
    if bias is not None:
        raise PcastError(f"Recorder: layer {label} got a bias; the analysis sees q·k/√D only, "
                         "so a biased attention cannot be recorded (argument 'bias')")
    if not causal and mask is None:
        raise PcastError(f"Recorder: layer {label} is not causal; the analysis is of causal "
                         "self-attention (pass is_causal=True)")
    if jnp.ndim(query) not in (3, 4) or jnp.ndim(query) != jnp.ndim(key):
        return  # the attention itself refuses these shapes
    if jnp.shape(query)[-3] != jnp.shape(key)[-3]:
        raise PcastError(f"Recorder: layer {label} has {jnp.shape(query)[-3]} queries and {jnp.shape(key)[-3]} "
                         "keys; only self-attention (as many keys as queries, no decode step) is recorded")


def _recording_hook(recorder: Recorder, attention_fn, q, k, v, layer, valid=None, window=None,
                    soft_cap: float = 0.0, sinks=None):
    """The hook :meth:`Recorder.hook` returns: attend, then record ``[T, H, D]`` q/k/v under the layer index,
    with the layer's local window, logit soft cap and learned sinks when the model passes them."""
    from pcast_jax import nn_common

    extra = {name: value for name, value in (("window", window), ("soft_cap", soft_cap), ("sinks", sinks))
             if value is not None and (name != "soft_cap" or value)}
    if attention_fn is None:
        from pcast_jax import nn

        mask = None if valid is None else jnp.asarray(valid, bool)[None, None, :]
        if window is not None:
            mask = nn_common.causal_keys(q.shape[0], valid, window)[None]
        out = nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, logits_soft_cap=soft_cap or None,
                                       sinks=sinks)
    elif valid is None:
        out = attention_fn(q, k, v, layer, **extra)
    else:
        out = attention_fn(q, k, v, layer, valid=valid, **extra)
    mask = None if valid is None else jnp.asarray(valid, bool)[None, None, None, :]
    if window is not None:
        mask = nn_common.causal_keys(q.shape[0], valid, window)[None, None]
    recorder._record(layer, q, k, v, scale=None, causal=True, mask=mask, soft_cap=soft_cap or None, sinks=sinks)
    return out


def _config_causal(config) -> bool:
    if config is None:
        return False
    from pcast_jax.presets import resolve

    return bool(resolve(config).causal)


def _layer_label(name) -> str:
    if isinstance(name, str):
        return name
    try:
        return f"layer{int(np.asarray(name))}"
    except jax.errors.TracerArrayConversionError:
        return "(a hooked layer)"
