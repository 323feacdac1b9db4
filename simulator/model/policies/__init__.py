"""The built-in scheduling policies, one module each (importing this package registers
them): ``fifo``, ``chunked``, ``priority_aging``, ``fair_score`` and ``static``. A user's policy is a
module like these, named in a scenario's ``plugins:`` list."""
from . import chunked, fair_score, fifo, priority_aging, static  # noqa: F401

__all__ = ["chunked", "fair_score", "fifo", "priority_aging", "static"]
