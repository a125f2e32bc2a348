"""OpenTelemetry traces and GenAI metrics of served requests; off unless
configured.

One SERVER span per HTTP request, named ``{operation} {model}`` with the
GenAI semantic-convention attributes, a child of the caller's W3C
``traceparent`` when one comes in; under it ``queue``, ``prefill`` and
``decode`` spans timed from the engine's own timestamps. The OTel metrics
``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token``
and ``gen_ai.server.request.duration`` come with it.

Export is OTLP over HTTP (``--otlp-endpoint http://collector:4318``), which
the OpenTelemetry Collector, Jaeger, Grafana Tempo and the Datadog Agent
(OTLP ingest on port 4318) all accept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferd.engine.outputs import RequestOutput

_PROPAGATOR = TraceContextTextMapPropagator()
# Seconds; the GenAI conventions' advised boundaries.
_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Makes the spans and GenAI metrics of requests; built from providers so
    tests can hand it in-memory ones."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider | None = None) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._tracer = tracer_provider.get_tracer("inferd")
        self._ttft = self._tpot = self._duration = None
        if meter_provider is not None:
            meter = meter_provider.get_meter("inferd")
            self._ttft = meter.create_histogram(
                "gen_ai.server.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
                description="Time to generate the first token",
            )
            self._tpot = meter.create_histogram(
                "gen_ai.server.time_per_output_token", unit="s", explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
                description="Time per output token after the first",
            )
            self._duration = meter.create_histogram(
                "gen_ai.server.request.duration", unit="s", explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
                description="Generative AI server request duration",
            )

    def start(
        self, operation: str, model: str, request: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestSpan:
        """Opens the request's span; ``request`` holds the GenAI request fields
        (max_tokens, temperature, top_p) that were given."""
        parent = _PROPAGATOR.extract(carrier=dict(headers))
        span = self._tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("gen_ai.system", "inferd")
        for field in ("max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty"):
            value = request.get(field)
            if value is not None:
                span.set_attribute(f"gen_ai.request.{field}", value)
        return RequestSpan(self, span, operation, model)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        if self.meter_provider is not None and hasattr(self.meter_provider, "shutdown"):
            self.meter_provider.shutdown()


class RequestSpan:
    def __init__(self, tracer: RequestTracer, span: trace.Span, operation: str, model: str) -> None:
        self._tracer = tracer
        self.span = span
        self._attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
        self._ended = False

    def finish(self, response_id: str, finals: Sequence[RequestOutput], error: str | None = None) -> None:
        """Ends the span (once) with the response's attributes and the engine
        phases as child spans, and records the GenAI metrics."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        span.set_attribute("gen_ai.response.id", response_id)
        span.set_attribute("gen_ai.response.model", self._attrs["gen_ai.request.model"])
        span.set_attribute("gen_ai.usage.input_tokens", sum(len(f.prompt_token_ids) for f in finals))
        span.set_attribute("gen_ai.usage.output_tokens", sum(f.num_generated_tokens for f in finals))
        reasons = [c.finish_reason or "unknown" for f in finals for c in f.outputs]
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
        context = trace.set_span_in_context(span)
        for final in finals:
            self._phases(final, context)
            self._record(final)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute("error.type", "internal_error")
        span.end()

    def _phases(self, out: RequestOutput, context: Any) -> None:  # noqa: ANN401 - an OTel Context
        m = out.metrics
        tracer = self._tracer._tracer
        edges = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time]
        for name, start, end in zip(("queue", "prefill", "decode"), edges, edges[1:]):
            if start is None or end is None:
                break
            child = tracer.start_span(name, context=context, start_time=_ns(start))
            child.set_attribute("inferd.request_id", out.request_id)
            child.end(end_time=_ns(end))

    def _record(self, out: RequestOutput) -> None:
        if self._tracer._duration is None:
            return
        m = out.metrics
        attrs = self._attrs
        if m.finish_time is not None:
            self._tracer._duration.record(m.finish_time - m.arrival_time, attrs)
        if m.first_token_time is not None:
            self._tracer._ttft.record(m.first_token_time - m.arrival_time, attrs)
            tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.finish_time is not None and tokens > 1:
                self._tracer._tpot.record((m.finish_time - m.first_token_time) / (tokens - 1), attrs)


def otlp_tracer(endpoint: str, service_name: str = "inferd") -> RequestTracer:
    """A tracer exporting spans and metrics over OTLP/HTTP to ``endpoint``
    (the collector's base URL, e.g. http://127.0.0.1:4318)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    base = endpoint.rstrip("/")
    resource = Resource.create({"service.name": service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics"))
    return RequestTracer(provider, SDKMeterProvider(resource=resource, metric_readers=[reader]))
