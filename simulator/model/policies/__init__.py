"""The built-in scheduling policies, one module each (importing this package registers
them): ``fifo``, ``chunked``, ``priority_aging``, ``fair_score``, ``static``,
``sjf`` (shortest job first) and ``edf`` (earliest TTFT deadline first). A user's policy is a
module like these, named in a scenario's ``plugins:`` list."""
from . import chunked, edf, fair_score, fifo, priority_aging, sjf, static  # noqa: F401

__all__ = ["chunked", "edf", "fair_score", "fifo", "priority_aging", "sjf", "static"]
