"""Issue 15, item 3: the planners compile before anything is timed, and warm-up steps are marked.

``ultraep.planning.warm_up()`` plans tiny loads through every built-in policy so that numba compiles (or
loads from its cache) every signature real planning uses; ``ultraep.wrap`` and the planning CLI commands
call it. Checked here without paying a cold compile: after ``warm_up()``, planning realistic loads
(writeable and read-only, one and two scale-up domains) compiles no new numba signature anywhere.
On a cold cache the measured difference is ~18 s of warm-up, then sub-millisecond first plans (before:
3 s for the first quota plan inside the timed call, ~20 s over all planners).

What a first step still pays (allocations, first plans, autograd warm-up) is marked: the runtime records
its step 0 with ``warmup=True``, and the summaries (``ultraep report``'s queries, the dashboard's Overview)
leave warm-up steps out of their averages and summed times, saying "(warm-up excluded)".
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

import ultraep.planning
from dist_utils import run_ranks
from ultraep import BalancerConfig, Topology
from ultraep.cli import main
from ultraep.engine import Engine
from ultraep.policies import POLICIES, make_policy
from ultraep.telemetry import Recorder, open_run, queries


def _signatures() -> set:
    """Every compiled signature of every numba dispatcher in the planners and the cost model."""
    import ultraep.cost
    import ultraep.policies as pkg

    mods = [importlib.import_module(f"{p.__name__}.{m.name}") for p in (ultraep.cost, pkg)
            for m in pkgutil.iter_modules(p.__path__)]
    out = set()
    for mod in mods:
        for name, obj in vars(mod).items():
            for sig in getattr(obj, "signatures", None) or ():
                if hasattr(obj, "py_func"):
                    out.add((mod.__name__, name, str(sig)))
    return out


def test_after_warm_up_real_planning_compiles_nothing():
    ultraep.planning.warm_up()
    before = _signatures()
    assert before, "warm_up compiled the planners"
    rng = np.random.default_rng(7)
    for domain_size in (None, 4):
        topo = Topology(num_ranks=8, num_experts=64, num_redundant_slots=3, domain_size=domain_size,
                        expert_bytes=3 << 20)
        for name in POLICIES:
            pol = make_policy(name)
            for step in range(4):
                load = rng.integers(0, 5000, size=(8, 64), dtype=np.int64)
                load[:, step] *= 40  # a hot expert that moves
                load.setflags(write=bool(step % 2))
                pol.commit(pol.plan(load, topo))
    assert _signatures() - before == set()


def test_planning_cli_commands_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ultraep.planning, "_WARM", {})
    assert main(["plan", "--synthetic", "--ranks", "4", "--experts", "8", "--tokens", "64", "--json"]) == 0
    assert "s" in ultraep.planning._WARM


def _wrap_warms_up(rank, world):
    import ultraep
    from ultraep.models import build_model

    ultraep.planning._WARM.clear()  # as in a fresh process: nothing compiled yet
    ultraep.wrap(build_model("qwen3-moe", layers=1), {"policy": "quota", "num_redundant_slots": 0})
    return "s" in ultraep.planning._WARM


def test_wrap_warms_up():
    assert run_ranks(_wrap_warms_up, 1, p2p=False) == [True]


def test_warm_up_is_idempotent():
    ultraep.planning.warm_up()
    assert ultraep.planning.warm_up() == 0.0


# --------------------------------------------------------------------------- warm-up steps in telemetry
WARM_TOPO = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1000)
LAYERS = 2


@pytest.fixture(scope="module")
def slow_first_step(tmp_path_factory):
    """4 steps x 2 layers under quota. Step 0 is a warm-up step as a cold start records it: 20 s of
    planning, 21 s measured, 10 s per transfer, a hot expert; steps 1-3 take 1e-4 s planning, 1e-3 s
    measured (predicted 1e-3), 1e-3 s per transfer, and only step 1 has the hot expert."""
    root = tmp_path_factory.mktemp("runs")
    with Recorder.open(root, "w", model="toy", flush_interval_s=None) as rec:
        engine = Engine(BalancerConfig(policy="quota", num_redundant_slots=1), WARM_TOPO, recorder=rec)
        for step in range(4):
            warm = step == 0
            for layer in range(LAYERS):
                load = np.full((4, 8), 100, dtype=np.int64)
                if step < 2:
                    load[:, 0] = 5000
                d = engine.decide(step, 0, layer, load)
                engine.commit(d)
                rec.record_timings(step, 0, layer, {"plan_s": 20.0 if warm else 1e-4, "measured_s": 21.0 if warm else 1e-3,
                                                    "predicted_s": 1e-3, "transfer_s": 5.0 if warm else 1e-4})
                rec.record_transfer_times(step, 0, layer, [10.0 if warm else 1e-3] * len(d.plan.transfers))
            rec.record_step(step, step_time_s=42.0 if warm else 0.01, warmup=warm)
    assert rec.errors == 0, rec.first_error
    return root / "w"


def _one(con, sql):
    return con.execute(sql).fetchone()


def _rows(con, query) -> list[dict]:
    cols, rows = queries.run(con, query)
    return [dict(zip(cols, r)) for r in rows]


def test_warmup_flag_is_stored_and_viewed(slow_first_step):
    con = open_run(slow_first_step)
    assert con.execute("SELECT step, warmup FROM steps ORDER BY step").fetchall() == [
        (0, True), (1, False), (2, False), (3, False)]
    assert con.execute("SELECT step FROM warmup_steps").fetchall() == [(0,)]
    assert [r["warmup"] for r in _rows(con, queries.STEP_SUMMARY)] == [True, False, False, False]
    # the step span says so too (OTel attribute ultraep.warmup), only on step 0
    spans = con.execute("SELECT attributes_json FROM spans WHERE name = 'ultraep.step' ORDER BY start_time").fetchall()
    assert ['"ultraep.warmup": true' in a[0] for a in spans] == [True, False, False, False]


def test_report_averages_leave_the_slow_first_step_out(slow_first_step):
    con = open_run(slow_first_step)
    settled = "FROM layer_balance WHERE step > 0"
    ov = _rows(con, queries.OVERVIEW)[0]
    assert (ov["steps"], ov["warmup_steps"], ov["plans"]) == (4, 1, 4 * LAYERS)  # counts keep every step
    expected_before = _one(con, f"SELECT avg(imbalance_before) {settled}")[0]
    assert expected_before < _one(con, "SELECT avg(imbalance_before) FROM layer_balance")[0]  # the test can fail
    assert ov["mean_imbalance_before"] == pytest.approx(expected_before)
    assert ov["mean_imbalance_after"] == pytest.approx(_one(con, f"SELECT avg(imbalance_after) {settled}")[0])
    for row in _rows(con, queries.LAYER_SUMMARY):
        assert row["plans"] == 4
        assert row["max_before"] == pytest.approx(_one(con, f"SELECT max(imbalance_before) {settled}")[0])
    pred = _rows(con, queries.PREDICTION_SUMMARY)
    assert [(r["samples"], r["mean_measured_s"]) for r in pred] == [(3 * LAYERS, pytest.approx(1e-3))]
    moved = _rows(con, queries.TRANSFER_SUMMARY)
    assert moved and all(r["measured_s"] == pytest.approx(1e-3 * r["measured"]) for r in moved)
    assert sum(r["transfers"] for r in moved) == _one(con, "SELECT count(*) FROM transfer_detail")[0]
    cmp = _rows(con, queries.POLICY_COMPARISON)
    assert [(r["plans"], r["mean_measured_s"]) for r in cmp] == [(4 * LAYERS, pytest.approx(1e-3))]
    assert all(q.title.endswith("(warm-up excluded)") for q in queries.REPORT if q is not queries.POLICY_SHARES)


def test_report_cli_says_warmup_excluded(slow_first_step, capsys):
    assert main(["report", str(slow_first_step)]) == 0
    out = capsys.readouterr().out
    assert "(warm-up excluded)" in out and "21.0" not in out


def test_dashboard_overview_leaves_the_slow_first_step_out(slow_first_step):
    pytest.importorskip("pandas")
    from ultraep.dashboard import data
    from ultraep.dashboard.mirror import RunMirror

    h = data.headline(RunMirror(slow_first_step))
    assert (h["steps"], h["warmup_steps"], h["plans"]) == (4, 1, 4 * LAYERS)
    assert h["plan_s"] == pytest.approx(3 * LAYERS * 1e-4)  # was 40 s of a 42 s total: "planning 95 %"
    assert h["time_s"] == pytest.approx(3 * LAYERS * 1e-3)
    assert h["plan_share"] == pytest.approx(0.1)
    assert h["transfer_s"] == pytest.approx(3 * LAYERS * 1e-4)
    con = open_run(slow_first_step)
    assert h["mean_imbalance_before"] == pytest.approx(
        _one(con, "SELECT avg(imbalance_before) FROM layer_balance WHERE step > 0")[0])


def test_warmup_must_be_a_bool(tmp_path):
    with Recorder.open(tmp_path, "b", flush_interval_s=None, otel=False) as rec:
        rec.record_step(0, warmup=np.bool_(True))
        rec.record_step(1, warmup=1)  # refused, not silently a warm-up step
    assert rec.errors == 1 and "expected a bool" in rec.first_error
    assert open_run(tmp_path / "b").execute("SELECT step, warmup FROM steps").fetchall() == [(0, True)]


def _two_recorded_steps(rank, world, runs):
    import torch

    import ultraep
    from ultraep.models import build_model

    model = build_model("qwen3-moe", layers=1)
    with Recorder.open(runs, "rt", world_size=world, rank=rank, flush_interval_s=None, otel=False) as rec:
        ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 0}, recorder=rec)
        for step in range(2):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids).logits.sum().backward()
            ultraep.runtime_of(model).next_step(loss=1.0)
    return rec.errors


def test_runtime_marks_its_first_step_warmup(tmp_path):
    assert run_ranks(_two_recorded_steps, 1, tmp_path, p2p=False) == [0]
    con = open_run(tmp_path)
    assert con.execute("SELECT step, warmup FROM steps ORDER BY step").fetchall() == [(0, True), (1, False)]


def test_dashboard_summaries_match_the_canned_queries_without_warmup(slow_first_step):
    pytest.importorskip("pandas")
    from ultraep.dashboard import data
    from ultraep.dashboard.mirror import RunMirror

    mirror, con = RunMirror(slow_first_step), open_run(slow_first_step)
    layers = data.layer_summary(mirror)
    for row, want in zip(layers.to_dict("records"), _rows(con, queries.LAYER_SUMMARY), strict=True):
        assert row["plans"] == want["plans"] and row["mean_before"] == pytest.approx(want["mean_before"])
        assert row["max_before"] == pytest.approx(want["max_before"])
    pred = data.prediction_summary(mirror)
    assert list(pred["samples"]) == [3 * LAYERS] and list(pred["mean_measured_s"]) == [pytest.approx(1e-3)]
    moved = data.transfer_layers(mirror)
    for row, want in zip(moved.to_dict("records"), _rows(con, queries.TRANSFER_SUMMARY), strict=True):
        assert (row["transfers"], row["measured"]) == (want["transfers"], want["measured"])
        assert row["measured_s"] == pytest.approx(want["measured_s"])
    cmp, _ = data.compare_runs([mirror])
    assert list(cmp["plans"]) == [4 * LAYERS] and list(cmp["mean_measured_s"]) == [pytest.approx(1e-3)]
