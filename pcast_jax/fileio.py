"""Atomic file writes: a reader never sees a half-written file, whatever kills the writer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path, writer, *, text: bool = False) -> Path:
    """Call ``writer(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The file gets the usual mode (0666 less the umask) rather than mkstemp's 0600. On any error
    (or KeyboardInterrupt) the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w" if text else "wb", **({"newline": ""} if text else {})) as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
