"""``simulate(scenario, seed) -> Results``: one run of the whole SimPy model.

The run is a pure function of the scenario and the seed: one
``numpy.random.Generator`` per concern is spawned from the seed (workload,
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
and ``wire.Wire`` does the per-request work: route (with regions, at send time), take a
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
from simulator.cost import build_cost_model, profile_search_dirs
from simulator.report.kv import kv_run_stats
from simulator.model.kv import rules as kvr
from simulator.model.kv.space import KVRules
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
from simulator.workload.sessions import session_reason


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


class Unsupported(Exception):
    """The loop asked for cannot run this configuration (the message says why)."""


def kv_capacity_blocks(scenario: Scenario) -> int:
    """KV blocks per replica: ``engine.kv.num_blocks`` when given; with a roofline cost
    model, what ``catalog.plan_memory`` leaves on the GPU type for its TP x PP, weight
    and KV formats, ``gpu_memory_utilization`` and the engine's activation reserve
    (refused before the run, with the numbers, when the model does not fit); else
    (GPU memory x utilisation - weights) / block bytes. Given blocks are refused when
    more than that room holds (with a roofline model, or with ``gpu_memory_gb`` given
    too): a cache the GPU cannot hold is no what-if.

    With a roofline cost model ``cluster.gpus_per_replica`` must equal tp x pp; left
    out, it is set to that here (every run computes this first)."""
    from simulator.errors import LatsimError
    if scenario.cluster.pools:
        # A mixed fleet: each pool's own (checked here); a request that fits the largest
        # can run somewhere.
        from simulator.cluster.pools import plan_pools
        return max(p.capacity for p in plan_pools(scenario))
    kv = scenario.engine.kv
    cost = scenario.model.cost
    if getattr(cost, "kind", None) == "roofline":
        _settle_gpus_per_replica(scenario)
        _check_model_context(scenario)
        if kv.num_blocks is None:
            return roofline_memory_plan(scenario).kv_blocks
        # Given blocks must still fit on the GPU, after the weights and the reserve.
        plan = roofline_memory_plan(scenario, require_fit=False)
        if plan.kv_blocks < 1:
            raise LatsimError(plan.reason, field="model.cost")
        room = plan.kv_blocks
        where = f"{plan.model} on {plan.gpu} (TP{plan.tp} PP{plan.pp})"
    else:
        shape = scenario.model.shape
        free = kv.gpu_memory_gb * 1e9 * kv.gpu_memory_utilization - shape.weight_bytes
        per_block = shape.kv_bytes_per_token * kv.block_size
        room = int(free // per_block)
        if kv.num_blocks is None or "gpu_memory_gb" in kv.model_fields_set:
            if room < 1:
                raise LatsimError("the model's weights leave no memory for the KV cache",
                                  field="engine.kv.gpu_memory_gb", value=kv.gpu_memory_gb,
                                  has_value=True)
        if kv.num_blocks is None:
            return room
        if "gpu_memory_gb" not in kv.model_fields_set:
            return kv.num_blocks       # blocks given alone: the engine's own count
        where = f"engine.kv.gpu_memory_gb = {kv.gpu_memory_gb:g} GB"
    if kv.num_blocks > room:
        raise LatsimError(f"more blocks than fit: {where} leaves room for {room} blocks of "
                          f"{kv.block_size} tokens after the weights",
                          field="engine.kv.num_blocks", value=kv.num_blocks, has_value=True)
    return kv.num_blocks


def _check_model_context(scenario: Scenario) -> None:
    """``engine.kv.max_model_len`` of a roofline scenario may not exceed the model's own
    longest context (``max_position_embeddings``): a server refuses to start so (vLLM
    does, unless told its positions are scaled), and the model was never trained past it."""
    from simulator.cost import catalog
    from simulator.cost.roofline import model_arch
    kv = scenario.engine.kv
    if kv.max_model_len is not None:
        catalog.check_context(model_arch(scenario.model.cost.model), kv.max_model_len,
                              "max_model_len of", field="engine.kv.max_model_len")


def _settle_gpus_per_replica(scenario: Scenario) -> None:
    """``cluster.gpus_per_replica`` of a roofline scenario: tp x pp (set when left out,
    a one-line error when it says otherwise)."""
    from simulator.errors import LatsimError
    cost, cl = scenario.model.cost, scenario.cluster
    n = cost.tp * cost.pp
    if "gpus_per_replica" not in cl.model_fields_set:
        cl.gpus_per_replica = n
    elif cl.gpus_per_replica != n:
        raise LatsimError(f"must equal model.cost tp x pp = {cost.tp} x {cost.pp} = {n}",
                          field="cluster.gpus_per_replica", value=cl.gpus_per_replica,
                          has_value=True)


def roofline_memory_plan(scenario: Scenario, require_fit: bool = True):
    """``catalog.plan_memory`` of a roofline scenario's replica: its model on tp x pp of
    its GPU, the weight and KV formats, and the engine's ``gpu_memory_utilization``,
    ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs`` and ``max_model_len``.
    ``engine.kv.gpu_memory_gb`` cannot be given with it (the GPU says)."""
    from simulator.cost import catalog
    from simulator.cost.roofline import model_arch
    from simulator.errors import LatsimError
    cost, eng = scenario.model.cost, scenario.engine
    kv = eng.kv
    spec = catalog.gpu(cost.gpu)
    if "gpu_memory_gb" in kv.model_fields_set:
        raise LatsimError(f"with a roofline cost model the memory is the GPU's ({spec.name}: "
                          f"{spec.memory_bytes / 2**30:.1f} GiB); leave it out",
                          field="engine.kv.gpu_memory_gb", value=kv.gpu_memory_gb, has_value=True)
    try:
        return catalog.plan_memory(
            model_arch(cost.model), spec, cost.tp, cost.pp, weight_dtype=cost.weight_dtype,
            kv_dtype=cost.kv_dtype, gpu_memory_utilization=kv.gpu_memory_utilization,
            block_size=kv.block_size, max_num_batched_tokens=eng.max_num_batched_tokens,
            max_num_seqs=eng.max_num_seqs, max_model_len=kv.max_model_len,
            require_fit=require_fit)
    except LatsimError as e:
        raise LatsimError(str(e), field="model.cost") from None


def kv_bytes_per_token(scenario: Scenario, per_gpu: bool = False) -> float:
    """KV bytes one cached token takes, in the scenario's KV format: a roofline cost
    model's catalogued architecture (``ModelArch.kv_bytes_per_token``, all layers and KV
    heads; ``per_gpu``: one GPU's slice, its pipeline stage's layers and its KV heads,
    replicated heads counted on every GPU, ``catalog.kv_bytes_per_token_per_gpu``), else
    ``model.shape`` (a shape has no parallelism: the whole token either way)."""
    cost = scenario.model.cost
    if getattr(cost, "kind", None) == "roofline":
        from simulator.cost import catalog
        from simulator.cost.roofline import model_arch
        arch = model_arch(cost.model)
        if per_gpu:
            return float(catalog.kv_bytes_per_token_per_gpu(arch, cost.tp, cost.pp,
                                                            cost.kv_dtype))
        return float(arch.kv_bytes_per_token(cost.kv_dtype))
    return float(scenario.model.shape.kv_bytes_per_token)


def replica_kv_args(scenario: Scenario) -> dict:
    """The KV keyword arguments of ``Replica`` for this scenario: rules, bytes per
    block (what a swap copies), CPU swap space in blocks and its bandwidth. With a
    roofline cost model a block's bytes are one GPU's slice of it (each GPU of the
    replica copies its own slice over its own link, in parallel), and
    ``swap_space_gb`` is per GPU, as vLLM's ``swap_space``. ``async_sched`` is set
    where the engine schedules asynchronously (``engine.async_scheduling``)."""
    kv = scenario.engine.kv
    block_bytes = kv_bytes_per_token(scenario, per_gpu=True) * kv.block_size
    args = {"kv_rules": KVRules.from_config(kv), "block_bytes": block_bytes,
            "swap_blocks": int(kv.swap_space_gb * 1e9 // block_bytes),
            "swap_bps": kv.swap_gb_per_s * 1e9}
    if scenario.engine.async_scheduling:
        args["async_sched"] = True   # (``model.scheduling.asyncsched``)
    return args


def never_fit(scenario: Scenario, workload: Workload, capacity: Optional[int] = None) -> dict:
    """Requests that can never run on a replica of this scenario (``kv.rules.never_fits``
    on every request at once, before the run): ``{"over_max_model_len": n,
    "over_capacity": n, "largest_blocks": blocks the largest request needs,
    "capacity_blocks": ..., "usable_blocks": capacity less the watermark}``."""
    kv = scenario.engine.kv
    cap = int(kv_capacity_blocks(scenario) if capacity is None else capacity)
    n = len(workload)
    why = np.zeros(n, np.int64)
    blocks = np.zeros(n, np.int64)
    wm = kvr.watermark_blocks(float(kv.watermark), cap)
    kvr.never_fits_each(kv.allocation == "paged", workload.prompt_tokens.astype(np.int64),
                        workload.output_tokens.astype(np.int64),
                        -1 if kv.max_model_len is None else int(kv.max_model_len),
                        int(kv.block_size), cap, wm, why, blocks)
    return {"over_max_model_len": int((why == kvr.OVER_MAX_MODEL_LEN).sum()),
            "over_capacity": int((why == kvr.OVER_CAPACITY).sum()),
            "largest_blocks": int(blocks.max()) if n else 0,
            "capacity_blocks": cap, "usable_blocks": cap - wm}


def simulate(scenario: Scenario, seed: Optional[int] = None, *, base_dir: Path | None = None,
             policy: Optional[str] = None, workload: Optional[Workload] = None,
             profile: Optional[dict] = None, mode: str = "auto",
             cost_model=None, loop: str = "auto", progress=None) -> Results:
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

    Longer than most functions here, on purpose: it is the order of a run (draw the
    seeded streams, build the parts every loop shares, choose the loop and say why, run,
    hand back) in one place; each part is a call (``_connections``, ``_cost_models``,
    ``run_compiled``, ``run_traffic``, ``run_simpy``)."""
    if loop not in LOOPS:
        raise ValueError(f"unknown loop {loop!r}; known: {', '.join(LOOPS)}")
    seed = scenario.seed if seed is None else seed
    ss = np.random.SeedSequence(seed)
    rng_wl, rng_net, rng_router, rng_cost = (np.random.default_rng(s) for s in ss.spawn(4))
    # Spawned after the first four, which (hence every default run) they leave unchanged.
    rng_link, rng_disc = (np.random.default_rng(s) for s in ss.spawn(2))
    rng_traffic = np.random.default_rng(ss.spawn(1)[0])   # client backoff jitter
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
    costs = _cost_models(scenario, cost_model, profile, base_dir, rng_cost)
    spec = None
    if eng.speculative is not None:
        # Speculative decoding (``engine.speculative``): its acceptance draws have their
        # own stream, spawned after every other one (which it leaves unchanged).
        from dataclasses import replace
        from simulator.model.speculative import build_speculative
        spec = build_speculative(eng.speculative, scenario.model.cost, costs[0],
                                 int(np.random.default_rng(ss.spawn(1)[0]).integers(2**63)),
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
                    router=scenario.cluster.router, router_rng=rng_router)
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
    """Sample time series at every step for small runs, ~20k points for large ones."""
    if len(wl) <= 5000:
        return 0.0
    span = float(wl.arrival_s[-1] - wl.arrival_s[0])
    return max(span, 0.0) / 20000.0
