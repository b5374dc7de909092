"""Adaptive engine's exploration budget (issue 35, item 4): exploring is bounded over the run, so where nothing pays
the engine ends within 1 % of the best single policy, and where balancing pays it still weighs every candidate."""

from pathlib import Path

import numpy as np
import pytest

from ultraep.policies import AdaptivePolicy
from ultraep.policies.exploration import ExplorationBudget
from ultraep.sim import build_cost_model, sim_params, simulate
from ultraep.traces import load_trace
from ultraep.traces.synthetic import SyntheticSpec, resampled_trace, synthetic_trace

OLMOE = Path("/work/shared/data/OLMoE/expert_counts.json")
SINGLE = ("none", "eplb", "quota", "feplb", "hybridep")


def _best_over_adaptive(trace, topology="gb200-nvl72", options=None, ranks=8):
    """Σ predicted time of the best single policy / Σ of adaptive, replaying ``trace`` at EP ``ranks``, 2 slots."""
    cm = build_cost_model(topology, ranks, trace.meta.num_experts, 2, params=sim_params(dedup_top_k=trace.meta.top_k))
    res = simulate(trace, cm, (*SINGLE, "adaptive"), max_plans=None, policy_options=options)
    tot = {p: float(res.rows[p]["time_s"].sum()) for p in (*SINGLE, "adaptive")}
    best = min(SINGLE, key=tot.get)
    return best, tot[best] / tot["adaptive"], res


@pytest.mark.skipif(not OLMOE.exists(), reason="shared OLMoE data (/work/shared/data/OLMoE) is not available")
def test_on_real_routing_with_few_tokens_per_rank_adaptive_pays_nothing_for_exploring():
    """OLMoE's real per-domain popularity (64 experts, top-8), one 120-token sequence per rank per step, EP8 on one
    NVL72 rack: every balancing policy costs more than it saves. Bounded per decision, the engine's decision
    overhead and an occasional quota planner cost 1.5 % of the layer time; bounded over the run, 0.3 %."""
    src = load_trace(OLMOE, model="olmoe")
    tr = resampled_trace(src, num_ranks=8, tokens_per_rank=120, num_steps=40, steps_per_source_point=10, seed=0)
    best, ratio, res = _best_over_adaptive(tr)
    assert best == "none"
    assert ratio >= 0.99
    chosen = {d[3] for d in res.decisions["adaptive"]}
    assert chosen == {"none"}
    # the same engine with an unbounded budget (exploring paid on every decision, as before): more than 1 % lost —
    # the assertion above can fail
    _, unbounded, _ = _best_over_adaptive(tr, options={"adaptive": {"explore_share": 1e9}})
    assert unbounded < 0.99 < ratio


@pytest.mark.parametrize("tokens,imbalance,topology,ranks", [
    (120, (1.0, 1.05), "gb200-nvl72", 8),  # near-balanced, few tokens: none or eplb
    (8000, (1.5, 3.0), "gb200-nvl72", 8),  # skewed, many tokens: quota pays
    (2048, (1.2, 2.0), "h100-8x-ib", 16),  # two 8-GPU nodes: replicas stay inside a node
])
def test_other_trace_shapes_stay_within_1pct_of_the_best_single_policy(tokens, imbalance, topology, ranks):
    tr = synthetic_trace(SyntheticSpec(num_ranks=ranks, num_experts=64, num_layers=2, num_steps=40, top_k=8,
                                       tokens_per_rank=tokens, imbalance=imbalance, drift=0.05, seed=3))
    _, ratio, _ = _best_over_adaptive(tr, topology, ranks=ranks)
    assert ratio >= 0.99


def test_where_balancing_pays_the_engine_keeps_balancing_and_explores_within_its_budget():
    """8000 tokens per rank, skewed, EP8: feplb and quota both halve the layer time and take turns being the best.
    Planning quota on every decision while feplb is in force cost 1.4 % of the layer time (adaptive / best 0.989);
    paid from the budget it is planned when the budget allows, and the engine never falls back to none."""
    tr = synthetic_trace(SyntheticSpec(num_ranks=8, num_experts=64, num_layers=1, num_steps=30, top_k=8,
                                       tokens_per_rank=8000, imbalance=(2.5, 2.5), seed=1))
    best, ratio, res = _best_over_adaptive(tr)
    assert best != "none" and ratio >= 0.99 and "none" not in {d[3] for d in res.decisions["adaptive"]}
    _, unbounded, _ = _best_over_adaptive(tr, options={"adaptive": {"explore_share": 1e9}})
    assert unbounded < 0.99


def _loads(R=8, E=64, tokens=120, k=8, steps=60, skew=None, seed=0):
    rng = np.random.default_rng(seed)
    p = np.full(E, 1.0 / E) if skew is None else (np.arange(1, E + 1, dtype=float) ** -skew)[rng.permutation(E)]
    p /= p.sum()
    return [rng.multinomial(tokens * k, p, size=R).astype(np.int64) for _ in range(steps)]


def test_exploring_costs_at_most_its_share_of_the_run_where_nothing_pays():
    """Decision by decision, the engine's booked exploring never exceeds the budget by more than one decision's
    cost, and the engine's overhead over the run is within the share (plus the first decision)."""
    pre_cm = build_cost_model("gb200-nvl72", 8, 64, 2)
    pol = AdaptivePolicy(cost_model=pre_cm, probe_max_loss=0.0)
    engine, run = [], []
    for load in _loads():
        plan = pol.plan(load, pre_cm.topology)
        pol.commit(plan)
        engine.append(plan.engine_s)
        run.append(plan.info["adaptive"]["predicted_s"])
        b = pol.budget
        assert b.spent_s <= b.share * b.run_s + b.of_gain * b.saved_s + pre_cm.params.engine_overhead_s + 1.2e-4
    assert {plan.decision.chosen} == {"none"}
    assert sum(engine[1:]) <= pol.budget.share * sum(run) + pre_cm.params.engine_overhead_s


def test_skew_appearing_after_a_dormant_stretch_is_weighed_at_once():
    """Dormant with none in force (nothing pays on a uniform load), then the load turns hot: the most any plan could
    save now pays quota's planner, so it is planned on that very decision whatever the budget says."""
    cm = build_cost_model("gb200-nvl72", 8, 64, 2)
    pol = AdaptivePolicy(cost_model=cm, probe_max_loss=0.0, patience=1)
    for load in _loads(steps=20):
        plan = pol.plan(load, cm.topology)
        pol.commit(plan)
    assert plan.decision.reason.startswith("dormant") and pol.budget.free() < cm.params.engine_overhead_s
    hot = _loads(tokens=8192, skew=1.5, steps=1, seed=1)[0]
    plan = pol.plan(hot, cm.topology)
    assert "quota" in plan.decision.predictions
    assert plan.decision.chosen == "quota"


def test_budget_ledger():
    b = ExplorationBudget(share=0.01, of_gain=0.5)
    assert b.free() == 0.0
    b.charge(run_s=1.0, saved_s=0.2, spent_s=0.05)
    assert b.free() == pytest.approx(0.01 + 0.1 - 0.05)
    b.charge(run_s=1.0, saved_s=-1.0, spent_s=0.1)  # a negative saving books nothing
    assert b.free() == pytest.approx(0.02 + 0.1 - 0.15)
