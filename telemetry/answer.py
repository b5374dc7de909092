"""The measured answer to "did balancing pay?": step time, and the speed-up over a baseline run.

Every surface (``ultraep report``, the dashboard's Overview and Compare, the demo) leads with it, and all
compute it here, from the store, the same way:

* **step time p50**: per step, the slowest rank's ``steps.step_time_s``; the median over the steps not
  marked warm-up (``queries.STEP_TIMES``). Warm-up steps (compiles, first allocations, first plans) are
  a one-time cost, reported apart as ``warmup_time_s``.
* **baseline**: a run of the same token stream without balancing. The demo and ``--compare`` record it and
  name it in every other run's ``extra`` (``{"baseline": RUN_ID}``); a user names one with ``--baseline``.
  Where the recorded baseline is not in the run's own store (a run opened by its directory, ``runs/<run id>``),
  :func:`answer_at` finds it beside the run, in ``runs/<baseline id>`` — one lookup for every surface.
* **speed-up** = baseline p50 / run p50 (measured; > 1 means balancing paid), with its 90 % interval over the
  steps both runs timed (paired by step number: :func:`.paired.ratio_interval`, the demo's interval from the
  same steps).
* Without a baseline: an **estimate** of what no balancing would have taken (``queries.NONE_ESTIMATE``:
  the cost model's prediction of ``none`` where a decision recorded it, else scaled from the measured
  expert compute by the rank loads), always labelled as an estimate.

Nothing here formats text for a person beyond :func:`headline`, the one sentence every surface prints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ultraep.telemetry import queries as Q
from ultraep.telemetry.paired import LEVEL, ratio_interval
from ultraep.telemetry.units import fmt_s

#: the key of ``Recorder.open(extra=...)`` naming the run's baseline (a run id of the same directory)
BASELINE_KEY = "baseline"
#: runs whose configured policy is this are baselines themselves (``ultraep.policies.BASELINE``, spelled here
#: because the dashboard reads this module and must not import the policies; a test checks the two agree)
BASELINE_POLICY = "none"


@dataclass(frozen=True)
class StepTimes:
    """One run's measured step times (seconds, warm-up excluded; ``None`` when no step was timed)."""

    run_id: str
    timed_steps: int
    warmup_steps: int
    p50_s: float | None
    p20_s: float | None
    p80_s: float | None
    warmup_time_s: float | None
    #: ``((step, seconds), ...)`` of every timed step (the slowest rank's), in step order: what pairs two runs
    series: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Answer:
    """Did balancing pay, for one run.

    ``basis``: ``"measured"`` (a baseline run was timed: ``speedup`` is measured), ``"baseline"`` (this run
    is itself unbalanced), ``"estimate"`` (no baseline: ``estimated_none_s`` is the cost model's, and
    ``speedup`` is the estimated one), ``"unknown"`` (nothing to compare with), ``"untimed"`` (no step
    time recorded)."""

    run_id: str
    policy: str | None
    steps: StepTimes
    basis: str
    baseline_id: str | None = None
    baseline_p50_s: float | None = None
    estimated_none_s: float | None = None
    estimate_source: str | None = None  # "cost model" | "load-scaled measurement"
    #: a simulation's run (``kind="simulation"``): its step times are the cost model's, not measured
    simulated: bool = False
    #: the measured speed-up's 90 % interval over ``paired_steps`` steps both runs timed (``None``: fewer than 2)
    interval: tuple[float, float] | None = None
    paired_steps: int = 0

    @property
    def speedup(self) -> float | None:
        ref = self.baseline_p50_s if self.basis == "measured" else self.estimated_none_s
        if ref is None or not self.steps.p50_s:
            return None
        return ref / self.steps.p50_s


def _num(v) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) else f


def step_times(con, run_id: str | None = None) -> dict[str, StepTimes]:
    """``{run_id: StepTimes}`` of every run in ``con`` (or only ``run_id``)."""
    cols, rows = Q.run(con, Q.STEP_TIMES, run_id=run_id)
    series: dict[str, list[tuple[int, float]]] = {}
    for rid, step, t in con.execute(_SERIES, {"run_id": run_id}).fetchall():
        series.setdefault(rid, []).append((int(step), float(t)))
    out = {}
    for r in rows:
        d = dict(zip(cols, r))
        out[d["run_id"]] = StepTimes(d["run_id"], int(d["timed_steps"] or 0), int(d["warmup_steps"] or 0),
                                     _num(d["step_time_p50_s"]), _num(d["step_time_p20_s"]),
                                     _num(d["step_time_p80_s"]), _num(d["warmup_time_s"]),
                                     tuple(series.get(d["run_id"], ())))
    return out


# the timed steps of Q.STEP_TIMES one by one (the slowest rank's time of each step not marked warm-up)
_SERIES = """
SELECT run_id, step, max(step_time_s) AS t FROM steps WHERE ($run_id IS NULL OR run_id = $run_id)
GROUP BY run_id, step HAVING NOT coalesce(bool_or(warmup), false) AND max(step_time_s) IS NOT NULL
ORDER BY run_id, step
"""


def paired_interval(baseline: StepTimes, run: StepTimes) -> tuple[tuple[float, float] | None, int]:
    """The 90 % interval of ``baseline p50 / run p50`` over the steps both timed (paired by step number), and
    how many steps that is; ``(None, n)`` with fewer than 2."""
    b = dict(baseline.series)
    pairs = [(b[s], t) for s, t in run.series if s in b]
    if len(pairs) < 2:
        return None, len(pairs)
    a, r = zip(*pairs)
    return ratio_interval(a, r, LEVEL), len(pairs)


def run_facts(con, run_id: str) -> dict:
    """``{"policy", "baseline", "kind", "model", "world_size"}`` of a run, from its newest runs_log rows."""
    row = con.execute(
        "SELECT any_value(config_json), any_value(extra_json), any_value(kind), any_value(model), max(world_size) "
        "FROM runs WHERE run_id = $r", {"r": run_id}).fetchone()
    cfg, extra, kind, model, world = row if row else (None, None, None, None, None)
    policy = baseline = None
    try:
        policy = (json.loads(cfg) or {}).get("policy") if cfg else None
    except (ValueError, AttributeError):
        policy = None
    try:
        e = json.loads(extra) if extra else {}
        policy = e.get("policy", policy) if isinstance(e, dict) and isinstance(e.get("policy"), str) else policy
        baseline = e.get(BASELINE_KEY) if isinstance(e, dict) else None
    except ValueError:
        baseline = None
    return {"policy": policy if isinstance(policy, str) else None,
            "baseline": baseline if isinstance(baseline, str) else None,
            "kind": kind, "model": model, "world_size": world}


def same_stream_problem(run: dict, base: dict) -> str | None:
    """Why ``base`` cannot be the baseline of ``run`` (a different kind, model or EP size), or ``None``."""
    for key in ("kind", "model", "world_size"):
        if run.get(key) != base.get(key):
            return f"its {key.replace('_', ' ')} is {base.get(key)!r}, the run's is {run.get(key)!r}"
    return None


def none_estimate(con, run_id: str) -> tuple[float | None, str | None]:
    """Seconds per step the run would have taken more without balancing, and the source of the estimate."""
    cols, rows = Q.run(con, Q.NONE_ESTIMATE, run_id=run_id)
    if not rows:
        return None, None
    d = dict(zip(cols, rows[0]))
    if _num(d["model_delta_s"]) is not None:
        return _num(d["model_delta_s"]), "cost model"
    if _num(d["load_delta_s"]) is not None:
        return _num(d["load_delta_s"]), "load-scaled measurement"
    return None, None


def answer(con, run_id: str, *, baseline: StepTimes | None = None, baseline_con=None) -> Answer:
    """The answer for ``run_id`` in ``con``.

    ``baseline``: the baseline's step times when the caller found them (``--baseline``, or a sibling run
    directory); otherwise the run's recorded baseline is looked up in ``con`` (``baseline_con`` if given)."""
    facts = run_facts(con, run_id)
    st = step_times(con, run_id).get(run_id) or StepTimes(run_id, 0, 0, None, None, None, None)
    policy = facts["policy"]
    sim = facts["kind"] == "simulation"
    if st.p50_s is None:
        return Answer(run_id, policy, st, "untimed", simulated=sim)
    if policy == BASELINE_POLICY:
        return Answer(run_id, policy, st, "baseline", simulated=sim)
    if baseline is None and facts["baseline"]:
        baseline = step_times(baseline_con or con, facts["baseline"]).get(facts["baseline"])
    if baseline is not None and baseline.p50_s:
        interval, paired = paired_interval(baseline, st)
        return Answer(run_id, policy, st, "measured", baseline_id=baseline.run_id, baseline_p50_s=baseline.p50_s,
                      simulated=sim, interval=interval, paired_steps=paired)
    delta, source = none_estimate(con, run_id)
    if delta is not None:
        return Answer(run_id, policy, st, "estimate", estimated_none_s=st.p50_s + delta, estimate_source=source,
                      simulated=sim)
    return Answer(run_id, policy, st, "unknown", simulated=sim)


def baseline_beside(con, path, run_id: str, runs: dict | None = None) -> StepTimes | None:
    """The step times of ``run_id``'s recorded baseline when it is not in ``con`` (the store at ``path``): in
    ``runs`` (``{run id: run directory}``, the runs a caller has on show) if it is there, else in the run
    directory named after it beside ``path`` when ``path`` is one run's directory (the demo writes
    ``runs/<run id>/`` for each run). ``None`` when the run recorded no baseline, ``con`` holds it (:func:`answer`
    reads it there), or it is found nowhere."""
    from pathlib import Path

    from ultraep.telemetry.store import open_run, run_layout

    rec = run_facts(con, run_id)["baseline"]
    if not rec or con.execute("SELECT count(*) FROM runs_log WHERE run_id = $r", {"r": rec}).fetchone()[0]:
        return None
    here = Path(path).resolve()
    where = (runs or {}).get(rec)
    if where is None and here.is_dir() and run_layout(here) == "run" and (here.parent / rec).is_dir():
        where = here.parent / rec
    if where is None or Path(where).resolve() == here:
        return None
    bcon = open_run(Path(where))
    try:
        return step_times(bcon, rec).get(rec)
    finally:
        bcon.close()


def answer_at(con, path, run_id: str, runs: dict | None = None) -> Answer:
    """:func:`answer` of ``run_id`` in the store ``con`` opened at ``path``, its recorded baseline found in the
    store or beside it (:func:`baseline_beside`): what ``ultraep report`` and the dashboard both show."""
    return answer(con, run_id, baseline=baseline_beside(con, path, run_id, runs))


def headline(a: Answer, name=None) -> str:
    """The one sentence every surface leads with (``name``: how to show a run id, e.g. a short label)."""
    name = name or (lambda rid: rid)
    if a.simulated:  # the same figures, from the cost model over a replayed trace: never called measured
        return ("SIMULATED (cost model, not measured): " + _sentence(a, name).replace("measured speed-up",
                                                                                      "simulated speed-up"))
    return _sentence(a, name)


def _sentence(a: Answer, name) -> str:
    p50 = fmt_s(a.steps.p50_s)
    n = f"over {a.steps.timed_steps} timed step{'s' if a.steps.timed_steps != 1 else ''}"
    if a.basis == "untimed":
        return "no step time recorded (record_step(step_time_s=...)): whether balancing paid is unknown."
    if a.basis == "baseline":
        return f"step time p50 {p50} {n}; this run is unbalanced (policy none): it is the baseline."
    if a.basis == "measured":
        s = a.speedup
        verdict = "faster" if s >= 1 else "slower"
        return (f"step time p50 {p50} {n} against {fmt_s(a.baseline_p50_s)} without balancing "
                f"(run {name(a.baseline_id)}): measured speed-up {s:.2f}x ({verdict}; {interval_text(a)}).")
    if a.basis == "estimate":
        return (f"step time p50 {p50} {n}. No baseline run: an ESTIMATE ({a.estimate_source}) of the same "
                f"steps without balancing is {fmt_s(a.estimated_none_s)}, an estimated speed-up of "
                f"{a.speedup:.2f}x. Record a run with policy none on the same stream (or pass --baseline) to "
                "measure it.")
    return (f"step time p50 {p50} {n}. No baseline run and no prediction of none: whether balancing paid is "
            "unknown (pass --baseline RUN).")


def interval_text(a: Answer) -> str:
    """``90 % interval 1.38x-1.44x over 12 paired steps`` (the demo's wording), or why there is none."""
    if a.interval is None:
        return f"no interval: {a.paired_steps} step{'s' if a.paired_steps != 1 else ''} timed by both runs"
    lo, hi = a.interval
    return f"{100 * LEVEL:.0f} % interval {lo:.2f}x-{hi:.2f}x over {a.paired_steps} paired steps"
