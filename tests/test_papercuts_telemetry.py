"""Issue 15, item 4: reports and the dashboard show the candidate an adaptive layer chose.

The engine plans an ``adaptive`` layer and records the plan under policy ``adaptive`` and the decision
under the candidate it chose. Policy shares (``ultraep report`` and the dashboard's Overview) and the
policy comparison (report and Compare page) used to read "adaptive 100 %"; they now count each
layer-microbatch under "<chosen> via adaptive".
"""

from __future__ import annotations

import numpy as np
import pytest

from ultraep import BalancerConfig, Topology
from ultraep.engine import Engine
from ultraep.telemetry import Recorder, open_run, queries

TOPO = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1000)


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    """3 steps x 3 layers under `adaptive`: layer 0 very hot (the engine picks quota), layers 1-2 uniform
    (it picks none); decisions checked, so the expected shares are 1/3 and 2/3."""
    root = tmp_path_factory.mktemp("runs")
    with Recorder.open(root, "ad", model="toy", flush_interval_s=None, otel=False) as rec:
        # no exploration probes: the expected shares below are the cost model's choices
        quiet = {"kind": "adaptive", "probe_every": 0}
        engine = Engine(BalancerConfig(policy="adaptive", num_redundant_slots=1, layers={i: quiet for i in range(3)}),
                        TOPO, recorder=rec)
        for step in range(3):
            for layer in range(3):
                load = np.full((4, 8), 1000, dtype=np.int64)
                if layer == 0:
                    load[:, 0] = 200_000
                d = engine.decide(step, 0, layer, load)
                assert d.plan.policy == "adaptive" and d.chosen == ("quota" if layer == 0 else "none")
                engine.commit(d)
            rec.record_step(step, step_time_s=0.01)
    return root / "ad"


EXPECTED = {"quota via adaptive": pytest.approx(1 / 3), "none via adaptive": pytest.approx(2 / 3)}


def _rows(con, query) -> list[dict]:
    cols, rows = queries.run(con, query)
    return [dict(zip(cols, r)) for r in rows]


def test_report_policy_shares_and_comparison_name_the_chosen_candidate(adaptive_run):
    con = open_run(adaptive_run)
    shares = {r["policy"]: r["share"] for r in _rows(con, queries.POLICY_SHARES)}
    assert shares == EXPECTED
    compared = {r["policy"]: r["plans"] for r in _rows(con, queries.POLICY_COMPARISON)}
    assert compared == {"quota via adaptive": 3, "none via adaptive": 6}
    # the raw tables keep what was recorded: the layer's policy and the decision's candidate
    assert con.execute("SELECT DISTINCT policy FROM layer_balance").fetchall() == [("adaptive",)]


def test_dashboard_policy_shares_and_compare_name_the_chosen_candidate(adaptive_run):
    pytest.importorskip("pandas")
    from ultraep.dashboard import data
    from ultraep.dashboard.mirror import RunMirror

    mirror = RunMirror(adaptive_run)
    df = data.policy_shares(mirror)
    assert dict(zip(df["policy"], df["share"])) == EXPECTED
    cmp, over = data.compare_runs([mirror])
    assert dict(zip(cmp["policy"], cmp["plans"])) == {"quota via adaptive": 3, "none via adaptive": 6}
    assert set(over["policy"]) == {"quota via adaptive", "none via adaptive"}
