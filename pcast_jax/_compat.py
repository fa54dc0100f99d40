"""Old parameter names and values, kept working for one version with a :class:`DeprecationWarning`.

One idea has one name across the package (``implementation=`` for which code computes attention,
as in :func:`jax.nn.dot_product_attention` and tokamax; ``scale=`` for the logit scale, as in
jax.nn; ``qkv=`` for the Q/K/V format). The names used before keep working until
:data:`REMOVED_IN`, each call warning once per call site.
"""

from __future__ import annotations

import functools
import warnings

from pcast_jax.errors import PcastError, check_choice

__all__ = ["REMOVED_IN", "SIMULATOR_IMPLEMENTATIONS", "deprecated", "deprecation_message", "renamed",
           "simulator_implementation"]

#: The version that drops the old names.
REMOVED_IN = "0.3"

#: What computes the simulated attention: ``"xla"`` (vectorized, the default) or ``"scan"`` (block by block).
SIMULATOR_IMPLEMENTATIONS = ("xla", "scan")


def deprecation_message(old: str, new: str) -> str:
    """``"<old> is deprecated and goes in pcast_jax <version>: use <new>"``."""
    return f"{old} is deprecated and goes in pcast_jax {REMOVED_IN}: use {new}"


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is spelled ``new`` now."""
    warnings.warn(deprecation_message(old, new), DeprecationWarning, stacklevel=stacklevel)


def renamed(**old_to_new: str):
    """Decorator: keyword ``old`` is accepted as ``new`` with a DeprecationWarning; both at once is an error."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise PcastError(f"{fn.__name__}: pass {new}= only ({old}= is its old name)")
                    deprecated(f"{fn.__name__}({old}=...)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapper
    return deco


def simulator_implementation(value, param: str = "implementation") -> str:
    """``"xla"`` or ``"scan"``; the old value ``"fast"`` is ``"xla"`` (with a DeprecationWarning)."""
    if value == "fast":
        deprecated(f"{param}='fast'", f"{param}='xla' (the same vectorized simulator)", stacklevel=4)
        return "xla"
    check_choice(param, value, SIMULATOR_IMPLEMENTATIONS)
    return value
