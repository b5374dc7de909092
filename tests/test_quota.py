"""The quota planner on hand-derived cases, the exact split and the transfer schedule."""

import subprocess
import sys

import numpy as np
import pytest

from ultraep import Topology, plan_layer
from ultraep.policies.quota import solve_quota
from ultraep.plan.transfers import schedule_transfers


def test_worked_example_from_the_module_docstring():
    # Expert loads [10, 2, 3, 3, 2, 2, 1, 1] on one source rank, 4 ranks x 2 masters, 1 redundant slot.
    load = np.zeros((4, 8), dtype=np.int64)
    load[0] = [10, 2, 3, 3, 2, 2, 1, 1]
    p = plan_layer(load, "quota", num_redundant_slots=1)
    p.check()
    np.testing.assert_array_equal(p.rank_load_before_R, [12, 6, 4, 2])
    np.testing.assert_array_equal(p.rank_load_after_R, [6, 6, 6, 6])
    # tau = floor(1.01 * 6) = 6; expert 0 goes best-fit: rank 3 (slack 4) takes 4, then rank 2 takes 2
    np.testing.assert_array_equal(p.phy2log_RS[:, 2], [-1, -1, 0, 0])
    assert p.quota_RS[0, 0] == 4 and p.quota_RS[3, 2] == 4 and p.quota_RS[2, 2] == 2
    assert p.num_replicas == 2 and p.imbalance_after == 1.0
    assert p.info["tau"].tolist() == [6]


def test_locality_split_keeps_local_tokens_home():
    # Expert 0 is hot on every source. Ranks that receive a replica of it also route their own tokens of
    # expert 0 to that local replica first (up to its quota).
    load = np.zeros((4, 4), dtype=np.int64)
    load[:, 0] = [40, 10, 10, 10]
    p = plan_layer(load, "quota", num_redundant_slots=1)
    p.check()
    routes = p.routes_RRS
    for r in range(1, 4):
        slots = np.nonzero(p.phy2log_RS[r] == 0)[0]
        for s in slots:
            assert routes[r, r, s] == min(load[r, 0], p.quota_RS[r, s])


def test_split_is_exact_on_odd_numbers():
    rng = np.random.default_rng(3)
    for _ in range(50):
        load = rng.integers(0, 97, size=(5, 10)) + (np.arange(10) == 3) * rng.integers(100, 999)
        p = plan_layer(load, "quota", num_redundant_slots=2)
        p.check()  # both conservation laws, exactly


def test_domains_confine_replicas_and_balance_each_domain():
    load = np.zeros((8, 16), dtype=np.int64)
    load[:, 0] = 800  # hot expert on rank 0 (domain 0)
    load[:, 9] = 400  # warm expert on rank 4 (domain 1)
    load += 10
    p = plan_layer(load, "quota", num_redundant_slots=2, domain_size=4)
    p.check()
    t = p.topology
    for r, s in zip(*np.nonzero(p.phy2log_RS[:, t.num_masters:] >= 0)):
        e = p.phy2log_RS[r, t.num_masters + s]
        assert t.domain_R[r] == t.domain_R[t.home_E[e]]
    after = p.rank_load_after_R.reshape(2, 4)
    assert (after.max(axis=1) <= np.ceil(after.mean(axis=1) * 1.01)).all()


def test_more_slots_never_hurt():
    rng = np.random.default_rng(11)
    w = rng.pareto(0.8, size=64) + 0.01
    load = rng.multinomial(50_000, w / w.sum(), size=16)
    prev = np.inf
    for n in range(0, 4):
        imb = plan_layer(load, "quota", num_redundant_slots=n).imbalance_after
        assert imb <= prev + 1e-9
        prev = imb


def test_min_replica_quota_blocks_small_replicas():
    load = np.zeros((4, 8), dtype=np.int64)
    load[0] = [10, 2, 3, 3, 2, 2, 1, 1]
    p = plan_layer(load, "quota", num_redundant_slots=1, min_replica_quota=5)
    p.check()
    M = p.topology.num_masters
    assert (p.quota_RS[:, M:][p.phy2log_RS[:, M:] >= 0] >= 5).all()


def _relay(n_replicas, mode=1, domain=64):
    """Schedule for one expert homed on rank 0 with replicas on ranks 1..n."""
    home = np.zeros(1, dtype=np.int64)
    ptr = np.array([0, n_replicas], dtype=np.int64)
    ranks = np.arange(1, n_replicas + 1, dtype=np.int64)
    return schedule_transfers(home, ptr, ranks, 100, domain, domain, mode)


def test_relay_tree_bounds_the_master_fan_out():
    e, src, dst, nbytes, stage = _relay(16)
    # n = 16: relays = min(floor(sqrt 16), 8, 15) = 4; 16 - max(4, ceil(12 / 4)) = 12 >= 2 -> tree
    assert (stage == 0).sum() == 4 and (stage == 1).sum() == 12
    assert (src[stage == 0] == 0).all()
    assert sorted(dst.tolist()) == list(range(1, 17))  # every replica reached exactly once
    assert set(src[stage == 1].tolist()) <= set(dst[stage == 0].tolist())  # relays forward what they got
    assert np.bincount(src).max() == 4  # busiest sender: 4 sends instead of 16


@pytest.mark.parametrize("n, expect_tree", [(3, False), (4, True), (6, True), (16, True)])
def test_relay_rule(n, expect_tree):
    # n = 3: below the minimum of 4 -> direct.
    # n = 4: relays = min(2, 8, 3) = 2; 4 - max(2, ceil(2 / 2)) = 2 >= 2 -> tree.
    # n = 6: relays = 2; 6 - max(2, ceil(4 / 2)) = 4 >= 2 -> tree.
    *_, stage = _relay(n)
    assert bool((stage == 1).any()) == expect_tree


def test_small_domains_send_directly_in_auto_mode():
    *_, stage = _relay(7, mode=1, domain=8)
    assert (stage == 0).all()
    *_, stage = _relay(7, mode=2, domain=8)
    assert (stage == 1).any()


def test_plans_are_bit_identical_across_processes():
    code = (
        "import numpy as np; from ultraep import plan_layer;"
        "rng=np.random.default_rng(5); w=rng.pareto(1.0,size=128)+0.01;"
        "load=rng.multinomial(100000,w/w.sum(),size=32);"
        "print(plan_layer(load,'quota',num_redundant_slots=2).digest(), plan_layer(load,'eplb').digest())"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(outs) == 1


def test_solver_outputs_are_within_slot_budget():
    rng = np.random.default_rng(1)
    load = rng.integers(0, 100, size=(8, 16))
    load[:, 0] += 5000
    t = Topology(num_ranks=8, num_experts=16, num_redundant_slots=1)
    e, r, s, q, tau = solve_quota(load, t.home_E, t.masters_RM, t.D, 1, 0.01, 1, np.zeros((t.num_ranks, t.num_experts), np.int8))
    assert np.bincount(r, minlength=8).max() <= 1
    assert (s == t.num_masters).all() and (q > 0).all()
