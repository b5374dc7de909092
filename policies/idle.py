"""The adaptive engine's idle decisions (Step 0): where nothing pays, a decision costs what ``none``'s does.

With the fallback (``none``) in force, no candidate in contention and the exploration budget spent
(:meth:`~.exploration.ExplorationBudget.idle`), a decision plans the fallback alone and weighs nothing. Deciding
*that* still costs predictions: the fallback's plan, the force-balanced ideal (the stake: what any plan could save),
and the fallback on the anchor model (its measured outcome is kept against it). On the runtime at 64 tokens per rank
on two gloo ranks, those and the engine's own prediction of the same plan made an idle decision 0.6 ms slower than
``none``'s, 3.5 % of a 17 ms layer call.

So a weighed idle verdict *rests*: the next IDLE_REST - 1 decisions take its stake (the fallback's time less the
ideal) while the load stays where it was (REST_MOVE), and do not predict the ideal again. Every idle decision hands
the fallback's prediction to the engine (:meth:`~.adaptive.AdaptivePolicy.breakdown_of`), which predicted the same
plan again before. The fallback is still predicted on the anchor model at every decision: its measured outcome is
kept against that prediction, and one carried from the verdict (the anchor over the calibrated prediction, as a
ratio) drifted as calibration moved the calibrated model, so that ``none`` looked slower than it measured and at 64
tokens per rank a run switched to ``quota`` for 12 of 32 timed calls (0.952x of ``none``). The budget's and the probes'
checks run on every decision as before: a probe due, or a rival in contention, ends the rest at once.
"""

from __future__ import annotations

import numpy as np

from ultraep.plan import Plan
from ultraep.topology import Topology

#: after an idle decision that weighed whether to idle, the next IDLE_REST - 1 decisions take its verdict while the
#: load stays where it was (:class:`Rest`)
IDLE_REST = 8
#: a resting verdict is re-weighed at once when the fallback's predicted time moves by this factor either way (the
#: tokens per rank moved), or the busiest rank's share of the tokens (the breakdown's ``imbalance``) grows by more
#: than REST_SKEW (skew appearing: the stake grows)
REST_MOVE = 1.25
#: the growth of the busiest rank's share that ends a rest. Not ``switch_now`` (2 %): on bench_long's stream (256
#: tokens per rank, 16 experts) the plain layer's busiest share grows by more than 2 % from one call to the next in 23 %
#: of calls, by more than 10 % in 1 % (3 % over four calls), so a 2 % bound ended most rests on routing noise, each
#: with a weighing (1.5-3 ms on 35 ms calls); skew that builds up over a phase still ends them
REST_SKEW = 0.10


def load_holds(total_s: float, imbalance: float, bd) -> bool:
    """Whether breakdown ``bd`` of this load is where a verdict weighed at predicted time ``total_s`` and busiest-rank
    share ``imbalance`` was: its predicted time within a factor REST_MOVE of it, the share grown by at most REST_SKEW
    (both rests, idle and settled, end here)."""
    return total_s / REST_MOVE <= bd.total_s <= total_s * REST_MOVE and bd.imbalance <= imbalance * (1.0 + REST_SKEW)


class Rest:
    """A weighed idle verdict taken by the next decisions: the fallback's predicted time and the busiest rank's
    share then, the stake, and the decisions left."""

    __slots__ = ("total_s", "imbalance", "stake_s", "left")

    def __init__(self, total_s: float, imbalance: float, stake_s: float) -> None:
        self.total_s, self.imbalance, self.stake_s = float(total_s), float(imbalance), float(stake_s)
        self.left = IDLE_REST

    def holds(self, bd) -> bool:
        """Whether the fallback's breakdown ``bd`` of this load is where the verdict was weighed (:func:`load_holds`)."""
        return load_holds(self.total_s, self.imbalance, bd)


def idle_plan(chooser, cm, load_RE: np.ndarray, topology: Topology, resident_RE) -> Plan | None:
    """Step 0 of ``chooser`` (an :class:`~.adaptive.AdaptivePolicy`): with the fallback in force, nothing in
    contention, too little at stake on this load and the budget spent, the fallback's plan alone: nothing weighed, no
    overhead; the other candidates' histories advance with the load in its ``commit``. Otherwise None (weigh)."""
    fb = chooser.fallback
    if (chooser.current != fb or chooser.budget.share is None
            or not all(map(chooser.candidates.can_rest, chooser.policies))):
        chooser._rest = None
        return None
    pl = chooser.candidates.plan(fb, load_RE, topology, resident_RE)  # (a weighing takes both if this does not rest)
    bd = chooser._predict(cm, fb, pl, resident_RE is not None)
    rest = chooser._rest if chooser._rest is not None and chooser._rest.holds(bd) else None
    # the stake: carried while resting
    stake = rest.stake_s if rest is not None else bd.total_s - chooser.candidates.ideal_s(cm, load_RE)
    fb_s = chooser.outcomes.estimate(fb, bd.total_s, chooser.current)
    # a rival the engine would probe is weighed when its probe is due (else within switch_now, as everywhere)
    due = chooser.schedule.probe_range(chooser.policies, fb_s, chooser.budget.standing)
    if not chooser.budget.idle(chooser.policies, fb, fb_s, stake, chooser.switch_now, cm.params.engine_overhead_s,
                               due):
        chooser._rest = None
        return None
    plan = chooser.decide({fb: pl}, topology, screened=sorted(n for n in chooser.policies if n != fb),
                          breakdowns={fb: bd}, resident=resident_RE is not None, idle=True)
    if rest is None:  # a weighed verdict: the next decisions may take it
        chooser._rest = Rest(bd.total_s, bd.imbalance, stake)
    if chooser._rest is not None:
        chooser._rest.left -= 1
        if chooser._rest.left <= 0:
            chooser._rest = None
    if plan.engine_s == 0.0:  # the plan returned is the fallback's as predicted: the engine need not predict it
        chooser._known = (plan.choice, cm, bd)
    return plan


def kept(chooser, cm, plans: dict, bd, topology: Topology, screened, resident: bool, idle: bool | str) -> Plan:
    """Steps 3-6 of a decision of ``chooser`` (an :class:`~.adaptive.AdaptivePolicy`) that weighed nothing (``idle``,
    as its ``decide`` takes it: Step 0 here, Step 0b in :mod:`.settled`), whose one plan is the policy in force's,
    predicted (``bd``): the plan its ``decide`` returns, without the choosing. One candidate leaves nothing to choose:
    no other is feasible, late or the fallback's double, hysteresis keeps the policy in force, and no probe or
    confirmation can run (each runs a candidate other than the chosen one). Why: such decisions are most of a run
    (three in four at bench_long's shape), and on the runtime each microsecond of their Python costs two to three
    (the same decision timed offline and in the ranks, after the layer's compute)."""
    name, fb, t = chooser.current, chooser.fallback, chooser.outcomes
    if t.anchor_plans is not plans:  # (Step 0b made them on these plans)
        chooser._anchor_predictions(topology, plans, resident)
    chooser._anchor_predictions(topology, plans, resident, names=[name])  # what its outcome is measured against
    est = t.estimate(name, bd.total_s, name)
    sched = chooser.schedule
    if sched.probe_every > 0 and sched._contender is None and name == fb:  # (what Step 5b's probe() records: the
        sched._contender = True  # fallback in force is its own best)
    settled = isinstance(idle, str)
    reason = idle if settled else f"idle: {fb} in force, nothing in contention, exploration budget spent"
    facts = {"late": [], "same_as_none": [], "screened": list(screened), "pending": None, "probe": False,
             "confirm": False, "restart": False, "settled": settled, "none_clear": False, "idle": not settled,
             "saved_s": 0.0}
    plan = chooser._assemble(cm, plans, {name: bd}, {name: est}, name, reason, facts, resident)
    chooser._memo = (plan, plans, None)
    return plan
