"""The registry of policy names: built-in classes (registered by the package when it is imported) and
third-party ones from the entry-point group ``ultraep.policies`` (``name = "pkg.module:Class"``).

A module of its own so that a policy which builds others by name (``adaptive``) imports the registry, not the
package that imports it.

It also answers, for code outside ``policies/`` (the simulator, the demo), what a policy *is* without comparing
its name: :data:`BASELINE` (the unbalanced policy every speed-up is measured against), :func:`is_chooser`
(a policy that decides by choosing among other policies' plans) and :func:`option_default`. Those callers never
branch on a policy name themselves (``tests/test_policy_names.py``).
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points

from ultraep.errors import ConfigError

from .base import Policy

#: built-in name -> class; filled by ``ultraep.policies`` (its ``__init__``) when the package is imported
POLICIES: dict[str, type] = {}

ENTRY_POINT_GROUP = "ultraep.policies"

#: the policy every speed-up is measured against and every chooser falls back to: plain EP, no balancing
#: (checked to be registered by the package)
BASELINE = "none"


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


def is_chooser(name: str) -> bool:
    """True for a policy that decides by choosing among other policies' plans (its class says so:
    ``chooses_among_policies``; it then takes ready candidate instances, ``policies=``, and the candidates'
    names, ``candidates=``). The simulator builds such a policy last, over the candidate instances it shares
    with the fixed policies, and keeps its decisions."""
    return bool(getattr(get_policy_class(name), "chooses_among_policies", False))


def option_default(name: str, option: str):
    """The default value of ``option`` in policy ``name``'s constructor (its options' single source)."""
    return inspect.signature(get_policy_class(name).__init__).parameters[option].default


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
