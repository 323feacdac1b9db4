"""Recorded runs that hold aggregates, not a timeline: an inference-perf output folder
and a ``vllm bench serve --save-result`` JSON (``read_summary_run``), and the same
aggregates taken from a simulation (``sim_aggregates``), so that ``latsim validate
--run`` and ``benchmarks/vllm_runs.py`` compare like with like.

**inference-perf** (kubernetes-sigs/inference-perf at 3b6f82a, ``reportgen/base.py``
and ``apis/completion.py``): ``summary_lifecycle_metrics.json`` and
``stage_N_lifecycle_metrics.json`` hold, in seconds, mean / median / p90 / p99 (and
more) of ``time_to_first_token``, ``request_latency``, ``time_per_output_token`` and
``inter_token_latency`` over successful requests, plus ``load_summary``
(``requested_rate``, ``achieved_rate``: the send rate) and ``failures.count``; when
``per_request_lifecycle_metrics.json`` is there too (``start_time``, ``end_time``,
``info.output_token_times``, ``error`` per request), the overall aggregates are
recomputed from it by the same definitions. Its
token clock is odd: the client stamps *every line* of the SSE stream, the blank line
after each ``data:`` event and the ``[DONE]`` event included, so an ``N``-token
response has ``2N + 2`` stamps and ``2N + 1`` gaps, half of them microseconds long.
Its TPOT is ``(last - first) / (2N + 1)`` and its ITL pools those gaps: both about
half the server's time per token. The simulated side is put in the same terms
(``sim_aggregates``): TPOT per request as above, the mean ITL as the pooled sum of
``last - first`` over the pooled ``2N + 1``. ITL percentiles are not compared (they
mix blank-line gaps with token gaps). Compared: mean, median, P90, P99 of TTFT, E2E
(``request_latency``) and TPOT, and the mean ITL.

**vllm bench serve** (vllm-project/vllm ``vllm/benchmarks/serve.py``): ``mean_`` /
``median_`` / ``std_`` / ``p<q>_`` of ``ttft``, ``tpot``, ``itl``, ``e2el`` in ms
(``--metric-percentiles``, 99 by default), ``request_rate``, ``burstiness``,
``completed``, ``failed`` and, per request, ``input_lens``, ``output_lens``, ``ttfts``
(s), ``itls`` (lists of s) and ``errors``. Its TPOT is ``(e2el - ttft) / (N - 1)``
and its ITL every gap between content chunks (one token each from vLLM). When the
per-request lists are there the aggregates are recomputed from them (mean, median,
P90, P99); otherwise the stored ones are taken.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from simulator.errors import LatsimError, read_json
from simulator.report.percentile import pct_ms

STATS = ("mean", "median", "p90", "p99")
METRICS = ("ttft", "e2el", "tpot", "itl")
MAX_JSON_BYTES = 256 << 20
#: A server is past saturation when its mean TTFT exceeds this many mean TPOTs: a
#: healthy request waits a prefill and a few steps before its first token (3-11 TPOTs on
#: the recorded runs that kept up, on either clock), a growing queue holds it for
#: others' whole decodes (about 5,700 TPOTs on the recorded reasoning runs).
SATURATED_TTFT_TPOTS = 100.0
_IP_NAMES = {"ttft": "time_to_first_token", "e2el": "request_latency",
             "tpot": "time_per_output_token", "itl": "inter_token_latency"}


@dataclass
class SummaryRun:
    """A recorded run of aggregates. ``stages``: one dict per load stage (inference-perf)
    or one for the whole run: ``{"<stat>_<metric>_ms": value}`` for what it holds, plus
    ``count``, ``failures``, ``requested_rate``, ``achieved_rate`` where known.
    ``overall``: the whole run's. ``clock``: ``inference_perf`` or ``vllm_bench``
    (what TPOT and ITL mean, module doc). ``config``: the inference-perf config file
    that describes its traffic (None: the user's scenario must)."""

    path: Path
    kind: str
    overall: dict
    stages: list = field(default_factory=list)
    clock: str = "vllm_bench"
    config: Optional[Path] = None
    notes: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name if self.path.is_dir() else self.path.stem

    @property
    def what(self) -> str:
        """The recorder, in words."""
        return {"inference_perf": "inference-perf", "vllm_bench": "vllm bench serve"}[self.kind]


def is_summary_run(path: str | Path) -> bool:
    """Whether ``path`` is an inference-perf folder (or its ``results/``) or a JSON file."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".json"
    return _ip_results(p) is not None


def _ip_results(folder: Path) -> Optional[Path]:
    for d in (folder, folder / "results"):
        if (d / "summary_lifecycle_metrics.json").is_file():
            return d
    return None


def _load_json(path: Path) -> dict:
    return read_json(path, max_bytes=MAX_JSON_BYTES, field="--run")


def _num(path: Path, where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise LatsimError("must be a number of at least 0", source=str(path), field=where,
                          value=v, has_value=True)
    return float(v)


def _ip_stage(path: Path) -> dict:
    """One inference-perf lifecycle file as ``{"<stat>_<metric>_ms": ...}`` and counts."""
    data = _load_json(path)
    succ = data.get("successes")
    if not isinstance(succ, dict) or not isinstance(succ.get("latency"), dict):
        raise LatsimError("no successes.latency: not an inference-perf lifecycle metrics "
                          "file", source=str(path), field="successes.latency")
    lat = succ["latency"]
    out: dict = {"count": int(_num(path, "successes.count", succ.get("count", 0)))}
    for m, ip in _IP_NAMES.items():
        block = lat.get(ip)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise LatsimError("must be a mapping of statistics", source=str(path),
                              field=f"successes.latency.{ip}", value=block, has_value=True)
        for st in STATS:
            if st in block and block[st] is not None:
                out[f"{st}_{m}_ms"] = 1000.0 * _num(path, f"successes.latency.{ip}.{st}",
                                                    block[st])
    if out["count"] and "mean_ttft_ms" not in out:
        raise LatsimError("no time_to_first_token: the run was not streamed",
                          source=str(path), field="successes.latency.time_to_first_token")
    fail = data.get("failures") or {}
    out["failures"] = int(_num(path, "failures.count", fail.get("count", 0) or 0))
    load = data.get("load_summary") or {}
    for k in ("requested_rate", "achieved_rate"):
        if load.get(k) is not None:
            out[k] = _num(path, f"load_summary.{k}", load[k])
    plen = succ.get("prompt_len") or {}
    if isinstance(plen, dict) and plen.get("mean") is not None:
        out["prompt_len_mean"] = _num(path, "successes.prompt_len.mean", plen["mean"])
    return out


def _ip_per_request(path: Path) -> dict:
    """inference-perf's per-request records (``start_time``, ``end_time``, ``info:
    {output_token_times, ...}``, ``error``): the successful streamed ones' aggregates,
    by the definitions of its summary (module doc)."""
    rows = read_json(path, max_bytes=MAX_JSON_BYTES, field="--run", mapping=False)
    if not isinstance(rows, list):
        raise LatsimError("not a list of request records", source=str(path))
    ttft, e2e, tpot, span, gaps = [], [], [], 0.0, 0
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or r.get("error") is not None:
            continue
        info = r.get("info") or {}
        times = info.get("output_token_times") if isinstance(info, dict) else None
        if times is None:
            times = []
        elif not isinstance(times, list):
            raise LatsimError("must be a list of time stamps", source=str(path),
                              field=f"[{i}].info.output_token_times", value=times,
                              has_value=True)
        start = _num(path, f"[{i}].start_time", r.get("start_time"))
        t = [_num(path, f"[{i}].info.output_token_times", x) for x in times]
        e2e.append(_num(path, f"[{i}].end_time", r.get("end_time")) - start)
        if len(t) > 1:
            ttft.append(t[0] - start)
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            span += t[-1] - t[0]
            gaps += len(t) - 1
    if not e2e:
        raise LatsimError("no successful request", source=str(path))
    out: dict = {"count": len(e2e), "failures": len(rows) - len(e2e)}
    for m, v in (("ttft", ttft), ("e2el", e2e), ("tpot", tpot)):
        if v:
            out[f"mean_{m}_ms"] = float(np.mean(v)) * 1000.0
            for st, q in (("median", 50), ("p90", 90), ("p99", 99)):
                out[f"{st}_{m}_ms"] = pct_ms(v, q)
    if gaps:
        out["mean_itl_ms"] = span / gaps * 1000.0
    return out


def _read_ip(folder: Path) -> SummaryRun:
    res = _ip_results(folder)
    overall = _ip_stage(res / "summary_lifecycle_metrics.json")
    stages = []
    k = 0
    while (res / f"stage_{k}_lifecycle_metrics.json").is_file():
        stages.append(_ip_stage(res / f"stage_{k}_lifecycle_metrics.json"))
        k += 1
    cfg = next((p for p in (res / "config.yaml", folder / "config.yaml", folder / "profile.yaml")
                if p.is_file()), None)
    notes = [] if stages else ["no stage_N files: the summary only"]
    per = res / "per_request_lifecycle_metrics.json"
    if per.is_file():
        overall = {**overall, **_ip_per_request(per)}
        notes.append("overall aggregates recomputed from per_request_lifecycle_metrics.json")
    if overall.get("failures"):
        notes.append(f"{overall['failures']} requests failed (timed out): the latencies are "
                     "of the successful ones")
    return SummaryRun(path=folder, kind="inference_perf", overall=overall, stages=stages,
                      clock="inference_perf", config=cfg, notes=notes)


def _read_vllm_json(path: Path) -> SummaryRun:
    data = _load_json(path)
    if not any(k.endswith("_ttft_ms") for k in data) and "ttfts" not in data:
        raise LatsimError("not a `vllm bench serve --save-result` JSON (no *_ttft_ms, no "
                          "ttfts)", source=str(path))
    out: dict = {}
    ttfts, itls = data.get("ttfts"), data.get("itls")
    if isinstance(ttfts, list) and isinstance(itls, list) and len(ttfts) == len(itls) and ttfts:
        errs = data.get("errors") or [""] * len(ttfts)
        if not (isinstance(errs, list) and len(errs) == len(ttfts)):
            raise LatsimError(f"must be a list of one error string per request "
                              f"({len(ttfts)}, as ttfts)", source=str(path), field="errors",
                              value=errs, has_value=True)
        ok = [i for i in range(len(ttfts)) if not errs[i] and isinstance(ttfts[i], (int, float))
              and ttfts[i] > 0 and isinstance(itls[i], list)]
        if not ok:
            raise LatsimError("no successful request in ttfts", source=str(path), field="ttfts")
        tt = np.array([_num(path, f"ttfts[{i}]", ttfts[i]) for i in ok])
        gaps = [np.array([_num(path, f"itls[{i}]", g) for g in itls[i]], float) for i in ok]
        e2e = tt + np.array([g.sum() for g in gaps])
        tp = np.array([g.sum() / len(g) for g in gaps if len(g)])
        pooled = np.concatenate(gaps) if gaps else np.zeros(0)
        for m, v in (("ttft", tt), ("e2el", e2e), ("tpot", tp), ("itl", pooled)):
            if len(v):
                out[f"mean_{m}_ms"] = float(v.mean()) * 1000.0
                for st, q in (("median", 50), ("p90", 90), ("p99", 99)):
                    out[f"{st}_{m}_ms"] = pct_ms(v, q)
        out["count"] = len(ok)
        out["failures"] = len(ttfts) - len(ok)
    else:
        for m in METRICS:
            for st in STATS:
                k = f"{st}_{m}_ms"
                if data.get(k) is not None:
                    out[k] = _num(path, k, data[k])
        out["count"] = int(_num(path, "completed", data.get("completed", 0) or 0))
        out["failures"] = int(_num(path, "failed", data.get("failed", 0) or 0))
    rate = data.get("request_rate")
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        out["requested_rate"] = float(rate)
    notes = [] if "ttfts" in data else ["aggregates only (saved without per-request lists)"]
    return SummaryRun(path=path, kind="vllm_bench", overall=out, stages=[], clock="vllm_bench",
                      notes=notes)


def read_summary_run(path: str | Path) -> SummaryRun:
    """An inference-perf folder or a vllm bench JSON (module doc); one-line
    ``LatsimError`` naming the file and field for anything missing or malformed."""
    p = Path(path)
    if p.is_file() and p.suffix == ".json":
        return _read_vllm_json(p)
    if p.is_dir() and _ip_results(p) is not None:
        return _read_ip(p)
    raise LatsimError("not a recorded run of aggregates: needs an inference-perf folder "
                      "(summary_lifecycle_metrics.json) or a vllm bench serve JSON",
                      source=str(p), field="--run")


def saturated(agg: dict) -> bool:
    """Whether aggregates show a server past saturation: failed (timed-out) or unfinished
    requests, a send rate below 95% of the one asked, or a mean TTFT over
    ``SATURATED_TTFT_TPOTS`` mean TPOTs."""
    if agg.get("failures", 0) > 0 or agg.get("unfinished", 0) > 0:
        return True
    a, r = agg.get("achieved_rate"), agg.get("requested_rate")
    if a is not None and r and a < 0.95 * r:
        return True
    t, tp = agg.get("mean_ttft_ms"), agg.get("mean_tpot_ms")
    return bool(t is not None and tp and t > SATURATED_TTFT_TPOTS * tp)


def sim_aggregates(df, clock: str, rows: Optional[np.ndarray] = None) -> dict:
    """The simulated requests (``requests_table`` rows, optionally masked) as the
    recording's client would report them (module doc): TTFT and E2E from the send to
    the first and last delivered token; TPOT and mean ITL by ``clock``'s definition."""
    keep = np.ones(len(df), bool) if rows is None else np.asarray(rows, bool)
    fin = keep & df["finished"].to_numpy(bool)
    arr = df["arrival"].to_numpy(float)[fin]
    first = df["first_delivered"].to_numpy(float)[fin] - arr
    last = df["last_delivered"].to_numpy(float)[fin] - arr
    n = df["output_tokens"].to_numpy(float)[fin]
    out = {"count": int(fin.sum()), "unfinished": int(keep.sum() - fin.sum())}
    if not fin.any():
        return out
    if clock == "inference_perf":
        gaps = 2.0 * n + 1.0
        tpot = (last - first) / gaps
        itl_mean = float((last - first).sum() / gaps.sum())
    else:
        many = n > 1
        tpot = (last - first)[many] / (n[many] - 1)
        itl_mean = float((last - first).sum() / max(float((n - 1).sum()), 1.0))
    for m, v in (("ttft", first), ("e2el", last), ("tpot", tpot)):
        if len(v):
            out[f"mean_{m}_ms"] = float(v.mean()) * 1000.0
            for st, q in (("median", 50), ("p90", 90), ("p99", 99)):
                out[f"{st}_{m}_ms"] = pct_ms(v, q)
    out["mean_itl_ms"] = itl_mean * 1000.0
    return out


def compared_keys(real: dict, clock: str) -> list[str]:
    """The aggregates compared (module doc): those the recording holds, less ITL
    percentiles on inference-perf's clock."""
    keys = []
    for m in METRICS:
        for st in STATS:
            k = f"{st}_{m}_ms"
            if k not in real:
                continue
            if m == "itl" and st != "mean" and clock == "inference_perf":
                continue
            keys.append(k)
    return keys


def compare_aggregates(real: dict, sim: dict, clock: str) -> dict:
    """``{key: {real, sim, rel_err}}`` over ``compared_keys``: (sim - real) / real."""
    out = {}
    for k in compared_keys(real, clock):
        r, s = real.get(k), sim.get(k)
        ok = r is not None and s is not None and r > 0 and math.isfinite(s)
        out[k] = {"real": r, "sim": s, "rel_err": (s - r) / r if ok else None}
    return out


def run_workload(rec: SummaryRun) -> Optional[dict]:
    """An inference-perf run's own traffic as a latsim workload: ``kind:
    inference_perf`` on its config, prompt lengths scaled by the recorded mean
    ``prompt_len`` over the drawn one (re-tokenised random text). None for a run
    without a config (a vllm bench JSON: the scenario describes its traffic)."""
    from simulator.workload.inference_perf import read_config
    if rec.kind != "inference_perf" or rec.config is None:
        return None
    data, _, _ = read_config(rec.config)
    sp = data.shared_prefix
    drawn = sp.system_prompt_len + sp.question_len
    infl = rec.overall.get("prompt_len_mean", drawn) / drawn
    return {"kind": "inference_perf", "config": str(rec.config.resolve()),
            "tokenizer_inflation": round(min(max(float(infl), 0.5), 4.0), 4)}


def with_run_workload(scenario, rec: SummaryRun):
    """``scenario`` with its workload replaced by ``run_workload(rec)``, unless the
    run has none or the scenario's workload is already inference-perf's."""
    from simulator.workload.inference_perf import InferencePerfWorkload
    wl = run_workload(rec)
    if wl is None or getattr(scenario.workload, "kind", None) == "inference_perf":
        return scenario
    return scenario.model_copy(update={"workload": InferencePerfWorkload(**wl)})


def simulate_summary(scenario, rec: SummaryRun, base_dir=None) -> dict:
    """Simulate ``scenario`` (one policy run, its workload as ``with_run_workload``
    leaves it) and compare with the recording, overall and per stage where the
    recording has stages and the workload tags them."""
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table
    res = simulate(scenario, base_dir=base_dir)
    df = requests_table(res)
    out = {"overall": judge(rec.overall, sim_aggregates(df, rec.clock), rec.clock),
           "stages": []}
    stage = res.workload.meta.get("stage")
    if stage is not None and rec.stages:
        stage = np.asarray(stage)
        if int(stage.max()) + 1 == len(rec.stages):
            out["stages"] = [judge(r, sim_aggregates(df, rec.clock, stage == k), rec.clock)
                             for k, r in enumerate(rec.stages)]
        else:
            out["note"] = (f"the recording has {len(rec.stages)} stages, the workload "
                           f"{int(stage.max()) + 1}: compared overall only")
    return out


def judge(real: dict, sim: dict, clock: str) -> dict:
    """Real vs simulated aggregates, their errors and both saturation verdicts."""
    return {"real": real, "sim": sim, "errors": compare_aggregates(real, sim, clock),
            "real_saturated": saturated(real), "sim_saturated": saturated(sim)}
