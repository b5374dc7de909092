"""Balancing policies behind one Protocol, and the registry of their names.

Built-in policies are registered here by name; the names must equal ``ultraep.config.PolicyName`` (checked
at import time, so a policy can never be configurable but unregistered, or the reverse). Third-party
policies register through the entry-point group ``ultraep.policies`` (``name = "pkg.module:Class"``).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import get_args

from ultraep.config import PolicyName
from ultraep.errors import ConfigError

from .base import Policy, assemble_plan, identity_plan
from .eplb import EplbPolicy, rebalance_experts
from .none import NonePolicy
from .quota import QuotaPolicy
from .feplb import FeplbPolicy
from .hybridep import HybridEPPolicy
from .adaptive import AdaptivePolicy

POLICIES: dict[str, type] = {
    "none": NonePolicy,
    "quota": QuotaPolicy,
    "eplb": EplbPolicy,
    "feplb": FeplbPolicy,
    "hybridep": HybridEPPolicy,
    "adaptive": AdaptivePolicy,
}

if set(POLICIES) != set(get_args(PolicyName)):  # pragma: no cover - import-time consistency check
    raise ImportError(
        f"policy registry {sorted(POLICIES)} disagrees with config PolicyName {sorted(get_args(PolicyName))}"
    )

ENTRY_POINT_GROUP = "ultraep.policies"


def available_policies() -> list[str]:
    """Built-in names plus those registered by installed packages."""
    names = set(POLICIES)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_policy_class(name: str) -> type:
    if name in POLICIES:
        return POLICIES[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise ConfigError("policy", f"unknown policy {name!r}; available: {', '.join(available_policies())}", name)


def make_policy(name: str, **options) -> Policy:
    """Instantiate a policy by name with its options; unknown options raise with the accepted ones."""
    cls = get_policy_class(name)
    import inspect

    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]}",
            f"unknown option for policy {name!r}; accepted: {', '.join(accepted) or '(none)'}",
            unknown[0],
        )
    return cls(**options)


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
]
