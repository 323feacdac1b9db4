"""Tiered KV (``engine.kv.offload``, ``simulator.model.kv.offload``): the CPU tier's LRU,
what an admission finds in each tier, the load time, a working set over the GPU cache,
capacity 0 as no tier bit for bit, the compiled loop against SimPy and bad input.

The closed forms: a load copies ``blocks x one GPU's slice of a block`` at the link's
rate (the swap copy rule); ``n`` cycles over ``k`` prompts of 32 blocks each, on a GPU
cache of 64 blocks (``k = 3``: LRU keeps none of them until its next turn) hit the CPU
tier on every repeat when the tier holds the ``3 x 32`` blocks, and never when it holds
64 (LRU over a cycle longer than the cache: the same law one tier down).
"""
from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import make_scenario_dict
from loopcheck import assert_identical
from simulator import kernel
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError, Unsupported
from simulator.loops.simulate import simulate
from simulator.model.kv import offload as off
from simulator.model.kv import prefixcache as pc
from simulator.model.kv.manager import PrefixKV
from simulator.report.metrics import requests_table
from simulator.report.output import run_outputs
from simulator.workload import Workload

BS = 16
KV_BYTES_PER_TOKEN = 131_072         # Llama-3-8B: 2 x 32 layers x 8 kv heads x 128 x 2 B
BLOCK_BYTES = KV_BYTES_PER_TOKEN * BS  # 2 MiB; one GPU holds the whole block (TP 1)


# -- the rules on their own ---------------------------------------------------------------
def test_load_time_is_blocks_times_block_bytes_over_the_link():
    # 128 blocks of Llama-3-8B (a 2,048-token prompt) over PCIe 4.0 x16's 25 GB/s.
    nbytes, secs = off.load_time(128, float(BLOCK_BYTES), 25e9)
    assert nbytes == 128 * 2 ** 21 == 268_435_456
    assert secs == 268_435_456 / 25e9            # 10.74 ms, the same division
    assert off.load_time(0, float(BLOCK_BYTES), 25e9) == (0.0, 0.0)
    # The scenario's arithmetic: 64 GB of CPU memory holds 30,517 such blocks.
    assert off.tier_blocks(64e9, BLOCK_BYTES) == 30_517


def test_cpu_tier_is_lru_with_first_blocks_most_recent():
    c, n = off.new_tier(3)
    keys = np.array([11, 12, 13, 14], dtype=np.int64)
    assert off.store_run(c, n, keys, 0, 3) == 3
    # Stored last first: a prompt's first block ends most recently used.
    assert off.lru_keys(c) == [13, 12, 11]
    assert off.store(c, n, np.int64(14)) == 1    # full: drops the least recently used
    assert off.lru_keys(c) == [12, 11, 14] and not off.holds(c, 13)
    assert n[off.C_EVICTED] == 1 and n[off.C_STORED] == 4
    assert off.touch(c, np.int64(12))
    assert off.lru_keys(c) == [11, 14, 12]
    assert off.store(c, n, np.int64(11)) == 0    # held: touched, not copied again
    assert off.lru_keys(c) == [14, 12, 11] and n[off.C_STORED] == 4
    assert not off.touch(c, np.int64(99))
    empty, m = off.new_tier(0)                  # holds nothing: every store is dropped
    assert off.store_run(empty, m, keys, 0, 4) == 0 and off.lru_keys(empty) == []
    with pytest.raises(ValueError):
        off.new_tier(-1)


def test_admission_loads_what_the_gpu_evicted_and_the_cpu_kept():
    kv = PrefixKV(4, BS, cpu_blocks=8)
    a, b = [1, 2, 3], [7, 8, 9, 10]
    assert kv.allocate(1, 3 * BS, a) == 0 and kv.loaded == 0
    kv.register(1, a, 3 * BS)
    kv.free(1)
    assert kv.stats.stored_blocks == 3
    kv.allocate(2, 4 * BS, b)                  # evicts every cached block of a
    kv.register(2, b, 4 * BS)
    kv.free(2)
    assert kv.admission(3 * BS, a) == (2 * BS, 3)   # 3 found in CPU; the last recomputed
    assert kv.allocate(3, 3 * BS, a) == 2 * BS and kv.loaded == 2
    st = kv.stats
    assert (st.hit_blocks, st.cpu_hit_blocks, st.loaded_blocks) == (0, 3, 2)
    # The loaded blocks are named in the GPU cache at once: a request behind it hits them.
    assert [pc.block_of(kv.pool, np.int64(k)) >= 0 for k in a] == [True, True, False]
    assert kv.admission(3 * BS, a) == (2 * BS, 1)
    kv.check()
    # GPU hit first, the CPU run after it: the GPU has 1, 2; the tier has 1..3 (b's
    # blocks pushed nothing out of 8 slots).
    assert kv.admission(4 * BS, [1, 2, 3, 5])[0] == 3 * BS
    kv.free(3)
    kv.check()


# -- a run ----------------------------------------------------------------------------------
N_CYCLES, K = 4, 3                       # A B C A B C ...: 12 requests, 2 s apart
PROMPT = 512                             # one Mooncake hash id = 32 blocks


def _cyclic_workload() -> Workload:
    n = N_CYCLES * K
    return Workload(arrival_s=2.0 * np.arange(n), prompt_tokens=np.full(n, PROMPT),
                    output_tokens=np.ones(n, dtype=np.int64),
                    priority=np.zeros(n, dtype=np.int64),
                    hash_ids=[np.array([i % K], dtype=np.int64) for i in range(n)])


def _cyclic(offload=None, **kv):
    d = make_scenario_dict()
    d["engine"]["kv"] = {"num_blocks": 64, "prefix_caching": True, **kv}
    if offload is not None:
        d["engine"]["kv"]["offload"] = offload
    sc = validate_scenario(d)
    res = simulate(sc, workload=_cyclic_workload(), loop="simpy")
    return res, requests_table(res), res.meta["kv"]


def _gb(blocks: float) -> float:
    return blocks * BLOCK_BYTES / 1e9


def test_working_set_over_the_gpu_cache_hits_the_cpu_tier_on_every_repeat():
    repeats = (N_CYCLES - 1) * K
    _, df0, st0 = _cyclic()
    assert st0["hit_blocks"] == 0                         # LRU over a longer cycle
    res, df, st = _cyclic({"cpu_gb": _gb(K * 32 + 0.5)})  # the tier holds all 3 prompts
    assert st["hit_blocks"] == 0
    assert st["cpu_hit_blocks"] == repeats * 32
    assert st["loaded_blocks"] == repeats * 31            # the last block is recomputed
    assert st["stored_blocks"] == K * 32 and st["cpu_evictions"] == 0
    rep = np.arange(len(df)) >= K
    assert (df["loaded_tokens"][rep] == 31 * BS).all() and (df["loaded_tokens"][~rep] == 0).all()
    assert (df["cached_tokens"][rep] == 31 * BS).all()
    assert (df["kv_load_s"][rep] == 31 * BLOCK_BYTES / 25e9).all()
    assert (df["ttft"][rep] < df0["ttft"][rep]).all()     # 10 ms of copy vs ~30 ms prefill
    assert np.array_equal(df["ttft"][~rep], df0["ttft"][~rep])
    kv = run_outputs(res)[1]["kv"]                         # summary.json's kv section
    assert kv["cpu_block_hit_ratio"] == repeats / (N_CYCLES * K) == 0.75
    assert kv["gpu_block_hit_ratio"] == 0.0
    # GB and seconds: products of the counts (rounding only: rel 1e-12).
    assert kv["loaded_gb"] == pytest.approx(_gb(repeats * 31), rel=1e-12)
    assert kv["stored_gb"] == pytest.approx(_gb(K * 32), rel=1e-12)
    assert kv["offload_load_s"] == pytest.approx(df["kv_load_s"].sum(), rel=1e-12)
    # A tier of 64 blocks is as short of the cycle as the GPU: LRU keeps nothing.
    _, df2, st2 = _cyclic({"cpu_gb": _gb(64.5)})
    assert st2["cpu_hit_blocks"] == 0 and st2["loaded_blocks"] == 0
    assert st2["stored_blocks"] == N_CYCLES * K * 32
    assert st2["cpu_evictions"] == N_CYCLES * K * 32 - 64
    assert np.array_equal(df2["ttft"], df0["ttft"], equal_nan=True)


def test_the_load_lengthens_the_admitting_step_by_its_copy_time():
    _, fast, _ = _cyclic({"cpu_gb": _gb(100), "pcie_gb_per_s": 50})
    _, slow, _ = _cyclic({"cpu_gb": _gb(100), "pcie_gb_per_s": 25})
    rep = np.arange(len(fast)) >= K
    d = (slow["t_prefill"] - fast["t_prefill"]).to_numpy()
    want = 31 * BLOCK_BYTES / 25e9 - 31 * BLOCK_BYTES / 50e9      # 1.30 ms
    # Each request runs alone (2 s apart): the difference is the copy alone, up to the
    # rounding of two clock readings near 20 s (a few 1e-15 s).
    assert np.allclose(d[rep], want, rtol=0, atol=1e-12)
    assert np.array_equal(d[~rep], np.zeros(K))


def test_async_loads_keep_the_copy_out_of_the_steps():
    # vLLM's OffloadingConnector (load: async): the request waits for its KV, no step is
    # longer. Each request runs alone here, so it sees the same time either way (to the
    # rounding of a sum taken in another order) and the steps add up to the loads less.
    sync, dfs, sts = _cyclic({"cpu_gb": _gb(100)})
    asy, dfa, sta = _cyclic({"cpu_gb": _gb(100), "load": "async"})
    assert sts == sta
    np.testing.assert_allclose(dfa["ttft"], dfs["ttft"], rtol=0, atol=1e-12)
    loads = dfs["kv_load_s"].sum()
    assert loads == pytest.approx(9 * 31 * BLOCK_BYTES / 25e9, rel=1e-12)
    assert sync.rec.steps == asy.rec.steps
    assert sync.rec.step_time_total - asy.rec.step_time_total == pytest.approx(loads,
                                                                               rel=1e-9)
    with pytest.raises(Unsupported):      # SimPy only
        simulate(asy.scenario, workload=_cyclic_workload(), loop="compiled")


def test_an_async_load_does_not_stall_a_running_decoder():
    # D decodes 400 tokens while A's prompt (31 blocks) comes back from the CPU tier over
    # a slow link (1 GB/s: 65.0 ms). Sync: one of D's steps waits for the copy; async: D
    # never waits, A prefills at the first step boundary after its KV has landed. D runs
    # the same 400 steps either way, one of them with A's chunk; only the decode context
    # of that step differs (by the few steps it moved), which this profile prices the
    # same to 1e-9 s.
    wl = Workload(arrival_s=np.array([0, 2, 4, 5.0, 6.0]),
                  prompt_tokens=np.array([512, 512, 512, 64, 512]),
                  output_tokens=np.array([1, 1, 1, 400, 1]), priority=np.zeros(5, np.int64),
                  hash_ids=[np.array([h], np.int64) for h in (0, 1, 2, 99, 0)])
    runs = {}
    for load in ("sync", "async"):
        d = make_scenario_dict()
        d["engine"]["kv"] = {"num_blocks": 64,
                             "offload": {"cpu_gb": 1, "pcie_gb_per_s": 1, "load": load}}
        res = simulate(validate_scenario(d), workload=wl, loop="simpy")
        runs[load] = (res, requests_table(res))
    (rs, s), (ra, a) = runs["sync"], runs["async"]
    copy = 31 * BLOCK_BYTES / 1e9
    assert s["kv_load_s"][4] == a["kv_load_s"][4] == copy              # 65.0 ms
    assert s["e2el"][3] - a["e2el"][3] == pytest.approx(copy, abs=1e-9)
    assert rs.rec.steps == ra.rec.steps
    # A itself waits at least as long: its chunk waits for the next step boundary.
    assert a["ttft"][4] >= s["ttft"][4] - 1e-12


def _eight_system_prompts() -> dict:
    """300 requests of eight classes, each with its own system prompt (200-900 tokens)."""
    return make_scenario_dict(workload={
        "kind": "synthetic", "num_requests": 300, "arrival": {"kind": "poisson", "rate": 20.0},
        "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
        "output_tokens": {"kind": "uniform", "low": 5, "high": 60},
        "classes": [{"name": f"c{i}", "system_prompt_tokens": 200 + 100 * i}
                    for i in range(8)]})


def test_a_tier_of_zero_blocks_is_no_offload_bit_for_bit():
    # Shared system prompts under memory pressure: hits, evictions and preemptions.
    d = _eight_system_prompts()
    d["engine"]["kv"] = {"num_blocks": 200, "prefix_caching": True}
    base = simulate(validate_scenario(d), loop="simpy")
    d["engine"]["kv"]["offload"] = {"cpu_gb": 0}
    zero = simulate(validate_scenario(d), loop="simpy")
    a, b = requests_table(base), requests_table(zero)
    assert base.meta["kv"]["hit_blocks"] > 0 and base.meta["kv"]["evictions"] > 0
    assert a["preemptions"].sum() > 0
    for col in a.columns:
        assert np.array_equal(a[col].to_numpy(), b[col].to_numpy(),
                              equal_nan=a[col].dtype.kind == "f"), col
    assert (b["loaded_tokens"] == 0).all() and zero.meta["kv"]["stored_blocks"] == 0
    assert {k: v for k, v in base.meta["kv"].items()} == \
        {k: v for k, v in zero.meta["kv"].items()}


@pytest.mark.skipif(not kernel.ENABLED, reason="the compiled loop needs numba")
@pytest.mark.parametrize("cpu_gb, replicas", [(0.3, 1), (0.2, 2), (0, 1)])
def test_the_compiled_loop_runs_the_cpu_tier_bit_for_bit(cpu_gb, replicas):
    # Eight system prompts over a GPU cache of 200 blocks (preemptions, evictions) and a
    # tier of 143 blocks (0.3 GB) or 95 per replica (0.2 GB, two replicas), which each prompt
    # block computed also enters (the unique questions too: most are evicted unused), or
    # none.
    d = _eight_system_prompts()
    d["engine"]["kv"] = {"num_blocks": 200, "offload": {"cpu_gb": cpu_gb}}
    d["cluster"] = {"replicas": replicas}
    sc = validate_scenario(d)
    a, b = simulate(sc, loop="simpy"), simulate(sc, loop="compiled")
    assert b.meta["loop"] == "compiled"
    assert_identical(a, b)
    for f in ("loaded_tokens", "kv_load_s"):
        np.testing.assert_array_equal(getattr(a.rec, f), getattr(b.rec, f), err_msg=f)
    assert a.meta["kv"] == b.meta["kv"]
    if cpu_gb:
        assert a.meta["kv"]["loaded_blocks"] > 0


# -- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize("offload, field", [
    ({"cpu_gb": -1}, "engine.kv.offload.cpu_gb"),
    ({"cpu_gb": 8, "pcie_gb_per_s": 0}, "engine.kv.offload.pcie_gb_per_s"),
    ({"cpu_gb": 8, "pcie_gbs": 25}, "engine.kv.offload.pcie_gbs"),
    ({"pcie_gb_per_s": 25}, "engine.kv.offload.cpu_gb"),
    ({"cpu_gb": True}, "engine.kv.offload.cpu_gb"),
    ({"cpu_gb": 1e300}, "engine.kv.offload.cpu_gb"),   # past 1 PB (an internal error once)
])
def test_bad_offload_keys_name_the_field(offload, field):
    d = make_scenario_dict()
    d["engine"]["kv"]["offload"] = offload
    with pytest.raises(LatsimError) as e:
        validate_scenario(d)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_a_tier_whose_bookkeeping_does_not_fit_is_refused_before_running(monkeypatch):
    """A tier of more blocks than this machine can index is one line naming cpu_gb, from
    the scenario's replica arguments (before any simulation), not an out-of-memory."""
    import simulator.errors as E
    from simulator.deploy.replica import replica_kv_args
    monkeypatch.setattr(E, "available_memory", lambda: 2**30)      # a 1 GiB machine
    d = make_scenario_dict()
    d["engine"]["kv"]["offload"] = {"cpu_gb": 1e5}
    with pytest.raises(LatsimError) as e:
        replica_kv_args(validate_scenario(d))
    assert "engine.kv.offload.cpu_gb" in str(e.value) and "\n" not in str(e.value)


def test_offload_with_prefix_caching_off_is_refused():
    d = make_scenario_dict()
    d["engine"]["kv"].update(prefix_caching=False, offload={"cpu_gb": 8})
    with pytest.raises(LatsimError) as e:
        validate_scenario(d)
    assert "engine.kv" in str(e.value) and "prefix_caching" in str(e.value)


def test_cli_exits_2_on_a_bad_offload_before_running(tmp_path):
    from simulator.cli.main import app
    import yaml
    d = make_scenario_dict()
    d["engine"]["kv"]["offload"] = {"cpu_gb": "lots"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output[-800:]
    assert "engine.kv.offload.cpu_gb" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("base, entry, says", [
    ({"offload": {"cpu_gb": 8}}, {"prefix_caching": False}, "offload needs prefix_caching"),
    ({"prefix_caching": True}, {"allocation": "contiguous"}, "needs allocation: paged"),
])
def test_a_policy_entry_that_breaks_the_merged_kv_is_refused_at_load(base, entry, says):
    # A run's engine.kv is the scenario's with its entry's changes: checked when read,
    # one line naming the entry, not an internal error when that run starts.
    d = make_scenario_dict(policies=[{"policy": "chunked", "label": "a"},
                                     {"policy": "chunked", "label": "b", "kv": entry}])
    d["engine"]["kv"].update(base)
    with pytest.raises(LatsimError) as e:
        validate_scenario(d)
    assert "policies ('b'): kv: " in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)
