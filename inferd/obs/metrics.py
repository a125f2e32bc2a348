"""Prometheus metrics of one served model, named like vLLM's (``inferd:``
prefix) so dashboards built for vLLM carry over. ``docs/metrics.md`` defines
each one.

Observed on the engine's step thread (``observe_step``), read at scrape time
for the gauges; prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811

from inferd.engine.outputs import RequestOutput
from inferd.obs.gpu import nvml_collector

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, device_type: str = "cpu"
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"inferd:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"inferd:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive output tokens.", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.gen_len = histogram("request_generation_tokens", "Output tokens per request.", _TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Decode steps that verified draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the model confirmed.")
        self._success = Counter(
            "inferd:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.model_load = Gauge("inferd:model_load_time_seconds", "Cold start: model load time.", labels, registry=r).labels(model_name)
        self._gauges = {
            name: Gauge(f"inferd:{name}", doc, labels, registry=r).labels(model_name)
            for name, doc in (
                ("num_requests_running", "Requests in the running batch."),
                ("num_requests_waiting", "Requests waiting to be scheduled."),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1."),
            )
        }
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        gpus = nvml_collector(device_type)
        if gpus is not None:
            r.register(gpus)
        self._last_token_time: dict[tuple[str, int], float] = {}
        # Counters of the scheduler last seen, so each step adds its delta.
        self._seen = dict.fromkeys(
            ("preemptions", "prefix_queries", "prefix_hits", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"), 0
        )

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        """Gauges read live at scrape time, so they are right when idle too."""
        self._gauges["num_requests_running"].set_function(running)
        self._gauges["num_requests_waiting"].set_function(waiting)
        self._gauges["kv_cache_usage_perc"].set_function(kv_usage)

    def observe_step(self, outputs: list[RequestOutput], scheduler_counters: dict[str, int], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for name, value in scheduler_counters.items():
            delta = value - self._seen[name]
            if delta > 0:
                getattr(self, name).inc(delta)
            self._seen[name] = value
        for out in outputs:
            for c in out.outputs:
                new = len(c.new_token_ids)
                if not new:
                    continue
                self.generation_tokens.inc(new)
                key = (out.request_id, c.index)
                last = self._last_token_time.get(key)
                if last is not None:
                    for _ in range(new):  # several tokens in one step share its gap
                        self.itl.observe((now - last) / new)
                self._last_token_time[key] = now
            if out.finished:
                for c in out.outputs:
                    self._last_token_time.pop((out.request_id, c.index), None)
                self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        finish = m.finish_time or time.time()
        self.e2e.observe(finish - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.decode.observe(finish - m.first_token_time)
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.gen_len.observe(out.num_generated_tokens)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for c in out.outputs:
            self._success.labels(self.model_name, c.finish_reason or "unknown").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
