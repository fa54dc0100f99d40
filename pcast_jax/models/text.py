"""Deterministic default text: Python standard-library source files, present on every machine."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from pcast_jax.errors import PcastError, check_int

__all__ = ["STDLIB_FILES", "stdlib_source", "stdlib_text_tokens"]

# Concatenated in this order; argparse.py alone holds ~25k tokens.
STDLIB_FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py")


def stdlib_source(name: str = "argparse.py") -> str:
    """Source text of one standard-library module file (e.g. ``"argparse.py"``)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    if not path.is_file():
        raise PcastError(f"name={name!r} is not a file in the standard library ({path.parent})")
    return path.read_text(encoding="utf-8")


def stdlib_text_tokens(tokenizer, n_tokens: int, offset: int = 0) -> np.ndarray:
    """``n_tokens`` token ids of standard-library source, starting ``offset`` tokens in.

    The files in :data:`STDLIB_FILES` are tokenized one by one (each file separately, so the
    result does not depend on how many files are needed) and concatenated. The same Python
    version gives the same tokens on every machine.

    Returns:
        int32 array ``[n_tokens]``.
    """
    n_tokens = check_int("n_tokens", n_tokens, min_value=1)
    offset = check_int("offset", offset, min_value=0)
    need = offset + n_tokens
    ids: list[int] = []
    for name in STDLIB_FILES:
        ids.extend(tokenizer.encode(stdlib_source(name)))
        if len(ids) >= need:
            return np.asarray(ids[offset:need], dtype=np.int32)
    raise PcastError(f"offset + n_tokens = {need} must be <= {len(ids)} (tokens available in "
                     f"{', '.join(STDLIB_FILES)})")
