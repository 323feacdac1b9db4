"""The random streams of one run, drawn from its seed in one fixed layout.

A run is a pure function of ``(scenario, seed)``: nothing global is touched, and each
concern that draws random numbers has its own ``numpy.random.Generator``, spawned
from ``numpy.random.SeedSequence(seed)``. A stream is a child of the seed at a fixed
index (``STREAMS``), so adding a concern (appended at the end) leaves every earlier
stream, hence every run that does not use it, unchanged; and a caller that needs
only one stream (``latsim run`` building the traffic once for every policy, the edge
node seeing the same requests as a run without it) takes that one from here instead
of re-deriving the layout.

- ``workload``: arrivals, lengths, classes (``simulator.workload``);
- ``network``: per-request network draws (``simulator.wire``);
- ``router``: the router's random picks (``simulator.cluster.routers``);
- ``cost``: step-cost noise (``simulator.cost``);
- ``link``, ``disconnect``: per-client downlinks and client disconnects;
- ``traffic``: client backoff jitter (``simulator.cluster.admission``);
- ``speculative``: speculative decoding's acceptance draws (``model.speculative``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: The children of the seed, in spawn order (a new one goes at the end).
STREAMS = ("workload", "network", "router", "cost", "link", "disconnect", "traffic",
           "speculative")


class RunStreams(NamedTuple):
    """One generator per concern (``STREAMS``), for one run."""
    workload: np.random.Generator
    network: np.random.Generator
    router: np.random.Generator
    cost: np.random.Generator
    link: np.random.Generator
    disconnect: np.random.Generator
    traffic: np.random.Generator
    speculative: np.random.Generator


def _child(seed: int, name: str) -> np.random.SeedSequence:
    # SeedSequence(seed).spawn(n)[i] is the child with spawn_key (i,): made directly.
    return np.random.SeedSequence(seed, spawn_key=(STREAMS.index(name),))


def run_streams(seed: int) -> RunStreams:
    """Every stream of the run seeded ``seed``."""
    return RunStreams(*(np.random.default_rng(s)
                        for s in np.random.SeedSequence(seed).spawn(len(STREAMS))))


def stream(seed: int, name: str) -> np.random.Generator:
    """The one stream ``name`` of the run seeded ``seed`` (the same generator state as
    ``getattr(run_streams(seed), name)``)."""
    return np.random.default_rng(_child(seed, name))
