"""Balancer configuration (pydantic v2): frozen, ``extra="forbid"``, a description per field.

The per-layer policy is a discriminated union on ``kind``. Cross-field rules that need the EP group's
shape (slots versus ranks) are checked by :meth:`BalancerConfig.validate_for`, with messages that name the
field path, both values and the fix. The validated config and its :meth:`~BalancerConfig.digest` are
stored with every run. No behaviour hides in environment variables.
"""

from __future__ import annotations

import difflib
import hashlib
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ultraep.errors import ConfigError

PolicyName = Literal["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]
CandidateName = Literal["none", "quota", "eplb", "feplb", "hybridep"]
RelayMode = Literal["auto", "direct", "always"]
#: the policies the simulator replays, in its table order, and its default budget of replayed layer-steps
#: (here, not in ``ultraep.sim.replay``, so that building the CLI imports neither numba nor the cost model)
ALL_POLICIES = ("none", "eplb", "quota", "feplb", "hybridep", "adaptive")
DEFAULT_MAX_PLANS = 30_000
#: a from-run figure's 90 % interval: the default resamples behind it and the fewest that can place a 5th percentile
#: (``ultraep.sim.uncertainty``; here for the same reason)
DEFAULT_RESAMPLES = 400
MIN_RESAMPLES = 20

# Strict scalars: lax pydantic turns ``True`` into 1 and ``2.0`` or ``"2"`` into 2, which hides mistakes
# (``num_redundant_slots=True``). Floats still take ints (1 means 1.0); none takes a bool or a string.
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]
StrictBool = Annotated[bool, Strict()]


class _Model(BaseModel):
    """Frozen, ``extra="forbid"``, and an unknown field names the closest known one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _suggest_fields(cls, data, handler):
        try:
            return handler(data)
        except ValidationError as exc:
            errors = exc.errors()
            if not any(e["type"] == "extra_forbidden" for e in errors):
                raise
            raise ValidationError.from_exception_data(exc.title, [_with_hint(cls, e) for e in errors]) from None


def _with_hint(cls: type[BaseModel], err: dict) -> InitErrorDetails:
    """Rebuild one pydantic error; an unknown key of ``cls`` itself (loc of length 1) gets a hint, an
    unknown key deeper down keeps the message its own model gave it."""
    if err["type"] != "extra_forbidden":
        extra = {"ctx": err["ctx"]} if "ctx" in err else {}
        return InitErrorDetails(type=err["type"], loc=err["loc"], input=err["input"], **extra)
    msg = err["msg"]
    if len(err["loc"]) == 1:
        fields = [f for f in cls.model_fields if f != "kind"]
        close = difflib.get_close_matches(str(err["loc"][0]), fields, n=1, cutoff=0.6)
        msg += f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(fields)}"
    kind = PydanticCustomError("extra_forbidden", msg.replace("{", "{{").replace("}", "}}"))
    return InitErrorDetails(type=kind, loc=err["loc"], input=err["input"])


class _Options(_Model):

    def policy_options(self) -> dict:
        """Keyword arguments for the policy class (everything but ``kind`` and slot overrides)."""
        return self.model_dump(exclude={"kind", "num_redundant_slots"})


class NoneOptions(_Options):
    """No balancing."""

    kind: Literal["none"] = "none"


class QuotaOptions(_Options):
    """Exact-load real-time balancing (UltraEP quota planner)."""

    kind: Literal["quota"] = "quota"
    num_redundant_slots: StrictInt | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    balance_eps: StrictFloat = Field(
        default=0.01, ge=0.0, le=1.0, description="Fast-path target: rank load <= (1 + eps) * mean."
    )
    min_replica_quota: StrictInt = Field(
        default=1, ge=1, description="Smallest quota (tokens) a new replica may carry, on top of the dynamic floor."
    )
    relay: RelayMode = Field(default="auto", description="Weight transfer: relay tree when it pays, direct, or always.")
    cache_tolerance: StrictFloat = Field(
        default=0.02, ge=0.0, description="Reuse resident replicas (no weight transfer) when the planned max rank load "
        "is at most this fraction of the mean rank load above the plan that ignores them (0.02: on persistent "
        "skew, 96-100 % of replicas reused at 3072+ tokens per rank for a 0.4-0.5 % higher max load).",
    )


class EplbOptions(_Options):
    """Historical balancing (DeepSeek EPLB placement, even token split)."""

    kind: Literal["eplb"] = "eplb"
    num_redundant_slots: StrictInt | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    interval: StrictInt = Field(default=50, ge=1, description="Steps between re-placements.")
    window: StrictInt = Field(default=50, ge=1, description="Past steps averaged for the load estimate.")
    ewma: StrictFloat | None = Field(
        default=None, gt=0.0, le=1.0, description="Use an EWMA with this weight on the newest load instead of a window."
    )
    use_current_load: StrictBool = Field(
        default=False, description="Plan from the current exact load (EPLB+ baseline) instead of history."
    )
    relay: RelayMode = Field(default="auto", description="Weight transfer: relay tree when it pays, direct, or always.")


class FeplbOptions(_Options):
    """Whole-expert intra-domain moves (FEPLB, arXiv 2604.19654)."""

    kind: Literal["feplb"] = "feplb"
    num_redundant_slots: StrictInt | None = Field(
        default=None, ge=0, description="Override of the dynamic-expert buffers per rank (default: global slots)."
    )
    num_dynamic: StrictInt = Field(default=4, ge=0, description="Dynamic (movable) experts per rank; the rest are static.")
    min_tokens: StrictInt = Field(default=1, ge=0, description="Smallest expert load (tokens) worth moving (FEPLB's tau).")
    ewma: StrictFloat = Field(
        default=0.3, gt=0.0, le=1.0, description="Weight of the newest load in the predictor of dynamic experts."
    )


class HybridEPOptions(_Options):
    """Hybrid expert/token transmission over slow links (HybridEP, arXiv 2510.19470)."""

    kind: Literal["hybridep"] = "hybridep"
    domain_sizes: tuple[Annotated[StrictInt, Field(ge=1)], ...] | None = Field(
        default=None, min_length=1,
        description="Candidate expert-domain sizes in scale-out domains (default: all divisors); not empty.",
    )
    compression: StrictFloat = Field(default=1.0, ge=1.0, description="Expert compression ratio for the all-gather.")


class AdaptiveOptions(_Options):
    """Per-layer choice of the cheapest policy by the cost model, with hysteresis."""

    kind: Literal["adaptive"] = "adaptive"
    num_redundant_slots: StrictInt | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    candidates: tuple[CandidateName, ...] = Field(
        default=("none", "quota", "eplb", "feplb", "hybridep"), description="Policies to choose from (need 'none')."
    )
    margin: StrictFloat = Field(default=0.005, ge=0.0, description="Relative gain below which the current policy stays.")
    patience: StrictInt = Field(default=2, ge=1, description="Consecutive wins a better policy needs before a switch.")
    switch_now: StrictFloat = Field(default=0.02, ge=0.0, description="Relative gain that switches immediately.")
    deadline_s: StrictFloat | None = Field(
        default=None, gt=0.0, description="Planning + weight sync later than this falls back to 'none' (seconds)."
    )
    screen: StrictBool = Field(default=True, description="Skip planning candidates that cannot pay for their planner.")
    probe_every: StrictInt = Field(
        default=32, ge=0,
        description="A candidate not run for this many decisions runs once to be measured (0: never probe).",
    )
    probe_max_loss: StrictFloat = Field(
        default=0.25, ge=0.0,
        description="Probe only candidates predicted at most this much slower than the best (bounds the regret).",
    )
    probe_share: StrictFloat | None = Field(
        default=0.05, ge=0.0, le=1.0,
        description="Probes may run on at most this share of the decisions, over the run, beside one per candidate "
        "(null: every due candidate within probe_max_loss is probed).",
    )
    probe_cost_share: StrictFloat | None = Field(
        default=0.02, ge=0.0, le=1.0,
        description="Probes' predicted seconds over the policy in force may sum to at most this share of its predicted "
        "time so far, at every decision from the first; the cheapest due probe runs first, none in the first 2 calls "
        "(null: probes are paced only by probe_share, every rival probed from the second call).",
    )
    probe_regret: StrictFloat | None = Field(
        default=0.0025, gt=0.0, le=1.0,
        description="A rival measured a few times is probed again once the decisions since it ran pay for its probe "
        "(its predicted loss over the policy in force plus two weighings) at this share of the policy in force's time "
        "each, however far behind it is predicted: every probe_every to 8 x probe_every decisions (null: every "
        "probe_every decisions, only within probe_max_loss).",
    )
    outcome_window: StrictInt = Field(
        default=5, ge=1,
        description="A candidate's measured/predicted layer-time ratio is the median of its last this many runs.",
    )
    explore_share: StrictFloat | None = Field(
        default=0.003, ge=0.0,
        description="With 'none' in force and no candidate in contention, weighing the candidates may cost this share "
        "of the run's layer time, over the run, not per decision (null: every decision weighs).",
    )
    explore_of_gain: StrictFloat = Field(
        default=0.1, ge=0.0,
        description="... plus this share of what weighing found so far (the best candidate's predicted saving over "
        "the policy in force).",
    )


LayerPolicy = Annotated[
    Union[NoneOptions, QuotaOptions, EplbOptions, FeplbOptions, HybridEPOptions, AdaptiveOptions],
    Field(discriminator="kind"),
]

_DEFAULTS: dict[str, type[_Options]] = {
    "none": NoneOptions, "quota": QuotaOptions, "eplb": EplbOptions,
    "feplb": FeplbOptions, "hybridep": HybridEPOptions, "adaptive": AdaptiveOptions,
}


class BalancerConfig(_Model):
    """How ultraep balances every MoE layer."""

    policy: PolicyName = Field(default="quota", description="Policy of every layer without an override.")
    num_redundant_slots: StrictInt = Field(default=2, ge=0, description="Redundant (replica) slots per rank (N).")
    domain_size: StrictInt | None = Field(
        default=None, ge=1, description="Ranks per scale-up domain; replicas stay inside. Default: the whole group."
    )
    quota: QuotaOptions = Field(default_factory=QuotaOptions, description="Options of `quota` layers.")
    eplb: EplbOptions = Field(default_factory=EplbOptions, description="Options of `eplb` layers.")
    adaptive: AdaptiveOptions = Field(default_factory=AdaptiveOptions, description="Options of `adaptive` layers.")
    layers: dict[Annotated[int, Field(ge=0)], LayerPolicy] = Field(
        default_factory=dict, description="Per-layer policy overrides, keyed by MoE layer index (>= 0)."
    )
    check_plan_hash: StrictBool = Field(
        default=False, description="Debug: all-gather each plan's hash and stop if ranks disagree."
    )
    replica_transport: Literal["auto", "tiles", "direct"] = Field(
        default="auto",
        description="How replica weights and gradients travel: 'tiles' (experts packed into fixed-size tiles, one "
        "message per peer: Triton kernels on GPUs, needed for relays), 'direct' (every expert tensor its own "
        "message, no packing: cheapest on CPU/gloo), or 'auto' (direct on CPU without relays, else tiles).",
    )
    replica_cache: StrictBool = Field(
        default=True,
        description="Keep replica weights between calls while their master is unchanged (serving; the microbatches "
        "of one optimizer step): a resident replica is reused with no transfer, and planners prefer resident "
        "placements. Lives in the replica memory budget (layers that keep their replicas).",
    )
    replica_memory_budget: Literal["auto"] | Annotated[StrictInt, Field(ge=0)] | Annotated[StrictFloat, Field(ge=0.0)] = Field(
        default="auto",
        description="Memory a rank may spend on per-layer replica weight buffers that live from forward to "
        "backward (no restore, no recompute): bytes (int), a multiple of this rank's master expert bytes "
        "(float, e.g. 0.5), or 'auto' (a quarter of the memory available at wrap time). Layers beyond it "
        "share one set of buffers and restore + recompute their replicas in backward.",
    )

    master_grads: Literal["auto", "mean", "sum"] = Field(
        default="auto",
        description="What the masters' gradients are over the EP group, which is also the data-parallel group: "
        "'mean' (divided by the group size, as DistributedDataParallel and fully_shard average every other "
        "gradient: loss.backward() on each rank's mean loss gives the unwrapped model's gradients of the global "
        "mean loss), 'sum' (summed over the ranks' losses: a hand-written loop that sums the other gradients), or "
        "'auto' ('mean' while the forward runs inside DistributedDataParallel or on a model with fully_shard "
        "modules, else 'sum').",
    )
    sync_check_every: StrictInt = Field(
        default=100, ge=0,
        description="Every this many steps (and at the first), next_step() checks with one small all-gather that "
        "the parameters outside the experts are equal on every rank, and raises naming the first that differs "
        "(a loop with no data-parallel wrapper and no synchronisation drifts apart silently). 0 turns it off.",
    )

    def layer_options(self, layer: int) -> _Options:
        """The options object that governs ``layer``."""
        if layer in self.layers:
            return self.layers[layer]
        configured = getattr(self, self.policy, None)  # the top-level options of that policy, if it has any
        return configured if isinstance(configured, _Options) else _DEFAULTS[self.policy]()

    def slots_for(self, layer: int) -> int:
        opts = self.layer_options(layer)
        override = getattr(opts, "num_redundant_slots", None)
        return self.num_redundant_slots if override is None else override

    def validate_for(self, num_ranks: int, num_masters: int) -> "BalancerConfig":
        """Check the rules that depend on the EP group; raise :class:`ConfigError` naming the field."""
        D = self.domain_size if self.domain_size is not None else num_ranks
        if num_ranks % D:
            raise ConfigError("domain_size", f"domain_size ({D}) must divide the number of ranks ({num_ranks})", D)
        limit = (D - 1) * num_masters
        checks = [("num_redundant_slots", self.num_redundant_slots)]
        top = getattr(self, self.policy, None)  # the top-level options of the policy (layer_options reads them)
        if isinstance(top, _Options) and getattr(top, "num_redundant_slots", None) is not None:
            checks.append((f"{self.policy}.num_redundant_slots", top.num_redundant_slots))
        for layer, opts in sorted(self.layers.items()):
            n = getattr(opts, "num_redundant_slots", None)
            if n is not None:
                checks.append((f"layers.{layer}.{opts.kind}.num_redundant_slots", n))
        for path, n in checks:
            if n > limit:
                raise ConfigError(
                    path,
                    f"{path} ({n}) must be <= (domain_size - 1) * masters_per_rank ({limit}); "
                    f"lower it or enlarge domain_size",
                    n,
                )
        return self

    def validate_layers(self, num_layers: int) -> "BalancerConfig":
        """Refuse ``layers`` overrides for MoE layers the model does not have (``wrap`` found
        ``num_layers`` of them, indexed ``0..num_layers-1``): an override that matches nothing would
        silently leave its layer on the default policy."""
        missing = sorted(k for k in self.layers if k >= num_layers)
        if missing:
            have = f"0..{num_layers - 1}" if num_layers > 1 else ("0" if num_layers == 1 else "none")
            raise ConfigError(
                f"layers.{missing[0]}",
                f"the model has {num_layers} MoE layer(s) (indices {have}); no layer {missing[0]} to override"
                + (f" (also missing: {', '.join(map(str, missing[1:]))})" if len(missing) > 1 else ""),
                missing[0],
            )
        return self

    def digest(self) -> str:
        """Stable hash of the validated config (stored with every run)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


#: the adaptive options of a calibration run (:func:`calibration_config`)
CALIBRATION_PROBE_EVERY = 4


def calibration_config(**overrides: Any) -> dict[str, Any]:
    """A config for a *calibration run*: the adaptive engine measuring every candidate policy often, whatever each
    is predicted to lose (a probe every ``CALIBRATION_PROBE_EVERY`` decisions, no regret bound, every candidate
    weighed at every decision), so that the cost model its engine learns has seen every policy's calls. Record a
    run with it (a few dozen steps) before ``ultraep simulate RUN --topology from-run`` or a projection: a run of
    one policy, or an adaptive run that rarely left it, predicts the others from the few calls it measured of them.
    It trains as any wrapped model (exact); it runs slower than ``adaptive`` while it probes. ``overrides``: other
    top-level config keys (``num_redundant_slots``, ...); an ``adaptive`` mapping among them is merged into the
    calibration's adaptive options (``adaptive={"candidates": ("none", "quota")}`` keeps the probes).

    Measured (2026-11-27, ``benchmarks/bench_validate.py``, 2 gloo ranks, four recordings): calibrated on such a
    run the predicted speed-up over none was within 2.4 / 7.9 / 5.7 / 6.0 % of the measured one at every shape, on
    the adaptive run of the same recordings within 6.9 / 5.7 / 25.9 / 8.4 % (``quota`` at 64 tokens per rank,
    predicted from the 4 / 1 / 4 calls the adaptive engine ran of it in the first, third and fourth)."""
    adaptive = {"probe_every": CALIBRATION_PROBE_EVERY, "probe_max_loss": 1e6, "explore_share": None,
                "probe_share": None, "probe_cost_share": None, "probe_regret": None,
                **dict(overrides.pop("adaptive", None) or {})}
    return {"policy": "adaptive", "adaptive": adaptive, **overrides}
