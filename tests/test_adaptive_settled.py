"""The adaptive engine's settled decisions (Step 0b, ``ultraep.policies.settled``): a balancing policy that its weighing
kept is planned alone for the next decisions, weighed again at least every SETTLED_REST decisions, and at once
when the load moves, a rival's measured estimate comes within reach, or a probe falls due.

Driven as the runtime's engine drives it: every decision committed and its measured layer time fed back."""

from __future__ import annotations

import numpy as np
import pytest

from ultraep.cost import CostModel
from ultraep.policies import AdaptivePolicy
from ultraep.policies.adaptive import DEFAULT_CANDIDATES
from ultraep.policies import adaptive as adaptive_mod
from ultraep.policies.settled import SETTLED_REST_MAX
from ultraep.presets import get_preset
from ultraep.sim.workload import power_law_popularity


def _cm() -> CostModel:
    pre = get_preset("gb200-nvl72")
    return CostModel(pre.topology(8, 32, 2), pre.hardware, pre.expert)


def _load(skew: float, tokens: int = 4096) -> np.ndarray:
    p = power_law_popularity(8, 32, skew, np.random.default_rng(0))
    return np.rint(np.outer(np.full(8, tokens * 4), p)).astype(np.int64)


def _drive(pol, cm, loads, truth) -> list[dict]:
    """One committed decision per load of ``loads``; the chosen candidate measures ``truth(i, name)`` times its
    anchor-model prediction (the engine feeds the calibrated prediction and the measured time)."""
    out = []
    for i, load in enumerate(loads):
        plan = pol.plan(load, cm.topology)
        pol.commit(plan)
        a = plan.info["adaptive"]
        predicted = pol.cost_model.predict(plan).total_s
        pol.observe_outcome(a["chosen"], predicted, predicted * truth(i, a["chosen"]))
        out.append(a)
    return out


def _quota_wins(i, name):
    return 0.8 if name == "quota" else 1.0


def test_a_kept_balancing_policy_is_planned_alone_between_weighings(monkeypatch):
    cm = _cm()
    counted = {"n": 0}
    predict = CostModel.predict

    def counting(self, plan, **kw):
        counted["n"] += 1
        return predict(self, plan, **kw)

    monkeypatch.setattr(CostModel, "predict", counting)
    pol = AdaptivePolicy(cost_model=cm)
    per = []
    decisions = []
    for a in _drive(pol, cm, [_load(1.2)] * 80, _quota_wins):
        decisions.append(a)
    assert pol.current == "quota"
    first_none = next(i for i, a in enumerate(decisions) if a["chosen"] == "none")  # none's first probe (call 31)
    assert not any(a["settled"] for a in decisions[:first_none])  # nothing settles before none is measured
    late = decisions[40:]
    settled = [i for i, a in enumerate(late) if a["settled"]]
    weighed = [i for i, a in enumerate(late) if len(a["predictions"]) > 1]
    assert len(settled) >= len(late) // 2, [a["reason"] for a in late]
    assert all(late[i]["chosen"] == "quota" and list(late[i]["predictions"]) == ["quota"] for i in settled)
    assert all(late[i]["reason"].startswith("settled: quota") for i in settled)
    assert max(np.diff([-1, *weighed, len(late)])) <= SETTLED_REST_MAX  # weighed again at least every SETTLED_REST_MAX
    # what a settled decision costs: the policy in force predicted (calibrated and anchor model), not every candidate
    counted["n"] = 0
    _drive(pol, cm, [_load(1.2)] * 40, _quota_wins)
    per.append(counted["n"] / 40)
    monkeypatch.setattr(adaptive_mod, "verdict", lambda *a: None)  # the negative control: no weighing settles
    pol._settled = None
    counted["n"] = 0
    got = _drive(pol, cm, [_load(1.2)] * 40, _quota_wins)
    per.append(counted["n"] / 40)
    assert not any(a["settled"] for a in got)
    assert per[0] < 0.8 * per[1], per  # (3.9 against 5.5 predictions per decision, the test's own one included)


def test_a_settled_rest_ends_at_once_when_the_load_moves():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm)
    loads = [_load(1.2)] * 40 + [_load(0.001)] * 10  # the skew is gone: a call 25 % cheaper
    got = _drive(pol, cm, loads, lambda i, n: 1.0)
    assert got[39]["settled"]
    assert not got[40]["settled"] and len(got[40]["predictions"]) > 1  # the first call of the new load weighs
    assert got[40]["predictions"]["quota"] < got[39]["predictions"]["quota"] / 1.25


def test_a_rival_measured_faster_since_the_weighing_ends_the_rest():
    """A rival's correction that moved since the weighing (here: its measured outcome) reaches the settled check
    without predicting it: with quota in force and settled, none measured 30 % faster on its probe ends the rest."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm)
    _drive(pol, cm, [_load(1.2)] * 40, _quota_wins)
    assert pol.current == "quota" and pol._settled is not None
    rival = next(iter(pol._settled.rivals))
    est = pol.outcomes.scale(rival)
    pol.outcomes._outcome_anchor[rival] = (float(np.log(est * 0.3)), pol.outcomes.runs(rival))
    a = _drive(pol, cm, [_load(1.2)], _quota_wins)[0]
    assert not a["settled"] and len(a["predictions"]) > 1, a["reason"]


@pytest.mark.parametrize("probe_every", [16, 32])
def test_probes_run_when_they_would_have(monkeypatch, probe_every):
    """Settled decisions do not delay a probe: the rivals within probe range are probed at least as often, and at most
    a decision later, as when every decision weighs (the negative control's schedule), and a rival is probed no more
    often than once per ``probe_every`` decisions. (Settled, feplb is probed every ``probe_every`` decisions; when every
    decision weighs, every 24-25 at ``probe_every`` 16: it rests on its streak between re-evaluations.)"""
    def probes(settle: bool):
        if not settle:
            monkeypatch.setattr(adaptive_mod, "verdict", lambda *a: None)
        cm = _cm()  # (the fixed schedule: paced probes are tests/test_adaptive_pacing.py's)
        pol = AdaptivePolicy(cost_model=cm, probe_every=probe_every, probe_regret=None)
        got = _drive(pol, cm, [_load(1.2)] * 240, lambda i, n: 0.95 if n == "quota" else 1.0)
        return got, [i for i, a in enumerate(got) if a["reason"].startswith("probe")]

    got, settled = probes(True)
    _, weighed = probes(False)
    assert sum(a["settled"] for a in got[40:]) > 40
    assert len(weighed) >= 6 and len(settled) >= len(weighed) - 1, (settled, weighed)
    assert max(np.diff(settled)) <= max(np.diff(weighed)) + 1, (settled, weighed)
    late = [i for i in settled if i > 60]  # (after the first calls' probes, which run as they fall due)
    assert min(np.diff(late)) >= probe_every, settled  # and never more often than probe_every asks


def test_none_kept_while_the_budget_allows_weighing_settles_and_an_unbounded_budget_weighs_every_call():
    """With ``none`` in force (quota measured 5 % slower) and an exploration budget that is never spent (so no decision
    idles), a weighing that kept ``none`` settles like any other: the next decisions plan ``none`` alone. With
    ``explore_share=None`` (weigh without bound) nothing settles with ``none`` in force: that setting keeps weighing
    every call, the negative control."""
    from ultraep.policies import make_policy

    cm, load = _cm(), _load(1.2)
    pred = {n: cm.predict(make_policy(n).plan(load, cm.topology)).total_s for n in DEFAULT_CANDIDATES}
    truth = {"none": 1.0, "quota": 1.05 * pred["none"] / pred["quota"]}  # the others measure 3x their prediction

    def run(share):
        pol = AdaptivePolicy(cost_model=cm, explore_share=share)
        got = _drive(pol, cm, [load] * 120, lambda i, n: truth.get(n, 3.0))
        return pol, got[60:]

    pol, late = run(1.0)
    assert pol.current == "none"
    assert not any(a["idle"] for a in late)
    settled = [a for a in late if a["settled"]]
    assert len(settled) >= len(late) // 2, [a["reason"] for a in late]
    assert all(a["chosen"] == "none" and list(a["predictions"]) == ["none"] for a in settled)
    pol, unbounded = run(None)
    assert pol.current == "none" and not any(a["settled"] for a in unbounded if a["chosen"] == "none")


def test_an_unmeasured_candidate_resting_on_its_streak_does_not_end_the_rest():
    """quota in force and settled, none measured within 1 % of it, eplb never run and resting on its losing streak: a
    probe of eplb is "due" (unmeasured), but the weighing does not plan a resting candidate and so cannot probe it.
    Counted as due, it ended every rest at once (2 settled decisions in 20); its re-evaluation is what plans it."""
    from ultraep.policies import make_policy

    cm, load = _cm(), _load(1.2)
    pred = {n: cm.predict(make_policy(n).plan(load, cm.topology)).total_s for n in DEFAULT_CANDIDATES}
    target = {n: pred["none"] * (1.01 if n == "quota" else 1.0 if n == "none" else 1.3) for n in pred}
    pol = AdaptivePolicy(cost_model=cm)
    got = _drive(pol, cm, [load] * 60, lambda i, n: target[n] / pred[n])
    assert pol.current == "quota" and pol.outcomes.runs("eplb") == 0
    assert "eplb" in pol.screening.resting(pol.current)
    assert sum(a["settled"] for a in got[40:]) >= 12, [a["reason"][:20] for a in got[40:]]


def test_routing_noise_does_not_end_a_rest_and_skew_that_builds_up_does(monkeypatch):
    """A rest (idle or settled) ends when the busiest rank's share grows by more than REST_SKEW (10 %): a 6 % growth,
    within a call's routing noise at bench_long's shape, keeps it; 19 % (skew building up over a phase) ends it. The
    negative control bounds the growth at ``switch_now`` (2 %), as before: the 6 % ends both rests."""
    from ultraep.policies import NonePolicy
    from ultraep.policies import idle as idle_mod
    from ultraep.policies.idle import Rest
    from ultraep.policies.settled import Settled

    cm, plain = _cm(), NonePolicy()
    bd = {s: cm.predict(plain.plan(_load(s), cm.topology)) for s in (0.3, 0.35, 0.45)}
    assert 1.05 < bd[0.35].imbalance / bd[0.3].imbalance < 1.1 < bd[0.45].imbalance / bd[0.3].imbalance
    rest = Rest(bd[0.3].total_s, bd[0.3].imbalance, 0.0)
    settled = Settled("none", bd[0.3].total_s, bd[0.3].imbalance, {})
    checks = (rest.holds, lambda b: settled.holds(b, b.total_s, 0.02, lambda n: 1.0))
    for holds in checks:
        assert holds(bd[0.3]) and holds(bd[0.35]) and not holds(bd[0.45])
    monkeypatch.setattr(idle_mod, "REST_SKEW", 0.02)  # (both rests read it through idle.load_holds)
    assert not any(holds(bd[0.35]) for holds in checks)
