"""Tile streaming of expert state and replica gradient reduction (ultraep.kernels.tiles, .grad_reduce):
Triton (interpreted on CPU) vs the pure-torch references, and a whole weight sync / gradient reduction
simulated across the ranks of a plan in one process.

Legend: X experts, J tensors per expert, TB tile bytes, P tiles per expert, A arena tiles, R ranks, M master
slots, S slots per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ultraep
from ultraep.kernels import (
    ExpertLayout, GradReduceSchedule, KernelInputError, StreamSchedule, forward_tiles, forward_tiles_reference,
    pack_grad_sends, pack_sends, pack_tiles, pack_tiles_reference, reduce_received, reduce_replica_grads,
    reduce_replica_grads_reference, unpack_tiles, forward_sends, unpack_received,
)

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics

POISON = 0xAB


def expert_tensors(e: int, kind: str, seed: int = 0) -> list[torch.Tensor]:
    """One expert's state in the layouts adapters produce (sizes deliberately not multiples of 16 or TB)."""
    g = torch.Generator().manual_seed(1000 * seed + e)
    if kind == "fused":  # gate_up [2I, H] + down [H, I], bf16 (Qwen/DeepSeek style, sliced from stacked params)
        return [torch.randn((2 * 13, 9), generator=g).bfloat16(), torch.randn((9, 13), generator=g).bfloat16()]
    if kind == "split":  # w1, w3, w2 as separate Linear weights, fp16 (Mixtral style)
        return [torch.randn((11, 7), generator=g).half(), torch.randn((11, 7), generator=g).half(),
                torch.randn((7, 11), generator=g).half()]
    # mixed dtypes, an odd bias, a tiny tensor
    return [torch.randn((5, 3), generator=g), torch.randn((31,), generator=g).bfloat16(),
            torch.randn((3,), generator=g).half(), torch.randn((17, 5), generator=g)]


@pytest.mark.parametrize("kind", ["fused", "split", "mixed"])
@pytest.mark.parametrize("tile_bytes", [16, 48, 256, 4096])
def test_pack_unpack_match_reference(kind, tile_bytes):
    experts = [expert_tensors(e, kind) for e in range(3)]
    layout = ExpertLayout.of(experts[0], tile_bytes=tile_bytes)
    assert layout.payload_bytes <= layout.expert_bytes < layout.payload_bytes + tile_bytes
    # Pack into a poisoned buffer: every byte, pads included, must be written (pads with zeros).
    got = layout.empty(3).fill_(POISON)
    pack_tiles(experts, layout, out=got, backend="triton")
    ref = pack_tiles_reference(experts, layout, layout.empty(3).fill_(POISON))
    assert torch.equal(got, ref)
    flat = got.view(-1)
    used = torch.zeros_like(flat, dtype=torch.bool)
    for x in range(3):
        for s, off in zip(layout.specs, layout.offsets):
            used[x * layout.expert_bytes + off: x * layout.expert_bytes + off + s.nbytes] = True
    assert (flat[~used] == 0).all()
    # Unpack into poisoned targets (NaN), in another order, from a buffer with a leading spare tile.
    arena = torch.cat([torch.full((1, tile_bytes), POISON, dtype=torch.uint8), got])
    targets = [[torch.full_like(t, float("nan")) for t in experts[0]] for _ in range(3)]
    first = [1 + 2 * layout.tiles_per_expert, 1, 1 + layout.tiles_per_expert]  # experts 2, 0, 1
    unpack_tiles(arena, targets, layout, first_tile=first, backend="triton")
    for tgt, e in zip(targets, (2, 0, 1)):
        assert all(torch.equal(a, b) for a, b in zip(tgt, experts[e]))  # bit-exact


def test_layout_worked_example_and_checks():
    # Module docstring: bf16 [3, 5] (30 B) and fp32 [7] (28 B), TB = 32: offsets (0, 32), payload 60 B, P = 2.
    lay = ExpertLayout.of([torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(7)], tile_bytes=32)
    assert (lay.offsets, lay.payload_bytes, lay.tiles_per_expert) == ((0, 32), 60, 2)
    with pytest.raises(KernelInputError, match=r"tile_bytes: \(40\) must be a positive multiple of 16"):
        ExpertLayout.of([torch.zeros(3)], tile_bytes=40)
    w = torch.zeros(5, 3, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"experts\.0\.0: is not contiguous"):
        pack_tiles([[w.t()]], ExpertLayout.of([w.t().contiguous()], 32))
    with pytest.raises(KernelInputError, match=r"experts\.1: has 2 tensors, the layout has 1"):
        pack_tiles([[w], [w, w]], ExpertLayout.of([w], 32))
    with pytest.raises(KernelInputError, match=r"experts\.0\.0: shape \(3, 5\) differs"):
        pack_tiles([[w.reshape(3, 5)]], ExpertLayout.of([w], 32))


def test_pack_converts_into_fp32_layout():
    experts = [expert_tensors(e, "mixed") for e in range(2)]
    layout = ExpertLayout.of(experts[0], tile_bytes=64).with_dtype(torch.float32)
    got = pack_tiles(experts, layout, out=layout.empty(2).fill_(POISON), backend="triton")
    assert torch.equal(got, pack_tiles_reference(experts, layout, layout.empty(2).fill_(POISON)))
    back = [[torch.full(t.shape, float("nan")) for t in experts[0]] for _ in range(2)]
    unpack_tiles(got, back, layout, backend="triton")
    assert all(torch.equal(a, b.float()) for x in range(2) for a, b in zip(back[x], experts[x]))


def test_forward_tiles_whole_and_chunked():
    g = torch.Generator().manual_seed(0)
    arena = torch.randint(0, 256, (9, 48), generator=g, dtype=torch.uint8)
    index = torch.tensor([4, 5, 6, 0, 1, 8, 8])
    ref = forward_tiles_reference(arena, index, torch.empty(7, 48, dtype=torch.uint8))
    got = forward_tiles(arena, index, out=torch.full((7, 48), POISON, dtype=torch.uint8), backend="triton")
    assert torch.equal(got, ref)
    chunked = torch.full((7, 48), POISON, dtype=torch.uint8)
    for lo in range(0, 7, 3):  # a relay forwarding 3-tile chunks as they arrive
        forward_tiles(arena, index[lo: lo + 3], out=chunked[lo: lo + 3], backend="triton")
    assert torch.equal(chunked, ref)
    with pytest.raises(KernelInputError, match="index: holds a tile outside 0..8"):
        forward_tiles(arena, [9])


# ---------------------------------------------------------------------------------------------- plan-driven
def relay_plan(relay: str):
    """R = 8, E = 8 (one master each), N = 1: expert 0 holds most tokens and is replicated on all 7 other
    ranks; with relay="always" the master feeds relays (stage 0) that feed the rest (stage 1)."""
    load = np.full((8, 8), 5)
    load[:, 0] = 400
    plan = ultraep.plan_layer(load, "quota", num_redundant_slots=1, relay=relay)
    plan.check()
    return plan


def simulate_weight_sync(plan, layout, masters, backend):
    """Every rank of ``plan`` in one process: pack stage 0, deliver, relay-forward stage 1, deliver, unpack."""
    t = plan.topology
    R, M, S = t.num_ranks, t.num_masters, t.num_slots
    sched = [StreamSchedule.from_plan(plan, r, layout) for r in range(R)]
    arenas = [torch.full((s.arena_tiles, layout.tile_bytes), POISON, dtype=torch.uint8) for s in sched]
    slots = [{s: [torch.full_like(x, float("nan")) for x in masters[0]] for s in range(M, S)} for _ in range(R)]

    def deliver(src, sent):
        for msg, buf in sent:
            (into,) = [m for m in sched[msg.peer].recvs if m.peer == src and m.stage == msg.stage]
            assert into.experts == msg.experts and buf.shape[0] == len(msg.experts) * layout.tiles_per_expert
            arenas[msg.peer][into.first_tile: into.first_tile + buf.shape[0]] = buf

    for r in range(R):
        deliver(r, pack_sends(sched[r], {e: masters[e] for e in range(t.num_experts) if t.home_E[e] == r}, layout,
                              backend=backend))
    for r in range(R):
        deliver(r, forward_sends(sched[r], arenas[r], backend=backend))
    for r in range(R):
        unpack_received(sched[r], arenas[r], slots[r], layout, backend=backend)
    return sched, slots


@pytest.mark.parametrize("relay", ["always", "direct"])
def test_weight_sync_over_plan_transfers(relay):
    plan = relay_plan(relay)
    stages = set(plan.transfers.stage.tolist())
    assert stages == ({0, 1} if relay == "always" else {0})
    masters = [expert_tensors(e, "mixed", seed=1) for e in range(8)]
    layout = ExpertLayout.of(masters[0], tile_bytes=128)
    for backend in ("triton", "torch"):
        sched, slots = simulate_weight_sync(plan, layout, masters, backend)
        held = 0
        for r in range(8):
            for s, tensors in slots[r].items():
                e = int(plan.phy2log_RS[r, s])
                if e >= 0:
                    held += 1
                    assert all(torch.equal(a, b) for a, b in zip(tensors, masters[e])), (backend, r, s, e)
        assert held == plan.num_replicas == 7
    # Relay bookkeeping: a relay forwards exactly the tiles of the expert it received in stage 0.
    for s in sched:
        for m in s.sends1:
            idx = s.forward_index(m)
            assert len(idx) == len(m.experts) * layout.tiles_per_expert
            assert all(any(r.stage == 0 and e in r.experts for r in s.recvs) for e in m.experts)


def test_grad_reduction_matches_reference_bitwise():
    g = torch.Generator().manual_seed(3)
    specs = [torch.zeros(13, 6), torch.zeros(37)]
    layout = ExpertLayout.of(specs, tile_bytes=64).with_dtype(torch.float32)
    P = layout.tiles_per_expert
    arena = torch.empty(7 * P, 64, dtype=torch.uint8)
    arena.view(torch.float32).copy_(torch.randn(arena.numel() // 4, generator=g).view(7 * P, 16) * 1e3)
    contributions = [[3 * P, 0, 5 * P], [], [P, 6 * P]]  # expert 1 has no replica: untouched
    for dtype in (torch.float32, torch.bfloat16):
        grads = [[torch.randn(t.shape, generator=g).to(dtype) for t in specs] for _ in range(3)]
        want = [[t.clone() for t in x] for x in grads]
        a_tri, a_ref = arena.clone(), arena.clone()
        reduce_replica_grads(grads, a_tri, contributions, layout, zero_consumed=True, backend="triton")
        reduce_replica_grads_reference(want, a_ref, contributions, layout, zero_consumed=True)
        assert all(torch.equal(a, b) for x, y in zip(grads, want) for a, b in zip(x, y))  # same order, same bits
        assert torch.equal(a_tri, a_ref)
        # Consumed payload ranges are zeroed; the copies at 2P and 4P (no contribution) keep their values.
        f = a_tri.view(-1).view(torch.float32)
        for c in (0, P, 3 * P, 5 * P, 6 * P):
            for spec, off in zip(layout.specs, layout.offsets):
                assert (f[c * 16 + off // 4: c * 16 + off // 4 + spec.numel] == 0).all()
        for c in (2 * P, 4 * P):
            assert torch.equal(a_tri[c: c + P], arena[c: c + P])
    # The order is the one given: fp32 sums of large values differ by order, and each order is reproduced.
    big = [[torch.zeros(t.shape) for t in specs]]
    rev = [[torch.zeros(t.shape) for t in specs]]
    reduce_replica_grads(big, arena.clone(), [[0, P, 3 * P]], layout, backend="triton")
    reduce_replica_grads(rev, arena.clone(), [[3 * P, P, 0]], layout, backend="triton")
    fwd_ref = [[torch.zeros(t.shape) for t in specs]]
    reduce_replica_grads_reference(fwd_ref, arena.clone(), [[0, P, 3 * P]], layout)
    assert all(torch.equal(a, b) for a, b in zip(big[0], fwd_ref[0]))
    torch.testing.assert_close(big[0][0], rev[0][0])


def test_grad_reduction_over_plan():
    plan = relay_plan("always")
    t = plan.topology
    R, M, S = t.num_ranks, t.num_masters, t.num_slots
    shapes = [(9, 5), (23,)]
    layout = ExpertLayout.of([torch.zeros(s) for s in shapes], tile_bytes=96).with_dtype(torch.float32)
    g = torch.Generator().manual_seed(7)
    master = {e: [torch.randn(s, generator=g) for s in shapes] for e in range(8)}
    replica = {r: {s: [torch.randn(x, generator=g).bfloat16() for x in shapes] for s in range(M, S)} for r in range(R)}
    # Expected: master + replicas in replica rank order, in fp32 (bf16 replica grads convert exactly).
    want = {e: [x.clone() for x in v] for e, v in master.items()}
    for r in range(R):
        for s in range(M, S):
            e = int(plan.phy2log_RS[r, s])
            if e >= 0:
                for a, b in zip(want[e], replica[r][s]):
                    a += b.float()
    sched = [GradReduceSchedule.from_plan(plan, r, layout) for r in range(R)]
    assert list(sched[0].contributions) == [0] and len(sched[0].contributions[0]) == 7
    arenas = [torch.full((s.arena_tiles, layout.tile_bytes), POISON, dtype=torch.uint8) for s in sched]
    for r in range(R):
        for msg, buf in pack_grad_sends(sched[r], replica[r], layout, backend="triton"):
            (into,) = [m for m in sched[msg.peer].recvs if m.peer == r]
            arenas[msg.peer][into.first_tile: into.first_tile + buf.shape[0]] = buf
    for r in range(R):
        reduce_received(sched[r], arenas[r], {e: master[e] for e in range(8) if t.home_E[e] == r}, layout,
                        zero_consumed=True, backend="triton")
    for e in range(8):
        assert all(torch.equal(a, b) for a, b in zip(master[e], want[e])), e
    # Every arena byte was written by a message (pads as zeros) and every payload consumed and zeroed.
    assert all((a == 0).all() for a in arenas)


def test_schedule_errors():
    plan = relay_plan("direct")
    layout = ExpertLayout.of([torch.zeros(4)], tile_bytes=16)
    with pytest.raises(KernelInputError, match=r"rank: \(8\) is outside 0..7"):
        StreamSchedule.from_plan(plan, 8, layout)
    with pytest.raises(KernelInputError, match="master_weights: has no tensors for expert"):
        pack_sends(StreamSchedule.from_plan(plan, 0, layout), {}, layout)
    with pytest.raises(KernelInputError, match="gradient tiles are fp32"):
        reduce_replica_grads([[torch.zeros(4)]], layout.empty(1), [[0]], layout.with_dtype(torch.bfloat16))
    with pytest.raises(KernelInputError, match=r"contributions\.0: tile 1 \(\+1 tiles\) is outside the arena of 1"):
        reduce_replica_grads([[torch.zeros(4)]], layout.empty(1), [[1]], layout)


def test_unpack_downcast_rounds_to_nearest_even():
    # fp32 tiles unpacked into bf16 tensors round like torch (to nearest, ties to even), also interpreted,
    # where Triton's own fp32 -> bf16 cast truncates. Ties: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6.
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-12, 3.0e38, -1e-40, 0.0])
    vals = torch.cat([ties, torch.randn(57, generator=torch.Generator().manual_seed(2)) * 1e3])
    layout = ExpertLayout.of([vals], tile_bytes=64)
    tiles = pack_tiles([[vals]], layout, backend="triton")
    got = [torch.full(vals.shape, float("nan"), dtype=torch.bfloat16)]
    unpack_tiles(tiles, [got], layout, backend="triton")
    assert torch.equal(got[0].view(torch.int16), vals.bfloat16().view(torch.int16))
