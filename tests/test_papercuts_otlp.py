"""Issue 15, item 7: OTLP export end to end.

A recorder configured only through the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``) exports through the real OTLP/HTTP exporter to a small
receiver running in this test (an ``http.server`` thread). The receiver decodes the requests with the
exporter's own generated protobuf classes, and the test checks that every span and metric name, unit and
attribute is the one ``ultraep.telemetry.semconv`` defines, and that the exported spans are the ones the
store recorded (same ids, same parents).
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter is a dev dependency")

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from ultraep import plan_layer  # noqa: E402
from ultraep.telemetry import Recorder, open_run  # noqa: E402
from ultraep.telemetry import semconv as sc  # noqa: E402

# path -> (request class, response class)
SERVICES = {
    "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
    "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest, metrics_service_pb2.ExportMetricsServiceResponse),
}


class _Collector(BaseHTTPRequestHandler):
    """The OTLP/HTTP protocol's binary-protobuf form: POST a serialized request, answer a serialized
    response with status 200 (https://opentelemetry.io/docs/specs/otlp/#otlphttp)."""

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path not in SERVICES or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        request_cls, response_cls = SERVICES[self.path]
        self.server.received.append((self.path, request_cls.FromString(body)))
        out = response_cls().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _value(v):
    """An OTLP ``AnyValue`` as a Python value."""
    return getattr(v, v.WhichOneof("value"))


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def test_spans_and_metrics_reach_an_otlp_http_collector(tmp_path, monkeypatch, collector):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    load = np.array([[40, 1, 1, 1], [30, 2, 2, 2]], dtype=np.int64)  # expert 0 hot: replicas and transfers
    with Recorder.open(tmp_path, "otlp", model="toy-moe", flush_interval_s=None) as rec:
        run_id = rec.run_id
        for step in range(2):
            for layer in range(2):
                plan = plan_layer(load, "quota", num_redundant_slots=1)
                rec.record_plan(step, 0, layer, plan)
                rec.record_timings(step, 0, layer, {"plan_s": 1e-4, "transfer_s": 2e-4, "dispatch_s": 3e-4})
            rec.record_step(step, loss=1.0 / (step + 1), step_time_s=0.05)
    assert rec.errors == 0, rec.first_error
    # closing the recorder shut the providers down, which flushed both exporters synchronously
    paths = [p for p, _ in collector.received]
    assert "/v1/traces" in paths and "/v1/metrics" in paths, paths

    spans, resources = [], []
    for path, req in collector.received:
        for rs in (req.resource_spans if path == "/v1/traces" else req.resource_metrics):
            resources.append(_attrs(rs.resource.attributes))
    for _, req in (r for r in collector.received if r[0] == "/v1/traces"):
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                assert ss.scope.name == sc.INSTRUMENTATION_SCOPE
                spans.extend(ss.spans)
    for res in resources:
        assert res["service.name"] == sc.SERVICE_NAME
        assert res[sc.ATTR_RUN_ID] == run_id and res[sc.ATTR_RANK] == 0 and res[sc.ATTR_MODEL] == "toy-moe"

    # spans: names from semconv, attributes in the ultraep namespace, the plan/transfer children of steps
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert set(by_name) == {sc.SPAN_STEP, sc.SPAN_PLAN, sc.SPAN_TRANSFER}
    assert len(by_name[sc.SPAN_STEP]) == 2 and len(by_name[sc.SPAN_PLAN]) == 2
    steps = {s.span_id: _attrs(s.attributes) for s in by_name[sc.SPAN_STEP]}
    assert sorted(a[sc.ATTR_STEP] for a in steps.values()) == [0, 1]
    for a in steps.values():
        assert all(k.startswith("ultraep.") for k in a), a
        assert a[sc.ATTR_PLAN_COUNT] == 2 and a[sc.ATTR_TOKENS] == 2 * int(load.sum())
        assert a[sc.ATTR_STEP_TIME] == pytest.approx(0.05)
        assert a[sc.ATTR_TIMING_PREFIX + "dispatch_s"] == pytest.approx(6e-4)
    for child in by_name[sc.SPAN_PLAN] + by_name[sc.SPAN_TRANSFER]:
        a = _attrs(child.attributes)
        assert child.parent_span_id in steps and a[sc.ATTR_AGGREGATE] is True
        assert a[sc.ATTR_STEP] == steps[child.parent_span_id][sc.ATTR_STEP]
    # the exported spans are the recorded ones
    stored = open_run(tmp_path / "otlp").execute("SELECT span_id, name FROM spans").fetchall()
    assert sorted(stored) == sorted((s.span_id.hex(), s.name) for s in spans)

    # metrics: exactly semconv's instruments, with its units and instrument kinds
    seen: dict[str, tuple[str, str]] = {}
    for _, req in (r for r in collector.received if r[0] == "/v1/metrics"):
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                assert sm.scope.name == sc.INSTRUMENTATION_SCOPE
                for m in sm.metrics:
                    seen[m.name] = (m.unit, m.WhichOneof("data"))
                    if m.name == sc.METRIC_STEPS:
                        assert m.sum.data_points[-1].as_int == 2
                    if m.name == sc.METRIC_STEP_DURATION:
                        assert m.histogram.data_points[-1].count == 2
    kinds = {"counter": "sum", "histogram": "histogram", "gauge": "gauge"}
    expected = {name: (unit, kinds[kind]) for name, (kind, unit, _) in sc.METRICS.items()}
    assert seen == expected
    exporters = open_run(tmp_path / "otlp").execute("SELECT otel_exporters FROM runs").fetchone()[0]
    assert exporters == "traces:otlp,metrics:otlp"
