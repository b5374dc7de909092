"""`ultraep sql`, `ultraep report`, `ultraep export` and the canned queries on a recorded run; user
mistakes exit 2 with one line and no traceback."""

import csv
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import ultraep
from ultraep.cli import main
from ultraep.telemetry import Recorder, open_run, queries

TOPO = ultraep.Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1000)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run of 2 steps x 3 layers: layers 0-1 `quota`, layer 2 `none`; hand-made load so numbers are known."""
    root = tmp_path_factory.mktemp("runs")
    with Recorder.open(root, "demo", model="toy", flush_interval_s=None) as rec:
        for step in range(2):
            for layer in range(3):
                load = np.full((4, 8), 10, dtype=np.int64)
                load[:, 0] = 70  # expert 0 (home rank 0) is hot: rank 0 gets 4*(70+10) = 320, others 80
                policy = "none" if layer == 2 else "quota"
                plan = ultraep.plan_layer(load, policy, topology=TOPO)
                rec.record_plan(step, 0, layer, plan)
                rec.record_decision(step, 0, layer, policy=policy, reason="test",
                                    predictions={"quota": 2e-3, "none": 4e-3},
                                    chosen_predicted_s=2e-3 if policy == "quota" else 4e-3)
                rec.record_timings(step, 0, layer, {"measured_s": 3e-3 if policy == "quota" else 4e-3})
                rec.record_transfer_times(step, 0, layer, [1e-6] * len(plan.transfers))
            rec.record_step(step, loss=2.0 - step, step_time_s=0.1)
    return root / "demo"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ultraep.cli", *args], capture_output=True, text=True)


def test_sql_table_csv_json(run_dir, capsys):
    q = "SELECT layer, max(imbalance_before) AS b FROM layer_balance GROUP BY layer ORDER BY layer"
    assert main(["sql", str(run_dir), q]) == 0
    out = capsys.readouterr().out
    assert "imbalance" not in out and "3 rows" in out and "┃ layer" in out
    assert main(["sql", str(run_dir), q, "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    # rank load before: [320, 80, 80, 80] -> max / mean = 320 / 140
    assert rows[0] == ["layer", "b"] and float(rows[1][1]) == pytest.approx(320 / 140)
    assert main(["sql", str(run_dir), "SELECT step, loss, steps.ts, rank_load_after FROM layer_loads "
                 "JOIN steps USING (run_id, rank, step) WHERE layer = 2 ORDER BY step", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["loss"] for d in data] == [2.0, 1.0] and data[0]["rank_load_after"] == [320, 80, 80, 80]
    assert isinstance(data[0]["ts"], str)


def test_report_sections(run_dir, capsys):
    assert main(["report", str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == {q.name for q in queries.REPORT} | {"answer"}
    (ov,) = rep["overview"]
    assert (ov["run_id"], ov["status"], ov["steps"], ov["plans"], ov["layers"]) == ("demo", "closed", 2, 6, 3)
    layers = {r["layer"]: r for r in rep["layer_summary"]}
    assert layers[2]["mean_after"] == pytest.approx(320 / 140)  # `none` leaves the imbalance
    assert layers[0]["mean_after"] < layers[0]["mean_before"]
    shares = {r["policy"]: r["share"] for r in rep["policy_shares"]}
    assert shares == {"quota": pytest.approx(2 / 3), "none": pytest.approx(1 / 3)}
    assert sum(r["bytes"] for r in rep["transfer_summary"]) == ov["transfer_bytes"] > 0
    pred = {r["policy"]: r for r in rep["prediction_summary"]}
    assert pred["quota"]["measured_over_predicted"] == pytest.approx(1.5)
    assert pred["none"]["mean_abs_rel_error"] == pytest.approx(0.0)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.lstrip().startswith("Did balancing pay?")
    assert "Balance (plan quality" in out and "policies chosen" in out and "Prediction quality" in out


def test_every_canned_query_runs_with_bound_parameters(run_dir):
    con = open_run(run_dir)
    for q in queries.ALL.values():
        params = {"layer": 0, "step": 1} if "layer" in q.params else {}
        if "step" not in q.params:
            params.pop("step", None)
        cols, rows = queries.run(con, q, run_id="demo", **params)
        assert cols and "$" not in "".join(cols), q.name
        assert queries.arrow(con, q, run_id="nope", **params).num_rows == 0, q.name
    cols, rows = queries.run(con, "rank_load", run_id="demo", layer=0, step=1)
    assert [r[cols.index("load_before")] for r in rows] == [320, 80, 80, 80]
    assert sum(r[cols.index("load_after")] for r in rows) == 560
    cols, rows = queries.run(con, "expert_load", layer=1)
    assert {(r[2], r[3]): r[4] for r in rows}[(0, 0)] == 280
    cols, rows = queries.run(con, "transfer_bytes_per_step")
    assert all(r[cols.index("busiest_sender_bytes")] >= 1000 for r in rows)
    with pytest.raises(TypeError, match="takes run_id"):
        queries.run(con, "overview", layer=3)


def test_queries_bind_values_never_format_them():
    for q in queries.ALL.values():
        assert "{" not in q.sql and "%s" not in q.sql, q.name
        for p in q.params:
            assert f"${p}" in q.sql, (q.name, p)


def test_export_then_query_the_file(run_dir, tmp_path, capsys):
    out = tmp_path / "demo.duckdb"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert main(["sql", str(out), "SELECT count(*) AS n FROM layer_balance", "--csv"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "6"
    assert main(["export", str(run_dir), str(out), "--force"]) == 0


@pytest.mark.parametrize("make_args, fragment", [
    (lambda d, t: ["sql", str(t / "missing"), "SELECT 1"], "no such run directory"),
    (lambda d, t: ["sql", str(d), "SELEC nonsense"], "query: Parser Error"),
    (lambda d, t: ["sql", str(d), "SELECT * FROM no_such_table"], "query: Catalog Error"),
    (lambda d, t: ["report", str(t), "--json"], "holds no recorded ultraep run"),
    (lambda d, t: ["report", str(d), "--run-id", "other"], "--run-id: 'other' is not in"),
    (lambda d, t: ["export", str(d), str(d / "runs_log" / next((d / "runs_log").iterdir()).name)],
     "already exists"),
    (lambda d, t: ["sql", str(t / "not.duckdb"), "SELECT 1"], "no such run"),
])
def test_user_mistakes_exit_2_with_one_line(run_dir, tmp_path, capsys, make_args, fragment):
    assert main(make_args(run_dir, tmp_path)) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_subprocess_exit_codes(run_dir, tmp_path):
    """Through the installed entry point: success prints the rows; a mistake is one line and exit 2."""
    ok = run_cli("sql", str(run_dir), "SELECT count(*) FROM plans", "--csv")
    assert ok.returncode == 0 and ok.stdout.split() == ["count_star()", "6"]
    (tmp_path / "garbage.duckdb").write_bytes(b"not a database")
    bad = run_cli("report", str(tmp_path / "garbage.duckdb"))
    assert bad.returncode == 2 and bad.stderr.startswith("ultraep: error:") and "Traceback" not in bad.stderr
    assert "is not a readable DuckDB file" in bad.stderr
