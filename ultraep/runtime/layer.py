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

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ultraep.runtime import phases
from ultraep.runtime.call_record import CallLog, LayerCall
from ultraep.runtime.call_timings import forward_timings
from ultraep.runtime.clock import clock_for
from ultraep.runtime.guard import CollectiveGuard
from ultraep.runtime.checkpoint_replay import recompute_forward
from ultraep.runtime.recompute import Replay, Replays
from ultraep.runtime.recording import Recording
from ultraep.runtime.comm import check_same_plan, gather_load
from ultraep.errors import PendingGradientsError
from ultraep.runtime.load_header import GatheredLoad, LoadHeader, expert_counts, pack_load
from ultraep.runtime.masters import MasterState, layer_topology, take_masters
from ultraep.runtime.replica_cache import MasterEpoch
from ultraep.runtime.replica_store import ReplicaMemory, ReplicaStore
from ultraep.runtime.replicas import DeferredGrads, ReplicaContext, ReplicaJob
from ultraep.runtime.token_path import route_tokens, run_slots

if TYPE_CHECKING:  # pragma: no cover
    from ultraep.models.adapters import ExpertsAdapter


class BalancedExperts(nn.Module):
    """Drop-in replacement of an experts container: same call, balanced expert-parallel execution.

    Holds only this rank's master weights (``[M, ...]`` slices of the original ``[E, ...]`` parameters,
    under the original parameter names), so optimizer state exists only for masters.
    """

    def __init__(self, container: nn.Module, adapter: "ExpertsAdapter", layer: int, name: str,
                 runtime, memory: ReplicaMemory) -> None:
        """``runtime``: the model's :class:`~ultraep.runtime.wrap.EPRuntime` (groups, config, engine, step counters;
        the layer never imports it: the runtime builds the layers); ``memory``: this layer's share of the replica
        memory budget (``replica_store.split_budget``, final)."""
        super().__init__()
        self.adapter = adapter
        self.layer = layer
        self.name = name
        object.__setattr__(self, "runtime", runtime)  # not a submodule
        #: what the layer, its token path and its replica jobs record through
        self.recording: Recording = runtime.recording
        object.__setattr__(self, "container", container)  # keeps activation, flags; no parameters
        cfg = runtime.config
        like = [getattr(container, n)[0] for n in adapter.param_names]
        self.topology, self.expert_spec = layer_topology(like, adapter.num_experts(container), layer, cfg,
                                                         runtime.world_size, cuda=runtime.device.type == "cuda")
        self.first_expert = runtime.rank * self.topology.num_masters
        for n, p in take_masters(container, adapter.param_names, runtime.rank, self.topology.num_masters).items():
            self.register_parameter(n, p)
        for n in adapter.shared:  # shared (non-expert) submodules, e.g. a post-expert norm: replicated on every
            self.add_module(n, getattr(container, n))  # rank like data-parallel ones, saved/trained under their key
        #: ``with self.collective(phase, peers):`` around each collective (a failure names layer, phase, peers)
        self.collective = CollectiveGuard(runtime, layer, name)
        self.policy_name = cfg.layer_options(layer).kind
        self.last_plan = None
        #: the layer's replica memory: own buffers or the shared ones, the replica cache, who holds them
        self.store = ReplicaStore(memory, self.topology.home_E, runtime.shared_slots)
        #: what the layer's replica jobs see of it and of the runtime (they hold neither)
        self.replica_context = ReplicaContext(
            rank=runtime.rank, transfer_group=runtime.transfer_group, guard=self.collective,
            expert_forward=partial(adapter.forward, container), master_params=self.master_params,
            first_expert=self.first_expert, event=partial(self.recording.event, layer=layer),
            transport=cfg.replica_transport)
        self.epoch = MasterEpoch()
        #: replica gradients of calls under ``runtime.no_sync()``, reduced by the next backward outside it
        self.deferred = DeferredGrads()
        #: this layer's calls an activation-checkpoint recompute may replay (runtime/recompute.py)
        self.replays = Replays()
        #: the call waiting for its backward before it is recorded, and the phases sent with the next load
        self.calls = CallLog(lambda call, t, row: self.recording.record_layer(self.layer, call, t, row),
                             lambda call: self.replays.drop(call.replay))
        #: whether the masters hold weights (not while a meta model's are unloaded) and their gradient hook
        self.master_state = MasterState(name, self.master_params(), self._scale_master_grad)

    @property
    def last_timings(self) -> dict[str, float]:
        """This rank's record of the layer's last recorded call (``CallTimings.to_record()``: the ``timings`` keys,
        seconds)."""
        return self.calls.last_timings

    def flush_record(self) -> None:
        """Record the call still waiting for its backward (at a step's end, or on a failure)."""
        self.calls.flush()

    def _scale_master_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        s = self.runtime.master_grad_scale
        return None if s == 1.0 else grad * s

    @property
    def policy(self):
        """This layer's policy instance (owned by the runtime's engine)."""
        return self.runtime.engine.policy_for(self.layer)

    @property
    def num_experts(self) -> int:
        """E, as the container reports it (torchtitan's FSDP application reads ``inner_experts.num_experts``)."""
        return self.topology.num_experts

    def master_params(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.adapter.param_names]

    def shared_params(self) -> list[torch.Tensor]:
        """Parameters of the container's shared submodules (``adapter.shared``): every rank's rows add to them."""
        return [p for n in self.adapter.shared for p in getattr(self, n).parameters()]

    def extra_repr(self) -> str:
        t = self.topology
        return (f"layer={self.layer}, policy={self.policy_name}, experts={t.num_experts}, "
                f"masters={self.first_expert}..{self.first_expert + t.num_masters - 1}, slots={t.num_slots}")

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``[T, H]``, ``[T, K]`` ids, ``[T, K]`` weights → ``[T, H]``, as the experts container computes it.

        A slot whose id is ``num_experts`` is dropped (the experts interface's sentinel: transformers' own
        expert parallelism, capacity dropping, zero-computation experts rewritten to it): it contributes
        nothing and gets no gradient. The token path drops it where it stands, without asking the host
        whether there is one: it is no load (the counts leave it out), reroute maps it to no instance, it gets
        no send row, and the combine adds nothing for it (a zero weight gradient) — exact, and neither load
        nor compute anywhere."""
        self.master_state.check_loaded(self.master_params())
        return self._balanced(hidden_states, top_k_index, top_k_weights)

    def _balanced(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # The collectives of one call, in the order every rank issues them (Steps 1-7 of the module docstring):
        #   load all-gather → [plan-hash all-gather] → replica weight posts → dispatch all-to-all → relay posts
        #   → replica weight wait → combine all-to-all.
        # The order is the protocol: each depends only on the plan (identical on every rank), so every rank
        # issues the same collectives in the same order; the weights are posted before the dispatch so they
        # travel while the tokens do, and waited for only right before the replicas compute.
        if torch._C._current_graph_task_id() != -1:  # a forward inside a backward: an activation recompute
            return recompute_forward(self, hidden_states, top_k_index, top_k_weights)
        self.master_state.hook(self.master_params())
        rt = self.runtime
        if self.calls.ready():
            self.calls.flush()  # the previous call's record, if its backward never came
        clk = clock_for(hidden_states)  # CUDA events on CUDA, read when the call is recorded
        t0 = clk.now()
        rt.enter_layer(self.layer)
        gathered, obs = self._gather_load(top_k_index)  # Step 1: load all-gather
        self._calibrate(gathered, obs)  # (timed with the load step, not the planning: every policy pays it)
        t1 = clk.now()
        decision, cached = self._decide(gathered)  # Step 2: [plan-hash all-gather]
        t2 = clk.now()
        self.recording.event("planned", self.layer)
        needs_backward = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            p.requires_grad for p in self.master_params() + self.shared_params()))
        # Step 3: replica weight posts (point-to-point batch W0)
        job, plan, hits = self._start_replicas(decision.plan, gathered.epoch_R, cached, needs_backward, clk)
        self.last_plan = plan
        t3 = clk.now()
        replay = Replay(plan, job, needs_backward, gathered.epoch_R) if self.training else None
        if replay is not None:  # an activation-checkpoint recompute of this call replays it (plan, routes, replicas)
            self.replays.keep(replay)
        marks: dict[str, float] = {}  # backward timings of this call, filled by hooks and the all-to-alls
        # Steps 4-7: dispatch all-to-all, relay posts, replica weight wait, combine all-to-all
        out, send, ts, master_s = route_tokens(self, hidden_states, top_k_index, top_k_weights, plan, job,
                                               needs_backward, marks, clk)
        timings = forward_timings((t0, t1, t2, t3, *ts), master_s, job, decision.predicted, plan, rt.rank,
                                  float(self.expert_spec.activation_row_bytes))
        if cached:  # this rank's replicas of this call: found resident, streamed, and the bytes not received
            mine = int((plan.replicas.rank == rt.rank).sum())
            timings.cache_hits, timings.cache_misses = float(hits), float(mine - hits)
            timings.cache_bytes_saved = float(hits * self.topology.expert_bytes)
        key = (rt.step, max(rt.microbatch, 0))
        self.calls.open(LayerCall(plan, timings, job, key, needs_backward, decision, marks, clk, replay), out, send)
        return out.to(hidden_states.dtype)

    def _gather_load(self, top_k_index: torch.Tensor) -> tuple[GatheredLoad, tuple | None]:
        """Step 1: this rank's per-expert counts and :class:`~ultraep.runtime.load_header.LoadHeader` → every rank's
        load ``[R, E]`` and header on every rank; returns them and the observation this rank sent."""
        rt, E = self.runtime, self.topology.num_experts
        counts = expert_counts(top_k_index, E)
        obs = self.calls.take_observation()
        header = LoadHeader(phases_s=None if obs is None else obs[2],
                            master_epoch=self.epoch.current(self.master_params()),  # the replica cache's epoch
                            cache_free=self.store.cache_usable())
        with self.collective("load all-gather"):  # the layer call's one host synchronisation
            gathered = GatheredLoad.unpack(gather_load(pack_load(counts, E, header), rt.group), E)
        self.calls.flush()  # (CUDA: the previous call's events completed, the all-gather synchronised)
        if gathered.bad_ids:
            from ultraep.models.adapters import UnsupportedModelError

            raise UnsupportedModelError(
                f"{self.name}.top_k_index", f"rank(s) {gathered.bad_ranks} routed {gathered.bad_ids} slot(s) to expert "
                f"ids above {E} or below 0: ids must be in 0..{E - 1} (num_experts = {E}), or {E} for a dropped slot", E)
        return gathered, obs

    def _calibrate(self, gathered: GatheredLoad, obs) -> None:
        """Step 1b: calibrate from every rank's last measured call (identical on every rank: all hold every rank's
        phases)."""
        meas_RK = gathered.phases_RK()
        if obs is not None and meas_RK is not None:
            measured, total = phases.reduce_phases(meas_RK)
            measured.update(phases.compute_spread(meas_RK))
            self.recording.safe(self.runtime.engine.observe, obs[0], obs[1], self.layer, measured, total,
                              rank_compute_s=phases.rank_compute(meas_RK))

    def _decide(self, gathered: GatheredLoad):
        """Step 2: plan from the load (identical on every rank: the residency table is too) and commit; returns
        (decision, cached)."""
        rt, t = self.runtime, self.topology
        R, E = t.num_ranks, t.num_experts
        eng = rt.engine
        epoch_R = gathered.epoch_R
        if self.deferred and not np.array_equal(epoch_R, self.deferred.epoch_R):
            ranks = [r for r in range(R) if epoch_R[r] != self.deferred.epoch_R[r]]
            pairs, _ = self.deferred.take()  # every rank refuses together (the epochs are all-gathered)
            raise PendingGradientsError(
                self.name, f"the gradients of {len(pairs)} replica(s) accumulated under no_sync() were never "
                f"reduced to their masters: the masters of rank(s) {ranks} changed (an optimizer step or a weight "
                "load) first. Run the last microbatch of each step, forward and backward, outside no_sync() "
                "(as with DDP).", ranks)
        cached = self.store.cache is not None and gathered.cache_free
        resident = self.store.resident(cached, epoch_R, R, E)  # (the cache forgets when some rank cannot use it)
        decision = eng.decide(rt.step, max(rt.microbatch, 0), self.layer, gathered.load_RE, resident)
        eng.commit(decision)
        if rt.config.check_plan_hash:
            with self.collective("plan-hash all-gather"):
                check_same_plan(decision.plan, rt.group, f"layer {self.layer} ({self.name})")
        return decision, cached

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

    def _experts(self, recv: torch.Tensor, C: np.ndarray, plan, job: ReplicaJob | None,
                 unbound: list, clk, replay: "Replay | None" = None) -> tuple[torch.Tensor, float]:
        """Step 6: masters, then replicas, over the received rows (:func:`~ultraep.runtime.token_path.run_slots`)."""
        return run_slots(self, recv, C, plan, job, unbound, clk, replay)
