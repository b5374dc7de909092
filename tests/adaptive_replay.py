"""Drive the adaptive engine through seeded random load sequences with synthetic measured outcomes, and
snapshot every decision and the outcome tables (``tests/test_adaptive_replay.py`` compares them with
``tests/data/adaptive_replay.json``, generated from the engine before it was split into parts).

Regenerate the fixture only for an intended change of behaviour:

    .venv/bin/python tests/adaptive_replay.py tests/data/adaptive_replay.json

Each scenario runs the real :class:`~ultraep.engine.Engine` (calibration included) on a small topology;
the measured layer time of the chosen candidate is its calibrated prediction times a per-candidate
"truth" factor, a warm-up slowdown and seeded noise (how the runtime's measurements differ from the model).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from ultraep.config import AdaptiveOptions, BalancerConfig
from ultraep.cost import CostModel
from ultraep.engine import Engine
from ultraep.presets import get_preset
from ultraep.sim.workload import power_law_popularity

#: (name, seed, ranks, experts, tokens per rank, decisions, adaptive options, residency, truth factors)
SCENARIOS = [
    ("skew-changes", 1, 8, 32, 2048, 60, {}, False, {"quota": 0.8, "eplb": 1.3}),
    ("few-tokens", 2, 8, 32, 64, 60, {"probe_every": 16}, False, {"none": 0.9}),
    ("resident", 3, 8, 32, 1024, 50, {"probe_every": 8}, True, {"feplb": 0.7}),
    ("deadline", 4, 8, 32, 4096, 30, {"deadline_s": 2e-4, "screen": False}, False, {}),
    ("hysteresis", 5, 8, 32, 512, 40, {"patience": 3, "margin": 0.02, "switch_now": 0.1}, True,
     {"quota": 0.7, "none": 1.2}),
]


def _loads(rng, R: int, E: int, tokens: int, n: int) -> list[np.ndarray]:
    """``n`` loads ``[R, E]``: top-4 routing of ``tokens`` per rank, popularity skew changing every 10 calls."""
    out = []
    for i in range(n):
        skew = float(rng.choice([0.0, 0.3, 1.0, 2.0])) if i % 10 == 0 else skew
        p = power_law_popularity(R, E, skew, rng)
        out.append(rng.multinomial(tokens * 4, p, size=R).astype(np.int64))
    return out


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.10g}") if math.isfinite(x) else repr(x)
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return _round(float(x))
    return x


def tables(pol) -> dict:
    """The adaptive engine's outcome tables: measured outcomes (both bases), clocks, run counters, streaks."""
    t, s = pol.outcomes, pol.schedule  # (read from the single class's own fields when the fixture was made)
    return _round({
        "outcome": dict(t._outcome), "outcome_anchor": dict(t._outcome_anchor),
        "clock": {n: [list(ts), list(xs)] for n, (ts, xs) in t._clock.items()},
        "ran": sorted(s._ran), "since": dict(s._since), "unplanned": dict(s._unplanned), "lost": dict(s._lost),
        "none_streak": s._none_streak, "current": pol.current, "corrections": {
            n: t.correction(n) for n in pol.policies},
    })


def run_scenario(name, seed, R, E, tokens, n, opts, resident, truth) -> list[dict]:
    rng = np.random.default_rng(seed)
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(R, E, 2), pre.hardware, pre.expert)
    # explore_share=None: the fixture pins the engine as it was split, before issue 35's exploration budget
    opts = {"explore_share": None, "probe_cost_share": None, **opts}
    eng = Engine(BalancerConfig(policy="adaptive", layers={0: AdaptiveOptions(**opts)}), cm.topology, cost_model=cm)
    held = np.zeros((R, E), dtype=bool)
    out = []
    for i, load in enumerate(_loads(rng, R, E, tokens, n)):
        d = eng.decide(i, 0, 0, load, held if resident else None)
        eng.commit(d)
        if resident:  # the replicas the plan placed stay resident (the runtime's replica cache, simplified)
            p = d.plan.phy2log_RS
            held = np.zeros((R, E), dtype=bool)
            for r in range(R):
                held[r, p[r][p[r] >= 0]] = True
        warm = 1.5 if i < 3 else 1.0
        noise = float(np.exp(rng.normal(0.0, 0.05)))
        meas = {k: v * truth.get(d.chosen, 1.0) * warm * noise for k, v in d.predicted.as_dict().items()
                if k in ("compute_fwd_s", "a2a_fwd_s")}
        eng.observe(i, 0, 0, meas, measured_total_s=d.predicted.terms_s * truth.get(d.chosen, 1.0) * warm * noise)
        c = d.plan.decision
        out.append(_round({"i": i, "chosen": d.chosen, "reason": d.reason, "probe": c.probe,
                           "screened": list(c.screened), "predictions": d.predictions,
                           "predicted_s": c.predicted_s, "engine_s": d.plan.engine_s,
                           "tables": tables(eng.policy_for(0))}))
    return out


def snapshot() -> dict:
    return {s[0]: run_scenario(*s) for s in SCENARIOS}


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(snapshot(), f, separators=(",", ":"), sort_keys=True)
