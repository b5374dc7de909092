"""Cost model: the predicted time of one MoE layer (one microbatch) under a plan.

Legend: R ranks, E experts, M masters per rank, S slots per rank, L link levels (0 = scale-up, the
NVLink domain; 1 = scale-out, between domains).

What is modelled (UltraEP arXiv 2606.04101 Eq. 1-5 and §6; HybridEP arXiv 2510.19470 §III; FEPLB
arXiv 2604.19654 §2; the terms are listed in ``docs/simulator.md`` with the numbers they were fitted to):

    compute_fwd  = max_r  Σ_{instances i on r} (n_i + h·[n_i > 0]) · F / (C · η)
                   grouped GEMM with efficiency η·n/(n + h): every active instance costs h extra tokens
    dispatch     = max_levels max_r max(send_r, recv_r) · token_bytes / (B_level · a2a_eff) + latency
    a2a_fwd      = 2 · dispatch                      (dispatch + combine move the same bytes)
    weight_sync  = Σ_relay stages max_r max(send_r, recv_r) / (B_up · copy_eff) + latency
                   exposed: all of it (UltraEP Eq. 1), or with ``weight_sync_overlap`` only what exceeds the
                   dispatch plus the smallest per-rank master compute (posted early, waited late)
    copy         = copy_call_s + max_r replica bytes r packs/unpacks/reduces · copy_s_per_byte
                   (host runtime, a call with replicas; 0 on GPUs)
    plan         = planner time of the policy (model figures from the papers, or measured)
    engine       = the adaptive engine's decision overhead (``plan.engine_s``), else 0
    fwd          = engine + plan + weight_sync + a2a_fwd + compute_fwd + non_moe_fwd   (UltraEP Eq. 1)
                   + call_overhead (a calibrated runtime's glue between the terms)
                   FEPLB: plan + copies overlap the static-expert compute; only the excess is exposed
                   HybridEP: expert all-gather is prefetched behind the pre-expert window; excess exposed
    compute_bwd  = backward_compute_factor · compute_fwd                       (≈ 2×, UltraEP Eq. 2)
    a2a_bwd      = backward_a2a_factor · a2a_fwd
    restore      = replica weights re-sent before expert backward (buffers are shared across layers),
                   hidden behind the non-MoE backward, excess exposed
    grad_reduce  = replica weight-gradients (fp32) reduced into the masters along the copy tree reversed,
                   at the SM-limited reduction bandwidth, hidden behind the backward compute window
                   (compute_bwd + non_moe_bwd), excess exposed
    total        = fwd + bwd   (``mode="prefill"``: fwd only)
    mean         = total + excess: what a call stands for on average (:func:`with_excess`); the terms are each right
                   at the typical call, their comparison leaves the excess out

The busiest rank's compute under the ranks' co-run slowdown and their noise (:func:`corun_finish`,
:func:`expected_max`) is priced here; :mod:`ultraep.cost.fit` fits those parameters from measurements and
:mod:`ultraep.cost.calibrator` learns the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from numba import njit

from ultraep.cost.params import CostParams
from ultraep.plan import ExpertDomains, Plan, Transfers
from ultraep.presets import PRESETS, ExpertSpec, HardwareSpec
from ultraep.topology import Topology
from ultraep.plan.traffic import (Traffic, dedup_levels, dest_logmiss, home_flows, hybrid_destinations,  # noqa: F401
                             hybrid_flows, level_flows, route_flows, route_logmiss)
from ultraep.plan.transfers import transfers_for


@dataclass(frozen=True)
class CostBreakdown:
    """Predicted seconds of every term for one layer and microbatch (see the module docstring)."""

    engine_s: float = 0.0
    plan_s: float = 0.0
    weight_sync_s: float = 0.0
    sync_exposed_s: float = 0.0
    a2a_fwd_s: float = 0.0
    compute_fwd_s: float = 0.0
    hybrid_ag_s: float = 0.0
    hybrid_ag_exposed_s: float = 0.0
    non_moe_fwd_s: float = 0.0
    fwd_s: float = 0.0
    compute_bwd_s: float = 0.0
    a2a_bwd_s: float = 0.0
    restore_exposed_s: float = 0.0
    grad_reduce_s: float = 0.0
    grad_reduce_exposed_s: float = 0.0
    non_moe_bwd_s: float = 0.0
    copy_s: float = 0.0
    call_overhead_s: float = 0.0
    excess_s: float = 0.0  #: the calls' mean excess over the terms, in total_s (:func:`with_excess`), else 0
    bwd_s: float = 0.0
    total_s: float = 0.0
    gemm_straggler_s: float = 0.0
    replica_tokens: float = 0.0  #: tokens the replica instances compute, over every rank
    replica_instances: float = 0.0  #: active replica instances, over every rank
    token_straggler: float = 0.0
    imbalance: float = 1.0
    rank_tokens_R: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: ``[R]`` active expert instances per rank: with ``rank_tokens_R``, what the calibrator learns the per-instance
    #: cost (``half_tokens``) from
    instances_R: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: ``[R]`` of those instances that are replicas
    replicas_R: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: ``[R]`` replica copies each rank sends or receives (None where the model has no such cost: on GPUs)
    moves_R: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: the predicting model's seconds per token before ``compute_scale`` (the layer's expert geometry): the unit in
    #: which :class:`ComputeFit` fits every rank's measured compute
    sec_per_token: float = 0.0

    @property
    def terms_s(self) -> float:
        """``total_s`` less ``excess_s``: the terms alone, what candidates are compared on."""
        return self.total_s - self.excess_s

    def as_dict(self) -> dict[str, float]:
        """JSON-ready floats: the terms (the per-rank arrays and the model's unit left out)."""
        # (fields() and getattr, not asdict(): asdict deep-copies every value, 0.1 ms per call on the runtime's
        # path, where the calibrator reads every layer call's prediction)
        return {n: float(getattr(self, n)) for n in _BREAKDOWN_FLOATS}


_BREAKDOWN_FLOATS = tuple(f.name for f in fields(CostBreakdown)
                          if f.name not in ("rank_tokens_R", "instances_R", "replicas_R", "moves_R", "sec_per_token"))


class CostModel:
    """Predicts one layer's time under a plan on a given cluster.

    Args:
        topology: the EP group (ranks, domains, link specs, ``expert_bytes``).
        hardware: accelerator figures; default: the preset named ``topology.name``, else H100 figures.
        expert: expert geometry (FLOPs and bytes per token); ``topology.expert_bytes`` wins for weights
            when it is set.
        params: calibration coefficients and modelling choices.
    """

    def __init__(self, topology: Topology, hardware: HardwareSpec | None = None, expert: ExpertSpec | None = None,
                 params: CostParams | None = None) -> None:
        preset = PRESETS.get(topology.name)
        self.topology = topology
        self.hardware = hardware or (preset.hardware if preset else PRESETS["h100-8x-ib"].hardware)
        self.expert = expert or (preset.expert if preset else ExpertSpec())
        self.params = params or CostParams()
        self._cache()

    def with_params(self, params: CostParams) -> "CostModel":
        return CostModel(self.topology, self.hardware, self.expert, params)

    def for_topology(self, topology: Topology) -> "CostModel":
        """This model re-targeted to ``topology`` (same hardware, expert and parameters): itself for its own
        topology, else one copy per topology, rebuilt when the parameters were replaced (calibration)."""
        if topology is self.topology:
            return self
        # (the last answer, by identity: comparing and hashing a topology's fields costs more than the rest of a
        # prediction's set-up, and the adaptive engine asks for its calibrated and its anchor model at each decision)
        last = self.__dict__.get("_last_for")
        if last is not None and last[0] is topology and (last[1] is self or last[1].params is self.params):
            return last[1]
        if topology == self.topology:
            cm = self
        else:
            cache = self.__dict__.setdefault("_retargeted", {})
            cm = cache.get(topology)
            if cm is None or cm.params is not self.params:
                cm = cache[topology] = CostModel(topology, self.hardware, self.expert, self.params)
        self.__dict__["_last_for"] = (topology, cm)
        return cm

    def _cache(self) -> None:
        t, hw, ex, p = self.topology, self.hardware, self.expert, self.params
        self.expert_bytes = float(t.expert_bytes or ex.expert_bytes)
        self.grad_bytes = self.expert_bytes * ex.grad_bytes / ex.weight_bytes
        self.token_bytes = float(ex.token_bytes)
        self.sec_per_token = ex.flops_per_token / (hw.gemm_tflops * 1e12 * hw.gemm_efficiency)
        self.half_tokens = float(hw.gemm_half_tokens if p.half_tokens is None else p.half_tokens)
        self.half_tokens_bwd = self.half_tokens if p.backward_half_tokens is None else float(p.backward_half_tokens)
        self.replica_instance_s_bwd = (p.replica_instance_s if p.backward_replica_instance_s is None
                                       else float(p.backward_replica_instance_s))
        self.replica_move_s_bwd = (p.replica_move_s if p.backward_replica_move_s is None
                                   else float(p.backward_replica_move_s))
        self.bw_L = np.array([t.scale_up.bandwidth_GBps, t.scale_out.bandwidth_GBps]) * 1e9
        self.lat_L = np.array([t.scale_up.latency_us, t.scale_out.latency_us]) * 1e-6
        self.a2a_eff = hw.a2a_efficiency
        self.copy_bw = self.bw_L[0] * hw.copy_efficiency
        self.grad_bw = self.bw_L[0] * hw.grad_reduce_efficiency
        self.prefetch_window = p.prefetch_window_s if p.prefetch_window_s is not None else p.non_moe_fwd_s

    # ------------------------------------------------------------------ traffic
    def traffic_from_flows(self, tok_RR: np.ndarray, tokens_R, instances_R, static_tokens_R=None,
                           static_instances_R=None) -> Traffic:
        """``tok_RR[src, dst]``: assignments src sends to dst (the diagonal stays local)."""
        send, recv = level_flows(np.ascontiguousarray(tok_RR, dtype=np.float64), self.topology.domain_R)
        return Traffic(np.asarray(tokens_R), np.asarray(instances_R), send, recv, static_tokens_R, static_instances_R)

    def tokens_of(self, load_RE: np.ndarray) -> np.ndarray | None:
        """``[R]`` tokens each source routes (assignments / top-k) when de-duplicating, else None."""
        k = self.params.dedup_top_k
        return None if k is None else np.asarray(load_RE, dtype=np.float64).sum(axis=1) / k

    def dest_flows(self, load_RE: np.ndarray, dst_RE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(send [R, 2], recv [R, 2])`` when source ``r``'s assignments to expert ``e`` go to rank
        ``dst_RE[r, e]``: assignments, or distinct tokens with :attr:`CostParams.dedup_top_k`."""
        t = self.topology
        tok = self.tokens_of(load_RE)
        if tok is not None:
            return dedup_levels(dest_logmiss(load_RE, dst_RE, tok), tok, t.D)
        R = t.num_ranks
        flows = np.zeros((R, R))
        np.add.at(flows, (np.repeat(np.arange(R), load_RE.shape[1]), dst_RE.ravel()), load_RE.ravel())
        return level_flows(flows, t.domain_R)

    def traffic(self, plan: Plan) -> Traffic:
        """Traffic of a plan; a plan with an expert-domain overlay (``plan.expert_domains``, HybridEP) uses its
        expert-domain routing. Kept with the plan (:func:`plan_memo`) for every model of the same topology that
        counts tokens alike."""
        memo = plan_memo(plan)
        key = ("traffic", self.params.dedup_top_k)
        got = memo.get(key)
        if got is not None and got[0] is self.topology:
            return got[1]
        tr = self._traffic(plan)
        memo[key] = (self.topology, tr)
        return tr

    def _traffic(self, plan: Plan) -> Traffic:
        dom = plan.expert_domains
        if dom is not None:
            return self.hybrid_traffic(plan.load_RE, dom.size, dom.fetched)
        q = plan.quota_RS
        t = self.topology
        tok = self.tokens_of(plan.load_RE)
        if plan.num_replicas == 0:  # masters only: every token goes home (no routes needed)
            if tok is not None:
                home = np.ascontiguousarray(np.broadcast_to(t.home_E, plan.load_RE.shape))
                send, recv = dedup_levels(dest_logmiss(plan.load_RE, home, tok), tok, t.D)
            else:
                send, recv = home_flows(plan.load_RE, t.home_E, t.domain_R)
            return Traffic(q.sum(axis=1), (q > 0).sum(axis=1), send, recv)
        if tok is not None:
            send, recv = dedup_levels(route_logmiss(plan.routes_RRS, tok), tok, t.D)
        else:
            send, recv = route_flows(plan.routes_RRS, t.domain_R)
        static_t = static_i = None
        M = self.topology.num_masters
        if plan.static_overlap:
            static_t = q[:, :M].sum(axis=1)
            static_i = (q[:, :M] > 0).sum(axis=1)
        return Traffic(q.sum(axis=1), (q > 0).sum(axis=1), send, recv, static_t, static_i, q[:, M:].sum(axis=1),
                       (q[:, M:] > 0).sum(axis=1))

    # ------------------------------------------------------------------ terms
    def compute_time_R(self, tokens_R, instances_R, backward: bool = False, replicas_R=None,
                       moves_R=None) -> np.ndarray:
        """``[R]`` forward expert compute seconds per rank (grouped-GEMM efficiency curve), with ``replicas_R`` of
        the instances replicas (each ``replica_instance_s`` more) and ``moves_R`` replica copies each rank sends or
        receives (each ``replica_move_s`` more); ``backward``: the same tokens' backward before
        ``backward_compute_factor``, with the backward's per-instance and per-copy costs."""
        h = self.half_tokens_bwd if backward else self.half_tokens
        t = (np.asarray(tokens_R, dtype=np.float64) + h * np.asarray(instances_R)) * (
            self.sec_per_token * self.params.compute_scale
        )
        rep_s = self.replica_instance_s_bwd if backward else self.params.replica_instance_s
        if replicas_R is not None and rep_s > 0:
            t = t + rep_s * np.asarray(replicas_R, dtype=np.float64)
        move_s = self.replica_move_s_bwd if backward else self.params.replica_move_s
        if moves_R is not None and move_s > 0:
            t = t + move_s * np.asarray(moves_R, dtype=np.float64)
        return t

    def busiest_compute_s(self, t_R: np.ndarray, backward: bool = False) -> float:
        """The busiest rank's compute seconds from every rank's own ``t_R`` (``[R]``, as alone): with ranks slowing
        each other by ``k`` per rank computing beside them (``corun_slowdown``), the rank with the least work finishes
        at ``(1 + k (R - 1)) t_min``, the next at that plus ``(1 + k (R - 2))`` times its remaining work, and so on:
        the busiest at ``max + k (sum - max)``. With ``compute_noise`` s, each rank's finish f varies as
        ``N(f, (s f)^2)``, independently, and the slowest rank is their expected maximum (:func:`expected_max`)."""
        if t_R.size == 0:
            return 0.0
        p = self.params
        k = p.corun_slowdown if not backward or p.backward_corun_slowdown is None else p.backward_corun_slowdown
        noise = p.compute_noise if not backward or p.backward_compute_noise is None else p.backward_compute_noise
        if noise > 0:  # every rank's finish, then the expected maximum of the noisy finishes
            t_R = np.ascontiguousarray(t_R, dtype=np.float64)
            s = _noisy_busiest(t_R, k, noise, EMAX_POINTS, EMAX_REACH)  # compiled: predicted at every decision
            return s if s >= 0.0 else expected_max(corun_finish(t_R, k), noise)  # a narrow rank: the refined grid
        top = float(t_R.max())
        return top + k * (float(t_R.sum()) - top) if k > 0 else top

    def dispatch_time(self, tr: Traffic) -> float:
        """One direction of the token all-to-all: the slowest link level (levels run concurrently); over a shared
        medium (:attr:`CostParams.a2a_shared_medium`) every byte of the group, at the scale-up bandwidth."""
        if self.params.a2a_shared_medium:
            total = float(tr.send_RL.sum()) * self.token_bytes
            t = total / (self.bw_L[0] * self.a2a_eff) + self.lat_L[0] if total > 0 else 0.0
            return t * self.params.a2a_scale
        worst = np.maximum(tr.send_RL, tr.recv_RL).max(axis=0) * self.token_bytes  # [L] bytes
        if self.params.scale_out_shared:  # one link per domain: its ranks' bytes add up
            D = self.topology.D
            worst[1] = max(tr.send_RL[:, 1].reshape(-1, D).sum(axis=1).max(),
                           tr.recv_RL[:, 1].reshape(-1, D).sum(axis=1).max()) * self.token_bytes
        t = np.where(worst > 0, worst / (self.bw_L * self.a2a_eff) + self.lat_L, 0.0)
        return float(t.max()) * self.params.a2a_scale

    def weight_sync_time(self, plan: Plan) -> float:
        """Replica weight copies of ``plan`` (see :meth:`transfers_time`): the copies it lists, or every
        replica's with ``resend_all_replicas`` (a runtime that streams every replica each microbatch)."""
        if self.params.resend_all_replicas and plan.num_replicas:
            return self.transfers_time(self.replica_tree(plan))
        return self.transfers_time(plan.transfers)

    def transfers_time(self, tr: Transfers) -> float:
        """Weight copies: per relay stage, the busiest sender or receiver; stages in sequence."""
        return self._tree_time(tr, 1.0, self.copy_bw) * self.params.weight_sync_scale

    def _tree_time(self, tr: Transfers, byte_scale: float, bandwidth: float) -> float:
        total = 0.0
        for busiest in stage_bytes(tr, self.topology.num_ranks):
            total += busiest * byte_scale / bandwidth + self.lat_L[0]
        return total

    def replica_tree(self, plan: Plan) -> Transfers:
        """The copy tree of *every* replica of ``plan`` (``plan.transfers`` holds only the copies this
        step needs, e.g. a historical placement moves weights only when it changes)."""
        if len(plan.transfers) >= plan.num_replicas:
            return plan.transfers
        memo, key = plan_memo(plan), ("tree", int(self.expert_bytes))
        tree = memo.get(key)
        if tree is None:
            tree = memo[key] = transfers_for(plan, expert_bytes=int(self.expert_bytes)).transfers
        return tree

    def full_sync_time(self, plan: Plan) -> float:
        """Weight sync if every replica of ``plan`` had to be sent (a placement that is not resident)."""
        if plan.num_replicas == 0:
            return 0.0
        return self.transfers_time(self.replica_tree(plan))

    def grad_reduce_time(self, plan: Plan) -> float:
        """Replica gradients (fp32) reduced into the masters along the copy tree reversed: per stage the
        busiest rank, at the SM-limited reduction bandwidth."""
        if plan.num_replicas == 0:
            return 0.0
        tree = self.replica_tree(plan)
        return self._tree_time(tree, self.grad_bytes / self.expert_bytes, self.grad_bw) * self.params.grad_reduce_scale

    def planner_time(self, plan: Plan) -> float:
        s = self.params.planner_s.get(plan.policy)  # an override by name, else the policy's own figure
        if s is None:
            s = plan.planner_s if plan.planner_s is not None else 0.0
        return float(s) * self.params.plan_scale

    # ------------------------------------------------------------------ prediction
    def predict(self, plan: Plan, *, sync_s: float | None = None) -> CostBreakdown:
        """Predicted time of ``plan``. ``sync_s`` overrides the weight-sync term (e.g. a switch to a
        placement whose replicas are not resident, see :meth:`full_sync_time`)."""
        dom = plan.expert_domains
        if dom is not None and plan.choice is None:  # the overlay alone: no planner, no replicas
            return self.predict_hybrid(plan.load_RE, dom.size, dom.compression, fetched=dom.fetched)
        tr = self.traffic(plan)
        moves_R = self.replica_moves_R(plan)
        ag_bytes_R = None if dom is None else self.allgather_bytes_R(dom.size, dom.compression, dom.fetched)
        if sync_s is None:
            sync_s = plan.sync_s
        wsync = self.weight_sync_time(plan) if sync_s is None else float(sync_s)
        master_s = None
        if self.params.weight_sync_overlap and wsync > 0:
            M = self.topology.num_masters
            mq = plan.quota_RS[:, :M]
            master_s = float(self.compute_time_R(mq.sum(axis=1), (mq > 0).sum(axis=1)).min())
        return self._assemble(
            tr, plan_s=self.planner_time(plan), wsync=wsync,
            grad_s=self.grad_reduce_time(plan) if self.params.mode == "training" else 0.0,
            overlap_static=plan.static_overlap, ag_bytes=ag_bytes_R,
            engine_s=float(plan.engine_s), master_s=master_s, copy_s=self.copy_time(plan, moves_R), moves_R=moves_R,
        )

    def replica_moves_R(self, plan: Plan) -> np.ndarray | None:
        """``[R]`` replica copies each rank sends or receives under ``plan`` (the copy tree's edges that touch it),
        where the host runtime copies them (``copy_s_per_byte > 0``); None elsewhere or without replicas (a HybridEP
        overlay has none)."""
        if self.params.copy_s_per_byte <= 0 or plan.num_replicas == 0:
            return None
        tree = self.replica_tree(plan)
        R = self.topology.num_ranks
        memo = plan_memo(plan)
        got = memo.get("moves")
        if got is None or got[0] is not tree or got[1].shape[0] != R:
            got = memo["moves"] = (tree, (np.bincount(tree.src, minlength=R)
                                          + np.bincount(tree.dst, minlength=R)).astype(np.float64))
        return got[1]

    def copy_time(self, plan: Plan, moves_R: np.ndarray | None = None) -> float:
        """Exposed host copies of ``plan``'s replicas: ``copy_call_s`` plus the busiest rank's bytes packed/unpacked
        (weights) and, in training, packed/reduced (fp32 gradients), at ``copy_s_per_byte``; ``moves_R``: the plan's
        :meth:`replica_moves_R` when the caller has them."""
        p = self.params
        moves = self.replica_moves_R(plan) if moves_R is None else moves_R
        if moves is None:
            return 0.0
        return p.copy_call_s + self.copy_bytes_time(moves) * p.copy_scale

    def copy_bytes_time(self, moves_R: np.ndarray) -> float:
        """The copies' per-byte part before ``copy_scale``: the busiest rank's bytes of ``moves_R`` (``[R]`` replica
        copies, :meth:`replica_moves_R`) at ``copy_s_per_byte``, weights and, in training, fp32 gradients."""
        nbytes = moves_R * self.expert_bytes
        if self.params.mode == "training":
            nbytes = nbytes + moves_R * self.grad_bytes
        return float(nbytes.max()) * self.params.copy_s_per_byte

    def predict_hybrid(self, load_RE: np.ndarray, expert_domain_size: int, compression: float = 1.0, *,
                       fetched: int | None = None) -> CostBreakdown:
        """Predicted time of a HybridEP overlay (no replicas, no planner on the critical path); ``fetched``: masters
        of each peer a rank fetches (default all)."""
        S = int(expert_domain_size)
        tr = self.hybrid_traffic(load_RE, S, fetched)
        ag = self.allgather_bytes_R(S, compression, fetched) if S > 1 else None
        return self._assemble(tr, plan_s=0.0, wsync=0.0, grad_s=0.0, overlap_static=False, ag_bytes=ag)

    def hybrid_traffic(self, load_RE: np.ndarray, S: int, fetched: int | None = None) -> Traffic:
        """:class:`Traffic` of the expert-domain overlay with size S (each rank fetching ``fetched`` masters of each
        peer; default all): tokens served by fetched copies in the source's own domain, the rest at home."""
        t = self.topology
        dst_AE = hybrid_destinations(t, S, fetched)
        send, recv, tokens, inst = hybrid_flows(load_RE, dst_AE, t.domain_R)
        if self.params.dedup_top_k is not None:  # a token once per destination rank / domain
            send, recv = self.dest_flows(load_RE, np.ascontiguousarray(dst_AE[t.domain_R]))
        return Traffic(tokens, inst, send, recv)

    def allgather_bytes_R(self, S: int, compression: float = 1.0, fetched: int | None = None) -> np.ndarray:
        """``[R]`` weight bytes every rank fetches over the scale-out link: ``fetched`` (default all) masters of each
        of its S − 1 peers (same offset, other domains of its expert domain), divided by the compression ratio."""
        t = self.topology
        f = t.num_masters if fetched is None else min(int(fetched), t.num_masters)
        nbytes = (S - 1) * f * self.expert_bytes / max(compression, 1e-9)
        return np.full(t.num_ranks, float(nbytes))

    def scheme_ideal(self, load_RE: np.ndarray, domains: ExpertDomains | None) -> CostBreakdown:
        """The force-balanced ideal of a plan's own transmission scheme: :meth:`ideal` for plain EP; with an
        expert-domain overlay, every source keeps its token count spread uniformly over all experts (``[R, E]``
        float load), routed and fetched as the overlay routes them, so every rank computes the mean and what is left
        is the scheme's own traffic and all-gather (plain EP's ideal is beaten on slow links by moving weights)."""
        if domains is None:
            return self.ideal(load_RE)
        T_R = np.asarray(load_RE, dtype=np.float64).sum(axis=1)
        E = load_RE.shape[1]
        return self.predict_hybrid(np.repeat((T_R / E)[:, None], E, axis=1), domains.size, domains.compression,
                                   fetched=domains.fetched)

    def ideal(self, load_RE: np.ndarray) -> CostBreakdown:
        """The force-balanced ideal of the same step: every source keeps its token count, tokens spread
        uniformly over all experts (so every rank receives exactly the mean), no balancing overhead."""
        t = self.topology
        R, D = t.num_ranks, t.D
        T_src = np.asarray(load_RE, dtype=np.float64).sum(axis=1)
        total = T_src.sum()
        per_rank = total / R
        k = self.params.dedup_top_k
        if k is None:
            dom_T = np.repeat(T_src.reshape(-1, D).sum(axis=1), D) if D > 1 else T_src  # [R] sourced in r's domain
            send, recv = np.empty((R, 2)), np.empty((R, 2))  # (filled by column: np.stack's dispatch costs more)
            np.multiply(T_src, D - 1, out=send[:, 0])
            np.multiply(T_src, R - D, out=send[:, 1])
            send /= R
            np.subtract(dom_T, T_src, out=recv[:, 0])
            recv[:, 0] /= R
            np.subtract(total, dom_T, out=recv[:, 1])
            recv[:, 1] /= R
        else:  # distinct tokens: a token picks each expert with probability k / E (the de-duplication estimate)
            tok = T_src / k
            q = min(k / t.num_experts, 1.0 - 1e-12)
            hit_rank = 1.0 - (1.0 - q) ** t.num_masters
            hit_dom = 1.0 - (1.0 - q) ** (t.num_masters * D)
            dom_tok = np.repeat(tok.reshape(-1, D).sum(axis=1), D)
            off_tok = np.tile(tok.reshape(-1, D).sum(axis=0), R // D)  # [R] tokens of the sources at r's offset
            send = np.stack([tok * (D - 1) * hit_rank, tok * (R // D - 1) * hit_dom], axis=1)
            recv = np.stack([(dom_tok - tok) * hit_rank, (off_tok - tok) * hit_dom], axis=1)
        inst = np.full(R, float(t.num_masters) if per_rank > 0 else 0.0)
        tr = Traffic(np.full(R, per_rank), inst, send, recv)
        return self._assemble(tr, plan_s=0.0, wsync=0.0, grad_s=0.0, overlap_static=False, ag_bytes=None)

    def _assemble(self, tr: Traffic, *, plan_s: float, wsync: float, grad_s: float, overlap_static: bool,
                  ag_bytes, engine_s: float = 0.0, master_s: float | None = None,
                  copy_s: float = 0.0, moves_R: np.ndarray | None = None) -> CostBreakdown:
        """The breakdown of one plan's traffic ``tr``; ``moves_R``: its :meth:`replica_moves_R` (None: not modelled)."""
        p = self.params
        comp_R = self.compute_time_R(tr.tokens_R, tr.instances_R, replicas_R=tr.replica_instances_R, moves_R=moves_R)
        compute = self.busiest_compute_s(comp_R)
        a2a = 2.0 * self.dispatch_time(tr)
        # Pre-dispatch critical path: planning, then replica weights (dispatch waits for them).
        if overlap_static and tr.static_tokens_R is not None:
            # FEPLB: CPU planning and copy-engine transfers run while static experts compute; the
            # receiving ranks wait only for what exceeds their static compute.
            static_R = self.compute_time_R(tr.static_tokens_R, tr.static_instances_R)
            window = float(static_R[tr.tokens_R > tr.static_tokens_R].min()) if (tr.tokens_R > tr.static_tokens_R).any() else float("inf")
            sync_exposed = max(0.0, plan_s + wsync - window) if wsync > 0 else 0.0
            plan_exposed = 0.0
        elif master_s is not None:  # posted before the dispatch, waited for after the masters computed
            sync_exposed = max(0.0, wsync - a2a / 2 - master_s)
            plan_exposed = plan_s
        else:
            sync_exposed = wsync
            plan_exposed = plan_s
        ag_s = ag_exposed = 0.0
        if ag_bytes is not None:
            ag_max = float(ag_bytes.reshape(-1, self.topology.D).sum(axis=1).max() if p.scale_out_shared
                           else ag_bytes.max())  # a shared link carries the whole domain's fetches
            ag_s = ag_max / (self.bw_L[1] * self.a2a_eff) + self.lat_L[1] if ag_max > 0 else 0.0
            ag_s *= p.a2a_scale
            ag_exposed = max(0.0, ag_s - self.prefetch_window)
        overhead = p.call_overhead_s
        if moves_weights(wsync, copy_s, grad_s):
            overhead = max(0.0, overhead + p.transfer_call_overhead_s)
        fwd = (engine_s + plan_exposed + sync_exposed + a2a + compute + ag_exposed + p.non_moe_fwd_s + copy_s
               + overhead)
        if p.mode == "training":
            same = (self.half_tokens_bwd == self.half_tokens and self.replica_instance_s_bwd == p.replica_instance_s
                    and self.replica_move_s_bwd == p.replica_move_s
                    and p.backward_corun_slowdown in (None, p.corun_slowdown)
                    and p.backward_compute_noise in (None, p.compute_noise))
            comp_b = p.backward_compute_factor * (compute if same else self.busiest_compute_s(
                self.compute_time_R(tr.tokens_R, tr.instances_R, backward=True, replicas_R=tr.replica_instances_R,
                                    moves_R=moves_R),
                backward=True))
            a2a_b = p.backward_a2a_factor * a2a
            restore = max(0.0, wsync - p.non_moe_bwd_s) if (p.restore_in_backward and wsync > 0) else 0.0
            window = comp_b + p.non_moe_bwd_s
            if ag_bytes is not None and ag_s > 0:  # fetched experts' gradients return over the slow link
                grad_s = grad_s + ag_s * self.expert.grad_bytes / self.expert.weight_bytes
            grad_exposed = max(0.0, grad_s - window)
            bwd = comp_b + a2a_b + restore + grad_exposed + p.non_moe_bwd_s
        else:
            comp_b = a2a_b = restore = grad_exposed = 0.0
            grad_s = 0.0
            bwd = 0.0
        tokens = np.asarray(tr.tokens_R, dtype=np.float64)
        top, mean = _top_mean(tokens)
        c_top, c_mean = _top_mean(comp_R)
        reps = tr.replica_instances_R
        return _breakdown(
            engine_s=engine_s, plan_s=plan_s, weight_sync_s=wsync, sync_exposed_s=sync_exposed, a2a_fwd_s=a2a, compute_fwd_s=compute,
            hybrid_ag_s=ag_s, hybrid_ag_exposed_s=ag_exposed, non_moe_fwd_s=p.non_moe_fwd_s, fwd_s=fwd,
            compute_bwd_s=comp_b, a2a_bwd_s=a2a_b, restore_exposed_s=restore, grad_reduce_s=grad_s,
            grad_reduce_exposed_s=grad_exposed, non_moe_bwd_s=p.non_moe_bwd_s if p.mode == "training" else 0.0,
            copy_s=copy_s, call_overhead_s=overhead, bwd_s=bwd, total_s=fwd + bwd,
            gemm_straggler_s=float(c_top - c_mean),
            token_straggler=float(top - mean),
            imbalance=float(top / mean) if mean > 0 else 1.0,
            rank_tokens_R=tokens, instances_R=np.asarray(tr.instances_R, dtype=np.float64),
            replicas_R=None if reps is None else np.asarray(reps, dtype=np.float64),
            moves_R=moves_R,
            sec_per_token=self.sec_per_token,
            replica_tokens=float(tr.replica_tokens_R.sum()) if tr.replica_tokens_R is not None else 0.0,
            replica_instances=float(reps.sum()) if reps is not None else 0.0,
        )


#: every field of :class:`CostBreakdown` at its default (what :func:`_breakdown` starts from)
_BREAKDOWN_DEFAULTS = {f.name: f.default for f in fields(CostBreakdown)}


def _breakdown(**terms) -> CostBreakdown:
    """``CostBreakdown(**terms)`` without the frozen dataclass's per-field ``object.__setattr__`` (30 fields: a fifth
    of a prediction's time, and the adaptive engine predicts every candidate at each decision). Equal to the
    constructor's result and as frozen: only its ``__init__`` is bypassed."""
    out = object.__new__(CostBreakdown)
    d = out.__dict__
    d.update(_BREAKDOWN_DEFAULTS)
    d.update(terms)
    return out


#: arrays of up to this many ranks are summarised in Python floats (numpy's per-call dispatch is most of the cost
#: there); longer ones in numpy
_SMALL = 64


def excess_of(terms_s: float, excess_s: float) -> float:
    """The excess a prediction of ``terms_s`` seconds takes: ``excess_s``, never below half the terms (an excess learned
    on larger calls, a negative one, does not take a small call's prediction to nothing)."""
    return max(float(excess_s), -0.5 * terms_s)


def with_excess(bd: CostBreakdown, excess_s: float) -> CostBreakdown:
    """``bd`` as the mean time of the calls it stands for: ``excess_s`` (``CostParams.excess_s``, the calls' mean over
    their terms) in its ``excess_s``, ``fwd_s`` and ``total_s``. Only where a prediction stands for a time (a call's
    recorded prediction, its decision's predictions): candidates are compared without it, as it is the same for each and
    a ratio of two times with it added is pulled toward 1 (:func:`excess_of` bounds it)."""
    if excess_s == 0.0 and bd.excess_s == 0.0:
        return bd
    excess_s = excess_of(bd.terms_s, excess_s)
    d = {**bd.__dict__, "excess_s": excess_s}
    d["fwd_s"] = bd.fwd_s - bd.excess_s + excess_s
    d["total_s"] = bd.total_s - bd.excess_s + excess_s
    return _breakdown(**d)


def _top_mean(a: np.ndarray) -> tuple[float, float]:
    """``(max, mean)`` of the 1-D array ``a`` (``(0, 0)`` when empty): a prediction's straggler and imbalance terms."""
    if a.size == 0:
        return 0.0, 0.0
    if a.size <= _SMALL:
        v = a.tolist()
        return max(v), sum(v) / len(v)
    return float(a.max()), float(a.sum()) / a.size


def moves_weights(weight_sync_s: float, copy_s: float, grad_reduce_s: float) -> bool:
    """Whether a call whose plan costs these predicted seconds moves expert weights (sends replicas or moved experts,
    copies them, reduces replica gradients back): such a call pays :attr:`CostParams.transfer_call_overhead_s`."""
    return weight_sync_s > 0 or copy_s > 0 or grad_reduce_s > 0


def corun_finish(t_R: np.ndarray, k: float) -> np.ndarray:
    """``[R]`` every rank's finish from its own ``t_R`` (as alone) when each runs ``1 + k (ranks still computing -
    1)`` times slower (:func:`corun_matrices`, in sorted order: O(R log R)); the largest is
    ``max + k (sum - max)``."""
    order = np.argsort(t_R, kind="stable")
    w = t_R[order]
    R = w.shape[0]
    steps = np.diff(w, prepend=0.0)
    out = np.empty(R)
    out[order] = np.cumsum((1.0 + k * (R - 1 - np.arange(R))) * steps)
    return out


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Phi(z), the standard normal CDF, from erf's rational approximation (Abramowitz & Stegun 1964, 7.1.26;
    absolute error below 1.5e-7): numpy has no erf, and this runs once per predicted call."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half = 0.5 * poly * np.exp(-x * x)  # 1 - Phi(|z|)
    return np.where(z >= 0, 1.0 - half, half)


#: grid points of :func:`expected_max`'s integral, and its reach in standard deviations of the largest mean
EMAX_POINTS, EMAX_REACH = 192, 6.0
#: the points added across a narrow rank's spread, in its standard deviations
EMAX_FINE = np.linspace(-4.0, 4.0, 17)


@njit(cache=True)
def _phi(z: float) -> float:
    """:func:`_norm_cdf` of one number (the same approximation, compiled)."""
    x = abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half = 0.5 * poly * math.exp(-x * x)
    return 1.0 - half if z >= 0 else half


@njit(cache=True)
def _noisy_busiest(t_R, k, noise, points, reach):
    """:func:`expected_max` of :func:`corun_finish` (``t_R`` [R] float64, ``k``, ``noise`` > 0) in one compiled pass,
    on the uniform grid; -1.0 where a rank is narrow (the caller integrates on the refined grid). The cost model
    prices the busiest rank twice per prediction and the adaptive engine predicts every candidate at each decision:
    in numpy, a few dozen array calls on arrays of a few ranks each, this was most of a prediction's time."""
    R = t_R.shape[0]
    order = np.argsort(t_R, kind="mergesort")
    fin = np.empty(R)
    acc = 0.0
    prev = 0.0
    for j in range(R):  # corun_finish, in sorted order
        w = t_R[order[j]]
        acc += (1.0 + k * (R - 1 - j)) * (w - prev)
        prev = w
        fin[order[j]] = acc
    top = fin.max() if R else 0.0
    if top <= 0:
        return top
    lo = top * (1.0 - reach * noise)
    hi = top * (1.0 + reach * noise)
    step = (hi - lo) / (points - 1)
    m = np.empty(R)
    n = 0
    for r in range(R):  # the ranks that can finish last; a narrow one needs expected_max's refined grid
        v = fin[r]
        if v > 0 and v * (1.0 + reach * noise) > lo:
            if noise * v < 4.0 * step:
                return -1.0
            m[n] = v
            n += 1
    total = 0.0
    y_prev = 0.0
    for i in range(points):  # lo + the trapezoid of 1 - prod_r Phi((x - m_r) / (noise m_r))
        x = lo + step * i
        F = 1.0
        for r in range(n):
            F *= _phi((x - m[r]) / (noise * m[r]))
        y = 1.0 - F
        if i > 0:
            total += (y + y_prev) * step
        y_prev = y
    return lo + total * 0.5


def expected_max(mean_R: np.ndarray, noise: float) -> float:
    """E[max_r X_r] for independent ``X_r ~ N(m_r, (noise m_r)^2)``: ``lo + integral_lo^hi (1 - prod_r Phi((x - m_r)
    / (noise m_r))) dx``, where below ``lo`` (6 standard deviations under the largest mean) the product is 0 to
    within 1e-9, above ``hi`` 1. Ranks that cannot reach ``lo`` are left out; the trapezoid over 192 points, and
    17 more across each narrow rank's spread, is within 1e-4 relative of the exact value (tests; at 96 points ranks
    of 0.25 or 9.5 beside 8 at noise 0.5 came out 2.2-2.7e-4 off). ``noise`` 0: the largest mean."""
    m = np.asarray(mean_R, dtype=np.float64)
    top = float(m.max()) if m.size else 0.0
    if noise <= 0 or top <= 0:
        return top
    lo = top * (1.0 - EMAX_REACH * noise)
    hi = top * (1.0 + EMAX_REACH * noise)
    m = m[(m > 0) & (m * (1.0 + EMAX_REACH * noise) > lo)]  # an idle rank (0 s) never finishes last
    x = np.linspace(lo, hi, EMAX_POINTS)
    # a rank whose spread spans fewer than 4 of the grid's steps moves the product within a few steps: the grid gets
    # points across its spread (its mean +- 4 standard deviations; ranks within a quarter step share them). Without
    # them means (8, 0.25, 0.25) at noise 0.5 came out 2.2e-4 high (hypothesis, 2026-11-26)
    step = (hi - lo) / (EMAX_POINTS - 1)
    narrow = m[noise * m < 4.0 * step]
    if narrow.size:
        narrow = np.unique(np.round(narrow / (step / 4))) * (step / 4)
        x = np.union1d(x, np.clip((narrow[:, None] * (1.0 + noise * EMAX_FINE[None, :])).ravel(), lo, hi))
    F = _norm_cdf((x[:, None] - m[None, :]) / (noise * m[None, :])).prod(axis=1)
    y = 1.0 - F
    return lo + float(((y[1:] + y[:-1]) * np.diff(x)).sum() / 2.0)


def cost_record(cm: "CostModel") -> dict[str, Any]:
    """``cm`` as a JSON-able dict (topology, hardware, expert geometry, calibrated parameters): what a recorded run
    keeps of the cost model its engine learned, so that ``ultraep simulate RUN --topology from-run`` replays on
    the very machine the run measured (:func:`cost_model_from_record`)."""
    return {"topology": cm.topology.model_dump(mode="json"), "hardware": cm.hardware.model_dump(mode="json"),
            "expert": cm.expert.model_dump(mode="json"), "params": cm.params.model_dump(mode="json")}


def cost_model_from_record(record: dict[str, Any], path: str = "cost_model") -> "CostModel":
    """The :class:`CostModel` of a :func:`cost_record` (validated field by field; a bad record raises
    :class:`~ultraep.errors.ConfigError` naming the field)."""
    from pydantic import ValidationError

    from ultraep.errors import ConfigError

    parts = {"topology": Topology, "hardware": HardwareSpec, "expert": ExpertSpec, "params": CostParams}
    if not isinstance(record, dict) or set(record) != set(parts):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(path, f"must hold exactly {sorted(parts)}, got {got}", got)
    built = {}
    for key, cls in parts.items():
        try:
            built[key] = cls.model_validate(record[key])
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ConfigError(f"{path}.{key}.{where}", err["msg"], err.get("input")) from None
    return CostModel(built["topology"], built["hardware"], built["expert"], built["params"])


_DEFAULT_MODELS: dict[Topology, CostModel] = {}


def model_for(base: CostModel | None, topology: Topology) -> CostModel:
    """The cost model a policy predicts ``topology`` with: ``base`` (the engine's calibrated model) re-targeted
    to it, or, with no ``base``, the preset model of that topology (one per topology, kept)."""
    if base is not None:
        return base.for_topology(topology)
    cm = _DEFAULT_MODELS.get(topology)
    if cm is None:
        if len(_DEFAULT_MODELS) > 64:  # bounded: topologies are few; a sweep over many should not grow it
            _DEFAULT_MODELS.clear()
        cm = _DEFAULT_MODELS[topology] = CostModel(topology)
    return cm


def plan_memo(plan: Plan) -> dict:
    """What the cost model derived from ``plan`` that no cost parameter changes (its traffic, its copy tree, the
    copies per rank), kept with the plan as its cached properties are (a plan is immutable; :meth:`Plan.replaced`
    hands it on to a copy of the same placement). Why: the adaptive engine predicts every candidate's plan on the
    calibrated and on the anchor model at each decision, and the engine predicts the chosen one again; deriving these
    each time was a third of a prediction (R = 2, 16 experts: 0.07 of 0.2 ms)."""
    d = plan.__dict__
    memo = d.get("_cost_memo")
    if memo is None:
        memo = d["_cost_memo"] = {}
    return memo


def stage_bytes(tr: Transfers, num_ranks: int) -> list[float]:
    """Per relay stage of the copies ``tr``, in stage order, the busiest rank's bytes sent or received (what
    :meth:`CostModel._tree_time` prices), kept with ``tr`` (a plan's transfers are not changed once made)."""
    got = tr.__dict__.get("_stage_bytes")
    if got is not None and got[0] == num_ranks:
        return got[1]
    out = []
    if len(tr):
        for stage in np.unique(tr.stage):
            sel = tr.stage == stage
            send = np.bincount(tr.src[sel], weights=tr.bytes[sel], minlength=num_ranks)
            recv = np.bincount(tr.dst[sel], weights=tr.bytes[sel], minlength=num_ranks)
            out.append(max(send.max(), recv.max()))
    tr.__dict__["_stage_bytes"] = (num_ranks, out)
    return out
