"""``latsim bench``: replay a trace over real HTTP against any OpenAI-compatible server.

Each request is sent at its arrival time (wall clock from the start of the run)
as ``POST /v1/completions`` with ``stream: true``, ``max_tokens`` = its output
tokens, ``ignore_eos: true`` (a vLLM/SGLang extension; ``--no-ignore-eos`` for
servers that reject it), ``priority`` = its class index (vLLM's field: an integer,
lower is served first, as class 0 = P0 is here; ``--no-priority`` for servers that
reject it: vLLM refuses a nonzero one unless started with ``--scheduling-policy
priority``) and a prompt of as many words as its prompt tokens
(words from a small list of common English words, most of which are one token
in BPE vocabularies, and one per-request word first so a prefix cache cannot
merge prompts; with ``latsim serve`` a word is exactly one token).

Requests share one ``httpx.AsyncClient`` (a keep-alive pool of ``pool_size``
connections, HTTP/2 optional), so connection reuse is what a real client
sees. Every SSE frame's arrival time is recorded when its event is complete
(the blank line that ends it is read).

The per-request table has the simulator's columns (``simulator.report.metrics``):
``arrival`` is the send time, ``first_delivered``/``last_delivered`` the first
and last content frames' arrivals. What happened inside the server a client
cannot see, unless the server tells it: every request carries the header
``x-latsim-timing``, and ``latsim serve`` answers it with a trailing SSE comment
``: latsim-timing {json}`` holding its wall-clock ``enqueued``, ``scheduled``,
``first_token`` and ``last_token`` times; they fill those columns, so
``t_net``, ``t_queue``, ``t_prefill`` and ``t_stream`` are measured. That needs
the client's and the server's clocks to agree (same host, e.g. loopback): if a
request's server times are impossible against its client times (enqueued
before sent, or a token produced after it arrived) the server times are
dropped for the run. Other servers ignore the header: then ``enqueued`` and
``scheduled`` are NaN and ``first_token``/``last_token`` are the client's
first/last frame, so only TTFT, TPOT, ITL, E2EL and ``t_decode`` are measured.
ITL is every gap between consecutive content frames, pooled. A request counts
as ``finished`` when it ended with ``[DONE]`` (or a clean end of stream) after
at least one content frame. Extra columns: ``planned_arrival`` (the trace's
time), ``frames`` (content frames), ``heartbeats`` (SSE comment lines),
``http_version`` (what the connection negotiated: with ``http2`` the client
offers HTTP/2 but a cleartext HTTP/1.1 server keeps 1.1), ``server_received``
and ``paused_s`` (from the server's timing, NaN without), ``status`` and
``error``. The summary's ``run`` says how many requests ``failed`` (sent, not
finished) and, under ``http2``, whether the server kept HTTP/1.1
(``http2_fallback``): a run asked for HTTP/2 must not pass for one.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from simulator.errors import LatsimError
from simulator.report.metrics import add_derived, per_class, summarize
from simulator.report.recorder import ItlHistogram
from simulator.workload.base import Workload

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from "
          "at which but have an they you were her she there one all we their been has when "
          "who will more no if out so said what up its about into than them can only other "
          "new some time could these two may then do first any my now such like our over man "
          "me even most made after also did many before must through back years where much "
          "your way well down should because each just those people how too little state good "
          "very make world still own see men work long get here between both life being under "
          "never day same another know while last might us great old year off come since "
          "against go came right used take three").split()


# The server-timing handshake with ``latsim serve`` (``real_engine.server`` uses these).
TIMING_HEADER = "x-latsim-timing"
TIMING_COMMENT = "latsim-timing"
# Server time fields, in the order a request passes them.
_SERVER_TIMES = ("received", "enqueued", "scheduled", "first_token", "last_token")


@dataclass
class SseEvent:
    """One SSE event: ``data`` (lines joined by newlines), ``event`` type and ``id``;
    or a comment line (``comment`` set, ``data`` None): a heartbeat."""

    data: Optional[str] = None
    event: str = "message"
    id: Optional[str] = None
    comment: Optional[str] = None

    @property
    def done(self) -> bool:
        """The OpenAI end-of-stream sentinel ``data: [DONE]``."""
        return self.data is not None and self.data.strip() == "[DONE]"


class SseParser:
    """Incremental SSE parser (the WHATWG event-stream rules): feed lines, get events.

    Field lines ``name: value`` (one leading space of the value dropped; a line
    without a colon is a field with an empty value); several ``data`` lines
    join with newlines; a blank line dispatches the event (none if it had no
    data); lines starting with ``:`` are comments, returned at once as
    heartbeats; unknown fields are ignored.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = "message"
        self._id: Optional[str] = None

    def feed(self, line: str) -> Optional[SseEvent]:
        """One line without its terminator; returns a completed event or None."""
        line = line.rstrip("\r\n")
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return SseEvent(comment=line[1:].lstrip(" "))
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or "message"
        elif name == "id":
            self._id = value
        return None

    def flush(self) -> Optional[SseEvent]:
        """End of stream: a pending event without its blank line is dispatched
        (lenient: some servers end with ``data: [DONE]\\n``)."""
        return self._dispatch()

    def _dispatch(self) -> Optional[SseEvent]:
        if not self._data:
            self._event = "message"
            return None
        ev = SseEvent(data="\n".join(self._data), event=self._event, id=self._id)
        self._data, self._event = [], "message"
        return ev


def parse_sse_lines(lines: Iterable[str]) -> list[SseEvent]:
    """Every event (and comment) in ``lines``, in order; see ``SseParser``."""
    p, out = SseParser(), []
    for ln in lines:
        # A chunk may hold several lines (a caller passing raw text): split it.
        for sub in ln.splitlines() or [""]:
            ev = p.feed(sub)
            if ev is not None:
                out.append(ev)
    ev = p.flush()
    if ev is not None:
        out.append(ev)
    return out


def frame_text(data: str) -> Optional[str]:
    """The generated text an OpenAI completion/chat chunk carries (None if not a chunk)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    ch = obj.get("choices") if isinstance(obj, dict) else None
    if not ch or not isinstance(ch, list) or not isinstance(ch[0], dict):
        return None
    c = ch[0]
    if c.get("text") is not None:
        return c["text"]
    d = c.get("delta") or {}
    return d.get("content") if isinstance(d, dict) else None


_BRACKETED = re.compile(r"^\[([^\]]*)\](?::(.*))?$")


def check_url(url: str, source: str = "--url") -> None:
    """Refuse, before anything is sent, a URL no request can go to: not http(s), no
    host, a port that is not a whole number in 1-65535, a malformed IPv6 literal (an
    unclosed bracket, not an address, text after the bracket) or blanks in the host.
    One-line ``LatsimError`` naming ``source`` and the value."""
    from urllib.parse import urlsplit

    def bad(why: str) -> LatsimError:
        return LatsimError(why, source=source, value=url, has_value=True)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise bad("must be an http:// or https:// URL")
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        raise bad("has a malformed IPv6 host (write it as [address]:port)") from None
    hostport = netloc.rpartition("@")[2]
    m = _BRACKETED.match(hostport)
    if hostport.startswith("["):
        try:
            if m is None:
                raise ValueError
            ipaddress.IPv6Address(m.group(1))
        except ValueError:
            raise bad("has a malformed IPv6 host (write it as [address]:port)") from None
        host, port = m.group(1), m.group(2)
    else:
        host, _, port = hostport.partition(":")
        if ":" in port:
            raise bad("has an IPv6 host without brackets (write it as [address]:port)")
    if not host or any(c.isspace() for c in host):
        raise bad("names no host" if not host else "has blanks in its host")
    if port is not None and port != "":
        if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
            raise bad("has a port outside 1-65535")


def make_prompt(n_words: int, rid: int, rng: np.random.Generator) -> str:
    """A prompt of ``n_words`` words: a per-request word, then common words."""
    words = [f"r{rid}"] + [_WORDS[i] for i in rng.integers(0, len(_WORDS), max(0, n_words - 1))]
    return " ".join(words)


def request_body(wl: Workload, i: int, model: str, rng: np.random.Generator, *,
                 ignore_eos: bool = True, send_priority: bool = True) -> dict:
    """The JSON body of request ``i`` of ``wl`` (its prompt drawn from ``rng``)."""
    b = {"model": model, "prompt": make_prompt(int(wl.prompt_tokens[i]), i, rng),
         "max_tokens": int(wl.output_tokens[i]), "stream": True}
    if ignore_eos:
        b["ignore_eos"] = True
    if send_priority:
        b["priority"] = int(wl.priority[i])
    return b


@dataclass
class _Rec:
    rid: int
    planned: float
    arrival: float = float("nan")
    times: list = field(default_factory=list)
    heartbeats: int = 0
    status: int = 0
    done: bool = False
    error: str = ""
    new_connection: bool = False
    http_version: str = ""
    server: dict = field(default_factory=dict)   # server timing, on the run's clock (s)


def _server_timing(text: str, wall0: float) -> dict:
    """A ``latsim-timing`` comment's times on the run's clock (``wall0``: its start)."""
    try:
        obj = json.loads(text[len(TIMING_COMMENT):])
    except ValueError:
        return {}
    if not isinstance(obj, dict):
        return {}
    out = {k: float(obj[k]) - wall0 for k in _SERVER_TIMES
           if isinstance(obj.get(k), (int, float))}
    if isinstance(obj.get("paused_s"), (int, float)):
        out["paused_s"] = float(obj["paused_s"])
    return out


async def _one(client, url: str, body: dict, rec: _Rec, t0: float, timeout: float,
               wall0: float = 0.0) -> None:
    """Send one request and record every content frame's arrival time (and the
    server's timing trailer, if it sends one; ``wall0``: the wall clock at ``t0``)."""
    clock = time.perf_counter

    async def trace(name, info):
        # httpcore's trace hook: a TCP connect means this request opened a new connection.
        if name.startswith("connection.connect_tcp.complete"):
            rec.new_connection = True

    async def go() -> None:
        async with client.stream("POST", url, json=body, headers={TIMING_HEADER: "1"},
                                 extensions={"trace": trace}) as resp:
            rec.status = resp.status_code
            rec.http_version = resp.http_version
            if resp.status_code != 200:
                txt = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {txt[:200]}"
                return
            p = SseParser()
            async for line in resp.aiter_lines():
                ev = p.feed(line)
                if ev is None:
                    continue
                now = clock() - t0
                if ev.comment is not None:
                    if ev.comment.startswith(TIMING_COMMENT):
                        rec.server = _server_timing(ev.comment, wall0)
                    else:
                        rec.heartbeats += 1
                elif ev.done:
                    # No break: reading to the end of the body lets httpx return the
                    # connection to the keep-alive pool (a half-read one is closed).
                    rec.done = True
                else:
                    txt = frame_text(ev.data)
                    if txt:
                        rec.times.append(now)
                    elif txt is None and '"error"' in ev.data:
                        rec.error = f"error event: {ev.data[:200]}"   # e.g. the engine died
            ev = p.flush()
            if ev is not None and ev.done:
                rec.done = True
            if not rec.done:
                rec.done = bool(rec.times)     # clean end of stream without [DONE]

    rec.arrival = clock() - t0
    try:
        await asyncio.wait_for(go(), timeout)   # (asyncio.timeout is 3.11+; latsim runs on 3.10)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout:g} s"
    except asyncio.CancelledError:
        rec.error = rec.error or "cancelled (--max-wall-s)"
        raise
    except Exception as e:                          # network errors: recorded, not fatal
        rec.error = f"{type(e).__name__}: {e}"[:200]


def need_h2() -> None:
    """A one-line error unless the h2 package (HTTP/2 for httpx) can be imported."""
    try:
        import h2  # noqa: F401
    except ImportError:
        raise LatsimError("--http2 needs the h2 package: pip install 'httpx[http2]'") from None


async def run_bench(url: str, wl: Workload, *, model: Optional[str] = None,
                    pool_size: int = 256, http2: bool = False, timeout: float = 600.0,
                    max_wall_s: Optional[float] = None, ignore_eos: bool = True,
                    seed: int = 0, api_key: Optional[str] = None,
                    send_priority: bool = True) -> tuple[list[_Rec], dict]:
    """Replay ``wl`` against ``url`` (a base URL or a full ``.../completions`` URL).

    Returns the request records and run facts. Requests not done by
    ``max_wall_s`` are cancelled (the client closes their streams). ``api_key``:
    sent as ``Authorization: Bearer <key>`` with every request. ``send_priority``:
    each body carries its request's ``priority`` (see the module docstring).
    """
    import httpx
    check_url(url)
    if http2:
        need_h2()
    base = url.rstrip("/")
    full = base if base.endswith("/completions") else base + "/v1/completions"
    rng = np.random.default_rng(seed)
    # Prompts and bodies built before the clock starts: building them is not client latency.
    bodies = []
    recs = []
    limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(limits=limits, http2=http2, headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0))) as client:
        if model is None:
            model = await _served_model(client, base)
        for i in range(len(wl)):
            bodies.append(request_body(wl, i, model, rng, ignore_eos=ignore_eos,
                                       send_priority=send_priority))
            recs.append(_Rec(i, float(wl.arrival_s[i])))
        t0 = time.perf_counter()
        wall0 = time.time()         # the same instant on the wall clock (server timing)
        tasks = []
        deadline = None if max_wall_s is None else t0 + max_wall_s
        for i, rec in enumerate(recs):
            wait = t0 + rec.planned - time.perf_counter()
            if deadline is not None and t0 + rec.planned > deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(_one(client, full, bodies[i], rec, t0, timeout,
                                                  wall0)))
        if tasks:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            _, pending = await asyncio.wait(tasks, timeout=left)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    return recs, {"url": full, "model": model, "pool_size": pool_size, "http2": http2,
                  "wall_s": wall, "planned": len(recs), "sent": len(tasks),
                  "max_wall_s": max_wall_s}


async def _served_model(client, base: str) -> str:
    """The first model ``GET /v1/models`` lists (OpenAI servers require a model name)."""
    root = base.rsplit("/v1/", 1)[0] if "/v1/" in base else base
    try:
        r = await client.get(root + "/v1/models", timeout=10.0)
        return r.json()["data"][0]["id"]
    except Exception:
        return "default"


def _server_col(recs: list[_Rec], key: str) -> np.ndarray:
    return np.array([r.server.get(key, np.nan) for r in recs], dtype=np.float64)


def server_times_consistent(recs: list[_Rec], tol: float = 1e-3) -> bool:
    """Whether the server's times fit the client's (``tol`` s of clock slack): each
    request enqueued after it was sent and each token made before it arrived. False
    means the two clocks disagree (another host) and the server times are unusable."""
    arr = np.array([r.arrival for r in recs], dtype=np.float64)
    first = np.array([r.times[0] if r.times else np.nan for r in recs])
    last = np.array([r.times[-1] if r.times else np.nan for r in recs])
    bad = ((_server_col(recs, "enqueued") < arr - tol)
           | (_server_col(recs, "first_token") > first + tol)
           | (_server_col(recs, "last_token") > last + tol))
    return not bad.any()         # NaN compares False: missing times are not evidence


def bench_table(recs: list[_Rec], wl: Workload,
                server_timing: bool = True) -> tuple[pd.DataFrame, ItlHistogram]:
    """The simulator's per-request table from the records, and the pooled ITL.

    ``server_timing``: use the server's timing trailers where present (see the
    module docstring); False ignores them."""
    n = len(recs)
    names = np.array(wl.class_names, dtype=object)
    prio = wl.priority[:n]
    first = np.array([r.times[0] if r.times else np.nan for r in recs])
    last = np.array([r.times[-1] if r.times else np.nan for r in recs])
    fin = np.array([r.done and bool(r.times) and not r.error for r in recs])
    srv = {k: (_server_col(recs, k) if server_timing else np.full(n, np.nan))
           for k in _SERVER_TIMES + ("paused_s",)}
    df = pd.DataFrame({
        "rid": np.arange(n), "priority": prio,
        "class": names[np.minimum(prio, len(names) - 1)] if len(names) else prio,
        "prompt_tokens": wl.prompt_tokens[:n], "output_tokens": wl.output_tokens[:n],
        "replica": -1, "new_connection": [r.new_connection for r in recs],
        "arrival": [r.arrival for r in recs], "enqueued": srv["enqueued"],
        "scheduled": srv["scheduled"],
        # Without the server's word, a token is taken to be made when its frame arrives.
        "first_token": np.where(np.isnan(srv["first_token"]), first, srv["first_token"]),
        "last_token": np.where(np.isnan(srv["last_token"]), last, srv["last_token"]),
        "first_delivered": first, "last_delivered": np.where(fin, last, np.nan),
    })
    df["finished"] = fin
    df["rejected"] = [r.status not in (0, 200) for r in recs]
    add_derived(df)
    df["planned_arrival"] = [r.planned for r in recs]
    df["frames"] = [len(r.times) for r in recs]
    df["heartbeats"] = [r.heartbeats for r in recs]
    df["http_version"] = [r.http_version for r in recs]
    df["server_received"] = srv["received"]
    df["paused_s"] = srv["paused_s"]
    df["status"] = [r.status for r in recs]
    df["error"] = [r.error for r in recs]
    itl = ItlHistogram()
    for r, ok in zip(recs, fin):
        if ok and len(r.times) > 1:
            itl.add_many(np.diff(r.times))
    return df, itl


def bench_outputs(recs: list[_Rec], wl: Workload, facts: dict) -> tuple[pd.DataFrame, dict]:
    """Table and summary (the simulator's ``summary.json`` layout: overall, per_class, run).

    Requests never sent (their arrival fell after ``max_wall_s``) have no row;
    ``run.planned - run.sent`` counts them.
    """
    timed = sum(bool(r.server) for r in recs)
    usable = server_times_consistent(recs)
    df, itl = bench_table(recs, wl, server_timing=usable)
    # The send order is fixed by the trace; keep only requests actually sent.
    df = df[~np.isnan(df["arrival"].to_numpy())].reset_index(drop=True)
    errors = df.loc[df["error"] != "", "error"]
    fin = df[df["finished"]]
    unobservable = [c for c in ("enqueued", "scheduled", "t_net", "t_queue", "t_prefill")
                    if not len(fin) or fin[c].isna().all()]
    versions = df.loc[df["http_version"] != "", "http_version"].value_counts()
    # Offered HTTP/2, and every answer that came back was something else.
    fallback = bool(facts.get("http2")) and len(versions) > 0 and "HTTP/2" not in versions
    run = dict(facts, errors=int(len(errors)), first_error=(errors.iloc[0] if len(errors) else None),
               failed=int(len(df) - len(fin)), http2_fallback=fallback,
               frames=int(df["frames"].sum()),
               new_connections=int(df["new_connection"].sum()),
               http_versions={str(k): int(v) for k, v in versions.items()},
               server_timing=(f"{timed} requests" if usable else
                              f"dropped: {timed} requests, but the clocks disagree"),
               unobservable=unobservable)
    return df, {"policy": "bench", "overall": summarize(df, itl), "per_class": per_class(df),
                "run": run}
