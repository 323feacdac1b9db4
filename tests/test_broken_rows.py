"""Issue 28's broken rows, each as its repro: a profile of another model checked wherever
the scenario is run from, a disconnected client's finished request counted as cancelled,
a plug-in order key honoured, and ``bench`` sending each request's priority."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from simulator.config.scenario import load_scenario
from simulator.errors import LatsimError

LATSIM = [sys.executable, "-m", "simulator.cli"]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def latsim(*args, cwd=REPO):
    return subprocess.run([*LATSIM, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# -- 1. a measured profile of another model -----------------------------------------------

@pytest.mark.parametrize("where", ["repo", "scenarios", "elsewhere"])
def test_a_profile_of_another_model_is_refused_from_any_working_directory(where, tmp_path,
                                                                          monkeypatch):
    # quickstart's cost.path is '../profiles/...', relative to the scenario file: from the
    # repository root it named nothing there and the check returned without looking.
    monkeypatch.chdir({"repo": REPO, "scenarios": REPO / "scenarios",
                       "elsewhere": tmp_path}[where])
    with pytest.raises(LatsimError) as e:
        load_scenario(QUICKSTART, ["model.name=llama-2-70b"])
    msg = str(e.value)
    assert "field 'model.cost.path'" in msg and "n_layers 80" in msg and "has 32" in msg
    # The profile's own model is accepted from the same place.
    sc, _ = load_scenario(QUICKSTART, ["model.name=llama-3-8b"])
    assert sc.model.shape.n_layers == 32


def test_a_missing_profile_is_refused_by_the_model_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LatsimError) as e:
        load_scenario(QUICKSTART, ["model.name=llama-3-8b", "model.cost.path=nope.json"])
    msg = str(e.value)
    assert "field 'model.cost.path'" in msg and "not found" in msg and "nope.json" in msg
    assert "\n" not in msg


def test_run_from_the_repository_root_refuses_another_models_profile(tmp_path):
    out = tmp_path / "x"
    r = latsim("run", "scenarios/quickstart.yaml", "--set", "model.name=llama-2-70b",
               "--out", out)
    assert r.returncode == 2, r.stdout[-500:]
    assert r.stderr.startswith("latsim: error: ") and r.stderr.count("\n") == 1
    assert "model.cost.path" in r.stderr and "n_layers 80" in r.stderr
    assert not out.exists()          # refused before any work


# -- 4. bench sends each request's priority; a URL no request can reach is refused ---------

class _Recorder:
    """A loopback HTTP server answering every completion with one SSE frame and
    ``[DONE]``, keeping each request's JSON body."""

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        bodies = self.bodies = []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length", 0))
                bodies.append(json.loads(self.rfile.read(n)))
                msg = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.mark.parametrize("send", [True, False])
def test_bench_sends_each_requests_priority_as_vllm_reads_it(send):
    import asyncio

    import numpy as np

    from simulator.wire.benchclient import run_bench
    from simulator.workload import Workload
    pytest.importorskip("httpx")
    prio = [2, 0, 1, 0]
    wl = Workload(arrival_s=np.zeros(4), prompt_tokens=np.array([3, 4, 5, 6]),
                  output_tokens=np.ones(4, int), priority=np.array(prio))
    srv = _Recorder()
    try:
        recs, _ = asyncio.run(run_bench(srv.url, wl, model="m", send_priority=send))
    finally:
        srv.close()
    assert all(r.done for r in recs)
    got = sorted(srv.bodies, key=lambda b: int(b["prompt"].split()[0][1:]))   # 'r<rid> ...'
    assert len(got) == 4
    if send:
        # vLLM's field: an integer, lower served first (class 0 = P0 is the most urgent).
        assert [b["priority"] for b in got] == prio
        assert all(type(b["priority"]) is int for b in got)
    else:
        assert all("priority" not in b for b in got)


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1:99999", "port outside 1-65535"),
    ("http://127.0.0.1:0", "port outside 1-65535"),
    ("http://127.0.0.1:-1", "port outside 1-65535"),
    ("http://127.0.0.1:80a", "port outside 1-65535"),
    ("http://[::1:8000", "malformed IPv6"),
    ("http://[zz::1]:8000", "malformed IPv6"),
    ("http://[::1]x:8000", "malformed IPv6"),
    ("http://::1:8000", "without brackets"),
    ("http://:8000", "names no host"),
    ("ftp://127.0.0.1", "http:// or https://"),
])
def test_bench_refuses_a_url_no_request_can_reach_before_sending(url, why, tmp_path, capsys):
    from simulator.cli.main import main
    out = tmp_path / "b"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--url", url, "--limit", "1", "--out", str(out)])
    assert e.value.code == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latsim: error: --url: "), cap.err
    assert why in lines[0] and repr(url) in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://[::1]:8000/v1/completions",
                                 "https://user@example.com", "http://localhost"])
def test_a_reachable_looking_url_passes_the_check(url):
    from simulator.wire.benchclient import check_url
    check_url(url)


# -- 2. a disconnected client's request ends cancelled, not unfinished ---------------------

@pytest.mark.parametrize("backpressure", ["block", "buffer", "degrade"])
def test_slow_clients_with_many_disconnects_exits_0_under_each_backpressure(backpressure,
                                                                            tmp_path):
    # 100 requests, 30% of clients leaving: under buffer and degrade some silently gone
    # clients' requests finish generating before the 45 s heartbeat finds them; they
    # were counted "never completed although the run ended" and the run exited 1.
    import pandas as pd
    out = tmp_path / "r"
    r = latsim("run", "scenarios/slow-clients.yaml", "--out", out,
               "--set", f"stream.backpressure={backpressure}",
               "--set", "workload.num_requests=100", "--set", "stream.disconnect.probability=0.3")
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr
    assert "never completed" not in r.stdout
    df = pd.read_csv(out / "requests.csv")
    gone = ~df["finished"]
    assert gone.sum() > 0 and df.loc[gone, "cancelled"].all()
