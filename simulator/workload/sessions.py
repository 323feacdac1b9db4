"""Closed-loop multi-turn sessions (``kind: sessions``): a fixed number of users, each
running its sessions one after another, each session a conversation whose next
prompt carries the history.

What a user does (the model of ``users`` closed-loop clients, as the interactive
response-time law assumes): send a turn, wait for the whole response, think
(``think_time``), send the next turn; after a session's last turn, think
(``session_gap``, default ``think_time``) and start the user's next session. So a
turn's send time depends on the previous turn's completion: the SimPy driver plays
this out (``loops.simpy.sessions``); the compiled loop, which needs every arrival
before it starts, declines (``session_reason``).

History (append-only per session): the prompt of a session's first request is
``system_prompt_tokens`` (shared by every session) + the first user message; each
later request's prompt is the previous prompt + what of the previous output joins
the history + the new input (the next user message after a think time, or a tool's
result after the tool's latency). So every prompt of a session is a prefix of one
token stream, and with prefix caching a turn finds the previous turn's prompt cached,
and its output where the history holds it as generated (``loops.simpy.sessions``).

Modes:

- ``chat``: the whole answer (``output_tokens``) joins the history.
- ``reasoning``: each request first generates ``reasoning_tokens`` (a thinking
  model's trace), then the answer; the history keeps the answer only, as DeepSeek-R1's
  and Qwen3's chat templates drop earlier turns' ``<think>`` content
  (``keep_reasoning: true`` keeps it).
- ``agentic``: each user turn is ``tool_calls`` rounds of (a request whose output is a
  tool call of ``tool_call_tokens``, the tool running for ``tool_latency``, its result
  of ``tool_result_tokens`` appended) and a final request answering the user. A tool
  result is sent on at once (no think time).

Prefix identity: the stream is named Mooncake-style (``hash_ids`` of
``hash_block_tokens``-token units; ``model.kv.prefixkeys``): the units wholly inside the
system prompt by their index (shared by all sessions), the others by (session, unit),
so a KV block is shared exactly where two prompts agree up to its last token,
whatever the engine's block size.

Requests are numbered in plan order: a session's requests are consecutive ids,
sessions in order. Their send times are set by the run; the ``Workload``'s
``arrival_s`` holds zeros until then (the recorder holds the real ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.pluginfield import plugin
from simulator.config.registry import LENGTHS, WORKLOADS
from simulator.config.strict import StrictModel
from simulator.errors import LatsimError, check_memory
from simulator.workload.base import Workload
from simulator.workload.lengths import MAX_TOKENS, sample_lengths

MAX_DELAY_S = 1e6          # a think or tool time beyond ~11 days is a mistake
MAX_TURNS = 10_000         # user turns in one session
GAP_NONE, GAP_THINK, GAP_TOOL = 0, 1, 2


class Delay(StrictModel):
    """A time in seconds: ``constant`` (``mean_s``), ``exponential`` (mean ``mean_s``),
    ``lognormal`` (mean ``mean_s``, coefficient of variation ``cv``) or ``uniform``
    (``low_s``..``high_s``). A bare number is a constant."""

    kind: Literal["constant", "exponential", "lognormal", "uniform"] = "constant"
    mean_s: Optional[float] = Field(None, ge=0, le=MAX_DELAY_S, description="constant, "
                                    "exponential, lognormal: the mean (s)")
    cv: float = Field(1.0, gt=0, le=100, description="lognormal: coefficient of variation")
    low_s: Optional[float] = Field(None, ge=0, le=MAX_DELAY_S, description="uniform: lowest (s)")
    high_s: Optional[float] = Field(None, ge=0, le=MAX_DELAY_S, description="uniform: highest "
                                    "(s)")

    @model_validator(mode="before")
    @classmethod
    def _number(cls, data):
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return {"kind": "constant", "mean_s": data}
        return data

    @model_validator(mode="after")
    def _fields(self):
        if self.kind == "uniform":
            if self.low_s is None or self.high_s is None or self.mean_s is not None:
                raise ValueError("uniform takes low_s and high_s (not mean_s)")
            if self.high_s < self.low_s:
                raise ValueError(f"high_s ({self.high_s:g}) < low_s ({self.low_s:g})")
        elif self.mean_s is None or self.low_s is not None or self.high_s is not None:
            raise ValueError(f"{self.kind} takes mean_s (not low_s/high_s)")
        return self

    @property
    def mean(self) -> float:
        return (self.low_s + self.high_s) / 2 if self.kind == "uniform" else self.mean_s

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` times (s) from ``rng``; a constant draws nothing."""
        if self.kind == "constant":
            return np.full(n, float(self.mean_s))
        if self.kind == "uniform":
            return rng.uniform(self.low_s, self.high_s, size=n)
        if self.mean_s == 0:
            return np.zeros(n)
        if self.kind == "exponential":
            return rng.exponential(self.mean_s, size=n)
        s2 = np.log1p(self.cv ** 2)
        return rng.lognormal(np.log(self.mean_s) - s2 / 2, np.sqrt(s2), size=n)


def _const(v: int):
    return lambda: LENGTHS.validate({"kind": "constant", "value": v})


class SessionsWorkload(StrictModel):
    """Closed-loop users, each running its sessions one after another: a turn is sent
    its think (or tool) time after the previous one's last byte, and its prompt is the
    session's history plus the new message (``simulator.workload.sessions``)."""

    kind: Literal["sessions"] = "sessions"
    users: int = Field(..., ge=1, le=100_000, description="closed-loop clients")
    sessions: Optional[int] = Field(None, ge=1, le=1_000_000, description="sessions in "
                                    "all, dealt to users in turn (default: one per user)")
    mode: Literal["chat", "reasoning", "agentic"] = Field(
        "chat", description="chat: the answer joins the history; reasoning: each request "
        "first generates reasoning_tokens; agentic: each user turn is tool_calls rounds of "
        "(tool call, tool latency, tool result) and a final answer")
    turns: plugin(LENGTHS) = Field(default_factory=_const(4), description="user turns "
                                   "per session")
    system_prompt_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="leading tokens "
                                      "every session shares")
    user_tokens: plugin(LENGTHS) = Field(default_factory=_const(128), description="each "
                                         "user message's new tokens")
    output_tokens: plugin(LENGTHS) = Field(default_factory=_const(128), description="each "
                                           "answer's tokens")
    think_time: Delay = Field(default_factory=lambda: Delay(kind="exponential", mean_s=5.0),
                              description="from an answer's last byte to the user's next "
                              "message (a number: constant seconds)")
    session_gap: Optional[Delay] = Field(None, description="before a user's next "
                                         "session (default: think_time)")
    ramp_s: float = Field(0.0, ge=0, le=MAX_DELAY_S, description="user u starts its "
                          "first session at u x ramp_s / users")
    reasoning_tokens: Optional[plugin(LENGTHS)] = Field(None, description="reasoning, "
                                                        "agentic: generated before each answer")
    keep_reasoning: bool = Field(False, description="the history keeps the reasoning (default: "
                                 "dropped, as DeepSeek-R1's and Qwen3's chat templates do)")
    tool_calls: Optional[plugin(LENGTHS)] = Field(None, description="agentic: tool calls per "
                                                  "user turn (default 1)")
    tool_latency: Optional[Delay] = Field(None, description="agentic: a tool's run time "
                                          "(default constant 1 s)")
    tool_call_tokens: Optional[plugin(LENGTHS)] = Field(None, description="agentic: a tool "
                                                        "call's output tokens (default 32)")
    tool_result_tokens: Optional[plugin(LENGTHS)] = Field(None, description="agentic: a "
                                                          "tool result's tokens (default 256)")
    max_context_tokens: Optional[int] = Field(None, ge=2, le=MAX_TOKENS, description=
                                              "a session ends before a request whose "
                                              "prompt + output would exceed this")
    hash_block_tokens: int = Field(16, ge=1, le=1 << 20, description="tokens per prefix "
                                   "id (a multiple-of-it KV block size names every shared "
                                   "block)")
    limit: Optional[int] = Field(None, gt=0, description="keep the first N requests (whole "
                                 "sessions in order, the last cut short)")

    @model_validator(mode="after")
    def _mode(self):
        # A key left at its default (None, false) is no request: a dumped scenario, which
        # holds every key, validates again.
        reasoning = ("reasoning_tokens", "keep_reasoning")
        tools = ("tool_calls", "tool_latency", "tool_call_tokens", "tool_result_tokens")
        for name in tools:
            if getattr(self, name) is not None and self.mode != "agentic":
                raise ValueError(f"{name} is for mode: agentic (mode is {self.mode})")
        for name in reasoning:
            if getattr(self, name) not in (None, False) and self.mode == "chat":
                raise ValueError(f"{name} is for mode: reasoning or agentic (mode is chat)")
        if self.mode == "reasoning" and self.reasoning_tokens is None:
            raise ValueError("mode: reasoning needs reasoning_tokens")
        if self.mode == "agentic":
            self.tool_calls = self.tool_calls or LENGTHS.validate({"kind": "constant",
                                                                   "value": 1})
            self.tool_latency = self.tool_latency or Delay(mean_s=1.0)
            self.tool_call_tokens = self.tool_call_tokens or _const(32)()
            self.tool_result_tokens = self.tool_result_tokens or _const(256)()
        return self

    @property
    def n_sessions(self) -> int:
        return self.sessions if self.sessions is not None else self.users


@dataclass(frozen=True)
class SessionPlan:
    """Per request (plan order): its session and user turn, the delay before it is sent
    after the previous request of its session comes back (``gap_s``, ``gap_kind``: none,
    think, tool), and what of its output joins the history (``kept``). Per session: its
    user, first request, number of requests and user turns, and the delay before it
    (``start_gap_s``: the ramp offset for a user's first session, else the gap after
    the user's previous one)."""

    users: int
    session: np.ndarray
    turn: np.ndarray
    gap_s: np.ndarray
    gap_kind: np.ndarray
    kept: np.ndarray
    s_user: np.ndarray
    s_first: np.ndarray
    s_requests: np.ndarray
    s_turns: np.ndarray
    start_gap_s: np.ndarray
    mode: str

    @property
    def n_sessions(self) -> int:
        return len(self.s_first)

    @property
    def delays(self) -> np.ndarray:
        """Per request, the delay its user waits before sending it: a session's first
        request its ``start_gap_s``, the others their ``gap_s``."""
        d = self.gap_s.copy()
        d[self.s_first] = self.start_gap_s
        return d

    @property
    def send_span_s(self) -> float:
        """A lower bound of the last send time: the busiest user's delays (its requests'
        E2E come on top). The run's time series sample on it (``loops.simulate``), as an
        open-loop run samples on its arrival span, which is all zeros here. With every
        delay 0 it is 0, and every step is sampled, as in a run of <= 5,000 requests."""
        per_user = np.bincount(self.s_user[self.session], weights=self.delays,
                               minlength=self.users)
        return float(per_user.max())


def session_reason(workload) -> Optional[str]:
    """Why the compiled loop cannot run this workload (None: nothing against it)."""
    if workload is not None and "sessions" in getattr(workload, "meta", {}):
        return "closed-loop sessions (a turn is sent when the previous one comes back)"
    return None


def _at_most_max_turns(x: np.ndarray, field: str) -> np.ndarray:
    """``x``, refused (not cut silently) when a draw exceeds ``MAX_TURNS``."""
    if len(x) and int(x.max()) > MAX_TURNS:
        raise LatsimError(f"a draw of {int(x.max()):,} exceeds {MAX_TURNS:,}: lower it or "
                          "set its max", field=field)
    return x


def _draw(cfg: SessionsWorkload, rng: np.random.Generator) -> dict:
    """Every random quantity of the run, drawn from ``rng`` in a fixed order."""
    s = cfg.n_sessions
    d = {"turns": _at_most_max_turns(sample_lengths(cfg.turns, s, rng), "workload.turns")}
    t = int(d["turns"].sum())
    check_memory(t * 256, f"drawing {t:,} session turns", field="workload",
                 hint="fewer sessions or turns")
    d["user"] = sample_lengths(cfg.user_tokens, t, rng)
    d["answer"] = sample_lengths(cfg.output_tokens, t, rng)
    d["think"] = cfg.think_time.sample(t, rng)
    d["session_gap"] = (cfg.session_gap or cfg.think_time).sample(s, rng)
    if cfg.mode == "agentic":
        d["calls"] = _at_most_max_turns(sample_lengths(cfg.tool_calls, t, rng),
                                        "workload.tool_calls")
        c = int(d["calls"].sum())
        check_memory((t + c) * 256, f"drawing {t + c:,} session requests", field="workload")
        d["call_out"] = sample_lengths(cfg.tool_call_tokens, c, rng)
        d["tool_s"] = cfg.tool_latency.sample(c, rng)
        d["result"] = sample_lengths(cfg.tool_result_tokens, c, rng)
    else:
        d["calls"] = np.zeros(t, dtype=np.int64)
    n_req = t + int(d["calls"].sum())
    d["reasoning"] = (sample_lengths(cfg.reasoning_tokens, n_req, rng)
                      if cfg.reasoning_tokens is not None else np.zeros(n_req, np.int64))
    return d


def _requests(cfg: SessionsWorkload, d: dict):
    """The requests of every session in plan order (module doc): columns as lists, and
    per session its first request, number of requests and of user turns. Draw ``i`` of
    each kind belongs to the same turn (or tool call, request) whether or not a limit
    cuts its session short."""
    cols = {k: [] for k in ("session", "turn", "prompt", "output", "kept", "gap_s",
                            "gap_kind")}
    s_first, s_req, s_turns = [], [], []
    keep_r = cfg.keep_reasoning
    limit = cfg.limit if cfg.limit is not None else float("inf")
    cap = cfg.max_context_tokens or float("inf")
    calls = d["calls"]
    t0 = np.concatenate([[0], np.cumsum(d["turns"])])          # first turn of session s
    c0 = np.concatenate([[0], np.cumsum(calls)])               # first tool call of turn t
    n = 0
    for s in range(len(d["turns"])):
        if n >= limit:
            break
        first, p = n, cfg.system_prompt_tokens
        for ti in range(int(t0[s]), int(t0[s + 1])):
            k = ti - int(t0[s])
            add, gap, kind = int(d["user"][ti]), float(d["think"][ti]), GAP_THINK
            if k == 0:
                gap, kind = 0.0, GAP_NONE
            ci = int(c0[ti])
            steps = [(int(d["call_out"][ci + i]), float(d["tool_s"][ci + i]),
                      int(d["result"][ci + i])) for i in range(int(calls[ti]))]
            steps.append((int(d["answer"][ti]), None, None))
            for j, (out, tool_s, result) in enumerate(steps):
                r = int(d["reasoning"][ti + ci + j])     # request draw: turns + calls before
                p += add
                if n >= limit or p + r + out > cap:
                    break
                for key, v in (("session", s), ("turn", k), ("prompt", p),
                               ("output", r + out), ("kept", out + (r if keep_r else 0)),
                               ("gap_s", gap), ("gap_kind", kind)):
                    cols[key].append(v)
                n += 1
                p += out + (r if keep_r else 0)
                if tool_s is not None:
                    add, gap, kind = result, tool_s, GAP_TOOL
            else:
                continue
            break
        if n > first:
            s_first.append(first)
            s_req.append(n - first)
            s_turns.append(cols["turn"][-1] + 1)
    return cols, s_first, s_req, s_turns


def _hash_ids(cfg: SessionsWorkload, session: np.ndarray, prompt: np.ndarray,
              s_first: list, s_req: list) -> list:
    """Mooncake-style prefix ids of every prompt: each session's stream of units (the
    system prompt's whole units shared), each prompt a view of its session's prefix."""
    h = cfg.hash_block_tokens
    sys_units = cfg.system_prompt_tokens // h
    units = -(-prompt // h)
    need = sum(int(units[f + r - 1]) for f, r in zip(s_first, s_req))
    check_memory(need * 8, f"naming {need:,} prefix units", field="workload.hash_block_tokens",
                 hint="raise it")
    out: list = [None] * len(prompt)
    base = 1 + sys_units
    for f, r in zip(s_first, s_req):
        last = int(units[f + r - 1])       # prompts grow: the last is the longest
        ids = np.arange(base, base + last, dtype=np.int64)
        ids[:min(sys_units, last)] = np.arange(1, 1 + min(sys_units, last))
        base += last
        for j in range(f, f + r):
            out[j] = ids[:int(units[j])]
    return out


def build_sessions(cfg: SessionsWorkload, rng: np.random.Generator, base_dir: Path) -> Workload:
    """The plan of ``cfg``'s sessions (module doc): lengths and delays drawn from
    ``rng`` (``_draw``, fixed order), arrivals left to the run."""
    d = _draw(cfg, rng)
    cols, s_first, s_req, s_turns = _requests(cfg, d)
    if not s_first:
        raise LatsimError("no request fits: the first prompt + output exceeds it",
                          field="workload.max_context_tokens", value=cfg.max_context_tokens,
                          has_value=True)
    a = {k: np.asarray(v) for k, v in cols.items()}
    if a["prompt"].max() + a["output"].max() > MAX_TOKENS:
        raise LatsimError(f"a session's history grows past {MAX_TOKENS:.0e} tokens: lower "
                          "turns or the lengths, or set max_context_tokens", field="workload")
    n_s = len(s_first)
    s_user = np.arange(n_s) % cfg.users
    start = np.asarray(d["session_gap"][:n_s], dtype=np.float64)
    first_of_user = np.arange(n_s) < cfg.users
    start[first_of_user] = s_user[first_of_user] * cfg.ramp_s / cfg.users
    plan = SessionPlan(users=cfg.users, session=a["session"].astype(np.int64),
                       turn=a["turn"].astype(np.int64), gap_s=a["gap_s"].astype(np.float64),
                       gap_kind=a["gap_kind"].astype(np.int8),
                       kept=a["kept"].astype(np.int64), s_user=s_user,
                       s_first=np.asarray(s_first, np.int64),
                       s_requests=np.asarray(s_req, np.int64),
                       s_turns=np.asarray(s_turns, np.int64), start_gap_s=start,
                       mode=cfg.mode)
    # Sessions dropped by ``limit`` leave a gap in the numbering: renumber them 0..
    plan.session[:] = np.repeat(np.arange(n_s), plan.s_requests)
    prompt = a["prompt"].astype(np.int64)
    n = len(prompt)
    hash_ids = _hash_ids(cfg, plan.session, prompt, s_first, s_req)
    meta = {"format": "sessions", "hash_block_tokens": cfg.hash_block_tokens,
            "sessions": plan}
    return Workload(arrival_s=np.zeros(n), prompt_tokens=prompt,
                    output_tokens=a["output"].astype(np.int64),
                    priority=np.zeros(n, dtype=np.int64), hash_ids=hash_ids,
                    client=plan.s_user[plan.session], meta=meta)


WORKLOADS.register("sessions", SessionsWorkload, build_sessions)
