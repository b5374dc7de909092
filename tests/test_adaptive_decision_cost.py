"""What a decision of the adaptive engine costs: the work it skips must not change what it decides.

* A decision that weighed nothing (Step 0's idle fallback, Step 0b's settled policy in force) returns its one plan
  without the choosing (:func:`ultraep.policies.idle.kept`): the same plan, reason, predictions and state as the
  generic Steps 3-6, which a deadline (``deadline_s``) still takes.
* A weighing predicts a candidate that has run on the anchor model alone (its estimate reads nothing else), the
  fallback and the chosen one on the calibrated model too.

Driven as the runtime's engine drives it (:class:`~ultraep.engine.Engine`, calibration included): every decision
committed, its measured layer time fed back."""

from __future__ import annotations

import numpy as np
import pytest

from ultraep.config import AdaptiveOptions, BalancerConfig
from ultraep.cost import CostModel
from ultraep.engine import Engine
from ultraep.policies import adaptive as adaptive_mod
from ultraep.policies.outcomes import OutcomeTracker
from ultraep.presets import get_preset
from ultraep.sim.workload import power_law_popularity


def _engine(**opts) -> Engine:
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(8, 32, 2), pre.hardware, pre.expert)
    return Engine(BalancerConfig(policy="adaptive", layers={0: AdaptiveOptions(**opts)}), cm.topology, cost_model=cm,
                  record_timings=False)


def _loads(n: int, seed: int) -> list[np.ndarray]:
    """Small batches first (nothing pays: ``none`` idles), then skewed large ones (quota wins and settles)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens, skew = (64, 0.3) if i < n // 2 else (2048, 1.2)
        out.append(rng.multinomial(tokens * 4, power_law_popularity(8, 32, skew, rng), size=8).astype(np.int64))
    return out


#: measured / calibrated prediction of each candidate (quota faster than modelled, eplb slower)
TRUTH = {"quota": 0.8, "eplb": 1.3}


def _step(eng: Engine, i: int, load: np.ndarray, noise: float):
    d = eng.decide(i, 0, 0, load)
    eng.commit(d)
    f = TRUTH.get(d.chosen, 1.0) * noise
    eng.observe(i, 0, 0, {k: v * f for k, v in d.predicted.as_dict().items() if k in ("compute_fwd_s", "a2a_fwd_s")},
                measured_total_s=d.predicted.terms_s * f)
    return d


def _state(eng: Engine) -> dict:
    pol = eng.policy_for(0)
    s, t, b = pol.schedule, pol.outcomes, pol.budget
    return {"current": pol.current, "pending": pol.hysteresis.pending, "contender": s._contender,
            "since": dict(s._since), "unplanned": dict(s._unplanned), "lost": dict(s._lost), "loss_s": s.loss_s,
            "base_s": s.base_s, "standing": dict(b.standing), "spent_s": b.spent_s, "anchor_s": dict(t.anchor_s),
            "outcome_anchor": dict(t._outcome_anchor)}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_decision_that_weighed_nothing_returns_what_the_choosing_would(monkeypatch, seed):
    """The same loads and measurements through two engines: one takes the rested decisions' short path, the other
    (a deadline no plan reaches: nothing is late) the generic Steps 3-6. Every decision and the engine's state after
    it are equal, and the short path was taken by idle and settled decisions alike."""
    calls = []
    kept = adaptive_mod.kept
    monkeypatch.setattr(adaptive_mod, "kept", lambda *a, **k: calls.append(a[-1]) or kept(*a, **k))
    fast, generic = _engine(), _engine(deadline_s=1e9)
    rng = np.random.default_rng(seed)
    for i, load in enumerate(_loads(160, seed)):
        noise = float(np.exp(rng.normal(0.0, 0.05)))
        before = len(calls)
        a, b = _step(fast, i, load, noise), _step(generic, i, load, noise)
        assert a.plan.info["adaptive"] == b.plan.info["adaptive"], i
        assert (a.plan.engine_s, a.plan.planner_s, a.plan.sync_s) == (b.plan.engine_s, b.plan.planner_s, b.plan.sync_s)
        assert a.predicted.total_s == b.predicted.total_s
        assert _state(fast) == _state(generic), i
        rested = a.plan.info["adaptive"]["idle"] or a.plan.info["adaptive"]["settled"]
        assert (len(calls) > before) == rested, (i, a.reason)
    assert sum(c is True for c in calls) >= 20 and sum(isinstance(c, str) for c in calls) >= 10, calls


def test_a_weighing_predicts_a_measured_rival_on_the_anchor_model_alone(monkeypatch):
    """Once every rival has run, a weighing predicts on the calibrated model only the fallback (the screen's gain
    bound and the budget's stake), the policy in force (Step 0b's check, before it weighs), the chosen candidate (its
    breakdown goes with the plan) and the candidates not yet estimated on the anchor basis, and the engine the plan
    it returns. The negative control reads every calibrated
    prediction, as before: each planned candidate is predicted on both models."""
    def run() -> list[tuple[int, int, int]]:
        eng = _engine()
        pol = eng.policy_for(0)
        counted = {"n": 0}
        predict = CostModel.predict

        def counting(self, plan, **kw):
            counted["n"] += self is not pol.outcomes.anchor  # (the anchor model as handed over: not calibrated)
            return predict(self, plan, **kw)

        monkeypatch.setattr(CostModel, "predict", counting)
        rng = np.random.default_rng(3)
        out = []
        for i, load in enumerate(_loads(200, 3)):
            counted["n"] = 0
            unanchored = {n for n in pol.policies if not pol.outcomes.anchored(n, pol.current)}
            cur = pol.current
            d = _step(eng, i, load, float(np.exp(rng.normal(0.0, 0.05))))
            a = d.plan.info["adaptive"]
            if len(a["predictions"]) > 1 and i >= 100:  # a weighing, rivals measured by then
                must = {pol.fallback, a["chosen"], cur} | (unanchored & set(a["predictions"]))
                out.append((counted["n"], len(must) + 1, len(a["predictions"])))
        monkeypatch.setattr(CostModel, "predict", predict)
        return out

    weighings = run()
    assert len(weighings) >= 10 and max(p for _, _, p in weighings) >= 4, weighings
    assert all(n <= bound for n, bound, _ in weighings), [w for w in weighings if w[0] > w[1]]
    monkeypatch.setattr(OutcomeTracker, "reads_calibrated", lambda self, name, current: True)
    control = run()
    assert any(n > bound for n, bound, _ in control), control
