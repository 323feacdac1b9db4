"""Routers: which replica a request goes to when it reaches the serving region.

- ``round_robin``: replicas in turn.
- ``random``: uniformly at random (seeded).
- ``least_outstanding``: the replica with the fewest outstanding tokens (prompt
  tokens not yet prefilled plus output tokens not yet generated), ties to the
  lowest index.

Region-aware routers ("route each user to the nearest cluster") pick a
serving region when the client sends (``pick_region``; the request then pays that
region's RTT), and a replica inside it when the request arrives (``pick_in``, the
least outstanding one there):

- ``nearest_region``: the serving region with the smallest RTT from the client's
  region, whatever its load.
- ``region_load_rtt``: the region minimising ``load + penalty x RTT``, where load is
  the outstanding tokens of its least loaded replica and the penalty is
  ``network.regions.rtt_penalty_tokens_per_ms`` per ms of RTT: a farther region wins
  only when the near one's backlog exceeds the far one's by more than the RTT
  difference is worth.

Without ``network.regions`` both see one region and behave as ``least_outstanding``.
Region-unaware routers, with regions, pick their replica when the client sends, as a
global load balancer would, and the request pays the RTT to that replica's region.

- ``cache_aware`` (``prefix_router``): the replica holding the longest cached prefix
  of the prompt, traded against load with tunable weights.

``pick(replicas, seq)`` chooses among the replicas it is given (an index into that
list): all of them, or the ready ones of a fleet that an autoscaler resizes.
"""
from __future__ import annotations

from typing import Literal


from simulator.config.strict import StrictModel

from simulator.cluster.picks import first_least, next_in_turn
from simulator.config.registry import ROUTERS
from simulator.kernel import python_of
from simulator.wire.network import Topology

# Once per routed request from Python: the plain functions (no compiled dispatch).
_next_in_turn, _first_least = python_of(next_in_turn), python_of(first_least)


class RouterName(StrictModel):
    kind: Literal["round_robin", "random", "least_outstanding", "nearest_region",
                  "region_load_rtt"]


class RoundRobin:
    """Replicas in turn."""

    def __init__(self, n: int, rng) -> None:
        self.n, self.i = n, -1

    def pick(self, replicas, seq) -> int:
        self.i = _next_in_turn(self.i, len(replicas))
        return self.i


class RandomRouter:
    """A uniformly random replica."""

    def __init__(self, n: int, rng) -> None:
        self.n, self.rng = n, rng

    def pick(self, replicas, seq) -> int:
        return int(self.rng.integers(len(replicas)))


class LeastOutstanding:
    """The replica with the fewest outstanding tokens."""

    def __init__(self, n: int, rng) -> None:
        self.n = n

    def pick(self, replicas, seq) -> int:
        return _least_loaded(replicas, range(len(replicas)))[0]


def _least_loaded(replicas, candidates) -> tuple[int, int]:
    """(index, outstanding tokens) of the least loaded of ``candidates``, ties to the first
    (``picks.first_least``)."""
    load = [replicas[i].outstanding_tokens for i in candidates]
    j = _first_least(load, len(load))
    return candidates[j], load[j]


class NearestRegion:
    """The serving region nearest the client (smallest RTT, ties to the first listed);
    the least outstanding replica inside it."""

    def __init__(self, n: int, rng, topology: Topology | None = None) -> None:
        self.topo = topology if topology is not None else Topology.single(n)
        self.nearest = [int(i) for i in self.topo.rtt.argmin(axis=1)]

    def pick_region(self, replicas, client_region: int) -> int:
        return self.nearest[client_region]

    def pick_in(self, replicas, region: int) -> int:
        return _least_loaded(replicas, self.topo.region_replicas[region])[0]

    def pick(self, replicas, seq) -> int:
        cr = int(self.topo.client_region[seq.client % len(self.topo.client_region)])
        return self.pick_in(replicas, self.pick_region(replicas, cr))


class RegionLoadRTT(NearestRegion):
    """The serving region minimising its least loaded replica's outstanding tokens
    plus ``rtt_penalty_tokens_per_ms`` x RTT (ms); ties to the nearer, then the first."""

    def __init__(self, n: int, rng, topology: Topology | None = None) -> None:
        super().__init__(n, rng, topology)
        # Penalty per region pair in tokens, computed once.
        self.penalty = self.topo.rtt * 1000.0 * self.topo.rtt_penalty_tokens_per_ms

    def pick_region(self, replicas, client_region: int) -> int:
        pen = self.penalty[client_region]
        best, best_key = 0, None
        for j, cands in enumerate(self.topo.region_replicas):
            load = _least_loaded(replicas, cands)[1]
            key = (load + pen[j], pen[j])
            if best_key is None or key < best_key:
                best, best_key = j, key
        return best


class _Build:
    """``ROUTERS``' factory for a router class without parameters of its own: the
    registry calls it with ``(cfg, n, rng, topology)``; a region-aware router takes the
    topology too."""

    def __init__(self, cls, regional: bool = False) -> None:
        self.cls, self.regional = cls, regional

    def __call__(self, cfg, n: int, rng, topology: Topology | None = None):
        return self.cls(n, rng, topology) if self.regional else self.cls(n, rng)


ROUTERS.register("round_robin", RouterName, _Build(RoundRobin))
ROUTERS.register("random", RouterName, _Build(RandomRouter))
ROUTERS.register("least_outstanding", RouterName, _Build(LeastOutstanding))
ROUTERS.register("nearest_region", RouterName, _Build(NearestRegion, regional=True))
ROUTERS.register("region_load_rtt", RouterName, _Build(RegionLoadRTT, regional=True))


def make_router(name: str, n: int, rng, topology: Topology | None = None,
                params: dict | None = None):
    """Router by registered name (with its own ``params``, e.g. ``cache_aware``'s
    weights); region-aware ones use ``topology`` (default: one region)."""
    cfg = ROUTERS.validate({"kind": name, **(params or {})})
    return ROUTERS.build(cfg, n, rng, topology=topology)

