"""The adaptive engine's state stays bounded over a run (issue 56, item 6): what it holds after N decisions and after
10 N is the same, everything it keeps per call being a window, a capped history or a fixed set of sums. The
benchmark (benchmarks/bench_long.py, part engine) writes both, and the time per decision, for 10^5 decisions."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_long import run_engine  # noqa: E402

# a short probe period and no probe bound: every window the engine keeps fills within a few dozen decisions
OPTIONS = {"probe_every": 4, "probe_share": None, "probe_cost_share": None}
N = 150


@pytest.fixture(autouse=True)
def _small_history(monkeypatch):
    import ultraep.cost.calibrator as calibrator

    monkeypatch.setattr(calibrator, "HISTORY_ROWS", 256)  # the calibration rows kept: filled within ~30 calls


def test_the_state_after_ten_times_the_decisions_is_the_same():
    """The stream's phases repeat every N decisions: after N the engine has seen every load regime it will (a
    candidate's outcomes are kept per regime, up to REGIMES of them), so what it holds after 10 N is the same. With
    the phases laid out once over the 10 N, the regimes of the later phases were still to come at N: their histories
    grew the state by 2 % between the marks, within their cap."""
    got = run_engine(10 * N, seed=1, options=OPTIONS, at=(N, 10 * N), cycle=N)["marks"]
    (items_n, bytes_n), (items_10n, bytes_10n) = got[N], got[10 * N]
    assert items_10n <= 1.02 * items_n, (items_n, items_10n)
    assert bytes_10n <= 1.05 * bytes_n, (bytes_n, bytes_10n)


def test_negative_control_an_unbounded_history_is_seen():
    """A calibrator whose rows are kept in a plain list (the engine before issue 56) grows with every call."""
    def unbounded(eng):
        eng.calibrator.history = []

    got = run_engine(10 * N, seed=1, options=OPTIONS, at=(N, 10 * N), engine=unbounded, cycle=N)["marks"]
    assert got[10 * N][0] > 3 * got[N][0], got


def test_footprint_counts_what_containers_hold():
    import numpy as np

    from ultraep.engine import footprint

    class Holder:
        def __init__(self):
            self.rows = [{"a": 1.0}, {"a": 2.0}]
            self.arr = np.zeros((3, 4))
            self.same = self.rows  # counted once

    items, size = footprint(Holder())
    assert items == 3 + 2 + 1 + 1 + 12  # 3 attributes, the list's 2 rows, each row's key, the array's 12
    assert size >= 12 * 8
