"""Replica cache of one balanced layer: replica weights stay valid until their master changes.

Legend: R ranks, E experts, M masters per rank, N redundant slots, C cached replicas a rank may hold
(``C >= N``), P replicas in a plan.

In serving, and between the microbatches of one optimizer step, a master's weights do not change, and hot
experts stay hot for many batches; re-sending every replica every call (UltraEP streams them per
microbatch) moves the same bytes again and again. This cache keeps them:

    Step 1 (before the load all-gather): this rank's **master epoch** moves on when any of its master
           tensors changed since the last call: PyTorch bumps a tensor's version counter on every in-place
           write through the tensor or its views (``optimizer.step()``, ``load_state_dict``, ``p.copy_``,
           ``with torch.no_grad(): p.mul_(...)``) and a new storage changes its data pointer. Writes through
           ``p.data`` bypass the counter: call ``ultraep.runtime_of(model).invalidate_replicas()`` after them.
    Step 2 (the all-gather): every rank's epoch and whether it can use its cache this call travel with the
           loads, so every rank knows every master's epoch.
    Step 3: ``resident_RE[r, e]`` = rank ``r`` holds expert ``e`` at its master's current epoch. The engine
           plans with it: only non-resident replicas are streamed, and the quota planner prefers resident
           placements when the balance is (nearly) as good.
    Step 4: :meth:`ReplicaCache.admit` the plan: stale entries go, the plan's replicas are (re)entered, a rank
           holding more than ``C`` entries evicts the least recently used ones the plan does not need (ties:
           lower expert id), and every new replica gets a free buffer (lowest index first).

The table is the same on every rank — it changes only through the plan and the all-gathered epochs — so
plans made from it are identical everywhere (``check_plan_hash`` stays green); each rank uses its own row's
buffer indices. Eviction is LRU: with ``C = N`` the plan decides anyway (every buffer it does not need is
free), and beyond that recency is the best predictor of which hot expert comes back, since routing drifts
slowly (the per-expert popularity of consecutive batches is strongly correlated).
"""

from __future__ import annotations

import numpy as np


class ReplicaCache:
    """Which replicas every rank of one layer holds, at which master epoch, in which buffer.

    ``capacity``: buffers per rank (``C >= N``). ``entries[(rank, expert)] = [epoch, last_use, buffer]``.
    Counters: ``hits``/``misses`` (replicas of this rank's plans found resident / streamed) and
    ``bytes_saved`` (this rank's received weight bytes the hits avoided).
    """

    def __init__(self, home_E: np.ndarray, capacity: int) -> None:
        self.home_E = np.asarray(home_E)
        self.capacity = int(capacity)
        self.entries: dict[tuple[int, int], list[int]] = {}
        self.tick = 0
        self.hits = self.misses = self.bytes_saved = 0

    def clear(self) -> None:
        self.entries.clear()

    def resident(self, epoch_R: np.ndarray, num_ranks: int) -> np.ndarray:
        """Step 3: bool ``[R, E]``, after dropping every entry whose master moved on."""
        out = np.zeros((num_ranks, self.home_E.shape[0]), dtype=bool)
        stale = []
        for (r, e), (epoch, _, _) in self.entries.items():
            if epoch == epoch_R[self.home_E[e]]:
                out[r, e] = True
            else:
                stale.append((r, e))
        for k in stale:
            del self.entries[k]
        return out

    def admit(self, replicas, epoch_R: np.ndarray, rank: int, expert_bytes: int) -> tuple[dict[int, int], int]:
        """Step 4 for a plan's ``replicas`` (:class:`~ultraep.plan.Replicas`, expert-major CSR). Returns this
        rank's ``{expert: buffer index}`` for its replicas and how many of them were resident (hits)."""
        self.tick += 1
        E = self.home_E.shape[0]
        expert_P = np.repeat(np.arange(E), np.diff(replicas.ptr))
        needed: dict[int, list[int]] = {}
        for e, r in zip(expert_P.tolist(), replicas.rank.tolist()):
            needed.setdefault(r, []).append(e)
        by_rank: dict[int, dict[int, list[int]]] = {}  # one pass over the table, not one per rank
        for (rr, e), v in self.entries.items():
            by_rank.setdefault(rr, {})[e] = v
        hits = 0
        for r, experts in needed.items():
            held = by_rank.get(r, {})
            new = [e for e in experts if e not in held]
            want = set(experts)
            spare = sorted((v[1], e) for e, v in held.items() if e not in want)  # least recently used first
            for _, e in spare[:max(0, len(held) + len(new) - self.capacity)]:
                del self.entries[(r, e)]
                del held[e]
            free = sorted(set(range(self.capacity)) - {v[2] for v in held.values()})
            for e, buf in zip(new, free):
                self.entries[(r, e)] = [int(epoch_R[self.home_E[e]]), self.tick, buf]
            for e in experts:
                self.entries[(r, e)][1] = self.tick
            if r == rank:
                hits = len(experts) - len(new)
        mine = {e: self.entries[(rank, e)][2] for e in needed.get(rank, [])}
        self.hits += hits
        self.misses += len(mine) - hits
        self.bytes_saved += hits * int(expert_bytes)
        return mine, hits


class MasterEpoch:
    """Step 1: this rank's master epoch of one layer, moved on by any in-place write or new storage."""

    def __init__(self) -> None:
        self.epoch = 0
        self._seen: tuple | None = None

    def current(self, params) -> int:
        key = tuple((p._version, p.data_ptr()) for p in params)
        if key != self._seen:
            if self._seen is not None:
                self.epoch += 1
            self._seen = key
        return self.epoch

    def invalidate(self) -> None:
        """Writes the version counter cannot see (through ``p.data``): the next call starts a new epoch."""
        self.epoch += 1
