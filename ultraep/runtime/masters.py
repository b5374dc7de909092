"""What a balanced layer takes from the model's experts container: its topology and this rank's masters.

Legend: E experts, R ranks, M = E / R masters per rank, N redundant slots.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ultraep.errors import UltraEPError
from ultraep.topology import Topology


def layer_topology(like: list[torch.Tensor], num_experts: int, layer: int, config, num_ranks: int,
                   cuda: bool | None = None):
    """``(topology, expert spec)`` of one layer: its EP group with the layer's ``N`` (``config.slots_for``), the
    bytes of one expert (``like``: one expert's tensors) and this machine's seed figures — the links go into the
    topology, so the plans and the engine's cost model of the layer share one topology (calibration then reaches
    every decision). ``cuda``: whether the masters will live on a GPU (default: where ``like`` is; ``like`` on the
    meta device has only shapes)."""
    from ultraep.presets import local_seed

    _, expert_spec, link, _ = local_seed(like, like[0].is_cuda if cuda is None else cuda)
    topology = Topology(
        num_ranks=num_ranks, num_experts=num_experts, num_redundant_slots=config.slots_for(layer),
        domain_size=config.domain_size, expert_bytes=int(sum(t.numel() * t.element_size() for t in like)),
        scale_up=link, scale_out=link,
    )
    return topology, expert_spec


def take_masters(container: nn.Module, param_names, rank: int, num_masters: int) -> dict[str, nn.Parameter]:
    """This rank's ``[M, ...]`` slices of the container's ``[E, ...]`` expert parameters (experts ``rank * M`` to
    ``(rank + 1) * M - 1``), as new parameters; the container's full tensors are freed (``unwrap`` gathers the
    masters back). A container on the meta device gives ``[M, ...]`` meta masters: ``model.to_empty`` allocates
    them (M rows, not E) and ``ultraep.load_masters`` fills them."""
    r, M = rank, num_masters
    out = {}
    for n in param_names:
        full = getattr(container, n)
        out[n] = nn.Parameter(full.detach()[r * M:(r + 1) * M].clone(), requires_grad=full.requires_grad)
        setattr(container, n, nn.Parameter(torch.empty(0, dtype=full.dtype, device=full.device), requires_grad=False))
    return out


class MasterState:
    """Whether a layer's masters hold weights, and the gradient hook each carries.

    ``loaded``: False while masters taken from a container on the meta device hold none: ``[M, ...]`` meta tensors
    until ``model.to_empty`` allocates them and ``ultraep.load_masters`` fills them (then :meth:`mark_loaded`).
    ``grad_hook``: the layer's scaling of master gradients (``master_grads``); ``to_empty`` replaces a meta parameter
    by a new one, so :meth:`hook` runs at every call and attaches it to any master that lacks it."""

    def __init__(self, name: str, params: list[torch.Tensor], grad_hook) -> None:
        self.name, self.grad_hook = name, grad_hook
        self.loaded = not any(p.device.type == "meta" for p in params)
        self._hooked = WeakIdKeyDictionary()  # the parameters that carry the hook (by identity, not ==)
        self.hook(params)

    def mark_loaded(self) -> None:
        self.loaded = True

    def hook(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.requires_grad and p not in self._hooked:
                p.register_hook(self.grad_hook)
                self._hooked[p] = True

    def check_loaded(self, params: list[torch.Tensor]) -> None:
        """Refuse a call before the masters hold weights (one line naming ``<layer>.masters``)."""
        if self.loaded:
            return
        meta = any(p.device.type == "meta" for p in params)
        raise UltraEPError(
            f"{self.name}.masters", "are on the meta device: allocate the model (model.to_empty(device=...)) and "
            "load them (ultraep.load_masters(model, source))" if meta else "were allocated but never loaded: "
            "ultraep.load_masters(model, SafetensorsMasters(...) | DCPMasters(...) | InitMasters(fn)) or "
            "model.load_state_dict(...) fills them")


def held_bytes(layers) -> dict[str, int]:
    """Bytes of expert tensors this rank holds, per kind: ``masters`` (every layer's ``[M, ...]``), ``replicas``
    (the replica buffers allocated so far: the layers' own and the shared ones), ``containers`` (what is left in
    the experts containers: 0 once wrapped) and ``full`` (the ``[E, ...]`` tensors a whole model would hold)."""
    def nbytes(ts) -> int:
        return int(sum(t.numel() * t.element_size() for t in ts))

    out = {"masters": 0, "replicas": 0, "containers": 0, "full": 0}
    shared = {}
    for layer in layers:
        masters = layer.master_params()
        out["masters"] += nbytes(masters)
        out["containers"] += nbytes(getattr(layer.container, n) for n in layer.adapter.param_names)
        out["full"] += layer.topology.num_experts * nbytes(p[0] for p in masters)
        out["replicas"] += layer.store.allocated_bytes()
        shared[id(layer.store.shared)] = layer.store.shared
    out["replicas"] += sum(s.allocated_bytes() for s in shared.values())
    return out
