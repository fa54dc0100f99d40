"""JAX's persistent compilation cache in a per-user folder: :func:`enable`.

A sweep's chunk compiles once per shape (:mod:`pcast_jax.sweep.compute`); with this cache a second
process with the same shapes (``pcast reproduce`` again, a test rerun) loads the compiled program
from disk instead of compiling it. The ``pcast`` command line (and so ``pcast reproduce``) turns it on;
a library call never does, since it is JAX's global state: a script calls :func:`enable` itself::

    from pcast_jax import cache
    cache.enable()          # before the first compile; returns the folder, or None when off

* Folder: ``$XDG_CACHE_HOME/pcast_jax/jax-cache`` (``~/.cache/pcast_jax/jax-cache`` without it).
* ``PCAST_JAX_COMPILATION_CACHE``: ``0`` / ``false`` / ``off`` / ``no`` turns the cache off; a path
  uses that folder; unset, empty, ``1`` / ``true`` / ``on`` / ``yes`` the default folder.
* A folder set already through JAX (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept.
* A folder that cannot be created or written leaves the cache off, silently: a cache is never a
  reason to fail.
* Every entry is verified before it is used (:class:`VerifiedCache`): the project writes each
  compiled program under its own key (JAX's key and a tag) with a SHA-256 of key and content, and
  reads back only an entry whose digest matches. A damaged entry, or one copied from another key or
  another program, is removed and the program compiled and written again: replaced once, never
  trusted, never a warning on every later run. A JAX without the hook this needs runs with the
  cache off.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["ENV_VAR", "default_cache_dir", "enable", "VerifiedCache"]

#: Environment variable that turns the cache off (0) or names its folder.
ENV_VAR = "PCAST_JAX_COMPILATION_CACHE"
_OFF = {"0", "false", "off", "no"}
_ON = {"", "1", "true", "on", "yes"}
#: JAX's own variable for the shortest compile that is cached; where it is set, its value is kept.
_MIN_TIME_VAR = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_state: dict = {}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pcast_jax/jax-cache``, or ``~/.cache/pcast_jax/jax-cache``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pcast_jax" / "jax-cache"


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
        return True
    except (OSError, ValueError):
        return False


def _env_folder(default: str | os.PathLike | None = None) -> Path | None:
    """The folder ``PCAST_JAX_COMPILATION_CACHE`` names; None where it turns the cache off.

    Unset, empty or an "on" value (``1``, ``true``, …) names ``default`` (:func:`default_cache_dir` if None).
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env.lower() in _OFF:
        return None
    if env.lower() in _ON:
        return Path(default) if default is not None else default_cache_dir()
    return Path(env).expanduser()


def enable(enabled: bool | None = None, path: str | os.PathLike | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on (idempotent); return its folder, or None when off.

    This changes JAX's configuration for the whole process (``jax_compilation_cache_dir``, the
    shortest compile that is kept, and a cache that verifies each entry): call it once, first.

    Args:
      enabled: False turns it off for this process; None (default) follows ``PCAST_JAX_COMPILATION_CACHE``.
      path: the folder (default: the variable's path, else :func:`default_cache_dir`).

    Only the first call that finds a usable folder sets it; JAX keeps the folder it starts with.
    Programs that compile in under 0.5 s are not written, unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
    is set (then JAX's value from it is kept).
    """
    named = _env_folder()
    if enabled is False or (enabled is None and named is None):
        if "dir" not in _state:
            _state["off"] = True
        return None
    if "dir" in _state:
        return _state["dir"]
    if _state.get("off") and enabled is None:
        return None
    import jax  # here, not at import: the command line imports this module for its help

    try:
        configured = jax.config.jax_compilation_cache_dir
    except AttributeError:  # a JAX without the option: no cache
        return None
    if configured:  # the user set it through JAX: keep it
        _state["dir"] = Path(configured)
        return _state["dir"]
    folder = Path(path).expanduser() if path is not None else (named or default_cache_dir())
    if not _writable(folder) or not _verify_entries():
        return None
    try:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        if _MIN_TIME_VAR not in os.environ:  # set through JAX's own variable: keep it
            # the compiled chunks take seconds; tiny helper programs are not worth a file each
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # noqa: BLE001 - a cache is never a reason to fail
        return None
    _state.pop("off", None)
    _state["dir"] = folder
    return folder


#: Start of every entry the project writes; the SHA-256 of key and content follows, then the content.
_MAGIC = b"pcast_jax compiled program v1\n"
#: Appended to JAX's key: the project's entries never share a name with another program's.
_KEY_TAG = "-pcast1"


class VerifiedCache:
    """JAX's cache interface (``get``, ``put``) over its file cache, every entry verified before use.

    ``put`` writes ``_MAGIC + sha256(key, content) + content`` under ``key + _KEY_TAG``, over any
    entry already there (JAX only writes after it could not use one); ``get`` returns the content
    only when the digest matches, and otherwise removes the entry (so the program is compiled and
    written again, once).
    """

    def __init__(self, base):
        self._base = base

    @property
    def _path(self):
        return self._base._path

    @_path.setter
    def _path(self, value):
        self._base._path = value

    @staticmethod
    def _digest(key: str, value: bytes) -> bytes:
        return hashlib.sha256(key.encode() + b"\0" + value).digest()

    def _remove(self, key: str) -> None:
        for suffix in ("-cache", "-atime"):  # the file cache's names (jax._src.lru_cache)
            try:
                os.unlink(Path(str(self._path)) / f"{key}{_KEY_TAG}{suffix}")
            except (OSError, TypeError, AttributeError):
                pass

    def get(self, key: str) -> bytes | None:
        raw = self._base.get(key + _KEY_TAG)
        if raw is None:
            return None
        head = len(_MAGIC) + 32
        if raw[:len(_MAGIC)] == _MAGIC and raw[len(_MAGIC):head] == self._digest(key, raw[head:]):
            return raw[head:]
        self._remove(key)  # damaged, truncated, or another key's or program's: never used
        return None

    def put(self, key: str, value: bytes) -> None:
        self._remove(key)  # JAX writes only after it could not use what is there: replace it
        self._base.put(key + _KEY_TAG, _MAGIC + self._digest(key, value) + value)

    def clear(self):
        if hasattr(self._base, "clear"):
            self._base.clear()


def _verify_entries() -> bool:
    """Make JAX's persistent cache a :class:`VerifiedCache`; False when this JAX has no hook for it."""
    try:
        from jax._src import compilation_cache as cc
    except ImportError:
        return False
    original = getattr(cc, "get_file_cache", None)
    if original is None or not hasattr(cc, "_cache"):
        return False
    if not getattr(original, "_pcast_verified", False):
        def get_file_cache(path):
            got = original(path)
            return None if got is None else (VerifiedCache(got[0]), got[1])

        get_file_cache._pcast_verified = True
        cc.get_file_cache = get_file_cache
    if cc._cache is not None and not isinstance(cc._cache, VerifiedCache):  # opened before: wrap it
        cc._cache = VerifiedCache(cc._cache)
    return True
