"""The ``latsim`` command line (typer): the app, its entry point and error handling.

The commands live in their own modules (``simulator.cli.run``, ``.engine``, ``.plan``,
``.serve``, ...); ``COMMANDS`` names them here, in the order ``--help`` lists them, and a
command's module is imported only when that command runs (or shows its help).

Every user error (bad scenario, trace, profile, flag or path, unknown policy) is a
``LatsimError``, found before any work starts: printed on one line to stderr, exit code
2, no traceback. A run whose requests did not all finish (rejected as too large for the
KV cache, cut by ``max_sim_time_s``) prints why and exits 1; 0 is a run that did what
was asked. ``main`` routes every command's errors, typer's usage errors included,
through the same one-line printer (a bug: one "internal error" line, exit 70).
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import List, Optional

import typer
import typer.core
import typer.main

from simulator.errors import LatsimError, error_line, one_line

# Every command, in the order ``latsim --help`` lists them: (name, module, attribute).
# A command's module (and what it imports: pandas, numba, the web stack) is imported
# only when that command is resolved, so ``latsim --version`` and ``latsim run --help``
# start in a fraction of a second; ``latsim --help`` imports them all (it shows every
# command's own help line).
COMMANDS = (("run", "simulator.cli.run", "run"), ("profile", "simulator.cli.engine", "profile"),
            ("validate", "simulator.cli.engine", "validate"),
            ("sweep", "simulator.cli.plan", "sweep"), ("plan", "simulator.cli.plan", "plan"),
            ("report", "simulator.cli.report", "report"),
            ("serve", "simulator.cli.serve", "serve"), ("bench", "simulator.cli.serve", "bench"),
            ("data", "simulator.cli.data", "data"),
            ("policies", "simulator.cli.policies", "policies"),
            ("fit", "simulator.cli.fidelity", "fit"),
            ("calibrate", "simulator.cli.fidelity", "calibrate"),
            ("cost", "simulator.cli.cost", "cost"), ("trace", "simulator.cli.trace", "trace_app"))
GROUP_HELP = {"trace": "Summarise and convert request traces."}   # sub-apps' help lines


def _load_command(name: str):
    """The click command ``name`` as typer makes it from its function (or sub-app), built
    the moment it is needed."""
    import importlib
    module, attr = next((m, a) for n, m, a in COMMANDS if n == name)
    fn = getattr(importlib.import_module(module), attr)
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.callback()(lambda: None)
    if isinstance(fn, typer.Typer):
        one.add_typer(fn, name=name, help=GROUP_HELP.get(name))
    else:
        one.command(name)(fn)
    return typer.main.get_command(one).commands[name]


class _LazyCommands(MutableMapping):
    """A group's ``commands`` mapping whose entries are built on first lookup: every name
    is there (for ``--help``, suggestions on a typo), only a looked-up one is imported."""

    def __init__(self, names) -> None:
        self._names, self._built = list(names), {}

    def __getitem__(self, name):
        if name not in self._built:
            if name not in self._names:
                raise KeyError(name)
            self._built[name] = _load_command(name)
        return self._built[name]

    def __setitem__(self, name, cmd) -> None:
        self._names += [] if name in self._names else [name]
        self._built[name] = cmd

    def __delitem__(self, name) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __iter__(self):
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)


class _LazyGroup(typer.core.TyperGroup):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        lazy = _LazyCommands(n for n, _, _ in COMMANDS)
        for name, cmd in self.commands.items():
            lazy[name] = cmd
        self.commands = lazy

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  cls=_LazyGroup,
                  help="latsim: latency simulator and capacity planner for LLM serving.")


def _version(value: bool) -> None:
    """``--version``: print the installed version and stop."""
    if value:
        try:
            from importlib.metadata import PackageNotFoundError, version
            v = version("latsim")
        except (ImportError, PackageNotFoundError):
            from simulator import __version__ as v
        typer.echo(f"latsim {v}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """latsim: latency simulator and capacity planner for LLM serving.

    Exit codes: 0 ok; 1 the command ran but did not do all that was asked (requests
    that never finished, no configuration meeting the SLOs, ...); 2 bad input (one
    'latsim: error:' line on stderr)."""


INTERNAL_ERROR = 70   # a bug, not the input: EX_SOFTWARE


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point. Every error of every command ends as one
    ``latsim: error:`` line on stderr: a bad input (``LatsimError``) or a bad flag
    (typer's usage errors) with exit 2, an interrupt with 130; anything else is a bug
    and says so on one line, exit 70 (``LATSIM_DEBUG=1`` shows its traceback)."""
    from simulator.cli.common import interrupted_line, on_interrupt
    usage, other, abort = _click_errors()
    on_interrupt(None)
    import warnings
    shown = warnings.showwarning
    warnings.showwarning = _warning_line
    try:
        rv = app(args=argv, standalone_mode=False)
    except LatsimError as e:
        _die(error_line(e), e.exit_code)
    except usage as e:
        if type(e).__name__ == "NoArgsIsHelpError":   # bare ``latsim``: the help, as usual
            if e.format_message().strip():   # (typer's rich help is printed already)
                e.show()
            sys.exit(e.exit_code)
        where = e.ctx.command_path if e.ctx is not None else "latsim"
        _die(error_line(LatsimError(f"{e.format_message()} (see '{where} --help')")), 2)
    except other as e:
        _die(error_line(LatsimError(e.format_message())), e.exit_code)
    except (KeyboardInterrupt, *abort):
        _die(interrupted_line(), 130)
    except MemoryError:
        _die(error_line(LatsimError("out of memory: the input is too large for this machine")),
             2)
    except BrokenPipeError:   # the reader of our output went away (``| head``)
        sys.stderr.close()
        sys.exit(0)
    except Exception as e:
        if os.environ.get("LATSIM_DEBUG"):
            raise
        _die(error_line(LatsimError(f"internal error, a bug in latsim: {type(e).__name__}: {e} "
                                    "(LATSIM_DEBUG=1 shows the traceback)")), INTERNAL_ERROR)
    finally:
        warnings.showwarning = shown
    if rv == 130:   # typer turns Ctrl-C into exit 130, silently: say it, and what was kept
        _die(interrupted_line(), 130)
    sys.exit(rv if isinstance(rv, int) else 0)


def _click_errors() -> tuple[tuple, tuple, tuple]:
    """Click's usage errors, its other errors and its abort, from the click typer runs on
    (typer may carry its own copy) and from click itself where it is imported (a typer
    that runs on click has imported it; importing it otherwise costs every command's
    start-up, and nothing in latsim raises its errors)."""
    import importlib
    usage, other, abort = [], [], [typer.Abort]
    for name in ("typer._click.exceptions", "click.exceptions"):
        if name == "click.exceptions" and "click" not in sys.modules:
            continue
        try:
            m = importlib.import_module(name)
        except ImportError:
            continue
        usage += [m.UsageError] if hasattr(m, "UsageError") else []
        other += [m.ClickException] if hasattr(m, "ClickException") else []
        abort += [m.Abort] if hasattr(m, "Abort") else []
    return tuple(usage), tuple(other), tuple(abort)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Python warnings as the CLI prints them: one ``latsim: warning:`` line on stderr."""
    sys.stderr.write("latsim: warning: " + one_line(str(message)) + "\n")


def _die(line: str, code: int) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
