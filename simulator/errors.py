"""User-facing errors: one line naming the file, the field and the value."""
from __future__ import annotations


class LatsimError(Exception):
    """An error caused by the user's input. The CLI prints it on one line and exits 2."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 value: object = None, has_value: bool = False) -> None:
        parts = []
        if source:
            parts.append(str(source))
        if field:
            parts.append(f"field '{field}'")
        head = ": ".join(parts)
        msg = message
        if has_value:
            msg = f"{message} (got {value!r})"
        full = f"{head}: {msg}" if head else msg
        super().__init__(full.replace("\n", " "))
