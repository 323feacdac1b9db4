"""The workload interface: a batch of requests as arrays, whatever produced them.

Every workload source (synthetic arrival processes, trace replay, ServeGen
synthesis) builds a ``Workload``. The model reads nothing else, so a new source
only has to produce these arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass
class Workload:
    """Requests sorted by arrival time.

    ``arrival_s``: client send times (s, from 0); ``prompt_tokens``/``output_tokens``:
    token counts (>= 1); ``priority``: class index (0 = P0 = most urgent);
    ``hash_ids``: optional per-request prefix-block hash ids (Mooncake style), or None;
    ``client``: optional client index per request (connection pools are per client).
    ``shared_prefix_tokens``: optional leading prompt tokens each request shares with
    every other request of its priority class (a class's system prompt), or None.
    ``class_names``: display name of each priority index.
    """

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    priority: np.ndarray
    class_names: tuple[str, ...] = ("default",)
    hash_ids: Optional[Sequence[np.ndarray]] = None
    client: Optional[np.ndarray] = None
    shared_prefix_tokens: Optional[np.ndarray] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrival_s = np.asarray(self.arrival_s, dtype=np.float64)
        self.prompt_tokens = np.asarray(self.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(self.output_tokens, dtype=np.int64)
        self.priority = np.asarray(self.priority, dtype=np.int64)
        n = len(self.arrival_s)
        for name in ("prompt_tokens", "output_tokens", "priority"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"workload column {name} has {len(getattr(self, name))} rows, expected {n}")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("workload arrivals must be sorted")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError("workload token counts must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)
