"""real_engine's KV memory under pressure, on the simulator's block manager:
prefix-cache hits really share blocks and change no logits, a request preempted
(recompute or swap) produces the tokens it would have produced anyway, every
block comes back whatever ends a request (cancellation included), the block
manager's invariants hold at every step of random workloads, and the engine and
the simulator's replica make the same memory decisions on the same workload.

All on the ``tiny`` preset in fp32 on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from real_engine.engine import EngineCore  # noqa: E402
from real_engine.model import build_model  # noqa: E402
from simulator.model.kv.blocks import request_blocks  # noqa: E402
from simulator.model.kv.space import KVRules  # noqa: E402
from simulator.model.kv.prefixkeys import keys_from_tokens  # noqa: E402
from simulator.model.scheduling import Seq, make_policy, policy_names  # noqa: E402

BUILTIN = policy_names()

torch.set_num_threads(1)   # 2 shared cores: one thread is faster and steadier

# Logits of one request computed along different paths (a prefix hit's masked SDPA
# over shared blocks vs the plain causal kernel, a recompute prefill vs decodes)
# differ only by float32 summation order: measured max 2e-6 on the tiny model.
ATOL = 2e-5
BS = 16


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def make_engine(model, num_blocks, rules=KVRules(), policy="chunked", max_num_seqs=6,
                budget=48, chunk=13, **kw):
    pol = make_policy(policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      chunk_size=chunk, aging_s=3.0)
    return EngineCore(model, pol, num_blocks=num_blocks, kv_rules=rules, **kw)


class Logits:
    """Records the LM-head output of every step, per request, in token order."""

    def __init__(self, monkeypatch, model) -> None:
        self.rows: list = []
        orig = model.logits

        def logits(hidden, rows=None):
            out = orig(hidden, rows)
            self.rows.append(out.detach().clone())
            return out

        monkeypatch.setattr(model, "logits", logits)

    def per_request(self, results) -> dict:
        """Logits by rid from the step results (each non-empty step ran one forward)."""
        out: dict = {}
        steps = [r for r in results if not r.plan.is_empty]
        assert len(steps) == len(self.rows)
        for r, lg in zip(steps, self.rows):
            rids = list(r.plan.decode) + [rid for (rid, _), (_, _, done)
                                          in zip(r.plan.prefill, r.chunks) if done]
            assert len(rids) == lg.shape[0]
            for rid, row in zip(rids, lg):
                out.setdefault(rid, []).append(row)
        return {rid: torch.stack(v) for rid, v in out.items()}


def run(e, results=None, check=True):
    """Step to the end; returns tokens per rid (and appends step results)."""
    toks: dict = {}
    while e.has_work:
        r = e.step()
        if results is not None:
            results.append(r)
        if check:
            e.kv.manager.check()
        for rid, t in r.tokens.items():
            toks.setdefault(rid, []).append(t)
    return toks


def ids(rng, vocab, n):
    return rng.integers(0, vocab, n)


def assert_all_free(e):
    e.kv.manager.check()
    assert e.cache.num_free == e.cache.num_blocks
    assert not e.kv.manager._tables and not e.seqs and e.cpu_used == 0


# -- prefix caching ------------------------------------------------------------------

@pytest.mark.parametrize("while_running", [True, False], ids=["shared-live", "evictable"])
def test_prefix_hit_logits_equal_no_hit(model, monkeypatch, while_running):
    """Request 1 shares its first 3 blocks with request 0. Served after it with prefix
    caching, it starts prefill at token 48, attending to request 0's blocks (still
    in request 0's table, or cached after request 0 finished); every logit it gets
    equals the run without caching."""
    rng = np.random.default_rng(7)
    V = model.cfg.vocab
    shared = ids(rng, V, 3 * BS)
    p0 = np.concatenate([shared, ids(rng, V, 10)])
    # Same first blocks; with while_running=False the very same prompt (64 tokens: the
    # hit is capped at 3 of its 4 full blocks, one token is always recomputed).
    p1 = np.concatenate([shared, ids(rng, V, 20)]) if while_running else \
        np.concatenate([shared, ids(rng, V, BS)])
    if not while_running:
        p0 = p1.copy()
    out0 = 20 if while_running else 3

    def serve(caching):
        lg = Logits(monkeypatch, model)
        e = make_engine(model, 64, KVRules(prefix_caching=caching), budget=96, chunk=96)
        results, toks = [], {}
        s0 = e.add_request(0, p0, out0)
        table0 = None
        while e.seqs.get(0) is not None and (s0.generated == 0 or not while_running):
            r = e.step()
            results.append(r)
            if 0 in e.seqs:
                table0 = e.cache.table(0).copy()
            for rid, t in r.tokens.items():
                toks.setdefault(rid, []).append(t)
        s1 = e.add_request(1, p1, 8)
        r = e.step()
        results.append(r)
        for rid, t in r.tokens.items():
            toks.setdefault(rid, []).append(t)
        assert r.admitted == (1,)
        hit = (s1.cached_tokens, e.cache.table(1).copy(), table0,
               e.cache.table(0).copy() if while_running else None, r.chunks)
        for rid, t in run(e, results).items():
            toks.setdefault(rid, []).extend(t)
        assert_all_free(e)
        by_rid = lg.per_request(results)
        monkeypatch.undo()
        return toks, by_rid, hit

    toks_c, lg_c, (cached, t1, t0_before, t0_now, chunks) = serve(True)
    toks_n, lg_n, (cached_n, *_) = serve(False)
    assert cached == 3 * BS and cached_n == 0
    # The hit really shares blocks: request 1's first 3 block ids are request 0's.
    np.testing.assert_array_equal(t1[:3], t0_before[:3])
    if while_running:
        np.testing.assert_array_equal(t1[:3], t0_now[:3])   # in both tables at once
        assert not set(t1[3:].tolist()) & set(t0_now.tolist())
    assert chunks[0][:2] == (len(p1) - 3 * BS, 3 * BS)      # prefill starts after the hit
    assert toks_c == toks_n
    for rid in (0, 1):
        assert lg_c[rid].shape == lg_n[rid].shape
        torch.testing.assert_close(lg_c[rid], lg_n[rid], atol=ATOL, rtol=0)


def test_prefix_cache_keys_and_stats(model):
    """Keys come from the prompt's token ids; a third request with the same system
    prompt hits too; a different first block hits nothing."""
    rng = np.random.default_rng(3)
    V = model.cfg.vocab
    sys_p = ids(rng, V, 2 * BS)
    e = make_engine(model, 64, KVRules(prefix_caching=True))
    a = e.add_request(0, np.concatenate([sys_p, ids(rng, V, 5)]), 2)
    run(e)
    b = e.add_request(1, np.concatenate([sys_p, ids(rng, V, 9)]), 2)
    c = e.add_request(2, np.concatenate([ids(rng, V, 1), sys_p]), 2)
    assert a.payload.keys(BS) == keys_from_tokens(a.payload.prompt_ids, BS)
    run(e)
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 2 * BS, 0)
    assert e.stats["cached_tokens"] == 2 * BS and e.kv.manager.stats.hit_blocks == 2
    assert_all_free(e)


# -- preemption ------------------------------------------------------------------------

def two_requests(model, seed=11):
    rng = np.random.default_rng(seed)
    V = model.cfg.vocab
    return {0: (ids(rng, V, 30), 30, 0), 1: (ids(rng, V, 30), 30, 0)}


def serve_all(e, reqs, results=None):
    for rid, (p, o, prio) in reqs.items():
        e.add_request(rid, p, o, prio, now=float(rid))
    return run(e, results)


@pytest.mark.parametrize("rules", [KVRules(), KVRules(prefix_caching=True),
                                   KVRules(preemption="swap")],
                         ids=["recompute", "recompute+cache", "swap"])
def test_preempted_request_produces_the_same_tokens(model, monkeypatch, rules):
    """Two requests of 30+30 tokens in a 5-block cache: both are admitted (2 blocks
    each), both need a third block at token 33, only one is free: the later one is
    preempted and resumes after the first finishes. Its tokens and logits are those
    of an unconstrained run."""
    reqs = two_requests(model)
    ref_lg = Logits(monkeypatch, model)
    ref_res = []
    ref = serve_all(make_engine(model, 64), reqs, ref_res)
    ref_logits = ref_lg.per_request(ref_res)
    monkeypatch.undo()

    lg = Logits(monkeypatch, model)
    e = make_engine(model, 5, rules)
    results = []
    got = serve_all(e, reqs, results)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted == [1]
    assert got == ref
    logits = lg.per_request(results)
    for rid in reqs:
        torch.testing.assert_close(logits[rid], ref_logits[rid], atol=ATOL, rtol=0)
    assert_all_free(e)
    if rules.preemption == "swap":
        assert e.stats["swap_outs"] == 1 and e.stats["recomputed_tokens"] == 0
        assert any(r.swapped_in == (1,) for r in results)
    else:
        # Preempted when its context reached 33 (3 tokens generated); readmitted, it
        # prefilled its prompt and those 3 tokens (the 4th comes from that prefill),
        # less its own first prompt block if still cached: that block's KV is recovered
        # by the prefix hit, so it is not counted as recomputed (the simulator's
        # definition of recomputed_tokens).
        redo = [r for r in results if 1 in r.admitted][1]
        n = sum(k for rid, k in redo.plan.prefill if rid == 1)
        cached = BS if rules.prefix_caching else 0
        assert e.stats["recomputed_tokens"] == 33 - cached and n <= 33 - cached
        assert e.stats["cached_tokens"] == cached


@pytest.mark.parametrize("where", ["decoding", "prefilling", "twice"])
@pytest.mark.parametrize("caching", [False, True])
def test_direct_preemption_recomputes_exactly(model, where, caching):
    """The preemption path called directly on a decoding request, on one mid-prefill,
    and twice (the second time as soon as it runs again): same tokens."""
    rng = np.random.default_rng(5)
    V = model.cfg.vocab
    reqs = {0: (ids(rng, V, 40), 12, 0), 1: (ids(rng, V, 57), 9, 1), 2: (ids(rng, V, 20), 15, 0)}
    ref = serve_all(make_engine(model, 64), reqs)
    e = make_engine(model, 64, KVRules(prefix_caching=caching))
    for rid, (p, o, prio) in reqs.items():
        e.add_request(rid, p, o, prio, now=float(rid))
    got: dict = {}
    victim = e.seqs[1]
    done = 0
    for _ in range(200):
        if not e.has_work:
            break
        if done < (2 if where == "twice" else 1):
            state = "decoding" if victim in e.decoding else (
                "prefilling" if victim in e.prefilling else None)
            if where == "twice" and done == 1:
                # Again as soon as it runs again: mid recompute-prefill, or decoding if
                # that prefill took one step (a prefix hit left it less than a chunk).
                want = state
                ok = state is not None
            else:
                want = "prefilling" if where == "prefilling" else "decoding"
                # Mid-prefill: once it has a full block computed (a prefix hit for later).
                ok = state == want and (victim.prefilled > BS if want == "prefilling"
                                        else victim.generated >= 3)
            if ok:
                if want == "prefilling":
                    assert 0 < victim.prefilled < victim.prefill_len
                e._preempt(victim, e.clock())
                done += 1
                assert not e.cache.holds(1) and victim.prefilled == 0
                if want == "decoding":
                    assert victim.prefill_len == victim.prompt_tokens + victim.generated
        r = e.step()
        e.kv.manager.check()
        for rid, t in r.tokens.items():
            got.setdefault(rid, []).append(t)
    assert done == (2 if where == "twice" else 1)
    assert got == ref
    assert victim.payload.preemptions == done
    if caching:   # readmitted, it hit its own prompt blocks (still cached)
        assert victim.cached_tokens >= BS
    assert_all_free(e)


def test_swap_space_full_falls_back_to_recompute(model):
    reqs = two_requests(model)
    ref = serve_all(make_engine(model, 64), reqs)
    e = make_engine(model, 5, KVRules(preemption="swap"), swap_blocks=1)
    assert serve_all(e, reqs) == ref
    assert e.stats["preemptions"] == 1 and e.stats["swap_outs"] == 0
    assert e.stats["recomputed_tokens"] == 33
    assert_all_free(e)


def test_paused_requests_keep_blocks_and_are_never_victims(model):
    """A paused decoder holds its blocks through memory pressure (the others are
    preempted instead), counts towards max_num_seqs, and resumes to the same tokens."""
    rng = np.random.default_rng(2)
    V = model.cfg.vocab
    reqs = {0: (ids(rng, V, 30), 30, 2), 1: (ids(rng, V, 30), 30, 0),
            2: (ids(rng, V, 10), 4, 0)}
    ref = serve_all(make_engine(model, 64), reqs)
    e = make_engine(model, 6, max_num_seqs=2)
    for rid in (0, 1):
        e.add_request(rid, *reqs[rid][:1], reqs[rid][1], reqs[rid][2], now=float(rid))
    got: dict = {}

    def step():
        r = e.step()
        e.kv.manager.check()
        for rid, t in r.tokens.items():
            got.setdefault(rid, []).append(t)
        return r

    while e.seqs[0].generated < 2:
        step()
    assert e.pause(0) and not e.pause(0)
    held = e.cache.table(0).copy()
    e.add_request(2, *reqs[2][:1], reqs[2][1], reqs[2][2], now=2.0)
    preempted = []
    while e.seqs[1].generated < 20:
        r = step()
        # Paused + running = max_num_seqs: request 2 waits.
        assert 2 not in r.admitted
        preempted += r.preempted
    # Request 0 (lowest class) would have been the victim; paused, it is untouched.
    assert 0 not in preempted
    np.testing.assert_array_equal(e.cache.table(0), held)
    assert e.num_running == 2 and len(e.waiting) == 1
    assert e.resume(0)
    for rid, t in run(e).items():
        got.setdefault(rid, []).extend(t)
    assert got == ref
    assert_all_free(e)


def test_contiguous_reserves_the_maximum_and_never_grows(model):
    rng = np.random.default_rng(4)
    V = model.cfg.vocab
    reqs = {0: (ids(rng, V, 20), 30, 0), 1: (ids(rng, V, 5), 3, 0)}
    ref = serve_all(make_engine(model, 64), reqs)
    for max_len, sizes in ((None, {0: request_blocks(20, 30), 1: request_blocks(5, 3)}),
                           (64, {0: 4, 1: 4})):
        e = make_engine(model, 64, KVRules(allocation="contiguous", max_model_len=max_len))
        for rid, (p, o, prio) in reqs.items():
            e.add_request(rid, p, o, prio, now=float(rid))
        got: dict = {}
        while e.has_work:
            r = e.step()
            for rid in list(e.seqs):
                if e.cache.holds(rid):
                    assert len(e.cache.table(rid)) == sizes[rid]
            for rid, t in r.tokens.items():
                got.setdefault(rid, []).append(t)
        assert got == ref
        assert_all_free(e)
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(model, 64, KVRules(allocation="contiguous", max_model_len=16)).add_request(
            0, 10, 10)
    with pytest.raises(ValueError, match="KV blocks"):
        make_engine(model, 4).add_request(0, 60, 10)


# -- blocks come back ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "paused", "requeued",
                                   "swapped"])
def test_cancel_frees_blocks_wherever_the_request_is(model, where):
    """Cancelling a request waiting, mid-prefill, mid-decode, paused, waiting again
    after a recompute preemption, or swapped out frees exactly its blocks at once (its
    host copy too); the others finish with the tokens they would have had anyway."""
    reqs = two_requests(model)
    reqs[2] = (np.arange(7), 5, 0)
    ref = serve_all(make_engine(model, 64, max_num_seqs=2), reqs)
    rules = KVRules(preemption="swap" if where == "swapped" else "recompute")
    e = make_engine(model, 5, rules, max_num_seqs=2)
    for rid, (p, o, prio) in reqs.items():
        e.add_request(rid, p, o, prio, now=float(rid))
    got: dict = {}
    target = {"waiting": 2, "requeued": 1, "swapped": 1}.get(where, 0)
    reached = False
    for _ in range(300):
        if not e.has_work:
            break
        r = e.step()
        e.kv.manager.check()
        for rid, t in r.tokens.items():
            got.setdefault(rid, []).append(t)
        if reached:
            continue
        s = e.seqs[target]
        if where == "waiting":
            reached = True
        elif where == "prefilling":
            reached = s in e.prefilling
        elif where in ("decoding", "paused"):
            reached = s in e.decoding and s.generated >= 2
            if reached and where == "paused":
                assert e.pause(target)
                for rid, t in e.step().tokens.items():
                    got.setdefault(rid, []).append(t)
        else:
            reached = target in r.preempted
            assert not reached or (s in e.swapped) == (where == "swapped")
        if reached:
            used, held = e.kv.manager.num_used, e.kv.manager.blocks_of(target)
            assert (held > 0) == (where not in ("waiting", "requeued", "swapped"))
            assert e.cancel(target) and not e.cancel(target)
            e.kv.manager.check()
            assert e.kv.manager.num_used == used - held and not e.cache.holds(target)
            assert e.cpu_used == 0 and not e.swapped and not e.paused
    assert reached
    assert_all_free(e)
    for rid in reqs:
        if rid != target:
            assert got[rid] == ref[rid]


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_the_block_invariants(model, data):
    """Random adds (shared system prompts), steps, cancels, pauses and resumes under
    random KV rules in a small cache. After every operation: the manager's invariants
    (used + free = capacity, no block both free and referenced, refcounts = tables),
    exactly the running and paused requests hold blocks. At the end no request is
    lost: every one not cancelled produced exactly its output tokens."""
    draw = data.draw
    allocation = draw(st.sampled_from(["paged", "paged", "contiguous"]))
    rules = KVRules(allocation=allocation,
                    preemption=draw(st.sampled_from(["recompute", "swap"])),
                    victim=draw(st.sampled_from(["priority", "latest"])),
                    watermark=draw(st.sampled_from([0.0, 0.1])),
                    prefix_caching=allocation == "paged" and draw(st.booleans()))
    e = make_engine(model, draw(st.integers(6, 12)), rules,
                    policy=draw(st.sampled_from(BUILTIN)), max_num_seqs=4, budget=32, chunk=16,
                    swap_blocks=draw(st.sampled_from([None, 3])))
    V = model.cfg.vocab
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    systems = [ids(rng, V, BS * k) for k in (1, 2)]
    want, got, cancelled = {}, {}, set()
    nxt = 0

    def check():
        e.kv.manager.check()
        holders = {s.rid for s in e.decoding + e.prefilling} | set(e.paused)
        assert set(e.kv.manager._tables) == holders
        assert e.cpu_used == sum(s.payload.swapped_blocks for s in e.swapped)
        assert e.num_running <= 4

    # Adds, steps, cancels, pauses, resumes.
    for op in rng.choice(list("ascpr"), size=100, p=[0.2, 0.62, 0.04, 0.08, 0.06]):
        if op == "a":
            sysp = systems[int(rng.integers(0, 3)) % 2][:int(rng.integers(0, 2 * BS + 1))]
            p = np.concatenate([sysp, ids(rng, V, int(rng.integers(1, 30)))])
            o = int(rng.integers(1, 20))
            why = e.kv.fits(Seq(nxt, 0.0, len(p), o))
            if why is None:
                e.add_request(nxt, p, o, int(rng.integers(0, 3)), now=float(nxt))
                want[nxt] = o
            else:
                with pytest.raises(ValueError, match="KV blocks"):
                    e.add_request(nxt, p, o)
            nxt += 1
        elif op == "s" and e.has_work:
            for rid in e.step().tokens:
                got[rid] = got.get(rid, 0) + 1
        elif op == "c" and e.seqs:
            rid = int(rng.choice(list(e.seqs)))
            assert e.cancel(rid)
            cancelled.add(rid)
        elif op == "p" and e.decoding:
            e.pause(e.decoding[int(rng.integers(0, len(e.decoding)))].rid)
        elif op == "r" and e.paused:
            e.resume(int(rng.choice(list(e.paused))))
        check()
    for rid in list(e.paused):
        e.resume(rid)
    while e.has_work:
        for rid in e.step().tokens:
            got[rid] = got.get(rid, 0) + 1
        check()
    for rid, o in want.items():
        if rid not in cancelled:
            assert got.get(rid) == o, (rid, got.get(rid), o)
        else:
            assert got.get(rid, 0) < o
    assert_all_free(e)


# -- the engine and the simulator decide alike ----------------------------------------------

class _ConstCost:
    """Every step lasts 1 s (the engine's fake clock ticks the same way)."""

    padded = False
    min_step_s = 1.0

    def step_time(self, n_decode, ctx_max, ctx_sum, chunks) -> float:
        return 1.0

    def decode_times(self, batch, ctx0, k) -> list:
        return [1.0] * k


class _Recording:
    """A policy that records the plans it returns (both executors call it)."""

    def __init__(self, policy) -> None:
        self.policy, self.plans = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def schedule(self, state):
        plan = self.policy.schedule(state)
        if not plan.is_empty:
            self.plans.append(plan)
        return plan


def _workload(model, seed=0, n=12):
    rng = np.random.default_rng(seed)
    V = model.cfg.vocab
    systems = [ids(rng, V, 40) for _ in range(3)]
    out = {}
    for r in range(n):
        p = int(rng.integers(0, 3))
        out[r] = (np.concatenate([systems[p], ids(rng, V, int(rng.integers(1, 20)))]),
                  int(rng.integers(1, 30)), p)
    return out


def _policy(name):
    return _Recording(make_policy(name, max_num_seqs=6, max_num_batched_tokens=48,
                                  chunk_size=13, aging_s=3.0))


def _engine_run(model, reqs, rules, policy, nb, swap_blocks):
    pol = _policy(policy)
    t = [0.0]
    e = EngineCore(model, pol, num_blocks=nb, kv_rules=rules, swap_blocks=swap_blocks,
                   clock=lambda: t[0])
    seqs = {rid: e.add_request(rid, p, o, prio, now=0.0) for rid, (p, o, prio) in reqs.items()}
    pre = np.zeros(len(reqs), int)
    steps = 0
    while e.has_work:
        r = e.step()
        assert not r.plan.is_empty
        steps += 1
        for rid in r.preempted:
            pre[rid] += 1
        t[0] += 1.0
    assert_all_free(e)
    return pre, pol.plans, steps, np.array([seqs[r].cached_tokens for r in reqs]), \
        np.array([seqs[r].payload.recomputed_tokens for r in reqs])


def _sim_run(reqs, rules, policy, nb, swap_blocks, mode):
    simpy = pytest.importorskip("simpy")
    from simulator.report.recorder import Recorder
    from simulator.loops.simpy.replica import Replica, SimSeq
    pol = _policy(policy)
    env = simpy.Environment()
    rec = Recorder(len(reqs), 1)
    rep = Replica(env, 0, pol, _ConstCost(), nb, rec, 0.0, 0.0, lambda s, t: None,
                  mode=mode, kv_rules=rules, block_bytes=1.0, swap_bps=1e12,
                  swap_blocks=10**9 if swap_blocks is None else swap_blocks)
    for rid, (p, o, prio) in reqs.items():
        s = SimSeq(rid, 0.0, len(p), o, prio, request_blocks(len(p), o, rules.block_size), 0,
                   False)
        s.keys = keys_from_tokens(p, rules.block_size)   # the engine's keys: prompt ids
        rec.enqueued[rid] = 0.0
        rep.enqueue(s)
    env.run()
    assert not np.isnan(rec.last_token).any()
    return rec.preemptions.astype(int), pol.plans, rec.steps, rec.cached_tokens.copy(), \
        rec.recomputed_tokens.copy()


@pytest.mark.parametrize("policy", BUILTIN)
@pytest.mark.parametrize("rules,swap_blocks", [
    (KVRules(), None), (KVRules(victim="latest"), None), (KVRules(watermark=0.1), None),
    (KVRules(preemption="swap"), 6), (KVRules(prefix_caching=True), None),
    (KVRules(prefix_caching=True, preemption="swap"), None)],
    ids=["recompute", "latest", "watermark", "swap", "cache", "cache+swap"])
def test_engine_and_simulator_make_the_same_memory_decisions(model, policy, rules, swap_blocks):
    """Same workload (shared system prompts, all waiting at t=0), same rules, same
    policy, a 10-block cache: the engine and the simulator's replica (step-by-step
    bookkeeping, and the fast one) preempt the same requests the same number of
    times, get the same prefix hits, count the same recomputed tokens (a re-admission's
    prefix hit is not recomputed, in both), and are handed the very same plans."""
    reqs = _workload(model)
    pre, plans, steps, cached, redo = _engine_run(model, reqs, rules, policy, 10, swap_blocks)
    # (A static batch is admitted only into an empty engine and grows within it here.)
    assert pre.sum() > 0 or rules.watermark > 0 or policy == "static"
    if rules.prefix_caching:
        assert cached.sum() > 0
    for mode in ("slow", "step"):
        s_pre, s_plans, s_steps, s_cached, s_redo = _sim_run(reqs, rules, policy, 10,
                                                             swap_blocks, mode)
        np.testing.assert_array_equal(pre, s_pre, err_msg=mode)
        np.testing.assert_array_equal(cached, s_cached, err_msg=mode)
        np.testing.assert_array_equal(redo, s_redo, err_msg=mode)
        assert steps == s_steps and plans == s_plans, mode
    # Epochs (several decode steps per policy call) change the calls, not the decisions.
    s_pre, _, s_steps, _, s_redo = _sim_run(reqs, rules, policy, 10, swap_blocks, "auto")
    np.testing.assert_array_equal(redo, s_redo)
    np.testing.assert_array_equal(pre, s_pre)
    assert steps == s_steps


def test_trace_under_memory_pressure_replays_in_the_simulator(model):
    """``run_trace`` on a cache too small for the burst: the simulator replaying the
    real step times (``latsim validate``'s logic check) takes the same number of steps
    and preempts the same requests as many times."""
    from real_engine.runner import run_trace
    from real_engine.validate import engine_settings, policy_kwargs, replay_logic_check
    from simulator.workload import Workload
    settings = engine_settings(max_num_seqs=6, max_num_batched_tokens=48, chunk_size=13)
    e = EngineCore(model, make_policy("chunked", **policy_kwargs(settings)), num_blocks=10)
    rng = np.random.default_rng(1)
    n = 12
    wl = Workload(arrival_s=np.zeros(n), prompt_tokens=rng.integers(1, 60, n),
                  output_tokens=rng.integers(1, 40, n), priority=rng.integers(0, 3, n),
                  class_names=("P0", "P1", "P2"))
    res = run_trace(e, wl.arrival_s, wl.prompt_tokens, wl.output_tokens, wl.priority,
                    realtime=False)
    real_pre = np.array([r["preemptions"] for r in sorted(res["requests"], key=lambda r: r["rid"])])
    assert real_pre.sum() > 0 and all(r["completed"] for r in res["requests"])
    assert sum(len(s["preempted"]) for s in res["steps"]) == real_pre.sum()
    # The loop added all twelve before its first step, microseconds apart; the simulator
    # would start a step at the first enqueue, with one request. Same instant for all.
    t0 = min(r["enqueued"] for r in res["requests"])
    for r in res["requests"]:
        r["enqueued"] = t0
    sim, steps = replay_logic_check(res, wl, "chunked", settings, 10)
    assert steps == len(res["steps"])
    np.testing.assert_array_equal(sim["preemptions"].to_numpy(), real_pre)
    # Recompute prefills are real prefill tokens: prompt + recomputed = all prefilled.
    assert sum(s["prefill_tokens"] for s in res["steps"]) == \
        int(wl.prompt_tokens.sum()) + int(sim["recomputed_tokens"].sum())
    assert_all_free(e)
