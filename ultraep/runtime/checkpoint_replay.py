"""The forward of an activation-checkpoint recompute of a balanced layer: its original call replayed.

Which call a recompute replays, and why it must not plan again, is :mod:`ultraep.runtime.recompute`'s; this
module runs it: the original plan's token path (:func:`~ultraep.runtime.token_path.route_tokens`) with the
original replicas, or — for a reentrant checkpoint, whose original call built no graph — with its replicas streamed
again.
"""

from __future__ import annotations

import torch

from ultraep.plan.transfers import transfers_for
from ultraep.runtime.clock import clock_for
from ultraep.runtime.token_path import route_tokens


def recompute_forward(layer, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward of an activation-checkpoint recompute of ``layer`` (a ``BalancedExperts``): the original call's
    plan, routes and replicas, with no second load all-gather, plan or commit (docs/design.md, "Training as users
    train"). ``[T, H]``, ``[T, K]``, ``[T, K]`` → ``[T, H]``.

    * Non-reentrant checkpoint (``use_reentrant=False``, transformers' default): the original call's graph
      runs the backward; the recompute only reproduces the tensors it saved, in the same order. Its replicas
      compute from the weights the original job still holds (restored first if shared buffers were reused).
    * Reentrant checkpoint: the original call ran without grad; this recompute's own graph runs the backward,
      so it is a full forward of the original plan: its replica weights stream again (the original's buffers
      may have been reused since) and its gradients reduce as any call's. It is not recorded (the original was)."""
    call = layer.replays.take(layer.name)
    if call.had_grad:
        job = call.job
        if job is not None and job.lease.overwritten():
            job.restore_weights()  # a later layer reused the shared buffers (the backward would restore too)
        clk = job.clock if job is not None else clock_for(hidden_states)
        out, *_ = route_tokens(layer, hidden_states, top_k_index, top_k_weights, call.plan, job, True, {}, clk, call)
        return out.to(hidden_states.dtype)
    needs_backward = torch.is_grad_enabled()
    plan = transfers_for(call.plan)  # every replica streams: nothing is known to be resident any more
    layer.store.forget()  # and the streams overwrite the cache's buffers (on every rank alike)
    clk = clock_for(hidden_states)
    job, plan, _ = layer._start_replicas(plan, call.epoch_R, False, needs_backward, clk)
    out, *_ = route_tokens(layer, hidden_states, top_k_index, top_k_weights, plan, job, needs_backward, {}, clk)
    return out.to(hidden_states.dtype)
