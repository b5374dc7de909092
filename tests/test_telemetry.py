"""Telemetry recorder and store on real Parquet/DuckDB files: every table fills with the right values, bad
values and broken disks never stop training, telemetry-off is a no-op, the schema matches semconv."""

import errno
import inspect
import json
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

import ultraep
from ultraep.errors import ConfigError
from ultraep.telemetry import MemorySink, NullRecorder, Recorder, export_run, open_run, semconv
from ultraep.telemetry.sinks import ParquetSink
from ultraep.telemetry.store import schema_statements

TOPO = ultraep.Topology(num_ranks=4, num_experts=16, num_redundant_slots=2, expert_bytes=1 << 20)


def make_plan(seed: int, policy: str = "quota"):
    load = np.random.default_rng(seed).integers(0, 200, (4, 16))
    load[:, 0] += 400  # a hot expert: the quota planner replicates it, so there are transfers
    return ultraep.plan_layer(load, policy, topology=TOPO)


def record_run(rec, steps=3, microbatches=2, layers=4):
    plans = {}
    for step in range(steps):
        for mb in range(microbatches):
            for layer in range(layers):
                plan = make_plan(step * 100 + mb * 10 + layer)
                plans[step, mb, layer] = plan
                rec.record_plan(step, mb, layer, plan, record_routes=(layer == 0))
                rec.record_decision(step, mb, layer, policy=plan.policy, reason="hot expert",
                                    predictions={"quota": 1e-3, "none": 3e-3}, chosen_predicted_s=1e-3)
                rec.record_timings(step, mb, layer, {"plan_s": 1e-4, "dispatch_s": 2e-4, "measured_s": 1.2e-3,
                                                     "predicted_s": 1e-3, "custom_s": 7.0})
                rec.record_transfer_times(step, mb, layer, [1e-3] * len(plan.transfers))
        rec.record_step(step, loss=1.0 / (step + 1), step_time_s=0.05, extra={"lr": 0.1})
    return plans


def count(con, table):
    return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_every_table_fills_with_exact_values(tmp_path):
    cfg = ultraep.BalancerConfig(num_redundant_slots=2)
    with Recorder.open(tmp_path, "r1", config=cfg, topology=TOPO, model="toy-moe", extra={"note": "x"},
                       flush_interval_s=None) as rec:
        plans = record_run(rec)
    assert rec.errors == 0, rec.first_error
    con = open_run(tmp_path / "r1")
    n = len(plans)
    T = sum(len(p.transfers) for p in plans.values())
    assert T > 0
    for table, expected in [("layer_loads", n), ("plans", n), ("decisions", n), ("timings", n),
                            ("transfer_times", n), ("transfers", T), ("steps", 3), ("runs", 1),
                            ("layer_balance", n), ("transfer_detail", T)]:
        assert count(con, table) == expected, table
    # the run row: config and its hash, topology, closed status
    run = con.execute("SELECT config_json, config_hash, topology_json, model, status, errors, kind, extra_json "
                      "FROM runs").fetchone()
    assert json.loads(run[0]) == json.loads(cfg.model_dump_json()) and run[1] == cfg.digest()
    assert json.loads(run[2])["num_experts"] == 16 and run[3] == "toy-moe"
    assert run[4:7] == ("closed", 0, "train") and json.loads(run[7]) == {"note": "x"}
    # raw load, rank loads and plan arrays round-trip exactly
    p = plans[1, 1, 2]
    load, before, after, expert = con.execute(
        "SELECT load, rank_load_before, rank_load_after, expert_load FROM layer_loads "
        "WHERE step = 1 AND microbatch = 1 AND layer = 2").fetchone()
    assert np.array_equal(np.array(load), p.load_RE)
    assert before == p.rank_load_before_R.tolist() and after == p.rank_load_after_R.tolist()
    assert expert == p.expert_load_E.tolist()
    phy2log, quota, routes, nrep = con.execute(
        "SELECT phy2log, quota, routes, num_replicas FROM plans WHERE step = 1 AND microbatch = 1 AND layer = 2"
    ).fetchone()
    assert np.array_equal(np.array(phy2log), p.phy2log_RS) and np.array_equal(np.array(quota), p.quota_RS)
    assert routes is None and nrep == p.num_replicas  # routes only where asked (layer 0)
    routes0 = con.execute("SELECT routes FROM plans WHERE step = 1 AND microbatch = 1 AND layer = 0").fetchone()[0]
    assert np.array_equal(np.array(routes0), plans[1, 1, 0].routes_RRS)
    # imbalance derived in SQL equals ultraep.plan.metrics
    ib, ia = con.execute("SELECT imbalance_before, imbalance_after FROM layer_balance "
                         "WHERE step = 1 AND microbatch = 1 AND layer = 2").fetchone()
    assert ib == pytest.approx(p.imbalance_before) and ia == pytest.approx(p.imbalance_after)
    # transfers: same rows as plan.transfers, measured seconds joined by index
    rows = con.execute("SELECT expert, src, dst, bytes, stage, measured_s FROM transfer_detail "
                       "WHERE step = 1 AND microbatch = 1 AND layer = 2 ORDER BY idx").fetchall()
    assert [r[:5] for r in rows] == [tuple(d.values()) for d in
                                     [{k: r[k] for k in ("expert", "src", "dst", "bytes", "stage")}
                                      for r in p.transfers.rows()]]
    assert all(r[5] == pytest.approx(1e-3) for r in rows)
    # decisions keep the predictions map; timings split known keys and `other`
    pred = con.execute("SELECT predictions['none'], chosen_predicted_s FROM decisions LIMIT 1").fetchone()
    assert pred == (pytest.approx(3e-3), pytest.approx(1e-3))
    t = con.execute("SELECT plan_s, dispatch_s, experts_s, other['custom_s'] FROM timings LIMIT 1").fetchone()
    assert t == (pytest.approx(1e-4), pytest.approx(2e-4), None, pytest.approx(7.0))
    # OpenTelemetry: one step span per step with aggregate children, metric points with units
    names = dict(con.execute("SELECT name, count(*) FROM spans GROUP BY 1").fetchall())
    assert names == {semconv.SPAN_STEP: 3, semconv.SPAN_PLAN: 3, semconv.SPAN_TRANSFER: 3}
    attrs = json.loads(con.execute("SELECT attributes_json FROM spans WHERE name = 'ultraep.step' "
                                   "ORDER BY start_time LIMIT 1").fetchone()[0])
    assert attrs[semconv.ATTR_PLAN_COUNT] == 8 and attrs[semconv.ATTR_LOSS] == 1.0
    assert attrs[semconv.ATTR_TRANSFER_BYTES] == sum(int(plans[0, m, l].transfers.bytes.sum())
                                                     for m in range(2) for l in range(4))
    parents = con.execute("SELECT count(*) FROM spans c JOIN spans p ON c.parent_span_id = p.span_id "
                          "WHERE p.name = 'ultraep.step'").fetchone()[0]
    assert parents == 6
    units = dict(con.execute("SELECT name, any_value(unit) FROM metric_points GROUP BY 1").fetchall())
    assert units[semconv.METRIC_TRANSFER_BYTES] == "By" and units[semconv.METRIC_TOKENS] == "{token}"
    assert units[semconv.METRIC_STEP_DURATION] == "s"
    total_bytes = con.execute("SELECT max(value) FROM metric_points WHERE name = $n",
                              {"n": semconv.METRIC_TRANSFER_BYTES}).fetchone()[0]
    assert total_bytes == sum(int(p.transfers.bytes.sum()) for p in plans.values())


def test_bad_values_are_dropped_counted_and_the_rest_is_kept(tmp_path, caplog):
    plan = make_plan(1)
    with caplog.at_level(logging.WARNING, logger="ultraep.telemetry"):
        rec = Recorder.open(tmp_path, "bad", flush_interval_s=None)
        rec.record_plan(0, 0, 0, plan)
        rec.record_plan(1.5, 0, 1, plan)          # a float step: refused, not truncated
        rec.record_plan(0, 0, 2, None)            # not a plan
        rec.record_plan(0, 0, 3, plan)
        rec.record_timings(0, 0, 0, {"plan_s": 1e-3})
        rec.record_timings(0, 0, 1, {"plan_s": "fast"})   # not a number
        rec.record_timings(0, 0, 2, {"plan_s": np.float32(2.0)})  # numpy scalars are fine
        rec.record_decision(0, 0, 0, policy="quota", reason="ok", predictions={"quota": 1.0})
        rec.record_decision(0, 0, 1, policy=None, reason="no policy", predictions={"quota": "x"})
        rec.record_timings(0, 0, 3, "not a dict")  # fails on the hot path already
        rec.record_step(0, loss=np.float32(0.5))
        rec.record_step("one", loss=0.1)
        rec.close()
    assert rec.errors == 6 and rec.dropped_rows == 5
    con = open_run(tmp_path / "bad")
    assert sorted(r[0] for r in con.execute("SELECT layer FROM plans").fetchall()) == [0, 3]
    assert sorted(r[0] for r in con.execute("SELECT layer FROM timings").fetchall()) == [0, 2]
    assert count(con, "decisions") == 1 and count(con, "steps") == 1
    assert con.execute("SELECT errors, first_error IS NOT NULL FROM runs").fetchone() == (6, True)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2  # the first failure, and the summary at close
    assert "6 recording failures" in warnings[-1].getMessage()


def test_unwritable_path_does_not_stop_a_training_loop(tmp_path, caplog):
    torch = pytest.importorskip("torch")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    with caplog.at_level(logging.WARNING, logger="ultraep.telemetry"):
        with Recorder.open(blocker / "runs", "r", flush_interval_s=0.01, flush_every=4) as rec:
            for step in range(20):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.record_plan(step, 0, 0, make_plan(step))
                rec.record_timings(step, 0, 0, {"plan_s": 1e-4})
                rec.record_step(step, loss=loss.item())
                rec.flush()
                losses.append(loss.item())
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert rec.errors > 0 and rec.dropped_rows > 0
    assert "NotADirectoryError" in rec.first_error or "FileExistsError" in rec.first_error
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2  # logged once, then summarised at close


def test_disk_full_mid_run_keeps_what_was_written(tmp_path, monkeypatch):
    real_write = ParquetSink.write
    state = {"full": False}

    def write(self, table, data):
        if state["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, table, data)

    monkeypatch.setattr(ParquetSink, "write", write)
    rec = Recorder.open(tmp_path, "full", flush_interval_s=None)
    for step in range(6):
        if step == 3:
            state["full"] = True
        rec.record_plan(step, 0, 0, make_plan(step))
        rec.record_step(step, loss=1.0)
        rec.flush()
    state["full"] = False  # space comes back: later flushes succeed again
    rec.record_plan(6, 0, 0, make_plan(6))
    rec.close()
    assert rec.errors > 0 and "No space left" in rec.first_error
    con = open_run(tmp_path / "full")
    assert sorted(r[0] for r in con.execute("SELECT step FROM plans").fetchall()) == [0, 1, 2, 6]
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "closed"


def test_null_recorder_has_the_same_interface_and_does_nothing(tmp_path):
    public = [m for m in dir(Recorder) if not m.startswith("_") and callable(getattr(Recorder, m))]
    for name in public:
        assert hasattr(NullRecorder, name), name
        if name != "open":
            assert inspect.signature(getattr(NullRecorder, name)) == inspect.signature(getattr(Recorder, name)), name
    rec = NullRecorder()
    with rec:
        rec.record_plan(0, 0, 0, None)
        rec.record_decision(0, 0, 0, policy="none", reason="off")
        rec.record_timings(0, 0, 0, {})
        rec.record_transfer_times(0, 0, 0, [])
        rec.record_step(0)
        with rec.span("x"):
            pass
    assert rec.errors == 0 and list(tmp_path.iterdir()) == []


def test_hot_path_is_cheap_and_never_flushes_inline():
    plan = make_plan(0)
    sink = MemorySink()
    rec = Recorder.open(sink, "hot", flush_interval_s=60.0, flush_every=1 << 20, max_pending=1 << 20)
    import time

    t0 = time.perf_counter()
    for i in range(20000):
        rec.record_plan(i // 64, 0, i % 64, plan)
    per_call = (time.perf_counter() - t0) / 20000
    assert sink.num_rows("plans") == 0  # nothing written from the hot path
    rec.close()
    assert sink.num_rows("plans") == 20000
    assert per_call < 50e-6  # loose (shared CI machine); the benchmark measures the real figure


class _HeldPlansSink(MemorySink):
    """A store whose plan writes wait until released: the flusher can take at most one batch of plans while the
    caller records, so what is held, written and dropped does not depend on when the flusher thread runs."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, table: str, data) -> None:
        if table == "plans":
            self.release.wait(30)
        super().write(table, data)


def test_overflow_drops_and_counts_instead_of_growing(tmp_path):
    sink = _HeldPlansSink()
    rec = Recorder.open(sink, "ovf", flush_interval_s=60.0, flush_every=10, max_pending=10)
    plan = make_plan(0)
    for i in range(25):
        rec.record_plan(0, 0, i, plan)
    # 10 records wait; the flusher took the first 10 (5 dropped) or had not run yet (15 dropped)
    assert rec.dropped_rows in (5, 15) and rec.errors == 1
    sink.release.set()
    rec.close()
    assert sink.num_rows("plans") + rec.dropped_rows == 25 and sink.num_rows("plans") <= 20


def test_records_after_close_are_ignored():
    sink = MemorySink()
    rec = Recorder.open(sink, "c", flush_interval_s=None)
    rec.close()
    rec.record_plan(0, 0, 0, make_plan(0))
    rec.record_step(0)
    rec.flush()
    rec.close()
    assert sink.num_rows("plans") == 0 and rec.errors == 0


def test_memory_sink_has_the_same_views():
    sink = MemorySink()
    with Recorder.open(sink, "mem", kind="simulation", flush_interval_s=None) as rec:
        plans = record_run(rec, steps=2, microbatches=1, layers=2)
    con = sink.connect()
    assert count(con, "layer_balance") == len(plans)
    assert con.execute("SELECT kind FROM runs").fetchone()[0] == "simulation"


def test_open_rejects_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="kind: must be one of train, prefill, simulation"):
        Recorder.open(tmp_path, "x", kind="inference")
    with pytest.raises(ConfigError, match=r"rank: \(4\) must be in 0..3"):
        Recorder.open(tmp_path, "x", world_size=4, rank=4)
    with pytest.raises(ConfigError, match="run_name"):
        Recorder.open(tmp_path, "../escape")
    with pytest.raises(ConfigError, match="run_name: is required when world_size"):
        Recorder.open(tmp_path, None, world_size=2, rank=1)
    assert list(tmp_path.iterdir()) == []


def test_generated_run_id_and_runs_directory(tmp_path):
    for _ in range(2):
        with Recorder.open(tmp_path, flush_interval_s=None) as rec:
            rec.record_plan(0, 0, 0, make_plan(0))
    con = open_run(tmp_path)  # a directory of runs
    ids = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM layer_balance ORDER BY 1").fetchall()]
    assert len(ids) == 2 and all(len(i) == len("20260101-000000-abcdef") for i in ids)


def test_export_to_one_duckdb_file(tmp_path):
    with Recorder.open(tmp_path / "runs", "e", flush_interval_s=None) as rec:
        plans = record_run(rec, steps=1, microbatches=1, layers=3)
    out = export_run(tmp_path / "runs" / "e", tmp_path / "e.duckdb")
    con = open_run(out)
    assert count(con, "layer_balance") == len(plans) and count(con, "runs") == 1
    live = open_run(tmp_path / "runs" / "e")
    q = "SELECT * FROM transfer_detail ORDER BY step, microbatch, layer, idx"
    assert con.execute(q).fetchall() == live.execute(q).fetchall()
    con.close()
    with pytest.raises(ultraep.UltraEPError, match="already exists"):
        export_run(tmp_path / "runs" / "e", out)


def test_schema_sql_matches_semconv_and_the_written_parts(tmp_path):
    import duckdb

    con = duckdb.connect()
    tables, views = schema_statements()
    assert len(tables) == len(semconv.RAW_TABLES) and len(views) == len(semconv.VIEWS)
    for stmt in tables:
        con.execute(stmt)
    for table, cols in semconv.TABLES.items():
        described = [(r[0], r[1]) for r in con.execute(f"DESCRIBE {table}").fetchall()]
        assert described == list(cols), table
    # what the writers produce reads back with exactly those types
    with Recorder.open(tmp_path, "s", flush_interval_s=None) as rec:
        record_run(rec, steps=1, microbatches=1, layers=1)
    live = open_run(tmp_path / "s")
    for table, cols in semconv.TABLES.items():
        glob = str(tmp_path / "s" / table / "*.parquet")
        got = [(r[0], r[1]) for r in live.execute("DESCRIBE SELECT * FROM read_parquet(?)", [glob]).fetchall()]
        assert got == list(cols), table


def test_otel_exporters_from_standard_env_vars(tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    # ConsoleSpanExporter's default stream is the sys.stdout of the moment its module was first imported,
    # perhaps under an earlier test's capture: give it the real stdout, whose file descriptor capfd captures.
    from opentelemetry.sdk.trace import export

    defaults = export.ConsoleSpanExporter.__init__.__defaults__
    monkeypatch.setattr(export.ConsoleSpanExporter.__init__, "__defaults__", (defaults[0], sys.__stdout__, *defaults[2:]))
    with Recorder.open(tmp_path, "otel", flush_interval_s=None) as rec:
        rec.record_step(0, loss=1.0, step_time_s=0.01)
    assert '"name": "ultraep.step"' in capfd.readouterr().out
    con = open_run(tmp_path / "otel")
    assert con.execute("SELECT otel_exporters FROM runs").fetchone()[0] == "traces:console"
    # an exporter that is not installed: one warning, and the store still gets the spans
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "surely-not-installed")
    with caplog.at_level(logging.WARNING, logger="ultraep.telemetry"):
        with Recorder.open(tmp_path, "otel2", flush_interval_s=None) as rec:
            rec.record_step(0, loss=1.0)
    assert rec.errors == 0 and any("no such exporter" in r.getMessage() for r in caplog.records)
    assert count(open_run(tmp_path / "otel2"), "spans") == 1
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    with Recorder.open(tmp_path, "otel3", flush_interval_s=None) as rec:
        rec.record_step(0, loss=1.0)
    con = open_run(tmp_path / "otel3")
    assert count(con, "spans") == 0 and count(con, "steps") == 1


def test_user_spans(tmp_path):
    with Recorder.open(tmp_path, "sp", flush_interval_s=None) as rec:
        with rec.span("ultraep.checkpoint", step=3):
            pass
        with pytest.raises(KeyError):
            with rec.span("ultraep.failing"):
                raise KeyError("x")  # the user's exception propagates; the span records it
    con = open_run(tmp_path / "sp")
    assert con.execute("SELECT name, status FROM spans ORDER BY name").fetchall() == [
        ("ultraep.checkpoint", "UNSET"), ("ultraep.failing", "ERROR")]


def test_importing_telemetry_is_light():
    code = ("import sys; from ultraep.telemetry import Recorder, NullRecorder, open_run; "
            "print([m for m in ('duckdb', 'pyarrow', 'opentelemetry.sdk', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
