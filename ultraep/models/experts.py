"""What one expert of a container is to ultraep: :class:`ExpertsAdapter` (its parameters and its one-expert
function), the experts interface's flags and the function they describe, and :class:`UnsupportedModelError`.

A module of its own because both sides use it: :mod:`.adapters` (which finds and checks containers, and asks
:mod:`.rewrite` about the blocks it rewrote) and :mod:`.rewrite` (which builds containers for blocks that keep
their experts another way). Neither then imports the other in both directions.

Legend: E experts, H hidden size, I expert intermediate size, T rows of one expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ultraep.errors import UltraEPError


class UnsupportedModelError(UltraEPError):
    """The model has no experts container ultraep knows how to balance, or one it must refuse."""


ExpertForward = Callable[[nn.Module, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class ExpertsAdapter:
    """How to run one expert of a container.

    param_names     the container's expert parameters, leading dimension E, in the order ``forward`` takes them:
                    the one description the runtime reads to slice, allocate (a model on the meta device), load
                    by rows, save and measure a rank's masters (``runtime/masters.py``, ``runtime/master_rows.py``)
    forward         ``forward(container, x [T, H], tensors) -> [T, H]``: one expert applied to its rows,
                    ``tensors[j] = getattr(container, param_names[j])[e]``, *without* the routing weight
    name            for reports
    shared          submodules of the container whose parameters every expert uses (a post-expert norm): the
                    balanced layer keeps them whole on every rank and gives each rank's copy the gradient of the
                    rows that rank computed (docs/design.md, § experts adapters)
    """

    name: str
    param_names: tuple[str, ...]
    forward: ExpertForward
    shared: tuple[str, ...] = ()

    def num_experts(self, container: nn.Module) -> int:
        return int(getattr(container, self.param_names[0]).shape[0])


#: experts-interface flags this adapter implements, with the interface's defaults
FLAGS = {"is_transposed": False, "has_bias": False, "is_concatenated": True, "has_gate": True,
         "has_post_expert_norm": False}


def _gate(mod: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Gated activation of ``h [T, 2I] -> [T, I]``: the class's own ``_apply_gate`` (what every transformers
    experts implementation calls; it encodes is_concatenated) or, without one, chunk [gate; up]."""
    apply = getattr(mod, "_apply_gate", None)
    if apply is not None:
        return apply(h)
    gate, up = h.chunk(2, dim=-1)
    return mod.act_fn(gate) * up


def hf_expert_forward(flags: dict[str, object]) -> ExpertForward:
    """The one-expert function of a transformers experts-interface container with ``flags`` (:data:`FLAGS`)."""
    transposed, bias = bool(flags["is_transposed"]), bool(flags["has_bias"])
    gated, post_norm = bool(flags["has_gate"]), bool(flags["has_post_expert_norm"])

    def forward(mod: nn.Module, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One expert: x [T, H] -> [T, H] (up or gate_up, activation, down, optional bias and post norm)."""
        w_in, w_out = tensors[0], tensors[1]
        h = x @ w_in if transposed else F.linear(x, w_in)
        if bias:
            h = h + tensors[2]
        h = _gate(mod, h) if gated else mod.act_fn(h)
        y = h @ w_out if transposed else F.linear(h, w_out)
        if bias:
            y = y + tensors[3]
        if post_norm:
            y = mod.post_expert_norm(y)
        return y

    return forward
