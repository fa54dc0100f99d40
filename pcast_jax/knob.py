"""How a :class:`~pcast_jax.config.KernelConfig` field is declared, checked and read from text.

A field is declared once, with :func:`knob`: its part of the default name and of the description, its
check, where it acts, what ``to_dict`` writes, the number of the program it is, whether the fingerprint
fits it (or why not: :class:`Unfitted`) and which Pallas kernels refuse which of its values
(:class:`Refusal`); :func:`declared_knobs` collects a dataclass's declarations (:class:`Knob`) and
refuses a field declared amiss. The checks a declaration names (:func:`real_number`, :func:`one_of`,
:func:`ranged_int`, :func:`format_named`) and the reading of one field's value from ``key=value`` text
(:func:`field_types`, :func:`parse_field`) know no field: :mod:`pcast_jax.config` declares the fields
and the rules between them, and re-exports the names its users import from it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from pcast_jax import numberline
from pcast_jax.errors import PcastError, check_choice, check_int

__all__ = ["PALLAS_KERNELS", "Refusal", "Unfitted", "Knob", "knob", "declared_knobs", "real_number", "one_of",
           "ranged_int", "format_named", "field_types", "parse_field"]

#: The Pallas kernels (:mod:`pallas_kernels`) a :class:`Refusal` names.
PALLAS_KERNELS = ("mosaic", "triton")


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Pallas kernels that refuse a field's value: ``when(config)`` true → ``why(config)``, the one-line
    error (it names the field first) that :meth:`KernelConfig.refusal` gives."""

    kernels: tuple[str, ...]
    when: Callable[[Any], Any]  # of a KernelConfig
    why: Callable[[Any], str]


@dataclasses.dataclass(frozen=True, slots=True)
class Unfitted:
    """Why the fingerprint (:mod:`pcast_jax.fingerprint.fit`) does not read a field. ``excluded``: no
    candidate of the fit sets it, so a config that sets it cannot be explained from its outputs."""

    why: str
    excluded: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Knob:
    """One :class:`KernelConfig` field as declared (:func:`knob`); :data:`KNOBS` holds every field's.

    Attributes:
      at: where the field's words sit in :meth:`KernelConfig.default_name` and :meth:`KernelConfig.describe`
        (both list their parts in ``at`` order); None for a field whose words another's part writes.
      words_of: that other field (a field with no words of its own: ``qkv_granularity`` in ``qkv``'s).
      name: its part of the default name: a format of the value (``"b{}"``) written where the field
        differs from its default, or a function of the config ("" for no part).
      says: its phrase in :meth:`KernelConfig.describe`, alike.
      check: validates and returns the field's own value (a :class:`PcastError` naming it); default:
        one of its ``Literal`` type's choices.
      acts: where the field acts; elsewhere it is normalised to its default, so equality is semantic.
      saved: where :meth:`KernelConfig.to_dict` writes it: ``"always"``, ``"set"`` (where it differs from
        its default) or ``"acts"``.
      stand_in: for a number of the program (:meth:`KernelConfig.program`), the value the program holds
        in its place; ``feeds``: the :class:`Numbers` it changes.
      fit: the fingerprint's search group that reads it (:data:`pcast_jax.fingerprint.fit.GROUP_ORDER`),
        or :class:`Unfitted` with why not.
      refused: the Pallas kernels that refuse some of its values (:class:`Refusal`).
    """

    at: int | None = None
    words_of: str | None = None
    name: str | Callable | None = None
    says: str | Callable | None = None
    check: Callable | None = None
    acts: Callable | None = None
    saved: Literal["always", "set", "acts"] = "always"
    stand_in: Callable | None = None
    feeds: tuple[str, ...] = ()
    fit: str | Unfitted
    refused: tuple[Refusal, ...] = ()


def knob(default, *, fit: str | Unfitted, compare: bool = True, **declared) -> Any:
    """A :class:`KernelConfig` field with its :class:`Knob` (``declared``: the Knob's other attributes).

    ``fit`` is required: a field the fingerprint does not read says why (:class:`Unfitted`).
    """
    spec = Knob(fit=fit, **declared)
    if compare and (spec.at is None) == (spec.words_of is None):  # a label (compare=False) has no words
        raise TypeError("a field has its own words (at=...) or is written in another field's (words_of=...)")
    return dataclasses.field(default=default, compare=compare, metadata={"knob": spec})


def real_number(field: str, value, allowed: str) -> float:
    """``value`` as a float when it is a real number (not a bool); PcastError naming ``field`` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PcastError(f"{field}={value!r} must be {allowed}")
    return float(value)


def one_of(field: str, choices) -> Callable:
    """A check that ``value`` is one of ``choices``."""
    def check(value):
        check_choice(field, value, choices)
        return value
    return check


def ranged_int(field: str, lo: int, hi: int = 1 << 16) -> Callable:
    return lambda value: check_int(field, value, min_value=lo, max_value=hi)


def format_named(field: str, choices: tuple[str, ...]) -> Callable:
    """A dtype is stored as its format's name (``jnp.float8_e5m2`` → ``"e5m2"``); names among ``choices``."""
    def check(value):
        value = numberline.format_name(value, param=field, choices=choices)
        check_choice(field, value.lower() if isinstance(value, str) and field == "p_format" else value, choices)
        return value
    return check


def declared_knobs(cls) -> dict[str, Knob]:
    """Field name → :class:`Knob` of dataclass ``cls``, each ``Literal`` field checked against its choices
    where no check is declared; TypeError naming a field declared without :func:`knob` or declared amiss."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Knob] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("knob")
        if not isinstance(spec, Knob):
            raise TypeError(f"{cls.__name__}.{f.name} is declared without knob(...): declare its name part, "
                            "what it saves, its numbers, whether the fingerprint fits it and which kernels refuse it")
        if spec.check is None:
            choices = typing.get_args(hints[f.name])
            if typing.get_origin(hints[f.name]) is not Literal:
                raise TypeError(f"{cls.__name__}.{f.name} needs check=...: only a Literal field is checked by its type")
            spec = dataclasses.replace(spec, check=one_of(f.name, choices))
        if spec.saved == "acts" and spec.acts is None or (spec.stand_in is None) != (not spec.feeds):
            raise TypeError(f"{cls.__name__}.{f.name}: saved='acts' needs acts=...; stand_in and feeds go together")
        out[f.name] = spec
    ats = [s.at for s in out.values() if s.at is not None]
    if len(set(ats)) != len(ats):
        raise TypeError(f"{cls.__name__}: two fields write their words at the same place (at=...)")
    for name, spec in out.items():
        if spec.words_of is not None and out.get(spec.words_of, Knob(fit="")).at is None:
            raise TypeError(f"{cls.__name__}.{name}: words_of={spec.words_of!r} must name a field with words "
                            "of its own")
    return out


def field_types(cls) -> dict[str, type]:
    """Field name → the type its string form is parsed to (the annotation, else the default's type)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: use the defaults
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        if not isinstance(t, type):
            t = type(f.default) if f.default is not dataclasses.MISSING else str
        out[f.name] = t
    return out


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _power(base: float, exp: float, sign: float) -> float:
    """``sign · base^exp`` for a finite base > 0 and a finite exponent; ValueError otherwise."""
    if not (0 < base < math.inf and math.isfinite(exp)):
        raise ValueError("not a power")
    return sign * base**exp


def parse_field(key: str, raw: str, kind: type):
    """One value of :meth:`KernelConfig.from_string`, as ``kind``; PcastError naming ``key``."""
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise PcastError(f"{key}={raw!r} must be true or false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise PcastError(f"{key}={raw!r} must be an integer") from None
    if kind is float:
        text = raw.replace("**", "^").strip()
        sign = -1.0 if text.startswith("-") else 1.0  # -2^2 is -(2^2), as written in mathematics
        base, op, exp = text.lstrip("+-").partition("^")
        try:
            value = float(text) if not op else _power(float(base), float(exp), sign)
        except (ValueError, OverflowError):
            raise PcastError(f"{key}={raw!r} must be a number (e.g. 256, 0.5, 2^8.807; a power's base "
                             "> 0, both finite)") from None
        if not math.isfinite(value):
            raise PcastError(f"{key}={raw!r} must be finite")
        return value
    if kind is str:
        if not raw:
            raise PcastError(f"{key}= needs a value")
        return raw
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise PcastError(f"{key}={raw!r}: {exc}") from None
