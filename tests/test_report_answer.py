"""`ultraep report` leads with the measured answer (issue 32): step time p50 and the speed-up over the baseline the
run recorded (or one named with --baseline), a labelled estimate without one; its sections fit 120 columns with
headers broken only between words; the warm-up step is a one-time cost, not part of the p50."""

import json
import re

import numpy as np
import pytest

import ultraep
from ultraep.cli import main
from ultraep.telemetry import Recorder, answer, open_run

TOPO = ultraep.Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1 << 20)
# per-step times (s): step 0 is warm-up (a compile: 5 s); balanced steps take half of the baseline's
TIMES = {"base": [5.0, 0.20, 0.22, 0.18, 0.20], "bal": [5.0, 0.10, 0.11, 0.09, 0.10]}


def _record(root, name, policy, times, extra, predictions=None):
    with Recorder.open(root, name, model="toy", world_size=4, flush_interval_s=None,
                       extra={"policy": policy, **extra}) as rec:
        for step, t in enumerate(times):
            for layer in range(2):
                load = np.full((4, 8), 10, dtype=np.int64)
                load[:, 0] = 70
                plan = ultraep.plan_layer(load, policy, topology=TOPO)
                rec.record_plan(step, 0, layer, plan)
                preds = predictions or {policy: 1e-2}
                rec.record_decision(step, 0, layer, policy=policy, reason="test", predictions=preds,
                                    chosen_predicted_s=preds[policy])
                rec.record_timings(step, 0, layer, {"measured_s": 2e-2, "experts_s": 1e-2, "plan_s": 1e-3})
            rec.record_step(step, loss=1.0, step_time_s=t, warmup=step == 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _record(root, "demo-1-none", "none", TIMES["base"], {})
    _record(root, "demo-1-quota", "quota", TIMES["bal"], {"baseline": "demo-1-none"})
    # no baseline, but the cost model predicted none: 30 ms more per layer call than quota, 2 layers a step
    _record(root, "solo-quota", "quota", TIMES["bal"], {}, predictions={"quota": 1e-2, "none": 4e-2})
    return root


def test_measured_speedup_over_the_recorded_baseline(runs):
    con = open_run(runs)
    a = answer.answer(con, "demo-1-quota")
    assert a.basis == "measured" and a.baseline_id == "demo-1-none"
    assert a.steps.p50_s == pytest.approx(0.10) and a.baseline_p50_s == pytest.approx(0.20)  # warm-up left out
    assert a.speedup == pytest.approx(2.0) and a.steps.warmup_time_s == pytest.approx(5.0)
    assert answer.answer(con, "demo-1-none").basis == "baseline"


def test_without_a_baseline_the_estimate_is_labelled(runs):
    con = open_run(runs)
    a = answer.answer(con, "solo-quota")
    assert a.basis == "estimate" and a.estimate_source == "cost model"
    assert a.estimated_none_s == pytest.approx(0.10 + 2 * 0.03)
    assert "ESTIMATE" in answer.headline(a) and "measured" not in answer.headline(a).split("ESTIMATE")[0]


def test_report_leads_with_the_answer_and_fits_120_columns(runs, capsys):
    assert main(["report", str(runs)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 120
    first_section = next(i for i, x in enumerate(lines) if x.startswith("Did balancing pay?"))
    assert first_section <= 2
    assert re.search(r"quota\s+│ quota\s+│\s+4 │\s+100 ms │.*2\.00x vs demo-1-none", out), out[:2000]
    assert "Measured step time: per step the slowest rank's" in out and "simulation" not in out
    assert "~1.60x (estimate)" in out
    # headers break between words only: every header word appears whole somewhere in its table
    for word in ("step", "time", "p50", "imbalance", "straggler", "transfers", "recording", "errors", "warm-up"):
        assert re.search(rf"\b{re.escape(word)}\b", out), word
    assert "world_siz" not in out and "_s " not in out


def test_report_json_carries_the_answer(runs, capsys):
    assert main(["report", str(runs), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    ans = {r["run_id"]: r for r in rep["answer"]}
    assert ans["demo-1-quota"]["speedup"] == pytest.approx(2.0) and ans["demo-1-quota"]["basis"] == "measured"


def test_a_single_run_directory_finds_its_baseline_beside_it(runs, capsys):
    assert main(["report", str(runs / "demo-1-quota"), "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)["answer"]
    assert a["basis"] == "measured" and a["speedup"] == pytest.approx(2.0)


def test_baseline_flag_names_one(runs, capsys):
    assert main(["report", str(runs / "solo-quota"), "--baseline", str(runs / "demo-1-none"), "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)["answer"]
    assert a["basis"] == "measured" and a["baseline_id"] == "demo-1-none" and a["speedup"] == pytest.approx(2.0)


def test_baseline_flag_mistakes_are_one_line(runs, tmp_path, capsys):
    assert main(["report", str(runs), "--baseline", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--baseline: 'nope' is neither a run" in err
    with Recorder.open(tmp_path, "other", model="another-model", world_size=4, flush_interval_s=None) as rec:
        rec.record_step(0, step_time_s=0.1)
    assert main(["report", str(runs / "solo-quota"), "--baseline", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be the baseline of solo-quota: its model is 'another-model'" in err


def test_the_readmes_query_agrees_with_the_report(runs, capsys):
    """README: `... FROM layer_balance WHERE NOT warmup GROUP BY layer` gives the report's per-layer means."""
    con = open_run(runs)
    readme = dict((r[0], r[1:]) for r in con.execute(
        "SELECT layer, avg(imbalance_before), avg(imbalance_after) FROM layer_balance WHERE NOT warmup "
        "AND run_id = 'demo-1-quota' GROUP BY layer ORDER BY layer").fetchall())
    assert main(["report", str(runs), "--run-id", "demo-1-quota", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for row in rep["layer_summary"]:
        assert readme[row["layer"]] == pytest.approx((row["mean_before"], row["mean_after"]))
    # the warm-up step is marked, not dropped: the view keeps every step
    n = con.execute("SELECT count(*) FILTER (WHERE warmup), count(*) FROM layer_balance WHERE run_id = "
                    "'demo-1-quota'").fetchone()
    assert n == (2, 10)


def test_run_summary_has_one_row_per_run(tmp_path):
    for rank in range(2):  # two ranks of one run: `runs` has a row for each, run_summary one
        with Recorder.open(tmp_path, "two", model="toy", world_size=2, rank=rank, flush_interval_s=None,
                           extra={"baseline": "base"}, config=ultraep.BalancerConfig(policy="quota")) as rec:
            rec.record_step(0, step_time_s=0.1, warmup=True)
            rec.record_step(1, step_time_s=0.1 + rank)
    con = open_run(tmp_path)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
    assert con.execute("SELECT run_id, ranks_recording, policy, baseline, steps, warmup_steps, status "
                       "FROM run_summary").fetchall() == [("two", 2, "quota", "base", 2, 1, "closed")]
    st = answer.step_times(con)["two"]
    assert st.p50_s == pytest.approx(1.1)  # the slowest rank's time of the step


def test_dashboard_overview_and_compare_lead_with_the_same_answer(runs):
    """Overview: the first figures are the measured step time and speed-up; Compare: each run's p50 and speed-up;
    both equal `ultraep report`'s (the same telemetry.answer)."""
    pytest.importorskip("streamlit")
    from test_dashboard import app, select_run

    at = select_run(app(runs), "demo-1-quota")
    assert not at.exception, [e.value for e in at.exception]
    labels = [m.label for m in at.metric]
    assert labels[:3] == ["step time p50 (measured)", "speed-up over none", "warm-up (one-time)"]
    m = {x.label: x.value for x in at.metric}
    assert (m["step time p50 (measured)"], m["speed-up over none"], m["warm-up (one-time)"]) == (
        "100 ms", "2.00x", "5.00 s")
    assert labels.index("plan quality: % of ideal") > 2
    at = select_run(app(runs), "solo-quota")
    assert {x.label: x.value for x in at.metric}["speed-up over none (estimate)"] == "1.60x (estimate)"
    at = select_run(app(runs, "compare"), "demo-1-quota")
    assert not at.exception, [e.value for e in at.exception]
    table = next(df.value for df in at.dataframe if "step time p50 (ms, measured)" in df.value.columns)
    rows = {r["policy"]: r for r in table.to_dict("records")}
    assert rows["quota"]["step time p50 (ms, measured)"] == pytest.approx(100.0)
    assert rows["quota"]["speed-up"] == "2.00x" and rows["none"]["speed-up"] == "baseline"


def test_the_answer_names_the_registrys_baseline():
    from ultraep.policies import BASELINE

    assert answer.BASELINE_POLICY == BASELINE
