"""The adaptive engine's hysteresis: the candidate in force, and when a better one may take over.

One :class:`Hysteresis` per adaptive layer. Switching has a cost of its own (replicas to move, caches to
warm), and predictions carry noise: the policy in force is kept unless the cheapest candidate is faster by
more than ``margin`` for ``patience`` consecutive decisions, or by more than ``switch_now`` at once.
"""

from __future__ import annotations


class Hysteresis:
    """The candidate in force (``current``) and a pending switch (``pending``: a better candidate and the
    decisions it has won in a row).

    Args:
        margin: relative gain below which the current policy is kept (0.005 = 0.5 %).
        patience: consecutive decisions the same better policy must win before a switch.
        switch_now: relative gain that switches at once, without waiting for ``patience``.
    """

    def __init__(self, margin: float, patience: int, switch_now: float) -> None:
        self.margin = float(margin)
        self.patience = max(1, int(patience))
        self.switch_now = float(switch_now)
        self.current: str | None = None  # the policy in force
        self.pending: tuple[str, int] | None = None  # a better candidate and the decisions it has won so far

    def choose(self, feasible: dict[str, float], best: str, late: list[str], fallback: str,
               deadline_s: float | None) -> tuple[str, str, tuple[str, int] | None]:
        """Step 5: (chosen, reason, pending switch) among ``feasible`` (corrected predictions of the candidates
        on time; ``best`` the cheapest; ``late`` those past ``deadline_s``)."""
        cur = self.current
        if cur is None or cur not in feasible:
            if cur is not None and cur in late:
                why = f"{cur} planning + weight sync exceeds deadline {deadline_s:g} s"
                return best, f"late: {why}; took {best}", None
            if late and best == fallback:
                return best, f"late: {', '.join(late)} would arrive after the deadline; fallback {best}", None
            return best, "cheapest", None
        if best == cur:
            return cur, "cheapest (kept)", None
        gain = (feasible[cur] - feasible[best]) / feasible[cur] if feasible[cur] > 0 else 0.0
        count = self.pending[1] + 1 if (self.pending and self.pending[0] == best) else 1
        if gain > self.switch_now or (gain > self.margin and count >= self.patience):
            return best, f"switch {cur} -> {best}: {gain:.2%} faster", None
        if gain > self.margin:
            return cur, f"hysteresis: {best} {gain:.2%} faster, {count}/{self.patience} decisions", (best, count)
        return cur, f"hysteresis: {best} only {gain:.2%} faster (margin {self.margin:.2%})", None

    def commit(self, chosen: str, pending, probe: bool) -> None:
        """A committed decision: ``chosen`` is in force now, unless it was a probe (it runs once)."""
        if not probe:
            self.current = chosen
            self.pending = tuple(pending) if pending else None
