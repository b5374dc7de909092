"""Reroute kernel (ultraep.kernels.rerouting): Triton (interpreted on CPU) vs the pure-torch reference,
and both vs the plan: every instance receives exactly ``routes[src]``.

Legend: T tokens, K top-k, E experts, R ranks, S slots per rank, I instances (table width).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ultraep
from ultraep.kernels import KernelInputError, RerouteTable, reroute, reroute_reference, reroute_table

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics

R, E, N = 4, 16, 2
SENTINEL = -7777


def topk_ids(T: int, K: int, seed: int, *, weights=None) -> torch.Tensor:
    """``[T, K]`` distinct experts per token, drawn from ``weights`` (zero weight = expert never chosen)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.ones(E) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    return torch.multinomial(w.expand(T, E), K, replacement=False, generator=g)


def plan_for(ids_per_src: list[torch.Tensor]):
    load = np.stack([np.bincount(i.reshape(-1).numpy(), minlength=E) for i in ids_per_src])
    plan = ultraep.plan_layer(load, "quota", num_redundant_slots=N)
    plan.check()
    return plan


def skewed(K: int) -> np.ndarray:
    """Zipf-like popularity; experts 5 and 11 never chosen (zero tokens)."""
    w = 1.0 / np.arange(1, E + 1) ** 1.2
    w[[5, 11]] = 0.0
    return w if K <= E - 2 else np.ones(E)


CASES = [(T, K) for T in (1, 7, 1023) for K in (1, 2, 8)]


@pytest.mark.parametrize("T,K", CASES)
def test_reroute_triton_equals_reference_and_plan(T, K):
    ids = [topk_ids(T, K, seed=10 * T + K + r, weights=skewed(K)) for r in range(R)]
    plan = plan_for(ids)
    S = plan.topology.num_slots
    # Triton on two sources (one interleaved) to bound interpreter time; the reference on all four.
    for src in range(R):
        for interleave in (False, True):
            table = reroute_table(plan, src, interleave=interleave)
            ref = reroute_reference(ids[src], table)
            counts = np.bincount(ref.reshape(-1).numpy(), minlength=R * S)
            assert np.array_equal(counts, plan.routes_RRS[src].reshape(-1)), (src, interleave)
            if src == (0 if not interleave else R - 1):
                out = torch.full((T, K), SENTINEL, dtype=torch.int64)  # poisoned: every element must be written
                got = reroute(ids[src], table, out=out, backend="triton")
                assert got.data_ptr() == out.data_ptr()
                assert torch.equal(got, ref)
                assert (got >= 0).all()


def test_reroute_worked_example():
    # Module docstring: expert 3's instances for this source are global slots 1 and 6 with counts 2 and 1.
    # phy2log over R = 2, S = 4 (global slots 0..7): slot 1 and slot 6 hold expert 3; the others 0, 1, 2.
    phy2log = np.array([[0, 3, 1, -1], [2, -1, 3, -1]])
    routes = np.array([[1, 2, 1, 0], [1, 0, 1, 0]])  # expert 0: 1, expert 1: 1, expert 2: 1, expert 3: 2 + 1
    table = RerouteTable.from_arrays(phy2log, routes)
    assert table.gid_EI[3].tolist() == [1, 6] and table.cum_EI[3].tolist() == [2, 3]
    ids = torch.tensor([[3, 0], [3, 2], [3, 1]])
    expect = torch.tensor([[1, 0], [1, 4], [6, 2]])  # the three 3s: j = 0, 1, 2 -> slots 1, 1, 6
    for backend in ("torch", "triton"):
        assert torch.equal(reroute(ids, table, backend=backend), expect)
    # Interleaved: n = 3, stride = 3 // 2 + 1 = 2 (coprime with 3), offset = 3 mod 3 = 0: j' = 0, 2, 1.
    inter = RerouteTable.from_arrays(phy2log, routes, interleave=True)
    assert int(inter.stride_E[3]) == 2 and int(inter.offset_E[3]) == 0
    expect_i = torch.tensor([[1, 0], [6, 4], [1, 2]])
    for backend in ("torch", "triton"):
        assert torch.equal(reroute(ids, inter, backend=backend), expect_i)


@pytest.mark.parametrize("K", [1, 2])
def test_reroute_expert_holding_all_tokens(K):
    # Every token picks expert 0 (and for K = 2 one other): expert 0 holds all T tokens of every source and
    # gets replicated; experts never picked have zero tokens.
    T = 257
    ids = []
    for r in range(R):
        other = topk_ids(T, 1, seed=r, weights=[0] + [1] * (E - 1))
        ids.append(torch.zeros((T, 1), dtype=torch.int64) if K == 1 else torch.cat([torch.zeros_like(other), other], 1))
    plan = plan_for(ids)
    assert plan.replica_count_E[0] > 1
    S = plan.topology.num_slots
    for src in (0, 2):
        table = reroute_table(plan, src, interleave=src == 2)
        got = reroute(ids[src], table, backend="triton", block=64)  # several blocks: offsets carried across
        assert torch.equal(got, reroute_reference(ids[src], table))
        counts = np.bincount(got.reshape(-1).numpy(), minlength=R * S)
        assert np.array_equal(counts, plan.routes_RRS[src].reshape(-1))


def test_reroute_drops_invalid_ids_and_unplanned_excess():
    phy2log = np.array([[0, 1, -1], [2, 3, 0]])
    routes = np.array([[2, 1, 0], [0, 0, 1]])  # expert 0: 2 at gid 0 + 1 at gid 5; expert 1: 1; 2, 3: none
    table = RerouteTable.from_arrays(phy2log, routes)
    ids = torch.tensor([[0, -1], [1, 0], [7, 0], [0, 2], [1, 16]], dtype=torch.int32)
    # Expert 0's assignments: j = 0, 1, 2 -> gid 0, 0, 5; the 4th exceeds the planned 3 -> -1.
    # Expert 1: its 2nd assignment exceeds the planned 1 -> -1; expert 2 has no planned tokens -> -1;
    # ids -1, 7 and 16 are outside [0, E = 4) -> -1.
    expect = torch.tensor([[0, -1], [1, 0], [-1, 5], [-1, -1], [-1, -1]])
    for backend in ("torch", "triton"):
        assert torch.equal(reroute(ids, table, backend=backend), expect)


def test_interleave_spreads_consecutive_tokens():
    # One expert with two equal instances: plain reroute sends the first half to one, interleaved alternates.
    phy2log = np.array([[0, -1], [1, 0]])
    routes = np.array([[50, 0], [0, 50]])
    ids = torch.zeros((100, 1), dtype=torch.int64)
    plain = reroute(ids, RerouteTable.from_arrays(phy2log, routes), backend="triton").reshape(-1)
    inter = reroute(ids, RerouteTable.from_arrays(phy2log, routes, interleave=True), backend="triton").reshape(-1)
    switches = lambda x: int((x[1:] != x[:-1]).sum())  # noqa: E731
    assert switches(plain) == 1 and switches(inter) >= 90
    assert torch.bincount(inter, minlength=4)[[0, 3]].tolist() == [50, 50]


def test_empty_input_and_table_errors():
    plan = plan_for([topk_ids(5, 2, seed=r) for r in range(R)])
    table = reroute_table(plan, 1)
    assert reroute(torch.zeros((0, 2), dtype=torch.int64), table, backend="triton").shape == (0, 2)
    with pytest.raises(KernelInputError, match="source rank 4 is outside 0..3"):
        reroute_table(plan, 4)
    with pytest.raises(KernelInputError, match="ids_TK"):
        reroute(torch.zeros((3, 2)), table)
    with pytest.raises(KernelInputError, match="out"):
        reroute(torch.zeros((3, 2), dtype=torch.int64), table, out=torch.zeros((3, 2), dtype=torch.int32))
    with pytest.raises(KernelInputError, match="unknown backend 'cuda'"):
        reroute(torch.zeros((3, 2), dtype=torch.int64), table, backend="cuda")
    # The table's counts are exactly this source's routes, instance by instance.
    c = table.counts_EI()
    gid = table.gid_EI
    flat = plan.routes_RRS[1].reshape(-1)
    assert all(int(c[e, i]) == flat[int(gid[e, i])] for e in range(E) for i in range(gid.shape[1]) if gid[e, i] >= 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reroute_cuda_auto_runs_triton_and_matches():
    ids = [topk_ids(4096, 8, seed=r) for r in range(R)]
    plan = plan_for(ids)
    table = reroute_table(plan, 0, device="cuda")
    got = reroute(ids[0].cuda(), table)
    assert torch.equal(got.cpu(), reroute_reference(ids[0], table.to("cpu")))


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    ranks=st.integers(1, 3),
    slots=st.integers(1, 3),
    K=st.integers(1, 3),
    interleave=st.booleans(),
)
def test_reroute_property_random_tables(data, ranks, slots, K, interleave):
    # Any placement and any per-instance counts: ids holding exactly the planned counts of each expert, in any
    # order, map to exactly those counts per instance, and Triton equals the reference.
    G = ranks * slots
    E = data.draw(st.integers(1, G))
    p = np.array(data.draw(st.permutations(list(range(E)) + [data.draw(st.integers(-1, E - 1)) for _ in range(G - E)])))
    counts = np.array(data.draw(st.lists(st.integers(0, 9), min_size=G, max_size=G)))
    counts[p < 0] = 0
    table = RerouteTable.from_arrays(p.reshape(ranks, slots), counts.reshape(ranks, slots), interleave=interleave)
    per_e = np.bincount(np.where(p >= 0, p, 0), weights=counts, minlength=E).astype(np.int64)
    flat = np.repeat(np.arange(E), per_e)
    pad = (-flat.size) % K
    flat = np.concatenate([flat, np.full(pad, -1)])  # dropped ids fill the last row
    order = data.draw(st.permutations(range(flat.size))) if flat.size else []
    ids = torch.as_tensor(flat[list(order)].reshape(-1, K) if flat.size else np.zeros((0, K), np.int64))
    ref = reroute_reference(ids, table)
    assert np.array_equal(np.bincount(ref[ref >= 0].numpy(), minlength=G), counts)
    assert torch.equal(reroute(ids, table, backend="triton", block=16), ref)
