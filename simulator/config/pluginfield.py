"""A pydantic field type that validates a mapping through a plug-in registry."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator


def plugin(registry) -> Any:
    """Field annotation: validate by ``kind`` in ``registry``; dump as the chosen model."""
    return Annotated[Any, PlainValidator(registry.validate),
                     PlainSerializer(lambda v: v.model_dump(mode="json"), return_type=dict)]
