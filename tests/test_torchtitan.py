"""torchtitan's MoE layers balanced exactly (issue 54, items 1 and 5): every family with routed experts, at its
MoE block built from torchtitan's own config, wrapped on 2 and 4 gloo ranks — outputs and every gradient equal
the unwrapped block's on the global batch, with the same dtype path (the experts' bf16 grouped mm), and the
replicas serve tokens; what cannot be exact is refused in one line naming the setting; the core package never
imports torchtitan.

The tolerance is bf16's (tests/numerics.py): the containers compute in bf16 and the unwrapped block adds its
K expert outputs in another order than the balanced layer's combine.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

import titan_models as tm  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from numerics import rel_error, tolerance  # noqa: E402

import ultraep  # noqa: E402
from ultraep.models import torchtitan as titan  # noqa: E402
from ultraep.models.adapters import adapter_for  # noqa: E402
from ultraep.models.experts import UnsupportedModelError  # noqa: E402

for _family in ("qwen3", "deepseek_v3", "gpt_oss", "kimi_k2_7"):  # imported before fork: ranks start fast
    tm._registry(_family)

# adaptive probes from its second call (probe_cost_share null): paced, a 2-call run stays on the model's pick and may
# move nothing between ranks, and then its exactness check would prove nothing
POLICIES = {"quota": {"policy": "quota", "num_redundant_slots": 2},
            "adaptive": {"policy": "adaptive", "num_redundant_slots": 2, "adaptive": {"probe_cost_share": None}}}
TOKENS = 24  # per rank


def _tokens(D: int, rank: int, dtype, world: int) -> torch.Tensor:
    """``[1, TOKENS, D]`` rows drawn from 3 vectors plus a little noise: concentrated routing (replicas planned)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, D, generator=g)
    g = torch.Generator().manual_seed(100 + rank)
    pick = torch.randint(0, 3, (TOKENS,), generator=g)
    return (base[pick] + 0.01 * torch.randn(TOKENS, D, generator=g)).to(dtype).view(1, TOKENS, D)


def _block_scenario(rank, world, family, config, perturb=False):
    """One MoE block wrapped; the unwrapped copy on the global batch. Returns each compared quantity's relative
    error and the tokens replicas served."""
    import torch.distributed as dist

    block = tm.moe_block(family)
    ref = copy.deepcopy(block)
    ultraep.wrap(block, config)
    rt = ultraep.runtime_of(block)
    layer = rt.layers[0]
    if perturb:  # negative control: one master row off by 1 % of its scale
        with torch.no_grad():
            p = layer.master_params()[0]
            p[0].add_(p[0].abs().mean() * 10)
    D = int(block.router.gate.weight.shape[1])
    dtype = next(ref.parameters()).dtype
    xs = [_tokens(D, r, dtype, world) for r in range(world)]
    g = torch.Generator().manual_seed(5)
    probe = torch.randn(world, TOKENS, D, generator=g)
    errors, served = {}, 0
    for step in range(2):  # the second call reuses plans and replica buffers
        block.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = xs[rank].clone().requires_grad_(True)
        y = block(x)
        (y.float() * probe[rank]).sum().backward()
        xg = torch.cat(xs, dim=1).requires_grad_(True)
        yr = ref(xg)
        (yr.float() * probe.view(1, world * TOKENS, D)).sum().backward()
        sl = slice(rank * TOKENS, (rank + 1) * TOKENS)
        M = layer.topology.num_masters  # rows the plan sent to replica slots (slots M..S-1): served by replicas
        served += int(layer.last_plan.routes_RRS[:, :, M:].sum())
        errors[f"{step} output"] = rel_error(y, yr[:, sl])
        errors[f"{step} input grad"] = rel_error(x.grad, xg.grad[:, sl])
        ref_params = dict(ref.named_parameters())
        M = layer.topology.num_masters
        masters = {id(p) for p in layer.master_params()}
        for name, p in block.named_parameters():
            gr = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            want = ref_params[name].grad
            if id(p) in masters:  # this rank's rows of the full tensor (its gradient sums every rank's tokens)
                want = want[rank * M:(rank + 1) * M]
            else:  # replicated parameters: each rank's gradient of its own tokens, summed
                dist.all_reduce(gr)
            errors[f"{step} {name}"] = rel_error(gr, want)
        rt.next_step()
    return {"errors": errors, "replicas": served, "policy": layer.policy_name}


def _check(results, dtype=torch.bfloat16):
    tol = tolerance(dtype)
    for r, res in enumerate(results):
        bad = {k: v for k, v in res["errors"].items() if not v <= tol}
        assert not bad, f"rank {r}: relative errors above {tol}: {bad}"
    assert sum(res["replicas"] for res in results) > 0, "no replica served a token: the test would prove nothing"


@pytest.mark.numerics
@pytest.mark.parametrize("family", list(tm.FAMILIES))
def test_every_family_is_exact_at_its_moe_block_on_two_ranks(family):
    _check(run_ranks(_block_scenario, 2, family, POLICIES["quota"]))


@pytest.mark.numerics
@pytest.mark.parametrize("family,policy", [("qwen3", "adaptive"), ("deepseek_v3-node-limited", "quota"),
                                           ("gpt_oss", "quota")])
def test_families_are_exact_on_four_ranks(family, policy):
    _check(run_ranks(_block_scenario, 4, family, POLICIES[policy]))


def test_a_perturbed_master_fails_the_comparison():
    # negative control of the exactness check above
    results = run_ranks(_block_scenario, 2, "qwen3", POLICIES["quota"], True)
    tol = tolerance(torch.bfloat16)
    assert any(v > tol for v in results[0]["errors"].values()), results[0]["errors"]


# --------------------------------------------------------------------------------------------- one process
def test_the_one_expert_functions_equal_the_containers_grouped_mm():
    """The container's own forward over many groups and the one-expert function over each group's rows agree."""
    from ultraep.models.rewrite import eager_experts

    for family in ("qwen3", "gpt_oss"):
        block = tm.moe_block(family)
        titan.prepare(block)
        inner = block.routed_experts.inner_experts
        adapter = getattr(inner, titan._MARK)
        params = [getattr(inner, n) for n in adapter.param_names]
        E, D = int(params[0].shape[0]), int(block.router.gate.weight.shape[1])
        g = torch.Generator().manual_seed(3)
        K = block.routed_experts.token_dispatcher.top_k  # the dispatcher's own top-k (it maps rows back with it)
        x = torch.randn(1, 16, D, generator=g).to(params[0].dtype)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(16)]).view(1, 16, K)
        w = torch.rand(1, 16, K, generator=g)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        with torch.no_grad():
            ref = type(block.routed_experts)._ultraep_titan_base.forward(block.routed_experts, x, w, idx, counts)
            ours = eager_experts(adapter.forward, inner, params, x.view(16, D), idx.view(16, K), w.view(16, K))
        assert rel_error(ours, ref.view(16, D)) <= tolerance(torch.bfloat16), family


def test_the_test_attention_computes_torchtitans_flex_attention_with_gpt_oss_sinks_and_windows():
    """tm.CausalAttention (the training tests' attention: flex has no backward on CPU) against torchtitan's own
    FlexAttention, forward (which flex runs on CPU), in GPT-OSS's attention with its sinks, on its own sliding-window
    and full masks from ``get_attention_masks``; a window shorter than the sequence, so the masks differ."""
    import dataclasses

    from torchtitan.models.common.attention import FlexAttention

    cfg = tm.decoder_config("gpt_oss")
    cfg.layers = [dataclasses.replace(la, attention=dataclasses.replace(la.attention, sliding_window_size=5)
                                      if la.attention.sliding_window_size else la.attention) for la in cfg.layers]
    model = tm.swap_attention(tm._init(cfg.build(), 0))
    B, L = 2, 12
    with torch.compiler.set_stance("force_eager"):  # (torchtitan compiles flex and its mask builder)
        masks = model.get_attention_masks(torch.arange(L).repeat(B, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, int(cfg.dim), generator=g)
    flex = FlexAttention(FlexAttention.Config())
    seen = set()
    for block in model.layers.values():
        att, mask = block.attention, masks[block.attn_mask_key]
        seen.add(block.attn_mask_key)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            ours = att(x, mask)
            inner, att.inner_attention = att.inner_attention, flex
            theirs = att(x, mask)
            att.inner_attention = inner
            att.sinks.add_(3.0)  # negative control: other sinks give another output
            other = att(x, mask)
            att.sinks.sub_(3.0)
        assert rel_error(ours, theirs) <= tolerance(torch.float32), block.attn_mask_key
        assert rel_error(other, theirs) > 1e-2, block.attn_mask_key
    assert seen == {"sliding_window_mask", "basic_mask"}, seen


def test_prepare_keeps_the_original_forward_until_wrapped_and_restore_undoes_it():
    block = tm.moe_block("deepseek_v3")
    ref = copy.deepcopy(block)
    keys = list(block.state_dict())
    titan.prepare(block)
    assert list(block.state_dict()) == keys  # same names: checkpoints load unchanged
    x = torch.randn(2, 5, int(block.router.gate.weight.shape[1]))
    assert torch.equal(block(x), ref(x))  # bit for bit: the original code runs
    titan.restore(block)
    assert type(block.routed_experts).__name__ == "RoutedExperts" and not hasattr(block.routed_experts,
                                                                                   "_ultraep_inner_cls")
    assert type(block.routed_experts) is type(ref.routed_experts)


def _round_trip(rank, world):
    """wrap, then unwrap: the original module classes, state_dict keys (in order) and values."""
    block = tm.moe_block("gpt_oss")
    orig = copy.deepcopy(block)
    ultraep.wrap(block, POLICIES["quota"])
    assert type(block.routed_experts.inner_experts).__name__ == "BalancedExperts"
    ultraep.unwrap(block)
    sd, osd = block.state_dict(), orig.state_dict()
    same = list(sd) == list(osd) and all(torch.equal(sd[k], osd[k]) for k in osd)
    return same and [type(m) for m in block.modules()] == [type(m) for m in orig.modules()]


def test_unwrap_gives_back_the_original_torchtitan_block():
    assert run_ranks(_round_trip, 2, p2p=False) == [True, True]  # (no forward: nothing moves between ranks)


def _refusal(block) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        titan.prepare(block)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_a_non_local_dispatcher_is_refused_in_one_line():
    # DeepEP, HybridEP and minimal async EP need CUDA to be built; an override package's dispatcher (a subclass
    # with its own token exchange) is refused by the same check
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    class OverlappedDispatcher(AllToAllTokenDispatcher):
        pass

    block = tm.moe_block("qwen3")
    block.routed_experts.token_dispatcher.__class__ = OverlappedDispatcher
    msg = _refusal(block)
    assert "token_dispatcher" in msg and "OverlappedDispatcher" in msg, msg


def test_a_converted_experts_class_is_refused_in_one_line():
    from torchtitan.models.common.moe import GroupedExperts

    class Float8GroupedExperts(GroupedExperts):  # what a quantization converter puts in place
        pass

    block = tm.moe_block("qwen3")
    block.routed_experts.inner_experts.__class__ = Float8GroupedExperts
    msg = _refusal(block)
    assert "Float8GroupedExperts" in msg and "inner_experts" in msg, msg


def test_a_changed_seam_is_refused_naming_the_version(monkeypatch):
    import dataclasses

    from torchtitan.models.common import moe

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(moe.RoutedExperts.Config):
        score_before_experts: bool = False  # a field this adapter does not know

    class RoutedExperts(moe.RoutedExperts):
        pass

    RoutedExperts.Config = Config
    RoutedExperts.__module__ = moe.__name__
    monkeypatch.setattr(moe, "RoutedExperts", RoutedExperts)
    block = tm.moe_block("qwen3")
    block.routed_experts.__class__ = RoutedExperts
    msg = _refusal(block)
    assert f"torchtitan {titan.version()}" in msg and "score_before_experts" in msg and titan.SEAM_VERSION in msg, msg


def test_a_routed_experts_subclass_is_refused_in_one_line():
    from torchtitan.models.common.moe import RoutedExperts

    class OverlappedRoutedExperts(RoutedExperts):  # what an override package could put in place
        pass

    block = tm.moe_block("qwen3")
    block.routed_experts.__class__ = OverlappedRoutedExperts
    msg = _refusal(block)
    assert "OverlappedRoutedExperts" in msg and "subclasses torchtitan's RoutedExperts" in msg, msg


def test_a_bare_grouped_experts_is_refused():
    block = tm.moe_block("qwen3")
    with pytest.raises(UnsupportedModelError, match="outside a torchtitan RoutedExperts"):
        adapter_for(block.routed_experts.inner_experts)


def _sharded(rank, world, how):
    """Refusals that need a process group: torchtitan's own EP (its dispatcher wired to an EP mesh), expert TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    block = tm.moe_block("qwen3")
    if how == "ep":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        block.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        inner = block.routed_experts.inner_experts
        inner.w1_EFD = torch.nn.Parameter(distribute_tensor(inner.w1_EFD.detach(), mesh, [Shard(1)]))
    try:
        ultraep.wrap(block, POLICIES["quota"])
    except UnsupportedModelError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how,says", [("ep", "token_dispatcher.ep_mesh"), ("tp", "expert tensor parallelism")])
def test_torchtitan_expert_parallelism_and_expert_tp_are_refused(how, says):
    for msg in run_ranks(_sharded, 2, how, p2p=False):  # refused before anything moves
        assert msg is not None and says in msg and "\n" not in msg, msg


def test_the_core_package_never_imports_torchtitan():
    code = ("import sys, ultraep, ultraep.models, ultraep.models.adapters, ultraep.models.torchtitan, ultraep.runtime;"
            "import ultraep.cli, ultraep.sim; assert 'torchtitan' not in sys.modules, 'torchtitan imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------- docs/models.md
def render_section(rows: list[tuple[str, str, str, str]]) -> str:
    """docs/models.md's torchtitan section from (family, experts class, result, detail) rows."""
    lines = ["", "## torchtitan", "",
             f"Generated by `python tests/test_torchtitan.py` on torchtitan {titan.version()} (do not edit by hand). "
             "**balanced** = the family's MoE block, built from torchtitan's own config (its model registry's debug "
             "flavor; expert hidden size cut to 32), wrapped on 2 gloo ranks with policy `quota` and 2 redundant "
             "slots on skewed tokens: outputs, input gradients, master gradients (rows of the full tensors) and "
             "every other parameter's gradient (sum over ranks) equal the unwrapped block's on the global batch "
             f"within bf16's tolerance ({tolerance(torch.bfloat16):g}: the experts compute in bf16), over two calls. "
             "Every family's whole decoder is also trained 4 steps under torchtitan's FSDP2 and activation "
             "checkpointing on 2 and 4 ranks, `quota` and `adaptive` (tests/test_torchtitan_train.py; what each "
             "family's test leaves out: [the torchtitan guide](guide/torchtitan.md#what-is-tested-and-how)).", "",
             "| family | experts class | result | detail |", "|---|---|---|---|"]
    lines += [f"| {f} | `{c}` | {r} | {d} |" for f, c, r, d in rows]
    return "\n".join(lines) + "\n"


def _row(family: str) -> tuple[str, str, str, str]:
    cls = type(tm.moe_block(family).routed_experts.inner_experts).__name__
    try:
        results = run_ranks(_block_scenario, 2, family, POLICIES["quota"])
        _check(results)
    except AssertionError as exc:
        return family, cls, "failed", str(exc).splitlines()[0].replace("|", "\\|")
    worst = max(v for res in results for v in res["errors"].values())
    return family, cls, "balanced", (f"rows served by replicas: {sum(r['replicas'] for r in results)}; "
                                     f"worst relative difference {worst:.2g}")


if __name__ == "__main__":
    import os

    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "models.md")
    mark = "\n## torchtitan\n"
    text = open(doc, encoding="utf-8").read().split(mark)[0]
    with open(doc, "w", encoding="utf-8") as fh:
        fh.write(text + render_section([_row(f) for f in tm.FAMILIES]))
    print(f"wrote {os.path.normpath(doc)} ({len(tm.FAMILIES)} torchtitan families)")
