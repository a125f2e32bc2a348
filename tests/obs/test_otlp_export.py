"""``otlp_tracer`` really sends OTLP/HTTP: a collector stand-in on loopback
receives the span and the GenAI metrics."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferd.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inferd.obs.tracing import otlp_tracer


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


def test_spans_and_metrics_reach_an_otlp_http_collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracer = otlp_tracer(f"http://127.0.0.1:{server.server_port}")
        span = tracer.start("chat", "m", {"max_tokens": 4}, {})
        out = RequestOutput(
            request_id="r1", prompt="hi", prompt_token_ids=[1, 2, 3],
            outputs=[CompletionOutput(index=0, text="abcd", token_ids=[5, 6, 7, 8], finish_reason="length")],
            finished=True, metrics=RequestMetrics(arrival_time=100.0, first_scheduled_time=100.1,
                                                  first_token_time=100.3, finish_time=100.9),
        )  # fmt: skip
        span.finish("chatcmpl-1", [out])
        tracer.shutdown()  # flushes both exporters
    finally:
        server.shutdown()
        thread.join(10)

    traces = [ExportTraceServiceRequest.FromString(b) for p, b in _Collector.received if p == "/v1/traces"]
    spans = [s for t in traces for rs in t.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == ["chat m", "decode", "prefill", "queue"]
    root = next(s for s in spans if s.name == "chat m")
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert attrs["gen_ai.response.id"].string_value == "chatcmpl-1"

    metrics = [ExportMetricsServiceRequest.FromString(b) for p, b in _Collector.received if p == "/v1/metrics"]
    names = {m.name for r in metrics for rm in r.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
            "gen_ai.server.time_per_output_token"} <= names  # fmt: skip
