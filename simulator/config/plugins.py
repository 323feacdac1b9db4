"""Plug-ins: the built-in ones (declared here: each name with the module whose import
registers it, imported when the name is first looked up) and a user's own
(``load_plugins``).

A user's plug-in is a Python module that registers a policy
(``simulator.model.scheduling.register_policy``), a workload, an arrival process, a
length distribution, a cost model or a router, exactly as the built-in modules do.
It is named in a scenario's ``plugins:`` list (an import path such as
``mypkg.mypolicy``, or a ``.py`` file relative to the scenario), or installed as a
package that declares an entry point in the group ``latsim.plugins``; either way it is
imported before the scenario is validated, so its names can be used in it. Every
built-in module is imported before the first user plug-in is, so that a user's module
meets the built-ins (and the cost models' contract check) as registered.

Declaring instead of importing keeps a run from importing what it does not use (the
trace readers, ServeGen, sessions, the other cost models' tables): a name is listed,
validated and offered in errors at once (``Registry.declare``); ``BUILTIN`` must name
exactly what importing its modules registers (``tests/test_plugin_declare.py``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Optional

from simulator.config.registry import ARRIVALS, COST_MODELS, LENGTHS, ROUTERS, WORKLOADS
from simulator.errors import LatsimError, about, check_file, present
from simulator.model.scheduling.policy import POLICIES

_W = "simulator.workload."
_P = "simulator.model.policies."
# (registry, module, the names importing the module registers): every built-in plug-in.
BUILTIN = (
    (COST_MODELS, "simulator.cost", ("profile", "fitted", "roofline")),
    (WORKLOADS, _W + "synthetic", ("synthetic",)),
    (WORKLOADS, _W + "inference_perf", ("inference_perf",)),
    (WORKLOADS, _W + "servegen", ("servegen",)),
    (WORKLOADS, _W + "traces", ("trace",)),
    (WORKLOADS, _W + "sessions", ("sessions",)),
    (ARRIVALS, _W + "arrivals", ("poisson", "gamma", "constant")),
    (ARRIVALS, _W + "rates", ("diurnal", "piecewise", "ramp", "servegen", "step")),
    (LENGTHS, _W + "lengths", ("constant", "uniform", "lognormal", "exponential")),
    (ROUTERS, "simulator.cluster.routers",
     ("round_robin", "random", "least_outstanding", "nearest_region", "region_load_rtt")),
    (ROUTERS, "simulator.cluster.prefix_router", ("cache_aware",)),
    *((POLICIES, _P + name, (name,)) for name in
      ("fifo", "chunked", "priority_aging", "fair_score", "static", "sjf", "edf")),
)
for _reg, _module, _names in BUILTIN:
    for _name in _names:
        _reg.declare(_name, _module)


def import_builtins() -> None:
    """Import every built-in plug-in module now (as a user's plug-in needs them: see the
    module doc)."""
    for _reg, module, _names in BUILTIN:
        importlib.import_module(module)


ENTRY_POINT_GROUP = "latsim.plugins"
MAX_PLUGIN_BYTES = 16 * 2**20   # a plug-in is a few KB of Python; this only stops a wrong file
_loaded_entry_points = False


def _entry_points() -> None:
    """Import every installed package's ``latsim.plugins`` entry points, once."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    eps = entry_points(group=ENTRY_POINT_GROUP)
    if eps:
        import_builtins()
    for ep in eps:
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
    if names:
        import_builtins()
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
