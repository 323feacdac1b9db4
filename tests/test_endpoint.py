"""latsim validate --endpoint: the simulator against latsim bench over real loopback HTTP.

The tiny model on CPU, a handful of requests; the servers are started in-process
on free loopback ports. The profile is a small hand-written one (the point here is
the wiring, tables and measured wire stages, not the cost model's accuracy, which
``test_validate`` checks with a measured profile), so no profiling run is needed.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from conftest import make_profile  # noqa: E402
from simulator.errors import LatsimError  # noqa: E402
from simulator.workload import Workload  # noqa: E402

N = 8


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    """A tiny-model profile of plausible CPU step costs (ms), naming its model."""
    prof = make_profile(prefill=((1, 0, 2.0), (512, 0, 12.0), (4096, 0, 90.0)),
                        decode=((1, 64, 3.0), (16, 64, 4.0), (1, 1024, 3.5), (16, 1024, 6.0)))
    prof["meta"]["model"] = {"name": "tiny"}
    p = tmp_path_factory.mktemp("prof") / "tiny.json"
    p.write_text(json.dumps(prof))
    return p


def _cli(args):
    from typer.testing import CliRunner

    from simulator.cli.main import app
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def _workload(n=N):
    rng = np.random.default_rng(3)
    return Workload(arrival_s=np.cumsum(rng.exponential(1 / 40, n)),
                    prompt_tokens=rng.integers(8, 64, n), output_tokens=rng.integers(3, 12, n),
                    priority=np.zeros(n, int))


@pytest.mark.exclusive  # a real server's timing
def test_validate_endpoint_local(profile_file, tmp_path):
    """`latsim validate --endpoint local`: a server per policy, the error table with the
    wire stages, one row per request on both sides, T_net and T_stream measured."""
    out = tmp_path / "ep"
    r = _cli(["validate", "--profile", str(profile_file), "--endpoint", "local",
              "--policies", "chunked", "--limit", str(N), "--load", "0.3",
              "--max-prompt-tokens", "64", "--max-output-tokens", "12", "--max-num-seqs", "16",
              "--max-num-batched-tokens", "128", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    for label in ("TTFT", "E2EL", "T_NET", "T_QUEUE", "T_PREFILL", "T_STREAM", "real P99"):
        assert label in r.output
    assert "HTTP/1.1 x8" in r.output
    v = json.loads((out / "endpoint.json").read_text())
    assert set(v["policies"]) == {"chunked"} and v["meta"]["endpoint"] == "local"
    p = v["policies"]["chunked"]
    assert p["real"]["completed"] == p["sim"]["completed"] == N
    assert p["rtt_ms"] > 0 and p["frame_bytes"] > 50
    real = pd.read_csv(out / "real-chunked.csv")
    sim = pd.read_csv(out / "sim-chunked.csv")
    assert len(real) == len(sim) == N
    assert (real["frames"] == real["output_tokens"]).all()
    for stage in ("t_net", "t_stream"):
        assert (real[stage] > 0).all(), stage                  # measured, per request
        assert p["stages"][f"median_{stage}_ms"]["real"] > 0
        assert p["stages"][f"median_{stage}_ms"]["sim"] > 0    # the loopback wire, modelled
    for stage in ("t_queue", "t_prefill", "t_decode"):
        assert real[stage].notna().all() and (real[stage] >= 0).all(), stage
    parts = real[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    assert np.allclose(parts, real["e2el"], atol=1e-6)


@pytest.mark.exclusive  # a real server's timing
def test_validate_endpoint_url_uses_the_servers_policy(profile_file):
    """A running server: its own policy and limits (from /metrics) drive the simulation;
    asking for another policy is a one-line error."""
    from real_engine.endpoint import run_endpoint_validation
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    from real_engine.validate import engine_settings
    prof = json.loads(profile_file.read_text())
    eng = build_engine("tiny", "cpu", policy="fifo", max_num_seqs=8, max_num_batched_tokens=256,
                       num_blocks=512)
    with BackgroundServer(make_app(eng, "tiny")) as srv:
        res, meta = run_endpoint_validation(srv.url, prof, _workload(), None, model="tiny",
                                            settings=engine_settings())
        assert list(res) == ["fifo"] and meta["server"]["max_num_seqs"] == 8
        r = res["fifo"]
        assert len(r["real_table"]) == len(r["sim_table"]) == N
        assert r["real"]["completed"] == N and r["stages"]["p99_t_stream_ms"]["real"] > 0
        with pytest.raises(LatsimError, match="runs policy 'fifo'"):
            run_endpoint_validation(srv.url, prof, _workload(), ["chunked"], model="tiny",
                                    settings=engine_settings())
        res2 = _cli(["validate", "--profile", str(profile_file), "--endpoint", srv.url,
                     "--policies", "chunked", "--limit", "2"])
    assert res2.exit_code == 2 and "runs policy 'fifo'" in res2.output
    assert "Traceback" not in res2.output


@pytest.mark.parametrize("args,message", [
    (["--endpoint", "http://127.0.0.1:1"], "cannot reach"),
    (["--endpoint", "ftp://example"], "must be 'local' or an http"),
    (["--endpoint", "local", "--policies", "nope"], "unknown policy"),
    (["--endpoint", "http://127.0.0.1:99999"], "--endpoint: has a port outside 1-65535"),
    (["--endpoint", "http://[::1:8000"], "--endpoint: has a malformed IPv6 host"),
], ids=["unreachable", "bad-scheme", "bad-policy", "bad-port", "bad-ipv6"])
def test_validate_endpoint_bad_input_is_one_line(profile_file, args, message):
    r = _cli(["validate", "--profile", str(profile_file), "--limit", "2"] + args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
