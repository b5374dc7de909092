"""Balancing policies behind one Protocol, and the registry of their names.

Built-in policies are registered here by name; the names must equal ``ultraep.config.PolicyName`` (checked
at import time, so a policy can never be configurable but unregistered, or the reverse). Third-party
policies register through the entry-point group ``ultraep.policies`` (``name = "pkg.module:Class"``).
"""

from __future__ import annotations

from typing import get_args

from ultraep.config import PolicyName

from .base import Policy, assemble_plan, identity_plan, plan_resident
from .eplb import EplbPolicy, rebalance_experts
from .none import NonePolicy
from .quota import QuotaPolicy
from .feplb import FeplbPolicy
from .hybridep import HybridEPPolicy
from .adaptive import AdaptivePolicy
from .registry import ENTRY_POINT_GROUP, POLICIES, available_policies, get_policy_class, make_policy

POLICIES.update({
    "none": NonePolicy,
    "quota": QuotaPolicy,
    "eplb": EplbPolicy,
    "feplb": FeplbPolicy,
    "hybridep": HybridEPPolicy,
    "adaptive": AdaptivePolicy,
})

if set(POLICIES) != set(get_args(PolicyName)):  # pragma: no cover - import-time consistency check
    raise ImportError(
        f"policy registry {sorted(POLICIES)} disagrees with config PolicyName {sorted(get_args(PolicyName))}"
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
    "get_policy_class",
    "make_policy",
    "assemble_plan",
    "identity_plan",
    "plan_resident",
]
