"""Replica memory: one owner per layer (:class:`ReplicaStore`), one object for what the layers really share.

Legend: N redundant slots, J tensors per expert, C buffers a layer keeps (``C >= N`` with the replica cache).

Who owns what (docs/design.md, "The runtime's rooms"):

    :func:`split_budget`  (at ``wrap``, before the layers are built) splits ``replica_memory_budget`` over the
                          layers in layer order: a layer whose ``N x expert bytes`` fit is ``kept`` (its own
                          buffers; replicas and their graph live from forward to backward), the others ``restore``
                          (shared buffers, restore + recompute in backward); with the replica cache, what the budget
                          still holds adds up to N more buffers per kept layer (layer order). The result is final:
                          each layer is built with its :class:`ReplicaMemory`, and nothing changes it afterwards.
    :class:`ReplicaStore` (one per layer) owns that layer's buffers, its residency table (:class:`ReplicaCache`)
                          and the job that holds its buffers until its backward ran (:meth:`ReplicaStore.hold`);
                          it hands each job the slots it computes with (:class:`ReplicaSlots`).
    :class:`SharedSlots`  (one per runtime) is what is really shared across layers: the one set of buffers of the
                          ``restore`` layers, per tensor layout, and the generation counter that tells a backward
                          whether a later layer overwrote them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ultraep.runtime.replica_cache import ReplicaCache

KEPT, RESTORE, NONE = "kept", "restore", "none"


@dataclass(frozen=True)
class ReplicaMemory:
    """One layer's share of the replica memory budget (:func:`split_budget`).

    ``mode``: ``"kept"`` (own buffers), ``"restore"`` (shared buffers) or ``"none"`` (no redundant slot).
    ``num_slots``: N. ``capacity``: own buffers per rank (``N``, up to ``2 N`` with the cache; 0 unless kept).
    ``cache``: whether the layer keeps replicas across calls (a kept layer with ``replica_cache`` on)."""

    mode: str = NONE
    num_slots: int = 0
    capacity: int = 0
    cache: bool = False


def split_budget(budget_bytes: int, sizes: list[tuple[int, int]], cache: bool) -> list[ReplicaMemory]:
    """``sizes``: ``(N, expert bytes)`` per layer, in layer order → each layer's :class:`ReplicaMemory`.

    Step 1: a layer whose ``N x expert bytes`` still fit the budget is kept, the others restore.
    Step 2 (``cache``): the cache lives in the kept layers' own buffers; what the budget still holds adds up to
            N more per kept layer (layer order), so replicas that leave a plan survive a while (LRU).

    Example: budget 100, sizes [(2, 30), (2, 30), (1, 30)] → kept (60 reserved), restore (60 more do not fit),
    kept (90 reserved); with the cache, the 10 bytes left hold no further buffer (capacities 2, 0, 1)."""
    reserved = 0
    modes = []
    for n, b in sizes:  # Step 1
        if not n:
            modes.append(NONE)
        elif reserved + n * b <= budget_bytes:
            reserved += n * b
            modes.append(KEPT)
        else:
            modes.append(RESTORE)
    out = []
    for (n, b), mode in zip(sizes, modes):  # Step 2
        capacity = n if mode == KEPT else 0
        if cache and mode == KEPT:
            more = max(0, min(n, (budget_bytes - reserved) // b))
            reserved += more * b
            capacity += more
        out.append(ReplicaMemory(mode, n, capacity, cache and mode == KEPT))
    return out


class SharedSlots:
    """The replica buffers the ``restore`` layers share (one ``[N][J]`` set per tensor layout) and their
    generation counter: ``generation`` counts syncs into the shared buffers, so a backward can tell whether a
    later layer overwrote its replicas; ``restorations`` counts the restores that caused."""

    def __init__(self) -> None:
        self._sets: dict[tuple, list[list[torch.Tensor]]] = {}
        self.generation = 0
        self.restorations = 0

    def allocated_bytes(self) -> int:
        """Bytes of the shared buffers allocated so far."""
        return sum(t.numel() * t.element_size() for sets in self._sets.values() for slot in sets for t in slot)

    def take(self, like: list[torch.Tensor], num_slots: int) -> list[list[torch.Tensor]]:
        """``[N][J]`` tensors shaped like one expert's tensors ``like`` (allocated once per layout)."""
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in like)
        have = self._sets.get(key, [])
        while len(have) < num_slots:
            have.append([torch.empty_like(t) for t in like])
        self._sets[key] = have
        return have[:num_slots]


class ReplicaSlots:
    """The ``[N][J]`` buffers one job computes with (slot ``M + i`` uses ``tensors[i]``).

    ``kept``: the layer's own buffers (they hold the replicas until the job's backward); else the shared ones,
    stamped with the generation of the sync that filled them (:meth:`filled`) so :meth:`overwritten` can tell
    whether another layer's sync came since."""

    def __init__(self, tensors: list[list[torch.Tensor]], kept: bool, shared: SharedSlots) -> None:
        self.tensors, self.kept, self._shared = tensors, kept, shared
        self.stamp = -1

    def filled(self) -> None:
        """The weights arrived in these buffers."""
        if not self.kept:
            self._shared.generation += 1
            self.stamp = self._shared.generation

    def overwritten(self) -> bool:
        """Whether a later sync into the shared buffers replaced what this job's replicas need."""
        return not self.kept and self._shared.generation != self.stamp

    def restored(self) -> None:
        self._shared.restorations += 1


class ReplicaStore:
    """The replica memory of one layer: its own buffers (mode ``kept``), its residency table (``cache``), the
    shared buffers it falls back to, and the job that holds its buffers until that job's backward ran."""

    def __init__(self, memory: ReplicaMemory, home_E: np.ndarray, shared: SharedSlots) -> None:
        self.memory = memory
        self.mode = memory.mode
        #: replicas kept across calls while their masters are unchanged (a kept layer with the cache on)
        self.cache: ReplicaCache | None = ReplicaCache(home_E, memory.capacity) if memory.cache else None
        self.shared = shared
        self._own: list[list[torch.Tensor]] | None = None  # allocated on first use
        self._holder: weakref.ref | None = None

    def allocated_bytes(self) -> int:
        """Bytes of this layer's own replica buffers allocated so far (the shared ones: ``shared.allocated_bytes``)."""
        return sum(t.numel() * t.element_size() for slot in self._own or [] for t in slot)

    # ------------------------------------------------------------------ who holds the buffers
    def hold(self, job) -> None:
        """``job`` keeps its replicas in this layer's buffers until its backward ran (or its graph is freed)."""
        self._holder = weakref.ref(job)

    def busy(self) -> bool:
        job = self._holder() if self._holder is not None else None
        return job is not None and job.holds_replicas

    def cache_usable(self) -> bool:
        """Whether this rank can plan with its residency this call (sent with the load: every rank must agree)."""
        return self.cache is not None and not self.busy()

    # ------------------------------------------------------------------ residency
    def resident(self, usable: bool, epoch_R: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
        """bool ``[R, E]`` the plan may reuse: the cache's table when every rank can use it (``usable``), else
        nothing — and the cache forgets, since this call overwrites what the buffers held."""
        if usable:
            return self.cache.resident(epoch_R, num_ranks)
        self.forget()
        return np.zeros((num_ranks, num_experts), dtype=bool)

    def forget(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    # ------------------------------------------------------------------ slots of a job
    def slots(self, plan, epoch_R: np.ndarray, like: list[torch.Tensor], cached: bool, rank: int,
              expert_bytes: int) -> tuple[ReplicaSlots, int]:
        """The buffers ``plan``'s job on ``rank`` computes with (``like``: one expert's J tensors) and how many of
        its replicas were resident: the cache's buffers (``cached``), else this layer's own when free, else the
        shared ones."""
        if cached:
            tensors, hits = self._cached(plan, epoch_R, like, rank, expert_bytes)
            return ReplicaSlots(tensors, True, self.shared), hits
        own = self._own_buffers(like, self.memory.num_slots)
        if own is not None:
            return ReplicaSlots(own, True, self.shared), 0
        return ReplicaSlots(self.shared.take(like, plan.topology.num_redundant_slots), False, self.shared), 0

    def _own_buffers(self, like: list[torch.Tensor], num_slots: int) -> list[list[torch.Tensor]] | None:
        """``[num_slots][J]`` buffers of this layer, or None when it has none or they still hold replicas a backward
        will read (several forwards before one backward, e.g. gradient accumulation in a pipeline schedule)."""
        if self.mode != KEPT or self.busy():
            return None
        if self._own is None or len(self._own) < num_slots:
            self._own = [[torch.empty_like(t) for t in like] for _ in range(num_slots)]
        return self._own[:num_slots]

    def _cached(self, plan, epoch_R, like, rank: int, expert_bytes: int):
        """``[N][J]`` from the cache's buffers (a resident replica's slot is the buffer that already holds it; an
        unused slot gets a buffer no replica of this plan needs) and how many of ``rank``'s replicas were resident."""
        t = plan.topology
        M, N = t.num_masters, t.num_redundant_slots
        bufs = self._own_buffers(like, self.cache.capacity)
        where, hits = self.cache.admit(plan.replicas, epoch_R, rank, expert_bytes)
        spare = iter(sorted(set(range(self.cache.capacity)) - set(where.values())))
        row = plan.phy2log_RS[rank, M:]
        return [bufs[where[int(e)]] if e >= 0 else bufs[next(spare)] for e in row[:N]], hits
