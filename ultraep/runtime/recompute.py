"""Activation checkpointing: which of a layer's calls a recompute replays.

A checkpointed block runs its forward twice: once in the forward pass, and again in the backward pass to
recompute the activations it did not keep (``torch.utils.checkpoint``, transformers'
``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``). The balanced layer must not
plan the second time: a second load all-gather and plan would commit a second plan to the engine's history,
could choose other replicas, and — with a non-reentrant checkpoint — would save other tensors than the original
forward did. So every training-mode call keeps a small :class:`Replay` (its plan, its replica job, every rank's
master epoch), and a forward that runs inside a backward (the recompute) replays the call it recomputes.

Which call: a layer normally has one call waiting for its backward; with several (gradient accumulation whose
backward runs over several microbatches at once, or a pipeline schedule) the autograd node that triggered the
recompute tells. Every call is stamped with the autograd sequence number current at its start (the counter
every graph node is numbered from, in creation order):

* non-reentrant checkpoint: the recompute is triggered by a node of the checkpointed region itself, created
  after the region's start — the call is the one with the largest stamp at or below that node's number;
* reentrant checkpoint: the recompute runs inside the region's ``CheckpointFunctionBackward``, created just
  before the region ran — the call is the one with the smallest stamp above that node's number.

Every rank's model runs the same structure, so every rank picks the same call: the collectives of the replay
stay consistent. A call is dropped once its backward ran, at ``next_step``, or beyond :data:`LIMIT` per layer.
"""

from __future__ import annotations

import numpy as np
import torch

from ultraep.errors import UltraEPError

#: replayable calls kept per layer (the oldest go first): enough for any accumulation or pipeline depth in use
LIMIT = 64


def _sequence_stamp() -> int:
    """The autograd sequence number at this point of the forward (a node made now gets it)."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class Replay:
    """One call of a balanced layer as a recompute replays it.

    ``plan``: the plan the call routed with; ``job``: its replica job (None without replicas); ``had_grad``: the
    call built a graph (non-reentrant checkpoint: that graph runs the backward); ``epoch_R``: every rank's master
    epoch at the call (a replayed call that defers its replica gradients records it)."""

    __slots__ = ("plan", "job", "had_grad", "epoch_R", "stamp")

    def __init__(self, plan, job, had_grad: bool, epoch_R: np.ndarray) -> None:
        self.plan, self.job, self.had_grad = plan, job, had_grad
        self.epoch_R = np.array(epoch_R, copy=True)
        self.stamp = _sequence_stamp()


class Replays:
    """A layer's replayable calls, oldest first."""

    def __init__(self) -> None:
        self._calls: list[Replay] = []

    def __len__(self) -> int:
        return len(self._calls)

    def keep(self, call: Replay) -> None:
        self._calls.append(call)
        if len(self._calls) > LIMIT:
            del self._calls[0]

    def drop(self, call: Replay | None) -> None:
        """``call``'s backward ran: no recompute needs it any more."""
        if call is not None:
            self._calls = [c for c in self._calls if c is not call]

    def clear(self) -> None:
        self._calls.clear()

    def take(self, layer_name: str) -> Replay:
        """The call the running recompute replays (module docstring); a reentrant checkpoint's call is removed
        (its recompute is the only one), a non-reentrant one stays until its backward ran."""
        node = torch._C._current_autograd_node()
        reentrant = node is not None and type(node).__name__ == "CheckpointFunctionBackward"
        calls = [c for c in self._calls if c.had_grad != reentrant]
        pick = None
        if node is not None and calls:
            seq = node._sequence_nr()
            if reentrant:
                above = [c for c in calls if c.stamp > seq]
                pick = min(above, key=lambda c: c.stamp) if above else None
            else:
                below = [c for c in calls if c.stamp <= seq]
                pick = max(below, key=lambda c: c.stamp) if below else None
        elif len(calls) == 1:
            pick = calls[0]
        if pick is None:
            raise UltraEPError(layer_name, "ran a forward inside a backward (an activation-checkpoint recompute) with "
                               "no call of its own to replay: ultraep keeps the calls of a module in training mode "
                               "(model.train()) until their backward ran or the step ended (next_step); "
                               f"{len(self._calls)} call(s) wait")
        if reentrant:
            self.drop(pick)
        return pick


class RecomputeAnchor(torch.autograd.Function):
    """Identity on a layer's output whose backward reads one saved tensor.

    Under a non-reentrant checkpoint, the first saved tensor a backward reads triggers the recompute of the whole
    checkpointed region — with the balanced layer's collectives in it. The layer's own graph differs by rank
    (replicas, empty slots), so left alone that first read comes at different points on different ranks, and one
    rank's recompute all-to-all would wait on a peer blocked in the replica gradient reduction. Reading a saved
    tensor here, where the layer's backward starts — the same point of every rank's graph — runs the recompute
    there on every rank (or earlier, at another rank-independent point of the region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # noqa: B018 - the read that triggers a pending recompute
        return grad, None

