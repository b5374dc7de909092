"""Who a run is: its id, the records of its config and topology, the software versions, agreement across
ranks. Used by :meth:`Recorder.open <ultraep.telemetry.recorder.Recorder.open>` (checks, at start-up) and
by the ``runs_log`` row the recorder writes when a recorder session opens and closes.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import secrets
import sys
import time

from ultraep.errors import ConfigError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxxxx`` (UTC time and 24 random bits)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def check_run_name(run_name) -> None:
    """Refuse a run name that is not 1-128 letters, digits, ``._-`` (it becomes a directory name)."""
    if run_name is not None and not RUN_NAME.match(str(run_name)):
        raise ConfigError(
            "run_name", f"{run_name!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with "
            "'.', '_' or '-'", run_name)


def config_record(config) -> tuple[str | None, str | None]:
    """``(config_json, config_hash)`` of a pydantic config (its ``digest()`` where it has one) or a dict."""
    if config is None:
        return None, None
    if hasattr(config, "model_dump_json"):
        text = config.model_dump_json()
        digest = getattr(config, "digest", None)
        h = digest() if callable(digest) else hashlib.sha256(text.encode()).hexdigest()[:16]
        return text, str(h)
    if isinstance(config, dict):
        text = json.dumps(config, sort_keys=True, default=str)
        return text, hashlib.sha256(text.encode()).hexdigest()[:16]
    raise ConfigError("config", f"must be a pydantic model or a dict, got {type(config).__name__}",
                      type(config).__name__)


def topology_record(topology) -> str | None:
    """The topology (pydantic model or dict) as JSON."""
    if topology is None:
        return None
    if hasattr(topology, "model_dump_json"):
        return topology.model_dump_json()
    return json.dumps(topology, sort_keys=True, default=str)


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that shape a recording (heavy ones only if already loaded)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("ultraep", "numpy", "pyarrow", "opentelemetry-sdk"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    for mod in ("torch", "duckdb", "triton"):  # only if the process already uses them
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, "__version__"):
            out[mod] = str(m.__version__)
    return out


def agree_run_id(run_id: str, world_size: int) -> str:
    """Rank 0's run id on every rank, through torch.distributed when the process group is up."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "run_name",
            f"is required when world_size ({world_size}) > 1 and torch.distributed is not initialised: "
            "every rank must name the same run (or initialise the process group first, and rank 0's "
            "generated id is broadcast)",
        )
    box = [run_id]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])
