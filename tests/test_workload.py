"""The synthetic workload generator hits its target skew, deterministically."""

import numpy as np
import pytest

from ultraep.plan.metrics import imbalance
from ultraep.sim.workload import sample_topk_counts, synthetic_load


@pytest.mark.parametrize("target", [1.5, 3.0])
def test_target_imbalance_is_met(target):
    load = synthetic_load(16, 64, top_k=4, tokens_per_rank=2048, target_imbalance=target, seed=3)
    got = imbalance(load.sum(axis=0).reshape(16, 4).sum(axis=1))
    assert abs(got - target) / target < 0.08
    assert load.sum() == 16 * 2048 * 4  # every token picks exactly k experts


def test_deterministic_per_seed():
    a = synthetic_load(8, 32, top_k=2, tokens_per_rank=256, target_imbalance=2.0, seed=1)
    b = synthetic_load(8, 32, top_k=2, tokens_per_rank=256, target_imbalance=2.0, seed=1)
    np.testing.assert_array_equal(a, b)


def test_topk_without_replacement_caps_an_expert_at_one_per_token():
    pop = np.array([0.97, 0.01, 0.01, 0.01])
    counts = sample_topk_counts(pop, 1000, 2, np.random.default_rng(0))
    assert counts[0] <= 1000 and counts.sum() == 2000


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        synthetic_load(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        synthetic_load(2, 8, top_k=9)
