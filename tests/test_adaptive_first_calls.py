"""A fresh wrap's first calls (issue 56, items 4 and 5): the adaptive engine explores at the pace the run can afford.

The probes' predicted seconds over the policy in force are paid from ``probe_cost_share`` of its predicted time,
at every decision from the first; none runs in the outcome warm-up; the cheapest due probe runs first (the
unmeasured fallback before the others); a probe is charged what it measured once measured. Replayed on the runtime
benchmark's layer (``tests/first_calls_replay.py``: the real engine, synthetic measured times), the schedule before
(``probe_cost_share=None``: every rival probed FEW_RUNS times at ``probe_every / 8`` from the second call) is the
negative control."""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from first_calls_replay import SCENARIOS, compare, window  # noqa: E402

from ultraep.policies.outcomes import OUTCOME_WARMUP, OutcomeTracker  # noqa: E402
from ultraep.policies.probes import ProbeSchedule  # noqa: E402

UNPACED = {"probe_cost_share": None}
#: adaptive >= 0.95x of the best fixed policy over the first 20 calls: its summed time at most this over the best's
FIRST_BOUND = 1 / 0.95


@pytest.mark.parametrize("shape", ["default", "tok64"])
def test_the_first_20_calls_lose_at_most_5_percent_to_the_best_fixed_policy(shape):
    for seed in range(5):
        paced = window(compare(SCENARIOS[shape], 20, seed), 0, 20)
        assert paced["ratio"] <= FIRST_BOUND, (shape, seed, paced["ratio"], paced["best"])
        # negative control: the burst probed every rival from the second call, none whatever its prediction
        burst = window(compare(SCENARIOS[shape], 20, seed, UNPACED), 0, 20)
        assert burst["ratio"] > FIRST_BOUND, (shape, seed, burst["ratio"])
        assert paced["probes"] < burst["probes"]


@pytest.mark.parametrize("shape", ["default", "tok64"])
def test_from_call_20_on_it_stays_within_3_percent(shape):
    """The probes the first calls did not run are not deferred into a loss later: calls 20-60 stay within 3 % of the
    best fixed policy (it measures every rival in time to choose right)."""
    for seed in range(3):
        later = window(compare(SCENARIOS[shape], 60, seed), 20)
        assert later["ratio"] <= 1.03, (shape, seed, later["ratio"], later["best"])


def test_where_nothing_pays_and_the_model_says_so_it_stays_on_none():
    """64 tokens per rank, 16 experts, 2 slots, ``none`` measured fastest and predicted so: adaptive within 2 % of
    ``none`` over the first 20 calls and over 60. The burst's probes of every rival cost 3.5 % of the first 20."""
    s = SCENARIOS["tok64-e16"]
    for seed in (0, 4):  # the seeds whose load the model puts none first on (the others: test above's kind)
        c = compare(s, 60, seed)
        assert c["adaptive"]["chosen"][0] == "none"
        assert window(c, 0, 20)["vs_none"] >= 0.98 and window(c)["vs_none"] >= 0.98, (seed, window(c, 0, 20))
        burst = compare(s, 20, seed, UNPACED)
        assert window(burst, 0, 20)["vs_none"] < 0.98, seed  # negative control


def test_a_long_warm_up_does_not_strand_it_on_a_slower_policy(monkeypatch):
    """Calls 20-80 within 3 % of the best fixed policy after a warm-up of 8 calls at 1.8-1.1x. Two rules hold it:
    quota's warm-up calls are read on the clock in force once quota's own stopped (:meth:`.OutcomeTracker.credit`;
    without it seed 0 held eplb at 1.125 of quota), and the re-check of a policy a switch left on fewer than FEW_RUNS
    measurements is owed (``probes._owed``): seeds 0 and 2 come to 1.020 and 1.018 of quota. The negative control owes
    the fallback's re-check alone, as before: 1.030 and 1.070, feplb held."""
    s = SCENARIOS["tok512-long-warm"]
    for seed in (0, 2):
        later = window(compare(s, 80, seed), 20)
        assert later["ratio"] <= 1.03, (seed, later["ratio"], later["best"])
    import ultraep.policies.probes as probes_mod

    def fallback_only(schedule):
        fb = schedule.fallback
        return fb if fb in schedule._recheck and schedule.due(fb) else None

    monkeypatch.setattr(probes_mod, "_owed", fallback_only)
    assert window(compare(s, 80, 2), 20)["ratio"] > 1.05


def test_the_same_calls_with_a_short_warm_up_stay_within_3_percent():
    """The control of the test above: the same shape, noise and seeds with the 3-call warm-up of the other scenarios."""
    s = dataclasses.replace(SCENARIOS["tok512-long-warm"], warm=SCENARIOS["default"].warm)
    for seed in (0, 2):
        later = window(compare(s, 80, seed), 20)
        assert later["ratio"] <= 1.03, (seed, later["ratio"], later["best"])


# ---------------------------------------------------------------------------------------------- the schedule's rules
def _schedule(cost_share=0.02, observed=OUTCOME_WARMUP, decisions=OUTCOME_WARMUP):
    t = OutcomeTracker(None, 5, 0.02, 32)
    t.observed = observed
    s = ProbeSchedule(32, 0.25, 0.02, t, None, 0, cost_share)
    s.decisions = decisions
    return s


def test_no_probe_in_the_outcome_warm_up():
    even = {"a": 1.0, "b": 1.0}
    assert _schedule(observed=OUTCOME_WARMUP - 1).probe(even, "a", "a") is None  # measured in the warm-up
    assert _schedule(observed=0, decisions=OUTCOME_WARMUP - 1).probe(even, "a", "a") is None  # the first decisions
    assert _schedule(observed=OUTCOME_WARMUP).probe(even, "a", "a") == "b"
    assert _schedule(observed=0).probe(even, "a", "a") == "b"  # nothing measured (a simulation): after the first
    assert _schedule(None, observed=OUTCOME_WARMUP - 1).probe(even, "a", "a") == "b"  # unpaced: at once


def test_a_probe_waits_until_the_run_has_earned_its_predicted_cost():
    s = _schedule()
    feasible = {"a": 1.0, "b": 1.09}  # b's probe is predicted to cost 0.09 s over a
    for i in range(4):  # the room at decision i: 0.02 * (i + 1) * 1.0 < 0.09: waits
        assert s.probe(feasible, "a", "a") is None, i
        s.record(feasible, "a", feasible, set(), False, ref_s=1.0)
    assert s.loss_room(1.0) == pytest.approx(0.1)
    assert s.probe(feasible, "a", "a") == "b"
    assert _schedule(None).probe(feasible, "a", "a") == "b"  # negative control: unpaced, at once


def test_the_cheapest_due_probe_runs_first_and_is_charged_what_it_measured():
    s = _schedule()
    s._ran.update({"b", "c"})  # both ran long ago: the unpaced order takes the oldest, c
    s._since.update({"b": 40, "c": 50})
    for _ in range(30):
        s.base_s += 1.0
    feasible = {"a": 1.0, "b": 1.05, "c": 1.2}
    assert s.probe(feasible, "a", "a") == "b"
    unpaced = _schedule(None)
    unpaced._ran.update({"b", "c"})
    unpaced._since.update({"b": 40, "c": 50})
    assert unpaced.probe(feasible, "a", "a") == "c"  # negative control: the oldest, whatever it costs
    s.record(feasible, "b", feasible, set(), False, probed=True, ref_s=1.0, loss_s=0.05)
    assert s.loss_s == pytest.approx(0.05)
    s.settle("b", 1.3)  # it measured 0.3 s over a
    assert s.loss_s == pytest.approx(0.3)


def test_a_switch_on_fresh_evidence_is_not_displaced_by_a_probe():
    s = _schedule()
    s.base_s = 100.0  # room for any probe
    feasible = {"a": 1.0, "b": 0.8, "c": 1.05}  # b measured faster at the last decision: the switch a -> b is taken
    assert s.probe(feasible, "b", "b", switching=True) is None
    assert s.probe(feasible, "b", "b") in ("a", "c")  # not switching: due rivals are probed
    assert _schedule(None).probe(feasible, "b", "b", switching=True) in ("a", "c")  # negative control: unpaced


def test_a_fallback_the_first_weighing_put_in_contention_is_probed_first_whatever_the_ledger_holds():
    """At 64 tokens per rank, 16 experts (the runtime), the first weighing put ``none`` 1.10-1.14x over FEPLB, the
    model's pick; calibration learned from FEPLB's and quota's calls then raised ``none``'s prediction to 1.5-1.7x
    (measured, none ran 0.8x of them), so its probe waited for the ledger and the engine ran them at 1.25-1.28x of
    ``none``'s time for 31 calls. A fallback within ``probe_max_loss`` of the best at its first weighing is probed at
    the first decision after the warm-up; one further behind (the default shape: 1.47x) waits for the ledger."""
    first = {"none": 1.10, "feplb": 1.0}
    later = {"none": 1.70, "feplb": 1.0}  # none's prediction after calibration learned from feplb's calls
    s = _schedule(observed=OUTCOME_WARMUP - 1, decisions=OUTCOME_WARMUP - 1)
    assert s.probe(first, "feplb", "feplb", "none") is None  # the first weighing: in the warm-up, no probe
    s.decisions, s.outcomes.observed = OUTCOME_WARMUP, OUTCOME_WARMUP
    assert s.loss_room(1.0) < 0.25  # the ledger alone would make it wait (its cost counts 0.25 of feplb's)
    assert s.probe(later, "feplb", "feplb", "none") == "none"
    behind = _schedule(observed=OUTCOME_WARMUP - 1, decisions=OUTCOME_WARMUP - 1)  # negative control
    assert behind.probe({"none": 1.40, "feplb": 1.0}, "feplb", "feplb", "none") is None
    behind.decisions, behind.outcomes.observed = OUTCOME_WARMUP, OUTCOME_WARMUP
    assert behind.probe(later, "feplb", "feplb", "none") is None  # it waits for the ledger, as before
    assert _schedule(None).probe(later, "feplb", "feplb", "none") == "none"  # unpaced: the fallback at once


@pytest.mark.parametrize("shape, contends", [("default", None), ("tok64", True)])
def test_a_fallback_the_seed_model_puts_in_contention_contends_whatever_the_first_calls_measure(shape, contends):
    """The seed model's first decision puts ``none`` 1.18x FEPLB at 64 tokens per rank: it contends from there on,
    whatever calibration makes of the process's first calls (on the runtime at 64 tokens per rank, 16 experts, the
    second decision, calibrated on the first call alone, put ``none`` past ``probe_max_loss`` in 9 of 20 runs, and
    its probe waited while quota's ran). At the default shape (1.5x quota) the first calibrated weighing judges, as
    before."""
    import numpy as np

    from first_calls_replay import cost_model, load

    from ultraep.config import AdaptiveOptions, BalancerConfig
    from ultraep.engine import Engine

    s = SCENARIOS[shape]
    cm = cost_model(s)
    eng = Engine(BalancerConfig(policy="adaptive", layers={0: AdaptiveOptions()}), cm.topology, cost_model=cm)
    held, L = np.zeros((2, s.experts), dtype=bool), load(s, 1)
    d = eng.decide(0, 0, 0, L, held)
    eng.commit(d)
    sched = eng.policy_for(0).schedule
    assert bool(d.predictions["none"] <= 1.25 * min(d.predictions.values())) is (contends is True)
    assert sched._contender is contends  # (before: None, whatever the seed model said)
    if contends:
        for i in range(1, 4):  # slow first calls of the policy chosen: calibration moves, the verdict stays
            bd = d.predicted
            eng.observe(i - 1, 0, 0, {k: 1.6 * v for k, v in bd.as_dict().items()
                                      if k in ("compute_fwd_s", "a2a_fwd_s")}, measured_total_s=1.6 * bd.terms_s)
            d = eng.decide(i, 0, 0, L, held)
            eng.commit(d)
            assert sched._contender is True
