"""The one recording path (issue 33): ``Engine.record`` writes a layer call's plan, decision, timings and transfer
times; ``decide`` calls it where nothing is measured later (the simulator, tests), the runtime after the call's
backward (``record_on_decide=False``), with plans from rank 0 only (``record_plans=False`` elsewhere)."""

import numpy as np

from ultraep.config import BalancerConfig
from ultraep.engine import Engine
from ultraep.topology import Topology

TOPO = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1000)


class Rec:
    def __init__(self):
        self.calls = []

    def record_plan(self, step, mb, layer, plan):
        self.calls.append(("plan", step, mb, layer, plan))

    def record_decision(self, step, mb, layer, **k):
        self.calls.append(("decision", step, mb, layer, k["policy"], k["chosen_predicted_s"]))

    def record_timings(self, step, mb, layer, timings):
        self.calls.append(("timings", step, mb, layer, dict(timings)))

    def record_transfer_times(self, step, mb, layer, secs):
        self.calls.append(("transfer_times", step, mb, layer, list(secs)))


def _hot() -> np.ndarray:
    load = np.full((4, 8), 100, dtype=np.int64)
    load[:, 0] = 5000  # a hot expert: the plan moves a replica
    return load


def test_decide_records_plan_decision_and_prediction_at_once():
    rec = Rec()
    eng = Engine(BalancerConfig(policy="quota", num_redundant_slots=1), TOPO, recorder=rec)
    d = eng.decide(2, 1, 0, _hot())
    assert [c[0] for c in rec.calls] == ["plan", "decision", "timings"]
    assert rec.calls[0][4] is d.plan and rec.calls[1][1:] == (2, 1, 0, "quota", d.predicted.total_s)
    assert rec.calls[2][4]["predicted_s"] == d.predicted.total_s
    rec.calls.clear()
    Engine(BalancerConfig(policy="quota", num_redundant_slots=1), TOPO, recorder=rec,
           record_timings=False).decide(0, 0, 0, _hot())
    assert [c[0] for c in rec.calls] == ["plan", "decision"]  # the simulator's engines: no prediction rows


def test_the_runtime_records_once_after_measuring():
    rec = Rec()
    cfg = BalancerConfig(policy="quota", num_redundant_slots=1)
    eng = Engine(cfg, TOPO, recorder=rec, record_timings=False, record_on_decide=False)
    d = eng.decide(0, 0, 1, _hot())
    assert rec.calls == []  # nothing until the call is measured
    ran = d.plan  # (the runtime passes the plan whose transfers really moved)
    secs = [0.5] * len(ran.transfers)
    assert secs, "the hot expert's replica must move"
    eng.record(d, plan=ran, timings={"measured_s": 1.0}, transfer_seconds=secs)
    assert [c[0] for c in rec.calls] == ["plan", "decision", "timings", "transfer_times"]
    assert rec.calls[0][4] is ran and rec.calls[2][4] == {"measured_s": 1.0} and rec.calls[3][4] == secs
    rec.calls.clear()
    other_rank = Engine(cfg, TOPO, recorder=rec, record_timings=False, record_on_decide=False, record_plans=False)
    other_rank.record(other_rank.decide(0, 0, 1, _hot()), timings={"measured_s": 2.0})
    assert [c[0] for c in rec.calls] == ["timings"]  # plans are identical on every rank: rank 0 records them
