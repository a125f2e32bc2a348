"""OpenTelemetry: a GenAI server span per request, under the caller's trace."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from inferd.obs.tracing import RequestTracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def traced(server):  # noqa: ANN001, ANN201
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    serving = server.state.serving
    serving.tracer = RequestTracer(provider, MeterProvider(metric_readers=[reader]))
    yield exporter, reader
    serving.tracer = None


def _histograms(reader) -> dict[str, int]:  # noqa: ANN001
    counts = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                counts[metric.name] = sum(p.count for p in metric.data.data_points)
    return counts


def test_a_chat_request_is_a_genai_span_in_the_callers_trace(http, traced):
    exporter, reader = traced
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0, "top_p": 0.9, "ignore_eos": True}  # fmt: skip
    res = http.post("/v1/chat/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert res.status_code == 200
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert root.name == "chat smol"
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "smol"
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.usage.input_tokens"] == res.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 6
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.id"] == res.json()["id"]

    phases = sorted((s for s in spans if s.kind != SpanKind.SERVER), key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["queue", "prefill", "decode"]
    assert all(s.parent.span_id == root.context.span_id for s in phases)
    assert phases[0].end_time <= phases[1].start_time + 1 and phases[1].end_time <= phases[2].start_time + 1

    counts = _histograms(reader)
    assert counts["gen_ai.server.request.duration"] == 1
    assert counts["gen_ai.server.time_to_first_token"] == 1
    assert counts["gen_ai.server.time_per_output_token"] == 1


def test_a_stream_and_a_failed_request_end_their_spans(http, traced):
    exporter, _ = traced
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as res:
        assert "".join(res.iter_text()).endswith("data: [DONE]\n\n")
    roots = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(roots) == 1 and roots[0].name == "text_completion smol"
    assert roots[0].attributes["gen_ai.usage.output_tokens"] == 3
    assert format(roots[0].context.trace_id, "032x") != TRACE_ID  # no traceparent: a trace of its own

    too_long = {"prompt": "Hi", "max_tokens": 10**6}
    assert http.post("/v1/completions", json=too_long).status_code == 400
    roots = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(roots) == 2
    assert roots[1].status.status_code == StatusCode.ERROR and "context length" in roots[1].status.description
