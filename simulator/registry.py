"""``Registry``: the one type every plug-in family is registered in (policies, arrival
processes, length distributions, workload sources, cost models, routers), GuideLLM
style: a name (a ``kind:`` field or a policy name) maps to a pydantic config class and
a factory. A config field typed with ``config.pluginfield.plugin(REGISTRY)`` validates a
mapping by looking up its ``kind``, so a new plug-in needs one ``register`` call and no
edit to the schema. The families are ``config.registry``'s and
``model.scheduling.POLICIES``. The built-in plug-ins are *declared* by the composition
root, ``config.plugins`` (``declare``: a name and the module whose import registers it),
and a module is imported only when one of its names is first looked up: a run imports
the plug-ins it uses, while every name is listed, validated and offered in errors at
once.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Generic, Optional, Tuple, Type, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named plug-ins of one family: ``name -> (config class, factory)``. A family whose
    plug-ins are classes (policies) registers the class as its factory."""

    def __init__(self, what: str, default: Optional[str] = None) -> None:
        self.what = what
        self.default = default
        self._items: Dict[str, Tuple[Type[BaseModel], Optional[Callable[..., T]]]] = {}
        # Declared names not registered yet: name -> the module whose import registers it.
        self._lazy: Dict[str, str] = {}
        # The family's contract, where it has one: ``check(config_cls)`` lists what a
        # config class lacks (``cost.model`` sets it for cost models).
        self.check: Optional[Callable[[type], list]] = None

    def register(self, name: str, config_cls: Type[BaseModel],
                 factory: Optional[Callable[..., T]] = None) -> None:
        """Add ``name``; the same entry again is a no-op, another one an error, and so is
        a config class that lacks what the family's ``check`` asks for."""
        missing = self.check(config_cls) if self.check is not None else []
        if missing:
            raise TypeError(f"{self.what} {name!r}: {config_cls.__name__} lacks "
                            f"{', '.join(missing)}")
        self._resolve(name)   # a declared built-in is registered first, as if imported
        if name in self._items and self._items[name] != (config_cls, factory):
            raise RuntimeError(f"{self.what} {name!r} registered twice")
        self._items[name] = (config_cls, factory)
        self._lazy.pop(name, None)

    def declare(self, name: str, module: str) -> None:
        """``name`` is registered by importing ``module``: known at once (in ``names``,
        ``in``, errors), the module imported when the name is first looked up."""
        if name not in self._items:
            self._lazy[name] = module

    def _resolve(self, name: str) -> None:
        """Import the module a declared ``name`` is registered by, unless that module is
        being imported right now (then its own ``register`` call is on its way)."""
        module = self._lazy.get(name)
        if module is None:
            return
        running = sys.modules.get(module)
        if running is not None and getattr(running.__spec__, "_initializing", False):
            return
        importlib.import_module(module)
        self._lazy.pop(name, None)
        if name not in self._items:
            raise RuntimeError(f"{self.what} {name!r}: importing {module} did not register it")

    def unregister(self, name: str) -> None:
        """Take ``name`` out (a plug-in a test or a notebook registered for a while);
        an unknown name is a no-op."""
        self._items.pop(name, None)
        self._lazy.pop(name, None)

    def names(self) -> list[str]:
        return sorted({*self._items, *self._lazy})

    def __iter__(self):
        return iter(self.names())

    def builtin_names(self) -> list[str]:
        """The names latsim itself registers (its factory, or its config class where it
        has none, defined in the ``simulator`` package): what the YAML reference
        documents, whatever plug-ins a process has loaded since."""
        def ours(item) -> bool:
            obj = item[1] if item[1] is not None else item[0]
            return getattr(obj, "__module__", "").split(".")[0] == "simulator"
        lazy = [n for n, m in self._lazy.items() if m.split(".")[0] == "simulator"]
        return sorted([n for n, item in self._items.items() if ours(item)] + lazy)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._items or name in self._lazy)

    def factory(self, name: str) -> Callable[..., T]:
        """What ``name`` builds with; ``ValueError`` naming the known ones."""
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}")
        self._resolve(name)
        return self._items[name][1]

    def holder(self, name: str) -> Optional[Callable[..., T]]:
        """What ``name`` is registered to build with, None if nothing (yet: a declared
        name whose module is registering it now)."""
        self._resolve(name)
        item = self._items.get(name)
        return None if item is None else item[1]

    def config_class(self, name: str) -> Type[BaseModel]:
        return self._lookup(name)[0]

    def build(self, cfg: BaseModel, *args: Any, **kwargs: Any) -> T:
        factory = self._lookup(cfg.kind)[1]  # type: ignore[attr-defined]
        if factory is None:
            raise RuntimeError(f"{self.what} {cfg.kind!r} has no factory")  # type: ignore[attr-defined]
        return factory(cfg, *args, **kwargs)

    def _lookup(self, name: str):
        self._resolve(name)
        if name not in self._items:
            raise KeyError(name)
        return self._items[name]

    def validate(self, value: Any) -> BaseModel:
        """Validate a mapping (or an already built config) against its ``kind``."""
        if isinstance(value, BaseModel):
            return value
        if not isinstance(value, dict):
            raise PydanticCustomError("plugin_type", "expected a mapping with a 'kind' key")
        kind = value.get("kind", self.default)
        if not isinstance(kind, str) or kind not in self:
            raise PydanticCustomError(
                "plugin_kind", "unknown {what} kind '{kind}'; known: {known}",
                {"what": self.what, "kind": kind, "known": ", ".join(self.names())})
        cls = self._lookup(kind)[0]
        data = dict(value)
        data.setdefault("kind", kind)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            msg, value = err["msg"].removeprefix("Value error, "), err.get("input")
            if err["type"] == "plugin_field":
                # A plug-in nested in this one: fold its location and value into ours.
                ctx = err["ctx"]
                loc = ".".join(p for p in (loc, ctx["loc"]) if p)
                msg, value = ctx["msg"], ctx["value"]
            elif err["type"] == "extra_forbidden":
                msg = "unknown key"
            raise PydanticCustomError("plugin_field", "{loc}: {msg}",
                                      {"loc": loc, "msg": msg, "value": value}) from None
