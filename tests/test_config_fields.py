"""Each KernelConfig field is declared once (``knob(...)`` in pcast_jax/config.py); what the class derives
from the declarations is checked here against the fields' behaviour, and a field declared without what
the rest of the package needs from it fails here.

A new knob: the field (its ``knob``: name part, description, where it acts, what it saves, its numbers,
whether the fingerprint fits it or why not, which kernels refuse it), ``block.py``, the oracle and its test.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math

import pytest

from pcast_jax import config
from pcast_jax.config import KNOBS, NUMERIC_FIELDS, PALLAS_KERNELS, KernelConfig, Unfitted, knob
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS

fit = importlib.import_module("pcast_jax.fingerprint.fit")  # the package exports fit() under that name

#: The fields that make up a config's semantics (``name`` is a label).
SEMANTIC = [f.name for f in dataclasses.fields(KernelConfig) if f.compare]
#: A few values of every field, the default first: a Literal field's choices, numbers a preset or the
#: fit's grid uses.
VALUES = {
    "block_kv": (64, 32, 128), "causal": (False, True), "scale": (1.0, 2.0, 256.0), "p_format": ("e4m3", "e5m2", "int8",
                                                                                                 "mxfp8"),
    "overflow": ("satfinite", "nan"), "f16_round_keys": (0, 32), "v_channel_max": (0.0, 2.25), "mma_acc_bits": (0, 14),
    "mma_promote_keys": (0, 32, 64), "kv_splits": (1, 2, 8), "rescale_threshold": (0.0, 4.0, 8.0),
    "block_q": (0, 16, 64), "skip_softmax_threshold": (0.0, 0.25, 0.001),
}


def _values(field: str) -> tuple:
    return VALUES[field] if field in VALUES else config.choices(field)


def _variants() -> list[KernelConfig]:
    """The default config with two fields set to each of their values, and every preset with one
    (the combinations that are not valid configs left out)."""
    out = []
    changes = [{f1: v1, f2: v2} for f1, f2 in itertools.combinations(SEMANTIC, 2)
               for v1, v2 in itertools.product(_values(f1), _values(f2))]
    changes = [(KernelConfig(), c) for c in changes]
    changes += [(p, {f: v}) for p in PRESETS.values() for f in SEMANTIC for v in _values(f)]
    for base, change in changes:
        try:
            out.append(dataclasses.replace(base, name="", **change))
        except PcastError:
            pass
    return list(dict.fromkeys(out))


VARIANTS = _variants()


def test_every_field_is_fitted_by_the_fingerprint_or_says_why_not():
    fitted = set(fit.FIELDS)
    for field in SEMANTIC:
        spec = KNOBS[field].fit
        if isinstance(spec, Unfitted):
            assert field not in fitted and len(spec.why) > 20, field
            assert fit.NOT_FITTED[field] == spec.why  # listed in every fingerprint
        else:
            assert spec in fit.GROUP_ORDER, f"{field}: fit={spec!r} is no search group of the fingerprint"
            assert field in fit.GROUPS[spec]
    assert set(fit.FIELDS) | (set(fit.NOT_FITTED) - {"row_sum"}) == set(SEMANTIC)
    assert all(fit.GROUPS[g] for g in fit.GROUP_ORDER), "a search group no field declares"


@pytest.mark.parametrize("group", list(fit.GROUPS))
def test_every_search_group_has_candidates_through_the_defaults(group):
    """Each group's candidates hold the defaults and every choice its Literal fields declare."""
    values = fit.candidate_values(group)
    fields = fit.GROUPS[group]
    assert tuple(getattr(KernelConfig(), f) for f in fields) in values
    for i, field in enumerate(fields):
        if field in VALUES or field in ("p_format",):
            continue
        assert set(config.choices(field)) <= {v[i] for v in values}, field


def test_a_field_declared_without_knob_fails():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Bare:
        order: config.Order = knob("forward", at=0, fit="walk")
        new_knob: int = 0

    with pytest.raises(TypeError, match=r"Bare.new_knob is declared without knob"):
        config.declared_knobs(Bare)
    with pytest.raises(TypeError, match="fit"):  # the fingerprint's answer is required
        knob(0, at=1)
    with pytest.raises(TypeError, match="words"):  # its name part too (or whose part writes it)
        knob(0, fit="walk")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Unchecked:
        n: int = knob(0, at=0, fit=Unfitted("a number nobody checks"))

    with pytest.raises(TypeError, match="needs check"):  # a field that is not a Literal says how it is checked
        config.declared_knobs(Unchecked)


def test_two_configs_with_different_semantics_never_share_a_default_name():
    by_name = {}
    for cfg in VARIANTS:
        assert by_name.setdefault(cfg.name, cfg) == cfg, (cfg.name, cfg, by_name[cfg.name])
    assert len(by_name) > 500


def test_a_field_that_does_not_act_reads_its_default():
    """Where a field's ``acts`` is false, setting it changes nothing: the config equals the default's."""
    checked = 0
    for cfg in VARIANTS:
        for field, spec in KNOBS.items():
            if spec.acts is None or spec.acts(cfg) or field not in VALUES and field not in SEMANTIC:
                continue
            assert getattr(cfg, field) == getattr(KernelConfig(), field), (cfg, field)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("field", SEMANTIC)
def test_the_dict_holds_a_field_where_it_is_saved(field):
    spec = KNOBS[field]
    for cfg in VARIANTS:
        d = cfg.to_dict()
        assert KernelConfig.from_dict(d) == cfg
        default = getattr(cfg, field) == getattr(KernelConfig(), field)
        expect = {"always": True, "set": not default, "acts": bool(spec.acts and spec.acts(cfg))}[spec.saved]
        assert (field in d) == expect, (cfg, field)


@pytest.mark.parametrize("field", SEMANTIC)
def test_a_number_of_the_program_changes_only_its_numbers(field):
    """Two configs that differ in a numeric field share a program and differ in the numbers it feeds;
    two that differ in any other field have different programs."""
    spec = KNOBS[field]
    assert (field in NUMERIC_FIELDS) == (spec.stand_in is not None)
    pairs = 0
    for cfg in VARIANTS:
        for value in _values(field):
            try:
                other = cfg.replace(**{field: value})
            except PcastError:
                continue
            if other == cfg:
                continue
            pairs += 1
            a, b = cfg.numbers(), other.numbers()
            changed = {n for n in a._fields if not (a._asdict()[n] == b._asdict()[n]
                                                      or math.isnan(a._asdict()[n]) and math.isnan(b._asdict()[n]))}
            if field in NUMERIC_FIELDS and bool(getattr(cfg, field)) == bool(value):
                assert cfg.program() == other.program(), (cfg, field, value)
                assert changed and changed <= set(spec.feeds), (cfg, field, value, changed)
            elif field not in NUMERIC_FIELDS:
                assert cfg.program() != other.program(), (cfg, field, value)
        if pairs > 200:
            break
    assert pairs


@pytest.mark.parametrize("kernel", PALLAS_KERNELS)
def test_a_kernel_refusal_names_the_field_that_declares_it(kernel):
    """Each declared refusal names its field (or, for a query tile, what turns it on) first, and a config
    that sets none of them is not refused."""
    refused = 0
    for cfg in VARIANTS:
        why = cfg.refusal(kernel)
        declaring = [f for f, spec in KNOBS.items() for r in spec.refused if kernel in r.kernels and r.when(cfg)]
        assert (why is None) == (not declaring)
        if why is not None:
            refused += 1
            named = why.split("=", 1)[0]
            tile = declaring[0] == "block_q" and named in ("scale_mode", "skip_softmax_threshold")
            assert named == declaring[0] or tile, (cfg, why)
    assert refused
    assert KernelConfig().refusal(kernel) is None


def test_the_oracle_takes_every_field():
    """The independent oracle is written by hand from the paper: a new field reaches it through
    ``oracle.config_kwargs`` or this fails. Q/K/V quantization is the one exception: the oracle takes the
    scores and values the quantized Q/K/V give, so ``qkv`` and ``qkv_granularity`` act before it."""
    import oracle

    assert set(oracle.config_kwargs(KernelConfig())) | {"qkv", "qkv_granularity"} == set(SEMANTIC)


def test_a_presets_name_is_its_key_written_once():
    """The registry names each preset by its key: in the registry and in each family module's dict, and no
    family module writes the name again in its ``PRESETS`` (its only ``name=`` builds derived configs)."""
    import inspect
    import re

    from pcast_jax import presets

    assert all(cfg.name == key for key, cfg in presets.PRESETS.items())
    for family in presets.FAMILIES:
        module = importlib.import_module(f"pcast_jax.presets.{family}")
        assert all(cfg.name == key for key, cfg in module.PRESETS.items()), module.__name__
        written = set(re.findall(r'\bname="(\w+)"', inspect.getsource(module)))
        assert not written & set(module.PRESETS), (module.__name__, written & set(module.PRESETS))
