"""The balanced expert-parallel layer: what runs in place of a model's experts container.

Legend: T tokens of this rank, K top-k, H hidden, E experts, R ranks, M masters per rank, N redundant slots,
S = M + N slots, J tensors per expert, Nr rows this rank receives, P tiles per expert.

Forward, per MoE layer and microbatch (ARCHITECTURE.md §4):

    Step 1: local per-expert counts → all-gather → exact load λ[R, E] on every rank.
    Step 2: the layer's policy plans from λ (deterministic: every rank computes the same plan; with
            ``check_plan_hash`` the ranks compare digests and stop on divergence) and commits it.
    Step 3: reroute logical top-k ids to physical instances; order (token, k) pairs by destination slot.
    Step 4: all-to-all the token rows (split sizes straight from the plan's routes).
    Step 5: experts: master slots with the local parameters (plain autograd); replica slots through
            :class:`_ReplicaExperts`, which streams the masters' weights into the shared redundant-slot
            buffers (tile-packed P2P, two-stage relay) and runs the replicas.
    Step 6: reverse all-to-all, then combine with the routing weights.

Backward: gradients flow back through combine, the all-to-alls and the master experts by autograd.
:class:`_ReplicaExperts` restores the replica weights if a later layer overwrote the shared buffers,
recomputes the replica rows under autograd, and sends each replica's weight gradient (fp32 tiles) to its
master's rank, where they are added in rank order (deterministic): the master's gradient equals the
unbalanced model's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ultraep.comm import AllToAll, all_gather_bytes, exchange, gather_load

if TYPE_CHECKING:  # pragma: no cover
    from ultraep.adapters import ExpertsAdapter
    from ultraep.runtime import EPRuntime


class PlanDivergenceError(RuntimeError):
    """Ranks computed different plans for the same layer: exchanging tokens would be wrong."""


class RankFailureError(RuntimeError):
    """A collective of a balanced layer failed on this rank: a peer died, or did not answer within the process
    group's timeout (``init_process_group(timeout=...)``; ``ultraep.launch(..., timeout_s=...)``).

    Raised by every surviving rank that reaches a collective, after its telemetry was flushed. Attributes:
    ``layer`` (MoE layer index), ``name`` (module path), ``phase``, ``rank``, ``peers`` (the ranks this one
    was exchanging with), ``step``.
    """

    def __init__(self, message: str, *, layer: int, name: str, phase: str, rank: int, peers: list[int],
                 step: int) -> None:
        super().__init__(message)
        self.layer, self.name, self.phase, self.rank, self.peers, self.step = layer, name, phase, rank, peers, step


def _peers(sends, recvs) -> list[int]:
    return sorted({int(p) for p, _ in sends} | {int(p) for p, _ in recvs})


class ReplicaBuffers:
    """Redundant-slot weight buffers shared by every layer with the same expert layout (UltraEP §4.1).

    ``owner`` names the (layer, microbatch) whose replicas the buffers hold; ``generation`` counts syncs, so
    a backward can tell whether a later layer overwrote its replicas.
    """

    def __init__(self) -> None:
        self._sets: dict[tuple, list[list[torch.Tensor]]] = {}
        self.generation = 0
        self.restorations = 0

    def slots(self, like: list[torch.Tensor], num_slots: int) -> list[list[torch.Tensor]]:
        """``[N][J]`` tensors shaped like one expert's tensors ``like`` (allocated once per layout)."""
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in like)
        have = self._sets.get(key, [])
        while len(have) < num_slots:
            have.append([torch.empty_like(t) for t in like])
        self._sets[key] = have
        return have[:num_slots]


class ReplicaJob:
    """Everything one layer's replicas need in forward and backward for one plan."""

    def __init__(self, layer: "BalancedExperts", plan, counts_S: np.ndarray) -> None:
        from ultraep.kernels import ExpertLayout, GradReduceSchedule, StreamSchedule

        self.layer = layer
        t = plan.topology
        if len(plan.transfers) != plan.num_replicas:
            # Historical policies list only *new* replicas (what a deployment with persistent replica buffers
            # must move). Here weights change every optimizer step and the buffers are shared by all layers,
            # so every replica is streamed again: schedule them all.
            plan = _with_all_transfers(plan)
        self.plan = plan
        self.M, self.S, self.me = t.num_masters, t.num_slots, layer.runtime.rank
        like = [p[0].detach() for p in layer.master_params()]
        self.layout = ExpertLayout.of(like)
        self.grad_layout = self.layout.with_dtype(torch.float32)
        self.schedule = StreamSchedule.from_plan(plan, self.me, self.layout)
        self.grad_schedule = GradReduceSchedule.from_plan(plan, self.me, self.grad_layout)
        self.buffers = layer.runtime.buffers
        self.slots = self.buffers.slots(like, t.num_redundant_slots)
        self.counts = [int(c) for c in counts_S[self.M:]]  # rows per replica slot, in slot order
        self.generation = -1
        self.bytes_sent = 0
        self.seconds = 0.0

    # ------------------------------------------------------------------ weight sync (forward, and restore)
    def sync_weights(self) -> None:
        from ultraep.kernels import forward_sends, pack_sends, unpack_received

        t0 = time.perf_counter()
        sched, lay, group = self.schedule, self.layout, self.layer.runtime.group
        params = [p.detach() for p in self.layer.master_params()]
        first = self.layer.first_expert
        sending = {e for m in sched.sends0 for e in m.experts}
        masters = {e: [p[e - first] for p in params] for e in sending}
        arena = lay.empty(sched.arena_tiles, device=params[0].device)
        P = lay.tiles_per_expert

        def recv_slices(stage):
            return [(m.peer, arena[m.first_tile:m.first_tile + len(m.experts) * P]) for m in sched.recvs
                    if m.stage == stage]

        sends0 = pack_sends(sched, masters, lay)
        msgs, recvs = [(m.peer, buf) for m, buf in sends0], recv_slices(0)
        with self.layer._collective("replica weight sync (stage 0)", _peers(msgs, recvs)):
            exchange(msgs, recvs, group)
        sends1 = forward_sends(sched, arena)  # relay: forward what arrived in stage 0
        msgs, recvs = [(m.peer, buf) for m, buf in sends1], recv_slices(1)
        with self.layer._collective("replica weight sync (relay stage)", _peers(msgs, recvs)):
            exchange(msgs, recvs, group)
        if sched.recvs:
            unpack_received(sched, arena, {self.M + i: self.slots[i] for i in range(len(self.slots))}, lay)
        self.bytes_sent = sum(int(b.numel()) for _, b in sends0) + sum(int(b.numel()) for _, b in sends1)
        self.buffers.generation += 1
        self.generation = self.buffers.generation
        self.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ compute
    def _chunks(self, x: torch.Tensor):
        at = 0
        for i, c in enumerate(self.counts):
            yield i, x[at:at + c]
            at += c

    def compute(self, x_rep: torch.Tensor) -> torch.Tensor:
        fwd, mod = self.layer.adapter.forward, self.layer.container
        outs = [fwd(mod, xs, self.slots[i]) if xs.shape[0] else xs.new_zeros(xs.shape)
                for i, xs in self._chunks(x_rep)]
        return torch.cat(outs) if outs else x_rep.new_zeros(x_rep.shape)

    def backward(self, x_rep: torch.Tensor, grad: torch.Tensor):
        fwd, mod = self.layer.adapter.forward, self.layer.container
        gx, wgrads = [], {}
        gchunks = dict(self._chunks(grad))
        for i, xs in self._chunks(x_rep):
            if xs.shape[0] == 0:  # a replica that got no rows still reports a (zero) gradient to its master
                gx.append(torch.zeros_like(xs))
                wgrads[self.M + i] = [torch.zeros_like(w) for w in self.slots[i]]
                continue
            with torch.enable_grad():
                xr = xs.detach().requires_grad_(True)
                ws = [w.detach().requires_grad_(True) for w in self.slots[i]]
                y = fwd(mod, xr, ws)
                g = torch.autograd.grad(y, [xr, *ws], gchunks[i])
            gx.append(g[0])
            wgrads[self.M + i] = list(g[1:])
        return (torch.cat(gx) if gx else torch.zeros_like(x_rep)), wgrads

    def reduce_grads(self, wgrads: dict[int, list[torch.Tensor]]) -> list[torch.Tensor] | None:
        """Send replica weight gradients to the masters' ranks; return this rank's master contributions."""
        from ultraep.kernels import pack_grad_sends, reduce_received

        gs, lay = self.grad_schedule, self.grad_layout
        sends = pack_grad_sends(gs, {s: g for s, g in wgrads.items() if s in gs.slot_E.values()}, lay)
        arena = lay.empty(gs.arena_tiles, device=self.layer.master_params()[0].device)
        P = lay.tiles_per_expert
        recvs = [(m.peer, arena[m.first_tile:m.first_tile + len(m.experts) * P]) for m in gs.recvs]
        msgs = [(m.peer, buf) for m, buf in sends]
        with self.layer._collective("replica gradient reduction", _peers(msgs, recvs)):
            exchange(msgs, recvs, self.layer.runtime.group)
        if not gs.contributions:
            return None
        full = [torch.zeros_like(p) for p in self.layer.master_params()]
        first = self.layer.first_expert
        reduce_received(gs, arena, {e: [f[e - first] for f in full] for e in gs.contributions}, lay)
        return full


def _with_all_transfers(plan):
    import dataclasses

    from ultraep.plan import Transfers
    from ultraep.policies.transfers import RELAY_MODES, schedule_transfers

    t = plan.topology
    cols = schedule_transfers(t.home_E, plan.replicas.ptr, plan.replicas.rank, t.expert_bytes, t.num_ranks, t.D,
                              RELAY_MODES["auto"])
    return dataclasses.replace(plan, transfers=Transfers(*cols))


class _ReplicaExperts(torch.autograd.Function):
    """Replica slots of one layer: weight sync + compute forward; restore + recompute + grad reduce backward."""

    @staticmethod
    def forward(ctx, x_rep, job: ReplicaJob, *master_params):
        job.sync_weights()
        ctx.job = job
        ctx.generation = job.generation
        ctx.save_for_backward(x_rep)
        with torch.no_grad():
            return job.compute(x_rep)

    @staticmethod
    def backward(ctx, grad):
        job: ReplicaJob = ctx.job
        (x_rep,) = ctx.saved_tensors
        t0 = time.perf_counter()
        if job.buffers.generation != ctx.generation:  # a later layer reused the shared buffers
            job.sync_weights()
            job.buffers.restorations += 1
        gx, wgrads = job.backward(x_rep, grad.contiguous())
        master = job.reduce_grads(wgrads)
        job.layer.runtime.note_backward(job.layer.layer, time.perf_counter() - t0)
        grads = master if master is not None else [None] * len(job.layer.adapter.param_names)
        return (gx, None, *grads)


class BalancedExperts(nn.Module):
    """Drop-in replacement of an experts container: same call, balanced expert-parallel execution.

    Holds only this rank's master weights (``[M, ...]`` slices of the original ``[E, ...]`` parameters,
    under the original parameter names), so optimizer state exists only for masters.
    """

    def __init__(self, container: nn.Module, adapter: "ExpertsAdapter", layer: int, name: str,
                 runtime: "EPRuntime") -> None:
        super().__init__()
        from ultraep.policies import make_policy
        from ultraep.topology import Topology

        self.adapter = adapter
        self.layer = layer
        self.name = name
        object.__setattr__(self, "runtime", runtime)  # not a submodule
        object.__setattr__(self, "container", container)  # keeps activation, flags; no parameters
        E = adapter.num_experts(container)
        R, r = runtime.world_size, runtime.rank
        cfg = runtime.config
        like = [getattr(container, n)[0] for n in adapter.param_names]
        self.topology = Topology(
            num_ranks=R, num_experts=E, num_redundant_slots=cfg.slots_for(layer), domain_size=cfg.domain_size,
            expert_bytes=int(sum(t.numel() * t.element_size() for t in like)),
        )
        M = self.topology.num_masters
        self.first_expert = r * M
        for n in adapter.param_names:
            full = getattr(container, n)
            self.register_parameter(n, nn.Parameter(full.detach()[r * M:(r + 1) * M].clone(),
                                                    requires_grad=full.requires_grad))
            # Free the full tensor; unwrap() gathers the masters back.
            setattr(container, n, nn.Parameter(torch.empty(0, dtype=full.dtype, device=full.device),
                                               requires_grad=False))
        opts = cfg.layer_options(layer)
        self.policy_name = opts.kind
        self.policy = make_policy(opts.kind, **opts.policy_options())
        self.last_plan = None
        self.calibrator = None
        if hasattr(self.policy, "cost_model"):  # adaptive: a cost model of this machine, calibrated as we go
            self.calibrator = self._local_calibrator(like)

    def _local_calibrator(self, like: list[torch.Tensor]):
        """A cost model seeded with rough CPU/gloo figures; measured timings correct it every microbatch."""
        from ultraep.cost import Calibrator, CostModel
        from ultraep.presets import ExpertSpec, HardwareSpec
        from ultraep.topology import LinkSpec

        H = int(min(min(t.shape) for t in like if t.dim() == 2))
        weights = sum(t.numel() for t in like if t.dim() == 2)
        size = like[0].element_size()
        expert = ExpertSpec(hidden_size=H, ffn_size=max(1, weights // (3 * H)), num_matrices=3, weight_bytes=size,
                            activation_bytes=size)
        cuda = like[0].is_cuda
        hw = HardwareSpec(name="local-gpu" if cuda else "local-cpu", gemm_tflops=100.0 if cuda else 0.05)
        link = LinkSpec(bandwidth_GBps=100.0 if cuda else 2.0, latency_us=10.0 if cuda else 100.0)
        topo = self.topology.model_copy(update={"scale_up": link, "scale_out": link})
        cm = CostModel(topo, hw, expert)
        self.policy.cost_model = cm
        return Calibrator(cm, recorder=self.runtime.recorder)

    def _calibrate(self, plan, timings: dict[str, float]) -> None:
        cal = self.calibrator
        predicted = cal.model.predict(plan)
        cal.observe(predicted, {"compute_fwd_s": timings["experts_s"],
                                "a2a_fwd_s": timings["dispatch_s"] + timings["combine_s"],
                                "weight_sync_s": timings["transfer_s"], "plan_s": timings["plan_s"]},
                    step=self.runtime.step, microbatch=max(self.runtime.microbatch, 0), layer=self.layer)
        self.policy.cost_model = cal.model
        timings["predicted_s"] = predicted.fwd_s if hasattr(predicted, "fwd_s") else predicted.total_s

    def master_params(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.adapter.param_names]

    def extra_repr(self) -> str:
        t = self.topology
        return (f"layer={self.layer}, policy={self.policy_name}, experts={t.num_experts}, "
                f"masters={self.first_expert}..{self.first_expert + t.num_masters - 1}, slots={t.num_slots}")

    @contextmanager
    def _collective(self, phase: str, peers: list[int] | None = None):
        """Around one collective: a backend failure (peer died, timeout) flushes this rank's telemetry and
        becomes :class:`RankFailureError` naming the layer, the phase and the peers."""
        try:
            yield
        except (RankFailureError, PlanDivergenceError):
            raise
        except RuntimeError as exc:
            rt = self.runtime
            flushed = rt.recorder is not None
            if flushed:
                rt._safe(rt.recorder.flush)
            if peers is None:
                peers = [r for r in range(rt.world_size) if r != rt.rank]
            text = str(exc).strip()
            cause = text.splitlines()[0] if text else type(exc).__name__
            raise RankFailureError(
                f"layer {self.layer} ({self.name}): {phase} failed on rank {rt.rank} of {rt.world_size} at step "
                f"{rt.step} while exchanging with rank(s) {peers}: a peer died or did not answer within the "
                f"process group timeout ({type(exc).__name__}: {cause}). {'Telemetry was flushed; ' if flushed else ''}"
                "stop every rank and restart from the last checkpoint.",
                layer=self.layer, name=self.name, phase=phase, rank=rt.rank, peers=list(peers), step=rt.step,
            ) from exc

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from ultraep.kernels import dispatch_layout, permute, reroute, reroute_table, unpermute

        rt = self.runtime
        t = self.topology
        R, me, S, M, E = t.num_ranks, rt.rank, t.num_slots, t.num_masters, t.num_experts
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        rt.enter_layer(self.layer)
        # Step 1: exact load.
        counts = torch.bincount(top_k_index.reshape(-1).to(torch.int64), minlength=E)
        with self._collective("load all-gather"):
            load = gather_load(counts, rt.group)
        t1 = time.perf_counter()
        # Step 2: plan (identical on every rank) and commit.
        plan = self.policy.plan(load, t)
        self.policy.commit(plan)
        if rt.config.check_plan_hash:
            with self._collective("plan-hash all-gather"):
                digests = all_gather_bytes(plan.digest().encode(), rt.group)
            if len(set(digests)) != 1:
                bad = [r for r, d in enumerate(digests) if d != digests[0]]
                raise PlanDivergenceError(
                    f"layer {self.layer} ({self.name}): ranks {bad} computed a different plan than rank 0 "
                    f"(digests {[d.decode() for d in digests]}); refusing to exchange tokens"
                )
        self.last_plan = plan
        t2 = time.perf_counter()
        # Step 3: reroute and order pairs by destination.
        phys = reroute(top_k_index, reroute_table(plan, me, device=top_k_index.device))
        lay = dispatch_layout(phys, R, S, num_rows=int(plan.routes_RRS[me].sum()))
        send = permute(hidden_states, lay)
        in_splits = lay.input_split_sizes()
        C = plan.routes_RRS[:, me, :]  # [R, S] rows each source sends to each of my slots
        out_splits = [int(c) for c in C.sum(axis=1)]
        t3 = time.perf_counter()
        # Step 4: dispatch.
        with self._collective("token dispatch (all-to-all)"):
            recv = AllToAll.apply(send, out_splits, in_splits, rt.group,
                                  lambda: self._collective("token dispatch gradient (all-to-all)"))
        t4 = time.perf_counter()
        # Step 5: experts on masters and replicas.
        y_recv, job = self._experts(recv, C, plan)
        t5 = time.perf_counter()
        # Step 6: return rows and combine.
        with self._collective("token combine (all-to-all)"):
            y_send = AllToAll.apply(y_recv, in_splits, out_splits, rt.group,
                                    lambda: self._collective("token combine gradient (all-to-all)"))
        out = unpermute(y_send, top_k_weights.to(y_send.dtype), lay)
        t6 = time.perf_counter()
        replica_s = job.seconds if job is not None else 0.0
        timings.update(load_s=t1 - t0, plan_s=t2 - t1, reroute_s=t3 - t2, dispatch_s=t4 - t3,
                       transfer_s=replica_s, experts_s=t5 - t4 - replica_s, combine_s=t6 - t5, measured_s=t6 - t0)
        if self.calibrator is not None:
            rt._safe(self._calibrate, plan, timings)
        rt.record_layer(self, plan, timings, job)
        return out.to(hidden_states.dtype)

    def _experts(self, recv: torch.Tensor, C: np.ndarray, plan) -> tuple[torch.Tensor, Any]:
        t = plan.topology
        M, S = t.num_masters, t.num_slots
        counts_S = C.sum(axis=0)
        # rows arrive source-major, slot-minor: sort them by slot (stable) to run each slot on one chunk
        slot_of_row = np.repeat(np.tile(np.arange(S), C.shape[0]), C.ravel())
        order = torch.as_tensor(np.argsort(slot_of_row, kind="stable"), device=recv.device)
        x = recv.index_select(0, order)
        outs, at = [], 0
        params = self.master_params()
        for s in range(M):
            c = int(counts_S[s])
            if c:
                outs.append(self.adapter.forward(self.container, x[at:at + c], [p[s] for p in params]))
            at += c
        job = None
        if plan.num_replicas:  # the same on every rank: plans are identical
            job = ReplicaJob(self, plan, counts_S)
            outs.append(_ReplicaExperts.apply(x[at:], job, *params))
        y_sorted = torch.cat(outs) if outs else x[:0]
        if not counts_S[:M].any() and torch.is_grad_enabled():
            # No row reached this rank's masters: tie them into the graph with a zero term so they still get a
            # (zero) gradient, as the unbalanced model's full parameters do, and optimizers treat them alike.
            y_sorted = y_sorted + sum((p.reshape(-1)[:1] * 0).sum() for p in params).to(y_sorted.dtype)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted.index_select(0, inv), job
