"""Benchmark rows say where they came from (issue 31): CPU model, torch's vector ISA, cores and threads on every
row; a results file of older columns is kept aside, never appended to; `commit` copies the latest run's rows."""

from __future__ import annotations

import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402


def test_every_row_names_the_machine(monkeypatch):
    r = common.row("planner", "quota", "latency", "s", "EP64", [1e-5, 2e-5, 3e-5])
    assert list(r) == common.COLUMNS
    assert r["cpu"] == common.cpu_model() and r["cpu"]
    assert r["isa"] == torch.backends.cpu.get_cpu_capability()
    assert r["cores"] >= 1 and r["threads"] == torch.get_num_threads() and r["run"] == common.RUN
    monkeypatch.setattr(common, "THREADS", 1)  # a benchmark whose ranks run one thread each
    assert common.row("x", "y", "z", "s", 0, 1.0)["threads"] == 1


def test_old_columns_are_kept_aside_and_commit_copies_the_latest_run(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "COMMITTED", tmp_path / "committed")
    (tmp_path / "results").mkdir()
    old = tmp_path / "results" / "bench_x.csv"
    old.write_text("what,provider,metric,unit,x,p50,p20,p80,machine,timestamp,version\na,b,c,d,e,1,1,1,m,t,v\n")
    monkeypatch.setattr(common, "RUN", "run-1")
    common.write_rows("bench_x", [common.row("a", "p", "latency", "s", 1, [1.0])])
    assert (tmp_path / "results" / "bench_x.columns-11.csv").read_text().startswith("what,provider")
    monkeypatch.setattr(common, "RUN", "run-2")
    path = common.write_rows("bench_x", [common.row("a", "p", "latency", "s", x, [2.0]) for x in (1, 2)])
    with path.open() as fh:
        assert [r["run"] for r in csv.DictReader(fh)] == ["run-1", "run-2", "run-2"]
    out = common.commit("bench_x")
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["run"], r["x"], float(r["p50"])) for r in rows] == [("run-2", "1", 2.0), ("run-2", "2", 2.0)]
    assert rows[0]["isa"] == torch.backends.cpu.get_cpu_capability() and rows[0]["cpu"] == common.cpu_model()


def test_commit_keeps_the_latest_runs_asked_for(tmp_path, monkeypatch):
    """A goal met "in three runs" commits the three runs' rows together; asking for more runs than the results
    hold stops with a message, and replaces nothing."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "COMMITTED", tmp_path / "committed")
    for i in (1, 2, 3, 4):
        monkeypatch.setattr(common, "RUN", f"run-{i}")
        common.write_rows("bench_y", [common.row("a", "p", "latency", "s", 1, [float(i)])])
    with common.commit("bench_y", runs=3).open() as fh:
        assert [r["run"] for r in csv.DictReader(fh)] == ["run-2", "run-3", "run-4"]
    with pytest.raises(SystemExit, match="holds 4 run"):
        common.commit("bench_y", runs=5)
    with (tmp_path / "committed" / "bench_y.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 3
