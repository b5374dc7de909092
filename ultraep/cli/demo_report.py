"""The demo's tables and its verdict: did balancing pay (Step 3 of :mod:`ultraep.cli.demo_job`).

The verdict is computed from the very numbers the step table prints, rounded as printed
(:class:`StepRow` → :func:`verdict`), so it cannot contradict them: "paid" needs the whole printed 90 %
interval of the speed-up above 1.00x, "did not pay" the whole interval below it; anything else is "no
measurable difference". The explanation beside it only restates the layer table's numbers (busiest-rank
expert compute of none and of the run, exposed overhead); it never claims a cause those numbers do not show.

Inputs: ``results[policy] = (run name, [per-rank result dict])`` with ``times`` (seconds per step),
``calls`` (``(step, layer, timings dict)``) and ``history`` (the runtime's per-call tuples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ultraep.cli.paired import ratio_interval
from ultraep.policies.registry import BASELINE

_PHASES = [  # (label, timing keys summed): exposed overheads of balancing, per layer call
    ("planning", ("plan_s",)),
    ("weight sync", ("weight_post_s", "relay_s", "weight_wait_s")),
    ("gradient reduction", ("grad_post_s", "grad_wait_s", "grad_reduce_s", "restore_s", "recompute_s")),
]


@dataclass(frozen=True)
class DemoTiming:
    """The launch's one-time costs: ``wall_s`` the whole launch (process start and imports included),
    ``setup_s`` the slowest rank's time from entering the rank function to the first step (model builds,
    ``ultraep.wrap``'s planner compile; shared by every run, charged to none), ``warmup`` the steps left out of
    every timed figure."""

    wall_s: float
    setup_s: float
    warmup: int


@dataclass(frozen=True)
class StepRow:
    """One run's line of the step table, every figure rounded as printed."""

    policy: str
    run_id: str | None
    p50_s: float            # step time p50, 3 decimals
    speedup: float          # none's p50 / this p50, 2 decimals
    lo: float               # 90 % interval of the speed-up (paired steps), 2 decimals
    hi: float
    expert_ms: float        # busiest-rank expert compute per layer call, whole ms
    none_expert_ms: float
    overhead_ms: float      # exposed overhead per layer call (plan + weight sync + grad reduction), 0.1 ms
    warmup_s: float         # the run's warm-up steps, summed (one-time cost), 0.1 s
    timed_s: float          # the run's timed steps, summed, 0.1 s
    recording_errors: int


def verdict(row: StepRow) -> str:
    """One sentence from the row's printed numbers (see the module docstring)."""
    what = (f"{row.policy} ran at {row.speedup:.2f}x of none (step time p50 {row.p50_s:.3f} s; 90 % interval "
            f"{row.lo:.2f}x-{row.hi:.2f}x over the paired steps)")
    cost = (f"busiest-rank expert compute {row.none_expert_ms:.0f} -> {row.expert_ms:.0f} ms per layer call, "
            f"exposed overhead {row.overhead_ms:.1f} ms per layer call")
    saved = row.none_expert_ms - row.expert_ms
    if row.lo > 1.0:
        why = (f"; {cost}." if saved > 0 else
               f"; {cost}: the expert compute did not shrink, so the table does not show where the time was saved.")
        return f"balancing paid: {what}{why}"
    if row.hi < 1.0:
        why = (f"; {cost}: the overhead outweighed the {saved:.0f} ms saved." if saved > 0 else
               f"; {cost}: it saved no expert compute.")
        return f"balancing did not pay: {what}{why}"
    return f"no measurable difference: {what}; {cost}. More steps (--steps) narrow the interval."


def _per_call(out: list, warm: int) -> dict:
    """``{(step, layer): [timings of each rank]}`` after the warm-up steps."""
    calls: dict = {}
    for o in out:
        for step, layer, t in o["calls"]:
            if step >= warm:
                calls.setdefault((step, layer), []).append(t)
    return calls


def _expert_s(ts: list, train: bool) -> float:
    """The busiest rank's expert compute of one layer call (forward, and backward when training)."""
    return max(t.get("experts_s", 0.0) + (t.get("backward_compute_s", 0.0) if train else 0.0) for t in ts)


def _overhead_ms(calls: dict) -> list[float]:
    """Exposed overhead per layer call, per phase of :data:`_PHASES` (slowest rank, mean over calls)."""
    if not calls:
        return [0.0 for _ in _PHASES]
    return [1e3 * float(np.mean([max(sum(t.get(k, 0.0) for k in keys) for t in ts) for ts in calls.values()]))
            for _, keys in _PHASES]


def step_times(out: list) -> np.ndarray:
    """``[steps]`` the slowest rank's time of every step (the store's definition: max over ranks)."""
    return np.max(np.array([o["times"] for o in out]), axis=0)


def step_rows(results: dict, warm: int, train: bool) -> list[StepRow]:
    """One :class:`StepRow` per run, none first."""
    base_t = step_times(results[BASELINE][1])[warm:]
    none_calls = _per_call(results[BASELINE][1], warm)
    none_expert = 1e3 * float(np.mean([_expert_s(ts, train) for ts in none_calls.values()])) if none_calls else 0.0
    rows = []
    for policy, (name, out) in results.items():
        t_all = step_times(out)
        t = t_all[warm:]
        calls = _per_call(out, warm)
        p50 = round(float(np.median(t)), 3)
        lo, hi = ratio_interval(base_t, t) if policy != BASELINE else (1.0, 1.0)
        exp = 1e3 * float(np.mean([_expert_s(ts, train) for ts in calls.values()])) if calls else 0.0
        rows.append(StepRow(policy, name, p50, round(float(np.median(base_t)) / float(np.median(t)), 2),
                            round(lo, 2), round(hi, 2), round(exp), round(none_expert),
                            round(sum(_overhead_ms(calls)), 1), round(float(t_all[:warm].sum()), 1),
                            round(float(t.sum()), 1), sum(o["recording_errors"] for o in out)))
    return rows


def _layer_table(settings, results: dict, warm: int, train: bool):
    from rich.table import Table

    table = Table(title=f"per MoE layer (rank 0's plans; steps {warm}..{settings.steps - 1})")
    for c in ["run", "layer", "imbalance before -> after", "decisions", "replicas", "expert compute ms "
              "(busiest rank)", "exposed overhead ms: plan / weight sync / grad reduction", "predicted / measured "
              "layer ms (median |error|)"]:
        table.add_column(c, justify="right")
    for policy, (name, out) in results.items():
        hist = [h for h in out[0]["history"] if h[0] >= warm]
        calls = _per_call(out, warm)
        for layer in sorted({h[1] for h in hist}):
            rows = [h for h in hist if h[1] == layer]
            shares: dict[str, int] = {}
            for h in rows:
                shares[h[2]] = shares.get(h[2], 0) + 1
            dec = ", ".join(f"{k} {100 * v / len(rows):.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
            lc = {k: ts for k, ts in calls.items() if k[1] == layer}
            exp_ms = 1e3 * np.mean([_expert_s(ts, train) for ts in lc.values()])
            pred = np.array([ts[0].get("predicted_s", np.nan) for ts in lc.values()])
            meas = np.array([max(t.get("measured_s", 0.0) for t in ts) for ts in lc.values()])  # forward + backward
            err = np.nanmedian(np.abs(pred - meas) / meas) if len(meas) else np.nan
            table.add_row(policy if layer == 0 else "", str(layer),
                          f"{np.mean([h[3] for h in rows]):.2f} -> {np.mean([h[4] for h in rows]):.2f}", dec,
                          f"{np.mean([h[5] for h in rows]):.1f}", f"{exp_ms:.0f}",
                          " / ".join(f"{v:.1f}" for v in _overhead_ms(lc)),
                          f"{1e3 * np.nanmedian(pred):.0f} / {1e3 * np.median(meas):.0f} ({100 * err:.0f} %)")
        table.add_section()
    return table


def step_table(rows: list[StepRow], timing: DemoTiming, steps: int):
    from rich.table import Table

    t = Table(title=f"did balancing pay? measured step time (slowest rank; steps {timing.warmup}..{steps - 1}, "
                    f"every run interleaved step by step in one launch)")
    for c in ["run", "step time p50 (s)", "speed-up vs none [90 % interval]", "warm-up steps (s)",
              "timed steps (s)", "recording errors"]:
        t.add_column(c, justify="right")
    for r in rows:
        spd = "baseline" if r.policy == BASELINE else f"{r.speedup:.2f}x [{r.lo:.2f}-{r.hi:.2f}]"
        t.add_row(r.policy, f"{r.p50_s:.3f}", spd, f"{r.warmup_s:.1f}", f"{r.timed_s:.1f}",
                  str(r.recording_errors))
    return t


def summary(con, settings, results: dict, timing: DemoTiming) -> str:
    """Print the step table (the answer) and the layer table; return the verdict lines."""
    train = settings.mode == "train"
    rows = step_rows(results, timing.warmup, train)
    con.print(step_table(rows, timing, settings.steps))
    ids = [r.run_id for r in rows if r.run_id]
    if ids:
        stem = ids[0].rsplit("-", 1)[0]
        con.print(f"recorded as {stem}-<run> in {settings.out}/ ({', '.join(i.rsplit('-', 1)[1] for i in ids)})",
                  soft_wrap=True)
    con.print(f"one-time costs, charged to no run: {timing.setup_s:.1f} s building every run's model and compiling "
              f"the planners before the first step, of {timing.wall_s:.1f} s for the whole launch (process start, "
              f"imports and every run's steps included); each run's first {timing.warmup} steps (first plans, "
              "allocations) are its warm-up column.", soft_wrap=True)
    con.print(_layer_table(settings, results, timing.warmup, train))
    return "\n".join(verdict(r) for r in rows if r.policy != BASELINE)
