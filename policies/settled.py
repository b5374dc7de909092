"""The adaptive engine's settled decisions (Step 0b): a policy its weighing kept in force is not weighed every call.

Without a rest every decision weighs: every candidate not resting is planned and
predicted twice (on the calibrated model and on the anchor model, :mod:`.outcomes`), and the force-balanced ideal
once. On the runtime at 256 tokens per rank, 16 experts, two gloo ranks (``benchmarks/bench_long.py``'s layer, 45-60
ms a call), that made adaptive's plan 3.4-5.0 ms against quota's own 0.9-1.0 ms: the engine's weighing alone was
5-8 % of the call, and adaptive running quota measured 1.03-1.10x quota's own calls on the same tokens.

So a weighing that kept the policy in force, with no switch pending and no rival predicted faster than it by more
than ``margin`` (hysteresis would keep it), *settles*: the next SETTLED_REST - 1 decisions plan the policy in force
alone, predict it (its measured outcome is kept against the anchor model's prediction, as on every decision) and
weigh nothing, no engine overhead added. A settled decision weighs again at once when

* the policy in force's predicted time moves by REST_MOVE either way, or the busiest rank's share grows by more
  than REST_SKEW (the load moved: :func:`~.idle.load_holds`);
* a rival would beat it by more than ``switch_now`` now (a gain hysteresis takes at once): its corrected estimate
  (what it measured, carried to this load) against each rival's at the weighing, scaled by how that rival's
  measured correction moved since (a fresh measurement, or the clock crediting one taken while the machine ran
  slower). Not ``margin``: the policy in force's estimate is the median of its last few calls and moves by more
  than that from call to call, and a rest ended by that noise paid its prediction and the weighing both;
* a candidate is due for re-evaluation, or for a probe that would run (due, affordable, within ``probe_max_loss``
  of the policy in force at its last weighing, and not resting on its losing streak, which the weighing would not
  plan: :class:`~.probes.ProbeSchedule`), so probes and re-plannings run when they would have;
* a candidate's history cannot advance without a plan (:meth:`~.candidates.Candidates.can_rest`).

A rest that runs to its end and is weighed again to the same verdict doubles, up to SETTLED_REST_MAX decisions; any
rest broken, or a weighing that does not settle on the same policy, starts again at SETTLED_REST.

So a switch a full weighing would take at once comes at the next decision, one it would take on a smaller gain at
most SETTLED_REST_MAX - 1 decisions late, and meanwhile the choice costs what the policy in force's own planner does.
The fallback in force rests by :mod:`.idle` once the exploration budget is spent and nothing is in contention; while
the budget still allows weighing (a rival in contention), a weighing that kept it settles as any other policy's does:
weighing the same candidates again on the same load learns nothing, and at 256 tokens per rank such weighings with
``none`` in force cost 1.6 ms against ``none``'s own 0.5 ms plan, on 26-36 ms calls. With ``explore_share=None``
(weighing without bound) the fallback never settles.
"""

from __future__ import annotations

import numpy as np

from ultraep.plan import Plan
from ultraep.topology import Topology

from .idle import load_holds

#: after a weighing that settled, the next SETTLED_REST - 1 decisions take its verdict while it holds
SETTLED_REST = 8
#: a rest that ran to its end, and whose weighing settled on the same policy again, is followed by one twice as long,
#: up to this many decisions: where the verdict keeps holding, a weighing every SETTLED_REST decisions learns
#: nothing (each weighing costs 1.5-2 ms on 30 ms calls at bench_long's shape, a settled decision 0.5 ms)
SETTLED_REST_MAX = 32


class Settled:
    """A settled verdict: the policy in force, its calibrated prediction and the busiest rank's share at the weighing,
    each rival's corrected estimate then with the correction it carried, and the decisions left."""

    __slots__ = ("name", "total_s", "imbalance", "rivals", "left", "length")

    def __init__(self, name: str, total_s: float, imbalance: float, rivals: dict[str, tuple[float, float]],
                 length: int = SETTLED_REST) -> None:
        self.name, self.total_s, self.imbalance = name, float(total_s), float(imbalance)
        self.rivals = rivals
        self.left = self.length = int(length)

    def holds(self, bd, estimate_s: float, switch_now: float, correction) -> bool:
        """Whether the policy in force's breakdown ``bd`` of this load, and its corrected estimate ``estimate_s``, are
        where the verdict was weighed (the module's first two conditions). A rival's estimate now is its estimate at
        the weighing scaled by how its measured correction moved since (``correction(name)``)."""
        if not load_holds(self.total_s, self.imbalance, bd):
            return False
        return all(v * correction(n) / c >= estimate_s * (1.0 - switch_now) for n, (v, c) in self.rivals.items())


def verdict(chooser, plan: Plan, same) -> Settled | None:
    """The settled verdict of ``plan``, a weighing ``chooser`` committed, or None: it kept the policy in force (the
    fallback only under a bounded exploration budget), no switch pending and no probe, and no other candidate it
    predicted (corrected; those in ``same`` do what the fallback does and count as it; there may be none: every rival
    resting) was faster than the policy in force by more than ``margin``. Each
    rival keeps its estimate with the correction it carried (:meth:`.outcomes.OutcomeTracker.scale`). Nothing settles
    while outcomes are measured and the fallback has not been: its first probe may run whatever the probe ledger
    holds (:meth:`.ProbeSchedule.probe`), and every gain is measured against it."""
    a, memo = plan.info["adaptive"], chooser._memo
    name, preds = a["chosen"], a["predictions"]
    if (memo is None or memo[0].choice is not plan.choice or memo[2] is None or a.get("probe") or a.get("pending")
            or name != a.get("previous") or (name == chooser.fallback and chooser.budget.share is None)):
        return None
    if chooser.outcomes.observed and chooser.outcomes.runs(chooser.fallback) == 0:  # none, unmeasured, is probed first
        return None
    own, scale = preds[name], chooser.outcomes.scale
    rivals = {n: (v, scale(n)) for n, v in preds.items() if n != name and n not in same}
    if rivals and min(v for v, _ in rivals.values()) < own * (1.0 - chooser.hysteresis.margin):
        return None
    if not all(c > 0 for _, c in rivals.values()):
        return None
    ran_out = chooser._ran_out  # the rest before this weighing ran to its end on this policy: twice as long
    length = min(SETTLED_REST_MAX, 2 * ran_out[1]) if ran_out is not None and ran_out[0] == name else SETTLED_REST
    return Settled(name, memo[2][0], memo[2][1], rivals, length)


def settled_plan(chooser, cm, load_RE: np.ndarray, topology: Topology, resident_RE) -> Plan | None:
    """Step 0b of ``chooser`` (an :class:`~.adaptive.AdaptivePolicy`): while its settled verdict holds, the policy in
    force's plan alone, nothing weighed, no engine overhead; the other candidates' histories advance with the load in
    its ``commit``. Otherwise None (weigh), and the verdict is dropped."""
    s, cur, sched = chooser._settled, chooser.current, chooser.schedule
    others = [n for n in chooser.policies if n != cur]
    if (s is None or s.name != cur or not all(map(chooser.candidates.can_rest, chooser.policies))
            or any(sched.reevaluate(n) for n in others)):
        chooser._settled = None
        return None
    has = resident_RE is not None
    pl = chooser.candidates.plan(cur, load_RE, topology, resident_RE)  # (a weighing takes both if this does not rest)
    bd = chooser._predict(cm, cur, pl, has)
    plans = {cur: pl}  # (the same dict to decide: the anchor predictions made here are not made again)
    chooser._anchor_predictions(topology, plans, has)  # what its estimate and its outcome are measured against
    est = chooser.outcomes.estimate(cur, bd.total_s, cur)
    if not s.holds(bd, est, chooser.switch_now, chooser.outcomes.scale) or _probe_due(chooser, s, others, est):
        chooser._settled = None
        return None
    plan = chooser.decide(plans, topology, screened=sorted(others), breakdowns={cur: bd}, resident=has,
                          idle=f"settled: {cur} kept at its last weighing, no rival faster by "
                               f"{chooser.hysteresis.margin:.1%}")  # (one reason per policy: the report counts them)
    s.left -= 1
    if s.left <= 1:  # the next decision weighs; if it settles on the same policy, for twice as long
        chooser._settled = None
        chooser._ran_out = (s.name, s.length)
    if plan.engine_s == 0.0:  # the plan returned is the policy in force's as predicted: the engine need not predict it
        chooser._known = (plan.choice, cm, bd)
    return plan


def _probe_due(chooser, s: Settled, others: list[str], estimate_s: float) -> bool:
    """Whether a probe the weighing would run is due: a candidate due and affordable
    (:meth:`.ProbeSchedule.probe_range`) that is unmeasured, or whose estimate now (the verdict's, scaled as in
    :meth:`Settled.holds`, else its standing at its last weighing) is within ``probe_max_loss`` of the policy in
    force's ``estimate_s``, or, paced, gives a probe cost its period has paid for (the weighing's probe reads that
    estimate; read from the standing alone, a probe could be due here that the weighing then does not run). Not a
    candidate resting on its losing streak (:meth:`.Screen.resting`): the weighing does not plan it, so it cannot probe
    it, and its re-evaluation ends the rest when it falls due. Counted, such an
    unmeasured candidate (eplb, never probed) ended every rest at once while the weighings it caused kept it resting."""
    sched, outcomes = chooser.schedule, chooser.outcomes
    standing = chooser.budget.standing
    resting = set(chooser.screening.resting(chooser.current))  # not planned by the weighing: it could not probe them
    for n, within in sched.probe_range([n for n in others if n not in resting], estimate_s, standing).items():
        level = s.rivals[n][0] * outcomes.scale(n) / s.rivals[n][1] if n in s.rivals else standing.get(n, 0.0)
        if within > sched.probe_max_loss or sched.paced(n):  # paced: due as the weighing will see it (its level)
            if sched.due(n, sched.pace.cost(level, estimate_s)):
                return True
        elif outcomes.runs(n) == 0 or level <= (1 + within) * estimate_s:
            return True
    return False
