"""The cost model's coefficients: :class:`CostParams`, the calibrated ``*_scale`` multipliers and additive seconds
(what :class:`~ultraep.cost.calibrator.Calibrator` learns) and the modelling choices (mode, overlaps, shared links,
de-duplication). The terms they enter are listed in :mod:`ultraep.cost.model`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    excess_s: float = Field(
        default=0.0,
        description="Mean seconds a call's measured layer time exceeds the sum of its predicted terms: what the "
        "terms, each right at its typical call, leave out of the mean (heavy-tailed all-to-alls, the slowest of the "
        "ranks' noisy compute, the decision's bookkeeping outside the planner's figures). Added where a prediction "
        "stands for a time (a call's recorded prediction, its decision's predictions: ``cost.with_excess``), never "
        "to the comparison of candidates; learned from each call's measured layer time (``Calibrator``, weight "
        "``EXCESS_WEIGHT``); 0 (the presets) until a call was measured. May be negative (a model that "
        "over-predicts).",
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
