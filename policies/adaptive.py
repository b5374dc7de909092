"""``adaptive``: per layer, predict every candidate policy's time with the cost model and take the cheapest.

No peer decides per layer whether balancing pays off; this policy does, from measured-and-modelled
overheads. Every decision carries the predictions of all candidates and a reason: typed in ``plan.choice``
(what the engine and telemetry read), with this policy's own bookkeeping in ``plan.info["adaptive"]``.

Legend: R ranks, E experts.

Steps (one layer, one microbatch):

    Step 1: screen: a candidate that lost clearly LOSING_STREAK decisions in a row (or every candidate, once
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
            last pays for sending all of its replicas.
    Step 4: late plans: with ``deadline_s``, a candidate whose planning + weight sync exceeds the
            deadline is dropped; if nothing else is left, ``none`` (always on time) is taken.
    Step 5: hysteresis: keep the current policy unless the cheapest is faster by more than ``margin``
            (relative) for ``patience`` consecutive decisions, or by more than ``switch_now`` at once.
    Step 6: the chosen plan is returned as policy ``adaptive`` with the engine's exposed overhead
            (``plan.engine_s``: decision time plus the planning of candidates slower than the chosen
            one's own planner, since they ran before the choice).

History (the current policy, the pending switch) advances only in :meth:`commit`; with
``owns_candidates`` the candidates' own histories advance there too (from the memoised candidate plans,
or by re-planning ``plan.load_RE`` when a recorded plan is replayed).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time

import numpy as np

from ultraep.cost import model_for
from ultraep.plan import Choice, Plan
from ultraep.topology import Topology

from .base import identity_plan, plan_resident
from .registry import get_policy_class, make_policy

#: candidates screened by the gain bound of Step 1 (stateless, their planner on the critical path)
SCREENABLE = ("quota",)
#: a candidate that lost clearly this many planned decisions in a row rests — not planned, not predicted — until
#: it is due for re-evaluation: its planning and prediction are then paid once per ``probe_every`` decisions
#: (only candidates whose history can advance without a plan rest: those with an ``advance`` method)
LOSING_STREAK = 8
DEFAULT_CANDIDATES = ("none", "quota", "eplb", "feplb", "hybridep")
#: a candidate measured fewer times than this has an uncertain outcome (one early call can be a warm-up outlier):
#: it is re-probed every probe_every / 8 decisions until it has this many measurements
FEW_RUNS = 3
#: the first measured calls of a layer are slower whatever runs (first allocations, caches): they do not feed
#: the outcome corrections, and a candidate probed then counts as not run yet (it is probed again)
OUTCOME_WARMUP = 2
#: the machine's level now is the median of the policy in force's last CLOCK_RUNS measurements
CLOCK_RUNS = 3


class AdaptivePolicy:
    """Cost-model-driven choice among candidate policies, with hysteresis and a deadline fallback.

    Options:
        candidates: policy names to choose from (must include ``none``, the fallback).
        margin: relative gain below which the current policy is kept (0.005 = 0.5 %).
        patience: consecutive decisions the same better policy must win before a switch.
        switch_now: relative gain that switches at once, without waiting for ``patience``.
        deadline_s: a plan whose planning + weight sync exceeds this (seconds) arrives too late.
        screen: skip planning stateless candidates that cannot pay for their own planner (Step 1).
        candidate_options: per-candidate option dicts, e.g. ``{"quota": {"balance_eps": 0.02}}``.
        cost_model: the :class:`~ultraep.cost.CostModel` (not a config value; engine/simulator pass it).
        policies: ready candidate instances (shared with a caller, e.g. the simulator).
        owns_candidates: commit the candidates' histories in :meth:`commit` (False when shared).
    """

    name = "adaptive"
    needs_cost_model = True  # the engine hands it the calibrated model of its layer
    chooses_among_policies = True  # (registry.is_chooser): built over shared candidates, its decisions kept

    def __init__(self, candidates=DEFAULT_CANDIDATES, margin: float = 0.005, patience: int = 2,
                 switch_now: float = 0.02, deadline_s: float | None = None, screen: bool = True,
                 probe_every: int = 32, probe_max_loss: float = 0.25, outcome_window: int = 5,
                 candidate_options: dict | None = None, cost_model=None, policies: dict | None = None,
                 owns_candidates: bool = True) -> None:
        from ultraep.errors import ConfigError

        names = list(policies) if policies is not None else list(candidates)
        if "none" not in names:
            raise ConfigError("adaptive.candidates", f"must include 'none' (the fallback), got {names}", names)
        if "adaptive" in names:
            raise ConfigError("adaptive.candidates", "cannot include 'adaptive' itself", names)
        if policies is None:

            opts = candidate_options or {}
            unknown = sorted(set(opts) - set(names))
            if unknown:
                raise ConfigError(f"adaptive.candidate_options.{unknown[0]}", f"is not a candidate ({names})", unknown[0])
            policies = {}
            for n in names:
                o = dict(opts.get(n, {}))
                if cost_model is not None and getattr(get_policy_class(n), "needs_cost_model", False):
                    o.setdefault("cost_model", cost_model)
                policies[n] = make_policy(n, **o)
        self.policies = dict(policies)
        self.margin = float(margin)
        self.patience = max(1, int(patience))
        self.switch_now = float(switch_now)
        self.deadline_s = deadline_s
        self.screen = bool(screen)
        self.cost_model = cost_model
        # the model as handed over, before any calibration: measured outcomes are kept relative to it, so a
        # candidate's correction does not drift when calibration (learned from other candidates' runs) moves
        self._anchor = cost_model
        self._anchor_s: dict[str, float] = {}  # this decision's anchor-model predictions of the candidates
        self._observing: tuple[str, float] | None = None  # the committed choice and its anchor prediction
        self._anchor_plans: dict | None = None  # the candidate plans _anchor_s belongs to
        self._observed = 0  # measured outcomes offered so far (the first OUTCOME_WARMUP are skipped)
        self.owns_candidates = bool(owns_candidates)
        self.probe_every = int(probe_every)
        self.probe_max_loss = float(probe_max_loss)
        self.outcome_window = max(1, int(outcome_window))
        #: per candidate: median of log(measured / predicted layer time) over its last runs, and how often it ran,
        #: against the calibrated model of the time (``_outcome``) and against the anchor model (``_outcome_anchor``)
        self._outcome: dict[str, tuple[float, int]] = {}
        self._outcome_anchor: dict[str, tuple[float, int]] = {}
        self._outcome_hist: dict[tuple[str, str], list] = {}  # (table, candidate) -> its last measurements
        #: per candidate, (decision, log-ratio against the anchor) of its last 2 probe_every measurements: the clock
        #: that tells how much faster the machine runs now than when a measurement was taken (:meth:`_credit`)
        self._clock: dict[str, tuple[list[int], list[float]]] = {}
        self._decisions = 0  # decisions committed so far (the clock's time axis)
        self._since: dict[str, int] = {}  # decisions since each candidate last ran
        self._unplanned: dict[str, int] = {}  # decisions since each candidate was last planned
        self._ran: set[str] = set()  # candidates that ran at least once
        self._none_streak = 0  # consecutive decisions none won by more than switch_now
        self._lost: dict[str, int] = {}  # consecutive decisions a planned candidate lost by more than switch_now
        self._current: str | None = None
        self._pending: tuple[str, int] | None = None
        self._memo: tuple[Plan, dict] | None = None

    # ------------------------------------------------------------------ helpers
    def _cost(self, topology: Topology):
        """The cost model for ``topology``: the one the engine handed over (calibrated), re-targeted to another
        topology with the current calibrated parameters (:func:`~ultraep.cost.model_for`)."""
        return model_for(self.cost_model, topology)

    # ------------------------------------------------------------------ measured outcomes
    def observe_outcome(self, name: str, predicted_s: float, measured_s: float) -> None:
        """Fold one measured layer time of candidate ``name`` into its outcome corrections: the median log-ratio
        of its last ``outcome_window`` measurements against ``predicted_s`` (the calibrated model's prediction),
        and against the anchor model's prediction of the decision being observed (the last committed one).

        A median, not a running mean: one call slowed 2x by something else on the machine (a scheduler hiccup,
        a neighbour's burst) must not make a candidate look 2x worse until its next probe — with a mean it was
        screened out and never re-measured. A real change (a slower link) moves the median after half a window.

        Against the anchor, each measurement is also paired with the policy in force at the time (the clock, see
        :meth:`_credit`), so that one taken while the whole machine ran slower is not held against its candidate."""
        if measured_s <= 0 or name not in self.policies:
            return
        self._observed += 1
        when = self._decisions - 1  # the decision being observed (committed just before its call ran)
        x = None
        if self._observing is not None and self._observing[0] == name and self._observing[1] > 0:
            x = float(np.log(measured_s / self._observing[1]))
            if name == self._current or self._observed > OUTCOME_WARMUP:  # the clock reads the warm-up too
                ts, xs = self._clock.setdefault(name, ([], []))
                ts.append(when)
                xs.append(x)
                del ts[:-2 * max(1, self.probe_every)], xs[:-2 * max(1, self.probe_every)]
        if self._observed <= OUTCOME_WARMUP:
            if name != self._current:  # a probe measured in the warm-up says nothing: it is probed again
                self._ran.discard(name)
            return
        if predicted_s > 0:
            hist = self._outcome_hist.setdefault(("calibrated", name), [])
            hist.append(float(np.log(measured_s / predicted_s)))
            del hist[:-self.outcome_window]
            self._outcome[name] = (float(np.median(hist)), self._outcome.get(name, (0.0, 0))[1] + 1)
        if x is None:
            return
        hist = self._outcome_hist.setdefault(("anchor", name), [])
        hist.append((when, x, self._current or name))
        del hist[:-self.outcome_window]
        self._outcome_anchor[name] = (0.0, self._outcome_anchor.get(name, (0.0, 0))[1] + 1)
        # only name's clock moved: the credits that change are those read on it (and name's own new entry)
        now = self._level(name)
        for (kind, n), h in self._outcome_hist.items():
            if kind == "anchor" and (n == name or any(ref == name for _, _, ref in h)):
                credited = [v - self._credit(ref, t, now if ref == name else None) for t, v, ref in h]
                self._outcome_anchor[n] = (statistics.median(credited), self._outcome_anchor[n][1])

    def _level(self, ref: str, when: int | None = None) -> float | None:
        """The clock: ``ref``'s log-ratio around decision ``when`` — the mean of its measurements just before, at
        and just after it (an A-B-A pairing: a probe runs between two calls of the policy in force) — or, with
        ``when`` None, now: the median of its last CLOCK_RUNS measurements."""
        if ref not in self._clock:
            return None
        ts, xs = self._clock[ref]
        if when is None:
            return statistics.median(xs[-CLOCK_RUNS:])
        lo, hi = bisect.bisect_left(ts, when), bisect.bisect_right(ts, when)
        near = xs[max(0, lo - 1):hi + 1]
        return sum(near) / len(near) if near else None

    def _credit(self, ref: str, when: int, now: float | None = None) -> float:
        """How much faster (log) the machine runs now than at decision ``when``, read on ``ref``, the policy that was
        in force then (measured around it, and measured last): a measurement taken then is credited with it.

        The interleaved benchmark showed why: every call is 10-30 % slower in a process's first iterations
        (allocator, caches), and one early measurement of quota (764 ms where it settles at 570) kept FEPLB in
        force, 4-7 % slower, for the rest of the run. Paired with the policy in force, which ran in the same
        slow moments, that measurement counts at what it would take now. Only a *faster* machine is credited,
        beyond ``switch_now`` (below it, the difference of two medians is noise): a policy in force that itself
        slows down (its own cost, not the machine's) must not make its rivals look slower and keep it in force.
        ``now``: ``ref``'s level now, when the caller has it."""
        then, now = self._level(ref, when), self._level(ref) if now is None else now
        if then is None or now is None:
            return 0.0
        return max(0.0, then - now - math.log1p(self.switch_now))

    def correction(self, name: str) -> float:
        """Multiplier of ``name``'s calibrated prediction: its own measured/predicted ratio when it has run, else
        the mean of the others' (the model's error is largely shared), else 1."""
        if name in self._outcome:
            return float(np.exp(self._outcome[name][0]))
        if self._outcome:
            return float(np.exp(np.mean([v for v, _ in self._outcome.values()])))
        return 1.0

    def estimate(self, name: str, calibrated_s: float) -> float:
        """Step 3's number for a candidate (``calibrated_s``: the calibrated model's prediction of its plan):

        * a candidate that has run: the anchor model's prediction times its measured/anchor ratio — its
          measured layer time carried to this load by a model that does not move. Calibration learned from the
          other candidates' runs can drift its calibrated prediction far from what it measured (on tiny
          layers fixed per-call costs are mistaken for compute: ``none`` looked 1.9x slower than it ran);
        * the policy in force, the same once it has FEW_RUNS measurements and a rival has run too (both then
          compare on one basis; see :meth:`_anchored`); before that ``calibrated_s`` times its measured/predicted
          ratio, so a change the calibrator sees (a slower link) reaches it at once;
        * a candidate that never ran: ``calibrated_s`` times the others' mean ratio, until its probe.
        """
        if name == self._current and name in self._outcome and not self._anchored(name):
            return calibrated_s * self.correction(name)
        if name in self._outcome_anchor and name in self._anchor_s:
            return self._anchor_s[name] * float(np.exp(self._outcome_anchor[name][0]))
        return calibrated_s * self.correction(name)

    def _anchored(self, name: str) -> bool:
        """Whether ``name`` is estimated on the anchor basis. Every candidate that has run is — except the policy
        in force while it has fewer than FEW_RUNS measurements or no rival has run. Comparing the policy in force
        on the calibrated basis with rivals on the anchor basis made the engine flap: calibration follows each
        call, so one call slowed by something else (2x at 64 tokens per rank) raised only the current's estimate
        and switched it away at once, the next call switched back (T=64: none <-> feplb every call)."""
        if name not in self._outcome_anchor:
            return False
        if name != self._current:
            return True
        return self._outcome_anchor[name][1] >= FEW_RUNS and any(n != name for n in self._outcome_anchor)

    def _anchor_predictions(self, topology: Topology, plans: dict, resident: bool, names=None) -> None:
        """Anchor-model predictions for :meth:`estimate` of ``names`` (default: the candidates that have run),
        added to this decision's (a new decision starts with ``names=None``)."""
        am = model_for(self._anchor, topology)
        todo = ([n for n in plans if self._anchored(n)] if names is None
                else [n for n in names if n not in self._anchor_s])
        got = {n: self._predict(am, n, plans[n], resident).total_s for n in todo}
        self._anchor_s = got if names is None else {**self._anchor_s, **got}
        if names is None:
            self._anchor_plans = plans

    def _since_run(self, name: str) -> int:
        return self.probe_every if name not in self._ran else self._since.get(name, 0)

    def _due(self, name: str) -> bool:
        """Whether ``name`` is due for a probe: it has not run for ``probe_every`` decisions, or — measured fewer
        than FEW_RUNS times, so its outcome is uncertain — for ``probe_every / 8`` (only where outcomes are
        measured at all: a simulation measures nothing)."""
        return self.probe_every > 0 and self._since_run(name) >= self._period(name)

    def _period(self, name: str) -> int:
        runs = self._outcome_anchor.get(name, (0.0, 0))[1]
        return max(1, self.probe_every // 8) if self._observed and runs < FEW_RUNS else self.probe_every

    def exposed_planner_s(self, cm, name: str) -> float:
        """Planner latency on the critical path (0 for a candidate whose policy says its planner is not on it,
        like FEPLB, which plans on a CPU thread under static compute)."""
        if not getattr(self.policies.get(name), "planner_exposed", True):
            return 0.0
        own = getattr(self.policies.get(name), "planner_s", 0.0)
        return cm.params.planner_s.get(name, own) * cm.params.plan_scale

    def screened(self, load_RE: np.ndarray, topology: Topology, *, none_s: float | None = None,
                 ideal_s: float | None = None, others_s: dict[str, float] | None = None) -> list[str]:
        """Step 1: stateless candidates that cannot win. ``none_s`` and ``ideal_s`` (predicted totals of ``none``
        and of the ideal) may be passed when known; ``others_s`` (the corrected predictions of the candidates
        planned anyway: none, the historical and off-critical-path ones) tightens the bound: a candidate can
        never beat the ideal plus its own planner, so if that already loses to one of them it is skipped."""
        if not self.screen:
            return []
        cm = self._cost(topology)
        todo = [n for n in self.policies if n in SCREENABLE and n != self._current  # hysteresis needs it
                and not self._reevaluate(n)]
        if not todo:
            return []
        out = [n for n in todo if self._rests(n)]
        todo = [n for n in todo if n not in out]
        if not todo:
            return out
        if none_s is None:
            none_s = cm.predict(identity_plan("none", topology, load_RE)).total_s
        if ideal_s is None:
            ideal_s = cm.ideal(load_RE).total_s
        gain_ub = none_s - ideal_s
        out += [n for n in todo if self.exposed_planner_s(cm, n) >= gain_ub]
        if others_s:
            ref = min(others_s.values())
            out += [n for n in todo if n not in out
                    and ideal_s * self.correction(n) + self.exposed_planner_s(cm, n) >= ref]
        return out

    def _reevaluate(self, name: str) -> bool:
        """Whether ``name`` must be planned this decision whatever the screen says: it was not planned for
        ``probe_every`` decisions, or it ran, is due for a probe and was not planned for its probe period
        (screening must not starve a candidate for its measured outcome: it could be screened *because* of that
        outcome, and one slow run kept quota out for good). Planned while due but too slow to be probed, it
        waits another period: re-planning it every decision until then cost the engine as much as never
        screening it (eplb at 64 tokens per rank)."""
        unplanned = self._unplanned.get(name, 0)
        return self.probe_every > 0 and (unplanned >= self.probe_every or (
            name in self._ran and self._due(name) and unplanned >= self._period(name)))

    def _rests(self, name: str) -> bool:
        """Step 1's streak rule for a candidate not due for re-evaluation: it lost clearly LOSING_STREAK
        decisions in a row, or ``none`` is in force and has won clearly for ``probe_every`` decisions."""
        return self.probe_every > 0 and (self._lost.get(name, 0) >= LOSING_STREAK or (
            self._current == "none" and self._none_streak >= self.probe_every))

    def resting(self) -> list[str]:
        """Step 1, first part: the candidates not planned (nor predicted) this decision because of a losing streak;
        ``none``, the policy in force, and candidates whose history cannot advance without a plan always plan.
        Regret: a resting candidate is re-planned at least once per ``probe_every`` decisions, so one that became
        the best is found within that many decisions, and meanwhile nothing is paid for it. At 64 tokens per rank
        this cut the engine's per-call planning from 1.5 ms to 0.8-0.9 ms (none alone: 0.5 ms; the layer: 70 ms)."""
        if not self.screen:
            return []
        return [n for n, p in self.policies.items() if n != "none" and n != self._current
                and callable(getattr(p, "advance", None)) and not self._reevaluate(n) and self._rests(n)]

    def references(self, breakdowns: dict) -> dict[str, float]:
        """Corrected predictions of the always-planned candidates in ``breakdowns`` that bound the screen (a
        historical placement only when resident: the plain prediction omits its switching cost)."""
        return {n: self.estimate(n, bd.total_s) for n, bd in breakdowns.items()
                if n in self.policies and n not in SCREENABLE and (n != "eplb" or self._current == "eplb")}

    def _predict(self, cm, name: str, plan: Plan, resident: bool = False):
        """Step 3 for one candidate: a historical placement that is not resident pays for sending all its
        replicas once; it then stays resident until its next re-placement, so that one-time cost is spread
        over the placement's ``interval`` decisions (charging it to one decision would make a switch never pay).
        With ``resident`` the plan's transfers already are exactly what moves (the caller knows which replicas
        are resident): no switch cost is added."""
        switch = name == "eplb" and self._current != "eplb"
        if not switch or resident or cm.params.resend_all_replicas:  # (a runtime resending every replica too)
            return cm.predict(plan)
        interval = max(1, int(getattr(self.policies[name], "interval", 1)))
        return cm.predict(plan, sync_s=cm.weight_sync_time(plan) + cm.full_sync_time(plan) / interval)

    # ------------------------------------------------------------------ planning
    #: candidates see which replicas are resident, and every candidate is predicted with what it would move
    uses_residency = True

    def plan(self, load_RE: np.ndarray, topology: Topology, resident_RE: np.ndarray | None = None) -> Plan:
        t0 = time.perf_counter()
        cm = self._cost(topology)
        has = resident_RE is not None
        # Step 1: the resting candidates; the others not screened by the gain bound are planned first (cheap or
        # off the critical path), then the bound screens the rest
        rest = set(self.resting())
        plans = {n: plan_resident(p, load_RE, topology, resident_RE) for n, p in self.policies.items()
                 if n not in SCREENABLE and n not in rest}
        bds = {n: self._predict(cm, n, pl, has) for n, pl in plans.items()}
        self._anchor_predictions(topology, plans, has)
        skip = rest | set(self.screened(load_RE, topology, none_s=bds["none"].total_s if "none" in bds else None,
                                        others_s=self.references(bds)))
        plans.update({n: plan_resident(p, load_RE, topology, resident_RE) for n, p in self.policies.items()
                      if n in SCREENABLE and n not in skip})
        plan = self.decide(plans, topology, screened=sorted(skip), breakdowns=bds, resident=has)
        object.__setattr__(plan, "solve_time_s", time.perf_counter() - t0)
        return plan

    def decide(self, plans: dict[str, Plan], topology: Topology | None = None, screened=(),
               breakdowns: dict | None = None, resident: bool = False) -> Plan:
        """Steps 3-6 on ready candidate plans ``{name: plan}`` (all of the same load and topology).
        ``breakdowns``: their cost-model predictions when the caller already has them; ``resident``: the plans'
        transfers are exactly what moves (see :meth:`_predict`).

        (About 100 lines, one function on purpose: Steps 3-6 read and narrow the same candidate tables in order;
        each step is marked.)"""
        any_plan = next(iter(plans.values()))
        topology = topology or any_plan.topology
        cm = self._cost(topology)
        predictions: dict[str, float] = {}
        known = breakdowns or {}
        breakdowns = {}
        if self._anchor_plans is plans:  # plan() started them; add candidates planned since
            self._anchor_predictions(topology, plans, resident, names=[n for n in plans if self._anchored(n)])
        else:  # decide() called directly (the simulator's shared candidates)
            self._anchor_predictions(topology, plans, resident)
        for name, pl in plans.items():  # Step 3
            switch = name == "eplb" and self._current != "eplb"
            if name in known and (resident or not switch):
                bd = known[name]
            else:
                bd = self._predict(cm, name, pl, resident)
            breakdowns[name] = bd
            predictions[name] = self.estimate(name, bd.total_s)
        # Step 4: late plans.
        late = []
        if self.deadline_s is not None:
            for name, bd in breakdowns.items():
                if name != "none" and self.exposed_planner_s(cm, name) + bd.weight_sync_s > self.deadline_s:
                    late.append(name)
        # A candidate whose plan does exactly what none's does (HybridEP choosing plain EP, FEPLB moving nothing)
        # is none under another name: measured, the two differ only by noise, and choosing by that noise made the
        # engine flip between them and pay the duplicate's planner (T=64: 7-10 % over none). none stands for it.
        # (the policy in force stays a candidate: hysteresis compares against it, and keeping it runs the same)
        same = sorted(n for n, pl in plans.items() if n not in ("none", self._current) and "none" in plans
                      and _same_work(pl, plans["none"]))
        feasible = {n: v for n, v in predictions.items() if n not in late and n not in same}
        if not feasible:  # pragma: no cover - none is never late
            feasible = {"none": predictions["none"]}
        best = min(feasible, key=lambda n: (feasible[n], n != "none"))
        cur = self._current
        pending = None
        # Step 5: hysteresis.
        if cur is None or cur not in feasible:
            chosen = best
            if cur is not None and cur in late:
                reason = f"late: {cur} planning + weight sync exceeds deadline {self.deadline_s:g} s; took {best}"
            elif late and best == "none":
                reason = f"late: {', '.join(late)} would arrive after the deadline; fallback none"
            else:
                reason = "cheapest"
        elif best == cur:
            chosen, reason = cur, "cheapest (kept)"
        else:
            gain = (feasible[cur] - feasible[best]) / feasible[cur] if feasible[cur] > 0 else 0.0
            count = self._pending[1] + 1 if (self._pending and self._pending[0] == best) else 1
            if gain > self.switch_now or (gain > self.margin and count >= self.patience):
                chosen, reason = best, f"switch {cur} -> {best}: {gain:.2%} faster"
            elif gain > self.margin:
                chosen, reason = cur, f"hysteresis: {best} {gain:.2%} faster, {count}/{self.patience} decisions"
                pending = (best, count)
            else:
                chosen, reason = cur, f"hysteresis: {best} only {gain:.2%} faster (margin {self.margin:.2%})"
        # Step 5b: bounded-regret probe: a candidate that never ran, or has not run for probe_every decisions,
        # runs once if its corrected prediction is within probe_max_loss of the best. A probe costs at most that
        # fraction of one layer call, once per candidate per probe_every calls: the regret is bounded by
        # (candidates - 1) * probe_max_loss / probe_every of the layer time (plus one exploration round).
        # Never-run candidates come first: until a candidate has run, its prediction borrows the others'
        # measured/predicted ratio, which says nothing about its own overheads.
        probe = False
        if self.probe_every > 0 and cur is not None:
            due = [n for n in sorted(feasible) if n != chosen and self._due(n)
                   and feasible[n] <= (1 + self.probe_max_loss) * feasible[best]]
            if due:
                probe_of = max(due, key=lambda n: (n not in self._ran, self._since_run(n), n))
                chosen, reason, probe = probe_of, (f"probe: {probe_of} " + (
                    "has not run yet" if probe_of not in self._ran
                    else f"last ran {self._since_run(probe_of)} decisions ago") + f" (kept {cur})"), True
        self._anchor_predictions(topology, plans, resident, names=[chosen])  # what its outcome is measured against
        # Step 6: the engine's exposed overhead.
        planned_max = max((self.exposed_planner_s(cm, n) for n in plans), default=0.0)
        engine_s = cm.params.engine_overhead_s + max(0.0, planned_max - self.exposed_planner_s(cm, chosen))
        src = plans[chosen]
        info = dict(src.info)
        predicted_s = float(predictions[chosen] + engine_s)
        info["adaptive"] = {  # this policy's own diagnostics (recorded with the plan; read back by commit)
            "chosen": chosen,
            "reason": reason,
            "predictions": {n: float(v) for n, v in predictions.items()},
            "predicted_s": predicted_s,
            "late": late,
            "same_as_none": same,
            "screened": list(screened),
            "previous": cur,
            "pending": list(pending) if pending else None,
            "probe": probe,
            "anchor_s": float(self._anchor_s.get(chosen, 0.0)),
            "none_clear": bool(best == "none" and len(feasible) > 1 and min(
                (v for n, v in feasible.items() if n != "none"), default=float("inf"))
                > feasible["none"] * (1 + self.switch_now)),
        }
        switched = chosen == "eplb" and cur != "eplb" and not resident
        plan = dataclasses.replace(
            src, policy=self.name, info=info,
            choice=Choice(chosen, reason, dict(info["adaptive"]["predictions"]), predicted_s, tuple(screened), probe),
            engine_s=float(engine_s),
            planner_s=float(cm.params.planner_s.get(chosen, src.planner_s if src.planner_s is not None else 0.0)),
            sync_s=float(breakdowns["eplb"].weight_sync_s) if switched else None)
        self._memo = (plan, plans)
        return plan

    def commit(self, plan: Plan) -> None:
        a = plan.info["adaptive"]
        if not a.get("probe"):  # a probe runs once; the current policy stays
            self._current = a["chosen"]
            self._pending = tuple(a["pending"]) if a.get("pending") else None
        preds, chosen = a["predictions"], a["chosen"]
        self._observing = (chosen, float(a.get("anchor_s", 0.0)))  # what observe_outcome will measure
        self._ran.add(chosen)
        self._decisions += 1
        for n in self.policies:
            self._since[n] = 0 if n == chosen else self._since.get(n, 0) + 1
            self._unplanned[n] = 0 if n in preds else self._unplanned.get(n, 0) + 1
        same = set(a.get("same_as_none", ()))  # none under another name cannot win either
        for n, v in preds.items():  # losing streaks of the candidates that were planned
            lost = n != chosen and (v > preds[chosen] * (1 + self.switch_now) or n in same)
            self._lost[n] = self._lost.get(n, 0) + 1 if lost else 0
        self._none_streak = self._none_streak + 1 if a.get("none_clear") else 0
        if not self.owns_candidates:
            return
        if self._memo is not None and self._memo[0] is plan:
            plans = self._memo[1]
        else:  # a replayed plan: re-plan the candidates from its load
            plans = {n: p.plan(plan.load_RE, plan.topology) for n, p in self.policies.items()
                     if n not in a.get("screened", [])}
        for n, p in self.policies.items():
            if n in plans:
                p.commit(plans[n])
            elif callable(getattr(p, "advance", None)):  # not planned (Step 1): its history still sees the load
                p.advance(plan.load_RE)
        self._memo = None


def _same_work(a: Plan, b: Plan) -> bool:
    """Whether plans ``a`` and ``b`` run the same layer: same placement, same routes, nothing moved, no overlay."""
    return (a.expert_domains is None and b.expert_domains is None and not len(a.transfers) and not len(b.transfers)
            and np.array_equal(a.phy2log_RS, b.phy2log_RS) and np.array_equal(a.routes_RRS, b.routes_RRS))
