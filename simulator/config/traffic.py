"""The scenario's traffic-control sections: admission control and rate limits
(``cluster.admission``), the clients' timeouts and retries (``client``), autoscaling
(``cluster.autoscaler``) and what the reports add (``report``: utilisation series,
window, diagnosis thresholds). The models they configure live in
``simulator.cluster.admission``, ``simulator.wire.clients``,
``simulator.cluster.autoscaler`` and ``simulator.report.traffic``.

Every section is off by default (a scenario without them runs as before); the defaults
inside a section are those of the article the client model comes from (5 s connect and
120 s read timeouts; ``data/README.md``, *Facts from two design articles*) and the
common production ones elsewhere (the Kubernetes HPA's 15 s period, 10% tolerance and
300 s scale-down stabilisation; AWS's exponential backoff with full jitter; Finagle's
retry budget of 20% plus a floor).
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from simulator.config.strict import StrictModel



class ClassLimits(StrictModel):
    """Admission limits of one priority class (any left out: no limit of that kind)."""

    rate: Optional[float] = Field(None, gt=0, description="token bucket: requests/s")
    burst: Optional[float] = Field(None, ge=1, description="requests the bucket holds "
                                   "(default: one second of rate, at least 1)")
    tokens_per_s: Optional[float] = Field(None, gt=0, description="token bucket: prompt + "
                                          "output tokens/s")
    token_burst: Optional[float] = Field(None, gt=0, description="tokens the bucket holds "
                                         "(default: one second of tokens_per_s)")
    max_queue: Optional[int] = Field(None, ge=0, description="refuse when the chosen "
                                     "replica already has this many requests waiting")
    max_wait_s: Optional[float] = Field(None, ge=0, description="refuse when the wait "
                                        "estimate published for the request exceeds this")


class WaitEstimateConfig(StrictModel):
    """How the server estimates a request's queue wait (published to the client at
    admission, and used by ``max_wait_s``)."""

    kind: Literal["work", "seed", "little"] = Field(
        "work", description="work: the queued prefill and the running requests' remaining "
        "decode projected on the step costs (cluster.waitest; within 20% of the median "
        "wait on the shipped scenarios); seed: sum of waiting prompts / chunk size x mean "
        "step time (estimate_wait_time, data/README.md: it ignores the running decodes); "
        "little: waiting requests / recent admission rate")
    p99_factor: float = Field(2.5, ge=1, description="published P99 = factor x estimate "
                              "(the article's 2.5)")
    window_s: float = Field(30.0, gt=0, description="little: admissions counted over this")


class AdmissionConfig(StrictModel):
    """Admission control in front of the replicas: per-class token buckets, queue and
    wait limits, and what happens beyond them."""

    classes: dict[str, ClassLimits] = Field(default_factory=dict, description="limits per "
                                            "class name; 'default' for classes not listed")
    action: Literal["reject", "shed"] = Field(
        "reject", description="past a queue or wait limit: reject the newcomer (429), or "
        "shed the lowest-class waiting request below it (503) to make room")
    retry_after_s: Optional[float] = Field(None, ge=0, description="Retry-After sent with "
                                           "a queue/wait refusal (default: the wait estimate); "
                                           "a rate-limit refusal says when its bucket refills")
    wait_estimate: WaitEstimateConfig = Field(default_factory=WaitEstimateConfig)

    def limits(self, name: str) -> Optional[ClassLimits]:
        """The limits of class ``name`` (its own, else ``default``, else None)."""
        return self.classes.get(name, self.classes.get("default"))


class BackoffConfig(StrictModel):
    """Exponential backoff between attempts: ``min(max_s, initial_s x multiplier^(k-1))``
    before retry k, with jitter (AWS Architecture Blog, "Exponential Backoff And
    Jitter": full = uniform(0, d), equal = d/2 + uniform(0, d/2))."""

    initial_s: float = Field(1.0, ge=0)
    multiplier: float = Field(2.0, ge=1)
    max_s: float = Field(30.0, ge=0)
    jitter: Literal["full", "equal", "none"] = "full"


class RetryBudgetConfig(StrictModel):
    """A retry budget shared by all clients (Finagle's RetryBudget): a retry is allowed
    while the retries decided in the last ``window_s`` (counted when the failure is
    known, before the backoff) stay within ``ratio`` x the first attempts sent in it
    plus ``min_per_s`` x ``window_s``."""

    ratio: float = Field(0.2, ge=0)
    min_per_s: float = Field(1.0, ge=0)
    window_s: float = Field(10.0, gt=0)


class RetryConfig(StrictModel):
    """Which failures a client retries, how often and how soon."""

    max_retries: int = Field(3, ge=0, le=20, description="retries after the first attempt")
    retry_on: list[Literal["429", "503", "timeout"]] = Field(
        default_factory=lambda: ["429", "503", "timeout"],
        description="429: rate or queue limit; 503: shed; timeout: connect or read timeout")
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    honour_retry_after: bool = Field(True, description="wait at least the server's "
                                     "Retry-After")
    budget: Optional[RetryBudgetConfig] = Field(default_factory=RetryBudgetConfig,
                                                description="null: unbounded retries")


class ClientConfig(StrictModel):
    """How clients wait: timeouts (httpx semantics: connect = setting up a connection;
    read = the longest wait for the next byte, here the response's first byte) and
    retries. ``deadline_s``: a client gives up on a request this long after first
    sending it, whatever attempt is in flight (None: never)."""

    connect_timeout_s: Optional[float] = Field(5.0, gt=0, description="give up on an attempt "
                                               "whose connection takes longer (null: never)")
    read_timeout_s: Optional[float] = Field(120.0, gt=0, description="give up when no byte "
                                            "of the response came this long after sending")
    deadline_s: Optional[float] = Field(None, gt=0, description="give up on the request this "
                                        "long after its first attempt")
    retry: Optional[RetryConfig] = Field(default_factory=RetryConfig,
                                         description="null: never retry")
    wait_patience_s: Optional[float] = Field(None, gt=0, description="act on the wait "
                                             "estimate the gateway publishes when it is past "
                                             "this (on_long_wait; null: ignore it)")
    on_long_wait: Literal["give_up", "elsewhere", "later"] = Field(
        "give_up", description="past wait_patience_s: give_up (leave: timed_out, attempt "
        "balked), elsewhere (the ready replica with the least estimate, if within "
        "patience, else give up), later (come back after come_back_s)")
    come_back_s: Optional[float] = Field(None, gt=0, description="later: come back after "
                                         "this (default: the estimate the client was told)")
    max_come_backs: int = Field(3, ge=0, le=100, description="later: at most this many")

    @property
    def max_attempts(self) -> int:
        later = self.wait_patience_s is not None and self.on_long_wait == "later"
        return (1 + (self.retry.max_retries if self.retry is not None else 0)
                + (self.max_come_backs if later else 0))


class AutoscalerConfig(StrictModel):
    """A replica autoscaler (the Kubernetes HPA rule): every ``interval_s`` the metric,
    averaged over ``window_s``, sets ``desired = ceil(ready x metric / target)`` within
    ``[min_replicas, max_replicas]`` (no change within ``tolerance`` of the target). A
    new replica serves ``model_load_s + warmup_s`` after the decision; scale-down waits
    ``scale_down_cooldown_s`` after any scaling and drains the replica (no new requests,
    the ones it holds finish) before removing it."""

    min_replicas: int = Field(1, ge=1, le=10_000)
    max_replicas: int = Field(..., ge=1, le=10_000)
    metric: Literal["queue", "kv", "p99_ttft"] = Field(
        "queue", description="queue: waiting requests per ready replica; kv: mean KV blocks "
        "reserved / capacity; p99_ttft: P99 TTFT (ms) of first tokens in the window, with "
        "the ages of requests still waiting")
    target: float = Field(..., gt=0, description="the metric's value per replica to hold")
    window_s: float = Field(60.0, gt=0, description="the metric is averaged over this")
    interval_s: float = Field(15.0, gt=0, description="time between decisions")
    sample_s: float = Field(1.0, gt=0, description="how often the metric is sampled")
    tolerance: float = Field(0.1, ge=0, lt=1, description="no change while metric / target "
                             "is within 1 +- this")
    model_load_s: float = Field(60.0, ge=0, description="weights loaded onto a new replica")
    warmup_s: float = Field(30.0, ge=0, description="warm-up (graph capture, first steps)")
    scale_down_cooldown_s: float = Field(300.0, ge=0, description="no scale-down sooner "
                                         "than this after any scaling")
    pool: Optional[str] = Field(None, description="with cluster.pools: the pool it scales "
                                "(default: the first); min/max_replicas count that pool's "
                                "replicas, the metric is the whole fleet's")

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas "
                             f"({self.min_replicas})")
        return self

    @property
    def scale_up_delay_s(self) -> float:
        return self.model_load_s + self.warmup_s


class DiagnosisConfig(StrictModel):
    """Thresholds of the bottleneck verdicts (``metrics.diagnose``)."""

    queue_ms: float = Field(100.0, ge=0, description="queue_saturation: mean T_queue above")
    ttft_ms: float = Field(500.0, ge=0, description="prefill_bottleneck: median TTFT above")
    jitter: float = Field(2.0, ge=1, description="decode_jitter: P99/P50 TPOT above")
    reject_frac: float = Field(0.05, ge=0, le=1, description="admission_limited: share of "
                               "requests refused above")
    retry_frac: float = Field(0.2, ge=0, description="retry_storm: retries after a timeout "
                              "per request above")
    preempt_frac: float = Field(0.1, ge=0, le=1, description="kv_pressure: share of "
                                "requests preempted at least once above")
    network_frac: float = Field(0.3, ge=0, le=1, description="network_bound: mean T_net "
                                "(retries excluded) / mean E2E above")
    stream_frac: float = Field(0.3, ge=0, le=1, description="stream_bound: mean T_stream / "
                               "mean E2E above")


class ReportConfig(StrictModel):
    """What a run records beyond latencies."""

    utilization: bool = Field(False, description="per-replica busy fraction, tokens/s and "
                              "MFU over time in timeseries.csv (the SimPy loop records them)")
    window_s: float = Field(60.0, gt=0, description="window of the utilisation columns and "
                            "of the cluster rows (offered/accepted load, replicas, SLO "
                            "attainment) in timeseries.csv")
    diagnosis: DiagnosisConfig = Field(default_factory=DiagnosisConfig)


def router_spec(data):
    """``router: {kind: name, param: value}`` -> ``router: name`` plus ``router_params``
    (flat enough for ``--set`` and sweep axes, as ``engine.policy`` is)."""
    if isinstance(data, dict) and isinstance(data.get("router"), dict):
        data = dict(data)
        spec = dict(data["router"])
        kind = spec.pop("kind", None)
        if not isinstance(kind, str):
            raise ValueError("router: a mapping needs a 'kind' naming the router")
        data["router"] = kind
        data["router_params"] = {**(data.get("router_params") or {}), **spec}
    return data


def check_router_params(router: str, params: dict) -> None:
    """The named router takes these parameters (its registered config)."""
    from pydantic import ValidationError

    from simulator.config.registry import ROUTERS
    try:
        ROUTERS.config_class(router).model_validate({"kind": router, **params})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown parameter" if err["type"] == "extra_forbidden" else \
            err["msg"].removeprefix("Value error, ")
        raise ValueError(f"router {router!r}, parameter {key!r}: {msg}") from None


def check_traffic(sc) -> None:
    """Cross-section rules of the traffic sections (``ValueError`` naming the field)."""
    cl = sc.cluster
    auto = cl.autoscaler
    pools = getattr(cl, "pools", None)
    if auto is not None and pools is not None:
        names = [p.name for p in pools]
        if auto.pool is not None and auto.pool not in names:
            raise ValueError(f"cluster.autoscaler.pool {auto.pool!r} is not a pool of "
                             f"cluster.pools ({', '.join(names)})")
        scaled = next(p for p in pools if p.name == (auto.pool or names[0]))
        if not auto.min_replicas <= scaled.replicas <= auto.max_replicas:
            raise ValueError(f"pool {scaled.name!r} replicas ({scaled.replicas}) must be within "
                             f"the autoscaler's min_replicas..max_replicas "
                             f"({auto.min_replicas}..{auto.max_replicas})")
    elif auto is not None and auto.pool is not None:
        raise ValueError("cluster.autoscaler.pool names a pool, but cluster.pools is not given")
    elif auto is not None and not auto.min_replicas <= cl.replicas <= auto.max_replicas:
        raise ValueError(f"cluster.replicas ({cl.replicas}) must be within the autoscaler's "
                         f"min_replicas..max_replicas ({auto.min_replicas}..{auto.max_replicas})")
    if sc.client is not None and getattr(cl, "disaggregated", False):
        # A client that gives up cancels its request where it is; a disaggregated request
        # is in flight between two replicas for part of its life (not modelled).
        raise ValueError("client: timeouts and retries are not modelled on a disaggregated "
                         "cluster (pools with prefill/decode roles); leave client out")
    on = [k for k, v in (("cluster.admission", cl.admission), ("client", sc.client),
                         ("cluster.autoscaler", auto), ("cluster.pools", pools),
                         ("cluster.faults", getattr(cl, "faults", None)),
                         ("cluster.breaker", getattr(cl, "breaker", None)),
                         ("cluster.degrade", getattr(cl, "degrade", None)),
                         ("report.utilization", sc.report.utilization or None))
          if v is not None]
    if on and (sc.stream.rich or sc.network.rich):
        raise ValueError(f"{on[0]} cannot be combined with the per-request stream and network "
                         "model (stream coalescing, heartbeats, buffers, disconnects, "
                         "connection drops, per-client downlinks, http2, regions): leave one "
                         "of them out")
    if cl.admission is not None:
        names = {c.name for c in getattr(sc.workload, "classes", None) or []}
        unknown = sorted(set(cl.admission.classes) - names - {"default"})
        if names and unknown:
            raise ValueError(f"cluster.admission.classes names {unknown[0]!r}, not a class of "
                             f"the workload ({', '.join(sorted(names))}) nor 'default'")
    if getattr(sc.workload, "kind", None) == "sessions":
        # Closed-loop sessions run on the plain SimPy driver (``loops.simpy.sessions``):
        # the gateway's clients, the edge and the per-request wire model send on their own
        # clocks.
        other = on + (["edge"] if getattr(sc, "edge", None) is not None else []) + (
            ["the per-request stream and network model"] if sc.stream.rich or sc.network.rich
            else [])
        if other:
            _sessions_alone(other[0])


def _sessions_alone(what: str) -> None:
    raise ValueError(f"workload kind sessions (closed-loop users) cannot be combined with "
                     f"{what}: leave one of them out")
