"""Switches weighed against the noise of what they compare, and a fallback whose history a re-check cut short (issue 56).

A switch away from the fallback on a rival's gain within the noise of the two medians it compares measures the rival
again first, and adds that measurement to its history (``policies.probes.confirm``); a switch back to the fallback is
taken at once; while it is held, the rival and the policy in force are measured in turn. The fallback, once measured
FEW_RUNS times, whose history a re-check or a confirmation replaced by
fewer, is probed every ``probe_every`` decisions whatever its estimate (``ProbeSchedule.uncertain``).
"""

from __future__ import annotations

import math

from ultraep.policies import AdaptivePolicy
from ultraep.policies import probes as probes_mod
from ultraep.policies.outcomes import MEDIAN_SE, NOISE_Z, OutcomeTracker
from ultraep.policies.probes import ProbeSchedule
from test_adaptive_settled import _cm, _load  # noqa: E402

#: ``none``'s per-call factors: an alternation whose successive log-differences (0.2) make its spread about 0.21
WIGGLE = (1.1, 0.9)


def _run(calls: int, measured) -> list[dict]:
    """``none`` and quota on a near-uniform load (the model keeps ``none`` in force); the chosen candidate measures
    ``measured(i, name, reason)`` x 10 ms."""
    cm, load = _cm(), _load(0.05)
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"))
    out = []
    for i in range(calls):
        plan = pol.plan(load, cm.topology)
        pol.commit(plan)
        a = plan.info["adaptive"]
        pol.observe_outcome(a["chosen"], pol.cost_model.predict(plan).total_s,
                            1e-2 * measured(i, a["chosen"], a["reason"]))
        out.append({**a, "support": pol.outcomes.support("quota")})
    return out


def _lucky_first_quota():
    """quota measures 15 % under ``none``'s level on its first call, 10 % over it after; ``none`` wiggles +-10 %."""
    seen = []

    def measured(i, name, reason):
        if name == "quota":
            seen.append(i)
            return 0.85 if len(seen) == 1 else 1.1
        return WIGGLE[i % 2]
    return measured


def test_a_gain_within_the_noise_is_measured_again_before_the_switch(monkeypatch):
    """quota's one lucky call puts it 15-20 % ahead of ``none``, whose calls vary by +-10 %: the engine measures quota
    again (its history kept and added to), finds it slower and stays on ``none``. The negative control, without the
    noise check, switches to quota on that one call."""
    got = _run(40, _lucky_first_quota())
    first = next(i for i, a in enumerate(got) if a["chosen"] == "quota")
    noisy = [a for a in got if "within their noise" in a["reason"]]
    assert noisy and noisy[0]["reason"].startswith(("confirm: none -> quota", "pair: none -> quota")), \
        [a["reason"] for a in got[:first + 3]]
    assert not noisy[0]["restart"] and max(a["support"] for a in got) >= 2  # added to, not replaced
    assert not any(a["reason"].startswith("switch none -> quota") for a in got)
    assert got[-1]["chosen"] == "none"

    monkeypatch.setattr(probes_mod, "_within_noise", lambda *a, **k: None)
    got = _run(40, _lucky_first_quota())
    first = next(i for i, a in enumerate(got) if a["chosen"] == "quota")
    assert got[first + 1]["reason"].startswith("switch none -> quota"), got[first + 1]["reason"]


def _slow_until_quota(start: int):
    """From decision ``start`` the machine runs 30 % slower until quota next runs; quota is 15 % slower than ``none``
    on the same machine state; both vary by +-5 %."""
    slow = []

    def measured(i, name, reason):
        if i == start:
            slow.append(True)
        if name == "quota" and slow and slow[-1]:
            slow.append(False)  # quota's next run finds the machine fast again
        level = 1.3 if slow and slow[-1] else 1.0
        return level * (1.15 if name == "quota" else 1.0) * (1.05, 0.95)[i % 2]
    return measured


def test_a_switch_within_the_noise_measures_both_sides_in_turn(monkeypatch):
    """``none``'s calls ran 30 % slow for a stretch, then the machine sped up as quota was probed: quota, 15 % slower
    than ``none`` on the same machine, reads "11.5 % faster" against ``none``'s slow median. The engine measures
    ``none`` beside quota's fresh call (the clock then credits the slow calls) and stays on ``none``. The negative
    control, confirming on quota's calls alone, adds them until the gain clears the noise and switches to quota."""
    got = _run(120, _slow_until_quota(60))
    held = [i for i, a in enumerate(got) if "within their noise" in a["reason"]]
    assert held and any(got[i]["chosen"] == "none" and got[i]["reason"].startswith("pair: none -> quota")
                        and "none measured beside it first" in got[i]["reason"] for i in held), \
        [a["reason"] for a in got[60:80]]
    assert not any(a["reason"].startswith("switch none -> quota") for a in got)
    assert sum(a["chosen"] == "quota" for a in got[60:]) <= 6

    monkeypatch.setattr(probes_mod, "_in_turn", lambda schedule, target, current, why: (why, False, target))
    got = _run(120, _slow_until_quota(60))
    assert any(a["reason"].startswith("switch none -> quota") for a in got[60:])


def test_the_noise_a_switch_must_clear_shrinks_with_the_measurements_and_spares_the_fallback():
    """:meth:`OutcomeTracker.resolution`: NOISE_Z standard errors of the difference of two medians, from the policy in
    force's spread; a switch back to the fallback is never held for it."""
    o = OutcomeTracker(_cm(), window=5, switch_now=0.02, probe_every=32)
    assert o.resolution("quota", "none") is None  # nothing measured
    for k in range(12):  # none in force, alternating +-10 %, then quota measured k times
        o.observing = ("none", 1e-2, 7)
        o.decisions += 1
        o.observe("none", 1e-2, 1e-2 * WIGGLE[k % 2], "none")
    assert 0.18 < o.spread("none") < 0.24
    sched = ProbeSchedule(32, 0.25, 0.02, o, fallback="none")
    needs, held = [], []
    for k in range(5):
        o.observing = ("quota", 1e-2, 7)
        o.decisions += 1
        o.observe("quota", 1e-2, 1e-2, "none")
        needs.append(o.resolution("quota", "none"))
        held.append(probes_mod._within_noise(sched, "quota", "none", 0.05) is not None)
        assert probes_mod._within_noise(sched, "none", "quota", 0.05) is None  # back to the fallback: at once
        assert probes_mod._within_noise(sched, "quota", "none", needs[-1] + 0.01) is None  # beyond the noise: at once
    assert all(a > b for a, b in zip(needs, needs[1:])), needs  # each measurement narrows it
    assert abs(needs[0] - math.expm1(NOISE_Z * MEDIAN_SE * o.spread("none") * math.sqrt(1 + 1 / 5))) < 1e-9
    assert held == [True, True, True, True, False]  # a 5 % gain is held until quota's median is of outcome_window


def test_a_fallback_cut_to_one_slow_call_is_probed_again(monkeypatch):
    """quota in force, ``none`` 30 % slower; the re-check of ``none`` after the switch to quota measures one call 3x
    slow, and that call is ``none``'s whole history. Ten decisions later ``none`` turns 20 % faster than quota. As
    uncertain, ``none`` is probed again at ``probe_every`` and taken back within 150 decisions; paced by its estimate
    (the negative control) it is not probed again for 8 x ``probe_every`` decisions."""

    def run():
        cm, load = _cm(), _load(1.0)
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"))
        out, outlier = [], None
        for i in range(400):
            plan = pol.plan(load, cm.topology)
            pol.commit(plan)
            a = plan.info["adaptive"]
            m = 1.0
            if a["chosen"] == "none":
                m = 0.8 if i < 40 or (outlier is not None and i >= outlier + 10) else 1.3
                if i >= 40 and outlier is None and "re-checked" in a["reason"]:
                    m, outlier = 3.0, i
            pol.observe_outcome(a["chosen"], pol.cost_model.predict(plan).total_s, 1e-2 * m)
            out.append(a)
        assert outlier is not None
        back = next((i for i, a in enumerate(out) if i > outlier and a["reason"].startswith("switch quota -> none")),
                    None)
        return outlier, back

    outlier, back = run()
    assert back is not None and back - outlier <= 150, (outlier, back)
    monkeypatch.setattr(ProbeSchedule, "uncertain", lambda self, name: False)
    outlier, back = run()
    assert back is None or back - outlier > 230, (outlier, back)


def test_the_fallbacks_re_check_runs_whatever_the_probe_ledger_holds(monkeypatch):
    """``none`` in force, quota 10 % slower, eplb 60 % slower. From decision 130 the probes' ledger is overdrawn (ten
    calls of probes past their room, as EPLB's costly probes left it on the runtime) and ``none``'s calls run 40 % slow
    until quota next runs: that probe switches to quota, and ``none``'s estimate stays at its slow calls. Its re-check
    after the switch runs at once and the engine switches back within a few decisions; charged to the ledger (the
    negative control), the re-check waits and quota holds for the rest of the run."""

    def run() -> list[dict]:
        cm, load = _cm(), _load(0.05)
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota", "eplb"))
        out: list[dict] = []
        for i in range(300):
            if i == 130:
                pol.schedule.loss_s += 0.1
            plan = pol.plan(load, cm.topology)
            pol.commit(plan)
            a = plan.info["adaptive"]
            m = {"eplb": 1.6, "quota": 1.1}.get(a["chosen"], 1.0)
            if a["chosen"] == "none" and i >= 130 and not any(x["chosen"] == "quota" for x in out[130:]):
                m = 1.4
            pol.observe_outcome(a["chosen"], pol.cost_model.predict(plan).total_s, 1e-2 * m * (1.02, 0.98)[i % 2])
            out.append(a)
        return out

    got = run()
    switched = next(i for i, a in enumerate(got) if a["reason"].startswith("switch none -> quota"))
    back = next(i for i, a in enumerate(got) if i > switched and a["reason"].startswith("switch quota -> none"))
    assert any("none re-checked" in a["reason"] for a in got[switched:back]), [a["reason"] for a in got[switched:back]]
    assert back - switched <= 8 and sum(a["chosen"] == "quota" for a in got[130:]) <= 8

    monkeypatch.setattr(probes_mod, "_owed", lambda schedule: None)
    got = run()
    switched = next(i for i, a in enumerate(got) if a["reason"].startswith("switch none -> quota"))
    assert sum(a["chosen"] == "quota" for a in got[switched:]) > 100


def test_a_policy_a_switch_left_on_few_measurements_is_owed_its_re_check():
    """eplb in force; quota, left by the switch to it, was measured once (a fresh wrap's slow third call) and its
    estimate is 40 % behind, past ``probe_max_loss``, with the probe ledger overdrawn. Its re-check is owed at its
    period (``probe_every / 8``) all the same: the switch may rest on that one call. The control: left after FEW_RUNS
    measurements, its estimate is trusted and the re-check waits for the ledger and the range, as any probe."""
    from ultraep.policies.outcomes import FEW_RUNS

    def schedule(runs: int) -> ProbeSchedule:
        t = OutcomeTracker(None, 5, 0.02, 32)
        t.observed = 10
        t._outcome_anchor = {"none": (0.0, FEW_RUNS), "quota": (0.3, runs), "eplb": (0.0, FEW_RUNS)}
        s = ProbeSchedule(32, 0.25, 0.02, t, 0.05, FEW_RUNS, 0.02, 0.0025, fallback="none")
        s._ran.update({"none", "quota", "eplb"})
        s._recheck.add("quota")
        s._since.update({"none": 1, "quota": 32 // 8, "eplb": 0})
        s.decisions, s.loss_s = 20, 1.0  # the ledger overdrawn
        return s

    feasible = {"none": 1.3, "quota": 1.4, "eplb": 1.0}
    few = schedule(1)
    assert probes_mod._owed(few) == "quota" and few.probe(feasible, "eplb", "eplb", "none") == "quota"
    assert "quota" in few.probe_range(["none", "quota"], 1.0, feasible)
    few._since["quota"] = 32 // 8 - 1
    assert probes_mod._owed(few) is None  # not due yet
    trusted = schedule(FEW_RUNS)
    assert probes_mod._owed(trusted) is None and trusted.probe(feasible, "eplb", "eplb", "none") is None
