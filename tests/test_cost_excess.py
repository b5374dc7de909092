"""A prediction is the mean time of the calls it stands for (``CostParams.excess_s``, :func:`ultraep.cost.with_excess`).

The calibrator learns each term's scale in log space: robust to a slow call, right at the typical call, short of the
mean where the calls' times are heavy-tailed (the all-to-alls on gloo). The excess, the calls' mean over their terms,
is added where a prediction stands for a time (the call's recorded prediction, its decision's predictions) and left
out of the comparison of candidates, so that the engine decides exactly as without it.

Driven as the runtime's engine drives it (:class:`~ultraep.engine.Engine`, calibration included): every decision
committed, the call's measured terms and layer time fed back, from the terms' prediction (``terms_s``) times a
seeded heavy-tailed factor (a log-normal of sigma 0.4: mean 1.083 at a geometric mean of 1)."""

from __future__ import annotations

import numpy as np
import pytest

from ultraep.config import AdaptiveOptions, BalancerConfig
from ultraep.cost import CostModel, calibrator, with_excess
from ultraep.engine import Engine
from ultraep.presets import get_preset
from ultraep.sim.workload import power_law_popularity

SIGMA = 0.4


def _engine(policy: str) -> Engine:
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(8, 32, 2), pre.hardware, pre.expert)
    layers = {0: AdaptiveOptions()} if policy == "adaptive" else {}
    return Engine(BalancerConfig(policy=policy, layers=layers), cm.topology, cost_model=cm, record_timings=False)


def _drive(eng: Engine, calls: int, seed: int = 0, slow_first: int = 0) -> list[dict]:
    """``calls`` decisions on skewed loads whose skew drifts, each observed; per call: what was chosen and why, the
    recorded prediction, the terms' prediction, the decision's predictions, the measured time and the excess then."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(calls):
        skew = 0.2 + 1.2 * (i % 100) / 100
        load = rng.multinomial(2048 * 4, power_law_popularity(8, 32, skew, rng), size=8).astype(np.int64)
        d = eng.decide(i, 0, 0, load)
        eng.commit(d)
        f = float(np.exp(rng.normal(0.0, SIGMA))) * (3.0 if i < slow_first else 1.0)
        bd = d.predicted
        meas = {k: v * f for k, v in bd.as_dict().items() if k in ("compute_fwd_s", "a2a_fwd_s", "compute_bwd_s")}
        eng.observe(i, 0, 0, meas, measured_total_s=bd.terms_s * f)
        out.append({"chosen": d.chosen, "reason": d.reason, "predicted": bd.total_s, "terms": bd.terms_s,
                    "predictions": dict(d.predictions), "measured": bd.terms_s * f,
                    "excess": eng.cost_model_for(0).params.excess_s})
    return out


def test_the_recorded_prediction_is_the_mean_of_heavy_tailed_calls():
    """Past the first 100 calls, the recorded predictions sum within 3 % of the measured times (a window's error, as
    ``benchmarks/bench_long.py`` reports it); the terms alone fall short by more than 4 %."""
    calls = _drive(_engine("quota"), 400)[100:]
    measured = sum(c["measured"] for c in calls)
    assert sum(c["predicted"] for c in calls) / measured == pytest.approx(1.0, abs=0.03)
    assert sum(c["terms"] for c in calls) / measured < 0.96  # (the control: what the excess adds)


def test_the_excess_leaves_every_decision_as_it_was(monkeypatch):
    """The same calls, with and without an excess (its weight set to 0): the same choices and reasons at every
    decision; its predictions and the recorded one are moved by the excess alone, the same for every candidate."""
    got = _drive(_engine("adaptive"), 200, seed=1)
    monkeypatch.setattr(calibrator, "EXCESS_WEIGHT", 0.0)
    base = _drive(_engine("adaptive"), 200, seed=1)
    assert [(c["chosen"], c["reason"]) for c in got] == [(c["chosen"], c["reason"]) for c in base]
    assert len({c["chosen"] for c in got}) > 1  # (the decisions compared are not all the same)
    assert all(c["excess"] == 0.0 for c in base) and max(abs(c["excess"]) for c in got) > 0
    for g, b in zip(got[1:], base[1:]):
        e = g["predicted"] - g["terms"]  # the excess the call was predicted with
        assert g["terms"] == pytest.approx(b["terms"], rel=1e-9) and g["predicted"] == pytest.approx(b["predicted"] + e)
        assert g["predictions"] == pytest.approx({k: v + e for k, v in b["predictions"].items()}, rel=1e-9)


def test_a_layers_first_calls_teach_no_excess():
    """Its first EXCESS_WARMUP measured calls (3x slower here) leave the excess at 0; the next one moves it by
    EXCESS_WEIGHT of its own excess."""
    eng = _engine("quota")
    calls = _drive(eng, calibrator.EXCESS_WARMUP + 1, slow_first=calibrator.EXCESS_WARMUP)
    assert [c["excess"] for c in calls[:-1]] == [0.0] * calibrator.EXCESS_WARMUP
    last = calls[-1]
    assert last["excess"] == pytest.approx(calibrator.EXCESS_WEIGHT * (last["measured"] - last["terms"]))


def test_with_excess_moves_the_total_and_nothing_else():
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(8, 32, 2), pre.hardware, pre.expert)
    rng = np.random.default_rng(0)
    load = rng.multinomial(2048 * 4, power_law_popularity(8, 32, 1.0, rng), size=8).astype(np.int64)
    bd = cm.ideal(load)
    assert with_excess(bd, 0.0) is bd
    t = bd.total_s
    up = with_excess(bd, 0.2 * t)
    assert (up.total_s, up.fwd_s, up.excess_s, up.terms_s) == pytest.approx(
        (1.2 * t, bd.fwd_s + 0.2 * t, 0.2 * t, t))
    assert with_excess(up, -0.1 * t).total_s == pytest.approx(0.9 * t)  # replaced, not added twice
    assert with_excess(up, -10.0).total_s == pytest.approx(0.5 * t)  # never below half the terms
    assert {k: v for k, v in up.as_dict().items() if k not in ("total_s", "fwd_s", "excess_s")} == \
        {k: v for k, v in bd.as_dict().items() if k not in ("total_s", "fwd_s", "excess_s")}


def test_a_call_far_off_its_terms_teaches_no_excess():
    """A call measured more than EXCESS_RANGE times off its terms' prediction (a layer whose scales came from two calls
    predicted a 0.16 s call at 31 s) leaves the excess as it was; one within moves it by EXCESS_WEIGHT of its excess."""
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(8, 32, 2), pre.hardware, pre.expert)
    rng = np.random.default_rng(0)
    bd = cm.ideal(rng.multinomial(2048 * 4, power_law_popularity(8, 32, 1.0, rng), size=8).astype(np.int64))
    t = bd.terms_s
    for measured in (t / (calibrator.EXCESS_RANGE * 1.01), t * calibrator.EXCESS_RANGE * 1.01, t / 200):
        assert calibrator.excess_after(1e-4, bd, measured) == 1e-4
    assert calibrator.excess_after(1e-4, bd, 1.5 * t) == pytest.approx(
        (1 - calibrator.EXCESS_WEIGHT) * 1e-4 + calibrator.EXCESS_WEIGHT * 0.5 * t)


def test_a_negative_excess_never_hides_a_measured_outcome():
    """With an excess far below the calls' terms (-10 s, as a broken prediction once taught it), a prediction stays at
    half its terms or more, and every measured call of the policy the engine ran still counts as its run: the
    negative control of 26 calls in a row confirming a rival "not measured yet" (64 tokens per rank, 2 gloo ranks)."""
    eng = _engine("adaptive")
    eng.calibrator.model = eng.calibrator.model.with_params(eng.calibrator.params.model_copy(update={"excess_s": -10.0}))
    eng._models.clear()
    rng = np.random.default_rng(3)
    outcomes = eng.policy_for(0).outcomes
    for i in range(12):
        load = rng.multinomial(2048 * 4, power_law_popularity(8, 32, 1.0, rng), size=8).astype(np.int64)
        d = eng.decide(i, 0, 0, load)
        eng.commit(d)
        assert d.predicted.total_s >= 0.5 * d.predicted.terms_s > 0
        assert all(v > 0 for v in d.predictions.values())
        before = outcomes.runs(d.chosen)
        eng.observe(i, 0, 0, {}, measured_total_s=d.predicted.terms_s)
        if i >= 3:  # (past the outcomes' warm-up)
            assert outcomes.runs(d.chosen) == before + 1, (i, d.chosen, d.reason)
