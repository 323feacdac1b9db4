"""Closed-loop multi-turn sessions (``workload: {kind: sessions}``): the prompts carry the
history (exact arithmetic), the loop closes (a turn is sent its think or tool time
after the previous one's last byte, one request per user at a time), prefix caching
finds the previous turn's prompt and answer, a session's time to last turn is the sum of
its requests' E2E and the delays between them, the run obeys the interactive
response-time law and the closed system's bounds, the compiled loop declines it with a reason, and bad input is a
one-line error (exit 2) naming the file and the field.

Float tolerances: times are sums of a few dozen doubles of at most ~1e3 s, so their
rounding is below 1e-9 s (``ABS``); counts and token arithmetic are exact."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from conftest import REPO, ZERO_NET, ZERO_STREAM, make_scenario_dict
from simulator.cli.main import app
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.loops.simulate import Unsupported, simulate
from simulator.workload import build_workload
from simulator.workload.sessions import GAP_THINK, GAP_TOOL

ABS = 1e-9
PROFILE = str(REPO / "profiles" / "h200-llama3-8b-refbench.json")


def _wl(**over) -> dict:
    wl = {"kind": "sessions", "users": 4, "sessions": 8,
          "turns": {"kind": "constant", "value": 4}, "system_prompt_tokens": 64,
          "user_tokens": {"kind": "constant", "value": 40},
          "output_tokens": {"kind": "constant", "value": 24},
          "think_time": {"kind": "exponential", "mean_s": 0.5}}
    wl.update(over)
    return wl


def _scenario(wl: dict, prefix: bool = True, **over):
    d = make_scenario_dict(workload=wl, network=dict(ZERO_NET), stream=dict(ZERO_STREAM))
    d["engine"]["kv"] = {"num_blocks": 20000, "prefix_caching": prefix}
    d.update(over)
    return validate_scenario(d)


def _run(wl: dict, seed: int = 3, **kw):
    sc = _scenario(wl, **kw)
    return simulate(sc, seed, loop="simpy")


def _plan(res):
    return res.workload.meta["sessions"]


def test_prompt_of_turn_k_is_the_history_chat():
    """Chat: P_k = sys + (k + 1) u + k o for constant lengths (each turn adds the last
    answer and the new message), and generally P_k = P_{k-1} + O_{k-1} + u_k."""
    wl = build_workload(_scenario(_wl()).workload, np.random.default_rng(0), REPO)
    plan = wl.meta["sessions"]
    assert len(wl) == 8 * 4 and plan.n_sessions == 8
    k = plan.turn
    np.testing.assert_array_equal(wl.prompt_tokens, 64 + (k + 1) * 40 + k * 24)
    np.testing.assert_array_equal(wl.output_tokens, 24)
    # Consecutive ids within a session; lognormal lengths: the recursion, exactly.
    wl2 = build_workload(_scenario(_wl(
        user_tokens={"kind": "lognormal", "mean": 50, "cv": 1.0},
        output_tokens={"kind": "lognormal", "mean": 30, "cv": 1.0},
        turns={"kind": "uniform", "low": 1, "high": 6})).workload,
        np.random.default_rng(1), REPO)
    p, o, s = wl2.prompt_tokens, wl2.output_tokens, wl2.meta["sessions"].session
    same = s[1:] == s[:-1]
    new_msg = p[1:][same] - p[:-1][same] - o[:-1][same]
    assert (new_msg >= 1).all()            # a user message of >= 1 token
    assert (p[~np.r_[False, same]] > 64).all()   # a session's first: sys + a message


def test_prompt_reasoning_and_agentic():
    """Reasoning: output = reasoning + answer, the history keeps the answer only (or
    both, ``keep_reasoning``). Agentic: each user turn is ``c`` tool-call requests and a
    final answer; a tool result joins the prompt after the tool's latency."""
    r = build_workload(_scenario(_wl(
        mode="reasoning", reasoning_tokens={"kind": "constant", "value": 100})).workload,
        np.random.default_rng(0), REPO)
    k = r.meta["sessions"].turn
    np.testing.assert_array_equal(r.output_tokens, 124)
    np.testing.assert_array_equal(r.prompt_tokens, 64 + (k + 1) * 40 + k * 24)
    kr = build_workload(_scenario(_wl(
        mode="reasoning", keep_reasoning=True,
        reasoning_tokens={"kind": "constant", "value": 100})).workload,
        np.random.default_rng(0), REPO)
    np.testing.assert_array_equal(kr.prompt_tokens, 64 + (k + 1) * 40 + k * 124)
    a = build_workload(_scenario(_wl(
        mode="agentic", tool_calls={"kind": "constant", "value": 2},
        tool_latency={"kind": "constant", "mean_s": 0.7},
        tool_call_tokens={"kind": "constant", "value": 10},
        tool_result_tokens={"kind": "constant", "value": 30})).workload,
        np.random.default_rng(0), REPO)
    plan = a.meta["sessions"]
    assert len(a) == 8 * 4 * 3
    # Request j of a turn (0, 1: tool calls; 2: the answer); turn k's history before it:
    # k earlier turns of (40 message + 2 x (10 call + 30 result) + 24 answer).
    j = np.tile(np.arange(3), 8 * 4)
    want = 64 + plan.turn * (40 + 2 * 40 + 24) + 40 + j * 40
    np.testing.assert_array_equal(a.prompt_tokens, want)
    np.testing.assert_array_equal(a.output_tokens, np.where(j < 2, 10, 24))
    np.testing.assert_array_equal(plan.gap_kind, np.where(
        j > 0, GAP_TOOL, np.where(plan.turn > 0, GAP_THINK, 0)))
    np.testing.assert_allclose(plan.gap_s[j > 0], 0.7, rtol=0, atol=0)


def test_the_loop_closes_and_time_to_last_turn_is_the_sum():
    """Each request is sent exactly its delay after the previous one of its session
    came back; a user never has two requests out; time to last turn = sum of E2E +
    think + tool times (agentic, so both kinds of delay are in it)."""
    res = _run(_wl(mode="agentic", tool_calls={"kind": "uniform", "low": 0 + 1, "high": 3},
                   tool_latency={"kind": "exponential", "mean_s": 0.3}))
    rec, plan = res.rec, _plan(res)
    assert not np.isnan(rec.last_delivered).any()
    s = plan.session
    same = s[1:] == s[:-1]
    sent_after = rec.arrival[1:][same] - rec.last_delivered[:-1][same]
    np.testing.assert_allclose(sent_after, plan.gap_s[1:][same], rtol=0, atol=ABS)
    user = plan.s_user[s]
    for u in range(plan.users):
        idx = np.flatnonzero(user == u)
        order = idx[np.argsort(rec.arrival[idx])]
        assert (rec.arrival[order][1:] >= rec.last_delivered[order][:-1] - ABS).all()
    t = res.meta["session_table"]
    assert (t["outcome"] == "completed").all()
    np.testing.assert_allclose(t["time_to_last_turn_s"],
                               t["e2el_sum_s"] + t["think_s"] + t["tool_s"], rtol=0, atol=ABS)
    assert (t["tool_s"] > 0).all() and (t["think_s"] > 0).all()
    summ = res.meta["sessions"]
    assert summ["sessions_completed"] == 8
    assert summ["mean_requests_per_session"] == pytest.approx(len(res.workload) / 8)
    assert summ["mean_time_to_last_turn_ms"] == pytest.approx(
        t["time_to_last_turn_s"].mean() * 1e3, rel=1e-12)


def test_users_ramp_and_run_their_sessions_in_turn():
    """User u starts at u x ramp_s / users; session s + users (the same user's next)
    starts its session gap after session s's last byte (the default network and stream:
    the last byte comes a frame and a one-way trip after the replica's last token)."""
    res = _run(_wl(ramp_s=2.0, session_gap={"kind": "uniform", "low_s": 1, "high_s": 3}),
               prefix=False, network={}, stream={})
    assert (res.rec.last_delivered > res.rec.last_token).all()
    t, plan = res.meta["session_table"], _plan(res)
    np.testing.assert_allclose(t["start_s"][:4], [0.0, 0.5, 1.0, 1.5], rtol=0, atol=ABS)
    nxt = np.arange(4, 8)
    np.testing.assert_allclose(t["start_s"][nxt], t["end_s"][nxt - 4] + plan.start_gap_s[nxt],
                               rtol=0, atol=ABS)
    assert ((plan.start_gap_s[nxt] >= 1) & (plan.start_gap_s[nxt] <= 3)).all()
    np.testing.assert_array_equal(t["user"], np.arange(8) % 4)


def _hits(wl: dict):
    """A run with prefix caching; per request with a predecessor in its session: its
    hit, and that predecessor's prompt, output and kept tokens; the block size."""
    res = _run(wl, prefix=True)
    rec, w, plan = res.rec, res.workload, _plan(res)
    same = np.r_[False, plan.session[1:] == plan.session[:-1]]
    prev = [np.r_[0, x[:-1]][same] for x in (w.prompt_tokens, w.output_tokens, plan.kept)]
    return res, same, rec.cached_tokens[same], *prev, res.scenario.engine.kv.block_size


def test_prefix_hits_cover_the_previous_prompt_and_answer():
    """One replica, a cache far larger than the run: turn k's hit is exactly the full
    blocks of what turn k-1 computed, its prompt and answer (vLLM caches a block of
    generated tokens once full; the last token's KV is never computed: prompt + output
    - 1 tokens), and at least the system prompt's full blocks once another session
    computed them. Reasoning the history drops sits where the next prompt has the
    answer: the hit stops at the previous prompt; kept, it covers all of it."""
    res, same, hit, p, o, _, bs = _hits(_wl(turns={"kind": "uniform", "low": 2, "high": 6},
                                           user_tokens={"kind": "lognormal", "mean": 60,
                                                        "cv": 1.0}))
    np.testing.assert_array_equal(hit, (p + o - 1) // bs * bs)
    assert (hit > p).any()                   # past the previous prompt: its answer
    rec, plan = res.rec, _plan(res)
    first = plan.s_first[plan.s_first > 0]   # later sessions' first turns
    late = first[rec.arrival[first] > rec.last_delivered[0]]
    assert len(late) and (rec.cached_tokens[late] >= (64 // bs) * bs).all()
    think = {"kind": "constant", "value": 100}
    _, _, hit, p, o, _, bs = _hits(_wl(mode="reasoning", reasoning_tokens=think))
    np.testing.assert_array_equal(hit, p // bs * bs)
    _, _, hit, p, o, _, bs = _hits(_wl(mode="reasoning", reasoning_tokens=think,
                                       keep_reasoning=True))
    np.testing.assert_array_equal(hit, (p + o - 1) // bs * bs)
    off = _run(_wl(turns={"kind": "uniform", "low": 2, "high": 6},
                   user_tokens={"kind": "lognormal", "mean": 60, "cv": 1.0}), prefix=False)
    assert off.rec.cached_tokens.sum() == 0


def test_prefix_ids_never_share_what_differs():
    """Prefix ids of 10 tokens under KV blocks of 16 (not a multiple): a hit never
    covers more than the two prompts share (the previous prompt and answer within a
    session, the system prompt across sessions), and still finds what the previous
    request computed up to its last full block (the keys pin each block's position in
    its id unit)."""
    res, same, hit, p, o, _, bs = _hits(_wl(hash_block_tokens=10, system_prompt_tokens=70))
    assert (hit <= p + o - 1).all()
    np.testing.assert_array_equal(hit, (p + o - 1) // bs * bs)
    assert (res.rec.cached_tokens[~same] <= 70).all()


def test_clock_stop_leaves_sessions_unfinished():
    """``max_sim_time_s`` cuts the loop: the turns never sent have no arrival, their
    sessions are unfinished, and the summary still has a finite duration."""
    from simulator.report.output import run_outputs
    sc = _scenario(_wl(think_time=2.0), prefix=False, max_sim_time_s=3.0)
    res = simulate(sc, 1, loop="simpy")
    assert np.isnan(res.rec.arrival).any() and not np.isnan(res.rec.arrival).all()
    _, summary = run_outputs(res)
    assert summary["sessions"]["sessions_unfinished"] == 8
    assert np.isfinite(summary["overall"]["duration_s"])


def test_interactive_response_time_law():
    """X (R + Z) = the mean number of users still in the loop, exactly (every user's
    time is its delays plus its requests' E2E), so ``N - X (R + Z)`` lies in
    ``[0, N x (1 - earliest user end / run end)]``. With a constant think time the
    users end close together and a run of 40 sessions per user has X within 5% of
    the law's N / (R + Z); exponential think times spread the ends (the bound holds)."""
    for think, close in (({"kind": "constant", "mean_s": 1.0}, True),
                         ({"kind": "exponential", "mean_s": 1.0}, False)):
        res = _run(_wl(users=6, sessions=240, turns={"kind": "constant", "value": 2},
                       think_time=think), prefix=False)
        law = res.meta["sessions"]["response_time_law"]
        n, x, r, z = law["users"], law["throughput"], law["mean_response_s"], law["mean_think_s"]
        assert x * (r + z) == pytest.approx(law["mean_active_users"], rel=1e-12)
        plan, rec = _plan(res), res.rec
        user = plan.s_user[plan.session]
        ends = np.array([rec.last_delivered[user == u].max() for u in range(n)])
        bound = n * (1 - ends.min() / ends.max())
        assert 0 <= n - x * (r + z) <= bound + 1e-9
        assert law["law_throughput"] == pytest.approx(n / (r + z), rel=1e-12)
        if close:
            assert bound < 0.05 * n
            assert x == pytest.approx(law["law_throughput"], rel=0.05)
            x_fast = x
    # The same users thinking longer do less work per second (X falls as Z grows).
    slow = _run(_wl(users=6, sessions=240, turns={"kind": "constant", "value": 2},
                    think_time=4.0), prefix=False)
    assert slow.meta["sessions"]["response_time_law"]["throughput"] < x_fast


def _one_at_a_time(users: int, sessions: int, think_s: float, ramp_s: float = 0.0):
    """Sessions of one identical request each on a replica serving one at a time."""
    wl = _wl(users=users, sessions=sessions, turns={"kind": "constant", "value": 1},
             system_prompt_tokens=0, user_tokens={"kind": "constant", "value": 200},
             output_tokens={"kind": "constant", "value": 20}, think_time=think_s,
             ramp_s=ramp_s)
    d = make_scenario_dict(workload=wl)
    d["engine"]["max_num_seqs"] = 1
    res = simulate(validate_scenario(d), 1, loop="simpy")
    return res, res.rec.last_delivered - res.rec.arrival


def test_closed_loop_meets_the_deterministic_bounds():
    """The closed form of a closed system with N users, constant think time Z and one
    server of constant service time S (Denning & Buzen 1978, the asymptotic bounds,
    tight when both are deterministic): past the first round R = max(S, N S - Z) and
    X = min(N / (S + Z), 1 / S). S is measured on its own (one user, one request): here
    the replica serves one request at a time (max_num_seqs 1), every request alike
    (one-turn sessions, constant lengths). Saturated (Z = 0 and Z = 1.5 S, N = 4): the
    server never idles, so R = N S - Z and X = 1 / S exactly; light (Z = 10 S, the users
    staggered by S): no one waits, R = S. A turn sent early or late, or a user with two
    requests out, moves every one of these. Tolerance: sums of ~200 doubles of < 10 s."""
    _, e = _one_at_a_time(1, 1, 0.0)
    s = float(e[0])
    n = 4
    for z in (0.0, 1.5 * s):
        res, e = _one_at_a_time(n, 40, z)
        np.testing.assert_allclose(e[:n], s * np.arange(1, n + 1), rtol=0, atol=1e-9)
        np.testing.assert_allclose(e[n:], n * s - z, rtol=0, atol=1e-9)
        law = res.meta["sessions"]["response_time_law"]
        assert law["throughput"] == pytest.approx(1 / s, rel=1e-9)
    res, e = _one_at_a_time(n, 40, 10 * s, ramp_s=n * s)
    np.testing.assert_allclose(e, s, rtol=0, atol=1e-9)


def test_every_request_ends_once_and_its_breakdown_adds_up(monkeypatch):
    """Nothing lost: each sent request comes back to its user exactly once (finished or
    turned away), a request is sent only once and its gap after the previous one's last
    byte, and per request T_net + T_queue +
    T_prefill + T_decode + T_stream = E2E with send times set by the closed loop (a
    network and a stream of non-zero cost here). Sessions cut by a too-large turn leave
    the rest unsent."""
    from simulator.loops.simpy import sessions as loop
    from simulator.report.metrics import BREAKDOWN, requests_table
    calls = []
    for name in ("finished", "ended", "_go"):
        orig = getattr(loop.SessionClients, name)

        def spy(self, rid, *a, _o=orig, _n=name):
            calls.append((_n, rid))
            return _o(self, rid, *a)
        monkeypatch.setattr(loop.SessionClients, name, spy)
    d = make_scenario_dict(workload=_wl(mode="agentic"))
    d["engine"]["kv"] = {"num_blocks": 20000, "prefix_caching": True,
                         # a turn is 40 + 32 (tool call) + 256 (result) + 24 tokens:
                         # turn 2's first request (808 + 32) is turned away
                         "max_model_len": 800}
    del d["network"], d["stream"]          # the defaults: RTT, TLS, bytes per token
    res = simulate(validate_scenario(d), 2, loop="simpy")
    rec, n = res.rec, len(res.workload)
    sent = np.bincount([r for k, r in calls if k == "_go"], minlength=n)
    back = np.bincount([r for k, r in calls if k != "_go"], minlength=n)
    assert sent.max() == 1 and (back == sent).all()
    assert ((~np.isnan(rec.last_delivered)) ^ rec.rejected == (sent == 1)).all()
    assert rec.rejected.any() and (sent == 0).any()
    # The next turn leaves its gap after the last byte (which here reaches the user a
    # frame and a one-way trip after the replica's last token, when the replica ends it).
    plan = _plan(res)
    nxt = np.flatnonzero((plan.session[1:] == plan.session[:-1]) & (sent[1:] == 1)) + 1
    assert (rec.last_delivered[nxt - 1] > rec.last_token[nxt - 1]).all()
    np.testing.assert_allclose(rec.arrival[nxt] - rec.last_delivered[nxt - 1],
                               plan.gap_s[nxt], rtol=0, atol=ABS)
    df = requests_table(res)
    df = df[df["finished"]]
    assert res.scenario.network.base_rtt_ms > 0 and (df["t_net"] > 0).all()
    np.testing.assert_allclose(df[list(BREAKDOWN)].sum(axis=1), df["e2el"], rtol=0, atol=ABS)


def test_series_sample_on_the_send_span():
    """Past 5,000 requests the time series sample every span / 20,000 s: an open-loop
    run's span is its arrivals', all zeros in a sessions workload before the run, so a
    closed loop uses a lower bound of its send span (the busiest user's delays): samples
    at least that far apart, far fewer than the steps."""
    from simulator.loops.simulate import _series_interval
    wl = _wl(users=64, sessions=1300, think_time=5.0, system_prompt_tokens=0,
             user_tokens={"kind": "constant", "value": 16},
             output_tokens={"kind": "constant", "value": 8})
    res = _run(wl, prefix=False)
    plan = _plan(res)
    assert len(res.workload) > 5000
    per_user = np.bincount(plan.s_user[plan.session], weights=plan.delays)
    sent_last = np.array([np.nanmax(res.rec.arrival[plan.s_user[plan.session] == u])
                          for u in range(plan.users)])
    assert (sent_last >= per_user - ABS).all()          # a lower bound, user by user
    dt = _series_interval(res.workload)
    assert dt == per_user.max() / 20000 and dt > 0
    ts = np.asarray(res.rec.series[0][0])
    assert (np.diff(ts) >= dt).all() and len(ts) < res.rec.steps / 2


def test_deterministic_and_compiled_declines():
    a, b = _run(_wl(), seed=5), _run(_wl(), seed=5)
    for name in ("arrival", "last_delivered", "first_delivered", "cached_tokens"):
        np.testing.assert_array_equal(getattr(a.rec, name), getattr(b.rec, name))
    c = _run(_wl(), seed=6)
    assert not np.array_equal(a.rec.arrival, c.rec.arrival)
    sc = _scenario(_wl(), prefix=False)
    with pytest.raises(Unsupported, match="closed-loop sessions"):
        simulate(sc, 1, loop="compiled")
    assert simulate(sc, 1).meta["loop"].startswith("simpy (closed-loop sessions")


def test_turn_too_large_ends_its_session():
    """A turn over max_model_len is rejected: its session ends there (later turns never
    sent: no arrival), and the user goes on to its next session."""
    sc = _scenario(_wl(users=2, sessions=4), prefix=False)
    sc.engine.kv.max_model_len = 64 + 3 * 40 + 2 * 24 + 24 - 1   # turn 2 (k = 2) does not fit
    res = simulate(sc, 1, loop="simpy")
    rec, plan = res.rec, _plan(res)
    t = res.meta["session_table"]
    assert (t["outcome"] == "aborted").all()
    assert rec.rejected[plan.turn == 2].all() and np.isnan(rec.arrival[plan.turn == 3]).all()
    assert (t["requests_completed"] == 2).all() and (t["requests_sent"] == 3).all()
    assert np.isfinite(res.meta["sessions"]["response_time_law"]["throughput"])


def _write(tmp_path, wl: dict, **over):
    d = {"name": "s", "workload": wl, "engine": {"kv": {"num_blocks": 20000}},
         "model": {"cost": {"kind": "profile", "path": PROFILE}}, **over}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_unsent_turns_are_said_so(tmp_path):
    """The run's closing line counts the turns a closed loop never sent (their session
    ended at a rejected turn), not as requests that never completed although the run
    ended; the rejection still fails the run (exit 1)."""
    p = _write(tmp_path, _wl(users=2, sessions=4),
               engine={"kv": {"num_blocks": 20000,
                              "max_model_len": 64 + 3 * 40 + 2 * 24 + 24 - 1}})
    r = CliRunner().invoke(app, ["run", str(p)])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "4 rejected" in text and "4 never sent" in text, text
    assert "never completed" not in text


@pytest.mark.parametrize("over, field", [
    ({"users": -1}, "workload.users"),
    ({"users": 0}, "workload.users"),
    ({"think_time": -1.0}, "workload.think_time"),
    ({"think_time": {"kind": "exponential", "mean_s": -2}}, "workload.think_time.mean_s"),
    ({"think_time": {"kind": "uniform", "low_s": 3, "high_s": 1}}, "workload.think_time"),
    ({"tool_calls": {"kind": "constant", "value": 2}}, "workload"),
    ({"keep_reasoning": True}, "workload"),
    ({"mode": "reasoning"}, "workload"),
    ({"sessions": 0}, "workload.sessions"),
    ({"max_context_tokens": 10}, "workload.max_context_tokens"),
    ({"turns": {"kind": "constant", "value": 20_000}}, "workload.turns"),   # not cut silently
])
def test_bad_input_is_one_line_exit_2(tmp_path, over, field):
    p = _write(tmp_path, _wl(**over))
    r = CliRunner().invoke(app, ["run", str(p)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and str(p) in line and field in line, line


@pytest.mark.parametrize("mode", ["chat", "reasoning", "agentic"])
def test_a_dumped_scenario_validates_again(mode):
    """The results folder's scenario.yaml (every key, defaults included) is a scenario."""
    extra = {"reasoning_tokens": {"kind": "constant", "value": 8}} if mode == "reasoning" else {}
    sc = _scenario(_wl(mode=mode, **extra))
    again = validate_scenario(sc.model_dump(mode="json"))
    assert again.workload == sc.workload


@pytest.mark.parametrize("over, what", [
    ({"cluster": {"admission": {"action": "reject"}}}, "cluster.admission"),
    ({"report": {"utilization": True}}, "report.utilization"),
    ({"stream": {"disconnect": {"probability": 0.1}}}, "per-request stream"),
])
def test_sessions_refuse_traffic_control(tmp_path, over, what):
    """The gateway's clients and the per-request wire model send on clocks of their own:
    combined with closed-loop sessions, a one-line error (exit 2)."""
    p = _write(tmp_path, _wl(), **over)
    r = CliRunner().invoke(app, ["run", str(p)])
    line = r.output.strip()
    assert r.exit_code == 2 and "\n" not in line and str(p) in line, r.output
    assert "sessions" in line and what in line, line


def test_shipped_scenario_writes_sessions_csv(tmp_path):
    """The shipped scenario (cut with ``limit``): exit 0, a sessions table per run and
    the summary's sessions section; with prefix caching on, hits."""
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["run", str(REPO / "scenarios" / "sessions-chat.yaml"),
                                 "--set", "workload.limit=40", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Sessions (closed-loop users)" in r.output and "time to last turn" in r.output
    import pandas as pd
    for label in ("no-cache", "prefix-cache"):
        t = pd.read_csv(out / f"sessions-{label}.csv")
        assert t["requests"].sum() == 40 and (t["outcome"] == "completed").all()
    doc = json.loads((out / "summary.json").read_text())
    assert doc["prefix-cache"]["sessions"]["sessions_completed"] == len(t)
    assert doc["prefix-cache"]["kv"]["token_hit_ratio"] > 0.3


def test_sweep_rows_carry_the_session_metrics(tmp_path):
    """A sweep over the number of users: each row has the sessions section's metrics
    (``sessions.<metric>``), and more users complete the same sessions at a higher rate."""
    import pandas as pd
    p = _write(tmp_path, _wl(sessions=8, think_time=1.0))
    out = tmp_path / "sw"
    r = CliRunner().invoke(app, ["sweep", str(p), "--grid", "workload.users=1,4",
                                 "--workers", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv").sort_values("workload.users")
    assert (df["sessions.sessions_completed"] == 8).all()
    assert (df["sessions.response_time_law.users"] == [1, 4]).all()
    x = df["sessions.response_time_law.throughput"].to_numpy()
    assert x[1] > x[0]
    # The offered rate of a closed loop is its sends' (the plan's arrivals are zeros).
    assert np.isfinite(df["offered_rate"]).all() and df["offered_rate"].is_monotonic_increasing
