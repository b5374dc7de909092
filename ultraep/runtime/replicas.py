"""Replica slots of a balanced layer: weights streamed in without a barrier, gradients reduced back without one.

Legend: M master slots, N redundant slots, S = M + N, J tensors per expert, P tiles per expert,
Nr rows this rank's replica slots receive (slot-major).

Why no barrier: a blocking exchange between two unequal pieces of per-rank work (the masters' rows on one
rank, the replicas' rows on another) makes the layer cost ``max_r(master) + max_r(replica)`` instead of
``max_r(master + replica)``, re-creating the imbalance the plan removed. So every transfer is *posted*
early and *waited* late, only where waiting is free:

    forward  Step 1 (right after the plan, before the token dispatch): every rank issues batch W0 — its
                    stage-0 receives of replica weights and the stage-0 sends of its masters
                    (:meth:`ReplicaJob.post_weights`).
             Step 2 (after the dispatch, a barrier anyway): batch W1 — a relay forwards what it received,
                    and the ranks it feeds post those stage-1 receives in the same batch
                    (:meth:`ReplicaJob.relay`).
             Step 3 masters compute while the weights travel; the replica slots wait for their weights
                    only right before they compute (:meth:`ReplicaJob.wait_weights`).
    backward Step 4 each replica's weight gradient is packed as soon as the replica backward made it
                    (replicas run their backward first: their autograd node is the newest), and batch G
                    issues those sends together with this rank's receives of its masters' gradients.
             Step 5 :class:`GradSink` — the node every expert's backward feeds, right before the dispatch
                    all-to-all's backward (a barrier) — waits for the gradients and returns them as the
                    masters' gradient contribution, added in replica-rank order (deterministic).

Every batch is one point-to-point group in a canonical order (:mod:`ultraep.runtime.transport`), issued at
the same step on every rank, and no receive waits on a send the peer issues in a later batch: NCCL, which
runs a pair's operations in issue order and ignores tags, cannot deadlock on it (docs/design.md, "Point-to-
point order"). That is why the gradient receives go out with the sends (Step 4) rather than alone at the
start of the backward, and why stage-1 receives go out with the relays' sends (Step 2) rather than in W0.

Replica weights and activations live from forward to backward when they fit the runtime's replica memory
budget (``BalancerConfig.replica_memory_budget``; per-layer buffers, mode ``kept``); beyond it the layers share
one set of buffers, and a layer whose replicas were overwritten restores them (a blocking exchange) and
recomputes the replica forward in its backward (mode ``restore``); :mod:`ultraep.runtime.replica_store` owns
that memory and hands each job its :class:`~ultraep.runtime.replica_store.ReplicaSlots`.

A job sees its layer and runtime only through a :class:`ReplicaContext` (the groups, a guard around each
exchange, the one-expert function, the masters, the event sink, the transport choice): it never holds the layer
or the runtime, and this module imports neither (``tests/test_import_graph.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch

from ultraep.runtime.clock import HostClock
from ultraep.runtime.replica_store import ReplicaSlots
from ultraep.runtime.replica_transport import DirectTransport, TiledTransport
from ultraep.runtime.transport import Transfer, TransferHandle

TAG_WEIGHTS = 11  # gloo matches by tag too; NCCL ignores tags, so the canonical order alone must match
TAG_GRADS = 12


def _keep(t: torch.Tensor) -> torch.Tensor:
    """Saved-tensor pack hook that keeps the tensor as autograd would (detached: no reference cycle)."""
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class DeferredGrads:
    """Replica gradients of the calls run under :meth:`EPRuntime.no_sync`: kept on the replica's rank, summed per
    expert in fp32, and reduced to the masters once, by the next backward outside it — as DDP defers its
    all-reduce over gradient accumulation, so a step of k microbatches sends each replica's gradient once, not k
    times (issue 23).

    ``pairs``: ``(replica rank, expert)`` of every replica of every deferred call — the same set on every rank
    (plans are identical), so each master knows what it will receive. ``sums[e]``: ``[J]`` fp32, this rank's sum
    of expert ``e``'s replica gradients over those calls (missing = zero: a deferred forward whose backward never
    ran). ``epoch_R``: every rank's master epoch when deferring began — an optimizer step before the reduction
    would drop the pending gradients, so the layer refuses it.
    """

    def __init__(self) -> None:
        self.pairs: set[tuple[int, int]] = set()
        self.sums: dict[int, list[torch.Tensor]] = {}
        self.epoch_R: np.ndarray | None = None

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def fits(self, plan, limit: int) -> bool:
        """Whether adding ``plan``'s replicas keeps every rank at ``limit`` pending experts or fewer (the same
        answer on every rank: it reads only the plans)."""
        pairs = self.pairs | _replica_pairs(plan)
        per_rank = np.bincount([r for r, _ in pairs], minlength=plan.topology.num_ranks) if pairs else [0]
        return int(np.max(per_rank)) <= limit

    def add_plan(self, plan, epoch_R: np.ndarray) -> None:
        """A deferred call's replicas (at its forward; ``epoch_R``: every rank's master epoch now)."""
        if not self.pairs:
            self.epoch_R = np.array(epoch_R, copy=True)
        self.pairs |= _replica_pairs(plan)

    def pairs_for(self, plan, grads: str) -> set[tuple[int, int]]:
        """``(replica rank, expert)`` whose gradients the backward of a call of ``plan`` moves in mode ``grads``:
        none (``"defer"``: they wait here), the plan's replicas (``"reduce"``), or those and every pending one
        (``"flush"``)."""
        if grads == "defer":
            return set()
        pairs = _replica_pairs(plan)
        return pairs | self.pairs if grads == "flush" else pairs

    def route(self, grads: str, mine: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """This call's replica gradients ``{expert: [J]}`` → what its backward sends in mode ``grads``: nothing
        (``"defer"``: summed here), them and everything pending (``"flush"``), or them (``"reduce"``)."""
        if grads == "defer":
            for e, gw in mine.items():
                self.add(e, gw)
            return {}
        return self.merge(mine) if grads == "flush" else mine

    def add(self, expert: int, grads: list[torch.Tensor]) -> None:
        have = self.sums.get(expert)
        if have is None:
            self.sums[expert] = [g.float().clone() for g in grads]
        else:
            for a, g in zip(have, grads):
                a.add_(g)

    def merge(self, grads: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """This call's replica gradients ``{expert: [J]}`` plus everything pending (then nothing is pending):
        what a flushing backward sends."""
        _, pending = self.take()
        for e, gw in grads.items():
            if e in pending:
                for a, g in zip(pending[e], gw):
                    a.add_(g)
            else:
                pending[e] = gw
        return pending

    def take(self) -> tuple[set[tuple[int, int]], dict[int, list[torch.Tensor]]]:
        """The pending pairs and this rank's sums; afterwards nothing is pending."""
        out = (self.pairs, self.sums)
        self.pairs, self.sums, self.epoch_R = set(), {}, None
        return out


def _replica_pairs(plan) -> set[tuple[int, int]]:
    """``{(rank, expert)}`` of ``plan``'s replicas."""
    M = plan.topology.num_masters
    r, s = np.nonzero(plan.phy2log_RS[:, M:] >= 0)
    return {(int(a), int(plan.phy2log_RS[a, M + b])) for a, b in zip(r, s)}


@dataclass(frozen=True)
class ReplicaContext:
    """What a layer's replica jobs use of their layer and runtime, and nothing else (built once by the layer).

    ``guard(phase, peers)``: a context manager around one exchange (a backend failure becomes a
    :class:`~ultraep.errors.CollectiveFailedError` naming the layer, ``phase`` and ``peers``).
    ``expert_forward(x, ws)``: one expert's rows ``[n, H]`` with its J tensors ``ws`` → ``[n, H]``.
    ``master_params()``: this rank's J master tensors ``[M, ...]`` (read per job: a load may replace them).
    ``event(name)``: the runtime's step trace (tests pin the order). ``transport``:
    ``BalancerConfig.replica_transport``."""

    rank: int
    transfer_group: object
    guard: Callable[[str, list[int]], ContextManager]
    expert_forward: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]
    master_params: Callable[[], list[torch.Tensor]]
    first_expert: int
    event: Callable[[str], None]
    transport: str = "auto"


def _transport_for(ctx: ReplicaContext, plan, schedule, layout, grad_schedule, grad_layout, slots, params):
    """Per-tensor messages on CPU (gloo) without relays, else tile-packed (replica_transport.py)."""
    M, dev = plan.topology.num_masters, params[0].device
    relays = bool((plan.transfers.stage > 0).any())
    direct = not relays and (ctx.transport == "direct" or (ctx.transport == "auto" and not params[0].is_cuda))
    if direct:
        return DirectTransport(schedule, grad_schedule, grad_layout, slots, M, dev)
    return TiledTransport(schedule, layout, grad_schedule, grad_layout, slots, M, dev)


def _transfer_seconds(transfers, me: int, recv_seconds: dict) -> list[float]:
    """Measured seconds of each of ``transfers`` that rank ``me`` received (keys ``(src, stage, expert)``); NaN
    for transfers into other ranks."""
    out = [float("nan")] * len(transfers)
    for i in range(len(transfers) if recv_seconds else 0):
        key = (int(transfers.src[i]), int(transfers.stage[i]), int(transfers.expert[i]))
        if int(transfers.dst[i]) == me and key in recv_seconds:
            out[i] = recv_seconds[key]
    return out


class ReplicaJob:
    """One layer's replicas for one plan, forward and backward (see the module docstring for the steps).

    ``phases`` collects this rank's measured seconds per phase (the ``timings`` keys); ``ctx.event`` (when the
    runtime traces) the order of the steps.
    """

    def __init__(self, ctx: ReplicaContext, plan, slots: ReplicaSlots, grads: str = "reduce",
                 deferred: DeferredGrads | None = None, clock=None) -> None:
        """``slots``: the ``[N][J]`` buffers of replica slots ``M..S-1`` (slot ``M + i`` computes with
        ``slots.tensors[i]``, which may already hold its weights) — the layer's own (``slots.kept``: replicas
        and graph live to the backward) or the shared ones (restore + recompute in backward).

        ``grads``: what the backward does with the replicas' weight gradients — ``"reduce"`` them to the masters
        (the default), ``"defer"`` them into ``deferred`` (under ``no_sync``), or ``"flush"``: reduce them
        together with everything ``deferred`` holds."""
        from ultraep.kernels import ExpertLayout, GradReduceSchedule, StreamSchedule

        self.ctx = ctx
        self.clock = clock if clock is not None else HostClock()  # the layer call's (CUDA events on CUDA)
        t = plan.topology
        # ``plan.transfers`` are exactly the replicas this call streams (the engine planned with the layer's
        # replica cache: resident replicas are reused in place, every other one is sent)
        self.plan = plan
        self.M, self.S, self.me = t.num_masters, t.num_slots, ctx.rank
        self.params = ctx.master_params()
        self.layout = ExpertLayout.of([p[0].detach() for p in self.params])
        self.grad_layout = self.layout.with_dtype(torch.float32)
        self.schedule = StreamSchedule.from_plan(plan, self.me, self.layout)
        row = plan.phy2log_RS[self.me]
        self.slot_of = {int(row[s]): s for s in range(self.M, self.S) if row[s] >= 0}  # this rank's {expert: slot}
        self.grads_mode = grads
        self.deferred = deferred if deferred is not None else DeferredGrads()
        self.grad_schedule = GradReduceSchedule.from_replicas(self.deferred.pairs_for(plan, grads), t.home_E,
                                                              self.me, self.grad_layout)
        self.grad_bytes_sent = 0
        self.lease, self.kept, self.slots = slots, slots.kept, slots.tensors
        self.transport = _transport_for(ctx, plan, self.schedule, self.layout, self.grad_schedule,
                                        self.grad_layout, self.slots, self.params)
        self.counts: list[int] = []
        self.needs_backward = False
        self.x_rep: torch.Tensor | None = None
        self.bytes_sent = 0
        self.phases: dict[str, float] = {}
        self._weights: TransferHandle | None = None  # batch W0
        self._relay: TransferHandle | None = None  # batch W1
        self._grads: TransferHandle | None = None  # batch G
        self._recv_seconds: dict[tuple[int, int, int], float] = {}
        self._graph = None  # kept mode: (x, weights, y) of the replica forward, for its backward

    @property
    def holds_replicas(self) -> bool:
        """Whether this job's own buffers still hold replicas its backward will read (the store asks)."""
        return self._graph is not None

    def _add(self, key: str, seconds) -> None:
        self.phases[key] = self.phases.get(key, 0.0) + seconds

    # ------------------------------------------------------------------ weights (forward)
    def post_weights(self) -> None:
        """Step 1: issue batch W0 — every stage-0 receive of replica weights and this rank's stage-0 sends;
        never waits."""
        t0 = self.clock.now()
        first = self.ctx.first_expert
        sending = {e for m in self.schedule.sends0 for e in m.experts}
        tr = Transfer(self.ctx.transfer_group, TAG_WEIGHTS)
        self.transport.add_weights(tr, {e: [p.detach()[e - first] for p in self.params] for e in sending})
        with self.ctx.guard("replica weight sync (post)", tr.peers()):
            self._weights = tr.execute()
        self.bytes_sent = tr.send_bytes()
        self.ctx.event("weight_sync_posted")
        self._add("weight_post_s", self.clock.now() - t0)

    def relay(self) -> None:
        """Step 2: issue batch W1 — a relay forwards the stage-0 tiles it received to its children (after its
        W0 completed), and every rank fed by a relay posts those stage-1 receives in the same batch."""
        sched = self.schedule
        if not sched.sends1 and not any(m.stage == 1 for m in sched.recvs):
            return
        t0 = self.clock.now()
        with self.ctx.guard("replica weight sync (relay stage)", [m.peer for m in sched.recvs]):
            if sched.sends1:
                self._weights.wait_recvs()
            tr = Transfer(self.ctx.transfer_group, TAG_WEIGHTS)
            self.transport.add_relay(tr)
            self._relay = tr.execute()
        self.bytes_sent += tr.send_bytes()
        self._add("relay_s", self.clock.now() - t0)

    def wait_weights(self) -> None:
        """Step 3: block until this rank's replica weights arrived, then unpack them into the slots."""
        t0 = self.clock.now()
        handles = [h for h in (self._weights, self._relay) if h is not None]
        with self.ctx.guard("replica weight sync (wait)", [m.peer for m in self.schedule.recvs]):
            for h in handles:
                h.poll()
            for h in handles:
                h.wait_recvs()
        self.ctx.event("weight_sync_waited")
        t1 = self.clock.now()
        self.transport.unpack()
        self._add("weight_unpack_s", self.clock.now() - t1)
        self.lease.filled()
        sec: dict = {}
        for h in handles:
            sec.update(h.recv_seconds())
        self._recv_seconds = self._recv_seconds or self.transport.message_seconds(sec)
        self._add("weight_sync_flight_s", max(sec.values(), default=0.0))
        self._add("weight_wait_s", self.clock.now() - t0)

    def finish_sends(self) -> None:
        """Complete this rank's weight sends (after the combine: every receiver has long waited)."""
        for h in (self._weights, self._relay):
            if h is not None:
                with self.ctx.guard("replica weight sync (send)", []):
                    h.wait_sends()
        self._weights = self._relay = None
        self.transport.release_weights()

    def transfer_seconds(self) -> list[float]:
        """Measured seconds of each of ``plan.transfers`` this rank received (posting to first seen
        complete, an upper bound); NaN for transfers into other ranks."""
        return _transfer_seconds(self.plan.transfers, self.me, self._recv_seconds)

    # ------------------------------------------------------------------ weights (backward restore)
    def restore_weights(self) -> None:
        """Mode ``restore``: a later layer overwrote the shared buffers; stream the replicas again (blocking)."""
        t0 = self.clock.now()
        self.post_weights()
        self.relay()
        self.wait_weights()
        self.finish_sends()
        self.lease.restored()
        self._add("restore_s", self.clock.now() - t0)

    # ------------------------------------------------------------------ compute
    def compute(self, x_rep: torch.Tensor, build_graph: bool) -> torch.Tensor:
        """Replica rows ``[Nr, H]`` → outputs ``[Nr, H]``; with ``build_graph`` the autograd graph of this
        forward is kept for the backward (mode ``kept``: no recompute)."""
        t0 = self.clock.now()
        if build_graph:
            # the replica graph keeps its own tensors, out of any saved-tensor hooks around the layer: under a
            # non-reentrant activation checkpoint its backward (a nested torch.autograd.grad, a graph task of its
            # own) would otherwise start a second recompute of the whole region, collectives included
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _same):
                xr = x_rep.detach().requires_grad_(True)
                ws = [[w.detach().requires_grad_(True) for w in slot] for slot in self.slots]
                y = self._run(xr, ws)
            self._graph = (xr, ws, y)
            out = y.detach()
        else:
            with torch.no_grad():
                out = self._run(x_rep, self.slots)
        self.ctx.event("replica_compute")
        self._add("replica_compute_s", self.clock.now() - t0)
        return out

    def recompute(self, x_rep: torch.Tensor) -> torch.Tensor:
        """An activation-checkpoint recompute of this job's replica forward (the original call's graph runs the
        backward): the outputs from the weights the slots still hold. It saves nothing, as the original forward
        saved nothing under the checkpoint (its replica graph keeps its own tensors, see :meth:`compute`)."""
        with torch.no_grad():
            return self._run(x_rep, self.slots)

    def _run(self, x, slots) -> torch.Tensor:
        """Rows ``[Nr, H]`` (``counts[i]`` rows of slot ``M + i``, in slot order) through the slots' experts."""
        outs, at = [], 0
        for i, c in enumerate(self.counts):
            xs = x[at:at + c]
            outs.append(self.ctx.expert_forward(xs, slots[i]) if xs.shape[0] else xs.new_zeros(xs.shape))
            at += c
        return torch.cat(outs) if outs else x.new_zeros(x.shape)

    # ------------------------------------------------------------------ backward
    def backward(self, grad: torch.Tensor, shared: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, list]:
        """Step 4: replica backward (restore + recompute in mode ``restore``), then post the weight gradients
        to the masters' ranks. Returns the gradient of the replica rows and of the ``shared`` parameters the
        replica forward also read (e.g. a post-expert norm; None where unused or frozen): they stay on this rank."""
        xr, ws, y = self._replica_graph()
        t1 = self.clock.now()
        gx, wgrads, g_shared = _replica_grads(xr, ws, y, grad, shared, [s - self.M for s in self.slot_of.values()])
        self.ctx.event("replica_backward")
        t2 = self.clock.now()
        eg = self.deferred.route(self.grads_mode, {e: wgrads[s - self.M] for e, s in self.slot_of.items()})
        for e in (e for m in self.grad_schedule.sends for e in m.experts if e not in eg):  # deferred by a call
            eg[e] = [torch.zeros(s.shape, dtype=torch.float32, device=grad.device)  # whose backward never ran:
                     for s in self.grad_layout.specs]  # zero (flush only)
        tr = Transfer(self.ctx.transfer_group, TAG_GRADS)  # batch G: these sends and this rank's receives
        self.transport.add_grad_sends(tr, eg)
        self.transport.add_grad_recvs(tr)
        self.grad_bytes_sent = tr.send_bytes()
        with self.ctx.guard("replica gradient reduction (post)", tr.peers()):
            self._grads = tr.execute()
        self.ctx.event("grad_sent")
        t3 = self.clock.now()
        self._add("replica_backward_s", t2 - t1)
        self._add("grad_post_s", t3 - t2)
        return gx, g_shared

    def _replica_graph(self):
        """``(x, weights, y)`` of the replica forward: the graph kept in forward, or (mode ``restore``) the
        replicas restored if a later layer overwrote them, and the forward recomputed."""
        if self.kept:
            graph, self._graph = self._graph, None
            return graph
        if self.lease.overwritten():
            self.restore_weights()
        t0 = self.clock.now()
        with torch.enable_grad():
            xr = self.x_rep.requires_grad_(True)
            ws = [[w.detach().requires_grad_(True) for w in slot] for slot in self.slots]
            y = self._run(xr, ws)
        self.x_rep = None
        self._add("recompute_s", self.clock.now() - t0)
        return xr, ws, y

    def reduce_grads(self) -> list[torch.Tensor]:
        """Step 5: wait for the replicas' gradients of this rank's masters; return, for every expert in
        ``contributing()`` and each of its J tensors, the sum of its replicas' gradients (replica-rank order,
        fp32, cast to the parameter's dtype)."""
        if self._grads is None:  # pragma: no cover - the replicas' backward (Step 4) runs before the sink
            raise RuntimeError("replica gradient reduction: the sink ran before the replicas' backward")
        t0 = self.clock.now()
        with self.ctx.guard("replica gradient reduction (wait)", sorted({m.peer for m in self.grad_schedule.recvs})):
            self._grads.wait_recvs()
        self.ctx.event("grad_reduced")
        t1 = self.clock.now()
        sums = self.transport.reduce(self.contributing())
        out = [a.to(p.dtype) for e in self.contributing() for a, p in zip(sums[e], self.params)]
        self._add("grad_wait_s", t1 - t0)
        self._add("grad_reduce_s", self.clock.now() - t1)
        return out

    def contributing(self) -> list[int]:
        """Experts mastered on this rank that have replicas (ascending): the gradient sink's inputs."""
        return sorted(self.grad_schedule.contributions)

    def finish_grad_sends(self) -> None:
        if self._grads is not None:
            with self.ctx.guard("replica gradient reduction (send)", []):
                self._grads.wait_sends()
            self._grads = None


def _replica_grads(xr, ws, y, grad, shared, used):
    """Autograd through one replica forward ``y(xr, ws)``: returns the rows' gradient ``[Nr, H]``, the J weight
    gradients of each slot index in ``used`` (``{i: [J]}``, zeros where its replica got no row) and the ``shared``
    parameters' (None where frozen/unused).

    Only the slots that hold a replica (``used``) get weight gradients: the others got no row and nothing reads
    theirs. Zero-filling every slot's weights cost the rank without replicas — the busiest one, whose experts the
    others replicate — 3.2 ms of its backward at 64 tokens per rank (two slots of 12 MB, 2026-11-27)."""
    used = sorted(used)
    flat_ws = [w for i in used for w in ws[i]]
    train = [p for p in shared if p.requires_grad]
    if y.requires_grad:
        g = torch.autograd.grad(y, [xr, *flat_ws, *train], grad, allow_unused=True)
    else:  # no replica got a row: every gradient is zero
        g = [None] * (1 + len(flat_ws) + len(train))
    g_train = iter(g[1 + len(flat_ws):])
    g_shared = [next(g_train) if p.requires_grad else None for p in shared]
    gx = g[0] if g[0] is not None else torch.zeros_like(xr)
    J = len(ws[0]) if ws else 0
    wgrads = {i: [gw if gw is not None else torch.zeros_like(w) for gw, w in zip(g[1 + k * J:1 + (k + 1) * J], ws[i])]
              for k, i in enumerate(used)}
    return gx, wgrads, g_shared


class ReplicaExperts(torch.autograd.Function):
    """The replica slots of one layer: wait for weights + compute forward; backward + post gradients.

    Inputs after ``job``: the J master parameters, then the container's shared parameters (a post-expert norm):
    the replica rows pass through those too, so their gradient from these rows is returned to them here."""

    @staticmethod
    def forward(ctx, x_rep, job: ReplicaJob, *params):
        # (grad mode is off inside a Function's forward: the layer decided ``job.needs_backward`` outside)
        job.wait_weights()
        ctx.job = job
        ctx.shared = params[len(job.params):]
        if not job.kept and job.needs_backward:
            job.x_rep = x_rep.detach()
        return job.compute(x_rep, build_graph=job.kept and job.needs_backward)

    @staticmethod
    def backward(ctx, grad):
        job: ReplicaJob = ctx.job
        gx, g_shared = job.backward(grad.contiguous(), ctx.shared)
        return (gx, None, *([None] * len(job.params)), *g_shared)


class GradSink(torch.autograd.Function):
    """Identity on the dispatched rows; in backward, where every expert's backward of this rank has run and
    the dispatch all-to-all (a barrier) comes next, it returns the replicas' gradients as the gradient of the
    contributing masters' slices (``master_slices``: for each expert of ``job.contributing()``, its J
    tensors), which autograd adds to the masters' own."""

    @staticmethod
    def forward(ctx, recv, job: ReplicaJob, *master_slices):
        ctx.job = job
        ctx.num = len(master_slices)
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad):
        job: ReplicaJob = ctx.job
        grads = job.reduce_grads()
        job.finish_grad_sends()
        if len(grads) != ctx.num:  # pragma: no cover - the schedule and the sink's inputs come from one plan
            raise RuntimeError(f"replica gradient reduction produced {len(grads)} tensors for {ctx.num} inputs")
        return (grad, None, *grads)
