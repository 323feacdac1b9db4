"""``simulate(scenario, seed) -> Results``: one run of the whole SimPy model.

The run is a pure function of the scenario and the seed: one
``numpy.random.Generator`` per concern is spawned from the seed (``simulator.seeds``: workload,
network, router, cost noise), nothing global is touched, and nothing is written
to disk here (the CLI writes files).

Flow of a request: the client sends at ``arrival``; the network stage picks a
connection from its client's keep-alive pool (or opens one) and delivers the
request to the router after ``T_net``; the router picks a replica, whose queue it
joins (``enqueued``); the replica's engine loop schedules, prefills and decodes it;
frames stream back; the connection returns to the pool when the last frame is
delivered.

When any stream or network setting departs from the defaults (coalescing,
heartbeats, a bounded send buffer, per-client downlinks, disconnects, HTTP/2,
regions) every request carries its own ``clientstream.ClientStream`` (``seq.stream``)
and ``wire.per_request.Wire`` does the per-request work: route (with regions, at send time), take a
connection, open the stream, and play out the client disconnects (a cancel one way
after a signalled one, or a heartbeat timeout after a silent one). Its totals go to
``Results.meta["stream"]`` (and ``meta["network"]`` with regions).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import simpy

from simulator.config.scenario import Scenario
from simulator.errors import Unsupported
from simulator.cost import build_cost_model, profile_search_dirs
from simulator.report.kv import kv_run_stats
from simulator.model.kv.prefixkeys import WorkloadKeys
from simulator.wire.network import ConnectionPools, H2Connections, NetworkTiming, Topology
from simulator.report.recorder import Recorder
from simulator.config.engine import engine_policy
from simulator.model.scheduling.view import class_table
from simulator.wire.frontend import FrontendTiming
from simulator.wire.stream import StreamTiming
from simulator.loops.compiled import (COMPILE_MIN_REQUESTS, Handback, kernel_reason,
                                      run_compiled, worth_compiling)
from simulator.loops.simpy.driver import run_simpy
from simulator.loops.traffic import run_traffic, traffic_reason
from simulator.workload import Workload, build_workload
from simulator.seeds import run_streams
from simulator.workload.sessions import session_reason
# A replica's set-up is computed before any loop (``simulator.deploy``); named here too,
# where callers have long imported them from.
from simulator.deploy.fleet import kv_capacity_blocks, never_fit  # noqa: F401
from simulator.deploy.replica import (kv_bytes_per_token, replica_kv_args,  # noqa: F401
                                      roofline_memory_plan)


@dataclass
class Results:
    """Everything a run produced, in memory."""

    scenario: Scenario
    seed: int
    policy: str
    workload: Workload
    rec: Recorder
    kv_capacity_blocks: int
    kv_capacity_tokens: int
    cost_info: dict
    extrapolations: int
    cost_lookups: int
    connections: dict
    sim_end: float
    meta: dict = field(default_factory=dict)


# Event loops: ``auto`` (the compiled loop where it covers the run and the run is large
# enough to be worth loading it, else SimPy), ``compiled`` (compiled only), ``simpy``.
LOOPS = ("auto", "simpy", "compiled")


def simulate(scenario: Scenario, seed: Optional[int] = None, *, base_dir: Path | None = None,
             policy: Optional[str] = None, workload: Optional[Workload] = None,
             profile: Optional[dict] = None, mode: str = "auto",
             cost_model=None, loop: str = "auto", progress=None, trace=None) -> Results:
    """Run the scenario once. ``policy`` overrides ``engine.policy``; ``workload`` and
    ``profile`` may be passed in pre-built (e.g. to run several policies on the same
    traffic without rebuilding it). ``mode`` selects the replica's bookkeeping
    (``auto``, ``step``, ``slow``; see ``replica``) - for tests, results do not depend on it.
    ``cost_model``: an object to use instead of building one from ``model.cost`` (one
    replica only; e.g. ``real_engine.validate.ReplayCost``). ``loop`` (results do not depend
    on it): ``auto`` runs a configuration the compiled loop covers on it when
    ``compiled.worth_compiling``, else SimPy, and ``meta["loop"]`` says which and why;
    ``simpy`` always uses SimPy; ``compiled`` insists (``Unsupported`` if it cannot, or on
    a hand-back). ``progress``: called as ``progress(loop, rec)`` when the event loop
    (``"compiled"`` or ``"simpy"``) is about to start filling the recorder ``rec``, so a
    caller can watch the run (the compiled loop may first have to be compiled).
    ``trace``: a ``report.decisions.DecisionTrace`` to fill (the SimPy loop records it;
    the results are bit for bit the untraced run's).

    Longer than most functions here, on purpose: it is the order of a run (draw the
    seeded streams, build the parts every loop shares, choose the loop and say why, run,
    hand back) in one place; each part is a call (``_connections``, ``_cost_models``,
    ``run_compiled``, ``run_traffic``, ``run_simpy``)."""
    if loop not in LOOPS:
        raise ValueError(f"unknown loop {loop!r}; known: {', '.join(LOOPS)}")
    if scenario.edge is not None:
        # An edge node answers some requests; the cluster runs the rest (``edgerun``).
        from simulator.cluster.edgerun import simulate_edge
        return simulate_edge(simulate, scenario, seed, base_dir=base_dir, policy=policy,
                             workload=workload, profile=profile, mode=mode,
                             cost_model=cost_model, loop=loop, progress=progress,
                             trace=trace)
    seed = scenario.seed if seed is None else seed
    streams = run_streams(seed)       # one generator per concern (``simulator.seeds``)
    rng_wl, rng_net, rng_router, rng_cost = streams[:4]
    rng_link, rng_disc, rng_traffic = streams.link, streams.disconnect, streams.traffic
    if workload is None:
        workload = build_workload(scenario.workload, rng_wl, base_dir or Path.cwd())
    eng = scenario.engine
    pname = policy or eng.policy
    pol = engine_policy(eng, pname)
    pol.classes = class_table(scenario)     # what a plug-in's order_key sees of a class
    n_rep = scenario.cluster.replicas
    capacity = kv_capacity_blocks(scenario)
    bs = eng.kv.block_size

    env = simpy.Environment()
    n = len(workload)
    rec = Recorder(n, n_rep)
    net, stream, topo, pools, clients, rich = _connections(scenario, workload, rng_net)
    kv_args = replica_kv_args(scenario)
    keys_of = WorkloadKeys(workload, bs) if kv_args["kv_rules"].prefix_caching else None
    if kv_args["kv_rules"].offload_blocks is not None:
        rec.track_offload()           # a CPU tier (``model.kv.offload``)
    costs = _cost_models(scenario, cost_model, profile, base_dir, rng_cost)
    spec = None
    if eng.speculative is not None:
        # Speculative decoding (``engine.speculative``): its acceptance draws have their
        # own stream (``simulator.seeds``), after every other one (left unchanged).
        from dataclasses import replace
        from simulator.model.speculative import build_speculative
        spec = build_speculative(eng.speculative, scenario.model.cost, costs[0],
                                 int(streams.speculative.integers(2**63)),
                                 profile_search_dirs(base_dir))
        kv_args["kv_rules"] = replace(kv_args["kv_rules"], lookahead=spec.k)
        kv_args["speculative"] = spec
        rec.track_speculative()

    def results(end: float, stats: list, loop_name: str) -> Results:
        res = Results(
            scenario=scenario, seed=seed, policy=pname, workload=workload, rec=rec,
            kv_capacity_blocks=capacity, kv_capacity_tokens=capacity * bs,
            cost_info=costs[0].describe(),
            extrapolations=sum(c.extrapolations for c in costs),
            cost_lookups=sum(c.lookups for c in costs),
            connections={"new": pools.new_connections, "reused": pools.reused_connections},
            sim_end=float(end),
        )
        res.meta["kv"] = kv_run_stats(stats, costs[0], rec, workload, pol.chunk_size)
        res.meta["loop"] = loop_name
        res.meta["policy_params"] = pol.params.model_dump(mode="json")
        if spec is not None:
            res.meta["speculative"] = spec.describe()
        return res

    why = None
    if trace is not None:       # recorded by the SimPy replica (``report.decisions``)
        if loop == "compiled":
            raise Unsupported("a decision trace is recorded by the SimPy loop")
        rec.trace, loop, why = trace, "simpy", "a decision trace"
    if loop != "simpy":
        why = session_reason(workload) or kernel_reason(
                            pol, kv_args["kv_rules"], pools, costs, scenario.cluster.router,
                            workload.priority, rich=rich or topo is not None, mode=mode,
                            cost_given=cost_model is not None, frame_time=stream.frame_time,
                            traffic=traffic_reason(scenario), speculative=spec is not None,
                            async_sched=eng.async_scheduling,
                            frontend=eng.frontend is not None)
        if why is None and (loop == "compiled" or worth_compiling(n)):
            rec.arrival[:] = workload.arrival_s
            if progress is not None:
                progress("compiled", rec)
            try:
                end, stats = run_compiled(
                    rec=rec, n_replicas=n_rep, policy=pol, costs=costs, capacity=capacity,
                    rules=kv_args["kv_rules"], pools=pools, net=net,
                    swap=(kv_args["block_bytes"], kv_args["swap_blocks"], kv_args["swap_bps"]),
                    frame_time=stream.frame_time, one_way=stream.one_way,
                    series_interval=_series_interval(workload),
                    arrival=workload.arrival_s, prompt=workload.prompt_tokens,
                    output=workload.output_tokens, priority=workload.priority,
                    clients=clients, until=scenario.max_sim_time_s,
                    router=scenario.cluster.router, router_rng=rng_router, keys=keys_of,
                    async_sched=eng.async_scheduling,
                    offload_bps=kv_args.get("offload_bps", 0.0))
            except Handback as e:
                if loop == "compiled":
                    raise Unsupported(str(e)) from None
                # Rebuilt from the seed: the run is what the SimPy model makes of it.
                res = simulate(scenario, seed, base_dir=base_dir, policy=policy,
                               workload=workload, profile=profile, mode=mode,
                               cost_model=cost_model, loop="simpy", progress=progress)
                res.meta["loop"] = f"simpy (the compiled loop handed back: {e})"
                return res
            return results(end, stats, "compiled")
        if loop == "compiled":
            raise Unsupported(why)
        if why is None:
            why = (f"{n} requests: below {COMPILE_MIN_REQUESTS:,}, where loading the "
                   f"compiled loop takes longer than running on SimPy")
    if traffic_reason(scenario) is not None:
        # Admission, clients, autoscaling or utilisation: the gateway's run (``traffic``).
        def more_cost():
            if cost_model is not None:
                raise ValueError("a given cost_model serves one replica only")
            return build_cost_model(scenario.model.cost,
                                    np.random.default_rng(rng_cost.integers(2**63)),
                                    profile_search_dirs(base_dir), profile=profile)
        end, stats, extra = run_traffic(
            scenario=scenario, env=env, rec=rec, workload=workload, policy=pol, costs=costs,
            more_cost=more_cost, capacity=capacity, kv_args=kv_args, pools=pools, net=net,
            stream=stream, keys_of=keys_of, clients=clients, mode=mode,
            series_interval=_series_interval(workload), rng_router=rng_router,
            rng_traffic=rng_traffic, progress=None if progress is None else
            (lambda view: progress("simpy", view)))
        res = results(end, stats, "simpy" if why is None else f"simpy ({why})")
        res.meta.update(extra)
        return res
    end, stats, wire_meta = run_simpy(
        scenario=scenario, env=env, rec=rec, workload=workload, policy=pol, costs=costs,
        capacity=capacity, kv_args=kv_args, pools=pools, net=net, stream=stream, topo=topo,
        keys_of=keys_of, clients=clients, mode=mode, rich=rich,
        series_interval=_series_interval(workload), rng_router=rng_router,
        rng_link=rng_link, rng_disc=rng_disc, progress=progress)
    res = results(end, stats, "simpy" if why is None else f"simpy ({why})")
    res.meta.update(wire_meta)
    return res


def _connections(scenario: Scenario, workload: Workload, rng_net):
    """The wire a run shares across loops: network and stream timing, the regions'
    topology (or None), the clients' connection pools (HTTP/1.1 or HTTP/2) and each
    request's client. Returns ``(net, stream, topo, pools, clients, rich)``, ``rich``:
    whether the per-request wire model is on."""
    ncfg = scenario.network
    n_rep = scenario.cluster.replicas
    # The engine's front end (``wire.frontend``): request side in T_net, response side
    # in each token's delivery (T_stream).
    net = NetworkTiming.from_config(ncfg, frontend=FrontendTiming.from_config(
        scenario.engine.frontend))
    stream = StreamTiming.from_config(scenario.stream, net.deliver_s)
    rich = scenario.stream.rich or ncfg.rich
    topo = (Topology.from_config(ncfg, ncfg.clients, n_rep, frontend=net.frontend)
            if ncfg.regions is not None else None)
    # With regions a client keeps separate connections to each serving region.
    n_keys = ncfg.clients * (len(topo.serving_names) if topo is not None else 1)
    if ncfg.protocol == "http2":
        pools = H2Connections(n_keys, ncfg.h2_max_streams, ncfg.keepalive_s,
                              ncfg.connection_reuse)
    else:
        pools = ConnectionPools(n_keys, ncfg.pool_size, ncfg.keepalive_s,
                                ncfg.connection_reuse)
    clients = (workload.client % ncfg.clients if workload.client is not None
               else rng_net.integers(0, ncfg.clients, size=len(workload)))
    return net, stream, topo, pools, clients, rich


def _cost_models(scenario: Scenario, cost_model, profile, base_dir, rng_cost) -> list:
    """One cost model per replica: ``cost_model`` when given (one replica only), a mixed
    fleet's slot by slot on its pool's (``cluster.pools``), else ``model.cost``'s. Each
    replica draws its own noise stream, so adding replicas does not shift the others."""
    n_rep = scenario.cluster.replicas
    if cost_model is not None:
        if n_rep > 1:
            raise ValueError("a given cost_model serves one replica only")
        return [cost_model]
    if scenario.cluster.pools:
        from simulator.cluster.pools import plan_pools, slot_pools
        return [build_cost_model(p.cost, np.random.default_rng(rng_cost.integers(2**63)),
                                 profile_search_dirs(base_dir),
                                 profile=profile if p.cost == scenario.model.cost else None)
                for p in slot_pools(plan_pools(scenario))]
    return [build_cost_model(scenario.model.cost, np.random.default_rng(rng_cost.integers(2**63)),
                             profile_search_dirs(base_dir), profile=profile)
            for _ in range(n_rep)]


def _series_interval(wl: Workload) -> float:
    """Sample time series at every step for small runs, ~20k points for large ones (over
    the arrival span; closed-loop sessions: a lower bound of their send span)."""
    if len(wl) <= 5000:
        return 0.0
    plan = wl.meta.get("sessions")
    span = (plan.send_span_s if plan is not None
            else float(wl.arrival_s[-1] - wl.arrival_s[0]))
    return max(span, 0.0) / 20000.0
