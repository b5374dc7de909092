"""The adaptive engine's Step 1: which candidates are not planned this decision.

Two reasons, both bounded by the :class:`~ultraep.policies.probes.ProbeSchedule` (a candidate due for
re-evaluation is planned whatever they say):

* *resting*: a candidate that lost clearly LOSING_STREAK decisions in a row (or every candidate, once the
  fallback has won clearly for ``probe_every`` decisions) is neither planned nor predicted; its history still
  advances with the load (its ``advance``);
* *the gain bound*: a ``screenable`` candidate (stateless, its planner on the critical path: ``quota``) whose
  planner alone exceeds the most any plan could gain over the fallback (its time minus the force-balanced
  ideal), or whose ideal time plus planner already loses to a candidate planned anyway.
"""

from __future__ import annotations

import numpy as np

from ultraep.topology import Topology

from .base import identity_plan
from .candidates import Candidates
from .exploration import ExplorationBudget
from .outcomes import OutcomeTracker
from .probes import ProbeSchedule


class Screen:
    """Step 1 over one chooser's parts; ``enabled=False`` screens nothing (every candidate planned)."""

    def __init__(self, candidates: Candidates, schedule: ProbeSchedule, outcomes: OutcomeTracker,
                 budget: ExplorationBudget, enabled: bool) -> None:
        self.candidates, self.schedule, self.outcomes, self.budget = candidates, schedule, outcomes, budget
        self.enabled = bool(enabled)

    def reevaluate(self, cm, name: str) -> bool:
        """Whether the schedule wants ``name`` planned whatever the bound says, and it may be. Where nothing is
        measured (the simulator: the model is the outcome, the bound cannot be wrong) it waits until the
        exploration budget can pay its planner: re-planning quota every ``probe_every`` decisions was 1 % of a
        layer at 120 tokens per rank. Where outcomes are measured (the runtime) it never waits: the model may be
        wrong about a candidate, and only a probe tells."""
        if not self.schedule.reevaluate(name):
            return False
        return self.outcomes.observed > 0 or self.budget.free() >= self.candidates.exposed_planner_s(cm, name)

    def resting(self, current: str | None) -> list[str]:
        """The candidates not planned (nor predicted) this decision because of a losing streak; the fallback, the
        policy in force, and candidates whose history cannot advance without a plan always plan. Regret: a resting
        candidate is re-planned at least once per ``probe_every`` decisions, so one that became the best is found
        within that many decisions, and meanwhile nothing is paid for it. At 64 tokens per rank this cut the
        engine's per-call planning from 1.5 ms to 0.8-0.9 ms (none alone: 0.5 ms; the layer: 70 ms)."""
        if not self.enabled:
            return []
        c, s, fb = self.candidates, self.schedule, self.candidates.fallback
        return [n for n in c.policies if n not in (fb, current)
                and c.can_rest(n) and not s.reevaluate(n) and s.rests(n, current == fb)]

    def screened(self, cm, load_RE: np.ndarray, topology: Topology, current: str | None, *,
                 none_s: float | None = None, ideal_s: float | None = None,
                 others_s: dict[str, float] | None = None) -> list[str]:
        """Stateless candidates that cannot win. ``none_s`` and ``ideal_s`` (predicted totals of the fallback and
        of the ideal) may be passed when known; ``others_s`` (the corrected predictions of the candidates planned
        anyway: the fallback, the historical and off-critical-path ones) tightens the bound: a candidate can never
        beat the ideal plus its own planner, so if that already loses to one of them it is skipped."""
        if not self.enabled:
            return []
        c = self.candidates
        todo = [n for n in c.policies if c.screenable(n) and n != current  # hysteresis compares against it
                and not self.reevaluate(cm, n)]
        out = [n for n in todo if self.schedule.rests(n, current == c.fallback)]
        todo = [n for n in todo if n not in out]
        if not todo:
            return out
        if none_s is None:
            none_s = cm.predict(identity_plan(c.fallback, topology, load_RE)).total_s
        if ideal_s is None:
            ideal_s = cm.ideal(load_RE).total_s
        gain_ub = none_s - ideal_s
        out += [n for n in todo if c.exposed_planner_s(cm, n) >= gain_ub]
        if others_s:
            ref = min(others_s.values())
            out += [n for n in todo if n not in out
                    and ideal_s * self.outcomes.correction(n) + c.exposed_planner_s(cm, n) >= ref]
        return out

    def bounds(self, name: str, current: str | None) -> bool:
        """Whether ``name``'s corrected prediction, when planned, bounds the screen (``others_s`` of :meth:`screened`):
        an always-planned candidate, a historical placement only when resident (the plain prediction omits its
        switching cost)."""
        c = self.candidates
        return name in c.policies and not c.screenable(name) and not c.switches(name, current)
