"""How a number reads in a console table cell (every report table formats through it)."""
from __future__ import annotations

import math


def fmt(v, digits: str = ".2f") -> str:
    """A number for a table cell: thousands separators, '-' for missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:,{digits}}"
    return str(v)
