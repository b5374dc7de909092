"""Balancing policies behind one Protocol, and the registry of their names.

Built-in policies are registered here by name; the names must equal ``ultraep.config.PolicyName`` (checked
at import time, so a policy can never be configurable but unregistered, or the reverse). Third-party
policies register through the entry-point group ``ultraep.policies`` (``name = "pkg.module:Class"``).
"""

from __future__ import annotations

from typing import get_args

from ultraep.config import ALL_POLICIES, CandidateName, PolicyName

from .base import Policy, assemble_plan, identity_plan, plan_resident, plan_with_residency
from .eplb import EplbPolicy, rebalance_experts
from .none import NonePolicy
from .quota import QuotaPolicy
from .feplb import FeplbPolicy
from .hybridep import HybridEPPolicy
from .adaptive import AdaptivePolicy
from .registry import (BASELINE, ENTRY_POINT_GROUP, POLICIES, available_policies, get_policy_class, is_chooser,
                       make_policy, option_default)

POLICIES.update({
    "none": NonePolicy,
    "quota": QuotaPolicy,
    "eplb": EplbPolicy,
    "feplb": FeplbPolicy,
    "hybridep": HybridEPPolicy,
    "adaptive": AdaptivePolicy,
})

# The config spells the names as Literals (its union of options models is what a config file is validated
# against); they must be exactly the registry's, the candidates exactly the policies that are not choosers, and
# the simulator's default list every policy (import-time checks: configurable iff registered).
_CHOOSERS = {n for n in POLICIES if is_chooser(n)}
if (set(POLICIES) != set(get_args(PolicyName)) or set(get_args(CandidateName)) != set(POLICIES) - _CHOOSERS
        or set(ALL_POLICIES) != set(POLICIES) or BASELINE not in POLICIES
        or not getattr(POLICIES[BASELINE], "fallback", False)):  # pragma: no cover
    raise ImportError(
        f"policy registry {sorted(POLICIES)} (choosers {sorted(_CHOOSERS)}, baseline {BASELINE!r}) disagrees with "
        f"config PolicyName {sorted(get_args(PolicyName))} / CandidateName {sorted(get_args(CandidateName))} / "
        f"ALL_POLICIES {sorted(ALL_POLICIES)}"
    )

__all__ = [
    "POLICIES",
    "Policy",
    "NonePolicy",
    "QuotaPolicy",
    "EplbPolicy",
    "FeplbPolicy",
    "HybridEPPolicy",
    "AdaptivePolicy",
    "rebalance_experts",
    "available_policies",
    "BASELINE",
    "is_chooser",
    "option_default",
    "get_policy_class",
    "make_policy",
    "assemble_plan",
    "identity_plan",
    "plan_resident",
    "plan_with_residency",
]
