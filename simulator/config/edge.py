"""``edge``: a node between the clients and the cluster that answers some requests
itself, from a result cache (``cache``) or with a small model (``speculation``).

What the keys model is in ``simulator.cluster.edge`` (the request's way through the
edge, the timings) and ``simulator.cluster.edgecache`` (the cache and its popularity
laws). Every section forbids unknown keys; bad values are one-line errors naming the
field (``load_scenario``).
"""
from __future__ import annotations

from importlib import import_module
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS
from simulator.config.strict import StrictModel, checked_as


class PopularityConfig(StrictModel):
    """Which requests ask the same thing. ``zipf``: each request asks one of
    ``catalogue`` prompts, prompt ``k`` (1-based) with probability proportional to
    ``k^-exponent``, independently (the independent reference model); ``same_lengths``:
    a prompt's every request has the prompt and output lengths of its first one (the
    same prompt, the same answer). ``trace``: the workload's own prompt identity (a
    trace's ``hash_ids``: equal lists are the same prompt)."""

    kind: Literal["zipf", "trace"]
    # At most 1e7 prompts: the law's probabilities are an array of K floats, and
    # 1e8 (800 MB each, several of them) ran out of memory rather than failing here.
    catalogue: Optional[int] = Field(None, ge=1, le=10**7, strict=True,
                                     description="zipf: distinct prompts K (at most 1e7)")
    exponent: float = Field(1.0, ge=0, le=10, description="zipf: s")
    same_lengths: bool = Field(False, description="every request of a prompt takes its "
                               "first request's prompt and output lengths")

    @model_validator(mode="after")
    def _needs_catalogue(self):
        if self.kind == "zipf" and self.catalogue is None:
            raise ValueError("kind zipf needs catalogue (the number of distinct prompts)")
        return self


class EdgeCacheConfig(StrictModel):
    """Whole results cached at the edge, keyed by the prompt. LRU over ``capacity``
    entries (None: unbounded); an entry lives ``ttl_s`` from when it was fetched (None:
    forever; a hit does not extend it). A hit streams its answer from the edge at
    ``stream_tokens_per_s`` (None: the whole answer in one frame)."""

    popularity: PopularityConfig
    capacity: Optional[int] = Field(None, ge=1, le=10**8, strict=True,
                                    description="entries held, LRU (null: unbounded)")
    ttl_s: Optional[float] = Field(None, gt=0, description="an entry's life from its fetch "
                                   "(null: forever)")
    stream_tokens_per_s: Optional[float] = Field(None, ge=0.01, le=1e9, description="a "
                                                 "hit's tokens per second from the edge, at "
                                                 "least 0.01 (null: one frame)")


class EdgeSpeculationConfig(StrictModel):
    """A small model at the edge answers first. Each request the cache did not answer
    runs on one of ``servers`` edge GPUs (one request at a time each, first come first
    served), priced by ``cost`` (a ``model.cost`` entry: its catalogue model and GPU).
    Its answer is kept with probability ``acceptance``; otherwise the request is
    escalated to the cluster after the edge generated ``decide_after_tokens`` tokens
    (None: its whole answer, judged then)."""

    cost: plugin(COST_MODELS)
    acceptance: float = Field(ge=0, le=1, description="probability the edge's answer is kept")
    servers: int = Field(1, ge=1, le=100000, strict=True,
                         description="edge GPUs, one request at a time each, FCFS")
    gpus_per_server: int = Field(1, ge=1, le=64, strict=True)
    decide_after_tokens: Optional[int] = Field(None, ge=0, le=10**7, strict=True,
                                               description="tokens the edge generates "
                                               "before escalating (null: its whole answer)")
    gpu_cost_per_hour: Optional[float] = Field(None, ge=0, description="edge GPU price")
    engine: Optional[dict[str, Any]] = Field(
        None, description="the edge GPUs' engine section (policy, max_num_seqs, kv, ...): "
        "they run the engine loop, batching; null: one request at a time each")

    _engine = checked_as("engine", lambda: import_module("simulator.config.engine").EngineConfig)

    @model_validator(mode="after")
    def _model_named(self):
        # A cost model that prices a catalogued model must name it (``CostModel``).
        if self.cost.describes_model and self.cost.model is None:
            raise ValueError("cost: a roofline edge model needs model (a catalogued model, "
                             "e.g. llama-3.2-1b)")
        return self


class EdgeConfig(StrictModel):
    """The edge node: ``rtt_ms`` between a client and it, ``lookup_ms`` it spends on
    each request before answering or forwarding it, and what it runs. The scenario's
    ``network`` is then the way from the edge to the cluster (the WAN)."""

    rtt_ms: float = Field(5.0, ge=0, le=1e6, description="client <-> edge round trip")
    lookup_ms: float = Field(0.0, ge=0, le=1e6, description="edge time per request "
                             "before it answers or forwards it")
    cache: Optional[EdgeCacheConfig] = None
    speculation: Optional[EdgeSpeculationConfig] = None

    @model_validator(mode="after")
    def _something(self):
        if self.cache is None and self.speculation is None:
            raise ValueError("an edge needs cache or speculation (or leave edge out)")
        return self


# Workload kinds whose requests carry no prompt identity (``hash_ids``) by construction.
_NO_PROMPT_IDS = ("synthetic",)


def check_edge(sc) -> None:
    """What the edge cannot do with the scenario's workload, refused when it is read
    (``ValueError`` naming the field): a ``trace`` popularity on a workload kind with no
    prompt identities, and closed-loop sessions (the edge is planned from the arrivals;
    a session's next turn is sent when the previous answer is back); and an edge
    engine whose scenario does not hold together (``edgeengine.edge_scenario``)."""
    kind = getattr(sc.workload, "kind", None)
    edges = [("edge", sc.edge)] + [
        (f"policies ({p.name!r}): edge", p.edge_of(sc))
        for p in sc.policies or [] if not isinstance(p, str) and p.edge]
    for where, e in edges:
        if e is None:
            continue
        if kind == "sessions":
            raise ValueError(f"{where}: an edge node is not modelled with closed-loop "
                             f"sessions (workload kind sessions)")
        if e.speculation is not None and e.speculation.engine is not None:
            from simulator.cluster.edgeengine import check_edge_engine
            check_edge_engine(sc, e.speculation, f"{where}.speculation")
        if e.cache is not None and e.cache.popularity.kind == "trace" and kind in _NO_PROMPT_IDS:
            raise ValueError(f"{where}.cache.popularity.kind: trace needs a workload with "
                             f"prompt identities (a trace's hash_ids); kind {kind} has none: "
                             f"use kind zipf")
