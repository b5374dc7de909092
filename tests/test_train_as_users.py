"""Training as users train — DDP, FSDP2, activation checkpointing, accumulation — on real gloo ranks: exact, or
refused in one line.

The contract (README, "Training with DDP"): a wrapped model trained under a data-parallel wrapper, each rank
on its own batch with its own mean loss, follows the *unwrapped* model trained on the global batch (every rank's
batch, concatenated) with the global mean loss — the same loss at every step and the same gradient of every
parameter (a master's gradient against its rows of the unwrapped expert tensor), through 4 Adam steps of the
wrapped model. After each step the unwrapped model takes the wrapped model's parameters (masters gathered from
every rank), so each step compares one forward and backward at the same parameters: fp32 rounding of one pass,
not Adam's amplification of last-bit differences compounded over steps (an element whose gradient is rounding
noise moves by the full learning rate), which made a fixed tolerance a matter of the CPU's kernels. A replica left
stale after an optimizer step still shows at the next step (its rows are computed with old weights); the optimizer
step itself is torch's, on the parameters and gradients compared here.

Every rank computes that reference itself (the batches are a function of rank and step), so each scenario is
one launch. The token batches use three ids, so routing is skewed and the planners make replicas (asserted).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from dist_utils import run_ranks
from ultraep.models import build_model, preload

preload()

STEPS = 4
VOCAB = 64
POLICIES = {
    "quota": {"policy": "quota", "num_redundant_slots": 2},
    "adaptive": {"policy": "adaptive", "num_redundant_slots": 2},
}


def _batch(rank: int, step: int, mb: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * mb + 17 * rank + 1)
    return torch.randint(0, 3, (2, 12), generator=g)  # 3 token ids: concentrated routing


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def _differs(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 2e-5) -> str | None:
    """None when ``actual`` equals ``expected`` within fp32 rounding relative to the reference's magnitude; the
    mismatch otherwise (NaN and inf fail)."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    try:
        torch.testing.assert_close(actual, expected, rtol=0.0, atol=rtol * max(scale, 1e-30), equal_nan=False)
    except AssertionError as exc:
        worst = float((actual.double() - expected.double()).abs().max()) if actual.shape == expected.shape else -1
        return f"{str(exc).splitlines()[0]} max |difference| {worst:.3g}, max |reference| {scale:.3g}"
    return None


class _Checkpointed(torch.nn.Module):
    """A decoder layer run under ``torch.utils.checkpoint`` (the plain-PyTorch way, not transformers')."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, hidden_states, *args, **kwargs):
        fn = functools.partial(self.inner, **kwargs)  # reentrant checkpoints take positional tensors only
        return torch.utils.checkpoint.checkpoint(fn, hidden_states, *args, use_reentrant=self.reentrant)


def _by_name(model, runtime):
    """(the unwrapped model's name, parameter, is a master) for every parameter of the wrapped model."""
    masters = {id(p) for layer in runtime.layers for p in layer.master_params()}
    for name, p in model.named_parameters():
        yield name.replace("._checkpoint_wrapped_module", "").replace(".inner.", "."), p, id(p) in masters


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 shard gathered (a collective)


def _grads(model, runtime, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (DTensor shards gathered); masters under their full tensor's name."""
    return {name: (_full(p.grad), is_master) for name, p, is_master in _by_name(model, runtime)
            if p.grad is not None}


@torch.no_grad()
def _take_parameters(ref, model, runtime, world: int) -> None:
    """Set the unwrapped model's parameters to the wrapped model's: FSDP2 shards and every rank's masters
    gathered (the same collectives in the same order on every rank)."""
    import torch.distributed as dist

    ref_params = dict(ref.named_parameters())
    for name, p, is_master in _by_name(model, runtime):
        full = _full(p.detach()).contiguous()
        if is_master:
            parts = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(parts, full)
            full = torch.cat(parts)
        ref_params[name].copy_(full)


def _scenario(rank, world, family, config, how, steps=STEPS):
    """Train the wrapped model the way ``how`` says and the unwrapped one on the global batch; return the
    mismatches (empty: exact) and how many replicas the plans made."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ultraep

    micro = 4 if how == "ddp-accumulate" else 1
    model = build_model(family, vocab=VOCAB, num_experts=8)
    ref = copy.deepcopy(model)
    ultraep.wrap(model, config)
    rt = ultraep.runtime_of(model)
    problems = []
    if how == "checkpoint-hf":  # transformers' current name: no deprecation warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.activation_checkpointing_enable()
        problems += [f"warned: {w.message}" for w in caught
                     if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    elif how == "checkpoint-hf-legacy":  # the deprecated name users still call works on a wrapped model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.gradient_checkpointing_enable()
        if not any("gradient_checkpointing_enable" in str(w.message) for w in caught):
            problems.append("transformers no longer warns about gradient_checkpointing_enable: drop the legacy case")
    if how.startswith("checkpoint-hf") and not model.is_activation_checkpointing:
        problems.append("activation checkpointing is not on")
    elif how.startswith("checkpoint-torch"):
        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = _Checkpointed(layers[i], reentrant=how.endswith("reentrant"))
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        ignored = ultraep.expert_params(model)
        for layer in model.model.layers:
            fully_shard(layer, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)
        trained = model
    else:
        trained = DDP(model)
    opt = torch.optim.Adam(trained.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        ref_loss = torch.zeros(())
        for mb in range(micro):
            last = mb == micro - 1
            ids = _batch(rank, step, mb)
            with contextlib.nullcontext() if last else ultraep.no_sync(trained):
                loss = _loss(trained(input_ids=ids, use_cache=False).logits, ids) / micro
                loss.backward()
            loss_sum += loss.detach()
            everyone = torch.cat([_batch(r, step, mb) for r in range(world)])
            rl = _loss(ref(input_ids=everyone, use_cache=False).logits, everyone) / micro
            rl.backward()
            ref_loss += rl.detach()
        dist.all_reduce(loss_sum)
        if (d := _differs(loss_sum / world, ref_loss, rtol=1e-5)) is not None:
            problems.append(f"step {step} loss: {d}")
        ref_params = dict(ref.named_parameters())
        got = _grads(model, rt, rank)  # once per step: under FSDP2 every gradient's gather is a collective
        for name, (g, is_master) in got.items():
            want = ref_params[name].grad
            if is_master:
                M = g.shape[0]
                want = want[rank * M:(rank + 1) * M]
            # fp32 rounding of one forward and backward (both models at the same parameters)
            if (d := _differs(g, want, rtol=2e-5)) is not None:
                problems.append(f"step {step} {name}: {d}")
        missing = [n for n, p in ref_params.items() if p.grad is not None and n not in got]
        problems += [f"step {step} {n}: no gradient" for n in missing]
        opt.step()
        _take_parameters(ref, model, rt, world)
        rt.next_step(loss=float(loss_sum))
    replicas = sum(h[5] for h in rt.recording.history)  # (step, layer, policy, before, after, replicas, ...) per call
    return {"problems": problems[:8], "replicas": replicas, "restorations": rt.shared_slots.restorations,
            "policies": sorted({h[2] for h in rt.recording.history})}


def _check(results):
    for r, res in enumerate(results):
        assert not res["problems"], f"rank {r}: " + "\n".join(res["problems"])
    assert sum(res["replicas"] for res in results) > 0, "the plans made no replicas: the test would prove nothing"


HOWS = ["ddp", "ddp-accumulate", "checkpoint-hf", "checkpoint-torch", "checkpoint-torch-reentrant", "fsdp2"]


@pytest.mark.numerics
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_two_ranks_train_like_the_unwrapped_model_on_the_global_batch(family, policy, how):
    _check(run_ranks(_scenario, 2, family, POLICIES[policy], how))


@pytest.mark.numerics
@pytest.mark.parametrize("memory", ["auto", 0])
@pytest.mark.parametrize("how", ["ddp", "ddp-accumulate", "checkpoint-hf", "checkpoint-torch-reentrant", "fsdp2"])
def test_four_ranks_train_like_the_unwrapped_model_on_the_global_batch(how, memory):
    # memory 0: no layer keeps its replicas; they share buffers and restore + recompute in backward
    results = run_ranks(_scenario, 4, "qwen3-moe", {**POLICIES["quota"], "replica_memory_budget": memory}, how)
    _check(results)
    if memory == 0 and how == "checkpoint-hf":  # the layers share buffers: a recompute restores (reentrant: streams)
        assert results[0]["restorations"] >= 1


def test_the_deprecated_checkpointing_name_still_trains_exactly():
    """transformers 5.x renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``; a user
    who still calls the old name on a wrapped model trains exactly as with the new one (the scenario checks the
    old name warns, so this test goes once transformers drops it)."""
    _check(run_ranks(_scenario, 2, "qwen3-moe", POLICIES["quota"], "checkpoint-hf-legacy"))


def test_the_comparison_fails_when_master_gradients_are_not_averaged_like_ddp():
    # negative control: summed master gradients under DDP (what wrap gave before master_grads) are caught
    results = run_ranks(_scenario, 2, "qwen3-moe", {**POLICIES["quota"], "master_grads": "sum"}, "ddp", 1)
    assert any("experts" in p for res in results for p in res["problems"]), results


def _plain_loop(rank, world, config):
    """A loop with no data-parallel wrapper and no synchronisation: the guard must stop it at the first step."""
    import ultraep

    model = build_model("qwen3-moe", vocab=VOCAB)
    ultraep.wrap(model, config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        for step in range(2):
            ids = _batch(rank, step)
            opt.zero_grad()
            _loss(model(input_ids=ids, use_cache=False).logits, ids).backward()
            opt.step()
            ultraep.runtime_of(model).next_step()
    except ultraep.runtime.ParameterDivergenceError as exc:
        return str(exc)
    return None


def test_a_loop_that_synchronises_nothing_is_stopped_at_the_first_step():
    messages = run_ranks(_plain_loop, 2, POLICIES["quota"])
    assert all(m is not None for m in messages), messages  # every rank raises: none is left waiting
    m = messages[0]
    assert "differs across ranks at step 0" in m and "DistributedDataParallel(ultraep.wrap(model))" in m, m
    assert "\n" not in m and "sync_check_every=0" in m
    name = m.split()[0]
    assert name.startswith("model.") and ".experts." not in name, m  # a replicated parameter, never a master


def test_the_replicated_parameter_check_can_be_turned_off():
    assert run_ranks(_plain_loop, 2, {**POLICIES["quota"], "sync_check_every": 0}) == [None, None]


def _wrong_order(rank, world, how):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ultraep

    model = build_model("qwen3-moe", vocab=VOCAB)
    if how == "ddp":
        model = DDP(model)
    elif how == "fsdp2-before":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    try:
        ultraep.wrap(model, POLICIES["quota"])
        if how == "fsdp2-masters":  # after wrap, but without ignored_params: the masters would be sharded
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            ids = _batch(rank, 0)
            model(input_ids=ids, use_cache=False)
    except ultraep.UltraEPError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how,says", [
    ("ddp", "wrap the model with ultraep first, then DDP — DistributedDataParallel(ultraep.wrap(model))"),
    ("fsdp2-before", "wrap the model with ultraep first, then fully_shard(..., ignored_params="),
    ("fsdp2-masters", "pass ignored_params=ultraep.expert_params(model) to every fully_shard call"),
])
def test_a_data_parallel_wrapper_in_the_wrong_order_is_refused_in_one_line(how, says):
    for m in run_ranks(_wrong_order, 2, how):
        assert m is not None and says in m and "\n" not in m, m


@pytest.mark.numerics
@pytest.mark.parametrize("family,policy,how", [("mixtral", "quota", "ddp-accumulate"),
                                               ("mixtral", "adaptive", "checkpoint-hf"),
                                               ("qwen3-moe", "adaptive", "ddp")])
def test_four_ranks_other_families_and_adaptive(family, policy, how):
    _check(run_ranks(_scenario, 4, family, POLICIES[policy], how))
