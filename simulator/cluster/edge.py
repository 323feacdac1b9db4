"""The edge node in front of the cluster (``edge``): a result cache and a small model
that answer some requests near the client, and the cluster for the rest (the mechanism
as ``data/README.md``, *Facts from two design articles*, gives it).

A request's way (``h`` = ``edge.rtt_ms`` / 2, ``L`` = ``edge.lookup_ms``): it reaches
the edge at ``t_e = arrival + h + L`` (``enqueued``). Then, in this order:

- **cache hit** (``edgecache``): no engine work. ``scheduled = first_token =
  last_token`` = when the entry is there (``t_e``, or the end of the fetch still in
  flight it waits on: its ``T_queue``); the first token reaches the client ``h``
  later and the rest follow at ``stream_tokens_per_s`` (or in the same frame). With
  no wait: E2E = edge RTT + L + (N - 1) / rate, exactly.
- **edge model** (``speculation``): the request waits for one of ``servers`` edge
  GPUs (first come first served, one request at a time each; ``scheduled``), which
  runs the small model's prefill and then its decode steps at batch 1, each step
  priced by the edge's own cost model (``cost``: its ``step_time`` and
  ``decode_times``, the project's cost models, called, not copied). With probability
  ``acceptance`` (one draw per request) its answer is kept: ``first_token`` after the
  prefill, ``last_token`` after the N - 1 decode steps, each token ``h`` later at the
  client. Otherwise the edge stops after ``decide_after_tokens`` tokens (None: its
  whole answer) and escalates: the request leaves for the cluster then.
- **to the cluster**: a miss (or an escalated request) is sent over the scenario's
  ``network``, which is now the WAN from the edge to the cluster, and served there as
  any request; its frames take ``h`` more from the edge to the client. Its ``T_net``
  holds ``h + L`` and the edge's time (escalated: edge time + WAN + central).

Everything at the edge is decided before the cluster runs (``plan_edge``): the cache
and the edge queue depend on arrivals only. The cluster then runs the requests sent
to it (``edgerun``), and a hit that waited on an in-flight fetch takes its times from
that fetch's delivery.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from simulator.cluster import edgecache

# How each request was answered (the per-request ``edge`` column).
KINDS = ("hit", "edge", "escalated", "miss")
HIT, EDGE, ESCALATED, MISS = range(4)


def alone_times(cost, prompt: int, steps: int, chunk: int | None = None) -> tuple[float, list]:
    """Seconds of a request alone on a replica priced by ``cost``: its prefill (chunks
    of at most ``chunk`` tokens, None: one; the last completes the prompt) and ``steps``
    decode steps at batch 1 from context ``prompt + 1`` (the prompt and the first
    token), as the engine loop prices them (``step_time``, ``decode_times``)."""
    size = int(prompt) if chunk is None else max(int(chunk), 1)
    pre, done = 0.0, 0
    while done < prompt:
        n = min(size, int(prompt) - done)
        pre += cost.step_time(0, 0, 0, [(n, done, done + n == prompt)])
        done += n
    dec = cost.decode_times(1, float(prompt + 1), int(steps)) if steps > 0 else []
    return pre, dec


@dataclass
class EdgePlan:
    """What the edge did, per request (arrays of the workload's length) and in total."""

    kind: np.ndarray            # KINDS index
    src: np.ndarray             # a hit's source miss (edgecache.MISS otherwise)
    reach: np.ndarray           # t_e: at the edge
    start: np.ndarray           # the edge model started on it (NaN: never)
    first_token: np.ndarray     # edge answers: first token produced
    last_token: np.ndarray      # edge answers: last token produced
    leave: np.ndarray           # to the cluster: sent from the edge (NaN: not sent)
    edge_busy_s: float = 0.0    # edge servers' busy time (each of edge_gpus GPUs)
    edge_gpus: int | None = None    # GPUs per edge server (None: gpus_per_server)
    gaps: list = field(default_factory=list)   # edge answers' decode steps (s), for ITL
    keys: np.ndarray = None

    @property
    def to_cluster(self) -> np.ndarray:
        """Requests the cluster serves, in the order they leave the edge."""
        idx = np.flatnonzero(np.isfinite(self.leave))
        return idx[np.argsort(self.leave[idx], kind="stable")]


def plan_edge(cfg, workload, keys, rng_accept: np.random.Generator, edge_cost,
              serve=None) -> EdgePlan:
    """The edge's part of the run (module doc) for a workload whose requests carry
    ``keys`` (None without a cache); ``edge_cost``: the edge model's built cost model
    (None without speculation); ``serve``: see ``_speculate``."""
    n = len(workload)
    arrival = workload.arrival_s
    reach = arrival + cfg.rtt_ms / 2000.0 + cfg.lookup_ms / 1000.0
    src = np.full(n, edgecache.MISS, dtype=np.int64)
    if cfg.cache is not None:
        src = edgecache.lookup(keys, reach, cfg.cache.capacity, cfg.cache.ttl_s)
    kind = np.where(src >= 0, HIT, MISS).astype(np.int8)
    nan = np.full(n, np.nan)
    plan = EdgePlan(kind=kind, src=src, reach=reach, start=nan.copy(),
                    first_token=nan.copy(), last_token=nan.copy(),
                    leave=np.where(src >= 0, np.nan, reach), keys=keys)
    if cfg.speculation is not None:
        _speculate(cfg.speculation, workload, plan, rng_accept, edge_cost, serve)
    return plan


def edge_tokens(sp, output: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Tokens the edge model generates for each request: a kept one its whole answer;
    an escalated one ``decide_after_tokens`` (0: the prefill's one, deciding on the
    prompt; None: its whole answer, judged then), at most its answer's length."""
    if sp.decide_after_tokens is None:
        return output.copy()
    return np.where(kept, output, np.minimum(output, max(sp.decide_after_tokens, 1)))


def _speculate(sp, workload, plan: EdgePlan, rng, cost, serve=None) -> None:
    """The edge model's pass over the misses, one acceptance draw per request, served
    by ``serve(misses, tokens, reach)`` (the engine loop on the edge's GPUs, ``edgeengine``)
    or, None, by ``_one_at_a_time``: per request (start, first token, last token), the
    busy seconds, each one's decode steps (s), and which the edge refused (escalated as
    they arrive)."""
    misses = np.flatnonzero(plan.kind == MISS)
    kept = rng.random(len(misses)) < sp.acceptance
    tokens = edge_tokens(sp, workload.output_tokens[misses], kept)
    run = serve or (lambda m, t, reach: _one_at_a_time(sp, workload, reach, m, t, cost))
    start, first, last, busy, gaps, refused = run(misses, tokens, plan.reach)
    plan.edge_busy_s = busy
    ok = np.isfinite(last)
    plan.start[misses] = start
    answered = kept & ok
    i = misses[answered]
    plan.kind[i] = EDGE
    plan.first_token[i] = first[answered]
    plan.last_token[i] = last[answered]
    plan.leave[i] = np.nan
    plan.gaps.extend(g for g, a in zip(gaps, answered) if a)
    i = misses[~answered]
    plan.kind[i] = ESCALATED
    # Escalated when the edge decided; one the edge refused (it can never hold it) as
    # it arrives; one the clock cut at the edge never leaves it.
    plan.leave[i] = np.where(ok[~answered], last[~answered],
                             np.where(refused[~answered], plan.reach[i], np.nan))


def _one_at_a_time(sp, workload, reach, misses, tokens, cost):
    """Each of ``servers`` edge GPUs serves one request at a time, first come first
    served (the next request goes to the earliest-free server: exact for FCFS): its
    prefill, then ``tokens - 1`` decode steps at batch 1, priced by ``cost``. Returns
    per request (start, first token, last token), the busy seconds, the decode steps,
    and none refused."""
    free = [0.0] * sp.servers
    start, first, last = (np.full(len(misses), np.nan) for _ in range(3))
    busy, gaps = 0.0, []
    for j, i in enumerate(misses):
        pre, dec = alone_times(cost, int(workload.prompt_tokens[i]), int(tokens[j]) - 1)
        t0 = max(reach[i], heapq.heappop(free))
        done = t0 + pre + float(np.sum(dec))
        heapq.heappush(free, done)
        busy += done - t0
        start[j], first[j], last[j] = t0, t0 + pre, done
        gaps.append(dec)
    return start, first, last, busy, gaps, np.zeros(len(misses), dtype=bool)
