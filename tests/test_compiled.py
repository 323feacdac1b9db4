"""The compiled loop (``simulator.loops.compiled``) is the SimPy model, bit for bit.

Every recorded array, the ITL histogram (sums over the same flushes), the time
series, the step, cost-model, connection and KV tallies and the end of the run must
be *identical* to ``loop="simpy"`` on random configurations of what it compiles:
every built-in policy (fifo, chunked prefill, priority classes with aging, the weighted
fair score), several replicas, round-robin,
random and least-outstanding routing, paged and contiguous memory, watermarks, tight
limits, ties in time, keep-alive pools, a clock stop, and memory pressure (preemption by
recompute and by swap, both victim rules). Its cost lookups are checked against
``ProfileCostModel`` directly, including ``np.interp``'s own formula for long epochs.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from conftest import REPO, make_profile, make_scenario  # noqa: E402
from loopcheck import (BROAD, POLICIES, PRESSURE, assert_identical,  # noqa: E402
                       loop_scenario, pressure_scenario)
from simulator.loops import compiled  # noqa: E402
from simulator.cost.profile import ProfileCostModel, load_profile  # noqa: E402
from simulator.loops.simulate import Unsupported  # noqa: E402
from simulator.report.recorder import ItlHistogram  # noqa: E402
from simulator.loops.simulate import simulate  # noqa: E402


def _same_on_both_loops(sc, flush: int, series_cap=None) -> None:
    """Run ``sc`` on SimPy and compiled with the ITL histogram flushing every ``flush``
    tokens (and the compiled time series capped at ``series_cap``): bit for bit."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ItlHistogram, "FLUSH", flush)
        if series_cap is not None:
            mp.setattr(compiled, "SERIES_CAP", series_cap)
        ref = simulate(sc, loop="simpy")
        res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(**BROAD, until=st.sampled_from([None, 0.7, 5.0]),
       flush=st.sampled_from([3, 64, ItlHistogram.FLUSH]), series_cap=st.sampled_from([2, 4096]),
       cost=st.sampled_from(["profile", "fitted"]))
def test_compiled_loop_is_the_simpy_model_bit_for_bit(flush, series_cap, **cfg):
    """Tiny ITL and time-series buffers exercise every hand-over to Python (the ITL sum
    is formed per flush, so SimPy's histogram flushes as often)."""
    sc = loop_scenario(noise=False, **cfg)
    _same_on_both_loops(sc, flush, series_cap)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(**PRESSURE, router=st.sampled_from(["round_robin", "least_outstanding", "random"]),
       flush=st.sampled_from([3, 1 << 16]))
def test_under_memory_pressure_the_compiled_loop_preempts_as_simpy_does(flush, **cfg):
    """Few blocks, long outputs: most runs preempt (by recompute or swap; a full swap
    space recomputes), some many times over; each must be SimPy's run bit for bit."""
    sc = pressure_scenario(**cfg)
    _same_on_both_loops(sc, flush)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(**PRESSURE, router=st.sampled_from(["round_robin", "least_outstanding", "random"]),
       sys_prompt=st.sampled_from([40, 100]), flush=st.sampled_from([3, 1 << 16]))
def test_prefix_caching_under_memory_pressure_is_the_simpy_run(flush, **cfg):
    """Prefix caching (``model.kv.prefixcache``'s kernels on both loops): two of three
    classes share a system prompt, so requests hit each other's blocks; few blocks and
    long outputs evict cached blocks, preempt (a recompute's re-admission hits its own
    freed prefix), swap, and drop an admission whose hit an earlier one evicted.
    Not vacuous: the draws hit, evict and preempt (counted below)."""
    sc = pressure_scenario(caching=True, **cfg)
    _same_on_both_loops(sc, flush)


@pytest.mark.parametrize("policy", ["chunked", "fifo", "priority_aging"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_prefix_hits_evictions_and_preemptions_compiled(policy, preemption):
    """Not vacuous: one pressure draw that hits shared prefixes (~200 blocks), evicts
    cached blocks (~20), preempts (~90 times) and, with swap, swaps some decoders out;
    the compiled run is SimPy's bit for bit."""
    sc = pressure_scenario(n=80, seed=7, policy=policy, replicas=1, router="round_robin",
                           watermark=0.0, blocks=40, max_seqs=16, budget=128, chunk=None,
                           rate=400.0, net="zero", out_hi=200, aging=1.0, victim="latest",
                           preemption=preemption, swap_gb=0.01, cost="profile",
                           caching=True, sys_prompt=40)
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)
    kv = ref.meta["kv"]
    assert kv["hit_blocks"] > 100 and kv["evictions"] > 5
    assert ref.rec.preemptions.sum() > 50 and ref.rec.cached_tokens.sum() > 0
    assert (ref.rec.swapped_bytes > 0).any() == (preemption == "swap")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**BROAD, sys_prompt=st.sampled_from([40, 100]), until=st.sampled_from([None, 0.7]),
       series_cap=st.sampled_from([2, 4096]))
def test_prefix_caching_is_the_simpy_run_on_broad_configurations(series_cap, **cfg):
    """Shared system prompts on every policy, router, replica count and limit (paged: a
    contiguous cache has no prefix caching); the time series' shared-block column too."""
    cfg["alloc"] = "paged"
    sc = loop_scenario(noise=False, caching=True, **cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled, "SERIES_CAP", series_cap)
        ref = simulate(sc, loop="simpy")
        res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)


def _vllm_serving(sc, async_sched: bool, frontend: bool):
    """``sc`` with vLLM v1's engine loop (async scheduling) and API server stage."""
    from simulator.wire.frontend import FrontendConfig
    sc.engine.async_scheduling = async_sched
    sc.engine.frontend = FrontendConfig() if frontend else None
    return sc


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**PRESSURE, router=st.sampled_from(["round_robin", "least_outstanding", "random"]),
       caching=st.booleans(), sys_prompt=st.sampled_from([0, 40]),
       async_sched=st.booleans(), frontend=st.booleans())
def test_async_scheduling_and_front_end_under_pressure_are_the_simpy_run(
        async_sched, frontend, **cfg):
    """Async scheduling (arrivals wait in an inbox until a decision sees them:
    ``asyncsched.sees``, no decode epochs) and the API server (its response side on
    each delivery, the outputs ahead of a first token, the bare network for a refused
    request's connection), with and without prefix caching, under memory pressure."""
    sc = _vllm_serving(pressure_scenario(**cfg), async_sched, frontend)
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**BROAD, until=st.sampled_from([None, 0.7]), caching=st.booleans(),
       sys_prompt=st.sampled_from([0, 40]), async_sched=st.booleans(),
       frontend=st.booleans())
def test_async_scheduling_and_front_end_are_the_simpy_run(async_sched, frontend, **cfg):
    """The same on the broad configurations (WAN connections: refused requests release
    pooled connections; clock stops)."""
    sc = _vllm_serving(loop_scenario(noise=False, **cfg), async_sched, frontend)
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)


def test_async_scheduling_changes_the_run():
    """Not vacuous: on the same traffic async scheduling admits later than synchronous
    scheduling (a decision sees arrivals by the previous one), on both loops alike."""
    sc = loop_scenario(150, 3, "chunked", 1, "round_robin", "paged", None, 0.0, 4000, 16,
                       128, None, "poisson", 40.0, "zero", False, None, True, 300, 60)
    sync = simulate(sc, loop="compiled")
    asy = simulate(_vllm_serving(sc, True, False), loop="compiled")
    wait = lambda r: float(np.mean(r.rec.scheduled - r.rec.enqueued))  # noqa: E731
    assert wait(asy) > wait(sync)
    assert_identical(simulate(sc, loop="simpy"), asy)


@pytest.mark.parametrize("blocks", [600, 3000])
def test_mooncake_prefix_hashes_compiled(blocks):
    """Real prefix hashes (the Mooncake slice, ``tests/data``): prompts share earlier
    turns; 600 blocks evicts and preempts, 3000 keeps more cached."""
    wl = {"kind": "trace", "path": str(REPO / "tests" / "data" / "mooncake_conv_head30.jsonl"),
          "speedup": 20.0}
    sc = make_scenario(workload=wl, engine={
        "policy": "chunked", "max_num_seqs": 16, "max_num_batched_tokens": 2048,
        "kv": {"num_blocks": blocks, "prefix_caching": True}})
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="compiled")
    assert_identical(ref, res)
    assert ref.meta["kv"]["hit_blocks"] > 0 and ref.meta["kv"]["evictions"] > 0


def test_compiled_loop_runs_the_common_configurations():
    """Not vacuous: with room to spare every policy, router and allocation compiles."""
    for policy, router, alloc in itertools.product(POLICIES,
                                                   ("round_robin", "least_outstanding",
                                                    "random"),
                                                   ("paged", "contiguous")):
        sc = loop_scenario(300, 3, policy, 2, router, alloc, None, 0.0, 20000, 16, 256, None,
                       "poisson", 20.0, "wan", False, None, True, 300, 60)
        res = simulate(sc, loop="compiled")
        assert res.meta["loop"] == "compiled", (policy, router, alloc)
        assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("over, why", [
    ({"stream": {"every_tokens": 4}}, "per-request stream models"),
])
def test_what_the_compiled_loop_leaves_out_runs_on_simpy(over, why):
    sc = make_scenario(**over)
    with pytest.raises(Unsupported, match=why):
        simulate(sc, loop="compiled")
    assert simulate(sc).meta["loop"] == f"simpy ({why})"


def test_cost_noise_runs_on_simpy():
    sc = make_scenario()
    sc.model.cost.noise = True
    with pytest.raises(Unsupported, match="cost noise"):
        simulate(sc, loop="compiled")


def test_a_policy_with_kernels_it_does_not_know_runs_on_simpy(tmp_path):
    """A user's policy with its own fill rule: SimPy runs it; auto says why."""
    from simulator.config.scenario import validate_scenario
    mod = tmp_path / "halfbudget.py"
    mod.write_text(HALF_BUDGET_POLICY)
    data = make_scenario().model_dump(mode="json")
    data["plugins"] = [str(mod)]
    data["engine"]["policy"] = "half_budget"
    sc = validate_scenario(data)
    with pytest.raises(Unsupported, match="kernels the compiled loop does not know"):
        simulate(sc, loop="compiled")


HALF_BUDGET_POLICY = """
from simulator.model.policies.chunked import ChunkedPolicy
from simulator.model.scheduling import register_policy


def fill_half(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre, cand_rem,
              cand_need, n_cand, out_pre, out_cand):
    return ChunkedPolicy.fill_kernel(budget // 2, chunk, max_seqs, n_running, free, n_dec,
                                     pre_rem, n_pre, cand_rem, cand_need, n_cand, out_pre,
                                     out_cand)


@register_policy("half_budget")
class HalfBudget(ChunkedPolicy):
    fill_kernel = fill_half
"""


def test_without_numba_auto_uses_simpy(monkeypatch):
    real = compiled.importlib.util.find_spec
    monkeypatch.setattr(compiled.importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba" else real(name, *a))
    sc = make_scenario(workload={"kind": "synthetic", "num_requests": 20_000,
                                 "arrival": {"kind": "poisson", "rate": 5.0},
                                 "prompt_tokens": {"kind": "constant", "value": 20},
                                 "output_tokens": {"kind": "constant", "value": 2}})
    with pytest.raises(Unsupported, match=r"numba is not installed"):
        simulate(sc, loop="compiled")
    assert simulate(sc).meta["loop"] == "simpy (numba is not installed)"


def test_auto_compiles_large_runs_only_whatever_ran_before():
    """The loop ``auto`` picks depends on the run's size alone: a sweep's table records
    it, and a resumed sweep must write the same table as an uninterrupted one."""
    assert compiled.worth_compiling(compiled.COMPILE_MIN_REQUESTS)
    simulate(make_scenario(), loop="compiled")
    assert not compiled.worth_compiling(compiled.COMPILE_MIN_REQUESTS - 1)
    assert simulate(make_scenario()).meta["loop"].startswith("simpy (")


def _cost_models():
    from simulator.cost.fitted import FittedCostModel
    for p in sorted((REPO / "profiles").glob("*.json")):
        yield ProfileCostModel(load_profile(p))
        yield FittedCostModel(load_profile(p))
    yield ProfileCostModel(make_profile(
        prefill=((16, 0, 2.0), (256, 0, 9.0), (256, 1024, 12.0), (64, 2048, 6.0)),
        decode=((1, 64, 1.5), (8, 64, 2.5), (8, 1024, 4.0), (32, 512, 6.0)),
        mixed=((8, 512, 128, 0, 10.0),), padded=True), scale=1.3)


@pytest.mark.parametrize("cm", list(_cost_models()), ids=lambda c: (
    type(c).__name__[:7] + ":" + c.profile["meta"].get("source", "synthetic")[:20]))
def test_compiled_cost_lookups_are_the_cost_model(cm):
    """The compiled loop's step times and decode epochs call the cost model's own
    kernels with its arguments: the same seconds, lookups and extrapolations as the
    Python model, below, inside and above the measured range."""
    from simulator.loops.compiled.cost import decode_ends, pack_cost, step_time
    rng = np.random.default_rng(7)
    max_batch = 300
    PACK = pack_cost(cm)
    CL = np.zeros(2, dtype=np.int64)
    chp = np.zeros(8, dtype=np.int64)
    chf = np.zeros(8, dtype=np.bool_)
    chn = np.zeros(8, dtype=np.int64)
    top = 9000
    for _ in range(300):
        nd = int(rng.integers(0, max_batch + 1))
        ctx_max = int(rng.integers(1, top))
        ctx_sum = nd * int(rng.integers(1, ctx_max + 1))
        nch = int(rng.integers(0 if nd else 1, 5))
        parts = []
        for i in range(nch):
            chn[i], chp[i] = int(rng.integers(1, 9000)), int(rng.integers(0, 30_000))
            chf[i] = bool(rng.integers(2))
            parts.append((int(chn[i]), int(chp[i]), bool(chf[i])))
        before = (cm.lookups, cm.extrapolations)
        want = cm.step_time(nd, ctx_max, ctx_sum, parts)
        CL[:] = 0
        got = step_time(*PACK, CL, nd, ctx_max, ctx_sum, chn, chp, chf, nch)
        assert got == want
        assert (CL[0], CL[1]) == (cm.lookups - before[0], cm.extrapolations - before[1])
        if nd == 0:
            continue
        k = int(rng.choice([2, 31, 32, 33, 500, 4096]))
        ctx0 = float(rng.integers(1, top)) if cm.padded else float(rng.uniform(1, top))
        now = 0.0 if rng.integers(2) else float(rng.uniform(0, 1000))
        before = (cm.lookups, cm.extrapolations)
        want = list(itertools.accumulate(cm.decode_times(nd, ctx0, k), initial=now))[1:]
        ends = np.zeros(k)
        CL[:] = 0
        decode_ends(*PACK, CL, nd, ctx0, k, now, ends, np.zeros(4096),
                    np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.bool_))
        assert ends.tolist() == want
        assert (CL[0], CL[1]) == (cm.lookups - before[0], cm.extrapolations - before[1])


def test_profile_decode_epochs_are_single_steps():
    """A decode epoch's step times are the single step's (the same kernel): a run of k
    decode-only steps equals k calls of ``step_time`` at growing context."""
    for cm in _cost_models():
        nd, ctx_max = 24, 700
        times = cm.decode_times(nd, float(ctx_max), 40)
        single = [cm.step_time(nd, ctx_max + j, nd * (ctx_max + j), ()) for j in range(40)]
        np.testing.assert_allclose(times, single, rtol=1e-12)


def test_cli_compiled_loop_gives_the_same_requests_csv(tmp_path):
    from test_cli import latsim
    a = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "a",
               "--set", "workload.num_requests=300", "--loop", "compiled")
    b = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "b",
               "--set", "workload.num_requests=300", "--loop", "simpy")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert "(compiled)" in a.stdout and "(simpy)" in b.stdout
    assert (tmp_path / "a/requests.csv").read_bytes() == (tmp_path / "b/requests.csv").read_bytes()
    bad = latsim("run", "scenarios/quickstart.yaml", "--loop", "compiled",
                 "--set", "stream.every_tokens=4")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "latsim: error: --loop: the compiled loop cannot run this scenario: "
        "per-request stream models (got 'compiled')")


def test_a_larger_run_samples_on_an_interval_and_runs_long_epochs():
    """Over 5,000 requests the time series is sampled on an interval, and long outputs
    make epochs of more than 32 steps (numpy's formula in ``decode_times``)."""
    sc = loop_scenario(6000, 11, "chunked", 2, "least_outstanding", "paged", None, 0.0, 4000, 32,
                   512, None, "poisson", 30.0, "wan", False, None, True, 300, 400)
    res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert 0 < len(res.rec.series[0][0]) < res.rec.steps / 2
    assert_identical(simulate(sc, loop="simpy"), res)


def test_the_kernel_cache_is_named_by_every_kernel_source(tmp_path, monkeypatch):
    """numba keys a cache on the function's own file only; a change to any file that
    holds kernels (a callee's, say, in another folder) must lead to another cache
    folder, or a caller would keep the callee's old machine code."""
    import shutil

    from simulator import kernel as K
    from simulator.loops.compiled.loop import run
    assert K.CACHE_DIR is not None
    assert run._cache._cache_path.startswith(K.CACHE_DIR)
    monkeypatch.setenv("LATSIM_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "simulator"
    shutil.copytree(K._ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    same = K.cache_dir(root)
    assert same == K.cache_dir(K._ROOT)
    for rel in ("loops/compiled/apply.py", "model/kv/space.py", "cost/profile.py"):
        before = K.cache_dir(root)
        (root / rel).write_text((root / rel).read_text() + "\n# changed\n")
        assert K.cache_dir(root) != before, rel
    # A file outside the kernel folders (the CLI) leaves the cache where it was.
    before = K.cache_dir(root)
    (root / "cli/main.py").write_text((root / "cli/main.py").read_text() + "\n# changed\n")
    assert K.cache_dir(root) == before


def test_outputs_longer_than_an_epoch_cap():
    """Outputs of thousands of tokens: epochs stop at ``MAX_EPOCH_STEPS`` (4096) and
    the next one takes over, exactly where SimPy's do."""
    sc = make_scenario(workload={"kind": "synthetic", "num_requests": 6,
                                 "arrival": {"kind": "poisson", "rate": 0.05},
                                 "prompt_tokens": {"kind": "constant", "value": 100},
                                 "output_tokens": {"kind": "uniform", "low": 4000,
                                                   "high": 9000}})
    res = simulate(sc, loop="compiled")
    assert res.rec.generated.max() > 4096
    assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("victim", ["priority", "latest"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_tied_arrivals_under_memory_pressure(tmp_path, victim, policy, preemption):
    """Requests arriving together (a trace's tied timestamps, no network): victims and
    requeued requests are ordered by arrival, then by request id, as in SimPy."""
    rng = np.random.default_rng(3)
    rows = ["arrival_s,prompt_tokens,output_tokens,priority"]
    for i in range(90):
        rows.append(f"{i // 4 * 0.05:.2f},{rng.integers(20, 120)},{rng.integers(20, 160)},"
                    f"P{rng.integers(0, 3)}")
    trace = tmp_path / "tied.csv"
    trace.write_text("\n".join(rows) + "\n")
    sc = make_scenario(workload={"kind": "trace", "path": str(trace)}, engine={
        "policy": policy, "max_num_seqs": 16, "max_num_batched_tokens": 128, "aging_s": 0.2,
        "kv": {"num_blocks": 48, "victim": victim, "preemption": preemption,
               "swap_space_gb": 0.02}})
    res = simulate(sc, loop="compiled")
    assert res.rec.preemptions.sum() > 0
    assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("num_blocks", [None, 300])
def test_vllm_preset_replay_is_the_simpy_run(num_blocks):
    """A realistic vLLM scenario all at once: ``engine: {preset: vllm}`` (prefix caching,
    async scheduling, the API server, chunked prefill), ``roofline`` costs and
    inference-perf traffic whose prompts share system prompts and repeat (hash-id keys,
    as ``benchmarks/vllm_runs.py`` replays the recorded runs); with the GPU's own cache
    and with 300 blocks (evictions, preemptions). Bit for bit."""
    from simulator.config.scenario import validate_scenario
    wl = {"kind": "inference_perf",
          "data": {"shared_prefix": {"num_groups": 4, "num_prompts_per_group": 6,
                                     "system_prompt_len": 700, "question_len": 300,
                                     "output_len": 120}},
          "load": {"type": "constant", "stages": [{"rate": 20, "duration": 6},
                                                   {"rate": 60, "duration": 3}]}}
    kv = {"max_model_len": 4096}
    if num_blocks:
        kv["num_blocks"] = num_blocks
    sc = validate_scenario({
        "name": "vllm", "seed": 2, "workload": wl,
        "network": {"distance_km": 0, "base_rtt_ms": 0.2, "tls": "none", "gateway_ms": 0,
                    "clients": 32, "pool_size": 16},
        "engine": {"preset": "vllm", "max_num_seqs": 32, "max_num_batched_tokens": 2048,
                   "kv": kv},
        "model": {"name": "llama-2-7b", "cost": {"kind": "roofline", "gpu": "h100-sxm",
                                                 "tp": 1}}})
    assert sc.engine.async_scheduling and sc.engine.frontend is not None
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="compiled")
    assert res.meta["loop"] == "compiled"
    assert_identical(ref, res)
    assert ref.meta["kv"]["hit_blocks"] > 0
    if num_blocks:
        assert ref.meta["kv"]["evictions"] > 0
