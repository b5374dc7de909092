"""Metrics: golden values from hand computation, and the [layers, ranks] axis convention."""

import numpy as np
import pytest

from ultraep import metrics


def test_imbalance_and_straggler_golden():
    # mean of [12, 6, 4, 2] is 6 -> max/mean 2.0, max-mean 6
    assert metrics.imbalance([12, 6, 4, 2]) == 2.0
    assert metrics.straggler([12, 6, 4, 2]) == 6.0
    assert metrics.imbalance([5, 5, 5]) == 1.0
    assert metrics.imbalance([0, 0, 0]) == 1.0  # no tokens: perfectly balanced by definition
    np.testing.assert_allclose(metrics.imbalance(np.array([[12, 6, 4, 2], [1, 1, 1, 1]])), [2.0, 1.0])


def test_balancedness_sums_layers_after_reducing_ranks():
    load_LR = np.array([[10, 0, 2], [5, 5, 5]])  # layer 0: mean 4 max 10; layer 1: mean 5 max 5
    assert metrics.balancedness(load_LR) == pytest.approx((4 + 5) / (10 + 5))
    # Read as [ranks, layers] (the axis mix-up): layers [10, 5], [0, 5], [2, 5] -> a different number
    assert metrics.balancedness(load_LR.T) == pytest.approx((7.5 + 2.5 + 3.5) / (10 + 5 + 5))
    assert metrics.balancedness(load_LR) != pytest.approx(metrics.balancedness(load_LR.T))


def test_utilization_is_mean_of_per_layer_ratios():
    load_LR = np.array([[10, 0, 2], [5, 5, 5]])
    assert metrics.utilization(load_LR) == pytest.approx((0.4 + 1.0) / 2)
    assert metrics.utilization(load_LR.T) == pytest.approx((0.75 + 0.5 + 0.7) / 3)


def test_maxvio_expert_level():
    assert metrics.maxvio([4, 2, 2, 0]) == pytest.approx(4 / 2 - 1)
    assert metrics.maxvio([3, 3, 3]) == 0.0


@pytest.mark.parametrize("fn", [metrics.balancedness, metrics.utilization])
def test_two_d_metrics_reject_other_shapes(fn):
    with pytest.raises(ValueError, match=r"\[layers, ranks\]"):
        fn(np.ones(4))


def test_rank_load_from_expert_load():
    home = np.array([0, 0, 1, 1])
    np.testing.assert_array_equal(metrics.rank_load(np.array([1, 2, 3, 4]), home, 2), [3, 7])
