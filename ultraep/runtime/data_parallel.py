"""Living inside the user's data-parallel training: DDP, FSDP2 (``fully_shard``), accumulation, and a guard for
a loop that synchronises nothing.

The rule (docs/design.md, "Training as users train"): the expert masters belong to ultraep — each rank holds
different experts, and their gradients already gather every rank's tokens (the all-to-alls and the replica
gradient reduction) — and every other parameter belongs to the user's data-parallel wrapper. So:

* ``wrap`` names the masters in ``_ddp_params_and_buffers_to_ignore``: ``DistributedDataParallel`` neither
  broadcasts them at construction (which would overwrite rank 1's experts with rank 0's) nor averages their
  gradients (which would average gradients of *different* experts);
* FSDP2 cannot be told from inside the module; ``fully_shard(..., ignored_params=expert_params(model))`` keeps
  the masters out, and a master that FSDP2 sharded anyway is refused at the next forward;
* master gradients follow the wrapper's averaging (``BalancerConfig.master_grads``): divided by the group size
  where DDP or FSDP2 average the other gradients, so ``loss.backward()`` on each rank's mean loss gives the
  unwrapped model's gradients of the mean loss over the global batch;
* ``ultraep.no_sync`` (:func:`accumulating`) is one context for gradient accumulation: DDP's (or FSDP2's) and the runtime's together;
* :func:`check_replicated` (run by ``next_step``) catches the silent case: replicated parameters that differ
  across ranks because nothing synchronised them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ultraep.errors import DistributedError, UltraEPError
from ultraep.runtime.comm import collective_device

#: relative difference of a parameter's checksum across ranks above which it is "not replicated": identical
#: parameters differ at most by the summation order of two float64 sums (~1e-16); one optimizer step on
#: unsynchronised gradients moves them by ~1e-4
DIVERGENCE_RTOL = 1e-6


class ParameterDivergenceError(DistributedError):
    """A parameter that every rank should hold identically (everything outside the experts) differs across ranks."""


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _fsdp_module_classes() -> tuple[type, ...]:
    classes: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2 (fully_shard)

        classes.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # FSDP1

        classes.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        pass
    return tuple(classes)


def refuse_wrapped(model: nn.Module) -> None:
    """``wrap`` after DDP or FSDP is refused in one line with the right order: the wrapper has already taken the
    full expert tensors (broadcast, bucketed or sharded them) that ``wrap`` is about to split over the ranks."""
    if isinstance(model, _ddp_class()):
        raise UltraEPError("model", "is already inside DistributedDataParallel: wrap the model with ultraep first, "
                           "then DDP — DistributedDataParallel(ultraep.wrap(model))")
    fsdp = _fsdp_module_classes()
    if getattr(model, "_ultraep_fsdp_ignores_experts", False):
        return  # built by ultraep.integrations.torchtitan: its FSDP application left the expert tensors out
    for name, mod in model.named_modules():
        if fsdp and isinstance(mod, fsdp):
            raise UltraEPError(name or "model", "is already sharded by FSDP: wrap the model with ultraep first, then "
                               "fully_shard(..., ignored_params=ultraep.expert_params(model))")


class MasterNames:
    """What ``wrap`` puts in ``model._ddp_params_and_buffers_to_ignore``: the names the user put there, then the
    masters' names *as DDP reads them* — computed when iterated (DDP iterates it once, at construction), so
    modules restructured after ``wrap`` (an activation-checkpoint wrapper around each block) are followed."""

    def __init__(self, model: nn.Module, layers, user: list[str]) -> None:
        import weakref

        self._model = weakref.ref(model)
        self._layers = layers
        self.user = list(user)

    def masters(self) -> list[str]:
        model = self._model()
        if model is None:
            return []
        ids = {id(p) for layer in self._layers for p in layer.master_params()}
        return [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids]

    def __iter__(self):
        return iter(self.user + [n for n in self.masters() if n not in self.user])


def ignore_masters_in_ddp(model: nn.Module, layers) -> None:
    """Name every layer's masters in ``model._ddp_params_and_buffers_to_ignore`` (what DDP reads at construction),
    keeping the names the user put there."""
    have = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    user = have.user if isinstance(have, MasterNames) else list(have or ())
    model._ddp_params_and_buffers_to_ignore = MasterNames(model, layers, user)


def check_ddp_ignores_masters(layers) -> None:
    """Inside a DDP forward: refuse a DDP that manages a master (its ignore list was replaced after ``wrap``);
    once per DDP instance."""
    ddp = _ddp_class()._active_ddp_module
    if ddp is None or getattr(ddp, "_ultraep_checked", False):
        return
    masters = {id(p) for layer in layers for p in layer.master_params()}
    if any(id(p) in masters for p in getattr(ddp, "_module_parameters", ())):
        raise UltraEPError("DistributedDataParallel", "manages the expert masters: its module's "
                           "_ddp_params_and_buffers_to_ignore was replaced after ultraep.wrap; add to it instead "
                           "(DDP would broadcast rank 0's experts over the others' and average different experts)")
    ddp._ultraep_checked = True


def model_of(model: nn.Module) -> nn.Module:
    """The module ``wrap`` returned, also when the user hands in its DDP wrapper."""
    return model.module if isinstance(model, _ddp_class()) else model


def in_ddp_forward() -> bool:
    """Whether a forward runs inside ``DistributedDataParallel.forward`` (DDP sets this class attribute around it)."""
    return getattr(_ddp_class(), "_active_ddp_module", None) is not None


def has_fsdp(model: nn.Module) -> bool:
    """Whether any module of ``model`` is managed by FSDP (FSDP2's ``fully_shard`` or FSDP1)."""
    fsdp = _fsdp_module_classes()
    return bool(fsdp) and any(isinstance(m, fsdp) for m in model.modules())


def fsdp_averages(model: nn.Module) -> bool:
    """Whether ``model``'s FSDP2 averages the gradients it reduces (its default), or sums them: every parameter
    group's ``gradient_divide_factor`` set to 1 (``set_gradient_divide_factor(1.0)``, what torchtitan's FSDP
    application does — its loss is already divided by the global token count)."""
    factors = []
    for mod in model.modules():
        state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", ()) or ():
            factors.append(getattr(group, "gradient_divide_factor", None))
    return not factors or any(f != 1.0 for f in factors)


def refuse_sharded_masters(model: nn.Module, layers) -> None:
    """Refuse a model whose FSDP2 (``fully_shard``) manages a balanced layer's masters: each rank's masters are
    different experts, so sharding them across ranks mixes experts. Checked where FSDP is first seen (the first
    forward of a step), before any collective of the layer."""
    from torch.distributed.tensor import DTensor

    balanced = {id(layer) for layer in layers}
    fsdp = _fsdp_module_classes()
    for mod in model.modules():
        if not (fsdp and isinstance(mod, fsdp)) or not hasattr(mod, "_get_fsdp_state"):
            continue
        group = getattr(mod._get_fsdp_state(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()):
            info = getattr(fp, "_module_info", None)
            if info is not None and id(info.module) in balanced:
                raise UltraEPError(f"{info.module.name}.{info.param_name}", "is sharded by fully_shard, but expert "
                                   "masters belong to ultraep: pass ignored_params=ultraep.expert_params(model) to "
                                   "every fully_shard call")
    for layer in layers:  # between steps FSDP2 leaves its parameters sharded: DTensors
        for n in layer.adapter.param_names:
            if isinstance(layer._parameters.get(n), DTensor):
                raise UltraEPError(f"{layer.name}.{n}", "is sharded by fully_shard, but expert masters belong to "
                                   "ultraep: pass ignored_params=ultraep.expert_params(model) to every fully_shard "
                                   "call")


@contextmanager
def accumulating(model: nn.Module, runtime):
    """DDP's ``no_sync()`` (or FSDP2's ``set_requires_gradient_sync(False)``) and ``runtime.no_sync()`` together
    (``ultraep.no_sync``)."""
    inner = model_of(model)
    fsdp = [m for m in inner.modules() if hasattr(m, "set_requires_gradient_sync")]
    with ExitStack() as stack:
        if isinstance(model, _ddp_class()):
            stack.enter_context(model.no_sync())
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        stack.enter_context(runtime.no_sync())
        try:
            yield model
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)


def _checksums(params: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """``[P, 3]`` float64: each parameter's sum, sum of squares and element count."""
    rows = []
    for _, p in params:
        d = p.detach().to(torch.float64)
        rows.append(torch.stack([d.sum(), d.pow(2).sum(), torch.tensor(float(d.numel()), dtype=torch.float64,
                                                                        device=d.device)]))
    if not rows:
        return torch.zeros(0, 3, dtype=torch.float64)
    return torch.stack(rows).cpu()


def replicated_params(model: nn.Module, masters: set[int]) -> list[tuple[str, torch.Tensor]]:
    """Parameters every rank should hold identically: all but the masters and FSDP2's shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in model.named_parameters() if id(p) not in masters and not isinstance(p, DTensor)]


def check_replicated(model: nn.Module, masters: set[int], group, step: int) -> None:
    """Raise :class:`ParameterDivergenceError` on every rank when a replicated parameter differs across ranks
    (checksums compared with one all-gather of ``[P, 3]`` float64). Collective: every rank calls it."""
    params = replicated_params(model, masters)
    mine = _checksums(params).to(collective_device(group))  # NCCL gathers only CUDA tensors
    R = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()  # [R, P, 3]
    if table.shape[1] == 0:
        return
    if not torch.equal(table[:, :, 2], table[:1, :, 2].expand_as(table[:, :, 2])):
        raise ParameterDivergenceError(f"the ranks' models have different parameters outside the experts at step "
                                       f"{step}: every rank must build the same model before ultraep.wrap")
    s, n2, count = table[..., 0], table[..., 1], table[0, :, 2]
    scale = n2[0].clamp_min(1e-300)
    rel = torch.maximum((n2 - n2[0]).abs() / scale, (s - s[0]).abs() / (scale * count).sqrt())  # [R, P]
    rel = torch.nan_to_num(rel, nan=float("inf"))
    bad = (rel > DIVERGENCE_RTOL).any(dim=0).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        r = int(rel[:, i].argmax())
        raise ParameterDivergenceError(
            f"{params[i][0]} differs across ranks at step {step} (rank {r} is {float(rel[r, i]):.1e} relative off "
            f"rank 0; {len(bad)} parameter(s) differ): ultraep synchronises only the experts, every other parameter "
            "needs a data-parallel wrapper — DistributedDataParallel(ultraep.wrap(model)), or "
            "fully_shard(..., ignored_params=ultraep.expert_params(model)) — or an all-reduce of its gradient in "
            "your loop; BalancerConfig(sync_check_every=0) turns this check off")
