"""The masters in every state dict as what they are: rows of the whole ``[E, ...]`` expert tensors, so that any
``torch.distributed.checkpoint`` save of a wrapped model (torchtitan's checkpointer, ``dcp.save``, ``dcp.async_save``,
with DCP's default planners) writes every rank's experts, and any load gives each rank its own rows.

Each rank holds its masters as plain ``[M, ...]`` parameters under the unwrapped model's names (the layer computes
with them). Left plain in ``state_dict()``, a save would see one name with the same shape on every rank, which DCP
takes for a replicated tensor: it keeps one rank's copy and the other ranks' experts are lost (and a load would put
those rows on every rank). So:

    model.state_dict()           each master is ``DTensor.from_local(master, mesh, [Shard(0)])`` — global shape
                                 ``[E, ...]``, rank ``r`` of the EP group holding rows ``r·M .. (r+1)·M - 1``
                                 (``mesh``: a 1-D DeviceMesh of the layers' EP group; its local tensor shares the
                                 master's storage: a DCP load writes into the master in place)
    model.load_state_dict(sd)    a master's entry may be such a DTensor (Shard(0) over the same ranks: its local
                                 rows), or a plain ``[E, ...]`` tensor (an unwrapped model's: this rank's rows are
                                 taken); a plain ``[M, ...]`` tensor (M < E) is refused — which rows it holds is not
                                 known. The layer is then loaded and its replica cache dropped.
    optimizer.state_dict()       an optimizer stepping on masters carries the same pair of hooks: each per-element
                                 state tensor of a master (momentum, ``exp_avg``, ...) goes out as a DTensor and comes
                                 back as this rank's rows. The hooks are attached by a global optimizer step pre-hook
                                 at the optimizer's first step (every state exists only after one; torchtitan's
                                 checkpointer and ``get_optimizer_state_dict`` take one with zero gradients first).

DTensor's ``Shard(0)`` chunks a dimension of size E over R ranks as ``ceil(E / R)`` rows each; ``wrap`` refuses
``E % R != 0``, so the chunks are exactly ``M = E / R`` rows and rank ``r``'s chunk is its masters. Any checkpoint
written this way is the unwrapped model's: it loads whole into an unwrapped model, or by rows into a wrapped one
on any number of ranks (DCP reshards), and a checkpoint of the unwrapped model loads into a wrapped one by rows.

Legend: E experts, R ranks of the EP group, M = E / R masters per rank.
"""

from __future__ import annotations

import weakref

import torch

from ultraep.errors import UltraEPError

_RUNTIMES: "weakref.WeakSet" = weakref.WeakSet()  # runtimes of wrapped models (their layers' masters)
_SEEN: "weakref.WeakSet" = weakref.WeakSet()  # optimizers the step pre-hook has looked at
_INSTALLED = []  # the global optimizer step pre-hook's handle, once


def mesh_of(runtime):
    """The 1-D DeviceMesh of ``runtime``'s EP group (the layers' own communicator; built once, no collective)."""
    mesh = getattr(runtime, "_master_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(runtime.group, runtime.device.type)
        runtime._master_mesh = mesh
    return mesh


def as_whole(rows: torch.Tensor, mesh) -> torch.Tensor:
    """``rows`` (``[M, ...]``, this rank's) as the ``[E, ...]`` DTensor sharded along dim 0 over ``mesh`` (a view:
    no copy, no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False)


def own_rows(value, key: str, local: torch.Tensor, layer) -> torch.Tensor:
    """This rank's ``[M, ...]`` rows of ``value`` (a master's state-dict entry, checkpoint key ``key``; ``local``:
    the tensor it will be copied into), refusing what does not say which rows it holds. A tensor of any other shape
    goes through unchanged (``load_state_dict`` reports the size mismatch)."""
    from torch.distributed.tensor import DTensor, Shard

    E, M, first = layer.topology.num_experts, int(local.shape[0]), layer.first_expert
    whole = (E, *local.shape[1:])
    if isinstance(value, DTensor):
        mesh = mesh_of(layer.runtime)
        if (tuple(value.placements) == (Shard(0),) and tuple(value.shape) == whole
                and value.device_mesh.mesh.tolist() == mesh.mesh.tolist()):
            return value.to_local()
        raise UltraEPError(key, f"is a DTensor {list(value.shape)} placed {list(value.placements)} on ranks "
                           f"{value.device_mesh.mesh.tolist()}; {layer.name} loads its masters from a Shard(0) DTensor "
                           f"{list(whole)} on its EP group's ranks {mesh.mesh.tolist()} (dcp.load into this model's "
                           "state_dict) or from the whole tensor")
    if not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) == whole:
        return value.narrow(0, first, M)
    if tuple(value.shape) == tuple(local.shape):
        raise UltraEPError(key, f"holds {M} rows {list(value.shape)}, not the {E} experts {list(whole)}: which "
                           "experts they are is not known; load the whole tensor, or the wrapped model's state_dict "
                           "(its masters are DTensors that know their rows)")
    return value


# ------------------------------------------------------------------------------------------------ model state dict
def _state_dict_hook(layer, state_dict, prefix, local_metadata) -> None:
    mesh = mesh_of(layer.runtime)
    for n in layer.adapter.param_names:
        if prefix + n in state_dict:
            state_dict[prefix + n] = as_whole(state_dict[prefix + n], mesh)


def _load_pre_hook(layer, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    found = 0
    for n in layer.adapter.param_names:
        if prefix + n in state_dict:
            state_dict[prefix + n] = own_rows(state_dict[prefix + n], prefix + n, getattr(layer, n), layer)
            found += 1
    if found == len(layer.adapter.param_names):
        layer.master_state.mark_loaded()
    if found:
        layer.epoch.invalidate()  # (a DCP load wrote into the masters' storage: the replica cache must not trust it)


# ------------------------------------------------------------------------------------------------ optimizers
def _masters() -> dict[int, tuple]:
    """``id(master) -> (master, layer)`` over every live wrapped model."""
    return {id(p): (p, layer) for rt in list(_RUNTIMES) for layer in rt.layers for p in layer.master_params()}


def _indexed(optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its ``state_dict`` index order (first occurrence, group after group)."""
    out, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _is_rows(v, p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() >= 1 and v.shape == p.shape


def _optim_state_dict_hook(optimizer, state_dict):
    masters, params = _masters(), _indexed(optimizer)
    state = dict(state_dict["state"])
    for i, s in state.items():
        hit = masters.get(id(params[i])) if isinstance(i, int) and i < len(params) else None
        if hit is not None and isinstance(s, dict):
            p, layer = hit
            mesh = mesh_of(layer.runtime)
            state[i] = {k: as_whole(v, mesh) if _is_rows(v, p) else v for k, v in s.items()}
    return {**state_dict, "state": state}


def _optim_load_pre_hook(optimizer, state_dict):
    masters, params = _masters(), _indexed(optimizer)
    state = dict(state_dict.get("state", {}))
    for i, s in state.items():
        hit = masters.get(id(params[i])) if isinstance(i, int) and i < len(params) else None
        if hit is not None and isinstance(s, dict):
            p, layer = hit
            state[i] = {k: own_rows(v, f"{layer.name}.{_name_of(layer, p)} (optimizer state {k})", p, layer)
                        if isinstance(v, torch.Tensor) and v.dim() >= 1 else v for k, v in s.items()}
    return {**state_dict, "state": state}


def _name_of(layer, p) -> str:
    return next((n for n in layer.adapter.param_names if getattr(layer, n) is p), "?")


def _step_pre_hook(optimizer, args, kwargs) -> None:
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    masters = _masters()
    if any(id(p) in masters for p in _indexed(optimizer)):
        optimizer.register_state_dict_post_hook(_optim_state_dict_hook)
        optimizer.register_load_state_dict_pre_hook(_optim_load_pre_hook)


# ------------------------------------------------------------------------------------------------ wiring
def attach(runtime) -> None:
    """Give every layer of ``runtime`` the state-dict hooks, and every optimizer that steps on its masters the
    optimizer's (``wrap`` calls it)."""
    for layer in runtime.layers:
        layer.register_state_dict_post_hook(_state_dict_hook)
        layer.register_load_state_dict_pre_hook(_load_pre_hook)
    _RUNTIMES.add(runtime)
    if not _INSTALLED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _INSTALLED.append(register_optimizer_step_pre_hook(_step_pre_hook))


def detach(runtime) -> None:
    """``unwrap``: the runtime's masters are plain parameters again."""
    _RUNTIMES.discard(runtime)
