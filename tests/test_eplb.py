"""DeepSeek EPLB reproduction and the historical `eplb` policy."""

import numpy as np
import pytest

from ultraep import Topology
from ultraep.errors import ConfigError
from ultraep.policies import EplbPolicy, rebalance_experts

README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])


def test_readme_example_is_reproduced_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
    # every physical slot is listed once in log2phy, and counts match
    for layer in range(2):
        assert sorted(log2phy[layer][log2phy[layer] >= 0].tolist()) == list(range(16))
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=12), logcnt[layer])
        for e in range(12):
            for p in log2phy[layer, e][log2phy[layer, e] >= 0]:
                assert phy2log[layer, p] == e


def test_global_policy_and_anti_affinity():
    # 3 groups do not divide 2 nodes -> global policy. It packs two copies of expert 8 on GPU 6 in layer 1
    # (deepseek-ai/EPLB issue #22); anti-affinity avoids it.
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 3, 2, 8)
    gpus = phy2log.reshape(2, 8, 2)
    assert any(g[0] == g[1] for g in gpus[1])
    aa, _, cnt = rebalance_experts(README_WEIGHT, 16, 3, 2, 8, anti_affinity=True)
    assert all(g[0] != g[1] for layer in aa.reshape(2, 8, 2) for g in layer)
    np.testing.assert_array_equal(np.sort(aa, axis=1), np.sort(phy2log, axis=1))  # same replicas


@pytest.mark.parametrize("args, path", [
    ((16, 4, 2, 6), "num_replicas"),   # 16 % 6
    ((16, 4, 3, 8), "num_gpus"),       # 8 % 3
    ((8, 4, 2, 8), "num_replicas"),    # fewer replicas than experts
    ((16, 5, 1, 8), "num_groups"),     # 12 experts % 5 groups
])
def test_invalid_arguments_raise_config_errors(args, path):
    with pytest.raises(ConfigError) as info:
        rebalance_experts(README_WEIGHT, *args)
    assert info.value.path == path


def test_policy_uses_only_history_and_refreshes_on_interval():
    t = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    pol = EplbPolicy(interval=3, window=2)
    hot0 = np.zeros((4, 8), dtype=np.int64)
    hot0[:, 0] = 100
    hot0 += 1
    hot6 = np.zeros((4, 8), dtype=np.int64)
    hot6[:, 6] = 100
    hot6 += 1
    p = pol.plan(hot0, t)  # step 0: no history -> masters only, and not counted as a placement
    p.check()
    assert p.num_replicas == 0 and p.info["refreshed"] and not p.info["placed"]
    assert pol.plan(hot0, t).digest() == p.digest()  # plan is pure: no state change without commit
    pol.commit(p)
    q = pol.plan(hot6, t)  # step 1: first load committed -> place from it (expert 0 hot), not from hot6
    q.check()
    assert q.info["placed"] and q.replica_count_E[0] > 1 and q.replica_count_E[6] == 1
    pol.commit(q)
    for _ in range(2):  # steps 2, 3: placement kept (age < interval)
        k = pol.plan(hot6, t)
        assert not k.info["refreshed"] and k.replica_count_E[0] > 1
        pol.commit(k)
    r = pol.plan(hot0, t)  # step 4: refresh from the window of past loads (expert 6 hot), not from hot0
    r.check()
    assert r.info["refreshed"] and r.replica_count_E[6] == 4 > r.replica_count_E[0]  # one per rank at most
    assert sorted(r.transfers.expert.tolist()) == [6, 6, 6]  # only new replicas move weights (0 on rank 3 stays)
    pol.commit(r)
    s = pol.plan(hot6, t)
    assert not s.info["refreshed"] and len(s.transfers) == 0  # unchanged placement moves nothing
    # even split across instances: expert 6's tokens are shared nearly equally
    q0 = s.quota_RS[s.phy2log_RS == 6]
    assert q0.max() - q0.min() <= len(q0)


def test_ewma_estimate():
    t = Topology(num_ranks=2, num_experts=4, num_redundant_slots=1)
    pol = EplbPolicy(interval=1, ewma=0.5)
    a = np.array([[100, 1, 1, 1], [100, 1, 1, 1]])
    p = pol.plan(a, t)
    pol.commit(p)
    q = pol.plan(a, t)
    assert q.info["refreshed"] and q.replica_count_E[0] == 2
