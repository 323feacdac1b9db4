"""Reading a scenario file safely: a size cap, YAML without alias bombs, plain values
only (no tag that smuggles in another type), numbers that fit the event loops, and
``--set`` overrides applied to the parsed tree."""
from __future__ import annotations

import copy
import math
from typing import Any

import yaml

from simulator.errors import LatsimError


MAX_SCENARIO_BYTES = 16 * 2**20   # a scenario is a few KB; this only stops a wrong file
MAX_ALIAS_EXPANSION = 100_000     # nodes YAML aliases may add to a document ("billion laughs")
INT_LIMIT = 2**63                 # every integer ends up in an int64 array or kernel


def _expanded_size(root) -> int:
    """How many nodes the YAML node graph ``root`` stands for once every alias is
    expanded, computed on the graph (aliases are shared nodes) without expanding it;
    ``LatsimError`` for a recursive alias."""
    from yaml.nodes import MappingNode, SequenceNode
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = (node.value if isinstance(node, SequenceNode) else
                    [x for kv in node.value for x in kv] if isinstance(node, MappingNode) else [])
            size[key] = min(1 + sum(size[id(k)] for k in kids), 2**62)
            continue
        if key in size:
            continue
        if key in on_path:
            raise LatsimError("a YAML alias refers to itself (a recursive structure)")
        on_path.add(key)
        stack.append((node, True))
        if isinstance(node, SequenceNode):
            stack.extend((k, False) for k in node.value if id(k) not in size)
        elif isinstance(node, MappingNode):
            stack.extend((x, False) for kv in node.value for x in kv if id(x) not in size)
    return size[id(root)]


def _nodes(root):
    """Every node of the graph as written, once (an alias target once)."""
    from yaml.nodes import MappingNode, SequenceNode
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node, SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, MappingNode):
            stack.extend(x for kv in node.value for x in kv)


def _distinct_nodes(root) -> int:
    """Nodes in the graph as written (each alias target once)."""
    return sum(1 for _ in _nodes(root))


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# The plain types a scenario is made of: strings, numbers, booleans, null, lists and
# mappings (with ``<<`` merges). Every other tag the safe loader knows builds another
# Python type that no field takes and no error message quotes well: ``!!binary``
# (bytes), ``!!timestamp`` (a datetime), ``!!set``, ``!!omap`` / ``!!pairs`` (lists of
# tuples); ``!!python/...`` and local ``!tags`` are never built.
_CORE = "tag:yaml.org,2002:"
PLAIN_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "map",
                                            "seq", "merge"))


def _check_plain_tags(root) -> None:
    """Refuse a node tagged as anything but a plain type (``PLAIN_TAGS``), naming the
    field it is at (``a.b[2].c``), its line and the tag."""
    from yaml.nodes import MappingNode, ScalarNode, SequenceNode
    seen: set[int] = set()
    stack = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag not in PLAIN_TAGS:
            tag = node.tag[len(_CORE):] if node.tag.startswith(_CORE) else node.tag
            tag = tag if tag.startswith("!") else "!!" + tag
            raise LatsimError(f"YAML tag {tag} at line {node.start_mark.line + 1} is not "
                              "allowed: a scenario holds plain values (text, numbers, "
                              "true/false, lists, mappings); write the value without the "
                              "tag", field=path or None)
        if isinstance(node, SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
        elif isinstance(node, MappingNode):
            for k, v in node.value:
                name = str(k.value) if isinstance(k, ScalarNode) else "?"
                stack.append((k, path or name))
                stack.append((v, f"{path}.{name}" if path else name))


def _check_unique_keys(root) -> None:
    """A mapping that names a key twice is refused (YAML would keep the last silently:
    a scenario with two ``seed:`` lines runs with the second), naming the line."""
    from yaml.nodes import MappingNode, ScalarNode
    for node in _nodes(root):
        if not isinstance(node, MappingNode):
            continue
        keys: dict = {}
        for k, _ in node.value:
            if isinstance(k, ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in keys:
                    raise LatsimError(f"key {k.value!r} at line {k.start_mark.line + 1} "
                                      f"repeats the one at line {keys[k.value]}: a key may "
                                      "appear once in a mapping", field=str(k.value))
                keys[k.value] = k.start_mark.line + 1


class BoundedLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """YAML's safe loader that refuses a document whose aliases expand it by more than
    ``MAX_ALIAS_EXPANSION`` nodes, or refer to themselves, that names a key twice in
    one mapping, or that tags a value as another type than a plain one (``!!binary``,
    ``!!set``, ...): the node graph is checked after composition, before anything is
    built from it. An unquoted date (``2024-01-01``) is read as the text it is, not as
    a datetime no field takes."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag != _CORE + "timestamp"]
        for first, rules in _BaseLoader.yaml_implicit_resolvers.items()}

    def get_single_node(self):
        """The document's node graph, refused when its aliases expand it too far or a
        mapping repeats a key."""
        node = super().get_single_node()
        if node is not None:
            extra = _expanded_size(node) - _distinct_nodes(node)
            if extra > MAX_ALIAS_EXPANSION:
                raise LatsimError(f"YAML aliases expand the document by {extra:,} nodes, over "
                                  f"the limit of {MAX_ALIAS_EXPANSION:,} (a 'billion laughs' "
                                  "file?)")
            _check_unique_keys(node)
            _check_plain_tags(node)
        return node


def _load_bounded(text: str, source: str) -> Any:
    """``BoundedLoader`` on ``text``: its bounds and deep nesting are ``LatsimError``s
    naming ``source``; a syntax error stays a ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 (a safe loader)
    except LatsimError as e:
        raise LatsimError(str(e), source=source) from None
    except RecursionError:
        raise LatsimError("invalid YAML: nested too deeply", source=source) from None


def safe_yaml(text: str, source: str) -> Any:
    """Parse YAML text with ``BoundedLoader``; one-line ``LatsimError`` on any problem."""
    try:
        return _load_bounded(text, source)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise LatsimError(f"invalid YAML{where}: {problem}", source=source) from None
    except (ValueError, TypeError, OverflowError) as e:   # e.g. a timestamp out of range
        raise LatsimError(f"invalid YAML: {e}", source=source) from None


def check_numbers(data: Any, source: str, prefix: str = "") -> None:
    """Every float in a scenario mapping is finite and every integer fits 64 bits: a
    ``.inf`` rate or a ``.nan`` time is an error naming its field, before anything runs."""
    stack = [(prefix, data)]
    seen: set[int] = set()
    while stack:
        path, v = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise LatsimError("must be a finite number", source=source, field=path or None,
                                  value=v, has_value=True)
        elif isinstance(v, int):
            if not -INT_LIMIT < v < INT_LIMIT:
                raise LatsimError("integer out of range (at most 2^63 - 1 in magnitude)",
                                  source=source, field=path or None, value=v, has_value=True)
        elif isinstance(v, (dict, list, tuple)):
            if id(v) in seen:
                continue
            seen.add(id(v))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                key = f"{path}[{k}]" if not isinstance(v, dict) else (
                    f"{path}.{k}" if path else str(k))
                stack.append((key, x))


def _set_path(data: dict, dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise LatsimError("cannot set a key inside a non-mapping", source=source, field=dotted)
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str, source: str = "--set") -> tuple[str, Any]:
    """``a.b=value`` -> ``("a.b", parsed value)``; the value is read as YAML (bounded as a
    scenario file is). ``source`` names the option in errors (``--set``, ``--grid``)."""
    if "=" not in text:
        raise LatsimError("must look like a.b=value", source=source, value=text,
                          has_value=True)
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p.strip() for p in key.split(".")):
        raise LatsimError("the key before '=' is empty", source=source, value=text,
                          has_value=True)
    if not raw.strip():
        return key, ""
    try:
        val = _load_bounded(raw, source)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError):
        val = raw   # not YAML: the text itself (e.g. a name with a colon)
    return key, val


def apply_overrides(data: dict, overrides: list[str] | None, source: str = "--set") -> dict:
    """Return a deep copy of ``data`` with every ``a.b=value`` override applied."""
    try:
        out = copy.deepcopy(data)
    except RecursionError:
        raise LatsimError("the scenario is nested too deeply", source=source) from None
    for text in overrides or []:
        key, val = parse_override(text)
        _set_path(out, key, val, source)
    return out
