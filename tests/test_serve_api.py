"""``latsim serve``'s request fields and failure isolation, on loopback.

Every field the API accepts is type- and range-checked with a 400 naming it; fields the
server cannot honour (``n`` > 1, a ``stop``, ``echo``...) are refused unless they ask for
nothing; a failure of the engine thread on one request (injected here) fails that
request only. Servers run in-process on free 127.0.0.1 ports (the ``tiny`` model on
CPU); every wait is bounded by a safety net, nothing asserts a duration.
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from simulator.wire.benchclient import SseParser  # noqa: E402
from simulator.workload.classes import MAX_PRIORITY  # noqa: E402

SAFETY_S = 30.0


def _engine(**kw):
    from real_engine.profile import build_engine
    args = dict(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=512)
    return build_engine("tiny", "cpu", **{**args, **kw})


def _server(engine):
    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    return BackgroundServer(make_app(engine, "tiny"))


@pytest.fixture(scope="module")
def aging():
    """A server running ``priority_aging`` (the policy whose key a priority overflowed)."""
    with _server(_engine(policy="priority_aging")) as s:
        yield s


@pytest.fixture()
def client(aging):
    with httpx.Client(base_url=aging.url, timeout=SAFETY_S) as c:
        yield c


def _events(c, body: dict, path: str = "/v1/completions") -> list:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        p = SseParser()
        return [e for e in (p.feed(ln) for ln in r.iter_lines()) if e is not None]


# -- priority ------------------------------------------------------------------------

@pytest.mark.parametrize("prio", [2 ** 63, 10 ** 30, MAX_PRIORITY + 1, -1, 1.5, 1e30, "9",
                                  True, [1]],
                         ids=["2**63", "10**30", "max+1", "negative", "float", "1e30",
                              "string", "bool", "list"])
def test_priority_outside_the_class_range_is_400_and_the_engine_keeps_serving(client, prio):
    """The repro: ``priority`` 2**63 once overflowed the aging key's int64 inside a step,
    and the engine answered 503 to everyone until restart. Now it is refused at the API
    with the field and the range, and the engine serves a mixed-priority load after it."""
    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3,
                                             "priority": prio})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and f"[0, {MAX_PRIORITY}]" in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert client.get("/health").status_code == 200
    # Two classes at once: the key is computed (the step that overflowed) and served.
    with httpx.Client(base_url=str(client.base_url), timeout=SAFETY_S) as c2:
        t = threading.Thread(target=lambda: c2.post("/v1/completions", json={
            "prompt": "x y", "max_tokens": 20, "priority": MAX_PRIORITY}))
        t.start()
        r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3,
                                                 "priority": 0})
        t.join(SAFETY_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- the other fields ----------------------------------------------------------------

BAD = [
    ({"n": 5}, "n", "not supported"),
    ({"n": -1}, "n", "integer >= 1"),
    ({"n": 0}, "n", "integer >= 1"),
    ({"n": "2"}, "n", "integer >= 1"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"temperature": "hot"}, "temperature", "number in [0, 2]"),
    ({"temperature": -0.1}, "temperature", "number in [0, 2]"),
    ({"temperature": 2.5}, "temperature", "number in [0, 2]"),
    ({"temperature": True}, "temperature", "number in [0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"min_p": -1}, "min_p", "[0, 1]"),
    ({"top_k": -2}, "top_k", "integer >= 1"),
    ({"top_k": 1.5}, "top_k", "integer >= 1"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": "0"}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"seed": 2 ** 64}, "seed", "64-bit integer"),
    ({"seed": "1"}, "seed", "64-bit integer"),
    ({"max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"max_tokens": -3}, "max_tokens", "integer >= 1"),
    ({"max_tokens": 2.0}, "max_tokens", "integer >= 1"),
    ({"max_tokens": True}, "max_tokens", "integer >= 1"),
    ({"max_tokens": 2 ** 64}, "max_tokens", "exceeds the model's context"),
    ({"min_tokens": 9}, "min_tokens", "[0, max_tokens = 3]"),
    ({"stream": "yes"}, "stream", "a boolean"),
    ({"stream": 1}, "stream", "a boolean"),
    ({"stop": 5}, "stop", "a string or a list of strings"),
    ({"stop": ["x", 1]}, "stop", "a string or a list of strings"),
    ({"stop": "\n"}, "stop", "not supported"),
    ({"stop": ["t1"]}, "stop", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"logprobs": 3}, "logprobs", "not supported"),
    ({"suffix": "z"}, "suffix", "not supported"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"ignore_eos": "yes"}, "ignore_eos", "a boolean"),
    ({"user": 7}, "user", "a string"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "needs 'stream': true"),
    ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options",
     "boolean"),
    ({"stream": True, "stream_options": []}, "stream_options", "an object"),
    ({"prompt": ["a b", "c d"]}, "prompt", "batch of 2 prompts is not supported"),
]


@pytest.mark.parametrize("extra,param,words", BAD,
                         ids=[f"{next(iter(e))}={json.dumps(next(iter(e.values())))[:20]}"
                              for e, _, _ in BAD])
def test_invalid_or_unsupported_field_is_400_naming_it(client, extra, param, words):
    """vLLM answers 400 to invalid values; an unsupported one (``n`` 5 used to get 200
    with one choice) is refused too, never answered as if it had been honoured."""
    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert words in err["message"], err["message"]
    assert "\n" not in err["message"] and len(err["message"]) < 300
    assert err["type"] == "invalid_request_error" and err["code"] == 400


def test_chat_fields_are_checked_as_well(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = client.post("/v1/chat/completions", json={"messages": [{"content": "hi"}], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/chat/completions", json={"messages": [{"content": "hi"}],
                                                  "max_completion_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_valid_fields_that_ask_for_nothing_are_served(client):
    """The defaults of the fields it refuses, and in-range sampling values (validated,
    then without effect: sampling is greedy), get exactly max_tokens tokens."""
    body = {"prompt": "a b c", "max_tokens": 5, "n": 1, "best_of": 1, "temperature": 0.7,
            "top_p": 1, "top_k": -1, "min_p": 0.0, "seed": -(2 ** 63), "stop": [],
            "echo": False, "logprobs": None, "ignore_eos": True, "min_tokens": 5,
            "presence_penalty": -2, "user": "u1", "priority": MAX_PRIORITY,
            "max_tokens_unknown_field": {"ignored": [1, 2]}, "stream": False}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_stream_options_include_usage_ends_with_a_usage_chunk(client):
    evs = _events(client, {"prompt": "a b c d", "max_tokens": 4,
                           "stream_options": {"include_usage": True}})
    data = [json.loads(e.data) for e in evs if e.data is not None and not e.done]
    assert evs[-1].done and len(data) == 5
    assert all(len(d["choices"]) == 1 for d in data[:4])
    assert data[-1]["choices"] == [] and data[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    # Not asked for: no usage chunk.
    plain = _events(client, {"prompt": "a b c d", "max_tokens": 4})
    assert sum(e.data is not None and not e.done for e in plain) == 4


# -- an engine-thread failure on one request -------------------------------------------

POISON = 13        # an injected failure hits any step holding a request of this prompt length


def _poisoned_engine():
    """An engine whose step raises while a POISON-token request is in it (a bug that
    only one request triggers, as the 2**63 priority did)."""
    eng = _engine()
    real = eng.step

    def step():
        if any(s.prompt_tokens == POISON for s in eng.seqs.values()):
            raise OverflowError("int too big to convert")
        return real()
    eng.step = step
    return eng


def test_a_step_failing_on_one_request_fails_that_request_only():
    """A healthy stream runs while a poisoned request arrives: the poisoned one gets a
    500 naming the failure, the healthy one gets all its tokens and [DONE], /health stays
    200 and the next request is served (the engine once answered 503 to all, for good)."""
    with _server(_poisoned_engine()) as s, httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        out: dict = {}
        first = threading.Event()

        def healthy():
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "a b", "max_tokens": 40, "stream": True}) as r:
                p, evs = SseParser(), []
                for ln in r.iter_lines():
                    e = p.feed(ln)
                    if e is not None:
                        evs.append(e)
                        first.set()
                out["evs"] = evs
        t = threading.Thread(target=healthy)
        t.start()
        assert first.wait(SAFETY_S)                 # it has been through good steps
        with httpx.Client(base_url=s.url, timeout=SAFETY_S) as c2:
            r = c2.post("/v1/completions", json={"prompt": "w " * POISON, "max_tokens": 3})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert "OverflowError" in err["message"] and err["type"] == "server_error"
            assert c2.get("/health").status_code == 200
        t.join(SAFETY_S)
        evs = out["evs"]
        assert evs[-1].done and sum(e.data is not None and not e.done for e in evs) == 40
        r = c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert c.get("/health").status_code == 200
        assert s.server.config.app.state.engine_loop.requests_failed == 1


def _run_loop(el, reqs: list) -> dict:
    """Queue every add before the engine thread starts (so they all reach one step
    together), run it, and collect what each request's queue received."""
    from real_engine.engineloop import _ABORT, _DONE, Failed, _Stream

    async def main():
        loop = asyncio.get_running_loop()
        sts = []
        for rid, (ids, mt) in enumerate(reqs):
            st, ack = _Stream(rid, loop, 0.0), loop.create_future()
            el.cmds.put(("add", st, ids, mt, 0, ack))
            sts.append((st, ack))
        el.start()
        got = {}
        for st, ack in sts:
            assert await asyncio.wait_for(ack, SAFETY_S) is None
            items = []
            while True:
                tok = await asyncio.wait_for(st.q.get(), SAFETY_S)
                if tok is _DONE or tok is _ABORT or isinstance(tok, Failed):
                    items.append(tok if not isinstance(tok, Failed) else "failed")
                    break
                items.append(tok)
            got[st.rid] = items
        return got
    try:
        return asyncio.run(main())
    finally:
        el.stop()


def test_elimination_blames_the_poisoned_request_not_its_step_mates():
    """Two requests new in the same step, one poisoned: both are taken out, put back one
    per step, and only the one whose step fails again is failed; the other is served
    whole, and the engine thread is still alive."""
    from real_engine.engineloop import _DONE, EngineLoop
    el = EngineLoop(_poisoned_engine())
    got = _run_loop(el, [([1, 2, 3], 6), ([5] * POISON, 6), ([7, 8], 4)])
    assert len(got[0]) == 7 and got[0][-1] is _DONE
    assert got[1] == ["failed"]
    assert len(got[2]) == 5 and got[2][-1] is _DONE
    assert el.failure is None and el.requests_failed == 1 and el.served == 2


def test_a_command_failing_on_one_request_fails_that_request_only():
    """``add_request`` raising something other than the ValueError of a request too big
    (here an OverflowError, for priority 7 only) is a 500 for that request; the others
    are served."""
    eng = _engine()
    real = eng.add_request

    def add(rid, ids, mt, prio=0, now=None):
        if prio == 7:
            raise OverflowError("Python int too large to convert to C long")
        return real(rid, ids, mt, prio, now=now)
    eng.add_request = add
    with _server(eng) as s, httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        r = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "priority": 7})
        assert r.status_code == 500 and "OverflowError" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "priority": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_an_engine_failing_every_request_is_reported_down():
    """A fault that is the engine's (every step fails, whoever is in it): the requests
    blamed alone one after another get 500, and at MAX_BLAMED_IN_A_ROW the engine thread
    stops: /health is 503 and new requests are refused with 503."""
    from real_engine.engineloop import MAX_BLAMED_IN_A_ROW
    eng = _engine()

    def step():
        raise RuntimeError("device lost")
    eng.step = step
    with _server(eng) as s, httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        codes = [c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2}).status_code
                 for _ in range(MAX_BLAMED_IN_A_ROW)]
        assert codes == [500] * (MAX_BLAMED_IN_A_ROW - 1) + [503]
        h = c.get("/health")
        assert h.status_code == 503 and "device lost" in h.json()["reason"]
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 503


# -- serve --model DIR: the folder's config.json ---------------------------------------

TINY_CFG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 192, "vocab_size": 512,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}


@pytest.mark.parametrize("change,field,value", [
    ({"num_hidden_layers": [2]}, "num_hidden_layers", "[2]"),
    ({"num_hidden_layers": -2}, "num_hidden_layers", "-2"),
    ({"num_attention_heads": 0}, "num_attention_heads", "0"),
    ({"hidden_size": "64"}, "hidden_size", "'64'"),
    ({"vocab_size": 512.5}, "vocab_size", "512.5"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "3"),
    ({"max_position_embeddings": True}, "max_position_embeddings", "True"),
    ({"rope_theta": "big"}, "rope_theta", "'big'"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps", "-1e-05"),
    ({"rope_scaling": [8]}, "rope_scaling", "[8]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8"}}, "rope_scaling.factor", "'8'"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "model_type", "'mixtral'"),
], ids=["layers-list", "layers-negative", "zero-heads", "hidden-text", "vocab-float",
        "kv-heads-not-dividing", "context-bool", "rope-theta-text", "eps-negative",
        "rope-scaling-list", "rope-factor-text", "moe"])
def test_serve_model_dir_with_a_bad_config_is_one_line_exit_2(change, field, value, tmp_path,
                                                               monkeypatch, capsys):
    """Wrong types or impossible values in a checkpoint's config.json: exit 2 with one
    line naming the file, the field and the value, before a socket is bound or anything
    is loaded (both are made to fail the test if reached)."""
    import sys

    import real_engine.hosting
    import real_engine.profile
    from simulator.cli.main import main
    cfg = {**TINY_CFG, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def reached(*a, **k):
        raise AssertionError("reached past the config check")
    monkeypatch.setattr(real_engine.hosting, "listen_socket", reached)
    monkeypatch.setattr(real_engine.profile, "build_engine", reached)
    monkeypatch.setattr(sys, "argv", ["latsim", "serve", "--model", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latsim: error: "), err
    assert str(tmp_path / "config.json") in lines[0] and f"field '{field}'" in lines[0]
    assert f"(got {value})" in lines[0], lines[0]


def test_a_good_config_still_reads_as_before(tmp_path):
    """The one reader gives the engine the shape the old Llama reader gave it."""
    from real_engine.model import PRESETS, resolve_config
    (tmp_path / "config.json").write_text(json.dumps(TINY_CFG))
    cfg = resolve_config(str(tmp_path))
    tiny = PRESETS["tiny"]
    for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn", "vocab", "max_seq_len",
              "rope_theta", "norm_eps", "head_dim"):
        assert getattr(cfg, f) == getattr(tiny, f), f


# -- /metrics: Prometheus text ----------------------------------------------------------

def test_metrics_are_prometheus_text_with_vllms_names_and_move_with_requests():
    """The text parses (``prometheus_client.parser``), carries vLLM's names, and its
    counts move by exactly what was served: 2 requests of 3 and 5 prompt words and 4 and
    6 tokens are 8 prompt tokens, 10 generated, 2 first tokens, 4 - 1 + 6 - 1 = 8
    inter-token gaps and 2 end-to-end latencies. Each server has its own registry: a
    second server in this process starts from zero."""
    from prometheus_client.parser import text_string_to_metric_families

    from real_engine.metrics import engine_settings, parse
    eng = _engine(policy="fifo")
    with _server(eng) as s, httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        types = {f.name: f.type for f in text_string_to_metric_families(r.text)}
        assert types["vllm:num_requests_running"] == "gauge"
        assert types["vllm:time_to_first_token_seconds"] == "histogram"
        assert types["vllm:prompt_tokens"] == "counter"
        m0 = parse(r.text)
        assert m0["vllm:kv_cache_usage_perc"] == 0.0 and m0["latsim:kv_blocks_total"] == 512
        assert engine_settings(m0) == {
            "model": "tiny", "device": "cpu", "policy": "fifo", "max_num_seqs": 8,
            "max_num_batched_tokens": 256, "chunk_size": getattr(eng.policy, "chunk_size", None),
            "aging_s": None,
            "num_blocks": 512, "block_size": eng.cache.block_size, "backpressure": "buffer",
            "stream_buffer_frames": 256}
        assert c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4}).status_code == 200
        evs = _events(c, {"prompt": "a b c d e", "max_tokens": 6})
        assert evs[-1].done
        m = parse(c.get("/metrics").text)
        moved = {k: m[k] - m0[k] for k in (
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            'vllm:request_success_total{finished_reason="length"}',
            "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
            "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count")}
        assert moved == {"vllm:prompt_tokens_total": 8, "vllm:generation_tokens_total": 10,
                         'vllm:request_success_total{finished_reason="length"}': 2,
                         "vllm:time_to_first_token_seconds_count": 2,
                         "vllm:inter_token_latency_seconds_count": 8,
                         "vllm:e2e_request_latency_seconds_count": 2,
                         "vllm:request_queue_time_seconds_count": 2}
        # Every latency is within its request's span: a TTFT is at most its E2E.
        assert 0 < m["vllm:time_to_first_token_seconds_sum"] <= m["vllm:e2e_request_latency_seconds_sum"]
        assert m['vllm:time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert m["latsim:frames_written_total"] == 6          # the streamed one's frames
        with _server(_engine(policy="fifo")) as s2, httpx.Client(base_url=s2.url) as c2:
            assert parse(c2.get("/metrics").text)["vllm:generation_tokens_total"] == 0


# -- the event loop under load ------------------------------------------------------------

def test_health_and_metrics_answer_while_the_engine_is_held_mid_step():
    """The event loop never waits on the engine thread: with a step held at a barrier
    (provably mid-step: the step has started and cannot end until the test lets it),
    /health and /metrics are answered, and a stream gets the tokens handed over before
    the barrier. Structural: no duration is asserted, only that the answers come while
    the engine is still held."""
    eng = _engine()
    real, entered, release, calls = eng.step, threading.Event(), threading.Event(), []

    def step():
        calls.append(1)
        if len(calls) == 4:             # prefill, then 2 decodes handed over first
            entered.set()
            assert release.wait(SAFETY_S), "the test never released the step"
        return real()
    eng.step = step
    from real_engine.metrics import parse
    with _server(eng) as s, httpx.Client(base_url=s.url, timeout=SAFETY_S) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "a b", "max_tokens": 8, "stream": True}) as r:
            p, got = SseParser(), []
            lines = r.iter_lines()
            while len(got) < 3:
                e = p.feed(next(lines))
                if e is not None and e.data is not None:
                    got.append(e)
            assert entered.wait(SAFETY_S) and not release.is_set()
            with httpx.Client(base_url=s.url, timeout=SAFETY_S) as c2:
                assert c2.get("/health").status_code == 200
                m = parse(c2.get("/metrics").text)
                assert m["vllm:generation_tokens_total"] == 3 and not release.is_set()
            release.set()
            rest = [e for e in (p.feed(ln) for ln in lines) if e is not None]
        assert rest[-1].done and len(got) + sum(e.data is not None and not e.done
                                                for e in rest) == 8


def test_tokens_already_queued_are_written_in_one_chunk():
    """A stream that fell behind the engine (k tokens queued when it wakes) writes them in
    one chunk, not k: one write and one wake-up of the event loop instead of k each, so a
    loop serving many streams catches up rather than keeping every other request, /health
    included, queued behind a backlog. The SSE a client parses is unchanged: k events."""
    from real_engine.engineloop import _DONE, EngineLoop, _Stream
    from real_engine.openai_api import Parsed
    from real_engine.server import _stream
    el = EngineLoop(_engine())

    async def run():
        st = _Stream(0, asyncio.get_running_loop(), 0.0, 2)
        for t in (11, 12, 13, 14, 15):
            st.q.put_nowait(t)
        st.q.put_nowait(_DONE)
        st.delivered = 5
        p = Parsed([1, 2], 5, True, 0, "tiny")
        return [c async for c in _stream(el, st, "cmpl-x", 0, p, False, heartbeat_s=15.0)], st
    chunks, st = asyncio.run(run())
    assert len(chunks) == 2 and chunks[-1] == "data: [DONE]\n\n"
    p = SseParser()
    texts = [json.loads(e.data)["choices"][0]["text"]
             for e in (p.feed(ln) for ln in chunks[0].split("\n")) if e is not None]
    assert texts == [" t11", " t12", " t13", " t14", " t15"]
    assert st.written == 5 and el.frames == 5       # each frame counted as written
