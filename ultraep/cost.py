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

**Calibration.** Each modelled term has a multiplicative scale in :class:`CostParams` (``compute_scale``,
``a2a_scale``, ...). :class:`Calibrator` updates them from measured timings with an exponentially weighted
moving average of the log ratio ``measured / unscaled prediction`` (weight ``alpha`` on the newest
observation): a geometric EWMA, insensitive to units, one number per term. Every observation returns (and
can record through the telemetry recorder) the prediction next to the measurement.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from itertools import combinations
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ultraep.plan import ExpertDomains, Plan, Transfers
from ultraep.presets import PRESETS, ExpertSpec, HardwareSpec
from ultraep.topology import Topology
from ultraep.plan.traffic import (Traffic, dedup_levels, dest_logmiss, home_flows, hybrid_destinations,  # noqa: F401
                             hybrid_flows, level_flows, route_flows, route_logmiss)
from ultraep.plan.transfers import transfers_for

class CostParams(BaseModel):
    """Coefficients of the cost model; the ``*_scale`` fields are what calibration learns."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["training", "prefill"] = Field(
        default="training", description="training = forward + backward; prefill = forward only."
    )
    compute_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of expert compute.")
    a2a_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of the token all-to-all.")
    weight_sync_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of weight sync.")
    grad_reduce_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of grad reduction.")
    plan_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of planner latency.")
    copy_scale: float = Field(default=1.0, gt=0, description="Calibrated multiplier of the exposed replica copies' "
                              "per-byte part.")
    copy_call_s: float = Field(
        default=0.0, ge=0,
        description="Exposed seconds of replica copies every call with replicas pays whatever their bytes (posting "
        "the weight and gradient sends, their buffers), where copy_s_per_byte > 0. On 2 gloo ranks 2.4-7.1 ms of the "
        "4.9-8.1 ms copies of a call moving 2 or 4 experts (2026-11-27). Calibrated with copy_scale from the measured "
        "copies (Calibrator._copy).",
    )
    copy_s_per_byte: float = Field(
        default=0.0, ge=0,
        description="Exposed seconds per byte of replica state a rank packs, unpacks or reduces on its own critical "
        "path (forward: weights packed and unpacked; backward: fp32 gradients packed and reduced). 0 on GPUs, "
        "where copy kernels overlap; the host runtime on CPU pays it.",
    )
    resend_all_replicas: bool = Field(
        default=False,
        description="Every replica is streamed again each microbatch (the ultraep runtime, whose masters change "
        "every optimizer step), not only the new ones a historical placement lists.",
    )
    weight_sync_overlap: bool = Field(
        default=False,
        description="Replica weights are posted before the token dispatch and waited for right before the "
        "replicas compute (the ultraep runtime): only what exceeds the dispatch and the masters' compute is "
        "exposed. False: the sync precedes the dispatch (UltraEP Eq. 1).",
    )
    backward_compute_factor: float = Field(
        default=2.0, gt=0, description="Expert backward compute / forward compute (UltraEP: ≈ 2)."
    )
    backward_a2a_factor: float = Field(default=1.0, gt=0, description="Backward all-to-all / forward all-to-all.")
    non_moe_fwd_s: float = Field(
        default=0.0, ge=0, description="Per-layer forward time outside the MoE block (attention etc.), seconds."
    )
    non_moe_bwd_s: float = Field(default=0.0, ge=0, description="Per-layer backward time outside the MoE block, s.")
    prefetch_window_s: float | None = Field(
        default=None, ge=0,
        description="Time an asynchronous expert prefetch (HybridEP all-gather) can hide behind; default "
        "non_moe_fwd_s (the pre-expert compute of HybridEP's stream model).",
    )
    restore_in_backward: bool = Field(
        default=True, description="Replica weights are re-sent before expert backward (shared slot buffers)."
    )
    planner_s: dict[str, float] = Field(
        default_factory=dict,
        description="Planner latency per policy name, seconds, overriding the figure each policy puts on its "
                    "plans (``Plan.planner_s``: the policy's own ``planner_s``).",
    )
    engine_overhead_s: float = Field(
        default=5e-6, ge=0,
        description="Decision overhead of the adaptive engine per layer, seconds (its own work beyond the planning "
        "of the candidates). Calibrated from the measured plan_s of calls whose plan carries an engine cost.",
    )
    call_overhead_s: float = Field(
        default=0.0, ge=0,
        description="Per-call seconds of the runtime outside every modelled term: the load all-gather, rerouting, "
        "token permute/unpermute and the glue between phases. Calibrated from each call's measured layer time "
        "minus its measured terms; 0 (the presets) models a runtime whose overheads vanish next to the terms.",
    )
    transfer_call_overhead_s: float = Field(
        default=0.0,
        description="Seconds a call that moves expert weights (replicas or moved experts: weight and replica "
        "gradient sends to post, buffers to unpack) spends outside the modelled terms beyond ``call_overhead_s``, "
        "which then holds the calls that move none. Calibrated as the difference of the two kinds' residuals; 0 "
        "until both kinds were measured. May be negative (a call that balances permutes fewer rows on its "
        "busiest rank).",
    )
    half_tokens: float | None = Field(
        default=None, ge=0,
        description="Tokens' worth of forward work every active expert instance costs beyond its tokens (the "
        "grouped GEMM's efficiency curve: an instance reads its expert's weights whatever its rows). None: the "
        "hardware's gemm_half_tokens. Calibrated from calls whose ranks carry unequal tokens.",
    )
    backward_half_tokens: float | None = Field(
        default=None, ge=0,
        description="The same in the backward, where every instance also writes its weight gradients (on CPU 1-3x the "
        "forward's, measured). None: half_tokens. Calibrated like it.",
    )
    replica_instance_s: float = Field(
        default=0.0, ge=0,
        description="Seconds every active replica instance costs beyond its tokens in the forward (the runtime's own "
        "per-replica work; the backward factor applies to it too). 0: replicas compute like masters. Calibrated from "
        "the replicas' measured compute.",
    )
    backward_replica_instance_s: float | None = Field(
        default=None, ge=0,
        description="The same in the backward, before backward_compute_factor (fitted apart from the forward's: at 64 "
        "tokens per rank on CPU 0.8-3.3 ms per replica instance against 0-0.5 ms forward). None: "
        "replica_instance_s. Calibrated from every rank's backward compute.",
    )
    replica_move_s: float = Field(
        default=0.0, ge=0,
        description="Seconds a rank's forward expert compute takes longer per replica copy it sends or receives in "
        "the call, where the host runtime's transport copies run on the cores that compute (CPU ranks sharing a "
        "host; modelled where copy_s_per_byte > 0): at 64 tokens per rank a rank that only sends its experts to "
        "replicas computed its backward 26-29 % slower than with more tokens and none (2026-11-26, seventh session). "
        "Calibrated from every rank's compute.",
    )
    backward_replica_move_s: float | None = Field(
        default=None, ge=0,
        description="The same in the backward (the replicas' gradients return to the masters), before "
        "backward_compute_factor. None: replica_move_s.",
    )
    corun_slowdown: float = Field(
        default=0.0, ge=0,
        description="Ranks that share one host's cores and memory slow each other while they compute: a rank computes "
        "1 + this x (the other ranks computing) times slower, so the busiest rank takes its own compute plus this "
        "fraction of the other ranks' (CostModel.busiest_compute_s). 0: each rank has its own device. Calibrated "
        "from every rank's compute when the ranks share a host.",
    )
    backward_corun_slowdown: float | None = Field(
        default=None, ge=0, description="The same in the backward. None: corun_slowdown.",
    )
    compute_noise: float = Field(
        default=0.0, ge=0, le=1,
        description="How much a rank's compute varies from call to call, relative (its standard deviation over its "
        "mean), independently of the other ranks. The slowest rank is then the expected maximum of the ranks' "
        "times (CostModel.busiest_compute_s), which exceeds the largest mean when ranks are near each other: "
        "two balanced ranks with 10 % noise finish 5.6 % after their mean. 0: ranks take their means. Calibrated "
        "from the spread of the ranks' measured compute around the fit, within each call.",
    )
    backward_compute_noise: float | None = Field(
        default=None, ge=0, le=1, description="The same in the backward. None: compute_noise.",
    )
    a2a_shared_medium: bool = Field(
        default=False,
        description="Every rank's all-to-all bytes cross one shared medium (gloo ranks on one host: its loopback and "
        "copies), so a dispatch takes the group's total bytes, not the busiest rank's. False: each rank has its own "
        "links.",
    )
    scale_out_shared: bool = Field(
        default=False,
        description="The scale-out bandwidth is one link per scale-up domain, shared by its ranks (a datacenter's "
        "WAN link): the scale-out level takes the busiest domain's bytes. False: every rank has that bandwidth.",
    )
    dedup_top_k: int | None = Field(
        default=None, ge=1,
        description="Router top-k. Set: the all-to-all sends a token once per destination rank inside a scale-up "
        "domain and once per destination domain across domains (DeepEP), estimated from the counts (tokens of a "
        "source = its assignments / k; choices independent per instance). None: every token-expert pair is sent.",
    )


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
        if topology == self.topology:
            return self
        cache = self.__dict__.setdefault("_retargeted", {})
        cm = cache.get(topology)
        if cm is None or cm.params is not self.params:
            cm = cache[topology] = CostModel(topology, self.hardware, self.expert, self.params)
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
        expert-domain routing."""
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
            return expected_max(corun_finish(np.asarray(t_R, dtype=np.float64), k), noise)
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
        if len(tr) == 0:
            return 0.0
        R = self.topology.num_ranks
        total = 0.0
        for stage in np.unique(tr.stage):
            sel = tr.stage == stage
            send = np.bincount(tr.src[sel], weights=tr.bytes[sel], minlength=R)
            recv = np.bincount(tr.dst[sel], weights=tr.bytes[sel], minlength=R)
            total += max(send.max(), recv.max()) * byte_scale / bandwidth + self.lat_L[0]
        return total

    def replica_tree(self, plan: Plan) -> Transfers:
        """The copy tree of *every* replica of ``plan`` (``plan.transfers`` holds only the copies this
        step needs, e.g. a historical placement moves weights only when it changes)."""
        if len(plan.transfers) >= plan.num_replicas:
            return plan.transfers
        return transfers_for(plan, expert_bytes=int(self.expert_bytes)).transfers

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
        return (np.bincount(tree.src, minlength=R) + np.bincount(tree.dst, minlength=R)).astype(np.float64)

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
            dom_T = np.repeat(T_src.reshape(-1, D).sum(axis=1), D)  # [R] tokens sourced in each rank's domain
            send = np.stack([T_src * (D - 1) / R, T_src * (R - D) / R], axis=1)
            recv = np.stack([(dom_T - T_src) / R, (total - dom_T) / R], axis=1)
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
        mean = tokens.mean() if tokens.size else 0.0
        return CostBreakdown(
            engine_s=engine_s, plan_s=plan_s, weight_sync_s=wsync, sync_exposed_s=sync_exposed, a2a_fwd_s=a2a, compute_fwd_s=compute,
            hybrid_ag_s=ag_s, hybrid_ag_exposed_s=ag_exposed, non_moe_fwd_s=p.non_moe_fwd_s, fwd_s=fwd,
            compute_bwd_s=comp_b, a2a_bwd_s=a2a_b, restore_exposed_s=restore, grad_reduce_s=grad_s,
            grad_reduce_exposed_s=grad_exposed, non_moe_bwd_s=p.non_moe_bwd_s if p.mode == "training" else 0.0,
            copy_s=copy_s, call_overhead_s=overhead, bwd_s=bwd, total_s=fwd + bwd,
            gemm_straggler_s=float(comp_R.max() - comp_R.mean()) if comp_R.size else 0.0,
            token_straggler=float(tokens.max() - mean) if tokens.size else 0.0,
            imbalance=float(tokens.max() / mean) if mean > 0 else 1.0,
            rank_tokens_R=tokens, instances_R=np.asarray(tr.instances_R, dtype=np.float64),
            replicas_R=None if tr.replica_instances_R is None else np.asarray(tr.replica_instances_R, dtype=np.float64),
            moves_R=moves_R,
            sec_per_token=self.sec_per_token,
            replica_tokens=float(np.sum(tr.replica_tokens_R)) if tr.replica_tokens_R is not None else 0.0,
            replica_instances=float(np.sum(tr.replica_instances_R)) if tr.replica_instances_R is not None else 0.0,
        )


#: a call teaches the per-instance cost only when its busiest rank has this many times the tokens of the least busy
#: one (ranks with about equal tokens cannot tell a per-instance cost from a per-token one)
HALF_TOKENS_MIN_SPREAD = 1.3
#: the largest per-instance cost, in tokens, the calibrator learns (a bound against a noisy ratio)
MAX_HALF_TOKENS = 1e5


def half_tokens_from_spread(tokens_R: np.ndarray, instances_R: np.ndarray, measured_ratio: float) -> float | None:
    """The per-instance cost h (tokens) with which the rank with the most tokens (a) and the one with the fewest (b)
    compute in the measured ratio slowest / fastest: ``(n_a + h i_a) / (n_b + h i_b) = ratio``, so
    ``h = (n_a - ratio n_b) / (ratio i_b - i_a)``, kept in [0, :data:`MAX_HALF_TOKENS`]. None when the ranks'
    tokens are too even to tell (:data:`HALF_TOKENS_MIN_SPREAD`) or the ratio is not a number."""
    n = np.asarray(tokens_R, dtype=np.float64)
    i = np.asarray(instances_R, dtype=np.float64)
    busy = np.flatnonzero((n > 0) & (i > 0))
    if busy.size < 2 or not np.isfinite(measured_ratio) or measured_ratio <= 0:
        return None
    a, b = busy[np.argmax(n[busy])], busy[np.argmin(n[busy])]
    if n[a] < HALF_TOKENS_MIN_SPREAD * n[b]:
        return None
    # as h grows from 0 the ratio moves from the tokens' ratio r_n towards the instances' ratio r_i
    r_n, r_i = n[a] / n[b], i[a] / i[b]
    if abs(r_n - r_i) <= 1e-9 * r_n:
        return None
    if (measured_ratio - r_n) * (r_i - r_n) <= 0:  # not moved towards r_i: no per-instance cost explains it
        return 0.0
    if (measured_ratio - r_i) * (r_n - r_i) <= 0:  # at or past r_i: only an unbounded cost would
        return MAX_HALF_TOKENS
    return float(min(MAX_HALF_TOKENS, (n[a] - measured_ratio * n[b]) / (measured_ratio * i[b] - i[a])))


# ---------------------------------------------------------------------------------------------- compute fit
# What expert compute costs, fitted over every rank of every measured call (issue 35).
#
# Legend: R ranks, K slowdowns tried (FIT_SLOWDOWNS), 4 unknowns.
#
# A rank's expert compute, as alone, is ``w_r = a·n_r + b·i_r + d·p_r + e·m_r`` in model seconds: ``n_r`` tokens and
# ``i_r`` active instances at the layer's seconds per token (``CostModel.sec_per_token``), so ``a`` is
# ``compute_scale`` and ``b / a`` the per-instance cost in tokens (``half_tokens``), ``p_r`` replica instances at
# ``d`` seconds each (``replica_instance_s``) and ``m_r`` replica copies the rank sends or receives at ``e`` seconds
# each (``replica_move_s``: on a host, the transport's copies run on the cores that compute; 0 where not modelled).
# Ranks that share one host slow each other while they compute (``CostParams.corun_slowdown`` = k): ordered by work,
# the rank with the least finishes at ``(1 + k (R - 1)) w``, the next that plus ``(1 + k (R - 2))`` times its
# remaining work, and so on. For a fixed k every rank's measured time is linear in ``(a, b, d, e)``, and every rank's
# row is linear in k, so three matrices hold the least-squares sums of every k of FIT_SLOWDOWNS at once, and the best
# k wins.
#
#     Step 1 (:meth:`ComputeFit.add`, every measured call): each rank gives one row, divided by its measured seconds so
#            that every rank weighs by its relative error; older sums decay by FIT_DECAY per call of the same
#            policy and FIT_STALE_DECAY per call of another (the machine drifts, and one policy's calls must not
#            wash out the few of a probed one: :class:`ComputeFit`).
#     Step 2 (:meth:`ComputeFit.solve`): per k the non-negative least squares of the four unknowns (every subset
#            of them tried: 15 small solves, batched over k); the smallest k whose residual is within FIT_TIE of the
#            best one's (balanced calls cannot tell a slowdown from a slower machine: only uneven ones can).
#
# Why: one ratio per uneven call (the slowest rank over the least busy) learned the per-instance cost from a few
# probes, and the scale followed whatever policy ran last, so a balanced policy's run over-predicted ``none`` by 3-7 %
# (2026-11-26 validation). The fit uses every rank of every call, balanced ones too (their instance counts differ).

#: the co-run slowdowns tried (0: ranks do not slow each other)
FIT_SLOWDOWNS = np.round(np.arange(0.0, 1.0001, 0.025), 3)
#: weight of a regime's sums kept from its calls before, per new call of that regime (its last ~20 calls count)
FIT_DECAY = 0.95
#: ...and per call of another regime (a probe's calls keep half their weight for ~35 calls of the policy in force,
#: about one probe period, so a drifting machine still moves the fit)
FIT_STALE_DECAY = 0.98
#: the smallest slowdown whose residual is within this (relative) of the best one's is taken
FIT_TIE = 0.01
#: a call whose ranks' tokens differ by this share of the busiest's or more shows the co-run slowdown (its rows are
#: kept apart: :class:`ComputeFit`); quota's balanced plans are within its ``balance_eps`` (1 %) of their mean, so they
#: stay out. None: nothing kept apart (every call decays alike: the fit before issue 56)
FIT_UNEVEN: float | None = 0.1
#: calls a fit needs before it is used
FIT_MIN_CALLS = 4
#: a solved fit is kept for this many calls (the sums move slowly; a solve costs ~0.15 ms on the decision's path)
FIT_SOLVE_EVERY = 4
#: the unknowns: a (tokens), b (instances), d (replica instances), e (replica copies)
FIT_UNKNOWNS = 4
#: ``[15, 4]`` which unknowns each subset solves for (every non-empty subset)
_FIT_MASKS = np.array([[float(j in sub) for j in range(FIT_UNKNOWNS)] for m in range(1, FIT_UNKNOWNS + 1)
                       for sub in combinations(range(FIT_UNKNOWNS), m)])


@dataclass(frozen=True)
class FittedCompute:
    """One solved fit: the slowdown ``k``, ``a`` (s per model second of tokens), ``b`` (s per instance's model
    second), ``d`` (s per replica instance), ``e`` (s per replica copy sent or received), and the calls behind it."""

    k: float
    a: float
    b: float
    d: float
    calls: int
    noise: float = 0.0  # the ranks' relative spread around the fit within a call (CostParams.compute_noise)
    e: float = 0.0


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


def corun_matrices(t_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[R, R]`` A0, A1 with ``finish_R = (A0 + k A1) @ work_R`` for ranks ordered as ``t_R`` orders them (the rank
    measured last has the most work): rank ``order[j]`` runs ``1 + k (R - m - 1)`` times slower while ``m`` ranks
    have finished, so its finish is ``sum_{m <= j} (1 + k (R - m - 1)) (w_(m) - w_(m-1))``: linear in k."""
    R = t_R.shape[0]
    order = np.argsort(t_R, kind="stable")
    steps = np.eye(R) - np.eye(R, k=-1)  # row m: w_(m) - w_(m-1), in sorted order
    lower = np.tril(np.ones((R, R)))  # finish of the j-th: the sum over m <= j
    slope = (R - 1 - np.arange(R)).astype(np.float64)
    perm = np.eye(R)[order]  # sorted = perm @ unsorted
    A0 = perm.T @ lower @ steps @ perm
    A1 = perm.T @ lower @ (slope[:, None] * steps) @ perm
    return A0, A1


def uneven(tokens_R: np.ndarray, share: float) -> bool:
    """Whether ranks carrying ``tokens_R`` (> 0) differ by ``share`` of the busiest's or more."""
    return tokens_R.size > 1 and float(tokens_R.max() - tokens_R.min()) >= share * float(tokens_R.max())


class _FitSums:
    """The decaying least-squares sums of one regime's calls (see :class:`ComputeFit`)."""

    def __init__(self) -> None:
        U = FIT_UNKNOWNS
        self.G = np.zeros((3, U, U))  # sums of D0'D0, D0'D1 + D1'D0, D1'D1: G(k) = G[0] + k G[1] + k^2 G[2]
        self.g = np.zeros((2, U))  # sums of D0, D1: g(k) = g[0] + k g[1] (the target is 1 per row)
        self.c = 0.0  # rows
        self.H = np.zeros((3, U, U))  # the same sums over rows centred within their call: the ranks' spread
        self.dof = 0.0  # rows minus calls (the spread's degrees of freedom)

    def decay(self, w: float) -> None:
        for acc in (self.G, self.g, self.H):
            acc *= w
        self.c *= w
        self.dof *= w

    def add(self, D0: np.ndarray, D1: np.ndarray) -> None:
        """One call's rows ``[R', U]`` (``D0 + k D1`` per rank, over its measurement)."""
        C0, C1 = D0 - D0.mean(axis=0), D1 - D1.mean(axis=0)  # centred: their fitted values are the ranks' spread
        self.G += np.stack([D0.T @ D0, D0.T @ D1 + D1.T @ D0, D1.T @ D1])
        self.g += np.stack([D0.sum(axis=0), D1.sum(axis=0)])
        self.H += np.stack([C0.T @ C0, C0.T @ C1 + C1.T @ C0, C1.T @ C1])
        self.c += float(D0.shape[0])
        self.dof += float(D0.shape[0]) - 1.0

    @classmethod
    def total(cls, parts) -> "_FitSums":
        out = cls()
        for r in parts:
            out.G += r.G
            out.g += r.g
            out.H += r.H
            out.c += r.c
            out.dof += r.dof
        return out


class ComputeFit:
    """Decaying least-squares sums of every rank's measured compute. Every rank's row is ``D0 + k D1`` (linear in the
    slowdown k), so three matrices and two vectors hold the sums of every k of :data:`FIT_SLOWDOWNS` at once.

    The sums are kept per *regime* (the policy whose plan ran the call): a call decays its own regime's sums by
    FIT_DECAY and the others' only by FIT_STALE_DECAY, and the fit solves over their total. Why: one regime's calls
    (``none``'s: every rank the same instance count) cannot tell a per-instance cost from a slowdown; a probe's
    calls of another policy can, and the policy in force's calls must not decay them away before they are used
    (2026-11-26 validation, tok64: 34 calls of ``none`` after 5 balanced ones left those at 0.95^34 = 17 % of their
    weight, and the fit under-predicted the balanced policies' backward by 13-15 %).

    The co-run slowdown k is kept apart: only *uneven* calls show it (ranks whose tokens differ by FIT_UNEVEN of the
    busiest's or more: on balanced ones every rank finishes at ``(1 + k (R - 1)) w``, which a slower machine
    explains as well). Their rows also go into sums of their own that decay by FIT_DECAY per uneven call and never
    otherwise. The regimes' sums pick k as before: the smallest whose residual is within FIT_TIE of the best one's;
    where several are (the calls weighed now cannot tell them apart) and the uneven sums (once FIT_MIN_CALLS calls
    went there) pick one of them, that one is taken, and the other unknowns are solved at it. Why: a run of balanced
    calls decayed the uneven ones away (FIT_STALE_DECAY leaves 3 % of their weight after 170 calls) and the fit took
    k = 0 and a scale that over-stated ``none``'s cost by 10 % in a 90-step run (issue 56). The scale still follows
    the machine (it is solved from the regimes' decaying sums), and where the calls weighed now do show k, theirs is
    taken."""

    def __init__(self) -> None:
        self._regimes: dict[str, _FitSums] = {}
        self._uneven = _FitSums()  # the uneven calls' rows, decayed only by uneven calls: what k is solved from
        self.uneven_calls = 0
        self.calls = 0
        self._solved: tuple[int, FittedCompute | None] | None = None  # (calls when solved, the fit)

    # the sums over every regime, which the solve reads (summed when read: a solve runs every FIT_SOLVE_EVERY calls)
    G = property(lambda self: sum(r.G for r in self._regimes.values()))
    g = property(lambda self: sum(r.g for r in self._regimes.values()))
    c = property(lambda self: sum(r.c for r in self._regimes.values()))
    H = property(lambda self: sum(r.H for r in self._regimes.values()))
    dof = property(lambda self: sum(r.dof for r in self._regimes.values()))

    def add(self, tokens_R, instances_R, replicas_R, t_R, sec_per_token: float, regime: str = "",
            moves_R=None) -> bool:
        """Fold one call in: ``[R]`` tokens, active instances, replica instances and measured seconds per rank;
        ``regime``: the policy whose plan ran it; ``moves_R``: replica copies each rank sent or received (None: 0).
        Ranks that computed nothing or measured nothing are left out; False when no rank was usable."""
        n, i, p, t = (np.asarray(x, dtype=np.float64) for x in (tokens_R, instances_R, replicas_R, t_R))
        m = np.zeros_like(n) if moves_R is None else np.asarray(moves_R, dtype=np.float64)
        use = (t > 0) & (n > 0)
        if use.sum() == 0 or not np.all(np.isfinite(t)):
            return False
        X = np.stack([n * sec_per_token, i * sec_per_token, p, m], axis=1)  # [R, 4] model seconds
        A0, A1 = corun_matrices(t)
        D0, D1 = ((A @ X)[use] / t[use, None] for A in (A0, A1))  # [R', 4]: each row over its measurement
        for key, sums in self._regimes.items():
            sums.decay(FIT_DECAY if key == regime else FIT_STALE_DECAY)
        self._regimes.setdefault(regime, _FitSums()).add(D0, D1)
        if FIT_UNEVEN is not None and uneven(n[use], FIT_UNEVEN):
            self._uneven.decay(FIT_DECAY)
            self._uneven.add(D0, D1)
            self.uneven_calls += 1
        self.calls += 1
        return True

    def solve(self) -> FittedCompute | None:
        """The best non-negative fit (see the comment above :class:`ComputeFit`), or None before
        :data:`FIT_MIN_CALLS` calls; solved again once :data:`FIT_SOLVE_EVERY` calls were added since the last. A
        solve that fails (no non-negative fit with a token cost: two ranks whose calls all look alike can be fitted
        without one) keeps the last solution: see :meth:`Calibrator._fit_compute` for what mixing did."""
        if self.calls < FIT_MIN_CALLS:
            return None
        if self._solved is not None and self.calls - self._solved[0] < FIT_SOLVE_EVERY:
            return self._solved[1]
        fit = self._solve()
        if fit is None and self._solved is not None:
            fit = self._solved[1]
        self._solved = (self.calls, fit)
        return fit

    def _solve(self) -> FittedCompute | None:
        total = _FitSums.total(self._regimes.values())
        got = _best_per_slowdown(total)
        if got is None:
            return None
        best_r, best_w = got
        near = _near_best(best_r, total.c)  # the slowdowns the calls cannot tell from the best
        kk = int(near[0])
        if self.uneven_calls >= FIT_MIN_CALLS and near.size > 1:  # the one the uneven calls showed, if it is one
            kept = _best_per_slowdown(self._uneven)
            if kept is not None:
                kept_k = int(_near_best(kept[0], self._uneven.c)[0])
                kk = kept_k if kept_k in near else kk
        if not np.isfinite(best_r[kk]) or best_w[kk, 0] <= 0:
            return None
        a, b, d, e = (float(x) for x in best_w[kk])
        k_ = float(FIT_SLOWDOWNS[kk])
        # the ranks' relative spread within a call: a rank's residual minus its call's mean residual is C w (the
        # target, 1 per row, centres to 0), so its mean square is w' H(k) w over the degrees of freedom
        H = total.H
        spread = float(best_w[kk] @ (H[0] + k_ * H[1] + k_ * k_ * H[2]) @ best_w[kk])
        noise = float(np.sqrt(max(spread, 0.0) / total.dof)) if total.dof > 0 else 0.0
        return FittedCompute(k_, a, b, d, self.calls, min(noise, 1.0), e)


def _best_per_slowdown(sums: _FitSums) -> tuple[np.ndarray, np.ndarray] | None:
    """``([K], [K, 4])`` per slowdown of FIT_SLOWDOWNS the least residual of a non-negative fit of ``sums`` and its
    unknowns (inf where none is feasible), or None where no k has one."""
    K = len(FIT_SLOWDOWNS)
    k = FIT_SLOWDOWNS[:, None]
    G, g = sums.G, sums.g
    GK = G[0] + FIT_SLOWDOWNS[:, None, None] * G[1] + (FIT_SLOWDOWNS ** 2)[:, None, None] * G[2]  # [K, U, U]
    gK = g[0] + k * g[1]  # [K, U]
    # every subset of the unknowns for every k in one batched solve: an unknown left out of a subset gets the
    # identity row and a 0 right-hand side, so it solves to 0
    # (solved in unknowns scaled to a unit diagonal: tokens, instances and replicas differ by orders of magnitude)
    diag = np.einsum("kii->ki", GK)
    u = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 1.0)  # [K, U]
    U = FIT_UNKNOWNS
    GU = GK * u[:, :, None] * u[:, None, :] + 1e-12 * np.eye(U)
    M = _FIT_MASKS[:, None, :]  # [S, 1, U]
    sel = M[..., :, None] * M[..., None, :]  # [S, 1, U, U]
    A = np.where(sel > 0, GU[None], np.eye(U))  # [S, K, U, U]
    try:
        W = np.linalg.solve(A, (gK * u)[None, ..., None] * M[..., None])[..., 0] * u[None]  # [S, K, U]
    except np.linalg.LinAlgError:
        return None
    resid = np.einsum("ski,kij,skj->sk", W, GK, W) - 2 * np.einsum("ski,ki->sk", W, gK) + sums.c  # [S, K]
    feasible = (W >= 0).all(axis=2) & (W.sum(axis=2) > 0)
    resid = np.where(feasible, resid, np.inf)
    s_best = resid.argmin(axis=0)  # [K]
    best_r = resid[s_best, np.arange(K)]
    if not np.isfinite(best_r).any():
        return None
    return best_r, W[s_best, np.arange(K)]


def _near_best(best_r: np.ndarray, rows: float) -> np.ndarray:
    """The indices of the slowdowns whose residual is within FIT_TIE of the best one's, smallest first (balanced
    calls cannot tell a slowdown from a slower machine: all of them are)."""
    floor = max(float(best_r.min()), 0.0)
    return np.flatnonzero(best_r <= floor * (1 + FIT_TIE) + 1e-9 * rows)


# ---------------------------------------------------------------------------------------------- calibration
#: measured timing key → the CostParams scale it calibrates
CALIBRATED_TERMS: dict[str, str] = {
    "compute_fwd_s": "compute_scale",
    "a2a_fwd_s": "a2a_scale",
    "weight_sync_s": "weight_sync_scale",
    "grad_reduce_s": "grad_reduce_scale",
    "plan_s": "plan_scale",
}  # copy_s calibrates copy_scale with copy_call_s as a line (Calibrator._copy)


#: the least spread (root mean square relative) of the calls' copied bytes that separates the copies' per-call part
#: from their per-byte part (Calibrator._copy): 2 experts moved in 1 call of 10 and 4 in the others spread 15 %
COPY_SPREAD = 0.05
#: the least copy_scale (CostParams.copy_scale > 0): copies that did not grow with their bytes
COPY_SCALE_FLOOR = 1e-3

#: measured backward term → (the CostParams factor it calibrates, the forward term the factor multiplies)
FACTOR_TERMS: dict[str, tuple[str, str]] = {
    "compute_bwd_s": ("backward_compute_factor", "compute_fwd_s"),
    "a2a_bwd_s": ("backward_a2a_factor", "a2a_fwd_s"),
}

#: the least busy rank's measured compute (the runtime reports it beside the slowest rank's) → (the slowest rank's
#: term, the per-instance cost it calibrates, whether it is the backward's)
FASTEST_TERMS: dict[str, tuple[str, str, bool]] = {
    "compute_fwd_fastest_s": ("compute_fwd_s", "half_tokens", False),
    "compute_bwd_fastest_s": ("compute_bwd_s", "backward_half_tokens", True),
}


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


#: the measured terms a call's layer time is the sum of on its critical path (besides the runtime's own overhead)
SUMMED_TERMS = ("compute_fwd_s", "compute_bwd_s", "a2a_fwd_s", "a2a_bwd_s", "copy_s", "plan_s")


def moves_weights(weight_sync_s: float, copy_s: float, grad_reduce_s: float) -> bool:
    """Whether a call whose plan costs these predicted seconds moves expert weights (sends replicas or moved experts,
    copies them, reduces replica gradients back): such a call pays :attr:`CostParams.transfer_call_overhead_s`."""
    return weight_sync_s > 0 or copy_s > 0 or grad_reduce_s > 0


def call_residual(measured: dict[str, float], total_s: float) -> float:
    """Seconds of a call's measured layer time ``total_s`` outside its measured terms (``measured``, the
    :data:`ultraep.timings.TERMS` a runtime reports): the load all-gather, rerouting, permute/unpermute and the
    glue between phases, which no term models. The replica weights' exposed wait is in it too (the runtime reports
    the transfer's flight time, not its exposed part); it is 0.1 ms against 20-30 ms on the gloo runtime. >= 0."""
    return max(0.0, float(total_s) - sum(float(measured.get(k, 0.0)) for k in SUMMED_TERMS))


#: calibration rows a :class:`Calibrator` keeps in ``history`` (the newest; ~10 per observed call)
HISTORY_ROWS = 4096


class Calibrator:
    """Learns the per-term scales of :class:`CostParams` from measured timings.

    Estimator (per term k with a measurement): ``log s_k ← (1 - α) · log s_k + α · log(m_k / u_k)`` where
    ``u_k`` is the *unscaled* model prediction (``predicted_k / s_k``) and ``m_k`` the measurement: an EWMA
    of the log ratio, whose weight is ``max(α, 1/n)`` for the n-th observation of a term (a running mean
    first, so a few observations replace the seed figures instead of nudging them). ``compute_bwd_s`` measurements update ``backward_compute_factor`` the same way
    (ratio to the forward compute). Terms predicted or measured as 0 are skipped.

    Three terms are additive seconds, not scales, and use the same weights on the seconds themselves:
    ``call_overhead_s`` and ``transfer_call_overhead_s`` from the call's layer time minus its measured terms
    (:func:`call_residual`; the runtime's load all-gather, reroute and permute, which no term covers; kept apart for
    the calls that move expert weights and those that do not: :meth:`_call_overhead`), and ``engine_overhead_s``
    from the measured ``plan_s`` of a call whose plan carries an engine cost (``engine_s > 0``: an adaptive
    decision) minus the planner figures the model already charges it; such a call leaves ``plan_scale`` to the fixed
    plans. The host copies are a line, ``copy_call_s`` plus ``copy_scale`` times their per-byte part, fitted by least
    squares with the same weights (:meth:`_copy`).

    ``weight_sync_s`` (the flight) is an upper bound unless the runtime blocked on it, and ``weight_wait_s`` (the
    exposed wait) bounds the exposure the model may predict: see :meth:`_weight_sync_target`.

    Args:
        model: the cost model whose params are calibrated (a new model is kept in :attr:`model`).
        alpha: weight of the newest observation (0 < alpha <= 1).
        recorder: optional telemetry recorder; every observation is recorded with ``record_timings``
            as ``predicted.<term>`` next to ``measured.<term>``.
    """

    def __init__(self, model: CostModel, alpha: float = 0.2, recorder=None) -> None:
        if not 0.0 < alpha <= 1.0:
            from ultraep.errors import ConfigError

            raise ConfigError("calibration.alpha", f"alpha ({alpha}) must be in (0, 1]", alpha)
        self.model = model
        self.alpha = float(alpha)
        self.recorder = recorder
        #: the last HISTORY_ROWS calibration rows (bounded: a run of 10^5 calls kept ~10^6 rows)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        self._n: dict[str, int] = {}  # observations per scale: the first ones weigh 1/n (a running mean)
        self._overhead: dict[str, float] = {}  # the residual per kind of call (_call_overhead)
        # the copies' weighted sums (1, x, y, x², x·y) of the per-byte part x and the measured copies y (_copy)
        self._copy_sums = np.zeros(5)
        # every rank's compute, forward and backward, fitted over the calls (ComputeFit)
        self.fits = {"compute_fwd_s": ComputeFit(), "compute_bwd_s": ComputeFit()}

    def _alpha(self, name: str) -> float:
        n = self._n.get(name, 0)
        self._n[name] = n + 1
        return max(self.alpha, 1.0 / (n + 1))

    def _call_overhead(self, predicted: CostBreakdown, resid: float) -> dict[str, float]:
        """``call_overhead_s`` and ``transfer_call_overhead_s`` after a call's residual ``resid``: each kind of call
        (moving expert weights or not: :func:`moves_weights`) keeps its own running estimate with the weights of the
        other additive terms; ``call_overhead_s`` is that of the calls that move none (that of the others until one
        ran), ``transfer_call_overhead_s`` the difference (0 until both kinds ran). Why two: the calls that move
        weights post the weight and gradient sends (3.0-4.3 and 3.4-7.6 ms on 2 gloo ranks); one estimate learned
        from a run of mostly one kind mispredicted the other by 1.3-2.9 ms a call at 64 tokens per rank (2026-11-27:
        the fixed policies' layer time up to 10 % short)."""
        kind = "transfer" if moves_weights(predicted.weight_sync_s, predicted.copy_s, predicted.grad_reduce_s) \
            else "plain"
        self._overhead[kind] = self._fold(f"call_overhead_s.{kind}", self._overhead.get(kind, 0.0), resid)
        plain, transfer = self._overhead.get("plain"), self._overhead.get("transfer")
        if plain is None:
            return {"call_overhead_s": transfer, "transfer_call_overhead_s": 0.0}
        return {"call_overhead_s": plain,
                "transfer_call_overhead_s": 0.0 if transfer is None else transfer - plain}

    def _copy(self, predicted: CostBreakdown, measured: float, updates: dict[str, float]) -> dict[str, Any]:
        """``copy_call_s`` and ``copy_scale`` from one call's measured replica copies: a line ``y = copy_call_s +
        copy_scale · x`` fitted by least squares over the calls whose plan copies (``x`` the per-byte part unscaled,
        the calls weighted as the other terms' observations). Where the calls' ``x`` spread less than
        ``COPY_SPREAD`` of their root mean square (one plan's copies) they cannot tell the two parts apart: the
        per-call part stays, the scale takes the rest. Why a per-call part: on 2 gloo ranks a call moving 4 experts
        copied 6.3-8.1 ms and one moving 2 copied 4.9-7.3 (2026-11-27, each run's and shape's mean, 7 shapes, 4 runs);
        one scale learned on a run of mostly one of them mispredicted the other by up to 4.7 ms a call."""
        p = self.model.params
        row = {"term": "copy_s", "predicted_s": predicted.copy_s, "measured_s": measured,
               "ratio": measured / predicted.copy_s if predicted.copy_s > 0 else float("nan")}
        x = 0.0 if predicted.moves_R is None else self.model.copy_bytes_time(predicted.moves_R)
        if x <= 0 or measured <= 0:
            return row  # the model copies nothing here (no replicas, or copies that overlap on a GPU), or none measured
        a = self._alpha("copy_s")
        self._copy_sums = (1 - a) * self._copy_sums + a * np.array([1.0, x, measured, x * x, x * measured])
        _, sx, sy, sxx, sxy = self._copy_sums
        var = sxx - sx * sx
        if var > COPY_SPREAD ** 2 * sxx:  # the calls copied different bytes: both parts
            scale = (sxy - sx * sy) / var
            call_s = sy - scale * sx
            if scale <= 0:  # more bytes were not slower: all per call
                call_s, scale = sy, COPY_SCALE_FLOOR
            elif call_s < 0:  # a line through the origin
                call_s, scale = 0.0, sxy / sxx
        else:
            call_s = min(p.copy_call_s, sy)
            scale = (sy - call_s) / sx
        updates["copy_call_s"] = float(call_s)
        updates["copy_scale"] = float(max(scale, COPY_SCALE_FLOOR))
        return row

    def _fold(self, name: str, old: float, new: float) -> float:
        """An additive term's next value: ``new`` folded into ``old`` with the weight of ``name``'s next observation."""
        a = self._alpha(name)
        return (1 - a) * old + a * new

    def _fold_log(self, name: str, old: float, new: float) -> float:
        """A scale's or factor's next value: ``new`` folded into ``old`` in log space (geometric), with the weight of
        ``name``'s next observation."""
        a = self._alpha(name)
        return math.exp((1 - a) * math.log(old) + a * math.log(new))

    @property
    def params(self) -> CostParams:
        return self.model.params

    def _replica_instance(self, predicted: CostBreakdown, measured: float, updates: dict[str, float]) -> dict[str, Any]:
        """``replica_instance_s`` from the replicas' measured forward compute, summed over the ranks: what it exceeds
        their tokens' predicted compute by, per active replica instance (>= 0), folded in with the weights of the other
        additive terms."""
        cm, p = self.model, self.model.params
        n, i = predicted.replica_tokens, predicted.replica_instances
        tokens_s = float(cm.compute_time_R(np.array([n]), np.array([i]))[0])
        pred = tokens_s + p.replica_instance_s * i
        if i > 0 and measured > 0:
            updates["replica_instance_s"] = self._fold("replica_instance_s", p.replica_instance_s,
                                                       max(0.0, (measured - tokens_s) / i))
        return {"term": "replica_compute_s", "predicted_s": pred, "measured_s": measured,
                "ratio": measured / pred if pred > 0 else float("nan")}

    def _weight_sync_target(self, predicted: CostBreakdown, measured: dict[str, float], flight: float) -> float | None:
        """The ``weight_sync_scale`` one call's replica weights point to, or None when it says nothing.

        The runtime's flight is post -> first seen complete, and it looks when it waits: after the dispatch and the
        masters. Its exposed wait (``weight_wait_s``, when measured) is what the critical path paid.

        - The model exposes more than the runtime waited: the copy hid more than the model's window lets it. The
          scale drops to the one whose exposure is the measured wait; it never rises this way. (A flight of 0, the
          copies complete when posted as on gloo, says the same: nothing was waited for.) Without this the scale the
          flights taught exposed 12-15 ms per call that the runtime never waited (quota, 64 tokens per rank,
          2026-11-26: +6 to +13 % on its layer time).
        - The runtime blocked (its wait is over 5 % of the flight): the flight ended when the wait did, a measurement.
        - It did not block, or no wait is known and the flight ended inside the forward's all-to-all and compute: an
          upper bound, which may lower the scale, never raise it (a quiet gloo run once fitted 12x to such flights,
          predicting 8 ms of exposed wait where the runtime waited 0.1 ms)."""
        old = self.model.params.weight_sync_scale
        pv = predicted.weight_sync_s
        if pv <= 0:
            return None
        wait = measured.get("weight_wait_s")
        if wait is None and flight <= 0:
            wait = 0.0
        if wait is not None and predicted.sync_exposed_s > wait:
            hidden = (pv - predicted.sync_exposed_s + wait) / pv
            return old * hidden if hidden > 0 else None
        if flight <= 0:
            return None
        if wait is not None:
            blocked = wait > 0.05 * flight
        else:
            blocked = flight > measured.get("a2a_fwd_s", 0.0) + measured.get("compute_fwd_s", 0.0)
        if not blocked and flight >= pv:
            return None  # an upper bound above the prediction: nothing learned
        return old * flight / pv

    def _half_tokens(self, predicted: CostBreakdown, measured: dict[str, float], key: str, fastest: float,
                     updates: dict[str, float]) -> dict[str, Any]:
        """``half_tokens`` (or ``backward_half_tokens``) from the slowest and the fastest rank of a call whose ranks
        carry unequal tokens (:func:`half_tokens_from_spread`), folded in with the weights of the other terms; the
        row puts the least busy rank's predicted compute next to the measured one."""
        slow_key, name, backward = FASTEST_TERMS[key]
        cm, p = self.model, self.model.params
        n, i = predicted.rank_tokens_R, predicted.instances_R
        pred = float("nan")
        if n is not None and i is not None and np.any(n > 0):
            t_R = cm.compute_time_R(n, i, backward=backward) * (p.backward_compute_factor if backward else 1.0)
            pred = float(t_R[n > 0].min())
            slowest = float(measured.get(slow_key, 0.0))
            if fastest > 0 and slowest > 0:
                h = half_tokens_from_spread(n, i, slowest / fastest)
                if h is not None:
                    updates[name] = self._fold(name, cm.half_tokens_bwd if backward else cm.half_tokens, h)
        return {"term": key, "predicted_s": pred, "measured_s": fastest,
                "ratio": fastest / pred if pred > 0 else float("nan")}

    def _fit_compute(self, predicted: CostBreakdown, rank_compute_s: dict[str, np.ndarray],
                     policy: str = "") -> dict[str, float]:
        """Fold every rank's measured compute into the fits; once the forward's is solved, the compute parameters it
        and the backward's give (``compute_scale``, ``half_tokens``, ``replica_instance_s``, ``replica_move_s``,
        ``corun_slowdown``, ``compute_noise`` and their backward counterparts) replace what the call-level ratios
        learned. {} while the fits lack calls.

        A fit whose solve fails keeps its last solution (:meth:`ComputeFit.solve`), and the backward's parameters,
        relative to the forward's scale, are derived from both fits' current solutions every call. Why: left to the
        call-level ratios, a backward factor learned against the forward's old scale met a forward solved anew (3x the scale, no per-instance cost) and the
        model predicted a backward 3x its measure for four calls (2026-11-27, 64 tokens per rank, feplb: 158 ms
        against 50), and a run that ended in such a state left that model to ``simulate --topology from-run``."""
        n, i = predicted.rank_tokens_R, predicted.instances_R
        if n is None or i is None or predicted.sec_per_token <= 0:
            return {}
        rep = predicted.replicas_R if predicted.replicas_R is not None else np.zeros_like(n)
        for key, t_R in rank_compute_s.items():
            if key in self.fits and t_R is not None and len(t_R) == len(n):
                self.fits[key].add(n, i, rep, t_R, predicted.sec_per_token, regime=policy, moves_R=predicted.moves_R)
        fwd = self.fits["compute_fwd_s"].solve()
        if fwd is None:
            return {}
        out = {"compute_scale": fwd.a, "half_tokens": fwd.b / fwd.a, "replica_instance_s": fwd.d,
               "replica_move_s": fwd.e, "corun_slowdown": fwd.k, "compute_noise": fwd.noise}
        bwd = self.fits["compute_bwd_s"].solve()
        if bwd is not None and bwd.a > 0:
            out.update(backward_compute_factor=bwd.a / fwd.a, backward_half_tokens=bwd.b / bwd.a,
                       backward_replica_instance_s=bwd.d * fwd.a / bwd.a,  # before the factor, as the model applies it
                       backward_replica_move_s=bwd.e * fwd.a / bwd.a,
                       backward_corun_slowdown=bwd.k, backward_compute_noise=bwd.noise)
        return out

    def observe(self, predicted: CostBreakdown, measured: dict[str, float], *, step: int = 0, microbatch: int = 0,
                layer: int = 0, total_s: float | None = None,
                rank_compute_s: dict[str, np.ndarray] | None = None, policy: str = "") -> list[dict[str, Any]]:
        """Fold one layer's measured timings in; return the rows ``term, predicted_s, measured_s, ratio``.
        ``total_s``: the call's measured layer time, which calibrates ``call_overhead_s`` (see :func:`call_residual`).
        ``rank_compute_s``: every rank's measured expert compute, ``{"compute_fwd_s": [R], "compute_bwd_s": [R]}``
        (the runtime's); with it the compute parameters come from the fit over every rank of every call
        (:class:`ComputeFit`), not from the slowest and the least busy rank of this one. ``policy``: the policy whose
        plan ran the call (the fit keeps each policy's calls apart)."""
        p = self.model.params
        pred = predicted.as_dict()
        updates: dict[str, float] = {}
        rows = []
        if total_s is not None and total_s > 0:  # the runtime's work outside every measured term: additive seconds
            resid = call_residual(measured, total_s)
            updates.update(self._call_overhead(predicted, resid))
            rows.append({"term": "call_overhead_s", "predicted_s": pred.get("call_overhead_s", 0.0),
                         "measured_s": resid, "ratio": float(resid / pred["call_overhead_s"])
                         if pred.get("call_overhead_s") else float("nan")})
        for key, value in measured.items():
            if key == "plan_s" and predicted.engine_s > 0:
                # an engine's plan: the measured plan_s is its whole decision, the planning of the chosen candidate
                # (plan_s), the candidates planned beyond it and its own overhead (engine_s). The planner figures
                # keep the scale fixed plans calibrate; the remainder is the engine's overhead (additive seconds).
                whole = pred.get("plan_s", 0.0) + predicted.engine_s
                planned_beyond = predicted.engine_s - p.engine_overhead_s
                own = max(0.0, float(value) - pred.get("plan_s", 0.0) - planned_beyond)
                updates["engine_overhead_s"] = self._fold("engine_overhead_s", p.engine_overhead_s, own)
                rows.append({"term": key, "predicted_s": whole, "measured_s": float(value),
                             "ratio": float(value / whole) if whole > 0 else float("nan")})
                continue
            if key == "weight_wait_s":  # the replica weights' exposed wait: next to the exposure the model predicts
                rows.append({"term": key, "predicted_s": predicted.sync_exposed_s, "measured_s": float(value),
                             "ratio": float(value / predicted.sync_exposed_s) if predicted.sync_exposed_s > 0
                             else float("nan")})
                continue
            if key == "replica_compute_s":  # every rank's replicas: what a replica costs beyond its tokens
                rows.append(self._replica_instance(predicted, float(value), updates))
                continue
            if key in FASTEST_TERMS:  # the least busy rank's compute: what an instance costs beyond its tokens
                rows.append(self._half_tokens(predicted, measured, key, float(value), updates))
                continue
            if key in FACTOR_TERMS:  # a backward term: its ratio to the prediction before the factor
                factor, fwd_key = FACTOR_TERMS[key]
                base = pred.get(key, 0.0) / getattr(p, factor)  # the backward's prediction before the factor...
                if pred.get(fwd_key, 0.0) > 0 and measured.get(fwd_key, 0.0) > 0:
                    # ...at the forward's measured scale: the factor is the backward over the same call's forward,
                    # whatever the scales (learned in this very observation) predicted
                    base *= float(measured[fwd_key]) / pred[fwd_key]
                if base > 0 and value > 0:
                    updates[factor] = self._fold_log(factor, getattr(p, factor), value / base)
                    rows.append({"term": key, "predicted_s": pred.get(key, 0.0), "measured_s": float(value),
                                 "ratio": float(value / pred[key]) if pred.get(key) else float("nan")})
                continue
            if key == "copy_s":  # the replica copies: a part per call and a part per byte (_copy)
                rows.append(self._copy(predicted, float(value), updates))
                continue
            scale_name = CALIBRATED_TERMS.get(key)
            pv = pred.get(key, 0.0)
            if scale_name is None:
                rows.append({"term": key, "predicted_s": pv, "measured_s": float(value), "ratio": float("nan")})
                continue
            rows.append({"term": key, "predicted_s": pv, "measured_s": float(value),
                         "ratio": float(value / pv) if pv > 0 else float("nan")})
            if key == "weight_sync_s":
                target = self._weight_sync_target(predicted, measured, float(value))
                if target is not None:
                    updates[scale_name] = self._fold_log(scale_name, p.weight_sync_scale, target)
                continue
            if pv <= 0 or value <= 0:
                continue
            old = getattr(p, scale_name)
            updates[scale_name] = self._fold_log(scale_name, old, value / (pv / old))
        if rank_compute_s:
            updates.update(self._fit_compute(predicted, rank_compute_s, policy))
        if updates:
            self.model = self.model.with_params(p.model_copy(update=updates))
        self.history.extend({"step": step, "microbatch": microbatch, "layer": layer, **r} for r in rows)
        if self.recorder is not None:
            timings = {f"predicted.{r['term']}": r["predicted_s"] for r in rows}
            timings.update({f"measured.{r['term']}": r["measured_s"] for r in rows})
            self.recorder.record_timings(step, microbatch, layer, timings)
        return rows


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
