"""What an adaptive run spent on probes (issue 56, item 3): the ``exploration`` view, ``run_summary``'s columns, the
report's section and the dashboard's Policies figures all give the probes' share of the chosen calls and what they
cost as measured against the policy in force's calls beside them."""

import numpy as np
import pytest

import ultraep
from ultraep.telemetry import Recorder, open_run

TOPO = ultraep.Topology(num_ranks=2, num_experts=8, num_redundant_slots=1, expert_bytes=1 << 20)

# one layer, 12 steps (step 0 warm-up): quota in force at 10 ms, probes of eplb at steps 3 (14 ms) and 7 (a
# confirmation, 12 ms); the warm-up step is a probe too (left out)
CALLS = [("probe: eplb has not run yet (kept none)", "eplb", 0.5)] + [
    ("switch to quota", "quota", 0.010), ("kept quota", "quota", 0.010),
    ("probe: eplb last ran 2 decisions ago (kept quota)", "eplb", 0.014), ("kept quota", "quota", 0.010),
    ("kept quota", "quota", 0.011), ("kept quota", "quota", 0.009),
    ("confirm: eplb 3 % faster; eplb last measured 4 decisions ago (kept quota)", "eplb", 0.012),
    ("kept quota", "quota", 0.011), ("kept quota", "quota", 0.010), ("kept quota", "quota", 0.010),
    ("kept quota", "quota", 0.010)]


def _record(root, name="adaptive-1", calls=CALLS, configured=None):
    with Recorder.open(root, name, model="toy", world_size=2, flush_interval_s=None) as rec:
        for step, (reason, policy, t) in enumerate(calls):
            load = np.full((2, 8), 10, dtype=np.int64)
            load[:, 0] = 70
            rec.record_plan(step, 0, 0, ultraep.plan_layer(load, "none", topology=TOPO))
            why = reason if configured is None else f"configured policy {configured}"
            rec.record_decision(step, 0, 0, policy=policy, reason=why, predictions={policy: 0.01},
                                chosen_predicted_s=0.01)
            rec.record_timings(step, 0, 0, {"measured_s": t})
            rec.record_step(step, step_time_s=t, warmup=step == 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _record(root)
    _record(root, "quota-1", configured="quota")  # a fixed policy: nothing chosen, no exploration row
    return root


def test_the_view_counts_the_probes_and_their_measured_cost(runs):
    con = open_run(runs)
    rows = con.execute("SELECT * FROM exploration ORDER BY run_id").fetchall()
    cols = [d[0] for d in con.description]
    assert len(rows) == 1
    x = dict(zip(cols, rows[0]))
    assert x["run_id"] == "adaptive-1" and x["chosen_calls"] == 11 and x["probe_calls"] == 2  # warm-up left out
    assert x["probe_share"] == pytest.approx(2 / 11)
    # step 3: 14 ms against (10 + 10) / 2; step 7: 12 ms against (9 + 11) / 2
    assert x["probe_cost_s"] == pytest.approx(0.004 + 0.002)
    total = sum(t for _, _, t in CALLS[1:])
    assert x["probe_cost_share"] == pytest.approx(0.006 / total)
    got = dict(con.execute("SELECT run_id, probe_share FROM run_summary").fetchall())
    assert got["adaptive-1"] == pytest.approx(2 / 11) and got["quota-1"] is None


def test_a_probe_at_the_end_is_costed_against_the_call_before_it(tmp_path):
    _record(tmp_path, calls=CALLS[:4])  # the probe at step 3 is the last call: only quota's call before it
    x = open_run(tmp_path).execute("SELECT probe_calls, probe_cost_s FROM exploration").fetchone()
    assert x[0] == 1 and x[1] == pytest.approx(0.004)


def test_the_report_says_what_exploring_cost(runs, capsys):
    from ultraep.cli import main

    assert main(["report", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "Exploration" in out
    line = next(ln for ln in out.splitlines() if "adaptive-1" in ln and "18 %" in ln)  # 2 of 11 calls
    assert "6 ms" in line, line  # 4 + 2 ms over the policy in force


def test_the_dashboard_gives_the_same_figures(runs):
    from ultraep.dashboard import data
    from ultraep.dashboard.mirror import RunMirror

    m = RunMirror(runs / "adaptive-1") if (runs / "adaptive-1").is_dir() else RunMirror(runs, "adaptive-1")
    x = data.exploration(m)
    assert int(x["probe_calls"].iloc[0]) == 2 and int(x["chosen_calls"].iloc[0]) == 11
    assert float(x["probe_cost_s"].iloc[0]) == pytest.approx(0.006)


def test_the_policies_page_shows_the_probes(runs):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py"), default_timeout=60)
    at.session_state["ultraep_root"] = str(runs)
    at.run()
    at.switch_page("pages/policies.py")
    at.run()
    at.sidebar.selectbox(key="ultraep_run").set_value("adaptive-1").run()
    assert not at.exception
    captions = [c.value for c in at.caption]
    assert any("probes: 2 of 11 chosen layer calls (18.2%)" in c and "6.00 ms" in c for c in captions), captions
