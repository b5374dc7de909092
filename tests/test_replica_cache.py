"""The replica cache: replicas stay valid until their master changes (serving and gradient accumulation).

Exactness against the unwrapped model, hits and bytes in steady state, invalidation by optimizer steps,
in-place writes and ``load_state_dict``, the explicit invalidation for writes through ``p.data``, and the
cache-aware quota planner (deterministic, never worse than its tolerance)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_ranks
from numerics import assert_within, master_grad_errors, rel_error, tolerance, worst
from ultraep.models import build_model, preload
from ultraep.plan import Replicas
from ultraep.policies import QuotaPolicy, plan_resident
from ultraep.runtime.replica_cache import MasterEpoch, ReplicaCache
from ultraep.topology import Topology

preload()


def _ids(rank: int, batch: int = 0, persistent: bool = True):
    """Skewed token ids: ids 0..2 dominate (concentrated routing, replicas needed); ``persistent`` keeps the
    same tokens every batch, else each batch draws new ones from the same skewed distribution."""
    g = torch.Generator().manual_seed(17 * rank + 1 + (0 if persistent else 1000 * batch))
    return torch.randint(0, 3, (2, 12), generator=g)


def _calls(rt):
    """Per layer, the (hits, misses, transfer bytes) of its last recorded call on this rank."""
    return [(lay.last_timings.get("cache_hits", 0.0), lay.last_timings.get("cache_misses", 0.0),
             lay.last_timings.get("transfer_bytes", 0.0)) for lay in rt.layers]


# ---------------------------------------------------------------------------------------------- serving
def _serve(rank, world, cache: bool, transport: str = "auto"):
    import ultraep

    model = build_model("qwen3-moe").eval()
    ref = copy.deepcopy(model)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2, "replica_cache": cache,
                         "check_plan_hash": True, "replica_transport": transport})
    rt = ultraep.runtime_of(model)
    errs, calls = [], []
    with torch.no_grad():
        for batch in range(4):
            ids = _ids(rank, batch)
            errs.append(rel_error(model(input_ids=ids).logits, ref(input_ids=ids).logits))
            calls.append(_calls(rt))
        # an in-place write to a master (detected by its version counter) must reach every replica
        for lay in rt.layers:
            lay.master_params()[0].mul_(1.5)
        for name, p in ref.named_parameters():
            if "experts.gate_up_proj" in name:
                p.mul_(1.5)
        ids = _ids(rank, 9)
        errs.append(rel_error(model(input_ids=ids).logits, ref(input_ids=ids).logits))
        calls.append(_calls(rt))
    return errs, calls, [lay.store.cache is not None for lay in rt.layers]


@pytest.mark.numerics
@pytest.mark.parametrize("transport", ["auto", "tiles"])  # per-tensor messages on CPU; tile-packed (GPU path)
def test_serving_reuses_resident_replicas_exactly(transport):
    out = run_ranks(_serve, 2, True, transport)
    for errs, calls, has_cache in out:
        assert all(has_cache)
        assert_within(errs)  # equal to the unwrapped model, before and after the master changed
        first, steady, changed = calls[0], calls[1:4], calls[4]
        for hits, misses, nbytes in first:
            assert hits == 0  # nothing resident yet
        for call in steady:  # the same routing: every replica of every layer is resident, nothing moves
            for hits, misses, nbytes in call:
                assert misses == 0 and nbytes == 0
    # replicas were used, and in steady state found resident
    assert sum(h for _, calls, _ in out for call in calls[1:4] for h, _, _ in call) > 0
    # the masters changed in place: their replicas were streamed again
    assert sum(m for _, calls, _ in out for _, m, _ in calls[4]) > 0


@pytest.mark.numerics
def test_serving_without_cache_streams_every_call():
    """Without the cache the same routing streams the same replica bytes on every call (a hit count of 0 alone
    proves nothing: a layer without a cache reports none, and the figure defaults to 0)."""
    out = run_ranks(_serve, 2, False)
    for errs, calls, has_cache in out:
        assert not any(has_cache)
        assert_within(errs)
        first = [nbytes for _, _, nbytes in calls[0]]
        for call in calls[1:4]:  # the same ids every batch: the same plan, streamed again, byte for byte
            assert [nbytes for _, _, nbytes in call] == first, (call, first)
    for i in range(5):  # every call moved replica weights on some rank (the sender's figure)
        assert sum(nbytes for _, calls, _ in out for _, _, nbytes in calls[i]) > 0, i


# ---------------------------------------------------------------------------------------------- training
def _accumulate(rank, world, cache: bool, microbatches: int, no_sync: bool = False, transport: str = "auto"):
    import contextlib

    import ultraep

    model = build_model("qwen3-moe")
    ref = copy.deepcopy(model)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2, "replica_cache": cache,
                         "replica_transport": transport})
    rt = ultraep.runtime_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    weight_bytes, grad_bytes, grad_errs, logit_errs = [], [], [], []
    for step in range(2):
        sent = gsent = 0.0
        for mb in range(microbatches):
            ids = _ids(rank, 10 * step + mb, persistent=False)
            # like DDP: every microbatch but the step's last keeps its replica gradients on their ranks
            with rt.no_sync() if no_sync and mb < microbatches - 1 else contextlib.nullcontext():
                out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
                logit_errs.append(rel_error(out, want))
                out.float().pow(2).mean().backward()
            want.float().pow(2).mean().backward()
            rt.flush_records()
            sent += sum(lay.last_timings.get("transfer_bytes", 0.0) for lay in rt.layers)
            gsent += sum(lay.last_timings.get("grad_bytes", 0.0) for lay in rt.layers)
        grad_errs.append(worst(master_grad_errors(rt, ref, rank).values()))
        # data parallelism over the EP ranks: the reference sums every gradient over ranks, the wrapped model
        # every gradient but its masters' (they already hold every rank's tokens), so both take the same step
        masters = {id(p) for lay in rt.layers for p in lay.master_params()}
        for p in [*ref.parameters(), *(p for p in model.parameters() if id(p) not in masters)]:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        rt.next_step()
        weight_bytes.append(sent)
        grad_bytes.append(gsent)
    return weight_bytes, worst(grad_errs), worst(logit_errs), grad_bytes


@pytest.mark.numerics
def test_gradient_accumulation_reuses_replicas_and_stays_exact():
    with_cache = run_ranks(_accumulate, 2, True, 4)
    without = run_ranks(_accumulate, 2, False, 4)
    for wb, grad, logits, _ in with_cache + without:
        assert_within({"grad": grad, "logits": logits})
    # the optimizer step invalidates: each step streams again, but only what its microbatches newly need
    total_with = sum(sum(wb) for wb, _, _, _ in with_cache)
    total_without = sum(sum(wb) for wb, _, _, _ in without)
    assert total_without > 0 and total_with * 2 <= total_without, (total_with, total_without)


@pytest.mark.numerics
@pytest.mark.parametrize("transport", ["direct", "tiles"])
def test_no_sync_defers_replica_gradients_to_the_last_microbatch_exactly(transport):
    """Under ``no_sync`` the replica gradients of 3 microbatches wait on their ranks, summed, and the 4th
    reduces them with its own: the masters' gradients equal the unbalanced model's, in fewer bytes."""
    deferred = run_ranks(_accumulate, 2, True, 4, True, transport)
    every = run_ranks(_accumulate, 2, True, 4, False, transport)
    for _, grad, logits, _ in deferred + every:
        assert_within({"grad": grad, "logits": logits})
    g_deferred = sum(sum(gb) for *_, gb in deferred)
    g_every = sum(sum(gb) for *_, gb in every)
    # each microbatch sends one fp32 gradient per replica; deferred, a replica used by several microbatches
    # of a step sends once (the union of the step's replicas, at most 2N per rank)
    assert g_every > 0 and 0 < g_deferred * 1.5 <= g_every, (g_deferred, g_every)


def _step_inside_no_sync(rank, world):
    import ultraep
    from ultraep.errors import PendingGradientsError

    model = build_model("qwen3-moe")
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    rt = ultraep.runtime_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with rt.no_sync():
        model(input_ids=_ids(rank)).logits.float().pow(2).mean().backward()
    opt.step()  # the pending replica gradients never reached their masters
    try:
        model(input_ids=_ids(rank, 1))
    except PendingGradientsError as exc:
        return str(exc)
    return None


def test_an_optimizer_step_inside_no_sync_is_refused_not_lost():
    for msg in run_ranks(_step_inside_no_sync, 2):
        assert msg is not None and "no_sync()" in msg and "never reduced" in msg, msg


# ---------------------------------------------------------------------------------------------- invalidation
def _data_write(rank, world, invalidate: bool):
    import ultraep

    model = build_model("qwen3-moe").eval()
    ref = copy.deepcopy(model)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    rt = ultraep.runtime_of(model)
    with torch.no_grad():
        model(input_ids=_ids(rank))
        for lay in rt.layers:  # behind the version counter's back
            lay.master_params()[0].data.mul_(2.0)
        for name, p in ref.named_parameters():
            if "experts.gate_up_proj" in name:
                p.mul_(2.0)
        if invalidate:
            rt.invalidate_replicas()
        ids = _ids(rank)
        return rel_error(model(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.numerics
def test_writes_through_data_need_invalidate_replicas():
    assert_within(run_ranks(_data_write, 2, True))
    # without the call the stale replicas are used: the documented reason the call exists
    assert worst(run_ranks(_data_write, 2, False)) > 100 * tolerance()


def _reload(rank, world):
    import ultraep

    model = build_model("qwen3-moe").eval()
    other = build_model("qwen3-moe", seed=3).eval()
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    ultraep.wrap(other, {"policy": "quota", "num_redundant_slots": 2})
    with torch.no_grad():
        model(input_ids=_ids(rank))
        model.load_state_dict(other.state_dict())
        ids = _ids(rank)
        return rel_error(model(input_ids=ids).logits, other(input_ids=ids).logits)


@pytest.mark.numerics
def test_load_state_dict_invalidates():
    assert_within(run_ranks(_reload, 2))


def test_master_epoch_sees_in_place_writes_and_new_storage():
    w = torch.nn.Parameter(torch.ones(2, 3))
    ep = MasterEpoch()
    assert ep.current([w]) == ep.current([w]) == 0
    with torch.no_grad():
        w[0].add_(1.0)  # through a view
    assert ep.current([w]) == 1
    w.data = torch.zeros(2, 3)  # new storage
    assert ep.current([w]) == 2
    ep.invalidate()
    assert ep.current([w]) == 3


# ---------------------------------------------------------------------------------------------- the table
def _replicas(rows, E):
    """Replicas CSR from ``[(expert, rank)]``."""
    rows = sorted(rows)
    ptr = np.zeros(E + 1, dtype=np.int64)
    np.cumsum(np.bincount([e for e, _ in rows], minlength=E), out=ptr[1:])
    rank = np.array([r for _, r in rows], dtype=np.int64)
    z = np.zeros(len(rows), dtype=np.int64)
    return Replicas(ptr, rank, z, z)


def test_cache_table_lru_eviction_and_stale_entries():
    home = np.repeat(np.arange(2), 4)  # 8 experts, 2 ranks
    c = ReplicaCache(home, capacity=2)
    epoch = np.array([0, 0])
    assert not c.resident(epoch, 2).any()
    where, hits = c.admit(_replicas([(0, 1), (1, 1)], 8), epoch, 1, 100)
    assert hits == 0 and sorted(where.values()) == [0, 1]
    res = c.resident(epoch, 2)
    assert res[1, 0] and res[1, 1] and res.sum() == 2
    where2, hits = c.admit(_replicas([(0, 1)], 8), epoch, 1, 100)  # expert 0 used again: expert 1 is LRU
    assert hits == 1 and where2 == {0: where[0]}
    where3, hits = c.admit(_replicas([(0, 1), (2, 1)], 8), epoch, 1, 100)  # capacity 2: expert 1 evicted
    assert hits == 1 and where3[2] == where[1] and (1, 1) not in c.entries
    assert c.hits == 2 and c.misses == 3 and c.bytes_saved == 200
    assert not c.resident(np.array([1, 0]), 2).any()  # rank 0's masters moved on: all stale, dropped
    assert not c.entries


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(4, 16, 2), (8, 32, 3), (4, 8, 1)]))
def test_quota_with_residency_is_valid_deterministic_and_within_tolerance(seed, shape):
    R, E, N = shape
    rng = np.random.default_rng(seed)
    t = Topology(num_ranks=R, num_experts=E, num_redundant_slots=N, expert_bytes=1 << 20)
    load = (rng.zipf(1.5, size=(R, E)) * rng.integers(1, 50, size=(R, E))).astype(np.int64)
    load = np.minimum(load, 5000)
    resident = rng.random((R, E)) < 0.2
    pol = QuotaPolicy()
    plan = plan_resident(pol, load, t, resident)
    plan.check()
    assert plan.rank_load_after_R.sum() == load.sum()
    again = plan_resident(QuotaPolicy(), load.copy(), t, resident.copy())
    assert plan.digest() == again.digest()
    blind = pol.plan(load, t)
    mean = load.sum() / R
    assert plan.rank_load_after_R.max() <= blind.rank_load_after_R.max() + pol.cache_tolerance * mean + 1
    # transfers are exactly the replicas that are not resident
    expert_P = np.repeat(np.arange(E), np.diff(plan.replicas.ptr))
    need = ~resident[plan.replicas.rank, expert_P]
    assert len(plan.transfers) == int(need.sum())
    assert sorted(zip(plan.transfers.expert.tolist(), plan.transfers.dst.tolist())) == sorted(
        zip(expert_P[need].tolist(), plan.replicas.rank[need].tolist()))


def test_quota_prefers_a_resident_placement():
    # one replica of expert 0 balances this load; the blind planner (best fit) puts it on rank 2. A valid copy
    # already on rank 3 balances it as well: the cache-aware plan reuses it and moves no weights.
    t = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1, expert_bytes=1 << 20)
    load = np.array([[14, 12, 19, 9, 1, 15, 10, 6], [20, 3, 12, 16, 9, 4, 14, 3],
                     [1, 6, 3, 2, 12, 17, 3, 9], [15, 3, 1, 9, 1, 8, 13, 9]], dtype=np.int64)
    blind = QuotaPolicy().plan(load, t)
    assert blind.replicas.rank.tolist() == [2] and len(blind.transfers) == 1
    resident = np.zeros((4, 8), dtype=bool)
    resident[3, 0] = True
    warm = plan_resident(QuotaPolicy(), load, t, resident)
    assert warm.replicas.rank.tolist() == [3] and len(warm.transfers) == 0
    assert warm.rank_load_after_R.max() <= blind.rank_load_after_R.max()


# ---------------------------------------------------------------------------------------------- telemetry
def _recorded_serving(rank, world, runs):
    import ultraep

    model = build_model("qwen3-moe").eval()
    rec = ultraep.telemetry.Recorder.open(runs, "cache-serve", kind="prefill", world_size=world, rank=rank,
                                          flush_interval_s=None)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec)
    rt = ultraep.runtime_of(model)
    with torch.no_grad():
        for batch in range(4):
            model(input_ids=_ids(rank, batch))
            rt.next_step()
    rec.close()
    return sum(lay.store.cache.hits for lay in rt.layers), sum(lay.store.cache.misses for lay in rt.layers)


def test_cache_hits_and_bytes_saved_are_recorded_and_shown(tmp_path):
    from test_dashboard import app, select_run

    import ultraep
    from ultraep.telemetry import queries

    counters = run_ranks(_recorded_serving, 2, str(tmp_path))
    con = ultraep.telemetry.open_run(str(tmp_path / "cache-serve"))
    cols, rows = queries.run(con, queries.REPLICA_CACHE)
    got = [dict(zip(cols, r)) for r in rows]
    assert [r["layer"] for r in got] == [0, 1]
    # step 0 (warm-up: every replica streamed) is excluded; the later steps find every replica resident
    hits, misses = sum(r["hits"] for r in got), sum(r["misses"] for r in got)
    assert hits > 0 and misses == 0
    assert hits == sum(h for h, _ in counters) - con.execute(
        "SELECT coalesce(sum(other['cache_hits']), 0) FROM timings WHERE step = 0").fetchone()[0]
    expert_bytes = con.execute("SELECT max(other['cache_bytes_saved'] / other['cache_hits']) FROM timings "
                               "WHERE other['cache_hits'] > 0").fetchone()[0]
    assert sum(r["bytes_saved"] for r in got) == hits * expert_bytes
    con.close()
    at = select_run(app(tmp_path, "transfers"), "cache-serve")
    assert not at.exception
    shown = {m.label: m.value for m in at.metric}
    assert shown["replica cache hit rate"] == "100.0%", shown
