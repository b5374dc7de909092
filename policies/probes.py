"""The adaptive engine's probe schedule: which candidate is due for a probe, for re-planning, or rests.

One :class:`ProbeSchedule` per adaptive layer. It counts, per candidate, the decisions since it last ran and
since it was last planned, and its losing streak; from these it says which candidate is *due* for a probe
(run once to be measured), which must be *re-evaluated* (planned whatever the screen says), and which *rests*
(neither planned nor predicted). The period of a candidate measured fewer than FEW_RUNS times is shorter
(its outcome is uncertain), read from the :class:`~ultraep.policies.outcomes.OutcomeTracker`.

Regret bound: a resting candidate is re-planned at least once per ``probe_every`` decisions, and a probe runs
a candidate predicted at most ``probe_max_loss`` slower than the best, once per ``probe_every`` decisions.

Re-check after a switch: where outcomes are measured, the policy a switch left is probed again after
``probe_every / 8`` decisions, and that fresh measurement replaces its history (the tracker's ``restart``). A
switch weighs one fresh measurement of the target against the median of the policy in force's last runs, which
can reach back to calls the clock cannot credit (the policy in force has no later runs to read the machine's level
on). On the runtime at the default shape (2026-11-26) quota's four runs in the engine's first 14 calls measured
592-687 ms (its own run settled at 600-615), one eplb probe measured 667, the engine switched to eplb, and quota
was not measured again within the 40-call run: adaptive ran 11 % slower than quota's own run. A candidate is
re-checked at most once per ``probe_every`` decisions, so two candidates within noise of each other cannot make
the engine alternate between them on re-checks.
"""

from __future__ import annotations

from .outcomes import FEW_RUNS, OutcomeTracker

#: the share of decisions that may run a probe (Step 5b), over the run: a probe runs a candidate predicted up to
#: ``probe_max_loss`` (25 %) slower than the best, so at this share probing costs at most 0.25 x 0.05 = 1.25 % of the
#: run's layer time, within the 3 % the engine may lose to the best fixed policy (issue 56; a reasoned bound, to be
#: confirmed by benchmarks/bench_long.py's ``--probe-share``). Beside it each candidate may be probed PROBE_BURST times
PROBE_SHARE = 0.05
#: probes per candidate (the fallback too) allowed beyond the share: FEW_RUNS, the measurements until its outcome is
#: trusted (a fresh wrap measures every candidate as it did before the share; the share bounds the run after them)
PROBE_BURST = FEW_RUNS

#: a candidate that lost clearly this many planned decisions in a row rests — not planned, not predicted — until
#: it is due for re-evaluation: its planning and prediction are then paid once per ``probe_every`` decisions
#: (only candidates whose history can advance without a plan rest: those with an ``advance`` method)
LOSING_STREAK = 8


class ProbeSchedule:
    """Due, period, resting and re-evaluation of one chooser's candidates.

    Args:
        probe_every: decisions between probes (and re-plannings) of a candidate; 0 turns probing and resting off.
        probe_max_loss: a due candidate is probed only if predicted at most this (relative) slower than the best.
        switch_now: a planned candidate predicted slower than the chosen one by more than this lost clearly.
        outcomes: the chooser's measured outcomes (how often each candidate was measured).
        probe_share: the share of decisions that may run a probe, over the run, beside ``burst`` probes (None: no
            bound: every due candidate within ``probe_max_loss`` is probed).
        burst: probes allowed beyond the share (the chooser passes PROBE_BURST per candidate).
    """

    def __init__(self, probe_every: int, probe_max_loss: float, switch_now: float, outcomes: OutcomeTracker,
                 probe_share: float | None = None, burst: int = 0) -> None:
        self.probe_share = None if probe_share is None else float(probe_share)
        self.burst = int(burst)
        self.decisions = 0  # decisions recorded
        self.probes = 0  # of them, probes of Step 5b (what the share bounds)
        self.probe_every = int(probe_every)
        self.probe_max_loss = float(probe_max_loss)
        self.switch_now = float(switch_now)
        self.outcomes = outcomes
        self._since: dict[str, int] = {}  # decisions since each candidate last ran
        self._unplanned: dict[str, int] = {}  # decisions since each candidate was last planned
        self._ran: set[str] = set()  # candidates that ran at least once
        self._none_streak = 0  # consecutive decisions the fallback won by more than switch_now
        self._lost: dict[str, int] = {}  # consecutive decisions a planned candidate lost by more than switch_now
        self._recheck: set[str] = set()  # candidates a switch left, not measured since (re-checked sooner)
        self._left_at: dict[str, int] = {}  # the decision (outcomes.decisions) each was last marked for a re-check

    # ------------------------------------------------------------------ reading the schedule
    def affordable(self) -> bool:
        """Whether one more probe keeps the probes within ``probe_share`` of the decisions (this one included) plus
        ``burst``."""
        return self.probe_share is None or self.probes + 1 <= self.probe_share * (self.decisions + 1) + self.burst

    def has_run(self, name: str) -> bool:
        return name in self._ran

    def since_run(self, name: str) -> int:
        return self.probe_every if name not in self._ran else self._since.get(name, 0)

    def period(self, name: str) -> int:
        """``probe_every``, or ``probe_every / 8`` for a candidate measured fewer than FEW_RUNS times or left by a
        switch and not measured since (only where outcomes are measured at all: a simulation measures nothing)."""
        few = self.outcomes.observed and (self.outcomes.runs(name) < FEW_RUNS or name in self._recheck)
        return max(1, self.probe_every // 8) if few else self.probe_every

    def due(self, name: str) -> bool:
        """Whether ``name`` is due for a probe: it has not run for its :meth:`period`."""
        return self.probe_every > 0 and self.since_run(name) >= self.period(name)

    def probe_range(self, names) -> dict[str, float]:
        """Where outcomes are measured, the candidates of ``names`` due for a probe, each with the range it is
        probed within (``probe_max_loss``): the exploration budget weighs them (``ExplorationBudget.in_contention``)."""
        if not self.outcomes.observed or not self.affordable():  # no probe could run now: none is due
            return {}
        return {n: self.probe_max_loss for n in names if self.due(n)}

    def reevaluate(self, name: str) -> bool:
        """Whether ``name`` must be planned this decision whatever the screen says: it was not planned for
        ``probe_every`` decisions, or it ran, is due for a probe and was not planned for its probe period
        (screening must not starve a candidate for its measured outcome: it could be screened *because* of that
        outcome, and one slow run kept quota out for good). Planned while due but too slow to be probed, it
        waits another period: re-planning it every decision until then cost the engine as much as never
        screening it (eplb at 64 tokens per rank)."""
        unplanned = self._unplanned.get(name, 0)
        return self.probe_every > 0 and (unplanned >= self.probe_every or (
            name in self._ran and self.due(name) and unplanned >= self.period(name)))

    def rests(self, name: str, fallback_in_force: bool) -> bool:
        """The streak rule for a candidate not due for re-evaluation: it lost clearly LOSING_STREAK decisions in a
        row, or the fallback (``none``) is in force and has won clearly for ``probe_every`` decisions."""
        return self.probe_every > 0 and (self._lost.get(name, 0) >= LOSING_STREAK or (
            fallback_in_force and self._none_streak >= self.probe_every))

    def probe(self, feasible: dict[str, float], chosen: str, best: str, fallback: str | None = None) -> str | None:
        """The candidate to probe this decision, if any: due, not the chosen one, and predicted within
        ``probe_max_loss`` of the best (``feasible``: corrected predictions). Never-run candidates come first:
        until a candidate has run, its prediction borrows the others' measured/predicted ratio, which says
        nothing about its own overheads; then the one that ran longest ago.

        The ``fallback`` (``none``), where outcomes are measured, is probed until it has run whatever its
        prediction: every other candidate's gain is relative to it, and its worst case is the layer the user
        runs without balancing. At 64 tokens per rank the uncalibrated model put ``none`` 27 % above
        FEPLB (measured, the two are within a few percent), past ``probe_max_loss``: ``none`` went unmeasured
        and the engine ran feplb, or quota at 0.8x of none, for 20 calls or the whole run.

        None while a probe would exceed the budget (:meth:`affordable`): the due candidates wait, the oldest first
        once it allows one."""
        if not self.affordable():
            return None
        unmeasured_fallback = fallback if (self.outcomes.observed and fallback is not None
                                           and self.outcomes.runs(fallback) == 0) else None
        due = [n for n in sorted(feasible) if n != chosen and self.due(n)
               and (feasible[n] <= (1 + self.probe_max_loss) * feasible[best] or n == unmeasured_fallback)]
        if not due:
            return None
        return max(due, key=lambda n: (n not in self._ran, self.since_run(n), n))

    def confirm(self, target: str, current: str | None) -> str | None:
        """Why a switch from ``current`` to ``target`` must first measure ``target`` again (None: switch now).

        Where outcomes are measured, a switch is taken only on a measurement of ``target`` from the previous
        decision, next to the policy in force's (the clock's A-B-A pairing). A stale one compares a measurement taken
        on another machine state with a fresh median: at 64 tokens per rank, after 24 calls of ``none`` that drifted
        from 87 to 99 ms, one FEPLB call measured at the fourth decision switched the engine to FEPLB "4 % faster";
        a rival measured only in the warm-up, or never, was switched to on the model's word. Confirming costs one
        call, the one the switch would have run anyway."""
        if current is None or target == current or not self.outcomes.observed or self.probe_every <= 0:
            return None
        if target not in self._ran or self.outcomes.runs(target) == 0:
            return f"{target} not measured yet, measured before the switch (kept {current})"
        if self.since_run(target) > 0:
            return f"{target} last measured {self.since_run(target) + 1} decisions ago, measured again before the " \
                   f"switch (kept {current})"
        return None

    def reason(self, name: str, current: str | None) -> str:
        """The decision's reason when ``name`` is probed while ``current`` stays in force."""
        if name in self._recheck:
            return f"probe: {name} re-checked after the switch to {current} (its runs before it are replaced)"
        why = "has not run yet" if name not in self._ran else f"last ran {self.since_run(name)} decisions ago"
        return f"probe: {name} {why} (kept {current})"

    # ------------------------------------------------------------------ advancing it
    def forget(self, name: str) -> None:
        """``name``'s run says nothing (measured in the warm-up): it counts as not run yet."""
        self._ran.discard(name)

    def record(self, names, chosen: str, predictions: dict[str, float], same: set[str], fallback_clear: bool,
               weighed: bool = True, left: str | None = None, probed: bool = False) -> None:
        """One committed decision: ``chosen`` ran; the candidates in ``predictions`` were planned (the others in
        ``names`` were not); a planned candidate lost clearly if predicted slower than the chosen one by more
        than ``switch_now``, or did what the fallback does (``same``); ``fallback_clear``: the fallback won clearly.
        A decision that weighed nothing (``weighed=False``: the exploration budget's idle one) leaves the streaks.
        ``left``: the policy in force before this decision, unless this decision was a probe (a switch from
        ``left`` to ``chosen`` marks ``left`` for a re-check, at most once per ``probe_every`` decisions, counted by
        ``outcomes.decisions``, which the chooser advances before it records). ``probed``: this decision ran a probe of
        Step 5b (counted against ``probe_share``)."""
        self.decisions += 1
        self.probes += bool(probed)
        self._ran.add(chosen)
        if chosen in self._recheck:  # the re-check: its fresh measurement replaces its history
            self._recheck.discard(chosen)
            self.outcomes.restart = chosen
        if (left not in (None, chosen) and self.outcomes.observed and self.probe_every > 0
                and self.outcomes.decisions - self._left_at.get(left, -self.probe_every) >= self.probe_every):
            self._recheck.add(left)
            self._left_at[left] = self.outcomes.decisions
        for n in names:
            self._since[n] = 0 if n == chosen else self._since.get(n, 0) + 1
            self._unplanned[n] = 0 if n in predictions else self._unplanned.get(n, 0) + 1
        if not weighed:
            return
        for n, v in predictions.items():
            lost = n != chosen and (v > predictions[chosen] * (1 + self.switch_now) or n in same)
            self._lost[n] = self._lost.get(n, 0) + 1 if lost else 0
        self._none_streak = self._none_streak + 1 if fallback_clear else 0
