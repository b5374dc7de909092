"""NCCL's point-to-point rules on gloo (issue 34): the harness of ``tests/nccl_harness.py`` finds what would
hang on NCCL — on synthetic records, on real gloo ranks, and on the runtime with replicas in both directions."""

import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from nccl_harness import NcclOrderingError, P2PRecord, check, expect_p2p, run_ranks_nccl
from numerics import assert_within
from replica_probe import served_rows
from test_runtime import CONFIGS, _equivalence
from ultraep.models import preload

preload()


def _op(uid, kind, peer, nbytes=4, batch=-1, label="test"):
    return ("op", uid, kind, peer, "g", nbytes, batch, label)


def _recv_then_send(peer, batched: bool):
    b = 0 if batched else -1
    return [_op(0, "recv", peer, batch=b, label="post_grad_recvs"), _op(1, "send", peer, batch=b, label="backward"),
            ("wait", (0, 1) if batched else (0,))]


def test_receives_first_on_both_sides_deadlock_and_name_the_pending_receives():
    with pytest.raises(NcclOrderingError) as err:
        check([_recv_then_send(1, False), _recv_then_send(0, False)])
    msg = str(err.value)
    assert "deadlock" in msg and "rank 0 blocks in wait()" in msg and "rank 1 blocks in wait()" in msg
    assert "rank 0: recv from rank 1 (4 B, group g) issued by post_grad_recvs" in msg


def test_one_group_per_batch_progresses_both_directions():
    check([_recv_then_send(1, True), _recv_then_send(0, True)])


def test_tags_are_ignored_so_sizes_must_agree_message_by_message():
    a = [_op(0, "send", 1, 8), _op(1, "send", 1, 4), ("wait", (0,)), ("wait", (1,))]
    b = [_op(0, "recv", 0, 4), _op(1, "recv", 0, 8), ("wait", (0,)), ("wait", (1,))]
    with pytest.raises(NcclOrderingError, match="sizes differ"):
        check([a, b])


def test_a_receive_waiting_on_a_send_issued_after_a_host_wait_deadlocks():
    # rank 0 waits for its receive before it sends; rank 1 does the same: fine on neither backend
    a = [_op(0, "recv", 1), ("wait", (0,)), _op(1, "send", 1), ("wait", (1,))]
    with pytest.raises(NcclOrderingError, match="deadlock"):
        check([a, [_op(0, "recv", 0), ("wait", (0,)), _op(1, "send", 0), ("wait", (1,))]])
    check([a, [_op(0, "send", 0), ("wait", (0,)), _op(1, "recv", 0), ("wait", (1,))]])


def test_collectives_are_barriers_and_unmatched_operations_are_reported():
    coll = ("coll", "w", "all_reduce", (0, 1))
    with pytest.raises(NcclOrderingError, match="deadlock"):  # rank 0 waits before a collective rank 1 is in
        check([[_op(0, "recv", 1), ("wait", (0,)), coll], [coll, _op(0, "send", 0)]])
    with pytest.raises(NcclOrderingError, match="never complete"):
        check([[_op(0, "send", 1)], []])


@pytest.mark.parametrize("scope", ["pair", "communicator"])
def test_a_collective_waits_behind_a_pending_batch_of_its_group(scope):
    """Rank 0 posts a receive batch and then joins an all-reduce on the same group; rank 1 joins the all-reduce
    first and sends afterwards. As host barriers the two pass; on NCCL rank 0's all-reduce queues behind its
    pending receive, whose send rank 1 issues only after the all-reduce: a deadlock."""
    coll = ("coll", "g", "all_reduce", (0, 1))
    r0 = [_op(0, "recv", 1, batch=0, label="post_weights"), coll, ("wait", (0,))]
    r1 = [coll, _op(0, "send", 0, batch=0), ("wait", (0,))]
    with pytest.raises(NcclOrderingError, match="deadlock") as err:
        check([r0, r1], scope=scope)
    assert "rank 0: all_reduce on group g" in str(err.value) or "blocks in all_reduce" in str(err.value)
    # the same operations with the send issued before the collective: the batch completes, then the collective
    check([r0, [_op(0, "send", 0, batch=0), coll, ("wait", (0,))]], scope=scope)
    # on another group the collective does not queue behind the batch
    other = ("coll", "h", "all_reduce", (0, 1))
    check([[_op(0, "recv", 1, batch=0), other, ("wait", (0,))], [other, _op(0, "send", 0, batch=0), ("wait", (0,))]],
          scope=scope)


def test_a_batch_that_opens_a_group_must_include_every_rank():
    """NCCL creates a group's communicator with its first batch or collective: a batch of ranks 0 and 1 that is
    the first operation of a three-rank group hangs rank 2's side of it."""
    grp = ("group", "g", (0, 1, 2))
    pair = [[grp, _op(0, "send", 1, batch=0), ("wait", (0,))], [grp, _op(0, "recv", 0, batch=0), ("wait", (0,))]]
    with pytest.raises(NcclOrderingError, match="opened by a batch that does not include every rank") as err:
        check(pair + [[grp]])
    assert "rank 2 never opens it" in str(err.value)
    opened = ("coll", "g", "all_reduce", (0, 1, 2))
    check([[opened] + tr for tr in pair] + [[grp, opened]])  # a collective every rank joins opens it first
    # a rank that opens the group with a collective while the others open it with a batch is named
    with pytest.raises(NcclOrderingError, match="rank 2 opens it with all_reduce"):
        check(pair + [[grp, opened]])
    # single isend/irecv use pair communicators: they open nothing
    check([[grp, _op(0, "send", 1), ("wait", (0,))], [grp, _op(0, "recv", 0), ("wait", (0,))], [grp]])


def test_an_empty_record_fails_the_expectation():
    assert P2PRecord([[], []]).sends == 0
    with pytest.raises(NcclOrderingError, match="holds no point-to-point operation"):
        expect_p2p(P2PRecord([[("coll", "g", "all_reduce", (0, 1))]] * 2), True)
    moved = P2PRecord([[_op(0, "send", 1, 8)], [_op(0, "recv", 0, 8)]])
    expect_p2p(moved, True)
    with pytest.raises(NcclOrderingError, match="expects no point-to-point"):
        expect_p2p(moved, False)
    assert moved.bytes == {(0, 1): 8} and moved.both_ways() == []


def test_communicator_scope_serialises_every_peer():
    # rank 1 receives from 0 then sends to 2, rank 2 receives from 1 then... all fine per pair, and per
    # communicator only if the order agrees: 0 sends to 1 after receiving from 2 -> a cycle
    r0 = [_op(0, "recv", 2), _op(1, "send", 1)]
    r1 = [_op(0, "recv", 0), _op(1, "send", 2)]
    r2 = [_op(0, "recv", 1), _op(1, "send", 0)]
    check([r0, r1, r2], scope="pair")
    with pytest.raises(NcclOrderingError, match="communicator scope"):
        check([r0, r1, r2], scope="communicator")


def _two_relays(stage1_in_w0: bool):
    """Rank 2 masters two experts and sends each to a relay (ranks 0 and 1, stage 0); each relay forwards its
    expert to the other relay (stage 1). A relay waits for its W0 before it forwards."""
    traces = []
    for me, other in ((0, 1), (1, 0)):
        w0 = [_op(0, "recv", 2, batch=0, label="post_weights")]
        w1 = [_op(2, "send", other, batch=1, label="relay")]
        (w0 if stage1_in_w0 else w1).insert(0, _op(1, "recv", other, batch=0 if stage1_in_w0 else 1))
        uids0, uids1 = tuple(e[1] for e in w0), tuple(e[1] for e in w1)
        traces.append(w0 + [("wait", uids0)] + w1 + [("wait", uids1)])
    traces.append([_op(0, "send", 0, batch=0), _op(1, "send", 1, batch=0), ("wait", (0, 1))])
    return traces


def test_stage_one_receives_go_with_the_relay_sends_not_in_the_first_batch():
    with pytest.raises(NcclOrderingError, match="deadlock"):
        check(_two_relays(stage1_in_w0=True))
    check(_two_relays(stage1_in_w0=False))
    check(_two_relays(stage1_in_w0=False), scope="communicator")


def _gloo_exchange(rank, world, batched: bool):
    import torch.distributed as dist

    peer = 1 - rank
    out, x = torch.zeros(3), torch.full((3,), float(rank))
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, peer), dist.P2POp(dist.isend, x, peer)])
    else:  # what gloo runs happily (tags or not): each rank receives first, then sends
        works = [dist.irecv(out, src=peer, tag=7), dist.isend(x, dst=peer, tag=7)]
    for w in works:
        w.wait()
    return float(out[0])


def test_real_gloo_ranks_recorded_and_checked():
    with pytest.raises(NcclOrderingError, match="deadlock"):
        run_ranks_nccl(_gloo_exchange, 2, False, timeout=60)
    assert run_ranks_nccl(_gloo_exchange, 2, True, timeout=60) == [1.0, 0.0]
    with pytest.raises(NcclOrderingError, match="expects no point-to-point"):
        run_ranks_nccl(_gloo_exchange, 2, True, timeout=60, p2p=False)


def _no_exchange(rank, world):
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    return float(t[0])


def test_a_run_that_moves_nothing_fails_unless_the_test_says_so():
    with pytest.raises(NcclOrderingError, match="holds no point-to-point operation"):
        run_ranks_nccl(_no_exchange, 2, timeout=60)
    assert run_ranks_nccl(_no_exchange, 2, timeout=60, p2p=False) == [2.0, 2.0]


def _cross_order(rank, world, collective_first_on_1: bool, direct: bool):
    """Rank 0 posts a receive batch, then joins a collective on the same group (through ``torch.distributed`` or
    straight on the ``ProcessGroup``); rank 1 sends before or after joining it. Gloo runs both orders."""
    import threading

    import torch.distributed as dist

    group = dist.new_group([0, 1])
    dist.all_reduce(torch.zeros(1), group=group)  # opens the group for every rank
    buf, x = torch.zeros(4), torch.full((4,), 3.0)
    t = torch.ones(1)

    def collective():
        if direct:
            group.allreduce([t]).wait()
        else:
            dist.all_reduce(t, group=group)

    if rank == 0:
        (w,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1, group)])
        # gloo would not finish the all-reduce before the receive either way: run it beside the wait
        th = threading.Thread(target=collective)
        th.start()
        w.wait()
        th.join()
    else:
        if collective_first_on_1:
            collective()
        (w,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0, group)])
        w.wait()
        if not collective_first_on_1:
            collective()
    return float(buf[0]) + float(t[0])


@pytest.mark.parametrize("direct", [False, True], ids=["torch.distributed", "ProcessGroup method"])
def test_real_gloo_collective_behind_a_pending_batch(direct):
    with pytest.raises(NcclOrderingError, match="deadlock"):
        run_ranks_nccl(_cross_order, 2, True, direct, timeout=60)
    assert run_ranks_nccl(_cross_order, 2, False, direct, timeout=60) == [5.0, 2.0]


def _ddp_broadcast(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP(torch.nn.Linear(3, 2))  # construction broadcasts rank 0's parameters (dist._broadcast_coalesced)
    x = torch.arange(2.0)
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    return float(x[1])


def _partial_opening(rank, world, opened: bool):
    """Ranks 0 and 1 exchange one batch on a three-rank group; rank 2 takes no part. Gloo runs it either way."""
    import torch.distributed as dist

    group = dist.new_group([0, 1, 2])
    if opened:
        dist.all_reduce(torch.zeros(1), group=group)
    buf = torch.zeros(2)
    if rank < 2:
        op = dist.isend if rank == 0 else dist.irecv
        for w in dist.batch_isend_irecv([dist.P2POp(op, buf if rank else torch.ones(2), 1 - rank, group)]):
            w.wait()
    dist.barrier()
    return float(buf[0])


def test_real_gloo_batch_opening_a_group_without_every_rank():
    with pytest.raises(NcclOrderingError, match="rank 2 never opens it"):
        run_ranks_nccl(_partial_opening, 3, False, timeout=60)
    assert run_ranks_nccl(_partial_opening, 3, True, timeout=60) == [0.0, 1.0, 0.0]


def _equivalence_unopened(rank, world, family, config, steps):
    """:func:`test_runtime._equivalence` with the transfer group left unopened (the runtime before issue 53
    on gloo: its opening all-reduce ran on NCCL only)."""
    import sys

    import torch.distributed as dist

    import ultraep.runtime.wrap  # noqa: F401 - (the package's `wrap` attribute is the function: patch the module)

    sys.modules["ultraep.runtime.wrap"].open_transfer_group = lambda ranks, backend, timeout=None: dist.new_group(
        ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
    return _equivalence_relays(rank, world, family, config, steps, one_token=True)


def test_the_runtime_opens_its_transfer_group_for_every_rank():
    """Negative control on the runtime: without the opening all-reduce, the first replica batch opens the
    transfer group, and a rank with no replica transfer in that call is not in it (one hot expert, replicas
    kept inside its scale-up domain of 2 ranks: the other domain's ranks move nothing)."""
    cfg = {"policy": "quota", "num_redundant_slots": 1, "domain_size": 2}
    with pytest.raises(NcclOrderingError, match="opened by a batch that does not include every rank"):
        run_ranks_nccl(_equivalence_unopened, 4, "qwen3-moe", cfg, 1)
    for r in run_ranks_nccl(_equivalence_relays, 4, "qwen3-moe", cfg, 1, True):  # opened: runs, and exact
        assert_within({"logits": r["logits"], **r["grad"], **r["other"]}, what=str(r["replicas"]))


def test_the_both_ways_check_fails_without_replicas_in_both_directions():
    """Negative controls of :func:`_both_ways` (the 4-rank tests' proof that replicas ran both ways): no tokens
    served, tokens one way only, and tokens both ways without the bytes that should have carried them."""
    both = P2PRecord([[_op(0, "send", 1, 64)], [_op(0, "send", 0, 64)]])
    _both_ways([{"served": {(0, 1): 5}}, {"served": {(1, 0): 3}}], both)
    for served, record in (({}, both), ({(0, 1): 5}, both),
                           ({(0, 1): 5, (1, 0): 3}, P2PRecord([[_op(0, "send", 1, 64)], []]))):
        with pytest.raises(AssertionError):
            _both_ways([{"served": served}], record)


def test_ddps_parameter_broadcast_is_recorded():
    seen = []
    assert run_ranks_nccl(_ddp_broadcast, 2, timeout=60, p2p=seen.append) == [1.0, 1.0]
    (rec,) = seen
    names = {name for _, _, name in rec.collectives}
    assert "_broadcast_coalesced" in names, names
    assert rec.bytes == {(0, 1): 8}


@pytest.mark.parametrize("policy,scope", [("eplb", "pair"), ("feplb", "pair"), ("eplb", "communicator")])
def test_bidirectional_replicas_at_four_ranks_follow_nccl_rules(policy, scope):
    """eplb and feplb place replicas of rank A's experts on rank B and of B's on A (issue 34 measured 5/6 and
    3/6 such pairs): the weight sync and the gradient reduction must not hang on NCCL, and stay exact — also
    under the stricter rule of one stream per communicator."""
    records = []
    results = run_ranks_nccl(_equivalence_served, 4, "qwen3-moe", CONFIGS[policy], 2, scope=scope,
                             p2p=records.append)
    for r in results:
        assert_within({"logits": r["logits"], **r["grad"], **r["other"]}, what=str(r["replicas"]))
    _both_ways(results, records[0])


def _equivalence_served(rank, world, family, config, steps):
    """:func:`test_runtime._equivalence`, also returning the rows this rank's replicas computed, by master rank."""
    served = served_rows()
    return {**_equivalence(rank, world, family, config, steps), "served": served}


def _both_ways(results, record):
    """Replicas in both directions between some pair of ranks, shown twice: tokens the replicas computed on
    each side (rows of A's experts computed on B and of B's on A), and weight bytes sent each way."""
    served: dict = {}
    for r in results:
        for k, v in r["served"].items():
            served[k] = served.get(k, 0) + v
    by_tokens = sorted((a, b) for (a, b) in served if a < b and served.get((b, a), 0) > 0)
    assert by_tokens, f"no pair of ranks computed tokens of each other's experts: {served}"
    by_bytes = record.both_ways()
    assert set(by_tokens) <= set(by_bytes), (by_tokens, record)


def _equivalence_relays(rank, world, family, config, steps, one_token: bool = False):
    """:func:`test_runtime._equivalence`, also counting the relay messages this rank forwarded; with
    ``one_token`` every rank's batch repeats one token id routed top-1 (one expert takes all the load, so
    it is replicated on most ranks: relay trees)."""
    import functools

    import test_runtime
    from ultraep.runtime.replicas import ReplicaJob

    if one_token:  # (this rank's process only: ranks are forked)
        test_runtime._batch = lambda rank, step=0: torch.zeros((2, 12), dtype=torch.int64)
        test_runtime.build_model = functools.partial(test_runtime.build_model, top_k=1)

    relayed = [0]
    relay = ReplicaJob.relay

    def counting(job):
        relayed[0] += len(job.schedule.sends1)
        return relay(job)

    ReplicaJob.relay = counting
    return {**_equivalence(rank, world, family, config, steps), "relayed": relayed[0]}


EIGHT = {
    # two scale-up domains of 4: replicas stay inside each, both domains balance at once
    "two-domains-kept": {"policy": "quota", "num_redundant_slots": 2, "domain_size": 4},
    "two-domains-restore": {"policy": "eplb", "num_redundant_slots": 2, "domain_size": 4,
                            "eplb": {"interval": 1, "window": 1}, "replica_memory_budget": 0},
    # one domain of 8 with the relay tree forced: stage-0 sends to relays, stage-1 forwards (tiles)
    "relays": {"policy": "quota", "num_redundant_slots": 2, "quota": {"relay": "always"},
               "replica_transport": "tiles"},
}


@pytest.mark.parametrize("case", list(EIGHT))
def test_exactness_at_eight_ranks_under_nccl_rules(case):
    steps = 2 if EIGHT[case]["policy"] == "eplb" else 1
    results = run_ranks_nccl(_equivalence_relays, 8, "qwen3-moe", EIGHT[case], steps, case == "relays",
                             scope="communicator")
    for r in results:
        assert_within({"logits": r["logits"], **r["grad"], **r["other"]}, what=str(r["replicas"]))
    assert max(max(r["replicas"]) for r in results) > 0
    if case == "relays":
        assert sum(r["relayed"] for r in results) > 0, "the plan used no relay"
    if case.endswith("restore"):
        assert results[0]["restorations"] >= 1


@pytest.mark.parametrize("transport", ["direct", "tiles"])
def test_no_sync_at_four_ranks_under_nccl_rules(transport):
    """Deferred replica gradients (three microbatches under ``no_sync``, the fourth reduces them all) with
    replicas in both directions between ranks: exact, and in an order NCCL runs."""
    from test_replica_cache import _accumulate

    records = []
    results = run_ranks_nccl(_accumulate_served, 4, True, 4, True, transport, scope="communicator",
                             p2p=records.append)
    for r in results:
        assert_within({"grad": r["grad"], "logits": r["logits"]}, what=f"{transport} under no_sync")
    _both_ways(results, records[0])


def _accumulate_served(rank, world, *args):
    from test_replica_cache import _accumulate

    served = served_rows()
    weight_bytes, grad, logits, grad_bytes = _accumulate(rank, world, *args)
    return {"rank": rank, "weight_bytes": weight_bytes, "grad": grad, "logits": logits, "grad_bytes": grad_bytes,
            "served": served}
