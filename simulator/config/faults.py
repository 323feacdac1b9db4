"""The scenario's fault-tolerance sections (容错 and 熔断): replicas that
fail and recover (``cluster.faults``), the gateway's per-replica circuit breaker
(``cluster.breaker``) and degradation under overload (``cluster.degrade``). The models
they configure live in ``simulator.cluster.faults``, ``simulator.cluster.breaker`` and
``simulator.cluster.degrade``.

Defaults are the common production ones where there is one: Envoy's outlier detection
ejects a host after 5 consecutive 5xx (``consecutive_5xx``) for a base ejection time of
30 s (envoyproxy.io, "Outlier detection"); a Kubernetes readiness probe takes a pod out
of its Service after ``failureThreshold`` 3 x ``periodSeconds`` 10 = 30 s
(kubernetes.io, "Configure Liveness, Readiness and Startup Probes") - ``detect_s``
defaults to 0 (the gateway learns of a failure at once), the optimistic end.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

# The longest outage (and latest start) taken, 1e7 s (~116 days): a request held at the
# gateway for a replica that never comes back would otherwise stretch the run's clock
# (and its time series) to the outage's end. ``mtbf_s`` at least 1 s: a replica failing
# more often is no replica, and each failure is events for every request it held.
MAX_S = 1e7


class OutageConfig(StrictModel):
    """One scheduled outage: replica ``replica`` is down from ``start_s`` for
    ``duration_s`` (then back with an empty KV cache)."""

    replica: int = Field(..., ge=0, description="the replica (slot index, from 0)")
    start_s: float = Field(..., ge=0, le=MAX_S, description="when it fails (s of "
                           "simulated time)")
    duration_s: float = Field(..., gt=0, le=MAX_S, description="how long it stays down (s)")


class FaultsConfig(StrictModel):
    """Replicas that fail and recover: each replica independently up for an exponential
    time of mean ``mtbf_s`` and down for one of mean ``mttr_s`` (both or neither), and/or
    the scheduled ``outages``. A failure drops the replica's KV (prefix cache included)
    and every request it held; ``in_flight`` says what becomes of them."""

    mtbf_s: Optional[float] = Field(None, ge=1.0, description="mean time between failures "
                                    "of one replica (s, exponential; at least 1 s)")
    mttr_s: Optional[float] = Field(None, ge=1e-3, le=MAX_S, description="mean time to "
                                    "repair (s, exponential): restart, model load and "
                                    "warm-up")
    outages: list[OutageConfig] = Field(default_factory=list, description="scheduled "
                                        "outages: {replica, start_s, duration_s}")
    detect_s: float = Field(0.0, ge=0, description="health-check delay: the gateway stops "
                            "routing to a failed replica this long after it fails (until "
                            "then a request sent there fails, refuse_s later)")
    refuse_s: float = Field(0.0, ge=0, le=3600, description="how long a request routed to a "
                            "failed replica (not yet detected) takes to fail there: ~0 for a "
                            "refused connection on a live node, a connect timeout for a dead "
                            "one (Envoy's connect_timeout default is 5 s)")
    in_flight: Literal["lost", "retry"] = Field(
        "retry", description="requests held by a failing replica (or sent to a failed one): "
        "lost (the request fails: 502 to its client) or retry (it re-enters the gateway at "
        "once, on another replica, up to max_retries times)")
    max_retries: int = Field(2, ge=0, le=100, description="retry: gateway retries of one "
                             "request after faults; past them it fails")

    @model_validator(mode="after")
    def _pair(self):
        if (self.mtbf_s is None) != (self.mttr_s is None):
            given, missing = (("mtbf_s", "mttr_s") if self.mttr_s is None
                              else ("mttr_s", "mtbf_s"))
            raise ValueError(f"cluster.faults.{given} needs cluster.faults.{missing} too "
                             "(exponential up and down times)")
        if self.mtbf_s is None and not self.outages:
            raise ValueError("cluster.faults: give mtbf_s and mttr_s, or outages (or leave "
                             "faults out)")
        return self


class BreakerConfig(StrictModel):
    """A circuit breaker per replica in the gateway: closed (routed to) until
    ``failures`` consecutive failed requests, or until the P99 of its last ``window_s``
    of TTFTs (at least ``min_samples`` of them) exceeds ``p99_ms``; then open (not routed
    to) for ``cooldown_s``; then half-open: ``probes`` requests go through, and it
    closes when they all succeed (one failure opens it again)."""

    failures: int = Field(5, ge=1, le=1_000_000, description="consecutive failures that "
                          "open it (Envoy's consecutive_5xx default)")
    p99_ms: Optional[float] = Field(None, gt=0, description="open when the rolling P99 "
                                    "TTFT on the replica (gateway routing to first token) "
                                    "exceeds this (null: no latency trigger)")
    window_s: float = Field(30.0, gt=0, description="the rolling window of p99_ms")
    min_samples: int = Field(20, ge=1, description="TTFTs the window needs before p99_ms "
                             "is judged")
    cooldown_s: float = Field(30.0, gt=0, description="time open before half-open (Envoy's "
                              "base_ejection_time default)")
    probes: int = Field(1, ge=1, le=10_000, description="half-open: requests let through; "
                        "all must succeed to close")



class DegradeConfig(StrictModel):
    """Degradation when overloaded (降级): while the replicas a request may be routed to
    (those of the other pools, with ``pool``) hold on average at least
    ``queue_per_replica`` waiting requests, a newly routed request is sent to the smaller
    model's ``pool`` (a pool of ``cluster.pools`` that otherwise takes no traffic) and/or
    has its output cut to ``max_output_tokens``: a cheaper answer instead of a longer
    wait."""

    queue_per_replica: float = Field(..., gt=0, description="overload: waiting requests "
                                     "per routable replica at or above this")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="output cap of a "
                                             "request routed while overloaded")
    pool: Optional[str] = Field(None, min_length=1, description="a pool of cluster.pools "
                                "(a smaller model) that serves only what overload sends it")

    @model_validator(mode="after")
    def _something(self):
        if self.max_output_tokens is None and self.pool is None:
            raise ValueError("cluster.degrade: give max_output_tokens, pool, or both")
        return self
