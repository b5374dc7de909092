"""The recording API: the only thing the runtime and the simulator call.

Hot path (``record_plan``, ``record_decision``, ``record_timings``, ``record_transfer_times``,
``record_step``): append one tuple (the arguments and a ``time_ns`` stamp) to a per-kind list. No
numpy, no Arrow, no span, no lock, no I/O. A :class:`~ultraep.plan.Plan` is kept by reference (its arrays
are read-only), dicts and lists are shallow-copied so the caller may reuse them.

Flush path (a daemon thread, every ``flush_interval_s`` seconds or as soon as a list holds
``flush_every`` records; also :meth:`Recorder.flush` and :meth:`Recorder.close`): take the records
(``buf[:n]`` then ``del buf[:n]``, both atomic, so appends racing with a flush land in the next one),
convert each kind into one Arrow table (:mod:`.batches`), emit the per-step OpenTelemetry span and
metrics, collect the metric reader, and hand one table per raw table to the sink (one Parquet part each).

Never breaks training: every public method catches every exception. A failure (unwritable path, disk
full, a bad value) is counted in :attr:`Recorder.errors` (rows lost in :attr:`Recorder.dropped_rows`),
logged once as a warning on the ``ultraep.telemetry`` logger (later ones at debug level), stored in the
run's closing ``runs_log`` row and summarised by :meth:`Recorder.close`. Mistakes in the arguments of
:meth:`Recorder.open` itself (unknown ``kind``, rank outside the world) raise :class:`ConfigError` at
start-up, before any step runs.

Legend: R ranks, E experts, S slots per rank, T transfers of a plan.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from time import time_ns

from ultraep.errors import ConfigError
from ultraep.telemetry import semconv as sc
from ultraep.telemetry.identity import (agree_run_id, check_run_name, config_record, new_run_id,
                                        topology_record, versions)
from ultraep.telemetry.null import NULL_SPAN, NullRecorder
from ultraep.telemetry.sinks import take as _take

__all__ = ["NullRecorder", "Recorder", "new_run_id"]  # NullRecorder and new_run_id: re-exported, as before

log = logging.getLogger("ultraep.telemetry")

_LIVE: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


class _Span:
    """Context manager around a real OpenTelemetry span; its own failures are swallowed and counted."""

    __slots__ = ("_rec", "_name", "_attrs", "_cm")

    def __init__(self, rec: "Recorder", name: str, attrs: dict) -> None:
        self._rec, self._name, self._attrs, self._cm = rec, name, attrs, None

    def __enter__(self):
        try:
            self._cm = self._rec._otel.tracer.start_as_current_span(self._name, attributes=self._attrs)
            return self._cm.__enter__()
        except Exception as exc:
            self._cm = None
            self._rec._fail("span", exc)
            return None

    def __exit__(self, *exc_info) -> bool:
        if self._cm is not None:
            try:
                self._cm.__exit__(*exc_info)
            except Exception as exc:
                self._rec._fail("span", exc)
        return False


class Recorder:
    """Records one run (on one rank) into a sink; see the module docstring for the hot/flush split.

    Create with :meth:`open`. Attributes: ``run_id``, ``run_dir`` (``None`` for a non-Parquet sink),
    ``rank``, ``world_size``, ``errors``, ``dropped_rows``, ``first_error``.
    """

    def __init__(self, sink, *, run_id: str, run_name: str | None, kind: str, rank: int, world_size: int,
                 model: str | None = None, config_json: str | None = None, config_hash: str | None = None,
                 topology_json: str | None = None, extra: dict | None = None, flush_interval_s: float | None = 2.0,
                 flush_every: int = 2048, max_pending: int = 65536, otel: bool = True,
                 plan_chunk: int = 512) -> None:
        self.run_id = run_id
        self.run_name = run_name
        self.kind = kind
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.run_dir = getattr(sink, "run_dir", None)
        self.session = getattr(sink, "session", None) or secrets.token_hex(4)
        self._sink = sink
        self._meta = dict(model=model, config_json=config_json, config_hash=config_hash,
                          topology_json=topology_json, extra=extra)
        self._flush_every = max(1, int(flush_every))
        self._max_pending = max(self._flush_every, int(max_pending))
        self._plan_chunk = max(1, int(plan_chunk))
        self._closed = False
        self._errors = 0
        self._dropped = 0
        self._first_error: str | None = None
        self._overflowing = False
        self._err_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._started_ns = time_ns()
        self._metrics_at = float("-inf")
        self._metrics_interval = 10.0  # seconds between metric collections (and at close)
        # hot-path buffers (identity never changes; drained with _take)
        self._plans: list = []
        self._decisions: list = []
        self._timings: list = []
        self._ttimes: list = []
        self._steps: list = []
        self._otel = None
        if otel and os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true":
            try:
                from ultraep import __version__
                from ultraep.telemetry.otel import OtelPipeline
                from ultraep.telemetry.step_spans import StepSpans

                self._otel = OtelPipeline({
                    sc.ATTR_RUN_ID: run_id, sc.ATTR_RANK: self.rank, sc.ATTR_WORLD_SIZE: self.world_size,
                    sc.ATTR_RUN_KIND: kind, **({sc.ATTR_MODEL: model} if model else {}),
                    **({sc.ATTR_CONFIG_HASH: config_hash} if config_hash else {}),
                }, __version__)
                self._step_spans = StepSpans(self._otel, self._started_ns)
            except Exception as exc:
                self._fail("OpenTelemetry set-up", exc)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = flush_interval_s
        # The opening runs_log row is the flusher's first write (so open() does not pay pyarrow's first-use
        # import, which also pulls in pandas where it is installed); without a thread it is written now.
        self._run_row_pending = True
        if flush_interval_s is None:
            self._write_run_row(status="running")
        else:
            self._wake.set()
            self._thread = threading.Thread(target=self._loop, name=f"ultraep-telemetry-r{self.rank}", daemon=True)
            self._thread.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, runs_dir, run_name: str | None = None, *, kind: str = "train", config=None, topology=None,
             model: str | None = None, world_size: int = 1, rank: int = 0, extra: dict | None = None,
             flush_interval_s: float | None = 2.0, flush_every: int = 2048, max_pending: int = 65536,
             fsync: bool = False, compression: str = "zstd", otel: bool = True) -> "Recorder":
        """Start recording a run.

        Args:
            runs_dir: directory holding runs (the run goes to ``runs_dir/run_id``), or a sink object
                (anything with ``write(table, arrow_table)`` and ``close()``, e.g. :class:`MemorySink`).
            run_name: the run id (letters, digits, ``._-``); every rank of a run passes the same one.
                ``None``: a new ``YYYYmmdd-HHMMSS-xxxxxx`` id, broadcast from rank 0 when
                ``world_size > 1`` (torch.distributed must be initialised, and every rank calls ``open``).
            kind: ``train`` | ``prefill`` | ``simulation``.
            config: the validated config (pydantic model, stored as JSON with its ``digest()``) or a dict.
            topology: a :class:`~ultraep.topology.Topology` (or dict) stored as JSON.
            model: model name. world_size, rank: this process's place in the EP group.
            extra: any JSON-able dict stored with the run.
            flush_interval_s: background flush period; ``None`` = no thread (flush when a buffer holds
                ``flush_every`` records, on :meth:`flush` and on :meth:`close`, in the caller's thread).
            flush_every: records of one kind that wake the flusher early.
            max_pending: records of one kind held at most; beyond it new records are dropped and counted.
            fsync: fsync each Parquet part (power-loss safety; SIGKILL safety does not need it).
            compression: Parquet codec. otel: feed spans/metrics through the OpenTelemetry SDK.
        """
        if kind not in sc.RUN_KINDS:
            raise ConfigError("kind", f"must be one of {', '.join(sc.RUN_KINDS)}; got {kind!r}", kind)
        if int(world_size) < 1:
            raise ConfigError("world_size", f"must be >= 1, got {world_size}", world_size)
        if not 0 <= int(rank) < int(world_size):
            raise ConfigError("rank", f"({rank}) must be in 0..{int(world_size) - 1} (world_size {world_size})", rank)
        check_run_name(run_name)
        config_json, config_hash = config_record(config)
        if run_name is not None:
            run_id = str(run_name)
        else:
            run_id = new_run_id()
            if int(world_size) > 1:
                run_id = agree_run_id(run_id, int(world_size))
        if isinstance(runs_dir, (str, os.PathLike)):
            from ultraep.telemetry.sinks import ParquetSink

            sink = ParquetSink(Path(runs_dir) / run_id, int(rank), secrets.token_hex(4), fsync=fsync,
                               compression=compression)
        elif hasattr(runs_dir, "write") and hasattr(runs_dir, "close"):
            sink = runs_dir
        else:
            raise ConfigError("runs_dir", f"must be a path or a sink, got {type(runs_dir).__name__}")
        return cls(sink, run_id=run_id, run_name=run_name, kind=kind, rank=int(rank), world_size=int(world_size),
                   model=model, config_json=config_json, config_hash=config_hash,
                   topology_json=topology_record(topology), extra=extra, flush_interval_s=flush_interval_s,
                   flush_every=flush_every, max_pending=max_pending, otel=otel)

    # ------------------------------------------------------------------ hot path
    def _push(self, buf: list, item: tuple) -> None:
        if self._closed:
            return
        if len(buf) >= self._flush_every and not self._pressure(buf):
            return
        buf.append(item)

    def record_plan(self, step: int, microbatch: int, layer: int, plan, *, record_routes: bool = False) -> None:
        """Record one layer's plan: the load (``plan.load_RE`` and rank load before/after), the plan
        (``phy2log``, quotas; ``routes`` if ``record_routes``) and its transfers. Keeps a reference."""
        try:
            self._push(self._plans, (step, microbatch, layer, plan, record_routes, time_ns()))
        except Exception as exc:
            self._fail("record_plan", exc)

    def record_decision(self, step: int, microbatch: int, layer: int, *, policy: str, reason: str,
                        predictions: dict[str, float] | None = None,
                        chosen_predicted_s: float | None = None) -> None:
        """Record the policy decision of a layer, with the predicted seconds of every candidate."""
        try:
            self._push(self._decisions, (step, microbatch, layer, time_ns(), policy, reason,
                                         None if predictions is None else dict(predictions), chosen_predicted_s))
        except Exception as exc:
            self._fail("record_decision", exc)

    def record_timings(self, step: int, microbatch: int, layer: int, timings: dict[str, float]) -> None:
        """Record measured phase times in seconds (keys of :data:`semconv.TIMING_KEYS` get columns of
        their own, any other key goes to the ``other`` map)."""
        try:
            self._push(self._timings, (step, microbatch, layer, time_ns(), dict(timings)))
        except Exception as exc:
            self._fail("record_timings", exc)

    def record_transfer_times(self, step: int, microbatch: int, layer: int, seconds_per_transfer) -> None:
        """Record measured seconds of each transfer, aligned with ``plan.transfers`` (NaN = not measured
        on this rank). A numpy array is kept by reference, anything else is copied into a list."""
        try:
            secs = seconds_per_transfer if hasattr(seconds_per_transfer, "dtype") else list(seconds_per_transfer)
            self._push(self._ttimes, (step, microbatch, layer, time_ns(), secs))
        except Exception as exc:
            self._fail("record_transfer_times", exc)

    def record_step(self, step: int, *, loss: float | None = None, step_time_s: float | None = None,
                    extra: dict | None = None, warmup: bool = False) -> None:
        """Record the end of a step (one ``ultraep.step`` span and the step metrics at the next flush).

        ``warmup=True`` marks a warm-up step (compiles, first allocations, first plans: the runtime's
        step 0): it is stored and exported like any other, and the summaries (``ultraep report``, the
        dashboard's Overview) leave it out of their averages."""
        try:
            self._push(self._steps, (step, time_ns(), loss, step_time_s, None if extra is None else dict(extra),
                                     warmup))
        except Exception as exc:
            self._fail("record_step", exc)

    def span(self, name: str, **attributes):
        """A real OpenTelemetry span around a block (``with rec.span("ultraep.step", step=3): ...``).
        Costs tens of microseconds: for per-step phases, not per layer."""
        if self._otel is None or self._closed:
            return NULL_SPAN
        return _Span(self, name, attributes)

    def _pressure(self, buf: list) -> bool:
        """A buffer reached ``flush_every``: wake the flusher (or flush here); refuse if over ``max_pending``."""
        if len(buf) >= self._max_pending:
            with self._err_lock:
                self._dropped += 1
                first = not self._overflowing
                self._overflowing = True
            if first:
                self._fail("buffer", RuntimeError(
                    f"more than max_pending ({self._max_pending}) records waiting; dropping new records "
                    "until the flusher catches up"))
            return False
        if self._thread is None:
            self._drain_safe()
        else:
            self._wake.set()
        return True

    # ------------------------------------------------------------------ failures
    def _fail(self, where: str, exc, rows: int = 0, count: int = 1) -> None:
        try:
            with self._err_lock:
                first = self._errors == 0
                self._errors += count
                self._dropped += rows
                if self._first_error is None:
                    self._first_error = f"{where}: {exc if isinstance(exc, str) else repr(exc)}"
            if first:
                log.warning("ultraep telemetry: recording failed (%s: %s); training continues, further "
                            "failures are only counted (Recorder.errors) and reported at close", where,
                            exc if isinstance(exc, str) else repr(exc))
            else:
                log.debug("ultraep telemetry: recording failed (%s: %r)", where, exc)
        except Exception:  # pragma: no cover - logging itself failed
            pass

    @property
    def errors(self) -> int:
        """Recording failures swallowed so far (failed writes, bad values, overflow episodes, ...)."""
        return self._errors

    @property
    def dropped_rows(self) -> int:
        """Records or rows lost to those failures."""
        return self._dropped

    @property
    def first_error(self) -> str | None:
        return self._first_error

    # ------------------------------------------------------------------ flush path
    def _loop(self) -> None:
        while True:
            self._wake.wait(self._interval)
            if self._closed:
                return
            self._wake.clear()
            self._drain_safe()

    def _drain_safe(self, collect_metrics: bool = True) -> None:
        try:
            self._drain(collect_metrics)
        except Exception as exc:
            self._fail("flush", exc)

    def _drain(self, collect_metrics: bool = True) -> None:
        from ultraep.telemetry import batches as bt

        with self._flush_lock:
            if self._run_row_pending:
                self._write_run_row(status="running")
            # Steps first: every plan/timing recorded before a step row is then already in its list.
            steps = _take(self._steps)
            plans = _take(self._plans)
            decisions = _take(self._decisions)
            timings = _take(self._timings)
            ttimes = _take(self._ttimes)
            rid, rk = self.run_id, self.rank
            built = bt.Built()
            parts: dict[str, list] = {}
            for i in range(0, len(plans), self._plan_chunk):
                chunk = plans[i:i + self._plan_chunk]
                sub = bt.Built()
                try:
                    bt.plan_tables(rid, rk, chunk, sub)
                except Exception as exc:
                    self._fail("flush plans", exc, rows=len(chunk))
                    continue
                for name, tbl in sub.tables.items():
                    parts.setdefault(name, []).append(tbl)
                built.bad += sub.bad
                built.first_error = built.first_error or sub.first_error
                for s, agg in sub.steps.items():
                    built.steps.setdefault(s, bt.StepAggregate()).add(agg)
            for fn, recs, what in ((bt.decision_table, decisions, "decisions"), (bt.timings_table, timings, "timings"),
                                   (bt.transfer_times_table, ttimes, "transfer times"),
                                   (bt.steps_table, steps, "steps")):
                if recs:
                    try:
                        fn(rid, rk, recs, built)
                    except Exception as exc:
                        self._fail(f"flush {what}", exc, rows=len(recs))
            if built.bad:
                self._fail("a recorded value was refused", built.first_error or "bad value", rows=built.bad,
                           count=built.bad)
            if self._otel is not None:
                try:
                    self._emit_otel(built, steps)
                    spans = self._otel.take_spans()
                    if spans:
                        from ultraep.telemetry.otel import span_columns

                        self._add_rows(built, sc.T_SPANS, span_columns(spans), len(spans))
                    now = time.monotonic()
                    if collect_metrics and (self._closed or (
                            now - self._metrics_at >= self._metrics_interval
                            and (steps or plans or decisions or timings or ttimes or spans))):
                        self._metrics_at = now  # cumulative points: a lower rate loses only resolution
                        from ultraep.telemetry.otel import metric_columns

                        cols = metric_columns(self._otel.take_metrics())
                        if cols["name"]:
                            self._add_rows(built, sc.T_METRIC_POINTS, cols, len(cols["name"]))
                except Exception as exc:
                    self._fail("OpenTelemetry", exc)
            import pyarrow as pa

            for name, tbls in parts.items():
                built.tables[name] = pa.concat_tables(tbls) if len(tbls) > 1 else tbls[0]
            for name, data in built.tables.items():
                if data.num_rows == 0:
                    continue
                try:
                    self._sink.write(name, data)
                except Exception as exc:
                    self._fail(f"write {name}", exc, rows=data.num_rows)
            if self._overflowing:
                with self._err_lock:
                    self._overflowing = False

    def _add_rows(self, built, table: str, cols: dict, n: int) -> None:
        from ultraep.telemetry.batches import rows_table
        import pyarrow as pa

        cols[sc.C_RUN_ID] = pa.array([self.run_id] * n, type=pa.string())
        cols[sc.C_RANK] = pa.array([self.rank] * n, type=pa.int32())
        built.tables[table] = rows_table(table, cols, n)

    def _emit_otel(self, built, step_records: list) -> None:
        """Per-step span (+ aggregate plan/transfer child spans) and metrics, from the flush path."""
        self._step_spans.emit(built.steps, step_records)

    # ------------------------------------------------------------------ run rows, flush, close
    def _write_run_row(self, status: str, ended_ns: int | None = None) -> None:
        self._run_row_pending = False
        try:
            from ultraep.telemetry.batches import rows_table

            m = self._meta
            extra = None if m["extra"] is None else json.dumps(m["extra"], sort_keys=True, default=str)
            now = time_ns()
            cols = {
                sc.C_RUN_ID: [self.run_id], sc.C_RANK: [self.rank], "session": [self.session],
                "run_name": [self.run_name], "kind": [self.kind], "world_size": [self.world_size],
                "model": [m["model"]], "config_json": [m["config_json"]], "config_hash": [m["config_hash"]],
                "topology_json": [m["topology_json"]], "host": [socket.gethostname()], "pid": [os.getpid()],
                "versions_json": [json.dumps(versions(), sort_keys=True)],
                "otel_exporters": [",".join(self._otel.exporters) if self._otel is not None else None],
                "started_at": [self._started_ns], "ended_at": [ended_ns], "status": [status],
                "errors": [self._errors], "dropped_rows": [self._dropped], "first_error": [self._first_error],
                "extra_json": [extra], "written_at": [now],
            }
            tbl = rows_table(sc.T_RUNS_LOG, cols, 1)
            self._sink.write(sc.T_RUNS_LOG, tbl)
        except Exception as exc:
            self._fail("write runs_log", exc)

    def flush(self) -> None:
        """Write every record made so far (returns once the parts are renamed into place)."""
        if self._closed:
            return
        self._drain_safe()

    def close(self) -> None:
        """Flush, write the run's closing row, shut the OpenTelemetry providers down, report failures."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread is not None:
                self._wake.set()
                self._thread.join(timeout=60)
            self._drain_safe()
            if self._otel is not None:
                self._otel.shutdown()
            self._write_run_row(status="closed", ended_ns=time_ns())
            self._sink.close()
        except Exception as exc:
            self._fail("close", exc)
        finally:
            _LIVE.discard(self)
        if self._errors:
            log.warning("ultraep telemetry: run %s rank %d finished with %d recording failures (%d rows lost); "
                        "first: %s", self.run_id, self.rank, self._errors, self._dropped, self._first_error)

    def _after_fork_in_child(self) -> None:
        """A forked child inherits this object but not its thread: make it inert (the parent flushes)."""
        self._closed = True
        self._thread = None
        for buf in (self._plans, self._decisions, self._timings, self._ttimes, self._steps):
            buf.clear()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return f"Recorder(run_id={self.run_id!r}, rank={self.rank}, sink={self._sink!r})"


def _close_all_at_exit() -> None:
    for rec in list(_LIVE):
        try:
            rec.close()
        except Exception:  # pragma: no cover
            pass


def _forget_all_in_child() -> None:
    for rec in list(_LIVE):
        rec._after_fork_in_child()
    _LIVE.clear()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_in_child)
