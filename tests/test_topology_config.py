"""Topology and BalancerConfig validation: messages name the field path and the values."""

import numpy as np
import pytest
from pydantic import ValidationError

from ultraep import BalancerConfig, Topology
from ultraep.config import EplbOptions, QuotaOptions
from ultraep.errors import ConfigError, format_pydantic_error


def test_contiguous_home_and_slots():
    t = Topology(num_ranks=4, num_experts=8, num_redundant_slots=2)
    np.testing.assert_array_equal(t.home_E, [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(t.master_slot_E, [0, 1, 0, 1, 0, 1, 0, 1])
    assert (t.num_masters, t.num_slots, t.D, t.num_domains) == (2, 4, 4, 1)
    assert not t.home_E.flags.writeable


def test_explicit_home_mapping():
    t = Topology(num_ranks=2, num_experts=5, home=(1, 0, 1, 1, 0), num_redundant_slots=1)
    assert t.num_masters == 3
    # rank 0 holds experts 1, 4 in id order; rank 1 holds 0, 2, 3
    np.testing.assert_array_equal(t.masters_RM, [[1, 4, -1], [0, 2, 3]])


@pytest.mark.parametrize(
    "kwargs, path, fragment",
    [
        (dict(num_ranks=4, num_experts=10), "topology.num_experts", "num_experts (10) must be divisible by num_ranks (4)"),
        (dict(num_ranks=8, num_experts=8, domain_size=3), "topology.domain_size", "domain_size (3) must divide num_ranks (8)"),
        (dict(num_ranks=4, num_experts=8, num_redundant_slots=7), "topology.num_redundant_slots",
         "num_redundant_slots (7) must be <= (domain_size - 1) * num_masters (6)"),
        (dict(num_ranks=2, num_experts=3, home=(0, 1)), "topology.home", "home has 2 entries but num_experts is 3"),
        (dict(num_ranks=2, num_experts=2, home=(0, 5)), "topology.home.1", "home rank 5 is outside 0..1"),
    ],
)
def test_topology_errors_name_path_and_values(kwargs, path, fragment):
    with pytest.raises(ValidationError) as info:
        Topology(**kwargs)
    msg = format_pydantic_error(info.value)
    assert msg.startswith(path + ":"), msg
    assert fragment in msg


def test_topology_rejects_unknown_fields():
    with pytest.raises(ValidationError, match="extra"):
        Topology(num_ranks=2, num_experts=2, ranks=3)


def test_config_defaults_and_per_layer_union():
    cfg = BalancerConfig(policy="eplb", layers={3: {"kind": "quota", "num_redundant_slots": 1}, 5: {"kind": "none"}})
    assert isinstance(cfg.layer_options(0), EplbOptions)
    assert isinstance(cfg.layer_options(3), QuotaOptions)
    assert cfg.layer_options(5).kind == "none"
    assert cfg.slots_for(3) == 1 and cfg.slots_for(0) == 2
    assert cfg.digest() == BalancerConfig.model_validate(cfg.model_dump()).digest()
    assert cfg.digest() != BalancerConfig().digest()


def test_config_cross_field_message_names_both_fields():
    cfg = BalancerConfig(num_redundant_slots=2, layers={3: {"kind": "quota", "num_redundant_slots": 9}})
    with pytest.raises(ConfigError) as info:
        cfg.validate_for(num_ranks=8, num_masters=1)
    assert info.value.path == "layers.3.quota.num_redundant_slots"
    assert "layers.3.quota.num_redundant_slots (9) must be <= (domain_size - 1) * masters_per_rank (7)" in str(info.value)


def test_a_top_level_policy_options_slots_are_checked_under_their_own_path():
    for policy in ("quota", "adaptive"):
        cfg = BalancerConfig.model_validate({"policy": policy, policy: {"num_redundant_slots": 9}})
        with pytest.raises(ConfigError) as info:
            cfg.validate_for(num_ranks=8, num_masters=1)
        assert info.value.path == f"{policy}.num_redundant_slots"


@pytest.mark.parametrize(
    "data, loc",
    [
        ({"policy": "fastest"}, "policy"),
        ({"num_redundant_slots": -1}, "num_redundant_slots"),
        ({"num_redundant_slots": "two"}, "num_redundant_slots"),
        ({"layers": {"1": {"kind": "magic"}}}, "layers.1"),
        ({"quota": {"balance_eps": 2}}, "quota.balance_eps"),
        ({"adaptive": {"probe_every": -1}}, "adaptive.probe_every"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_config_errors_carry_field_path(data, loc):
    with pytest.raises(ValidationError) as info:
        BalancerConfig.model_validate(data)
    assert format_pydantic_error(info.value).startswith(loc)


def test_config_is_frozen():
    cfg = BalancerConfig()
    with pytest.raises(ValidationError):
        cfg.policy = "none"
