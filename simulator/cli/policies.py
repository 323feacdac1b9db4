"""``latsim policies``: the registered scheduling policies, their parameters, and which
event loop runs each."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table


def policy_rows(plugins: Optional[List[str]] = None, base_dir: Optional[Path] = None) -> list:
    """One row per registered policy: name, summary, parameters (with defaults), loops."""
    from simulator.config.plugins import load_plugins
    from simulator.loops.compiled.queue import policy_ids
    from simulator.model.scheduling import policy_class, policy_names
    load_plugins(list(plugins or []), base_dir, source="--plugin")
    rows = []
    for name in policy_names():
        cls = policy_class(name)
        params = []
        for f, info in cls.Params.model_fields.items():
            default = info.default
            params.append(f"{f}={'engine' if default is None else default}")
        import sys
        mod_doc = sys.modules[cls.__module__].__doc__ or cls.__doc__ or ""
        doc = [line.split(": ", 1)[-1] if line.startswith("``") else line
               for line in mod_doc.strip().splitlines()[:1]]
        compiled = cls.fill_kernel is not None and policy_ids(cls) is not None
        rows.append({"name": name, "summary": doc[0] if doc else "",
                     "params": ", ".join(params) or "-",
                     "loops": "compiled, simpy" if compiled else "simpy",
                     "module": cls.__module__})
    return rows


def policies(
    plugin: Optional[List[str]] = typer.Option(None, "--plugin", help="import this module "
                                               "(or .py file) first, as a scenario's plugins"),
) -> None:
    """List the scheduling policies a scenario can name in engine.policy."""
    console = Console()
    rows = policy_rows(plugin, Path.cwd())
    t = Table(title="scheduling policies", show_lines=False)
    for col in ("name", "parameters (default)", "loops", "what it does"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["name"], r["params"], r["loops"], r["summary"])
    console.print(t)
    console.print("engine.policy: NAME, or {kind: NAME, PARAM: VALUE, ...}; a parameter left "
                  "at 'engine' takes engine.chunk_size / engine.aging_s.", highlight=False)
