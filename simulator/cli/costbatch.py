"""``latsim cost --steps``: many steps priced with one cost model, for scripts.

In: a CSV with a header naming a ``prefill`` and/or a ``decode`` column (cells ``NxL``
and ``B@C`` as the options take them, empty: none), or JSON lines (``.jsonl`` / ``.ndjson``,
or ``-`` for stdin) of objects with ``prefill`` / ``decode`` (``"4x512"``, ``[4, 512]``
or ``{"prompts": 4, "tokens": 512}``; ``"16@1024"``, ``[16, 1024]`` or
``{"batch": 16, "context": 1024}``). Other columns or keys are passed through.
Out: one row per step, in order: the passed-through columns, ``prefill``, ``decode``,
``ms``, from the roofline ``step_fits`` (the step's KV fits the GPUs) and with
``--terms`` ``compute``, ``memory``, ``communication``, ``overhead`` and ``bound``; CSV (or JSON lines with ``--json``) on stdout or ``--out``.
Every row is read and checked before any is priced, and all are priced before anything
is written: a bad row is one line naming file, line, column and value, exit 2, no
output."""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Optional

from simulator.cost.steps import (check_steps, cost_model, parse_decode, parse_prefill,
                                  price_row)
from simulator.errors import LatsimError, check_file

MAX_STEPS_MB = 512
SIDES = (("prefill", parse_prefill, ("prompts", "tokens"), "x"),
         ("decode", parse_decode, ("batch", "context"), "@"))


def _cell(v, keys: tuple, sep: str):
    """A JSON value of a step side as the option's text (None: no such side)."""
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        return v   # refused by the parser, quoted as given
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v):
        return f"{v[0]}{sep}{v[1]}"
    if isinstance(v, dict) and set(v) == set(keys) and all(type(v[k]) is int for k in keys):
        return f"{v[keys[0]]}{sep}{v[keys[1]]}"
    return v


def read_steps(path: str) -> tuple[str, list]:
    """``(name, rows)``: each row ``(line, passed-through fields, prefill, decode)`` with
    the sides parsed (one-line errors naming ``name:line`` and the column)."""
    jsonl = path == "-" or path.lower().endswith((".jsonl", ".ndjson"))
    if path == "-":
        name, text = "<stdin>", sys.stdin.read()
    else:
        name = path
        p = check_file(path, max_bytes=MAX_STEPS_MB * 2**20, what="steps file",
                       field="--steps")
        text = p.read_text(encoding="utf-8", errors="replace")
    raw = _json_rows(name, text) if jsonl else _csv_rows(name, text)
    rows = []
    for line, rec in raw:
        parsed = []
        for col, parse, keys, sep in SIDES:
            v = rec.pop(col, None)
            v = _cell(v, keys, sep) if jsonl else (v.strip() or None if v else None)
            parsed.append(None if v is None else parse(v, source=f"{name}:{line}: column "
                                                               f"'{col}'"))
        rows.append((line, rec, *parsed))
    if not rows:
        raise LatsimError("no steps in the file", source=name)
    return name, rows


def _csv_rows(name: str, text: str):
    reader = csv.DictReader(io.StringIO(text))
    cols = reader.fieldnames or []
    if not {"prefill", "decode"} & set(cols):
        raise LatsimError("needs a header with a 'prefill' and/or a 'decode' column (NxL, B@C)",
                          source=f"{name}:1", value=",".join(cols)[:200], has_value=True)
    for rec in reader:
        if None in rec:
            raise LatsimError(f"more cells than the {len(cols)} columns of the header",
                              source=f"{name}:{reader.line_num}")
        if not any((v or "").strip() for v in rec.values()):
            continue   # a blank line
        yield reader.line_num, dict(rec)


def _json_rows(name: str, text: str):
    for line, s in enumerate(text.splitlines(), 1):
        if not s.strip():
            continue
        try:
            rec = json.loads(s)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            raise LatsimError("not a JSON object", source=f"{name}:{line}",
                              value=s, has_value=True)
        yield line, rec


def _side_text(v: Optional[tuple], sep: str) -> str:
    return f"{v[0]}{sep}{v[1]}" if v else ""


def cost_batch(steps: Optional[str], out: Optional[Path], force: bool, as_json: bool,
               terms: bool, config: dict, single: dict) -> None:
    """``latsim cost --steps``: read and check every row, price them all, then write."""
    if steps is None:
        raise LatsimError("goes with --steps FILE", source="--out" if out else
                          "--force" if force else "--terms")
    for flag, v in single.items():
        if v is not None:
            raise LatsimError("is for one step; with --steps each row gives its step",
                              source=flag, value=v, has_value=True)
    if out is not None:
        from simulator.report.files import check_out_file
        check_out_file(out, force=force, reading=() if steps == "-" else (steps,))
    cm = cost_model(**config)
    name, rows = read_steps(steps)
    checked = check_steps(cm, [(pre, dec) for _, _, pre, dec in rows],
                          [f"{name}:{line}" for line, _, _, _ in rows])
    priced = []
    for (line, rec, pre, dec), plan in zip(rows, checked):
        priced.append({**rec, "prefill": _side_text(pre, "x"), "decode": _side_text(dec, "@"),
                       **price_row(cm, pre, dec, plan, terms)})
    text = _render(priced, as_json)
    if out is None:
        sys.stdout.write(text)
        return
    from simulator.report.files import StagedFile
    with StagedFile(out) as staged:
        staged.path.write_text(text, encoding="utf-8")


def _render(rows: list[dict], as_json: bool) -> str:
    if as_json:
        return "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows)
    buf = io.StringIO()
    cols = list(dict.fromkeys(k for r in rows for k in r))   # JSON rows may differ in keys
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()

