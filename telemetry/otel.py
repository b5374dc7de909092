"""OpenTelemetry set-up: a private TracerProvider and MeterProvider per recorder, feeding the store.

* :class:`StoreSpanProcessor` keeps ended spans in a list; the recorder's flush path turns them into
  rows of the ``spans`` table.
* :class:`StoreMetricReader` is a pull reader; the flush path calls :meth:`collect` and turns the data
  points into rows of ``metric_points`` (cumulative temporality: each point is the running total).
* Optional export with the standard OpenTelemetry environment variables: ``OTEL_TRACES_EXPORTER`` /
  ``OTEL_METRICS_EXPORTER`` (comma-separated exporter names such as ``otlp`` or ``console``; ``none``
  disables), or just ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``
  (implies ``otlp``). Exporters are found through the entry points the OpenTelemetry packages register
  (``opentelemetry_traces_exporter``, ``opentelemetry_metrics_exporter``), so ``otlp`` works once the
  user installs ``opentelemetry-exporter-otlp`` (or only its HTTP or gRPC half; ``OTEL_EXPORTER_OTLP_PROTOCOL``
  picks between them as in the SDK's auto-configuration); endpoint, headers, timeouts and
  ``OTEL_METRIC_EXPORT_INTERVAL`` are read by those exporters themselves. ``OTEL_SDK_DISABLED=true``
  turns the OpenTelemetry part off (the store tables other than ``spans``/``metric_points`` still fill).
  Without any of these variables nothing leaves the process.

The providers are private: ultraep never installs global providers, so an application's own
OpenTelemetry set-up is untouched.
"""

from __future__ import annotations

import json
import logging
import os
from importlib.metadata import entry_points

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, MetricsData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from ultraep.telemetry import semconv as sc
from ultraep.telemetry.sinks import take

log = logging.getLogger("ultraep.telemetry")


class StoreSpanProcessor(SpanProcessor):
    """Collects ended spans for the store (no thread; ``list.append`` is atomic)."""

    def __init__(self) -> None:
        self.ended: list[ReadableSpan] = []

    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - SDK hook
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class StoreMetricReader(MetricReader):
    """A pull metric reader; :meth:`collect` (from the flush path) appends a ``MetricsData``."""

    def __init__(self) -> None:
        super().__init__()
        self.collected: list[MetricsData] = []

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> None:
        if metrics_data is not None:
            self.collected.append(metrics_data)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def _exporter_names(signal: str) -> list[str]:
    raw = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER")
    if raw is None:
        endpoint_vars = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        return ["otlp"] if any(os.environ.get(v) for v in endpoint_vars) else []
    return [n.strip() for n in raw.split(",") if n.strip() and n.strip().lower() != "none"]


# OTLP protocol (OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL) -> the entry-point name of its exporter, as the
# OpenTelemetry SDK's own auto-configuration maps it.
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def _otlp_entry_points(signal: str) -> list:
    """Entry points for the generic name ``otlp``: the exporter of the configured protocol; without one,
    ``otlp`` itself (the ``opentelemetry-exporter-otlp`` bundle, gRPC), else whichever of the gRPC and
    HTTP exporters is installed (so ``pip install opentelemetry-exporter-otlp-proto-http`` is enough)."""
    group = f"opentelemetry_{signal}_exporter"
    protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "").strip()
    if protocol:
        if protocol not in _OTLP_BY_PROTOCOL:
            log.warning("ultraep telemetry: OTLP protocol %r is not supported (use one of %s)", protocol,
                        ", ".join(_OTLP_BY_PROTOCOL))
            return []
        return list(entry_points(group=group, name=_OTLP_BY_PROTOCOL[protocol]))
    for name in ("otlp", *_OTLP_BY_PROTOCOL.values()):
        eps = list(entry_points(group=group, name=name))
        if eps:
            return eps
    return []


def _load_exporters(signal: str) -> list[tuple[str, object]]:
    out = []
    for name in _exporter_names(signal):
        if name == "otlp":
            eps = _otlp_entry_points(signal)
        else:
            eps = list(entry_points(group=f"opentelemetry_{signal}_exporter", name=name))
        if not eps:
            log.warning(
                "ultraep telemetry: OTEL_%s_EXPORTER names %r but no such exporter is installed "
                "(for otlp: pip install opentelemetry-exporter-otlp); spans and metrics still go to the store",
                signal.upper(), name,
            )
            continue
        try:
            out.append((name, eps[0].load()()))
        except Exception as exc:  # a broken exporter must not stop the run
            log.warning("ultraep telemetry: could not start the %s exporter %r: %r", signal, name, exc)
    return out


class OtelPipeline:
    """Providers, the store-feeding processor/reader, optional exporters and the instruments."""

    def __init__(self, resource_attributes: dict, version: str) -> None:
        resource = Resource.create({"service.name": sc.SERVICE_NAME, **resource_attributes})
        self.spans = StoreSpanProcessor()
        self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(self.spans)
        self.exporters: list[str] = []
        for name, exporter in _load_exporters("traces"):
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
            self.exporters.append(f"traces:{name}")
        self.reader = StoreMetricReader()
        readers: list[MetricReader] = [self.reader]
        for name, exporter in _load_exporters("metrics"):
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(exporter))
            self.exporters.append(f"metrics:{name}")
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
        self.tracer = self.tracer_provider.get_tracer(sc.INSTRUMENTATION_SCOPE, version)
        meter = self.meter_provider.get_meter(sc.INSTRUMENTATION_SCOPE, version)
        create = {"counter": meter.create_counter, "histogram": meter.create_histogram, "gauge": meter.create_gauge}
        self.instruments = {name: create[kind](name, unit=unit, description=desc)
                            for name, (kind, unit, desc) in sc.METRICS.items()}

    def take_spans(self) -> list:
        return take(self.spans.ended)

    def take_metrics(self) -> list:
        self.reader.collect()
        return take(self.reader.collected)

    def shutdown(self) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            try:
                provider.shutdown()
            except Exception as exc:  # pragma: no cover - exporter failures at exit
                log.debug("ultraep telemetry: provider shutdown failed: %r", exc)


def _attrs_json(attrs) -> str | None:
    if not attrs:
        return None
    return json.dumps(dict(attrs), default=str, sort_keys=True)


def span_columns(spans: list) -> dict:
    """Ended spans → columns of the ``spans`` table (without run_id / rank)."""
    cols: dict[str, list] = {k: [] for k in (
        "trace_id", "span_id", "parent_span_id", "name", "start_time", "end_time", "duration_s", "status",
        "attributes_json")}
    for s in spans:
        ctx = s.context
        cols["trace_id"].append(f"{ctx.trace_id:032x}")
        cols["span_id"].append(f"{ctx.span_id:016x}")
        cols["parent_span_id"].append(f"{s.parent.span_id:016x}" if s.parent is not None else None)
        cols["name"].append(s.name)
        start, end = int(s.start_time or 0), int(s.end_time or s.start_time or 0)
        cols["start_time"].append(start)
        cols["end_time"].append(end)
        cols["duration_s"].append((end - start) / 1e9)
        cols["status"].append(s.status.status_code.name)
        cols["attributes_json"].append(_attrs_json(s.attributes))
    return cols


def metric_columns(batches: list) -> dict:
    """Collected ``MetricsData`` → columns of ``metric_points`` (without run_id / rank)."""
    names = ("ts", "name", "unit", "kind", "attributes_json", "value", "count", "sum", "min", "max",
             "bucket_bounds", "bucket_counts")
    cols: dict[str, list] = {k: [] for k in names}
    for data in batches:
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = type(m.data).__name__.lower()  # sum | gauge | histogram | exponentialhistogram
                    for p in m.data.data_points:
                        hist = hasattr(p, "bucket_counts") and hasattr(p, "explicit_bounds")
                        cols["ts"].append(int(p.time_unix_nano))
                        cols["name"].append(m.name)
                        cols["unit"].append(m.unit or None)
                        cols["kind"].append(kind)
                        cols["attributes_json"].append(_attrs_json(p.attributes))
                        cols["value"].append(None if hist else _num(getattr(p, "value", None)))
                        cols["count"].append(int(p.count) if hist else None)
                        cols["sum"].append(float(p.sum) if hist else None)
                        cols["min"].append(_num(getattr(p, "min", None)) if hist else None)
                        cols["max"].append(_num(getattr(p, "max", None)) if hist else None)
                        cols["bucket_bounds"].append([float(b) for b in p.explicit_bounds] if hist else None)
                        cols["bucket_counts"].append([int(c) for c in p.bucket_counts] if hist else None)
    return cols


def _num(v):
    if v is None:
        return None
    v = float(v)
    return None if v in (float("inf"), float("-inf")) else v
