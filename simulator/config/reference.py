"""The scenario's YAML reference, generated from the typed tree itself.

Every key a scenario may hold is a field of a pydantic model under ``Scenario``
(``config.scenario``), or of a plug-in's config (a ``kind:`` looked up in a registry,
``config.registry``: workloads, arrival processes, length distributions, cost models,
routers; and ``model.scheduling.POLICIES``: a policy's parameters, ``engine.policy: {kind:
name, ...}``). ``markdown()`` walks them all and writes one table per top-level section and
one per plug-in kind: the key's dotted path, its default and its description (the
field's ``description``, else the first sentence of its model's docstring). README.md's
*YAML reference* is this text between its markers; ``tests/test_docs.py`` checks that
they agree, so a key added to the tree without being documented fails a test.

``python -m simulator.config.reference`` prints it (paste it between the markers).
"""
from __future__ import annotations

import enum
import typing
from typing import Any, Iterator, Optional

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

BEGIN = "<!-- BEGIN python -m simulator.config.reference -->"
END = "<!-- END python -m simulator.config.reference -->"


def _registry_of(info: FieldInfo):
    """The registry a ``plugin(REGISTRY)`` field validates through, or None."""
    for meta in [*info.metadata, *_annotated_meta(info.annotation)]:
        func = getattr(meta, "func", None)
        reg = getattr(func, "__self__", None)
        if reg is not None and hasattr(reg, "names") and hasattr(reg, "config_class"):
            return reg
    return None


def _annotated_meta(ann) -> list:
    out = []
    for a in (ann, *typing.get_args(ann)):
        out += list(getattr(a, "__metadata__", ()))
        for b in typing.get_args(a):
            out += list(getattr(b, "__metadata__", ()))
    return out


def _models(ann) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``Optional[X]``, ``list[X]``, unions)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    out = []
    for a in typing.get_args(ann):
        for m in _models(a):
            if m not in out:
                out.append(m)
    return out


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        try:
            v = info.default_factory()
        except TypeError:
            return ""
    else:
        v = info.default
    if v is PydanticUndefined:
        return ""
    if isinstance(v, BaseModel) or (isinstance(v, (list, tuple)) and v
                                     and isinstance(v[0], BaseModel)):
        return ""
    if isinstance(v, enum.Enum):
        v = v.value
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)) and not v:
        return "[]"
    if isinstance(v, dict) and not v:
        return "{}"
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


def _first_sentence(doc: Optional[str]) -> str:
    if not doc:
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    cut = para.find(". ")
    return para if cut < 0 else para[:cut + 1]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _choices(ann) -> list[str]:
    """The values a ``Literal`` annotation (or an Optional of one) allows."""
    if typing.get_origin(ann) is typing.Literal:
        return [str(a) for a in typing.get_args(ann)]
    out = []
    for a in typing.get_args(ann):
        out += [c for c in _choices(a) if c not in out]
    return out


def _kind_of(model: type[BaseModel]) -> Optional[str]:
    """The one ``kind`` value a model takes (its default, or its one-value Literal)."""
    f = model.model_fields.get("kind")
    if f is None:
        return None
    if isinstance(f.default, str):
        return f.default
    choices = _choices(f.annotation)
    return choices[0] if len(choices) == 1 else None


def rows(model: type[BaseModel], prefix: str, seen: tuple = ()) -> Iterator[tuple]:
    """``(path, default, description)`` of every key under ``model``, depth first. A key
    holding one of several models told apart by ``kind`` lists each model's keys with
    ``(kind: X)``."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        subs = [m for m in _models(info.annotation) if m not in seen]
        reg = _registry_of(info)
        desc = info.description or ""
        if not desc and len(subs) == 1:
            desc = _first_sentence(subs[0].__doc__)
        if reg is not None and not desc:
            desc = f"{reg.what}, `kind`: {', '.join(reg.builtin_names())} (tables below)"
        elif reg is not None:
            desc += f" ({reg.what}: tables below)"
        kinds = [_kind_of(m) for m in subs]
        if len(subs) > 1 and all(kinds):
            desc = (desc + "; " if desc else "") + "`kind`: " + ", ".join(kinds)
        else:
            choices = _choices(info.annotation)
            if choices and not subs:
                desc = (desc + "; " if desc else "") + "one of " + ", ".join(choices)
        yield path, _default(info), desc
        for m in subs:
            if len(subs) > 1 and _kind_of(m):
                for p, d, t in rows(m, path + ".", seen + (model,)):
                    if p != f"{path}.kind":
                        yield f"{p} (kind: {_kind_of(m)})", d, t
            else:
                yield from rows(m, path + ".", seen + (model,))


def _table(items) -> list[str]:
    out = ["| key | default | what |", "|---|---|---|"]
    for path, default, desc in items:
        out.append(f"| `{path}` | {_cell(default) and '`' + _cell(default) + '`'} | {_cell(desc)} |")
    return out


def markdown() -> str:
    """The reference as markdown: the scenario's sections, then every plug-in kind."""
    import simulator.config.plugins  # noqa: F401  (the built-in plug-ins register)
    from simulator.config import registry as R
    from simulator.config.scenario import Scenario

    out: list[str] = []
    top = [(n, i) for n, i in Scenario.model_fields.items()]
    plain = [(n, i) for n, i in top if not _models(i.annotation) and _registry_of(i) is None]
    out += ["Top-level keys:", ""] + _table((n, _default(i), i.description or "")
                                            for n, i in plain) + [""]
    for name, info in top:
        if (name, info) in plain:
            continue
        reg = _registry_of(info)
        if reg is not None:
            out += [f"`{name}`: a {reg.what}, by `kind` (tables below).", ""]
            continue
        out += [f"`{name}`:", ""] + _table(rows(_models(info.annotation)[0], f"{name}.")) + [""]
    from simulator.model.scheduling.policy import POLICIES   # engine.policy: {kind: ...}
    regs = [getattr(R, n) for n in dir(R) if isinstance(getattr(R, n), R.Registry)]
    regs.append(POLICIES)
    for reg in sorted(regs, key=lambda r: r.what):
        for kind in reg.builtin_names():     # not the plug-ins a process loaded
            cls = reg.config_class(kind)
            items = [r for r in rows(cls, "") if r[0] != "kind"]
            head = f"{reg.what} `kind: {kind}`"
            doc = _first_sentence(cls.__doc__)
            out += [f"{head}{': ' + doc if doc else ''}", ""]
            out += (_table(items) if items else ["(no other keys)"]) + [""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
