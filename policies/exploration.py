"""The adaptive engine's exploration budget: when weighing the candidates is not worth its cost.

A chooser pays for weighing on every decision: its decision overhead and the planners of candidates it does not
choose. Paid per decision, that is a fixed share of every layer call, and where nothing pays (a few tokens per
rank, layer calls of a few hundred microseconds) it was the whole difference to ``none``: 3 % of the layer time
(issue 35, item 4). Bounded over the run, it is a share of what there is to gain::

    spent_s <= share * run_s + of_gain * saved_s

``run_s``: the predicted layer time of every decision so far; ``saved_s``: what weighing found, the best
candidate's predicted saving over the policy in force on each decision; ``spent_s``: what weighing cost.

What the budget may do, and what it may not (the first budget, reverted in 7c92a3b, froze the runtime on
eplb/feplb while quota measured faster): a decision is *idle* — only the fallback planned and predicted, nothing
weighed, no decision overhead — only when all of these hold:

* the fallback (``none``) is in force: with any other policy in force every decision weighs as before;
* no candidate is *in contention*: at its last weighing each other candidate's corrected prediction (its
  measured outcome where it ran), less what any plan could save more on this load than then (skew appearing),
  was slower than the fallback now by more than ``switch_now`` — or, where outcomes are measured (the runtime)
  and the candidate is due for a probe, by more than ``probe_max_loss``: a candidate the engine would probe is
  weighed when its probe is due, not at every decision in between (weighing every decision for such a
  candidate, feplb measured a few % from ``none`` at 64 tokens per rank, the runtime's adaptive measured 3.5 %
  slower than ``none``'s own run while running ``none``, 2026-11-26); a candidate that did exactly what the fallback
  does is the fallback under another name; a candidate never weighed is in contention, one screened before
  its first weighing counts at the least it could take (the ideal plus its planner, refreshed at each
  screening): a bound, so it contends only below the fallback's time, without the margin;
* the budget cannot pay one weighing (the cost model's decision overhead).

So where nothing pays, weighing costs at most ``share`` of the run. Where nothing is measured (the simulator), a
candidate that the schedule wants re-planned whatever the gain bound says (:mod:`.screening`) also waits until
the budget can pay its planner; where outcomes are measured it never waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: share of the run's layer time that weighing may always cost (the floor that keeps re-evaluating a regime
#: where nothing pays, so that a change of the load is still found)
SHARE = 0.003
#: share of what weighing found (the best candidate's saving over the policy in force) it may cost on top
OF_GAIN = 0.1


@dataclass
class ExplorationBudget:
    """Running ledger of one chooser (one layer) and the candidates' standing at their last weighing.

    ``share=None``: unbounded (every decision weighs: the engine before issue 35's item 4)."""

    share: float | None = SHARE
    of_gain: float = OF_GAIN
    run_s: float = 0.0
    saved_s: float = 0.0
    spent_s: float = 0.0
    #: per candidate, its corrected prediction (seconds) at its last weighing: inf for one that did what the
    #: fallback does; for one screened before it was weighed, the least it could take (the ideal plus its planner)
    standing: dict[str, float] = field(default_factory=dict)
    #: what any plan could save over the fallback (its time minus the ideal) at the last weighing
    stake_s: float = 0.0
    #: the candidates whose standing is a floor (screened, never weighed since): a bound, not an estimate
    floors: set[str] = field(default_factory=set)
    #: the probes' (and confirmations') predicted seconds over the policy in force's, summed
    probe_s: float = 0.0

    def free(self) -> float:
        """Seconds weighing may still cost now (negative: overdrawn)."""
        if self.share is None:
            return float("inf")
        return self.share * self.run_s + self.of_gain * self.saved_s - self.spent_s

    def in_contention(self, names, fallback: str, fallback_s: float, stake_s: float, max_loss: float,
                      due: dict[str, float] | None = None) -> bool:
        """Whether a candidate other than ``fallback`` could come within ``max_loss`` of it on this load (the
        fallback's time ``fallback_s``, ``stake_s`` what any plan could save): its time at its last weighing, less
        what the stake grew since (skew appearing can save at most that much more), or it was never weighed. A
        candidate in ``due`` (due for a probe: ``{name: the probe's range}``) is in contention within that range."""
        growth, due = max(0.0, stake_s - self.stake_s), due or {}
        return any(self._could(n, growth, fallback_s, max(max_loss, due.get(n, 0.0))) for n in names if n != fallback)

    def _could(self, name: str, growth: float, fallback_s: float, max_loss: float) -> bool:
        """Whether ``name`` could come within ``max_loss`` of the fallback. A floor (the least a screened
        candidate could take) is a bound, not an estimate with a model error: it contends only if it is below the
        fallback's time. With the margin, a floor within ``switch_now`` of ``none`` held the budget in contention
        for good at 64 tokens per rank (quota's floor 65.4 ms, ``none`` 64.9): the replay's adaptive weighed every
        decision and paid 4 % over ``none`` while it ran ``none`` (2026-11-27)."""
        s = self.standing.get(name, 0.0) - growth
        return s < fallback_s if name in self.floors else s <= (1.0 + max_loss) * fallback_s

    def idle(self, names, fallback: str, fallback_s: float, stake_s: float, max_loss: float, weigh_s: float,
             due: dict[str, float] | None = None) -> bool:
        """Whether this decision may skip weighing (see the module docstring); ``weigh_s``: what weighing costs;
        ``due``: see :meth:`in_contention`."""
        if weigh_s <= 0 or self.free() >= weigh_s:
            return False
        return not self.in_contention(names, fallback, fallback_s, stake_s, max_loss, due)

    def note(self, predictions: dict[str, float], fallback: str, same, floors: dict[str, float],
             stake_s: float) -> None:
        """A weighed decision: the candidates' corrected predictions (seconds), those that did what the fallback
        does (``same``: never in contention on their own), the least the candidates screened before their first
        weighing could take (``floors``), and what any plan could save on its load (``stake_s``)."""
        for n, v in floors.items():  # refreshed at each screening until the candidate is weighed
            if n not in self.standing or n in self.floors:
                self.standing[n] = float(v)
                self.floors.add(n)
        for n, v in predictions.items():
            if n != fallback:
                self.standing[n] = float("inf") if n in same else float(v)
                self.floors.discard(n)
        self.stake_s = float(stake_s)

    def rescale(self, name: str, factor: float | None) -> None:
        """``name`` was measured since its last weighing and its measured correction moved by ``factor``: its standing
        moves with it (not a floor's, a bound). Without it a probe that measured a rival 30 % faster than ``none``
        left its standing where the weighing before the probe put it, and the decisions idled on ``none`` until its
        next probe (100 decisions)."""
        if factor and factor > 0 and math.isfinite(factor) and name in self.standing and name not in self.floors:
            self.standing[name] *= factor

    def charge(self, run_s: float, saved_s: float, spent_s: float, probe_s: float = 0.0) -> None:
        """Book one committed decision: its predicted layer time, what the best candidate was predicted to save
        over the policy in force, and what weighing cost on it (all seconds, >= 0); ``probe_s``: a probe's predicted
        seconds over the policy in force's (may be negative: a probe predicted faster)."""
        self.probe_s += float(probe_s)
        self.run_s += max(0.0, float(run_s))
        self.saved_s += max(0.0, float(saved_s))
        self.spent_s += max(0.0, float(spent_s))


def ledger(schedule, budget: ExplorationBudget) -> dict[str, float]:
    """What a chooser spent exploring so far: ``decisions``, ``probes`` (Step 5b's, bounded by the schedule's
    ``probe_share``), ``probe_share`` (their share of the decisions), ``probe_loss_s`` (the probes' and
    confirmations' predicted seconds over the policy in force's, summed), ``weigh_s`` (what weighing cost) and
    ``run_s`` (the decisions' predicted layer time). What the probes cost as measured is the telemetry's (the
    ``exploration`` view: each probe's measured time against the policy in force's calls beside it)."""
    n = schedule.decisions
    return {"decisions": n, "probes": schedule.probes, "probe_share": schedule.probes / n if n else 0.0,
            "probe_loss_s": budget.probe_s, "weigh_s": budget.spent_s, "run_s": budget.run_s}
