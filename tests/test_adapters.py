"""The experts adapter refuses, with one line naming the cause, every container it cannot balance exactly.

Single process (``adapter_for`` needs no process group), except the sentinel-id check on 2 gloo ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ultraep.adapters import UnsupportedModelError, adapter_for, register_experts


def _mixtral_experts(E=8, H=16, I=8):
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = tf.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E)
    cfg._experts_implementation = "eager"
    return randomized(MixtralExperts, cfg)


def randomized(cls, cfg, std=0.3):
    """``cls(cfg)`` with every parameter drawn from N(0, std) (seeded: the same module every call)."""
    torch.manual_seed(0)
    mod = cls(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, std)
    return mod


def _refusal(mod) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        adapter_for(mod)
    msg = str(info.value)
    assert "\n" not in msg and "refused:" in msg, msg
    return msg


def test_plain_interface_container_is_accepted():
    a = adapter_for(_mixtral_experts())
    assert a is not None and a.param_names == ("gate_up_proj", "down_proj")


def test_unaccounted_parameter_buffer_or_submodule_is_refused():
    mod = _mixtral_experts()
    mod.scale = nn.Parameter(torch.ones(8))
    assert "parameter 'scale'" in _refusal(mod)
    mod = _mixtral_experts()
    mod.register_buffer("mask", torch.ones(8))
    assert "buffer 'mask'" in _refusal(mod)
    mod = _mixtral_experts()
    mod.extra = nn.Linear(16, 16)
    assert "submodule 'extra'" in _refusal(mod)


def test_transformers_expert_parallelism_with_sentinel_ids_is_refused():
    mod = _mixtral_experts()
    mod._is_expert_parallel = True
    assert "_is_expert_parallel=True" in _refusal(mod) and "sentinel" in _refusal(mod)


def test_unknown_interface_flag_is_refused_by_name():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class Future(MixtralExperts):
        pass

    original_init = MixtralExperts.__init__.__wrapped__
    has_gate, has_bias, is_transposed, has_router_bias = True, False, False, True

    def __init__(self, config):  # what a later transformers' decorator with one more flag would build
        original_init(self, config)
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, is_transposed
        self.has_router_bias = has_router_bias

    Future.__init__ = __init__
    src = _mixtral_experts()
    mod = Future(src.config)
    assert "flag 'has_router_bias=True'" in _refusal(mod)


def test_interleaved_layout_without_own_gate_is_refused():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_concatenated=False)
    class Interleaved(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
            self.act_fn = nn.SiLU()

    cfg = _mixtral_experts().config
    assert "is_concatenated=False" in _refusal(Interleaved(cfg))


def test_probe_refuses_a_forward_the_flags_do_not_describe():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class Scaled(MixtralExperts):  # e.g. a post-expert scale hidden in forward, no flag says so
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2.0 * super().forward(hidden_states, top_k_index, top_k_weights)

    mod = Scaled(_mixtral_experts().config)
    mod.load_state_dict(_mixtral_experts().state_dict())
    msg = _refusal(mod)
    assert "differs from the experts function" in msg and "probe" in msg


def test_trainable_post_expert_norm_is_refused_frozen_is_accepted():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_post_expert_norm=True)
    class Normed(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8) * 0.3)
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
            self.act_fn = nn.SiLU()
            self.post_expert_norm = nn.RMSNorm(8)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    g, u = nn.functional.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, -1)
                    y = nn.functional.linear(self.act_fn(g) * u, self.down_proj[e])
                    out[t] += top_k_weights[t, k] * self.post_expert_norm(y)
            return out

    cfg = _mixtral_experts().config
    mod = Normed(cfg)
    assert "has_post_expert_norm=True" in _refusal(mod) and "post_expert_norm.weight" in _refusal(mod)
    mod.post_expert_norm.requires_grad_(False)
    with torch.no_grad():
        mod.post_expert_norm.weight.normal_(1.0, 0.3)
    assert adapter_for(mod) is not None  # the probe ran the norm: exact


def test_registered_container_with_extra_trainable_parameter_is_refused():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 8))
            self.gain = nn.Parameter(torch.ones(8))

    register_experts(Custom, ("w",), lambda mod, x, t: x @ t[0])
    assert "trainable parameter 'gain'" in _refusal(Custom())
    ok = Custom()
    ok.gain.requires_grad_(False)
    assert adapter_for(ok) is not None


def _sentinel(rank, world):
    import ultraep

    ref = _mixtral_experts()
    model = nn.Sequential()
    model.add_module("experts", copy.deepcopy(ref))
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 1})
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12, 16, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    idx[2, 1] = 8  # the experts interface's sentinel for a dropped slot
    idx[5, :] = 8  # a token whose every slot is dropped
    w = torch.rand(12, 2, generator=g)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out, want = model.experts(xs, idx, ws), ref(xr, idx, wr)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    return (float((out - want).abs().max()), float((xs.grad - xr.grad).abs().max()),
            float((ws.grad - wr.grad).abs().max()), float(ws.grad[5].abs().max()))


def test_sentinel_ids_are_dropped_exactly():
    """Slots routed to the sentinel id E are dropped as the eager forward drops them: outputs, input and
    routing-weight gradients equal the unwrapped container's, and a dropped slot's weight gets no gradient."""
    from dist_utils import run_ranks

    for out, gx, gw, dropped_gw in run_ranks(_sentinel, 2, timeout=60):
        assert out < 1e-5 and gx < 1e-5 and gw < 1e-5 and dropped_gw == 0.0