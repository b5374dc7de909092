"""The registry of policy names: built-in classes (registered by the package when it is imported) and
third-party ones from the entry-point group ``ultraep.policies`` (``name = "pkg.module:Class"``).

A module of its own so that a policy which builds others by name (``adaptive``) imports the registry, not the
package that imports it.
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points

from ultraep.errors import ConfigError

from .base import Policy

#: built-in name -> class; filled by ``ultraep.policies`` (its ``__init__``) when the package is imported
POLICIES: dict[str, type] = {}

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
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]}",
            f"unknown option for policy {name!r}; accepted: {', '.join(accepted) or '(none)'}",
            unknown[0],
        )
    if POLICIES.get(name) is cls:
        _check_options(name, options)
    return cls(**options)


def _check_options(name: str, options: dict) -> None:
    """Hold a built-in policy's options to the same types and bounds as a config file (the pydantic options
    model of ``ultraep.config``), so ``plan_layer(..., balance_eps=-1)`` or ``--policy-opt eplb.interval=0``
    fail with the option's path instead of planning nonsense or raising deep inside the policy."""
    from pydantic import ValidationError

    from ultraep.config import _DEFAULTS

    model = _DEFAULTS[name]
    given = {k: v for k, v in options.items() if k in model.model_fields and k not in ("kind", "num_redundant_slots")}
    if not given:
        return
    try:
        model.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        value = err.get("input")
        raise ConfigError(f"{name}.{loc}", f"{err.get('msg')} (got {value!r})", value) from None
