"""The balanced runtime on real gloo process groups: the wrapped model computes what the unwrapped one does.

For each model family and policy: every rank feeds its own batch whose few token ids make the routing
skewed (so the planners create replicas — asserted), and checks that
  * the wrapped model's logits on that rank equal the unwrapped model's on the same batch, and
  * each master's gradient equals the sum over ranks of the unwrapped expert's gradient
(fp32 tolerance). EPLB plans from history, so those runs take a warm-up step first.
"""

import copy

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from dist_utils import run_ranks
from numerics import assert_within, master_grad_errors, param_grad_errors, rel_error
from ultraep.models import FAMILIES, build_model, preload

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics

preload()

CONFIGS = {
    "none": {"policy": "none"},
    "quota": {"policy": "quota", "num_redundant_slots": 2},
    "eplb": {"policy": "eplb", "num_redundant_slots": 2, "eplb": {"interval": 1, "window": 1}},
    "feplb": {"policy": "feplb", "num_redundant_slots": 2},
}


def _batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 1)
    return torch.randint(0, 3, (2, 12), generator=g)  # 3 token ids: concentrated routing


def _equivalence(rank, world, family, config, steps):
    import ultraep

    model = build_model(family, num_experts=8 if world <= 2 else 8)
    ref = copy.deepcopy(model)
    ultraep.wrap(model, config)
    rt = ultraep.runtime_of(model)
    for step in range(steps):
        ids = _batch(rank, step)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits
        ref_out = ref(input_ids=ids).logits
        (out.float().pow(2).mean()).backward()
        (ref_out.float().pow(2).mean()).backward()
        rt.next_step()
    # every figure relative to the reference's largest magnitude (tests/numerics.py); non-expert parameters: the
    # same local gradient as the reference (no data-parallel reduction here)
    grads = master_grad_errors(rt, ref, rank)
    other = param_grad_errors(model, ref, skip=lambda n: ".experts." in n)
    return {
        "logits": rel_error(out, ref_out), "grad": grads, "other": other,
        "replicas": [layer.last_plan.num_replicas for layer in rt.layers],
        "imbalance": [(layer.last_plan.imbalance_before, layer.last_plan.imbalance_after) for layer in rt.layers],
        "restorations": rt.shared_slots.restorations,
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", list(CONFIGS))
def test_wrapped_equals_unwrapped_two_ranks(family, policy):
    steps = 2 if policy == "eplb" else 1
    # no balancing moves nothing between ranks; every other policy streams replicas (the record must show it)
    results = run_ranks(_equivalence, 2, family, CONFIGS[policy], steps, p2p=policy != "none")
    for r in results:
        assert_within({"logits": r["logits"], **r["grad"], **r["other"]}, what=f"{family}/{policy}")
    if policy != "none":
        assert max(max(r["replicas"]) for r in results) > 0, f"{policy} made no replicas: {results[0]}"
        if policy == "quota":  # the exact-load planner never makes the busiest rank busier
            for before, after in results[0]["imbalance"]:
                assert after <= before
    else:
        assert all(max(r["replicas"]) == 0 for r in results)


@pytest.mark.parametrize("memory", ["kept", "restore", "kept-tiles"])
@pytest.mark.parametrize("policy", ["quota", "eplb", "feplb"])
def test_wrapped_equals_unwrapped_four_ranks(policy, memory):
    steps = 2 if policy == "eplb" else 1
    # budget 0: no layer keeps its replicas, they share one set of buffers and restore + recompute in backward;
    # tiles: the GPU transport (tile-packed messages, Triton kernels there, their references here)
    cfg = {**CONFIGS[policy], **({"replica_memory_budget": 0} if memory == "restore" else {}),
           **({"replica_transport": "tiles"} if memory == "kept-tiles" else {})}
    results = run_ranks(_equivalence, 4, "qwen3-moe", cfg, steps)
    for r in results:
        assert_within({"logits": r["logits"], **r["grad"]}, what=f"{policy}/{memory}")
    assert max(max(r["replicas"]) for r in results) > 0
    if memory != "restore":  # replicas live from forward to backward: nothing restored
        assert all(r["restorations"] == 0 for r in results)
    elif policy == "quota":  # two layers share the buffers: the first layer's replicas were restored
        assert results[0]["restorations"] >= 1


def _training(rank, world, family, config, steps):
    import torch.distributed as dist

    import ultraep

    model = build_model(family)
    ref = copy.deepcopy(model)
    if config is not None:
        ultraep.wrap(model, config)
    target = model if config is not None else ref
    opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        logits = target(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        # data parallelism over the global batch: every gradient is summed over ranks, except the wrapped
        # masters' gradients, which the balanced layer already summed over ranks.
        for name, p in target.named_parameters():
            if p.grad is not None and not (config is not None and ".experts." in name):
                dist.all_reduce(p.grad)
        opt.step()
        if config is not None:
            ultraep.runtime_of(model).next_step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("policy", ["quota", "eplb", "quota-restore", "quota-tiles"])
def test_training_loop_losses_match(policy):
    variants = {"quota-restore": {"replica_memory_budget": 0}, "quota-tiles": {"replica_transport": "tiles"}}
    cfg = CONFIGS[policy] if policy in CONFIGS else {**CONFIGS["quota"], **variants[policy]}
    wrapped = run_ranks(_training, 2, "qwen3-moe", cfg, 4)
    plain = run_ranks(_training, 2, "qwen3-moe", None, 4, p2p=False)  # the unwrapped model: collectives only
    # step 0 is exact (fp32 summation order); each Adam step after it amplifies last-bit differences, which
    # 1e-4 of the loss covers over 3 steps. equal_nan=False: two NaN losses are not a match.
    np.testing.assert_allclose(np.array(wrapped)[:, 0], np.array(plain)[:, 0], rtol=1e-5, atol=0, equal_nan=False)
    np.testing.assert_allclose(wrapped, plain, rtol=1e-4, atol=0, equal_nan=False)


class TinyExperts(torch.nn.Module):
    """A plain PyTorch experts container (not transformers): w_in [E, F, H], w_out [E, H, F], GELU."""

    def __init__(self, E=8, H=16, F=8):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(E, F, H) * 0.2)
        self.w_out = torch.nn.Parameter(torch.randn(E, H, F) * 0.2)

    @staticmethod
    def expert(mod, x, tensors):
        w_in, w_out = tensors
        return torch.nn.functional.gelu(x @ w_in.T) @ w_out.T

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            t, k = torch.where(idx == e)
            if t.numel():
                out.index_add_(0, t, self.expert(self, x[t], (self.w_in[e], self.w_out[e])) * w[t, k, None])
        return out


class TinyMoE(torch.nn.Module):
    """A custom MoE block: its own softmax-top-k router feeding the experts container."""

    def __init__(self, E=8, H=16, K=2):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = TinyExperts(E, H)
        self.K = K

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(self.K, dim=-1)
        return self.experts(x, idx, w)


def skewed_tiny_moes() -> torch.nn.Sequential:
    """Two :class:`TinyMoE` blocks (seed 0) whose routers lean towards experts 0 and 5, so that quota makes replicas
    (also the model ``tests/test_runtime_meta.py`` saves and rebuilds on the meta device)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyMoE(), TinyMoE())
    with torch.no_grad():  # skew the routers towards experts 0 and 5
        for blk in model:
            blk.router.weight[0] += 0.8
            blk.router.weight[5] += 0.4
    return model


def tiny_errors(model, ref, rank: int) -> tuple[float, float, list[int]]:
    """One forward and backward of the wrapped two-block ``model`` and the plain ``ref`` on this rank's batch (``[24,
    16]``, seeded by rank): the logits' relative error, that of this rank's master rows of the first block's ``w_in``
    gradient against the reference's (summed over the ranks: every rank's batch reaches every expert), and every
    layer's replicas in its last plan."""
    import torch.distributed as dist

    import ultraep

    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(rank)).abs()
    out, ref_out = model(x), ref(x)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    rt = ultraep.runtime_of(model)
    g = ref[0].experts.w_in.grad.clone()
    dist.all_reduce(g)
    M = rt.layers[0].topology.num_masters
    return (rel_error(out, ref_out), rel_error(model[0].experts.w_in.grad, g[rank * M:(rank + 1) * M]),
            [layer.last_plan.num_replicas for layer in rt.layers])


def _custom(rank, world):
    import ultraep

    ultraep.register_experts(TinyExperts, ("w_in", "w_out"), TinyExperts.expert)
    model = skewed_tiny_moes()
    ref = copy.deepcopy(model)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    return (*tiny_errors(model, ref, rank), str(ultraep.runtime_of(model).report))


def test_custom_pytorch_block():
    res = run_ranks(_custom, 2)
    for logits, grad, replicas, report in res:
        assert_within({"logits": logits, "w_in.grad": grad})
        assert max(replicas) > 0
        assert "custom:TinyExperts" in report and "layer 1" in report


def _unwrap(rank, world):
    import ultraep

    model = build_model("mixtral")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ultraep.wrap(model, {"policy": "quota"})
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in before.values())
    ultraep.unwrap(model)
    after = dict(model.named_parameters())
    return sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)


def test_unwrap_restores_full_model():
    assert run_ranks(_unwrap, 2, p2p=False) == [True, True]  # no forward: nothing moves


def _unsupported(rank, world):
    import ultraep
    from ultraep.models.adapters import UnsupportedModelError

    try:
        ultraep.wrap(torch.nn.Linear(4, 4))
    except UnsupportedModelError as exc:
        return str(exc)
    return "no error"


def test_unsupported_model_lists_supported_ones():
    msg = run_ranks(_unsupported, 2, p2p=False)[0]  # refused at wrap: nothing moves
    assert "has no experts container" in msg and "MixtralExperts" in msg and "Qwen3MoeExperts" in msg


def _ids_above_sentinel(rank, world):
    """Rank 1 routes two slots to expert id E + 1 (beyond the sentinel E), rank 0 one to -1: every rank refuses
    together, naming both."""
    import ultraep
    from ultraep.models.adapters import UnsupportedModelError

    holder = torch.nn.Module()
    holder.experts = build_model("qwen3-moe").model.layers[0].mlp.experts
    ultraep.wrap(holder, CONFIGS["quota"])
    E = 8
    idx = torch.randint(0, E, (5, 2), generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        idx[1:3, 0] = E + 1
    else:
        idx[4, 1] = -1
    try:
        holder.experts(torch.randn(5, 32), idx, torch.rand(5, 2))
    except UnsupportedModelError as exc:
        return str(exc)
    return "no error"


def test_ids_above_the_sentinel_are_refused_on_every_rank():
    for msg in run_ranks(_ids_above_sentinel, 2, p2p=False):  # refused before any transfer
        assert "rank(s) [0, 1] routed 3 slot(s) to expert ids above 8 or below 0" in msg, msg


def _divergence(rank, world):
    import ultraep
    import ultraep.runtime.layer as ep
    from ultraep.errors import PlanDivergenceError

    model = build_model("qwen3-moe")
    ultraep.wrap(model, {"policy": "quota", "check_plan_hash": True})
    model(input_ids=_batch(rank))  # agreeing ranks pass the check
    if rank == 1:  # corrupt this rank's view of the load
        real = ep.gather_load

        def corrupted(counts, group):
            load = real(counts, group).copy()
            load[0, 0] += 50
            return load

        ep.gather_load = corrupted
    try:
        model(input_ids=_batch(rank))
    except PlanDivergenceError as exc:
        return str(exc)
    return "no error"


def test_plan_divergence_is_detected_on_every_rank():
    msgs = run_ranks(_divergence, 2)
    for m in msgs:
        assert "computed a different plan than rank 0" in m and "refusing to exchange tokens" in m
