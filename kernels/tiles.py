"""Tile streaming of expert state: pack expert tensors into fixed-size tiles, forward tiles, unpack them.

Legend:
    X  experts in one message (or one call)        J  tensors per expert (gate/up, down, ...: any list)
    TB tile bytes (a multiple of 16)               P  tiles per expert (``ExpertLayout.tiles_per_expert``)
    A  tiles of a rank's receive arena             R  ranks     S  slots per rank    M  master slots

Replica weight sync (UltraEP §6) moves each replicated expert from its master's rank to the ranks that host
its replicas, possibly through a relay. Here that is three kernels and a schedule:

    Step 1 (:func:`pack_tiles`): the J tensors of each expert a rank sends to one peer are copied into one
            contiguous staging buffer ``[X * P, TB]`` (uint8): expert x starts at tile ``x * P``, tensor j
            at byte ``offsets[j]`` of the expert (16-byte aligned); every pad byte is written as zero.
    Step 2: the runtime sends the buffer (P2P), in chunks of whole tiles if it wants to pipeline.
    Step 3 (:func:`forward_tiles`): a relay copies received tiles into the staging buffer of each child
            (stage 1), chunk by chunk as they arrive: ``out[i] = arena[index[i]]``.
    Step 4 (:func:`unpack_tiles`): received tiles are copied into the replica slots' tensors.

:class:`StreamSchedule` derives, for one rank, every message of Steps 1-4 from a plan's transfers
(stage 0: master -> direct replica or relay; stage 1: relay -> child), with the tile offsets of each
received message in one receive arena. Tensors may be bf16, fp16, fp32 (fp64) in any mix; same-dtype
copies are bit-exact raw-word copies, and a layout of another dtype (e.g. fp32 gradient tiles) converts.

Worked example: an expert with tensors bf16 [3, 5] (30 B) and fp32 [7] (28 B), TB = 32: offsets (0, 32),
payload 60 B, P = 2 tiles (64 B); bytes 30-31 and 60-63 are zero pads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from ultraep.kernels._backend import Backend, KernelInputError, is_interpreted, resolve, triton_module, upload

ALIGN = 16
DEFAULT_TILE_BYTES = 32 * 1024  # UltraEP's weight tile
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one expert tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class ExpertLayout:
    """Where each tensor of one expert lies in its tiles. Experts of one layer share a layout.

    specs       ``[J]`` shapes and dtypes        offsets  ``[J]`` byte offset of each tensor (16-aligned)
    tile_bytes  TB                               tiles_per_expert  P = ceil(payload / TB) (at least 1)
    """

    specs: tuple[TensorSpec, ...]
    tile_bytes: int = DEFAULT_TILE_BYTES
    offsets: tuple[int, ...] = field(init=False)
    payload_bytes: int = field(init=False)
    tiles_per_expert: int = field(init=False)

    def __post_init__(self) -> None:
        if self.tile_bytes <= 0 or self.tile_bytes % ALIGN:
            raise KernelInputError("tile_bytes", f"({self.tile_bytes}) must be a positive multiple of {ALIGN}", self.tile_bytes)
        for j, s in enumerate(self.specs):
            if not s.dtype.is_floating_point or s.itemsize > 8:
                raise KernelInputError(f"specs.{j}.dtype", f"{s.dtype} is not a supported floating dtype", s.dtype)
        offs, at = [], 0
        for s in self.specs:
            offs.append(at)
            at = -(-(at + s.nbytes) // ALIGN) * ALIGN
        object.__setattr__(self, "offsets", tuple(offs))
        end = offs[-1] + self.specs[-1].nbytes if self.specs else 0
        object.__setattr__(self, "payload_bytes", end)
        object.__setattr__(self, "tiles_per_expert", max(1, -(-end // self.tile_bytes)))

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in a staging buffer (P * TB)."""
        return self.tiles_per_expert * self.tile_bytes

    @staticmethod
    def of(tensors: Sequence[torch.Tensor], tile_bytes: int = DEFAULT_TILE_BYTES) -> "ExpertLayout":
        """The layout of one expert's tensors ``[J]`` (e.g. ``[gate_up_proj[e], down_proj[e]]``)."""
        return ExpertLayout(tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors), tile_bytes)

    def with_dtype(self, dtype: torch.dtype, tile_bytes: int | None = None) -> "ExpertLayout":
        """The same shapes in another dtype, e.g. ``torch.float32`` for gradient tiles."""
        return ExpertLayout(tuple(TensorSpec(s.shape, dtype) for s in self.specs), tile_bytes or self.tile_bytes)

    def empty(self, num_experts: int, device=None) -> torch.Tensor:
        """An uninitialised staging buffer ``[X * P, TB]`` uint8."""
        return torch.empty((num_experts * self.tiles_per_expert, self.tile_bytes), dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------- checks
def _check_experts(experts: Sequence[Sequence[torch.Tensor]], layout: ExpertLayout, device, name: str) -> None:
    J = len(layout.specs)
    for x, tensors in enumerate(experts):
        if len(tensors) != J:
            raise KernelInputError(f"{name}.{x}", f"has {len(tensors)} tensors, the layout has {J}")
        for j, (t, s) in enumerate(zip(tensors, layout.specs)):
            path = f"{name}.{x}.{j}"
            if tuple(t.shape) != s.shape:
                raise KernelInputError(path, f"shape {tuple(t.shape)} differs from the layout's {s.shape}")
            if not t.dtype.is_floating_point:
                raise KernelInputError(path, f"dtype {t.dtype} is not floating")
            if not t.is_contiguous():
                raise KernelInputError(path, f"is not contiguous (stride {t.stride()}); pass .contiguous() or the base tensor")
            if t.device != device:
                raise KernelInputError(path, f"is on {t.device}, the buffer on {device}")


def _check_buffer(buf: torch.Tensor, layout: ExpertLayout, name: str, min_tiles: int) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.tile_bytes or not buf.is_contiguous():
        raise KernelInputError(
            name, f"expected a contiguous uint8 [tiles, {layout.tile_bytes}] buffer, got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.shape[0] < min_tiles:
        raise KernelInputError(name, f"has {buf.shape[0]} tiles, needs at least {min_tiles}")
    if buf.data_ptr() % ALIGN:
        raise KernelInputError(name, f"data pointer is not {ALIGN}-byte aligned")


def _first_tiles(first_tile, n: int, layout: ExpertLayout) -> np.ndarray:
    if first_tile is None:
        return np.arange(n, dtype=np.int64) * layout.tiles_per_expert
    arr = np.asarray(first_tile, dtype=np.int64).reshape(-1)
    if arr.shape[0] != n:
        raise KernelInputError("first_tile", f"has {arr.shape[0]} entries for {n} experts")
    return arr


# ---------------------------------------------------------------------------------------------- references
def pack_tiles_reference(experts, layout: ExpertLayout, out: torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`pack_tiles` into ``out`` ``[X * P, TB]`` uint8."""
    flat = out.view(-1)
    eb = layout.expert_bytes
    flat[: len(experts) * eb].zero_()
    for x, tensors in enumerate(experts):
        for t, s, off in zip(tensors, layout.specs, layout.offsets):
            at = x * eb + off
            flat[at: at + s.nbytes] = t.to(s.dtype).reshape(-1).view(torch.uint8)
    return out


def unpack_tiles_reference(tiles: torch.Tensor, targets, layout: ExpertLayout, first_tile=None) -> None:
    """Pure-torch :func:`unpack_tiles`."""
    flat = tiles.view(-1)
    starts = _first_tiles(first_tile, len(targets), layout)
    for x, tensors in enumerate(targets):
        for t, s, off in zip(tensors, layout.specs, layout.offsets):
            at = int(starts[x]) * layout.tile_bytes + off
            t.copy_(flat[at: at + s.nbytes].view(s.dtype).view(s.shape))


def forward_tiles_reference(arena: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`forward_tiles`."""
    return torch.index_select(arena, 0, index, out=out)


# ---------------------------------------------------------------------------------------------- item tables
def _segment_items(n_bytes: int, tile_bytes: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the byte range ``[start, start + n_bytes)`` of a buffer at tile boundaries: (offsets, lengths)."""
    if n_bytes <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = start // tile_bytes
    last = (start + n_bytes - 1) // tile_bytes
    cuts = np.arange(first + 1, last + 1, dtype=np.int64) * tile_bytes
    lo = np.concatenate([[start], cuts])
    hi = np.concatenate([cuts, [start + n_bytes]])
    return lo, hi - lo


def build_items(experts, layout: ExpertLayout, starts: np.ndarray, with_pads: bool):
    """Item tables for one pack/unpack call, grouped by launch.

    Returns ``{(t_dtype, buf_dtype, unit): int64 [W, 4]}`` where rows are ``(address, n, tensor offset,
    buffer offset)`` in units of ``unit`` bytes. Same-dtype tensors share one raw-word launch (unit = the
    widest word dividing every address and size); converting tensors get one launch per dtype pair.
    """
    tb = layout.tile_bytes
    raw: list[tuple[int, int, int]] = []  # (address or 0, byte offset in buffer, n bytes)
    conv: dict[tuple[torch.dtype, torch.dtype], list[tuple[int, int, int]]] = {}
    for x, tensors in enumerate(experts):
        base = int(starts[x]) * tb
        for j, (t, s, off) in enumerate(zip(tensors, layout.specs, layout.offsets)):
            nxt = layout.offsets[j + 1] if j + 1 < len(layout.specs) else layout.expert_bytes
            rows = raw if t.dtype == s.dtype else conv.setdefault((t.dtype, s.dtype), [])
            rows.append((t.data_ptr(), base + off, s.nbytes))
            if with_pads and nxt > off + s.nbytes:
                rows.append((0, base + off + s.nbytes, nxt - off - s.nbytes))
        if with_pads and not layout.specs:
            raw.append((0, base, layout.expert_bytes))
    groups = {}
    if raw:
        unit = 8
        for addr, boff, nb in raw:
            while (addr % unit) or (nb % unit) or (boff % unit):
                unit //= 2
        groups[(_WORDS[unit], _WORDS[unit], unit)] = _rows(raw, unit, tb)
    for (tdt, bdt), rows in conv.items():
        groups[(tdt, bdt, torch.empty(0, dtype=bdt).element_size())] = _rows(rows, None, tb, b_dtype=bdt)
    return groups


def _rows(rows, unit, tb, b_dtype=None) -> np.ndarray:
    """Byte-level rows -> item table in element units, each item inside one tile of the buffer.

    Converting launches count both offsets in elements (element k of the tensor is element k of its run in
    the buffer), so the unit is the buffer's element size.
    """
    bsz = unit if unit is not None else torch.empty(0, dtype=b_dtype).element_size()
    out = []
    for addr, boff, nb in rows:
        lo, ln = _segment_items(nb, tb, boff)
        n = ln // bsz
        toff = (lo - boff) // bsz
        a = np.full(lo.shape, addr, dtype=np.int64)
        out.append(np.stack([a, n, toff if addr else np.zeros_like(toff), lo // bsz], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 4), np.int64)


# ---------------------------------------------------------------------------------------------- wrappers
def pack_tiles(
    experts: Sequence[Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Step 1: the tensors ``[X][J]`` of X experts -> staging buffer ``[X * P, TB]`` uint8 (pads zeroed).

    Tensors whose dtype differs from the layout's are converted (e.g. bf16 grads into fp32 tiles).
    """
    if out is None:
        device = experts[0][0].device if experts and experts[0] else torch.device("cpu")
        out = layout.empty(len(experts), device)
    _check_buffer(out, layout, "out", len(experts) * layout.tiles_per_expert)
    _check_experts(experts, layout, out.device, "experts")
    if resolve(backend, out.device, "pack_tiles", 2 * len(experts) * layout.payload_bytes) == "torch":
        return pack_tiles_reference(experts, layout, out)
    tri = triton_module("tiles_triton", "pack_tiles")
    starts = _first_tiles(None, len(experts), layout)
    groups = build_items(experts, layout, starts, with_pads=True)
    for ((tdt, bdt, _unit), _), items in zip(groups.items(), upload(list(groups.values()), out.device)):
        tri.copy_items(items, out.view(-1).view(bdt), True, tdt, is_interpreted(out.device))
    return out


def unpack_tiles(
    tiles: torch.Tensor,
    targets: Sequence[Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    first_tile: Sequence[int] | np.ndarray | None = None,
    backend: Backend = "auto",
) -> None:
    """Step 4: copy expert x's tiles (starting at ``first_tile[x]``, default ``x * P``) of ``tiles``
    ``[A, TB]`` uint8 into the tensors ``targets[x]`` (e.g. a replica slot's buffers), in place."""
    starts = _first_tiles(first_tile, len(targets), layout)
    need = int(starts.max()) + layout.tiles_per_expert if len(targets) else 0
    _check_buffer(tiles, layout, "tiles", need)
    if (starts < 0).any():
        raise KernelInputError("first_tile", "holds a negative tile index")
    _check_experts(targets, layout, tiles.device, "targets")
    if resolve(backend, tiles.device, "unpack_tiles", 2 * len(targets) * layout.payload_bytes) == "torch":
        unpack_tiles_reference(tiles, targets, layout, starts)
        return
    tri = triton_module("tiles_triton", "unpack_tiles")
    groups = build_items(targets, layout, starts, with_pads=False)
    for ((tdt, bdt, _unit), _), items in zip(groups.items(), upload(list(groups.values()), tiles.device)):
        tri.copy_items(items, tiles.view(-1).view(bdt), False, tdt, is_interpreted(tiles.device))


def forward_tiles(
    arena: torch.Tensor,
    index: torch.Tensor | Sequence[int] | np.ndarray,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Step 3 (relay): ``out[i] = arena[index[i]]`` for whole tiles. arena ``[A, TB]`` uint8, index ``[n]``
    -> ``[n, TB]`` uint8. Call it per chunk (a slice of ``index`` and of ``out``) to forward as tiles arrive.
    An index given on the host (a sequence, numpy, a CPU tensor) is range-checked there and copied without
    blocking; an index already on the GPU is trusted (checking it would synchronise)."""
    if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.shape[1] % ALIGN or not arena.is_contiguous():
        raise KernelInputError("arena", f"expected a contiguous uint8 [tiles, TB] buffer, got {arena.dtype} {tuple(arena.shape)}")
    idx = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
    if not idx.is_cuda:
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= arena.shape[0]):
            raise KernelInputError("index", f"holds a tile outside 0..{arena.shape[0] - 1}")
        idx = upload([idx], arena.device)[0]
    if out is None:
        out = torch.empty((idx.numel(), arena.shape[1]), dtype=torch.uint8, device=arena.device)
    if tuple(out.shape) != (idx.numel(), arena.shape[1]) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise KernelInputError("out", f"expected contiguous uint8 {(idx.numel(), arena.shape[1])}, got {out.dtype} {tuple(out.shape)}")
    if resolve(backend, arena.device, "forward_tiles", 2 * idx.numel() * arena.shape[1]) == "torch":
        return forward_tiles_reference(arena, idx, out)
    if arena.data_ptr() % 4 or out.data_ptr() % 4:
        raise KernelInputError("arena", "data pointers must be 4-byte aligned")
    tri = triton_module("tiles_triton", "forward_tiles")
    tri.gather_tiles(arena.view(torch.int32), idx, out.view(torch.int32), is_interpreted(arena.device))
    return out


# ---------------------------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class Message:
    """One point-to-point message of expert state: ``experts`` (ascending) to or from ``peer``.

    For received messages ``first_tile`` is where the message starts in the receive arena.
    """

    peer: int
    stage: int
    experts: tuple[int, ...]
    first_tile: int = 0


@dataclass(frozen=True)
class StreamSchedule:
    """What one rank sends, forwards and receives for a plan's replica weight sync.

    sends0   stage-0 messages this rank packs from its masters (direct, or to a relay)
    sends1   stage-1 messages this rank forwards as a relay (tiles taken from its receive arena)
    recvs    messages this rank receives, stage 0 then stage 1, each by peer; laid out back to back in a
             receive arena of ``arena_tiles`` tiles
    slot_E   ``{expert: replica slot on this rank}`` for every expert received
    """

    rank: int
    tiles_per_expert: int
    sends0: tuple[Message, ...]
    sends1: tuple[Message, ...]
    recvs: tuple[Message, ...]
    arena_tiles: int
    slot_E: Mapping[int, int]

    @staticmethod
    def from_plan(plan, rank: int, layout: ExpertLayout | int) -> "StreamSchedule":
        """Derive rank ``rank``'s schedule from ``plan.transfers`` (``layout`` or tiles per expert)."""
        P = layout.tiles_per_expert if isinstance(layout, ExpertLayout) else int(layout)
        t = plan.topology
        if not 0 <= rank < t.num_ranks:
            raise KernelInputError("rank", f"({rank}) is outside 0..{t.num_ranks - 1}", rank)
        tr = plan.transfers

        # Step 1: group this rank's transfers by (stage, peer); experts ascending within a message.
        def group(mask: np.ndarray, peer_col: np.ndarray, stage: int) -> list[Message]:
            peers = peer_col[mask]
            exps = tr.expert[mask]
            out = []
            for p in np.unique(peers):
                out.append(Message(int(p), stage, tuple(int(e) for e in np.sort(exps[peers == p]))))
            return out

        sends0 = group((tr.src == rank) & (tr.stage == 0), tr.dst, 0)
        sends1 = group((tr.src == rank) & (tr.stage == 1), tr.dst, 1)
        recv0 = group((tr.dst == rank) & (tr.stage == 0), tr.src, 0)
        recv1 = group((tr.dst == rank) & (tr.stage == 1), tr.src, 1)
        # Step 2: lay received messages out back to back.
        recvs, at = [], 0
        for m in recv0 + recv1:
            recvs.append(Message(m.peer, m.stage, m.experts, at))
            at += len(m.experts) * P
        # Step 3: the replica slot of each received expert.
        M = t.num_masters
        row = plan.phy2log_RS[rank]
        slot_E = {int(row[s]): s for s in range(M, t.num_slots) if row[s] >= 0}
        for m in recvs:
            for e in m.experts:
                if e not in slot_E:
                    raise KernelInputError("plan.transfers", f"rank {rank} receives expert {e} but holds no replica of it")
        return StreamSchedule(rank, P, tuple(sends0), tuple(sends1), tuple(recvs), at, slot_E)

    def arena_tile_of(self, expert: int) -> int:
        """First arena tile of ``expert`` (received in any stage)."""
        for m in self.recvs:
            if expert in m.experts:
                return m.first_tile + m.experts.index(expert) * self.tiles_per_expert
        raise KernelInputError("expert", f"rank {self.rank} receives no copy of expert {expert}", expert)

    def forward_index(self, msg: Message) -> np.ndarray:
        """``[len(msg.experts) * P]`` arena tiles that make up a stage-1 (relay-out) message."""
        P = self.tiles_per_expert
        if not msg.experts:
            return np.zeros(0, np.int64)
        return np.concatenate([self.arena_tile_of(e) + np.arange(P, dtype=np.int64) for e in msg.experts])

    def received(self) -> list[tuple[int, int, int]]:
        """``(expert, slot, first arena tile)`` of every received expert, in arena order."""
        out = []
        for m in self.recvs:
            for i, e in enumerate(m.experts):
                out.append((e, self.slot_E[e], m.first_tile + i * self.tiles_per_expert))
        return out


def pack_sends(
    schedule: StreamSchedule,
    master_weights: Mapping[int, Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    backend: Backend = "auto",
) -> list[tuple[Message, torch.Tensor]]:
    """Stage 0: one packed staging buffer per destination. ``master_weights[e]`` = expert e's tensors."""
    out = []
    for m in schedule.sends0:
        missing = [e for e in m.experts if e not in master_weights]
        if missing:
            raise KernelInputError("master_weights", f"has no tensors for expert(s) {missing} that rank {schedule.rank} sends")
        out.append((m, pack_tiles([master_weights[e] for e in m.experts], layout, backend=backend)))
    return out


def forward_sends(
    schedule: StreamSchedule, arena: torch.Tensor, *, backend: Backend = "auto"
) -> list[tuple[Message, torch.Tensor]]:
    """Stage 1 (relay): one staging buffer per child, gathered from the receive arena ``[A, TB]``."""
    return [(m, forward_tiles(arena, schedule.forward_index(m), backend=backend)) for m in schedule.sends1]


def unpack_received(
    schedule: StreamSchedule,
    arena: torch.Tensor,
    replica_slots: Mapping[int, Sequence[torch.Tensor]],
    layout: ExpertLayout,
    *,
    backend: Backend = "auto",
) -> None:
    """Step 4 for every received expert in one launch: ``replica_slots[slot]`` = that slot's tensors."""
    got = schedule.received()
    missing = [s for _, s, _ in got if s not in replica_slots]
    if missing:
        raise KernelInputError("replica_slots", f"has no tensors for slot(s) {missing} of rank {schedule.rank}")
    unpack_tiles(arena, [replica_slots[s] for _, s, _ in got], layout, first_tile=[a for _, _, a in got], backend=backend)
