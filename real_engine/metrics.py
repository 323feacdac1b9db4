"""``GET /metrics`` of ``latsim serve``: Prometheus text format, with vLLM's metric names
where vLLM has the metric (so a dashboard or a scraper made for vLLM reads this server).

vLLM's (V1 names, each labelled ``model_name``): ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` (gauges), ``vllm:kv_cache_usage_perc`` (used KV blocks,
0-1), ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}`` (``length``: served whole; ``abort``:
cancelled, by a disconnect or the request timeout), ``vllm:num_preemptions_total``,
the histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds`` and ``vllm:request_queue_time_seconds`` (server
wall clock: from the body read to the end of the step that made the token, as the
``latsim-timing`` trailer), and ``vllm:cache_config_info`` (block size, blocks).

latsim's own, ``latsim:``: the engine's settings as labels of ``latsim:engine_info``
(what ``latsim validate --endpoint`` simulates the server with: ``engine_settings``),
KV blocks total and free, paused requests, failed and timed-out requests, engine
steps, and the backpressure accounting (buffered frames now and at their peaks, pauses,
resumes, paused seconds, the worst resume lag, degraded streams, frames written and
their bytes).

Each server has its own ``CollectorRegistry`` (never the process-global one): two
servers in one process (tests, ``validate --endpoint local``) count apart. Gauges and
counters are read when scraped, from the snapshot the engine thread publishes after
every step and from the event loop's counters; only the histograms are observed as
tokens are handed over (``observe_*``, engine thread). ``parse`` reads the text back
(``prometheus_client.parser``).
"""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's bucket bounds (s), with finer ones below for a small model's millisecond steps.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# The settings a client needs to simulate the server, in ``latsim:engine_info``'s labels.
SETTINGS = ("model", "device", "policy", "max_num_seqs", "max_num_batched_tokens",
            "chunk_size", "aging_s", "num_blocks", "block_size", "backpressure",
            "stream_buffer_frames")
_INTS = {"max_num_seqs", "max_num_batched_tokens", "chunk_size", "num_blocks", "block_size",
         "stream_buffer_frames"}


class ServerMetrics:
    """The metrics of one server: its registry, its histograms, and a collector that
    reads the engine loop's counters at scrape time."""

    def __init__(self, loop_, settings: dict, model_name: str) -> None:
        self.loop_, self.settings, self.model_name = loop_, settings, model_name
        self.registry = CollectorRegistry(auto_describe=True)
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, lab, registry=self.registry,
                             buckets=buckets).labels(model_name=model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.registry.register(_Collector(self))

    # -- engine thread: one request's token handed over --------------------------------
    def observe_first(self, timing: dict) -> None:
        self.ttft.observe(max(0.0, timing["first_token"] - timing["received"]))
        if "scheduled" in timing and "enqueued" in timing:
            self.queue.observe(max(0.0, timing["scheduled"] - timing["enqueued"]))

    def observe_gap(self, seconds: float) -> None:
        self.itl.observe(max(0.0, seconds))

    def observe_done(self, timing: dict) -> None:
        self.e2e.observe(max(0.0, timing["last_token"] - timing["received"]))

    # -- the event loop -------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Collector:
    """Gauges and counters read at scrape time (module docstring)."""

    def __init__(self, m: ServerMetrics) -> None:
        self.m = m

    def collect(self):
        m, el = self.m, self.m.loop_
        snap, name = el.snapshot, [m.model_name]

        def fam(kind, metric: str, doc: str, value: float, **labels):
            f = kind(metric, doc, labels=["model_name", *labels])
            f.add_metric(name + [str(v) for v in labels.values()], value)
            return f

        def gauge(metric, doc, value, **labels):
            return fam(GaugeMetricFamily, metric, doc, value, **labels)

        def counter(metric, doc, value):
            return fam(CounterMetricFamily, metric, doc, value)

        total, free = snap["kv_blocks_total"], snap["kv_blocks_free"]
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches (paused ones included: they hold their KV).", snap["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                    "processed.", snap["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    (total - free) / total if total else 0.0)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      snap["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      snap["generation_tokens"])
        ok = CounterMetricFamily("vllm:request_success", "Count of finished requests, by "
                                 "finished reason (abort: cancelled).",
                                 labels=["model_name", "finished_reason"])
        ok.add_metric(name + ["length"], snap["requests_served"])
        ok.add_metric(name + ["abort"], snap["requests_cancelled"])
        yield ok
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                      snap["preemptions"])
        s = m.settings
        yield gauge("vllm:cache_config_info", "Information of the KV cache config.", 1,
                    block_size=s["block_size"], num_gpu_blocks=s["num_blocks"])
        yield gauge("latsim:engine_info", "The engine's settings (labels).", 1,
                    **{k: "" if s.get(k) is None else s[k] for k in SETTINGS})
        yield gauge("latsim:kv_blocks_total", "KV blocks in the cache.", total)
        yield gauge("latsim:kv_blocks_free", "KV blocks free.", free)
        yield gauge("latsim:num_requests_paused", "Requests paused by backpressure "
                    "(block), KV kept.", snap["paused"])
        yield gauge("latsim:active_streams", "Open requests the event loop serves.",
                    len(el.streams))
        yield counter("latsim:requests_failed", "Requests the engine failed on (500), "
                      "each alone.", snap["requests_failed"])
        yield counter("latsim:requests_timed_out", "Requests cut by the request timeout.",
                      el.timed_out)
        yield counter("latsim:engine_steps", "Engine steps run.", snap["engine_steps"])
        yield gauge("latsim:stream_buffered_frames", "Frames made but not yet written, "
                    "all streams.", snap["buffered_frames"])
        yield gauge("latsim:stream_buffered_frames_peak", "Most frames buffered at once, "
                    "all streams together.", snap["buffered_frames_peak"])
        yield gauge("latsim:stream_buffered_frames_stream_peak", "Most frames one stream "
                    "had buffered.", snap["stream_buffered_frames_peak"])
        mean = el.frame_bytes / el.frames if el.frames else 0.0
        yield gauge("latsim:stream_buffered_bytes_peak_estimate", "Peak buffered frames "
                    "times the mean frame size (bytes).", snap["buffered_frames_peak"] * mean)
        yield counter("latsim:backpressure_pauses", "Requests paused (block).", snap["pauses"])
        yield counter("latsim:backpressure_resumes", "Paused requests resumed.",
                      snap["resumes"])
        yield counter("latsim:backpressure_paused_seconds", "Seconds requests spent "
                      "paused.", snap["paused_s_total"])
        yield gauge("latsim:backpressure_resume_lag_seconds_max", "Worst delay from a "
                    "drained buffer to the request's resume.", snap["resume_lag_ms_max"] / 1e3)
        yield counter("latsim:streams_degraded", "Streams sent the rest as one frame "
                      "(degrade).", el.degraded)
        yield counter("latsim:frames_written", "Content frames written.", el.frames)
        yield counter("latsim:frame_bytes", "Bytes of the content frames written.",
                      el.frame_bytes)


def parse(text: str) -> dict[str, Any]:
    """The samples of a ``/metrics`` text by name (``prometheus_client.parser``), without
    the ``model_name`` label; a sample with other labels is keyed ``name{k="v",...}``,
    and an ``*_info`` sample's value is its labels. Raises ``ValueError`` on text that
    is not the format."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, Any] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            if s.name.endswith("_info"):
                out[s.name] = labels
            elif labels:
                key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                out[f"{s.name}{{{key}}}"] = s.value
            else:
                out[s.name] = s.value
    return out


def engine_settings(metrics: dict) -> Optional[dict]:
    """The engine's settings from ``parse``'d metrics (``latsim:engine_info``), typed
    back (None where unset); None if the metrics have none (not a latsim server)."""
    info = metrics.get("latsim:engine_info")
    if not isinstance(info, dict) or "policy" not in info:
        return None
    out: dict[str, Any] = {}
    for k in SETTINGS:
        v = info.get(k, "")
        if v == "":
            out[k] = None
        elif k in _INTS:
            out[k] = int(v)
        elif k == "aging_s":
            out[k] = float(v)
        else:
            out[k] = v
    return out


def mean_frame_bytes(metrics: dict) -> float:
    """Mean bytes of a content frame written so far (0 before any)."""
    n = metrics.get("latsim:frames_written_total", 0.0)
    return metrics.get("latsim:frame_bytes_total", 0.0) / n if n else 0.0
