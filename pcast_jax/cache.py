"""JAX's persistent compilation cache, on by default in a per-user folder.

A sweep's chunk compiles once per shape (:mod:`pcast_jax.sweep.compute`); with this cache a second
process with the same shapes (``pcast reproduce`` again, a test rerun) loads the compiled program
from disk instead of compiling it.

* Folder: ``$XDG_CACHE_HOME/pcast_jax/jax-cache`` (``~/.cache/pcast_jax/jax-cache`` without it).
* ``PCAST_JAX_COMPILATION_CACHE``: ``0`` / ``false`` / ``off`` / ``no`` turns the cache off; a path
  uses that folder; unset, empty, ``1`` / ``true`` / ``on`` / ``yes`` the default folder.
* A folder set already through JAX (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept.
* A folder that cannot be created or written leaves the cache off, silently: a cache is never a
  reason to fail.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["ENV_VAR", "default_cache_dir", "setup_compilation_cache"]

#: Environment variable that turns the cache off (0) or names its folder.
ENV_VAR = "PCAST_JAX_COMPILATION_CACHE"
_OFF = {"0", "false", "off", "no"}
_ON = {"", "1", "true", "on", "yes"}
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


def setup_compilation_cache(enabled: bool | None = None, path: str | os.PathLike | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on (idempotent); return its folder, or None when off.

    Args:
      enabled: False turns it off for this process; None (default) follows ``PCAST_JAX_COMPILATION_CACHE``.
      path: the folder (default: the variable's path, else :func:`default_cache_dir`).

    Only the first call that finds a usable folder sets it; JAX keeps the folder it starts with.
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if enabled is False or (enabled is None and env.lower() in _OFF):
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
    if path is None:
        path = env if env and env.lower() not in _ON else default_cache_dir()
    folder = Path(path).expanduser()
    if not _writable(folder):
        return None
    try:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        # the compiled chunks take seconds; tiny helper programs are not worth a file each
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # noqa: BLE001 - a cache is never a reason to fail
        return None
    _state.pop("off", None)
    _state["dir"] = folder
    return folder
