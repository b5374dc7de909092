"""Communication for the EP runtime over torch.distributed (gloo on CPU, NCCL on GPU).

Legend: R ranks, E experts, N rows, H hidden size.

* :func:`gather_load`: every rank's per-expert counts ``[E]`` → the exact load matrix ``[R, E]`` on all ranks.
* :func:`check_same_plan`: every rank's plan digest compared (``BalancerConfig.check_plan_hash``).
* :class:`AllToAll`: ``all_to_all_single`` with split sizes, differentiable (backward is the reverse
  exchange). Split sizes come from the plan, so no count exchange is needed.

Point-to-point batches (replica weights and gradients) are :mod:`ultraep.runtime.transport`'s.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ultraep.errors import PlanDivergenceError


# torch 2.13 renamed all_gather_into_tensor to all_gather_single; both take a flat R * numel output.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_load(counts_E: torch.Tensor, group=None) -> np.ndarray:
    """All-gather per-rank expert counts ``[E]`` (int64) into the load matrix ``λ[R, E]`` (numpy int64)."""
    R = dist.get_world_size(group)
    E = counts_E.shape[0]
    out = torch.empty(R * E, dtype=torch.int64, device=counts_E.device)  # flat: gloo wants R * numel
    _all_gather(out, counts_E.to(torch.int64).contiguous(), group=group)
    return out.view(R, E).cpu().numpy()


def check_same_plan(plan, group, where: str) -> None:
    """Compare ``plan``'s digest across the ranks of ``group`` (one small all-gather); raise
    :class:`~ultraep.errors.PlanDivergenceError` on every rank if any rank computed a different plan."""
    digests = all_gather_bytes(plan.digest().encode(), group)
    if len(set(digests)) != 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanDivergenceError(f"{where}: ranks {bad} computed a different plan than rank 0 "
                                  f"(digests {[d.decode() for d in digests]}); refusing to exchange tokens")


def collective_device(group=None) -> torch.device | None:
    """Where a tensor must live for a collective on ``group``: the current CUDA device on NCCL (which has no CPU
    path: "No backend type associated with device type cpu"), None (stay on the CPU) otherwise."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    """All-gather a short byte string (e.g. a plan digest) from every rank."""
    R = dist.get_world_size(group)
    dev = collective_device(group)
    t = torch.zeros(64, dtype=torch.uint8)
    data = payload[:63]
    t[0] = len(data)
    t[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(R * 64, dtype=torch.uint8, device=dev)
    _all_gather(out, t.to(dev) if dev is not None else t, group=group)
    out = out.view(R, 64).cpu()
    return [bytes(out[r, 1:1 + int(out[r, 0])].tolist()) for r in range(R)]


def _a2a(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows ``[sum(in_splits), ...]`` → ``[sum(out_splits), ...]``; rows to rank r are the r-th block.

    ``guard`` (optional): a callable returning a context manager placed around the backward exchange (the
    balanced layer turns a failed peer into a clear error there, as it does around the forward call).
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, guard=None):
        ctx.splits = (list(out_splits), list(in_splits))
        ctx.group = group
        ctx.guard = guard
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        with ctx.guard() if ctx.guard is not None else nullcontext():
            g = _a2a(grad, in_splits, out_splits, ctx.group)
        return g, None, None, None, None
