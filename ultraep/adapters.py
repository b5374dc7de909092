"""Adapters: how ultraep finds, reads and runs the experts of a model, without touching model code.

The interception point is the **experts container**: a module called as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` that holds the
weights of all E experts as 3-D parameters with a leading expert dimension. That is exactly Hugging Face
transformers v5's *experts interface* (``@use_experts_implementation``), so the router, shared experts,
group-limited routing and DeepSeek's ``e_score_correction_bias`` all stay in the MoE block, untouched.

The explicit table :data:`HF_EXPERTS` names the model families ultraep is tested on; any other module
carrying the v5 experts-interface flags (``is_transposed``, ``has_bias``, ``_apply_gate``, ...) and
``gate_up_proj`` / ``down_proj`` parameters is supported the same way. Plain PyTorch containers register
with :func:`register_experts` (see the protocol there). Anything else raises with the supported list.

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
    """The model has no experts container ultraep knows how to balance."""


ExpertForward = Callable[[nn.Module, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class ExpertsAdapter:
    """How to run one expert of a container.

    param_names     the container's 3-D parameters, leading dimension E, in the order ``forward`` takes them
    forward         ``forward(container, x [T, H], tensors) -> [T, H]``: one expert applied to its rows,
                    ``tensors[j] = getattr(container, param_names[j])[e]``, *without* the routing weight
    name            for reports
    """

    name: str
    param_names: tuple[str, ...]
    forward: ExpertForward

    def num_experts(self, container: nn.Module) -> int:
        return int(getattr(container, self.param_names[0]).shape[0])


def _hf_forward(mod: nn.Module, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert of a transformers v5 experts-interface container (all its layout flags honoured)."""
    transposed = getattr(mod, "is_transposed", False)
    if getattr(mod, "has_bias", False):
        gate_up, down, gate_up_b, down_b = tensors
    else:
        (gate_up, down), gate_up_b, down_b = tensors, None, None
    h = x @ gate_up if transposed else F.linear(x, gate_up)
    if gate_up_b is not None:
        h = h + gate_up_b
    h = mod._apply_gate(h)  # concatenated [gate; up] or interleaved (GPT-OSS), with the model's activation
    y = h @ down if transposed else F.linear(h, down)
    if down_b is not None:
        y = y + down_b
    return y


def _hf_adapter(mod: nn.Module) -> ExpertsAdapter:
    names = ("gate_up_proj", "down_proj")
    if getattr(mod, "has_bias", False):
        names = names + ("gate_up_proj_bias", "down_proj_bias")
    return ExpertsAdapter(f"transformers:{type(mod).__name__}", names, _hf_forward)


# Model families tested end to end (tests/test_runtime*.py); other v5 experts-interface modules work alike.
HF_EXPERTS = {
    "MixtralExperts": "mixtral",
    "Qwen3MoeExperts": "qwen3_moe",
    "DeepseekV3Experts": "deepseek_v3",
    "GptOssExperts": "gpt_oss",
}

_CUSTOM: dict[type, ExpertsAdapter] = {}


def register_experts(cls: type, param_names: Sequence[str], forward: ExpertForward, name: str | None = None) -> None:
    """Register a plain PyTorch experts container class.

    Protocol: instances of ``cls`` are called as ``experts(hidden [T, H], top_k_index [T, K] (int),
    top_k_weights [T, K]) -> [T, H]`` and return ``Σ_k w[t, k] * expert_{idx[t, k]}(hidden[t])``; each name in
    ``param_names`` is an ``nn.Parameter`` of shape ``[E, ...]``; ``forward(container, x, tensors)`` applies
    one expert (tensors = that expert's slices, in ``param_names`` order) to rows ``x`` without the routing
    weight. ``wrap`` then balances every instance of ``cls`` in the model. A block whose experts live in an
    ``nn.ModuleList`` stacks them into such a container once (see ``tests/test_runtime.py``'s custom block).
    """
    if not param_names:
        raise UltraEPError("param_names", "must name at least one [E, ...] parameter")
    _CUSTOM[cls] = ExpertsAdapter(name or f"custom:{cls.__name__}", tuple(param_names), forward)


def adapter_for(mod: nn.Module) -> ExpertsAdapter | None:
    """The adapter of an experts container, or ``None`` if ``mod`` is not one."""
    for cls, adapter in _CUSTOM.items():
        if isinstance(mod, cls):
            return adapter
    if type(mod).__name__ in HF_EXPERTS or (
        hasattr(mod, "_apply_gate") and hasattr(mod, "is_transposed")
        and isinstance(getattr(mod, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(mod, "down_proj", None), nn.Parameter)
    ):
        if not getattr(mod, "has_gate", True):
            return None
        return _hf_adapter(mod)
    return None


def supported() -> list[str]:
    """Human-readable list of what ``wrap`` accepts."""
    out = [f"transformers v5 {cls} ({fam})" for cls, fam in HF_EXPERTS.items()]
    out.append("any transformers v5 experts-interface module with gate_up_proj/down_proj")
    out += [a.name for a in _CUSTOM.values()]
    return out
