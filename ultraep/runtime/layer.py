"""The balanced expert-parallel layer: what runs in place of a model's experts container.

Legend: T tokens of this rank, K top-k, H hidden, E experts, R ranks, M masters per rank, N redundant slots,
S = M + N slots, J tensors per expert, Nr rows this rank receives, P tiles per expert.

Forward, per MoE layer and microbatch (docs/design.md, How data flows):

    Step 1: local per-expert counts → all-gather → exact load λ[R, E] on every rank.
    Step 2: the layer's policy plans from λ (deterministic: every rank computes the same plan; with
            ``check_plan_hash`` the ranks compare digests and stop on divergence) and commits it.
    Step 3: post the replica weight sync (receives and stage-0 sends; :mod:`ultraep.runtime.replicas`): it travels
            while the tokens are dispatched and the masters compute.
    Step 4: reroute logical top-k ids to physical instances; order (token, k) pairs by destination slot.
    Step 5: all-to-all the token rows (split sizes straight from the plan's routes); relays forward weights.
    Step 6: experts: master slots with the local parameters (plain autograd), then the replica slots
            (:class:`~ultraep.runtime.replicas.ReplicaExperts`), which wait for their weights only now.
    Step 7: reverse all-to-all, then combine with the routing weights.

Backward: gradients flow back through combine, the all-to-alls and the master experts by autograd. The
replica slots run their backward first, from the graph kept in forward (or restore + recompute beyond the
replica memory budget), and post each replica's weight gradient (fp32 tiles) to its master's rank without
waiting; :class:`~ultraep.runtime.replicas.GradSink`, right before the dispatch all-to-all's backward, waits for them
and adds them to the masters' gradients in rank order (deterministic): each master's gradient equals the
unbalanced model's.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ultraep.plan.transfers import transfers_for
from ultraep.runtime import phases
from ultraep.runtime.clock import clamp0, clock_for
from ultraep.runtime.recompute import RecomputeAnchor, Replay as _Replay, Replays
from ultraep.runtime.comm import AllToAll, all_gather_bytes, gather_load
from ultraep.errors import CollectiveFailedError, PendingGradientsError, PlanDivergenceError
from ultraep.runtime.replica_cache import MasterEpoch
from ultraep.runtime.replica_store import ReplicaMemory, ReplicaStore
from ultraep.runtime.replicas import DeferredGrads, GradSink, ReplicaContext, ReplicaExperts, ReplicaJob
from ultraep.timings import TERMS

if TYPE_CHECKING:  # pragma: no cover
    from ultraep.models.adapters import ExpertsAdapter
    from ultraep.runtime.wrap import EPRuntime


#: the name this error had before it joined the UltraEPError hierarchy (kept for ``except`` clauses)
RankFailureError = CollectiveFailedError


#: fields of the load all-gather before the measured phases: ids above the sentinel, "measured the last call",
#: master epoch (replica cache), "replica cache buffers free"
_HEAD = 4
#: the cost model's terms recorded next to their measurement: the one set of phase names
PREDICTED = TERMS


class BalancedExperts(nn.Module):
    """Drop-in replacement of an experts container: same call, balanced expert-parallel execution.

    Holds only this rank's master weights (``[M, ...]`` slices of the original ``[E, ...]`` parameters,
    under the original parameter names), so optimizer state exists only for masters.
    """

    def __init__(self, container: nn.Module, adapter: "ExpertsAdapter", layer: int, name: str,
                 runtime: "EPRuntime", memory: ReplicaMemory) -> None:
        """``memory``: this layer's share of the replica memory budget (``replica_store.split_budget``, final)."""
        super().__init__()
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
        from ultraep.presets import local_seed

        # this machine's seed figures; the links go into the layer's topology, so the plans and the engine's
        # cost model of this layer share one topology (calibration then reaches every decision)
        _, self.expert_spec, link, _ = local_seed(like, like[0].is_cuda)
        self.topology = Topology(
            num_ranks=R, num_experts=E, num_redundant_slots=cfg.slots_for(layer), domain_size=cfg.domain_size,
            expert_bytes=int(sum(t.numel() * t.element_size() for t in like)), scale_up=link, scale_out=link,
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
        for n in adapter.shared:  # shared (non-expert) submodules, e.g. a post-expert norm: replicated on every
            self.add_module(n, getattr(container, n))  # rank like data-parallel ones, saved/trained under their key
        self.policy_name = cfg.layer_options(layer).kind
        self.last_plan = None
        #: the layer's replica memory: own buffers or the shared ones, the replica cache, who holds them
        self.store = ReplicaStore(memory, self.topology.home_E, runtime.shared_slots)
        #: what the layer's replica jobs see of it and of the runtime (they hold neither)
        self.replica_context = ReplicaContext(
            rank=r, transfer_group=runtime.transfer_group, guard=self.collective,
            expert_forward=partial(adapter.forward, container), master_params=self.master_params,
            first_expert=self.first_expert, event=partial(runtime.event, layer=layer), transport=cfg.replica_transport)
        self.epoch = MasterEpoch()
        #: replica gradients of calls under ``runtime.no_sync()``, reduced by the next backward outside it
        self.deferred = DeferredGrads()
        self._record = None
        #: this layer's calls an activation-checkpoint recompute may replay (runtime/recompute.py)
        self.replays = Replays()
        for p in self.master_params():  # masters follow the data-parallel wrapper's averaging (master_grads)
            if p.requires_grad:
                p.register_hook(self._scale_master_grad)
        self._observation: tuple[int, int, np.ndarray] | None = None  # last complete call: (step, mb, phases)
        #: this rank's measured phases of the last recorded call (the ``timings`` keys, seconds)
        self.last_timings: dict[str, float] = {}

    def _scale_master_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        s = self.runtime.master_grad_scale
        return None if s == 1.0 else grad * s

    @property
    def policy(self):
        """This layer's policy instance (owned by the runtime's engine)."""
        return self.runtime.engine.policy_for(self.layer)

    def master_params(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.adapter.param_names]

    def shared_params(self) -> list[torch.Tensor]:
        """Parameters of the container's shared submodules (``adapter.shared``): every rank's rows add to them."""
        return [p for n in self.adapter.shared for p in getattr(self, n).parameters()]

    def extra_repr(self) -> str:
        t = self.topology
        return (f"layer={self.layer}, policy={self.policy_name}, experts={t.num_experts}, "
                f"masters={self.first_expert}..{self.first_expert + t.num_masters - 1}, slots={t.num_slots}")

    @contextmanager
    def _timed(self, clock, marks: dict, key: str, phase: str):
        """:meth:`collective` that also notes the seconds it took under ``marks[key]`` (backward all-to-alls)."""
        t0 = clock.now()
        with self.collective(phase):
            yield
        marks[key] = marks.get(key, 0.0) + (clock.now() - t0)

    @contextmanager
    def collective(self, phase: str, peers: list[int] | None = None):
        """Around one collective: a backend failure (peer died, timeout) flushes this rank's telemetry and
        becomes :class:`~ultraep.errors.CollectiveFailedError` naming the layer, the phase and the peers.
        Public: the layer's replica jobs (``replicas.py``) run their point-to-point exchanges under it too."""
        try:
            yield
        except (CollectiveFailedError, PlanDivergenceError):
            raise
        except RuntimeError as exc:
            rt = self.runtime
            flushed = rt.recorder is not None
            if flushed:
                rt.flush_records()
                rt.safe(rt.recorder.flush)
            if peers is None:
                peers = [r for r in range(rt.world_size) if r != rt.rank]
            text = str(exc).strip()
            cause = text.splitlines()[0] if text else type(exc).__name__
            raise CollectiveFailedError(
                f"layer {self.layer} ({self.name}): {phase} failed on rank {rt.rank} of {rt.world_size} at step "
                f"{rt.step} while exchanging with rank(s) {peers}: a peer died or did not answer within the "
                f"process group timeout ({type(exc).__name__}: {cause}). {'Telemetry was flushed; ' if flushed else ''}"
                "stop every rank and restart from the last checkpoint.",
                layer=self.layer, name=self.name, phase=phase, rank=rt.rank, peers=list(peers), step=rt.step,
            ) from exc

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``[T, H]``, ``[T, K]`` ids, ``[T, K]`` weights → ``[T, H]``, as the experts container computes it.

        A slot whose id is ``num_experts`` is dropped (the experts interface's sentinel: transformers' own
        expert parallelism, capacity dropping, zero-computation experts rewritten to it): it contributes
        nothing and gets no gradient. Such calls run the kept (token, slot) pairs as one-slot rows and add
        them back per token — exact, and the dropped slots are neither load nor compute anywhere."""
        E = self.topology.num_experts
        dropped = top_k_index == E
        if not bool(dropped.any()):
            return self._balanced(hidden_states, top_k_index, top_k_weights)
        tok, slot = (~dropped).nonzero(as_tuple=True)
        y = self._balanced(hidden_states.index_select(0, tok), top_k_index[tok, slot].unsqueeze(1),
                           top_k_weights[tok, slot].unsqueeze(1))
        return torch.zeros_like(hidden_states).index_add(0, tok, y)

    def _balanced(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # The collectives of one call, in the order every rank issues them (Steps 1-7 of the module docstring):
        #   load all-gather → [plan-hash all-gather] → replica weight posts → dispatch all-to-all → relay posts
        #   → replica weight wait → combine all-to-all.
        # The order is the protocol: each depends only on the plan (identical on every rank), so every rank
        # issues the same collectives in the same order; the weights are posted before the dispatch so they
        # travel while the tokens do, and waited for only right before the replicas compute.
        if torch._C._current_graph_task_id() != -1:  # a forward inside a backward: an activation recompute
            return self._recompute(hidden_states, top_k_index, top_k_weights)
        rt = self.runtime
        if self._record is not None and self._record.clock.ready():
            self.flush_record()  # the previous call's record, if its backward never came
        clk = clock_for(hidden_states)  # CUDA events on CUDA, read when the call is recorded
        t0 = clk.now()
        rt.enter_layer(self.layer)
        load, extra, obs = self._gather_load(top_k_index)  # Step 1 (collective)
        t1 = clk.now()
        decision, epoch_R, cached = self._decide(load, extra, obs)  # Step 2 (plan-hash all-gather if asked)
        t2 = clk.now()
        rt.event("planned", self.layer)
        needs_backward = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            p.requires_grad for p in self.master_params() + self.shared_params()))
        job, plan, hits = self._start_replicas(decision.plan, epoch_R, cached, needs_backward, clk)  # Step 3 (posts)
        self.last_plan = plan
        t3 = clk.now()
        replay = _Replay(plan, job, needs_backward, epoch_R) if self.training else None
        if replay is not None:  # an activation-checkpoint recompute of this call replays it (plan, routes, replicas)
            self.replays.keep(replay)
        marks: dict[str, float] = {}  # backward timings of this call, filled by hooks and the all-to-alls
        out, send, ts, master_s = self._route(hidden_states, top_k_index, top_k_weights, plan, job,  # Steps 4-7
                                              needs_backward, marks, clk)
        t4, t5, t6, t7 = ts
        timings = self._forward_timings(job, (t0, t1, t2, t3, t4, t5, t6, t7), master_s, decision.predicted)
        # expert activations this rank holds for the call (rows it computes x the expert's activation width), without
        # and with balancing: the third cost of imbalance (telemetry.queries.ACTIVATION_MEMORY)
        row_bytes = float(self.expert_spec.activation_row_bytes)
        timings.update(activation_bytes_before=float(plan.rank_load_before_R[rt.rank]) * row_bytes,
                       activation_bytes_after=float(plan.rank_load_after_R[rt.rank]) * row_bytes)
        if cached:  # this rank's replicas of this call: found resident, streamed, and the bytes not received
            mine = int((plan.replicas.rank == rt.rank).sum())
            timings.update(cache_hits=float(hits), cache_misses=float(mine - hits),
                           cache_bytes_saved=float(hits * self.topology.expert_bytes))
        key = (rt.step, max(rt.microbatch, 0))
        self._record = _LayerCall(plan, timings, job, t7, key, needs_backward, decision, marks, clk, replay=replay)
        if needs_backward and out.requires_grad:
            self._hook_backward(out, send, self._record)
        else:
            self.flush_record()
        return out.to(hidden_states.dtype)

    def _gather_load(self, top_k_index: torch.Tensor):
        """Step 1: this rank's per-expert counts → the exact load ``[R, E]`` on every rank, with each rank's
        header (``[R, _HEAD]``: ids above the sentinel, measured flag, master epoch, cache buffers free) and its
        measured phases of this layer's last complete call; returns (load, extra, the observation sent)."""
        rt, t = self.runtime, self.topology
        E = t.num_experts
        counts = torch.bincount(top_k_index.reshape(-1).to(torch.int64), minlength=E)
        obs, self._observation = self._observation, None
        K = len(phases.RANK_PHASES)
        mine = torch.zeros(_HEAD + K, dtype=torch.int64)
        mine[2] = self.epoch.current(self.master_params())  # the replica cache's master epoch of this rank
        mine[3] = int(self.store.cache_usable())  # its cache buffers are free to use
        if obs is not None:
            mine[1] = 1
            mine[_HEAD:] = torch.as_tensor(np.round(obs[2] * 1e9).astype(np.int64))
        vec = torch.cat([counts[:E], mine.to(counts.device)])
        vec[E] = counts[E:].sum()  # ids beyond the sentinel (every rank refuses together), summed on the device
        with self.collective("load all-gather"):  # the layer call's one host synchronisation
            gathered = gather_load(vec, rt.group)
        self.flush_record()  # (CUDA: the previous call's events completed, the all-gather synchronised)
        load, extra = gathered[:, :E], gathered[:, E:]
        if extra[:, 0].any():
            from ultraep.models.adapters import UnsupportedModelError

            bad = [r for r in range(t.num_ranks) if extra[r, 0]]
            raise UnsupportedModelError(
                f"{self.name}.top_k_index", f"rank(s) {bad} routed {int(extra[:, 0].sum())} slot(s) to expert ids "
                f"above {E}: ids must be < num_experts = {E}, or {E} for a dropped slot", E)
        return load, extra, obs

    def _decide(self, load: np.ndarray, extra: np.ndarray, obs):
        """Step 2: calibrate from every rank's last measured call, plan from ``load`` (identical on every rank:
        the residency table is too) and commit; returns (decision, every rank's master epoch, cached)."""
        rt, t = self.runtime, self.topology
        R, E = t.num_ranks, t.num_experts
        eng = rt.engine
        if obs is not None and extra[:, 1].all():  # every rank measured the same call: calibrate identically
            measured, total = phases.reduce_phases(extra[:, _HEAD:].astype(np.float64) * 1e-9)
            rt.safe(eng.observe, obs[0], obs[1], self.layer, measured, total)
        epoch_R = extra[:, 2]
        if self.deferred and not np.array_equal(epoch_R, self.deferred.epoch_R):
            ranks = [r for r in range(R) if epoch_R[r] != self.deferred.epoch_R[r]]
            pairs, _ = self.deferred.take()  # every rank refuses together (the epochs are all-gathered)
            raise PendingGradientsError(
                self.name, f"the gradients of {len(pairs)} replica(s) accumulated under no_sync() were never "
                f"reduced to their masters: the masters of rank(s) {ranks} changed (an optimizer step or a weight "
                "load) first. Run the last microbatch of each step, forward and backward, outside no_sync() "
                "(as with DDP).", ranks)
        cached = self.store.cache is not None and bool(extra[:, 3].all())
        resident = self.store.resident(cached, epoch_R, R, E)  # (the cache forgets when some rank cannot use it)
        decision = eng.decide(rt.step, max(rt.microbatch, 0), self.layer, load, resident)
        eng.commit(decision)
        if rt.config.check_plan_hash:
            with self.collective("plan-hash all-gather"):
                digests = all_gather_bytes(decision.plan.digest().encode(), rt.group)
            if len(set(digests)) != 1:
                bad = [r for r, d in enumerate(digests) if d != digests[0]]
                raise PlanDivergenceError(
                    f"layer {self.layer} ({self.name}): ranks {bad} computed a different plan than rank 0 "
                    f"(digests {[d.decode() for d in digests]}); refusing to exchange tokens"
                )
        return decision, epoch_R, cached

    def _start_replicas(self, plan, epoch_R, cached: bool, needs_backward: bool, clk):
        """Step 3: the replica job of ``plan`` (or None), its weight sync posted (the same on every rank: plans
        are identical); returns (job, the plan with what actually moves, replicas found resident)."""
        rt, t = self.runtime, self.topology
        job, hits = None, 0
        # Replica gradients: reduced now, deferred (under no_sync, while every rank's pending experts fit in
        # 2N sums), or reduced together with the deferred ones — decided from the plans alone: the same everywhere
        grads = "reduce"
        if needs_backward and not rt.grad_sync:
            if plan.num_replicas:
                grads = "defer" if self.deferred.fits(plan, 2 * t.num_redundant_slots) else "flush"
        elif needs_backward and self.deferred:
            grads = "flush"  # (a call without replicas still runs a job: it only reduces the pending gradients)
        if plan.num_replicas or grads == "flush":
            like = [p[0].detach() for p in self.master_params()]
            slots, hits = self.store.slots(plan, epoch_R, like, cached, rt.rank, t.expert_bytes)
            job = ReplicaJob(self.replica_context, plan, slots, grads, self.deferred, clock=clk)
            if grads == "defer":
                self.deferred.add_plan(plan, epoch_R)
            job.needs_backward = needs_backward
            if job.kept and needs_backward:
                self.store.hold(job)
            job.post_weights()
            plan = job.plan  # with a transfer for every replica: what actually moves
        return job, plan, hits

    def _route(self, hidden_states, top_k_index, top_k_weights, plan, job, needs_backward: bool,
               marks: dict, clk, replay: "_Replay | None" = None):
        """Steps 4-7 of ``plan``: reroute, dispatch, experts (masters, then replicas), combine. ``replay``: the
        call is an activation-checkpoint recompute whose original graph runs the backward (only the tensors it
        saves are recomputed: no relay, no gradient sink, replicas computed from the weights already here).
        Returns (output ``[T, H]``, the dispatched rows, (t4, t5, t6, t7), the masters' seconds)."""
        from ultraep.kernels import dispatch_layout, permute, reroute, reroute_table, unpermute

        rt = self.runtime
        R, S, me = self.topology.num_ranks, self.topology.num_slots, rt.rank
        phys = reroute(top_k_index, reroute_table(plan, me, device=top_k_index.device))
        lay = dispatch_layout(phys, R, S, num_rows=int(plan.routes_RRS[me].sum()))
        send = permute(hidden_states, lay)
        in_splits = [int(c) for c in plan.routes_RRS[me].sum(axis=1)]  # = the layout's, without a host sync
        C = plan.routes_RRS[:, me, :]  # [R, S] rows each source sends to each of my slots
        out_splits = [int(c) for c in C.sum(axis=1)]
        t4 = clk.now()
        # Step 5: dispatch; relays forward the weights they received.
        with self.collective("token dispatch (all-to-all)"):
            recv = AllToAll.apply(send, out_splits, in_splits, rt.group, lambda: self._timed(
                clk, marks, "dispatch_bwd_s", "token dispatch gradient (all-to-all)"))
        rt.event("dispatched", self.layer)
        t5 = clk.now()
        # per-expert views of the masters (one stacking backward instead of a full-size zero fill per slot)
        unbound = [p.unbind(0) for p in self.master_params()]
        if job is not None and replay is None:
            job.relay()
            if needs_backward:
                first = self.first_expert
                recv = GradSink.apply(recv, job, *[u[e - first] for e in job.contributing() for u in unbound])
        # Step 6: experts on masters, then replicas.
        y_recv, master_s = self._experts(recv, C, plan, job, unbound, clk, replay)
        t6 = clk.now()
        # Step 7: return rows and combine.
        with self.collective("token combine (all-to-all)"):
            y_send = AllToAll.apply(y_recv, in_splits, out_splits, rt.group, lambda: self._timed(
                clk, marks, "combine_bwd_s", "token combine gradient (all-to-all)"))
        out = unpermute(y_send, top_k_weights.to(y_send.dtype), lay)
        if needs_backward and out.requires_grad:  # a checkpoint's recompute starts here on every rank
            out = RecomputeAnchor.apply(out, out.new_empty(0))
        rt.event("combined", self.layer)
        if job is not None and replay is None:
            job.finish_sends()
        return out, send, (t4, t5, t6, clk.now()), master_s

    def _forward_timings(self, job, ts: tuple, master_s, pred) -> dict:
        """This rank's measured forward phases of one call (``ts``: t0..t7 of the steps) and the prediction."""
        t0, t1, t2, t3, t4, t5, t6, t7 = ts
        ph = job.phases if job is not None else {}
        weight_s = ph.get("weight_post_s", 0.0) + ph.get("relay_s", 0.0) + ph.get("weight_wait_s", 0.0)
        replica_s = ph.get("replica_compute_s", 0.0)
        timings = dict(
            load_s=t1 - t0, plan_s=t2 - t1, reroute_s=t4 - t3, dispatch_s=t5 - t4,
            master_compute_s=master_s, replica_compute_s=replica_s, experts_s=master_s + replica_s,
            transfer_s=weight_s, combine_s=t7 - t6, forward_s=t7 - t0, measured_s=t7 - t0,
        )
        if job is not None:
            for k in ("weight_post_s", "relay_s", "weight_wait_s"):
                timings[k] = ph.get(k, 0.0)
            flight = ph.get("weight_sync_flight_s", 0.0)
            timings["weight_sync_flight_s"] = flight
            timings["weight_unpack_s"] = ph.get("weight_unpack_s", 0.0)
            timings["weight_sync_hidden_s"] = clamp0(flight - ph.get("weight_wait_s", 0.0))
            timings["replica_kept"] = 1.0 if job.kept else 0.0
            timings["transfer_bytes"] = float(job.bytes_sent)
        timings["predicted_s"] = pred.total_s
        for k in PREDICTED:  # predicted next to measured, per term (the measured ones once the backward ran)
            timings[f"predicted.{k}"] = float(getattr(pred, k))
        return timings

    # ------------------------------------------------------------------ activation checkpointing
    def _recompute(self, hidden_states, top_k_index, top_k_weights):
        """The forward of an activation-checkpoint recompute: the original call's plan, routes and replicas, with
        no second load all-gather, plan or commit (docs/design.md, "Training as users train").

        * Non-reentrant checkpoint (``use_reentrant=False``, transformers' default): the original call's graph
          runs the backward; the recompute only reproduces the tensors it saved, in the same order. Its replicas
          compute from the weights the original job still holds (restored first if shared buffers were reused).
        * Reentrant checkpoint: the original call ran without grad; this recompute's own graph runs the backward,
          so it is a full forward of the original plan: its replica weights stream again (the original's buffers
          may have been reused since) and its gradients reduce as any call's."""
        rt = self.runtime
        call = self.replays.take(self.name)
        if call.had_grad:
            job = call.job
            if job is not None and job.lease.overwritten():
                job.restore_weights()  # a later layer reused the shared buffers (the backward would restore too)
            clk = job.clock if job is not None else clock_for(hidden_states)
            out, *_ = self._route(hidden_states, top_k_index, top_k_weights, call.plan, job, True, {}, clk, call)
            return out.to(hidden_states.dtype)
        needs_backward = torch.is_grad_enabled()
        plan = transfers_for(call.plan)  # every replica streams: nothing is known to be resident any more
        self.store.forget()  # and the streams overwrite the cache's buffers (on every rank alike)
        clk = clock_for(hidden_states)
        job, plan, _ = self._start_replicas(plan, call.epoch_R, False, needs_backward, clk)
        marks: dict = {}
        out, send, _, _ = self._route(hidden_states, top_k_index, top_k_weights, plan, job, needs_backward, marks,
                                      clk)
        if needs_backward and out.requires_grad:
            self._hook_backward(out, send, _LayerCall(plan, {}, job, clk.now(), (rt.step, 0), True, None, marks,
                                                      clk, recompute=True))
        return out.to(hidden_states.dtype)

    # ------------------------------------------------------------------ backward bookkeeping
    def _hook_backward(self, out, send, call: "_LayerCall") -> None:
        """Hooks at the layer's backward start and end (the gradient of the dispatched rows), for its timings.
        (The replica-gradient receives are posted with the sends, by the replicas' backward: docs/design.md.)"""

        def start(grad):
            call.marks["bwd_start"] = call.clock.now()

        out.register_hook(start)
        if send.requires_grad:
            send.register_hook(lambda grad: self._backward_end(call))

    def _backward_end(self, call: "_LayerCall") -> None:
        call.marks["bwd_end"] = call.clock.now()
        self.replays.drop(call.replay)  # its backward ran: no recompute needs this call any more
        if self._record is call and call.clock.ready():  # (CUDA: else at the next call, never a sync here)
            self.flush_record()

    def flush_record(self) -> None:
        """Record the pending call (forward phases, and backward phases if its backward ran)."""
        call, self._record = self._record, None
        if call is None:
            return
        read = call.clock.read  # device times become seconds here, never on the hot path
        t = {k: read(v) for k, v in call.timings.items()}
        m = {k: read(v) for k, v in call.marks.items()}
        if call.job is not None:
            ph = {k: read(v) for k, v in call.job.phases.items()}
            for k in ("restore_s", "recompute_s", "replica_backward_s", "grad_post_s", "grad_wait_s",
                      "grad_reduce_s"):
                if k in ph:
                    t[k] = ph[k]
            t["grad_bytes"] = float(call.job.grad_bytes_sent)  # replica gradients this rank sent (0: deferred)
            t["backward_reduce_s"] = sum(ph.get(k, 0.0) for k in ("restore_s", "grad_post_s", "grad_wait_s",
                                                                     "grad_reduce_s"))
        if "bwd_start" in m and "bwd_end" in m:
            # the layer's backward: its two all-to-alls (timed inside), the gradient sink and a restore (timed
            # by the job); everything else — expert backward, weight-gradient finalisation, (un)permute — is
            # this rank's backward compute
            t["backward_s"] = m["bwd_end"] - m["bwd_start"]
            t["measured_s"] = t["forward_s"] + t["backward_s"]  # the whole layer, as predicted_s
            t["combine_bwd_s"] = m.get("combine_bwd_s", 0.0)
            t["dispatch_bwd_s"] = m.get("dispatch_bwd_s", 0.0)
            sink = t.get("grad_wait_s", 0.0) + t.get("grad_reduce_s", 0.0)
            t["backward_compute_s"] = max(0.0, t["backward_s"] - t["combine_bwd_s"] - t["dispatch_bwd_s"] - sink
                                          - t.get("restore_s", 0.0))
        self.last_timings = t
        complete = "backward_s" in t or not call.needs_backward
        rank_ph = phases.rank_phases(t)
        mine, total = phases.reduce_phases(rank_ph[None, :])
        for k, v in {**mine, "total_s": total}.items():
            t[f"measured.{k}"] = v  # this rank's; the engine calibrates from every rank's (next call)
        if complete:  # sent with the next call's load: the engine calibrates from every rank's phases
            self._observation = (call.key[0], call.key[1], rank_ph)
        self.runtime.record_layer(self, call.plan, t, call.job, call.decision, call.key)

    def _experts(self, recv: torch.Tensor, C: np.ndarray, plan, job: ReplicaJob | None,
                 unbound: list, clk, replay: "_Replay | None" = None) -> tuple[torch.Tensor, float]:
        """Masters, then replicas, over the received rows; returns the outputs and the masters' seconds.
        ``replay``: an activation-checkpoint recompute (the replicas compute from the weights ``job`` holds)."""
        t = plan.topology
        M, S = t.num_masters, t.num_slots
        counts_S = C.sum(axis=0)
        # rows arrive source-major, slot-minor: sort them by slot (stable) to run each slot on one chunk
        slot_of_row = np.repeat(np.tile(np.arange(S), C.shape[0]), C.ravel())
        order = torch.as_tensor(np.argsort(slot_of_row, kind="stable"), device=recv.device)
        x = recv.index_select(0, order)
        t0 = clk.now()
        outs, at = [], 0
        params = self.master_params()
        for s in range(M):
            c = int(counts_S[s])
            if c:
                outs.append(self.adapter.forward(self.container, x[at:at + c], [u[s] for u in unbound]))
            at += c
        self.runtime.event("master_compute", self.layer)
        master_s = clk.now() - t0
        if job is not None:
            job.counts = [int(c) for c in counts_S[M:]]  # rows per replica slot, in slot order
            if replay is not None:
                outs.append(job.recompute(x[at:]))
            else:  # shared parameters ride along: the replica rows' gradient of e.g. a post-expert norm reaches them
                outs.append(ReplicaExperts.apply(x[at:], job, *params, *self.shared_params()))
        y_sorted = torch.cat(outs) if outs else x[:0]
        if not counts_S[:M].any() and torch.is_grad_enabled():
            # No row reached this rank's masters: tie them into the graph with a zero term so they still get a
            # (zero) gradient, as the unbalanced model's full parameters do, and optimizers treat them alike.
            y_sorted = y_sorted + sum((p.reshape(-1)[:1] * 0).sum()
                                      for p in params + self.shared_params()).to(y_sorted.dtype)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted.index_select(0, inv), master_s


class _LayerCall:
    """One forward of a layer waiting for its backward before it is recorded."""

    __slots__ = ("plan", "timings", "job", "marks", "key", "needs_backward", "decision", "clock", "recompute",
                 "replay")

    def __init__(self, plan, timings: dict, job: ReplicaJob | None, t_fwd_end, key: tuple[int, int],
                 needs_backward: bool, decision, marks: dict, clock, recompute: bool = False,
                 replay: "_Replay | None" = None) -> None:
        self.plan, self.timings, self.job, self.key = plan, timings, job, key
        self.clock = clock
        self.replay = replay
        self.recompute = recompute  # a reentrant checkpoint's recompute: its backward runs, it is not recorded
        self.needs_backward, self.decision = needs_backward, decision
        self.marks = marks
        self.marks["fwd_end"] = t_fwd_end
