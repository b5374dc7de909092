"""A recorded run as the simulator's machine: the cost model its engine learned, and what the run measured.

The runtime's rank 0 records the engine's calibrated cost model (topology, hardware seed, expert geometry, every
calibrated scale: :func:`~ultraep.cost.cost_record`) with every step (``steps.extra_json``). ``ultraep simulate RUN
--topology from-run`` replays the run's own routing through every policy on that model — predictions for the machine
that measured the run — and prints next to them what the run measured (:func:`measured_summary`), so the two can be
told apart: measured figures come from the run's timings, predicted ones from the model, projected ones from a model
of another cluster (any preset).
"""

from __future__ import annotations

import json

from ultraep.cost import SUMMED_TERMS, CostModel, call_residual, cost_model_from_record
from ultraep.errors import TraceError

#: what a figure is: measured by the runtime, predicted for the machine of the run, or projected to another cluster
MEASURED, PREDICTED, PROJECTED = "measured", "predicted", "projected"


def _connect(path):
    from ultraep.telemetry import open_run

    try:
        return open_run(path)
    except Exception as exc:
        raise TraceError(str(path), f"is not a readable ultraep run ({exc})") from None


def recorded_cost_model(path, run_id: str) -> CostModel:
    """The cost model the run's engine had learned at its last recorded step (rank 0's record). A prefill run's
    model predicts the forward only."""
    con = _connect(path)
    row = con.execute(
        "SELECT extra_json FROM steps WHERE run_id = ? AND json_extract(extra_json, '$.cost_model') IS NOT NULL "
        "ORDER BY step DESC, rank LIMIT 1", [run_id]).fetchone()
    if row is None:
        raise TraceError(f"{path}:steps", f"run {run_id!r} recorded no cost model: it was recorded before the "
                         "runtime kept one with every step, or without next_step(); use a preset --topology", run_id)
    record = json.loads(row[0])["cost_model"]
    cm = cost_model_from_record(record, path=f"{path}:steps.cost_model")
    if "call_overhead_s" not in record.get("params", {}):  # recorded before the term existed: learn it as the
        # engine's calibrator would have, from the run's own measurements
        cm = cm.with_params(cm.params.model_copy(update={"call_overhead_s": learned_call_overhead(con, run_id)}))
    kind = con.execute("SELECT any_value(kind) FROM runs WHERE run_id = ?", [run_id]).fetchone()
    if kind and kind[0] == "prefill" and cm.params.mode != "prefill":
        cm = cm.with_params(cm.params.model_copy(update={"mode": "prefill"}))
    return cm


#: one row per measured layer call, reduced over its ranks as the engine reduces them (``ultraep.runtime.phases``:
#: the slowest rank's compute, copies, planning and layer time; each all-to-all exchange the fastest rank's)
_CALL_TERMS_SQL = """
SELECT step, microbatch, layer,
  max(other['measured.compute_fwd_s']), max(other['measured.compute_bwd_s']),
  min(dispatch_s) + min(combine_s), min(other['combine_bwd_s']) + min(other['dispatch_bwd_s']),
  max(other['measured.copy_s']), max(plan_s), max(measured_s)
FROM timings WHERE run_id = ? AND measured_s IS NOT NULL AND other['measured.compute_fwd_s'] IS NOT NULL
GROUP BY ALL HAVING count(*) = (SELECT max(rank) + 1 FROM timings WHERE run_id = ?)
ORDER BY step, microbatch, layer"""


def learned_call_overhead(con, run_id: str, alpha: float = 0.2) -> float:
    """``call_overhead_s`` as the engine's :class:`~ultraep.cost.Calibrator` learns it (weights ``max(alpha, 1/n)``
    over the calls in order, ``alpha`` the engine's default) from a recorded run's measured calls, for runs recorded
    before the model had the term. 0 when the run measured no complete call."""
    est, n = 0.0, 0
    for row in con.execute(_CALL_TERMS_SQL, [run_id, run_id]).fetchall():
        measured = {k: (0.0 if v is None else float(v)) for k, v in zip(SUMMED_TERMS, row[3:9])}
        n += 1
        a = max(alpha, 1.0 / n)
        est = (1 - a) * est + a * call_residual(measured, row[9])
    return est


def measured_summary(path, run_id: str) -> dict:
    """What the run measured: its configured policy, the policies its engine chose, its layer calls (warm-up steps
    left out) and their mean measured and predicted layer time (the layer's time is the slowest rank's)."""
    con = _connect(path)
    cfg = con.execute("SELECT any_value(config_json) FROM runs WHERE run_id = ?", [run_id]).fetchone()
    configured = None
    if cfg and cfg[0]:
        try:
            configured = json.loads(cfg[0]).get("policy")
        except (ValueError, AttributeError):
            configured = None
    calls, measured, predicted = con.execute(
        "WITH c AS (SELECT step, microbatch, layer, max(measured_s) AS m, max(predicted_s) AS p FROM timings "
        "WHERE run_id = ? AND measured_s IS NOT NULL AND step NOT IN (SELECT step FROM warmup_steps WHERE run_id = ?) "
        "GROUP BY ALL) SELECT count(*), avg(m), avg(p) FROM c", [run_id, run_id]).fetchone()
    chosen = dict(con.execute("SELECT policy, count(*) FROM decisions WHERE run_id = ? GROUP BY 1 ORDER BY 2 DESC",
                              [run_id]).fetchall())
    return {"run_id": run_id, "policy": configured, "chosen": chosen, "calls": int(calls or 0),
            "measured_layer_ms": None if measured is None else 1e3 * float(measured),
            "predicted_layer_ms": None if predicted is None else 1e3 * float(predicted)}
