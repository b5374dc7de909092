"""Issue 15, items 8 and 9: config mistakes are refused with one line that names the field and the value.

* strict scalars: ``num_redundant_slots=True`` (lax pydantic made it 1) and ``interval=2.0`` are refused;
* an unknown field names the closest known one, at the root and inside a per-layer override;
* ``wrap`` refuses ``layers={99: ...}`` on a model with fewer MoE layers, naming the layers it has;
* ``plan_layer`` with experts not divisible by ranks raises one ``ConfigError`` line, not pydantic text.
"""

import numpy as np
import pytest
from pydantic import ValidationError

from dist_utils import run_ranks
from ultraep import BalancerConfig, plan_layer
from ultraep.errors import ConfigError, format_pydantic_error


def _message(data: dict) -> str:
    with pytest.raises(ValidationError) as info:
        BalancerConfig.model_validate(data)
    return format_pydantic_error(info.value)


@pytest.mark.parametrize("data, expected", [
    ({"num_redundant_slots": True}, "num_redundant_slots (True): Input should be a valid integer"),
    ({"num_redundant_slots": 2.0}, "num_redundant_slots (2.0): Input should be a valid integer"),
    ({"check_plan_hash": 1}, "check_plan_hash (1): Input should be a valid boolean"),
    ({"eplb": {"interval": "4"}}, "eplb.interval ('4'): Input should be a valid integer"),
    ({"quota": {"balance_eps": False}}, "quota.balance_eps (False): Input should be a valid number"),
    ({"layers": {"1": {"kind": "adaptive", "screen": 0}}}, "layers.1.adaptive.screen (0): Input should be a valid boolean"),
])
def test_strict_scalars_refuse_coercion(data, expected):
    assert _message(data) == expected


def test_strict_scalars_still_take_what_config_files_hold():
    # JSON/YAML give ints for floats, lists for tuples and strings for layer keys: all still accepted.
    cfg = BalancerConfig.model_validate({"quota": {"balance_eps": 0}, "eplb": {"ewma": 1},
                                         "layers": {"1": {"kind": "hybridep", "domain_sizes": [2, 4]}}})
    assert cfg.quota.balance_eps == 0.0 and cfg.layers[1].domain_sizes == (2, 4)


@pytest.mark.parametrize("data, expected", [
    ({"num_redundant_slot": 2}, "num_redundant_slot (2): Extra inputs are not permitted; "
                                "did you mean 'num_redundant_slots'?"),
    ({"layers": {"1": {"kind": "eplb", "intervl": 3}}}, "layers.1.eplb.intervl (3): Extra inputs are not "
                                                        "permitted; did you mean 'interval'?"),
    ({"quota": {"relays": "direct"}}, "quota.relays ('direct'): Extra inputs are not permitted; did you mean 'relay'?"),
])
def test_typo_suggests_the_closest_field(data, expected):
    assert _message(data) == expected


def test_unknown_field_with_no_close_match_lists_the_fields_and_keeps_other_errors():
    msg = _message({"zzz": 1, "num_redundant_slots": -1}).splitlines()
    assert msg[0] == "num_redundant_slots (-1): Input should be greater than or equal to 0"
    assert msg[1].startswith("zzz (1): Extra inputs are not permitted; known fields: policy, num_redundant_slots,")


def test_validate_layers_names_the_layers_that_exist():
    cfg = BalancerConfig(layers={1: {"kind": "none"}, 5: {"kind": "none"}, 99: {"kind": "none"}})
    assert cfg.validate_layers(100) is cfg
    with pytest.raises(ConfigError) as info:
        cfg.validate_layers(4)
    assert info.value.path == "layers.5"
    assert str(info.value) == ("layers.5: the model has 4 MoE layer(s) (indices 0..3); no layer 5 to override "
                               "(also missing: 99)")


def _wrap_with_override(rank, world):
    import ultraep
    from ultraep.models import build_model

    model = build_model("qwen3-moe", layers=2)
    try:
        ultraep.wrap(model, {"policy": "quota", "layers": {99: {"kind": "none"}}})
    except ConfigError as exc:
        return str(exc)
    return "wrapped"


def test_wrap_refuses_override_of_a_missing_layer():
    (msg,) = run_ranks(_wrap_with_override, 1, p2p=False)
    assert msg == "layers.99: the model has 2 MoE layer(s) (indices 0..1); no layer 99 to override"


@pytest.mark.parametrize("shape, kwargs, expected", [
    ((4, 10), {}, "topology.num_experts: num_experts (10) must be divisible by num_ranks (4) for the contiguous "
                  "home mapping; pass an explicit `home` tuple instead (load of shape [4, 10])"),
    ((4, 8), {"domain_size": 3}, "topology.domain_size: domain_size (3) must divide num_ranks (4) "
                                 "(load of shape [4, 8])"),
    ((4, 8), {"num_redundant_slots": True}, "num_redundant_slots: must be an integer, got True"),
])
def test_plan_layer_topology_errors_are_one_line(shape, kwargs, expected):
    with pytest.raises(ConfigError) as info:
        plan_layer(np.ones(shape, dtype=np.int64), **kwargs)
    assert str(info.value) == expected
