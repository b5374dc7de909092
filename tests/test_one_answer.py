"""One answer everywhere (issue 53): for one balanced run whose baseline run lives in the sibling directory
(what the demo writes: ``runs/<run id>/`` per run), ``ultraep report``, the dashboard and ``ultraep sql`` on
``run_summary`` give the same measured speed-up — with the run opened by its own directory and by its parent.
Opened by its directory, the store holds no baseline: the report and the dashboard look beside the run (one
function, :func:`ultraep.telemetry.answer.answer_at`); SQL over that one store gives the same step time p50 and
names the baseline, and gives the speed-up once both runs are in the store (the parent).

The browser half drives ``ultraep dashboard``'s Streamlit server in Debian's chromium (tests/browser_utils.py)
and skips, with the reason, where chromium or playwright is missing."""

from __future__ import annotations

import json

import pytest

from test_report_answer import TIMES, _record
from ultraep.cli import main
from ultraep.telemetry import answer as A
from ultraep.telemetry import open_run

RUN, BASE, SOLO = "demo-1-quota", "demo-1-none", "solo-quota"
MEASURED = TIMES["base"][1:]  # (the p50 of the timed steps: 0.20 s against 0.10 s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-answer") / "runs"
    _record(root, BASE, "none", TIMES["base"], {})
    _record(root, RUN, "quota", TIMES["bal"], {"baseline": BASE})
    _record(root, SOLO, "quota", TIMES["bal"], {})  # no baseline anywhere: an estimate, labelled
    return root


def _report(path, capsys) -> dict:
    assert main(["report", str(path), "--json"]) == 0
    return {a["run_id"]: a for a in json.loads(capsys.readouterr().out)["answer"]}


def _sql(path, capsys) -> dict:
    assert main(["sql", str(path), "SELECT run_id, baseline, step_time_p50_s, baseline_step_time_p50_s, speedup "
                 "FROM run_summary", "--json"]) == 0
    return {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}


def test_report_dashboard_and_sql_agree_by_directory_and_by_parent(runs, capsys):
    from ultraep.dashboard.data import measured_answer

    figures = {}
    for how, path in (("directory", runs / RUN), ("parent", runs)):
        rep = _report(path, capsys)[RUN]
        assert rep["basis"] == "measured" and rep["baseline_id"] == BASE, (how, rep)
        figures[f"report by {how}"] = rep["speedup"]
        a = measured_answer(path / RUN if how == "parent" else path, RUN,
                            {RUN: path / RUN} if how == "parent" else None)
        assert a.basis == "measured", (how, a)
        figures[f"dashboard by {how}"] = a.speedup
        row = _sql(path, capsys)[RUN]
        assert row["baseline"] == BASE and row["step_time_p50_s"] == pytest.approx(rep["step_time_p50_s"])
        if how == "parent":
            figures["sql by parent"] = row["speedup"]
            assert row["baseline_step_time_p50_s"] == pytest.approx(rep["baseline_p50_s"])
        else:  # the baseline is not in this store: SQL does not guess
            assert row["speedup"] is None and row["baseline_step_time_p50_s"] is None
    assert len({f"{v:.6f}" for v in figures.values()}) == 1 and figures["sql by parent"] == pytest.approx(2.0), figures


def test_without_the_lookup_beside_the_run_the_answer_would_be_an_estimate(runs):
    """Negative control: the run's own store alone (what the dashboard read before) gives another figure, so
    the agreement above is not a coincidence of two estimates."""
    con = open_run(runs / RUN)
    alone = A.answer(con, RUN)
    assert alone.basis == "estimate" and alone.speedup != pytest.approx(2.0), alone
    beside = A.answer_at(con, runs / RUN, RUN)
    assert beside.basis == "measured" and beside.speedup == pytest.approx(2.0)
    # a recorded baseline that is nowhere stays an estimate, labelled (never a measured heading)
    from ultraep.dashboard.ui import answer_basis

    solo = A.answer_at(open_run(runs / SOLO), runs / SOLO, SOLO)
    assert solo.basis == "estimate" and "(measured)" not in answer_basis(solo) and "ESTIMATED" in answer_basis(solo)
    assert answer_basis(beside) == "(measured)"


# ---------------------------------------------------------------------------------------------- the browser
def _overview(path, run_id: str, tmp_path) -> tuple[str, str]:
    """(the "speed-up over none" metric's value, the "Did balancing pay?" heading) of ``run_id`` on the Overview
    page of ``ultraep dashboard path``, read in chromium."""
    from browser_utils import chromium, open_page, served_dashboard

    with served_dashboard(path, tmp_path, refresh=60.0) as url, chromium() as browser:
        page = open_page(browser)
        page.goto(url + f"/?run={run_id}")
        metric = page.locator('[data-testid="stMetric"]').filter(has_text="speed-up over none")
        metric.first.wait_for()
        assert page.locator('[data-testid="stException"]').count() == 0
        value = metric.first.locator('[data-testid="stMetricValue"]').inner_text().strip()
        main_text = page.locator('[data-testid="stMain"]').inner_text()
        heading = next(line for line in main_text.splitlines() if line.startswith("Did balancing pay?"))
    return value, heading


@pytest.mark.slow
def test_the_dashboard_in_chromium_shows_the_reports_figure(runs, tmp_path, capsys):
    from browser_utils import require_browser

    require_browser()
    want = f"{_report(runs / RUN, capsys)[RUN]['speedup']:.2f}x"
    for path in (runs / RUN, runs):
        value, heading = _overview(path, RUN, tmp_path)
        assert value == want and heading == "Did balancing pay? (measured)", (path, value, heading)
    value, heading = _overview(runs, SOLO, tmp_path)  # no baseline: the heading says estimate, not measured
    assert value.endswith("(estimate)") and "(measured)" not in heading and "ESTIMATED" in heading, (value, heading)


def test_an_export_made_before_the_step_times_view_still_answers(runs, tmp_path, capsys):
    """`run_summary` and the report read the ``step_times`` view; an export written before it existed gets it
    when opened (read-only: a temporary view over the file's own tables)."""
    import duckdb

    from ultraep.telemetry.store import export_run

    path = export_run(runs, tmp_path / "old.duckdb")
    con = duckdb.connect(str(path))
    con.execute("DROP VIEW run_summary")  # (it reads step_times now; the old one did not)
    con.execute("DROP VIEW step_times")
    con.close()
    old = open_run(path)
    assert A.step_times(old, RUN)[RUN].p50_s == pytest.approx(0.10)
    old.close()
    assert _report(path, capsys)[RUN]["speedup"] == pytest.approx(2.0)
