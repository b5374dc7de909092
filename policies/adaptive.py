"""``adaptive``: per layer, predict every candidate policy's time with the cost model and take the cheapest.

No peer decides per layer whether balancing pays off; this policy does, from measured-and-modelled
overheads. Every decision carries the predictions of all candidates and a reason: typed in ``plan.choice``
(what the engine and telemetry read), with this policy's own bookkeeping in ``plan.info["adaptive"]``.

Legend: R ranks, E experts.

Steps (one layer, one microbatch; each part in its own module):

    Step 0: the exploration budget (:mod:`.exploration`): with ``none`` in force, no candidate in contention and
            the budget spent, the decision is idle: ``none`` alone is planned, nothing weighed, no overhead. The
            next decisions take that verdict's stake while the load stays where it was (:mod:`.idle`), and the
            engine reads the policy's prediction of ``none``'s plan instead of making it again.
    Step 0b: settled (:mod:`.settled`): otherwise, with a policy in force that its last weighing kept (no rival faster
            by more than ``margin``, no switch pending), the next decisions plan it alone while the load and the
            measured estimates stay where they were and no probe or re-evaluation is due; then it is weighed again.
    Step 1: screen (:mod:`.screening`, :mod:`.probes`): a candidate that lost clearly LOSING_STREAK decisions in a row (or every candidate, once
            ``none`` has won clearly for ``probe_every`` decisions) rests: it is not planned nor predicted
            until it is due for re-evaluation; its history still advances with the load (its ``advance``).
            Then a stateless balancing candidate (``quota``) whose *fixed* overhead (its planner time)
            already exceeds the most any plan could gain over ``none`` (none's time minus the
            force-balanced ideal, a lower bound for every plan) is not planned either. Neither skips
            ``none`` or the current policy, which hysteresis must compare against.
    Step 2: plan every remaining candidate (pure; the planners would run side by side: the GPU quota
            planner, FEPLB's CPU thread, EPLB's cached placement, HybridEP's closed choice).
    Step 3: predict each plan's layer time with the cost model, including its planning and transfer
            overhead. A historical placement (``eplb``) that is not resident because another policy ran
            last pays for sending all of its replicas. A candidate that has run is estimated from the anchor
            model's prediction and what it measured (:mod:`.outcomes`): it is not predicted on the calibrated
            model too, unless it is chosen (its breakdown goes with the plan).
    Step 4: late plans: with ``deadline_s``, a candidate whose planning + weight sync exceeds the
            deadline is dropped; if nothing else is left, ``none`` (always on time) is taken.
    Step 5: hysteresis (:mod:`.hysteresis`): keep the current policy unless the cheapest is faster by more than ``margin``
            (relative) for ``patience`` consecutive decisions, or by more than ``switch_now`` at once.
    Step 5a: confirmation (:mod:`.probes`): where outcomes are measured, a switch to a candidate whose own latest
            measurement is not from the previous decision runs it once as a probe instead; the switch happens at
            the next decision if the fresh measurement still wins.
    Step 5b: a probe (:mod:`.probes`): a candidate due runs once to be measured (:mod:`.outcomes` keeps what it
            measured), paced by its cost (``probe_cost_share``); one measured FEW_RUNS times is due once the decisions
            since it ran pay for its probe at ``probe_regret`` each, others within ``probe_max_loss`` of the best.
    Step 6: the chosen plan is returned as policy ``adaptive`` with the engine's exposed overhead
            (``plan.engine_s``: decision time plus the planning of candidates slower than the chosen
            one's own planner, since they ran before the choice).

History (the current policy, the pending switch, the schedule, the budget) advances only in :meth:`commit`; with
``owns_candidates`` the candidates' own histories advance there too (from the memoised candidate plans,
or by re-planning ``plan.load_RE`` when a recorded plan is replayed).
"""

from __future__ import annotations

import numpy as np

from ultraep.cost import model_for
from ultraep.plan import Choice, Plan
from ultraep.topology import Topology

from .candidates import Candidates
from .exploration import OF_GAIN, SHARE, ExplorationBudget
from .outcomes import CLOCK_RUNS, FEW_RUNS, OUTCOME_WARMUP, OutcomeTracker
from .hysteresis import Hysteresis
from .idle import idle_plan, kept
from .settled import settled_plan, verdict
from .probes import LOSING_STREAK, PROBE_BURST, PROBE_COST_SHARE, PROBE_REGRET, PROBE_SHARE, ProbeSchedule
from .probes import confirm as confirm_switch
from .probes import first_weighing, probe_reason
from .screening import Screen

DEFAULT_CANDIDATES = ("none", "quota", "eplb", "feplb", "hybridep")

__all__ = ["AdaptivePolicy", "DEFAULT_CANDIDATES", "CLOCK_RUNS", "FEW_RUNS", "LOSING_STREAK", "OUTCOME_WARMUP"]


class AdaptivePolicy:
    """Cost-model-driven choice among candidate policies, with hysteresis and a deadline fallback.

    Parts: ``candidates`` (:class:`.Candidates`: what each declares), ``outcomes`` (:class:`.OutcomeTracker`:
    measured outcomes, clocks, credits), ``schedule`` (:class:`.ProbeSchedule`: due, period, resting) and
    ``hysteresis`` (:class:`.Hysteresis`: the policy in force, a pending switch).

    Options:
        candidates: policy names to choose from (must include the fallback, ``none``).
        margin: relative gain below which the current policy is kept (0.005 = 0.5 %).
        patience: consecutive decisions the same better policy must win before a switch.
        switch_now: relative gain that switches at once, without waiting for ``patience``.
        deadline_s: a plan whose planning + weight sync exceeds this (seconds) arrives too late.
        screen: skip planning stateless candidates that cannot pay for their own planner (Step 1).
        probe_every, probe_max_loss: a candidate not run for ``probe_every`` decisions runs once if predicted at
            most ``probe_max_loss`` (relative) slower than the best (Step 5b).
        probe_share, probe_cost_share, probe_regret: probes run on at most ``probe_share`` of the decisions beside
            PROBE_BURST per candidate, cost at most ``probe_cost_share`` of the time, one rival's ``probe_regret`` a call.
        outcome_window: measured outcomes per candidate whose median corrects its predictions.
        explore_share, explore_of_gain: weighing may cost ``explore_share`` of the run's layer time plus
            ``explore_of_gain`` of what it found, over the run (:mod:`.exploration`; ``explore_share=None``: no bound).
        candidate_options: per-candidate option dicts, e.g. ``{"quota": {"balance_eps": 0.02}}``.
        cost_model: the :class:`~ultraep.cost.CostModel` (not a config value; engine/simulator pass it).
        policies: ready candidate instances (shared with a caller, e.g. the simulator).
        owns_candidates: commit the candidates' histories in :meth:`commit` (False when shared).
    """

    name = "adaptive"
    needs_cost_model = True  # the engine hands it the calibrated model of its layer
    chooses_among_policies = True  # (registry.is_chooser): built over shared candidates, its decisions kept
    #: candidates see which replicas are resident, and every candidate is predicted with what it would move
    uses_residency = True

    def __init__(self, candidates=DEFAULT_CANDIDATES, margin: float = 0.005, patience: int = 2,
                 switch_now: float = 0.02, deadline_s: float | None = None, screen: bool = True,
                 probe_every: int = 32, probe_max_loss: float = 0.25, probe_share: float | None = PROBE_SHARE,
                 probe_cost_share: float | None = PROBE_COST_SHARE, probe_regret: float | None = PROBE_REGRET,
                 outcome_window: int = 5,
                 explore_share: float | None = SHARE, explore_of_gain: float = OF_GAIN,
                 candidate_options: dict | None = None, cost_model=None, policies: dict | None = None,
                 owns_candidates: bool = True) -> None:
        self.candidates = Candidates(policies) if policies is not None else Candidates.build(
            candidates, candidate_options, cost_model)
        self.policies = self.candidates.policies
        self.fallback = self.candidates.fallback
        self.hysteresis = Hysteresis(margin, patience, switch_now)
        self.switch_now = self.hysteresis.switch_now
        self.deadline_s = deadline_s
        self.cost_model = cost_model
        self.owns_candidates = bool(owns_candidates)
        # the model as handed over, before any calibration: measured outcomes are kept relative to it, so a
        # candidate's correction does not drift when calibration (learned from other candidates' runs) moves
        self.outcomes = OutcomeTracker(cost_model, outcome_window, self.switch_now, probe_every)
        self.schedule = ProbeSchedule(probe_every, probe_max_loss, self.switch_now, self.outcomes, probe_share,
                                      PROBE_BURST * len(self.policies), probe_cost_share, probe_regret, self.fallback)
        self.budget = ExplorationBudget(None if explore_share is None else float(explore_share),
                                        float(explore_of_gain))
        self.screening = Screen(self.candidates, self.schedule, self.outcomes, self.budget, screen)
        #: the last decision, its candidate plans and, when it weighed, its chosen's calibrated (total, imbalance)
        self._memo: tuple[Plan, dict, tuple | None] | None = None
        self._rest = None  # the last weighed idle verdict (:class:`.idle.Rest`), taken while the load stays (Step 0)
        self._settled = self._ran_out = None  # Step 0b's verdict, (policy, length) of a rest run out (:mod:`.settled`)
        self._known: tuple | None = None  # (choice, model, breakdown) of an idle plan returned: :meth:`breakdown_of`
        self._weighing: dict | None = None  # what the budget keeps of the decision being made (Step 0)

    @property
    def current(self) -> str | None:
        """The candidate in force (None before the first decision)."""
        return self.hysteresis.current

    def _cost(self, topology: Topology):
        """The cost model handed over (calibrated), re-targeted to ``topology`` (:func:`~ultraep.cost.model_for`)."""
        return model_for(self.cost_model, topology)

    def breakdown_of(self, plan: Plan, cost_model):
        """``plan``'s breakdown (or a copy's) on ``cost_model`` where this policy predicted just that on it, else None."""
        k = self._known
        return k[2] if k is not None and k[0] is plan.choice and k[1] is cost_model else None

    # ------------------------------------------------------------------ measured outcomes
    def observe_outcome(self, name: str, predicted_s: float, measured_s: float) -> None:
        """Fold one measured layer time of ``name`` into its outcome corrections (:meth:`.OutcomeTracker.observe`), a
        probe's cost (:meth:`.ProbeSchedule.settle`) and its standing (:meth:`.ExplorationBudget.rescale`)."""
        if measured_s <= 0 or name not in self.policies:
            return
        self.schedule.settle(name, measured_s)
        before = self.outcomes.scale(name) if name in self.budget.standing else None  # (a rival weighed before)
        if not self.outcomes.observe(name, predicted_s, measured_s, self.current):
            self.schedule.forget(name)
        self.budget.rescale(name, self.outcomes.scale(name) / before if before else None)

    def _anchor_predictions(self, topology: Topology, plans: dict, resident: bool, names=None) -> None:
        """Anchor-model predictions for :meth:`.OutcomeTracker.estimate` of ``names`` (default: the candidates that have
        run), added to this decision's (a new decision starts with ``names=None``)."""
        t = self.outcomes
        am = model_for(t.anchor, topology)
        todo = ([n for n in plans if self.outcomes.anchored(n, self.current)] if names is None
                else [n for n in names if n not in t.anchor_s])
        got = {n: self._predict(am, n, plans[n], resident).total_s for n in todo}
        t.anchor_s = got if names is None else {**t.anchor_s, **got}
        if names is None:
            t.anchor_plans = plans

    # ------------------------------------------------------------------ Step 1: screening
    def screened(self, load_RE: np.ndarray, topology: Topology, **known) -> list[str]:
        """Step 1's gain bound (:meth:`.Screen.screened`) on this chooser's state."""
        return self.screening.screened(self._cost(topology), load_RE, topology, self.current, **known)

    def _predict(self, cm, name: str, plan: Plan, resident: bool = False):
        """Step 3 for one candidate (see :meth:`Candidates.predict`: a historical placement switched to pays)."""
        return self.candidates.predict(cm, name, plan, resident, self.current)

    # ------------------------------------------------------------------ planning
    def plan(self, load_RE: np.ndarray, topology: Topology, resident_RE: np.ndarray | None = None) -> Plan:
        cm = self._cost(topology)
        has = resident_RE is not None
        self._known = None
        self.schedule.pace.weigh_s = cm.params.engine_overhead_s  # what a probe's weighings cost (its period)
        self.candidates.begin()
        self.outcomes.at(self.outcomes.regime_at(load_RE))  # the measured outcomes read at this load's size
        for rested in (idle_plan, settled_plan):  # Step 0: the exploration budget; Step 0b: settled
            if (pl := rested(self, cm, load_RE, topology, resident_RE)) is not None:
                return pl
        # Step 1: the resting candidates; the others not screened by the gain bound are planned first (cheap or
        # off the critical path), then the bound screens the rest
        rest = set(self.screening.resting(self.current))
        plans = {n: self.candidates.plan(n, load_RE, topology, resident_RE) for n in self.policies
                 if not self.candidates.screenable(n) and n not in rest}
        self._anchor_predictions(topology, plans, has)
        fb = self.fallback
        bds = {fb: self._predict(cm, fb, plans[fb], has)} if fb in plans else {}  # (the gain bound and the stake)
        refs = {n: _estimate(self, cm, n, pl, bds, has) for n, pl in plans.items()  # (the screen's bound)
                if self.screening.bounds(n, self.current)}
        ideal_s = self.candidates.ideal_s(cm, load_RE) if self.budget.share is not None else None
        skip = rest | set(self.screening.screened(cm, load_RE, topology, self.current, ideal_s=ideal_s,
                                                  none_s=bds[fb].total_s if fb in bds else None, others_s=refs))
        plans.update({n: self.candidates.plan(n, load_RE, topology, resident_RE) for n in self.policies
                      if self.candidates.screenable(n) and n not in skip})
        if ideal_s is not None and fb in bds:  # what the budget keeps of this weighing (Step 0)
            floors = {n: ideal_s + self.candidates.exposed_planner_s(cm, n) for n in skip}
            self._weighing = {"stake_s": bds[fb].total_s - ideal_s, "floors": floors}
        return self.decide(plans, topology, screened=sorted(skip), breakdowns=bds, resident=has)

    def decide(self, plans: dict[str, Plan], topology: Topology | None = None, screened=(),
               breakdowns: dict | None = None, resident: bool = False, idle: bool | str = False) -> Plan:
        """Steps 3-6 on ready candidate plans ``{name: plan}`` (all of the same load and topology).
        ``breakdowns``: their cost-model predictions when the caller already has them; ``resident``: the plans'
        transfers are exactly what moves (see :meth:`_predict`); ``idle``: Step 0 planned the fallback alone (True),
        or Step 0b the policy in force alone (the decision's reason): nothing weighed, and with no deadline the plan
        is returned without the choosing (:func:`.idle.kept`)."""
        topology = topology or next(iter(plans.values())).topology
        self.outcomes.at(self.outcomes.regime_at(next(iter(plans.values())).load_RE))  # (decide() called directly)
        cm = self._cost(topology)
        if idle and self.deadline_s is None and list(plans) == [self.current] and self.current in (breakdowns or {}):
            return kept(self, cm, plans, breakdowns[self.current], topology, screened, resident, idle)
        if self.outcomes.anchor_plans is plans:  # plan() started them; add candidates planned since
            ran = [n for n in plans if self.outcomes.anchored(n, self.current)]
            self._anchor_predictions(topology, plans, resident, names=ran)
        else:  # decide() called directly (the simulator's shared candidates), or Step 0's fallback alone
            self._anchor_predictions(topology, plans, resident)
        bds, predictions = _predict_all(self, cm, plans, breakdowns or {}, resident,
                                        every=self.deadline_s is not None)  # Step 3
        late = _late(self.candidates, self.deadline_s, cm, bds)  # Step 4
        same = _same_as(plans, self.fallback, self.current)
        feasible = {n: v for n, v in predictions.items() if n not in late and n not in same}
        if not feasible:  # pragma: no cover - the fallback is never late
            feasible = {self.fallback: predictions[self.fallback]}
        best = min(feasible, key=lambda n: (feasible[n], n != self.fallback))
        chosen, reason, pending = self.hysteresis.choose(feasible, best, late, self.fallback, self.deadline_s)
        switch, probe = self.current in feasible and chosen != self.current, False  # hysteresis let the cheapest win
        if self.current is None and self.schedule.probe_every > 0:  # (the fallback's first probe: does it contend)
            first_weighing(self.schedule, feasible, best, self.fallback)
        confirm = confirm_switch(self.schedule, chosen, self.current, feasible) if switch else None  # why, restart, run
        if confirm is not None:  # Step 5a: a switch on stale, no, or too few measurements of its own is measured first
            chosen, probe, pending = confirm[2], confirm[2] != self.current, None  # ("pair": the policy in force ran)
            reason = f"{'confirm' if probe else 'pair'}: {reason[len('switch '):]}; {confirm[0]}"
        elif self.schedule.probe_every > 0 and self.current is not None:  # Step 5b: bounded-regret probe
            probe_of = self.schedule.probe(feasible, chosen, best, self.fallback, switching=switch)
            if probe_of is not None and probe_of != self.current:  # the policy in force is measured anyway (a
                # "probe" of it cancelled the switch this decision had chosen)
                chosen, reason, probe = probe_of, probe_reason(self.schedule, probe_of, self.current), True
        self._anchor_predictions(topology, plans, resident, names=[chosen])  # what its outcome is measured against
        if chosen not in bds:  # (its breakdown goes with the plan: a rival estimated on the anchor basis had none)
            bds[chosen] = self._predict(cm, chosen, plans[chosen], resident)
        settled = isinstance(idle, str)  # Step 0b's (its reason), else Step 0's budget idle (True)
        if idle:
            reason = idle if settled else f"idle: {self.fallback} in force, nothing in contention, exploration budget spent"
        idle = bool(idle) and not settled
        facts = {"late": late, "same_as_none": same, "screened": list(screened), "pending": pending, "probe": probe,
                 "confirm": confirm is not None, "restart": bool(confirm and confirm[1]), "settled": settled,
                 "none_clear": _clear_win(feasible, best, self.fallback, self.switch_now), "idle": idle,
                 "saved_s": max(0.0, feasible[self.current] - feasible[best]) if self.current in feasible else 0.0}
        plan = self._assemble(cm, plans, bds, predictions, chosen, reason, facts, resident)  # Step 6
        self._memo = (plan, plans, None if idle or settled else (bds[chosen].total_s, bds[chosen].imbalance))
        return plan

    def _assemble(self, cm, plans, bds, predictions, chosen, reason, facts, resident) -> Plan:
        """Step 6: the chosen plan as policy ``adaptive``, with the engine's exposed overhead (decision time plus
        the planning of candidates slower than the chosen one's own planner, since they ran before the choice)."""
        exposed = self.candidates.exposed_planner_s
        planned_max = max((exposed(cm, n) for n in plans), default=0.0)
        weighed = not (facts["idle"] or facts["settled"])
        engine_s = cm.params.engine_overhead_s + max(0.0, planned_max - exposed(cm, chosen)) if weighed else 0.0
        src = plans[chosen]
        own = src.planner_s if src.planner_s is not None else 0.0
        costs = {"engine_s": float(engine_s), "planner_s": float(cm.params.planner_s.get(chosen, own)),
                 "sync_s": None if resident or not self.candidates.switches(chosen, self.current)
                 else float(bds[chosen].weight_sync_s)}
        facts = {**facts, "previous": self.current, "anchor_s": float(self.outcomes.anchor_s.get(chosen, 0.0))}
        return _decided(src, self.name, chosen, reason, predictions, facts, costs)

    def commit(self, plan: Plan) -> None:
        a = plan.info["adaptive"]
        self.hysteresis.commit(a["chosen"], a.get("pending"), bool(a.get("probe")))  # a probe runs once
        preds, chosen = a["predictions"], a["chosen"]
        self.outcomes.observing = (chosen, float(a.get("anchor_s", 0.0)), self.outcomes.regime_at(plan.load_RE))  # to measure
        self.outcomes.restart = chosen if a.get("confirm") and a.get("restart") else None  # (stale: replaced)
        self.outcomes.decisions += 1
        same, idle = set(a.get("same_as_none", ())), bool(a.get("idle")) or bool(a.get("settled"))  # weighed nothing
        ref_s = preds.get(a.get("previous"), preds[chosen]) if a.get("probe") else preds[chosen]  # in force's
        loss = preds[chosen] - ref_s
        self.schedule.record(self.policies, chosen, preds, same, bool(a.get("none_clear")), weighed=not idle,
                             left=None if a.get("probe") else a.get("previous"),
                             probed=bool(a.get("probe")) and not a.get("confirm"), ref_s=ref_s, loss_s=loss)
        weighing, self._weighing = self._weighing, None
        if not idle and weighing is not None:
            self.budget.note(preds, self.fallback, same, weighing["floors"], weighing["stake_s"])
        self.budget.charge(a.get("predicted_s", 0.0), a.get("saved_s", 0.0), plan.engine_s + max(0.0, loss), loss)
        self._settled, self._ran_out = (self._settled, self._ran_out) if idle else (verdict(self, plan, same), None)
        if self.owns_candidates:
            self._commit_candidates(plan, a)
        self._memo = None

    def _commit_candidates(self, plan: Plan, a: dict) -> None:
        """Advance the candidates' histories: from the memoised candidate plans of this decision (the engine may
        hand back a copy of the plan: it shares the ``choice``), or, for a replayed plan, by re-planning its load;
        a candidate not planned (Step 1) advances with the load."""
        if self._memo is not None and self._memo[0].choice is plan.choice:
            plans = self._memo[1]
        else:
            plans = {n: p.plan(plan.load_RE, plan.topology) for n, p in self.policies.items()
                     if n not in a.get("screened", [])}
        for n, p in self.policies.items():
            if n in plans:
                p.commit(plans[n])
            elif callable(getattr(p, "advance", None)):
                p.advance(plan.load_RE)


def _predict_all(chooser, cm, plans: dict, known: dict, resident: bool, every: bool = False) -> tuple[dict, dict]:
    """Step 3 of ``chooser`` (an :class:`AdaptivePolicy`): every plan's corrected prediction, and the cost-model
    breakdowns made for it (``known`` ones reused unless a switch cost must be added): only of the plans whose
    estimate reads it (:func:`_estimate`), or, with ``every``, of all of them."""
    bds = {n: bd for n, bd in known.items()
           if n in plans and (resident or not chooser.candidates.switches(n, chooser.current))}
    predictions = {}
    for name, pl in plans.items():
        if every and name not in bds:
            bds[name] = chooser._predict(cm, name, pl, resident)
        predictions[name] = _estimate(chooser, cm, name, pl, bds, resident)
    return bds, predictions


def _estimate(chooser, cm, name: str, plan: Plan, bds: dict, resident: bool) -> float:
    """``name``'s corrected prediction (:meth:`.OutcomeTracker.estimate`) of ``plan`` by ``chooser``; its calibrated
    breakdown is made (into ``bds``) only where the estimate reads it. Why: a rival that has run is estimated from the
    anchor model's prediction and what it measured, and its calibrated prediction was made and thrown away: four of
    a weighing's ten (five candidates on two models) with ``none`` in force and every rival measured, where a weighing
    cost 2-3 ms on the runtime at bench_long's shape (30 ms calls) and a fifth of the decisions weigh."""
    if name not in bds and chooser.outcomes.reads_calibrated(name, chooser.current):
        bds[name] = chooser._predict(cm, name, plan, resident)
    bd = bds.get(name)
    return chooser.outcomes.estimate(name, bd.total_s if bd is not None else float("nan"), chooser.current)


def _late(candidates, deadline_s: float | None, cm, bds: dict) -> list[str]:
    """Step 4: with ``deadline_s``, the candidates whose planning + weight sync exceeds the deadline."""
    if deadline_s is None:
        return []
    return [n for n, bd in bds.items() if n != candidates.fallback
            and candidates.exposed_planner_s(cm, n) + bd.weight_sync_s > deadline_s]


def _same_as(plans: dict, fallback: str, current: str | None) -> list[str]:
    """A candidate whose plan does exactly what the fallback's does (HybridEP choosing plain EP, FEPLB moving
    nothing) is the fallback under another name: measured, the two differ only by noise, and choosing by that
    noise made the engine flip between them and pay the duplicate's planner (T=64: 7-10 % over none). The
    fallback stands for it. (The policy in force stays a candidate: hysteresis compares against it, and
    keeping it runs the same.)"""
    if fallback not in plans:
        return []
    return sorted(n for n, pl in plans.items() if n not in (fallback, current) and _same_work(pl, plans[fallback]))


def _clear_win(feasible: dict, best: str, fallback: str, switch_now: float) -> bool:
    """Whether the fallback won by more than ``switch_now`` over every other feasible candidate."""
    others = min((v for n, v in feasible.items() if n != fallback), default=float("inf"))
    return bool(best == fallback and len(feasible) > 1 and others > feasible[fallback] * (1 + switch_now))


def _decided(src: Plan, policy: str, chosen: str, reason: str, predictions: dict, facts: dict, costs: dict) -> Plan:
    """``src`` (the chosen candidate's plan) as the chooser's plan: its typed ``choice``, what the choice costs
    (``costs``: ``engine_s``, ``planner_s``, ``sync_s``) and the chooser's diagnostics in ``info["adaptive"]``
    (recorded with the plan; read back by ``commit``)."""
    predicted_s = float(predictions[chosen] + costs["engine_s"])
    pending = facts["pending"]
    info = dict(src.info)
    info["adaptive"] = {
        "chosen": chosen, "reason": reason, "predictions": {n: float(v) for n, v in predictions.items()},
        "predicted_s": predicted_s, "late": facts["late"], "same_as_none": facts["same_as_none"],
        "screened": facts["screened"], "previous": facts["previous"],
        "pending": list(pending) if pending else None, "probe": facts["probe"], "confirm": facts["confirm"],
        "restart": facts["restart"],
        "anchor_s": facts["anchor_s"], "none_clear": facts["none_clear"], "idle": facts["idle"],
        "settled": facts["settled"],
        "saved_s": float(facts["saved_s"]),
    }
    choice = Choice(chosen, reason, dict(info["adaptive"]["predictions"]), predicted_s, tuple(facts["screened"]),
                    facts["probe"])
    return src.replaced(policy=policy, info=info, choice=choice, **costs)


def _same_work(a: Plan, b: Plan) -> bool:
    """Whether plans ``a`` and ``b`` run the same layer: same placement, same routes, nothing moved, no overlay."""
    return (a.expert_domains is None and b.expert_domains is None and not len(a.transfers) and not len(b.transfers)
            and np.array_equal(a.phy2log_RS, b.phy2log_RS) and np.array_equal(a.routes_RRS, b.routes_RRS))
