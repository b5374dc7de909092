"""ultraep.telemetry: record every plan, transfer and decision; query them with SQL.

Three layers (docs/telemetry.md):

* **Recording API** (the only thing the runtime and the simulator call)::

      from ultraep.telemetry import Recorder, NullRecorder, open_run

      with Recorder.open("runs", kind="train", config=cfg, topology=topo, world_size=R, rank=r) as rec:
          rec.record_plan(step, microbatch, layer, plan)
          rec.record_decision(step, microbatch, layer, policy="quota", reason="...", predictions={...})
          rec.record_timings(step, microbatch, layer, {"dispatch_s": ..., "measured_s": ...})
          rec.record_step(step, loss=loss, step_time_s=dt)

  ``NullRecorder()`` has the same interface and does nothing (telemetry off).
* **Store**: per-rank append-only Parquet parts (:mod:`.sinks`), schema in ``schema.sql``, names in
  :mod:`.semconv`.
* **Reading**: :func:`open_run` (a DuckDB connection with every table and view), :func:`export_run`
  (one ``.duckdb`` file), canned queries in :mod:`.queries`, CLI ``ultraep sql`` / ``ultraep report``.

Importing this package is cheap: pyarrow, DuckDB and the OpenTelemetry SDK load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_LAZY = {
    "Recorder": "ultraep.telemetry.recorder",
    "NullRecorder": "ultraep.telemetry.null",
    "new_run_id": "ultraep.telemetry.identity",
    "open_run": "ultraep.telemetry.store",
    "export_run": "ultraep.telemetry.store",
    "TelemetryError": "ultraep.telemetry.store",
    "Sink": "ultraep.telemetry.sinks",
    "ParquetSink": "ultraep.telemetry.sinks",
    "MemorySink": "ultraep.telemetry.sinks",
    "semconv": "ultraep.telemetry.semconv",
    "queries": "ultraep.telemetry.queries",
}

if TYPE_CHECKING:  # pragma: no cover
    from ultraep.telemetry import queries, semconv
    from ultraep.telemetry.identity import new_run_id
    from ultraep.telemetry.null import NullRecorder
    from ultraep.telemetry.recorder import Recorder
    from ultraep.telemetry.sinks import MemorySink, ParquetSink, Sink
    from ultraep.telemetry.store import TelemetryError, export_run, open_run


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ultraep.telemetry' has no attribute {name!r}")
    module = import_module(mod)
    value = module if mod.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
