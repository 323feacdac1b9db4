"""User-facing errors: one line naming the file, the field and the value; and the checks
of inputs and resources that raise them before any work starts (``check_file``,
``read_text``, ``check_memory``).

``LatsimError`` is the one place where an error's text is shaped: the value it quotes
is shortened to ``VALUE_CHARS`` characters, control characters (newlines, a binary
file's bytes) are escaped, and the whole line is capped at ``LINE_CHARS``, so that
a 2 MB value or a nested structure of millions of elements costs a short line on
stderr, never megabytes. Every command prints it with ``error_line`` and exits
with its ``exit_code`` (2: bad input).
"""
from __future__ import annotations

import contextlib

from typing import Any

VALUE_CHARS = 80     # the quoted value, at most
LINE_CHARS = 1000    # the whole message, at most (a path, a field, a reason and a value)
_ELLIPSIS = "..."


def short_repr(value: Any, limit: int = VALUE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with the full length said when cut).

    Containers are rendered only as far as needed: a million-element list (or a
    structure built from YAML aliases) is never turned into one huge string."""
    text = _bounded_repr(value, limit + 1)
    if len(text) <= limit:
        return text
    size = _size_hint(value)
    return text[: max(limit - len(_ELLIPSIS), 1)] + _ELLIPSIS + (f" ({size})" if size else "")


def _size_hint(value: Any) -> str:
    if isinstance(value, (str, bytes)):
        return f"{len(value):,} characters" if isinstance(value, str) else f"{len(value):,} bytes"
    if isinstance(value, (list, tuple, dict, set)):
        return f"{len(value):,} items"
    return ""


def _bounded_repr(value: Any, budget: int, depth: int = 0) -> str:
    """A repr that stops once ``budget`` characters are produced (nested containers
    included), so its cost does not depend on the value's size."""
    if isinstance(value, str):
        return repr(value[:budget])
    if isinstance(value, bytes):
        return repr(value[:budget])
    if depth > 20:
        return _ELLIPSIS
    if isinstance(value, dict):
        parts, used = [], 2
        for k, v in value.items():
            item = f"{_bounded_repr(k, budget, depth + 1)}: {_bounded_repr(v, budget, depth + 1)}"
            parts.append(item)
            used += len(item) + 2
            if used > budget:
                break
        return "{" + ", ".join(parts) + "}"
    if isinstance(value, (list, tuple, set)):
        parts, used = [], 2
        for v in value:
            item = _bounded_repr(v, budget, depth + 1)
            parts.append(item)
            used += len(item) + 2
            if used > budget:
                break
        open_, close = ("[", "]") if isinstance(value, list) else \
            (("(", ")") if isinstance(value, tuple) else ("{", "}"))
        return open_ + ", ".join(parts) + close
    try:
        text = repr(value)
    except Exception:  # a user object whose repr fails still gets a message
        text = f"<{type(value).__name__}>"
    return text[:budget]


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    """``text`` on one printable line of at most ``limit`` characters: line breaks and
    other control characters escaped, the middle elided when it is too long."""
    if len(text) > 4 * limit:
        text = text[: 2 * limit] + text[-2 * limit:]   # bound the work below
    out = []
    for ch in text:
        if ch in "\n\r":
            out.append(" ")
        elif ch == "\t":
            out.append(" ")
        elif not ch.isprintable():
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    line = "".join(out)
    if len(line) > limit:
        keep = (limit - len(_ELLIPSIS)) // 2
        line = line[:keep] + _ELLIPSIS + line[-keep:]
    return line


class LatsimError(Exception):
    """An error caused by the user's input. The CLI prints it on one line and exits 2
    (``exit_code``). ``source`` names the file or option, ``field`` the field in it;
    with ``has_value`` the offending value is quoted, shortened (see module doc)."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 value: object = None, has_value: bool = False) -> None:
        parts = []
        if source:
            parts.append(str(source))
        if field:
            parts.append(f"field '{field}'")
        head = ": ".join(parts)
        msg = str(message)
        if has_value:
            msg = f"{msg} (got {short_repr(value)})"
        full = f"{head}: {msg}" if head else msg
        self.source = source
        super().__init__(one_line(full))


@contextlib.contextmanager
def about(source: str):
    """Name ``source`` (the file being worked on) in a ``LatsimError`` raised inside that
    names no file: a check of a scenario's values after it loaded (memory, sizes) then
    says which scenario, as its loader's errors do. Keeps the error's class (its exit
    code)."""
    try:
        yield
    except LatsimError as e:
        if not getattr(e, "source", None):
            e.source = source
            e.args = (one_line(f"{source}: {e.args[0]}"),)
        raise


def check_file(path, *, max_bytes: int, what: str = "file", field: str | None = None):
    """``path`` as a ``Path`` after checking it is an existing, readable regular file of
    at most ``max_bytes`` (one-line ``LatsimError`` otherwise: a folder, a device, a
    missing or unreadable file, one over the size cap)."""
    import os
    import stat
    from pathlib import Path
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise LatsimError("file not found", source=str(p), field=field) from None
    except NotADirectoryError:
        raise LatsimError("file not found (a part of the path is a file)", source=str(p),
                          field=field) from None
    except PermissionError:
        raise LatsimError(f"cannot read the {what}: permission denied", source=str(p),
                          field=field) from None
    except (OSError, ValueError) as e:
        raise LatsimError(f"cannot read the {what}: {getattr(e, 'strerror', None) or e}",
                          source=str(p), field=field) from None
    if stat.S_ISDIR(st.st_mode):
        raise LatsimError(f"is a folder, not a {what}", source=str(p), field=field)
    if not stat.S_ISREG(st.st_mode):
        raise LatsimError(f"is not a regular file (a device, pipe or socket), not a {what}",
                          source=str(p), field=field)
    if st.st_size > max_bytes:
        raise LatsimError(f"{what} is {_bytes(st.st_size)}, over the {_bytes(max_bytes)} limit",
                          source=str(p), field=field)
    if not os.access(p, os.R_OK):
        raise LatsimError(f"cannot read the {what}: permission denied", source=str(p),
                          field=field)
    return p


def _bytes(n: float) -> str:
    """A size for messages: bytes, KiB or MiB."""
    if n < 2**10:
        return f"{n:,.0f} bytes"
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB"


def read_text(path, *, max_bytes: int, what: str = "file", field: str | None = None) -> str:
    """The contents of a UTF-8 text file (``check_file``'s checks first); a binary file
    (a NUL byte, or bytes that are not UTF-8) is a one-line ``LatsimError``."""
    p = check_file(path, max_bytes=max_bytes, what=what, field=field)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise LatsimError(f"cannot read the {what}: {e.strerror or e}", source=str(p),
                          field=field) from None
    if len(raw) > max_bytes:   # grew since the check
        raise LatsimError(f"{what} is over the {_bytes(max_bytes)} limit",
                          source=str(p), field=field)
    nul = raw.find(b"\0")
    if nul >= 0:
        raise LatsimError(f"not a text file (a NUL byte at offset {nul:,}): expected a "
                          f"UTF-8 {what}", source=str(p), field=field)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LatsimError(f"not a UTF-8 text file (byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start:,}): expected a UTF-8 {what}", source=str(p),
                          field=field) from None


HEAD_BYTES = 1 << 16   # how much of a table is checked for text before a parser reads it


def check_text_file(path, *, max_bytes: int, what: str = "file", field: str | None = None):
    """``check_file``'s checks, then the first ``HEAD_BYTES`` must be UTF-8 without NUL
    bytes: a binary file is refused before a parser (which would read it whole) sees it.
    Returns the ``Path``."""
    p = check_file(path, max_bytes=max_bytes, what=what, field=field)
    try:
        with open(p, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as e:
        raise LatsimError(f"cannot read the {what}: {e.strerror or e}", source=str(p),
                          field=field) from None
    nul = head.find(b"\0")
    if nul >= 0:
        raise LatsimError(f"not a text file (a NUL byte at offset {nul:,}): expected a "
                          f"UTF-8 {what}", source=str(p), field=field)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # Not merely a character cut at the end of the head:
        if len(head) < HEAD_BYTES or e.reason != "unexpected end of data":
            raise _not_utf8(p, head, e, what, field) from None
    return p


def _not_utf8(p, raw: bytes, e: UnicodeDecodeError, what: str, field,
              offset: bool = True) -> "LatsimError":
    where = f" at offset {e.start:,}" if offset else ""   # a parser's chunk: no file offset
    return LatsimError(f"not a UTF-8 text file (byte 0x{raw[e.start]:02x}{where}): expected "
                       f"a UTF-8 {what}", source=str(p), field=field)


def present(path) -> bool:
    """Whether ``path`` names anything, a broken or looping symbolic link included
    (``Path.exists`` says False for those, so a file that is there but cannot be read
    would be skipped as missing rather than refused)."""
    import os
    return os.path.lexists(path)


def read_json(path, *, max_bytes: int, what: str = "JSON file", field: str | None = None,
              mapping: bool = True):
    """A JSON file's value (``read_text``'s checks first); invalid or too deeply nested
    JSON is a one-line ``LatsimError``, and so is a top-level value that is not an
    object when ``mapping``."""
    import json
    text = read_text(path, max_bytes=max_bytes, what=what, field=field)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LatsimError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                          source=str(path), field=field) from None
    except RecursionError:
        raise LatsimError("invalid JSON: nested too deeply", source=str(path),
                          field=field) from None
    if mapping and not isinstance(data, dict):
        raise LatsimError(f"must be a JSON object (a {what})", source=str(path), field=field,
                          value=data, has_value=True)
    return data


def read_csv(path, *, max_bytes: int, what: str = "table", field: str | None = None, **kw):
    """A CSV file as a ``DataFrame`` (``check_text_file``'s checks first, then pandas
    with ``kw``); an empty, malformed or non-UTF-8 file is a one-line ``LatsimError``."""
    import pandas as pd
    p = check_text_file(path, max_bytes=max_bytes, what=what, field=field)
    try:
        return pd.read_csv(p, **kw)
    except pd.errors.EmptyDataError:
        raise LatsimError(f"the {what} is empty", source=str(p), field=field) from None
    except UnicodeDecodeError as e:
        raise _not_utf8(p, e.object, e, what, field, offset=False) from None
    except (pd.errors.ParserError, ValueError, OverflowError, OSError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise LatsimError(f"cannot read the {what}: {msg}", source=str(p), field=field) from None


def available_memory() -> int | None:
    """Bytes of memory a new allocation can get now: ``MemAvailable`` on Linux, else the
    physical memory, else None (unknown)."""
    import os
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def gib(n_bytes: float) -> str:
    """Bytes as GiB for messages (``'7.3 GiB'``; TiB past 1024 GiB)."""
    g = n_bytes / 2**30
    return f"{g / 1024:,.1f} TiB" if g >= 1024 else f"{g:,.1f} GiB"


def check_memory(need: float, what: str, *, source: str | None = None,
                 field: str | None = None, hint: str = "") -> None:
    """Refuse (one-line ``LatsimError``) work whose memory ``need`` (bytes) is beyond what
    the machine has available now, before it is attempted."""
    have = available_memory()
    if have is not None and need > have:
        raise LatsimError(f"{what} needs about {gib(need)} of memory, {gib(have)} is available"
                          + (f"; {hint}" if hint else ""), source=source, field=field)


def error_line(e: BaseException) -> str:
    """The line every command prints for an error: ``latsim: error: <message>``."""
    return "latsim: error: " + one_line(str(e))


class Unsupported(Exception):
    """The loop asked for cannot run this configuration (the message says why): raised by
    ``loops.simulate`` and the runs that wrap it (``cluster.edgerun``)."""
