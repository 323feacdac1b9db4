"""The real server (``latsim serve``) and load client (``latsim bench``) on loopback.

One server (the ``tiny`` model on CPU) is started by the module fixture on
127.0.0.1 with a free port, in a background thread, and stopped at the end.
Loads are a few dozen requests of at most a few hundred tokens; every wait is
bounded.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from simulator.benchclient import SseParser, bench_outputs, frame_text, parse_sse_lines, run_bench  # noqa: E402
from simulator.errors import LatsimError  # noqa: E402
from simulator.workload import Workload  # noqa: E402

# Disconnect-to-blocks-freed bound (s). Measured on a 2-core CPU box (tiny model,
# ~3 ms steps), 30 streamed disconnects: engine.cancel runs 3-7 ms after the client
# closes (its FIN, uvicorn's connection_lost, Starlette cancelling the generator,
# then at most one engine step); seen through /metrics polling, median 15 ms, p90
# 24 ms, max 44 ms (non-streamed: median 18 ms, max 32 ms; the server checks for a
# disconnect every 0.1 s). The bound leaves room for a loaded CI runner.
FREE_BOUND_S = 2.0
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def server():
    from real_engine.profile import build_engine
    from real_engine.server import BackgroundServer, make_app
    eng = build_engine("tiny", "cpu", max_num_seqs=16, max_num_batched_tokens=256, num_blocks=1024)
    with BackgroundServer(make_app(eng, "tiny")) as s:
        yield s


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        yield c


def _metrics(c) -> dict:
    return c.get("/metrics").json()


def _wait_idle(c, bound: float) -> float:
    """Poll /metrics until no request holds KV; returns the seconds it took."""
    t0 = time.perf_counter()
    while True:
        m = _metrics(c)
        if m["kv_blocks_free"] == m["kv_blocks_total"] and m["running"] == 0 and m["waiting"] == 0:
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
    # Frame by frame, not one burst at the end: the frames span several engine steps.
    assert times[-1] - times[0] > 0.0005 * len(times)
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
            assert m["running"] == 1 and m["kv_blocks_free"] < m["kv_blocks_total"]
        # Leaving the block closes the half-read response: the TCP connection goes away.
    took = _wait_idle(client, FREE_BOUND_S)
    after = _metrics(client)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
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


def test_too_big_for_cache_is_400():
    """A request needing more KV blocks than the whole cache is refused, not queued forever."""
    from real_engine.profile import build_engine
    from real_engine.server import BackgroundServer, make_app
    eng = build_engine("tiny", "cpu", num_blocks=4)
    with BackgroundServer(make_app(eng, "tiny")) as s, httpx.Client(base_url=s.url) as tc:
        r = tc.post("/v1/completions", json={"prompt": "x " * 60, "max_tokens": 10})
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]
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

    from simulator.servecli import bench
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
    for col in ("arrival", "enqueued", "scheduled", "first_token", "last_token",
                "first_delivered", "last_delivered", "t_decode", "ttft", "tpot", "e2el"):
        assert col in df
    assert df["enqueued"].isna().all() and df["scheduled"].isna().all()
    assert (df["arrival"] >= df["planned_arrival"] - 1e-3).all()
    assert ((df["ttft"] > 0) & (df["ttft"] < 10)).all()
    tpot = df["tpot"].dropna()
    assert ((tpot > 0) & (tpot < 1.0)).all()
    o = s["overall"]
    assert o["num_requests"] == 12 and o["completed"] == 12
    assert 0 < o["median_ttft_ms"] < 10_000 and 0 < o["median_tpot_ms"] < 1000
    assert 0 < o["median_itl_ms"] < 1000 and o["mean_t_queue_ms"] is None
    assert s["run"]["errors"] == 0 and s["run"]["new_connections"] <= 4


def test_bench_max_wall_cancels_and_server_frees(server, client):
    """A run cut by max_wall_s closes its streams; the server frees every block."""
    n = 4
    wl = Workload(arrival_s=np.zeros(n), prompt_tokens=np.full(n, 20),
                  output_tokens=np.full(n, 3000), priority=np.zeros(n))
    recs, facts = asyncio.run(run_bench(server.url, wl, max_wall_s=0.5, pool_size=8))
    df, s = bench_outputs(recs, wl, facts)
    assert len(df) == n and not df["finished"].any()
    assert (df["frames"] > 0).all() and s["overall"]["completed"] == 0
    _wait_idle(client, FREE_BOUND_S)


def test_missing_web_stack_is_one_line_error():
    from simulator.servecli import _need
    with pytest.raises(LatsimError, match="pip install 'latsim\\[serve\\]'"):
        _need("no_such_module_latsim_xyz")


def test_heartbeats_while_waiting():
    """A stream silent for heartbeat_s gets ': ping' comments; content frames are unchanged."""
    from real_engine.profile import build_engine
    from real_engine.server import BackgroundServer, make_app
    eng = build_engine("tiny", "cpu", num_blocks=256)
    slow = eng.step

    def step():                         # a slow engine: 30 ms per step
        time.sleep(0.03)
        return slow()
    eng.step = step
    with BackgroundServer(make_app(eng, "tiny", heartbeat_s=0.01)) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        evs = [e for _, e in _stream(c, "/v1/completions",
                                     {"prompt": "a b", "max_tokens": 4, "stream": True})]
    assert sum(e.comment is not None for e in evs) >= 3
    assert sum(e.data is not None and not e.done for e in evs) == 4 and evs[-1].done


def test_engine_failure_ends_streams_and_health():
    """If the engine thread dies, open streams end with an error, /health says 503, new
    requests get 503 JSON: nothing hangs."""
    from real_engine.profile import build_engine
    from real_engine.server import BackgroundServer, make_app
    eng = build_engine("tiny", "cpu", num_blocks=256)
    real, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("device lost")
        return real()
    eng.step = step
    with BackgroundServer(make_app(eng, "tiny")) as s, httpx.Client(base_url=s.url, timeout=10) as c:
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


def test_bench_http2(server):
    """--http2 needs h2; with it, a cleartext HTTP/1.1 server still answers (httpx
    negotiates HTTP/2 only over TLS or with prior knowledge)."""
    wl = Workload(arrival_s=[0.0], prompt_tokens=[4], output_tokens=[3], priority=[0])
    try:
        import h2  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(LatsimError, match="h2"):
            asyncio.run(run_bench(server.url, wl, http2=True))
        return
    recs, _ = asyncio.run(run_bench(server.url, wl, http2=True))
    assert recs[0].done and len(recs[0].times) == 3


def test_serve_cli_rejects_bad_options():
    import typer
    from typer.testing import CliRunner

    from simulator.servecli import serve
    app = typer.Typer()
    app.command("serve")(serve)
    app.command("noop")(lambda: None)
    for args in (["serve", "--device", "tpu"], ["serve", "--policy", "nope"]):
        r = CliRunner().invoke(app, args)
        assert isinstance(r.exception, LatsimError), r.output
