"""The experts adapter refuses, with one line naming the cause, every container it cannot balance exactly.

Single process (``adapter_for`` needs no process group), except the sentinel-id check on 2 gloo ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ultraep.models.adapters import UnsupportedModelError, adapter_for, register_experts

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics


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


def _normed_class():
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

    return Normed


def test_post_expert_norm_is_a_shared_submodule_trainable_or_frozen():
    Normed = _normed_class()
    mod = Normed(_mixtral_experts().config)
    with torch.no_grad():
        mod.post_expert_norm.weight.normal_(1.0, 0.3)  # not the identity: the probe below runs a real norm
    assert adapter_for(mod).shared == ("post_expert_norm",)
    frozen = copy.deepcopy(mod).requires_grad_(False)
    assert adapter_for(frozen).shared == ("post_expert_norm",)
    wrong = copy.deepcopy(mod)
    wrong.post_expert_norm.weight.data.mul_(2.0)  # the norm the forward uses is no longer the one it holds
    wrong.forward = lambda *a, _ref=mod: _ref.forward(*a)
    assert "differs from the experts function" in _refusal(wrong)
    missing = copy.deepcopy(mod)
    del missing.post_expert_norm
    assert "no 'post_expert_norm' module" in _refusal(missing)


def _muse_spark_experts():
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    cfg = MuseSparkTextConfig(moe_hidden_size=16, moe_intermediate_size=8, num_local_experts=8)
    cfg._experts_implementation = "eager"
    mod = randomized(MuseSparkExperts, cfg)
    with torch.no_grad():
        mod.post_expert_norm.weight.normal_(0.0, 0.5)  # (1 + weight) scales before the RMS: a real gradient
    return mod


def _shared_norm(rank, world, budget, drop_replica_grad):
    import torch.distributed as dist

    import ultraep
    from ultraep.runtime.replicas import ReplicaJob

    if drop_replica_grad:  # negative control: the replica rows' norm gradient is lost (the pre-fix behaviour)
        original = ReplicaJob.backward
        ReplicaJob.backward = lambda self, grad, shared=(): (original(self, grad, shared)[0], [None] * len(shared))
    ref = _muse_spark_experts()
    model = nn.Sequential()
    model.add_module("experts", copy.deepcopy(ref))
    cfg = {"policy": "quota", "num_redundant_slots": 1}
    if budget is not None:
        cfg["replica_memory_budget"] = budget
    ultraep.wrap(model, cfg)
    layer = ultraep.runtime_of(model).layers[0]
    assert dict(model.named_parameters())["experts.post_expert_norm.weight"] is layer.post_expert_norm.weight
    g = torch.Generator().manual_seed(10 + rank)
    probs = torch.tensor([8.0, 6.0, 1, 1, 1, 1, 1, 1])  # experts 0 and 1 (rank 0's masters) are hot: replicas
    outs, refs, kept, replicas = [], [], [], []
    x = torch.randn(24, 16, generator=g)
    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    for call in range(2):  # two calls before one backward: with budget 0 the second overwrites the first's
        idx = torch.stack([torch.multinomial(probs, 2, generator=g) for _ in range(24)])  # replicas (restore)
        w = torch.rand(24, 2, generator=g) + 0.2
        outs.append(model.experts(xs * (call + 1), idx, w))
        refs.append(ref(xr * (call + 1), idx, w))
        kept.append(layer.calls.pending.job.kept)  # this call's replica mode (recorded only after its backward)
        replicas.append(layer.last_plan.num_replicas)
    cot = torch.randn(24, 16, generator=g)
    (sum(outs) * cot).sum().backward()
    (sum(refs) * cot).sum().backward()

    from numerics import rel_error as rel, worst

    diffs = {"out": worst(rel(o, r) for o, r in zip(outs, refs)), "x.grad": rel(xs.grad, xr.grad)}
    M = layer.topology.num_masters
    for n in layer.adapter.param_names:  # each master's gradient: the unwrapped one summed over ranks
        full = getattr(ref, n).grad.clone()
        dist.all_reduce(full)
        diffs[n] = rel(getattr(layer, n).grad, full[rank * M:(rank + 1) * M])
    mine, want = layer.post_expert_norm.weight.grad.clone(), ref.post_expert_norm.weight.grad.clone()
    dist.all_reduce(mine)  # the equivalence rule: data parallelism's all-reduce of the shared norm
    dist.all_reduce(want)
    diffs["post_expert_norm.weight"] = rel(mine, want)
    return diffs, kept, replicas, ultraep.runtime_of(model).shared_slots.restorations


@pytest.mark.parametrize("budget", [None, 0], ids=["kept", "restore"])
def test_trainable_post_expert_norm_balances_exactly_sum_over_ranks(budget):
    """MuseSpark's trainable post-expert norm (shared by all experts): on 2 gloo ranks, skewed routing (replicas
    used), training mode, two calls before the backward: outputs, input gradients and master gradients equal the
    unwrapped container's, and the sum over ranks of the norm's gradient equals the unwrapped one's summed over
    ranks (what data parallelism all-reduces). ``budget=0`` forces replica mode "restore" (recompute in backward,
    the first call's replicas restored); the default keeps the graph. Negative control: dropping the replica
    rows' norm gradient (what the layer did before) is caught."""
    from dist_utils import run_ranks

    pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    results = run_ranks(_shared_norm, 2, budget, False, timeout=180)
    from numerics import assert_within, tolerance

    for diffs, kept, replicas, restorations in results:
        assert_within(diffs)
        assert all(r > 0 for r in replicas), replicas
        if budget == 0:
            assert kept == [0.0, 0.0] and restorations >= 1, (kept, restorations)
        else:
            assert kept[0] == 1.0, kept  # the first call keeps its graph (the second shares buffers)
    if budget is None:
        bad = run_ranks(_shared_norm, 2, budget, True, timeout=180)
        assert all(d["post_expert_norm.weight"] > 100 * tolerance() for d, *_ in bad), bad
        for d, *_ in bad:
            assert_within({k: v for k, v in d.items() if k != "post_expert_norm.weight"})


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
    from numerics import rel_error

    return ({"out": rel_error(out, want), "x.grad": rel_error(xs.grad, xr.grad), "w.grad": rel_error(ws.grad, wr.grad)},
            float(ws.grad[5].abs().max()))


def test_sentinel_ids_are_dropped_exactly():
    """Slots routed to the sentinel id E are dropped as the eager forward drops them: outputs, input and
    routing-weight gradients equal the unwrapped container's, and a dropped slot's weight gets no gradient."""
    from dist_utils import run_ranks

    from numerics import assert_within

    for diffs, dropped_gw in run_ranks(_sentinel, 2, timeout=180):
        assert_within(diffs)  # relative to each reference's largest magnitude (was 1e-5 absolute: CPU-dependent)
        assert dropped_gw == 0.0