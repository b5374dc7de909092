"""A calibration run's config (issue 35): the adaptive engine probing every candidate often, whatever it is predicted
to lose, so that the cost model its engine learns has measured every policy. ``adaptive`` options given at the top
level govern every adaptive layer, as ``quota`` and ``eplb`` options do; a per-layer override still wins."""

import pytest

import ultraep
from ultraep.config import CALIBRATION_PROBE_EVERY, AdaptiveOptions, BalancerConfig, calibration_config


def test_every_layer_of_a_calibration_run_probes_every_candidate_often():
    cfg = BalancerConfig.model_validate(ultraep.calibration_config())
    assert cfg.policy == "adaptive"
    for layer in (0, 7):
        opts = cfg.layer_options(layer)
        assert isinstance(opts, AdaptiveOptions)
        assert opts.probe_every == CALIBRATION_PROBE_EVERY < AdaptiveOptions().probe_every
        assert opts.probe_max_loss >= 1e6  # no candidate is spared a probe for what it is predicted to lose
        assert opts.explore_share is None  # every decision weighs every candidate
        assert opts.candidates == AdaptiveOptions().candidates


def test_overrides_are_other_top_level_keys():
    cfg = BalancerConfig.model_validate(calibration_config(num_redundant_slots=3, sync_check_every=0))
    assert (cfg.num_redundant_slots, cfg.sync_check_every, cfg.policy) == (3, 0, "adaptive")
    assert cfg.layer_options(0).probe_every == CALIBRATION_PROBE_EVERY
    # adaptive options given are merged: the probes stay
    cfg = BalancerConfig.model_validate(calibration_config(adaptive={"candidates": ("none", "quota")}))
    opts = cfg.layer_options(0)
    assert opts.candidates == ("none", "quota") and opts.probe_every == CALIBRATION_PROBE_EVERY
    assert opts.explore_share is None


def test_top_level_adaptive_options_and_a_layer_override():
    cfg = BalancerConfig.model_validate({"policy": "adaptive", "adaptive": {"probe_every": 9, "margin": 0.03},
                                         "layers": {1: {"kind": "adaptive", "probe_every": 2}}})
    assert (cfg.layer_options(0).probe_every, cfg.layer_options(0).margin) == (9, 0.03)
    assert (cfg.layer_options(1).probe_every, cfg.layer_options(1).margin) == (2, AdaptiveOptions().margin)
    # another policy's layers do not read them
    assert not isinstance(BalancerConfig(policy="quota", adaptive={"probe_every": 9}).layer_options(0),
                          AdaptiveOptions)


def test_a_bad_adaptive_option_names_its_path():
    with pytest.raises(Exception) as info:
        BalancerConfig.model_validate(calibration_config() | {"adaptive": {"probe_evry": 4}})
    assert "adaptive.probe_evry" in str(info.value) and "probe_every" in str(info.value)
