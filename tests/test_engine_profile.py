"""real_engine's profiler: the JSON it writes is a valid latsim-profile/1 the
simulator's cost model reads, and the GPU script runs end to end on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce")

from real_engine.model import PRESETS  # noqa: E402
from real_engine.profile import (DECODE_BATCHES, build_engine, default_grid,  # noqa: E402
                                 run_profile, time_step_components)

REPO = Path(__file__).resolve().parents[1]
STATS = ("ms", "p10", "p90", "mean", "min", "n")


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("prof")
    prof = run_profile("tiny", "cpu", out=out, quick=True, log=lambda s: None)
    return prof, out / "cpu-tiny.json"


def test_profile_format(tiny_profile):
    prof, path = tiny_profile
    assert json.loads(path.read_text()) == prof
    assert prof["format"] == "latsim-profile/1"
    meta = prof["meta"]
    for k in ("hardware", "source", "model", "dtype", "torch", "date", "notes"):
        assert meta[k]
    assert meta["dtype"] == "fp32" and meta["model"]["name"] == "tiny"
    assert set(meta["model"]) >= {"n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim",
                                  "ffn", "vocab", "params"}
    eng = prof["engine"]
    assert eng["decode_attention"] == "paged" and eng["kv_block_size"] == 16
    assert eng["cuda_graphs"] is False and eng["host_overhead_ms"] > 0
    keys = {"prefill": ("chunk", "prior"), "decode": ("batch", "context"),
            "mixed": ("batch", "context", "chunk", "prior")}
    for section, cols in keys.items():
        assert prof[section], section
        for r in prof[section]:
            assert set(r) == set(cols) | set(STATS)
            assert 0 < r["min"] <= r["p10"] <= r["ms"] <= r["p90"]
    assert {r["prior"] for r in prof["prefill"]} == {0, 256}
    assert 12 in {r["batch"] for r in prof["decode"]}


def test_simulator_reads_the_profile(tiny_profile):
    cm = pytest.importorskip("simulator.cost.profile")
    prof, path = tiny_profile
    data = cm.load_profile(path)
    model = cm.ProfileCostModel(data)
    assert model.decode_ms(4, 100) > 0 and model.prefill_ms(64, 0) > 0


def test_step_components():
    torch.set_num_threads(1)
    e = build_engine("tiny", "cpu", num_blocks=128)
    c = time_step_components(e, batch=4, context=40, steps=5)
    for part in ("schedule", "prepare", "issue", "sync", "apply", "total"):
        assert c["decode"][part] >= 0 and c["smallest"][part] >= 0
    assert c["decode"]["total"] >= c["decode"]["issue"]
    assert c["host_overhead_ms"] > 0 and not e.seqs and e.cache.num_free == 128


def test_grids_are_scaled():
    g = default_grid(PRESETS["llama3-8b"], "cuda")
    assert tuple(g.decode_batches) == DECODE_BATCHES and max(g.prefill_chunks) == 4096
    assert g.max_blocks() * 2 * 2**20 < 60 * 2**30     # KV for the grid fits an H200
    tiny = default_grid(PRESETS["tiny"], "cpu")
    assert len(tiny.decode_batches) == len(DECODE_BATCHES)
    assert default_grid(PRESETS["llama3-8b"], "cpu").repeats <= 3   # 8B on a CPU: coarse


def test_gpu_script_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_profile.py"),
                        "--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--quick",
                        "--threads", "1", "--graphs", "on"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    prof = json.loads((tmp_path / "cpu-tiny.json").read_text())
    assert prof["decode"] and prof["engine"]["decode_attention"] == "paged"
    log = (tmp_path / "cpu-tiny.log").read_text()
    assert "decode batch 8" in log and '"profile": "ok"' in log
    assert "padded graph check" in log     # the graph path's padding ran (eagerly)


def test_grid_max_blocks_holds_every_row_the_profiler_sets_up():
    """``Grid.max_blocks`` counts the requests ``setup_state`` installs (one function
    describes them): a cache of exactly that many blocks holds every row, including
    a chunk that leaves one prompt token for later (15 + 1 tokens + 1 output = 2 blocks
    of 16; the old count, 1, would not hold it)."""
    from real_engine.profile import Grid, build_engine, setup_state
    grid = Grid(prefill_chunks=(15,), prefill_priors=(0,), decode_batches=(1,),
                decode_contexts=(2,), repeats=1, warmup=0)
    eng = build_engine("tiny", "cpu", num_blocks=grid.max_blocks())
    assert grid.max_blocks() == 2
    for row in (dict(chunk=15, prior=0), dict(chunk=15, prior=0, final=False),
                dict(batch=1, context=2)):
        setup_state(eng, **row)
    eng.clear()
