"""Which runs exist under a root, and what state each is in (live, stalled, closed, empty).

A run is a directory holding raw table folders (:data:`~ultraep.telemetry.semconv.RAW_TABLES`). Its
status comes from its ``runs_log`` rows (read through a mirror) and the age of its newest part. Nothing
here does I/O at import time.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultraep.dashboard.cache import LOCK, mirror_query
from ultraep.dashboard.mirror import RunMirror
from ultraep.dashboard.page_sql import RUNS_STATUS
from ultraep.telemetry import semconv as sc

# A run whose newest runs_log row says 'running' is live while parts keep arriving; after this many
# seconds without a new part it is shown as stalled (crashed or paused) instead.
LIVE_WINDOW_S = 120.0


# --------------------------------------------------------------------------- discovery
def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds one run (any raw table folder)."""
    return any((path / t).is_dir() for t in sc.RAW_TABLES)


def find_runs(root) -> list[Path]:
    """Run directories under ``root`` (``root`` itself if it is one), oldest first by name."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    if is_run_dir(root):
        return [root]
    out = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith(".") and is_run_dir(child):
            out.append(child)
    return out


# --------------------------------------------------------------------------- run status
@dataclass(frozen=True)
class RunInfo:
    """What the runs_log rows say about a run, plus liveness from the newest part's age."""

    run_id: str
    path: Path
    kind: str | None
    model: str | None
    world_size: int | None
    ranks_recording: int
    status: str                 # live | stalled | closed | empty
    started_at: Any
    ended_at: Any
    last_write: float           # seconds since the epoch (newest part)
    errors: int
    dropped_rows: int
    first_error: str | None
    config_hash: str | None
    config_json: str | None
    name_prefix: str | None     # simulation runs "<base>-<policy>": the base

    @property
    def live(self) -> bool:
        return self.status == "live"

    @property
    def label(self) -> str:
        mark = {"live": "● ", "stalled": "◐ "}.get(self.status, "")
        return f"{mark}{self.run_id}"

    def workload(self) -> tuple:
        """Runs with the same workload: simulations of one trace (config minus the policy), or runs of
        the same kind, model and EP size."""
        cfg = None
        if self.config_json:
            try:
                cfg = json.loads(self.config_json)
            except ValueError:
                cfg = None
        if self.kind == "simulation" and isinstance(cfg, dict):
            rest = {k: v for k, v in cfg.items() if k != "policy"}
            return ("simulation", json.dumps(rest, sort_keys=True, default=str))
        return (self.kind, self.model, self.world_size)


def run_info(mirror: RunMirror, now: float | None = None) -> RunInfo:
    """Refresh the run's ``runs_log`` facts and say whether it is live."""
    mirror.refresh(("runs_log",))
    df = mirror_query(mirror, RUNS_STATUS, (sc.T_RUNS_LOG,))
    row = df.iloc[0].to_dict() if len(df) else {}
    has_rows = bool(len(df)) and int(row.get("ranks_recording") or 0) > 0
    now = time.time() if now is None else now
    last = max(mirror.last_write, _newest_mtime(mirror.run_dir))
    if not has_rows:
        status = "empty"
    elif bool(row.get("closed")):
        status = "closed"
    else:
        status = "live" if now - last <= LIVE_WINDOW_S else "stalled"
    prefix = None
    rid = mirror.run_id
    if row.get("kind") == "simulation" and "-" in rid:
        prefix = rid.rsplit("-", 1)[0]

    import pandas as pd

    def _none(v):
        return None if v is None or (not isinstance(v, (list, dict)) and pd.isna(v)) else v

    def _int(v):
        return 0 if _none(v) is None else int(v)

    return RunInfo(
        run_id=rid, path=mirror.run_dir, kind=_none(row.get("kind")), model=_none(row.get("model")),
        world_size=None if _none(row.get("world_size")) is None else int(row["world_size"]),
        ranks_recording=_int(row.get("ranks_recording")), status=status,
        started_at=_none(row.get("started_at")), ended_at=_none(row.get("ended_at")), last_write=last,
        errors=_int(row.get("errors")), dropped_rows=_int(row.get("dropped_rows")),
        first_error=_none(row.get("first_error")), config_hash=_none(row.get("config_hash")),
        config_json=_none(row.get("config_json")), name_prefix=prefix,
    )


_INFO_CACHE: dict = {}


def run_info_at(run_dir, now: float | None = None) -> RunInfo:
    """:func:`run_info` of a run without keeping a mirror of it: the runs_log rows are read again only
    when a part was added; liveness is re-judged from the newest part's time at every call."""
    run_dir = Path(run_dir).resolve()
    sig = run_signature(run_dir)
    with LOCK:
        hit = _INFO_CACHE.get(run_dir)
    if hit is not None and hit[0] == sig:
        info = hit[1]
    else:
        info = run_info(RunMirror(run_dir), now)  # a throwaway mirror that reads runs_log only
        with LOCK:
            _INFO_CACHE[run_dir] = (sig, info)
    if info.status in ("live", "stalled"):
        now = time.time() if now is None else now
        info = dataclasses.replace(info, status="live" if now - info.last_write <= LIVE_WINDOW_S else "stalled")
    return info


def run_signature(run_dir) -> tuple:
    """Changes whenever a part is added to the run (folder modification times), without reading it."""
    run_dir = Path(run_dir)
    out = []
    for t in sc.RAW_TABLES:
        try:
            out.append((run_dir / t).stat().st_mtime_ns)
        except OSError:
            out.append(0)
    return tuple(out)


def _newest_mtime(run_dir: Path) -> float:
    newest = 0.0
    for t in sc.RAW_TABLES:
        try:
            newest = max(newest, (run_dir / t).stat().st_mtime)
        except OSError:
            pass
    return newest

