"""The built-in plug-ins are declared, not imported (``config.plugins.BUILTIN``): every
name is known at once, a module is imported when one of its names is first looked up,
and what a process sees is what the eager imports registered (the same names, the same
errors, "registered twice" for a built-in name taken by another class). Checked in a
fresh interpreter, where nothing but ``config.plugins`` has been imported."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PROBE = r'''
import json, sys
from simulator.config import plugins
from simulator.config.registry import ROUTERS, WORKLOADS
from simulator.model.scheduling.policy import POLICIES, Policy, register_policy
out = {}
regs = {reg.what: reg for reg, _m, _n in plugins.BUILTIN}
lazy_mods = sorted({m for _r, m, _n in plugins.BUILTIN})
out["imported_at_start"] = [m for m in lazy_mods if m in sys.modules]
out["names_declared"] = {w: r.names() for w, r in regs.items()}
out["builtin_declared"] = {w: r.builtin_names() for w, r in regs.items()}
try:
    WORKLOADS.validate({"kind": "nope"})
except Exception as e:
    out["unknown_declared"] = str(e)
# A lookup imports the name's module, and only it.
ROUTERS.config_class("cache_aware")
out["after_lookup"] = [m for m in lazy_mods if m in sys.modules]
# Another class under a built-in name whose module was not imported yet.
try:
    @register_policy("edf")
    class Other(Policy):
        fill_kernel = staticmethod(lambda *a: 0)
except RuntimeError as e:
    out["twice"] = str(e)
out["edf_imported"] = "simulator.model.policies.edf" in sys.modules
plugins.import_builtins()
out["names_imported"] = {w: r.names() for w, r in regs.items()}
out["builtin_imported"] = {w: r.builtin_names() for w, r in regs.items()}
out["registered"] = {w: sorted(r._items) for w, r in regs.items()}
out["still_lazy"] = {w: sorted(r._lazy) for w, r in regs.items()}
out["declared_per_module"] = {}
for reg, module, names in plugins.BUILTIN:
    mods = {n: getattr(reg.factory(n) or reg.config_class(n), "__module__", "") for n in names}
    out["declared_per_module"][module] = sorted(set(mods.values()))
try:
    WORKLOADS.validate({"kind": "nope"})
except Exception as e:
    out["unknown_imported"] = str(e)
print(json.dumps(out))
'''

# What importing each module registers: its own factory's module, except the cost models
# (``simulator.cost`` registers factories it defines for the classes of its submodules).
OWNER = {"simulator.cost": ["simulator.cost"]}


def test_declared_plugins_are_what_importing_them_registers():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # Nothing declared is imported by declaring it, yet every name is there.
    assert "simulator.workload.servegen" not in out["imported_at_start"]
    assert "simulator.workload.traces" not in out["imported_at_start"]
    assert "simulator.cluster.prefix_router" not in out["imported_at_start"]
    assert out["names_declared"] == out["names_imported"]
    assert out["builtin_declared"] == out["builtin_imported"] == out["names_imported"]
    assert out["unknown_declared"] == out["unknown_imported"]
    assert "unknown workload kind 'nope'; known: inference_perf, servegen, sessions, " \
        "synthetic, trace" in out["unknown_declared"]
    assert "simulator.cluster.prefix_router" in out["after_lookup"]
    assert "simulator.workload.servegen" not in out["after_lookup"]
    # Taking a built-in name imports the built-in first: the clash is seen, as before.
    assert out["twice"] == "policy 'edf' registered twice" and out["edf_imported"]
    # Once imported, every declared name is registered, none left declared only, and
    # each by the module BUILTIN names.
    assert out["registered"] == out["names_declared"]
    assert all(v == [] for v in out["still_lazy"].values())
    for module, owners in out["declared_per_module"].items():
        assert owners == OWNER.get(module, [module]), module
