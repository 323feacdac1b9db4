"""``model``: the model served (a catalogue name, a shape, or a Hugging Face config)
and its step-cost model, with the checks that the two agree."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import Field, model_validator

from simulator.errors import LatsimError
from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS
from simulator.config.strict import StrictModel
from simulator.model.kv.blocks import kv_bytes_per_token


class ModelShape(StrictModel):
    """The served model's shape: what sets weight and KV memory. Filled from the
    catalogue when ``model.name`` names the model."""

    name: str = Field("llama3-8b", description="the shape's label (model.name fills it)")
    n_layers: int = Field(32, ge=1, description="transformer layers")
    d_model: int = Field(4096, ge=1, description="hidden size")
    n_heads: int = Field(32, ge=1, description="attention (query) heads")
    n_kv_heads: int = Field(8, ge=1, description="key/value heads (grouped-query attention)")
    head_dim: int = Field(128, ge=1, description="dimension of one head")
    params_b: float = Field(8.03, gt=0, description="parameters, billions")
    dtype_bytes: int = Field(2, ge=1, description="bytes of a K or V element (and of a "
                             "weight unless weight_dtype_bytes says otherwise)")
    weight_dtype_bytes: Optional[float] = Field(None, gt=0, description="bytes per weight "
                                                "(default: dtype_bytes)")

    @property
    def kv_bytes_per_token(self) -> int:
        return int(kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim,
                                      self.dtype_bytes))

    @property
    def weight_bytes(self) -> float:
        """Bytes of all the weights."""
        return self.params_b * 1e9 * (self.weight_dtype_bytes or self.dtype_bytes)


# The shape fields that say which model it is (a hand-typed shape must agree on them).
_SHAPE_DIMS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim")


def _field_error(loc: str, msg: str, value: Any):
    """A validation error naming ``model.<loc>`` and its value (one line)."""
    from pydantic_core import PydanticCustomError
    return PydanticCustomError("plugin_field", "{loc}: {msg}", {"loc": loc, "msg": msg,
                                                                "value": value})


def _bare(e: Exception) -> str:
    """A LatsimError's message without its ``field '...':`` head and ``(got ...)`` tail
    (the validation error names the field and value again)."""
    import re
    msg = str(e)
    msg = re.sub(r"^.*?field '[^']*': ", "", msg)
    return re.sub(r" \(got .*\)$", "", msg)


def _search_dirs(info) -> list[Path]:
    """Where a relative model or profile path is looked up: the scenario's folder (when
    the loader passes it as context ``base_dir``), the working directory, the checkout."""
    from simulator.cost.profile import profile_search_dirs
    ctx = getattr(info, "context", None) or {}
    base = ctx.get("base_dir") if isinstance(ctx, dict) else None
    return profile_search_dirs(base)


def _shape_of(arch, kv_bytes: float, weight_bytes: Optional[float]) -> "ModelShape":
    return ModelShape(name=arch.name, n_layers=arch.layers, d_model=arch.hidden,
                      n_heads=arch.heads, n_kv_heads=arch.kv_heads, head_dim=arch.head_dim,
                      params_b=arch.param_count() / 1e9, dtype_bytes=max(1, int(kv_bytes)),
                      weight_dtype_bytes=weight_bytes)


def _profile_model_check(name: Optional[str], shape: "ModelShape", path: str, dirs) -> None:
    """A measured profile must be of the scenario's model: its ``meta.model`` dimensions
    (or, lacking them, its catalogued name) must match (one-line error otherwise)."""
    import json

    from simulator.cost import catalog
    from simulator.cost.profile import resolve_profile_path
    # Found as the cost model will find it (scenario folder, cwd, checkout); a profile that
    # is not there is refused here: checking nothing would let another model's pass.
    try:
        found = resolve_profile_path(path, dirs)
    except LatsimError as e:
        raise _field_error("cost.path", _bare(e), path) from None
    try:
        meta = json.loads(found.read_text()).get("meta") or {}
    except (ValueError, OSError, AttributeError, RecursionError):
        return      # ... and an unreadable one (JSON nested too deeply too)
    m = meta.get("model")
    if not isinstance(m, dict):
        return
    theirs = {"n_layers": m.get("n_layers"), "d_model": m.get("d_model"),
              "n_heads": m.get("n_heads"), "n_kv_heads": m.get("n_kv_heads"),
              "head_dim": m.get("head_dim")}
    what = f"model.name {name!r}" if name else "model.shape"
    hint = ("; to carry a measurement to another model or GPU use model.cost: {kind: roofline, "
            f"gpu: ..., calibrate: {path}}}")
    for k, v in theirs.items():
        if isinstance(v, (int, float)) and int(v) != getattr(shape, k):
            raise _field_error("cost.path", f"{what} has {k} {getattr(shape, k)} but the "
                               f"profile's meta.model ({m.get('name')!r}) has {int(v)}{hint}",
                               path)
    if name and isinstance(m.get("name"), str) and not any(
            isinstance(v, (int, float)) for v in theirs.values()):
        try:
            same = catalog.model(name).name == catalog.model(m["name"]).name
        except Exception:  # noqa: BLE001 - an uncatalogued name cannot be compared
            return
        if not same:
            raise _field_error("cost.path", f"model.name {name!r} but the profile's "
                               f"meta.model.name is {m['name']!r}{hint}", path)


class ModelConfig(StrictModel):
    """The model and how its step cost is obtained. ``name`` (a catalogue name or a
    Hugging Face config.json path) fills ``shape`` from the catalogue; a hand-typed
    ``shape`` is kept for scenarios that name no model, and must agree with a named
    one. A roofline cost model takes its model from ``name``; a measured profile
    (``profile``, ``fitted``) must be of the named or shaped model."""

    name: Optional[str] = Field(None, description="catalogued model or config.json path")
    shape: ModelShape = Field(default_factory=ModelShape)
    cost: plugin(COST_MODELS) = Field(default_factory=lambda: COST_MODELS.validate(
        {"kind": "fitted", "path": "profiles/h200-llama3-8b-refbench.json"}))

    @model_validator(mode="after")
    def _coherent(self, info):
        # The cost model says how it relates to the model (``CostModel``,
        # ``simulator.cost.model``): whether it names the model itself, the formats it
        # fixes, the measured profile it reads.
        cost = self.cost
        dirs = _search_dirs(info)
        name = self.name
        if cost.describes_model:
            if name and cost.model and not _same_model(name, cost.model, dirs):
                raise _field_error("cost.model", f"names another model than model.name "
                                   f"({name!r}); give the model once, as model.name", cost.model)
            name = name or cost.model
            if not name:
                raise _field_error("name", "a roofline cost model needs the model: a catalogued "
                                   "name or a config.json path", None)
        if name is None:
            if cost.profile_path is not None and "shape" in self.model_fields_set:
                _profile_model_check(None, self.shape, cost.profile_path, dirs)
            return self
        try:
            from simulator.cost.roofline.model import model_arch
            arch = model_arch(name, dirs)
        except LatsimError as e:
            raise _field_error("name", _bare(e), name) from None
        # A config.json found relative to the scenario is kept by its absolute path, so
        # whatever reads the scenario later finds it from anywhere.
        if arch.source and Path(arch.source).is_file():
            name = str(Path(arch.source).resolve())
        try:
            formats = cost.model_formats(arch)
        except LatsimError as e:
            which = next((f for f in ("pp", "ep", "dp") if f"'{f}'" in str(e)), "tp")
            raise _field_error(f"cost.{which}", _bare(e), getattr(cost, which)) from None
        fixed = formats is not None     # the cost model's formats, not the shape's
        kv_bytes, w_bytes = formats if fixed else (2.0, None)
        derived = _shape_of(arch, kv_bytes, w_bytes)
        given = self.shape.model_fields_set if "shape" in self.model_fields_set else set()
        for k in _SHAPE_DIMS + (("dtype_bytes",) if fixed else ()):
            if k in given and getattr(self.shape, k) != getattr(derived, k):
                raise _field_error(f"shape.{k}", f"contradicts model.name {name!r}, whose "
                                   f"{k} is {getattr(derived, k)}; leave model.shape out when "
                                   f"naming the model", getattr(self.shape, k))
        keep = {k: getattr(self.shape, k) for k in given
                if k not in _SHAPE_DIMS and k != "name" and not fixed}
        self.shape = derived.model_copy(update=keep)
        self.name = name
        if cost.with_model(name) is not cost:
            self.cost = cost.with_model(name)
        if cost.profile_path is not None:
            _profile_model_check(name, self.shape, cost.profile_path, dirs)
        return self


def _same_model(a: str, b: str, dirs) -> bool:
    """Whether two model references resolve to the same catalogued shape."""
    from simulator.cost.roofline.model import model_arch
    try:
        x, y = model_arch(a, dirs), model_arch(b, dirs)
    except LatsimError:
        return a == b
    return (x.name, x.layers, x.hidden, x.heads, x.kv_heads) == (y.name, y.layers, y.hidden,
                                                                  y.heads, y.kv_heads)
