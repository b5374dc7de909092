"""The SQL each dashboard page runs on a run's mirror (:mod:`.mirror`), as named, parameterised queries.

Text only: no DuckDB, no data. :mod:`.cache` runs these over the mirror's in-memory Arrow tables
(parameters bound by DuckDB) and :mod:`.data` shapes the results for the pages. Each page section also
names the mirror units its figures read (``*_UNITS``).

Step binning: a query with parameters ``first`` and ``bin`` groups steps into bins of ``bin`` consecutive
steps starting at ``first + k * bin`` (:data:`BIN`); with ``bin == 1`` every figure equals the canned
query's (``ultraep.telemetry.queries``).
"""

from __future__ import annotations

from ultraep.telemetry import semconv as sc
from ultraep.telemetry.queries import SHOWN_POLICY as _SHOWN
from ultraep.telemetry.queries import Query


def _q(name: str, sql: str, params: tuple[str, ...] = (), doc: str = "") -> Query:
    return Query(name, name, sql, params=params, doc=doc)


# --------------------------------------------------------------------------- run status and step range
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


STEP_RANGE = _q("step_range", """
SELECT min(step) AS first_step, max(step) AS last_step, count(*) AS rows,
       list(DISTINCT layer ORDER BY layer) AS layers
FROM layer_facts
""")


# The first step of a step's bin (parameters first, bin).
BIN = "($first + (step - $first) // $bin * $bin)"

# --------------------------------------------------------------------------- overview
# The headline leaves warm-up steps (steps.warmup; the runtime's step 0: compiles, allocations, first
# plans) out of every mean, summed time and share, as the canned summaries do (queries.WARM_JOIN); counts
# keep every step. A fact row is settled when no steps row marks its step as warm-up.
SETTLED = f"step NOT IN (SELECT step FROM {sc.T_STEPS} WHERE warmup)"

HEADLINE_LAYERS = _q("headline_layers", f"""
SELECT count(*) AS plans, count(DISTINCT layer) AS layers, count(DISTINCT step) AS steps,
       count(DISTINCT step) FILTER (WHERE NOT settled) AS warmup_steps,
       min(step) AS first_step, max(step) AS last_step, sum(tokens)::BIGINT AS tokens,
       avg(imbalance_before) FILTER (WHERE settled) AS mean_imbalance_before,
       avg(imbalance_after) FILTER (WHERE settled) AS mean_imbalance_after,
       sum(mean_before) FILTER (WHERE settled) / nullif(sum(max_before) FILTER (WHERE settled), 0) AS load_ideal_before,
       sum(mean_after) FILTER (WHERE settled) / nullif(sum(max_after) FILTER (WHERE settled), 0) AS load_ideal_after
FROM (SELECT *, {SETTLED} AS settled FROM layer_facts)
""")

HEADLINE_TIMINGS = _q("headline_timings", f"""
SELECT count(*) AS timed, sum(plan_s) AS plan_s, sum(transfer_s) AS transfer_s,
       sum(measured_s) AS measured_s, sum(predicted_s) AS predicted_s,
       sum(coalesce(measured_s, predicted_s)) AS time_s,
       sum(ideal_s) FILTER (WHERE coalesce(measured_s, predicted_s) IS NOT NULL) AS ideal_s,
       sum(coalesce(measured_s, predicted_s)) FILTER (WHERE ideal_s IS NOT NULL) AS time_with_ideal_s
FROM timing_facts WHERE {SETTLED}
""")

HEADLINE_PLANS = _q("headline_plans", f"""
SELECT count(*) AS plans, sum(solve_time_s) FILTER (WHERE settled) AS solve_time_s,
       avg(num_replicas) FILTER (WHERE settled) AS mean_replicas, sum(num_transfers)::BIGINT AS transfers
FROM (SELECT *, {SETTLED} AS settled FROM plan_facts)
""")

# An adaptive layer-microbatch counts under the candidate its decision chose (queries.SHOWN_POLICY).
SHOWN_FACTS = ("layer_facts", "decision_facts")

POLICY_SHARES = _q("policy_shares", f"""
SELECT {_SHOWN} AS policy, count(*) AS plans, count(*) / sum(count(*)) OVER () AS share
FROM layer_facts b LEFT JOIN decision_facts d USING (step, microbatch, layer)
GROUP BY 1 ORDER BY plans DESC, policy
""", doc="As queries.POLICY_SHARES: share of layer-microbatches planned by each policy ('quota via adaptive').")

IMBALANCE_OVER_STEPS = _q("imbalance_over_steps", f"""
SELECT {BIN} AS step, avg(imbalance_before) AS imbalance_before, avg(imbalance_after) AS imbalance_after,
       count(*) AS plans
FROM layer_facts GROUP BY 1 ORDER BY 1
""", params=("first", "bin"))

OVERVIEW_UNITS = ("layer", "plan", "timing", "runs_log", "steps")


# --------------------------------------------------------------------------- layers
LAYER_STEP_IMBALANCE = _q("layer_step_imbalance", f"""
SELECT layer, {BIN} AS step, avg(imbalance_before) AS imbalance_before,
       avg(imbalance_after) AS imbalance_after, count(*) AS plans
FROM layer_facts GROUP BY layer, 2 ORDER BY layer, 2
""", params=("first", "bin"), doc="Heatmap cells; with bin = 1 equal to queries.LAYER_IMBALANCE.")

LAYER_SUMMARY = _q("layer_summary", f"""
SELECT layer, count(*) AS plans, avg(imbalance_before) FILTER (WHERE settled) AS mean_before,
       avg(imbalance_after) FILTER (WHERE settled) AS mean_after,
       max(imbalance_before) FILTER (WHERE settled) AS max_before,
       max(imbalance_after) FILTER (WHERE settled) AS max_after,
       avg(max_after - mean_after) FILTER (WHERE settled) AS mean_straggler_after_tokens
FROM (SELECT *, {SETTLED} AS settled FROM layer_facts) GROUP BY layer ORDER BY layer
""", doc="As queries.LAYER_SUMMARY (warm-up excluded).")

MICROBATCHES = _q("microbatches", """
SELECT DISTINCT microbatch FROM layer_facts WHERE layer = $layer AND step = $step ORDER BY microbatch
""", params=("layer", "step"))


# --------------------------------------------------------------------------- policies
DECISION_MAP = _q("decision_map", f"""
SELECT layer, {BIN} AS step, mode(policy) AS policy, count(*) AS decisions,
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
FROM predictions WHERE {SETTLED} GROUP BY policy ORDER BY policy
""", doc="As queries.PREDICTION_SUMMARY (warm-up excluded).")

EXPLORATION = _q("exploration", f"""
WITH c AS (
    SELECT d.step, d.probe, t.measured_s,
           last_value(CASE WHEN NOT d.probe THEN t.measured_s END IGNORE NULLS) OVER (
               PARTITION BY d.layer ORDER BY d.step, d.microbatch
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_s,
           first_value(CASE WHEN NOT d.probe THEN t.measured_s END IGNORE NULLS) OVER (
               PARTITION BY d.layer ORDER BY d.step, d.microbatch
               ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS after_s
    FROM (SELECT *, reason LIKE 'probe:%' OR reason LIKE 'confirm:%' AS probe FROM decision_facts
          WHERE reason NOT LIKE 'configured policy%' AND {SETTLED}) d
    LEFT JOIN timing_facts t USING (step, microbatch, layer)
),
p AS (SELECT *, measured_s - coalesce((before_s + after_s) / 2, before_s, after_s) AS cost_s FROM c)
SELECT count(*) AS chosen_calls, count(*) FILTER (WHERE probe) AS probe_calls,
       count(*) FILTER (WHERE probe) / count(*) AS probe_share,
       sum(cost_s) FILTER (WHERE probe) AS probe_cost_s,
       sum(cost_s) FILTER (WHERE probe) / nullif(sum(measured_s), 0) AS probe_cost_share
FROM p HAVING count(*) > 0
""", doc="As the store's view exploration (warm-up excluded): the probes' share of the chosen calls and their "
         "measured cost against the policy in force's calls beside them.")

PREDICTION_OVER_STEPS = _q("prediction_over_steps", f"""
SELECT {BIN} AS step, policy, count(*) AS samples,
       avg(predicted_s) AS predicted_s, avg(measured_s) AS measured_s, avg(rel_error) AS rel_error
FROM predictions WHERE {SETTLED} GROUP BY ALL ORDER BY 1, 2
""", params=("first", "bin"), doc="Per step bin and policy, warm-up steps left out (their compile-time "
    "measurements are off the scale of every other step).")


_TERM_ERRORS = " UNION ALL ".join(
    f"""SELECT step, '{t}' AS term, "measured.{t}" / "predicted.{t}" - 1 AS rel_error
FROM timing_facts WHERE "predicted.{t}" > 0 AND "measured.{t}" IS NOT NULL""" for t in sc.PREDICTED_TERMS)

PHASE_ERRORS_OVER_STEPS = _q("phase_errors_over_steps", f"""
SELECT {BIN} AS step, term AS policy, count(*) AS samples, median(abs(rel_error)) AS rel_error
FROM ({_TERM_ERRORS}) WHERE {SETTLED} GROUP BY ALL ORDER BY 1, 2
""", params=("first", "bin"), doc="Per step bin and cost-model term, warm-up excluded: the median |measured / predicted - 1| (runs "
    "of the runtime record predicted.<term> and measured.<term>; the slowest rank's measurement).")

POLICY_UNITS = ("layer", "decision", "timing")


# --------------------------------------------------------------------------- transfers
TRANSFERS_OVER_STEPS = _q("transfers_over_steps", f"""
SELECT {BIN} AS step, sum(transfers)::BIGINT AS transfers, sum(bytes)::BIGINT AS bytes,
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
WHERE {SETTLED}
GROUP BY t.layer ORDER BY t.layer
""", doc="As queries.TRANSFER_SUMMARY's measured columns (transfer_times joined to transfers; warm-up "
         "excluded).")

CACHE_LAYERS = _q("cache_layers", f"""
SELECT layer, sum(cache_hits)::BIGINT AS hits, sum(cache_misses)::BIGINT AS misses,
       sum(cache_hits) / nullif(sum(cache_hits) + sum(cache_misses), 0) AS hit_rate,
       sum(cache_bytes_saved)::BIGINT AS bytes_saved, count(DISTINCT (step, microbatch)) AS calls
FROM cache_facts WHERE {SETTLED}
GROUP BY layer ORDER BY layer
""", doc="As queries.REPLICA_CACHE: per layer, replicas found resident (hits) or streamed (misses) over every "
         "rank, and the weight bytes the hits saved (warm-up excluded).")

TRANSFER_UNITS = ("transfer", "transfer_time", "layer")


# --------------------------------------------------------------------------- compare
COMPARE = _q("compare", f"""
WITH b AS (SELECT *, {SETTLED} AS settled FROM layer_facts),
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

COMPARE_OVER_STEPS = _q("compare_over_steps", f"""
SELECT {_SHOWN} AS policy, {BIN} AS step, avg(imbalance_after) AS imbalance_after,
       count(*) AS plans
FROM layer_facts b LEFT JOIN decision_facts d USING (step, microbatch, layer)
GROUP BY 1, 2 ORDER BY 1, 2
""", params=("first", "bin"))
