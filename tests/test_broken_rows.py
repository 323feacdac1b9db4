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


def test_sweep_points_find_the_profile_from_any_working_directory(tmp_path, monkeypatch):
    # Each grid point is checked as the file is: relative to the scenario, so a sweep
    # of a scenario naming its model runs from outside the repository too.
    import pandas as pd
    from typer.testing import CliRunner

    from simulator.cli.main import app
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sw"
    r = CliRunner().invoke(app, ["sweep", str(QUICKSTART), "--set", "model.name=llama-3-8b",
                                 "--set", "workload.num_requests=20", "--grid",
                                 "engine.max_num_seqs=16,32", "--workers", "1",
                                 "--out", str(out)])
    assert r.exit_code == 0, (r.output[-1500:], r.exception)
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 and (df["completed"] == 20).all()


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


# -- 3. a plug-in policy's order key is honoured, and sees what it needs -------------------

from simulator.kernel import kernel  # noqa: E402
from simulator.model.policies.chunked import ChunkParams, fill_chunked  # noqa: E402
from simulator.model.scheduling import Policy, SchedulerState, Seq, register_policy  # noqa: E402
from simulator.model.scheduling.view import ClassInfo  # noqa: E402


@kernel
def _lifo_kernel(prio, enq, progress, now, p):
    return -enq


@pytest.fixture(autouse=True, scope="module")
def _forget_test_policies():
    """The policies these tests register leave the registry with the module."""
    yield
    from simulator.model.scheduling.policy import POLICIES
    for name in [n for n in POLICIES if n.startswith("t_")]:
        POLICIES.unregister(name)


def _policy(name, key=None, by_class=False, kern=None, timed=False):
    """A chunked policy ordered by ``key`` (an ``order_key`` method) or ``kern`` (an
    order kernel of its own), registered once under ``name``."""
    from simulator.model.scheduling.policy import POLICIES
    if name not in POLICIES:
        body = {"Params": ChunkParams, "fill_kernel": fill_chunked, "by_class": by_class,
                "time_dependent": timed}
        if key is not None:
            body["order_key"] = lambda self, req: key(req)
        if kern is not None:
            body["order_kernel"] = kern
        register_policy(name)(type(name, (Policy,), body))
    from simulator.model.scheduling import make_policy
    return make_policy(name, max_num_seqs=1, max_num_batched_tokens=10_000)


def _queue(pol, reqs):
    """A queue holding ``reqs``: (rid, enqueued, prompt, priority), pushed in that order."""
    q = pol.new_queue()
    seqs = {}
    for rid, enq, prompt, prio in reqs:
        seqs[rid] = s = Seq(rid, enq, prompt, 10, priority=prio)
        q.push(s)
    return q, seqs


# Four requests of two classes; rid = arrival order.
TINY = [(0, 0.0, 300, 1), (1, 1.0, 100, 0), (2, 2.0, 200, 1), (3, 3.0, 100, 1)]


@pytest.mark.parametrize("by_class", [False, True])
def test_a_lifo_key_gives_last_in_first_out(by_class):
    pol = _policy(f"t_lifo_{by_class}", key=lambda r: -r.enqueued, by_class=by_class)
    q, _ = _queue(pol, TINY)
    # Newest first, across and within classes (before: by_class=False never called the
    # key, [0, 1, 2, 3]; by_class=True kept each class FIFO, [1, 0, 2, 3]).
    assert [s.rid for s in q.candidates(5.0)] == [3, 2, 1, 0]
    # The schedule admits the newest (max_num_seqs = 1: one admission).
    state = SchedulerState(now=5.0, waiting=q, decoding=[], prefilling=[], free_blocks=10**6)
    assert pol.schedule(state).admit == (3,)
    q.remove(q_seq := next(iter(q.candidates(5.0))))
    assert q_seq.rid == 3 and [s.rid for s in q.candidates(5.0)] == [2, 1, 0] and len(q) == 3


def test_an_order_kernel_of_a_plugins_own_is_honoured_too():
    pol = _policy("t_lifo_kernel", kern=_lifo_kernel, by_class=True)
    q, _ = _queue(pol, TINY)
    assert [s.rid for s in q.candidates(5.0)] == [3, 2, 1, 0]


def test_shortest_prompt_first_ties_to_the_earlier_arrival():
    pol = _policy("t_spf", key=lambda r: r.prompt_tokens)
    q, _ = _queue(pol, TINY)
    # prompts 300, 100, 200, 100: the two 100s by arrival (1 before 3), then 200, 300.
    assert [s.rid for s in q.candidates(0.0)] == [1, 3, 2, 0]
    # A request requeued (preempted by recompute) with an equal key goes before the
    # ones that joined (REQUEUE_FRONT), by arrival first: rid 4 arrived at 0.5.
    s4 = Seq(4, 0.5, 100, 10, priority=0)
    q.requeue(s4)
    assert [s.rid for s in q.candidates(0.0)] == [4, 1, 3, 2, 0]


def test_an_slo_deadline_key_reads_each_class_target():
    pol = _policy("t_edf", key=lambda r: r.ttft_deadline)
    pol.classes = {0: ClassInfo("P0", slo_ttft_s=0.5), 1: ClassInfo("P1", slo_ttft_s=2.0)}
    q, _ = _queue(pol, TINY)
    # Deadlines: rid 0 (P1) 0 + 2 = 2.0; rid 1 (P0) 1 + 0.5 = 1.5; rid 2 (P1) 4.0; rid 3 5.0.
    assert [s.rid for s in q.candidates(0.0)] == [1, 0, 2, 3]


def test_a_time_dependent_key_is_recomputed_at_each_decision():
    # Prompt over (1 + seconds waited): rid 0 (400 tokens, enqueued at 0) and rid 1
    # (300 tokens, at 1). At now = 1: 400 / 2 = 200 < 300 / 1; at now = 5:
    # 400 / 6 = 66.7 > 300 / 5 = 60.
    pol = _policy("t_hrrn", key=lambda r: r.prompt_tokens / (1.0 + r.waited), timed=True)
    q, _ = _queue(pol, [(0, 0.0, 400, 0), (1, 1.0, 300, 0)])
    assert [s.rid for s in q.candidates(1.0)] == [0, 1]
    assert [s.rid for s in q.candidates(5.0)] == [1, 0]


def test_a_key_that_reads_the_time_must_say_so():
    from simulator.errors import LatsimError
    pol = _policy("t_bad_wait", key=lambda r: r.waited)
    with pytest.raises(LatsimError, match="time_dependent = True"):
        _queue(pol, TINY)
    pol = _policy("t_none_key", key=lambda r: None)
    with pytest.raises(LatsimError, match="its order key failed on request 0"):
        _queue(pol, TINY)


def test_a_plugin_key_runs_in_the_simulation_and_the_compiled_loop_declines_it():
    from conftest import make_scenario_dict
    from simulator.config.scenario import validate_scenario
    from simulator.loops.compiled.queue import policy_ids
    from simulator.loops.simulate import simulate
    from simulator.workload import Workload
    import numpy as np
    _policy("t_lifo_sim", key=lambda r: -r.enqueued)
    d = make_scenario_dict(engine={"policy": "t_lifo_sim", "max_num_seqs": 1,
                                   "max_num_batched_tokens": 512, "kv": {"num_blocks": 4096}})
    sc = validate_scenario(d)
    # Five requests 1 ms apart; each decodes for tens of steps, so 1-4 wait behind 0 and
    # are admitted newest first.
    wl = Workload(arrival_s=np.arange(5) * 1e-3, prompt_tokens=np.full(5, 16),
                  output_tokens=np.full(5, 20), priority=np.zeros(5, int))
    res = simulate(sc, 0, workload=wl)
    order = list(np.argsort(res.rec.scheduled, kind="stable"))
    assert order == [0, 4, 3, 2, 1]
    assert res.meta.get("loop", "simpy").startswith("simpy")
    from simulator.config.engine import engine_policy
    assert policy_ids(engine_policy(sc.engine)) is None


def test_the_real_engine_admits_by_a_plugin_key():
    pytest.importorskip("torch")
    from real_engine.profile import build_engine
    _policy("t_spf_engine", key=lambda r: r.prompt_tokens)
    eng = build_engine("tiny", "cpu", policy="t_spf_engine", max_num_seqs=1,
                       max_num_batched_tokens=512, num_blocks=256)
    for rid, prompt in enumerate([40, 10, 30, 20]):
        eng.add_request(rid, prompt, 2, now=float(rid))
    admitted = []
    while eng.has_work and len(admitted) < 4:
        admitted += list(eng.step().admitted)
    # Prompts 40, 10, 30, 20: shortest first, one at a time (max_num_seqs = 1).
    assert admitted == [1, 3, 2, 0]


def test_a_plugin_keys_run_does_not_depend_on_the_replicas_bookkeeping():
    """Decode epochs (steps with nothing to decide, priced at once) are exact only if no
    arrival can be admitted mid-epoch; with a key of a policy's own a new short request
    can go before a head that does not fit, so such a policy runs them only while nobody
    waits: the run is the same per request ("slow") and in the fast bookkeeping."""
    from conftest import make_scenario_dict
    from simulator.config.scenario import validate_scenario
    from simulator.loops.simulate import simulate
    from simulator.workload import Workload
    import numpy as np
    _policy("t_spf_epochs", key=lambda r: r.prompt_tokens)
    d = make_scenario_dict(engine={"policy": "t_spf_epochs", "max_num_seqs": 32,
                                   "max_num_batched_tokens": 512, "kv": {"num_blocks": 64}})
    sc = validate_scenario(d)
    rng = np.random.default_rng(5)
    n = 120
    wl = Workload(arrival_s=np.cumsum(rng.exponential(0.02, n)),
                  prompt_tokens=rng.integers(16, 400, n), output_tokens=rng.integers(20, 80, n),
                  priority=np.zeros(n, int))
    fast = simulate(sc, 0, workload=wl, loop="simpy").rec
    slow = simulate(sc, 0, workload=wl, loop="simpy", mode="slow").rec
    for col in ("scheduled", "first_token", "last_token"):
        assert np.array_equal(getattr(fast, col), getattr(slow, col)), col
