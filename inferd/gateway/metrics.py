"""The gateway's Prometheus metrics, ``inferd_gateway:`` prefix (defined in
``docs/metrics.md``). Replica gauges are read from the pools at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_STARTUP_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# (model, state) -> replicas in that state, for every model.
ReplicaCounts = Callable[[], Iterable[tuple[str, str, int]]]


class _ReplicaCollector(Collector):
    def __init__(self, counts: ReplicaCounts, in_flight: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._counts = counts
        self._in_flight = in_flight

    def collect(self):  # noqa: ANN201
        replicas = GaugeMetricFamily("inferd_gateway:replicas", "Replicas per model and state.", labels=["model", "state"])
        for model, state, n in self._counts():
            replicas.add_metric([model, state], n)
        yield replicas
        busy = GaugeMetricFamily("inferd_gateway:requests_in_flight", "Requests the gateway is serving.", labels=["model"])
        for model, n in self._in_flight():
            busy.add_metric([model], n)
        yield busy


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "inferd_gateway:requests", "Requests answered, by model, route and HTTP status.",
            ["model", "route", "status"], registry=r,
        )
        self.latency = Histogram(
            "inferd_gateway:request_duration_seconds", "Arrival at the gateway to the last byte sent.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.first_byte = Histogram(
            "inferd_gateway:time_to_first_byte_seconds", "Arrival to the first byte of the upstream's answer.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "inferd_gateway:upstream_errors", "Failed upstream attempts, by kind (connect, timeout, status, stream).",
            ["model", "replica", "kind"], registry=r,
        )
        self.retries = Counter(
            "inferd_gateway:retries", "Requests sent to another replica after a failure before their first byte.",
            ["model"], registry=r,
        )
        self.rate_limited = Counter(
            "inferd_gateway:rate_limited", "Requests refused with 429, by limit (requests, tokens, concurrency).",
            ["reason"], registry=r,
        )
        self.auth_failures = Counter(
            "inferd_gateway:auth_failures", "Requests refused with 401/403, by reason.", ["reason"], registry=r,
        )
        self.routing = Counter(
            "inferd_gateway:routing_decisions", "How replicas were chosen (affinity, overload, least_loaded, round_robin).",
            ["model", "decision"], registry=r,
        )
        self.cold_starts = Counter(
            "inferd_gateway:cold_starts", "Replicas started because a request found its model at zero.",
            ["model"], registry=r,
        )
        self.cold_start_wait = Histogram(
            "inferd_gateway:cold_start_wait_seconds", "How long requests to a model at zero waited for a replica.",
            ["model"], buckets=_STARTUP_BUCKETS, registry=r,
        )
        self.startup = Histogram(
            "inferd_gateway:replica_startup_seconds", "Process start to first healthy check, per local replica.",
            ["model"], buckets=_STARTUP_BUCKETS, registry=r,
        )
        self.scaling = Counter(
            "inferd_gateway:scaling_events", "Replicas started or stopped by the autoscaler (direction up/down).",
            ["model", "direction"], registry=r,
        )
        self.tokens = Counter(
            "inferd_gateway:tokens", "Tokens through the gateway, by model and kind (prompt, completion).",
            ["model", "kind"], registry=r,
        )

    def bind_replicas(self, counts: ReplicaCounts, in_flight: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self.registry.register(_ReplicaCollector(counts, in_flight))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
