"""Replica transfers as point-to-point batches that cannot deadlock on NCCL (issue 34).

Shaped like vLLM's ``EplbCommunicator``: :meth:`Transfer.add_send` / :meth:`Transfer.add_recv` collect a
batch, :meth:`Transfer.execute` issues it and returns a :class:`TransferHandle`, and
:meth:`TransferHandle.wait` completes it.

Why a batch, and why this order. NCCL runs the operations between two ranks one at a time in issue order,
ignores tags, and a receive holds the pair until the peer's matching send runs. Gloo does none of that, so
an order that works on gloo can hang on NCCL (``tests/nccl_harness.py`` checks the rules on gloo). Hence:

* every batch is issued as **one group** (``dist.batch_isend_irecv``): its receives and sends progress
  together, so two ranks that send to each other in one batch never wait on each other;
* within a batch the messages to and from each peer are issued in a **canonical order**, sorted by a key
  both sides derive from the plan alone (``(stage, expert, tensor)`` for weights, ``(expert, tensor)`` for
  gradients): the j-th send from A to B meets the j-th receive on B from A without tags;
* callers issue the batches of a layer call at the same program point on every rank, and a batch never
  holds a receive whose send the peer issues in a later batch (see ``replicas.py`` for the three batches).

On gloo ``batch_isend_irecv`` posts each message as its own ``isend`` / ``irecv`` (no coalescing there), so
the per-tensor path of the CPU transport costs what it cost before. On CUDA the batch is issued on a side
stream (:class:`SideStream`) after it waited for the producer of the send buffers, the buffers are
recorded on that stream so the caching allocator does not reuse them early, and a wait makes the current
stream wait for the side stream.
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch
import torch.distributed as dist


def open_transfer_group(ranks: list[int], backend: str, timeout=None):
    """The process group replica transfers travel on, beside the token all-to-alls' group (on NCCL, one
    communicator's operations share a stream: transfers must not queue behind the all-to-alls).

    Its communicator is opened here, by a one-element all-reduce every rank joins: on NCCL a batch of
    point-to-point operations that is a group's *first* operation must include every rank of the group
    (``torch.distributed.batch_isend_irecv``), and a layer call's batches rarely do. Issued on every backend, so
    that the same order runs on gloo, where ``tests/nccl_harness.py`` checks it. ``timeout``: the user group's
    (None: the backend's default)."""
    group = dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


class SideStream:
    """The stream transfers are issued on (CUDA), or nothing to do (CPU). Small on purpose: the three
    calls are all a CUDA transfer needs, and a test drives them with a fake stream module."""

    _streams: dict = {}

    def __init__(self, device: torch.device, cuda=None) -> None:
        self.cuda = cuda if cuda is not None else (torch.cuda if device.type == "cuda" else None)
        self.stream = None
        if self.cuda is not None:
            key = (id(self.cuda), device)
            if key not in SideStream._streams:
                SideStream._streams[key] = self.cuda.Stream(device=device)
            self.stream = SideStream._streams[key]

    def before_issue(self, tensors: Sequence[torch.Tensor]):
        """Order the side stream after the producer of ``tensors``; return the context to issue in."""
        if self.stream is None:
            return _NULL
        self.stream.wait_stream(self.cuda.current_stream())
        for t in tensors:  # used on the side stream: not freed for reuse before it finished with them
            t.record_stream(self.stream)
        return self.cuda.stream(self.stream)

    def after_wait(self) -> None:
        """Order the current stream after the completed transfers (their receive buffers are read next)."""
        if self.stream is not None:
            self.cuda.current_stream().wait_stream(self.stream)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


class Transfer:
    """One batch of point-to-point messages on ``group`` (peers are group ranks)."""

    def __init__(self, group=None, tag: int = 0) -> None:
        self.group, self.tag = group, tag
        self._recvs: list[tuple[int, Hashable, torch.Tensor]] = []
        self._sends: list[tuple[int, Hashable, torch.Tensor]] = []

    def add_recv(self, peer: int, tensor: torch.Tensor, key: Hashable) -> None:
        """Receive into ``tensor`` (contiguous) the message from ``peer`` that the peer sends under ``key``."""
        self._recvs.append((int(peer), key, tensor))

    def add_send(self, peer: int, tensor: torch.Tensor, key: Hashable) -> None:
        """Send ``tensor`` to ``peer``, which receives it under the same ``key``."""
        self._sends.append((int(peer), key, tensor.contiguous()))

    def __len__(self) -> int:
        return len(self._recvs) + len(self._sends)

    def peers(self) -> list[int]:
        """Every peer of the batch (ascending): the ranks a failure here is reported against."""
        return sorted({p for p, _, _ in self._recvs + self._sends})

    def send_bytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) for _, _, t in self._sends)

    def execute(self) -> "TransferHandle":
        """Issue the batch (receives then sends, each sorted by (peer, key)); never waits."""
        recvs = sorted(self._recvs, key=lambda m: (m[0], m[1]))
        sends = sorted(self._sends, key=lambda m: (m[0], m[1]))
        for msgs in (recvs, sends):
            keys = [(p, k) for p, k, _ in msgs]
            if len(set(keys)) != len(keys):  # two messages under one key would match in either order
                raise ValueError(f"duplicate (peer, key) in one transfer batch: {sorted(keys)}")
        t0 = time.perf_counter()
        tensors = [t for _, _, t in recvs] + [t for _, _, t in sends]
        works: list = []
        streams = SideStream(tensors[0].device) if tensors else None
        if tensors:
            ops = [dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag, group_peer=p) for p, _, t in recvs]
            ops += [dist.P2POp(dist.isend, t, group=self.group, tag=self.tag, group_peer=p) for p, _, t in sends]
            with streams.before_issue(tensors):
                works = dist.batch_isend_irecv(ops)
        return TransferHandle(works, [(p, k) for p, k, _ in recvs], [(p, k) for p, k, _ in sends], tensors, t0,
                              streams)


class TransferHandle:
    """An issued :class:`Transfer`: receives ``0..R-1`` then sends, in the canonical order.

    NCCL returns one request for the whole group, gloo one per message: message i waits on
    ``works[owner[i]]``. ``done_at[i]``: the ``perf_counter`` time message i was first seen complete (by
    :meth:`poll` or a wait; NaN until then), so the runtime can tell how much of a transfer was hidden.
    """

    def __init__(self, works: list, recv_keys: list, send_keys: list, tensors: list, posted_at: float,
                 streams: SideStream | None) -> None:
        n = len(recv_keys) + len(send_keys)
        # (no request at all: the backend ordered the batch on the current stream itself; it is done for
        # everything issued after it, so a wait only notes the time)
        self.works = works
        self.owner = list(range(n)) if len(works) == n else [0 if works else -1] * n
        self.recv_keys, self.send_keys = recv_keys, send_keys
        self.tensors = tensors  # alive until the messages complete
        self.posted_at = posted_at
        self.done_at = [float("nan")] * n
        self.waited_s = 0.0  # exposed: time spent blocked in a wait
        self._streams = streams

    @property
    def num_recvs(self) -> int:
        return len(self.recv_keys)

    def poll(self) -> None:
        """Note which messages have completed (never blocks)."""
        now = None
        for i, w in enumerate(self.owner):
            if self.done_at[i] != self.done_at[i] and (w < 0 or self.works[w].is_completed()):
                now = now or time.perf_counter()
                self.done_at[i] = now

    def _wait(self, which: range) -> None:
        t0 = time.perf_counter()
        for i in which:
            if self.done_at[i] != self.done_at[i]:
                w = self.owner[i]
                if w >= 0:
                    self.works[w].wait()
                now = time.perf_counter()
                for k, o in enumerate(self.owner):  # every message of that request completed with it
                    if o == w and self.done_at[k] != self.done_at[k]:
                        self.done_at[k] = now
        if len(which) and self._streams is not None:
            self._streams.after_wait()
        self.waited_s += time.perf_counter() - t0

    def wait_recvs(self) -> None:
        """Block until every receive of the batch completed (on NCCL: the whole group)."""
        self._wait(range(self.num_recvs))

    def wait_sends(self) -> None:
        self._wait(range(self.num_recvs, len(self.owner)))

    def wait(self) -> None:
        self._wait(range(len(self.owner)))

    def recv_seconds(self) -> dict[tuple[int, Hashable], float]:
        """``{(peer, key): posting to first seen complete}`` of each receive (an upper bound of its flight)."""
        return {pk: self.done_at[i] - self.posted_at for i, pk in enumerate(self.recv_keys)}
