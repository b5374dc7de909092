"""What a balanced layer takes from the model's experts container: its topology and this rank's masters.

Legend: E experts, R ranks, M = E / R masters per rank, N redundant slots.
"""

from __future__ import annotations

import torch
from torch import nn

from ultraep.topology import Topology


def layer_topology(like: list[torch.Tensor], num_experts: int, layer: int, config, num_ranks: int):
    """``(topology, expert spec)`` of one layer: its EP group with the layer's ``N`` (``config.slots_for``), the
    bytes of one expert (``like``: one expert's tensors) and this machine's seed figures — the links go into the
    topology, so the plans and the engine's cost model of the layer share one topology (calibration then reaches
    every decision)."""
    from ultraep.presets import local_seed

    _, expert_spec, link, _ = local_seed(like, like[0].is_cuda)
    topology = Topology(
        num_ranks=num_ranks, num_experts=num_experts, num_redundant_slots=config.slots_for(layer),
        domain_size=config.domain_size, expert_bytes=int(sum(t.numel() * t.element_size() for t in like)),
        scale_up=link, scale_out=link,
    )
    return topology, expert_spec


def take_masters(container: nn.Module, param_names, rank: int, num_masters: int) -> dict[str, nn.Parameter]:
    """This rank's ``[M, ...]`` slices of the container's ``[E, ...]`` expert parameters (experts ``rank * M`` to
    ``(rank + 1) * M - 1``), as new parameters; the container's full tensors are freed (``unwrap`` gathers the
    masters back)."""
    r, M = rank, num_masters
    out = {}
    for n in param_names:
        full = getattr(container, n)
        out[n] = nn.Parameter(full.detach()[r * M:(r + 1) * M].clone(), requires_grad=full.requires_grad)
        setattr(container, n, nn.Parameter(torch.empty(0, dtype=full.dtype, device=full.device), requires_grad=False))
    return out
