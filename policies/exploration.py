"""The adaptive engine's exploration budget: what weighing, planning and probing other candidates may cost.

A chooser pays for exploring on every decision it weighs candidates: its decision overhead, the planners of
candidates it did not choose, and the predicted loss of a probe. Bounded per decision, that cost is a fixed
share of every layer call, and where nothing pays (a few tokens per rank, layer calls of a few hundred
microseconds) it was the whole difference to ``none``: 3-5 % of the layer time (issue 35, item 4). Bounded
over the run, it is a share of what there is to gain:

    spent_s <= share * run_s + of_gain * saved_s

``run_s``: the predicted layer time of every decision so far (the run); ``saved_s``: what weighing found, the best
candidate's predicted saving over the policy in force on each decision (0 where the policy in force is best);
``spent_s``: what exploring cost. Where candidates keep overtaking each other, ``of_gain * saved_s`` pays for
weighing them; where the policy in force stays the best (nothing pays, or one policy clearly wins), exploring
costs at most ``share`` of the run, plus the one decision that overdraws it. (Saving over the policy in force,
not over ``none``: against ``none``, a layer where feplb and quota both halve the time licensed planning quota
on every call while feplb was in force, 1.4 % of the layer for a 2 % alternative.)
"""

from __future__ import annotations

from dataclasses import dataclass

#: share of the run's layer time that exploring may always cost (the floor that keeps re-evaluating a regime
#: where nothing pays, so that a change of the load is still found)
SHARE = 0.003
#: share of what weighing found (the best candidate's saving over the policy in force) exploring may cost on top
OF_GAIN = 0.1


@dataclass
class ExplorationBudget:
    """Running ledger of one chooser (one layer): seconds run, saved over ``none`` and spent exploring."""

    share: float = SHARE
    of_gain: float = OF_GAIN
    run_s: float = 0.0
    saved_s: float = 0.0
    spent_s: float = 0.0

    def free(self) -> float:
        """Seconds exploring may still cost now (negative: overdrawn)."""
        return self.share * self.run_s + self.of_gain * self.saved_s - self.spent_s

    def charge(self, run_s: float, saved_s: float, spent_s: float) -> None:
        """Book one committed decision: its predicted layer time, what the best candidate was predicted to save
        over ``none`` on it, and what exploring cost on it (all seconds, >= 0)."""
        self.run_s += max(0.0, float(run_s))
        self.saved_s += max(0.0, float(saved_s))
        self.spent_s += max(0.0, float(spent_s))
