"""Communication for the EP runtime over torch.distributed (gloo on CPU, NCCL on GPU).

Legend: R ranks, E experts, N rows, H hidden size.

* :func:`gather_load`: every rank's per-expert counts ``[E]`` → the exact load matrix ``[R, E]`` on all ranks.
* :class:`AllToAll`: ``all_to_all_single`` with split sizes, differentiable (backward is the reverse
  exchange). Split sizes come from the plan, so no count exchange is needed.
* :func:`exchange`: a batch of point-to-point sends and receives, all posted before any is waited on, so
  two ranks that send to each other never deadlock whatever order they list their messages in.
* :func:`post` / :class:`Pending`: the same batch posted without waiting; the caller waits later, where
  waiting is free (the balanced layer posts replica weights before the token dispatch and waits right
  before the replicas compute). :meth:`Pending.poll` notes when each message was first seen complete, so
  the runtime can tell how much of a transfer was hidden behind compute.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor to all_gather_single; both take a flat R * numel output.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_load(counts_E: torch.Tensor, group=None) -> np.ndarray:
    """All-gather per-rank expert counts ``[E]`` (int64) into the load matrix ``λ[R, E]`` (numpy int64)."""
    R = dist.get_world_size(group)
    E = counts_E.shape[0]
    out = torch.empty(R * E, dtype=torch.int64, device=counts_E.device)  # flat: gloo wants R * numel
    _all_gather(out, counts_E.to(torch.int64).contiguous(), group=group)
    return out.view(R, E).cpu().numpy()


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    """All-gather a short byte string (e.g. a plan digest) from every rank."""
    R = dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
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


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], group=None,
             tag: int = 0) -> None:
    """Send each ``(peer, tensor)`` of ``sends`` and fill each ``(peer, tensor)`` of ``recvs`` (group ranks).

    Messages between the same pair of ranks are matched in the order listed on both sides.
    """
    if not sends and not recvs:
        return
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    reqs = []
    for peer, buf in recvs:
        reqs.append(dist.irecv(buf, src=to_global(peer), group=group, tag=tag))
    for peer, buf in sends:
        reqs.append(dist.isend(buf.contiguous(), dst=to_global(peer), group=group, tag=tag))
    for r in reqs:
        r.wait()


class Pending:
    """Posted point-to-point messages: ``recvs`` then ``sends``, each with its posting time.

    ``done_at[i]`` is the ``perf_counter`` time message i was first seen complete (by :meth:`poll` or
    :meth:`wait`), ``nan`` until then.
    """

    def __init__(self, reqs: list, posted_at: float, num_recvs: int, buffers: list) -> None:
        self.reqs = reqs
        self.buffers = buffers  # alive until the messages complete
        self.posted_at = posted_at
        self.num_recvs = num_recvs
        self.done_at = [float("nan")] * len(reqs)
        self.waited_s = 0.0  # exposed: time spent blocked in wait()

    def poll(self) -> None:
        """Note which messages have completed (never blocks)."""
        now = None
        for i, r in enumerate(self.reqs):
            if self.done_at[i] != self.done_at[i] and r.is_completed():
                now = now or time.perf_counter()
                self.done_at[i] = now

    def wait(self, which: Sequence[int] | None = None) -> None:
        """Block until the messages ``which`` (indices; default all) are complete."""
        t0 = time.perf_counter()
        for i in (range(len(self.reqs)) if which is None else which):
            if self.done_at[i] != self.done_at[i]:
                self.reqs[i].wait()
                self.done_at[i] = time.perf_counter()
        self.waited_s += time.perf_counter() - t0

    def seconds(self, i: int) -> float:
        """Posting to first-seen-complete of message i (an upper bound of its transfer time)."""
        return self.done_at[i] - self.posted_at


def post(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], group=None,
         tag: int = 0) -> Pending:
    """Post every receive, then every send, without waiting (see :func:`exchange` for matching rules)."""
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    t0 = time.perf_counter()
    bufs = [buf for _, buf in recvs] + [buf.contiguous() for _, buf in sends]
    peers = [peer for peer, _ in recvs] + [peer for peer, _ in sends]
    reqs = [dist.irecv(b, src=to_global(p), group=group, tag=tag) for p, b in zip(peers[:len(recvs)], bufs)]
    reqs += [dist.isend(b, dst=to_global(p), group=group, tag=tag)
             for p, b in zip(peers[len(recvs):], bufs[len(recvs):])]
    return Pending(reqs, t0, len(recvs), bufs)
