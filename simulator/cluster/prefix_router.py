"""``cache_aware``: a router that sends a request where its prompt's prefix is cached,
traded against load, as llm-d's inference scheduler and SGLang's router do.

Each ready replica gets three scores in [0, 1] and the request goes to the highest
``prefix_weight x prefix + load_weight x load + kv_weight x kv`` (llm-d's weighted
scorers: ``prefix-cache-scorer``, ``queue-scorer``, ``kv-cache-utilization-scorer``):

- ``prefix``: the share of the prompt the replica's KV cache holds as a leading run of
  blocks (what an admission there would skip prefilling), read from the replica's
  block manager (``PrefixKV``) with the request's prefix keys (``prefixkeys``) - the
  precise view llm-d gets from KV-cache events; 0 everywhere without prefix caching;
- ``load``: ``(max - o) / (max - min)`` of the replicas' outstanding tokens ``o``
  (prompt tokens not yet prefilled plus output tokens not yet generated), 1 for all
  when they are equal;
- ``kv``: ``1 - blocks reserved / capacity``.

Ties go to the fewest outstanding tokens, then the lowest index. ``load_weight`` 0 is
pure cache affinity (a hot prefix piles onto one replica); ``prefix_weight`` 0 is a
load balancer.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from simulator.config.strict import StrictModel

from simulator.config.registry import ROUTERS


class CacheAwareConfig(StrictModel):
    """``cluster.router: {kind: cache_aware, prefix_weight, load_weight, kv_weight}``."""

    kind: Literal["cache_aware"] = "cache_aware"
    prefix_weight: float = Field(1.0, ge=0, description="weight of the cached-prefix share")
    load_weight: float = Field(1.0, ge=0, description="weight of the outstanding-token score")
    kv_weight: float = Field(0.0, ge=0, description="weight of the free-KV share")


class CacheAware:
    """See module doc."""

    def __init__(self, cfg: CacheAwareConfig) -> None:
        self.wp, self.wl, self.wk = cfg.prefix_weight, cfg.load_weight, cfg.kv_weight
        self.picks = 0
        self.hit_picks = 0      # picks of a replica holding part of the prompt

    def scores(self, replicas, seq) -> list[tuple[float, float, float]]:
        """``(prefix, load, kv)`` of each replica for ``seq``."""
        loads = [r.outstanding_tokens for r in replicas]
        lo, hi = min(loads), max(loads)
        out = []
        for r, o in zip(replicas, loads):
            mgr = r.kv.manager
            keys = seq.keys       # an int64 array (``prefixkeys``) or None
            hit = mgr.admission(seq.prompt_tokens, keys)[0] if keys is not None \
                and len(keys) else 0
            load = (hi - o) / (hi - lo) if hi > lo else 1.0
            out.append((hit / seq.prompt_tokens, load, 1.0 - mgr.num_used / mgr.capacity))
        return out

    def pick(self, replicas, seq) -> int:
        best, best_key = 0, None
        sc = self.scores(replicas, seq)
        for i, ((p, load, kv), r) in enumerate(zip(sc, replicas)):
            key = (self.wp * p + self.wl * load + self.wk * kv, -r.outstanding_tokens, -i)
            if best_key is None or key > best_key:
                best, best_key = i, key
        self.picks += 1
        self.hit_picks += sc[best][0] > 0
        return best


ROUTERS.register("cache_aware", CacheAwareConfig,
                 lambda cfg, n, rng, topology=None: CacheAware(cfg))
