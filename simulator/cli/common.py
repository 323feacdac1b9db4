"""What every command module shares: printing an error as the one line on stderr with
its exit code, the line an interrupted command ends with, and reading a ``--policies``
list."""
from __future__ import annotations

import sys

import typer

from simulator.errors import LatsimError, error_line


def _fail(e: Exception) -> None:
    """Print ``e`` as the one error line on stderr and exit with its code (2: bad input)."""
    sys.stderr.write(error_line(e) + "\n")
    sys.stderr.flush()
    raise typer.Exit(getattr(e, "exit_code", 2))


_interrupt_note: list[str] = []


def on_interrupt(note: str | None) -> None:
    """What the line an interrupted command ends with says it kept or left untouched
    (``nothing written to DIR``); a command sets it as its state changes, the latest
    holds (None: nothing to say)."""
    _interrupt_note[:] = [note] if note else []


def interrupted_line() -> str:
    """``latsim: interrupted`` and, when the command set one, what it kept."""
    return "latsim: interrupted" + "".join(f"; {n}" for n in _interrupt_note)


def _policy_list(text: str) -> list[str]:
    """``--policies a,b`` as a checked list."""
    from simulator.model.scheduling import check_policy_name
    names = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return [check_policy_name(p) for p in names]
    except ValueError as e:
        raise LatsimError(str(e), source="--policies") from None
