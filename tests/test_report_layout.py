"""`ultraep report` for a person at any width (issue 57): the terminal's width, also when piped; no value broken
across lines; the speed-up's 90 % interval (the demo's); per-term prediction errors beside the times they compare,
terms too small to compare marked; and why a replica cache never hit. Each check has a negative control."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import termios

import numpy as np
import pytest

import ultraep
from ultraep.cli import main
from ultraep.telemetry import Recorder
from ultraep.telemetry import report as R
from ultraep.telemetry.paired import ratio_interval

TOPO = ultraep.Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1 << 20)
BASE = [5.0, 0.20, 0.22, 0.18, 0.20, 0.21, 0.19]
BAL = [5.0, 0.10, 0.12, 0.09, 0.11, 0.10, 0.08]
LONG = "a-rather-long-run-name-that-takes-room"


def _record(root, name, policy, times, extra, kind="train", hot=lambda call: 0, hits=0, terms=None, offset=0):
    """A run of 2 layers, one microbatch per step; ``hot(call)`` the hot expert of each call (where replicas go),
    ``hits`` the replica-cache hits each call records (misses: the rest of 2), ``terms`` per-term predictions."""
    with Recorder.open(root, name, model="toy", kind=kind, world_size=4, flush_interval_s=None,
                       extra={"policy": policy, **extra}) as rec:
        for i, t in enumerate(times):
            step = offset + i
            for layer in range(2):
                load = np.full((4, 8), 10, dtype=np.int64)
                load[:, hot(step)] = 70
                rec.record_plan(step, 0, layer, ultraep.plan_layer(load, policy, topology=TOPO))
                timings = {"measured_s": 2e-2, "experts_s": 1e-2, "plan_s": 1e-3, "cache_hits": float(hits),
                           "cache_misses": float(2 - hits), "cache_bytes_saved": float(hits << 20)}
                for term, (pred, meas) in (terms or {}).items():
                    timings |= {f"predicted.{term}": pred, f"measured.{term}": meas}
                rec.record_timings(step, 0, layer, timings)
            rec.record_step(step, loss=1.0, step_time_s=t, warmup=i == 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    terms = {"total_s": (0.100, 0.110), "compute_fwd_s": (0.050, 0.080), "plan_s": (1e-5, 7.3e-4)}
    _record(root, "base-none", "none", BASE, {})
    _record(root, LONG, "quota", BAL, {"baseline": "base-none"}, terms=terms)
    return root


def _report(root, monkeypatch, capsys, columns: int | None, *args) -> str:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["report", str(root), *args]) == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------- width
def test_piped_output_takes_the_width_columns_says(runs, monkeypatch, capsys):
    narrow = _report(runs, monkeypatch, capsys, 80).splitlines()
    wide = _report(runs, monkeypatch, capsys, 160).splitlines()
    assert max(map(len, narrow)) == 80 and max(map(len, wide)) == 160  # the section rules span the width
    assert sum(len(x) > 120 for x in wide) > 3  # the tables use it too, not only the rules
    # negative control: with neither COLUMNS nor a terminal, the fallback
    plain = _report(runs, monkeypatch, capsys, None).splitlines()
    assert max(map(len, plain)) == R.WIDTH


def test_piped_stdout_takes_the_terminal_width_from_stderr(monkeypatch):
    """``ultraep report RUN | less``: stdout is a pipe, stderr still the terminal."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 97, 0, 0))
    tty = os.fdopen(slave, "w")
    try:
        monkeypatch.delenv("COLUMNS", raising=False)
        monkeypatch.setattr("sys.stderr", tty)
        assert R.terminal_width() == 97
        monkeypatch.setenv("COLUMNS", "133")  # COLUMNS wins
        assert R.terminal_width() == 133
    finally:
        tty.close()
        os.close(master)


# -------------------------------------------------------------------------------------------- no value split
def _split_cells(text: str, cells: list[str]) -> list[str]:
    """Cells that appear whole on no line of ``text``."""
    lines = text.splitlines()
    return [c for c in cells if c.strip() and not any(c in x for x in lines)]


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_no_cell_is_broken_across_lines(runs, monkeypatch, capsys, columns):
    cells: list[str] = []
    real = R.FitTable.__init__

    def spy(self, cols, rows, *a, **k):
        real(self, cols, rows, *a, **k)
        cells.extend(c for r in self.rows for c in r)

    monkeypatch.setattr(R.FitTable, "__init__", spy)
    out = _report(runs, monkeypatch, capsys, columns)
    assert LONG in cells and len(cells) > 100
    assert _split_cells(out, cells) == []
    assert max(map(len, out.splitlines())) <= columns
    # headers break between words only
    for word in ("interval", "imbalance", "straggler", "predicted", "recording"):
        assert re.search(rf"\b{word}\b", out), word


def test_the_check_catches_a_table_that_folds_its_cells():
    """Negative control: the former layout (rich folding cells to fit) breaks a long run name."""
    from rich.console import Console
    from rich.table import Table

    t = Table(show_edge=False, pad_edge=False)
    for c in ("run", "policy", "step time p50", "speed-up", "warm-up steps (one-time)"):
        t.add_column(c, overflow="fold")
    row = [LONG, "quota", "100 ms", "2.00x vs base-none", "1 (5.00 s)"]
    t.add_row(*row)
    con = Console(width=50, record=True, file=open(os.devnull, "w"))
    con.print(t)
    assert LONG in _split_cells(con.export_text(), row)
    con = Console(width=50, record=True, file=open(os.devnull, "w"))
    con.print(R.FitTable(["run", "policy", "step time p50", "speed-up", "warm-up steps (one-time)"], [row]))
    assert _split_cells(con.export_text(), row) == []


# ----------------------------------------------------------------------------------------------- the interval
def test_the_speedup_carries_its_90_percent_interval_over_the_paired_steps(runs, monkeypatch, capsys):
    lo, hi = ratio_interval(BASE[1:], BAL[1:])  # the demo's computation, on the same steps (warm-up left out)
    out = _report(runs, monkeypatch, capsys, 160)
    assert f"{lo:.2f}x – {hi:.2f}x" in out and "90 % interval" in out
    assert f"90 % interval {lo:.2f}x-{hi:.2f}x over 6 paired steps" in out  # the headline, as the demo words it
    (a,) = [a for a in json.loads(_report(runs, monkeypatch, capsys, 160, "--json"))["answer"] if a["run_id"] == LONG]
    assert a["speedup_interval_90"] == pytest.approx([lo, hi]) and a["paired_steps"] == 6


def test_no_interval_without_paired_steps(tmp_path, monkeypatch, capsys):
    """Negative control: a baseline that timed other steps than the run pairs none, and the report says so."""
    _record(tmp_path, "base", "none", BASE, {})
    _record(tmp_path, "late", "quota", BAL, {"baseline": "base"}, offset=10)
    out = " ".join(_report(tmp_path, monkeypatch, capsys, 160, "--run-id", "late").split())
    assert "no interval: 0 steps timed by both runs" in out and "paired steps" not in out
    (a,) = json.loads(_report(tmp_path, monkeypatch, capsys, 160, "--run-id", "late", "--json"))["answer"]
    assert a["basis"] == "measured" and a["paired_steps"] == 0 and a["speedup_interval_90"] is None


# ---------------------------------------------------------------------------------- per-term prediction errors
def test_term_errors_show_the_times_they_compare_and_mark_terms_too_small(runs, monkeypatch, capsys):
    out = _report(runs, monkeypatch, capsys, 400)  # each sentence on one line
    assert "median |error| = the median over layer calls of |measured / predicted − 1|" in out
    assert "* = the term is under 2 % of the layer call's measured time, too small to compare" in out
    plan = next(x for x in out.splitlines() if " plan_s " in x)
    # 10 µs predicted, 730 µs measured: 7200 % off, and marked (0.7 % of the 110 ms layer call)
    assert re.search(r"10 µs\s+│\s+730 µs\s+│\s+7200 % \*", plan), plan
    # negative control: a term of a size to compare is not marked
    fwd = next(x for x in out.splitlines() if " compute_fwd_s " in x)
    assert re.search(r"50 ms\s+│\s+80 ms\s+│\s+60 %\s+│", fwd) and "*" not in fwd, fwd


# ------------------------------------------------------------------------------------------- replica cache
def test_a_cache_that_never_hit_says_why(tmp_path, monkeypatch, capsys):
    # training, one microbatch per step: the optimizer step changes the masters before every call
    _record(tmp_path, "train1", "quota", BAL, {})
    # serving, the hot expert moving every call: no replica is placed twice on a rank
    _record(tmp_path, "moving", "quota", BAL, {}, kind="prefill", hot=lambda call: call % 8)
    # serving, the same placement every call, yet no hit: the masters changed between the calls
    _record(tmp_path, "written", "quota", BAL, {}, kind="prefill")
    # negative control: a cache that hits gets no explanation
    _record(tmp_path, "hitting", "quota", BAL, {}, kind="prefill", hits=1)
    out = " ".join(_report(tmp_path, monkeypatch, capsys, 400).split())  # one line per sentence
    assert ("Hit rate 0 % (train1, layers 0, 1): every layer call follows an optimizer step, which changes the "
            "masters" in out)
    assert "Hit rate 0 % (moving, layers 0, 1): no replica was placed on the same rank as in the layer's previous " \
           "call: the plans moved every replica" in out
    assert re.search(r"Hit rate 0 % \(written, layers 0, 1\): 100 % of the replicas repeated the previous call's "
                     r"placement, but their masters had changed", out), out
    assert "hitting │ 0 │ 6 │ 6 │ 50 % │" in out and "(hitting" not in out
