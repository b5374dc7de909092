"""ultraep: Mixture-of-Experts expert-parallel load balancing with full telemetry.

``import ultraep`` is light: numpy and pydantic only. Planners (numba), the runtime (torch), kernels
(triton), telemetry (duckdb, OpenTelemetry) and the dashboard (streamlit) load on first use.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

# pyproject.toml's `version` is the one source: the installed distribution's metadata carries it (an
# editable install too); a source tree that was never installed has no version to report.
try:
    __version__ = version("ultraep")
except PackageNotFoundError:  # pragma: no cover - only in a checkout without `pip install`
    __version__ = "0+unknown"

_LAZY = {
    "Topology": "ultraep.topology",
    "LinkSpec": "ultraep.topology",
    "Plan": "ultraep.plan",
    "Transfers": "ultraep.plan",
    "BalancerConfig": "ultraep.config",
    "calibration_config": "ultraep.config",
    "plan_layer": "ultraep.planning",
    "validate_load": "ultraep.load",
    "metrics": "ultraep.plan.metrics",
    "UltraEPError": "ultraep.errors",
    "ConfigError": "ultraep.errors",
    "LoadError": "ultraep.errors",
    "wrap": "ultraep.runtime",
    "unwrap": "ultraep.runtime",
    "runtime_of": "ultraep.runtime",
    "expert_params": "ultraep.runtime",
    "no_sync": "ultraep.runtime",
    "load_masters": "ultraep.runtime",
    "SafetensorsMasters": "ultraep.runtime",
    "DCPMasters": "ultraep.runtime",
    "InitMasters": "ultraep.runtime",
    "register_experts": "ultraep.models.adapters",
    "telemetry": "ultraep.telemetry",  # the README's `ultraep.telemetry.Recorder.open(...)` works after `import ultraep`
}

_MODULES = {"metrics", "telemetry"}

if TYPE_CHECKING:  # pragma: no cover
    from ultraep.plan import metrics
    from ultraep.config import BalancerConfig, calibration_config
    from ultraep.errors import ConfigError, LoadError, UltraEPError
    from ultraep.load import validate_load
    from ultraep.plan import Plan, Transfers
    from ultraep.planning import plan_layer
    from ultraep.topology import LinkSpec, Topology
    from ultraep.runtime import (DCPMasters, InitMasters, SafetensorsMasters, expert_params,
                                 load_masters, no_sync, runtime_of, unwrap, wrap)
    from ultraep.models.adapters import register_experts


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ultraep' has no attribute {name!r}")
    module = import_module(mod)
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY) + ["__version__"]
