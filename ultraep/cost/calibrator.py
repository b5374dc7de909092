"""The online calibration of the cost model (:class:`Calibrator`).

**Calibration.** Each modelled term has a multiplicative scale in :class:`CostParams` (``compute_scale``,
``a2a_scale``, ...). :class:`Calibrator` updates them from measured timings with an exponentially weighted
moving average of the log ratio ``measured / unscaled prediction`` (weight ``alpha`` on the newest
observation): a geometric EWMA, insensitive to units, one number per term. Every observation returns (and
can record through the telemetry recorder) the prediction next to the measurement.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from ultraep.cost.fit import ComputeFit, half_tokens_from_spread
from ultraep.cost.model import CostBreakdown, CostModel, moves_weights
from ultraep.cost.params import CostParams


# ---------------------------------------------------------------------------------------------- calibration
#: measured timing key → the CostParams scale it calibrates
CALIBRATED_TERMS: dict[str, str] = {
    "compute_fwd_s": "compute_scale",
    "a2a_fwd_s": "a2a_scale",
    "weight_sync_s": "weight_sync_scale",
    "grad_reduce_s": "grad_reduce_scale",
    "plan_s": "plan_scale",
}  # copy_s calibrates copy_scale with copy_call_s as a line (Calibrator._copy)


#: the least spread (root mean square relative) of the calls' copied bytes that separates the copies' per-call part
#: from their per-byte part (Calibrator._copy): 2 experts moved in 1 call of 10 and 4 in the others spread 15 %
COPY_SPREAD = 0.05
#: the least copy_scale (CostParams.copy_scale > 0): copies that did not grow with their bytes
COPY_SCALE_FLOOR = 1e-3

#: measured backward term → (the CostParams factor it calibrates, the forward term the factor multiplies)
FACTOR_TERMS: dict[str, tuple[str, str]] = {
    "compute_bwd_s": ("backward_compute_factor", "compute_fwd_s"),
    "a2a_bwd_s": ("backward_a2a_factor", "a2a_fwd_s"),
}

#: the least busy rank's measured compute (the runtime reports it beside the slowest rank's) → (the slowest rank's
#: term, the per-instance cost it calibrates, whether it is the backward's)
FASTEST_TERMS: dict[str, tuple[str, str, bool]] = {
    "compute_fwd_fastest_s": ("compute_fwd_s", "half_tokens", False),
    "compute_bwd_fastest_s": ("compute_bwd_s", "backward_half_tokens", True),
}


#: the measured terms a call's layer time is the sum of on its critical path (besides the runtime's own overhead)
SUMMED_TERMS = ("compute_fwd_s", "compute_bwd_s", "a2a_fwd_s", "a2a_bwd_s", "copy_s", "plan_s")


def call_residual(measured: dict[str, float], total_s: float) -> float:
    """Seconds of a call's measured layer time ``total_s`` outside its measured terms (``measured``, the
    :data:`ultraep.timings.TERMS` a runtime reports): the load all-gather, rerouting, permute/unpermute and the
    glue between phases, which no term models. The replica weights' exposed wait is in it too (the runtime reports
    the transfer's flight time, not its exposed part); it is 0.1 ms against 20-30 ms on the gloo runtime. >= 0."""
    return max(0.0, float(total_s) - sum(float(measured.get(k, 0.0)) for k in SUMMED_TERMS))


#: calibration rows a :class:`Calibrator` keeps in ``history`` (the newest; ~10 per observed call)
HISTORY_ROWS = 4096
#: weight of the newest call in ``CostParams.excess_s`` (about the last 20 calls). The terms' scales are learned in log
#: space, robust to a slow call but right at the typical call, not the mean: on 2 gloo ranks the all-to-alls measured
#: 1.15-1.22x their prediction on average at a geometric mean of 1.00, and the whole calls of a window of 100 ran
#: up to 18 % over its prediction (``benchmarks/bench_long.py``, every window short). Replayed offline on the calls of
#: its 15 recordings, the excess learned at this weight left every window within 5.1 % (at 0.02: 11.9 %; at 0.1:
#: 2.6 %, chasing the last few calls' noise)
EXCESS_WEIGHT = 0.05
#: measured calls of a calibrator that do not feed ``excess_s`` (a layer's first calls are slower whatever runs)
EXCESS_WARMUP = 2
#: a call measured more than this factor off its terms' prediction, either way, feeds no excess: it says the terms
#: are not calibrated yet, not what their tail adds. At 64 tokens per rank on 2 gloo ranks a layer's third call was
#: predicted at 1.06 s (a backward factor of 5.1 learned from two calls), and in another run at 31 s, for calls of
#: 0.16 s; folded in, the 31 s call made the excess -1.55 s and every later prediction of the 40 logged negative. On
#: bench_long's recordings 66 of 15000 calls fall outside; the offline replay of the excess leaves every window within
#: 6.0 % without them
EXCESS_RANGE = 2.0


def excess_after(excess_s: float, predicted: CostBreakdown, total_s: float) -> float:
    """``CostParams.excess_s`` after one call: its measured layer time ``total_s`` over ``predicted`` (the call's
    prediction, its own excess taken out) folded into ``excess_s`` with weight :data:`EXCESS_WEIGHT`; unchanged where
    the call measured more than :data:`EXCESS_RANGE` times off that prediction, either way."""
    terms, measured = predicted.terms_s, float(total_s)
    if not (terms > 0 and measured > 0 and 1.0 / EXCESS_RANGE <= measured / terms <= EXCESS_RANGE):
        return float(excess_s)
    return float((1.0 - EXCESS_WEIGHT) * excess_s + EXCESS_WEIGHT * (measured - terms))  # (a float in the params)


class Calibrator:
    """Learns the per-term scales of :class:`CostParams` from measured timings.

    Estimator (per term k with a measurement): ``log s_k ← (1 - α) · log s_k + α · log(m_k / u_k)`` where
    ``u_k`` is the *unscaled* model prediction (``predicted_k / s_k``) and ``m_k`` the measurement: an EWMA
    of the log ratio, whose weight is ``max(α, 1/n)`` for the n-th observation of a term (a running mean
    first, so a few observations replace the seed figures instead of nudging them). ``compute_bwd_s`` measurements update ``backward_compute_factor`` the same way
    (ratio to the forward compute). Terms predicted or measured as 0 are skipped.

    Three terms are additive seconds, not scales, and use the same weights on the seconds themselves:
    ``call_overhead_s`` and ``transfer_call_overhead_s`` from the call's layer time minus its measured terms
    (:func:`call_residual`; the runtime's load all-gather, reroute and permute, which no term covers; kept apart for
    the calls that move expert weights and those that do not: :meth:`_call_overhead`), and ``engine_overhead_s``
    from the measured ``plan_s`` of a call whose plan carries an engine cost (``engine_s > 0``: an adaptive
    decision) minus the planner figures the model already charges it; such a call leaves ``plan_scale`` to the fixed
    plans. The host copies are a line, ``copy_call_s`` plus ``copy_scale`` times their per-byte part, fitted by least
    squares with the same weights (:meth:`_copy`).

    ``excess_s`` is the calls' mean over their whole prediction (:func:`excess_after`): what the terms, right at the
    typical call, leave out of the mean, so that a prediction is the mean time of the calls it stands for.

    ``weight_sync_s`` (the flight) is an upper bound unless the runtime blocked on it, and ``weight_wait_s`` (the
    exposed wait) bounds the exposure the model may predict: see :meth:`_weight_sync_target`.

    Args:
        model: the cost model whose params are calibrated (a new model is kept in :attr:`model`).
        alpha: weight of the newest observation (0 < alpha <= 1).
        recorder: optional telemetry recorder; every observation is recorded with ``record_timings``
            as ``predicted.<term>`` next to ``measured.<term>``.
    """

    def __init__(self, model: CostModel, alpha: float = 0.2, recorder=None) -> None:
        if not 0.0 < alpha <= 1.0:
            from ultraep.errors import ConfigError

            raise ConfigError("calibration.alpha", f"alpha ({alpha}) must be in (0, 1]", alpha)
        self.model = model
        self.alpha = float(alpha)
        self.recorder = recorder
        #: the last HISTORY_ROWS calibration rows (bounded: a run of 10^5 calls kept ~10^6 rows)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        self._n: dict[str, int] = {}  # observations per scale: the first ones weigh 1/n (a running mean)
        self._overhead: dict[str, float] = {}  # the residual per kind of call (_call_overhead)
        self._totals = 0  # calls whose measured layer time was observed (the first EXCESS_WARMUP teach no excess)
        # the copies' weighted sums (1, x, y, x², x·y) of the per-byte part x and the measured copies y (_copy)
        self._copy_sums = np.zeros(5)
        # every rank's compute, forward and backward, fitted over the calls (ComputeFit)
        self.fits = {"compute_fwd_s": ComputeFit(), "compute_bwd_s": ComputeFit()}

    def _alpha(self, name: str) -> float:
        n = self._n.get(name, 0)
        self._n[name] = n + 1
        return max(self.alpha, 1.0 / (n + 1))

    def _call_overhead(self, predicted: CostBreakdown, resid: float) -> dict[str, float]:
        """``call_overhead_s`` and ``transfer_call_overhead_s`` after a call's residual ``resid``: each kind of call
        (moving expert weights or not: :func:`moves_weights`) keeps its own running estimate with the weights of the
        other additive terms; ``call_overhead_s`` is that of the calls that move none (that of the others until one
        ran), ``transfer_call_overhead_s`` the difference (0 until both kinds ran). Why two: the calls that move
        weights post the weight and gradient sends (3.0-4.3 and 3.4-7.6 ms on 2 gloo ranks); one estimate learned
        from a run of mostly one kind mispredicted the other by 1.3-2.9 ms a call at 64 tokens per rank (2026-11-27:
        the fixed policies' layer time up to 10 % short)."""
        kind = "transfer" if moves_weights(predicted.weight_sync_s, predicted.copy_s, predicted.grad_reduce_s) \
            else "plain"
        self._overhead[kind] = self._fold(f"call_overhead_s.{kind}", self._overhead.get(kind, 0.0), resid)
        plain, transfer = self._overhead.get("plain"), self._overhead.get("transfer")
        if plain is None:
            return {"call_overhead_s": transfer, "transfer_call_overhead_s": 0.0}
        return {"call_overhead_s": plain,
                "transfer_call_overhead_s": 0.0 if transfer is None else transfer - plain}

    def _copy(self, predicted: CostBreakdown, measured: float, updates: dict[str, float]) -> dict[str, Any]:
        """``copy_call_s`` and ``copy_scale`` from one call's measured replica copies: a line ``y = copy_call_s +
        copy_scale · x`` fitted by least squares over the calls whose plan copies (``x`` the per-byte part unscaled,
        the calls weighted as the other terms' observations). Where the calls' ``x`` spread less than
        ``COPY_SPREAD`` of their root mean square (one plan's copies) they cannot tell the two parts apart: the
        per-call part stays, the scale takes the rest. Why a per-call part: on 2 gloo ranks a call moving 4 experts
        copied 6.3-8.1 ms and one moving 2 copied 4.9-7.3 (2026-11-27, each run's and shape's mean, 7 shapes, 4 runs);
        one scale learned on a run of mostly one of them mispredicted the other by up to 4.7 ms a call."""
        p = self.model.params
        row = {"term": "copy_s", "predicted_s": predicted.copy_s, "measured_s": measured,
               "ratio": measured / predicted.copy_s if predicted.copy_s > 0 else float("nan")}
        x = 0.0 if predicted.moves_R is None else self.model.copy_bytes_time(predicted.moves_R)
        if x <= 0 or measured <= 0:
            return row  # the model copies nothing here (no replicas, or copies that overlap on a GPU), or none measured
        a = self._alpha("copy_s")
        self._copy_sums = (1 - a) * self._copy_sums + a * np.array([1.0, x, measured, x * x, x * measured])
        _, sx, sy, sxx, sxy = self._copy_sums
        var = sxx - sx * sx
        if var > COPY_SPREAD ** 2 * sxx:  # the calls copied different bytes: both parts
            scale = (sxy - sx * sy) / var
            call_s = sy - scale * sx
            if scale <= 0:  # more bytes were not slower: all per call
                call_s, scale = sy, COPY_SCALE_FLOOR
            elif call_s < 0:  # a line through the origin
                call_s, scale = 0.0, sxy / sxx
        else:
            call_s = min(p.copy_call_s, sy)
            scale = (sy - call_s) / sx
        updates["copy_call_s"] = float(call_s)
        updates["copy_scale"] = float(max(scale, COPY_SCALE_FLOOR))
        return row

    def _fold(self, name: str, old: float, new: float) -> float:
        """An additive term's next value: ``new`` folded into ``old`` with the weight of ``name``'s next observation."""
        a = self._alpha(name)
        return (1 - a) * old + a * new

    def _fold_log(self, name: str, old: float, new: float) -> float:
        """A scale's or factor's next value: ``new`` folded into ``old`` in log space (geometric), with the weight of
        ``name``'s next observation."""
        a = self._alpha(name)
        return math.exp((1 - a) * math.log(old) + a * math.log(new))

    @property
    def params(self) -> CostParams:
        return self.model.params

    def _replica_instance(self, predicted: CostBreakdown, measured: float, updates: dict[str, float]) -> dict[str, Any]:
        """``replica_instance_s`` from the replicas' measured forward compute, summed over the ranks: what it exceeds
        their tokens' predicted compute by, per active replica instance (>= 0), folded in with the weights of the other
        additive terms."""
        cm, p = self.model, self.model.params
        n, i = predicted.replica_tokens, predicted.replica_instances
        tokens_s = float(cm.compute_time_R(np.array([n]), np.array([i]))[0])
        pred = tokens_s + p.replica_instance_s * i
        if i > 0 and measured > 0:
            updates["replica_instance_s"] = self._fold("replica_instance_s", p.replica_instance_s,
                                                       max(0.0, (measured - tokens_s) / i))
        return {"term": "replica_compute_s", "predicted_s": pred, "measured_s": measured,
                "ratio": measured / pred if pred > 0 else float("nan")}

    def _weight_sync_target(self, predicted: CostBreakdown, measured: dict[str, float], flight: float) -> float | None:
        """The ``weight_sync_scale`` one call's replica weights point to, or None when it says nothing.

        The runtime's flight is post -> first seen complete, and it looks when it waits: after the dispatch and the
        masters. Its exposed wait (``weight_wait_s``, when measured) is what the critical path paid.

        - The model exposes more than the runtime waited: the copy hid more than the model's window lets it. The
          scale drops to the one whose exposure is the measured wait; it never rises this way. (A flight of 0, the
          copies complete when posted as on gloo, says the same: nothing was waited for.) Without this the scale the
          flights taught exposed 12-15 ms per call that the runtime never waited (quota, 64 tokens per rank,
          2026-11-26: +6 to +13 % on its layer time).
        - The runtime blocked (its wait is over 5 % of the flight): the flight ended when the wait did, a measurement.
        - It did not block, or no wait is known and the flight ended inside the forward's all-to-all and compute: an
          upper bound, which may lower the scale, never raise it (a quiet gloo run once fitted 12x to such flights,
          predicting 8 ms of exposed wait where the runtime waited 0.1 ms)."""
        old = self.model.params.weight_sync_scale
        pv = predicted.weight_sync_s
        if pv <= 0:
            return None
        wait = measured.get("weight_wait_s")
        if wait is None and flight <= 0:
            wait = 0.0
        if wait is not None and predicted.sync_exposed_s > wait:
            hidden = (pv - predicted.sync_exposed_s + wait) / pv
            return old * hidden if hidden > 0 else None
        if flight <= 0:
            return None
        if wait is not None:
            blocked = wait > 0.05 * flight
        else:
            blocked = flight > measured.get("a2a_fwd_s", 0.0) + measured.get("compute_fwd_s", 0.0)
        if not blocked and flight >= pv:
            return None  # an upper bound above the prediction: nothing learned
        return old * flight / pv

    def _half_tokens(self, predicted: CostBreakdown, measured: dict[str, float], key: str, fastest: float,
                     updates: dict[str, float]) -> dict[str, Any]:
        """``half_tokens`` (or ``backward_half_tokens``) from the slowest and the fastest rank of a call whose ranks
        carry unequal tokens (:func:`half_tokens_from_spread`), folded in with the weights of the other terms; the
        row puts the least busy rank's predicted compute next to the measured one."""
        slow_key, name, backward = FASTEST_TERMS[key]
        cm, p = self.model, self.model.params
        n, i = predicted.rank_tokens_R, predicted.instances_R
        pred = float("nan")
        if n is not None and i is not None and np.any(n > 0):
            t_R = cm.compute_time_R(n, i, backward=backward) * (p.backward_compute_factor if backward else 1.0)
            pred = float(t_R[n > 0].min())
            slowest = float(measured.get(slow_key, 0.0))
            if fastest > 0 and slowest > 0:
                h = half_tokens_from_spread(n, i, slowest / fastest)
                if h is not None:
                    updates[name] = self._fold(name, cm.half_tokens_bwd if backward else cm.half_tokens, h)
        return {"term": key, "predicted_s": pred, "measured_s": fastest,
                "ratio": fastest / pred if pred > 0 else float("nan")}

    def _fit_compute(self, predicted: CostBreakdown, rank_compute_s: dict[str, np.ndarray],
                     policy: str = "") -> dict[str, float]:
        """Fold every rank's measured compute into the fits; once the forward's is solved, the compute parameters it
        and the backward's give (``compute_scale``, ``half_tokens``, ``replica_instance_s``, ``replica_move_s``,
        ``corun_slowdown``, ``compute_noise`` and their backward counterparts) replace what the call-level ratios
        learned. {} while the fits lack calls.

        A fit whose solve fails keeps its last solution (:meth:`ComputeFit.solve`), and the backward's parameters,
        relative to the forward's scale, are derived from both fits' current solutions every call. Why: left to the
        call-level ratios, a backward factor learned against the forward's old scale met a forward solved anew (3x the scale, no per-instance cost) and the
        model predicted a backward 3x its measure for four calls (2026-11-27, 64 tokens per rank, feplb: 158 ms
        against 50), and a run that ended in such a state left that model to ``simulate --topology from-run``."""
        n, i = predicted.rank_tokens_R, predicted.instances_R
        if n is None or i is None or predicted.sec_per_token <= 0:
            return {}
        rep = predicted.replicas_R if predicted.replicas_R is not None else np.zeros_like(n)
        for key, t_R in rank_compute_s.items():
            if key in self.fits and t_R is not None and len(t_R) == len(n):
                self.fits[key].add(n, i, rep, t_R, predicted.sec_per_token, regime=policy, moves_R=predicted.moves_R)
        fwd = self.fits["compute_fwd_s"].solve()
        if fwd is None:
            return {}
        out = {"compute_scale": fwd.a, "half_tokens": fwd.b / fwd.a, "replica_instance_s": fwd.d,
               "replica_move_s": fwd.e, "corun_slowdown": fwd.k, "compute_noise": fwd.noise}
        bwd = self.fits["compute_bwd_s"].solve()
        if bwd is not None and bwd.a > 0:
            out.update(backward_compute_factor=bwd.a / fwd.a, backward_half_tokens=bwd.b / bwd.a,
                       backward_replica_instance_s=bwd.d * fwd.a / bwd.a,  # before the factor, as the model applies it
                       backward_replica_move_s=bwd.e * fwd.a / bwd.a,
                       backward_corun_slowdown=bwd.k, backward_compute_noise=bwd.noise)
        return out

    def observe(self, predicted: CostBreakdown, measured: dict[str, float], *, step: int = 0, microbatch: int = 0,
                layer: int = 0, total_s: float | None = None,
                rank_compute_s: dict[str, np.ndarray] | None = None, policy: str = "") -> list[dict[str, Any]]:
        """Fold one layer's measured timings in; return the rows ``term, predicted_s, measured_s, ratio``.
        ``total_s``: the call's measured layer time, which calibrates ``call_overhead_s`` (see :func:`call_residual`).
        ``rank_compute_s``: every rank's measured expert compute, ``{"compute_fwd_s": [R], "compute_bwd_s": [R]}``
        (the runtime's); with it the compute parameters come from the fit over every rank of every call
        (:class:`ComputeFit`), not from the slowest and the least busy rank of this one. ``policy``: the policy whose
        plan ran the call (the fit keeps each policy's calls apart)."""
        p = self.model.params
        pred = predicted.as_dict()
        updates: dict[str, float] = {}
        rows = []
        if total_s is not None and total_s > 0:  # the runtime's work outside every measured term: additive seconds
            resid = call_residual(measured, total_s)
            updates.update(self._call_overhead(predicted, resid))
            rows.append({"term": "call_overhead_s", "predicted_s": pred.get("call_overhead_s", 0.0),
                         "measured_s": resid, "ratio": float(resid / pred["call_overhead_s"])
                         if pred.get("call_overhead_s") else float("nan")})
            self._totals += 1
            if self._totals > EXCESS_WARMUP:
                updates["excess_s"] = excess_after(p.excess_s, predicted, float(total_s))
        for key, value in measured.items():
            if key == "plan_s" and predicted.engine_s > 0:
                # an engine's plan: the measured plan_s is its whole decision, the planning of the chosen candidate
                # (plan_s), the candidates planned beyond it and its own overhead (engine_s). The planner figures
                # keep the scale fixed plans calibrate; the remainder is the engine's overhead (additive seconds).
                whole = pred.get("plan_s", 0.0) + predicted.engine_s
                planned_beyond = predicted.engine_s - p.engine_overhead_s
                own = max(0.0, float(value) - pred.get("plan_s", 0.0) - planned_beyond)
                updates["engine_overhead_s"] = self._fold("engine_overhead_s", p.engine_overhead_s, own)
                rows.append({"term": key, "predicted_s": whole, "measured_s": float(value),
                             "ratio": float(value / whole) if whole > 0 else float("nan")})
                continue
            if key == "weight_wait_s":  # the replica weights' exposed wait: next to the exposure the model predicts
                rows.append({"term": key, "predicted_s": predicted.sync_exposed_s, "measured_s": float(value),
                             "ratio": float(value / predicted.sync_exposed_s) if predicted.sync_exposed_s > 0
                             else float("nan")})
                continue
            if key == "replica_compute_s":  # every rank's replicas: what a replica costs beyond its tokens
                rows.append(self._replica_instance(predicted, float(value), updates))
                continue
            if key in FASTEST_TERMS:  # the least busy rank's compute: what an instance costs beyond its tokens
                rows.append(self._half_tokens(predicted, measured, key, float(value), updates))
                continue
            if key in FACTOR_TERMS:  # a backward term: its ratio to the prediction before the factor
                factor, fwd_key = FACTOR_TERMS[key]
                base = pred.get(key, 0.0) / getattr(p, factor)  # the backward's prediction before the factor...
                if pred.get(fwd_key, 0.0) > 0 and measured.get(fwd_key, 0.0) > 0:
                    # ...at the forward's measured scale: the factor is the backward over the same call's forward,
                    # whatever the scales (learned in this very observation) predicted
                    base *= float(measured[fwd_key]) / pred[fwd_key]
                if base > 0 and value > 0:
                    updates[factor] = self._fold_log(factor, getattr(p, factor), value / base)
                    rows.append({"term": key, "predicted_s": pred.get(key, 0.0), "measured_s": float(value),
                                 "ratio": float(value / pred[key]) if pred.get(key) else float("nan")})
                continue
            if key == "copy_s":  # the replica copies: a part per call and a part per byte (_copy)
                rows.append(self._copy(predicted, float(value), updates))
                continue
            scale_name = CALIBRATED_TERMS.get(key)
            pv = pred.get(key, 0.0)
            if scale_name is None:
                rows.append({"term": key, "predicted_s": pv, "measured_s": float(value), "ratio": float("nan")})
                continue
            rows.append({"term": key, "predicted_s": pv, "measured_s": float(value),
                         "ratio": float(value / pv) if pv > 0 else float("nan")})
            if key == "weight_sync_s":
                target = self._weight_sync_target(predicted, measured, float(value))
                if target is not None:
                    updates[scale_name] = self._fold_log(scale_name, p.weight_sync_scale, target)
                continue
            if pv <= 0 or value <= 0:
                continue
            old = getattr(p, scale_name)
            updates[scale_name] = self._fold_log(scale_name, old, value / (pv / old))
        if rank_compute_s:
            updates.update(self._fit_compute(predicted, rank_compute_s, policy))
        if updates:
            self.model = self.model.with_params(p.model_copy(update=updates))
        self.history.extend({"step": step, "microbatch": microbatch, "layer": layer, **r} for r in rows)
        if self.recorder is not None:
            timings = {f"predicted.{r['term']}": r["predicted_s"] for r in rows}
            timings.update({f"measured.{r['term']}": r["measured_s"] for r in rows})
            self.recorder.record_timings(step, microbatch, layer, timings)
        return rows
