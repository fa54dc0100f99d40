"""Atomic file writes: a reader never sees a half-written file, whatever kills the writer.

Temporary files are named ``.<name>.<host>.<pid>.<random>.tmp`` beside their target: unique per
process and call, and telling :func:`clean_stale_temps` whose they are, so that leftovers of a
killed writer can be removed without touching the files of a writer that still runs.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from pathlib import Path

__all__ = ["atomic_write", "create_exclusive", "temp_prefix", "temp_owner", "clean_stale_temps",
           "STALE_TEMP_S"]

#: Age (seconds) past which a temporary file whose writer cannot be checked counts as left over.
STALE_TEMP_S = 6 * 3600.0


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname() or "host")[:32] or "host"


def temp_prefix(name: str) -> str:
    """Prefix of this process's temporary files for a target named ``name``."""
    return f".{name}.{_host()}.{os.getpid()}."


def temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of the writer of temporary file ``name``, or None when it is not one of ours."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    parts = name.rsplit(".", 4)  # '.<target>', host, pid, random, 'tmp'
    if len(parts) != 5 or not parts[2].isdigit() or not parts[1]:
        return None
    return parts[1], int(parts[2])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's process) or cannot tell: keep its files
    return True


def clean_stale_temps(folder, *, max_age_s: float = STALE_TEMP_S) -> list[Path]:
    """Remove temporary files in ``folder`` left behind by writers that were killed.

    A file written on this host by a process that no longer exists is removed at once; any other
    ``.*.tmp`` file (another host's, or of an older naming) only once it is older than
    ``max_age_s``, since its writer may still be running. Errors are ignored (best effort).

    Returns:
      The removed paths.
    """
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    host, now = _host(), time.time()
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        owner = temp_owner(entry.name)
        try:
            if owner is not None and owner[0] == host:
                stale = owner[1] != os.getpid() and not _alive(owner[1])
            else:
                stale = now - entry.stat(follow_symlinks=False).st_mtime > max_age_s
            if stale and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _write_temp(path: Path, writer, text: bool) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name), suffix=".tmp")
    try:
        with os.fdopen(fd, "w" if text else "wb", **({"newline": ""} if text else {})) as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(tmp) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def atomic_write(path, writer, *, text: bool = False) -> Path:
    """Call ``writer(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The file gets the usual mode (0666 less the umask) rather than mkstemp's 0600. On any error
    (or KeyboardInterrupt) the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, writer, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return path


def create_exclusive(path, writer, *, text: bool = False) -> Path:
    """Create ``path`` with ``writer(f)``'s content only if it does not exist yet, atomically.

    The content is written to a temporary file first and then hard-linked to ``path``: the link
    fails when ``path`` exists, so of several processes creating the same file exactly one
    succeeds, and a reader never sees it half-written. Nothing is left held when a writer is
    killed (there is no lock). On file systems without hard links the file is created with
    ``O_CREAT | O_EXCL`` and written in place (still exactly one winner).

    Raises:
      FileExistsError: ``path`` already exists (another writer won).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, writer, text)
    try:
        try:
            os.link(tmp, path)
            return path
        except FileExistsError:
            raise
        except OSError:  # no hard links here (some FUSE, SMB mounts): exclusive create instead
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f, open(tmp, "rb") as src:
            f.write(src.read())
            f.flush()
            os.fsync(f.fileno())
        return path
    finally:
        _unlink(tmp)
