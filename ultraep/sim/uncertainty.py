"""How sure a from-run prediction is: the calibration's uncertainty propagated to every predicted time and speed-up.

``ultraep simulate RUN --topology from-run`` predicts on the cost model the run's engine learned, anchored on the run's
own measured calls (:func:`~ultraep.sim.from_run.anchor`): per kind of call (moving expert weights or not) the median
of measured minus predicted, shrunk by its noise, moves that kind's call overhead. Those medians come from a sample of
calls, and a sample of 30 noisy steps leaves them uncertain; what a run then measures scatters about the model by its
own calls' noise. The interval is one on what a run of the replayed calls measures, a bootstrap over that sample:

    for b in 1..B:  draw the run's compared steps with replacement (every call of a drawn step, a step drawn twice
                    counted twice: the calls of one step share the machine's moment), re-derive each kind's shift
                    from the drawn calls' differences (the same median and shrinkage; a kind too few calls to shift
                    at the point: its drawn median, unshrunk, :func:`_few`), hence the anchored overheads; anchor each
                    policy of at least ANCHOR_MIN_CALLS calls on its own drawn calls (their median, unshrunk: the
                    model can miss one policy's calls by more than their kind's); re-predict every replayed call with
                    them (:func:`resampled_times`), and add to each a draw from the calibration's calls of the policy
                    that ran it, about their median (:func:`run_noise`: a new run's call-to-call noise)
    interval = the 5th and 95th percentiles over the B re-predictions (a 90 % percentile interval), stretched to
               hold the point figure where the draws all lie on one side of it (:func:`bounds`)

Why the two last terms (``bench_validate``, 10 shape-runs at 512 tokens per rank, the same recordings): the interval
of the kinds' shifts alone held the measured speed-up in 3 of 10 shape-runs; with each policy's own anchoring 7, with
the run's noise 6, with both 9 (docs/design.md).

Re-predicting is exact, not re-simulated: a call's overhead enters its predicted layer time as one additive term
(``CostBreakdown.call_overhead_s``, the plain or the moving kind's), so a call re-predicted under other overheads is
its replayed time minus its own overhead plus the resample's overhead of its kind (or of its policy). The plans of a
fixed policy do not depend on the cost model, so the replay of every fixed policy is the same under every resample; a
chooser's (``adaptive``) choices are held at the point model's (a resample could flip a choice between candidates whose
predictions differ by less than the shift moved), each call anchored and scattered as the candidate that ran it.

The width scales as ``1 / sqrt(n)`` in the number of compared steps (a median's standard error does, and the replayed
run is the calibration run's length), so an interval of half-width ``h`` from ``n`` steps narrows to ``±5 %`` with
``n * (h / 5 %)^2`` steps (:func:`steps_for`). The engine's fit itself (its per-term scales) is the run's recorded
state and not re-derived; what it misses on the run's own calls is what anchoring measures, per kind and per policy,
and what the interval carries.

Legend: B resamples, C compared calls, N replayed calls of a policy.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from ultraep.config import DEFAULT_RESAMPLES, MIN_RESAMPLES  # noqa: F401 - re-exported
from ultraep.cost import moves_weights
from ultraep.errors import ConfigError
from ultraep.sim.from_run import ANCHOR_MIN_CALLS, AnchorCalls, AnchorShift, _shift, anchored_overheads

#: DEFAULT_RESAMPLES (in ``ultraep.config``, so that building the CLI imports no simulator): resamples of the
#: calibration's steps behind an interval. From one seed to another the bounds of 400 draws move by 3-7 % of the
#: interval's width (standard deviation over 20 seeds, 30 steps of calls 4 ms noisy), against 8-11 % with 100 draws
#: and 2-4 % with 1000. MIN_RESAMPLES: fewer cannot place a 5th percentile: 0 (no interval) or at least this many
#: the interval's coverage
LEVEL = 0.90
#: a relative half-width above this is flagged, with the calibration steps that would narrow it to this
TARGET = 0.05


def check_resamples(resamples: int, seed: int, flag: str = "--resamples") -> None:
    """Refuse a number of resamples that cannot give a 90 % interval, and a negative seed (one line each)."""
    if resamples != 0 and resamples < MIN_RESAMPLES:
        raise ConfigError(flag, f"must be 0 (no interval) or >= {MIN_RESAMPLES}, got {resamples}", resamples)
    if seed < 0:
        raise ConfigError("--interval-seed", f"must be >= 0, got {seed}", seed)


@dataclass(frozen=True)
class Overheads:
    """Per resample the anchored overheads a call pays: ``plain_s`` [B] (a call moving no expert weights) and
    ``moving_s`` [B] (one that moves them), and the ``steps`` the calls were drawn from. Where the calls say which
    policy ran them: ``own_s`` ``{policy: [B]}``, each policy of at least ``ANCHOR_MIN_CALLS`` calls anchored on its
    own drawn calls (their median difference, unshrunk; NaN where a draw held none of them), added to ``base_s``,
    the recorded model's ``(plain, moving)`` overheads; and the calls' spread about their median, per policy
    (``policy_spread``) and per kind (``kind_spread``), what a new run's calls scatter by (:func:`run_noise`)."""

    plain_s: np.ndarray
    moving_s: np.ndarray
    steps: int
    base_s: tuple[float, float] = (0.0, 0.0)
    own_s: dict[str, np.ndarray] = field(default_factory=dict)
    policy_spread: dict[str, np.ndarray] = field(default_factory=dict)
    kind_spread: dict[bool, np.ndarray] = field(default_factory=dict)
    seed: int = 0


def resampled_overheads(calls: AnchorCalls, params, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                        ) -> Overheads | None:
    """The anchored overheads of ``resamples`` bootstrap draws of ``calls``' steps, re-derived from the recorded
    model's ``params`` as anchoring derives them, and per policy from its own drawn calls (deterministic in
    ``seed``). None: fewer than 2 steps compared, or no resample asked for."""
    steps = np.unique(calls.step)
    if resamples <= 0 or steps.size < 2:
        return None
    rng = np.random.default_rng(seed)
    # the calls of every step, once: a draw of steps is the concatenation of their call indices
    of_step = [np.flatnonzero(calls.step == s) for s in steps]
    plain = np.empty(resamples)
    moving = np.empty(resamples)
    point = {k: v.size for k, v in calls.kinds().items()}
    ran = calls.policy if calls.policy is not None else np.full(calls.step.size, None, dtype=object)
    names = sorted(q for q in set(ran) if q is not None and int(np.sum(ran == q)) >= ANCHOR_MIN_CALLS)
    own = {q: np.full(resamples, np.nan) for q in names}
    for b in range(resamples):
        take = np.concatenate([of_step[i] for i in rng.integers(0, steps.size, steps.size)])
        drawn = calls.kinds(take)
        # (a kind the draw missed: no calls, no shift; not the other kind's, as a run without it would get)
        shifts = {k: _shift(drawn.get(k, np.zeros(0))) if n >= ANCHOR_MIN_CALLS else _few(drawn.get(k, np.zeros(0)))
                  for k, n in point.items()}
        p, extra = anchored_overheads(params, shifts)
        plain[b], moving[b] = p, max(0.0, p + extra)  # what a call of each kind pays (CostModel clamps at 0)
        for q in names:
            mine = calls.diff_s[take[ran[take] == q]]
            if mine.size:
                own[q][b] = float(np.median(mine))
    base = (params.call_overhead_s, params.call_overhead_s + params.transfer_call_overhead_s)

    def about_median(d: np.ndarray) -> np.ndarray:
        return d - float(np.median(d))

    policy_spread = {q: about_median(calls.diff_s[ran == q]) for q in names}
    kind_spread = {t: about_median(calls.diff_s[calls.transfer == t]) for t in (False, True)
                   if int(np.sum(calls.transfer == t)) >= ANCHOR_MIN_CALLS}
    return Overheads(plain, moving, int(steps.size), base, own, policy_spread, kind_spread, seed)


def _few(diff: np.ndarray) -> AnchorShift:
    """A kind the point anchoring left unshifted for want of calls (fewer than ``ANCHOR_MIN_CALLS``): a resample moves
    it by its drawn calls' median, unshrunk. The point cannot tell that median from noise, so it does not move; the
    interval spans it, because the model may be off by that much (a median of its drawn calls, a call drawn twice
    counted twice)."""
    med = float(np.median(diff)) if diff.size else 0.0
    return AnchorShift(int(diff.size), med, None, med)


def _calls_of(rows: dict[str, np.ndarray], policy: str | None, ran: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """``([N] bool, [N] str)``: whether each replayed call moves expert weights, and the policy it ran: ``ran`` (a
    chooser's candidates), else ``policy`` at every call."""
    moving = np.fromiter((moves_weights(w, c, g) for w, c, g in
                          zip(rows["weight_sync_s"], rows["copy_s"], rows["grad_reduce_s"])), bool, len(rows["time_s"]))
    names = np.asarray(ran, dtype=object) if ran is not None else np.full(len(rows["time_s"]), policy, dtype=object)
    return moving, names


def _pay(over: Overheads, moving: np.ndarray, names: np.ndarray) -> np.ndarray:
    """``[B, n]``: the overhead each of ``n`` calls pays per resample: its policy's own (:class:`Overheads`) where it
    has them, else its kind's."""
    pay = np.where(moving[None, :], over.moving_s[:, None], over.plain_s[:, None])
    for q in sorted(set(names) & set(over.own_s)):
        cols = names == q
        own = over.own_s[q][:, None]
        mine = np.maximum(0.0, np.where(moving[cols], over.base_s[1], over.base_s[0])[None, :] + own)
        pay[:, cols] = np.where(np.isnan(own), pay[:, cols], mine)
    return pay


def resampled_times(rows: dict[str, np.ndarray], over: Overheads, policy: str | None = None,
                    ran: np.ndarray | None = None) -> np.ndarray:
    """``[B, N]``: every replayed call of one policy (``rows``: its replay rows; ``policy``: its name, or ``ran``
    [N]: the policy each call ran, a chooser's) re-predicted under each resample's overheads: its time minus its own
    overhead plus the resample's of the policy that ran it, anchored on that policy's own drawn calls where it has
    them (:class:`Overheads`), else of its kind."""
    return (rows["time_s"] - rows["call_overhead_s"])[None, :] + _pay(over, *_calls_of(rows, policy, ran))


#: replayed calls per block (bounds the ``[B, block]`` arrays of a trace's 30 000 calls)
NOISE_BLOCK = 2048


def _noise_blocks(over: Overheads, policy: str | None, moving: np.ndarray, names: np.ndarray):
    """The ``[B, block]`` blocks of :func:`run_noise`, in call order (the same draws whatever sums them)."""
    # one stream per policy: two policies' runs scatter independently, and a policy over itself is 1 in every draw
    rng = np.random.default_rng([over.seed, zlib.crc32(str(policy).encode())])
    size = over.plain_s.size
    for a in range(0, len(names), NOISE_BLOCK):
        sl = slice(a, min(len(names), a + NOISE_BLOCK))
        block = np.zeros((size, sl.stop - a))
        pools = [over.policy_spread.get(q, over.kind_spread.get(bool(m))) for q, m in zip(names[sl], moving[sl])]
        for j, pool in enumerate(pools):
            if pool is not None and pool.size:
                block[:, j] = pool[rng.integers(0, pool.size, size)]
        yield block


def run_noise(rows: dict[str, np.ndarray], over: Overheads, policy: str | None = None,
              ran: np.ndarray | None = None) -> np.ndarray:
    """``[B, N]``: what a new run's calls scatter by about the model, per resample: each replayed call's draw from
    the calibration's calls of the policy that ran it, about their median (its kind's where that policy ran fewer
    than ``ANCHOR_MIN_CALLS``; 0 where neither). A measured figure of N calls carries that noise; added to
    :func:`resampled_times` it turns the interval on the model into one on what a run of the replayed length
    measures (seeded by ``over.seed`` and ``policy``)."""
    blocks = list(_noise_blocks(over, policy, *_calls_of(rows, policy, ran)))
    return np.hstack(blocks) if blocks else np.zeros((over.plain_s.size, 0))


def predicted_times(rows: dict[str, np.ndarray], over: Overheads, policy: str | None = None,
                    ran: np.ndarray | None = None) -> np.ndarray:
    """``[B, N]``: :func:`resampled_times` plus :func:`run_noise`: what each resample says a run of these calls
    measures."""
    return resampled_times(rows, over, policy, ran) + run_noise(rows, over, policy, ran)


def resampled_sums(rows: dict[str, np.ndarray], over: Overheads, policy: str | None = None,
                   ran: np.ndarray | None = None, noise: bool = True) -> np.ndarray:
    """``[B]``: Σ of :func:`predicted_times` (of :func:`resampled_times` without ``noise``) over the calls, a block
    of calls at a time (not the ``[B, N]`` array of a trace's 30 000 calls)."""
    moving, names = _calls_of(rows, policy, ran)
    out = np.full(over.plain_s.size, float(rows["time_s"].sum() - rows["call_overhead_s"].sum()))
    for a in range(0, len(names), NOISE_BLOCK):
        out += _pay(over, moving[a:a + NOISE_BLOCK], names[a:a + NOISE_BLOCK]).sum(axis=1)
    if noise:
        for block in _noise_blocks(over, policy, moving, names):
            out += block.sum(axis=1)
    return out


def bounds(draws: np.ndarray, level: float = LEVEL, point: float | None = None) -> tuple[float, float]:
    """The percentile interval of ``draws`` at ``level`` (5th and 95th percentiles at 90 %), stretched to hold
    ``point`` where given. Why stretched: the point's anchoring is one the calls allow, and the draws can all lie on
    one side of it (a kind too few calls to shift at the point but moved in every draw; a shift the point shrank to
    0 that most draws keep): an interval beside its own figure would read as a contradiction, not as a bias."""
    tail = 50.0 * (1.0 - level)
    lo, hi = (float(x) for x in np.percentile(draws, [tail, 100.0 - tail]))
    if point is not None:
        lo, hi = min(lo, float(point)), max(hi, float(point))
    return lo, hi


def half_width(point: float, lo: float, hi: float) -> float:
    """The interval's relative half-width about ``point``: its larger side (a bootstrap interval need not be
    symmetric), over the point."""
    return max(hi - point, point - lo, 0.0) / abs(point) if point else 0.0


def steps_for(steps: int, width: float, target: float = TARGET) -> int:
    """Calibration steps that narrow a relative half-width ``width`` measured from ``steps`` steps to ``target``,
    as a median's standard error narrows, with ``1 / sqrt(steps)``."""
    if width <= target:
        return steps
    return int(math.ceil(steps * (width / target) ** 2))


def chooser_ran(rows: dict[str, np.ndarray], decisions) -> np.ndarray:
    """``[N]``: the candidate each replayed call of a chooser ran (its ``rows``), from its replay ``decisions``
    (``(step, microbatch, layer, policy, ...)`` tuples; a call without one: None, anchored by its kind)."""
    of = {(int(d[0]), int(d[1]), int(d[2])): d[3] for d in decisions}
    return np.array([of.get((int(s), int(m), int(l))) for s, m, l in zip(rows["step"], rows["microbatch"],
                                                                          rows["layer"])], dtype=object)


def summary_intervals(rows: dict[str, dict[str, np.ndarray]], policies, over: Overheads, baseline: str = "none",
                      step_fixed_s: float = 0.0, level: float = LEVEL, ran: dict[str, np.ndarray] | None = None
                      ) -> dict[str, dict]:
    """Per policy of ``policies``, the interval of the figures :func:`~ultraep.sim.replay.summarise` reports:
    ``time_per_layer_ms`` and ``step_ms`` (the replayed layers of a step plus ``step_fixed_s``) as ``[lo, hi]``,
    ``speedup_vs_none`` as ``[lo, hi]`` (``baseline``'s time over the policy's in the same resample: both move with
    the same draw), each one's relative half-width about the point figure, the calibration steps the draws came from,
    and ``steps_for_5pct`` (the steps that would narrow the wider of the two to ±5 %). ``ran``: per chooser the
    candidate each of its calls ran (:func:`chooser_ran`)."""
    ran = ran or {}
    sums = {p: resampled_sums(rows[p], over, p, ran.get(p)) for p in dict.fromkeys([*policies, baseline]) if p in rows}

    def fixed_of(p: str) -> float:  # the step's fixed time over the policy's replayed steps (as summarise adds it)
        return step_fixed_s * int(np.unique(rows[p]["step"]).size)

    out = {}
    for p in policies:
        r = rows[p]
        n = len(r["time_s"])
        if not n:
            continue
        n_steps = int(np.unique(r["step"]).size)
        fixed = fixed_of(p)
        point_t = float(r["time_s"].sum()) + fixed
        t = sums[p] + fixed
        lo, hi = bounds(t, level, point_t)
        fig = {"level": level, "steps": over.steps, "resamples": int(over.plain_s.size),
               # the same arithmetic as summarise's figure, so that a bound stretched to the point equals it
               "time_per_layer_ms": [(lo - fixed) / n * 1e3, (hi - fixed) / n * 1e3],
               "step_ms": [1e3 * lo / n_steps, 1e3 * hi / n_steps],
               "time_half_width": half_width(point_t, lo, hi)}
        if baseline in sums:
            base_point = float(rows[baseline]["time_s"].sum()) + fixed_of(baseline)
            x_lo, x_hi = bounds((sums[baseline] + fixed_of(baseline)) / t, level, base_point / point_t)
            fig["speedup_vs_none"] = [x_lo, x_hi]
            fig["speedup_half_width"] = half_width(base_point / point_t, x_lo, x_hi)
        wider = max(fig["time_half_width"], fig.get("speedup_half_width", 0.0))
        fig["steps_for_5pct"] = steps_for(over.steps, wider)
        out[p] = fig
    return out
