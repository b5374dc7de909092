"""Probes paced by what they cost, and settled rests that lengthen while they hold (issue 56).

A measured rival is probed again once the decisions since it ran pay for its probe at ``probe_regret`` of the policy
in force's time each (``policies.probes.Pace``), whatever its estimate: the fixed period with ``probe_max_loss`` as a
cut-off left a rival whose estimate had gone stale beyond the cut-off unmeasured for good. A settled rest that runs
to its end and settles again on the same policy doubles, up to ``SETTLED_REST_MAX`` decisions.
"""

from __future__ import annotations

import numpy as np
import pytest

from ultraep.policies import AdaptivePolicy
from ultraep.policies import settled as settled_mod
from ultraep.policies.probes import PERIOD_CAP, Pace
from ultraep.policies.settled import SETTLED_REST, SETTLED_REST_MAX
from test_adaptive_settled import _cm, _load  # noqa: E402


def _drive(pol, cm, loads, measured) -> list[dict]:
    """One committed decision per load; the chosen candidate measures ``measured(i, name)`` seconds."""
    out = []
    for i, load in enumerate(loads):
        plan = pol.plan(load, cm.topology)
        pol.commit(plan)
        a = plan.info["adaptive"]
        pol.observe_outcome(a["chosen"], pol.cost_model.predict(plan).total_s, measured(i, a["chosen"]))
        out.append(a)
    return out


def test_a_probes_period_is_what_pays_for_it_at_the_regret_within_its_bounds():
    pace = Pace(0.0025)
    pace.weigh_s = 0.5e-3
    assert pace.cost(1.1, 1.0) == pytest.approx(0.1 + 2 * 0.5e-3)  # its loss and two weighings, relative
    assert pace.cost(0.9, 1.0) == pytest.approx(2 * 0.5e-3)  # predicted faster: the weighings only
    assert pace.cost(1.0, 0.0) is None and pace.cost(float("inf"), 1.0) is None
    assert pace.period(32, 0.001) == 32  # never shorter than probe_every
    assert pace.period(32, 0.15) == 60  # 0.15 / 0.0025
    assert pace.period(32, 5.0) == PERIOD_CAP * 32  # never longer than PERIOD_CAP periods, however far behind


def test_a_rival_measured_far_behind_is_probed_again_and_found_when_it_turns_faster():
    """``none`` in force; quota measures 40 % slower for 100 decisions (beyond ``probe_max_loss``, 25 %), then 30 %
    faster. Paced, quota is probed again at its period (its estimate 40 % behind: 160-odd decisions) and found; with the
    fixed period and the cut-off (``probe_regret=None``, the negative control) it is never probed again."""
    cm, load = _cm(), _load(0.05)

    def run(regret):
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_regret=regret)
        slow = lambda i, n: 1e-2 * ((1.4 if i < 100 else 0.7) if n == "quota" else 1.0)  # noqa: E731
        return pol, _drive(pol, cm, [load] * 500, slow)

    pol, got = run(0.0025)
    probes = [i for i, a in enumerate(got) if a["reason"].startswith("probe: quota") and i > 40]
    assert pol.current == "quota", probes
    assert probes and probes[0] > 100 and np.diff([40, *probes]).min() >= 32, probes  # paced, not every probe_every
    switched = next(i for i, a in enumerate(got) if a["reason"].startswith("switch"))
    assert switched - probes[0] <= 3, (probes, switched)  # the probe's measurement reaches the next decisions
    pol, got = run(None)
    assert pol.current == "none" and not any(a["chosen"] == "quota" for a in got[100:])


def test_a_probes_measurement_reaches_the_idle_decisions_at_once(monkeypatch):
    """The same run: the probe that measured quota 30 % faster moves its standing (``ExplorationBudget.rescale``), so
    the next decisions weigh and switch. Without it (the negative control) they idle on ``none``, the standing that
    of the weighing before the probe, until quota's next probe."""
    from ultraep.policies.exploration import ExplorationBudget

    def gap():
        cm, load = _cm(), _load(0.05)
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"))
        got = _drive(pol, cm, [load] * 400, lambda i, n: 1e-2 * ((1.4 if i < 100 else 0.7) if n == "quota" else 1.0))
        probe = next(i for i, a in enumerate(got) if a["reason"].startswith("probe") and i > 100)
        return next(i for i, a in enumerate(got) if a["reason"].startswith("switch")) - probe

    assert gap() <= 3
    monkeypatch.setattr(ExplorationBudget, "rescale", lambda self, name, factor: None)
    assert gap() > 30


def test_a_rival_close_to_the_policy_in_force_is_probed_no_less_often_than_its_period_says():
    """Paced probes are spread: a rival 5 % behind is probed every period its cost gives, at least ``probe_every``."""
    cm, load = _cm(), _load(0.05)
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"))
    got = _drive(pol, cm, [load] * 400, lambda i, n: 1e-2 * (1.05 if n == "quota" else 1.0))
    probes = [i for i, a in enumerate(got) if a["reason"].startswith("probe") and i > 60]
    period = pol.schedule.period("quota", pol.schedule.pace.cost(1.05e-2, 1e-2))
    assert pol.current == "none" and period >= 32
    assert len(probes) >= 3 and np.diff(probes).max() <= period + 2 and np.diff(probes).min() >= 32, (probes, period)


def _rests(monkeypatch, longest: int) -> list[int]:
    """quota in force (20 % faster than every rival, none measured): the lengths of its settled rests."""
    monkeypatch.setattr(settled_mod, "SETTLED_REST_MAX", longest)
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, probe_every=1000)  # no probe or re-evaluation ends a rest
    got = _drive(pol, cm, [_load(1.2)] * 200, lambda i, n: 0.8e-2 if n == "quota" else 1e-2)
    runs, n = [], 0
    for a in got[40:]:
        if a["settled"]:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_a_settled_rest_that_holds_doubles_up_to_its_longest(monkeypatch):
    runs = _rests(monkeypatch, SETTLED_REST_MAX)
    assert max(runs) == SETTLED_REST_MAX - 1 and runs.count(SETTLED_REST_MAX - 1) >= 2, runs
    assert 2 * SETTLED_REST - 1 in runs, runs  # (8 - 1, then 16 - 1, then 32 - 1 settled decisions between weighings)
    assert max(_rests(monkeypatch, SETTLED_REST)) == SETTLED_REST - 1  # the negative control: every rest as long


def test_a_rivals_estimate_reads_its_measurements_of_one_span_only():
    """Measurements more than ``window x probe_every`` decisions before a candidate's newest do not vote: four old
    ones (log-ratio 0.3) and a fresh one (-0.3) give the fresh one; with every measurement voting (``probe_every`` 0,
    the negative control) the old median stands."""
    from ultraep.policies.outcomes import OutcomeTracker

    def median(probe_every):
        t = OutcomeTracker(None, 5, 0.02, probe_every)
        t.regime = 9
        h = [(d, 0.3, "quota", 9) for d in (10, 20, 30, 40)] + [(400, -0.3, "quota", 9)]
        return t._anchor_median(h)

    assert median(32) == -0.3  # 400 - 5 x 32 = 240: the four old ones are out of the span
    assert median(0) == 0.3


def test_a_due_rival_the_last_weighing_did_not_plan_ends_no_rest_until_it_is_re_evaluated():
    """What idle and settled decisions ask (``ProbeSchedule.probe_range``) leaves out a paced rival due for a probe that
    the last weighing did not plan (screened): the next weighing would not plan it either, so it could not probe it.
    Re-evaluated (unplanned for ``probe_every`` decisions: the next weighing plans it), it is due again; planned by the
    last weighing (the control), it is due at once."""
    from ultraep.policies.outcomes import FEW_RUNS, OutcomeTracker
    from ultraep.policies.probes import ProbeSchedule

    def after_weighing(planned: dict[str, float]) -> ProbeSchedule:
        t = OutcomeTracker(None, 5, 0.02, 32)
        t.observed = 300
        t._outcome_anchor = {"none": (0.0, FEW_RUNS), "eplb": (0.3, FEW_RUNS)}
        s = ProbeSchedule(32, 0.25, 0.02, t, 0.05, FEW_RUNS, 0.02, 0.0025, fallback="none")
        s._ran.update({"none", "eplb"})
        s._since.update({"none": 0, "eplb": 299})
        s.decisions, s.base_s = 300, 300.0  # (the probe ledger has room for it)
        s.record(["none", "eplb"], "none", planned, set(), False, weighed=True, ref_s=1.0)
        return s

    standing = {"eplb": 1.4}  # 40 % behind: paced, due once 160 decisions paid for its probe (it ran 300 ago)
    screened = after_weighing({"none": 1.0})
    assert "eplb" not in screened.probe_range(["none", "eplb"], 1.0, standing)
    screened._unplanned["eplb"] = 32
    assert screened.reevaluate("eplb") and "eplb" in screened.probe_range(["none", "eplb"], 1.0, standing)
    planned = after_weighing({"none": 1.0, "eplb": 1.4})
    assert "eplb" in planned.probe_range(["none", "eplb"], 1.0, standing)


def test_a_rival_screened_while_due_does_not_make_every_rest_weigh(monkeypatch):
    """``none`` in force, every rival measured 40 % slower on a load with little to gain, where the gain bound screens
    eplb and feplb: their probes come due by their regret period while every weighing screens them. Counted as due, they
    ended the rests with a weighing that could not probe them (the control: the last weighing's screened candidates
    forgotten); left out until re-evaluated, a third of those weighings go."""
    from ultraep.policies.probes import ProbeSchedule

    def weighings():
        cm, load = _cm(), _load(0.05)
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota", "eplb", "feplb"))
        got = _drive(pol, cm, [load] * 600, lambda i, n: 1e-2 * (1.0 if n == "none" else 1.4))
        assert all(a["chosen"] == "none" or a["probe"] or a["confirm"] for a in got[100:])
        return sum(not (a["idle"] or a["settled"]) for a in got[100:])

    fixed = weighings()
    record = ProbeSchedule.record

    def forgetting(self, *args, **kw):
        record(self, *args, **kw)
        self._screened = set()

    monkeypatch.setattr(ProbeSchedule, "record", forgetting)
    control = weighings()
    assert fixed <= 0.7 * control, (fixed, control)
