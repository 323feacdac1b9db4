"""Start-up: ``latsim --version`` and ``latsim run --help`` import no command's heavy
modules (pandas, numba, matplotlib, torch, the web stack), and the lazily built commands
are exactly the ones typer builds from the command functions (same help, same options).
Structural checks only; the timing is ``benchmarks/startup.py``."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from conftest import REPO

HEAVY = ("pandas", "numba", "matplotlib", "torch", "fastapi", "uvicorn", "simulator.kernel")


def _modules_after(code: str) -> dict:
    """Which of ``HEAVY`` are imported after ``code`` runs in a fresh interpreter."""
    probe = (code + "\nimport json, sys\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    return {"out": r.stdout, "heavy": json.loads(r.stderr.strip().splitlines()[-1])}


def _cli(args) -> str:
    return ("from simulator.cli.main import main\ntry:\n"
            f"    main({list(args)!r})\nexcept SystemExit:\n    pass")


def test_importing_the_cli_imports_no_heavy_module():
    assert _modules_after("import simulator.cli.main")["heavy"] == []
    assert _modules_after("import simulator.cli")["heavy"] == []


@pytest.mark.parametrize("args", [["--version"], ["run", "--help"], ["cost", "--help"],
                                  ["trace", "--help"]])
def test_version_and_help_import_no_heavy_module(args):
    r = _modules_after(_cli(args))
    assert r["heavy"] == [], args
    assert ("latsim 0." in r["out"]) if args == ["--version"] else ("Usage:" in r["out"] and "--help" in r["out"])


def test_a_command_imports_only_when_it_runs():
    # latsim run --help imports simulator.cli.run, not the other commands' modules.
    probe = _cli(["run", "--help"]) + (
        "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith('simulator.cli.'))), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    loaded = json.loads(r.stderr.strip().splitlines()[-1])
    assert loaded == ["simulator.cli.common", "simulator.cli.main", "simulator.cli.run"]


def _eager_app() -> typer.Typer:
    """The app as typer builds it with every command registered up front (how main.py
    registered them before the commands were loaded lazily)."""
    from simulator.cli import main as m
    app = typer.Typer(add_completion=False, no_args_is_help=True,
                      pretty_exceptions_enable=False, help=m.app.info.help)
    app.callback()(m._root)
    for name, module, attr in m.COMMANDS:
        fn = getattr(importlib.import_module(module), attr)
        if isinstance(fn, typer.Typer):
            app.add_typer(fn, name=name, help=m.GROUP_HELP[name])
        else:
            app.command(name)(fn)
    return app


def test_lazy_commands_have_the_eager_help_and_options():
    from simulator.cli.main import COMMANDS, app
    eager = _eager_app()
    runner = CliRunner()
    cases = [[]] + [[name] for name, _, _ in COMMANDS] + [["trace", "summarize"],
                                                          ["trace", "convert"]]
    for args in cases:
        a = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "120"})
        b = runner.invoke(eager, [*args, "--help"], env={"COLUMNS": "120"})
        assert a.exit_code == b.exit_code == 0, (args, a.output)
        assert a.output == b.output, args
    # the root help lists every command, in COMMANDS' order
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "120"}).output
    at = [out.index(f"│ {name} ") for name, _, _ in COMMANDS]
    assert at == sorted(at)


def test_a_typo_still_suggests_the_command():
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "rn"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert "No such command 'rn'. Did you mean 'run'?" in r.stderr


def test_a_cold_kernel_cache_is_announced_on_the_simpy_path(tmp_path):
    # A fresh cache folder: the SimPy path compiles the step-cost and KV-rule kernels
    # (seconds) and says so, as the compiled path does for its loop; the next run loads
    # them and prints nothing about compiling.
    import os
    env = {**os.environ, "LATSIM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LATSIM_NO_JIT", None)
    args = [sys.executable, "-m", "simulator.cli", "run", "scenarios/quickstart.yaml",
            "--loop", "simpy", "--set", "workload.num_requests=30"]
    first = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "latsim: compiling the simulator's kernels for this machine" in first.stderr
    second = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr


def test_a_cold_kernel_cache_is_announced_by_sweep_once_its_points_are_checked(tmp_path):
    # sweep's runs say nothing of compiling (many, maybe in worker processes): the
    # command says it once, after every point is checked (a bad point's error stays the
    # only line) and before the first run; with the cache warm it says nothing.
    import os
    env = {**os.environ, "LATSIM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LATSIM_NO_JIT", None)

    def sweep(out, *grid):
        return subprocess.run(
            [sys.executable, "-m", "simulator.cli", "sweep", "scenarios/quickstart.yaml",
             "--set", "workload.num_requests=30", "--workers", "1", "--out", str(out),
             *[a for g in grid for a in ("--grid", g)]],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    bad = sweep(tmp_path / "bad", "engine.max_num_seqs=0,4")
    assert bad.returncode == 2, bad.stderr
    assert "compiling" not in bad.stderr and "compiles" not in bad.stderr
    first = sweep(tmp_path / "a", "engine.max_num_seqs=8")
    assert first.returncode == 0, first.stderr
    assert "latsim: compiling the simulator's kernels for this machine" in first.stderr
    # 30 requests per point: the compiled loop is not what such a run takes.
    assert "compiled event loop" not in first.stderr
    second = sweep(tmp_path / "b", "engine.max_num_seqs=8")
    assert second.returncode == 0, second.stderr
    assert "compiling the simulator's kernels" not in second.stderr
