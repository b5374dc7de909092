"""Replica gradient reduction: add the replicas' fp32 gradient tiles into each master's gradient, in a fixed
order, so the result is bit-for-bit reproducible and equal to the unbalanced model's gradient up to fp32
summation (UltraEP §4.1: "each main expert sums the replica Wgrads into its own gradient buffer";
the authors' code uses ordered, non-atomic accumulation in deterministic mode; so does this).

Legend:
    X  master experts reduced in one call     J  tensors per expert       C  contributions of one expert
    TB tile bytes    P  tiles per expert      A  tiles of the master's receive arena
    R  ranks         S  slots per rank        M  master slots

    Step 1 (replica rank, :func:`pack_grad_sends`): each replica's gradients are packed into fp32 tiles
            (:func:`~ultraep.kernels.tiles.pack_tiles` with an fp32 :class:`ExpertLayout`, converting bf16
            grads), one message per master rank, experts ascending.
    Step 2: the runtime sends the messages to the masters' ranks; the master lays them out back to back in
            a receive arena, by sender rank ascending (:class:`GradReduceSchedule`).
    Step 3 (master rank, :func:`reduce_replica_grads`): for every element, ``g = master_grad`` (as fp32),
            then ``g += tile_c`` for the contributions c in the order given (replica rank ascending), then
            ``master_grad = g`` (cast back to its dtype). One program owns each element range: no atomics.

Worked example: expert 5 mastered on rank 1 has replicas on ranks 3 and 0. The master receives rank 0's
message first in its arena, then rank 3's; the order is fixed by rank, not by arrival:
``grad = (grad + g_rank0) + g_rank3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ultraep.kernels._backend import Backend, KernelInputError, is_interpreted, resolve, triton_module, upload
from ultraep.kernels.tiles import ExpertLayout, Message, _check_buffer, _check_experts, _segment_items, pack_tiles


def _check_fp32(layout: ExpertLayout) -> None:
    bad = [j for j, s in enumerate(layout.specs) if s.dtype != torch.float32]
    if bad:
        raise KernelInputError(
            f"layout.specs.{bad[0]}.dtype", "gradient tiles are fp32; build the layout with layout.with_dtype(torch.float32)"
        )


def _contrib(contributions, n: int, arena_tiles: int, P: int) -> list[list[int]]:
    if len(contributions) != n:
        raise KernelInputError("contributions", f"has {len(contributions)} entries for {n} master experts")
    out = []
    for x, cs in enumerate(contributions):
        cs = [int(c) for c in cs]
        for c in cs:
            if c < 0 or c + P > arena_tiles:
                raise KernelInputError(f"contributions.{x}", f"tile {c} (+{P} tiles) is outside the arena of {arena_tiles} tiles", c)
        out.append(cs)
    return out


def reduce_replica_grads_reference(master_grads, arena: torch.Tensor, contributions, layout: ExpertLayout,
                                   zero_consumed: bool = False) -> None:
    """Pure-torch :func:`reduce_replica_grads` (same order of fp32 additions, so bit-identical)."""
    f = arena.view(-1).view(torch.float32)
    te = layout.tile_bytes // 4
    for grads, cs in zip(master_grads, contributions):
        for g, s, off in zip(grads, layout.specs, layout.offsets):
            acc = g.reshape(-1).to(torch.float32, copy=True)
            for c in cs:
                at = int(c) * te + off // 4
                acc += f[at: at + s.numel]
                if zero_consumed:
                    f[at: at + s.numel] = 0
            g.copy_(acc.view(g.shape))


def reduce_replica_grads(
    master_grads: Sequence[Sequence[torch.Tensor]],
    arena: torch.Tensor,
    contributions: Sequence[Sequence[int]],
    layout: ExpertLayout,
    *,
    zero_consumed: bool = False,
    backend: Backend = "auto",
) -> None:
    """Step 3, in place: ``master_grads[x][j] += Σ_c tiles of contributions[x][c]`` in the given order.

    Args:
        master_grads: ``[X][J]`` gradient tensors of the master experts (fp32, bf16 or fp16; contiguous).
        arena: ``[A, TB]`` uint8 buffer of received fp32 gradient tiles.
        contributions: ``[X][C_x]`` first arena tile of each replica's copy of expert x, in summation order.
        layout: the fp32 :class:`ExpertLayout` the replicas packed with.
        zero_consumed: zero each consumed range of the arena (ready for the next layer).
    """
    _check_fp32(layout)
    P = layout.tiles_per_expert
    _check_buffer(arena, layout, "arena", 0)
    _check_experts(master_grads, layout.with_dtype(torch.float32), arena.device, "master_grads")
    cs = _contrib(contributions, len(master_grads), arena.shape[0], P)
    size = sum(2 + len(c) for c in cs) * layout.payload_bytes
    if resolve(backend, arena.device, "reduce_replica_grads", size) == "torch":
        reduce_replica_grads_reference(master_grads, arena, cs, layout, zero_consumed)
        return
    # Item rows (address, n, tensor offset, payload offset, c0, c1); one launch per gradient dtype.
    flat_c = np.asarray([c for x in cs for c in x], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum([len(x) for x in cs])]).astype(np.int64)
    groups: dict[torch.dtype, list[np.ndarray]] = {}
    for x, grads in enumerate(master_grads):
        if ptr[x + 1] == ptr[x]:
            continue
        for g, s, off in zip(grads, layout.specs, layout.offsets):
            lo, ln = _segment_items(s.nbytes, layout.tile_bytes, off)
            n = lo.shape[0]
            rows = np.stack([
                np.full(n, g.data_ptr(), np.int64), ln // 4, (lo - off) // 4, lo // 4,
                np.full(n, ptr[x], np.int64), np.full(n, ptr[x + 1], np.int64),
            ], axis=1)
            groups.setdefault(g.dtype, []).append(rows)
    if not groups:
        return
    tri = triton_module("tiles_triton", "reduce_replica_grads")
    f32 = arena.view(-1).view(torch.float32)
    contrib_t, *tables = upload([flat_c, *(np.concatenate(rows) for rows in groups.values())], arena.device)
    for dt, items in zip(groups, tables):
        tri.reduce_items(items, contrib_t, f32, layout.tile_bytes // 4, dt, zero_consumed, is_interpreted(arena.device))


@dataclass(frozen=True)
class GradReduceSchedule:
    """One rank's part of the replica gradient reduction of a plan (direct: every replica -> its master).

    sends          messages of this rank's replica grads, one per master rank (ascending), experts ascending
    recvs          messages this rank receives as a master, by replica rank ascending, back to back in an
                   arena of ``arena_tiles`` tiles
    slot_E         ``{expert: key of its gradients in pack_grad_sends' replica_grads}``: the replica slot on this
                   rank (:meth:`from_plan`) or the expert itself (:meth:`from_replicas`)
    contributions  ``{expert mastered here: first arena tiles of its replicas, replica rank ascending}``
    """

    rank: int
    tiles_per_expert: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    arena_tiles: int
    slot_E: Mapping[int, int]
    contributions: Mapping[int, tuple[int, ...]]

    @staticmethod
    def from_plan(plan, rank: int, layout: ExpertLayout | int) -> "GradReduceSchedule":
        """The reduction of ``plan``'s replicas; ``slot_E`` maps each of this rank's replicas to its slot."""
        t = plan.topology
        if not 0 <= rank < t.num_ranks:
            raise KernelInputError("rank", f"({rank}) is outside 0..{t.num_ranks - 1}", rank)
        M, S, R = t.num_masters, t.num_slots, t.num_ranks
        p = plan.phy2log_RS
        # Step 1: replicas as (rank, slot, expert), in rank order.
        reps = [(r, s, int(p[r, s])) for r in range(R) for s in range(M, S) if p[r, s] >= 0]
        out = GradReduceSchedule.from_replicas([(r, e) for r, _, e in reps], t.home_E, rank, layout)
        return GradReduceSchedule(out.rank, out.tiles_per_expert, out.sends, out.recvs, out.arena_tiles,
                                  {e: s for r, s, e in reps if r == rank}, out.contributions)

    @staticmethod
    def from_replicas(replicas, home_E, rank: int, layout: ExpertLayout | int) -> "GradReduceSchedule":
        """The reduction of the replicas ``[(replica rank, expert)]`` (at most one per rank and expert), e.g. the
        union of several plans' replicas whose gradients were accumulated on their ranks; ``slot_E`` maps each
        of this rank's replicas to its expert (the key of its gradients in :func:`pack_grad_sends`)."""
        P = layout.tiles_per_expert if isinstance(layout, ExpertLayout) else int(layout)
        home = np.asarray(home_E)
        reps = sorted({(int(r), int(e)) for r, e in replicas})
        # Step 2: this rank's sends: its replicas grouped by their master's rank.
        mine = sorted((int(home[e]), e) for r, e in reps if r == rank)
        sends = []
        for h in sorted({h for h, _ in mine}):
            sends.append(Message(h, 0, tuple(e for hh, e in mine if hh == h)))
        # Step 3: this rank's receives, by replica rank ascending; contributions in the same order.
        recvs, at = [], 0
        contrib: dict[int, list[int]] = {}
        for r in sorted({r for r, _ in reps}):
            exps = tuple(e for rr, e in reps if rr == r and home[e] == rank)
            if not exps:
                continue
            recvs.append(Message(r, 0, exps, at))
            for i, e in enumerate(exps):
                contrib.setdefault(e, []).append(at + i * P)
            at += len(exps) * P
        return GradReduceSchedule(rank, P, tuple(sends), tuple(recvs), at, {e: e for r, e in reps if r == rank},
                                  {e: tuple(v) for e, v in sorted(contrib.items())})


def pack_grad_sends(
    schedule: GradReduceSchedule,
    replica_grads: Mapping[int, Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    backend: Backend = "auto",
) -> list[tuple[Message, torch.Tensor]]:
    """Step 1: one fp32 tile buffer per master rank. ``replica_grads[slot]`` = that slot's gradient tensors."""
    _check_fp32(layout)
    out = []
    for m in schedule.sends:
        slots = [schedule.slot_E[e] for e in m.experts]
        missing = [s for s in slots if s not in replica_grads]
        if missing:
            raise KernelInputError("replica_grads", f"has no tensors for slot(s) {missing} of rank {schedule.rank}")
        out.append((m, pack_tiles([replica_grads[s] for s in slots], layout, backend=backend)))
    return out


def reduce_received(
    schedule: GradReduceSchedule,
    arena: torch.Tensor,
    master_grads: Mapping[int, Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    zero_consumed: bool = False,
    backend: Backend = "auto",
) -> None:
    """Step 3 for every expert mastered on this rank that has replicas. ``master_grads[e]`` = its grads."""
    exps = list(schedule.contributions)
    missing = [e for e in exps if e not in master_grads]
    if missing:
        raise KernelInputError("master_grads", f"has no tensors for expert(s) {missing} mastered on rank {schedule.rank}")
    reduce_replica_grads([master_grads[e] for e in exps], arena, [schedule.contributions[e] for e in exps], layout,
                         zero_consumed=zero_consumed, backend=backend)
