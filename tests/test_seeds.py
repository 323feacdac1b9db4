"""The run's random streams come from one layout (``simulator.seeds``), which every
caller that needs one of them takes instead of re-deriving it."""
import numpy as np

from simulator.seeds import STREAMS, run_streams, stream


def test_each_stream_is_the_seeds_child_at_its_index_and_one_stream_alone_is_the_same():
    # SeedSequence(seed).spawn(n)[i] (spawn key (i,)): the layout runs were drawn from
    # before this module, so every recorded run's numbers stay bit-for-bit.
    for seed in (0, 7, 2**40 + 3):
        kids = np.random.SeedSequence(seed).spawn(len(STREAMS))
        streams = run_streams(seed)
        for name, kid in zip(STREAMS, kids):
            want = np.random.default_rng(kid).integers(2**63, size=4)
            assert (getattr(streams, name).integers(2**63, size=4) == want).all(), name
            assert (stream(seed, name).integers(2**63, size=4) == want).all(), name
    # Streams differ from one another (a concern never shares another's draws).
    draws = {tuple(g.integers(2**63, size=2)) for g in run_streams(3)}
    assert len(draws) == len(STREAMS)


def test_latsim_runs_traffic_is_the_traffic_simulate_draws():
    # ``latsim run`` builds the workload once (every policy on the same traffic) from
    # ``stream(seed, "workload")``; simulate, given no workload, draws its own from its
    # streams: both must be the same requests.
    from conftest import make_scenario
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table
    from simulator.workload import build_workload
    sc = make_scenario()
    wl = build_workload(sc.workload, stream(5, "workload"), None)
    a = simulate(sc, 5, loop="simpy")
    b = simulate(sc, 5, workload=wl, loop="simpy")
    assert np.array_equal(a.workload.arrival_s, wl.arrival_s)
    assert np.array_equal(a.workload.prompt_tokens, wl.prompt_tokens)
    assert requests_table(a).equals(requests_table(b))
