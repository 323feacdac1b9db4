"""Plug-ins: the built-in ones (imported here so their ``register`` calls run) and a
user's own (``load_plugins``).

A user's plug-in is a Python module that registers a policy
(``simulator.model.scheduling.register_policy``), a workload, an arrival process, a
length distribution, a cost model or a router, exactly as the built-in modules do.
It is named in a scenario's ``plugins:`` list (an import path such as
``mypkg.mypolicy``, or a ``.py`` file relative to the scenario), or installed as a
package that declares an entry point in the group ``latsim.plugins``; either way it is
imported before the scenario is validated, so its names can be used in it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Optional

from simulator import cost as _cost  # noqa: F401  cost models
from simulator import workload as _workload  # noqa: F401  arrivals, lengths, synthetic
from simulator.cluster import prefix_router as _prefix_router  # noqa: F401  cache_aware
from simulator.cluster import routers as _routers  # noqa: F401  replica routers
from simulator.errors import LatsimError, about, check_file, present
from simulator.model import policies as _policies  # noqa: F401  scheduling policies
from simulator.workload import servegen as _servegen  # noqa: F401  kind: servegen
from simulator.workload import inference_perf as _ip  # noqa: F401  kind: inference_perf
from simulator.workload import traces as _traces  # noqa: F401  kind: trace
from simulator.workload import sessions as _sessions  # noqa: F401  kind: sessions

ENTRY_POINT_GROUP = "latsim.plugins"
MAX_PLUGIN_BYTES = 16 * 2**20   # a plug-in is a few KB of Python; this only stops a wrong file
_loaded_entry_points = False


def _entry_points() -> None:
    """Import every installed package's ``latsim.plugins`` entry points, once."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a broken third-party plug-in: say which, in one line
            raise LatsimError(f"plug-in entry point {ep.name!r} ({ep.value}) "
                              f"{_failure(e)}") from None


def _failure(e: BaseException) -> str:
    """What went wrong importing a plug-in, for its one-line error. ``sys.exit`` (or any
    ``SystemExit``) is named as such: left alone it would end latsim with that status
    (0: 'success') having written nothing."""
    if isinstance(e, SystemExit):
        return (f"called sys.exit({e.code!r}) while being imported (a plug-in module may "
                "only define and register its classes)")
    return f"failed to load: {type(e).__name__}: {e}"


def load_plugins(names, base_dir: Optional[Path] = None, source: str = "<scenario>") -> None:
    """Import each of ``names`` (import paths, or ``.py`` files relative to
    ``base_dir``) and the installed entry points; one-line ``LatsimError`` on failure."""
    _entry_points()
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise LatsimError("must be a list of module names or .py files", source=source,
                          field="plugins", value=names, has_value=True)
    for i, name in enumerate(names):
        field = f"plugins[{i}]"
        try:
            if name.endswith(".py"):
                path = Path(name)
                if not path.is_absolute() and base_dir is not None:
                    path = Path(base_dir) / path
                if not present(path):
                    raise LatsimError("plug-in file not found", source=source, field=field,
                                      value=name, has_value=True)
                # A regular file (not a folder, a pipe or a loop of links), named as such.
                check_file(path, max_bytes=MAX_PLUGIN_BYTES, what="plug-in (.py file)")
                mod_name = f"latsim_plugin_{path.stem}_{abs(hash(str(path.resolve())))}"
                if mod_name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                try:
                    with about(f"plug-in {path}"):   # its own LatsimError names it too
                        spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
            else:
                with about(f"plug-in {name}"):
                    importlib.import_module(name)
        except (LatsimError, KeyboardInterrupt):
            raise
        except BaseException as e:   # SystemExit too: the run goes on only as an error
            where = path if name.endswith(".py") else name
            raise LatsimError(f"plug-in {where} {_failure(e)}", source=source,
                              field=field) from None
