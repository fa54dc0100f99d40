"""Every preset through every entry point, under every mask, at every head dim: held to the oracle.

The matrix a user walks, in one place:

* presets: every entry of :data:`pcast_jax.presets.PRESETS` (a preset added there is covered with no
  edit here);
* entry points (:data:`ENTRIES`): the simulator from scores (``engine.attention``, scan and fast),
  from Q/K/V (``engine.attention_qkv``), the drop-in ``dot_product_attention`` with each
  implementation (``xla``, ``scan``, and the Pallas kernels ``triton`` and ``mosaic`` in interpret
  mode), Flax's ``attention_fn`` called as ``nnx.MultiHeadAttention`` calls it, and the model hook
  ``models.FP8Attention``;
* masks (:data:`MASKS`): none, causal T = S, causal T < S (jax.nn's top-left mask), right padding,
  left padding (whose first query rows see nothing), a fully masked row, an additive bias that
  hides keys with ``finfo(float32).min``; every case is grouped-query (2 query heads over 1 KV head);
* head dims 64, 128 and 256.

Without ``PCAST_JAX_TEST_FULL=1`` (``make test``, CI) a preset × entry point computes one call of masks at
one head dim (taken in turn over the presets, so every mask and head dim is computed through every entry
point) and checks every refusal it owes; ``make test-full`` walks the whole cross product. CI runs the matrix
whole under each jax version, the second half of its halved run (``cases.HALF``) one cell further along the
turn, so the two compute two calls per preset × entry point.

Each cell either refuses with a :class:`PcastError` whose message says why (the refusals an entry
point owes are listed in its ``refuses``), or returns a finite output equal to the independent
float64 oracle (``tests/oracle.py``, which imports nothing from the package) within FP32 rounding
plus the slack of values within rounding of a decision point. The expected config is the
documented one: a preset name given to the drop-in paths runs the tile of the head dim
(:func:`pcast_jax.presets.preset_for`); the scores paths run the preset as given.

The inputs make the logits exact in float32 whatever the summation order: Q and K hold multiples of
1/4 in [−1.75, 1.75] (products are multiples of 1/16; sums stay below 2^24 of them), so the only
rounding before the kernel is the one multiply by the softmax scale, which the oracle's inputs
repeat. The largest |Q|, |K|, |V| is 1.75 = 448 · 2^−8, so the kernels' per-tensor E4M3
quantization (descale amax / 448 = 2^−8) is exact too. Two sink keys carry ≈ 12 logits over the
rest (P-collapse territory for a forward S = 1 kernel).

Cost: the XLA compilations of ``docs/guides/performance.md`` (mostly the drop-in at three head dims and
the Pallas kernels in interpret mode, restricted to the masks they take: none and causal T = S).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_gpu, triton_gpu
from pcast_jax import engine, nn
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, preset_for

import oracle
from cases import FULL, HALF, shared_program

HEAD_DIMS = (64, 128, 256)
KERNEL_MODULES = {"triton": triton_gpu, "mosaic": mosaic_gpu}
S = 320  # keys: more than one tile of every preset, a multiple of none but 64, 160 and 320
T_RECT = 64  # query rows of the non-square masks
N_HEADS, KV_HEADS = 2, 1
N_SINKS = 2
F32_MIN = float(np.finfo(np.float32).min)
OUT_RTOL = 3e-6


# --------------------------------------------------------------------------------------------
# Inputs and masks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One mask kind's inputs: (1, T, N, H) queries, (1, S, K, H) keys and values, what is visible."""

    kind: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    visible: np.ndarray  # (T, S) bool, True where a query sees a key
    causal: bool = False  # expressed through is_causal / a causal config
    kv_len: int | None = None  # right padding, expressed through key_value_seq_lengths / valid
    bias: np.ndarray | None = None  # (T, S) additive bias (F32_MIN where hidden), or None
    mask: np.ndarray | None = None  # (T, S) boolean mask argument, or None

    @property
    def t(self) -> int:
        return self.q.shape[1]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1])

    def scores(self) -> np.ndarray:
        """(N, T, S) float32 logits as every implementation computes them: exact Q·K, one rounding by
        the scale, then the bias (one more float32 rounding)."""
        qk = np.einsum("tnh,sh->nts", self.q[0].astype(np.float64), self.k[0, :, 0].astype(np.float64))
        s = qk.astype(np.float32) * np.float32(self.scale)
        if self.bias is not None:
            s = s + self.bias.astype(np.float32)
        return s


def _quarters(rng, shape):
    return (rng.integers(-7, 8, shape) / 4.0).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _qkv(t: int, h: int):
    rng = np.random.default_rng(1000 + h + t)
    sink_dims = round(3.9 * math.sqrt(h))  # ≈ 12 logits of sink advantage at the 1/√H scale
    q = _quarters(rng, (1, t, N_HEADS, h))
    q[..., :sink_dims] = 1.75
    k = _quarters(rng, (1, S, KV_HEADS, h))
    k[:, :, :, :sink_dims] = 0.0
    k[:, :N_SINKS, :, :sink_dims] = 1.75
    v = _quarters(rng, (1, S, KV_HEADS, h))
    v[0, 0, 0, 0] = 1.75  # amax = 448 · 2^-8 in every tensor
    return q, k, v


def _case(kind: str, h: int) -> Case:
    square = kind in ("causal", "right_pad", "left_pad")
    q, k, v = _qkv(S if square else T_RECT, h)
    t = q.shape[1]
    rows, cols = np.arange(t)[:, None], np.arange(S)[None, :]
    tril = cols <= rows  # top-left: jax.nn's causal mask
    if kind == "none":
        return Case(kind, q, k, v, np.ones((t, S), bool))
    if kind in ("causal", "causal_rect"):
        return Case(kind, q, k, v, tril, causal=True)
    if kind == "right_pad":  # a sequence of 250 real tokens in a batch padded to 320
        return Case(kind, q, k, v, tril & (cols < 250), causal=True, kv_len=250)
    if kind == "left_pad":  # 40 padding tokens first: query rows 0..39 see nothing
        keep = np.broadcast_to(cols >= 40, (t, S))
        return Case(kind, q, k, v, tril & keep, causal=True, mask=keep)
    if kind == "masked_row":
        keep = np.ones((t, S), bool)
        keep[3] = False
        return Case(kind, q, k, v, keep, mask=keep)
    if kind == "bias":
        rng = np.random.default_rng(h)
        hidden = rng.random((t, S)) < 0.1
        bias = np.where(hidden, F32_MIN, rng.integers(-4, 5, (t, S)) / 4.0).astype(np.float32)
        return Case(kind, q, k, v, ~hidden, bias=bias)
    raise AssertionError(kind)


MASKS = ("none", "causal", "causal_rect", "right_pad", "left_pad", "masked_row", "bias")


@functools.lru_cache(maxsize=None)
def case(kind: str, h: int) -> Case:
    return _case(kind, h)


@functools.lru_cache(maxsize=None)
def expected(kind: str, h: int, cfg) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's (1, T, N, H) output and slack for ``cfg`` on ``case(kind, h)``: visible keys only."""
    case = _case(kind, h)
    scores = case.scores()
    kw = oracle.config_kwargs(cfg)
    kw["causal"] = False  # the visibility says what is masked
    outs, slacks = [], []
    for n in range(N_HEADS):
        ref = oracle.attention(scores[n], case.v[0, :, 0], visible=case.visible, **kw)
        outs.append(ref.out)
        slacks.append(ref.out_slack)
    return np.stack(outs, 1)[None], np.stack(slacks, 1)[None]


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def _refuse_kernel(backend: str):
    limits = KERNEL_MODULES[backend].check_limits  # the backend owns its limits

    def refuses(cfg, kind: str, h: int) -> str | None:  # in the order the drop-in checks them
        if kind not in ("none", "causal"):
            return "causal_alignment='bottom_right'" if kind == "causal_rect" else "take no"
        why = cfg.refusal(backend)  # what the config's fields declare this kernel refuses
        if why is not None:
            return why.split("=", 1)[0]
        try:  # what the backend says it refuses, by the parameter its message names first
            limits(cfg, q_len=case(kind, h).t, head_dim=h, n_kv=S, num_slots=2)
        except PcastError as exc:
            return str(exc).split("=", 1)[0]
        return None
    return refuses


def _never(cfg, kind, h):
    return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """An entry point: ``run(cfg, cases)`` → (len(cases), T, N, H) outputs computed with ``cfg`` (the preset's
    config at the cases' head dim, :meth:`config`).

    Cases with the same ``key`` go through one call (batched along B), so the mask kinds that differ
    only in data share one compiled program, as a model's batch does.
    """

    name: str
    run: Callable
    kinds: tuple[str, ...] = MASKS  # the masks its arguments can express
    tiled: bool = True  # a preset name gets the head dim's tile (the drop-in paths)
    refuses: Callable = _never
    head_dims: tuple[int, ...] = HEAD_DIMS
    key: Callable = lambda c: c.kind  # noqa: E731
    real_rows_only: bool = False  # query rows past a right-padded length are free (the model hook zeroes them)

    def config(self, name: str, h: int):
        return preset_for(name, h) if self.tiled else PRESETS[name]


# Each entry point is called under jax.jit, as a model calls it, with the config's numbers (S, τ, the V
# channel max: KernelConfig.numbers) as traced arguments of one program per config *program*
# (KernelConfig.program): presets that differ only in their numbers share it, so a cell costs a compile
# only for a program no earlier cell compiled (JAX's persistent cache keeps them across the cells). The
# Pallas kernels take the config as it is (their numbers are constants of the kernel).


def _stack(cases, field: str, default):
    """The cases' ``field`` arrays stacked (B, ...), ``default(case)`` where a case has none; None if none has."""
    if all(getattr(c, field) is None for c in cases):
        return None
    return np.stack([default(c) if getattr(c, field) is None else getattr(c, field) for c in cases])


def _batch_qkv(cases):
    return (np.concatenate([getattr(c, x) for c in cases]) for x in ("q", "k", "v"))


_jit_engine = shared_program(lambda cfg, impl: lambda s, v: engine.attention(s, v, cfg, implementation=impl).out)


def _engine(engine_name: str, fill: float):
    def run(cfg, cases):
        scores = np.stack([np.where(c.visible, c.scores(), fill).astype(np.float32) for c in cases])  # (B, N, T, S)
        v = np.stack([np.repeat(c.v[0].transpose(1, 0, 2), N_HEADS, 0) for c in cases])
        return np.asarray(_jit_engine(cfg, engine_name)(scores, v)).transpose(0, 2, 1, 3)
    return run


_jit_qkv = shared_program(lambda cfg, causal: lambda q, k, v: engine.attention_qkv(
    q, k, v, cfg.replace(causal=causal, name=cfg.name), q_offset=0 if causal else None).out)


def _qkv_entry(cfg, cases):
    (c,) = cases
    q = c.q[0].transpose(1, 0, 2)
    k, v = (np.repeat(x[0].transpose(1, 0, 2), N_HEADS, 0) for x in (c.k, c.v))
    return np.asarray(_jit_qkv(cfg, c.causal)(q, k, v)).transpose(1, 0, 2)[None]


def _drop_in_key(c: Case):
    return (c.t, c.causal, c.kind == "none")


def _drop_in_fn(cfg, implementation: str, causal: bool, given: tuple):
    def f(q, k, v, *arrays):
        return nn.dot_product_attention(q, k, v, is_causal=causal, config=cfg, implementation=implementation,
                                        **dict(zip(given, arrays)))
    return f


_jit_drop_in = shared_program(_drop_in_fn)
_jit_kernel = functools.lru_cache(maxsize=None)(lambda cfg, *static: jax.jit(_drop_in_fn(cfg, *static)))


def _drop_in(implementation: str):
    jitted = _jit_drop_in if implementation in engine.IMPLEMENTATIONS else _jit_kernel

    def run(cfg, cases):
        t = cases[0].t
        arrays = {"bias": _stack(cases, "bias", lambda c: np.zeros((t, S), np.float32)),
                  "mask": _stack(cases, "mask", lambda c: np.ones((t, S), bool)),
                  "key_value_seq_lengths": _stack(cases, "kv_len", lambda c: S)}
        arrays = {k: (x if k == "key_value_seq_lengths" else x[:, None]) for k, x in arrays.items() if x is not None}
        if "key_value_seq_lengths" in arrays:
            arrays["key_value_seq_lengths"] = arrays["key_value_seq_lengths"].astype(np.int32)
        given = tuple(arrays)
        f = jitted(cfg, implementation, cases[0].causal, given)
        return np.asarray(f(*_batch_qkv(cases), *arrays.values()))
    return run


def _flax_fn(cfg, causal: bool, has_bias: bool, has_mask: bool):
    def f(q, k, v, bias, mask):
        return nn.attention_fn(cfg)(q, k, v, bias=bias if has_bias else None, mask=mask if has_mask else None,
                                    dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True, deterministic=True,
                                    dtype=None, precision=None, module=None, is_causal=causal)
    return f


_jit_flax = shared_program(_flax_fn)


def _flax(cfg, cases):
    """As ``flax.nnx.MultiHeadAttention`` calls its ``attention_fn``: a float 0/1 mask, flax's kwargs."""
    t = cases[0].t

    def keep(c):
        m = np.ones((t, S), bool) if c.mask is None else c.mask
        return m & (np.arange(S)[None, :] < (c.kv_len or S))

    has_mask = any(c.mask is not None or c.kv_len is not None for c in cases)
    bias = _stack(cases, "bias", lambda c: np.zeros((t, S), np.float32))
    mask = np.stack([keep(c) for c in cases]).astype(np.float32)[:, None]
    f = _jit_flax(cfg, cases[0].causal, bias is not None, has_mask)
    return np.asarray(f(*_batch_qkv(cases), None if bias is None else bias[:, None], mask))


def _hook_fn(cfg):
    from pcast_jax.models.fp8 import FP8Attention

    return lambda q, k, v, valid: FP8Attention(config=cfg)(q, k, v, valid=valid)


_jit_hook = shared_program(_hook_fn)


def _hook(cfg, cases):
    valid = np.stack([np.arange(S) < (c.kv_len or S) for c in cases])
    return np.asarray(_jit_hook(cfg)(*_batch_qkv(cases), valid))


ENTRIES = (
    Entry("engine.attention[scan]", _engine("scan", F32_MIN), tiled=False, head_dims=(64,), key=lambda c: c.t),
    Entry("engine.attention[xla]", _engine("xla", -np.inf), tiled=False, head_dims=(64,), key=lambda c: c.t),
    Entry("engine.attention_qkv", _qkv_entry, kinds=("none", "causal", "causal_rect"), tiled=False,
          head_dims=(64,)),
    Entry("dot_product_attention[xla]", _drop_in("xla"), key=_drop_in_key),
    Entry("dot_product_attention[scan]", _drop_in("scan"), key=_drop_in_key, head_dims=(64, 128)),
    Entry("nn.attention_fn", _flax, key=_drop_in_key, head_dims=(64, 128)),
    Entry("models.FP8Attention", _hook, kinds=("causal", "right_pad"), key=lambda c: c.t, real_rows_only=True),
    # interpret mode is slow: d = 64 here; tests/test_pallas.py holds both kernels to the oracle at 64 and 128
    Entry("dot_product_attention[triton]", _drop_in("triton"), refuses=_refuse_kernel("triton"), head_dims=(64,)),
    Entry("dot_product_attention[mosaic]", _drop_in("mosaic"), refuses=_refuse_kernel("mosaic"), head_dims=(64,)),
)


def _groups(entry: Entry):
    """The entry's cells, (head dim, [mask kinds of one call]) in order."""
    out: dict = {}
    for h in entry.head_dims:
        for kind in entry.kinds:
            out.setdefault((h, entry.key(case(kind, h))), []).append(kind)
    return [(h, kinds) for (h, _), kinds in out.items()]


@pytest.fixture(autouse=True)
def _release_programs():
    """Each cell compiles its own programs (one preset, one entry): release them after it, so that the
    matrix's thousands of executables never accumulate in one process (see conftest.py)."""
    yield
    jax.clear_caches()


def _cells(entry: Entry, preset: str) -> list[tuple[int, list[str], str | None]]:
    """Every cell of ``entry`` × ``preset``: (head dim, mask kinds of one call, the refusal it owes or None)."""
    out = []
    for h, kinds in _groups(entry):
        cfg = entry.config(preset, h)
        whys = {entry.refuses(cfg, kind, h) for kind in kinds}
        assert len(whys) == 1, f"{entry.name}: one call mixes refused and accepted cases {kinds}"
        out.append((h, kinds, whys.pop()))
    return out


def _planned(entry: Entry, preset: str, full: bool = FULL) -> list[tuple[int, list[str], str | None]]:
    """The cells a run walks for ``entry`` × ``preset``: all of them with ``full``; otherwise every refusal
    (no program is compiled for one) and one of the calls that compute, taken in turn over the presets'
    programs (shifted by the entry, so that a preset meets different masks through different entry points)."""
    cells = _cells(entry, preset)
    computed = [c for c in cells if c[2] is None]
    if full or not computed:
        return cells
    # the second half of a halved run (cases.HALF) computes the next cell: together they compute two
    pick = computed[(_PROGRAM_INDEX[preset] + _ENTRY_INDEX[entry.name] + (HALF == "2")) % len(computed)]
    return [c for c in cells if c[2] is not None or c is pick]


# The turn is taken over the presets' programs (KernelConfig.program), not the presets: presets that share a
# program compute the same cell through an entry point, so they share its compiled program too.
_PROGRAMS = list(dict.fromkeys(cfg.program() for cfg in PRESETS.values()))
_PROGRAM_INDEX = {name: _PROGRAMS.index(cfg.program()) for name, cfg in PRESETS.items()}
_ENTRY_INDEX = {e.name: i for i, e in enumerate(ENTRIES)}


@pytest.mark.every_half
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_preset_through_entry_point_matches_the_oracle_or_is_refused(entry: Entry, preset: str):
    bad = []
    for h, kinds, why in _planned(entry, preset):
        cases = [case(kind, h) for kind in kinds]
        cfg = entry.config(preset, h)
        where = f"{entry.name} × {preset} (B={cfg.block_kv}) × {'+'.join(kinds)} × d={h}"
        try:
            outs = entry.run(cfg, cases)
        except PcastError as exc:
            if why is None or why not in str(exc):
                owed = "" if why is None else f", expected a refusal naming {why!r}"
                bad.append(f"{where}: refused ({exc}){owed}")
            continue
        if why is not None:
            bad.append(f"{where}: ran, but should be refused ({why})")
            continue
        for kind, c, out in zip(kinds, cases, outs):
            here = where.replace("+".join(kinds), kind)
            if not np.all(np.isfinite(out)):
                bad.append(f"{here}: {int(np.sum(~np.isfinite(out)))} non-finite outputs")
                continue
            ref, slack = expected(kind, h, cfg)
            out = out[None]
            if entry.real_rows_only and c.kv_len is not None:
                out, ref, slack = (x[:, :c.kv_len] for x in (out, ref, slack))
            err = np.abs(out.astype(np.float64) - ref) - (OUT_RTOL * np.max(np.abs(ref)) + slack)
            if np.any(err > 0):
                bad.append(f"{here}: {int(np.sum(err > 0))} outputs off the oracle, worst by {np.max(err):.3g}")
    assert not bad, "\n".join(bad)


def test_a_preset_name_runs_the_tile_the_matrix_computes(monkeypatch):
    """The matrix hands each entry point the preset's config at the head dim (:meth:`Entry.config`); given
    the preset's *name*, every tiled entry point must run that same config (the one it binds for the engine,
    engine.bound). Traced, not compiled."""
    from pcast_jax.models.fp8 import FP8Attention

    seen = []
    real = engine.bound
    monkeypatch.setattr(engine, "bound", lambda *a, **kw: seen.append(a[0]) or real(*a, **kw))
    for h in HEAD_DIMS:
        q = jax.ShapeDtypeStruct((1, 4, N_HEADS, h), jnp.float32)
        for name in PRESETS:
            want = preset_for(name, h)
            for call in (lambda q: nn.dot_product_attention(q, q, q, config=name),
                         lambda q: nn.attention_fn(name)(q, q, q)):
                seen.clear()
                jax.eval_shape(call, q)
                assert [c.replace(causal=False, name="") for c in seen] == [want.replace(name="")], (name, h)
            assert FP8Attention.from_preset(name).config_for(h) == want.replace(causal=True), (name, h)


def _computed(entry: Entry, full: bool) -> set[tuple[int, str]]:
    """(head dim, mask) pairs some preset computes through ``entry`` (not refused)."""
    return {(h, kind) for preset in PRESETS for h, kinds, why in _planned(entry, preset, full) if why is None
            for kind in kinds}


def test_the_matrix_covers_every_preset_entry_and_mask():
    """The matrix is built from the registries: a new preset needs no edit here, and every entry point
    is walked under each mask its arguments can express, at each head dim it takes."""
    assert {e.name for e in ENTRIES} >= {"engine.attention[scan]", "engine.attention[xla]", "engine.attention_qkv",
                                         "dot_product_attention[xla]", "dot_product_attention[scan]",
                                         "dot_product_attention[triton]", "dot_product_attention[mosaic]",
                                         "nn.attention_fn", "models.FP8Attention"}
    drop_ins = [e for e in ENTRIES if e.name.startswith(("dot_product_attention", "nn."))]
    assert all(set(e.kinds) == set(MASKS) for e in drop_ins)
    for entry in ENTRIES:  # the subset CI walks computes every mask at every head dim of each entry point
        assert _computed(entry, full=False) == _computed(entry, full=True), entry.name
        assert all(_planned(entry, p, full=False) for p in PRESETS), entry.name  # every preset goes through it
    for kind in MASKS:  # each mask is what it says
        c = case(kind, 64)
        assert c.visible.shape == (c.t, S)
        assert (kind == "left_pad" or kind == "masked_row") == bool(np.any(~c.visible.any(axis=1)))


def test_flax_layer_in_decode_mode_equals_its_causal_forward():
    """nnx.MultiHeadAttention with the FP8 attention_fn, decoding token by token against its cache,
    gives the causal forward of the whole sequence (fa3, whose exponent mode used to give NaN there)."""
    nnx = pytest.importorskip("flax.nnx")
    t, d_model = 12, 64
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=d_model, qkv_features=d_model, decode=False,
                                   attention_fn=nn.attention_fn("fa3"), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(3), (1, t, d_model))
    full = layer(x, mask=nnx.make_causal_mask(jnp.ones((1, t))))
    layer.init_cache((1, t, d_model))
    steps = [layer(x[:, i:i + 1], decode=True) for i in range(t)]
    stepped = jnp.concatenate(steps, axis=1)
    assert bool(jnp.all(jnp.isfinite(stepped)))
    np.testing.assert_allclose(np.asarray(stepped), np.asarray(full), rtol=2e-5, atol=2e-6)


def test_flax_sow_weights_records_the_weights_before_and_after_the_cast():
    nnx = pytest.importorskip("flax.nnx")
    t, d_model = 16, 64
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=d_model, qkv_features=d_model, decode=False,
                                   attention_fn=nn.attention_fn("fwd_s1"), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(4), (1, t, d_model))
    out = layer(x, mask=nnx.make_causal_mask(jnp.ones((1, t))), sow_weights=True)
    state = nnx.state(layer, nnx.Intermediate)
    (probs,) = jax.tree.leaves(state["attention_weights"])
    (kernel,) = jax.tree.leaves(state["attention_weights_kernel"])
    assert probs.shape == kernel.shape == (1, 2, t, t)
    np.testing.assert_allclose(np.asarray(jnp.sum(probs, -1)), 1.0, rtol=1e-6)
    assert bool(jnp.all(jnp.triu(probs[0, 0], 1) == 0)) and bool(jnp.all(jnp.triu(kernel[0, 0], 1) == 0))
    # the kernel's weights are the E4M3-rounded ones: close to P, not equal
    assert 0 < float(jnp.max(jnp.abs(kernel - probs))) < 0.1
    assert out.shape == x.shape
