"""Training as users train — DDP, FSDP2, activation checkpointing, accumulation — on real gloo ranks: exact, or
refused in one line.

The contract (README, "Training with DDP"): a wrapped model trained under a data-parallel wrapper, each rank
on its own batch with its own mean loss, follows the *unwrapped* model trained on the global batch (every rank's
batch, concatenated) with the global mean loss. Both train on their own, each with its own optimizer, through 4
steps: at every step the losses agree, every parameter's gradient agrees (a master's against its rows of the
unwrapped expert tensor), and after the optimizer step every parameter agrees — so a lost or wrong optimizer
update on a master, or a replica left stale after a step, shows (the next forward computes with other weights).
Every comparison is :func:`numerics.rel_error` within :func:`numerics.tolerance` (relative to the reference's
largest magnitude — for a gradient, the largest it had so far in the run, :class:`numerics.TrainingScale`;
NaN and inf fail).

The optimizer is SGD with momentum: its update is a linear function of the gradients, so fp32 rounding of the
gradients stays rounding in the parameters. Adam divides each gradient by its own running magnitude: an element
whose gradient is rounding noise on both sides moves by the full learning rate in directions that differ, which
makes a fixed tolerance on independently trained parameters a matter of the CPU's kernels.

Every rank computes that reference itself (the batches are a function of rank and step), so each scenario is
one launch. The token batches use three ids, so routing is skewed and the replicas compute tokens (counted from
the rows the replicas ran, tests/replica_probe.py, not from the plans: asserted).
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
from nccl_harness import expect_p2p
from numerics import TrainingScale, rel_error, tolerance
from replica_probe import served_rows
from ultraep.models import build_model, preload

preload()

STEPS = 4
VOCAB = 64
POLICIES = {
    "quota": {"policy": "quota", "num_redundant_slots": 2},
    # adaptive probes from its second call (probe_cost_share null): paced, a run of STEPS calls may stay on the
    # model's pick and no replica would compute a token, so the comparison would prove nothing about replicas
    "adaptive": {"policy": "adaptive", "num_redundant_slots": 2, "adaptive": {"probe_cost_share": None}},
}


def _batch(rank: int, step: int, mb: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * mb + 17 * rank + 1)
    return torch.randint(0, 3, (2, 12), generator=g)  # 3 token ids: concentrated routing


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def _differs(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> str | None:
    """None when ``actual`` equals ``expected`` within the fp32 tolerance (tests/numerics.py: relative to the
    reference's largest magnitude, or ``scale`` where larger — a gradient's :class:`numerics.TrainingScale`;
    NaN and inf fail); the figure otherwise."""
    err = rel_error(actual, expected, scale)
    if err <= tolerance():
        return None
    own = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return (f"relative error {err:.3g} > {tolerance():g} (max |reference| {own:.3g}"
            + (f", its largest in this run {scale:.3g})" if scale is not None and scale > own else ")"))


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
def _params(model, runtime) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every parameter of the wrapped model by the unwrapped model's name (FSDP2 shards gathered: a collective,
    in the same order on every rank), with whether it is a master."""
    return {name: (_full(p.detach()).clone(), is_master) for name, p, is_master in _by_name(model, runtime)}


def _scenario(rank, world, family, config, how, steps=STEPS, lose_master_update: bool = False):
    """Train the wrapped model the way ``how`` says and the unwrapped one on the global batch, each with its own
    optimizer; return the mismatches (empty: exact) and the rows the replicas computed. ``lose_master_update``:
    the negative control — the masters' first optimizer update is undone on rank 0."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ultraep

    served = served_rows()
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
    opt = torch.optim.SGD(trained.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_params = dict(ref.named_parameters())
    grad_scale = TrainingScale()
    problems = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
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
        if (d := _differs(loss_sum / world, ref_loss)) is not None:
            problems.append(f"step {step} loss: {d}")
        got = _grads(model, rt, rank)  # once per step: under FSDP2 every gradient's gather is a collective
        for name, (g, is_master) in got.items():
            want = ref_params[name].grad
            if is_master:
                M = g.shape[0]
                want = want[rank * M:(rank + 1) * M]
            if (d := _differs(g, want, grad_scale.update(name, want))) is not None:
                problems.append(f"step {step} {name} gradient: {d}")
        missing = [n for n, p in ref_params.items() if p.grad is not None and n not in got]
        problems += [f"step {step} {n}: no gradient" for n in missing]
        masters = [p for layer in rt.layers for p in layer.master_params()]
        before = [p.detach().clone() for p in masters]
        opt.step()
        ref_opt.step()
        if lose_master_update and step == 0 and rank == 0:
            with torch.no_grad():
                for p, b in zip(masters, before):
                    p.copy_(b)
        # the parameters each trained on its own: the step's update, compared
        for name, (p, is_master) in _params(model, rt).items():
            want = ref_params[name].detach()
            if is_master:
                M = p.shape[0]
                want = want[rank * M:(rank + 1) * M]
            if (d := _differs(p, want)) is not None:
                problems.append(f"step {step} {name} parameter after the update: {d}")
        rt.next_step(loss=float(loss_sum))
    return {"problems": problems[:40], "served": dict(served), "restorations": rt.shared_slots.restorations,
            "policies": sorted({h[2] for h in rt.recording.history})}


def _check(results, records=None):
    """No mismatch on any rank, and replicas that computed tokens (rows counted where they ran). ``records``: the
    run's point-to-point record (:func:`_train`), which must hold the weights those replicas received."""
    for r, res in enumerate(results):
        assert not res["problems"], f"rank {r}: " + "\n".join(res["problems"][:8])
    rows = sum(n for res in results for n in res["served"].values())
    if rows == 0 and records and not records[0].sends and all(res["policies"] == ["none"] for res in results):
        # adaptive chooses from measured times: on a machine where no balancing pays it stays on none, and the
        # run compared the unbalanced path only — reported as such, never as a pass on replicas
        pytest.skip("adaptive chose none at every call here: no replica ran, nothing to compare them on")
    assert rows > 0, "no replica computed a token: the test would prove nothing"
    if records is not None:
        assert records[0].sends > 0, f"replicas computed tokens but no weight moved: {records[0]}"


def _train(world, family, policy, how, **config):
    """:func:`_scenario` on ``world`` ranks; adaptive runs may move nothing (see :func:`_check`), so their record
    is checked there rather than required up front. Returns (results, [the record])."""
    records: list = []
    p2p = records.append if policy == "adaptive" else (lambda rec: records.append(rec) or expect_p2p(rec, True))
    results = run_ranks(_scenario, world, family, {**POLICIES[policy], **config}, how, p2p=p2p)
    return results, records


HOWS = ["ddp", "ddp-accumulate", "checkpoint-hf", "checkpoint-torch", "checkpoint-torch-reentrant", "fsdp2"]


@pytest.mark.numerics
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_two_ranks_train_like_the_unwrapped_model_on_the_global_batch(family, policy, how):
    _check(*_train(2, family, policy, how))


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


def test_the_check_fails_when_no_replica_computed_a_token():
    # negative control: plans may name replicas that compute nothing; only rows the replicas ran count
    _check([{"problems": [], "served": {(0, 1): 4}}])
    for served in ({}, {(0, 1): 0}):
        with pytest.raises(AssertionError, match="no replica computed a token"):
            _check([{"problems": [], "served": served}])


def test_the_comparison_fails_when_master_gradients_are_not_averaged_like_ddp():
    # negative control: summed master gradients under DDP (what wrap gave before master_grads) are caught
    results = run_ranks(_scenario, 2, "qwen3-moe", {**POLICIES["quota"], "master_grads": "sum"}, "ddp", 1)
    assert any("experts" in p for res in results for p in res["problems"]), results


def test_the_comparison_fails_when_a_masters_optimizer_update_is_lost():
    """Negative control: rank 0's masters keep their weights through the first step (an optimizer that skipped
    them). The gradients of that step are right; the parameters after it are not, and the reference, training
    on its own, does not take the wrapped model's weights back."""
    results = run_ranks(_scenario, 2, "qwen3-moe", POLICIES["quota"], "ddp", 2, True)
    first = results[0]["problems"]
    assert first and first[0].startswith("step 0 ") and "experts" in first[0] and "parameter after the update" in \
        first[0], first
    assert not any("gradient" in p for p in first if p.startswith("step 0 ")), first
    assert any(p.startswith("step 1 ") for p in first), first  # and the next step computes with the stale weights


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
    for m in run_ranks(_wrong_order, 2, how, p2p=False):  # refused before anything moves
        assert m is not None and says in m and "\n" not in m, m


@pytest.mark.numerics
@pytest.mark.parametrize("family,policy,how", [("mixtral", "quota", "ddp-accumulate"),
                                               ("mixtral", "adaptive", "checkpoint-hf"),
                                               ("qwen3-moe", "adaptive", "ddp")])
def test_four_ranks_other_families_and_adaptive(family, policy, how):
    _check(*_train(4, family, policy, how))
