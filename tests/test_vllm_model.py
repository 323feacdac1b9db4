"""The vLLM serving model: ``engine: {preset: vllm}`` (vLLM v0.15's defaults), async
scheduling as vLLM v1's engine core does it, and the API server front end, in closed
form at zero load: TTFT = front end + one step-wait + prefill."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ZERO_NET, ZERO_STREAM, make_profile, make_scenario
from simulator.config.scenario import validate_scenario
from simulator.cost import build_cost_model, profile_search_dirs
from simulator.errors import LatsimError
from simulator.loops.simulate import simulate
from simulator.report.metrics import requests_table
from simulator.wire import frontend as F
from simulator.workload.base import Workload

D_MS = 10.0   # every decode-only step of the busy-decode profile below


def _busy_decode(n: int, seed: int = 3) -> Workload:
    """One long request decoding from t=0 (2600 tokens, ~26 s of 10 ms steps) and ``n``
    one-token requests, one every 80 ms, each uniform over a 30 ms window (three whole
    decode-only steps: the previous newcomer's mixed step has ended by then, so its
    phase within the step it arrives in is exactly uniform)."""
    rng = np.random.default_rng(seed)
    arr = np.concatenate([[0.0], 0.1 + 0.08 * np.arange(n) + rng.uniform(0, 0.03, n)])
    return Workload(arrival_s=arr, prompt_tokens=np.r_[100, np.full(n, 16)],
                    output_tokens=np.r_[2600, np.ones(n, int)],
                    priority=np.zeros(n + 1, int))


def _const_decode_profile() -> dict:
    # Decode costs D_MS at every batch and context (a constant plane extrapolates flat).
    return make_profile(prefill=((1, 0, 0.01), (10**6, 0, 10**4)),
                        decode=((1, 1, D_MS), (1, 10**6, D_MS), (256, 1, D_MS),
                                (256, 10**6, D_MS)))


def _engine(**kw) -> dict:
    return {"policy": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 256,
            "kv": {"num_blocks": 4096}, **kw}


def test_async_scheduling_waits_one_more_step_than_sync():
    """A request arriving uniformly during a busy decode of step time D waits for the
    rest of the current step (U(0, D), mean D/2) under synchronous scheduling, and for
    that plus one whole step under async scheduling (the next step was planned when the
    current one started): mean 3D/2, and each request exactly D more than under sync.
    Tolerance on the mean: 4 standard errors of U(0, D) over n, D / sqrt(12 n) each."""
    n = 240
    wl = _busy_decode(n)
    prof = _const_decode_profile()
    waits = {}
    for a in (False, True):
        res = simulate(make_scenario(engine=_engine(async_scheduling=a)), 0, workload=wl,
                       profile=prof)
        # The long request's decode steps are D apart: the profile is what we think.
        gaps = (res.rec.last_token[0] - res.rec.first_token[0]) / 2599
        assert gaps == pytest.approx(D_MS / 1000, rel=0.01)   # mixed steps cost D + ~0.2 ms
        waits[a] = (res.rec.scheduled - res.rec.enqueued)[1:]
    d = D_MS / 1000
    se = d / np.sqrt(12 * n)
    assert waits[False].mean() == pytest.approx(d / 2, abs=4 * se)
    assert waits[True].mean() == pytest.approx(1.5 * d, abs=4 * se)
    # Same arrivals, same step grid (each run has the same steps, one later): exactly D.
    np.testing.assert_allclose(waits[True] - waits[False], d, rtol=0, atol=1e-9)
    assert waits[True].min() >= d - 1e-9 and waits[False].max() <= d + 1e-9


def test_async_idle_engine_starts_at_once_and_the_compiled_loop_agrees():
    """An idle engine has nothing planned ahead: a lone request is scheduled on arrival
    (no step wait). The compiled loop runs async scheduling and the front end with the
    same kernels (``asyncsched.sees``; the front end's response side on deliveries only,
    a refused request's connection release on the bare network): the same run."""
    from loopcheck import assert_identical
    wl = Workload(arrival_s=np.array([0.0, 5.0]), prompt_tokens=np.array([64, 64]),
                  output_tokens=np.array([4, 4]), priority=np.zeros(2, int))
    sc = make_scenario(engine=_engine(async_scheduling=True))
    res = simulate(sc, 0, workload=wl, profile=_const_decode_profile())
    np.testing.assert_allclose(res.rec.scheduled, res.rec.enqueued, atol=0)
    assert "below 1,000" in res.meta["loop"]
    assert_identical(res, simulate(sc, 0, workload=wl, profile=_const_decode_profile(),
                                   loop="compiled"))
    sc = make_scenario(engine=_engine(frontend={}))
    res = simulate(sc, 0, workload=wl, profile=_const_decode_profile())
    assert_identical(res, simulate(sc, 0, workload=wl, profile=_const_decode_profile(),
                                   loop="compiled"))


def test_frontend_adds_its_closed_form_to_ttft_and_sits_in_t_net_and_t_stream():
    """At zero load the front end adds request_ms + ipc + prompt x tokenise to T_net
    (before the request is enqueued) and ipc + output_ms_per_token to each token's
    delivery (T_stream), nothing to the engine's times; the breakdown still adds up."""
    fe = {"request_ms": 1.0, "tokenize_us_per_token": 1.5, "ipc_ms": 0.04,
          "output_ms_per_token": 0.1}
    p = np.array([100, 3000, 700])
    wl = Workload(arrival_s=np.array([0.0, 10.0, 20.0]), prompt_tokens=p,
                  output_tokens=np.array([3, 3, 3]), priority=np.zeros(3, int))
    recs = {}
    for on in (False, True):
        sc = make_scenario(engine=_engine(frontend=fe if on else None,
                                          max_num_batched_tokens=4096))
        res = simulate(sc, 0, workload=wl, profile=_const_decode_profile())
        recs[on] = res.rec
        t = requests_table(res)
        parts = t.t_net + t.t_queue + t.t_prefill + t.t_decode + t.t_stream
        np.testing.assert_allclose(parts, t.e2el, rtol=0, atol=1e-12)
    off, on = recs[False], recs[True]
    req = (1.0 + 0.04) / 1000 + p * 1.5e-6
    resp = (0.04 + 0.1) / 1000
    np.testing.assert_allclose((on.enqueued - on.arrival) - (off.enqueued - off.arrival), req,
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose((on.first_token - on.enqueued) - (off.first_token - off.enqueued),
                               0.0, atol=1e-12)
    np.testing.assert_allclose((on.first_delivered - on.arrival)
                               - (off.first_delivered - off.arrival), req + resp, atol=1e-12)
    np.testing.assert_allclose((on.last_delivered - on.last_token)
                               - (off.last_delivered - off.last_token), resp, atol=1e-12)


def test_ttft_at_low_load_is_front_end_plus_one_more_step_plus_prefill():
    """The closed form of a first token under async scheduling and the API server,
    one long request decoding (steps of D = 10 ms) and newcomers arriving uniformly
    within a step: TTFT = request side (request_ms + ipc + prompt x tokenise) + the
    step wait (U(D, 2D) under async scheduling: mean 3D/2, 4 standard errors D /
    sqrt(12 n)) + the newcomer's own step (the cost model's mixed step) + response side
    (ipc + output_ms_per_token) + one output ahead of it in the API server (the
    decoder's)."""
    fe = {"request_ms": 1.0, "tokenize_us_per_token": 1.5, "ipc_ms": 0.04,
          "output_ms_per_token": 0.0699}
    n = 240
    wl = _busy_decode(n)
    res = simulate(make_scenario(engine=_engine(async_scheduling=True, frontend=fe)), 0,
                   workload=wl, profile=_const_decode_profile())
    rec = res.rec
    new = slice(1, None)
    req = (1.0 + 0.04) / 1000 + 16 * 1.5e-6
    np.testing.assert_allclose((rec.enqueued - rec.arrival)[new], req, rtol=0, atol=1e-12)
    step = (rec.first_token - rec.scheduled)[new]
    # Every newcomer's step is one decode plus its 16-token prefill: the same step.
    np.testing.assert_allclose(step, step[0], rtol=0, atol=1e-12)
    resp = (0.04 + 0.0699) / 1000 + 1 * 0.0699e-3
    np.testing.assert_allclose((rec.first_delivered - rec.first_token)[new], resp,
                               rtol=0, atol=1e-12)
    ttft = (rec.first_delivered - rec.arrival)[new]
    d = D_MS / 1000
    assert ttft.mean() == pytest.approx(req + 1.5 * d + step[0] + resp,
                                        abs=4 * d / np.sqrt(12 * n))
    assert ttft.min() >= req + d + step[0] + resp - 1e-9
    assert ttft.max() <= req + 2 * d + step[0] + resp + 1e-9


def test_frontend_constants_are_the_cited_ones():
    """The defaults are the module's cited constants: 1.5 us per prompt token (HF fast
    tokenizers, 1.1-1.6 us/token single-threaded), 1.0 ms per request, 0.04 ms per ZMQ
    hop (40 us per small message), 0.0699 ms per output token (an upper bound: one
    vLLM v1 API server delivered 14,308.94 output tokens/s, vllm-project/vllm#12287,
    1,211,959 tokens in 84.70 s)."""
    t = F.FrontendTiming.from_config(F.FrontendConfig())
    assert t.request_s(1000) == pytest.approx((1.0 + 0.04) / 1000 + 1000 * 1.5e-6, abs=1e-15)
    assert F.OUTPUT_MS_PER_TOKEN == pytest.approx(1000 / 14_308.94, abs=5e-5)
    # The source's throughput is its tokens over its duration (rounded to 0.01 s).
    assert 1_211_959 / 84.70 == pytest.approx(14_308.94, rel=1e-4)
    assert t.response_s == pytest.approx((0.04 + 0.0699) / 1000, abs=1e-15)
    assert t.first_token_s(83) == pytest.approx(83 * 0.0699e-3, abs=1e-15)
    none = F.FrontendTiming.from_config(None)
    assert none.request_s(10**6) == 0.0 and none.first_token_s(10**6) == 0.0


def _newcomer_behind_three_decoders(newcomer_tokens: int):
    """Three 5-token decoders from t=0 and a newcomer of ``newcomer_tokens`` at 25 ms,
    front end with only its per-output cost (0.5 ms) and a 0.5 ms response side, zero
    network: ``(loop, mode, recorder)`` for every executor (SimPy per request and
    step-level, compiled, and the traffic driver: ``report.utilization`` drives the same
    replicas through ``loops.traffic``)."""
    fe = {"request_ms": 0.0, "tokenize_us_per_token": 0.0, "ipc_ms": 0.0,
          "output_ms_per_token": 0.5}
    wl = Workload(arrival_s=np.r_[np.zeros(3), 0.025], prompt_tokens=np.full(4, 16),
                  output_tokens=np.r_[np.full(3, 5), newcomer_tokens],
                  priority=np.zeros(4, int))
    sc = make_scenario(engine=_engine(frontend=fe))
    traffic = make_scenario(engine=_engine(frontend=fe), report={"utilization": True})
    for sc, loop, mode in ((sc, "simpy", "slow"), (sc, "simpy", "auto"),
                           (sc, "compiled", "auto"), (traffic, "simpy", "auto")):
        yield loop, mode, simulate(sc, 0, workload=wl, profile=_const_decode_profile(),
                                   loop=loop, mode=mode).rec


def test_first_token_waits_for_the_steps_other_outputs_in_the_api_server():
    """vLLM's API server handles a step's outputs in the engine core's order, running
    requests first and the step's newly admitted ones last, one event loop for all: a
    first token is sent after every output listed before it. A lone request arriving
    while ``k`` requests decode (one 10 ms step each, constant profile) has its first
    token delivered ``k x output_ms_per_token`` later than with nobody decoding (zero
    network, so delivery = token + response side); later tokens are not held back."""
    fe = {"request_ms": 0.0, "tokenize_us_per_token": 0.0, "ipc_ms": 0.0,
          "output_ms_per_token": 0.5}
    extra = {}
    for k in (0, 1, 5):
        n = k + 1
        wl = Workload(arrival_s=np.r_[np.zeros(k), 1.0], prompt_tokens=np.full(n, 16),
                      output_tokens=np.r_[np.full(k, 400), 3], priority=np.zeros(n, int))
        rec = simulate(make_scenario(engine=_engine(frontend=fe)), 0, workload=wl,
                       profile=_const_decode_profile()).rec
        # The response side's per-token part, then the outputs ahead of it: k decodes.
        extra[k] = float(rec.first_delivered[k] - rec.first_token[k]) - 0.5e-3
        np.testing.assert_allclose(rec.last_delivered - rec.last_token, 0.5e-3, atol=1e-12)
    np.testing.assert_allclose([extra[0], extra[1], extra[5]], [0.0, 0.5e-3, 2.5e-3],
                               rtol=0, atol=1e-12)


def test_decoders_ending_in_the_step_are_ahead_of_its_first_token_in_every_executor():
    """A decoder whose last token comes from the step a newcomer's prefill completes in
    still has an output in that step, listed ahead of the newcomer's first token (the
    engine core lists running requests first). Three 5-token decoders from t=0, a
    newcomer at 25 ms: its first token comes from the step that ends the three, and
    waits 3 x output_ms_per_token whichever books the SimPy replica keeps (per request,
    ``mode="slow"``, drops the ended decoders before the prefills are applied; the
    step-level books later), through the traffic driver, and on the compiled loop
    (``wire.frontend.first_token_wait_s``).
    Zero network, so delivery = token + the response side (0.5 ms) + the wait; 1e-12 s
    is the rounding of sums of ~0.04 s."""
    for loop, mode, rec in _newcomer_behind_three_decoders(3):
        assert rec.first_token[3] == rec.last_token[0] == rec.last_token[2]   # one step
        wait = float(rec.first_delivered[3] - rec.first_token[3]) - 0.5e-3
        assert wait == pytest.approx(3 * 0.5e-3, abs=1e-12), (loop, mode)


def test_a_one_token_answer_leaves_after_its_first_tokens_wait():
    """A one-token answer's first token is its last: it leaves the API server after the
    same wait for the step's other outputs, so its E2E is its TTFT (before, its last
    byte left without the wait and TTFT exceeded E2E by 3 x 0.5 ms). Three 5-token
    decoders from t=0, a one-token newcomer at 25 ms whose token comes from the step
    that ends them; on every executor. 1e-12 s: rounding of sums of ~0.04 s."""
    for loop, mode, rec in _newcomer_behind_three_decoders(1):
        assert rec.first_token[3] == rec.last_token[3] == rec.last_token[0]
        wait = float(rec.first_delivered[3] - rec.first_token[3]) - 0.5e-3
        assert wait == pytest.approx(3 * 0.5e-3, abs=1e-12), (loop, mode)
        assert rec.last_delivered[3] == pytest.approx(rec.first_delivered[3], abs=1e-12), \
            (loop, mode)


def _vllm_scenario(gpu: str = "h100-sxm", **engine) -> dict:
    return {"name": "vllm", "seed": 1,
            "workload": {"kind": "synthetic", "num_requests": 10,
                         "arrival": {"kind": "poisson", "rate": 1.0},
                         "prompt_tokens": {"kind": "constant", "value": 100},
                         "output_tokens": {"kind": "constant", "value": 10}},
            "network": dict(ZERO_NET), "stream": dict(ZERO_STREAM),
            "engine": {"preset": "vllm", "kv": {"max_model_len": 4096}, **engine},
            "model": {"name": "llama-2-7b", "cost": {"kind": "roofline", "gpu": gpu}}}


def test_vllm_preset_is_vllm_v015_defaults():
    """vLLM's own defaults (vllm-project/vllm): ``EngineArgs.get_batch_defaults`` in
    vllm/engine/arg_utils.py (OPENAI_API_SERVER: 8192 tokens and 1024 sequences on a GPU
    of >= 70 GiB that is not an A100, else 2048 and 256); ``SchedulerConfig`` in
    vllm/config/scheduler.py at commit 01230b40128e570a58e54e75f7e55c4d5cd9246d
    (enable_chunked_prefill True, policy fcfs); async scheduling resolved on
    (vllm/config/vllm.py, ``async_scheduling is None`` -> True); block size 16,
    gpu_memory_utilization 0.9, prefix caching on."""
    e = validate_scenario(_vllm_scenario()).engine
    assert (e.max_num_batched_tokens, e.max_num_seqs) == (8192, 1024)
    assert e.policy == "chunked" and e.async_scheduling and e.frontend is not None
    assert (e.kv.block_size, e.kv.gpu_memory_utilization, e.kv.prefix_caching,
            e.kv.allocation, e.kv.preemption) == (16, 0.9, True, "paged", "recompute")
    for gpu in ("a100-80gb", "l40s"):
        a = validate_scenario(_vllm_scenario(gpu)).engine
        assert (a.max_num_batched_tokens, a.max_num_seqs) == (2048, 256), gpu
    # The scenario's own keys win, down to one KV field.
    o = validate_scenario(_vllm_scenario(max_num_batched_tokens=1024, async_scheduling=False,
                                         kv={"max_model_len": 4096, "prefix_caching": False}))
    assert (o.engine.max_num_batched_tokens, o.engine.max_num_seqs) == (1024, 1024)
    assert not o.engine.async_scheduling and not o.engine.kv.prefix_caching
    assert o.engine.kv.block_size == 16
    # The resolved scenario (what ``--out`` echoes) reads back to the same engine.
    assert validate_scenario(o.model_dump(mode="json")).engine == o.engine
    # Without the preset nothing changes: the default engine is latsim's.
    plain = _vllm_scenario()
    del plain["engine"]["preset"]
    p = validate_scenario(plain).engine
    assert (p.max_num_batched_tokens, p.async_scheduling, p.frontend) == (2048, False, None)


def test_bad_preset_name_is_refused():
    with pytest.raises(LatsimError, match="engine.preset"):
        validate_scenario(_vllm_scenario(preset="vllm-0.3"))


def _cost(sc):
    return build_cost_model(sc.model.cost, np.random.default_rng(0), profile_search_dirs(None))


def _lone(prompts, shared=None, gap=5.0) -> Workload:
    n = len(prompts)
    return Workload(arrival_s=gap * np.arange(n), prompt_tokens=np.asarray(prompts),
                    output_tokens=np.full(n, 2), priority=np.zeros(n, int),
                    shared_prefix_tokens=None if shared is None else np.asarray(shared))


def test_prefix_hit_prefills_only_the_uncached_part():
    """Two lone requests with the same 500-token system prompt: the second finds its 31
    whole blocks (496 tokens) cached and prefills only the other 104 tokens, in one
    step priced at 104 tokens after 496 (the cost model's own step, zero load)."""
    sc = validate_scenario(_vllm_scenario())
    res = simulate(sc, 0, workload=_lone([600, 600], shared=[500, 500]))
    rec = res.rec
    assert list(rec.cached_tokens) == [0, 496]
    cost = _cost(sc)
    expect = [cost.step_time(0, 0, 0, [(600, 0, True)]), cost.step_time(0, 0, 0, [(104, 496, True)])]
    np.testing.assert_allclose(rec.first_token - rec.scheduled, expect, rtol=1e-12)
    assert expect[1] < expect[0]


def test_token_budget_chunks_a_long_prompt():
    """A lone 3000-token prompt under budget 1024 prefills in three steps (1024, 1024,
    952 tokens), under 8192 in one: TTFT's prefill part is those steps' sum, priced by
    the cost model, and the smaller budget is slower (each step pays its own floor)."""
    pre = {}
    for budget in (1024, 8192):
        sc = validate_scenario(_vllm_scenario(max_num_batched_tokens=budget))
        rec = simulate(sc, 0, workload=_lone([3000])).rec
        pre[budget] = float(rec.first_token[0] - rec.scheduled[0])
        cost = _cost(sc)
        chunks = ([(1024, 0, False)], [(1024, 1024, False)], [(952, 2048, True)]) \
            if budget == 1024 else ([(3000, 0, True)],)
        assert pre[budget] == pytest.approx(sum(cost.step_time(0, 0, 0, c) for c in chunks),
                                            rel=1e-12)
    assert pre[1024] > pre[8192]


def test_async_arrival_behind_blocked_streams_is_seen_at_once():
    """Nothing is in flight while every decoder waits on its client (``backpressure:
    block``: a 0.08 Mbit/s client drains one 1000-byte frame per 0.1 s, its 4000-byte
    buffer is full after four 10 ms steps): the engine waits, so a request arriving then
    is seen by the next decision and scheduled on arrival (it waited for no step)."""
    wl = Workload(arrival_s=np.array([0.0, 0.5]), prompt_tokens=np.array([64, 64]),
                  output_tokens=np.array([400, 2]), priority=np.zeros(2, int),
                  client=np.array([0, 1]))
    sc = make_scenario(engine=_engine(async_scheduling=True),
                       network={**ZERO_NET, "clients": 2},
                       stream={"frame_overhead_bytes": 1000, "bytes_per_token": 0,
                               "downlink_mbps": 0.08, "buffer_bytes": 4000,
                               "backpressure": "block"})
    rec = simulate(sc, 0, workload=wl, profile=_const_decode_profile()).rec
    np.testing.assert_allclose(rec.scheduled, rec.enqueued, rtol=0, atol=0)
