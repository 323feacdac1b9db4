"""``kernel``: how a rule is written once and called by every executor.

A scheduling rule, memory rule or cost formula is a small pure function over numbers
and numpy arrays, decorated with ``@kernel``. With numba installed (a core dependency)
it is compiled to machine code: the compiled event loop calls it from its own compiled
code, and the SimPy model and the real engine call the very same compiled function from
Python. Without numba (or with ``LATSIM_NO_JIT=1``) it stays the plain Python function,
and everything still runs, only slower. A kernel may call other kernels, never Python
objects.

numba keys a cached function on its own source file only: a function that calls one from
another file keeps the callee's old machine code when only the callee's file changes.
So every kernel caches into one folder named by a hash of numba's version and all the
sources of the folders that hold kernels (``KERNEL_DIRS``):
``~/.cache/latsim/numba/<hash>`` (or under ``$LATSIM_CACHE_DIR``). Any change to any of
them compiles everything afresh. Where no such folder can be made the kernels are
compiled in each process instead (correct, only slower to start)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

try:  # pragma: no cover - exercised by the import itself
    import numba
    from numba.core import config as _numba_config
except ImportError:  # pragma: no cover
    numba = None

_ROOT = Path(__file__).resolve().parent
# Folders (under simulator/) whose modules define kernels; the cache hash covers them.
KERNEL_DIRS = ("model", "cost", "loops/compiled", "wire", "cluster")

ENABLED = numba is not None and os.environ.get("LATSIM_NO_JIT", "") in ("", "0")


def cache_dir(root: Path = _ROOT, dirs=KERNEL_DIRS) -> Optional[str]:
    """The cache folder for the kernel sources under ``root`` (None if it cannot be
    written)."""
    h = hashlib.sha256((numba.__version__ if numba is not None else "").encode())
    files = [root / "kernel.py"] + sorted(p for d in dirs for p in (root / d).rglob("*.py"))
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    base = os.environ.get("LATSIM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "latsim")
    d = Path(base) / "numba" / h.hexdigest()[:16]
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError:
        return None
    return str(d)


CACHE_DIR = cache_dir() if ENABLED else None


def kernel(f=None, *, inline: bool = False):
    """Compile ``f`` with ``numba.njit(cache=True)`` into ``CACHE_DIR`` (numba picks a
    function's cache folder when it is decorated; the setting is restored right after),
    or return it unchanged when numba is off (see module doc). ``@kernel(inline=True)``
    inlines a small kernel into its compiled callers (a call's argument passing costs
    more than a lookup or a comparison does)."""
    if f is None:
        return lambda g: kernel(g, inline=inline)
    if not ENABLED:
        return f
    opts = {"inline": "always"} if inline else {}
    if CACHE_DIR is None:
        return numba.njit(**opts)(f)
    old = _numba_config.CACHE_DIR
    _numba_config.CACHE_DIR = CACHE_DIR
    try:
        return numba.njit(cache=True, **opts)(f)
    finally:
        _numba_config.CACHE_DIR = old


def python_of(f):
    """The plain Python function a kernel was compiled from (the kernel itself when numba
    is off): the same rule, for a Python caller on a hot path, where a compiled call's
    dispatch (type checks, boxing: microseconds) costs more than the rule's arithmetic.
    Only for kernels that call no other kernel (those would still dispatch)."""
    return getattr(f, "py_func", f)
