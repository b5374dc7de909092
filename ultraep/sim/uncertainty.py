"""How sure a from-run prediction is: the calibration's uncertainty propagated to every predicted time and speed-up.

``ultraep simulate RUN --topology from-run`` predicts on the cost model the run's engine learned, anchored on the run's
own measured calls (:func:`~ultraep.sim.from_run.anchor`): per kind of call (moving expert weights or not) the median
of measured minus predicted, shrunk by its noise, moves that kind's call overhead. Those medians come from a sample of
calls, and a sample of 30 noisy steps leaves them uncertain. The interval is a bootstrap over that sample:

    for b in 1..B:  draw the run's compared steps with replacement (every call of a drawn step, a step drawn twice
                    counted twice: the calls of one step share the machine's moment), re-derive each kind's shift
                    from the drawn calls' differences (the same median and shrinkage; a kind too few calls to shift
                    at the point: its drawn median, unshrunk, :func:`_few`), hence the anchored overheads, and
                    re-predict every replayed call with them
    interval = the 5th and 95th percentiles over the B re-predictions (a 90 % percentile interval), stretched to
               hold the point figure where the draws all lie on one side of it (:func:`bounds`)

Re-predicting is exact, not re-simulated: a call's overhead enters its predicted layer time as one additive term
(``CostBreakdown.call_overhead_s``, the plain or the moving kind's), so a call re-predicted under other overheads is
its replayed time minus its own overhead plus the resample's overhead of its kind. The plans of a fixed policy do not
depend on the cost model, so the replay of every fixed policy is the same under every resample; a chooser's
(``adaptive``) choices are held at the point model's (a resample could flip a choice between candidates whose
predictions differ by less than the shift moved).

The width scales as ``1 / sqrt(n)`` in the number of compared steps (a median's standard error does), so an interval
of half-width ``h`` from ``n`` steps narrows to ``±5 %`` with ``n * (h / 5 %)^2`` steps (:func:`steps_for`). The
engine's fit itself (its per-term scales) is the run's recorded state and not re-derived; what it misses on the run's
own calls is what anchoring measures, per kind, and what the interval carries.

Legend: B resamples, C compared calls, N replayed calls of a policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    ``moving_s`` [B] (one that moves them), and the ``steps`` the calls were drawn from."""

    plain_s: np.ndarray
    moving_s: np.ndarray
    steps: int


def resampled_overheads(calls: AnchorCalls, params, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                        ) -> Overheads | None:
    """The anchored overheads of ``resamples`` bootstrap draws of ``calls``' steps, re-derived from the recorded
    model's ``params`` as anchoring derives them (deterministic in ``seed``). None: fewer than 2 steps compared, or
    no resample asked for."""
    steps = np.unique(calls.step)
    if resamples <= 0 or steps.size < 2:
        return None
    rng = np.random.default_rng(seed)
    # the calls of every step, once: a draw of steps is the concatenation of their call indices
    of_step = [np.flatnonzero(calls.step == s) for s in steps]
    plain = np.empty(resamples)
    moving = np.empty(resamples)
    point = {k: v.size for k, v in calls.kinds().items()}
    for b in range(resamples):
        take = np.concatenate([of_step[i] for i in rng.integers(0, steps.size, steps.size)])
        drawn = calls.kinds(take)
        # (a kind the draw missed: no calls, no shift; not the other kind's, as a run without it would get)
        shifts = {k: _shift(drawn.get(k, np.zeros(0))) if n >= ANCHOR_MIN_CALLS else _few(drawn.get(k, np.zeros(0)))
                  for k, n in point.items()}
        p, extra = anchored_overheads(params, shifts)
        plain[b], moving[b] = p, max(0.0, p + extra)  # what a call of each kind pays (CostModel clamps at 0)
    return Overheads(plain, moving, int(steps.size))


def _few(diff: np.ndarray) -> AnchorShift:
    """A kind the point anchoring left unshifted for want of calls (fewer than ``ANCHOR_MIN_CALLS``): a resample moves
    it by its drawn calls' median, unshrunk. The point cannot tell that median from noise, so it does not move; the
    interval spans it, because the model may be off by that much (a median of its drawn calls, a call drawn twice
    counted twice)."""
    med = float(np.median(diff)) if diff.size else 0.0
    return AnchorShift(int(diff.size), med, None, med)


def resampled_times(rows: dict[str, np.ndarray], over: Overheads) -> np.ndarray:
    """``[B, N]``: every replayed call of one policy (``rows``: its replay rows) re-predicted under each resample's
    overheads: its time minus its own overhead plus the resample's of its kind."""
    moving = np.fromiter((moves_weights(w, c, g) for w, c, g in
                          zip(rows["weight_sync_s"], rows["copy_s"], rows["grad_reduce_s"])), bool, len(rows["time_s"]))
    base = rows["time_s"] - rows["call_overhead_s"]
    return base[None, :] + np.where(moving[None, :], over.moving_s[:, None], over.plain_s[:, None])


def resampled_sums(rows: dict[str, np.ndarray], over: Overheads) -> np.ndarray:
    """``[B]``: Σ of :func:`resampled_times` over the calls, without the ``[B, N]`` array (a trace's 30 000 calls)."""
    moving = np.fromiter((moves_weights(w, c, g) for w, c, g in
                          zip(rows["weight_sync_s"], rows["copy_s"], rows["grad_reduce_s"])), bool, len(rows["time_s"]))
    base = float(rows["time_s"].sum() - rows["call_overhead_s"].sum())
    return base + int(moving.sum()) * over.moving_s + int((~moving).sum()) * over.plain_s


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


def summary_intervals(rows: dict[str, dict[str, np.ndarray]], policies, over: Overheads, baseline: str = "none",
                      step_fixed_s: float = 0.0, level: float = LEVEL) -> dict[str, dict]:
    """Per policy of ``policies``, the interval of the figures :func:`~ultraep.sim.replay.summarise` reports:
    ``time_per_layer_ms`` and ``step_ms`` (the replayed layers of a step plus ``step_fixed_s``) as ``[lo, hi]``,
    ``speedup_vs_none`` as ``[lo, hi]`` (``baseline``'s time over the policy's in the same resample: both move with
    the same draw), each one's relative half-width about the point figure, the calibration steps the draws came from,
    and ``steps_for_5pct`` (the steps that would narrow the wider of the two to ±5 %)."""
    sums = {p: resampled_sums(rows[p], over) for p in dict.fromkeys([*policies, baseline]) if p in rows}

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
