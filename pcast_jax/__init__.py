"""pcast_jax: FP8 attention P-cast precision — theory, kernel-faithful simulator, sweeps.

The names a user needs are here; everything else is importable from its submodule::

    import pcast_jax as pj
    cfg = pj.get_preset("fa3")                        # or pj.KernelConfig(order="reverse", ...)
    out = pj.dot_product_attention(q, k, v, is_causal=True, config=cfg)   # jax.nn-style, in a model
    res = pj.attention(scores, v, cfg)                # simulated kernel output and statistics
    result = pj.run_sweep(pj.SweepSpec(deltas=(7.0,), seeds=20), out_dir="sweeps/t2")
    pj.theory.collapse_fraction(7.0, 1.0)             # Eq. (7)
    pj.presets.FAMILIES                               # every kernel preset, by family, citing its source
    pj.jax_fp8.predict(scale_s=1.0, sinks=[6.0])      # what JAX's own FP8 attention does to P

Submodules load on first use, so ``import pcast_jax`` (and the ``pcast`` command line) stays fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the submodule that defines it (a submodule itself when the name is one)
_EXPORTS = {
    "KernelConfig": "pcast_jax.config",
    "PRESETS": "pcast_jax.presets",
    "get_preset": "pcast_jax.presets",
    "preset_for": "pcast_jax.presets",
    "dot_product_attention": "pcast_jax.nn",
    "attention_weights": "pcast_jax.nn",
    "attention": "pcast_jax.engine",
    "attention_qkv": "pcast_jax.engine",
    "reference_attention": "pcast_jax.engine",
    "AttentionResult": "pcast_jax.engine",
    "SinkWorkload": "pcast_jax.workloads",
    "make_instance": "pcast_jax.workloads",
    "SweepSpec": "pcast_jax.sweep",
    "run_sweep": "pcast_jax.sweep",
    "load_result": "pcast_jax.sweep",
    "PcastError": "pcast_jax.errors",
    "block": None,
    "nn": None,
    "formats": None,
    "theory": None,
    "presets": None,
    "jax_fp8": None,
    "analysis": None,
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pcast_jax' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = (importlib.import_module(f"pcast_jax.{name}") if module is None
             else getattr(importlib.import_module(module), name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
