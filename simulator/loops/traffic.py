"""The SimPy run of a scenario with traffic control: admission (``cluster.admission``),
clients that time out and retry (``client``), an autoscaled fleet
(``cluster.autoscaler``) or utilisation series (``report.utilization``).

``simulate`` hands such a run to ``run_traffic`` after building what every run shares
(workload, cost models, KV rules, connection pools); this module builds the fleet of
replicas, the gateway (``cluster.gateway``) in front of them, the autoscaler, runs the
clock, folds the attempts into the run's per-request recorder and returns what the
reports read (``meta``: ``traffic``, ``cluster``, ``utilization``). The compiled loop
models none of these (``traffic_reason`` says why, and ``auto`` runs SimPy).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import simpy

from simulator.cluster.admission import Admission, WaitEstimator
from simulator.cluster.autoscaler import Autoscaler, Fleet, has_work
from simulator.cluster.gateway import Gateway
from simulator.cluster.routers import make_router
from simulator.loops.simpy.replica import Replica
from simulator.report.percentile import pct_ms
from simulator.report.recorder import Recorder
from simulator.report.utilization import UtilTracker
from simulator.wire.clients import Clients


def traffic_reason(scenario) -> Optional[str]:
    """What of the scenario's traffic control the compiled loop does not model (None:
    nothing is asked for)."""
    cl = scenario.cluster
    parts = [what for on, what in (
        (cl.admission is not None, "admission control"),
        (scenario.client is not None, "client timeouts and retries"),
        (cl.autoscaler is not None, "autoscaling"),
        (cl.pools is not None, "disaggregated prefill/decode pools"
         if cl.disaggregated else "replica pools"),
        (scenario.report.utilization, "utilisation series"),
        (cl.faults is not None or cl.breaker is not None,
         "replica faults and circuit breaking"),
        (cl.degrade is not None, "degradation under overload")) if on]
    return ", ".join(parts) or None


def n_slots(scenario) -> int:
    """Replica slots the run needs: the fleet's largest size."""
    a = scenario.cluster.autoscaler
    if scenario.cluster.pools:
        from simulator.cluster.pools import plan_pools
        return sum(p.n_slots for p in plan_pools(scenario))
    return max(scenario.cluster.replicas, a.max_replicas if a is not None else 0)


def run_traffic(*, scenario, env: simpy.Environment, rec: Recorder, workload, policy, costs,
                more_cost, capacity: int, kv_args: dict, pools, net, stream, keys_of,
                clients, mode: str, series_interval: float, rng_router, rng_traffic,
                progress=None):
    """Run the scenario's traffic model; fills ``rec``. ``costs``: cost models of the
    first replicas; ``more_cost()`` builds the next one (autoscaled slots);
    ``progress(view)``: called as the clock starts with a view whose ``last_delivered``,
    ``rejected`` and ``cancelled`` say which requests have ended. Returns ``(end of the
    run, each replica's KVStats, meta)``."""
    if "sessions" in workload.meta:
        # Closed-loop sessions need the plain driver's session process (the gateway sends
        # on a fixed clock); ``config.traffic.check_traffic`` refuses the known sections.
        from simulator.errors import LatsimError
        raise LatsimError(f"workload kind sessions (closed-loop users) cannot be combined "
                          f"with {traffic_reason(scenario)}", field="workload.kind")
    sc = scenario
    cl = sc.cluster
    n = len(workload)
    slots = n_slots(sc)
    while len(costs) < slots:
        costs.append(more_cost())
    ccfg = sc.client
    # Attempts: each client attempt, and each gateway retry after a fault.
    fc = cl.faults
    arec = Recorder(n * ((ccfg.max_attempts if ccfg is not None else 1)
                         + (fc.max_retries if fc is not None else 0)), slots)
    rec.arrival[:] = workload.arrival_s
    # A decision trace (``report.decisions``) follows the attempts (a retry: its own id).
    arec.trace = getattr(rec, "trace", None)
    track = sc.report.utilization
    trackers = [UtilTracker(costs[i]) if track else None for i in range(slots)]
    gateway = None
    fleet_pools = None
    disagg = None
    if cl.pools:
        # A mixed fleet (``cluster.pools``): each slot its pool's capacity and KV sizes.
        from simulator.cluster.pools import plan_pools, slot_pools
        fleet_pools = plan_pools(sc)
        of_slot = slot_pools(fleet_pools)
        if cl.disaggregated:
            # Prefill and decode pools (``cluster.disagg``); the decode side has its own
            # router of the cluster's kind, on its own stream.
            from simulator.cluster.disagg import Disaggregation
            from simulator.config.cluster import KVTransferConfig
            n_dec = sum(p.n_slots for p in fleet_pools if p.role == "decode")
            disagg = Disaggregation(
                env, sc, fleet_pools,
                make_router(cl.router, n_dec, np.random.default_rng(rng_router.integers(2**63)),
                            params=cl.router_params),
                cl.kv_transfer or KVTransferConfig(), arec.n)

    def on_finish(seq, delivered_at: float) -> None:
        gateway.finished(seq, delivered_at)

    def make_replica(slot: int) -> Replica:
        cap, kva = ((capacity, kv_args) if fleet_pools is None
                    else (of_slot[slot].capacity, of_slot[slot].kv_args))
        rep = Replica(env, slot, policy, costs[slot], cap, arec, stream.frame_time,
                      stream.one_way, on_finish, series_interval=series_interval, mode=mode,
                      **kva)
        rep.util = trackers[slot]
        rep.first_out_s = net.frontend.per_output_s   # the API server (wire.frontend)
        if disagg is not None:
            rep.handoff = disagg
            rep.hands_off = of_slot[slot].role == "prefill"
        return rep

    if fleet_pools is None:
        fleet = Fleet(env, make_replica, cl.replicas, slots)
    else:
        scaled = [p for p in fleet_pools if p.scaled]
        fleet = Fleet(env, make_replica, cl.replicas, slots,
                      ready_slots=[s for p in fleet_pools for s in p.slots[:p.replicas]],
                      scalable=scaled[0].slots if scaled else [])
        fleet.mixed = True
        if disagg is not None:
            disagg.attach(fleet)
    router = make_router(cl.router, slots, rng_router, params=cl.router_params)
    eng = sc.engine
    adm = cl.admission
    estimator = WaitEstimator(adm.wait_estimate if adm is not None else _default_estimate(),
                              policy.chunk_size, slots)
    if ccfg is not None and ccfg.read_timeout_s is not None:
        # How long clients wait before they leave: what the server learns from their
        # cancellations (the ``work`` estimate does not wait for those ahead that leave).
        estimator.patience = ccfg.read_timeout_s
    auto = cl.autoscaler
    faults = None
    if fc is not None or cl.breaker is not None:
        from simulator.cluster.faults import Faults
        faults = Faults(env, fc, cl.breaker, n, slots, rng_traffic.spawn(1)[0],
                        eng.kv.block_size)
    degrade = None
    if cl.degrade is not None:
        from simulator.cluster.degrade import Degrade
        small = [s for p in fleet_pools or [] if p.name == cl.degrade.pool for s in p.slots]
        degrade = Degrade(cl.degrade, workload, small, lambda aid: int(gateway.a_rid[aid]),
                          eng.kv.block_size)
    gateway = Gateway(env, workload, arec, fleet, router, pools, net,
                      Clients(ccfg, rng_traffic),
                      Admission(adm, workload.class_names) if adm is not None else None,
                      estimator, keys_of, eng.kv.block_size, clients,
                      track_ttft=auto is not None and auto.metric == "p99_ttft",
                      entry=disagg.entry if disagg is not None else None,
                      faults=faults, degrade=degrade)
    if faults is not None:
        faults.attach(gateway)
    if arec.trace is not None:
        arec.trace.rid_of = gateway.a_rid      # a retry's waits are its request's
    scaler = None
    if auto is not None:
        scaler = Autoscaler(env, auto, fleet, capacity if fleet_pools is None else None,
                            gateway.ttft_values,
                            lambda: gateway.all_resolved)
    env.process(gateway.arrivals())
    if progress is not None:
        progress(_ProgressView(gateway))
    _run_clock(env, gateway, fleet, sc.max_sim_time_s, n)
    end = float(env.now)
    gateway.fold(rec)
    meta = {"traffic": _traffic_meta(gateway, scaler, fleet),
            "cluster": _cluster_meta(sc, fleet, end, fleet_pools, gateway, disagg),
            "attempts": gateway.attempts_table(),
            "fleet_timeline": fleet.timeline()}
    if fleet_pools is not None:
        meta["slot_pools"] = [(p.name, p.capacity, p.gpus) for p in of_slot]
    if faults is not None or degrade is not None:
        # Per-request columns (the recorder's generic slot; neither is modelled with
        # disaggregation, whose columns use it otherwise).
        rec.set_disagg({**(faults.columns() if faults is not None else {}),
                        **(degrade.columns() if degrade is not None else {})})
    if faults is not None:
        meta["faults"] = faults.meta(end)
    if degrade is not None:
        meta["degrade"] = degrade.meta()
    if disagg is not None:
        rec.set_disagg(disagg.columns(gateway.final_attempts()))
        meta["disaggregation"] = disagg.summary()
    if track:
        meta["utilization"] = trackers
    return end, [r.kv.manager.stats for r in fleet.built], meta


class _ProgressView:
    """What a progress display reads of a run in flight: a request has ended when the
    gateway has resolved it (``last_delivered`` 0 then, NaN before)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway
        self.rejected = np.zeros(gateway.n, dtype=bool)
        self.cancelled = self.rejected

    @property
    def last_delivered(self) -> np.ndarray:
        from simulator.cluster.gateway import UNFINISHED
        return np.where(self._gw.outcome != UNFINISHED, 0.0, np.nan)


def _default_estimate():
    from simulator.config.traffic import WaitEstimateConfig
    return WaitEstimateConfig()


def _run_clock(env, gateway, fleet, until: Optional[float], n: int) -> None:
    """Run until every request has ended and no replica holds work (timers that can no
    longer matter are left unfired, so the clock ends where the work did), or until
    ``until`` as the plain model does."""
    if until is not None:
        env.run(until=until)
        return
    stop = env.event()
    if n == 0:
        stop.succeed()
    else:
        gateway.on_all_resolved = lambda: stop.succeed() if not stop.triggered else None
    env.run(until=stop)
    while any(has_work(r) for r in fleet.built) and env.peek() < math.inf:
        env.step()


def _traffic_meta(gw: Gateway, scaler, fleet) -> dict:
    """Attempt-level tallies of the gateway (summary.json ``traffic``)."""
    from simulator.cluster.admission import REASONS
    from simulator.wire import clients as C
    t = gw.attempts_table()
    out = t["outcome"]
    n_att = len(out)
    refused = out == C.REFUSED
    res = {
        "attempts": n_att,
        "retries": n_att - gw.n,
        "admitted": int(np.isfinite(t["admitted"]).sum()),
        "refused": int(refused.sum()),
        "refused_by_reason": {nm: int((refused & (t["reason"] == i)).sum())
                              for i, nm in enumerate(REASONS)},
        "connect_timeouts": int((out == C.CONNECT_TIMEOUT).sum()),
        "read_timeouts": int((out == C.READ_TIMEOUT).sum()),
        "deadlines": int((out == C.DEADLINE).sum()),
        "retry_budget_denied": gw.clients.budget.denied if gw.clients.budget else 0,
        "balked": gw.clients.balked, "moved_elsewhere": gw.clients.moved,
        "came_back": gw.clients.came_back,      # acting on the estimate (cluster.patience)
        "wasted_tokens": gw.wasted_tokens(),
        "abandoned_attempts_with_work": len(gw.gone),
    }
    router = gw.router
    if hasattr(router, "hit_picks"):
        res["router_picks_with_cached_prefix"] = int(router.hit_picks)
    if scaler is not None:
        res["autoscaler_decisions"] = len(scaler.decisions)
    return res


def _cluster_meta(sc, fleet, end: float, pools=None, gateway=None, disagg=None) -> dict:
    """Fleet size and what it cost (summary.json ``cluster``); with pools, per pool too
    (``pools``), the cluster's GPU-hours and cost their sums."""
    tl = fleet.timeline()
    if pools is not None:
        pm = _pools_meta(pools, fleet, end, gateway, disagg)
        return {**{k: pm.pop(k) for k in ("gpu_hours", "cost_usd", "gpu_cost_per_hour")},
                **_fleet_shape(tl, end, fleet), **pm}
    gpus = sc.cluster.gpus_per_replica
    hours = fleet.gpu_hours(end, gpus)
    price = sc.cluster.gpu_cost_per_hour
    live = tl[:, 1] + tl[:, 2] + tl[:, 3]
    dur = np.diff(np.append(tl[:, 0], max(end, tl[-1, 0])))
    return {
        "gpu_hours": hours,
        "cost_usd": hours * price if price is not None else None,
        "gpu_cost_per_hour": price,
        "replicas_mean": float((live * dur).sum() / dur.sum()) if dur.sum() > 0 else float(live[0]),
        "replicas_max": int(live.max()),
        "ready_min": int(tl[:, 1].min()),
        "scale_ups": fleet.scale_ups,
        "scale_downs": fleet.scale_downs,
    }


def _fleet_shape(tl: np.ndarray, end: float, fleet) -> dict:
    live = tl[:, 1] + tl[:, 2] + tl[:, 3]
    dur = np.diff(np.append(tl[:, 0], max(end, tl[-1, 0])))
    return {
        "replicas_mean": float((live * dur).sum() / dur.sum()) if dur.sum() > 0 else float(live[0]),
        "replicas_max": int(live.max()),
        "ready_min": int(tl[:, 1].min()),
        "scale_ups": fleet.scale_ups,
        "scale_downs": fleet.scale_downs,
    }


def _pools_meta(pools, fleet, end: float, gateway, disagg=None) -> dict:
    """Per pool (``cluster.pools``): what it is, what it held and cost, and how many
    requests it served (admitted attempts, retries included) and completed (the
    requests whose completing attempt ran there); the cluster's GPU-hours and cost are
    the pools' sums (cost None when a pool has no price). Disaggregated (``disagg``): a
    decode pool counts the requests handed to it, ``completed_share`` is within the
    pool's role, and its ``p99_ttft_ms`` is NaN (TTFT ends on the prefill pool)."""
    from simulator.cluster.gateway import DONE
    held = fleet.held_s(end)
    slot_of = np.full(len(held), -1, dtype=np.int64)
    for k, p in enumerate(pools):
        slot_of[list(p.slots)] = k
    f = gateway.final_attempts()
    ok = gateway.outcome == DONE
    ttft = gateway.arec.first_delivered[f][ok] - gateway.wl.arrival_s[ok]

    def tally(a_slot):
        served = a_slot[:gateway.next_aid]
        served = np.bincount(slot_of[served[served >= 0]], minlength=len(pools))
        done = a_slot[f][ok]
        completed = np.bincount(slot_of[done[done >= 0]], minlength=len(pools))
        return served, completed, np.where(done >= 0, slot_of[np.maximum(done, 0)], -1)
    served, completed, pool_done = tally(gateway.a_slot)
    if disagg is not None:
        dec = np.array([p.role == "decode" for p in pools])
        d_served, d_completed, d_done = tally(disagg.d_slot)
        served = np.where(dec, d_served, served)
        completed = np.where(dec, d_completed, completed)
    else:
        d_done = pool_done
    out = {}
    for k, p in enumerate(pools):
        n_done = max(1, int(sum(completed[j] for j, q in enumerate(pools) if q.role == p.role)))
        rep_h = float(held[list(p.slots)].sum()) / 3600.0
        hours = rep_h * p.gpus
        mine = (d_done if p.role == "decode" else pool_done) == k
        out[p.name] = {
            "role": p.role, "gpu": p.gpu, "cost_model": getattr(p.cost, "kind", None),
            "gpus_per_replica": p.gpus, "replicas_start": p.replicas,
            "replicas_mean": rep_h * 3600.0 / end if end > 0 else float(p.replicas),
            "autoscaled": p.scaled, "kv_capacity_blocks": p.capacity,
            "requests_served": int(served[k]), "requests_completed": int(completed[k]),
            "completed_share": int(completed[k]) / n_done,
            # A decode pool's requests had their first token on the prefill pool, which
            # set their TTFT: none of it is the decode pool's, so NaN (as with no request).
            "p99_ttft_ms": pct_ms(ttft[mine], 99) if p.role != "decode" else math.nan,
            "gpu_hours": hours, "gpu_cost_per_hour": p.price,
            "cost_usd": hours * p.price if p.price is not None else None,
        }
    costs = [v["cost_usd"] for v in out.values()]
    scaled = [p.name for p in pools if p.scaled]
    return {"gpu_hours": sum(v["gpu_hours"] for v in out.values()),
            "cost_usd": None if any(c is None for c in costs) else sum(costs),
            "gpu_cost_per_hour": None, "autoscaled_pool": scaled[0] if scaled else None,
            "pools": out}
