"""Atomic file writes, and bounded reads of every file the project reads.

Writes: a reader never sees a half-written file, whatever kills the writer. Temporary files are
named ``.<name>.<host>.<pid>.<random>.tmp`` beside their target: unique per process and call, and
telling :func:`clean_stale_temps` whose they are, so that leftovers of a killed writer can be
removed without touching the files of a writer that still runs. A folder of files that belong
together (a report) is written as a set by :func:`write_set`: staged whole in such a temporary
folder beside it, then renamed in, so an error while writing leaves the previous set as it was.

Reads (:func:`read_bounded`, :func:`load_json`, :func:`load_toml`, :func:`load_npy`,
:func:`load_npz`): a file is opened only if it is a regular file no larger than its bound, at most
that many bytes are ever read (a file that grows, or a device that never ends, changes nothing),
JSON and TOML are refused past :data:`MAX_DEPTH` levels of nesting before they are parsed, and an
``.npz`` member is refused when its declared size or its array header exceeds the bound, before
anything is inflated or allocated. Every refusal is one :class:`~pcast_jax.errors.PcastError` line
naming the option or file.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np

from pcast_jax.errors import PcastError

__all__ = ["atomic_write", "create_exclusive", "write_set", "temp_prefix", "temp_owner", "clean_stale_temps",
           "STALE_TEMP_S", "check_regular", "read_bounded", "load_json", "parse_json", "load_toml", "load_npy",
           "load_npz", "map_npy", "MAX_TEXT_BYTES", "MAX_TOML_BYTES", "MAX_DEPTH"]

#: Largest JSON file read (spec.json): 4 MiB, thousands of kernels.
MAX_TEXT_BYTES = 4 * 2**20
#: Largest TOML file read (--config-file): 1 MiB, thousands of kernels. Python's TOML reader needs
#: about 400 bytes of memory per byte of deeply nested tables: this keeps it under ~0.5 GB.
MAX_TOML_BYTES = 2**20
#: Deepest nesting accepted in a JSON or TOML file: brackets and braces, and in TOML each dot of a
#: dotted key (the project's own files nest at most 4 levels).
MAX_DEPTH = 16

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
    """Remove temporary files (and :func:`write_set`'s staging folders) in ``folder`` left behind by
    writers that were killed.

    One written on this host by a process that no longer exists is removed at once; any other
    ``.*.tmp`` entry (another host's, or of an older naming) only once it is older than
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
            elif stale and owner is not None and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
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
    except OSError as exc:
        _unlink(tmp)
        if exc.filename is None and exc.errno is not None:  # a failed write names no file: name the target
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
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


def write_set(folder, writer, *, what: str = "--out") -> Path:
    """Write the files ``writer(staging)`` creates in ``staging`` into ``folder``, as a set or not at all.

    ``staging`` is a new temporary folder beside ``folder`` (in its parent, so on the same file
    system). Once ``writer`` has returned, a ``folder`` that does not exist yet is the staging folder
    renamed (one rename: all files or none); into an existing ``folder`` each staged file is renamed
    over its namesake, so files of ``folder`` the set does not hold are kept. Any error while
    writing (a full disk, a refused number) removes the staging folder and leaves ``folder`` as it
    was; an ``OSError`` becomes one :class:`~pcast_jax.errors.PcastError` line naming ``what``, the
    folder and the file.

    Returns:
      ``folder`` as a Path.
    """
    folder = Path(folder)
    parent = folder.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(parent)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=temp_prefix(folder.name), suffix=".tmp"))
    except OSError as exc:
        raise _set_error(what, folder, exc) from None
    moved: list[str] = []
    try:
        writer(staging)
        os.chmod(staging, 0o777 & ~_umask())
        try:
            os.rename(staging, folder)  # a new folder: the whole set at once
            return folder
        except OSError:
            if not folder.is_dir():
                raise
        names = sorted(os.listdir(staging))
        for name in names:  # an existing folder: each file over its namesake
            os.replace(staging / name, folder / name)
            moved.append(name)
        return folder
    except OSError as exc:
        raise _set_error(what, folder, exc, staging, moved) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _set_error(what: str, folder: Path, exc: OSError, staging: Path | None = None, moved=()) -> PcastError:
    name = str(exc.filename or "")
    if staging is not None and name.startswith(str(staging)):
        name = str(folder) + name[len(str(staging)):]  # the file as it would have been named
    where = f" ({name})" if name else ""
    kept = (f"{len(moved)} of its files were replaced ({', '.join(moved)}), the others are as they were" if moved
            else "what it held before is unchanged")
    return PcastError(f"{what}={str(folder)!r} was not written: {exc.strerror or exc}{where}; {kept}")


# --------------------------------------------------------------------------------------------
# Bounded reads
# --------------------------------------------------------------------------------------------


def _size_text(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n} bytes"


def check_regular(path, *, what: str) -> int:
    """The size of regular file ``path``; a directory, device, pipe or missing file is refused in one line.

    The file is opened without blocking (a pipe would wait for a writer forever) and never read.
    """
    with _open_regular(path, what) as f:
        return os.fstat(f.fileno()).st_size


def _open_regular(path, what: str):
    try:  # non-blocking: opening a pipe must not wait for a writer
        f = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb")
    except FileNotFoundError:
        raise PcastError(f"{what} does not exist") from None
    except IsADirectoryError:
        raise PcastError(f"{what} is not a regular file (a directory, device or pipe)") from None
    except OSError as exc:
        raise PcastError(f"{what} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise PcastError(f"{what} is not a regular file (a directory, device or pipe)")
    return f


def read_bounded(path, *, what: str, max_bytes: int) -> bytes:
    """The bytes of regular file ``path``, refused (naming ``what``) when larger than ``max_bytes``.

    A directory, a device (``/dev/zero``), a pipe or a missing file is refused with one line; never
    more than ``max_bytes`` + 1 bytes are read, whatever the file claims or does while it is read.
    Memory follows the file, not the bound: the buffer asked for is the file's size as it is opened
    (and one byte that tells a file that grew), then at most a chunk at a time past it, so a bound of
    gigabytes costs nothing under an address-space limit (``ulimit -v``, RLIMIT_AS) on a small file.
    """
    with _open_regular(path, what) as f:
        st = os.fstat(f.fileno())
        if st.st_size > max_bytes:
            raise PcastError(f"{what} is {_size_text(st.st_size)}; at most {_size_text(max_bytes)} is read")
        try:
            data = _read_upto(f, st.st_size, max_bytes + 1)
        except OSError as exc:
            raise PcastError(f"{what} cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise PcastError(f"{what} grew past {_size_text(max_bytes)} while it was read")
    return data


#: Bytes read at a time past a file's size as it was opened (a file that grows while it is read).
_GROWTH_CHUNK = 1 << 20


def _read_upto(f, size: int, limit: int) -> bytes:
    """At most ``limit`` bytes of file ``f``, whose size was ``size`` when it was opened.

    Python's ``read(n)`` reserves all ``n`` bytes before it reads: the first read asks for the file's
    size and one byte more (which tells a file that grew), and a file that grew is read on a chunk at
    a time up to ``limit``.
    """
    data = f.read(min(size + 1, limit))
    if len(data) <= size or len(data) >= limit:
        return data
    parts = [data]
    total = len(data)
    while total < limit:
        chunk = f.read(min(_GROWTH_CHUNK, limit - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PcastError(f"{what} is not UTF-8 text (a binary file?): byte {exc.start}") from None


def _check_depth(text: str, what: str, *, toml: bool) -> None:
    """Refuse ``text`` nested deeper than :data:`MAX_DEPTH` levels, counted outside strings.

    A level is a bracket or brace, and in TOML also each dot of a dotted key (``a.b.c = 1`` nests
    three tables; Python's TOML reader needs memory quadratic in that depth).
    """
    depth, dots, quote, i, n = 0, 0, "", 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c in "\n,=" and toml:
            dots = 0
        elif c == "." and toml:
            dots += 1
        elif c == "#" and toml:
            j = text.find("\n", i)
            i, dots = (n if j < 0 else j), 0
        if depth + dots > MAX_DEPTH:
            raise PcastError(f"{what} nests deeper than {MAX_DEPTH} levels")
        i += 1


def load_json(path, *, what: str, max_bytes: int = MAX_TEXT_BYTES):
    """The JSON document in ``path``: bounded in size and depth (:func:`read_bounded`), one-line errors."""
    return parse_json(read_bounded(path, what=what, max_bytes=max_bytes), what=what)


def parse_json(data: bytes, *, what: str):
    """The JSON document in ``data`` (read with a bound already), refused past :data:`MAX_DEPTH` levels.

    Damage, an integer of more digits than Python converts, or nesting is one line naming ``what``.
    """
    text = _text(data, what)
    _check_depth(text, what, toml=False)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PcastError(f"{what} is not valid JSON ({' '.join(str(exc).split())})") from None


def load_toml(path, *, what: str, max_bytes: int = MAX_TOML_BYTES) -> dict:
    """The TOML document in ``path``: bounded in size and depth, one-line errors naming ``what``."""
    import tomllib

    text = _text(read_bounded(path, what=what, max_bytes=max_bytes), what)
    _check_depth(text, what, toml=True)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise PcastError(f"{what} is not valid TOML ({exc})") from None


def _read_npy(f, what: str, limit: int) -> np.ndarray:
    """One ``.npy`` array from file object ``f``: its header checked against ``limit`` before any allocation."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = header(f)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise PcastError(f"{what} is not a NumPy array ({exc})") from None
    if dtype.hasobject:
        raise PcastError(f"{what} holds Python objects ({dtype}); only numeric arrays are read")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > limit:
        raise PcastError(f"{what} declares {shape} {dtype} = {_size_text(nbytes)}; at most {_size_text(limit)}")
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise PcastError(f"{what} is truncated ({len(data)} of {nbytes} bytes)")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C").copy()


def load_npy(path, *, what: str, max_bytes: int) -> np.ndarray:
    """The array in ``.npy`` file ``path`` (no pickles), its size and header bounded by ``max_bytes``."""
    return _read_npy(io.BytesIO(read_bounded(path, what=what, max_bytes=max_bytes)), what, max_bytes)


def load_npz(path, *, what: str, max_bytes: int) -> dict[str, np.ndarray]:
    """Every array of ``.npz`` file ``path``, never inflating more than ``max_bytes`` in all.

    The file's size, each member's declared size and each array header are checked against the
    bound before anything is decompressed or allocated (zip bombs and lying headers are refused).
    """
    raw = read_bounded(path, what=what, max_bytes=max_bytes)
    out, total = {}, 0
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
            declared = sum(i.file_size for i in infos)
            if declared > max_bytes:
                raise PcastError(f"{what} inflates to {_size_text(declared)}; at most {_size_text(max_bytes)}")
            for info in infos:
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                with zf.open(info) as f:
                    arr = _read_npy(f, f"{what} entry {name!r}", min(info.file_size, max_bytes - total))
                total += arr.nbytes
                out[name] = arr
    except PcastError:
        raise  # already one line naming the entry
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
            zlib.error, struct.error) as exc:
        raise PcastError(f"{what} is not a readable .npz ({type(exc).__name__}: {exc})") from None
    return out


def map_npy(path, *, what: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """The array of ``.npy`` file ``path`` memory-mapped read-only (nothing read but its header).

    The file must be a regular file holding exactly a C-ordered ``shape`` array of ``dtype``: the header is
    checked, and the file's size against it, before the map is made; anything else is one line naming ``what``.
    """
    dtype = np.dtype(dtype)
    with _open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            got_shape, fortran, got_dtype = header(f)
        except (ValueError, OSError, EOFError, SyntaxError) as exc:
            raise PcastError(f"{what} is not a NumPy array ({exc})") from None
        offset = f.tell()
    if got_dtype != dtype or tuple(got_shape) != tuple(shape) or fortran:
        raise PcastError(f"{what} holds {got_dtype} {tuple(got_shape)}{' (Fortran order)' if fortran else ''}; "
                         f"expected {dtype} {tuple(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if size != offset + nbytes:
        raise PcastError(f"{what} is {_size_text(size)}, not the {_size_text(offset + nbytes)} its header declares")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))
    except (OSError, ValueError) as exc:
        raise PcastError(f"{what} cannot be mapped ({exc})") from None
