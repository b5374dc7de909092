"""HybridEP: plain EP on fast links, expert transmission on 10 Gb/s with small experts, the stream model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraep.cost import CostModel
from ultraep.policies import HybridEPPolicy
from ultraep.plan import ExpertDomains
from ultraep.policies.hybridep import paper_p, stream_p_star
from ultraep.presets import get_preset
from ultraep.topology import Topology
from ultraep.plan.traffic import hybrid_destinations


def _setup(preset, R, E, overrides=None):
    pre = get_preset(preset, overrides)
    cm = CostModel(pre.topology(R, E, 2), pre.hardware, pre.expert)
    load = np.full((R, E), 8192 * 8 // E, dtype=np.int64)
    return cm, load


def test_plain_ep_where_bandwidth_is_plentiful():
    # One NVL72 rack: a single scale-out domain, nothing to convert.
    cm, load = _setup("gb200-nvl72", 64, 128)
    plan = HybridEPPolicy(cost_model=cm).plan(load, cm.topology)
    assert plan.info["hybridep"]["expert_domain_size"] == 1 and plan.info["hybridep"]["p"] == 1.0
    # Two 8-GPU nodes on a fast (400 GB/s) scale-out link with large experts: plain EP as well.
    cm, load = _setup("h100-8x-ib", 16, 64, {"scale_out": {"bandwidth_GBps": 400.0}})
    plan = HybridEPPolicy(cost_model=cm).plan(load, cm.topology)
    h = plan.info["hybridep"]
    assert h["expert_domain_size"] == 1 and h["mode"] == "plain-ep"
    assert plan.expert_domains is None  # plain EP: no overlay for the cost model to price
    assert cm.predict(plan).total_s == pytest.approx(h["predicted_s"]["1"])
    plan.check()


def test_expert_transmission_on_10gbps_with_small_experts():
    # Two datacenters joined by 10 Gb/s, HybridEP-sized experts (0.36 MB: H 512, F 128, 3 bf16 matrices).
    cm, load = _setup("cross-dc", 16, 64, {"expert": {"hidden_size": 512, "ffn_size": 128}})
    plan = HybridEPPolicy(cost_model=cm).plan(load, cm.topology)
    h = plan.info["hybridep"]
    assert h["expert_domain_size"] == 2 and h["mode"] == "expert-transmission" and h["p"] == 0.0
    # the cost model reads the typed overlay, not the diagnostics in info
    assert plan.expert_domains == ExpertDomains(2, cm.topology.num_masters, 1.0)
    assert h["predicted_s"]["2"] < 0.5 * h["predicted_s"]["1"]
    bd = cm.predict(plan)
    assert bd.total_s == pytest.approx(h["predicted_s"]["2"])
    assert bd.hybrid_ag_s > 0
    plan.check()


def test_destinations_worked_example():
    # R = 4, D = 2 -> G = 2 DCs; expert 3 lives on rank 3 (DC 1, offset 1).
    t = Topology(num_ranks=4, num_experts=4, domain_size=2)
    assert hybrid_destinations(t, 1)[:, 3].tolist() == [3, 3]
    assert hybrid_destinations(t, 2)[:, 3].tolist() == [1, 3]  # DC 0 computes it on its offset-1 rank


def test_whole_group_expert_domain_sends_no_tokens_over_scale_out():
    cm, load = _setup("cross-dc", 32, 64)
    G = cm.topology.num_domains
    tr = cm.hybrid_traffic(load, G)
    assert tr.send_RL[:, 1].sum() == 0 and tr.recv_RL[:, 1].sum() == 0
    assert tr.tokens_R.sum() == load.sum()


def test_stream_model_closed_form_and_p_mapping():
    # HybridEP Table IV case split: Mix-1 (D 8 MB, P_E 4.7 MB, G 8): 2D < G*P_E -> mixed p in (0, 1];
    # AG-only-1 (D 3 MB, P_E 0.094 MB): 2D >= G*P_E -> p* = 0.
    B = 16e9
    mixed = stream_p_star(8e6, 4.7e6, 8, B, 0.049e-3)
    assert 0.0 < mixed <= 1.0
    assert stream_p_star(3e6, 0.094e6, 8, B, 0.099e-3) == 0.0
    assert [paper_p(s, 8) for s in (8, 4, 2, 1)] == [0.0, 0.5, 0.75, 1.0]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(8, 2, 16), (8, 4, 8), (12, 4, 24), (16, 4, 32), (4, 1, 8)]),
    bw=st.sampled_from([0.5, 1.25, 50.0, 400.0]),
    seed=st.integers(0, 2**16),
)
def test_hybridep_plans_satisfy_invariants(shape, bw, seed):
    R, D, E = shape
    pre = get_preset("cross-dc", {"scale_out": {"bandwidth_GBps": bw}, "expert": {"hidden_size": 256, "ffn_size": 64}})
    t = pre.topology(R, E, 1 if D > 1 else 0, domain_size=D, ranks_per_node=D)
    cm = CostModel(t, pre.hardware, pre.expert)
    load = np.random.default_rng(seed).integers(0, 500, size=(R, E))
    plan = HybridEPPolicy(cost_model=cm).plan(load, t)
    plan.check()
    h = plan.info["hybridep"]
    assert t.num_domains % h["expert_domain_size"] == 0
    assert min(h["predicted_s"].values()) == pytest.approx(cm.predict(plan).total_s)


def test_memory_check_refuses_domains_whose_fetches_do_not_fit():
    """Fetched experts (weights + the fp32 gradients returned for them) must fit in memory_fraction of the GPU:
    with 2 x 8 GB per fetched expert, 4 masters per rank and 4 DCs, S = 2 needs 48 GB and S = 4 144 GB."""
    big = {"expert": {"hidden_size": 8192, "ffn_size": 81920, "num_matrices": 3}, "scale_out": {"bandwidth_GBps": 0.01}}
    cm, load = _setup("cross-dc", 32, 128, big)
    assert cm.expert_bytes + cm.grad_bytes == pytest.approx(3 * 8192 * 81920 * 6)
    pol = HybridEPPolicy(cost_model=cm, memory_fraction=0.25)  # 20 GB of 80: one master of one peer (12 GB)
    assert pol.candidates(cm.topology) == [(1, 4), (2, 1)]
    plan = pol.plan(load, cm.topology)
    assert plan.info["hybridep"]["memory_refused"] == ["2x2", "2x4", "4x1", "4x2", "4x4"]
    roomy = HybridEPPolicy(cost_model=cm, memory_fraction=1.0)  # 80 GB: all of one peer (48 GB) fits
    assert roomy.candidates(cm.topology) == [(1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]
    with pytest.raises(Exception, match="memory_fraction"):
        HybridEPPolicy(memory_fraction=0)


def test_partial_fetch_when_only_part_of_the_experts_hides_behind_the_window():
    """HybridEP's intermediate p (Case 2.1 of its stream model): fetch the part of the experts the pre-expert
    window hides, send the rest as tokens. Two DCs, 4 masters per GPU, a window that hides about one expert."""
    from ultraep.cost import CostParams

    pre = get_preset("hybridep-a800", {"expert": {"hidden_size": 1024, "ffn_size": 2048, "num_matrices": 2}})
    t = pre.topology(16, 64, 0)
    ag_one = 8 * 2 * 1024 * 2048 * 2 / (1.25e9 * 0.7)  # one master of the peer, for the DC's 8 GPUs
    cm = CostModel(t, pre.hardware, pre.expert, CostParams(scale_out_shared=True, mode="prefill",
                                                           prefetch_window_s=1.05 * ag_one))
    load = np.full((16, 64), 4096 * 2 // 64, dtype=np.int64)
    h = HybridEPPolicy(cost_model=cm).plan(load, t).info["hybridep"]
    assert (h["expert_domain_size"], h["fetched_masters"], h["mode"]) == (2, 1, "mixed")
    assert h["predicted_fetch_s"]["2x1"] < min(h["predicted_fetch_s"]["2x4"], h["predicted_s"]["1"])
    assert 0 < h["p"] < 1
    # the fetched masters' tokens stay in the source's DC, the others go home
    dst = hybrid_destinations(t, 2, 1)
    slot = t.master_slot_E
    assert (dst[0, (t.home_E >= 8) & (slot == 0)] < 8).all() and (dst[0, (t.home_E >= 8) & (slot > 0)] >= 8).all()
