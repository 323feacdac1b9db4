"""The base of every section of the scenario tree: unknown keys, non-finite numbers and
``true`` / ``false`` where a number belongs are errors."""
from __future__ import annotations

import types
import typing

from typing import Callable, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


def _wants_number(annotation) -> bool:
    """Whether a field typed ``annotation`` takes numbers but not booleans (``int``,
    ``float``, ``Optional`` of them, a union of them with other non-bool types)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return bool not in args and any(a in (int, float) for a in args)
    return False


class StrictModel(BaseModel):
    """The scenario tree's base model: unknown keys, non-finite floats and booleans
    where numbers belong are errors."""

    # Unknown keys are errors; so is a float that is not finite (inf, nan).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data):
        # Pydantic reads ``true`` as 1 for an int field: ``num_requests: true`` would run
        # one request. A boolean where a number belongs is a mistake, not a number.
        # Handed on as the word it was written as, it fails that field's own number check
        # (the error then names the field and the value).
        if isinstance(data, dict):
            for name, f in cls.model_fields.items():
                key = f.alias or name
                v = data.get(key)
                if isinstance(v, bool) and _wants_number(f.annotation):
                    data = {**data, key: str(v).lower()}
        return data


def checked_as(field: str, model: Union[type, Callable[[], type]]):
    """A validator for a section kept as the mapping it was written as (a ``policies``
    entry's partial section, merged into the scenario's later) but checked as ``model``
    when the scenario is read, so unknown keys and bad values fail at load time.
    ``model``: the config class, or a function returning it (to import it late)."""
    def check(cls, v):
        if v is not None:
            m = model if isinstance(model, type) else model()
            m.model_validate(v)
        return v
    return field_validator(field)(classmethod(check))
