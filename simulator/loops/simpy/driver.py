"""The plain SimPy run of a scenario: requests leave their clients, cross the network,
are routed to a replica and served, and stream back.

``simulate`` hands a run here after building what every run shares (workload, cost
models, KV rules, connection pools); a run with traffic control goes to
``loops.traffic`` instead. This module builds the replicas and the router, the rich
per-request wire model when the scenario asks for it (``wire.per_request``), and the
arrival process (or, for closed-loop sessions, the users: ``loops.simpy.sessions``),
and runs the clock.
"""
from __future__ import annotations

from simulator.cluster.routers import make_router
from simulator.loops.simpy.replica import Replica, SimSeq
from simulator.model.kv.blocks import request_blocks
from simulator.wire.network import net_time
from simulator.wire.per_request import Wire
from simulator.wire.stream import DisconnectDraws, client_downlinks_bps


def run_simpy(*, scenario, env, rec, workload, policy, costs, capacity: int, kv_args: dict,
              pools, net, stream, topo, keys_of, clients, mode: str, rich: bool,
              series_interval: float, rng_router, rng_link, rng_disc, progress=None):
    """Run the scenario's replicas on SimPy until the workload is served or the clock
    stops (``max_sim_time_s``); fills ``rec``. ``progress(loop, rec)`` is called as the
    clock starts. Returns ``(end of the run, each replica's KVStats, the wire model's
    summary and the sessions' metrics, or {})``.

    Over 80 lines: ``send``, ``deliver`` and ``on_finish`` are closures over the run's
    wire model, router, replicas and users (each needs most of them); split out, each
    would take a dozen of them as arguments."""
    n_rep = scenario.cluster.replicas
    bs = kv_args["kv_rules"].block_size
    wire = None

    users = None   # closed-loop sessions (``workload.sessions``): set below

    def on_finish(s: SimSeq, delivered_at: float) -> None:
        if wire is None:
            pools.release(s.client, delivered_at, s.pooled)
        else:
            wire.finished(s, delivered_at)
        if users is not None:
            users.finished(s.rid, delivered_at)

    replicas = [Replica(env, i, policy, costs[i], capacity, rec, stream.frame_time,
                        stream.one_way, on_finish, series_interval=series_interval,
                        mode="slow" if rich else mode, streams=rich, **kv_args)
                for i in range(n_rep)]
    for r in replicas:
        r.first_out_s = net.frontend.per_output_s     # the API server (wire.frontend)
    router = make_router(scenario.cluster.router, n_rep, rng_router, topology=topo,
                         params=scenario.cluster.router_params)
    if rich:
        wire = Wire(scenario, env, rec, replicas, router, pools, topo, net,
                    client_downlinks_bps(scenario.stream, scenario.network.clients, rng_link),
                    DisconnectDraws.sample(scenario.stream.disconnect, len(workload), rng_disc,
                                           scenario.stream.reconnect))

    arrival = workload.arrival_s
    prompt = workload.prompt_tokens
    output = workload.output_tokens
    prio = workload.priority
    rec.arrival[:] = arrival

    def deliver(seq: SimSeq) -> None:
        rid = seq.rid
        seq.enqueued = env.now
        rec.enqueued[rid] = env.now
        if replicas[0].rejects(seq):
            # Can never fit in this replica's KV cache: rejected, reported as not finished.
            rec.rejected[rid] = True
            if wire is None:
                pools.release(seq.client, env.now + net.one_way, seq.pooled)
            else:
                wire.rejected(seq, env.now)
            if users is not None:
                users.ended(rid, env.now + net.one_way)
            return
        if wire is None:
            k = router.pick(replicas, seq)
        else:
            k = wire.replica_for(seq)
            seq.stream = wire.open_stream(seq, env.now)
        rec.replica[rid] = k
        replicas[k].enqueue(seq)

    if wire is not None:
        wire.deliver = deliver   # a request its client sends again (``wire.reconnect``)

    def arrivals():
        t = 0.0
        for rid in range(len(workload)):
            a = arrival[rid]
            if a > t:
                yield env.timeout(a - t)
                t = a
            send(rid)

    def send(rid: int) -> None:
        """The client sends request ``rid`` now."""
        c = int(clients[rid])
        if wire is None:
            is_new, pooled = pools.acquire(c, env.now)
            rec.new_connection[rid] = is_new
        else:
            pooled = False   # wire.send routes the request, then takes its connection
        p = int(prompt[rid])
        o = int(output[rid])
        seq = SimSeq(rid, 0.0, p, o, int(prio[rid]), request_blocks(p, o, bs), c, pooled)
        if keys_of is not None:
            seq.keys = keys_of(rid)
            if users is not None:
                seq.keys_out = users.answer_keys(rid)
        if wire is None:
            t_net = net_time(net.send_time(p), net.handshake, is_new, 0.0)
        else:
            t_net = wire.send(seq, env.now)
        env.timeout(t_net).callbacks.append(lambda _e, s=seq: deliver(s))

    plan = workload.meta.get("sessions")
    if plan is None:
        env.process(arrivals())
    else:
        from simulator.loops.simpy.sessions import SessionClients
        users = SessionClients(env, plan, rec, send, workload, bs)
    if progress is not None:
        progress("simpy", rec)
    env.run(until=scenario.max_sim_time_s)
    meta = {} if wire is None else wire.summary(float(env.now))
    if users is not None:
        from simulator.report.sessions import session_meta
        meta.update(session_meta(plan, rec, users.aborted, prompt))
    return env.now, [r.kv.manager.stats for r in replicas], meta
