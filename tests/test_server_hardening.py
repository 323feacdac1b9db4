"""``latsim serve`` exposed to clients it does not trust, and ``latsim bench`` honest.

Real HTTP on loopback, as ``test_server``: body and JSON limits, the API key,
request timeouts and context checks against servers started in-process on free
ports (raw sockets where the point is what the server does before a body has
arrived); bad flag values and exit codes through ``latsim``'s own entry point;
``--port 0`` and the exposure warning through a ``latsim serve`` subprocess.
Every wait is bounded by a generous safety net; nothing asserts a duration.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import types

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serveproc import get_when_up, serve_process, stop  # noqa: E402
from simulator.wire.benchclient import SseParser, bench_outputs, run_bench  # noqa: E402
from simulator.workload import Workload  # noqa: E402

LIMIT = 64 * 1024          # the guarded server's body limit (bytes)
KEY = "test-key-7f3a91"
AUTH = {"Authorization": f"Bearer {KEY}"}
BIG = 50 << 20             # a Content-Length far past the limit, never sent
SAFETY_S = 30.0            # socket read safety net: only a broken server gets near it


def _engine(**kw):
    from real_engine.profile import build_engine
    args = dict(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=512)
    return build_engine("tiny", "cpu", **{**args, **kw})


def _server(engine, **app_kw):
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    send_buffer = app_kw.pop("send_buffer_bytes", None)
    return BackgroundServer(make_app(engine, "tiny", **app_kw), send_buffer_bytes=send_buffer)


@pytest.fixture(scope="module")
def guarded():
    """A server with a 64 KiB body limit and an API key."""
    with _server(_engine(), max_body_bytes=LIMIT, api_key=KEY) as s:
        yield s


@pytest.fixture()
def client(guarded):
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=SAFETY_S) as c:
        yield c


# /metrics is Prometheus text (real_engine.metrics): the samples these tests read.
SERVED = 'vllm:request_success_total{finished_reason="length"}'
CANCELLED = 'vllm:request_success_total{finished_reason="abort"}'
FREE = "latsim:kv_blocks_free"
TOTAL = "latsim:kv_blocks_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PAUSED = "latsim:num_requests_paused"
TIMED_OUT = "latsim:requests_timed_out_total"


def _metrics(c) -> dict:
    from real_engine.metrics import parse
    return parse(c.get("/metrics").text)


def _poll(c, cond, what: str, bound: float = SAFETY_S) -> dict:
    t_end = time.monotonic() + bound
    while True:
        m = _metrics(c)
        if cond(m):
            return m
        assert time.monotonic() < t_end, f"{what} not seen within {bound} s: {m}"
        time.sleep(0.02)


def _idle(m: dict) -> bool:
    return (m[FREE] == m[TOTAL]
            and m[RUNNING] == 0 and m[WAITING] == 0
            and m[PAUSED] == 0)


def _wait_idle(c, bound: float = SAFETY_S) -> dict:
    return _poll(c, _idle, "every KV block free", bound)


def _raw(port: int, head: str, body: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    """A raw-socket client: sends ``head`` (request line and headers) and ``body``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    return s


def _response(s: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body of one Content-Length response read off ``s``."""
    s.settimeout(SAFETY_S)
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        assert d, f"connection closed before a response: {buf!r}"
        buf += d
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(ln.lower().split(": ", 1) for ln in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        d = s.recv(65536)
        assert d, "connection closed mid-response"
        body += d
    return int(lines[0].split()[1]), headers, body


def _error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert err["message"] and "\n" not in err["message"]       # one line
    return err


# -- body size -----------------------------------------------------------------------

def test_content_length_over_the_limit_is_413_before_any_body_byte(guarded, client):
    """Only the headers are sent: a server that read (or waited for) the body before
    checking its size would never answer."""
    s = _raw(guarded.port, f"POST /v1/completions HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
                           f"Content-Type: application/json\nContent-Length: {BIG}\n")
    try:
        status, headers, body = _response(s)
        assert status == 413 and headers["connection"] == "close"
        err = _error_of(body)
        assert err["code"] == 413 and str(LIMIT) in err["message"] and str(BIG) in err["message"]
        assert s.recv(1) == b""                 # closed, not left waiting for 50 MiB
    finally:
        s.close()
    r = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    assert r.status_code == 200                 # the server is unharmed


def test_chunked_body_is_refused_where_it_crosses_the_limit(guarded):
    """A chunked body has no size up front: it is counted while read and refused once
    past the limit, although the client has not finished sending it."""
    s = _raw(guarded.port, f"POST /v1/completions HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
                           "Content-Type: application/json\nTransfer-Encoding: chunked\n",
             b"%x\r\n" % (4 * LIMIT) + b"a" * (LIMIT + 1))     # a chunk never finished
    try:
        status, headers, body = _response(s)
        assert status == 413 and headers["connection"] == "close"
        assert _error_of(body)["code"] == 413
    finally:
        s.close()


def test_chunked_body_under_the_limit_is_served(client):
    def pieces():
        yield b'{"prompt": "a b c", '
        yield b'"max_tokens": 3}'
    r = client.post("/v1/completions", content=pieces(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- JSON ----------------------------------------------------------------------------

def _nested(levels: int):
    v: list = []
    for _ in range(levels - 1):
        v = [v]
    return v


def test_json_depth_limit(client):
    """The body object is level 1: 31 more levels pass, 32 more are refused with 400, and
    nesting deep enough to exhaust the parser's recursion is a 400 too, never a 500."""
    # Carried by a field the API ignores (vLLM ignores unknown fields too).
    ok = {"prompt": "a b", "max_tokens": 2, "metadata": _nested(31)}
    assert client.post("/v1/completions", json=ok).status_code == 200
    deep = {"prompt": "a b", "max_tokens": 2, "metadata": _nested(32)}
    r = client.post("/v1/completions", json=deep)
    assert r.status_code == 400 and "nested deeper than 32" in _error_of(r.content)["message"]
    for raw in (b"[" * 30000 + b"]" * 30000, b'{"a":' * 9000 + b"1" + b"}" * 9000,
                b"[" * 60000):
        assert len(raw) <= LIMIT
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:200]
        _error_of(r.content)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b"", None),
    ("/v1/completions", b"null", None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 3', None),
    ("/v1/completions", b"\xff\xfe\xfa\x00 not utf", None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": NaN}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 3, "model": {"a": 1}}', "model"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 3, "model": "' + b"m" * 300 + b'"}',
     "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": 5, "content": "x"}]}', "messages"),
], ids=["empty", "null", "truncated", "not-utf8", "huge-int", "nan", "model-object",
        "model-long", "role-not-string"])
def test_malformed_bodies_are_one_line_400s(client, path, raw, param):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:200]
    err = _error_of(r.content)
    assert err["code"] == 400 and err["param"] == param and len(err["message"]) < 300
    assert client.get("/health").status_code == 200


def test_lone_surrogate_in_a_prompt_is_served(client):
    """Valid JSON that is not valid UTF-8 once decoded (a lone surrogate escape) used to
    fail the tokenizer with a 500."""
    r = client.post("/v1/completions", content=b'{"prompt": "a \\ud800 b", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


# -- the model's context -------------------------------------------------------------

@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": "w " * 4000, "max_tokens": 200}, "max_tokens",
     ["4000 tokens", "200", "4096", "at most 96"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens",
     ["5000", "4096", "at most 4095"]),
    ("/v1/completions", {"prompt": "w " * 5000, "max_tokens": 1}, "prompt",
     ["at least 4096 tokens", "4096"]),
    ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 1}, "prompt",
     ["5000 tokens", "4096"]),
    ("/v1/chat/completions", {"messages": [{}] * 4100, "max_tokens": 1}, "messages",
     ["4100 messages", "4096"]),
], ids=["sum", "max_tokens", "prompt-text", "prompt-ids", "messages"])
def test_context_limit_names_the_field_and_the_limits(client, path, body, param, words):
    r = client.post(path, json=body)
    assert r.status_code == 400
    err = _error_of(r.content)
    assert err["param"] == param
    for w in words:
        assert w in err["message"], err["message"]


# -- the API key ---------------------------------------------------------------------

@pytest.mark.parametrize("auth", [None, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}",
                                  "Bearer", KEY],
                         ids=["none", "longer", "prefix", "basic", "empty", "no-scheme"])
def test_every_endpoint_but_health_needs_the_key(guarded, auth):
    headers = {"Authorization": auth} if auth else {}
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=SAFETY_S) as c:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/no/such/path")):
            r = c.request(method, path, json={"prompt": "a", "max_tokens": 1})
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
            assert _error_of(r.content)["code"] == 401
        assert c.get("/health").status_code == 200


def test_the_key_opens_every_endpoint(guarded):
    for scheme in ("Bearer", "bearer"):
        with httpx.Client(base_url=guarded.url, timeout=SAFETY_S,
                          headers={"Authorization": f"{scheme} {KEY}"}) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
            assert "latsim:kv_blocks_free" in _metrics(c)
            r = c.post("/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200


def test_unauthenticated_request_body_is_never_read(guarded):
    s = _raw(guarded.port, "POST /v1/completions HTTP/1.1\nHost: t\n"
                           f"Content-Type: application/json\nContent-Length: {BIG}\n")
    try:
        status, _, body = _response(s)
        assert status == 401 and _error_of(body)["code"] == 401
    finally:
        s.close()


# -- timeouts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_timed():
    """A server whose engine sleeps 20 ms a step and which cuts requests at 0.5 s: a
    request of hundreds of tokens cannot finish in time on any machine."""
    eng = _engine()
    step = eng.step

    def slow_step():
        time.sleep(0.02)
        return step()
    eng.step = slow_step
    with _server(eng, request_timeout_s=0.5, heartbeat_s=None) as s, \
            httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        yield s, c


def test_streamed_request_past_the_timeout_ends_with_an_error_event(slow_timed):
    _, c = slow_timed
    before = _metrics(c)
    evs = []
    with c.stream("POST", "/v1/completions",
                  json={"prompt": "a b c", "max_tokens": 2000, "stream": True}) as r:
        assert r.status_code == 200
        p = SseParser()
        for line in r.iter_lines():
            ev = p.feed(line)
            if ev is not None:
                evs.append(ev)
    assert not any(e.done for e in evs), "a timed-out stream must not end with [DONE]"
    err = json.loads(evs[-1].data)["error"]
    assert err["code"] == 504 and "timed out after 0.5 s" in err["message"]
    m = _wait_idle(c)
    assert m[TIMED_OUT] == before[TIMED_OUT] + 1
    assert m[CANCELLED] == before[CANCELLED] + 1
    assert m[SERVED] == before[SERVED]


def test_plain_request_past_the_timeout_is_504(slow_timed):
    _, c = slow_timed
    before = _metrics(c)
    r = c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2000})
    assert r.status_code == 504 and _error_of(r.content)["code"] == 504
    m = _wait_idle(c)
    assert m[TIMED_OUT] == before[TIMED_OUT] + 1
    assert m[CANCELLED] == before[CANCELLED] + 1


def test_body_not_arriving_within_the_timeout_is_408(slow_timed):
    srv, _ = slow_timed
    s = _raw(srv.port, "POST /v1/completions HTTP/1.1\nHost: t\nContent-Type: application/json\n"
                       "Content-Length: 100\n", b'{"prompt": ')     # the rest never comes
    try:
        status, headers, body = _response(s)
        assert status == 408 and headers["connection"] == "close"
        assert _error_of(body)["code"] == 408
    finally:
        s.close()


def test_deadline_stream_cuts_a_write_that_never_completes():
    """The mechanism behind a non-reading client: the response is stuck in a write
    (``send`` never returns), so only the deadline wrapper can end it; it must close
    the generator (whose ``finally`` cancels the request) and count the timeout."""
    from real_engine.guards import Deadline, DeadlineStream
    closed, sent = [], []

    async def frames():
        try:
            while True:
                yield "data: x\n\n"
        finally:
            closed.append(True)

    async def send(msg):
        sent.append(msg)
        if msg.get("body"):
            await asyncio.Event().wait()        # the client stopped reading

    async def receive():
        await asyncio.Event().wait()            # and never disconnects

    async def main():
        counters = types.SimpleNamespace(timed_out=0)
        resp = DeadlineStream(frames(), Deadline(counters, 0.05),
                               media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(resp(scope, receive, send), SAFETY_S)
        # Read before the event loop ends: asyncio.run finalizes leftover generators itself.
        return counters.timed_out, list(closed)

    assert asyncio.run(main()) == (1, [True])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_client_that_stops_reading_cannot_hold_kv_past_the_timeout():
    """``block`` backpressure pauses a non-reading client's request with its KV blocks
    kept; the timeout still frees them (whether the stream was stuck in a write or
    not), and the client never sees ``[DONE]``."""
    with _server(_engine(), backpressure="block", stream_buffer_frames=16, heartbeat_s=None,
                 request_timeout_s=1.0, send_buffer_bytes=8192) as srv, \
            httpx.Client(base_url=srv.url, timeout=SAFETY_S) as c:
        body = json.dumps({"prompt": "a b c", "max_tokens": 3000, "stream": True}).encode()
        s = _raw(srv.port, "POST /v1/completions HTTP/1.1\nHost: t\n"
                           f"Content-Type: application/json\nContent-Length: {len(body)}\n",
                 body, rcvbuf=4096)
        try:
            m = _poll(c, lambda m: m[TIMED_OUT] == 1 and _idle(m),
                      "the request timed out and its blocks freed")
            assert m[CANCELLED] == 1
            assert m[SERVED] == 0
            s.settimeout(SAFETY_S)
            data = b""
            while True:                         # whatever was sent, up to the end
                d = s.recv(1 << 16)
                if not d:
                    break
                data += d
                if data.endswith(b"\r\n0\r\n\r\n"):
                    break
        finally:
            s.close()
        assert data.startswith(b"HTTP/1.1 200") and b"[DONE]" not in data


# -- command line: bad values, --port 0, the exposure warning --------------------------

def _latsim(argv, monkeypatch, capsys) -> tuple[int, str, str]:
    """Run ``latsim`` in-process through its entry point: (exit code, stdout, stderr)."""
    from simulator.cli.main import main
    monkeypatch.setattr(sys, "argv", ["latsim"] + argv)
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.parametrize("argv,flag,value", [
    (["serve", "--model", "nosuch"], "--model", "'nosuch'"),
    (["profile", "--model", "nosuch"], "--model", "'nosuch'"),
    (["serve", "--model", "m" * 300], "--model", "mmm..."),
    (["serve", "--device", "tpu"], "--device", "'tpu'"),
    (["profile", "--device", "d" * 300], "--device", "ddd..."),
    pytest.param(["serve", "--device", "cuda"], "--device", "'cuda'",
                 marks=pytest.mark.skipif("_cuda()", reason="this machine has CUDA")),
    pytest.param(["profile", "--device", "cuda"], "--device", "'cuda'",
                 marks=pytest.mark.skipif("_cuda()", reason="this machine has CUDA")),
    (["serve", "--api-key", ""], "--api-key", None),
    (["serve", "--api-key", "two words"], "--api-key", None),
    (["serve", "--policy", "nope"], "--policy", "'nope'"),
    (["serve", "--host", "203.0.113.7", "--port", "0"], "--host", "203.0.113.7"),
    (["bench", "--url", "ftp://example"], "--url", "'ftp://example'"),
], ids=["serve-model", "profile-model", "serve-long-model", "serve-device", "profile-long-device",
        "serve-cuda", "profile-cuda", "empty-key", "key-with-space", "policy", "host",
        "bench-url"])
def test_bad_flag_values_are_one_line_exit_2(argv, flag, value, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)                 # profile/bench must not write anything anyway
    code, out, err = _latsim(argv, monkeypatch, capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latsim: error: "), err
    assert flag in lines[0] and "Traceback" not in err
    if value is not None:
        assert value in lines[0]
    assert len(lines[0]) < 300                 # long values are shortened
    assert list(tmp_path.iterdir()) == []


def test_bench_http2_without_h2_is_exit_2_before_anything_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "h2", None)        # makes `import h2` fail
    out = tmp_path / "b"
    code, _, err = _latsim(["bench", "--url", "http://127.0.0.1:9", "--http2", "--out", str(out)],
                           monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [
        "latsim: error: --http2 needs the h2 package: pip install 'httpx[http2]'"]
    assert not out.exists()


def test_serve_port_0_prints_the_real_port_and_warns_beyond_loopback():
    proc, port = serve_process({}, "--num-blocks", "64", "--host", "0.0.0.0")
    try:
        assert port != 0
        assert get_when_up(port, "/health").status_code == 200     # the printed port is the real one
        assert get_when_up(port, "/v1/models").status_code == 200  # no key: open
    finally:
        err = stop(proc)
    warnings = [ln for ln in err.splitlines() if ln.startswith("latsim: warning:")]
    assert len(warnings) == 1 and "without an API key" in warnings[0] and str(port) in warnings[0]


def test_serve_key_from_the_environment_and_no_warning():
    proc, port = serve_process({"LATSIM_API_KEY": KEY}, "--num-blocks", "64", "--host", "0.0.0.0")
    try:
        assert get_when_up(port, "/health").status_code == 200
        assert get_when_up(port, "/v1/models").status_code == 401
        assert get_when_up(port, "/v1/models", headers=AUTH).status_code == 200
    finally:
        err = stop(proc)
    assert "latsim: warning:" not in err


# -- latsim bench: failures and HTTP/2 said out loud ------------------------------------

def _write_trace(path, rows) -> str:
    """An Azure-format trace: (seconds after the first, prompt tokens, output tokens)."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{46 + t:010.7f},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bench_all_failed_exits_1(guarded, monkeypatch, capsys, tmp_path):
    """No key against a keyed server: every request gets 401; bench says so and exits 1."""
    monkeypatch.delenv("LATSIM_API_KEY", raising=False)
    out = tmp_path / "b"
    code, stdout, err = _latsim(["bench", "--url", guarded.url, "--limit", "3", "--rate", "50",
                                 "--prompt-tokens", "4", "--output-tokens", "2",
                                 "--out", str(out)], monkeypatch, capsys)
    assert code == 1, stdout + err
    assert "latsim: bench: all 3 requests failed, none completed" in err and "HTTP 401" in err
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["failed"] == 3 and run["errors"] == 3


def test_bench_with_the_key_completes_and_exits_0(guarded, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LATSIM_API_KEY", KEY)
    out = tmp_path / "b"
    code, stdout, err = _latsim(["bench", "--url", guarded.url, "--limit", "3", "--rate", "50",
                                 "--prompt-tokens", "4", "--output-tokens", "2",
                                 "--out", str(out)], monkeypatch, capsys)
    assert code == 0, stdout + err
    assert "latsim: warning" not in err
    s = json.loads((out / "summary.json").read_text())
    assert s["overall"]["completed"] == 3 and s["run"]["failed"] == 0


def test_bench_some_failed_says_how_many(guarded, monkeypatch, capsys, tmp_path):
    """One request of three asks for more than the model's context: refused with 400."""
    trace = _write_trace(tmp_path / "t.csv", [(0.0, 5, 3), (0.01, 5, 9000), (0.02, 5, 3)])
    out = tmp_path / "b"
    code, stdout, err = _latsim(["bench", "--url", guarded.url, "--trace", trace,
                                 "--api-key", KEY, "--out", str(out)], monkeypatch, capsys)
    assert code == 0, stdout + err
    assert "1 of 3 requests failed" in err
    assert "3 sent, 2 completed, 1 failed" in stdout
    assert json.loads((out / "summary.json").read_text())["run"]["failed"] == 1


def test_bench_http2_fallback_is_reported_and_warned(guarded, monkeypatch, capsys, tmp_path):
    """uvicorn speaks HTTP/1.1 only: a run asked for HTTP/2 must say it measured 1.1."""
    pytest.importorskip("h2")
    out = tmp_path / "b"
    code, stdout, err = _latsim(["bench", "--url", guarded.url, "--http2", "--api-key", KEY,
                                 "--limit", "2", "--rate", "50", "--prompt-tokens", "4",
                                 "--output-tokens", "2", "--out", str(out)], monkeypatch, capsys)
    assert code == 0, stdout + err
    assert "(HTTP/2 asked for; the server answered HTTP/1.1)" in stdout
    warnings = [ln for ln in err.splitlines() if ln.startswith("latsim: warning:")]
    assert len(warnings) == 1 and "HTTP/1.1" in warnings[0]
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["http2_fallback"] is True and run["http_versions"] == {"HTTP/1.1": 2}


def test_bench_outputs_count_failures_and_fallback():
    """The summary fields the command line reads, from records alone."""
    from simulator.wire.benchclient import _Rec
    wl = Workload(arrival_s=[0.0, 0.1], prompt_tokens=[4, 4], output_tokens=[2, 2],
                  priority=[0, 0])
    ok = _Rec(0, 0.0, arrival=0.0, times=[0.05, 0.06], status=200, done=True,
              http_version="HTTP/1.1")
    bad = _Rec(1, 0.1, arrival=0.1, status=401, error="HTTP 401: no", http_version="HTTP/1.1")
    _, s = bench_outputs([ok, bad], wl, {"http2": True})
    assert s["run"]["failed"] == 1 and s["run"]["http2_fallback"] is True
    _, s = bench_outputs([ok, bad], wl, {"http2": False})
    assert s["run"]["http2_fallback"] is False
    h2 = _Rec(0, 0.0, arrival=0.0, times=[0.05], status=200, done=True, http_version="HTTP/2")
    _, s = bench_outputs([h2], wl, {"http2": True})
    assert s["run"]["http2_fallback"] is False and s["run"]["failed"] == 0


def test_run_bench_sends_the_key(guarded):
    wl = Workload(arrival_s=np.zeros(2), prompt_tokens=np.full(2, 4),
                  output_tokens=np.full(2, 2), priority=np.zeros(2))
    recs, facts = asyncio.run(run_bench(guarded.url, wl, api_key=KEY))
    _, s = bench_outputs(recs, wl, facts)
    assert s["overall"]["completed"] == 2 and s["run"]["failed"] == 0
    recs, facts = asyncio.run(run_bench(guarded.url, wl, model="tiny"))
    assert {r.status for r in recs} == {401}
