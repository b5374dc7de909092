"""How one job's replica weights and gradients become point-to-point messages: the direct and the tiled
transport, behind one interface (issue 33's "transport as its own room", issue 34's canonical keys).

Legend: J tensors per expert, N redundant slots, P tiles per expert.

Both fill :class:`~ultraep.runtime.transport.Transfer` batches with messages under keys both sides derive
from the plan, and own the buffers those messages land in:

* :class:`DirectTransport` (CPU/gloo, no relays): every expert tensor its own message, straight from the
  master's parameter into the replica slot, and from the replica's fp32 gradient into a receive buffer —
  no pack, no unpack, no arena: host copies would sit on the critical path. Keys ``(stage, expert, j)`` for
  weights, ``(expert, j)`` for gradients.
* :class:`TiledTransport` (GPUs, and whenever a relay forwards): experts tile-packed, one message per peer
  and stage (Triton kernels on GPUs, their references on CPU). Keys ``(stage, first expert)`` and
  ``(first expert,)``.

The job (``replicas.ReplicaJob``) decides *when* each batch is issued and waited; a transport decides
*what* is in it.
"""

from __future__ import annotations

import torch

from ultraep.runtime.transport import Transfer


class DirectTransport:
    """Per-tensor messages. ``slots``: this rank's ``[N][J]`` replica slot tensors; ``M``: master slots."""

    def __init__(self, schedule, grad_schedule, grad_layout, slots: list[list[torch.Tensor]], M: int,
                 device: torch.device) -> None:
        self.schedule, self.grad_schedule, self.grad_layout = schedule, grad_schedule, grad_layout
        self.slots, self.M, self.device = slots, M, device
        self._grad_bufs: dict[int, list[list[torch.Tensor]]] = {}  # expert -> [replica][J] fp32

    def add_weights(self, tr: Transfer, masters: dict[int, list[torch.Tensor]]) -> None:
        """Batch W0: every receive (all stage 0: no relays here) and this rank's sends of ``masters``."""
        sched = self.schedule
        for m in sched.recvs:
            for e in m.experts:
                for j, t in enumerate(self.slots[sched.slot_E[e] - self.M]):
                    tr.add_recv(m.peer, t, (0, e, j))
        for m in sched.sends0:
            for e in m.experts:
                for j, w in enumerate(masters[e]):
                    tr.add_send(m.peer, w, (0, e, j))

    def add_relay(self, tr: Transfer) -> None:  # pragma: no cover - a plan with relays takes the tiled transport
        raise RuntimeError("the direct transport has no relay stage")

    def unpack(self) -> None:
        """Nothing to do: the weights were received into the slots."""

    def release_weights(self) -> None:
        """Nothing held."""

    def message_seconds(self, sec: dict) -> dict[tuple[int, int, int], float]:
        """``{(peer, stage, expert): seconds}`` from the batches' ``{(peer, key): seconds}`` (slowest tensor)."""
        out: dict[tuple[int, int, int], float] = {}
        for (peer, (stage, e, _)), s in sec.items():
            out[(peer, stage, e)] = max(out.get((peer, stage, e), 0.0), s)
        return out

    def add_grad_recvs(self, tr: Transfer) -> None:
        for m in self.grad_schedule.recvs:  # replica ranks ascending, experts ascending: the summation order
            for e in m.experts:
                bufs = [torch.empty(s.shape, dtype=torch.float32, device=self.device) for s in self.grad_layout.specs]
                self._grad_bufs.setdefault(e, []).append(bufs)
                for j, b in enumerate(bufs):
                    tr.add_recv(m.peer, b, (e, j))

    def add_grad_sends(self, tr: Transfer, grads: dict[int, list[torch.Tensor]]) -> None:
        for m in self.grad_schedule.sends:  # each gradient tensor its own fp32 message
            for e in m.experts:
                for j, g in enumerate(grads[e]):
                    tr.add_send(m.peer, g.float(), (e, j))

    def reduce(self, experts: list[int]) -> dict[int, list[torch.Tensor]]:
        """``{expert: [J] fp32}``: the received replica gradients summed in replica-rank order."""
        sums = {}
        for e, parts in self._grad_bufs.items():
            acc = parts[0]
            for more in parts[1:]:  # in replica-rank order: deterministic
                acc = [a + b for a, b in zip(acc, more)]
            sums[e] = acc
        self._grad_bufs = {}
        return sums


class TiledTransport:
    """Tile-packed messages through an arena (weights) and a gradient arena (fp32)."""

    def __init__(self, schedule, layout, grad_schedule, grad_layout, slots: list[list[torch.Tensor]], M: int,
                 device: torch.device) -> None:
        self.schedule, self.layout = schedule, layout
        self.grad_schedule, self.grad_layout = grad_schedule, grad_layout
        self.slots, self.M, self.device = slots, M, device
        self.arena: torch.Tensor | None = None
        self._grad_arena: torch.Tensor | None = None

    def _tiles(self, arena: torch.Tensor, m, layout) -> torch.Tensor:
        P = layout.tiles_per_expert
        return arena[m.first_tile:m.first_tile + len(m.experts) * P]

    def add_weights(self, tr: Transfer, masters: dict[int, list[torch.Tensor]]) -> None:
        """Batch W0: the stage-0 receives and this rank's packed stage-0 sends. Stage-1 receives wait for
        :meth:`add_relay`: in W0 they would make it complete only after a relay forwarded."""
        from ultraep.kernels import pack_sends

        self.arena = self.layout.empty(self.schedule.arena_tiles, device=self.device)
        for m in self.schedule.recvs:
            if m.stage == 0:
                tr.add_recv(m.peer, self._tiles(self.arena, m, self.layout), (0, m.experts[0]))
        for m, buf in pack_sends(self.schedule, masters, self.layout):
            tr.add_send(m.peer, buf, (0, m.experts[0]))

    def add_relay(self, tr: Transfer) -> None:
        """Batch W1: the stage-1 receives, and (a relay, after its W0 completed) the tiles it forwards."""
        from ultraep.kernels import forward_sends

        for m in self.schedule.recvs:
            if m.stage == 1:
                tr.add_recv(m.peer, self._tiles(self.arena, m, self.layout), (1, m.experts[0]))
        if self.schedule.sends1:
            for m, buf in forward_sends(self.schedule, self.arena):
                tr.add_send(m.peer, buf, (1, m.experts[0]))

    def unpack(self) -> None:
        from ultraep.kernels import unpack_received

        if self.schedule.recvs:
            unpack_received(self.schedule, self.arena, {self.M + i: self.slots[i] for i in range(len(self.slots))},
                            self.layout)

    def message_seconds(self, sec: dict) -> dict[tuple[int, int, int], float]:
        return {(m.peer, m.stage, e): sec[(m.peer, (m.stage, m.experts[0]))]
                for m in self.schedule.recvs for e in m.experts}

    def release_weights(self) -> None:
        self.arena = None

    def add_grad_recvs(self, tr: Transfer) -> None:
        gs = self.grad_schedule
        self._grad_arena = self.grad_layout.empty(gs.arena_tiles, device=self.device)
        for m in gs.recvs:
            tr.add_recv(m.peer, self._tiles(self._grad_arena, m, self.grad_layout), (m.experts[0],))

    def add_grad_sends(self, tr: Transfer, grads: dict[int, list[torch.Tensor]]) -> None:
        from ultraep.kernels import pack_grad_sends

        gs = self.grad_schedule
        for m, buf in pack_grad_sends(gs, {e: grads[e] for m in gs.sends for e in m.experts}, self.grad_layout):
            tr.add_send(m.peer, buf, (m.experts[0],))

    def reduce(self, experts: list[int]) -> dict[int, list[torch.Tensor]]:
        from ultraep.kernels import reduce_received

        sums = {}
        if experts:
            sums = {e: [torch.zeros(s.shape, dtype=torch.float32, device=self.device) for s in self.grad_layout.specs]
                    for e in experts}
            reduce_received(self.grad_schedule, self._grad_arena, sums, self.grad_layout)
        self._grad_arena = None
        return sums
