"""The dashboard's data: which runs exist, their mirrors, and every figure the pages show (no Streamlit).

Two sources, both read-only:

* the **mirror** of a run (:mod:`.mirror`): compact facts refreshed incrementally from the run's Parquet
  parts; every chart over all steps and layers is a query on it (``MIRROR_*`` below, run by DuckDB over
  the in-memory Arrow tables, parameters bound by DuckDB);
* the **store** (``ultraep.telemetry.open_run``) for point look-ups that need the full matrices of one
  layer-microbatch (``queries.RANK_LOAD_BY_EXPERT``), and the SQL page's sandbox (:func:`sandbox`).

Functions return pandas DataFrames whose columns carry units in their names (``_s`` seconds, ``bytes``,
``tokens``), ready for :mod:`.charts` and ``st.dataframe``. Nothing here does I/O at import time.

Step binning: charts over steps show at most ``max_bins`` points; a bin covers ``bin`` consecutive steps
starting at ``first_step + k * bin`` and its value is the mean (or sum, where stated) over the
layer-microbatches inside. With ``bin == 1`` every figure equals the canned query's.

Legend: R ranks, E experts.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ultraep.dashboard.mirror import UNIT_OF, RunMirror
from ultraep.telemetry import semconv as sc
from ultraep.telemetry.queries import SHOWN_POLICY as _SHOWN
from ultraep.telemetry.queries import Query

# A run whose newest runs_log row says 'running' is live while parts keep arriving; after this many
# seconds without a new part it is shown as stalled (crashed or paused) instead.
LIVE_WINDOW_S = 120.0
MAX_BINS = 240


# --------------------------------------------------------------------------- runs and mirrors
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


class MirrorPool:
    """One :class:`RunMirror` per run directory, shared by every session; least recently used ones are
    dropped beyond ``capacity`` (a dropped run is simply read again when next shown)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._mirrors: OrderedDict[Path, RunMirror] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_dir) -> RunMirror:
        key = Path(run_dir).resolve()
        with self._lock:
            m = self._mirrors.get(key)
            if m is None:
                m = self._mirrors[key] = RunMirror(key)
            self._mirrors.move_to_end(key)
            while len(self._mirrors) > self.capacity:
                self._mirrors.popitem(last=False)
            return m


# --------------------------------------------------------------------------- running queries on facts
_BASE = None
_BASE_LOCK = threading.Lock()


def _cursor():
    """A cursor on one process-wide in-memory DuckDB (opening a database costs ~80 ms; a cursor ~0.5 ms).
    Each query gets its own cursor, so registered tables never cross threads or queries."""
    global _BASE
    import duckdb

    with _BASE_LOCK:
        if _BASE is None:
            _BASE = duckdb.connect(":memory:")
        return _BASE.cursor()


def facts_query(tables: dict, query: Query, **params):
    """Run ``query`` on the given Arrow tables (registered under their names); returns a DataFrame."""
    cur = _cursor()
    try:
        for name, tbl in tables.items():
            cur.register(name, tbl)
        return cur.execute(query.sql, query.bind(**params)).df()
    finally:
        cur.close()


def mirror_query(mirror: RunMirror, query: Query, facts: tuple[str, ...], **params):
    """Run ``query`` on the mirror's ``facts``, after reading any new parts they come from. Results are
    cached on the mirror until new parts of those facts arrive (a copy is returned)."""
    mirror.refresh(tuple(dict.fromkeys(UNIT_OF[f] for f in facts)))
    key = ("query", query.name, tuple(sorted(params.items())))
    df = mirror.memo(key, facts, lambda: facts_query({f: mirror.facts(f) for f in facts}, query, **params))
    return df.copy()


def _q(name: str, sql: str, params: tuple[str, ...] = (), doc: str = "") -> Query:
    return Query(name, name, sql, params=params, doc=doc)


def warm_up(mirror: RunMirror) -> None:
    """Read the run in the background (once per mirror): the pages' facts in the order a visitor meets
    them, then the per-expert ones, so later pages open without waiting for their first read. Each unit is
    refreshed on its own, so a page never waits longer than one unit's read."""
    with _BASE_LOCK:
        if mirror.warm_started:
            return
        mirror.warm_started = True

    def work() -> None:
        try:
            import plotly.graph_objects  # noqa: F401  (the first page needs it; import it meanwhile)

            for unit in OVERVIEW_UNITS + ("decision", "transfer", "transfer_time", "expert", "replica"):
                mirror.refresh((unit,))
        except Exception as exc:  # never let the warm-up break a page; the pages read on their own
            mirror.read_errors.append(f"warm-up: {type(exc).__name__}: {exc}")

    threading.Thread(target=work, name="ultraep-dashboard-warm-up", daemon=True).start()


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


RUNS_STATUS = _q("runs_status", """
WITH newest AS (
    SELECT * FROM runs_log
    QUALIFY row_number() OVER (PARTITION BY run_id, rank, session ORDER BY written_at DESC, status) = 1
)
SELECT any_value(kind) AS kind, any_value(model) AS model, max(world_size) AS world_size,
       count(DISTINCT rank) AS ranks_recording, min(started_at) AS started_at,
       CASE WHEN bool_and(status = 'closed') THEN max(ended_at) END AS ended_at,
       bool_and(status = 'closed') AS closed,
       sum(errors)::BIGINT AS errors, sum(dropped_rows)::BIGINT AS dropped_rows,
       min(first_error) AS first_error, any_value(config_hash) AS config_hash,
       any_value(config_json) AS config_json
FROM newest
""", doc="One row: the run's status over its recorder sessions (as the store's `runs` view).")


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
    import dataclasses

    run_dir = Path(run_dir).resolve()
    sig = run_signature(run_dir)
    with _BASE_LOCK:
        hit = _INFO_CACHE.get(run_dir)
    if hit is not None and hit[0] == sig:
        info = hit[1]
    else:
        info = run_info(RunMirror(run_dir), now)  # a throwaway mirror that reads runs_log only
        with _BASE_LOCK:
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


# --------------------------------------------------------------------------- binning
@dataclass(frozen=True)
class Bins:
    first_step: int
    last_step: int
    bin: int

    @property
    def count(self) -> int:
        return (self.last_step - self.first_step) // self.bin + 1


def step_bins(first: int, last: int, max_bins: int = MAX_BINS) -> Bins:
    span = max(1, int(last) - int(first) + 1)
    return Bins(int(first), int(last), max(1, math.ceil(span / max(1, max_bins))))


STEP_RANGE = _q("step_range", """
SELECT min(step) AS first_step, max(step) AS last_step, count(*) AS rows,
       list(DISTINCT layer ORDER BY layer) AS layers
FROM layer_facts
""")


def layer_bins(mirror: RunMirror, max_bins: int = MAX_BINS) -> tuple[Bins | None, list[int]]:
    """Step bins over the run's layer-microbatches and the layers recorded (``None`` if no rows yet)."""
    df = mirror_query(mirror, STEP_RANGE, ("layer_facts",))
    if not len(df) or int(df["rows"].iloc[0]) == 0:
        return None, []
    r = df.iloc[0]
    return step_bins(int(r["first_step"]), int(r["last_step"]), max_bins), [int(x) for x in r["layers"]]


_BIN = "($first + (step - $first) // $bin * $bin)"

# --------------------------------------------------------------------------- overview
# The headline leaves warm-up steps (steps.warmup; the runtime's step 0: compiles, allocations, first
# plans) out of every mean, summed time and share, as the canned summaries do (queries.WARM_JOIN); counts
# keep every step. A fact row is settled when no steps row marks its step as warm-up.
_SETTLED = f"step NOT IN (SELECT step FROM {sc.T_STEPS} WHERE warmup)"

HEADLINE_LAYERS = _q("headline_layers", f"""
SELECT count(*) AS plans, count(DISTINCT layer) AS layers, count(DISTINCT step) AS steps,
       count(DISTINCT step) FILTER (WHERE NOT settled) AS warmup_steps,
       min(step) AS first_step, max(step) AS last_step, sum(tokens)::BIGINT AS tokens,
       avg(imbalance_before) FILTER (WHERE settled) AS mean_imbalance_before,
       avg(imbalance_after) FILTER (WHERE settled) AS mean_imbalance_after,
       sum(mean_before) FILTER (WHERE settled) / nullif(sum(max_before) FILTER (WHERE settled), 0) AS load_ideal_before,
       sum(mean_after) FILTER (WHERE settled) / nullif(sum(max_after) FILTER (WHERE settled), 0) AS load_ideal_after
FROM (SELECT *, {_SETTLED} AS settled FROM layer_facts)
""")

HEADLINE_TIMINGS = _q("headline_timings", f"""
SELECT count(*) AS timed, sum(plan_s) AS plan_s, sum(transfer_s) AS transfer_s,
       sum(measured_s) AS measured_s, sum(predicted_s) AS predicted_s,
       sum(coalesce(measured_s, predicted_s)) AS time_s,
       sum(ideal_s) FILTER (WHERE coalesce(measured_s, predicted_s) IS NOT NULL) AS ideal_s,
       sum(coalesce(measured_s, predicted_s)) FILTER (WHERE ideal_s IS NOT NULL) AS time_with_ideal_s
FROM timing_facts WHERE {_SETTLED}
""")

HEADLINE_PLANS = _q("headline_plans", f"""
SELECT count(*) AS plans, sum(solve_time_s) FILTER (WHERE settled) AS solve_time_s,
       avg(num_replicas) FILTER (WHERE settled) AS mean_replicas, sum(num_transfers)::BIGINT AS transfers
FROM (SELECT *, {_SETTLED} AS settled FROM plan_facts)
""")

# An adaptive layer-microbatch counts under the candidate its decision chose (queries.SHOWN_POLICY).
_SHOWN_FACTS = ("layer_facts", "decision_facts")

POLICY_SHARES = _q("policy_shares", f"""
SELECT {_SHOWN} AS policy, count(*) AS plans, count(*) / sum(count(*)) OVER () AS share
FROM layer_facts b LEFT JOIN decision_facts d USING (step, microbatch, layer)
GROUP BY 1 ORDER BY plans DESC, policy
""", doc="As queries.POLICY_SHARES: share of layer-microbatches planned by each policy ('quota via adaptive').")

IMBALANCE_OVER_STEPS = _q("imbalance_over_steps", f"""
SELECT {_BIN} AS step, avg(imbalance_before) AS imbalance_before, avg(imbalance_after) AS imbalance_after,
       count(*) AS plans
FROM layer_facts GROUP BY 1 ORDER BY 1
""", params=("first", "bin"))

OVERVIEW_UNITS = ("layer", "plan", "timing", "runs_log", "steps")


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def headline(mirror: RunMirror) -> dict[str, Any]:
    """The Overview's figures for one run (see docs/dashboard.md for each definition).

    * ``mean_imbalance_before/after``: mean over layer-microbatches of max/mean rank load.
    * ``pct_of_ideal``: Σ force-balanced ideal time / Σ time (measured, else predicted) over the
      layer-microbatches that recorded ``ideal_s`` (the simulator does), in %; ``ideal_basis`` 'time'.
      Without ``ideal_s``: Σ mean rank load / Σ max rank load after balancing (compute-bound share of
      the ideal, no overhead counted), ``ideal_basis`` 'load'.
    * ``plan_s`` / ``transfer_s``: summed planning / transfer seconds (timings; planning falls back to
      the planners' ``solve_time_s``), and their share of the summed layer time when one is known.
    * ``warmup_steps``: steps marked warm-up; every figure above leaves them out (counts keep them).
    """
    mirror.refresh(OVERVIEW_UNITS)
    lay = mirror_query(mirror, HEADLINE_LAYERS, ("layer_facts", sc.T_STEPS)).iloc[0].to_dict()
    tim = mirror_query(mirror, HEADLINE_TIMINGS, ("timing_facts", sc.T_STEPS)).iloc[0].to_dict()
    pl = mirror_query(mirror, HEADLINE_PLANS, ("plan_facts", sc.T_STEPS)).iloc[0].to_dict()
    out: dict[str, Any] = {
        "plans": int(lay["plans"] or 0), "layers": int(lay["layers"] or 0), "steps": int(lay["steps"] or 0),
        "warmup_steps": int(lay["warmup_steps"] or 0),
        "first_step": _num(lay["first_step"]), "last_step": _num(lay["last_step"]),
        "tokens": int(_num(lay["tokens"]) or 0),
        "mean_imbalance_before": _num(lay["mean_imbalance_before"]),
        "mean_imbalance_after": _num(lay["mean_imbalance_after"]),
        "timed": int(tim["timed"] or 0), "transfers": int(_num(pl["transfers"]) or 0),
        "mean_replicas": _num(pl["mean_replicas"]),
    }
    ideal, t_ideal = _num(tim["ideal_s"]), _num(tim["time_with_ideal_s"])
    if ideal is not None and t_ideal:
        out["pct_of_ideal"], out["ideal_basis"] = 100.0 * ideal / t_ideal, "time"
    elif _num(lay["load_ideal_after"]) is not None:
        out["pct_of_ideal"], out["ideal_basis"] = 100.0 * float(lay["load_ideal_after"]), "load"
    else:
        out["pct_of_ideal"], out["ideal_basis"] = None, None
    out["pct_of_ideal_before"] = (100.0 * float(lay["load_ideal_before"])
                                  if _num(lay["load_ideal_before"]) is not None else None)
    plan_s = _num(tim["plan_s"])
    out["plan_basis"] = "timings"
    if plan_s is None:
        plan_s, out["plan_basis"] = _num(pl["solve_time_s"]), "solve_time"
    out["plan_s"] = plan_s
    out["transfer_s"] = _num(tim["transfer_s"])
    time_s = _num(tim["time_s"])
    out["time_s"] = time_s
    out["plan_share"] = plan_s / time_s if plan_s is not None and time_s else None
    out["transfer_share"] = out["transfer_s"] / time_s if out["transfer_s"] is not None and time_s else None
    out["generation"] = mirror.generation
    return out


def policy_shares(mirror: RunMirror):
    return mirror_query(mirror, POLICY_SHARES, _SHOWN_FACTS)


def imbalance_over_steps(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, IMBALANCE_OVER_STEPS, ("layer_facts",), first=bins.first_step, bin=bins.bin)


# --------------------------------------------------------------------------- layers
LAYER_STEP_IMBALANCE = _q("layer_step_imbalance", f"""
SELECT layer, {_BIN} AS step, avg(imbalance_before) AS imbalance_before,
       avg(imbalance_after) AS imbalance_after, count(*) AS plans
FROM layer_facts GROUP BY layer, 2 ORDER BY layer, 2
""", params=("first", "bin"), doc="Heatmap cells; with bin = 1 equal to queries.LAYER_IMBALANCE.")

LAYER_SUMMARY = _q("layer_summary", f"""
SELECT layer, count(*) AS plans, avg(imbalance_before) FILTER (WHERE settled) AS mean_before,
       avg(imbalance_after) FILTER (WHERE settled) AS mean_after,
       max(imbalance_before) FILTER (WHERE settled) AS max_before,
       max(imbalance_after) FILTER (WHERE settled) AS max_after,
       avg(max_after - mean_after) FILTER (WHERE settled) AS mean_straggler_after_tokens
FROM (SELECT *, {_SETTLED} AS settled FROM layer_facts) GROUP BY layer ORDER BY layer
""", doc="As queries.LAYER_SUMMARY (warm-up excluded).")

MICROBATCHES = _q("microbatches", """
SELECT DISTINCT microbatch FROM layer_facts WHERE layer = $layer AND step = $step ORDER BY microbatch
""", params=("layer", "step"))


def layer_step_imbalance(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, LAYER_STEP_IMBALANCE, ("layer_facts",), first=bins.first_step, bin=bins.bin)


def layer_summary(mirror: RunMirror):
    return mirror_query(mirror, LAYER_SUMMARY, ("layer_facts", sc.T_STEPS))


_STORES: OrderedDict = OrderedDict()


def store(run_dir):
    """A cursor on the run's store connection (``open_run``, cached per run; its views re-glob the parts
    at every query, so new rows show up)."""
    from ultraep.telemetry import open_run

    key = Path(run_dir).resolve()
    with _BASE_LOCK:
        con = _STORES.get(key)
        if con is None:
            con = _STORES[key] = open_run(key)
        _STORES.move_to_end(key)
        while len(_STORES) > 8:
            _STORES.popitem(last=False)[1].close()
        return con.cursor()


def rank_load_by_expert(run_dir, run_id: str, layer: int, step: int, microbatch: int | None = None):
    """Tokens each rank receives from each expert before/after balancing for one layer and step (store,
    ``queries.RANK_LOAD_BY_EXPERT``)."""
    from ultraep.telemetry import queries

    cur = store(run_dir)
    try:
        q = queries.RANK_LOAD_BY_EXPERT
        return cur.execute(q.sql, q.bind(run_id=run_id, layer=layer, step=step, microbatch=microbatch)).df()
    finally:
        cur.close()


# --------------------------------------------------------------------------- experts
def _per_layer_matrix(tbl, column: str, layer: int):
    """Rows of one layer as ``(steps [n], matrix [n, E])`` from a per-expert fact table."""
    import pyarrow.compute as pc

    sel = tbl.filter(pc.equal(tbl.column(sc.C_LAYER), layer))
    n = sel.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
    steps = sel.column(sc.C_STEP).to_numpy()
    col = sel.column(column).combine_chunks()
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    E = int(lengths.max()) if n else 0
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
    if (lengths == E).all():
        return steps, flat.reshape(n, E)
    mat = np.zeros((n, E), dtype=np.int64)  # ragged (a run whose E changed): pad with zeros
    pos = 0
    for i, ln in enumerate(lengths.tolist()):
        mat[i, :ln] = flat[pos:pos + ln]
        pos += ln
    return steps, mat


def _bin_sum(steps: np.ndarray, mat: np.ndarray, bins: Bins) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step bin: (bin start steps [b], summed matrix [b, E], rows per bin [b])."""
    b = (steps - bins.first_step) // bins.bin
    uniq, inv = np.unique(b, return_inverse=True)
    out = np.zeros((uniq.size, mat.shape[1]), dtype=np.float64)
    np.add.at(out, inv, mat)
    counts = np.bincount(inv, minlength=uniq.size)
    return bins.first_step + uniq * bins.bin, out, counts


def expert_load(mirror: RunMirror, layer: int, bins: Bins):
    """Long table (step, expert, load_tokens): tokens routed to each expert per step bin, summed over the
    bin's microbatches and divided by the number of steps in the bin (per-step load, {token})."""
    import pandas as pd

    mirror.refresh(("expert",))
    steps, mat = _per_layer_matrix(mirror.facts("expert_facts"), "expert_load", layer)
    if steps.size == 0:
        return pd.DataFrame(columns=["step", "expert", "load_tokens"])
    starts, sums, _ = _bin_sum(steps, mat, bins)
    per_bin_steps = _steps_per_bin(steps, bins, starts)
    loads = sums / per_bin_steps[:, None]
    B, E = loads.shape
    return pd.DataFrame({"step": np.repeat(starts, E), "expert": np.tile(np.arange(E), B),
                         "load_tokens": loads.ravel()})


def _steps_per_bin(steps: np.ndarray, bins: Bins, starts: np.ndarray) -> np.ndarray:
    u = np.unique(steps)
    b = (u - bins.first_step) // bins.bin
    cnt = np.bincount(b, minlength=int(b.max()) + 1 if b.size else 0)
    return cnt[(starts - bins.first_step) // bins.bin].astype(np.float64)


def replica_counts(mirror: RunMirror, layer: int, bins: Bins):
    """Long table (step, expert, replicas): mean replicas (instances beyond the master) per step bin."""
    import pandas as pd

    mirror.refresh(("replica",))
    steps, mat = _per_layer_matrix(mirror.facts("replica_facts"), "replicas", layer)
    if steps.size == 0:
        return pd.DataFrame(columns=["step", "expert", "replicas"])
    starts, sums, counts = _bin_sum(steps, mat, bins)
    mean = sums / counts[:, None]
    B, E = mean.shape
    return pd.DataFrame({"step": np.repeat(starts, E), "expert": np.tile(np.arange(E), B),
                         "replicas": mean.ravel()})


def hottest_experts(load_df, top: int = 10):
    """The ``top`` experts by total load with their share of the layer's load in the first and last
    quarter of the bins (drift: how the hot set moves)."""
    import pandas as pd

    cols = ["expert", "load_tokens", "share", "share_first_quarter", "share_last_quarter", "drift"]
    if load_df is None or not len(load_df):
        return pd.DataFrame(columns=cols)
    wide = load_df.pivot_table(index="step", columns="expert", values="load_tokens", aggfunc="sum").fillna(0.0)
    total = wide.sum(axis=0)
    grand = float(total.sum()) or 1.0
    q = max(1, len(wide) // 4)
    first, last = wide.iloc[:q].sum(axis=0), wide.iloc[-q:].sum(axis=0)
    f_tot, l_tot = float(first.sum()) or 1.0, float(last.sum()) or 1.0
    df = pd.DataFrame({"expert": total.index.astype(int), "load_tokens": total.values,
                       "share": total.values / grand, "share_first_quarter": first.values / f_tot,
                       "share_last_quarter": last.values / l_tot})
    df["drift"] = df["share_last_quarter"] - df["share_first_quarter"]
    return df.sort_values(["load_tokens", "expert"], ascending=[False, True]).head(top).reset_index(drop=True)[cols]


def hot_set_turnover(load_df, k: int = 4):
    """Per step bin: the hottest expert and the share of the top-``k`` set that changed since the
    previous bin (0 = the same hot experts, 1 = all new)."""
    import pandas as pd

    if load_df is None or not len(load_df):
        return pd.DataFrame(columns=["step", "hottest_expert", "turnover"])
    wide = load_df.pivot_table(index="step", columns="expert", values="load_tokens", aggfunc="sum").fillna(0.0)
    vals = wide.to_numpy()
    k = max(1, min(k, vals.shape[1]))
    top = np.argsort(-vals, axis=1, kind="stable")[:, :k]
    experts = wide.columns.to_numpy()
    turnover = [np.nan]
    for i in range(1, len(top)):
        turnover.append(1.0 - len(set(top[i]) & set(top[i - 1])) / k)
    return pd.DataFrame({"step": wide.index.to_numpy(), "hottest_expert": experts[top[:, 0]].astype(int),
                         "turnover": turnover})


# --------------------------------------------------------------------------- policies
DECISION_MAP = _q("decision_map", f"""
SELECT layer, {_BIN} AS step, mode(policy) AS policy, count(*) AS decisions,
       count(DISTINCT policy) AS policies
FROM decision_facts GROUP BY layer, 2 ORDER BY layer, 2
""", params=("first", "bin"), doc="The most frequent decision per layer and step bin.")

DECISION_SWITCHES = _q("decision_switches", """
SELECT layer, count(*) AS decisions, count(DISTINCT policy) AS policies,
       count(*) FILTER (WHERE prev IS NOT NULL AND prev <> policy) AS switches
FROM (SELECT layer, policy, lag(policy) OVER (PARTITION BY layer ORDER BY step, microbatch) AS prev
      FROM decision_facts)
GROUP BY layer ORDER BY layer
""", doc="Per layer: decisions and how often the chosen policy changed from one decision to the next.")

DECISION_REASONS = _q("decision_reasons", """
SELECT policy, reason, count(*) AS decisions, min(step) AS first_step, max(step) AS last_step
FROM decision_facts GROUP BY policy, reason ORDER BY decisions DESC, policy, reason LIMIT 200
""")

RECENT_DECISIONS = _q("recent_decisions", """
SELECT step, microbatch, layer, policy, reason, chosen_predicted_s, ts
FROM decision_facts WHERE layer = $layer ORDER BY step DESC, microbatch DESC LIMIT $limit
""", params=("layer", "limit"))

PREDICTIONS = _q("predictions", """
SELECT t.step, t.microbatch, t.layer, coalesce(d.policy, '?') AS policy,
       coalesce(t.predicted_s, d.chosen_predicted_s) AS predicted_s, t.measured_s,
       t.measured_s / nullif(coalesce(t.predicted_s, d.chosen_predicted_s), 0) - 1 AS rel_error
FROM timing_facts t LEFT JOIN decision_facts d USING (step, microbatch, layer)
WHERE t.measured_s IS NOT NULL AND coalesce(t.predicted_s, d.chosen_predicted_s) IS NOT NULL
""", doc="Per layer-microbatch: prediction (timings.predicted_s, else the decision's) vs measured (slowest "
         "rank), as queries.PREDICTED_VS_MEASURED.")

PREDICTION_SUMMARY = _q("prediction_summary", f"""
SELECT policy, count(*) AS samples,
       avg(predicted_s) AS mean_predicted_s, avg(measured_s) AS mean_measured_s,
       avg(abs(rel_error)) AS mean_abs_rel_error,
       sum(measured_s) / nullif(sum(predicted_s), 0) AS measured_over_predicted
FROM predictions WHERE {_SETTLED} GROUP BY policy ORDER BY policy
""", doc="As queries.PREDICTION_SUMMARY (warm-up excluded).")

PREDICTION_OVER_STEPS = _q("prediction_over_steps", f"""
SELECT {_BIN} AS step, policy, count(*) AS samples,
       avg(predicted_s) AS predicted_s, avg(measured_s) AS measured_s, avg(rel_error) AS rel_error
FROM predictions GROUP BY ALL ORDER BY 1, 2
""", params=("first", "bin"))


_TERM_ERRORS = " UNION ALL ".join(
    f"""SELECT step, '{t}' AS term, "measured.{t}" / "predicted.{t}" - 1 AS rel_error
FROM timing_facts WHERE "predicted.{t}" > 0 AND "measured.{t}" IS NOT NULL""" for t in sc.PREDICTED_TERMS)

PHASE_ERRORS_OVER_STEPS = _q("phase_errors_over_steps", f"""
SELECT {_BIN} AS step, term AS policy, count(*) AS samples, median(abs(rel_error)) AS rel_error
FROM ({_TERM_ERRORS}) GROUP BY ALL ORDER BY 1, 2
""", params=("first", "bin"), doc="Per step bin and cost-model term: the median |measured / predicted - 1| (runs "
    "of the runtime record predicted.<term> and measured.<term>; the slowest rank's measurement).")

POLICY_UNITS = ("layer", "decision", "timing")


def decision_map(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, DECISION_MAP, ("decision_facts",), first=bins.first_step, bin=bins.bin)


def decision_switches(mirror: RunMirror):
    """Per layer: decisions, distinct policies and policy changes (in step, microbatch order)."""
    mirror.refresh(("decision",))
    if not mirror.is_sorted("decision_facts"):
        return mirror_query(mirror, DECISION_SWITCHES, ("decision_facts",))

    def compute():  # rows already in (step, microbatch, layer) order: a stable sort by layer suffices
        import pandas as pd
        import pyarrow.compute as pc

        t = mirror.facts("decision_facts")
        layer = t.column(sc.C_LAYER).to_numpy()
        codes = pc.dictionary_encode(t.column("policy")).combine_chunks().indices.to_numpy(zero_copy_only=False)
        order = np.argsort(layer, kind="stable")
        lay, pol = layer[order], codes[order]
        change = np.zeros(lay.size, dtype=bool)
        change[1:] = (lay[1:] == lay[:-1]) & (pol[1:] != pol[:-1])
        uniq, start = np.unique(lay, return_index=True)
        counts = np.diff(np.append(start, lay.size))
        switches = np.add.reduceat(change, start) if lay.size else np.zeros(0, dtype=np.int64)
        policies = [len(np.unique(pol[a:a + n])) for a, n in zip(start, counts)]
        return pd.DataFrame({"layer": uniq.astype(np.int64), "decisions": counts.astype(np.int64),
                             "policies": np.asarray(policies, dtype=np.int64),
                             "switches": np.asarray(switches, dtype=np.int64)})

    return mirror.memo(("decision_switches",), ("decision_facts",), compute).copy()


def decision_reasons(mirror: RunMirror):
    return mirror_query(mirror, DECISION_REASONS, ("decision_facts",))


def recent_decisions(mirror: RunMirror, layer: int, limit: int = 50):
    return mirror_query(mirror, RECENT_DECISIONS, ("decision_facts",), layer=layer, limit=limit)


def predictions(mirror: RunMirror):
    """The joined predictions table (Arrow), cached until new timings or decisions arrive."""
    facts = ("timing_facts", "decision_facts")
    mirror.refresh(("timing", "decision"))

    def compute():
        cur = _cursor()
        try:
            for f in facts:
                cur.register(f, mirror.facts(f))
            rel = cur.sql(PREDICTIONS.sql)
            fn = getattr(rel, "to_arrow_table", None) or rel.arrow
            return fn()
        finally:
            cur.close()

    return mirror.memo(("predictions",), facts, compute)


def _on_predictions(mirror: RunMirror, query: Query, *, with_steps: bool = False, **params):
    table = predictions(mirror)
    tables, facts = {"predictions": table}, ("timing_facts", "decision_facts")
    if with_steps:  # the warm-up steps, for summaries that leave them out
        mirror.refresh(("steps",))
        tables[sc.T_STEPS], facts = mirror.facts(sc.T_STEPS), facts + (sc.T_STEPS,)
    key = ("predictions", query.name, tuple(sorted(params.items())))
    return mirror.memo(key, facts, lambda: facts_query(tables, query, **params)).copy()


def prediction_summary(mirror: RunMirror):
    return _on_predictions(mirror, PREDICTION_SUMMARY, with_steps=True)


def prediction_over_steps(mirror: RunMirror, bins: Bins):
    return _on_predictions(mirror, PREDICTION_OVER_STEPS, first=bins.first_step, bin=bins.bin)


def phase_errors_over_steps(mirror: RunMirror, bins: Bins):
    """Per step bin and cost-model term (column ``policy``, so the prediction charts draw it): the median
    absolute relative prediction error."""
    return mirror_query(mirror, PHASE_ERRORS_OVER_STEPS, ("timing_facts",), first=bins.first_step, bin=bins.bin)


def prediction_sample(mirror: RunMirror, limit: int = 1500):
    """At most ``limit`` layer-microbatches, evenly spread over the run (for the scatter)."""
    t = predictions(mirror)
    if t.num_rows > limit:
        t = t.take(np.linspace(0, t.num_rows - 1, limit).astype(np.int64))
    return t.to_pandas()


# --------------------------------------------------------------------------- transfers
TRANSFERS_OVER_STEPS = _q("transfers_over_steps", f"""
SELECT {_BIN} AS step, sum(transfers)::BIGINT AS transfers, sum(bytes)::BIGINT AS bytes,
       sum(relay_bytes)::BIGINT AS relay_bytes, (sum(bytes) - sum(relay_bytes))::BIGINT AS direct_bytes,
       max(busiest_sender_bytes)::BIGINT AS busiest_sender_bytes, max(max_fan_out)::BIGINT AS max_fan_out,
       count(DISTINCT step) AS steps
FROM transfer_plan_facts GROUP BY 1 ORDER BY 1
""", params=("first", "bin"), doc="With bin = 1 equal to queries.TRANSFER_BYTES_PER_STEP (bytes summed).")

TRANSFER_TOTALS = _q("transfer_totals", """
SELECT count(*) AS plans_with_transfers, coalesce(sum(transfers), 0)::BIGINT AS transfers,
       coalesce(sum(bytes), 0)::BIGINT AS bytes, coalesce(sum(relay_transfers), 0)::BIGINT AS relay_transfers,
       coalesce(sum(relay_bytes), 0)::BIGINT AS relay_bytes, max(max_fan_out) AS max_fan_out,
       max(busiest_sender_bytes) AS busiest_sender_bytes
FROM transfer_plan_facts
""")

TRANSFER_SENDERS = _q("transfer_senders", """
SELECT src AS rank, count(*) AS transfers, sum(bytes)::BIGINT AS bytes,
       coalesce(sum(bytes) FILTER (WHERE stage = 1), 0)::BIGINT AS relay_bytes,
       (sum(bytes) - coalesce(sum(bytes) FILTER (WHERE stage = 1), 0))::BIGINT AS direct_bytes,
       count(DISTINCT expert) AS experts
FROM transfer_facts GROUP BY src ORDER BY src
""", doc="Per sending rank over the whole run.")

TRANSFER_FANOUT = _q("transfer_fanout", """
SELECT expert, sum(copies)::BIGINT AS copies, sum(bytes)::BIGINT AS bytes, max(fan_out) AS max_fan_out,
       avg(fan_out) AS mean_fan_out, count(*) AS planned_microbatches
FROM transfer_expert_facts GROUP BY expert ORDER BY copies DESC, expert
""", doc="Per logical expert: copies sent, and fan-out (copies one rank sent in one layer-microbatch).")

TRANSFER_LAYERS = _q("transfer_layers", """
SELECT layer, sum(transfers)::BIGINT AS transfers, sum(bytes)::BIGINT AS bytes,
       count(DISTINCT (step, microbatch)) AS planned_microbatches,
       sum(relay_bytes)::BIGINT AS relay_bytes
FROM transfer_plan_facts GROUP BY layer ORDER BY layer
""", doc="As queries.TRANSFER_SUMMARY (without the measured columns).")

TRANSFER_LAYERS_MEASURED = _q("transfer_layers_measured", f"""
SELECT t.layer, count(m.seconds) AS measured, sum(m.seconds) AS measured_s,
       sum(t.bytes) FILTER (WHERE m.seconds > 0) / nullif(sum(m.seconds), 0) AS bandwidth_Bps
FROM transfer_facts t JOIN transfer_time_facts m USING (step, microbatch, layer, idx)
WHERE {_SETTLED}
GROUP BY t.layer ORDER BY t.layer
""", doc="As queries.TRANSFER_SUMMARY's measured columns (transfer_times joined to transfers; warm-up "
         "excluded).")

TRANSFER_UNITS = ("transfer", "transfer_time", "layer")


def transfers_over_steps(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, TRANSFERS_OVER_STEPS, ("transfer_plan_facts",), first=bins.first_step, bin=bins.bin)


def transfer_totals(mirror: RunMirror) -> dict[str, Any]:
    return mirror_query(mirror, TRANSFER_TOTALS, ("transfer_plan_facts",)).iloc[0].to_dict()


def transfer_senders(mirror: RunMirror):
    return mirror_query(mirror, TRANSFER_SENDERS, ("transfer_facts",))


def transfer_fanout(mirror: RunMirror):
    return mirror_query(mirror, TRANSFER_FANOUT, ("transfer_expert_facts",))


def transfer_layers(mirror: RunMirror):
    df = mirror_query(mirror, TRANSFER_LAYERS, ("transfer_plan_facts",))
    mirror.refresh(("transfer_time",))
    if mirror.facts("transfer_time_facts").num_rows:
        meas = mirror_query(mirror, TRANSFER_LAYERS_MEASURED, ("transfer_facts", "transfer_time_facts", sc.T_STEPS))
        df = df.merge(meas, on="layer", how="left")
        df["measured"] = df["measured"].fillna(0).astype("int64")
    else:
        df["measured"], df["measured_s"], df["bandwidth_Bps"] = 0, np.nan, np.nan
    return df


def transfer_step_range(mirror: RunMirror) -> Bins | None:
    t = mirror.facts("transfer_plan_facts")
    if t.num_rows == 0:
        return None
    import pyarrow.compute as pc

    mm = pc.min_max(t.column(sc.C_STEP)).as_py()
    return step_bins(mm["min"], mm["max"])


# --------------------------------------------------------------------------- compare
COMPARE = _q("compare", f"""
WITH b AS (SELECT *, {_SETTLED} AS settled FROM layer_facts),
t AS (SELECT step, microbatch, layer, bytes FROM transfer_plan_facts),
m AS (SELECT step, microbatch, layer, coalesce(measured_s, predicted_s) AS time_s, measured_s, predicted_s,
             ideal_s FROM timing_facts)
SELECT {_SHOWN} AS policy, count(*) AS plans,
       count(*) / sum(count(*)) OVER () AS share,
       avg(b.imbalance_before) FILTER (WHERE b.settled) AS mean_imbalance_before,
       avg(b.imbalance_after) FILTER (WHERE b.settled) AS mean_imbalance_after,
       sum(b.mean_after) FILTER (WHERE b.settled) / nullif(sum(b.max_after) FILTER (WHERE b.settled), 0)
           AS load_ideal_after,
       avg(coalesce(t.bytes, 0)) FILTER (WHERE b.settled) AS mean_transfer_bytes,
       avg(m.measured_s) FILTER (WHERE b.settled) AS mean_measured_s,
       avg(m.predicted_s) FILTER (WHERE b.settled) AS mean_predicted_s,
       avg(m.time_s) FILTER (WHERE b.settled) AS mean_time_s,
       sum(m.ideal_s) FILTER (WHERE m.time_s IS NOT NULL AND b.settled) /
           nullif(sum(m.time_s) FILTER (WHERE m.ideal_s IS NOT NULL AND b.settled), 0) AS time_ideal
FROM b LEFT JOIN t USING (step, microbatch, layer) LEFT JOIN m USING (step, microbatch, layer)
     LEFT JOIN decision_facts d USING (step, microbatch, layer)
GROUP BY 1 ORDER BY plans DESC, policy
""", doc="Per policy within one run; as queries.POLICY_COMPARISON plus the share of the ideal (warm-up "
         "excluded from the means).")

COMPARE_UNITS = ("layer", "decision", "timing", "transfer", "runs_log", "steps")


def compare_runs(mirrors: list[RunMirror], bins_max: int = MAX_BINS):
    """Per (run, policy) comparison rows and per (run, policy, step bin) mean imbalance after."""
    import pandas as pd

    rows, series = [], []
    for m in mirrors:
        m.refresh(COMPARE_UNITS)
        df = mirror_query(m, COMPARE, _SHOWN_FACTS + ("transfer_plan_facts", "timing_facts", sc.T_STEPS))
        if not len(df):
            continue
        df.insert(0, "run_id", m.run_id)
        df["pct_of_ideal"] = np.where(df["time_ideal"].notna(), 100.0 * df["time_ideal"],
                                      100.0 * df["load_ideal_after"])
        rows.append(df)
        bins, _ = layer_bins(m, bins_max)
        if bins is not None:
            s = mirror_query(m, COMPARE_OVER_STEPS, _SHOWN_FACTS, first=bins.first_step, bin=bins.bin)
            s.insert(0, "run_id", m.run_id)
            series.append(s)
    cmp = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    over = pd.concat(series, ignore_index=True) if series else pd.DataFrame()
    return cmp, over


COMPARE_OVER_STEPS = _q("compare_over_steps", f"""
SELECT {_SHOWN} AS policy, {_BIN} AS step, avg(imbalance_after) AS imbalance_after,
       count(*) AS plans
FROM layer_facts b LEFT JOIN decision_facts d USING (step, microbatch, layer)
GROUP BY 1, 2 ORDER BY 1, 2
""", params=("first", "bin"))


# --------------------------------------------------------------------------- the SQL page's sandbox
class SqlRefused(Exception):
    """A statement the SQL page does not run (anything but a read-only query)."""


SANDBOX_TABLES = sc.RAW_TABLES
MAX_SQL_ROWS = 10_000
SQL_TIMEOUT_S = 30.0


def _dataset(run_dir: Path, table: str):
    import pyarrow.dataset as ds

    d = run_dir / table
    files = sorted(str(p) for p in d.glob("*.parquet") if not p.name.startswith(".")) if d.is_dir() else []
    return ds.dataset(files, schema=sc.arrow_schema(table), format="parquet")


def sandbox(run_dir, *, memory_limit: str = "2GB", threads: int = 2):
    """A DuckDB connection over one run that can read the run's tables and nothing else.

    Every raw table is a view over a pyarrow dataset of the run's parts as they are now (Python objects,
    not file paths); the derived views come from ``schema.sql``. Then ``enable_external_access = false``
    (no file, network or extension access: ``read_text``, ``COPY ... TO``, ``ATTACH``, ``INSTALL`` fail),
    Python replacement scans are off, and ``lock_configuration = true`` (no ``SET`` / ``RESET``).
    """
    import duckdb

    from ultraep.telemetry.store import schema_statements

    run_dir = Path(run_dir)
    con = duckdb.connect(":memory:")
    con.execute(f"SET memory_limit = '{memory_limit}'")  # fixed settings, not user values
    con.execute(f"SET threads = {int(threads)}")
    cols = {t: ", ".join('"' + c + '"' for c in sc.columns(t)) for t in SANDBOX_TABLES}
    for t in SANDBOX_TABLES:
        con.register(f"_parts_{t}", _dataset(run_dir, t))
        con.execute(f'CREATE VIEW "{t}" AS SELECT {cols[t]} FROM "_parts_{t}"')
    for stmt in schema_statements()[1]:
        con.execute(stmt)
    con.execute("SET enable_external_access = false")
    try:
        con.execute("SET python_enable_replacements = false")
    except duckdb.Error:  # pragma: no cover - older DuckDB
        pass
    con.execute("SET lock_configuration = true")
    return con


def check_sql(con, sql: str) -> None:
    """Refuse anything but one read-only query (SELECT / WITH / VALUES / DESCRIBE / SHOW / EXPLAIN)."""
    import duckdb

    text = sql.strip().rstrip(";").strip()
    if not text:
        raise SqlRefused("empty query")
    try:
        stmts = con.extract_statements(text)
    except duckdb.Error as exc:
        raise SqlRefused(_first_line(exc)) from None
    if len(stmts) != 1:
        raise SqlRefused(f"one statement at a time, got {len(stmts)}")
    st = stmts[0].type
    allowed = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
    if st not in allowed:
        raise SqlRefused(f"only read-only queries run here (SELECT, WITH, EXPLAIN); got {st.name}")


def run_sql(run_dir, sql: str, *, max_rows: int = MAX_SQL_ROWS, timeout_s: float = SQL_TIMEOUT_S):
    """Run a user's query in :func:`sandbox`; returns ``(DataFrame, truncated)``.

    Raises :class:`SqlRefused` for anything but one read-only query, and for queries DuckDB refuses
    (file access, locked configuration, syntax) with DuckDB's first line.
    """
    import duckdb
    import pandas as pd

    con = sandbox(run_dir)
    timer = threading.Timer(timeout_s, con.interrupt)
    try:
        check_sql(con, sql)
        timer.start()
        try:
            cur = con.execute(sql.strip().rstrip(";"))
            names = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchmany(max_rows + 1)
        except duckdb.InterruptException:
            raise SqlRefused(f"stopped after {timeout_s:.0f} s") from None
        except duckdb.Error as exc:
            raise SqlRefused(_first_line(exc)) from None
    finally:
        timer.cancel()
        con.close()
    truncated = len(rows) > max_rows
    df = pd.DataFrame.from_records(rows[:max_rows], columns=names)
    return df, truncated


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

