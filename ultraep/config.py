"""Balancer configuration (pydantic v2): frozen, ``extra="forbid"``, a description per field.

The per-layer policy is a discriminated union on ``kind``. Cross-field rules that need the EP group's
shape (slots versus ranks) are checked by :meth:`BalancerConfig.validate_for`, with messages that name the
field path, both values and the fix. The validated config and its :meth:`~BalancerConfig.digest` are
stored with every run. No behaviour hides in environment variables.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ultraep.errors import ConfigError

PolicyName = Literal["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]
CandidateName = Literal["none", "quota", "eplb", "feplb", "hybridep"]
RelayMode = Literal["auto", "direct", "always"]


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def policy_options(self) -> dict:
        """Keyword arguments for the policy class (everything but ``kind`` and slot overrides)."""
        return self.model_dump(exclude={"kind", "num_redundant_slots"})


class NoneOptions(_Options):
    """No balancing."""

    kind: Literal["none"] = "none"


class QuotaOptions(_Options):
    """Exact-load real-time balancing (UltraEP quota planner)."""

    kind: Literal["quota"] = "quota"
    num_redundant_slots: int | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    balance_eps: float = Field(
        default=0.01, ge=0.0, le=1.0, description="Fast-path target: rank load <= (1 + eps) * mean."
    )
    min_replica_quota: int = Field(
        default=1, ge=1, description="Smallest quota (tokens) a new replica may carry, on top of the dynamic floor."
    )
    relay: RelayMode = Field(default="auto", description="Weight transfer: relay tree when it pays, direct, or always.")


class EplbOptions(_Options):
    """Historical balancing (DeepSeek EPLB placement, even token split)."""

    kind: Literal["eplb"] = "eplb"
    num_redundant_slots: int | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    interval: int = Field(default=50, ge=1, description="Steps between re-placements.")
    window: int = Field(default=50, ge=1, description="Past steps averaged for the load estimate.")
    ewma: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Use an EWMA with this weight on the newest load instead of a window."
    )
    use_current_load: bool = Field(
        default=False, description="Plan from the current exact load (EPLB+ baseline) instead of history."
    )
    relay: RelayMode = Field(default="auto", description="Weight transfer: relay tree when it pays, direct, or always.")


class FeplbOptions(_Options):
    """Whole-expert intra-domain moves (FEPLB, arXiv 2604.19654)."""

    kind: Literal["feplb"] = "feplb"
    num_redundant_slots: int | None = Field(
        default=None, ge=0, description="Override of the dynamic-expert buffers per rank (default: global slots)."
    )
    num_dynamic: int = Field(default=4, ge=0, description="Dynamic (movable) experts per rank; the rest are static.")
    min_tokens: int = Field(default=1, ge=0, description="Smallest expert load (tokens) worth moving (FEPLB's tau).")
    ewma: float = Field(
        default=0.3, gt=0.0, le=1.0, description="Weight of the newest load in the predictor of dynamic experts."
    )


class HybridEPOptions(_Options):
    """Hybrid expert/token transmission over slow links (HybridEP, arXiv 2510.19470)."""

    kind: Literal["hybridep"] = "hybridep"
    domain_sizes: tuple[Annotated[int, Field(ge=1)], ...] | None = Field(
        default=None, min_length=1,
        description="Candidate expert-domain sizes in scale-out domains (default: all divisors); not empty.",
    )
    compression: float = Field(default=1.0, ge=1.0, description="Expert compression ratio for the all-gather.")


class AdaptiveOptions(_Options):
    """Per-layer choice of the cheapest policy by the cost model, with hysteresis."""

    kind: Literal["adaptive"] = "adaptive"
    num_redundant_slots: int | None = Field(
        default=None, ge=0, description="Override of the redundant slots this layer may use (default: global)."
    )
    candidates: tuple[CandidateName, ...] = Field(
        default=("none", "quota", "eplb", "feplb", "hybridep"), description="Policies to choose from (need 'none')."
    )
    margin: float = Field(default=0.005, ge=0.0, description="Relative gain below which the current policy stays.")
    patience: int = Field(default=2, ge=1, description="Consecutive wins a better policy needs before a switch.")
    switch_now: float = Field(default=0.02, ge=0.0, description="Relative gain that switches immediately.")
    deadline_s: float | None = Field(
        default=None, gt=0.0, description="Planning + weight sync later than this falls back to 'none' (seconds)."
    )
    screen: bool = Field(default=True, description="Skip planning candidates that cannot pay for their planner.")


LayerPolicy = Annotated[
    Union[NoneOptions, QuotaOptions, EplbOptions, FeplbOptions, HybridEPOptions, AdaptiveOptions],
    Field(discriminator="kind"),
]

_DEFAULTS: dict[str, type[_Options]] = {
    "none": NoneOptions, "quota": QuotaOptions, "eplb": EplbOptions,
    "feplb": FeplbOptions, "hybridep": HybridEPOptions, "adaptive": AdaptiveOptions,
}


class BalancerConfig(BaseModel):
    """How ultraep balances every MoE layer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyName = Field(default="quota", description="Policy of every layer without an override.")
    num_redundant_slots: int = Field(default=2, ge=0, description="Redundant (replica) slots per rank (N).")
    domain_size: int | None = Field(
        default=None, ge=1, description="Ranks per scale-up domain; replicas stay inside. Default: the whole group."
    )
    quota: QuotaOptions = Field(default_factory=QuotaOptions, description="Options of `quota` layers.")
    eplb: EplbOptions = Field(default_factory=EplbOptions, description="Options of `eplb` layers.")
    layers: dict[Annotated[int, Field(ge=0)], LayerPolicy] = Field(
        default_factory=dict, description="Per-layer policy overrides, keyed by MoE layer index (>= 0)."
    )
    check_plan_hash: bool = Field(
        default=False, description="Debug: all-gather each plan's hash and stop if ranks disagree."
    )

    def layer_options(self, layer: int) -> _Options:
        """The options object that governs ``layer``."""
        if layer in self.layers:
            return self.layers[layer]
        if self.policy == "quota":
            return self.quota
        if self.policy == "eplb":
            return self.eplb
        return _DEFAULTS[self.policy]()

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

    def digest(self) -> str:
        """Stable hash of the validated config (stored with every run)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]
