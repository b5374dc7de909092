"""The adaptive engine's probe schedule: which candidate is due for a probe, for re-planning, or rests.

One :class:`ProbeSchedule` per adaptive layer. It counts, per candidate, the decisions since it last ran and
since it was last planned, and its losing streak; from these it says which candidate is *due* for a probe
(run once to be measured), which must be *re-evaluated* (planned whatever the screen says), and which *rests*
(neither planned nor predicted). The period of a candidate measured fewer than FEW_RUNS times is shorter
(its outcome is uncertain), read from the :class:`~ultraep.policies.outcomes.OutcomeTracker`.

Regret bound: a resting candidate is re-planned at least once per ``probe_every`` decisions, and a probe runs
a candidate predicted at most ``probe_max_loss`` slower than the best, once per ``probe_every`` decisions. What the
probes cost is paced (``cost_share``): their predicted seconds over the policy in force stay within a share of its
predicted time at every decision, from a fresh wrap's first (:meth:`ProbeSchedule.probe`).

Re-check after a switch: where outcomes are measured, the policy a switch left is probed again after
``probe_every / 8`` decisions, and that fresh measurement replaces its history (the tracker's ``restart``). A
switch weighs one fresh measurement of the target against the median of the policy in force's last runs, which
can reach back to calls the clock cannot credit (the policy in force has no later runs to read the machine's level
on). On the runtime at the default shape (2026-11-26) quota's four runs in the engine's first 14 calls measured
592-687 ms (its own run settled at 600-615), one eplb probe measured 667, the engine switched to eplb, and quota
was not measured again within the 40-call run: adaptive ran 11 % slower than quota's own run. A candidate is
re-checked at most once per ``probe_every`` decisions, so two candidates within noise of each other cannot make
the engine alternate between them on re-checks. The fallback's re-check runs whatever the probe ledger and the share
hold: its worst case is the layer without balancing, and a switch away from it on noise is undone only by measuring it.
At 64 tokens per rank, with the ledger spent on EPLB probes (one measured 50 % over ``none``), its re-check waited 37
decisions while FEPLB, 12 % slower, ran (the run came to 0.927x of ``none``). So is the re-check of a policy the switch
left while it was measured fewer than FEW_RUNS times: its estimate may stand on one slow call (:func:`_owed`).

First probe of the fallback: one put within ``probe_max_loss`` of the best by the seed model at the wrap's first
decision (:func:`first_weighing`) or by the first calibrated weighing after it is probed at the first decision after
the warm-up, whatever the ledger holds. Calibration learns from the policies that run, and on the runtime at 64 tokens
per rank, 16 experts it raised ``none``'s prediction from 1.10-1.14x FEPLB's at the first decision to 1.5-1.7x
(measured, ``none`` ran at 0.8x of FEPLB and quota), so its probe waited 31 calls for the ledger while they ran. One
further behind at first (the default shape: 1.5x quota) is probed first only if the first calibrated weighing puts
it within reach, else waits for the ledger: its probe costs some 0.4 of a call there.

Switches: one a decision takes on fresh evidence is not displaced by a probe. Each probe that displaced it kept the
slower policy in force one more call (in a replay of the 16-expert shape, two probes in a row cancelled the switch
from quota to ``none``, measured 16 % faster).

Uncertain fallback: a re-check or a confirmation replaces the fallback's history by one measurement, and one slow
call kept as its whole history put it far behind. Paced by that estimate, ``none`` was not measured again for 150
decisions while EPLB, 30 % slower, ran (bench_long's runtime calls replayed, the small-token phase). Until it has
FEW_RUNS measurements again it is probed every ``probe_every`` decisions, as if within ``probe_max_loss``.

Paced by regret: a rival measured FEW_RUNS times is probed again once the decisions since it ran pay for its probe at
``probe_regret`` of the policy in force's time each (:class:`Pace`), at any predicted loss: probing costs each window
about that much per rival, and no estimate, however stale, keeps a rival out of reach for good.

Screened while due: a decision that weighs nothing asks :meth:`ProbeSchedule.probe_range` whether a probe is due, and
weighs if one is, so that the probe runs. A candidate the last weighing did not plan (the gain bound screened it, or
it rests) cannot be probed by the next weighing either until it is re-evaluated (:meth:`ProbeSchedule.reevaluate`):
until then it is not due there. Counted, a paced rival due by its regret period (eplb at 1.4x ``none``'s time) but
screened by every weighing ended the idle and settled rests at each decision for up to ``probe_every`` decisions: in
a replay of bench_long's runtime calls, 30 weighings in a window of 100, each 1.5-2 ms of a 25 ms call, for no probe.
"""

from __future__ import annotations

import math

from .outcomes import FEW_RUNS, OUTCOME_WARMUP, OutcomeTracker

#: the share of decisions that may run a probe (Step 5b), over the run: a probe runs a candidate predicted up to
#: ``probe_max_loss`` (25 %) slower than the best, so at this share probing costs at most 0.25 x 0.05 = 1.25 % of the
#: run's layer time, within the 3 % the engine may lose to the best fixed policy (issue 56; a reasoned bound, to be
#: confirmed by benchmarks/bench_long.py's ``--probe-share``). Beside it each candidate may be probed PROBE_BURST times
PROBE_SHARE = 0.05
#: probes per candidate (the fallback too) allowed beyond the share: FEW_RUNS, the measurements until its outcome is
#: trusted (what they cost is paced by PROBE_COST_SHARE; the share bounds the run after them)
PROBE_BURST = FEW_RUNS
#: the probes' predicted seconds over the policy in force may sum to at most this share of the policy in force's
#: predicted time, at every decision from the wrap's first (``adaptive.probe_cost_share``). Over a fresh wrap's
#: first 20 calls that is 0.4 of a call, within the 5 % the engine may lose there to the best fixed policy (issue
#: 56), with room for its weighing and a wrong first pick. Without it the burst probed every rival FEW_RUNS times at
#: ``probe_every / 8``, ``none`` whatever its prediction: 8 probes in 20 calls, 8-10 % over quota at the default
#: shape (tests/first_calls_replay.py; the runtime measured 8 %)
PROBE_COST_SHARE = 0.02

#: what the probes of one measured rival may cost per decision, as a share of the policy in force's predicted time
#: (``adaptive.probe_regret``): a rival measured FEW_RUNS times is probed again once the decisions since it last ran
#: pay for its probe at this rate: its :meth:`Pace.cost` (its predicted loss over the policy in force plus the two
#: weighings a probe takes) over PROBE_REGRET decisions, at least ``probe_every`` and at most PERIOD_CAP times that.
#: So probing costs the run about PROBE_REGRET per rival in every window, and no rival is left unmeasured for good
#: however far behind its estimate puts it (with a fixed period and ``probe_max_loss`` as a cut-off, a rival
#: measured only while the machine ran slower stayed out of probe range, and the engine held a slower policy for the
#: last 300-400 calls of a long run)
PROBE_REGRET = 0.0025
#: the longest wait between two probes of a measured rival, in ``probe_every`` periods
PERIOD_CAP = 8

#: a candidate that lost clearly this many planned decisions in a row rests — not planned, not predicted — until
#: it is due for re-evaluation: its planning and prediction are then paid once per ``probe_every`` decisions
#: (only candidates whose history can advance without a plan rest: those with an ``advance`` method)
LOSING_STREAK = 8


class Pace:
    """The probe period of a measured rival, paced by what its probe costs (``adaptive.probe_regret``, PROBE_REGRET).

    ``regret``: the share of the policy in force's time one rival's probes may cost per decision (None: not paced);
    ``weigh_s``: what a weighing costs the call (the chooser sets its cost model's ``engine_overhead_s``)."""

    __slots__ = ("regret", "weigh_s")

    def __init__(self, regret: float | None) -> None:
        self.regret = None if regret is None else float(regret)
        self.weigh_s = 0.0

    def cost(self, est_s: float, ref_s: float) -> float | None:
        """A probe of a candidate estimated at ``est_s``, relative to the policy in force's ``ref_s``: its predicted
        loss over it and the two weighings a probe takes (its own decision, and the next: a probe does not settle).
        None without a reference."""
        if not ref_s > 0 or not math.isfinite(est_s):
            return None
        return max(0.0, est_s / ref_s - 1.0) + 2.0 * self.weigh_s / ref_s

    def period(self, probe_every: int, cost: float) -> int:
        """The decisions that pay for a probe of relative ``cost`` at ``regret`` each, within ``probe_every`` and
        PERIOD_CAP times it."""
        return int(min(PERIOD_CAP * probe_every, max(probe_every, math.ceil(cost / self.regret))))


class ProbeSchedule:
    """Due, period, resting and re-evaluation of one chooser's candidates.

    Args:
        probe_every: decisions between probes (and re-plannings) of a candidate; 0 turns probing and resting off.
        probe_max_loss: a due candidate is probed only if predicted at most this (relative) slower than the best.
        switch_now: a planned candidate predicted slower than the chosen one by more than this lost clearly.
        outcomes: the chooser's measured outcomes (how often each candidate was measured).
        probe_share: the share of decisions that may run a probe, over the run, beside ``burst`` probes (the
            chooser passes PROBE_BURST per candidate; None: no bound, every due one within ``probe_max_loss``).
        cost_share: the probes' predicted seconds over the policy in force may sum to at most this share of its
            predicted time so far (:meth:`loss_room`); None: not paced by cost (no warm-up wait, never-run first).
        regret: :class:`Pace`'s (None: every ``probe_every`` decisions, within ``probe_max_loss`` of the best).
    """

    def __init__(self, probe_every: int, probe_max_loss: float, switch_now: float, outcomes: OutcomeTracker,
                 probe_share: float | None = None, burst: int = 0, cost_share: float | None = None,
                 regret: float | None = None, fallback: str | None = None) -> None:
        self.pace = Pace(regret)
        self.fallback = fallback
        self.probe_share = None if probe_share is None else float(probe_share)
        self.burst = int(burst)
        self.cost_share = None if cost_share is None else float(cost_share)
        self.loss_s = 0.0  # the probes' predicted seconds over the policy in force, summed (what cost_share bounds)
        self.base_s = 0.0  # the policy in force's predicted seconds over the decisions recorded
        self._charged: tuple[str, float, float] | None = None  # the last probe: name, in force's time, its charge
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
        self._screened: set[str] = set()  # the candidates the last weighing did not plan (screened or resting)
        #: whether the fallback was predicted within probe_max_loss of the best at its first weighing (None: not yet)
        self._contender: bool | None = None

    # ------------------------------------------------------------------ reading the schedule
    def affordable(self) -> bool:
        """Whether one more probe keeps the probes within ``probe_share`` of the decisions (this one too) + ``burst``."""
        return self.probe_share is None or self.probes + 1 <= self.probe_share * (self.decisions + 1) + self.burst

    def loss_room(self, ref_s: float) -> float:
        """Predicted seconds a probe may cost over the policy in force this decision (``ref_s``: its predicted time
        now): ``cost_share`` of the policy in force's predicted time up to and including this decision, less what
        the probes cost so far (inf without ``cost_share``)."""
        if self.cost_share is None:
            return float("inf")
        return self.cost_share * (self.base_s + max(0.0, ref_s)) - self.loss_s

    def warming(self) -> bool:
        """Whether a probe now would be measured in the outcome warm-up (where paced by cost), discarded and repeated:
        the first OUTCOME_WARMUP decisions, and after them while measurements are arriving but fewer than
        OUTCOME_WARMUP (a simulation, which measures nothing, probes as the runtime does after its first ones)."""
        return self.cost_share is not None and (self.decisions < OUTCOME_WARMUP
                                                or 0 < self.outcomes.observed < OUTCOME_WARMUP)

    def has_run(self, name: str) -> bool:
        return name in self._ran

    def since_run(self, name: str) -> int:
        return self.probe_every if name not in self._ran else self._since.get(name, 0)

    def _few(self, name: str) -> bool:
        """Measured fewer than FEW_RUNS times, or left by a switch and not measured since (only where outcomes are
        measured at all: a simulation measures nothing)."""
        return bool(self.outcomes.observed) and (self.outcomes.runs(name) < FEW_RUNS or name in self._recheck)

    def paced(self, name: str, few: bool = False) -> bool:
        """Whether ``name``'s probes are paced by their cost (:class:`Pace`): it ran, and is not :meth:`_few` (with
        ``few``: whether or not; a rival measured fewer times is probed sooner within ``probe_max_loss``, paced
        beyond it)."""
        return (self.pace.regret is not None and name in self._ran and (few or not self._few(name))
                and not self.uncertain(name))

    def uncertain(self, name: str) -> bool:
        """Whether ``name`` is the fallback, measured FEW_RUNS times, whose history a re-check or a confirmation
        replaced by fewer: probed every ``probe_every`` decisions at any predicted loss, charged at most
        ``probe_max_loss`` (the module's *uncertain fallback*)."""
        o = self.outcomes
        return name == self.fallback and bool(o.observed) and o.support(name) < FEW_RUNS <= o.runs(name)

    def period(self, name: str, cost: float | None = None) -> int:
        """With a probe's relative ``cost`` (:meth:`Pace.cost`), for a candidate that ran, the period that pays for it
        (:meth:`Pace.period`); else ``probe_every``, or ``probe_every / 8`` for a candidate :meth:`_few`."""
        if cost is not None and self.paced(name, few=True):
            return self.pace.period(self.probe_every, cost)
        return max(1, self.probe_every // 8) if self._few(name) else self.probe_every

    def due(self, name: str, cost: float | None = None) -> bool:
        """Whether ``name`` is due for a probe: it has not run for its :meth:`period` (``cost``: its probe's)."""
        return self.probe_every > 0 and self.since_run(name) >= self.period(name, cost)

    def probe_range(self, names, ref_s: float = 0.0, standing: dict | None = None) -> dict[str, float]:
        """Where outcomes are measured, the candidates of ``names`` due for a probe, each with the range it is
        probed within (``probe_max_loss``): the exploration budget weighs them (``ExplorationBudget.in_contention``).
        ``ref_s``, ``standing``: the policy in force's predicted time now and each candidate's at its last weighing;
        one whose probe would cost more than :meth:`loss_room` is not due yet (weighing for it would buy nothing)."""
        if not self.outcomes.observed or self.warming():  # no probe could run now
            return {}
        standing, fb = standing or {}, self.fallback
        if (owed := _owed(self)) in names:  # its re-check, owed whatever the ledger and the share hold
            return {owed: max(self.probe_max_loss, standing.get(owed, ref_s) / ref_s - 1.0 if ref_s > 0 else 0.0)}
        if not self.affordable():
            return {}
        room, out = self.loss_room(ref_s), {}
        for n in names:  # a paced one within any loss, once its period paid for its probe
            if n in self._screened and not self.reevaluate(n):  # (the module's *screened while due*)
                continue
            unsure = self.uncertain(n)  # (read once: it counts the fallback's measurements)
            if min(self.probe_max_loss * ref_s if unsure else float("inf"), standing.get(n, 0.0) - ref_s) > room:
                continue
            cost = self.pace.cost(standing[n], ref_s) if n in standing and self.paced(n, few=True) else None
            if not self.paced(n) and self.due(n):
                far = standing[n] / ref_s - 1.0 if unsure and n in standing and ref_s > 0 else 0.0
                out[n] = max(self.probe_max_loss, far)
            elif cost is not None and self.due(n, cost):
                out[n] = max(self.probe_max_loss, standing[n] / ref_s - 1.0)
        return out

    def reevaluate(self, name: str) -> bool:
        """Whether ``name`` must be planned this decision whatever the screen says: it was not planned for
        ``probe_every`` decisions, or it ran, is due for a probe and was not planned for its probe period (screening
        must not starve a candidate for its measured outcome: it could be screened *because* of that outcome, and one
        slow run kept quota out for good). Planned while due but too slow to be probed, it waits another period:
        re-planning it every decision until then cost as much as never screening it (eplb at 64 tokens per rank)."""
        unplanned = self._unplanned.get(name, 0)
        return self.probe_every > 0 and (unplanned >= self.probe_every or (
            name in self._ran and self.due(name) and unplanned >= self.period(name)))

    def rests(self, name: str, fallback_in_force: bool) -> bool:
        """The streak rule for a candidate not due for re-evaluation: it lost clearly LOSING_STREAK decisions in a
        row, or the fallback (``none``) is in force and has won clearly for ``probe_every`` decisions."""
        return self.probe_every > 0 and (self._lost.get(name, 0) >= LOSING_STREAK or (
            fallback_in_force and self._none_streak >= self.probe_every))

    def probe(self, feasible: dict[str, float], chosen: str, best: str, fallback: str | None = None,
              switching: bool = False) -> str | None:
        """The candidate to probe this decision, if any: due, not the chosen one, and, unless :meth:`paced`, predicted
        within ``probe_max_loss`` of the best (``feasible``: corrected predictions). Never-run candidates come first:
        until a candidate has run, its prediction borrows the others' measured/predicted ratio, which says
        nothing about its own overheads; then the one that ran longest ago.

        The ``fallback`` (``none``), where outcomes are measured, is probed until it has run whatever its
        prediction: every other candidate's gain is relative to it, and its worst case is the layer the user
        runs without balancing. At 64 tokens per rank the uncalibrated model put ``none`` 27 % above
        FEPLB (measured, the two are within a few percent), past ``probe_max_loss``: ``none`` went unmeasured
        and the engine ran feplb, or quota at 0.8x of none, for 20 calls or the whole run.
        None while a probe would exceed the budget (:meth:`affordable`): the due candidates wait.
        Paced by cost (``cost_share``): no probe in the outcome warm-up (:meth:`warming`); a probe whose predicted
        time over ``chosen``'s exceeds :meth:`loss_room` waits; of the others the unmeasured fallback runs first (the
        reference of every gain: at 64 tokens per rank, 16 experts, the model's pick quota measured 13 % over ``none``
        and an eplb probe predicted cheaper delayed ``none``'s), then the cheapest (then the never-run, the oldest).
        The unmeasured fallback's probe counts at most ``probe_max_loss`` of ``chosen``'s time: the model can be off
        on ``none`` by any factor (17x in ``test_the_fallback_is_measured_even_when_the_model_puts_it_far_behind``), and
        charged its prediction it would wait for good; so it waits at most ``probe_max_loss / cost_share`` decisions
        (12.5 at the defaults) after the warm-up. What it measured is charged when it is measured (:meth:`settle`).
        A fallback the first weighing put within ``probe_max_loss`` of the best is probed at the first decision after
        the warm-up, whatever the ledger holds (the module's *first probe of the fallback*). A switch this decision
        takes on fresh evidence (``switching``) is not displaced by a probe (the module's *switches*)."""
        if self._contender is None and fallback in feasible:
            self._contender = contends(self, feasible, best, fallback)
        if self.warming() or (switching and self.cost_share is not None):
            return None
        if (owed := _owed(self)) in feasible and owed != chosen:
            return owed
        if not self.affordable():
            return None
        unmeasured_fallback = fallback if (self.outcomes.observed and fallback is not None
                                           and self.outcomes.runs(fallback) == 0) else None
        if (self.cost_share is not None and self._contender and unmeasured_fallback is not None
                and unmeasured_fallback != chosen and self.due(unmeasured_fallback)):
            return unmeasured_fallback
        room, ref = self.loss_room(feasible[chosen]), feasible[chosen]

        def cost(n: str) -> float:  # the fallback's, unmeasured or uncertain, at most probe_max_loss: its error is open
            loss = max(0.0, feasible[n] - ref)
            return min(loss, self.probe_max_loss * ref) if n == unmeasured_fallback or self.uncertain(n) else loss

        def is_due(n: str) -> bool:  # paced: due once its period paid for its probe, at any predicted loss
            if not self.paced(n) and self.due(n) and (feasible[n] <= (1 + self.probe_max_loss) * feasible[best]
                                                       or n == unmeasured_fallback or self.uncertain(n)):
                return True
            return self.paced(n, few=True) and self.due(n, self.pace.cost(feasible[n], ref))

        due = [n for n in sorted(feasible) if n != chosen and cost(n) <= room and is_due(n)]
        if not due:
            return None
        if self.cost_share is not None:
            return min(due, key=lambda n: (n != unmeasured_fallback, cost(n), n in self._ran, -self.since_run(n), n))
        return max(due, key=lambda n: (n not in self._ran, self.since_run(n), n))

    # ------------------------------------------------------------------ advancing it
    def settle(self, name: str, measured_s: float) -> None:
        """The last probe, of ``name``, measured ``measured_s``: its charge becomes what it measured over the policy in
        force's predicted time (the prediction that paced it can be far off for a candidate that never ran: at 64
        tokens per rank eplb's first probe measured 35 % over the policy in force, predicted at a few %)."""
        if self._charged is None or self._charged[0] != name:
            return
        _, ref_s, charged = self._charged
        self.loss_s += max(0.0, float(measured_s) - ref_s) - charged
        self._charged = None

    def forget(self, name: str) -> None:
        """``name``'s run says nothing (measured in the warm-up): it counts as not run yet."""
        self._ran.discard(name)

    def record(self, names, chosen: str, predictions: dict[str, float], same: set[str], fallback_clear: bool,
               weighed: bool = True, left: str | None = None, probed: bool = False, ref_s: float = 0.0,
               loss_s: float = 0.0) -> None:
        """One committed decision: ``chosen`` ran; the candidates in ``predictions`` were planned (the others in
        ``names`` were not); a planned candidate lost clearly if predicted slower than the chosen one by more
        than ``switch_now``, or did what the fallback does (``same``); ``fallback_clear``: the fallback won clearly.
        A decision that weighed nothing (``weighed=False``: the exploration budget's idle one) leaves the streaks.
        ``left``: the policy in force before this decision, unless this decision was a probe (a switch from
        ``left`` to ``chosen`` marks ``left`` for a re-check, at most once per ``probe_every`` decisions, counted by
        ``outcomes.decisions``, which the chooser advances before it records). ``probed``: this decision ran a probe of
        Step 5b (counted against ``probe_share``). ``ref_s``: the policy in force's predicted time on this decision;
        ``loss_s``: a probe's predicted seconds over it (both for ``cost_share``)."""
        self.decisions += 1
        self.probes += bool(probed)
        self.base_s += max(0.0, float(ref_s))
        if probed:
            self.loss_s += max(0.0, float(loss_s))
            self._charged = (chosen, float(ref_s), max(0.0, float(loss_s)))
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
        self._screened = {n for n in names if n not in predictions}
        for n, v in predictions.items():
            lost = n != chosen and (v > predictions[chosen] * (1 + self.switch_now) or n in same)
            self._lost[n] = self._lost.get(n, 0) + 1 if lost else 0
        self._none_streak = self._none_streak + 1 if fallback_clear else 0


def first_weighing(schedule: ProbeSchedule, feasible: dict[str, float], best: str, fallback: str | None) -> None:
    """At a fresh wrap's first decision, before any call is measured: a fallback the seed model puts within
    ``probe_max_loss`` of ``best`` contends (the module's *first probe of the fallback*); one it puts further behind
    is judged at the first weighing after it, calibrated, as before. Why: that weighing's calibration stands on the
    process's first call alone, the slowest of the run, and on the runtime at 64 tokens per rank, 16 experts, where
    ``none`` is the fastest policy and the seed model puts it 1.10x FEPLB, it put ``none`` past ``probe_max_loss`` in
    9 of 20 runs: quota was probed first, and ``none`` first ran at calls 4-20 (docs/design.md, *the first calls*)."""
    if fallback in feasible and contends(schedule, feasible, best, fallback):
        schedule._contender = True


def contends(schedule: ProbeSchedule, feasible: dict[str, float], best: str, fallback: str) -> bool:
    """Whether ``fallback`` is predicted (``feasible``) within ``probe_max_loss`` of ``best``."""
    return bool(feasible[fallback] <= (1 + schedule.probe_max_loss) * feasible[best])


def _owed(schedule: ProbeSchedule) -> str | None:
    """The candidate whose re-check after a switch is owed now, if any: left by a switch, not measured since, due, and
    the fallback or measured fewer than FEW_RUNS times. It runs whatever the probe ledger and the share hold (the
    module's *re-check after a switch*). A switch away from a candidate measured that few times may rest on one slow
    call: at the default shape a fresh wrap's third call of quota measured 1.70 s where quota's own run measured 1.19
    on the same call, the engine switched to FEPLB and EPLB, and quota, 28 % behind them on that one call, was out of
    probe range and paced past the run's 64 calls (adaptive came to 1.072x quota's time)."""
    fb, o = schedule.fallback, schedule.outcomes
    for n in sorted(schedule._recheck, key=lambda n: n != fb):  # (the fallback first)
        if (n == fb or o.runs(n) < FEW_RUNS) and schedule.due(n):
            return n
    return None


def probe_reason(schedule: ProbeSchedule, name: str, current: str | None) -> str:
    """The decision's reason when ``name`` is probed while ``current`` stays in force."""
    if name in schedule._recheck:
        return f"probe: {name} re-checked after the switch to {current} (its runs before it are replaced)"
    why = "has not run yet" if not schedule.has_run(name) else f"last ran {schedule.since_run(name)} decisions ago"
    return f"probe: {name} {why} (kept {current})"


def confirm(schedule: ProbeSchedule, target: str, current: str | None, feasible: dict) -> tuple[str, bool, str] | None:
    """Why a switch from ``current`` to ``target`` must first measure again, whether that measurement of ``target``
    replaces its history, and which policy runs this decision (None: switch now), by ``schedule`` (Step 5a);
    ``feasible``: the corrected estimates.

    Where outcomes are measured, a switch is taken only on a *fresh* measurement of ``target``: from the previous
    decision, or from the one before it with the policy in force measured in between (the clock's A-B-A pairing). A
    stale one compares a measurement taken on another machine state with a fresh median: at 64 tokens per rank,
    after 24 calls of ``none`` that drifted from 87 to 99 ms, one FEPLB call measured at the fourth decision switched
    the engine to FEPLB "4 % faster"; a rival measured only in the warm-up, or never, was switched to on the model's
    word. ``target`` then runs, and that measurement replaces the stale history. Confirming costs one call, the one
    the switch would have run anyway.

    A fresh one is added to (:func:`_within_noise`) while the gain is within the noise of the medians it compares, and
    the two sides are measured in turn (:func:`_in_turn`)."""
    if current is None or target == current or not schedule.outcomes.observed or schedule.probe_every <= 0:
        return None
    if not schedule.has_run(target) or schedule.outcomes.runs(target) == 0:
        return f"{target} not measured yet, measured before the switch (kept {current})", True, target
    since = schedule.since_run(target)
    if since > 1 or (since == 1 and schedule.since_run(current) > 0):
        return f"{target} last measured {since + 1} decisions ago, measured again before the " \
               f"switch (kept {current})", True, target
    ref = feasible.get(current, 0.0)
    why = _within_noise(schedule, target, current, (ref - feasible[target]) / ref if ref > 0 else 0.0)
    return None if why is None else _in_turn(schedule, target, current, why)


def _in_turn(schedule: ProbeSchedule, target: str, current: str, why: str) -> tuple[str, bool, str]:
    """A switch within the noise measures its two sides in turn: ``target`` measured at the previous decision, the
    policy in force runs now (its measurement pairs with it); else ``target`` runs again, added to its history.

    Why: a run of confirmations measured only ``target``, against the median of the policy in force's calls taken
    before them. On the runtime at 64 tokens per rank the machine ran 25 % slower for the four calls before FEPLB's
    confirmations and then sped up again: ``none``'s median kept the slow calls, no call of ``none`` showed the clock
    that the machine was fast again, five FEPLB calls measured 15 % slower than ``none``'s beside them read as 2-12 %
    faster, and the engine switched to FEPLB."""
    if schedule.since_run(target) == 0:
        return f"{why}; {current} measured beside it first", False, current
    return why, False, target


def _within_noise(schedule: ProbeSchedule, target: str, current: str, gain: float) -> str | None:
    """Why a switch from ``current`` to ``target``, freshly measured, must measure ``target`` once more (None: it need
    not): ``target`` is not the fallback (a switch back to it is taken at once: its worst case is the layer without
    balancing), its ``gain`` (relative, corrected estimates) is within the noise of the two medians
    (:meth:`.OutcomeTracker.resolution`), and ``target``'s median is of fewer than ``outcome_window`` measurements.

    On the runtime at 64 tokens per rank a single EPLB probe, 25 % slower than ``none`` on the same calls, measured
    "3 % faster" and switched the engine to it: a call's noise there is 5-10 % (12 % at bench_long's shape). The switch
    paid that loss until EPLB's own median moved, then a confirmation of ``none`` and the switch back."""
    o = schedule.outcomes
    if target == schedule.fallback:
        return None
    n, need = o.support(target), o.resolution(target, current)
    if need is None or n >= o.window or gain >= need:
        return None
    return f"{target} {gain:.1%} faster on {n} measurement(s), within their noise ({need:.1%}), measured again " \
           f"before the switch (kept {current})"
