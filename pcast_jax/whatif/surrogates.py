"""Surrogates of the FP8 cast: what stands in for line 9 of Algorithm 1 when the MSE is differentiated.

The exact E4M3 cast is piecewise constant, so its gradient is zero almost everywhere. This module
holds the replacements (:class:`Surrogate`): the straight-through estimator (exact forward,
identity backward) and a smooth one built from the cast's expected squared error per element
(:func:`expected_squared_error`: a soft underflow gate at the round-to-zero boundary plus LSB²/12
rounding noise), and :func:`make_cast_fn`, which turns either into a ``cast_fn`` for
:func:`pcast_jax.engine.effective_weights`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pcast_jax import formats
from pcast_jax.errors import PcastError, check_choice, check_positive

__all__ = ["CAST_KINDS", "LSB_MODES", "ATOM_MODES", "PARTS", "Surrogate", "as_surrogate",
           "expected_squared_error", "make_cast_fn"]

CAST_KINDS = ("exact", "ste", "smooth")
LSB_MODES = ("mean", "staircase")
ATOM_MODES = ("exact", "representable")
PARTS = ("total", "collapse", "noise")
_TINY = 1e-30  # keeps √e differentiable where e = 0 (f32 normal, far below any real error²)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Surrogate:
    """How line 9's cast is replaced.

    The kinds:

    * ``"exact"`` — the real E4M3 cast. Piecewise constant: its gradient is useless (zero a.e.),
      only finite differences over many seeds see the slope.
    * ``"ste"`` — straight-through estimator: forward the exact cast, backward identity (zero
      beyond ±max, where the satfinite clip acts).
    * ``"smooth"`` — the cast replaced by its expected squared error per element, x = P·S:
      e(x) = (1 − g(x))·x² + g(x)·(LSB(x)²/12 + relu(x − max)²), with a soft underflow gate
      g = sigmoid((ln x − ln 2^-10)/τ) at the round-to-zero boundary (P = 2^-10/S, Prop. 1) and a
      local LSB that is either smooth in x (``lsb_mode="mean"``: κ·x with κ the binade-averaged
      LSB/x, floored at the subnormal step) or a soft staircase 2^(⌊log2 x⌋_τ − 3)
      (``lsb_mode="staircase"``, which keeps the dp(S) sawtooth of §5). The entries with P = 1
      exactly (the row maximum of a block that set the running max) are atoms, not a continuum:
      ``atoms="exact"`` gives them their exact rounding error (cast(S) − S)², ``"representable"``
      assumes S itself is an E4M3 value (only saturation counts). The engine receives
      y = x − √e(x), so (W − P)² carries exactly e(x) per element.

    Attributes:
      kind: ``"exact"``, ``"ste"`` or ``"smooth"``.
      gate_temperature: τ of the soft underflow gate sigmoid((ln x − ln 2^-10)/τ), in units of
        ln P — i.e. of the scores: the gate smooths the threshold of Eq. (6) over ±τ.
      lsb_mode: ``"mean"`` (LSB ∝ x, no sawtooth) or ``"staircase"`` (soft ⌊log2 x⌋).
      lsb_temperature: width of the soft staircase steps, in binades (staircase only).
      atoms: ``"exact"`` or ``"representable"`` treatment of the P = 1 entries (smooth only).
    """

    kind: str = "smooth"
    gate_temperature: float = 0.2
    lsb_mode: str = "mean"
    lsb_temperature: float = 0.05
    atoms: str = "exact"

    def __post_init__(self):
        check_choice("kind", self.kind, CAST_KINDS)
        check_positive("gate_temperature", self.gate_temperature)
        check_choice("lsb_mode", self.lsb_mode, LSB_MODES)
        check_positive("lsb_temperature", self.lsb_temperature)
        check_choice("atoms", self.atoms, ATOM_MODES)
        if self.gate_temperature > 5 or self.lsb_temperature > 0.5:
            raise PcastError(f"gate_temperature={self.gate_temperature} must be <= 5 and "
                             f"lsb_temperature={self.lsb_temperature} <= 0.5 (a surrogate, not a blur)")

    @property
    def label(self) -> str:
        if self.kind != "smooth":
            return self.kind
        lsb = "mean" if self.lsb_mode == "mean" else f"staircase {self.lsb_temperature:g}"
        return f"smooth(lsb {lsb}, gate {self.gate_temperature:g}, atoms {self.atoms})"


def as_surrogate(surrogate) -> Surrogate:
    """A :class:`Surrogate`, or a kind name (``"exact"``, ``"ste"``, ``"smooth"``) made into one."""
    if isinstance(surrogate, Surrogate):
        return surrogate
    if isinstance(surrogate, str):
        check_choice("surrogate", surrogate, CAST_KINDS)
        return Surrogate(kind=surrogate)
    raise PcastError(f"surrogate={surrogate!r} must be one of {CAST_KINDS} or a Surrogate")


def _soft_floor(y, temperature):
    """⌊y⌋ smoothed over ±temperature around each integer; exact on half-integers, C¹."""
    yy = y - 0.5
    n = jnp.floor(yy)
    r = yy - n  # in [0, 1)
    lo, hi = jax.nn.sigmoid(-0.5 / temperature), jax.nn.sigmoid(0.5 / temperature)
    s = (jax.nn.sigmoid((r - 0.5) / temperature) - lo) / (hi - lo)
    return n + s


def _fmt_consts(fmt):
    f = formats.get_format(fmt)
    emin = round(math.log2(f.smallest_normal))  # −6 for E4M3
    top = math.floor(math.log2(f.max))  # 8 for E4M3: top binade [256, 512) ∩ [0, 448]
    # κ: E[LSB²] = κ² E[x²] for x log-uniform within a binade, E[x²] = 4^n (4 − 1)/ln 4.
    kappa = 2.0 ** -f.mantissa_bits * math.sqrt(math.log(4.0) / 3.0)
    return f, emin, top, kappa


def _block_format(fmt):
    """The block-scaled format ``fmt`` names (MXFP8, MXFP4, NVFP4), or None for an element format."""
    if isinstance(fmt, formats.BlockFormat):
        return fmt
    return formats.BLOCK_FORMATS.get(fmt.lower()) if isinstance(fmt, str) else None


def _blocks(x, bf):
    return formats.split_blocks(x, bf.block, bf.name)


def _block_squared_error(x, sur: Surrogate, bf):
    """(collapse, noise) of a block-scaled cast along the last axis (see :func:`expected_squared_error`)."""
    el = bf.element
    xb = _blocks(x, bf)
    a = jnp.max(xb, axis=-1, keepdims=True)
    sb = jnp.where(a > 0, a, 1.0) / el.max  # the block scale without its rounding
    u = xb / sb
    c_u, n_u = expected_squared_error(u, surrogate=sur, fmt=el)
    if bf.is_mx:
        h = jnp.ones_like(sb)  # an E8M0 scale has no zero
    else:  # the UE4M3 scale rounds to zero below its round-to-zero boundary: the whole block is lost
        h = jax.nn.sigmoid((jnp.log(sb) - math.log(float(bf.scale_fmt.round_to_zero))) / sur.gate_temperature)
    collapse = sb * sb * (c_u + (1.0 - h) * (u * u - c_u))
    noise = h * sb * sb * n_u
    return collapse.reshape(x.shape), noise.reshape(x.shape)


def expected_squared_error(x, *, surrogate: Surrogate | str = "smooth", fmt="e4m3"):
    """(collapse, noise) parts of the smooth surrogate's E[(cast(x) − x)²] for x = P·S ≥ 0.

    collapse = (1 − g)·x² (the values lost to underflow, Prop. 1 smoothed), noise =
    g·(LSB(x)²/12 + relu(x − max)²) (round-to-nearest noise of a value uniform in its cell, and
    the satfinite clip above max). Elementwise; differentiable in x. Atoms (P = 1) are handled by
    :func:`make_cast_fn`, not here.

    A block-scaled ``fmt`` (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``) works along the last axis, in
    blocks of its block size: with a the block's largest x and its scale taken as s = a / max_e
    (without the scale's own rounding; the MX power of two lies within a factor 2 of it), the
    element's parts at u = x/s times s², and for NVFP4 a second gate h = sigmoid((ln s − ln 2^-10)/τ)
    at the UE4M3 scale's round-to-zero boundary: collapse = s²((1 − g)u² + (1 − h)g u²),
    noise = h s² g·LSB(u)²/12.
    """
    sur = as_surrogate(surrogate)
    bf = _block_format(fmt)
    if bf is not None:
        return _block_squared_error(jnp.asarray(x), sur, bf)
    f, emin, top, kappa = _fmt_consts(fmt)
    x = jnp.asarray(x)
    pos = x > 0
    xs = jnp.where(pos, x, 1.0)
    gate = jnp.where(pos, jax.nn.sigmoid((jnp.log(xs) - math.log(f.round_to_zero)) / sur.gate_temperature), 0.0)
    xc = jnp.minimum(xs, f.max)
    if sur.lsb_mode == "mean":
        sub = f.smallest_subnormal
        # soft max(sub, κ x) as a 4-norm: within 10 % of the true LSB² at the normal/subnormal seam
        lsb2 = jnp.sqrt(sub**4 + (kappa * xc) ** 4)
    else:
        expo = jnp.clip(_soft_floor(jnp.log2(xc), sur.lsb_temperature), emin, top)
        lsb2 = jnp.exp2(2.0 * (expo - f.mantissa_bits))
    over = jnp.maximum(x - f.max, 0.0)
    noise = gate * (lsb2 / 12.0 + over * over)
    collapse = (1.0 - gate) * x * x
    return collapse, noise


def make_cast_fn(surrogate: Surrogate | str, scale, *, fmt="e4m3", overflow="satfinite", part="total"):
    """A ``cast_fn`` for :func:`pcast_jax.engine.effective_weights` with P-scale ``scale``.

    The engine is run with S = 1, so ``cast_fn`` receives P itself; it returns what stands in for
    cast(P·S)/S (the P-domain value the kernel multiplies V by). ``scale`` may be traced.

    ``part`` restricts the error to the collapse (underflowed values) or the noise (everything else)
    so that Σ(W − P)² splits as Prop. 3's term plus the quantization floor (exact and smooth kinds).

    A block-scaled ``fmt`` (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``: P's last axis in blocks of the
    format's block size) is cast by :func:`pcast_jax.formats.block_cast` (NVFP4's second level is
    S, as the kernels' row normalization); the straight-through backward is the identity (the
    block scales follow the values, so there is no clip), and the smooth atoms are the entries
    equal to their block's maximum (exact rounding error, either ``atoms`` setting).
    """
    sur = as_surrogate(surrogate)
    check_choice("part", part, PARTS)
    if sur.kind == "ste" and part != "total":
        raise PcastError(f"part={part!r} needs kind 'exact' or 'smooth' (the STE has no split)")
    check_choice("overflow", overflow, formats.OVERFLOW_MODES)
    bf = _block_format(fmt)
    if bf is not None:
        return _block_cast_fn(sur, scale, bf, overflow, part)
    f = formats.get_format(fmt)

    def exact(x):
        return formats.cast(x, f, overflow=overflow)

    def split_exact(x, c):
        if part == "total":
            return c
        lost = (c == 0) & (x > 0)
        return jnp.where(lost, 0.0, x) if part == "collapse" else jnp.where(lost, x, c)

    def fn(p):
        s = jnp.asarray(scale, jnp.float32)
        x = p * s
        if sur.kind == "exact":
            return split_exact(x, exact(x)) / s
        if sur.kind == "ste":
            xc = jnp.clip(x, -f.max, f.max)
            return (xc + jax.lax.stop_gradient(exact(x) - xc)) / s
        collapse, noise = expected_squared_error(x, surrogate=sur, fmt=f)
        err = {"total": collapse + noise, "collapse": collapse, "noise": noise}[part]
        c = jax.lax.stop_gradient(exact(x))
        if sur.atoms == "exact":
            d = c - x
            atom_lost = (c == 0) & (x > 0)
            atom = {"total": d * d, "collapse": jnp.where(atom_lost, x * x, 0.0),
                    "noise": jnp.where(atom_lost, 0.0, d * d)}[part]
        else:
            over = jnp.maximum(x - f.max, 0.0)
            atom = over * over if part != "collapse" else jnp.zeros_like(x)
        err = jnp.where(p == 1.0, atom, err)
        return (x - jnp.sqrt(err + _TINY)) / s

    return fn


def _block_cast_fn(sur: Surrogate, scale, bf, overflow: str, part: str):
    """:func:`make_cast_fn` for a block-scaled format (arguments already checked)."""

    def exact(x):
        return formats.block_cast(x, bf, overflow=overflow)

    def fn(p):
        s = jnp.asarray(scale, jnp.float32)
        x = p * s
        c = exact(x)
        if sur.kind == "exact":
            if part != "total":
                lost = (c == 0) & (x > 0)
                c = jnp.where(lost, 0.0, x) if part == "collapse" else jnp.where(lost, x, c)
            return c / s
        if sur.kind == "ste":
            return (x + jax.lax.stop_gradient(c - x)) / s
        collapse, noise = expected_squared_error(x, surrogate=sur, fmt=bf)
        err = {"total": collapse + noise, "collapse": collapse, "noise": noise}[part]
        c = jax.lax.stop_gradient(c)
        d = c - x
        lost = (c == 0) & (x > 0)
        atom = {"total": d * d, "collapse": jnp.where(lost, x * x, 0.0), "noise": jnp.where(lost, 0.0, d * d)}[part]
        is_max = (x == jnp.repeat(jnp.max(_blocks(x, bf), axis=-1), bf.block, axis=-1)) & (x > 0)
        err = jnp.where(is_max, atom, err)
        return (x - jnp.sqrt(err + _TINY)) / s

    return fn
