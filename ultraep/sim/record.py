"""Simulation results → telemetry runs: one recorded run per reported policy (``kind="simulation"``), so the
dashboard and ``ultraep sql`` read a replay like a real run."""

from __future__ import annotations

import numpy as np

from ultraep.errors import ConfigError
from ultraep.policies.registry import BASELINE
from ultraep.sim.replay import TERM_FIELDS, SimulationResult


def check_new_runs(runs_dir, run_name: str | None, policies) -> None:
    """Refuse a ``run_name`` whose runs (``<run_name>-<policy>``) already exist under ``runs_dir``: runs are
    append-only, so recording again would mix two simulations into one run."""
    from pathlib import Path

    if run_name is None or runs_dir is None:
        return
    taken = [f"{run_name}-{p}" for p in policies if (Path(runs_dir) / f"{run_name}-{p}").exists()]
    if taken:
        raise ConfigError("--run-name", f"{run_name!r}: run {taken[0]!r} already exists under {runs_dir}; pick another "
                          "name (recording again would mix two simulations into one run)", run_name)


def record(result: SimulationResult, runs_dir, *, run_name: str | None = None, trace_path: str | None = None,
           model: str | None = None, topology=None) -> list[str]:
    """Write one telemetry run per reported policy (``kind="simulation"``); return the run ids."""
    from ultraep.telemetry import Recorder
    from ultraep.telemetry.recorder import new_run_id

    base = run_name or ("sim-" + new_run_id())
    reported = list(result.settings.get("reported", result.policies))
    check_new_runs(runs_dir, base, reported)
    summary = {s["policy"]: s for s in result.summary()}

    def baseline(pol: str) -> dict:  # the replay of none on the same trace: what `ultraep report` compares with
        return {"baseline": f"{base}-{BASELINE}"} if BASELINE in reported and pol != BASELINE else {}

    ids = []
    for pol in result.settings.get("reported", result.policies):
        r = result.rows[pol]
        cfg = {"policy": pol, "trace": trace_path, **{k: v for k, v in result.settings.items() if k != "reported"}}
        rec = Recorder.open(runs_dir, f"{base}-{pol}", kind="simulation", config=cfg, topology=topology, model=model,
                            extra={"summary": summary[pol], **baseline(pol)}, flush_interval_s=None, flush_every=8192,
                            max_pending=1 << 22)
        try:
            for i in range(len(r["time_s"])):
                s, mb, layer = int(r["step"][i]), int(r["microbatch"][i]), int(r["layer"][i])
                # the engine's names: predicted_s and predicted.<term> (CostBreakdown fields), as a live run records
                rec.record_timings(s, mb, layer, {
                    "predicted_s": float(r["time_s"][i]), "plan_s": float(r["plan_s"][i]),
                    "ideal_s": float(r["ideal_s"][i]), "imbalance_before": float(r["imbalance_before"][i]),
                    "imbalance_after": float(r["imbalance_after"][i]),
                    **{f"predicted.{f}": float(r[f][i]) for f in TERM_FIELDS if f.endswith("_s")},
                })
                if pol not in result.decisions:  # a fixed policy: its one decision per row (a chooser's are below)
                    rec.record_decision(s, mb, layer, policy=pol, reason="fixed policy (simulation)",
                                        predictions={pol: float(r["time_s"][i])},
                                        chosen_predicted_s=float(r["time_s"][i]))
            for s, mb, layer, chosen, reason, preds, t_pred in result.decisions.get(pol, []):
                rec.record_decision(s, mb, layer, policy=chosen, reason=reason, predictions=preds,
                                    chosen_predicted_s=t_pred)
            for s, mb, layer, plan in result.plans.get(pol, []):
                rec.record_plan(s, mb, layer, plan)
            steps, inv = np.unique(r["step"], return_inverse=True)
            t_step = np.bincount(inv, weights=r["time_s"], minlength=len(steps))
            i_step = np.bincount(inv, weights=r["ideal_s"], minlength=len(steps))
            for k, s in enumerate(steps):  # predicted time of the replayed layers of the step
                rec.record_step(int(s), step_time_s=float(t_step[k]), extra={"ideal_s": float(i_step[k])})
        finally:
            rec.close()
        ids.append(rec.run_id)
    return ids
