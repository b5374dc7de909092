"""Cost model: unit sanity (hand-derived seconds), monotonicity, overlap rules, calibration, presets."""

import math

import numpy as np
import pytest

from ultraep.cost import Calibrator, CostModel, CostParams
from ultraep.errors import ConfigError
from ultraep.policies import make_policy
from ultraep.policies.base import assemble_plan, identity_plan
from ultraep.presets import PRESETS, get_preset, parse_overrides
from ultraep.topology import LinkSpec


def _cm(preset="gb200-nvl72", R=64, E=128, N=2, params=None, **ov):
    pre = get_preset(preset, ov or None)
    return CostModel(pre.topology(R, E, N), pre.hardware, pre.expert, params)


def _uniform(R, E, per_rank_tokens):
    # every source sends the same count to every expert
    return np.full((R, E), per_rank_tokens // E, dtype=np.int64)


def test_ideal_matches_hand_derived_seconds():
    # gb200: peak 2500 TFLOP/s, efficiency 0.53, half tokens 128; Qwen3-235B expert 3*4096*1536 params.
    cm = _cm()
    R, E = 64, 128
    load = _uniform(R, E, 65536)  # 8192 tokens x top-8 per rank
    bd = cm.ideal(load)
    flops = 2 * 3 * 4096 * 1536
    per_rank = 65536.0
    expected_compute = (per_rank + 128 * 2) * flops / (2500e12 * 0.53)  # 2 masters per rank, all active
    assert bd.compute_fwd_s == pytest.approx(expected_compute, rel=1e-9)
    # all ranks in one NVLink domain: each sends 63/64 of its assignments, 8 KiB each, at 0.7 x 900 GB/s.
    sent = per_rank * 63 / 64 * 4096 * 2
    expected_dispatch = sent / (900e9 * 0.7) + 3e-6
    assert bd.a2a_fwd_s == pytest.approx(2 * expected_dispatch, rel=1e-9)
    # the UltraEP paper's Qwen3-235B ideal (Fig. 13): 1.89 ms compute, 1.68 ms all-to-all per layer forward
    assert bd.compute_fwd_s == pytest.approx(1.89e-3, rel=0.02)
    assert bd.a2a_fwd_s == pytest.approx(1.68e-3, rel=0.02)
    assert bd.total_s == pytest.approx(bd.fwd_s + bd.bwd_s)
    assert bd.compute_bwd_s == pytest.approx(2 * bd.compute_fwd_s)
    assert bd.imbalance == pytest.approx(1.0)


def test_identity_plan_equals_ideal_on_uniform_load():
    cm = _cm()
    load = _uniform(64, 128, 65536)
    plan = identity_plan("none", cm.topology, load)
    assert cm.predict(plan).total_s == pytest.approx(cm.ideal(load).total_s, rel=1e-9)


def test_compute_increases_with_hot_rank_load():
    cm = _cm()
    load = _uniform(64, 128, 65536)
    prev = cm.predict(identity_plan("none", cm.topology, load)).total_s
    for extra in (1000, 10000, 100000):
        hot = load.copy()
        hot[:, 0] += extra // 64  # expert 0 lives on rank 0
        t = cm.predict(identity_plan("none", cm.topology, hot)).total_s
        assert t > prev
        prev = t


def test_more_bandwidth_never_slower_and_bigger_experts_sync_longer():
    load = _uniform(16, 64, 16384)
    load[:, 0] *= 8
    times = []
    for bw in (10.0, 50.0, 200.0):
        cm = _cm("h100-8x-ib", 16, 64, 2, scale_out={"bandwidth_GBps": bw})
        times.append(cm.predict(identity_plan("none", cm.topology, load)).total_s)
    assert times[0] > times[1] > times[2]
    syncs = []
    for hidden in (1024, 2048, 4096):
        cm = _cm("h100-8x-ib", 16, 64, 2, expert={"hidden_size": hidden})
        plan = make_policy("quota").plan(load, cm.topology)
        assert plan.num_replicas > 0
        syncs.append(cm.predict(plan).weight_sync_s)
    assert syncs[0] < syncs[1] < syncs[2]


def test_weight_sync_is_busiest_sender_per_stage():
    cm = _cm()
    t = cm.topology
    load = _uniform(64, 128, 65536)
    # expert 0 (home rank 0) replicated on ranks 1..3: rank 0 sends 3 copies directly (domain of 64 > 8
    # ranks, but 3 replicas < 4 use no relay).
    e = np.zeros(3, dtype=np.int64)
    r = np.array([1, 2, 3])
    s = np.full(3, t.num_masters)
    q = np.full(3, 100)
    plan = assemble_plan("quota", t, load, e, r, s, q)
    expected = 3 * t.expert_bytes / (900e9 * 0.78) + 3e-6
    assert cm.predict(plan).weight_sync_s == pytest.approx(expected, rel=1e-9)


def test_prefill_has_no_backward_and_grad_reduce_hides_behind_backward():
    load = _uniform(64, 128, 65536)
    load[:, :4] *= 6
    plan = make_policy("quota").plan(load, _cm().topology)
    train = _cm().predict(plan)
    prefill = _cm(params=CostParams(mode="prefill")).predict(plan)
    assert prefill.bwd_s == 0 and prefill.total_s == pytest.approx(prefill.fwd_s)
    assert train.grad_reduce_s > 0 and train.grad_reduce_exposed_s == 0  # hidden behind backward compute
    slow = _cm(params=CostParams(grad_reduce_scale=1000.0)).predict(plan)
    assert slow.grad_reduce_exposed_s > 0 and slow.total_s > train.total_s


def test_feplb_copies_hide_behind_static_compute():
    cm = _cm("h100-8x-ib", 8, 32, 1)
    load = _uniform(8, 32, 32768)
    load[:, 0] *= 4
    plan = make_policy("feplb").plan(load, cm.topology)
    assert plan.static_overlap and plan.num_replicas > 0
    bd = cm.predict(plan)
    assert bd.weight_sync_s > 0
    assert bd.sync_exposed_s < bd.weight_sync_s  # the static experts' compute covers most of the copy


def test_calibration_ewma_of_log_ratio_and_records_pairs():
    class FakeRecorder:
        def __init__(self):
            self.rows = []

        def record_timings(self, step, mb, layer, timings):
            self.rows.append((step, mb, layer, timings))

    cm = _cm()
    load = _uniform(64, 128, 65536)
    bd = cm.ideal(load)
    rec = FakeRecorder()
    cal = Calibrator(cm, alpha=0.5, recorder=rec)
    rows = cal.observe(bd, {"compute_fwd_s": 2 * bd.compute_fwd_s, "a2a_fwd_s": bd.a2a_fwd_s}, step=3, layer=1)
    # the first observation of a term weighs 1/1 (a running mean first): s = 2; a2a measured = predicted
    assert cal.params.compute_scale == pytest.approx(2.0)
    assert cal.params.a2a_scale == pytest.approx(1.0)
    # the second weighs max(alpha, 1/2) = 0.5: log s = 0.5 * log 2 + 0.5 * log 1 -> s = sqrt(2)
    cal.observe(cal.model.ideal(load), {"compute_fwd_s": cm.ideal(load).compute_fwd_s})
    assert cal.params.compute_scale == pytest.approx(math.sqrt(2))
    assert {r["term"] for r in rows} == {"compute_fwd_s", "a2a_fwd_s"}
    step, mb, layer, timings = rec.rows[0]
    assert (step, layer) == (3, 1)
    assert timings["measured.compute_fwd_s"] == pytest.approx(2 * timings["predicted.compute_fwd_s"])
    # repeated observations converge on the true ratio
    for _ in range(30):
        bd = cal.model.ideal(load)
        cal.observe(bd, {"compute_fwd_s": 2 * cm.ideal(load).compute_fwd_s})
    assert cal.params.compute_scale == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(ConfigError, match="alpha"):
        Calibrator(cm, alpha=0.0)


def test_presets_overrides_and_errors():
    assert set(PRESETS) >= {"h100-8x-ib", "gb200-nvl72", "cross-dc"}
    assert PRESETS["cross-dc"].scale_out.bandwidth_GBps == pytest.approx(1.25)  # 10 Gb/s
    assert PRESETS["gb200-nvl72"].domain_for(256) == 64 and PRESETS["gb200-nvl72"].domain_for(64) == 64
    t = PRESETS["h100-8x-ib"].topology(32, 64, 2)
    assert t.D == 8 and t.scale_out == LinkSpec(bandwidth_GBps=50.0, latency_us=8.0)
    assert t.expert_bytes == 3 * 4096 * 1536 * 2
    pre = get_preset("cross-dc", parse_overrides(["scale_out.bandwidth_GBps=5", "expert.hidden_size=512"]))
    assert pre.scale_out.bandwidth_GBps == 5 and pre.expert.hidden_size == 512
    with pytest.raises(ConfigError, match="unknown preset 'nvl9'.*available: cross-dc, gb200-nvl72, h100-8x-ib, hybridep-a800"):
        get_preset("nvl9")
    with pytest.raises(ConfigError) as exc:
        get_preset("cross-dc", {"scale_out": {"bandwidth_GBps": -1}})
    assert exc.value.path == "topology.scale_out.bandwidth_GBps" and exc.value.value == -1
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["scale_out.bandwidth_GBps"])


def test_token_dedup_per_destination_rank_and_domain():
    """With the router's top-k, a token is sent once per destination rank inside a domain and once per destination
    domain across domains (DeepEP), estimated from counts with independent choices: distinct = T·(1 − Π(1 − x/T))."""
    D_ov = {"domain_size": 2, "ranks_per_node": 2}
    pairs = _cm("h100-8x-ib", 4, 8, 0, **D_ov)
    dedup = _cm("h100-8x-ib", 4, 8, 0, params=CostParams(dedup_top_k=2), **D_ov)
    load = np.zeros((4, 8), dtype=np.int64)
    load[0, [0, 2, 3, 4, 6]] = [4, 6, 4, 5, 1]  # source 0: 20 assignments = 10 tokens of top-2
    plan = identity_plan("none", pairs.topology, load)
    tp, td = pairs.traffic(plan), dedup.traffic(plan)
    # rank 1 (same domain) holds experts 2, 3: 10 + 0 pairs, 10·(1 − 0.4·0.6) = 7.6 tokens
    assert tp.send_RL[0, 0] == 10 and td.send_RL[0, 0] == pytest.approx(7.6)
    assert td.recv_RL[1, 0] == pytest.approx(7.6)
    # domain 1 (ranks 2, 3: experts 4 and 6) gets each token once, at rank 2 (source 0's in-domain offset)
    assert tp.send_RL[0, 1] == 6 and td.send_RL[0, 1] == pytest.approx(10 * (1 - 0.5 * 0.9))
    assert td.recv_RL[2, 1] == pytest.approx(5.5) and td.recv_RL[3, 1] == 0
    # the force-balanced ideal uses the same estimate: a uniform load is its own ideal, with or without dedup
    uni = _uniform(16, 64, 8 * 64 * 4)
    for cm in (_cm("h100-8x-ib", 16, 64, 0), _cm("h100-8x-ib", 16, 64, 0, params=CostParams(dedup_top_k=8))):
        mine = cm.traffic(identity_plan("none", cm.topology, uni))
        ideal = cm.predict(identity_plan("none", cm.topology, uni)).a2a_fwd_s
        assert ideal == pytest.approx(cm.ideal(uni).a2a_fwd_s, rel=0.02)
        assert mine.send_RL.sum() > 0
    # dedup lowers the all-to-all, most across domains (8 masters per node here)
    none_p = pairs.predict(plan).a2a_fwd_s
    none_d = dedup.predict(plan).a2a_fwd_s
    assert none_d < none_p


def test_scale_out_link_shared_per_domain():
    """A datacenter's WAN link is one link for its 8 GPUs (HybridEP's setting): the scale-out leg then carries the
    whole domain's bytes, 8x what a per-GPU NIC of the same bandwidth would."""
    from ultraep.sim import build_cost_model

    cm = build_cost_model("cross-dc", 16, 64, 0)
    assert cm.params.scale_out_shared and not build_cost_model("h100-8x-ib", 16, 64, 0).params.scale_out_shared
    per_gpu = cm.with_params(cm.params.model_copy(update={"scale_out_shared": False}))
    load = _uniform(16, 64, 1 << 20)
    plan = identity_plan("none", cm.topology, load)
    lat = 2 * 500e-6  # dispatch + combine latency
    ratio = (cm.predict(plan).a2a_fwd_s - lat) / (per_gpu.predict(plan).a2a_fwd_s - lat)
    assert ratio == pytest.approx(8.0, rel=1e-6)


def test_calibration_learns_the_runtimes_call_overhead_and_the_engines_own():
    """Two additive terms (seconds, not scales): the call's layer time minus its measured terms, and an engine
    decision's measured plan_s minus the planner figures the model charges it."""
    import dataclasses

    from ultraep.cost import call_residual

    cm = _cm()
    bd = cm.ideal(_uniform(64, 128, 65536))
    measured = {"compute_fwd_s": 0.010, "compute_bwd_s": 0.020, "a2a_fwd_s": 0.004, "a2a_bwd_s": 0.003,
                "copy_s": 0.001, "plan_s": 0.0005, "weight_sync_s": 0.5}  # the flight time is not on the path
    # 0.050 - (0.010 + 0.020 + 0.004 + 0.003 + 0.001 + 0.0005) = 0.0115
    assert call_residual(measured, 0.050) == pytest.approx(0.0115)
    assert call_residual(measured, 0.030) == 0.0  # never negative
    cal = Calibrator(cm, alpha=0.5)
    rows = cal.observe(bd, measured, total_s=0.050)
    assert cal.params.call_overhead_s == pytest.approx(0.0115)  # the first observation weighs 1
    assert any(r["term"] == "call_overhead_s" and r["measured_s"] == pytest.approx(0.0115) for r in rows)
    cal.observe(cal.model.ideal(_uniform(64, 128, 65536)), measured, total_s=0.040)  # weight 1/2: (0.0115+0.0015)/2
    assert cal.params.call_overhead_s == pytest.approx(0.0065)
    # the model charges it on every call, the ideal included
    without = cal.model.with_params(cal.params.model_copy(update={"call_overhead_s": 0.0}))
    load = _uniform(64, 128, 65536)
    assert cal.model.ideal(load).total_s == pytest.approx(without.ideal(load).total_s + 0.0065)
    # an engine's decision: 2 ms measured, 0.3 ms planning of the chosen, 0.5 ms of candidates planned beyond it
    plan_scale = cal.params.plan_scale
    eng = dataclasses.replace(bd, plan_s=0.0003, engine_s=cal.params.engine_overhead_s + 0.0005)
    cal.observe(eng, {"plan_s": 0.002})
    assert cal.params.engine_overhead_s == pytest.approx(0.002 - 0.0003 - 0.0005)
    assert cal.params.plan_scale == plan_scale  # left to the fixed plans


def test_calls_that_move_expert_weights_learn_their_own_call_overhead():
    """A call that moves expert weights posts the weight and gradient sends; its residual is kept apart from that of
    the calls that move none, and the model charges the difference only to plans that move weights."""
    cm = _cm(R=8, E=16)
    rng = np.random.default_rng(0)
    load = rng.zipf(1.6, size=(8, 16)).clip(max=400).astype(np.int64) * 8
    none = cm.predict(identity_plan("none", cm.topology, load))
    quota = cm.predict(make_policy("quota").plan(load, cm.topology))
    assert quota.weight_sync_s > 0 and none.weight_sync_s == 0 and none.copy_s == 0
    terms = {"compute_fwd_s": 0.010, "compute_bwd_s": 0.020}
    cal = Calibrator(cm, alpha=0.5)
    cal.observe(quota, terms, total_s=0.040)  # residual 10 ms; only moving calls so far: it stands for every call
    assert cal.params.call_overhead_s == pytest.approx(0.010) and cal.params.transfer_call_overhead_s == 0.0
    cal.observe(none, terms, total_s=0.036)  # residual 6 ms: the plain calls' own
    assert cal.params.call_overhead_s == pytest.approx(0.006)
    assert cal.params.transfer_call_overhead_s == pytest.approx(0.004)
    cal.observe(quota, terms, total_s=0.044)  # weight 1/2 within its kind: (10 + 14) / 2 = 12 ms
    assert cal.params.call_overhead_s == pytest.approx(0.006)
    assert cal.params.transfer_call_overhead_s == pytest.approx(0.006)
    # charged to the plans that move weights only
    base = cal.model.with_params(cal.params.model_copy(update={"call_overhead_s": 0.0,
                                                                "transfer_call_overhead_s": 0.0}))
    plans = {"none": identity_plan("none", cm.topology, load), "quota": make_policy("quota").plan(load, cm.topology)}
    got = {k: cal.model.predict(v) for k, v in plans.items()}
    assert got["none"].total_s == pytest.approx(base.predict(plans["none"]).total_s + 0.006)
    assert got["quota"].total_s == pytest.approx(base.predict(plans["quota"]).total_s + 0.012)
    assert got["quota"].call_overhead_s == pytest.approx(0.012)
    # the sum is never negative: moving calls cheaper than the plain ones by more than the plain overhead
    neg = cal.model.with_params(cal.params.model_copy(update={"transfer_call_overhead_s": -0.5}))
    assert neg.predict(plans["quota"]).call_overhead_s == 0.0


def test_replica_copies_learn_a_part_per_call_and_a_part_per_byte():
    """The host runtime's copies cost a part per call (posting the sends) and a part per byte; fitted as a line over
    calls that copy different bytes, they predict a plan of either size. Calls of one size cannot tell the parts
    apart: the per-call part learned stays. A model without host copies (a GPU's) learns nothing."""
    from ultraep.cost import CostBreakdown

    base = _cm(R=2, E=8)
    per_byte = 0.002 / (2 * (base.expert_bytes + base.grad_bytes))  # 2 experts' weights and gradients: 2 ms
    cm = base.with_params(base.params.model_copy(update={"copy_s_per_byte": per_byte}))
    two, four = np.array([2.0, 2.0]), np.array([4.0, 4.0])
    assert cm.copy_bytes_time(two) == pytest.approx(0.002) and cm.copy_bytes_time(four) == pytest.approx(0.004)

    def measured(moves):  # 5 ms a call and half the per-byte seed
        return 0.005 + 0.5 * cm.copy_bytes_time(moves)

    cal = Calibrator(cm, alpha=0.2)
    for _ in range(3):  # one size only: through the origin, nothing known of a part per call
        cal.observe(CostBreakdown(copy_s=cal.model.copy_bytes_time(two), moves_R=two), {"copy_s": measured(two)})
    assert cal.params.copy_call_s == 0.0 and cal.params.copy_scale == pytest.approx(0.006 / 0.002)
    for i in range(12):  # both sizes: the line
        moves = four if i % 2 else two
        cal.observe(CostBreakdown(copy_s=0.001, moves_R=moves), {"copy_s": measured(moves)})
    assert cal.params.copy_call_s == pytest.approx(0.005) and cal.params.copy_scale == pytest.approx(0.5)
    for moves in (two, four):
        assert cal.model.copy_time(None, moves_R=moves) == pytest.approx(measured(moves))
    for _ in range(40):  # one size again: the older calls fade out, the line stays
        cal.observe(CostBreakdown(copy_s=0.001, moves_R=four), {"copy_s": measured(four)})
    assert cal.params.copy_call_s == pytest.approx(0.005) and cal.params.copy_scale == pytest.approx(0.5)
    for _ in range(60):  # then 10 % slower: the part per call stays, the scale takes the rest
        cal.observe(CostBreakdown(copy_s=0.001, moves_R=four), {"copy_s": 1.1 * measured(four)})
    assert cal.params.copy_call_s == pytest.approx(0.005)
    assert cal.params.copy_scale == pytest.approx((1.1 * measured(four) - 0.005) / 0.004, rel=1e-3)
    before = cal.params
    cal.observe(CostBreakdown(copy_s=0.001, moves_R=two), {"copy_s": 0.0})  # nothing measured: nothing learned
    assert cal.params == before
    gpu = Calibrator(base, alpha=0.2)  # copy_s_per_byte 0: the copies overlap, no term to learn
    gpu.observe(CostBreakdown(copy_s=0.0, moves_R=None), {"copy_s": 0.004})
    assert gpu.params.copy_call_s == 0.0 and gpu.params.copy_scale == 1.0


def test_a_weight_flight_hidden_behind_the_compute_only_lowers_its_scale():
    """The runtime's flight of replica weights is post -> first seen complete, and it looks only when it waits:
    a flight that ended inside the forward's all-to-all plus compute is an upper bound of the transfer."""
    import dataclasses

    cm = _cm()
    bd = dataclasses.replace(cm.ideal(_uniform(64, 128, 65536)), weight_sync_s=0.010)
    cal = Calibrator(cm, alpha=0.5)
    hidden = {"a2a_fwd_s": 0.02, "compute_fwd_s": 0.3}
    cal.observe(bd, {**hidden, "weight_sync_s": 0.2})  # 0.2 s <= 0.32 s: the wait came first, nothing learned
    assert cal.params.weight_sync_scale == 1.0
    cal.observe(bd, {**hidden, "weight_sync_s": 0.005})  # a smaller upper bound still lowers it (weight 1)
    assert cal.params.weight_sync_scale == pytest.approx(0.5)
    bd = dataclasses.replace(bd, weight_sync_s=0.005)
    cal.observe(bd, {**hidden, "weight_sync_s": 0.64})  # longer than the window: the wait blocked, a measurement
    assert cal.params.weight_sync_scale == pytest.approx(math.exp(0.5 * math.log(0.5) + 0.5 * math.log(64.0)))



def test_a_flight_complete_at_its_post_lowers_the_scale_until_the_copy_is_hidden():
    """A flight of 0 s: the copies were complete when posted, nothing was waited for; a prediction that exposes part
    of the copy has too large a scale. One that exposes none learns nothing from it."""
    import dataclasses

    cm = _cm()
    bd = dataclasses.replace(cm.ideal(_uniform(64, 128, 65536)), weight_sync_s=0.010, sync_exposed_s=0.006)
    cal = Calibrator(cm, alpha=0.5)
    cal.observe(bd, {"a2a_fwd_s": 0.002, "compute_fwd_s": 0.003, "weight_sync_s": 0.0})
    assert cal.params.weight_sync_scale == pytest.approx(0.4)  # 4 ms of 10 were hidden; first observation: weight 1
    cal.observe(dataclasses.replace(bd, sync_exposed_s=0.0), {"a2a_fwd_s": 0.002, "compute_fwd_s": 0.003,
                                                              "weight_sync_s": 0.0})
    assert cal.params.weight_sync_scale == pytest.approx(0.4)  # hidden already: nothing to learn
    cal.observe(dataclasses.replace(bd, weight_sync_s=0.0), {"weight_sync_s": 0.0})  # no copy predicted: nothing
    assert cal.params.weight_sync_scale == pytest.approx(0.4)

def test_the_exposed_wait_bounds_the_exposure_and_a_blocked_wait_measures_the_flight():
    """The runtime's wait for the replica weights is what the critical path paid: a model exposing more than that has
    too large a scale (lowered to expose the wait); a flight the runtime blocked on is a measurement (it may rise);
    one it did not block on is an upper bound."""
    import dataclasses

    cm = _cm()
    bd = dataclasses.replace(cm.ideal(_uniform(64, 128, 65536)), weight_sync_s=0.010, sync_exposed_s=0.006)
    seen = {"a2a_fwd_s": 0.002, "compute_fwd_s": 0.003}
    cal = Calibrator(cm, alpha=1.0)
    cal.observe(bd, {**seen, "weight_sync_s": 0.020, "weight_wait_s": 0.0005})  # waited 0.5 ms, not 6
    assert cal.params.weight_sync_scale == pytest.approx((0.010 - 0.006 + 0.0005) / 0.010)
    cal = Calibrator(cm, alpha=1.0)
    rows = cal.observe(dataclasses.replace(bd, sync_exposed_s=0.0), {**seen, "weight_sync_s": 0.020,
                                                                     "weight_wait_s": 0.008})  # blocked 8 ms
    assert cal.params.weight_sync_scale == pytest.approx(2.0)
    assert {"term": "weight_wait_s", "predicted_s": 0.0, "measured_s": 0.008} in [
        {k: r[k] for k in ("term", "predicted_s", "measured_s")} for r in rows]
    cal = Calibrator(cm, alpha=1.0)
    cal.observe(dataclasses.replace(bd, sync_exposed_s=0.0), {**seen, "weight_sync_s": 0.020,
                                                              "weight_wait_s": 0.0001})  # not blocked: a bound
    assert cal.params.weight_sync_scale == 1.0
    cal.observe(dataclasses.replace(bd, sync_exposed_s=0.0), {**seen, "weight_sync_s": 0.004,
                                                              "weight_wait_s": 0.0})  # a bound below: lowers
    assert cal.params.weight_sync_scale == pytest.approx(0.4)

def test_an_instance_costs_its_half_tokens_forward_and_backward():
    """Every active instance costs ``half_tokens`` tokens of work beyond its rows in the forward, and
    ``backward_half_tokens`` in the backward (weight gradients written per instance); unset, the hardware's figure."""
    cm = _cm("h100-8x-ib", R=2, E=8, N=0)
    assert cm.half_tokens == cm.half_tokens_bwd == cm.hardware.gemm_half_tokens
    load = np.array([[600, 200, 100, 100, 50, 50, 50, 0], [500, 300, 100, 100, 50, 50, 50, 0]])
    plan = identity_plan("none", cm.topology, load)
    base = cm.predict(plan)
    np.testing.assert_allclose(base.rank_tokens_R, [2000, 300])
    np.testing.assert_allclose(base.instances_R, [4, 3])
    spt = cm.sec_per_token
    big = cm.with_params(cm.params.model_copy(update={"half_tokens": 100.0, "backward_half_tokens": 400.0}))
    bd = big.predict(plan)
    assert bd.compute_fwd_s == pytest.approx((2000 + 4 * 100) * spt)
    assert bd.compute_bwd_s == pytest.approx(2.0 * (2000 + 4 * 400) * spt)
    # the backward's unset: the forward's
    same = cm.with_params(cm.params.model_copy(update={"half_tokens": 100.0}))
    assert same.predict(plan).compute_bwd_s == pytest.approx(2.0 * same.predict(plan).compute_fwd_s)


@pytest.mark.parametrize("seed", range(20))
def test_the_per_instance_cost_is_recovered_from_the_fastest_and_slowest_rank(seed):
    from ultraep.cost import HALF_TOKENS_MIN_SPREAD, MAX_HALF_TOKENS, half_tokens_from_spread

    rng = np.random.default_rng(seed)
    R = int(rng.integers(2, 9))
    n = rng.uniform(100, 1000, R)
    n[0] = n.min() / 2  # spread enough to tell
    i = rng.integers(1, 7, R).astype(float)
    h = float(rng.uniform(0, 300))
    t = n + h * i
    a, b = int(np.argmax(n)), int(np.argmin(n))
    assert half_tokens_from_spread(n, i, float(t[a] / t[b])) == pytest.approx(h, rel=1e-9, abs=1e-9)
    even = np.full(R, 500.0)
    even[0] = 500.0 / (HALF_TOKENS_MIN_SPREAD - 0.01)
    assert half_tokens_from_spread(even, i, 1.2) is None  # about equal tokens: cannot tell
    assert half_tokens_from_spread(n, i, float("nan")) is None
    r_n, r_i = n[a] / n[b], i[a] / i[b]
    if abs(r_n - r_i) > 1e-6:
        # past the tokens' ratio, away from the instances': no per-instance cost explains it
        assert half_tokens_from_spread(n, i, float(r_n * (r_n / r_i) ** 0.1)) == 0.0
        # past the instances' ratio: only an unbounded one would, so the bound
        assert half_tokens_from_spread(n, i, float(r_i * (r_i / r_n) ** 0.5)) == MAX_HALF_TOKENS
    i2 = i.copy()
    i2[a] = i2[b] * r_n  # instances in the tokens' ratio: any h gives the same ratio
    assert half_tokens_from_spread(n, i2, float(r_n)) is None


def test_calibration_learns_the_per_instance_cost_from_uneven_calls_only():
    """The engine hands the calibrator the least busy rank's compute next to the slowest's: calls whose ranks carry
    unequal tokens teach the per-instance cost (here 300 tokens forward, 900 backward), even ones leave it."""
    cm = _cm("h100-8x-ib", R=2, E=8, N=0)
    uneven = identity_plan("none", cm.topology, np.array([[900, 100, 100, 100, 50, 50, 50, 50]] * 2) * 10)
    even = identity_plan("none", cm.topology, np.full((2, 8), 300))
    cal = Calibrator(cm, alpha=0.5)
    h0 = cm.half_tokens

    def truth(bd, hf, hb):
        spt = cal.model.sec_per_token * 1.5
        n, i = bd.rank_tokens_R, bd.instances_R
        f, b = (n + hf * i) * spt, 2.5 * (n + hb * i) * spt
        return {"compute_fwd_s": f.max(), "compute_bwd_s": b.max(), "compute_fwd_fastest_s": f.min(),
                "compute_bwd_fastest_s": b.min()}

    for _ in range(3):
        rows = cal.observe(cal.model.predict(even), truth(cal.model.predict(even), 300.0, 900.0))
        assert cal.model.half_tokens == h0 and cal.model.half_tokens_bwd == h0
        assert {"compute_fwd_fastest_s", "compute_bwd_fastest_s"} <= {r["term"] for r in rows}
    bd = cal.model.predict(uneven)
    cal.observe(bd, truth(bd, 300.0, 900.0))
    assert cal.params.half_tokens == pytest.approx(300.0) and cal.params.backward_half_tokens == pytest.approx(900.0)
    for _ in range(10):  # the scales settle on the new curve: the model predicts the uneven call as measured
        bd = cal.model.predict(uneven)
        cal.observe(bd, truth(bd, 300.0, 900.0))
    bd = cal.model.predict(uneven)
    m = truth(bd, 300.0, 900.0)
    assert bd.compute_fwd_s == pytest.approx(m["compute_fwd_s"], rel=0.02)
    assert bd.compute_bwd_s == pytest.approx(m["compute_bwd_s"], rel=0.02)

def test_a2a_over_a_shared_medium_takes_the_groups_bytes():
    """gloo ranks on one host move every byte through its loopback: the dispatch is the group's total bytes at the
    scale-up bandwidth, not the busiest rank's."""
    cm = _cm("h100-8x-ib", R=8, E=16, N=0)
    shared = cm.with_params(cm.params.model_copy(update={"a2a_shared_medium": True}))
    load = _uniform(8, 16, 16000)
    plan = identity_plan("none", cm.topology, load)
    tr = cm.traffic(plan)
    bw = cm.bw_L[0] * cm.a2a_eff
    assert shared.dispatch_time(tr) == pytest.approx(float(tr.send_RL.sum()) * cm.token_bytes / bw + cm.lat_L[0])
    assert shared.predict(plan).a2a_fwd_s > cm.predict(plan).a2a_fwd_s
    empty = identity_plan("none", cm.topology, np.zeros((8, 16), dtype=np.int64))
    assert shared.predict(empty).a2a_fwd_s == 0.0


def test_a_replica_costs_its_measured_extra_and_the_calibrator_learns_it():
    """The runtime's replicas cost more than their tokens (their own GEMM calls and weight views): the model
    charges ``replica_instance_s`` per active replica instance, forward and (times the factor) backward, and the
    calibrator learns it from the replicas' measured compute over every rank."""
    cm = _cm("h100-8x-ib", R=2, E=8, N=2)
    load = np.array([[4000, 100, 100, 100, 100, 100, 100, 100]] * 2)
    plan = make_policy("quota").plan(load, cm.topology)
    bd = cm.predict(plan)
    assert bd.replica_instances > 0 and bd.replica_tokens > 0
    tr = cm.traffic(plan)
    np.testing.assert_array_equal(tr.replica_instances_R, (plan.quota_RS[:, cm.topology.num_masters:] > 0).sum(axis=1))
    extra = cm.with_params(cm.params.model_copy(update={"replica_instance_s": 0.001}))
    ebd = extra.predict(plan)
    busiest = int(np.argmax(cm.compute_time_R(tr.tokens_R, tr.instances_R, replicas_R=tr.replica_instances_R)))
    more = extra.compute_time_R(tr.tokens_R, tr.instances_R, replicas_R=tr.replica_instances_R)
    assert ebd.compute_fwd_s == pytest.approx(float(more.max()))
    assert more[busiest] - 0.001 * tr.replica_instances_R[busiest] == pytest.approx(bd.compute_fwd_s)
    assert ebd.compute_bwd_s == pytest.approx(2.0 * ebd.compute_fwd_s)
    # calibration: the replicas took 3 ms each beyond their tokens' predicted compute
    cal = Calibrator(cm, alpha=0.5)
    tokens_s = float(cm.compute_time_R(np.array([bd.replica_tokens]), np.array([bd.replica_instances]))[0])
    rows = cal.observe(bd, {"replica_compute_s": tokens_s + 0.003 * bd.replica_instances})
    assert cal.params.replica_instance_s == pytest.approx(0.003)
    assert [r["term"] for r in rows] == ["replica_compute_s"]
    cal.observe(bd, {"replica_compute_s": tokens_s * 0.5})  # faster than the tokens: no extra cost (weight 1/2)
    assert cal.params.replica_instance_s == pytest.approx(0.0015)
    none = identity_plan("none", cm.topology, load)
    cal.observe(cal.model.predict(none), {"replica_compute_s": 0.0})  # no replicas: nothing learned
    assert cal.params.replica_instance_s == pytest.approx(0.0015)


def test_a_plan_predicted_on_several_models_derives_its_traffic_once(monkeypatch):
    """What no cost parameter changes (the plan's traffic, its copy tree, the copies per rank) is derived once per plan
    and read by every model of its topology, and by a copy of the plan that keeps its placement
    (:meth:`~ultraep.plan.Plan.replaced`); a model that counts tokens otherwise (``dedup_top_k``) derives its own."""
    base = _cm("h100-8x-ib", 8, 16, 2)
    topo = base.topology
    other = CostModel(topo, base.hardware, base.expert, CostParams(compute_scale=1.7, weight_sync_scale=0.5))
    dedup = CostModel(topo, base.hardware, base.expert, CostParams(dedup_top_k=2))
    load = np.random.default_rng(3).multinomial(4096, np.arange(16, 0, -1) / 136.0, size=8)
    plan = make_policy("quota").plan(load, topo)
    assert plan.num_replicas > 0

    def fresh():  # the same plan, nothing derived yet
        return make_policy("quota").plan(load, topo)

    derived = {"n": 0}
    traffic = CostModel._traffic

    def counting(self, p):
        derived["n"] += 1
        return traffic(self, p)

    monkeypatch.setattr(CostModel, "_traffic", counting)
    for cm in (base, other, base):
        assert cm.predict(plan) == cm.predict(fresh())  # the same figures as derived anew...
    assert derived["n"] == 1 + 3  # ...derived once for the plan (and once for every fresh one)
    copy = plan.replaced(policy="adaptive", engine_s=1e-3)
    assert other.predict(copy).total_s == pytest.approx(other.predict(fresh()).total_s + 1e-3)
    assert derived["n"] == 4 + 1  # the copy shares the plan's; only the fresh one derived its own
    dedup.predict(plan)
    assert derived["n"] == 6  # another way of counting tokens derives its own
    assert dedup.traffic(plan).send_RL.sum() < base.traffic(plan).send_RL.sum()
    moved = plan.replaced(transfers=plan.transfers)  # a change of the placement's parts keeps nothing derived
    assert "_cost_memo" not in moved.__dict__ and "routes_RRS" not in moved.__dict__
    assert "routes_RRS" in copy.__dict__
