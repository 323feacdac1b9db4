"""The real server (``latsim serve``) and load client (``latsim bench``) on loopback.

One server (the ``tiny`` model on CPU) is started by the module fixture on
127.0.0.1 with a free port, in a background thread, and stopped at the end.
Loads are a few dozen requests of at most a few hundred tokens (the slow-reader
tests: one request of 700); every wait is bounded. The backpressure tests start
their own servers, one per policy, over one shared engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from simulator.wire.benchclient import SseParser, bench_outputs, frame_text, parse_sse_lines, run_bench  # noqa: E402
from simulator.errors import LatsimError  # noqa: E402
from simulator.workload import Workload  # noqa: E402

# Disconnect-to-blocks-freed bound (s). Measured on a 2-core CPU box (tiny model,
# ~3 ms steps), 30 streamed disconnects: engine.cancel runs 3-7 ms after the client
# closes (its FIN, uvicorn's connection_lost, Starlette cancelling the generator,
# then at most one engine step); seen through /metrics polling, median 15 ms, p90
# 24 ms, max 44 ms (non-streamed: median 18 ms, max 32 ms; the server checks for a
# disconnect every 0.1 s). The bound only catches a server that never frees them: it
# leaves room for a CI runner loaded past anything seen (a 0.5 s cut once saw no token).
FREE_BOUND_S = 10.0
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def server():
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    eng = build_engine("tiny", "cpu", max_num_seqs=16, max_num_batched_tokens=256, num_blocks=1024)
    with BackgroundServer(make_app(eng, "tiny")) as s:
        yield s


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        yield c


# /metrics is Prometheus text (real_engine.metrics): the samples these tests read.
SERVED = 'vllm:request_success_total{finished_reason="length"}'
CANCELLED = 'vllm:request_success_total{finished_reason="abort"}'
FREE = "latsim:kv_blocks_free"
TOTAL = "latsim:kv_blocks_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PAUSED = "latsim:num_requests_paused"
STEPS = "latsim:engine_steps_total"
BUFFERED = "latsim:stream_buffered_frames"
BUFFERED_PEAK = "latsim:stream_buffered_frames_peak"
STREAM_PEAK = "latsim:stream_buffered_frames_stream_peak"
BYTES_PEAK = "latsim:stream_buffered_bytes_peak_estimate"
DEGRADED = "latsim:streams_degraded_total"
PAUSES = "latsim:backpressure_pauses_total"
RESUMES = "latsim:backpressure_resumes_total"


def _metrics(c) -> dict:
    from real_engine.metrics import parse
    return parse(c.get("/metrics").text)


def _wait_idle(c, bound: float) -> float:
    """Poll /metrics until no request holds KV; returns the seconds it took."""
    t0 = time.perf_counter()
    while True:
        m = _metrics(c)
        if m[FREE] == m[TOTAL] and m[RUNNING] == 0 and m[WAITING] == 0:
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < bound, f"blocks not freed within {bound} s: {m}"
        time.sleep(0.002)


def _stream(c, path: str, body: dict):
    """(arrival time, event) for every SSE event of a streamed request."""
    out = []
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        p = SseParser()
        for line in r.iter_lines():
            ev = p.feed(line)
            if ev is not None:
                out.append((time.perf_counter(), ev))
    return out


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 24, "stream": True}),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 7, "stream": True,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                              "max_tokens": 12, "stream": True}),
])
def test_stream_frame_by_frame(client, path, body):
    evs = _stream(client, path, body)
    assert evs[-1][1].done, "the stream must end with data: [DONE]"
    content = evs[:-1]
    assert len(content) == body["max_tokens"]           # exactly one frame per token
    times = [t for t, _ in content]
    assert all(b >= a for a, b in zip(times, times[1:]))
    # That frames leave while the request is still generating is checked structurally
    # in test_serve_api.py (test_health_and_metrics_answer_while_the_engine_is_held_mid_step:
    # frames arrive while a step is held at a barrier). A span in seconds here failed
    # under load: an event loop behind the engine writes the queued frames together.
    chunks = [json.loads(e.data) for _, e in content]
    assert all(frame_text(e.data) for _, e in content)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    _wait_idle(client, FREE_BOUND_S)


def test_non_streaming(client):
    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 5})
    assert r.status_code == 200
    j = r.json()
    assert j["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert len(j["choices"][0]["text"].split()) == 5
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_disconnect_mid_stream_frees_blocks(client, server):
    before = _metrics(client)
    with httpx.Client(base_url=server.url, timeout=30.0) as c2:
        with c2.stream("POST", "/v1/completions",
                       json={"prompt": "w " * 100, "max_tokens": 3000, "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            while got < 5:
                if next(lines).startswith("data:"):
                    got += 1
            m = _metrics(client)
            assert m[RUNNING] == 1 and m[FREE] < m[TOTAL]
        # Leaving the block closes the half-read response: the TCP connection goes away.
    took = _wait_idle(client, FREE_BOUND_S)
    after = _metrics(client)
    assert after[CANCELLED] == before[CANCELLED] + 1
    print(f"disconnect -> blocks freed in {took * 1e3:.1f} ms")


def test_disconnect_non_streaming_frees_blocks(client, server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(0.3)) as c2:
        with pytest.raises(httpx.ReadTimeout):
            c2.post("/v1/completions", json={"prompt": "w w w", "max_tokens": 3000})
    # The server polls for a disconnect every 0.1 s while it collects tokens.
    _wait_idle(client, FREE_BOUND_S)


@pytest.mark.parametrize("path,content", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}'),
    ("/v1/completions", b'{"prompt": "", "max_tokens": 3}'),
    ("/v1/completions", b'{"prompt": {"a": 1}, "max_tokens": 3}'),
    ("/v1/completions", b'{"prompt": [1, 99999], "max_tokens": 3}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 5000}'),            # > max_seq_len
    ("/v1/completions", json.dumps({"prompt": [1] * 4100, "max_tokens": 3}).encode()),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 3, "stream": "yes"}'),
    ("/v1/chat/completions", b'{"messages": [], "max_tokens": 3}'),
    ("/v1/chat/completions", b'{"messages": [{"content": 5}], "max_tokens": 3}'),
], ids=lambda v: (v.decode() if isinstance(v, bytes) else v)[:40])
def test_malformed_requests_get_4xx_json(client, path, content):
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["message"]
    assert client.get("/health").status_code == 200     # still serving


@pytest.mark.parametrize("blocks, watermark", [(4, 0.0), (8, 0.5)])
def test_too_big_for_cache_is_400(blocks, watermark):
    """A request needing more KV blocks than the cache can ever give it is refused with
    the engine's own reason, not queued forever: the same rule as the simulator's
    (``KVSpace.fits``), so a watermark's reserve counts (70 tokens need 5 of 16-token
    blocks: 4 blocks, or 8 with half kept free, are too few)."""
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    from simulator.model.kv.space import KVRules
    eng = build_engine("tiny", "cpu", num_blocks=blocks, kv_rules=KVRules(watermark=watermark))
    with BackgroundServer(make_app(eng, "tiny")) as s, httpx.Client(base_url=s.url) as tc:
        r = tc.post("/v1/completions", json={"prompt": "x " * 60, "max_tokens": 10})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "could never run" in msg and f"the cache has {blocks}" in msg, msg
        assert r.json()["error"]["param"] == "max_tokens"
        assert tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_sse_parser():
    text = ("data: {\"a\":\n"
            "data: 1}\n"
            "\n"
            ": keep-alive\n"
            "event: ping\n"
            "id: 7\n"
            "data:no-space\n"
            "\r\n"
            "retry: 100\n"
            "\n"                    # an event without data is not dispatched
            ":\n"
            "data: [DONE]\n")       # no trailing blank line: flushed at the end
    evs = parse_sse_lines(text.split("\n"))
    assert json.loads(evs[0].data) == {"a": 1} and evs[0].data == '{"a":\n1}'
    assert evs[1].comment == "keep-alive" and evs[1].data is None
    assert (evs[2].event, evs[2].id, evs[2].data) == ("ping", "7", "no-space")
    assert evs[3].comment == ""
    assert evs[4].done and len(evs) == 5
    assert parse_sse_lines(["data: x\n\ndata: y\n\n"])[1].data == "y"   # chunks of many lines
    assert frame_text('{"choices":[{"delta":{"content":"hi"}}]}') == "hi"
    assert frame_text('{"choices":[{"delta":{"role":"assistant"}}]}') is None
    assert frame_text("not json") is None


def _bench_app():
    import typer

    from simulator.cli.serve import bench
    app = typer.Typer()
    app.command("bench")(bench)
    app.command("noop")(lambda: None)       # two commands: keep "bench" as a subcommand
    return app


def test_bench_cli_writes_simulator_tables(server, tmp_path):
    from typer.testing import CliRunner
    out = tmp_path / "b"
    args = ["bench", "--url", server.url, "--trace", str(DATA / "azure_conv_head40.csv"),
            "--limit", "12", "--speedup", "10", "--max-prompt-tokens", "200",
            "--max-output-tokens", "32", "--pool-size", "4", "--timeout", "30",
            "--max-wall-s", "30", "--out", str(out)]
    r = CliRunner().invoke(_bench_app(), args)
    assert r.exit_code == 0, r.output + repr(r.exception)
    df = pd.read_csv(out / "requests.csv")
    s = json.loads((out / "summary.json").read_text())
    assert len(df) == 12 and df["finished"].all() and (df["error"].isna()).all()
    assert (df["frames"] == df["output_tokens"]).all()
    # Every frame's arrival, one row each, ordered within a request and bounded by its
    # first and last delivery (what ``latsim calibrate`` times the steps from).
    tok = pd.read_csv(out / "tokens.csv")
    assert len(tok) == int(df["frames"].sum())
    for rid, g in tok.groupby("request_id"):
        row = df[df["rid"] == rid].iloc[0]
        assert list(g["token_index"]) == list(range(len(g)))
        assert g["time_s"].is_monotonic_increasing
        assert abs(g["time_s"].iloc[0] - row["first_delivered"]) < 1e-6
        assert abs(g["time_s"].iloc[-1] - row["last_delivered"]) < 1e-6
    for col in ("arrival", "enqueued", "scheduled", "first_token", "last_token",
                "first_delivered", "last_delivered", "t_decode", "ttft", "tpot", "e2el"):
        assert col in df
    # latsim serve answers x-latsim-timing: the server-side stages are measured and ordered.
    order = ["arrival", "server_received", "enqueued", "scheduled", "first_token",
             "first_delivered", "last_delivered"]
    assert (df[order].diff(axis=1).iloc[:, 1:] >= -1e-6).all().all()
    assert (df["last_token"] <= df["last_delivered"] + 1e-6).all()
    for stage in ("t_net", "t_queue", "t_prefill", "t_decode", "t_stream"):
        assert (df[stage] >= -1e-6).all() and (df[stage] < 10).all(), stage
    assert (df["t_net"] > 0).all() and (df["t_prefill"] > 0).all()
    assert (df["http_version"] == "HTTP/1.1").all() and (df["paused_s"] == 0).all()
    assert (df["arrival"] >= df["planned_arrival"] - 1e-3).all()
    assert ((df["ttft"] > 0) & (df["ttft"] < 10)).all()
    tpot = df["tpot"].dropna()
    assert ((tpot > 0) & (tpot < 1.0)).all()
    o = s["overall"]
    assert o["num_requests"] == 12 and o["completed"] == 12
    assert 0 < o["median_ttft_ms"] < 10_000 and 0 < o["median_tpot_ms"] < 1000
    assert 0 < o["median_itl_ms"] < 1000 and o["mean_t_net_ms"] > 0
    assert s["run"]["errors"] == 0 and s["run"]["new_connections"] <= 4
    assert s["run"]["unobservable"] == [] and s["run"]["server_timing"] == "12 requests"
    assert s["run"]["http_versions"] == {"HTTP/1.1": 12}


def test_bench_max_wall_cancels_and_server_frees():
    """A run cut by max_wall_s closes its streams; the server frees every block.

    Not a test of speed: every step of this engine sleeps 20 ms, so 3000 tokens take
    at least 60 s and no cut below that can see a request finish; the cut starts at
    0.5 s and doubles (up to 16 s) until every request has streamed a token, so a box
    too loaded to answer in 0.5 s (CI once was) only makes the test take longer."""
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    eng = build_engine("tiny", "cpu", max_num_seqs=16, max_num_batched_tokens=256,
                       num_blocks=1024)
    fast = eng.step

    def step():
        time.sleep(0.02)
        return fast()
    eng.step = step
    n = 4
    wl = Workload(arrival_s=np.zeros(n), prompt_tokens=np.full(n, 20),
                  output_tokens=np.full(n, 3000), priority=np.zeros(n))
    with BackgroundServer(make_app(eng, "tiny")) as s, \
            httpx.Client(base_url=s.url, timeout=30.0) as c:
        for cut in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0):
            recs, facts = asyncio.run(run_bench(s.url, wl, max_wall_s=cut, pool_size=8))
            df, summary = bench_outputs(recs, wl, facts)
            assert len(df) == n and not df["finished"].any()
            assert summary["overall"]["completed"] == 0
            _wait_idle(c, FREE_BOUND_S)
            if (df["frames"] > 0).all():
                break
        assert (df["frames"] > 0).all(), f"no token within a {cut} s cut"


def test_missing_web_stack_is_one_line_error(monkeypatch):
    """A missing web package names the serve extra; a missing torch names the line that
    brings torch too (the serve extra alone does not)."""
    import importlib.util

    from simulator.cli.serve import _need
    with pytest.raises(LatsimError, match=r'pip install -e "\.\[serve\]"'):
        _need("no_such_module_latsim_xyz")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(LatsimError) as e:
        _need("fastapi", "torch")
    assert str(e.value) == ('needs torch: pip install torch==2.13.0 && '
                            'pip install -e ".[engine,serve]"')


def test_heartbeats_while_waiting():
    """A stream silent for heartbeat_s gets ': ping' comments; content frames are unchanged.

    Structural: the engine's first step is held at a barrier until the client has read
    three pings (the request is silent for as long as that takes, on any box), then the
    request runs to its end. (A 30 ms sleep per step once stood for the silence: a loop
    that fell behind found the tokens queued and owed no ping.)"""
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    eng = build_engine("tiny", "cpu", num_blocks=256)
    real, release = eng.step, threading.Event()

    def step():
        assert release.wait(30.0), "the test never released the engine"
        return real()
    eng.step = step
    evs = []
    with BackgroundServer(make_app(eng, "tiny", heartbeat_s=0.01)) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "a b", "max_tokens": 4, "stream": True}) as r:
            p = SseParser()
            for line in r.iter_lines():
                ev = p.feed(line)
                if ev is None:
                    continue
                evs.append(ev)
                if not release.is_set() and sum(e.comment is not None for e in evs) == 3:
                    assert not any(e.data is not None for e in evs)   # nothing ran yet
                    release.set()
    assert release.is_set()
    assert sum(e.data is not None and not e.done for e in evs) == 4 and evs[-1].done
    assert all(e.comment == "ping" for e in evs if e.comment is not None)


def test_engine_failure_ends_streams_and_health():
    """If the engine thread dies, open streams end with an error, /health says 503, new
    requests get 503 JSON: nothing hangs."""
    from real_engine.profile import build_engine
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    eng = build_engine("tiny", "cpu", num_blocks=256)
    real, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("device lost")
        return real()
    eng.step = step
    with BackgroundServer(make_app(eng, "tiny")) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        evs = [e for _, e in _stream(c, "/v1/completions",
                                     {"prompt": "a b", "max_tokens": 50, "stream": True})]
        assert not evs[-1].done and "error" in json.loads(evs[-1].data)
        h = c.get("/health")
        assert h.status_code == 503 and "device lost" in h.json()["reason"]
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]


def test_bench_records_http_errors(server):
    """A refused request is a row with its status and error, not a crash; the rest run."""
    wl = Workload(arrival_s=[0.0, 0.0], prompt_tokens=[5, 5], output_tokens=[5000, 3],
                  priority=[0, 0])
    recs, facts = asyncio.run(run_bench(server.url, wl))
    df, s = bench_outputs(recs, wl, facts)
    assert df.loc[0, "status"] == 400 and "HTTP 400" in df.loc[0, "error"]
    assert not df.loc[0, "finished"] and df.loc[0, "rejected"]
    assert df.loc[1, "finished"] and df.loc[1, "frames"] == 3
    assert s["overall"]["completed"] == 1 and s["run"]["errors"] == 1


def test_bench_http2_falls_back_and_is_reported(server):
    """--http2 offers HTTP/2; uvicorn speaks HTTP/1.1 only (and httpx negotiates HTTP/2
    only over TLS), so the requests run on HTTP/1.1 and the summary says so."""
    pytest.importorskip("h2")
    n = 3
    wl = Workload(arrival_s=np.zeros(n), prompt_tokens=np.full(n, 4),
                  output_tokens=np.full(n, 3), priority=np.zeros(n))
    recs, facts = asyncio.run(run_bench(server.url, wl, http2=True))
    df, s = bench_outputs(recs, wl, facts)
    assert df["finished"].all() and (df["frames"] == 3).all()
    assert s["run"]["http2"] is True and s["run"]["http_versions"] == {"HTTP/1.1": n}


def test_bench_http2_without_h2_is_one_line_error(server, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "h2", None)        # makes `import h2` fail
    wl = Workload(arrival_s=[0.0], prompt_tokens=[4], output_tokens=[3], priority=[0])
    with pytest.raises(LatsimError, match="h2"):
        asyncio.run(run_bench(server.url, wl, http2=True))


def test_server_timing_dropped_when_clocks_disagree():
    """Server times that contradict the client's (another host's clock) are not used."""
    from simulator.wire.benchclient import _Rec, _server_timing
    wl = Workload(arrival_s=[0.0, 0.1], prompt_tokens=[4, 4], output_tokens=[2, 2],
                  priority=[0, 0])

    def rec(i, shift):
        r = _Rec(i, 0.1 * i, arrival=0.1 * i, times=[0.1 * i + 0.05, 0.1 * i + 0.06],
                 status=200, done=True, http_version="HTTP/1.1")
        wall = 1000.0 + 0.1 * i + shift
        r.server = _server_timing('latsim-timing {"received":%r,"enqueued":%r,"scheduled":%r,'
                                  '"first_token":%r,"last_token":%r,"paused_s":0}'
                                  % (wall + .001, wall + .002, wall + .003, wall + .04,
                                     wall + .055), 1000.0)
        return r
    df, s = bench_outputs([rec(0, 0.0), rec(1, 0.0)], wl, {})
    assert s["run"]["server_timing"] == "2 requests" and (df["t_queue"] > 0).all()
    assert abs(df.loc[0, "t_net"] - 0.002) < 1e-9 and abs(df.loc[0, "t_stream"] - 0.005) < 1e-9
    df, s = bench_outputs([rec(0, 0.0), rec(1, -0.5)], wl, {})     # server clock behind
    assert s["run"]["server_timing"].startswith("dropped") and df["enqueued"].isna().all()
    assert "t_net" in s["run"]["unobservable"] and (df["t_stream"] == 0).all()


def test_serve_cli_rejects_bad_options():
    import typer
    from typer.testing import CliRunner

    from simulator.cli.serve import serve
    app = typer.Typer()
    app.command("serve")(serve)
    app.command("noop")(lambda: None)
    for args in (["serve", "--device", "tpu"], ["serve", "--policy", "nope"],
                 ["serve", "--backpressure", "drop"], ["serve", "--preemption", "evict"],
                 ["serve", "--kv-allocation", "slab"],
                 ["serve", "--kv-allocation", "contiguous", "--prefix-caching"]):
        r = CliRunner().invoke(app, args)
        assert isinstance(r.exception, LatsimError), r.output


# -- backpressure: a client that stops reading -----------------------------------------
# The server's SO_SNDBUF is pinned small (the kernel would otherwise autotune a loopback
# send buffer to ~4 MB, i.e. ~20k frames absorbed before the server feels anything) and
# the client's receive buffer too; the socket plus uvicorn's 64 KiB transport buffer then
# hold ~450 frames, so a request of SLOW_TOKENS tokens outgrows them within ~2 s.
SLOW_TOKENS = 700
SLOW_BUFFER = 16


def _raw_request(port: int, body: dict, rcvbuf: int = 4096):
    """A raw-socket client that sends one request and reads nothing (yet)."""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
              b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return s


def _read_sse(s, timeout: float = 30.0) -> list:
    """Read a chunked SSE response to its end; its events."""
    s.settimeout(timeout)
    buf = bytearray()
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        d = s.recv(1 << 16)
        assert d, "connection closed before the end of the response"
        buf += d
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    text, i = [], 0
    while True:                                   # undo the chunked transfer encoding
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            break
        text.append(body[j + 2:j + 2 + n])
        i = j + 2 + n + 2
    return parse_sse_lines(b"".join(text).decode().split("\n"))


def _poll(c, cond, bound: float, what: str) -> dict:
    t_end = time.perf_counter() + bound
    while True:
        m = _metrics(c)
        if cond(m):
            return m
        assert time.perf_counter() < t_end, f"{what} not seen within {bound} s: {m}"
        time.sleep(0.05)     # not faster: each poll costs the server's event loop and the GIL


@pytest.fixture(scope="module")
def slow_engine():
    from real_engine.profile import build_engine
    return build_engine("tiny", "cpu", max_num_seqs=8, max_num_batched_tokens=256,
                        num_blocks=512)


def test_metrics_count_a_request_before_its_last_token_is_handed_over(slow_engine):
    """The engine thread publishes the metrics a step changes before it hands the step's
    tokens to the event loop: a client that has read a request's last frame then finds
    it counted. (Published after, ``requests_served`` lagged a quick client: once in a
    whole-suite run, the slow-reader test read 0 after its stream had ended.)"""
    from real_engine.engineloop import _DONE, EngineLoop, _Stream

    el = EngineLoop(slow_engine)
    seen = []

    class Loop:                 # an event loop that records what the metrics said
        def call_soon_threadsafe(self, fn, pairs):
            seen.append((el.snapshot["requests_served"],
                         [items[-1] is _DONE for _, items in pairs]))

    st = _Stream(7, Loop(), 0.0)
    el.streams[7] = st
    el._deliver({7: 11}, set(), 1.0)
    el._deliver({7: 12}, {7}, 2.0)
    assert seen == [(0, [False]), (1, [True])]


@contextlib.contextmanager
def _slow_reader(engine, mode: str):
    """A server with ``mode`` backpressure and a small send buffer, a metrics client,
    and a raw-socket request of SLOW_TOKENS tokens that reads nothing yet: yields
    ``(client, socket)``; the caller closes the socket."""
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    app = make_app(engine, "tiny", heartbeat_s=None, backpressure=mode,
                   stream_buffer_frames=SLOW_BUFFER)
    with BackgroundServer(app, send_buffer_bytes=8192) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c, _raw_request(srv.port, {"prompt": "a b c", "max_tokens": SLOW_TOKENS,
                                         "stream": True})


@pytest.mark.parametrize("mode", ["block", "buffer", "degrade"])
def test_slow_reader_backpressure(slow_engine, mode):
    """A client that stops reading: ``block`` pauses its request (KV kept, the engine
    idles, the buffer stays at the bound) and resumes it as the client drains;
    ``buffer`` lets the buffer grow past the bound; ``degrade`` sends the rest as one
    frame. In every mode the request completes with all its tokens."""
    with _slow_reader(slow_engine, mode) as (c, s):
        try:
            if mode == "block":
                m = _poll(c, lambda m: m[PAUSED] == 1, 20.0, "a paused request")
                assert m[RUNNING] == 1 and m[FREE] < m[TOTAL]
                assert m[BUFFERED] == SLOW_BUFFER       # never past the bound
                # Until the socket and the transport's buffer are full the stream still
                # drains to the resume mark, so a loaded box can see a pause, a resume and
                # a pause again; once they are full the engine idles for good.
                t_end = time.monotonic() + 20.0
                while True:
                    time.sleep(0.2)
                    m2 = _metrics(c)
                    assert m2[BUFFERED] <= SLOW_BUFFER   # never past the bound
                    if m2[STEPS] == m[STEPS] and m2[PAUSED] == 1:
                        break
                    assert time.monotonic() < t_end, "a paused engine must idle"
                    m = m2
                assert m2[FREE] == m[FREE]
                t0 = time.perf_counter()
            else:
                # The engine finishes the request while its client is still not reading.
                m = _poll(c, lambda m: m[SERVED] == 1, 30.0, "the request finished")
                assert m[PAUSES] == 0 and m[PAUSED] == 0
            evs = _read_sse(s)
            if mode == "block":
                drained = time.perf_counter() - t0
        finally:
            s.close()
        assert evs[-1].done
        texts = [frame_text(e.data) for e in evs[:-1] if e.data is not None]
        assert sum(len(t.split()) for t in texts) == SLOW_TOKENS      # every token arrived
        m = _metrics(c)
        assert m[SERVED] == 1 and m[PAUSED] == 0 and m[RUNNING] == 0
        if mode == "block":
            assert len(texts) == SLOW_TOKENS and m[PAUSES] >= 1 and m[RESUMES] == m[PAUSES]
            assert m[STREAM_PEAK] == SLOW_BUFFER
            print(f"block: {m[PAUSES]:.0f} pauses, paused "
                  f"{m['latsim:backpressure_paused_seconds_total']:.2f} s, resume lag max "
                  f"{m['latsim:backpressure_resume_lag_seconds_max'] * 1e3:.2f} ms, "
                  f"drained and finished in {drained:.2f} s")
        elif mode == "buffer":
            assert len(texts) == SLOW_TOKENS
            assert m[STREAM_PEAK] > 4 * SLOW_BUFFER     # far past the bound
            assert m[BYTES_PEAK] > m[BUFFERED_PEAK] * 50
            print(f"buffer: peak {m[BUFFERED_PEAK]:.0f} frames "
                  f"(~{m[BYTES_PEAK] / 1024:.0f} KiB)")
        else:
            assert m[DEGRADED] == 1 and len(texts) < SLOW_TOKENS
            assert len(texts[-1].split()) > SLOW_BUFFER     # the rest came as one frame
            assert json.loads(evs[-2].data)["choices"][0]["finish_reason"] == "length"


def test_paused_request_freed_when_its_client_leaves(slow_engine):
    """A request paused by ``block`` whose client then disconnects is cancelled and its
    KV blocks freed, like a running one."""
    with _slow_reader(slow_engine, "block") as (c, s):
        try:
            _poll(c, lambda m: m[PAUSED] == 1, 20.0, "a paused request")
        finally:
            s.close()                    # unread data pending: the kernel sends a RST
        t0 = time.perf_counter()
        took = _wait_idle(c, FREE_BOUND_S)
        m = _metrics(c)
        assert m[CANCELLED] == 1 and m[PAUSED] == 0 and m[SERVED] == 0
        print(f"paused request: client gone -> blocks freed in {took * 1e3:.1f} ms "
              f"({(time.perf_counter() - t0) * 1e3:.1f} ms)")
