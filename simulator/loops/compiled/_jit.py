"""``jit``: numba's ``njit`` with an on-disk cache that cannot go stale.

numba keys a cached function on its own source file only: a function that calls one
from another file keeps the callee's old machine code when only the callee's file
changes (a new latsim version, an edit). So every compiled function of this package
caches into one folder named by a hash of all the package's sources and numba's
version (``~/.cache/latsim/numba/<hash>``, or under ``$LATSIM_CACHE_DIR``): any change
anywhere compiles everything afresh. Where no such folder can be made the functions
are compiled in each process instead (correct, only slower to start)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

import numba
from numba.core import config

_HERE = Path(__file__).resolve().parent


def cache_dir(package: Path = _HERE) -> Optional[str]:
    """The cache folder for the sources in ``package`` (None if it cannot be written)."""
    h = hashlib.sha256(numba.__version__.encode())
    for p in sorted(package.glob("*.py")):
        h.update(p.name.encode())
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


CACHE_DIR = cache_dir()


def jit(f):
    """``numba.njit(cache=True)`` into ``CACHE_DIR`` (numba picks a function's cache
    folder when it is decorated; the setting is restored right after)."""
    if CACHE_DIR is None:
        return numba.njit(f)
    old = config.CACHE_DIR
    config.CACHE_DIR = CACHE_DIR
    try:
        return numba.njit(cache=True)(f)
    finally:
        config.CACHE_DIR = old
