"""Canned SQL over the store, shared by ``ultraep report``, ``ultraep sql`` users and the dashboard.

Every query is a :class:`Query` with named parameters (``$run_id``, ``$layer``, ...), bound by DuckDB,
never formatted into the SQL text. ``run_id`` is optional everywhere: ``None`` means every run in the
connection (results carry a ``run_id`` column). Run them with :func:`run` (rows), :func:`arrow`
(a ``pyarrow.Table``) or through ``con.execute(q.sql, q.bind(...))``.

Conventions (see ``schema.sql``): plans and loads come from the derived views, which keep one row per
layer-microbatch; measured times are the slowest rank's (``max`` over recording ranks), because a layer
finishes when its last rank does; imbalance is max / mean rank load (1.0 = perfect).

Warm-up steps (``steps.warmup``, the ``warmup_steps`` view: the runtime's step 0 pays for compiles,
allocations and first plans) are left out of every average, maximum and summed time of the summaries
(:data:`REPORT`, :data:`POLICY_COMPARISON`), whose titles say "(warm-up excluded)"; counts (plans, layers,
transfers, bytes, policy shares) keep every step, and per-step queries show every step.

Legend: R ranks, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Query:
    """A named, parameterised query."""

    name: str
    title: str
    sql: str
    params: tuple[str, ...] = ("run_id",)
    doc: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)

    def bind(self, **params: Any) -> dict[str, Any]:
        """The parameter dict for DuckDB: every declared parameter (missing ones ``None``), no others."""
        unknown = set(params) - set(self.params)
        if unknown:
            raise TypeError(f"query {self.name!r} takes {', '.join(self.params)}; got {', '.join(sorted(unknown))}")
        return {p: params.get(p, self.defaults.get(p)) for p in self.params}


_RUN = "($run_id IS NULL OR run_id = $run_id)"
# Joined to a table with (run_id, step): WARM_JOIN, then FILTER (WHERE SETTLED) on each statistic.
WARM_JOIN = "LEFT JOIN warmup_steps w USING (run_id, step)"
SETTLED = "w.step IS NULL"
_EXCLUDED = " (warm-up excluded)"

OVERVIEW = Query(
    "overview", "Runs" + _EXCLUDED,
    f"""
WITH r AS (
    SELECT run_id, any_value(kind) AS kind, any_value(model) AS model, max(world_size) AS world_size,
           count(DISTINCT rank) AS ranks_recording, min(started_at) AS started_at,
           CASE WHEN bool_and(status = 'closed') THEN max(ended_at) END AS ended_at,
           CASE WHEN bool_and(status = 'closed') THEN 'closed' ELSE 'running' END AS status,
           sum(errors)::BIGINT AS errors, any_value(config_hash) AS config_hash
    FROM runs WHERE {_RUN} GROUP BY run_id
),
s AS (
    SELECT run_id, count(DISTINCT step) AS steps, count(DISTINCT step) FILTER (WHERE warmup) AS warmup_steps
    FROM steps WHERE {_RUN} GROUP BY run_id
),
b AS (
    SELECT run_id, count(*) AS plans, count(DISTINCT layer) AS layers,
           avg(imbalance_before) FILTER (WHERE {SETTLED}) AS mean_imbalance_before,
           avg(imbalance_after) FILTER (WHERE {SETTLED}) AS mean_imbalance_after
    FROM layer_balance {WARM_JOIN} WHERE {_RUN} GROUP BY run_id
),
t AS (SELECT run_id, count(*) AS transfers, sum(bytes)::BIGINT AS transfer_bytes FROM transfer_detail WHERE {_RUN} GROUP BY run_id)
SELECT r.run_id, r.kind, r.model, r.world_size, r.ranks_recording, r.status, r.started_at, r.ended_at,
       coalesce(s.steps, 0) AS steps, coalesce(s.warmup_steps, 0) AS warmup_steps, coalesce(b.layers, 0) AS layers, coalesce(b.plans, 0) AS plans,
       b.mean_imbalance_before, b.mean_imbalance_after,
       coalesce(t.transfers, 0) AS transfers, coalesce(t.transfer_bytes, 0) AS transfer_bytes,
       r.errors, r.config_hash
FROM r LEFT JOIN s USING (run_id) LEFT JOIN b USING (run_id) LEFT JOIN t USING (run_id)
ORDER BY r.started_at, r.run_id
""",
    doc="One row per run: status, size, warm-up steps, mean imbalance before/after (warm-up excluded), "
        "transfers, recording errors.",
)

LAYER_IMBALANCE = Query(
    "layer_imbalance", "Imbalance per layer and step",
    f"""
SELECT run_id, layer, step,
       avg(imbalance_before) AS imbalance_before, avg(imbalance_after) AS imbalance_after,
       sum(tokens)::BIGINT AS tokens
FROM layer_balance WHERE {_RUN}
GROUP BY run_id, layer, step
ORDER BY run_id, layer, step
""",
    doc="Heatmap data: mean over microbatches of max/mean rank load, per (layer, step).",
)

LAYER_SUMMARY = Query(
    "layer_summary", "Imbalance per layer" + _EXCLUDED,
    f"""
SELECT run_id, layer, count(*) AS plans,
       avg(imbalance_before) FILTER (WHERE {SETTLED}) AS mean_before,
       avg(imbalance_after) FILTER (WHERE {SETTLED}) AS mean_after,
       max(imbalance_before) FILTER (WHERE {SETTLED}) AS max_before,
       max(imbalance_after) FILTER (WHERE {SETTLED}) AS max_after,
       avg(straggler_after) FILTER (WHERE {SETTLED}) AS mean_straggler_after_tokens
FROM layer_balance {WARM_JOIN} WHERE {_RUN}
GROUP BY run_id, layer
ORDER BY run_id, layer
""",
    doc="Per layer: mean and worst imbalance before/after balancing over all steps and microbatches but "
        "the warm-up steps (plans counts them all).",
)

RANK_LOAD = Query(
    "rank_load", "Load per rank",
    f"""
SELECT run_id, layer, step, r - 1 AS rank,
       sum(rank_load_before[r])::BIGINT AS load_before, sum(rank_load_after[r])::BIGINT AS load_after
FROM (SELECT *, generate_subscripts(rank_load_before, 1) AS r FROM layer_balance
      WHERE {_RUN} AND layer = $layer AND step = $step AND ($microbatch IS NULL OR microbatch = $microbatch))
GROUP BY run_id, layer, step, r
ORDER BY run_id, rank
""",
    params=("run_id", "layer", "step", "microbatch"),
    doc="Tokens each rank receives before/after balancing for one layer and step (microbatch NULL = summed).",
)

EXPERT_LOAD = Query(
    "expert_load", "Expert load over time",
    f"""
SELECT run_id, layer, step, e - 1 AS expert, sum(expert_load[e])::BIGINT AS load
FROM (SELECT *, generate_subscripts(expert_load, 1) AS e FROM layer_loads
      WHERE {_RUN} AND layer = $layer
      QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1)
GROUP BY run_id, layer, step, e
ORDER BY run_id, step, expert
""",
    params=("run_id", "layer"),
    doc="Token-expert assignments of every expert of one layer, per step (summed over microbatches).",
)

RANK_LOAD_BY_EXPERT = Query(
    "rank_load_by_expert", "Load per rank and expert",
    f"""
WITH p AS (
    SELECT run_id, step, microbatch, layer, num_masters, phy2log, quota FROM plans
    WHERE {_RUN} AND layer = $layer AND step = $step AND ($microbatch IS NULL OR microbatch = $microbatch)
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
),
l AS (
    SELECT run_id, step, microbatch, layer, expert_load FROM layer_loads
    WHERE {_RUN} AND layer = $layer AND step = $step AND ($microbatch IS NULL OR microbatch = $microbatch)
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
),
slot_rows AS (
    SELECT run_id, step, microbatch, layer, num_masters, expert_load, r - 1 AS rank, phy2log[r] AS ph, quota[r] AS q
    FROM (SELECT *, generate_subscripts(phy2log, 1) AS r FROM p JOIN l USING (run_id, step, microbatch, layer))
),
slots AS (
    SELECT run_id, layer, step, rank, ph[s] AS expert, q[s] AS quota, s <= num_masters AS master, expert_load
    FROM (SELECT *, generate_subscripts(ph, 1) AS s FROM slot_rows)
)
SELECT run_id, layer, step, rank, expert,
       sum(CASE WHEN master THEN expert_load[expert + 1] ELSE 0 END)::BIGINT AS load_before,
       sum(quota)::BIGINT AS load_after
FROM slots WHERE expert >= 0
GROUP BY run_id, layer, step, rank, expert
ORDER BY run_id, rank, expert
""",
    params=("run_id", "layer", "step", "microbatch"),
    doc="Tokens each rank receives from each logical expert for one layer and step (microbatch NULL = "
        "summed): before = the expert's whole load on its master's rank, after = the quotas of the "
        "expert's instances on that rank. Summed over experts it equals rank_load.",
)

DECISION_TIMELINE = Query(
    "decision_timeline", "Decisions",
    f"""
SELECT run_id, step, microbatch, layer, policy, reason, chosen_predicted_s, predictions, ts
FROM decisions WHERE {_RUN}
QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
ORDER BY run_id, step, microbatch, layer
""",
    doc="Every policy decision in order, with the predicted seconds of each candidate.",
)

_MEASURED = f"""
    SELECT run_id, step, microbatch, layer,
           max(measured_s) AS measured_s, max(predicted_s) AS timing_predicted_s
    FROM timings WHERE {_RUN}
    GROUP BY run_id, step, microbatch, layer
"""
_DECIDED = f"""
    SELECT run_id, step, microbatch, layer, policy, chosen_predicted_s
    FROM decisions WHERE {_RUN}
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
"""

# The policy a layer-microbatch is shown under (``b``: its layer_balance row, ``d``: its decision): the
# recorded policy, or "<chosen> via <policy>" when the decision names another policy (the adaptive engine
# records the candidate it chose). The dashboard's queries use the same expression.
SHOWN_POLICY = "CASE WHEN d.policy IS NOT NULL AND d.policy <> b.policy THEN d.policy || ' via ' || b.policy ELSE b.policy END"

POLICY_SHARES = Query(
    "policy_shares", "Policy shares",
    f"""
WITH d AS ({_DECIDED})
SELECT run_id, {SHOWN_POLICY} AS policy, count(*) AS plans,
       count(*) / sum(count(*)) OVER (PARTITION BY run_id) AS share
FROM (SELECT * FROM layer_balance WHERE {_RUN}) b LEFT JOIN d USING (run_id, step, microbatch, layer)
GROUP BY run_id, 2
ORDER BY run_id, plans DESC, policy
""",
    doc="Share of layer-microbatches planned by each policy; a layer whose policy delegates (adaptive) "
        "counts under the candidate it chose, shown as 'quota via adaptive'.",
)

_PVM = f"""
WITH m AS ({_MEASURED}), d AS ({_DECIDED})
SELECT m.run_id, m.step, m.microbatch, m.layer, d.policy,
       coalesce(m.timing_predicted_s, d.chosen_predicted_s) AS predicted_s, m.measured_s,
       m.measured_s / nullif(coalesce(m.timing_predicted_s, d.chosen_predicted_s), 0) - 1 AS rel_error
FROM m LEFT JOIN d USING (run_id, step, microbatch, layer)
WHERE m.measured_s IS NOT NULL
"""

EXPLORATION = Query(
    "exploration", "Exploration" + _EXCLUDED,
    f"""
SELECT * FROM exploration WHERE {_RUN} ORDER BY run_id
""",
    doc="Per run an engine chose for: the probes' share of the chosen layer calls and their measured cost against "
        "the policy in force's calls beside them (the view exploration).",
)

PREDICTED_VS_MEASURED = Query(
    "predicted_vs_measured", "Predicted vs measured",
    _PVM + "ORDER BY m.run_id, m.step, m.microbatch, m.layer\n",
    doc="Per layer-microbatch: the cost model's prediction (timings.predicted_s, else the decision's) "
        "against the measured time (slowest rank).",
)

PREDICTION_SUMMARY = Query(
    "prediction_summary", "Prediction accuracy" + _EXCLUDED,
    f"""
WITH p AS ({_PVM})
SELECT run_id, coalesce(policy, '?') AS policy, count(*) AS samples,
       avg(predicted_s) AS mean_predicted_s, avg(measured_s) AS mean_measured_s,
       avg(abs(rel_error)) AS mean_abs_rel_error,
       sum(measured_s) / nullif(sum(predicted_s), 0) AS measured_over_predicted
FROM p {WARM_JOIN} WHERE predicted_s IS NOT NULL AND {SETTLED}
GROUP BY ALL
ORDER BY run_id, policy
""",
    doc="Per policy: mean predicted and measured seconds, mean |measured/predicted - 1|, total ratio; "
        "samples of warm-up steps left out.",
)

PHASE_PREDICTION_ERRORS = Query(
    "phase_prediction_errors", "Prediction error per phase" + _EXCLUDED,
    f"""
WITH per_call AS (
    -- one row per layer-microbatch and term: the prediction (equal on every rank) and the measurement
    -- reduced over ranks as the engine reduces it (the all-to-alls from the fastest rank, the rest slowest)
    SELECT run_id, step, microbatch, layer, term,
           max(predicted) AS predicted_s,
           CASE WHEN term LIKE 'a2a%' THEN min(measured) ELSE max(measured) END AS measured_s
    FROM (
        SELECT run_id, step, microbatch, layer, replace(k, 'predicted.', '') AS term, other[k] AS predicted,
               other['measured.' || replace(k, 'predicted.', '')] AS measured
        FROM (SELECT *, unnest(map_keys(other)) AS k FROM timings WHERE {_RUN})
        WHERE k LIKE 'predicted.%'
    )
    WHERE measured IS NOT NULL
    GROUP BY run_id, step, microbatch, layer, term
)
SELECT run_id, term, count(*) AS samples,
       median(abs(measured_s / nullif(predicted_s, 0) - 1)) AS median_abs_rel_error,
       sum(measured_s) / nullif(sum(predicted_s), 0) AS measured_over_predicted,
       avg(predicted_s) AS mean_predicted_s, avg(measured_s) AS mean_measured_s
FROM per_call {WARM_JOIN} WHERE {SETTLED} AND predicted_s > 0
GROUP BY run_id, term
ORDER BY run_id, term
""",
    doc="Per run and cost-model term (compute, all-to-alls, weight sync, copies, plan, total): the median "
        "|measured / predicted - 1| over layer-microbatches, the total ratio, and the mean predicted and "
        "measured seconds per layer call (a term of a few µs can show a large relative error); the runtime "
        "records predicted.<term> and measured.<term> with every call once its backward ran.",
)

TRANSFER_BYTES_PER_STEP = Query(
    "transfer_bytes_per_step", "Transfers per step",
    f"""
WITH per_src AS (
    SELECT run_id, step, microbatch, layer, src, sum(bytes)::BIGINT AS sent
    FROM transfer_detail WHERE {_RUN} GROUP BY ALL
),
fan AS (
    SELECT run_id, step, microbatch, layer, src, expert, count(*) AS fan_out
    FROM transfer_detail WHERE {_RUN} GROUP BY ALL
)
SELECT t.run_id, t.step, count(*) AS transfers, sum(t.bytes)::BIGINT AS bytes,
       sum(t.measured_s) AS measured_s,
       (SELECT max(sent) FROM per_src p WHERE p.run_id = t.run_id AND p.step = t.step) AS busiest_sender_bytes,
       (SELECT max(fan_out) FROM fan f WHERE f.run_id = t.run_id AND f.step = t.step) AS max_fan_out
FROM transfer_detail t WHERE {_RUN}
GROUP BY t.run_id, t.step
ORDER BY t.run_id, t.step
""",
    doc="Per step: transfers, bytes, the most bytes one rank sent in one layer-microbatch (busiest sender), "
        "and the largest fan-out (copies of one expert one rank sent in one layer-microbatch).",
)

TRANSFER_SUMMARY = Query(
    "transfer_summary", "Transfers per layer" + _EXCLUDED,
    f"""
SELECT run_id, layer, count(*) AS transfers, sum(bytes)::BIGINT AS bytes,
       count(DISTINCT (step, microbatch)) AS planned_microbatches,
       sum(bytes) FILTER (WHERE stage = 1)::BIGINT AS relay_bytes,
       count(measured_s) FILTER (WHERE {SETTLED}) AS measured,
       sum(measured_s) FILTER (WHERE {SETTLED}) AS measured_s,
       sum(bytes) FILTER (WHERE measured_s > 0 AND {SETTLED})
           / nullif(sum(measured_s) FILTER (WHERE {SETTLED}), 0) AS bandwidth_Bps
FROM transfer_detail {WARM_JOIN} WHERE {_RUN}
GROUP BY run_id, layer
ORDER BY run_id, layer
""",
    doc="Per layer: transfers, bytes (and relay share) of every step; measured seconds and effective "
        "bandwidth without the warm-up steps.",
)

REPLICA_CACHE = Query(
    "replica_cache", "Replica cache per layer" + _EXCLUDED,
    f"""
WITH c AS (
    SELECT run_id, layer, sum(other['cache_hits'])::BIGINT AS hits, sum(other['cache_misses'])::BIGINT AS misses,
           sum(other['cache_hits']) / nullif(sum(other['cache_hits']) + sum(other['cache_misses']), 0) AS hit_rate,
           sum(other['cache_bytes_saved'])::BIGINT AS bytes_saved
    FROM timings {WARM_JOIN} WHERE {_RUN} AND {SETTLED} AND other['cache_hits'] IS NOT NULL
    GROUP BY run_id, layer
),
k AS (SELECT run_id, any_value(kind) AS kind FROM runs WHERE {_RUN} GROUP BY run_id),
mb AS (SELECT run_id, layer, max(microbatch) + 1 AS microbatches_per_step FROM timings WHERE {_RUN} GROUP BY ALL),
p AS (  -- one plan per layer call (the lowest recording rank's), numbered in call order per layer
    SELECT run_id, step, microbatch, layer, num_masters, phy2log,
           row_number() OVER (PARTITION BY run_id, layer ORDER BY step, microbatch) AS call
    FROM plans WHERE {_RUN}
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
),
pr AS (SELECT p.*, unnest(range(len(phy2log))) AS r FROM p),
rep AS (  -- every replica of every call: (rank, expert) in a redundant slot
    SELECT run_id, step, layer, call, r, e
    FROM (SELECT *, unnest(phy2log[r + 1][num_masters + 1:]) AS e FROM pr) WHERE e >= 0
),
again AS (  -- replicas of a call already on their rank in the layer's previous call (in a training run: of the
            -- same step, since an optimizer step between them changes the master)
    SELECT a.run_id, a.layer, count(*) AS replicas,
           count(b.e) FILTER (WHERE k.kind <> 'train' OR b.step = a.step) AS repeated
    FROM rep a JOIN k USING (run_id)
         LEFT JOIN rep b ON b.run_id = a.run_id AND b.layer = a.layer AND b.call = a.call - 1
                        AND b.r = a.r AND b.e = a.e
    WHERE a.call > 1
    GROUP BY a.run_id, a.layer
)
SELECT c.*, k.kind, mb.microbatches_per_step, coalesce(again.repeated, 0) / nullif(again.replicas, 0) AS repeat_share
FROM c LEFT JOIN k USING (run_id) LEFT JOIN mb USING (run_id, layer) LEFT JOIN again USING (run_id, layer)
ORDER BY run_id, layer
""",
    doc="Per layer, over every rank: replicas found resident in the replica cache (hits, no transfer) or "
        "streamed (misses), the hit rate and the weight bytes the hits saved; and what explains a low hit "
        "rate: the run's kind, its microbatches per optimizer step (each optimizer step changes the masters, "
        "so a replica stays valid only between the microbatches of one step, or in serving) and the share of "
        "replicas placed on the same rank as in the layer's previous call (of the same step in training).",
)

POLICY_COMPARISON = Query(
    "policy_comparison", "Policies compared" + _EXCLUDED,
    f"""
WITH b AS (SELECT layer_balance.*, {SETTLED} AS settled FROM layer_balance {WARM_JOIN} WHERE {_RUN}),
t AS (SELECT run_id, step, microbatch, layer, sum(bytes)::BIGINT AS bytes FROM transfer_detail WHERE {_RUN} GROUP BY ALL),
m AS ({_MEASURED}), d AS ({_DECIDED})
SELECT b.run_id, {SHOWN_POLICY} AS policy, count(*) AS plans,
       count(*) / sum(count(*)) OVER (PARTITION BY b.run_id) AS share,
       avg(b.imbalance_before) FILTER (WHERE b.settled) AS mean_imbalance_before,
       avg(b.imbalance_after) FILTER (WHERE b.settled) AS mean_imbalance_after,
       avg(coalesce(t.bytes, 0)) FILTER (WHERE b.settled) AS mean_transfer_bytes,
       avg(m.measured_s) FILTER (WHERE b.settled) AS mean_measured_s,
       avg(m.timing_predicted_s) FILTER (WHERE b.settled) AS mean_predicted_s
FROM b LEFT JOIN t USING (run_id, step, microbatch, layer) LEFT JOIN m USING (run_id, step, microbatch, layer)
     LEFT JOIN d USING (run_id, step, microbatch, layer)
GROUP BY b.run_id, 2
ORDER BY b.run_id, plans DESC, policy
""",
    doc="Per policy (the candidate an adaptive layer chose, 'quota via adaptive'): how often it ran and "
        "what it achieved (imbalance, bytes moved, measured time; warm-up steps left out of the means).",
)

STEP_SUMMARY = Query(
    "step_summary", "Steps",
    f"""
SELECT run_id, step, avg(loss) AS loss, max(step_time_s) AS step_time_s, count(*) AS ranks, max(ts) AS ts,
       coalesce(bool_or(warmup), false) AS warmup
FROM steps WHERE {_RUN}
GROUP BY run_id, step
ORDER BY run_id, step
""",
    doc="Per step: loss (mean over ranks), step time (slowest rank), whether any rank marked it warm-up.",
)

PHASE_TIMES = Query(
    "phase_times", "Phase times per step",
    f"""
WITH per_rank AS (
    SELECT run_id, step, rank,
           sum(plan_s) AS plan_s, sum(transfer_s) AS transfer_s, sum(dispatch_s) AS dispatch_s,
           sum(experts_s) AS experts_s, sum(combine_s) AS combine_s, sum(backward_reduce_s) AS backward_reduce_s
    FROM timings WHERE {_RUN} GROUP BY ALL
)
SELECT run_id, step, max(plan_s) AS plan_s, max(transfer_s) AS transfer_s, max(dispatch_s) AS dispatch_s,
       max(experts_s) AS experts_s, max(combine_s) AS combine_s, max(backward_reduce_s) AS backward_reduce_s
FROM per_rank GROUP BY run_id, step ORDER BY run_id, step
""",
    doc="Per step: seconds in each phase, summed over layers and microbatches (slowest rank).",
)

STEP_TIMES = Query(
    "step_times", "Measured step time" + _EXCLUDED,
    f"""
SELECT run_id, timed_steps, warmup_steps, step_time_p50_s, step_time_p20_s, step_time_p80_s, warmup_time_s
FROM step_times WHERE {_RUN} ORDER BY run_id
""",
    doc="Per run: the measured step time (slowest rank of each step) over the steps not marked warm-up: "
        "median (p50), p20, p80; and the seconds the warm-up steps took (one-time cost, reported apart). "
        "The view step_times of telemetry/schema.sql (run_summary reads it too).",
)

NONE_ESTIMATE = Query(
    "none_estimate", "What no balancing would have cost (cost-model estimate)" + _EXCLUDED,
    f"""
WITH d AS (
    SELECT run_id, step, microbatch, layer, predictions['none'] AS none_s, chosen_predicted_s
    FROM decisions WHERE {_RUN}
    QUALIFY row_number() OVER (PARTITION BY run_id, step, microbatch, layer ORDER BY rank, ts) = 1
),
tm AS (  -- the slowest rank's time of each layer call and its parts (the load-scaled fallback)
    SELECT run_id, step, microbatch, layer, max(experts_s) AS experts_s,
           max(coalesce(plan_s, 0) + coalesce(transfer_s, 0)) AS overhead_s
    FROM timings WHERE {_RUN} GROUP BY ALL
),
per_call AS (
    SELECT b.run_id, b.step,
           d.none_s - d.chosen_predicted_s AS model_delta_s,
           tm.experts_s * (list_max(b.rank_load_before) / nullif(list_max(b.rank_load_after), 0) - 1)
               - tm.overhead_s AS load_delta_s
    FROM layer_balance b LEFT JOIN d USING (run_id, step, microbatch, layer)
         LEFT JOIN tm USING (run_id, step, microbatch, layer)
    WHERE ($run_id IS NULL OR b.run_id = $run_id)
),
per_step AS (
    SELECT p.run_id, p.step, sum(model_delta_s) AS model_delta_s, count(model_delta_s) AS model_calls,
           sum(load_delta_s) AS load_delta_s, count(load_delta_s) AS load_calls, count(*) AS calls
    FROM per_call p {WARM_JOIN} WHERE {SETTLED} GROUP BY ALL
)
SELECT run_id,
       median(model_delta_s) FILTER (WHERE model_calls = calls) AS model_delta_s,
       median(load_delta_s) FILTER (WHERE load_calls = calls) AS load_delta_s
FROM per_step GROUP BY run_id ORDER BY run_id
""",
    doc="Per run: how many seconds per step the run would have taken more without balancing, from the cost "
        "model (predictions['none'] - the chosen policy's prediction, summed over a step's layer calls, median "
        "over settled steps) and, where no decision predicted none, scaled from the measurement (busiest-rank "
        "expert compute x (max rank load before / after - 1) - planning - transfers). An estimate, never a "
        "measurement.",
)

ACTIVATION_MEMORY = Query(
    "activation_memory", "Expert activation memory per rank" + _EXCLUDED,
    f"""
WITH per_call AS (
    SELECT run_id, layer, step, microbatch,
           max(other['activation_bytes_before']) AS busiest_before, avg(other['activation_bytes_before']) AS mean_before,
           max(other['activation_bytes_after']) AS busiest_after, avg(other['activation_bytes_after']) AS mean_after
    FROM timings WHERE {_RUN} AND other['activation_bytes_after'] IS NOT NULL
    GROUP BY ALL
)
SELECT run_id, layer, count(*) AS calls,
       max(busiest_before) FILTER (WHERE {SETTLED}) / 1e6 AS peak_busiest_before_MB,
       max(busiest_after) FILTER (WHERE {SETTLED}) / 1e6 AS peak_busiest_after_MB,
       avg(mean_after) FILTER (WHERE {SETTLED}) / 1e6 AS mean_rank_MB,
       max(busiest_before) FILTER (WHERE {SETTLED}) / avg(mean_before) FILTER (WHERE {SETTLED}) AS peak_over_mean_before,
       max(busiest_after) FILTER (WHERE {SETTLED}) / avg(mean_after) FILTER (WHERE {SETTLED}) AS peak_over_mean_after
FROM per_call {WARM_JOIN}
GROUP BY run_id, layer ORDER BY run_id, layer
""",
    doc="Per layer: bytes of expert activations a rank holds for a call (rows it computes x the expert's activation "
        "width x dtype, recorded by every rank), the busiest rank's peak over the calls without and with balancing "
        "against the mean rank's: what a rank must reserve for activations. Needs every rank's timings.",
)

ACTIVATION_MEMORY_BY_RANK = Query(
    "activation_memory_by_rank", "Expert activation memory of each rank" + _EXCLUDED,
    f"""
SELECT run_id, layer, rank, count(*) AS calls,
       max(other['activation_bytes_before']) FILTER (WHERE {SETTLED}) / 1e6 AS peak_before_MB,
       max(other['activation_bytes_after']) FILTER (WHERE {SETTLED}) / 1e6 AS peak_after_MB,
       avg(other['activation_bytes_before']) FILTER (WHERE {SETTLED}) / 1e6 AS mean_before_MB,
       avg(other['activation_bytes_after']) FILTER (WHERE {SETTLED}) / 1e6 AS mean_after_MB
FROM timings {WARM_JOIN}
WHERE {_RUN} AND ($layer IS NULL OR layer = $layer) AND other['activation_bytes_after'] IS NOT NULL
GROUP BY ALL ORDER BY run_id, layer, rank
""",
    params=("run_id", "layer"),
    doc="Per layer and rank: the peak and mean over the calls (warm-up excluded) of the expert-activation bytes the "
        "rank held without and with balancing (``activation_memory`` compares the busiest rank with the mean rank; "
        "this shows every rank). ``layer`` NULL: every layer.",
)

ALL: dict[str, Query] = {q.name: q for q in (
    OVERVIEW, LAYER_IMBALANCE, LAYER_SUMMARY, RANK_LOAD, RANK_LOAD_BY_EXPERT, EXPERT_LOAD, DECISION_TIMELINE,
    POLICY_SHARES, EXPLORATION,
    PREDICTED_VS_MEASURED, PREDICTION_SUMMARY, PHASE_PREDICTION_ERRORS, TRANSFER_BYTES_PER_STEP, TRANSFER_SUMMARY,
    REPLICA_CACHE,
    POLICY_COMPARISON,
    STEP_SUMMARY, PHASE_TIMES, STEP_TIMES, NONE_ESTIMATE, ACTIVATION_MEMORY, ACTIVATION_MEMORY_BY_RANK,
)}

# What `ultraep report` prints, in order.
REPORT = (OVERVIEW, LAYER_SUMMARY, POLICY_SHARES, TRANSFER_SUMMARY, REPLICA_CACHE, PREDICTION_SUMMARY,
          PHASE_PREDICTION_ERRORS, ACTIVATION_MEMORY, EXPLORATION)


def run(con, query: Query | str, **params: Any) -> tuple[list[str], list[tuple]]:
    """Execute a canned query; returns ``(column names, rows)``."""
    q = ALL[query] if isinstance(query, str) else query
    cur = con.execute(q.sql, q.bind(**params))
    cols = [d[0] for d in cur.description]
    return cols, cur.fetchall()


def arrow(con, query: Query | str, **params: Any):
    """Execute a canned query; returns a ``pyarrow.Table``."""
    q = ALL[query] if isinstance(query, str) else query
    rel = con.sql(q.sql, params=q.bind(**params))
    fn = getattr(rel, "to_arrow_table", None) or rel.arrow  # DuckDB 2.x / 1.x
    return fn()
