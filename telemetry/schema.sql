-- ultraep telemetry store: schema.
--
-- Storage: every raw table below is a directory of append-only Parquet parts inside a run directory,
--     RUNS_DIR/RUN_ID/<table>/r<rank>-<session>-<seq>.parquet
-- one part per table per flush per rank, renamed into place atomically (see docs/telemetry.md).
-- ultraep.telemetry.open_run(path) gives a DuckDB connection in which every raw table is a view over
-- read_parquet(<glob>) (so a live run's new parts show up in the next query) and the derived views at the
-- end of this file are defined on top. export_run(path, file) materialises the same into one .duckdb file.
--
-- Conventions:
--   * Vocabulary of docs/design.md: R ranks, E logical experts, S slots per rank (M masters + N redundant).
--   * run_id + rank start every table: `rank` is the rank that RECORDED the row. With exact-load balancing
--     every rank computes the same plan; when several ranks record it, the derived views keep the row of
--     the lowest recording rank (raw tables keep them all).
--   * step / microbatch / layer identify one layer-microbatch; ts is when it was recorded (UTC).
--   * Matrices are nested LIST columns, row-major: load[r + 1][e + 1] is λ[r, e] (DuckDB lists are 1-based).
--   * Raw counts are stored; ratios (imbalance, bandwidth, ...) are derived in the views and queries.
--   * All timestamps are TIMESTAMP in UTC; all durations are DOUBLE seconds (unit s); bytes are BIGINT (By).
--   * Names are defined once in telemetry/semconv.py; a test checks this file against it.
-- Statements are separated by a semicolon at the end of a line (the loader splits on that).

-- ============================================================================ raw tables

-- One row when a recorder opens (status 'running') and one when it closes (status 'closed'), per rank
-- and recorder instance. A run whose newest row still says 'running' is live or crashed.
CREATE TABLE runs_log (
    run_id          VARCHAR,    -- run directory name; the same on every rank of a run
    rank            INTEGER,    -- recording rank
    session         VARCHAR,    -- random id of the recorder instance (a resumed rank gets a new one)
    run_name        VARCHAR,    -- the name given to Recorder.open (NULL: generated id)
    kind            VARCHAR,    -- train | prefill | simulation
    world_size      INTEGER,    -- ranks in the EP group
    model           VARCHAR,    -- model name
    config_json     VARCHAR,    -- the validated config as JSON
    config_hash     VARCHAR,    -- BalancerConfig.digest() (or sha256 of the JSON)
    topology_json   VARCHAR,    -- the Topology as JSON
    host            VARCHAR,
    pid             BIGINT,
    versions_json   VARCHAR,    -- python, ultraep, numpy, pyarrow, opentelemetry-sdk, torch (if loaded)
    otel_exporters  VARCHAR,    -- OTel exporters enabled through OTEL_* variables, e.g. 'traces:otlp'
    started_at      TIMESTAMP,
    ended_at        TIMESTAMP,  -- NULL while running
    status          VARCHAR,    -- running | closed
    errors          BIGINT,     -- recording failures swallowed so far (Recorder.errors)
    dropped_rows    BIGINT,     -- rows lost to them
    first_error     VARCHAR,    -- the first failure, for the report
    extra_json      VARCHAR,    -- Recorder.open(extra=...)
    written_at      TIMESTAMP   -- when this row was written (the newest row per recorder instance wins)
);

-- One row per Recorder.record_step call.
CREATE TABLE steps (
    run_id          VARCHAR,
    rank            INTEGER,
    step            BIGINT,
    ts              TIMESTAMP,  -- end of the step
    loss            DOUBLE,
    step_time_s     DOUBLE,     -- as measured by the caller (NULL if not given)
    extra_json      VARCHAR,
    warmup          BOOLEAN     -- a warm-up step (compile, allocation, first plans): summaries leave it
                                -- out of their averages; NULL in runs recorded before the column = false
);

-- One row per recorded plan: the exact load and what each rank receives before / after balancing.
CREATE TABLE layer_loads (
    run_id           VARCHAR,
    rank             INTEGER,
    step             BIGINT,
    microbatch       INTEGER,
    layer            INTEGER,
    ts               TIMESTAMP,
    policy           VARCHAR,
    num_ranks        INTEGER,     -- R
    num_experts      INTEGER,     -- E
    tokens           BIGINT,      -- sum of load (token-expert assignments, unit {token})
    load             BIGINT[][],  -- [R][E] raw λ: assignments source rank r routes to expert e
    expert_load      BIGINT[],    -- [E]    λ summed over source ranks
    rank_load_before BIGINT[],    -- [R]    tokens each rank would receive without balancing (home masters)
    rank_load_after  BIGINT[]     -- [R]    tokens each rank receives under the plan (sum of its quotas)
);

-- One row per recorded plan: placement and quotas (routes when record_routes=True).
CREATE TABLE plans (
    run_id          VARCHAR,
    rank            INTEGER,
    step            BIGINT,
    microbatch      INTEGER,
    layer           INTEGER,
    ts              TIMESTAMP,
    policy          VARCHAR,
    num_ranks       INTEGER,       -- R
    num_experts     INTEGER,       -- E
    num_masters     INTEGER,       -- M
    num_slots       INTEGER,       -- S = M + N
    domain_size     INTEGER,       -- ranks per scale-up domain
    phy2log         INTEGER[][],   -- [R][S] logical expert in each slot, -1 = empty
    quota           BIGINT[][],    -- [R][S] tokens each instance receives
    routes          BIGINT[][][],  -- [R][R][S] tokens source rank sends to instance (r, s); NULL unless asked
    solve_time_s    DOUBLE,        -- planner time
    num_replicas    INTEGER,       -- redundant slots in use
    num_transfers   INTEGER,
    info_json       VARCHAR        -- Plan.info (policy-specific details)
);

-- One row per transfer of a recorded plan (expert-state movement between ranks).
CREATE TABLE transfers (
    run_id          VARCHAR,
    rank            INTEGER,
    step            BIGINT,
    microbatch      INTEGER,
    layer           INTEGER,
    idx             INTEGER,    -- position in plan.transfers (0-based); transfer_times.seconds[idx + 1]
    expert          INTEGER,    -- logical expert whose weights move
    src             INTEGER,    -- sending rank
    dst             INTEGER,    -- receiving rank
    stage           INTEGER,    -- 0 direct from the master's rank, 1 relay forward
    bytes           BIGINT      -- unit By
);

-- Measured seconds of each transfer, aligned with plan.transfers (NaN where this rank did not measure).
CREATE TABLE transfer_times (
    run_id          VARCHAR,
    rank            INTEGER,
    step            BIGINT,
    microbatch      INTEGER,
    layer           INTEGER,
    ts              TIMESTAMP,
    seconds         DOUBLE[]    -- [T]
);

-- One row per policy decision (which policy a layer uses and why), with the cost model's predictions.
CREATE TABLE decisions (
    run_id             VARCHAR,
    rank               INTEGER,
    step               BIGINT,
    microbatch         INTEGER,
    layer              INTEGER,
    ts                 TIMESTAMP,
    policy             VARCHAR,               -- the chosen policy
    reason             VARCHAR,               -- why (free text from the engine)
    predictions        MAP(VARCHAR, DOUBLE),  -- predicted seconds of every candidate policy
    chosen_predicted_s DOUBLE                 -- predicted seconds of the chosen one
);

-- Measured phase times of a layer-microbatch on the recording rank (seconds; NULL = not measured).
CREATE TABLE timings (
    run_id            VARCHAR,
    rank              INTEGER,
    step              BIGINT,
    microbatch        INTEGER,
    layer             INTEGER,
    ts                TIMESTAMP,
    plan_s            DOUBLE,
    transfer_s        DOUBLE,
    dispatch_s        DOUBLE,
    experts_s         DOUBLE,
    combine_s         DOUBLE,
    backward_reduce_s DOUBLE,
    measured_s        DOUBLE,                -- end-to-end time of the balanced layer, to compare with:
    predicted_s       DOUBLE,                -- the cost model's prediction for it
    other             MAP(VARCHAR, DOUBLE)   -- any other timing key given to record_timings
);

-- Spans that went through the OpenTelemetry SDK (ultraep.step and its per-step aggregate children
-- ultraep.plan / ultraep.transfer, plus any Recorder.span). Aggregate children carry
-- "ultraep.aggregate": true; their duration is the summed phase time of the step, anchored at its start.
CREATE TABLE spans (
    run_id          VARCHAR,
    rank            INTEGER,
    trace_id        VARCHAR,    -- 32 hex digits
    span_id         VARCHAR,    -- 16 hex digits
    parent_span_id  VARCHAR,
    name            VARCHAR,
    start_time      TIMESTAMP,
    end_time        TIMESTAMP,
    duration_s      DOUBLE,
    status          VARCHAR,    -- UNSET | OK | ERROR
    attributes_json VARCHAR
);

-- Metric data points collected from the OpenTelemetry MeterProvider (cumulative), at most every 10 s
-- while records arrive, and at close.
CREATE TABLE metric_points (
    run_id          VARCHAR,
    rank            INTEGER,
    ts              TIMESTAMP,
    name            VARCHAR,    -- e.g. ultraep.transfer.bytes
    unit            VARCHAR,    -- s | By | {token} | 1 | ...
    kind            VARCHAR,    -- sum | gauge | histogram
    attributes_json VARCHAR,
    value           DOUBLE,     -- sum / gauge value
    count           BIGINT,     -- histogram
    sum             DOUBLE,     -- histogram
    min             DOUBLE,     -- histogram
    max             DOUBLE,     -- histogram
    bucket_bounds   DOUBLE[],   -- histogram explicit bounds
    bucket_counts   BIGINT[]    -- histogram counts (len(bucket_bounds) + 1)
);

-- ============================================================================ derived views

-- One row per RECORDING RANK and recorder instance (a run of R ranks has R rows): its newest runs_log row.
-- Join on run_summary (one row per run) instead, or filter on rank, so that a join does not multiply counts.
CREATE VIEW runs AS
SELECT *
FROM runs_log
QUALIFY row_number() OVER (PARTITION BY run_id, rank, session ORDER BY written_at DESC, status) = 1;

-- One row per warm-up step (any rank marked it: Recorder.record_step(warmup=True)). Summaries leave these
-- steps out of their averages (telemetry/queries.py); per-step queries keep them.
CREATE VIEW warmup_steps AS
SELECT run_id, step
FROM steps
WHERE warmup
GROUP BY run_id, step;

-- One row per run: its measured step time (per step the slowest rank's steps.step_time_s) over the steps not
-- marked warm-up: median (p50), p20, p80; and the seconds the warm-up steps took (one-time cost, reported apart).
-- The one definition of the step time: ultraep.telemetry.queries.STEP_TIMES, `ultraep report`, the dashboard
-- and run_summary all read it here.
CREATE VIEW step_times AS
WITH per_step AS (
    SELECT run_id, step, max(step_time_s) AS step_time_s, coalesce(bool_or(warmup), false) AS warmup
    FROM steps GROUP BY run_id, step
)
SELECT run_id, count(step_time_s) FILTER (WHERE NOT warmup) AS timed_steps,
       count(*) FILTER (WHERE warmup) AS warmup_steps,
       median(step_time_s) FILTER (WHERE NOT warmup) AS step_time_p50_s,
       quantile_cont(step_time_s, 0.2) FILTER (WHERE NOT warmup) AS step_time_p20_s,
       quantile_cont(step_time_s, 0.8) FILTER (WHERE NOT warmup) AS step_time_p80_s,
       sum(step_time_s) FILTER (WHERE warmup) AS warmup_time_s
FROM per_step GROUP BY run_id;

-- One row per run whose layers an engine chose for (decisions whose reason is not 'configured policy ...'), warm-up
-- steps left out: those layer calls, the probes among them (reason 'probe: ...' or 'confirm: ...': a candidate other
-- than the policy in force run once to be measured), their share, and what they cost as measured: each probe's layer
-- time (slowest rank) less the mean of the nearest calls of its layer before and after it that were not probes (the
-- policy in force's), summed (probe_cost_s), and over the chosen calls' measured time (probe_cost_share).
CREATE VIEW exploration AS
WITH d AS (
    SELECT run_id, step, microbatch, layer, reason LIKE 'probe:%' OR reason LIKE 'confirm:%' AS probe
    FROM decisions
    WHERE reason NOT LIKE 'configured policy%'
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
),
m AS (
    SELECT run_id, step, microbatch, layer, max(measured_s) AS measured_s
    FROM timings GROUP BY run_id, step, microbatch, layer
),
c AS (
    SELECT d.run_id, d.probe, m.measured_s,
           last_value(CASE WHEN NOT d.probe THEN m.measured_s END IGNORE NULLS) OVER (
               PARTITION BY d.run_id, d.layer ORDER BY d.step, d.microbatch
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_s,
           first_value(CASE WHEN NOT d.probe THEN m.measured_s END IGNORE NULLS) OVER (
               PARTITION BY d.run_id, d.layer ORDER BY d.step, d.microbatch
               ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS after_s
    FROM d LEFT JOIN m USING (run_id, step, microbatch, layer)
    LEFT JOIN warmup_steps w ON w.run_id = d.run_id AND w.step = d.step
    WHERE w.step IS NULL
),
p AS (
    SELECT *, measured_s - coalesce((before_s + after_s) / 2, before_s, after_s) AS cost_s FROM c
)
SELECT run_id, count(*) AS chosen_calls, count(*) FILTER (WHERE probe) AS probe_calls,
       count(*) FILTER (WHERE probe) / count(*) AS probe_share,
       sum(cost_s) FILTER (WHERE probe) AS probe_cost_s,
       sum(cost_s) FILTER (WHERE probe) / nullif(sum(measured_s), 0) AS probe_cost_share
FROM p GROUP BY run_id;

-- One row per run: what its ranks' runs_log rows say together (status 'closed' once every rank closed), its
-- configured policy and recorded baseline (Recorder.open(extra={"baseline": RUN_ID}), the run of the same
-- stream without balancing), its steps, its measured step time p50 (step_times) and, where this store also holds
-- the baseline run, the baseline's p50 and the measured speed-up = baseline p50 / this run's p50 (what
-- `ultraep report` and the dashboard show; NULL where the baseline is in another directory: open the parent
-- directory of both runs, or run `ultraep report`, which looks beside the run). probe_share, probe_cost_share: an
-- engine's probes (the view exploration; NULL where no engine chose).
CREATE VIEW run_summary AS
WITH r AS (
    SELECT run_id, any_value(kind) AS kind, any_value(model) AS model, max(world_size) AS world_size,
           count(DISTINCT rank) AS ranks_recording,
           any_value(json_extract_string(config_json, '$.policy')) AS policy,
           any_value(json_extract_string(extra_json, '$.baseline')) AS baseline,
           min(started_at) AS started_at,
           CASE WHEN bool_and(status = 'closed') THEN max(ended_at) END AS ended_at,
           CASE WHEN bool_and(status = 'closed') THEN 'closed' ELSE 'running' END AS status,
           sum(errors)::BIGINT AS errors, any_value(config_hash) AS config_hash
    FROM runs GROUP BY run_id
),
s AS (
    SELECT run_id, count(DISTINCT step) AS steps, count(DISTINCT step) FILTER (WHERE warmup) AS warmup_steps
    FROM steps GROUP BY run_id
)
SELECT r.*, coalesce(s.steps, 0) AS steps, coalesce(s.warmup_steps, 0) AS warmup_steps,
       t.step_time_p50_s, b.step_time_p50_s AS baseline_step_time_p50_s,
       CASE WHEN r.policy IS DISTINCT FROM 'none' AND b.step_time_p50_s > 0 AND t.step_time_p50_s > 0
            THEN b.step_time_p50_s / t.step_time_p50_s END AS speedup,
       x.probe_share, x.probe_cost_share
FROM r LEFT JOIN s USING (run_id)
     LEFT JOIN step_times t ON t.run_id = r.run_id
     LEFT JOIN step_times b ON b.run_id = r.baseline
     LEFT JOIN exploration x ON x.run_id = r.run_id;

-- One row per layer-microbatch (lowest recording rank), with imbalance = max / mean rank load (1.0 when
-- the layer has no tokens) and straggler = max - mean, before and after balancing. `warmup`: the step is a
-- warm-up step (warmup_steps); `ultraep report` and the dashboard's summaries leave those rows out
-- (WHERE NOT warmup gives their figures).
CREATE VIEW layer_balance AS
WITH lb AS (
SELECT
    run_id, step, microbatch, layer, policy, num_ranks, num_experts, tokens,
    rank_load_before, rank_load_after,
    CASE WHEN list_avg(rank_load_before) > 0
         THEN list_max(rank_load_before) / list_avg(rank_load_before) ELSE 1.0 END AS imbalance_before,
    CASE WHEN list_avg(rank_load_after) > 0
         THEN list_max(rank_load_after) / list_avg(rank_load_after) ELSE 1.0 END AS imbalance_after,
    list_max(rank_load_before) - list_avg(rank_load_before) AS straggler_before,
    list_max(rank_load_after) - list_avg(rank_load_after) AS straggler_after,
    rank AS recorded_by,
    ts
FROM layer_loads
QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
)
SELECT lb.*, w.step IS NOT NULL AS warmup
FROM lb LEFT JOIN warmup_steps w ON lb.run_id = w.run_id AND lb.step = w.step;

-- One row per transfer (lowest recording rank), with the measured seconds (the largest value any rank
-- reported for it; NULL if none) and the resulting bandwidth; `warmup` as in layer_balance.
CREATE VIEW transfer_detail AS
WITH t AS (
    SELECT *
    FROM transfers
    QUALIFY rank = min(rank) OVER (PARTITION BY run_id, step, microbatch, layer)
),
m AS (
    SELECT run_id, step, microbatch, layer, i - 1 AS idx, max(s) AS measured_s
    FROM (
        SELECT run_id, step, microbatch, layer, unnest(seconds) AS s, generate_subscripts(seconds, 1) AS i
        FROM transfer_times
    )
    WHERE s IS NOT NULL AND NOT isnan(s)
    GROUP BY ALL
)
SELECT
    t.run_id, t.step, t.microbatch, t.layer, t.idx, t.expert, t.src, t.dst, t.stage, t.bytes,
    m.measured_s,
    CASE WHEN m.measured_s > 0 THEN t.bytes / m.measured_s END AS bandwidth_Bps,
    t.rank AS recorded_by,
    w.step IS NOT NULL AS warmup
FROM t
LEFT JOIN m USING (run_id, step, microbatch, layer, idx)
LEFT JOIN warmup_steps w ON t.run_id = w.run_id AND t.step = w.step;
