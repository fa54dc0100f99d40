"""Parameter lists shared by several test modules."""

from __future__ import annotations

import pytest

from pcast_jax.config import KernelConfig


def distinct_configs(configs: dict[str, KernelConfig]) -> list:
    """One ``pytest.param`` per distinct semantics, its id naming every config it stands for.

    Configs are equal when their semantics are (the name is a label), so grouping by the config
    itself leaves one test per behaviour: e.g. ``fwd_s1=hpc_ops_prior``.
    """
    groups: dict[KernelConfig, list[str]] = {}
    for name, cfg in configs.items():
        groups.setdefault(cfg, []).append(name)
    return [pytest.param(cfg, id="=".join(names)) for cfg, names in groups.items()]
