"""Replica memory has one owner per layer (issue 33): the budget split at ``wrap`` (``split_budget``, pure), the store's
buffers, residency and ``hold(job)``, and the buffers the ``restore`` layers share with their generation counter.
The runtime behaviour (kept vs restore, exactness) is tested on gloo ranks in ``test_runtime_overlap.py``."""

import weakref

import numpy as np
import torch

from ultraep.runtime.replica_store import ReplicaMemory, ReplicaSlots, ReplicaStore, SharedSlots, split_budget


def test_split_budget_keeps_layers_in_layer_order():
    # budget 100, 30-byte experts: layer 0 (2 slots, 60) fits; layer 1 (60 more = 120) does not; layer 2 (30 more = 90)
    # fits; a layer without redundant slots needs nothing
    got = split_budget(100, [(2, 30), (2, 30), (1, 30), (0, 30)], cache=False)
    assert [m.mode for m in got] == ["kept", "restore", "kept", "none"]
    assert [m.capacity for m in got] == [2, 0, 1, 0]
    assert not any(m.cache for m in got)
    assert [m.num_slots for m in got] == [2, 2, 1, 0]


def test_split_budget_gives_the_cache_what_is_left_in_layer_order():
    # budget 150: layer 0 (60) is kept, layer 1 (120 more = 180) restores, layer 2 (30 more = 90) is kept; the 60
    # left add up to N more buffers per kept layer in layer order: layer 0 gets 2 (60, 0 left), layer 2 gets 0 more
    got = split_budget(150, [(2, 30), (4, 30), (1, 30)], cache=True)
    assert [m.mode for m in got] == ["kept", "restore", "kept"]
    assert [m.capacity for m in got] == [4, 0, 1]
    assert [m.cache for m in got] == [True, False, True]
    # 100 over two kept layers of one slot (60): the 40 left give layer 0 one more buffer, layer 1 none (10 left)
    assert [m.capacity for m in split_budget(100, [(1, 30), (1, 30)], cache=True)] == [2, 1]
    # nothing left over: the cache still exists with N buffers (the plan decides which replicas they hold)
    assert split_budget(60, [(2, 30)], cache=True) == [ReplicaMemory("kept", 2, 2, True)]
    assert split_budget(0, [(2, 30)], cache=True) == [ReplicaMemory("restore", 2, 0, False)]


class _Job:
    """The one thing the store reads of a job: whether its buffers still hold replicas its backward will read."""

    def __init__(self) -> None:
        self.holds_replicas = True


def test_hold_makes_the_own_buffers_busy_until_the_backward_or_the_job_is_gone():
    like = [torch.zeros(3, 2), torch.zeros(4)]
    store = ReplicaStore(ReplicaMemory("kept", 2, 3, True), np.array([0, 0, 1, 1]), SharedSlots())
    assert store.cache is not None and store.cache.capacity == 3 and store.cache_usable()
    first = store._own_buffers(like, 2)
    assert [[tuple(t.shape) for t in slot] for slot in first] == [[(3, 2), (4,)]] * 2
    job = _Job()
    store.hold(job)
    assert store.busy() and not store.cache_usable() and store._own_buffers(like, 2) is None
    job.holds_replicas = False  # its backward ran
    assert not store.busy() and store._own_buffers(like, 2)[0][0] is first[0][0]  # the same buffers again
    job.holds_replicas = True
    ref = weakref.ref(job)
    del job
    assert ref() is None and not store.busy()  # a freed graph frees the buffers too


def test_restore_layers_share_buffers_and_a_later_sync_overwrites_them():
    shared = SharedSlots()
    like = [torch.zeros(2, 2)]
    a = ReplicaSlots(shared.take(like, 2), False, shared)
    b = ReplicaSlots(shared.take(like, 1), False, shared)
    assert b.tensors[0][0] is a.tensors[0][0]  # one set per tensor layout
    assert a.overwritten()  # never filled
    a.filled()
    assert not a.overwritten()
    b.filled()  # a later layer's weights landed in the same buffers
    assert a.overwritten() and not b.overwritten()
    a.restored()
    assert shared.restorations == 1
    kept = ReplicaSlots([[torch.zeros(1)]], True, shared)
    kept.filled()
    assert not kept.overwritten() and shared.generation == 2  # own buffers: no generation, never overwritten


def test_a_store_without_own_buffers_forgets_nothing_and_hands_out_none():
    store = ReplicaStore(ReplicaMemory("restore", 2, 0, False), np.array([0, 1]), SharedSlots())
    assert store.cache is None and not store.cache_usable()
    assert store._own_buffers([torch.zeros(1)], 2) is None
    assert store.resident(False, np.array([0, 0]), 2, 2).tolist() == [[False, False], [False, False]]
