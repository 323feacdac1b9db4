"""real_engine's continuous batching: the simulator's policies drive it, every
request gets exactly its output tokens, blocks come back, cancel works, padded
decode (the CUDA-graph path) equals eager, and the trace runner's timestamps are
consistent."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce")

from real_engine.engine import EngineCore  # noqa: E402
from real_engine.graphs import DecodeGraphs, page_buckets  # noqa: E402
from real_engine.kv import to_device  # noqa: E402
from real_engine.model import build_model  # noqa: E402
from real_engine.runner import run_trace  # noqa: E402
from simulator.model.kv.blocks import blocks_for, request_blocks  # noqa: E402
from simulator.model.kv.space import KVRules  # noqa: E402
from simulator.model.scheduling import StepPlan, make_policy, policy_names  # noqa: E402

BUILTIN = policy_names()

torch.set_num_threads(1)   # 2 shared cores: one thread is faster and steadier


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def engine(model, policy="chunked", num_blocks=256, **kw):
    pol = make_policy(policy, max_num_seqs=kw.pop("max_num_seqs", 6),
                      max_num_batched_tokens=kw.pop("budget", 48), chunk_size=kw.pop("chunk", 13),
                      aging_s=0.01)
    return EngineCore(model, pol, num_blocks=num_blocks, **kw)


def serve(e, reqs):
    """Add all requests, step to the end; returns tokens per rid and the step results."""
    for rid, (ids, out, prio) in reqs.items():
        e.add_request(rid, ids, out, prio)
    toks = {}
    results = []
    while e.has_work:
        r = e.step()
        assert not r.plan.is_empty
        results.append(r)
        for rid, t in r.tokens.items():
            toks.setdefault(rid, []).append(t)
    return toks, results


def random_reqs(n, vocab, seed=0, max_prompt=70, max_out=9):
    rng = np.random.default_rng(seed)
    return {r: (rng.integers(0, vocab, int(rng.integers(1, max_prompt))),
                int(rng.integers(1, max_out)), int(rng.integers(0, 3))) for r in range(n)}


def test_block_sizes():
    assert blocks_for(0) == 0 and blocks_for(16) == 1 and blocks_for(17) == 2
    assert request_blocks(10, 7) == 2


@pytest.mark.parametrize("policy", BUILTIN)
def test_policies_complete_with_exact_outputs(model, policy):
    reqs = random_reqs(14, model.cfg.vocab, seed=1)
    e = engine(model, policy)
    toks, results = serve(e, reqs)
    assert all(len(toks[r]) == reqs[r][1] for r in reqs)
    assert e.cache.num_free == e.cache.num_blocks and not e.seqs
    first = {}
    for i, r in enumerate(results):
        for rid in r.tokens:
            first.setdefault(rid, i)
        for rid, n in r.plan.prefill:
            # the first token comes from exactly the step that completes the prompt
            done = sum(m for s in results[:i + 1] for q, m in s.plan.prefill if q == rid)
            assert (done == len(reqs[rid][0])) == (first.get(rid) == i and rid in r.tokens)
        for rid in r.finished:
            if reqs[rid][1] == 1:
                assert rid in dict(r.plan.prefill)
    # Greedy tokens do not depend on the batch they were computed in.
    alone = engine(model, "fifo")
    for rid in list(reqs)[:4]:
        t, _ = serve(alone, {rid: reqs[rid]})
        assert t[rid] == toks[rid]


def test_state_seen_by_policy(model):
    """free_blocks is the unreserved capacity; contiguous admission reserves
    prompt+output blocks (paged admission: see test_engine_kvcache)."""
    e = engine(model, "chunked", num_blocks=10, kv_rules=KVRules(allocation="contiguous"))
    e.add_request(0, 40, 9)              # 49 tokens -> 4 blocks
    e.add_request(1, 60, 30)             # 90 tokens -> 6 blocks
    e.add_request(2, 5, 5)               # must wait: no blocks left
    r = e.step()
    assert set(r.admitted) == {0, 1} and e.cache.num_free == 0 and len(e.waiting) == 1
    with pytest.raises(ValueError):
        e.add_request(3, 200, 10)        # can never fit
    toks, _ = serve(e, {})
    assert e.cache.num_free == 10


def test_cancel_frees_blocks(model):
    e = engine(model, "chunked", num_blocks=64, max_num_seqs=2)
    for rid in range(4):
        e.add_request(rid, 30, 20)
    e.step()
    e.step()
    running = [s.rid for s in e.decoding + e.prefilling]
    waiting = [rid for rid in range(4) if rid not in running]
    assert running and waiting
    used = e.cache.num_blocks - e.cache.num_free
    held = len(e.cache.table(running[0]))
    assert held == blocks_for(30)              # paged: the prompt's blocks so far
    assert e.cancel(running[0])
    assert e.cache.num_blocks - e.cache.num_free == used - held
    assert e.cancel(waiting[0]) and not e.cancel(waiting[0])
    while e.has_work:
        e.step()
    assert e.cache.num_free == 64 and not e.seqs


def test_padded_decode_equals_eager(model):
    """The CUDA-graph path's padding (batch and block buckets, scratch block) run
    eagerly on the CPU gives the eager step's tokens and leaves real KV intact."""
    e = engine(model, "chunked", num_blocks=200)
    g = DecodeGraphs(model, e.cache, max_batch=16, capture=False)
    rng = np.random.default_rng(4)
    ctx = rng.integers(2, 90, 5)
    for r, c in enumerate(ctx):
        e.install_running(r, int(c) - 1, 3, prefilled=int(c) - 1, generated=1)
    e.cache.randomize_(1)
    plan = StepPlan(decode=tuple(range(5)))
    h = e.host_step(plan)
    b, nb = g.bucket(5, h.num_pages)
    assert b == 8 and nb >= h.num_pages + 3
    eager, _ = e.execute(plan)
    k_before = [t.clone() for t in e.cache.k]
    padded = g.run(h).numpy()
    np.testing.assert_array_equal(padded, eager)
    with torch.no_grad():
        logits_eager = model.logits(model(to_device(h, e.cache, sample_all=True), e.cache))
    torch.testing.assert_close(g._forward(g._meta(b, nb))[0][:5], logits_eager, atol=1e-4, rtol=0)
    sb = e.cache.scratch_block
    for a, bb in zip(k_before, e.cache.k):
        torch.testing.assert_close(a[:, :sb], bb[:, :sb])   # only the scratch block changed
    assert page_buckets(100)[:6] == [4, 6, 8, 12, 16, 24] and page_buckets(100)[-1] >= 100
    # Pre-capture list: every bucket real steps of these sizes can hit.
    keys = set(g.buckets_for(range(1, 9), 200))
    for B in range(1, 9):
        for ctx in (1, 64, 65, 130, 200):
            assert g.bucket(B, B * -(-ctx // 64)) in keys


def _enqueued_by_the_next_step(res):
    """A request is added at the first step boundary after its arrival: no step that
    began after its arrival was followed by another that began before it was enqueued
    (the one allowed step is the one its arrival may have raced). Wall-time free, so it
    holds on a loaded machine too."""
    starts = [s["start"] for s in res["steps"]]
    for r in res["requests"]:
        later = [t for t in starts if t > r["arrival"]]
        if len(later) >= 2:
            assert r["enqueued"] < later[1], r


def test_run_trace_timestamps(model):
    e = engine(model, "priority_aging", num_blocks=256)
    n = 10
    rng = np.random.default_rng(5)
    arr = np.cumsum(rng.exponential(0.02, n))
    arr[5:] += 1.0                       # an idle gap the non-realtime run skips
    P, O = rng.integers(1, 60, n), rng.integers(1, 6, n)
    res = run_trace(e, arr, P, O, rng.integers(0, 2, n), realtime=False)
    assert res["idle_skipped_s"] > 0.5
    for r in res["requests"]:
        assert r["completed"] and len(r["token_times"]) == r["output_tokens"]
        assert r["arrival"] <= r["enqueued"] <= r["scheduled"] < r["first_token"] <= r["last_token"]
        assert r["token_times"][0] == r["first_token"] and r["token_times"][-1] == r["last_token"]
    st = res["steps"]
    _enqueued_by_the_next_step(res)
    assert all(a["end"] <= b["start"] for a, b in zip(st, st[1:]))
    assert sum(s["n_decode"] for s in st) == int(O.sum()) - n
    assert sum(s["prefill_tokens"] for s in st) == int(P.sum())
    assert e.cache.num_free == 256

    # Real time: nobody is enqueued before their arrival; the run lasts the trace.
    arr2 = np.array([0.0, 0.05, 0.1, 0.25])
    res2 = run_trace(e, arr2, [20, 5, 40, 3], [3, 1, 4, 2], realtime=True)
    assert res2["wall_s"] >= 0.25 and res2["idle_skipped_s"] == 0
    _enqueued_by_the_next_step(res2)
    for r in res2["requests"]:
        assert r["arrival"] <= r["enqueued"] and r["completed"]


def test_a_priority_run_is_rebuilt_from_its_step_log_by_the_policys_own_aging(tmp_path):
    """A refbench-format run of the real engine under ``priority_aging`` (aging every
    2 s, the reference engine's rule: data/h200-refbench/README.md) is read back by
    ``runs.read_run`` with every step's prefill sequences, decode contexts and first
    tokens as the engine recorded them, and every chunk the engine ran; aging changed
    the admission order in this run, so a reader ordering by priority alone would not.

    The run's clock moves only inside a step (20 ms per step), so every recorded time is
    exact and the test does not depend on this machine's speed."""
    import pandas as pd

    from simulator.cost.runs import read_run
    eng = EngineCore(build_model("tiny", "cpu"),
                     make_policy("priority_aging", max_num_seqs=2, max_num_batched_tokens=64,
                                 aging_s=2.0), num_blocks=512)
    now = [0.0]
    execute = eng.execute

    def timed_execute(plan, timings=None):
        out = execute(plan, timings)
        now[0] += 0.02
        return out
    eng.execute = timed_execute
    # Two slots, 115 tokens (~2.3 s) a request. At t=0 two P0 requests take the slots
    # and a P2 one waits; a P1 request arrives at 1.5 s. When the slots free (~2.3 s)
    # the P2 request has aged one class (key 2 - 1) and ties with the P1 one (1 - 0):
    # the earlier arrival, the P2 one, goes first. Later arrivals keep the queue busy.
    arr = [0.0, 0.0, 0.0, 1.5, 2.6, 2.7, 3.9]
    prio = [2, 0, 0, 1, 0, 2, 1]
    n = len(arr)
    P = [100, 40, 60, 50, 120, 30, 80]
    O = [115] * n
    out = run_trace(eng, arr, P, O, prio, realtime=False, time_source=lambda: now[0])
    assert all(r["completed"] for r in out["requests"])
    folder = tmp_path / "prio-run"
    folder.mkdir()
    pd.DataFrame({"request_id": range(n), "arrival_s": arr, "prompt_tokens": P,
                  "output_tokens": O, "priority": prio}).to_csv(folder / "trace.csv",
                                                                 index=False)
    reqs = out["requests"]
    pd.DataFrame({"policy": "priority", "request_id": range(n), "priority": prio,
                  "arrival_s": arr, "first_scheduled_s": [r["scheduled"] for r in reqs],
                  "first_token_s": [r["first_token"] for r in reqs],
                  "last_token_s": [r["last_token"] for r in reqs]}).to_csv(
        folder / "requests.csv", index=False)
    pd.DataFrame([(r["rid"], i, t) for r in reqs for i, t in enumerate(r["token_times"])],
                 columns=["request_id", "token_index", "time_s"]).to_csv(
        folder / "tokens.csv", index=False)
    steps = out["steps"]
    pd.DataFrame({"iter": range(len(steps)), "start_s": [s["start"] for s in steps],
                  "end_s": [s["end"] for s in steps],
                  "n_decode": [s["n_decode"] for s in steps],
                  "n_prefill_tokens": [s["prefill_tokens"] for s in steps],
                  "n_prefill_seqs": [len(s["chunks"]) for s in steps],
                  "max_decode_context": [s["ctx_max"] for s in steps],
                  "sum_decode_context": [s["ctx_sum"] for s in steps],
                  "n_running": [s["n_running"] for s in steps],
                  "n_waiting": [s["n_waiting"] for s in steps]}).to_csv(
        folder / "iterations.csv", index=False)
    run = read_run(folder)
    assert run.check["prefill_seq_mismatches"] == 0
    assert run.check["decode_mismatches"] == 0
    assert run.check["first_token_mismatches"] == 0
    assert [[tuple(c[:3]) for c in ch] for ch in run.chunks] == \
        [[tuple(c) for c in s["chunks"]] for s in steps]
    # Aging mattered: a request was admitted before one of a more urgent class that
    # was already waiting.
    first = {r["rid"]: r["scheduled"] for r in reqs}
    overtaken = [(a, b) for a in range(n) for b in range(n)
                 if prio[a] > prio[b] and first[a] < first[b] and arr[b] < first[a]]
    assert overtaken, "aging never reordered this run: the test would not see it"
