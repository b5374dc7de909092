"""Adaptive engine: none on tiny skew, quota on large skew, no flapping, deadline fallback, recording."""

import numpy as np
import pytest

from ultraep.config import AdaptiveOptions, BalancerConfig
from ultraep.cost import CostModel, CostParams
from ultraep.engine import Engine
from ultraep.policies import AdaptivePolicy, make_policy
from ultraep.presets import get_preset
from ultraep.sim.workload import power_law_popularity


def _cm(params=None):
    pre = get_preset("gb200-nvl72")
    return CostModel(pre.topology(32, 64, 2), pre.hardware, pre.expert, params)


def _load(skew: float, seed: int = 0, R: int = 32, E: int = 64) -> np.ndarray:
    """Expected-value load (no sampling noise) of 8192 tokens x top-8 per rank, power-law popularity."""
    p = power_law_popularity(R, E, skew, np.random.default_rng(seed))
    return np.rint(np.outer(np.full(R, 8192 * 8), p)).astype(np.int64)


def test_tiny_skew_picks_none_and_skips_the_quota_planner():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm)
    plan = pol.plan(_load(0.001), cm.topology)
    a = plan.info["adaptive"]
    assert a["chosen"] == "none" and a["reason"] == "cheapest"
    assert "quota" in a["screened"]  # cannot pay for its own planner
    assert plan.num_replicas == 0
    assert a["predicted_s"] == pytest.approx(cm.predict(plan).total_s)


def test_large_skew_picks_quota_with_every_prediction_recorded():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm)
    plan = pol.plan(_load(2.0), cm.topology)
    plan.check()
    a = plan.info["adaptive"]
    assert a["chosen"] == "quota" and plan.policy == "adaptive"
    assert set(a["predictions"]) == {"none", "quota", "eplb", "feplb", "hybridep"}
    assert a["predictions"]["quota"] == min(a["predictions"].values())
    assert cm.predict(plan).total_s == pytest.approx(a["predictions"]["quota"] + plan.engine_s)


def test_constant_workload_does_not_flap():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm)
    chosen, probes = [], 0
    for _ in range(25):
        plan = pol.plan(_load(1.0), cm.topology)
        if plan.decision.probe:  # bounded exploration: each candidate near the best runs once to be measured
            probes += 1
        else:
            chosen.append(plan.decision.chosen)
        pol.commit(plan)
    assert len(set(chosen)) == 1
    assert probes <= len(pol.policies) - 1


def test_hysteresis_keeps_the_current_policy_on_small_gains():
    cm = _cm()
    # margin 50 %: alternating loads whose best policy differs never beat the current one by that much
    pol = AdaptivePolicy(cost_model=cm, margin=0.5, switch_now=1.0, candidates=("none", "quota"), probe_every=0)
    chosen = []
    for i in range(10):
        plan = pol.plan(_load(0.001 if i % 2 else 0.6), cm.topology)
        chosen.append(plan.info["adaptive"]["chosen"])
        pol.commit(plan)
    assert len(set(chosen)) == 1
    # patience 3: a switch needs three consecutive wins
    pol = AdaptivePolicy(cost_model=cm, margin=0.0, switch_now=1.0, patience=3, candidates=("none", "quota"),
                         probe_every=0)
    seq = []
    for load in [_load(0.001)] + [_load(2.0)] * 4:
        plan = pol.plan(load, cm.topology)
        seq.append(plan.info["adaptive"]["chosen"])
        pol.commit(plan)
    assert seq == ["none", "none", "none", "quota", "quota"]


def test_late_plans_fall_back_to_none():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, deadline_s=1e-6, candidates=("none", "quota"), screen=False)
    plan = pol.plan(_load(2.0), cm.topology)
    a = plan.info["adaptive"]
    assert a["chosen"] == "none" and a["late"] == ["quota"] and a["reason"].startswith("late")


def test_commit_of_a_replayed_plan_advances_candidate_history():
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "eplb"))
    load = _load(1.5)
    plan = pol.plan(load, cm.topology)
    pol._memo = None  # as if the plan came back from a recording
    pol.commit(plan)
    assert len(pol.policies["eplb"]._history) == 1


def test_candidates_must_include_none():
    from ultraep.errors import ConfigError

    with pytest.raises(ConfigError, match="must include 'none'"):
        AdaptivePolicy(candidates=("quota",))
    with pytest.raises(ConfigError, match="candidate_options.feplb"):
        AdaptivePolicy(candidates=("none", "quota"), candidate_options={"feplb": {}})


def test_engine_records_decisions_and_calibrates():
    class Rec:
        def __init__(self):
            self.plans, self.decisions, self.timings = [], [], []

        def record_plan(self, *a, **k):
            self.plans.append(a)

        def record_decision(self, step, mb, layer, **k):
            self.decisions.append((step, mb, layer, k))

        def record_timings(self, step, mb, layer, timings):
            self.timings.append((step, mb, layer, timings))

    cm = _cm()
    cfg = BalancerConfig(policy="adaptive", layers={1: AdaptiveOptions(candidates=("none", "quota"))})
    rec = Rec()
    eng = Engine(cfg, cm.topology, cost_model=cm, recorder=rec)
    d0 = eng.decide(0, 0, 0, _load(2.0))
    d1 = eng.decide(0, 0, 1, _load(0.001))
    assert (d0.chosen, d1.chosen) == ("quota", "none") and d0.configured == "adaptive"
    assert set(d1.predictions) == {"none"} or set(d1.predictions) == {"none", "quota"}
    eng.commit(d0)
    eng.commit(d1)
    assert rec.decisions[0][3]["policy"] == "quota" and "predictions" in rec.decisions[0][3]
    rows = eng.observe(0, 0, 0, {"compute_fwd_s": 3 * d0.predicted.compute_fwd_s})
    assert rows[0]["term"] == "compute_fwd_s" and rows[0]["ratio"] == pytest.approx(3.0)
    assert eng.cost_model.params.compute_scale > 1.0
    assert rec.timings[-1][3]["measured.compute_fwd_s"] == pytest.approx(3 * d0.predicted.compute_fwd_s)
    # the calibrated model reaches the adaptive policy of every layer
    assert eng.policy_for(0).cost_model.params.compute_scale == eng.cost_model.params.compute_scale


def test_engine_fixed_policy_and_prefill_mode():
    cm = _cm(CostParams(mode="prefill"))
    eng = Engine(BalancerConfig(policy="feplb"), cm.topology, cost_model=cm)
    d = eng.decide(3, 1, 0, _load(1.5))
    assert d.chosen == "feplb" and d.reason == "configured policy feplb" and d.predicted.bwd_s == 0
    d.plan.check()
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)


#: the mechanisms these tests pin (outcome bases, clocks, credits, re-checks) on the probe schedule without the
#: cost pacing of a fresh wrap's first calls (``probe_cost_share``; tests/test_adaptive_first_calls.py tests it)
UNPACED = {"probe_cost_share": None}


def _run(pol, cm, load, measured):
    """One decision, committed, and its measured layer time ``measured(chosen)`` fed back as the engine does."""
    plan = pol.plan(load, cm.topology)
    pol.commit(plan)
    a = plan.info["adaptive"]
    pol.observe_outcome(a["chosen"], pol.cost_model.predict(plan).total_s, measured(a["chosen"]))  # as the engine
    return a


def test_a_candidate_that_ran_keeps_its_measured_time_when_calibration_drifts():
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=8, probe_max_loss=10.0,
                         **UNPACED)
    load = _load(1.0)
    truth = {"none": 2e-3, "quota": 1e-3}  # what each really takes on this machine
    for _ in range(OUTCOME_WARMUP + 12):
        _run(pol, cm, load, truth.get)
    assert pol.outcomes._outcome_anchor.keys() == {"none", "quota"} and pol.current == "quota"
    # calibration learned from quota's runs now says compute is 5x slower: the calibrated model would put none
    # (never run since) at 5x what it measured; its estimate stays at its measured time
    pol.cost_model = cm.with_params(cm.params.model_copy(update={"compute_scale": 5.0}))
    a = pol.plan(load, cm.topology).info["adaptive"]
    assert a["predictions"]["none"] == pytest.approx(truth["none"], rel=0.05)
    calibrated_none = pol.cost_model.predict(pol._memo[1]["none"]).total_s * pol.outcomes.correction("none")
    assert calibrated_none > 3 * truth["none"]


def test_a_candidate_measured_only_once_or_twice_is_probed_again_sooner():
    from ultraep.policies.adaptive import FEW_RUNS, OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=32, probe_max_loss=10.0,
                         **UNPACED)
    load = _load(1.0)
    runs = []
    for _ in range(OUTCOME_WARMUP + 40):
        runs.append(_run(pol, cm, load, {"none": 2e-3, "quota": 1e-3}.get)["chosen"])
    # none is measured FEW_RUNS times within the first probe_every decisions (every probe_every / 8), then
    # once per probe_every
    first = runs[:32]
    assert first.count("none") >= FEW_RUNS
    assert runs[32:].count("none") <= 2


def test_a_candidate_due_for_a_probe_is_not_screened_for_its_measured_outcome():
    """The runtime's FEPLB lock-in: quota's one measured call was slowed by something else, its outcome made it
    look slow, the screen then skipped planning it — and an unplanned candidate is never probed. Once due for a
    probe (measured fewer than FEW_RUNS times: every probe_every / 8 decisions) it is planned again."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota", "feplb"), probe_every=32)
    load = _load(1.0)
    pol.hysteresis.current, pol.schedule._ran, pol.outcomes.observed = "feplb", {"none", "quota", "feplb"}, 10
    slow = (float(np.log(50.0)), 1)  # one run, looked 50x slow
    pol.outcomes._outcome["quota"] = pol.outcomes._outcome_anchor["quota"] = slow
    ref = {"feplb": 1.01 * cm.ideal(load).total_s}
    pol.schedule._since = {"none": 9, "feplb": 0, "quota": 3}
    pol.schedule._unplanned = {"quota": 3}  # screened since it ran
    assert "quota" in pol.screened(load, cm.topology, others_s=ref)  # not due yet: the bound holds
    pol.schedule._since["quota"] = pol.schedule._unplanned["quota"] = 4
    assert "quota" not in pol.screened(load, cm.topology, others_s=ref)
    pol.outcomes._outcome_anchor["quota"] = (float(np.log(50.0)), 3)  # measured enough: due only every probe_every
    assert "quota" in pol.screened(load, cm.topology, others_s=ref)


def test_outcome_is_the_median_of_the_last_runs():
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    pol = AdaptivePolicy(cost_model=_cm(), outcome_window=5)
    for _ in range(OUTCOME_WARMUP):
        pol.observe_outcome("none", 1.0, 1.0)
    for m in (1.0, 1.1, 3.0, 0.9, 1.0):  # one 3x outlier among ratios near 1
        pol.observe_outcome("none", 1.0, m)
    assert pol.outcomes.correction("none") == pytest.approx(1.0)
    for m in (2.0, 2.0, 2.0):  # a lasting change moves it within half a window
        pol.observe_outcome("none", 1.0, m)
    assert pol.outcomes.correction("none") == pytest.approx(2.0)


def test_a_candidate_that_does_what_none_does_is_not_chosen_over_none_for_noise():
    """HybridEP choosing plain EP runs exactly none's layer: measured a few % faster by chance, it must not take
    over (and flip back and forth) — none stands for it (the runtime at 64 tokens per rank)."""
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "hybridep"), probe_every=4)
    load = _load(0.3)
    noise = {"none": 1.0, "hybridep": 0.9}  # the same work, measured 10 % apart
    decisions = [_run(pol, cm, load, lambda n: noise[n] * 1e-3) for _ in range(OUTCOME_WARMUP + 20)]
    # planned, it is none under another name; after LOSING_STREAK such decisions it rests (Step 1) until due
    assert all(a["same_as_none"] == ["hybridep"] or a["screened"] == ["hybridep"] for a in decisions[1:])
    assert any(a["screened"] == ["hybridep"] for a in decisions)
    assert {a["chosen"] for a in decisions} == {"none"}


def test_the_policy_in_force_is_compared_on_the_same_basis_as_its_rivals():
    """Once the policy in force and a rival have both been measured, a jump of the calibrated model (one noisy
    call) moves neither estimate: before, only the current's moved, and the engine switched away and back."""
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=8, probe_max_loss=10.0,
                         **UNPACED)
    load = _load(1.0)
    truth = {"none": 2e-3, "quota": 1e-3}
    for _ in range(OUTCOME_WARMUP + 30):
        _run(pol, cm, load, truth.get)
    assert pol.current == "quota" and pol.outcomes._outcome_anchor["none"][1] >= 1
    pol.cost_model = cm.with_params(cm.params.model_copy(update={"compute_scale": 5.0}))  # a calibration jump
    a = pol.plan(load, cm.topology).info["adaptive"]
    assert a["predictions"]["quota"] == pytest.approx(truth["quota"], rel=0.05)
    assert a["chosen"] == "quota"


def _drive(pol, cm, load, truth, slow, decisions):
    """``decisions`` committed decisions; the chosen candidate's measured time is ``truth[name]`` times the
    slowdown ``slow(decision, name)``. Returns the chosen names."""
    chosen = []
    for i in range(decisions):
        chosen.append(_run(pol, cm, load, lambda n, i=i: truth[n] * slow(i, n))["chosen"])
    return chosen


def test_a_probe_measured_while_the_whole_machine_ran_slower_is_credited(monkeypatch):
    """The interleaved runtime benchmark's first calls run 10-30 % slower whatever runs; a rival probed then
    looked slower than the policy in force measured later, and was not chosen until its next probe. Paired with
    the policy in force, measured in the same slow moments, it is credited with the difference at once."""
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    def run(credit: bool):
        cm = _cm()
        pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=128, probe_max_loss=10.0,
                             **UNPACED)
        if not credit:
            monkeypatch.setattr(pol.outcomes, "credit", lambda ref, when, now=None: 0.0)
        truth = {"none": 0.9e-3, "quota": 1.0e-3}  # the model picks quota first; none is really faster
        warm = [1.4, 1.3, 1.2]  # the machine's slowdown in its first calls, then none
        return pol, _drive(pol, cm, _load(0.2), truth, lambda i, n: warm[i] if i < len(warm) else 1.0, 12)

    pol, chosen = run(credit=True)
    # none's probe inside the warm-up is not counted: it is probed again at once, still in the slow part
    assert chosen[:OUTCOME_WARMUP + 1] == ["quota", "none", "none"]
    assert pol.current == "none" and chosen[-1] == "none"
    # without the credit, none looked 1.08 against quota's 1.0 and waited for its next probe (16 decisions)
    pol, chosen = run(credit=False)
    assert pol.current == "quota" and chosen[3:] == ["quota"] * 9


def test_a_measurement_whose_clock_stopped_is_read_on_the_clock_in_force(monkeypatch):
    """A fresh wrap whose first calls run 1.4-1.8x slower: quota, in force then, is measured only there, and a switch
    leaves eplb in force. Quota's clock stopped with it; eplb's, measured beside quota's last calls, shows the machine
    1.3x faster since, and quota's measurements are credited with that (within CLOCK_REACH decisions of eplb's).
    Read on quota's own clock they kept it 1.5x behind, out of probe range (tests/first_calls_replay.py's
    tok512-long-warm held eplb at 1.09-1.13x quota's time)."""
    from ultraep.policies.outcomes import CLOCK_REACH, OUTCOME_WARMUP, OutcomeTracker

    def run(stopped_clocks_read: bool) -> OutcomeTracker:
        t = OutcomeTracker(None, 5, 0.02, 32)
        if not stopped_clocks_read:  # negative control: every measurement on its own clock, as before
            monkeypatch.setattr(t, "_clock_of", lambda ref, when, now: (ref, now))
        calls = [("quota", "quota", m) for m in (1.8, 1.7, 1.6, 1.5, 1.4)] + [("eplb", "quota", 1.45)]
        calls += [("eplb", "eplb", 1.1)] * 10
        for name, in_force, measured in calls:
            t.decisions += 1
            t.observing = (name, 1.0, 0)
            t.observe(name, 1.0, measured, in_force)
        return t

    assert CLOCK_REACH == 2 and OUTCOME_WARMUP == 2  # quota's kept calls: decisions 2-4, eplb's first at 5
    t = run(stopped_clocks_read=True)
    # quota's calls at decisions 3 and 4 are within reach of eplb's at 5 and credited with log(1.45 / 1.1) less the
    # switch_now margin; the one at 2 is not
    credit = np.log(1.45 / 1.1) - np.log1p(0.02)
    assert t.scale("quota") == pytest.approx(1.5 * np.exp(-credit), rel=1e-9)
    assert t.scale("quota") < 1.2 and t.scale("eplb") == pytest.approx(1.1)
    assert run(stopped_clocks_read=False).scale("quota") == pytest.approx(1.5)  # the median of 1.6, 1.5, 1.4 as measured


def test_a_policy_in_force_that_slows_down_itself_does_not_make_its_rivals_look_slower():
    """Only a faster machine is credited: the policy in force getting slower (its own cost) is not read as
    the machine slowing down, which would have raised every rival's estimate with it and kept it in force."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=128, probe_max_loss=10.0,
                         **UNPACED)
    truth = {"none": 1.1e-3, "quota": 1.0e-3}
    chosen = _drive(pol, cm, _load(0.2), truth, lambda i, n: 1.3 if (i >= 6 and n == "quota") else 1.0, 14)
    assert chosen[:2] == ["quota", "none"] and pol.current == "none"


def test_the_fallback_is_measured_even_when_the_model_puts_it_far_behind():
    """At 64 tokens per rank the uncalibrated model put none 27 % above FEPLB, past ``probe_max_loss``, so none was
    never probed and the engine ran a balancing policy slower than none for the whole run. Where outcomes are
    measured, the fallback is probed until it has run; once measured faster, it takes over. Paced by cost, its first
    probe is charged at most ``probe_max_loss`` of the policy in force (here the model puts it 17x above quota):
    it waits at most ``probe_max_loss / probe_cost_share`` decisions after the warm-up."""
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=32, probe_max_loss=0.25)
    load = _load(2.0)
    plan = pol.plan(load, cm.topology)
    first = plan.info["adaptive"]
    assert first["chosen"] == "quota" and first["predictions"]["none"] > 1.25 * first["predictions"]["quota"]
    pol.commit(plan)
    truth = {"none": 1e-3, "quota": 2e-3}  # on this machine none is twice as fast as the model says it is
    pol.observe_outcome("quota", first["predicted_s"], truth["quota"])
    wait = OUTCOME_WARMUP + int(0.25 / pol.schedule.cost_share) + 1
    runs = [_run(pol, cm, load, truth.get) for _ in range(wait + 8)]
    assert any(r["chosen"] == "none" and r["probe"] for r in runs[:wait])
    assert pol.current == "none" and [r["chosen"] for r in runs[-3:]] == ["none"] * 3


def test_a_switch_on_a_stale_measurement_measures_the_target_again_first():
    """A rival measured long ago (on another machine state) is not switched to on that measurement: it runs once
    as a probe, and the switch happens only if the fresh measurement still wins."""
    from ultraep.policies.adaptive import OUTCOME_WARMUP

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=32, probe_max_loss=10.0,
                         **UNPACED)
    load = _load(1.0)
    truth = {"none": 1.0e-3, "quota": 1.5e-3}
    for _ in range(OUTCOME_WARMUP + 16):
        _run(pol, cm, load, truth.get)
    assert pol.current == "none" and pol.outcomes.runs("quota") >= 1
    truth = {"none": 2.0e-3, "quota": 3.0e-3}  # the whole machine slows down; quota's last measurement is stale
    seen = [_run(pol, cm, load, truth.get) for _ in range(10)]
    wanted = [a for a in seen if a["reason"].startswith(("switch", "confirm"))]
    assert wanted and wanted[0]["reason"].startswith("confirm: none -> quota") and wanted[0]["probe"]
    assert not any(a["reason"].startswith("switch") for a in seen)  # measured again, quota still loses
    assert pol.current == "none"


def test_the_policy_a_switch_left_is_measured_again_and_taken_back_when_it_wins():
    """The runtime at the default shape (2026-11-26): quota's runs in the engine's first calls were slow (the
    machine's first calls), one eplb probe right after measured below quota's median of those, the engine switched
    to eplb, and quota was not measured again in the run (11 % slower than quota's own run). The policy a switch
    left is re-checked within probe_every / 8 decisions, its fresh measurement replacing its history."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota", "eplb"), probe_every=32,
                         **UNPACED)
    truth = {"none": 2e-3, "quota": 1.0e-3, "eplb": 1.08e-3}
    chosen = _drive(pol, cm, _load(1.0), truth, lambda i, n: 1.2 if i < 8 else 1.0, 40)  # slow first 8 calls
    switch = next(i for i in range(1, 40) if chosen[i] == chosen[i - 1] == "eplb")  # eplb in force (not a probe)
    assert switch < 16  # the scenario: the engine did switch to eplb on quota's stale runs
    back = next(i for i in range(switch, 40) if chosen[i] == "quota")
    assert back - switch <= 32 // 8 + 2  # re-checked within probe_every / 8 (before: at the next probe, 32 later)
    assert pol.current == "quota" and chosen[-10:] == ["quota"] * 10
    assert chosen[back:].count("eplb") <= 2  # eplb, left in turn, is re-checked once, then rests


def test_a_candidate_is_re_checked_at_most_once_per_probe_period():
    from policies.probes import ProbeSchedule, probe_reason

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, candidates=("none", "quota"), probe_every=16)
    pol.outcomes.observed = 5  # outcomes are measured (the runtime)
    s: ProbeSchedule = pol.schedule
    names = ("none", "quota")
    rechecked = lambda n: probe_reason(s, n, "x").startswith(f"probe: {n} re-checked")  # noqa: E731

    def record(chosen, preds, left):  # one committed decision, as AdaptivePolicy.commit records it
        pol.outcomes.decisions += 1
        s.record(names, chosen, preds, set(), False, left=left)

    record("quota", {"none": 2.0, "quota": 1.0}, "none")  # none -> quota
    assert rechecked("none") and not rechecked("quota")
    record("none", {"none": 2.0, "quota": 1.0}, None)  # the re-check (a probe)
    assert pol.outcomes.restart == "none" and not rechecked("none")  # its fresh run replaces its history
    record("none", {"none": 1.0, "quota": 2.0}, "quota")  # switched back
    assert rechecked("quota")  # quota's first re-check
    record("quota", {"none": 2.0, "quota": 1.0}, "none")  # and forth again
    assert not rechecked("quota")  # it ran
    assert not rechecked("none")  # none was marked 3 decisions ago: not again within probe_every
    for _ in range(16):
        record("quota", {"none": 2.0, "quota": 1.0}, "quota")
    record("none", {"none": 1.0, "quota": 2.0}, "quota")
    record("quota", {"none": 2.0, "quota": 1.0}, "none")
    assert rechecked("none")  # a probe period later, a switch marks it again
