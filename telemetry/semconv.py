"""Every name telemetry uses: spans, metrics, units, attributes, tables and their columns.

Nothing else in ultraep spells a telemetry name as a string literal; the recorder, the store, the
canned queries, the CLI and the dashboard import them from here. ``schema.sql`` documents the same
tables in SQL and a test checks that the two agree column by column.

Units follow the OpenTelemetry / UCUM conventions: ``s`` (seconds), ``By`` (bytes), ``{token}``
(token-expert assignments), ``1`` (a ratio).

Column types are DuckDB type names; :func:`arrow_type` maps them to the Arrow types the writers use.
"""

from __future__ import annotations

from functools import lru_cache

from ultraep.timings import TERMS

# --------------------------------------------------------------------------- resource / scope
SERVICE_NAME = "ultraep"
INSTRUMENTATION_SCOPE = "ultraep.telemetry"

# --------------------------------------------------------------------------- units
UNIT_SECONDS = "s"
UNIT_BYTES = "By"
UNIT_TOKENS = "{token}"
UNIT_RATIO = "1"
UNIT_PLANS = "{plan}"
UNIT_TRANSFERS = "{transfer}"
UNIT_STEPS = "{step}"

# --------------------------------------------------------------------------- spans
SPAN_STEP = "ultraep.step"          # one training / prefill step, real wall-clock interval
SPAN_PLAN = "ultraep.plan"          # per-step aggregate of planning (child of ultraep.step)
SPAN_TRANSFER = "ultraep.transfer"  # per-step aggregate of expert-state transfers (child of ultraep.step)

# --------------------------------------------------------------------------- attributes
ATTR_RUN_ID = "ultraep.run_id"
ATTR_RUN_NAME = "ultraep.run_name"
ATTR_RUN_KIND = "ultraep.run_kind"
ATTR_RANK = "ultraep.rank"
ATTR_WORLD_SIZE = "ultraep.world_size"
ATTR_MODEL = "ultraep.model"
ATTR_CONFIG_HASH = "ultraep.config_hash"
ATTR_STEP = "ultraep.step"
ATTR_LOSS = "ultraep.loss"
ATTR_STEP_TIME = "ultraep.step_time_s"
ATTR_WARMUP = "ultraep.warmup"          # true on a warm-up step (compile, allocation, first plans)
ATTR_PLAN_COUNT = "ultraep.plan.count"
ATTR_PLAN_SOLVE_TIME = "ultraep.plan.solve_time_s"
ATTR_TOKENS = "ultraep.tokens"
ATTR_TRANSFER_COUNT = "ultraep.transfer.count"
ATTR_TRANSFER_BYTES = "ultraep.transfer.bytes"
ATTR_IMBALANCE_BEFORE = "ultraep.imbalance.before"
ATTR_IMBALANCE_AFTER = "ultraep.imbalance.after"
ATTR_TIMING_PREFIX = "ultraep.timing."  # + a timing key, e.g. ultraep.timing.dispatch_s
ATTR_AGGREGATE = "ultraep.aggregate"    # true on per-step aggregate spans (duration = summed time)

# --------------------------------------------------------------------------- metrics
METRIC_STEP_DURATION = "ultraep.step.duration"
METRIC_STEPS = "ultraep.steps"
METRIC_LOSS = "ultraep.loss"
METRIC_PLANS = "ultraep.plan.count"
METRIC_PLAN_SOLVE_TIME = "ultraep.plan.solve_time"
METRIC_TOKENS = "ultraep.tokens"
METRIC_TRANSFERS = "ultraep.transfer.count"
METRIC_TRANSFER_BYTES = "ultraep.transfer.bytes"
METRIC_IMBALANCE_BEFORE = "ultraep.imbalance.before"
METRIC_IMBALANCE_AFTER = "ultraep.imbalance.after"

# name -> (instrument kind, unit, description); the recorder creates exactly these instruments.
METRICS: dict[str, tuple[str, str, str]] = {
    METRIC_STEP_DURATION: ("histogram", UNIT_SECONDS, "Wall time of a step (one point per step)."),
    METRIC_STEPS: ("counter", UNIT_STEPS, "Steps recorded."),
    METRIC_LOSS: ("gauge", UNIT_RATIO, "Loss of the last step."),
    METRIC_PLANS: ("counter", UNIT_PLANS, "Layer plans recorded."),
    METRIC_PLAN_SOLVE_TIME: ("counter", UNIT_SECONDS, "Total planner solve time."),
    METRIC_TOKENS: ("counter", UNIT_TOKENS, "Token-expert assignments planned."),
    METRIC_TRANSFERS: ("counter", UNIT_TRANSFERS, "Expert-state transfers planned."),
    METRIC_TRANSFER_BYTES: ("counter", UNIT_BYTES, "Bytes of expert state planned to move."),
    METRIC_IMBALANCE_BEFORE: ("gauge", UNIT_RATIO, "Mean max/mean rank load of a step's plans, unbalanced."),
    METRIC_IMBALANCE_AFTER: ("gauge", UNIT_RATIO, "Mean max/mean rank load of a step's plans, as planned."),
}

# --------------------------------------------------------------------------- timing keys
# record_timings() keys with a column of their own; any other key goes to the `other` MAP column.
TIMING_KEYS = (
    "plan_s",
    "transfer_s",
    "dispatch_s",
    "experts_s",
    "combine_s",
    "backward_reduce_s",
    "measured_s",
    "predicted_s",
)

#: cost-model terms the runtime records as ``predicted.<term>`` and ``measured.<term>`` timing keys (in ``other``):
#: the one set of phase names (:mod:`ultraep.timings`)
PREDICTED_TERMS = TERMS

#: replica-cache counters the runtime records per call and rank (in ``other``): replicas of this rank found
#: resident, replicas streamed, and the weight bytes the hits did not receive
CACHE_KEYS = ("cache_hits", "cache_misses", "cache_bytes_saved")

RUN_KINDS = ("train", "prefill", "simulation")

# --------------------------------------------------------------------------- tables
# Raw tables: what the writers append (one Parquet part per flush, per table, per rank).
T_RUNS_LOG = "runs_log"
T_STEPS = "steps"
T_LAYER_LOADS = "layer_loads"
T_PLANS = "plans"
T_TRANSFERS = "transfers"
T_TRANSFER_TIMES = "transfer_times"
T_DECISIONS = "decisions"
T_TIMINGS = "timings"
T_SPANS = "spans"
T_METRIC_POINTS = "metric_points"

# Derived views (defined in schema.sql over the raw tables).
V_RUNS = "runs"
V_LAYER_BALANCE = "layer_balance"
V_TRANSFER_DETAIL = "transfer_detail"
V_WARMUP_STEPS = "warmup_steps"
V_STEP_TIMES = "step_times"
V_RUN_SUMMARY = "run_summary"
V_EXPLORATION = "exploration"
VIEWS = (V_RUNS, V_WARMUP_STEPS, V_STEP_TIMES, V_EXPLORATION, V_RUN_SUMMARY, V_LAYER_BALANCE, V_TRANSFER_DETAIL)

# Columns every per-record table starts with.
C_RUN_ID = "run_id"
C_RANK = "rank"
C_STEP = "step"
C_MICROBATCH = "microbatch"
C_LAYER = "layer"
C_TS = "ts"

_KEY = ((C_RUN_ID, "VARCHAR"), (C_RANK, "INTEGER"))
_LAYER_KEY = _KEY + ((C_STEP, "BIGINT"), (C_MICROBATCH, "INTEGER"), (C_LAYER, "INTEGER"), (C_TS, "TIMESTAMP"))

TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    T_RUNS_LOG: _KEY + (
        ("session", "VARCHAR"),
        ("run_name", "VARCHAR"),
        ("kind", "VARCHAR"),
        ("world_size", "INTEGER"),
        ("model", "VARCHAR"),
        ("config_json", "VARCHAR"),
        ("config_hash", "VARCHAR"),
        ("topology_json", "VARCHAR"),
        ("host", "VARCHAR"),
        ("pid", "BIGINT"),
        ("versions_json", "VARCHAR"),
        ("otel_exporters", "VARCHAR"),
        ("started_at", "TIMESTAMP"),
        ("ended_at", "TIMESTAMP"),
        ("status", "VARCHAR"),
        ("errors", "BIGINT"),
        ("dropped_rows", "BIGINT"),
        ("first_error", "VARCHAR"),
        ("extra_json", "VARCHAR"),
        ("written_at", "TIMESTAMP"),
    ),
    T_STEPS: _KEY + (
        (C_STEP, "BIGINT"),
        (C_TS, "TIMESTAMP"),
        ("loss", "DOUBLE"),
        ("step_time_s", "DOUBLE"),
        ("extra_json", "VARCHAR"),
        ("warmup", "BOOLEAN"),
    ),
    T_LAYER_LOADS: _LAYER_KEY + (
        ("policy", "VARCHAR"),
        ("num_ranks", "INTEGER"),
        ("num_experts", "INTEGER"),
        ("tokens", "BIGINT"),
        ("load", "BIGINT[][]"),
        ("expert_load", "BIGINT[]"),
        ("rank_load_before", "BIGINT[]"),
        ("rank_load_after", "BIGINT[]"),
    ),
    T_PLANS: _LAYER_KEY + (
        ("policy", "VARCHAR"),
        ("num_ranks", "INTEGER"),
        ("num_experts", "INTEGER"),
        ("num_masters", "INTEGER"),
        ("num_slots", "INTEGER"),
        ("domain_size", "INTEGER"),
        ("phy2log", "INTEGER[][]"),
        ("quota", "BIGINT[][]"),
        ("routes", "BIGINT[][][]"),
        ("solve_time_s", "DOUBLE"),
        ("num_replicas", "INTEGER"),
        ("num_transfers", "INTEGER"),
        ("info_json", "VARCHAR"),
    ),
    T_TRANSFERS: _KEY + (
        (C_STEP, "BIGINT"),
        (C_MICROBATCH, "INTEGER"),
        (C_LAYER, "INTEGER"),
        ("idx", "INTEGER"),
        ("expert", "INTEGER"),
        ("src", "INTEGER"),
        ("dst", "INTEGER"),
        ("stage", "INTEGER"),
        ("bytes", "BIGINT"),
    ),
    T_TRANSFER_TIMES: _LAYER_KEY + (
        ("seconds", "DOUBLE[]"),
    ),
    T_DECISIONS: _LAYER_KEY + (
        ("policy", "VARCHAR"),
        ("reason", "VARCHAR"),
        ("predictions", "MAP(VARCHAR, DOUBLE)"),
        ("chosen_predicted_s", "DOUBLE"),
    ),
    T_TIMINGS: _LAYER_KEY + tuple((k, "DOUBLE") for k in TIMING_KEYS) + (
        ("other", "MAP(VARCHAR, DOUBLE)"),
    ),
    T_SPANS: _KEY + (
        ("trace_id", "VARCHAR"),
        ("span_id", "VARCHAR"),
        ("parent_span_id", "VARCHAR"),
        ("name", "VARCHAR"),
        ("start_time", "TIMESTAMP"),
        ("end_time", "TIMESTAMP"),
        ("duration_s", "DOUBLE"),
        ("status", "VARCHAR"),
        ("attributes_json", "VARCHAR"),
    ),
    T_METRIC_POINTS: _KEY + (
        (C_TS, "TIMESTAMP"),
        ("name", "VARCHAR"),
        ("unit", "VARCHAR"),
        ("kind", "VARCHAR"),
        ("attributes_json", "VARCHAR"),
        ("value", "DOUBLE"),
        ("count", "BIGINT"),
        ("sum", "DOUBLE"),
        ("min", "DOUBLE"),
        ("max", "DOUBLE"),
        ("bucket_bounds", "DOUBLE[]"),
        ("bucket_counts", "BIGINT[]"),
    ),
}

RAW_TABLES = tuple(TABLES)


def columns(table: str) -> tuple[str, ...]:
    """Column names of a raw table, in schema order."""
    return tuple(name for name, _ in TABLES[table])


@lru_cache(maxsize=None)
def arrow_type(duckdb_type: str):
    """The Arrow type a writer uses for a DuckDB column type of :data:`TABLES`."""
    import pyarrow as pa

    t = duckdb_type.strip()
    if t.endswith("[]"):
        return pa.list_(arrow_type(t[:-2]))
    if t.startswith("MAP("):
        key, value = (p.strip() for p in t[4:-1].split(","))
        return pa.map_(arrow_type(key), arrow_type(value))
    return {
        "VARCHAR": pa.string(),
        "INTEGER": pa.int32(),
        "BIGINT": pa.int64(),
        "DOUBLE": pa.float64(),
        "TIMESTAMP": pa.timestamp("us"),
        "BOOLEAN": pa.bool_(),
    }[t]


@lru_cache(maxsize=None)
def arrow_schema(table: str):
    """The Arrow schema of a raw table."""
    import pyarrow as pa

    return pa.schema([(name, arrow_type(typ)) for name, typ in TABLES[table]])
