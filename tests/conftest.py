"""Tiny factories shared by the tests: scenarios, profiles and workloads."""
from __future__ import annotations

import copy
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# What a test reads must not depend on the machine's load: validate's busy-box warning is
# off in every test (and the subprocesses they start) but the one that checks it.
os.environ["LATSIM_NO_LOAD_WARNING"] = "1"
# Rich consoles are built when a CLI module is imported and read the width then: pin it,
# so a table's labels never depend on which test happened to import the CLI first.
os.environ["COLUMNS"] = "200"
DATA = REPO / "data"  # the public data shipped with the repository (data/README.md)


def make_profile(prefill=((1, 0, 1.0), (100_000, 0, 100_000.0)),
                 decode=((1, 1, 1.0),), mixed=(), padded=False, host_overhead_ms=None) -> dict:
    """A profile dict from (chunk, prior, ms) and (batch, context, ms) rows."""
    return {
        "format": "latsim-profile/1",
        "meta": {"hardware": "test", "source": "tests"},
        "engine": {"decode_attention": "padded" if padded else "paged",
                   "host_overhead_ms": host_overhead_ms},
        "prefill": [{"chunk": c, "prior": p, "ms": ms} for c, p, ms in prefill],
        "decode": [{"batch": b, "context": x, "ms": ms} for b, x, ms in decode],
        "mixed": [{"batch": b, "context": x, "chunk": c, "prior": p, "ms": ms}
                  for b, x, c, p, ms in mixed],
    }


ZERO_NET = {"distance_km": 0, "base_rtt_ms": 0, "tls": "none", "gateway_ms": 0,
            "request_overhead_bytes": 0, "bytes_per_prompt_token": 0}
ZERO_STREAM = {"frame_overhead_bytes": 0, "bytes_per_token": 0}


def make_scenario_dict(**over) -> dict:
    """A small valid scenario mapping; keyword args replace whole top-level sections."""
    base = {
        "name": "test",
        "seed": 1,
        "workload": {"kind": "synthetic", "num_requests": 200,
                     "arrival": {"kind": "poisson", "rate": 5.0},
                     "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
                     "output_tokens": {"kind": "uniform", "low": 5, "high": 60}},
        "network": dict(ZERO_NET),
        "stream": dict(ZERO_STREAM),
        "engine": {"policy": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 256,
                   "kv": {"num_blocks": 4096}},
        "model": {"cost": {"kind": "profile", "path": str(REPO / "profiles" /
                                                          "h200-llama3-8b-refbench.json")}},
    }
    for k, v in over.items():
        base[k] = v
    return copy.deepcopy(base)


def make_scenario(**over):
    from simulator.config.scenario import validate_scenario
    return validate_scenario(make_scenario_dict(**over))


def make_workload(n, *, rate=5.0, prompt=100, output=10, priority=None, seed=0, class_names=None):
    """A Poisson workload of ``n`` requests with constant (or given array) lengths."""
    from simulator.workload import Workload
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n))
    p = np.broadcast_to(np.asarray(prompt), (n,)).copy()
    o = np.broadcast_to(np.asarray(output), (n,)).copy()
    pr = np.zeros(n, dtype=int) if priority is None else np.asarray(priority)
    names = class_names or tuple(f"P{i}" for i in range(int(pr.max()) + 1))
    return Workload(arrival_s=arr, prompt_tokens=p, output_tokens=o, priority=pr,
                    class_names=names)


@pytest.fixture
def data_dir() -> Path:
    """The repository's ``data/`` folder. It is part of the checkout: a test that needs a
    file from it fails (file not found), never skips, when the file is missing."""
    return DATA


@pytest.fixture(autouse=True)
def _exclusive_under_xdist(request, tmp_path_factory):
    """Under pytest-xdist (``-n 2``, pyproject's addopts) a test marked ``exclusive``
    (it times a real server on this machine's CPUs) runs with no other test running:
    it takes an exclusive lock that every other test holds shared while it runs."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    lock = tmp_path_factory.getbasetemp().parent / "exclusive.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if request.node.get_closest_marker("exclusive")
                    else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
