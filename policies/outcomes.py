"""The adaptive engine's measured outcomes: what each candidate's layer time measured against what was predicted.

One :class:`OutcomeTracker` per adaptive layer. It keeps, per candidate, the median log-ratio of measured to
predicted layer time over its last runs, on two bases: against the calibrated model of the time, and against
the *anchor* (the model as handed over, before any calibration), which does not move when calibration learned
from other candidates' runs drifts. Each anchor measurement is paired with the policy in force when it was
taken (the *clock*), so one taken while the whole machine ran slower is credited with the difference, and with
the *regime* of its load (:func:`regime_of`, the token-expert assignments per rank to a power of two): the anchor's error is not flat
in the load (on a small layer fixed per-call costs the model leaves out weigh more), so a candidate is estimated from
what it measured at the regime of the load now, where it has measured there.

It knows nothing of policies beyond their names: the chooser tells it which candidate ran, which was in force,
and what the anchor model predicted (:class:`~ultraep.policies.adaptive.AdaptivePolicy` composes it).
"""

from __future__ import annotations

import bisect
import math
import statistics

import numpy as np

#: a candidate measured fewer times than this has an uncertain outcome (one early call can be a warm-up outlier):
#: it is re-probed every probe_every / 8 decisions until it has this many measurements
FEW_RUNS = 3
#: the first measured calls of a layer are slower whatever runs (first allocations, caches): they do not feed
#: the outcome corrections, and a candidate probed then counts as not run yet (it is probed again)
OUTCOME_WARMUP = 2
#: the machine's level now is the median of the policy in force's last CLOCK_RUNS measurements
CLOCK_RUNS = 3
#: the load regimes a candidate's anchor outcomes are kept for (the most recently measured ones), each its last
#: ``window`` measurements: bounded state, and room for a run that goes back and forth between a few batch sizes
REGIMES = 4
#: a switch whose measured gain is within NOISE_Z standard errors of the two medians' difference is measured again
#: first (:func:`.probes.confirm`); one-sided 95 %
NOISE_Z = 1.645
#: the standard error of a median of n measurements is about MEDIAN_SE x sigma / sqrt(n): sqrt(pi / 2) for large n,
#: 1 for one or two measurements (their mean), so small n is taken a little wider than it is
MEDIAN_SE = 1.2533
#: a measurement whose own clock stopped (the policy in force then has not run since) is read on the clock of the policy
#: in force now, where that one was measured within CLOCK_REACH decisions of it (:meth:`OutcomeTracker.credit`)
CLOCK_REACH = 2
#: a policy's per-call noise is read from its last SPREAD_RUNS or more measurements on the clock
SPREAD_RUNS = 6
#: the standard deviation of a normal variable over its median absolute deviation
MAD_SIGMA = 1.4826


def regime_of(load_RE: np.ndarray) -> int:
    """The load regime of ``load_RE`` ``[R, E]``: log2 of the token-expert assignments routed per rank (tokens x
    top-k), rounded (sizes within a factor of sqrt(2) share one). At 256 tokens per rank, 16 experts, two ranks
    (``benchmarks/bench_long.py``'s layer) the plain layer measured 0.5-0.7x the anchor's prediction and at 64 tokens
    0.8-1.4x: a ratio measured at one size carried to the other mis-estimated ``none`` by 2x, out of reach of every
    probe, for the rest of the run."""
    per_rank = float(np.asarray(load_RE).sum()) / max(1, np.shape(load_RE)[0])
    return int(round(math.log2(per_rank))) if per_rank >= 1.0 else 0


class OutcomeTracker:
    """Measured outcomes, clocks and credits of one chooser's candidates.

    Args:
        anchor: the cost model as handed over (measured outcomes are kept relative to it).
        window: measured outcomes per candidate whose median corrects its predictions.
        switch_now: the chooser's relative gain that switches at once; a machine faster by less than this is
            not credited (below it, the difference of two medians is noise).
        probe_every: the chooser's probe period; the clock keeps ``2 * probe_every`` measurements per policy.
    """

    def __init__(self, anchor, window: int, switch_now: float, probe_every: int) -> None:
        self.anchor = anchor
        self.window = max(1, int(window))
        self.switch_now = float(switch_now)
        self.probe_every = int(probe_every)
        self.anchor_s: dict[str, float] = {}  # this decision's anchor-model predictions of the candidates
        self.anchor_plans: dict | None = None  # the candidate plans anchor_s belongs to
        self.observing: tuple | None = None  # the committed choice, its anchor prediction and its load's regime
        self.regime: int | None = None  # the regime of the load being decided (:meth:`at`)
        self.in_force: str | None = None  # the policy in force at the last measurement (the clock of stopped ones)
        #: a confirmation probe's candidate (the chooser's Step 5a): its fresh measurement replaces its history, so
        #: the switch is decided on it and not on the median of measurements taken on another machine state
        self.restart: str | None = None
        self.observed = 0  # measured outcomes offered so far (the first OUTCOME_WARMUP are skipped)
        self.decisions = 0  # decisions committed so far (the clock's time axis)
        #: per candidate: median of log(measured / predicted layer time) over its last runs, and how often it ran,
        #: against the calibrated model of the time (``_outcome``) and against the anchor model (``_outcome_anchor``:
        #: its runs at the regime now where it has some, else its last ``window`` runs at any)
        self._outcome: dict[str, tuple[float, int]] = {}
        self._outcome_anchor: dict[str, tuple[float, int]] = {}
        #: (table, candidate) -> its last measurements; the anchor table's are (decision, log-ratio, policy in force,
        #: regime), the last ``window`` of each of its REGIMES regimes
        self._outcome_hist: dict[tuple[str, str], list] = {}
        #: per candidate, (decision, log-ratio against the anchor) of its last 2 probe_every measurements: the clock
        #: that tells how much faster the machine runs now than when a measurement was taken (:meth:`credit`)
        self._clock: dict[str, tuple[list[int], list[float]]] = {}
        self._regime_of: tuple | None = None  # (the load decided, its regime): :meth:`regime_at`

    # ------------------------------------------------------------------ folding measurements in
    def observe(self, name: str, predicted_s: float, measured_s: float, current: str | None) -> bool:
        """Fold one measured layer time of candidate ``name`` in (``current``: the policy in force). Returns False
        when the measurement fell in the warm-up and ``name`` was a probe: it says nothing, probe it again.

        A median, not a running mean: one call slowed 2x by something else on the machine (a scheduler hiccup,
        a neighbour's burst) must not make a candidate look 2x worse until its next probe — with a mean it was
        screened out and never re-measured. A real change (a slower link) moves the median after half a window."""
        self.observed += 1
        self.in_force = current
        when = self.decisions - 1  # the decision being observed (committed just before its call ran)
        x = None
        if self.observing is not None and self.observing[0] == name and self.observing[1] > 0:
            x = float(np.log(measured_s / self.observing[1]))
            if name == current or self.observed > OUTCOME_WARMUP:  # the clock reads the warm-up too
                self._tick(name, when, x)
        if self.observed <= OUTCOME_WARMUP:
            return name == current
        if self.restart == name:
            self._outcome_hist.pop(("calibrated", name), None)
            self._outcome_hist.pop(("anchor", name), None)
        if predicted_s > 0:
            hist = self._outcome_hist.setdefault(("calibrated", name), [])
            hist.append(float(np.log(measured_s / predicted_s)))
            del hist[:-self.window]
            # (statistics.median: on five numbers, numpy's call overhead is most of the cost, once per layer call)
            self._outcome[name] = (float(statistics.median(hist)), self._outcome.get(name, (0.0, 0))[1] + 1)
        if x is not None:
            self._fold_anchor(name, when, x, current, self.observing[2])
        return True

    def regime_at(self, load_RE: np.ndarray) -> int:
        """:func:`regime_of` of ``load_RE``, kept for the same array: a decision reads it when it plans, decides and
        commits."""
        got = self._regime_of
        if got is None or got[0] is not load_RE:
            got = self._regime_of = (load_RE, regime_of(load_RE))
        return got[1]

    def at(self, regime: int | None) -> None:
        """The load being decided is of ``regime`` (:func:`regime_of`): where it moved, every candidate's anchor
        outcome is read again from its measurements at that regime (else from its last ones at any)."""
        if regime == self.regime:
            return
        self.regime = regime
        for (kind, n), h in self._outcome_hist.items():
            if kind == "anchor" and h:
                self._outcome_anchor[n] = (self._anchor_median(h), self._outcome_anchor[n][1])

    def _tick(self, name: str, when: int, x: float) -> None:
        ts, xs = self._clock.setdefault(name, ([], []))
        ts.append(when)
        xs.append(x)
        keep = 2 * max(1, self.probe_every)
        del ts[:-keep], xs[:-keep]

    def _fold_anchor(self, name: str, when: int, x: float, current: str | None, regime: int | None) -> None:
        """Add ``name``'s anchor log-ratio ``x`` of decision ``when`` at load ``regime``, paired with the policy in
        force, and re-credit the histories read on ``name``'s clock (only its clock moved)."""
        hist = self._outcome_hist.setdefault(("anchor", name), [])
        hist.append((when, x, current or name, regime))
        _keep_recent(hist, self.window)
        self._outcome_anchor[name] = (0.0, self._outcome_anchor.get(name, (0.0, 0))[1] + 1)
        now = self.level(name)
        for (kind, n), h in self._outcome_hist.items():  # (the clock in force reads the stopped ones)
            if kind == "anchor" and (n == name or name == current or any(e[2] == name for e in h)):
                self._outcome_anchor[n] = (self._anchor_median(h, name, now), self._outcome_anchor[n][1])

    def _anchor_median(self, h: list, name: str | None = None, now: float | None = None) -> float:
        """The credited median of anchor history ``h``: its entries at the regime now, else its last ``window``
        (``now``: ``name``'s clock level now, when the caller has it), of those taken within ``window x probe_every``
        decisions of the newest. That is the span a rival probed every ``probe_every`` decisions fills; one probed
        less often (its probes paced by their cost, :meth:`.ProbeSchedule.period`) is estimated from its measurements
        of that span only, so a fresh probe is not outvoted by four taken hundreds of decisions before, on another
        machine state (a rival that had turned 30 % faster went unchosen for 3 probes, 120 decisions)."""
        return statistics.median([v - self.credit(ref, t, now if ref == name else None) for t, v, ref, _ in self._span(h)])

    def _span(self, h: list) -> list:
        """The entries of anchor history ``h`` its estimate reads (:meth:`_anchor_median`)."""
        use = [e for e in h if e[3] == self.regime] or h[-self.window:]
        if self.probe_every > 0:  # only those within window x probe_every decisions of its newest
            newest = use[-1][0] - self.window * self.probe_every
            use = [e for e in use if e[0] >= newest]
        return use

    def support(self, name: str) -> int:
        """How many measurements ``name``'s anchor estimate is the median of now (0: it has none)."""
        h = self._outcome_hist.get(("anchor", name))
        return len(self._span(h)) if h else 0

    def spread(self, name: str) -> float | None:
        """The noise of one measured call of ``name``: the standard deviation of its log-ratio, robustly from the
        differences of its successive measurements on the clock (a level shift, a new load or a slower machine, moves
        one difference, not the median of them), or None with fewer than SPREAD_RUNS of them."""
        xs = self._clock.get(name, ((), ()))[1]
        if len(xs) < SPREAD_RUNS:  # (read on a switch only: not kept)
            return None
        return statistics.median(abs(b - a) for a, b in zip(xs, xs[1:])) * MAD_SIGMA / math.sqrt(2.0)

    def resolution(self, name: str, current: str) -> float | None:
        """The relative gain of ``name`` over ``current`` their measured estimates tell apart from noise: ``NOISE_Z``
        standard errors of the difference of the two medians (each ``MEDIAN_SE`` x spread / sqrt(its support)), the
        spread read on ``current``'s calls. None when either has no measurement or ``current`` too few calls."""
        sigma, n, m = self.spread(current), self.support(name), self.support(current)
        if sigma is None or n == 0 or m == 0:
            return None
        return math.expm1(NOISE_Z * MEDIAN_SE * sigma * math.sqrt(1.0 / n + 1.0 / m))

    # ------------------------------------------------------------------ the clock
    def level(self, ref: str, when: int | None = None) -> float | None:
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

    def credit(self, ref: str, when: int, now: float | None = None) -> float:
        """How much faster (log) the machine runs now than at decision ``when``, read on ``ref``, the policy that was
        in force then (measured around it, and measured last), or where ``ref``'s clock stopped, on the clock in force
        (:meth:`_clock_of`): a measurement taken then is credited with it.

        The interleaved benchmark showed why: every call is 10-30 % slower in a process's first iterations
        (allocator, caches), and one early measurement of quota (764 ms where it settles at 570) kept FEPLB in
        force, 4-7 % slower, for the rest of the run. Only a *faster* machine is credited, beyond ``switch_now``:
        a policy in force that itself slows down (its own cost, not the machine's) must not make its rivals look
        slower and keep it in force. ``now``: ``ref``'s level now, when the caller has it."""
        ref, now = self._clock_of(ref, when, now)
        then, now = self.level(ref, when), self.level(ref) if now is None else now
        if then is None or now is None:
            return 0.0
        return max(0.0, then - now - math.log1p(self.switch_now))

    def _clock_of(self, ref: str, when: int, now: float | None) -> tuple[str, float | None]:
        """The clock that reads a measurement of decision ``when`` taken with ``ref`` in force (and ``ref``'s level now,
        when the caller has it): ``ref``'s, unless ``ref`` has not been measured since the call after it while the
        policy in force now was measured within CLOCK_REACH decisions of it. A stopped clock tells nothing: on a
        fresh wrap whose first 8 calls ran 1.1-1.8x slower, quota's warm-up calls kept it 1.5x behind eplb, the policy
        a switch left in force, out of probe range for good (eplb ran at 1.09-1.13x quota's time), while eplb's own
        clock, measured beside them, had run 1.5x faster since."""
        ts = self._clock.get(ref, ((),))[0]
        cur = self.in_force
        if cur is None or cur == ref or (ts and ts[-1] > when + 1) or cur not in self._clock:
            return ref, now
        near = self._clock[cur][0]
        i = bisect.bisect_left(near, when - CLOCK_REACH)
        return (cur, None) if i < len(near) and near[i] <= when + CLOCK_REACH else (ref, now)

    # ------------------------------------------------------------------ reading outcomes
    def runs(self, name: str) -> int:
        """How often ``name`` was measured against the anchor."""
        return self._outcome_anchor.get(name, (0.0, 0))[1]

    def correction(self, name: str) -> float:
        """Multiplier of ``name``'s calibrated prediction: its own measured/predicted ratio when it has run, else
        the mean of the others' (the model's error is largely shared), else 1."""
        if name in self._outcome:
            return float(np.exp(self._outcome[name][0]))
        if self._outcome:
            return float(np.exp(np.mean([v for v, _ in self._outcome.values()])))
        return 1.0

    def scale(self, name: str) -> float:
        """What multiplies ``name``'s model prediction in its estimate now: its measured/anchor ratio (credited) where
        it was measured against the anchor, else its :meth:`correction`. A settled verdict (:mod:`.settled`) reads
        how it moved since the weighing, without predicting the candidate again."""
        if name in self._outcome_anchor:
            return float(np.exp(self._outcome_anchor[name][0]))
        return self.correction(name)

    def anchored(self, name: str, current: str | None) -> bool:
        """Whether ``name`` is estimated on the anchor basis. Every candidate that has run is — except the policy
        in force while it has fewer than FEW_RUNS measurements or no rival has run. Comparing the policy in force
        on the calibrated basis with rivals on the anchor basis made the engine flap: calibration follows each
        call, so one call slowed by something else (2x at 64 tokens per rank) raised only the current's estimate
        and switched it away at once, the next call switched back (T=64: none <-> feplb every call)."""
        if name not in self._outcome_anchor:
            return False
        if name != current:
            return True
        return self._outcome_anchor[name][1] >= FEW_RUNS and any(n != name for n in self._outcome_anchor)

    def reads_calibrated(self, name: str, current: str | None) -> bool:
        """Whether :meth:`estimate` of ``name`` reads its calibrated prediction now (else the anchor's alone)."""
        return (name == current and name in self._outcome and not self.anchored(name, current)) or not (
            name in self._outcome_anchor and name in self.anchor_s)

    def estimate(self, name: str, calibrated_s: float, current: str | None) -> float:
        """A candidate's predicted layer time (``calibrated_s``: the calibrated model's prediction of its plan):

        * a candidate that has run: the anchor model's prediction times its measured/anchor ratio — its
          measured layer time carried to this load by a model that does not move. Calibration learned from the
          other candidates' runs can drift its calibrated prediction far from what it measured (on tiny
          layers fixed per-call costs are mistaken for compute: ``none`` looked 1.9x slower than it ran);
        * the policy in force, the same once it has FEW_RUNS measurements and a rival has run too (both then
          compare on one basis; see :meth:`anchored`); before that ``calibrated_s`` times its measured/predicted
          ratio, so a change the calibrator sees (a slower link) reaches it at once;
        * a candidate that never ran: ``calibrated_s`` times the others' mean ratio, until its probe.
        """
        if name == current and name in self._outcome and not self.anchored(name, current):
            return calibrated_s * self.correction(name)
        if name in self._outcome_anchor and name in self.anchor_s:
            return self.anchor_s[name] * float(np.exp(self._outcome_anchor[name][0]))
        return calibrated_s * self.correction(name)


def _keep_recent(hist: list, window: int) -> None:
    """Trim anchor history ``hist`` (oldest first) in place to the last ``window`` entries of each of its REGIMES most
    recently measured regimes."""
    seen: dict = {}
    keep = []
    for e in reversed(hist):
        r = e[3]
        if r not in seen and len(seen) >= REGIMES:
            continue
        if seen.get(r, 0) < window:
            seen[r] = seen.get(r, 0) + 1
            keep.append(e)
    hist[:] = keep[::-1]
