"""The adaptive engine's exploration budget (issue 35, item 4): where nothing pays, weighing costs at most a
share of the run; where something pays, or a measured outcome could beat the policy in force, nothing changes.

Simulated time is deterministic, so the simulator checks pin ratios. The guard tests drive the engine with
synthetic measured outcomes as the runtime's engine feeds them (the reverted first budget froze the runtime on
eplb/feplb while quota measured faster: whatever the budget, the engine must end on the candidate that measures
fastest)."""


import numpy as np
import pytest

from shared_data import shared_path
from ultraep.cost import CostModel, CostParams
from ultraep.policies import AdaptivePolicy
from ultraep.presets import get_preset
from ultraep.sim import build_cost_model, sim_params, simulate
from ultraep.sim.workload import power_law_popularity
from ultraep.traces import load_trace
from ultraep.traces.synthetic import SyntheticSpec, resampled_trace, synthetic_trace

OLMOE = shared_path("data", "OLMoE", "expert_counts.json")
SINGLE = ("none", "eplb", "quota", "feplb", "hybridep")
BUDGETS = (None, 0.0, 0.003, 0.05)  # explore_share: unbounded, nothing, the default, generous


def _ratio(trace, cm, **adaptive) -> tuple[float, str, list]:
    """(adaptive / the best single policy in Σ simulated time, that policy, adaptive's decisions)."""
    opts = {"adaptive": adaptive} if adaptive else None
    res = simulate(trace, cm, (*SINGLE, "adaptive"), workers=1, max_plans=None, policy_options=opts)
    tot = {p: float(res.rows[p]["time_s"].sum()) for p in (*SINGLE, "adaptive")}
    best = min(SINGLE, key=tot.get)
    return tot["adaptive"] / tot[best], best, res.decisions["adaptive"]


@pytest.mark.skipif(not OLMOE.exists(), reason="shared OLMoE data (../shared/data/OLMoE) is not available")
def test_real_routing_with_few_tokens_per_rank_costs_under_one_percent():
    """OLMoE's recorded popularity at one 120-token sequence per rank per step, EP8: nothing pays; before the
    budget adaptive was 3.0 % slower than none (its decision overhead on every call)."""
    src = load_trace(OLMOE, model="olmoe")
    tr = resampled_trace(src, num_ranks=8, tokens_per_rank=120, num_steps=40, steps_per_source_point=10, seed=0)
    cm = build_cost_model("gb200-nvl72", 8, 64, 2, params=sim_params(dedup_top_k=8))
    ratio, best, decisions = _ratio(tr, cm)
    assert best == "none" and ratio <= 1.01, ratio
    assert sum(str(d[4]).startswith("idle") for d in decisions) > len(decisions) // 2
    unbounded, _, _ = _ratio(tr, cm, explore_share=None)
    assert unbounded > 1.02 > ratio  # the budget is what closes the gap


@pytest.mark.parametrize("tokens, imbalance", [(120, (1.5, 3.0)), (8000, (1.5, 3.0)), (8000, (1.0, 1.05))])
def test_other_trace_shapes_stay_within_one_percent_of_the_best(tokens, imbalance):
    """Skewed and near-balanced synthetic layers at few and many tokens per rank (bench_simulate's shapes, EP16
    to keep the test short): adaptive within 1 % of the best single policy, where that is quota or feplb too."""
    tr = synthetic_trace(SyntheticSpec(num_ranks=16, num_experts=64, num_layers=2, num_steps=60, top_k=8,
                                       tokens_per_rank=tokens, imbalance=imbalance, drift=0.05, seed=3))
    cm = build_cost_model("gb200-nvl72", 16, 64, 2, params=sim_params(dedup_top_k=8))
    ratio, best, _ = _ratio(tr, cm)
    assert ratio <= 1.01, (best, ratio)


# ---------------------------------------------------------------------------------------------- guards
def _cm(**params) -> CostModel:
    pre = get_preset("gb200-nvl72")
    return CostModel(pre.topology(32, 64, 2), pre.hardware, pre.expert, CostParams(**params) if params else None)


def _load(skew: float) -> np.ndarray:
    p = power_law_popularity(32, 64, skew, np.random.default_rng(0))
    return np.rint(np.outer(np.full(32, 8192 * 8), p)).astype(np.int64)


def _drive(pol, cm, load, measured, decisions: int) -> list[str]:
    """``decisions`` committed decisions; the chosen candidate's measured layer time is ``measured(i, name)``,
    fed back as the engine does (``observe_outcome`` with the calibrated prediction). Returns the decisions'
    ``info["adaptive"]``."""
    out = []
    for i in range(decisions):
        plan = pol.plan(load, cm.topology)
        pol.commit(plan)
        name = plan.info["adaptive"]["chosen"]
        pol.observe_outcome(name, pol.cost_model.predict(plan).total_s, measured(i, name))
        out.append(plan.info["adaptive"])
    return out


@pytest.mark.parametrize("share", BUDGETS)
def test_quota_measured_faster_after_the_warm_up_wins_whatever_the_budget(share):
    """The runtime's default shape: the first calls run slow whatever runs (quota probed then looks slow), the
    model prefers feplb, and after the warm-up quota measures 30 % faster than anything else. The engine must
    end on quota for every budget (the reverted budget stayed on eplb/feplb)."""
    cm = _cm(planner_s={"quota": 1e-3})  # the model sees quota's planner as costly (10.5 ms against feplb's 12.8)
    pol = AdaptivePolicy(cost_model=cm, explore_share=share, probe_every=16)
    load = _load(0.2)
    truth = {"none": 1.6e-2, "eplb": 1.5e-2, "feplb": 1.4e-2, "hybridep": 1.6e-2, "quota": 0.98e-2}
    chosen = [a["chosen"] for a in _drive(pol, cm, load, lambda i, n: truth[n] * (2.0 if i < 6 else 1.0), 160)]
    assert pol.current == "quota", chosen[-20:]
    assert chosen[-40:].count("quota") >= 36


@pytest.mark.parametrize("share", BUDGETS)
def test_with_none_in_force_a_candidate_measured_near_it_keeps_being_weighed(share):
    """With ``none`` in force and the budget spent, a candidate whose measured outcome is within probe range of
    none stays in contention when its probe is due: the engine probes it and finds it once it measures faster."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, explore_share=share, probe_every=16, candidates=("none", "quota"))
    load = _load(0.05)
    # quota measures 10 % slower than none for 60 decisions, then (the load's regime changed) 30 % faster
    slow = lambda i, n: 1e-2 * ((1.1 if i < 60 else 0.7) if n == "quota" else 1.0)  # noqa: E731
    chosen = [a["chosen"] for a in _drive(pol, cm, load, slow, 160)]
    assert pol.current == "quota", chosen[-20:]


def test_with_none_in_force_a_candidate_measured_slower_is_weighed_when_its_probe_is_due_not_in_between():
    """The runtime at 64 tokens per rank: ``none`` in force, quota measured 8 % slower (inside the probe range):
    weighing every decision until quota's next probe learned nothing and cost the runtime's adaptive 3.5 % over
    ``none``'s own run. Between quota's probes the decisions idle; quota is still probed, every period its probe's
    cost gives (``probe_regret``)."""
    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, probe_every=16, candidates=("none", "quota"))
    load = _load(0.05)
    out = _drive(pol, cm, load, lambda i, n: 1e-2 * (1.08 if n == "quota" else 1.0), 200)
    late = out[100:]
    assert pol.current == "none"
    weighed = [i for i, a in enumerate(late) if not a["idle"]]
    assert len(weighed) <= len(late) // 8, weighed  # about one weighing per probe period, not every decision
    probes = [i for i, a in enumerate(late) if a["chosen"] == "quota"]
    period = pol.schedule.period("quota", pol.schedule.pace.cost(1.08e-2, 1e-2))
    assert 16 < period <= 3 * 16  # 8 % over none: more than probe_every, paced
    assert probes and max(np.diff([-1, *probes, len(late)])) <= period + 2, (probes, period)  # still probed


def test_the_budget_only_ever_idles_the_fallback():
    """With a policy other than none in force the budget idles nothing, whatever it holds: a decision that does not
    weigh is a settled one (Step 0b, :mod:`ultraep.policies.settled`), and one in every SETTLED_REST weighs."""
    from ultraep.policies.settled import SETTLED_REST

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, explore_share=0.0, explore_of_gain=0.0)
    decisions = _drive(pol, cm, _load(1.0), lambda i, n: 1e-2 * (0.8 if n == "quota" else 1.0), 60)
    assert pol.current == "quota"
    assert not any(a["idle"] for a in decisions)
    weighed = [i for i, a in enumerate(decisions) if len(a["predictions"]) > 1]
    assert all(a["settled"] and a["chosen"] == "quota" for i, a in enumerate(decisions[1:], 1) if i not in weighed)
    assert max(np.diff([0, *weighed, len(decisions)])) <= SETTLED_REST


def test_idle_decisions_charge_nothing_and_keep_the_streaks():
    """Nothing pays (few tokens, near-balanced): once the budget is spent, decisions plan none alone with no
    engine overhead; the candidates' histories advance with the load and their losing streaks stand."""
    cm = build_cost_model("gb200-nvl72", 8, 64, 2, params=sim_params(dedup_top_k=8))
    rng = np.random.default_rng(1)
    pol = AdaptivePolicy(cost_model=cm)
    idle = []
    for i in range(60):
        load = rng.multinomial(120 * 8, np.full(64, 1 / 64), size=8).astype(np.int64)
        plan = pol.plan(load, cm.topology)
        a = plan.info["adaptive"]
        if a["idle"]:
            idle.append(i)
            assert a["chosen"] == "none" and plan.engine_s == 0.0 and set(a["predictions"]) == {"none"}
            streaks = dict(pol.schedule._lost)
        pol.commit(plan)
        if a["idle"]:
            assert pol.schedule._lost == streaks
    assert len(idle) > 30
    eplb = pol.policies["eplb"]
    assert len(eplb._history) == min(60, eplb.window)  # every load reached eplb's window, planned or not


def test_a_screened_candidates_floor_is_a_bound_not_an_estimate():
    """A floor (the least a screened candidate could take) at or above the fallback's time cannot win: it does not
    keep the budget in contention; the same figure as a weighed prediction (with a model error) does. A floor is
    refreshed at each screening until the candidate is weighed (at 64 tokens per rank quota's floor 65.4 ms within
    switch_now of none's 64.9 held the replay's budget in contention for 40 decisions, 2026-11-27)."""
    from ultraep.policies.exploration import ExplorationBudget

    b = ExplorationBudget()
    b.note({"none": 64.9e-3}, "none", set(), {"quota": 65.4e-3}, stake_s=0.0)
    assert not b.in_contention(["none", "quota"], "none", 64.9e-3, 0.0, max_loss=0.02)
    b.note({"none": 64.9e-3}, "none", set(), {"quota": 64.0e-3}, stake_s=0.0)  # refreshed: now below none
    assert b.in_contention(["none", "quota"], "none", 64.9e-3, 0.0, max_loss=0.02)
    b.note({"none": 64.9e-3, "quota": 65.4e-3}, "none", set(), {}, stake_s=0.0)  # weighed: an estimate
    assert b.in_contention(["none", "quota"], "none", 64.9e-3, 0.0, max_loss=0.02)
    b.note({"none": 64.9e-3}, "none", set(), {"quota": 70.0e-3}, stake_s=0.0)  # a weighed standing stays
    assert b.standing["quota"] == 65.4e-3


# ------------------------------------------------------------------------------- the probes' share (issue 56)
def _probes(probe_share, decisions=320):
    """Every rival measured within probe range of ``none`` (none in force: all of them due every ``probe_every``),
    the schedule at its shortest (probe_every 8, not paced by regret): ``(Step 5b probes, decisions, the ledger)``."""
    from ultraep.policies.exploration import ledger

    cm = _cm()
    pol = AdaptivePolicy(cost_model=cm, probe_every=8, probe_share=probe_share, probe_regret=None)
    truth = {"none": 1.0e-2, "quota": 1.05e-2, "eplb": 1.06e-2, "feplb": 1.04e-2, "hybridep": 1.07e-2}
    out = _drive(pol, cm, _load(0.05), lambda i, n: truth[n], decisions)
    probes = sum(bool(a["probe"]) and not a["confirm"] for a in out)
    return probes, len(out), ledger(pol.schedule, pol.budget), out


@pytest.mark.parametrize("share", [0.02, 0.05, 0.1])
def test_probes_stay_within_their_share_of_the_decisions(share):
    probes, n, spent, out = _probes(share)
    burst = 3 * 5  # FEW_RUNS per candidate
    assert probes <= share * n + burst, probes
    assert spent["probes"] == probes and spent["decisions"] == n
    assert spent["probe_share"] == pytest.approx(probes / n)
    assert probes >= share * n - 2  # the share is spent: the rivals are still measured
    assert {"quota", "eplb"} <= {a["chosen"] for a in out}  # (feplb and hybridep move nothing here: none stands in)
    # the probes' prediction over none's, summed: each probe predicted slower than none at its decision
    assert spent["probe_loss_s"] > 0


def test_without_a_share_the_schedule_probes_far_more():
    """Negative control: ``probe_share=None`` (the engine before issue 56) probes every due rival (here 76 of 320
    decisions against 31, 15 of them the candidates' first measurements)."""
    unbounded, n, _, _ = _probes(None)
    bounded, _, _, _ = _probes(0.05)
    assert unbounded > 0.05 * n + 15 and unbounded > 2 * bounded, (unbounded, bounded)


# ------------------------------------------------------------------------ resting idle decisions (issue 56)
def _idle_run(monkeypatch, loads, rest: int | None = None):
    """An engine deciding ``loads`` with adaptive (nothing measured): per decision ``(idle, ideal() calls,
    predict() calls, the decision)``; ``rest``: IDLE_REST for the run."""
    from ultraep.config import BalancerConfig
    from ultraep.engine import Engine
    import ultraep.policies.idle as idle_mod

    if rest is not None:
        monkeypatch.setattr(idle_mod, "IDLE_REST", rest)
    cm = build_cost_model("gb200-nvl72", 8, 64, 2, params=sim_params(dedup_top_k=8))
    calls = {"ideal": 0, "predict": 0}
    for name in calls:
        orig = getattr(CostModel, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(CostModel, name, counted)
    eng = Engine(BalancerConfig(policy="adaptive"), cm.topology, cost_model=cm)
    out = []
    for i, load in enumerate(loads):
        before = dict(calls)
        d = eng.decide(i, 0, 0, load)
        eng.commit(d)
        a = d.plan.info["adaptive"]
        out.append((a["idle"], calls["ideal"] - before["ideal"], calls["predict"] - before["predict"], d))
    return out


def _uniform_loads(n: int, tokens: int = 120, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.multinomial(tokens * 8, np.full(64, 1 / 64), size=8).astype(np.int64) for _ in range(n)]


def test_resting_idle_decisions_skip_the_ideal_and_the_engine_reads_the_policys_prediction(monkeypatch):
    """Nothing pays: most idle decisions rest on the last weighed verdict's stake and do not predict the ideal; each
    predicts ``none``'s plan on the calibrated and on the anchor model (one model here: nothing measured), and the
    engine records the policy's breakdown, equal to its own prediction of the plan. Negative controls: with IDLE_REST 1
    every idle decision predicts the ideal again; with ``breakdown_of`` answering nothing, the engine predicts the plan
    again."""
    from ultraep.policies.adaptive import AdaptivePolicy as Chooser
    from ultraep.policies.idle import IDLE_REST

    run = _idle_run(monkeypatch, _uniform_loads(80))
    idle = [r for r in run if r[0]]
    assert len(idle) > 40
    resting = [r for r in idle if r[1] == 0]
    assert len(resting) >= len(idle) * (IDLE_REST - 2) / IDLE_REST, [r[1] for r in idle]
    # none's plan predicted once: nothing was measured, so the calibrated model is the anchor model and one prediction
    # serves both (the decision's predictions are kept: Candidates.predict); the engine predicts nothing
    assert all(r[2] == 1 for r in resting)
    eng_cm = build_cost_model("gb200-nvl72", 8, 64, 2, params=sim_params(dedup_top_k=8))
    for _, _, _, d in idle:
        assert d.predicted.as_dict() == eng_cm.predict(d.plan).as_dict()
    control = [r for r in _idle_run(monkeypatch, _uniform_loads(80), rest=1) if r[0]]
    assert control and all(r[1] == 1 for r in control)
    monkeypatch.setattr(Chooser, "breakdown_of", lambda self, plan, cm: None)
    again = [r for r in _idle_run(monkeypatch, _uniform_loads(80), rest=IDLE_REST) if r[0] and r[1] == 0]
    assert again and all(r[2] == 2 for r in again)


def test_a_rest_ends_when_the_tokens_per_rank_move(monkeypatch):
    """A resting verdict holds only where it was weighed: the decision after the tokens per rank double weighs
    (the ideal again), and one where the busiest rank's share grows past ``switch_now`` does too."""
    loads = _uniform_loads(60)
    run = _idle_run(monkeypatch, loads)
    i = next(k for k in range(20, 59) if run[k][0] and run[k][1] == 0 and run[k + 1][0])  # resting, then idle
    moved = [*loads[:i + 1], loads[i + 1] * 2]
    assert _idle_run(monkeypatch, moved)[-1][1] >= 1
    skewed = loads[i + 1].copy()
    skewed[:, 0] += 300  # expert 0's rank gets 300 more tokens from every source
    assert _idle_run(monkeypatch, [*loads[:i + 1], skewed])[-1][1] >= 1
    assert _idle_run(monkeypatch, loads[:i + 2])[-1][1] == 0  # negative control: the load as it was rests
