"""A run with an edge node (``edge``): the edge's plan (``cluster.edge``), the cluster's
run of the requests sent to it (``simulate`` on them alone), and the two folded into
one row per request, with the summary's ``edge`` section.

The cluster run is the scenario without ``edge``, on the sub-workload of the requests
the edge sent on, each arriving when it left the edge; its rows are copied back, with
the request's own ``arrival`` (so ``T_net`` holds the way to and through the edge) and
its deliveries ``h`` later (the edge-to-client hop). The compiled loop does not run
edge scenarios (``EDGE_REASON``): ``loop: compiled`` is refused, ``auto`` says why.

What the edge saves the cluster (``saved_gpu_s``): for every request it answered (a
hit or an edge answer), the GPU-seconds that request costs alone on a cluster replica
(``edge.alone_times`` on the scenario's cost model, times ``gpus_per_replica``): an
upper bound on the saving under load, where a batch shares each step.
``saved_gpu_s_at_run_rate`` prices them at what the run's cluster spent per request it
served instead (busy GPU-seconds / requests completed).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from simulator.cluster import edge as E
from simulator.cluster import edgecache
from simulator.report.recorder import Recorder

EDGE_REASON = "an edge node (edge: a result cache, an edge model) is modelled on SimPy only"


def edge_rngs(seed: int):
    """The edge's own streams (keys, acceptance, cost noise), apart from every stream
    ``simulate`` spawns (their spawn keys are small indices; these are under 0xED6E)."""
    root = np.random.SeedSequence(seed, spawn_key=(0xED6E,))
    return tuple(np.random.default_rng(s) for s in root.spawn(3))


def simulate_edge(simulate, scenario, seed, *, base_dir=None, workload=None,
                  loop: str = "auto", **kw):
    """``simulate(scenario, seed, ...)`` of a scenario with ``edge`` (module doc);
    ``simulate`` is the plain run, called on the cluster's share."""
    from simulator.cost import build_cost_model, profile_search_dirs
    from simulator.errors import Unsupported
    from simulator.workload import build_workload
    if loop == "compiled":
        raise Unsupported(EDGE_REASON)
    if kw.pop("trace", None) is not None:
        from simulator.errors import LatsimError
        raise LatsimError("a decision trace (--chrome-trace) follows the cluster's requests "
                          "by id, not an edge node's: run it without edge", field="edge")
    cfg = scenario.edge
    if getattr(scenario.workload, "kind", None) == "sessions":
        from simulator.errors import LatsimError
        # The edge is planned from the arrivals; a session's next turn is sent when the
        # previous answer is back, which the plan cannot know beforehand.
        raise LatsimError("an edge node is not modelled with closed-loop sessions "
                          "(workload kind sessions)", field="edge")
    seed = scenario.seed if seed is None else seed
    if workload is None:
        # The stream ``simulate`` draws its workload from (``simulator.seeds``), so a
        # run with the edge and one without see the same requests.
        from simulator.seeds import stream
        rng_wl = stream(seed, "workload")
        workload = build_workload(scenario.workload, rng_wl, base_dir or Path.cwd())
    rng_keys, rng_accept, rng_cost = edge_rngs(seed)
    dirs = profile_search_dirs(base_dir)
    keys = None
    if cfg.cache is not None:
        keys = _keys(cfg.cache.popularity, workload, rng_keys, scenario)
        if cfg.cache.popularity.same_lengths:
            p, o = edgecache.same_lengths(keys, workload.prompt_tokens, workload.output_tokens)
            workload = dataclasses.replace(workload, prompt_tokens=p, output_tokens=o)
    edge_cost = None
    if cfg.speculation is not None:
        edge_cost = build_cost_model(cfg.speculation.cost, rng_cost, dirs)
    serve = None
    if cfg.speculation is not None and cfg.speculation.engine is not None:
        from simulator.cluster.edgeengine import engine_server
        serve = engine_server(simulate, scenario, workload, seed, base_dir)
    plan = E.plan_edge(cfg, workload, keys, rng_accept, edge_cost, serve)
    if serve is not None:
        plan.edge_gpus = serve.gpus
    idx = plan.to_cluster
    inner = scenario.model_copy(update={"edge": None})
    res = simulate(inner, seed, base_dir=base_dir, workload=_sub_workload(workload, idx,
                                                                          plan.leave[idx]),
                   loop="simpy", **kw)
    rec = _fold(res.rec, idx, workload, plan, cfg)
    end = res.sim_end
    if scenario.max_sim_time_s is not None:
        end = _cut(rec, float(scenario.max_sim_time_s))
    elif np.isfinite(rec.last_delivered).any():
        end = max(end, float(np.nanmax(rec.last_delivered)))
    cluster_cost = build_cost_model(scenario.model.cost, np.random.default_rng(rng_cost.integers(2**63)),
                                    dirs, profile=kw.get("profile"))
    out = dataclasses.replace(res, scenario=scenario, workload=workload, rec=rec,
                              meta=dict(res.meta), sim_end=end)
    out.meta["loop"] = f"simpy ({EDGE_REASON})"
    # A saved request's prefill is priced in the engine's chunks (the policy's size).
    from simulator.config.engine import engine_policy
    chunk = engine_policy(scenario.engine, kw.get("policy")).chunk_size
    out.meta["edge"] = edge_summary(scenario, workload, plan, rec, cluster_cost, chunk)
    return out


def _keys(pop, workload, rng, scenario) -> np.ndarray:
    if pop.kind == "trace" and workload.hash_ids is None:
        from simulator.errors import LatsimError
        raise LatsimError("popularity kind trace needs a workload with prompt identities "
                          "(a trace's hash_ids); use kind zipf",
                          field="edge.cache.popularity.kind", value="trace", has_value=True)
    return edgecache.prompt_keys(pop, workload, rng)


def _sub_workload(wl, idx: np.ndarray, arrival: np.ndarray):
    """The requests ``idx`` of ``wl`` arriving at ``arrival``: every per-request field
    taken at ``idx`` (arrays and lists alike), the rest as it is."""
    n = len(wl)
    parts = {}
    for f in dataclasses.fields(wl):
        v = getattr(wl, f.name)
        if isinstance(v, np.ndarray) and v.shape[:1] == (n,):
            v = v[idx]
        elif isinstance(v, (list, tuple)) and len(v) == n and f.name != "class_names":
            v = [v[i] for i in idx]
        parts[f.name] = v
    parts["arrival_s"] = np.asarray(arrival, dtype=np.float64)
    return type(wl)(**parts)


def _fold(sub: Recorder, idx: np.ndarray, wl, plan, cfg) -> Recorder:
    """One row per request of the whole workload: the cluster's rows at ``idx`` (its
    own arrival, deliveries one edge hop later), the edge's answers and the hits."""
    n = len(wl)
    rec = Recorder(n, len(sub.series))
    for name, v in vars(sub).items():
        if isinstance(v, np.ndarray) and v.shape[:1] == (sub.n,):
            full = getattr(rec, name, None)
            if full is None or full.shape[:1] != (n,):
                fill = np.nan if v.dtype.kind == "f" else (-1 if "replica" in name
                                                           or "slot" in name else 0)
                full = np.full((n,) + v.shape[1:], fill, dtype=v.dtype)
            full[idx] = v
            setattr(rec, name, full)
        elif name != "n":
            setattr(rec, name, v)
    h = cfg.rtt_ms / 2000.0
    rec.arrival[:] = wl.arrival_s
    rec.first_delivered[idx] += h
    rec.last_delivered[idx] += h
    _edge_answers(rec, wl, plan, h)
    _hits(rec, wl, plan, cfg, h)
    rec.edge_columns = ("edge",)
    rec.edge = np.array(E.KINDS, dtype=object)[plan.kind]
    return rec


def _cut(rec, until: float) -> float:
    """``max_sim_time_s``: what would happen after the clock stops does not (a timestamp
    past it is NaN, as the plain model never reaches it); returns the clock's end."""
    from simulator.report.recorder import TIMESTAMPS
    for name in TIMESTAMPS[1:]:
        col = getattr(rec, name)
        col[col > until] = np.nan
    return until


def _edge_answers(rec, wl, plan, h: float) -> None:
    """The edge model's kept answers (module doc of ``cluster.edge``)."""
    i = np.flatnonzero(plan.kind == E.EDGE)
    rec.enqueued[i] = plan.reach[i]
    rec.scheduled[i] = plan.start[i]
    rec.first_token[i] = plan.first_token[i]
    rec.last_token[i] = plan.last_token[i]
    rec.first_delivered[i] = plan.first_token[i] + h
    rec.last_delivered[i] = plan.last_token[i] + h
    rec.generated[i] = wl.output_tokens[i]
    for gaps in plan.gaps:
        if len(gaps):
            rec.itl.add_many(gaps)


def _hits(rec, wl, plan, cfg, h: float) -> None:
    """The cache's hits: ready when the entry is (its fetch's last byte at the edge, one
    edge hop ``h`` before it reaches that fetch's client), streamed from the edge. A hit
    whose fetch never completed ends as the fetch did (rejected, timed out, failed,
    cancelled; unfinished when the clock cut it)."""
    rate = cfg.cache.stream_tokens_per_s if cfg.cache is not None else None
    for i in np.flatnonzero(plan.kind == E.HIT):
        s = plan.src[i]
        avail = rec.last_delivered[s] - h
        if not np.isfinite(avail):
            for name in ("rejected", "refused", "timed_out", "failed", "cancelled",
                         "reject_reason"):
                col = getattr(rec, name, None)
                if col is not None:
                    col[i] = col[s]
            rec.enqueued[i] = plan.reach[i]
            continue
        ready = max(plan.reach[i], avail)
        o = int(wl.output_tokens[i])
        gap = 0.0 if rate is None else 1.0 / rate
        rec.enqueued[i] = plan.reach[i]
        rec.scheduled[i] = rec.first_token[i] = rec.last_token[i] = ready
        rec.first_delivered[i] = ready + h
        rec.last_delivered[i] = ready + h + (o - 1) * gap
        rec.generated[i] = o
        if o > 1:
            rec.itl.add(gap, o - 1)


def alone_gpu_s(cost, wl, which: np.ndarray, gpus: int, chunk: int | None) -> float:
    """GPU-seconds the requests ``which`` cost alone on a replica of ``gpus`` GPUs
    priced by ``cost`` (prefill in ``chunk``-token chunks + N - 1 decode steps at
    batch 1)."""
    total = 0.0
    for i in which:
        pre, dec = E.alone_times(cost, int(wl.prompt_tokens[i]), int(wl.output_tokens[i]) - 1,
                                 chunk)
        total += pre + float(np.sum(dec))
    return total * gpus


def edge_summary(sc, wl, plan, rec, cluster_cost, chunk: int | None) -> dict:
    """The summary's ``edge``: the cache, the edge model, what they took off the cluster."""
    cfg = sc.edge
    n = len(wl)
    count = {k: int((plan.kind == j).sum()) for j, k in enumerate(E.KINDS)}
    out = {"requests": n, "rtt_ms": cfg.rtt_ms, "lookup_ms": cfg.lookup_ms, **count,
           "sent_to_cluster": count["miss"] + count["escalated"]}
    if cfg.cache is not None:
        c = cfg.cache
        hits = plan.kind == E.HIT
        coalesced = hits & (rec.scheduled > plan.reach)
        out["cache"] = {
            "popularity": c.popularity.model_dump(), "capacity": c.capacity, "ttl_s": c.ttl_s,
            "hits": count["hit"], "hit_ratio": count["hit"] / n if n else None,
            "coalesced_hits": int(coalesced.sum()),
            "distinct_prompts": int(len(np.unique(plan.keys))) if n else 0,
            "expected_hit_ratio": edgecache.expected_hit_ratios(
                c.popularity, c.capacity, c.ttl_s, n,
                float(np.ptp(wl.arrival_s)) if n else 0.0)}
    if cfg.speculation is not None:
        sp = cfg.speculation
        tried = count["edge"] + count["escalated"]
        gpu_s = plan.edge_busy_s * (plan.edge_gpus or sp.gpus_per_server)
        waited = plan.start - plan.reach
        out["speculation"] = {
            "edge_model": getattr(sp.cost, "model", None) or getattr(sp.cost, "path", None),
            "edge_engine": "engine loop" if sp.engine is not None else "one request at a time",
            "edge_gpu": getattr(sp.cost, "gpu", None), "servers": sp.servers,
            "acceptance": sp.acceptance, "tried": tried,
            "escalation_ratio": count["escalated"] / tried if tried else None,
            "edge_gpu_s": gpu_s,
            "edge_cost_usd": (gpu_s / 3600.0 * sp.gpu_cost_per_hour
                              if sp.gpu_cost_per_hour is not None else None),
            "mean_edge_wait_s": float(np.nanmean(waited)) if tried else None}
    answered = np.flatnonzero((plan.kind == E.HIT) | (plan.kind == E.EDGE))
    gpus = sc.cluster.gpus_per_replica
    saved = alone_gpu_s(cluster_cost, wl, answered, gpus, chunk)
    sent = plan.to_cluster
    done = int(np.isfinite(rec.last_delivered[sent]).sum())
    rate = rec.step_time_total * gpus / done if done else None
    price = sc.cluster.gpu_cost_per_hour
    out["saved_requests"] = int(len(answered))
    out["saved_gpu_s"] = saved
    out["saved_cost_usd"] = saved / 3600.0 * price if price is not None else None
    out["saved_gpu_s_at_run_rate"] = len(answered) * rate if rate is not None else None
    return out
