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
import math
from dataclasses import dataclass

import numpy as np

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


def configured_policy(con, run_id: str) -> str | None:
    """The policy the run's config names (None: no config recorded, or not readable)."""
    cfg = con.execute("SELECT any_value(config_json) FROM runs WHERE run_id = ?", [run_id]).fetchone()
    try:
        return json.loads(cfg[0]).get("policy") if cfg and cfg[0] else None
    except (ValueError, AttributeError):
        return None


def measured_summary(path, run_id: str) -> dict:
    """What the run measured: its configured policy, the policies its engine chose, its layer calls (warm-up steps
    left out) and their mean measured and predicted layer time (the layer's time is the slowest rank's)."""
    con = _connect(path)
    configured = configured_policy(con, run_id)
    calls, measured, predicted = con.execute(
        "WITH c AS (SELECT step, microbatch, layer, max(measured_s) AS m, max(predicted_s) AS p FROM timings "
        "WHERE run_id = ? AND measured_s IS NOT NULL AND step NOT IN (SELECT step FROM warmup_steps WHERE run_id = ?) "
        "GROUP BY ALL) SELECT count(*), avg(m), avg(p) FROM c", [run_id, run_id]).fetchone()
    chosen = dict(con.execute("SELECT policy, count(*) FROM decisions WHERE run_id = ? GROUP BY 1 ORDER BY 2 DESC",
                              [run_id]).fetchall())
    return {"run_id": run_id, "policy": configured, "chosen": chosen, "calls": int(calls or 0),
            "measured_layer_ms": None if measured is None else 1e3 * float(measured),
            "predicted_layer_ms": None if predicted is None else 1e3 * float(predicted)}


# ---------------------------------------------------------------------------------------------- anchoring
# The engine's model is an online fit: per term an exponentially weighted ratio, the compute a decaying least-squares
# fit. It predicts each term from the scales every kind of call shares, and a call that moves expert weights can cost
# more in every term than those scales say: at 64 tokens per rank on 2 gloo ranks the calibration runs' own quota and
# feplb calls ran 4-8 % over what their final model predicted for them (all-to-alls, copies and backward alike), their
# `none` calls within 2 % (2026-11-27, four recordings of benchmarks/bench_validate.py), and every such policy's
# predicted speed-up over none was 5-8 % high. The run's own measured calls show it, so from-run checks the model
# against them before replaying:
#
#     Step 1: replay the run's routing through the policies its calls ran, on the recorded model, and pair every
#             measured call (the run's first step and its warm-up steps left out) with the prediction of the policy
#             that ran it, both net of their planning (an adaptive run's calls also planned the other candidates).
#     Step 2: per kind of call (moving expert weights or not: the kinds `CostParams.call_overhead_s` and
#             `transfer_call_overhead_s` already tell apart), the median of measured minus predicted, and its
#             standard error (from the median absolute deviation).
#     Step 3: shrink the median by its noise, `shift = median * max(0, 1 - (SE / median)^2)`, so a shift the calls
#             cannot tell from their noise (a dozen calls of a layer that varies 5-10 % from call to call) moves
#             nothing, and add it to that kind's call overhead.
#
# Measured (the same four recordings, `bench_validate --from`): worst speed-up error 2.4 / 7.9 / 5.7 / 6.0 % without,
# 2.5 / 4.7 / 5.7 / 5.6 % anchored; tok64's `quota` and `feplb` within 0.2-2.8 %. Why the shrinkage: unshrunk (applied
# to the replayed rows offline), the shifts learned from the ~10 `none` calls a calibration run makes at the larger
# shapes were 1-2 % of their layer time either way and moved the other predictions by as much (2.2 / 4.2 / 5.7 / 5.9 %).

#: calls of a kind below which its shift is left at 0 (a median of fewer says little)
ANCHOR_MIN_CALLS = 4
#: the median absolute deviation of a normal sample over its standard deviation, inverted; and the standard error of a
#: median over that of a mean (both for normal samples)
MAD_TO_SD, MEDIAN_SE = 1.4826, 1.2533
PLAIN, TRANSFER = "plain", "transfer"


@dataclass(frozen=True)
class AnchorShift:
    """One kind of call's comparison: ``calls`` paired, their ``median_s`` (measured minus predicted), its
    standard error ``se_s`` (None below ``ANCHOR_MIN_CALLS`` calls) and the ``shift_s`` added to that kind's call
    overhead."""

    calls: int
    median_s: float
    se_s: float | None
    shift_s: float


def _shift(diff: np.ndarray) -> AnchorShift:
    n = int(diff.size)
    if n < ANCHOR_MIN_CALLS:
        return AnchorShift(n, float(np.median(diff)) if n else 0.0, None, 0.0)
    med = float(np.median(diff))
    se = MEDIAN_SE * MAD_TO_SD * float(np.median(np.abs(diff - med))) / math.sqrt(n)
    shift = 0.0 if se >= abs(med) else med * (1.0 - (se / med) ** 2)  # (also med = 0; no overflow of se / med)
    return AnchorShift(n, med, se, shift)


def run_call_policies(con, run_id: str) -> dict[tuple[int, int, int], str]:
    """``{(step, microbatch, layer): policy}`` of every call the run's engine decided (rank 0's decisions); a run of
    one policy records none: its configured policy ran every call (``{}`` if that is unknown)."""
    rows = con.execute("SELECT step, microbatch, layer, policy FROM decisions WHERE run_id = ? AND rank = 0",
                       [run_id]).fetchall()
    if rows:
        return {(int(s), int(m), int(l)): p for s, m, l, p in rows}
    policy = configured_policy(con, run_id)
    if not policy:
        return {}
    calls = con.execute("SELECT DISTINCT step, microbatch, layer FROM timings WHERE run_id = ?", [run_id]).fetchall()
    return {(int(s), int(m), int(l)): policy for s, m, l in calls}


@dataclass(frozen=True)
class AnchorCalls:
    """The calls anchoring compares, one entry each: ``step`` [C] (int), ``transfer`` [C] (bool: the call moved expert
    weights), ``diff_s`` [C], its measured minus predicted layer time on the recorded model, both net of planning, and
    ``policy`` [C] (str: the policy that ran it; None: not known). What :func:`anchor` derives the shifts from (per
    kind), and what :mod:`ultraep.sim.uncertainty` resamples (per kind and per policy)."""

    step: np.ndarray
    transfer: np.ndarray
    diff_s: np.ndarray
    policy: np.ndarray | None = None

    def kinds(self, take: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``{kind: diffs}`` of the calls ``take`` indexes (default all; an index drawn twice counts twice), kinds
        without a call left out."""
        t, d = (self.transfer, self.diff_s) if take is None else (self.transfer[take], self.diff_s[take])
        return {k: v for k, v in ((PLAIN, d[~t]), (TRANSFER, d[t])) if v.size}


def anchor_calls(path, run_id: str, cm: CostModel, trace, workers: int = 1) -> AnchorCalls:
    """Steps 1 of the anchoring (the comment above): every measured call of the run (its first step and warm-up steps
    left out) paired with the prediction of ``cm`` (the run's recorded model) for the policy that ran it. Empty:
    nothing to compare (a run without measured layer times or of a policy the simulator does not replay)."""
    from ultraep.cost import moves_weights
    from ultraep.sim.replay import SIM_POLICIES, simulate

    con = _connect(path)
    policy_of = run_call_policies(con, run_id)
    measured = con.execute(
        "SELECT step, microbatch, layer, max(measured_s), coalesce(max(plan_s), 0) FROM timings WHERE run_id = ? "
        "AND measured_s IS NOT NULL AND step NOT IN (SELECT step FROM warmup_steps WHERE run_id = ?) "
        "AND step > (SELECT min(step) FROM timings WHERE run_id = ?) GROUP BY ALL ORDER BY ALL", [run_id] * 3).fetchall()
    con.close()
    names = sorted({p for p in policy_of.values() if p in SIM_POLICIES})
    steps, moving, diffs, ran = [], [], [], []
    if names and measured:
        res = simulate(trace, cm, names, max_plans=None, workers=workers)
        where = {n: {(int(s), int(m), int(l)): i for i, (s, m, l) in
                     enumerate(zip(res.rows[n]["step"], res.rows[n]["microbatch"], res.rows[n]["layer"]))}
                 for n in names}
        for s, m, l, total, plan in measured:
            key = (int(s), int(m), int(l))
            n = policy_of.get(key)
            i = where.get(n, {}).get(key)
            if i is None:
                continue
            r = res.rows[n]
            steps.append(key[0])
            ran.append(n)
            moving.append(moves_weights(r["weight_sync_s"][i], r["copy_s"][i], r["grad_reduce_s"][i]))
            diffs.append((float(total) - float(plan)) - (float(r["time_s"][i]) - float(r["plan_s"][i])))
    return AnchorCalls(np.asarray(steps, dtype=np.int64), np.asarray(moving, dtype=bool),
                       np.asarray(diffs, dtype=np.float64), np.asarray(ran, dtype=object))


def anchored_overheads(params, shifts: dict[str, AnchorShift]) -> tuple[float, float]:
    """Step 3's result on the recorded model's ``params``: ``(call_overhead_s, transfer_call_overhead_s)`` after each
    kind's shift (a kind without calls: a call moving weights keeps its difference to the plain calls)."""
    plain = max(0.0, params.call_overhead_s + (shifts[PLAIN].shift_s if PLAIN in shifts else 0.0))
    # what a call moving weights paid before, and after: its own shift, or the plain calls' where none was measured
    moving = max(0.0, params.call_overhead_s + params.transfer_call_overhead_s)
    moving += shifts[TRANSFER].shift_s if TRANSFER in shifts else plain - params.call_overhead_s
    return plain, moving - plain


def anchor(cm: CostModel, calls: AnchorCalls) -> tuple[CostModel, dict[str, AnchorShift]]:
    """Steps 2 and 3: ``cm`` with each kind's call overhead shifted by what ``calls`` say it missed, and the shifts."""
    shifts = {k: _shift(v) for k, v in calls.kinds().items()}
    if not shifts:
        return cm, {}
    plain, extra = anchored_overheads(cm.params, shifts)
    return cm.with_params(cm.params.model_copy(update={"call_overhead_s": plain, "transfer_call_overhead_s": extra})), shifts


def anchored_cost_model(path, run_id: str, cm: CostModel, trace, workers: int = 1
                        ) -> tuple[CostModel, dict[str, AnchorShift]]:
    """``cm`` (the run's recorded model) with each kind of call's overhead shifted so that the model reproduces the
    run's own measured calls (see the comment above), and the shifts per kind (``{}``: nothing to compare, e.g. a run
    without measured layer times or of a policy the simulator does not replay). ``trace``: the run's routing
    (``load_trace(path, "recorded-run")``, any of its layers); ``workers``: the replay's processes."""
    return anchor(cm, anchor_calls(path, run_id, cm, trace, workers))
