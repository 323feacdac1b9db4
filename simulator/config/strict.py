"""The base of every section of the scenario tree: unknown keys and non-finite
numbers are errors."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    # Unknown keys are errors; so is a float that is not finite (inf, nan).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
