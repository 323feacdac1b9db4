"""The edge's GPUs running the project's engine loop (``edge.speculation.engine``):
continuous batching, KV memory and the scheduling policy of the engine section given,
priced by the edge model's cost model, instead of one request at a time per GPU.

The edge is a small cluster of ``servers`` replicas of the edge model, with nothing
on the wire (the edge's own RTT is charged by ``cluster.edge``): the requests the
cache did not answer are run on it by ``simulate`` (SimPy), each arriving when it
reaches the edge and generating the tokens ``edge.edge_tokens`` says (its whole answer
if kept, else up to ``decide_after_tokens``). A request the edge's KV cache can never
hold is refused there and escalated at once. The edge answers' inter-token gaps are
each request's mean step (the run pools its gaps with the escalated requests', which
their clients never see).
"""
from __future__ import annotations

import numpy as np

# Nothing on the wire between the edge's front and its GPUs.
_NO_NET = {"distance_km": 0, "base_rtt_ms": 0, "tls": "none", "gateway_ms": 0,
           "request_overhead_bytes": 0, "bytes_per_prompt_token": 0}
_NO_STREAM = {"frame_overhead_bytes": 0, "bytes_per_token": 0}


def edge_scenario(sc, sp):
    """The edge as a scenario of its own: ``servers`` replicas of the edge model with
    the ``engine`` section given (a one-line error naming it when it does not hold)."""
    from simulator.config.scenario import validate_scenario
    cost = sp.cost.model_dump(mode="json")
    model = {"cost": cost, **({"name": cost["model"]} if cost.get("model") else {})}
    d = {"name": f"{sc.name}-edge", "seed": sc.seed,
         "workload": {"kind": "synthetic", "num_requests": 1,
                      "arrival": {"kind": "poisson", "rate": 1.0},
                      "prompt_tokens": {"kind": "constant", "value": 1},
                      "output_tokens": {"kind": "constant", "value": 1}},
         "network": dict(_NO_NET), "stream": dict(_NO_STREAM), "engine": dict(sp.engine),
         "model": model, "cluster": {"replicas": sp.servers}}
    return validate_scenario(d, source="edge.speculation (the edge's engine)")


def check_edge_engine(sc, sp, where: str) -> None:
    """The edge's scenario holds together and its model fits its GPU with the KV cache
    asked for (``ValueError`` naming ``where``: the scenario's reader makes it a line
    naming the file)."""
    from simulator.deploy.fleet import kv_capacity_blocks
    from simulator.errors import LatsimError
    try:
        kv_capacity_blocks(edge_scenario(sc, sp))
    except LatsimError as e:
        msg = str(e).removeprefix("edge.speculation (the edge's engine): ")
        raise ValueError(f"{where} (the edge's own replica): {msg}") from None


def engine_server(simulate, sc, workload, seed, base_dir):
    """``serve(misses, tokens, reach)`` for ``edge._speculate``: the misses run on the edge's
    engine (module doc); ``serve.gpus``: GPUs per edge replica, once it ran."""
    from simulator.workload import Workload
    esc = edge_scenario(sc, sc.edge.speculation)

    def serve(misses, tokens, reach):
        sub = Workload(arrival_s=reach[misses], prompt_tokens=workload.prompt_tokens[misses],
                       output_tokens=tokens, priority=workload.priority[misses],
                       class_names=workload.class_names)
        res = simulate(esc, seed, base_dir=base_dir, workload=sub, loop="simpy")
        r = res.rec
        o = np.asarray(tokens)
        gaps = [np.full(int(k) - 1, (lt - ft) / (k - 1)) if k > 1 and np.isfinite(lt) else []
                for k, ft, lt in zip(o, r.first_token, r.last_token)]
        serve.gpus = esc.cluster.gpus_per_replica    # settled by the run (tp x pp)
        return (r.scheduled.copy(), r.first_token.copy(), r.last_token.copy(),
                r.step_time_total, gaps, r.rejected.copy())
    serve.gpus = None
    return serve
