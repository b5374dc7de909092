"""Does the simulator predict what the runtime measures? (issue 35, item 2)

For every shape of ``bench_runtime.py`` the runs of ``none``, ``quota``, ``feplb`` and ``adaptive`` are measured as
there (2 gloo ranks, one thread each, interleaved), this time recorded. The run of ``--calibrate-on`` (default
``quota``: it exercises every cost term, weight sync and gradient reduction included) gives the cost model its
engine learned; the simulator replays that run's routing (the same in every run of a shape) through every policy
on that model (``ultraep simulate RUN --topology from-run``). Per shape and policy the table puts the measured
layer time (median over the timed calls of the slowest rank's forward + backward) next to the prediction, and the
measured speed-up over none next to the predicted one. ``--demo`` adds ``ultraep demo`` (none and adaptive on a real
model; calibrated on its adaptive run; layer time = the recorded timings' slowest rank, warm-up excluded).

Goals (issue 35): predicted layer time within 10 % of measured, predicted speed-up over none within 5 %, at every
shape and in the demo, three runs on a quiet machine.

    .venv/bin/python -m benchmarks.bench_validate --warmup 20 --iters 30 --demo     # the runs of record (quiet machine)
    .venv/bin/python -m benchmarks.bench_validate --shapes default --warmup 2 --iters 4   # a quick check
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.bench_runtime import POLICIES, SHAPES, _run_shape  # noqa: E402
from benchmarks.common import carryover_orders, row, write_rows  # noqa: E402

WHAT = "validate_sim_vs_runtime"
MEASURED_POLICIES = [p for p in POLICIES if p[0] != "force-balanced"]


def predict(run_dir: Path, policies) -> dict[str, float]:
    """Predicted seconds per layer call of ``policies`` on the recorded run ``run_dir``'s routing and cost model (what
    ``ultraep simulate RUN --topology from-run`` prints), warm-up step left out as in the measurement."""
    from ultraep.sim import simulate
    from ultraep.sim.from_run import recorded_cost_model
    from ultraep.traces import load_trace

    trace = load_trace(run_dir, "recorded-run")
    cm = recorded_cost_model(run_dir, trace.meta.extra["run_id"])
    res = simulate(trace, cm, policies, max_plans=None)
    out = {}
    for p in policies:
        r = res.rows[p]
        keep = r["step"] > 0  # step 0 is the runtime's warm-up step
        out[p] = float(r["time_s"][keep].mean())
    return out


def measured_layer_time(con, run_id: str) -> float:
    """Mean over the recorded layer calls (warm-up steps left out) of the slowest rank's measured layer time."""
    v = con.execute(
        "WITH c AS (SELECT step, microbatch, layer, max(measured_s) AS m FROM timings WHERE run_id = ? AND "
        "measured_s IS NOT NULL AND step NOT IN (SELECT step FROM warmup_steps WHERE run_id = ?) GROUP BY ALL) "
        "SELECT avg(m) FROM c", [run_id, run_id]).fetchone()[0]
    return float("nan") if v is None else float(v)


def _shape_rows(shape, args, runs_dir: Path) -> list[tuple]:
    """``(source, policy, measured s, predicted s, measured speed-up, predicted speed-up)`` for one shape."""
    res = _run_shape(shape, args, MEASURED_POLICIES, str(runs_dir))
    measured = {name: float(np.median(t)) for name, (t, _) in res.items()}
    names = [n for n, _, _ in MEASURED_POLICIES]
    predicted = predict(runs_dir / f"{shape.name}-{args.calibrate_on}", names)
    return [(shape.name, n, measured[n], predicted[n], measured["none"] / measured[n], predicted["none"] / predicted[n])
            for n in names]


def _demo_rows(args, runs_dir: Path) -> list[tuple]:
    from ultraep.telemetry import open_run

    cmd = [sys.executable, "-m", "ultraep.cli", "demo", "--out", str(runs_dir)] + (["--quick"] if args.quick_demo else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"ultraep demo failed ({done.returncode}): {done.stderr[-2000:]}")
    con = open_run(runs_dir)
    ids = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM runs ORDER BY 1").fetchall()]
    by = {i.rsplit("-", 1)[-1]: i for i in ids}
    balanced = next(p for p in by if p != "none")
    measured = {p: measured_layer_time(con, by[p]) for p in ("none", balanced)}
    predicted = predict(runs_dir / by[balanced], ["none", balanced])
    return [("demo", p, measured[p], predicted[p], measured["none"] / measured[p], predicted["none"] / predicted[p])
            for p in ("none", balanced)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)} ('' for none)")
    ap.add_argument("--demo", action="store_true", help="also validate `ultraep demo` (its none and adaptive runs)")
    ap.add_argument("--quick-demo", action="store_true", help="the demo with --quick (a check, not a measurement)")
    ap.add_argument("--calibrate-on", default="quota", choices=[n for n, _, _ in MEASURED_POLICIES],
                    help="the recorded run whose learned cost model predicts every policy (default quota)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=None, help="keep the recorded runs in this directory")
    args = ap.parse_args()
    args.backend = "gloo"  # bench_runtime's runner reads it; the validation is of the gloo runs of record
    from rich.console import Console
    from rich.table import Table

    from ultraep.models import preload

    preload()
    unknown = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    n_orders = len(carryover_orders(len(MEASURED_POLICIES)))
    args.iters = -(-args.iters // n_orders) * n_orders  # whole rounds of the interleaving orders, as bench_runtime
    base = args.keep or Path(tempfile.mkdtemp(prefix="ultraep-validate-"))
    table = Table(title=f"simulator (from-run: shapes calibrated on their {args.calibrate_on} run, the demo on its "
                  f"balanced run) vs runtime: one MoE layer fwd+bwd, 2 ranks x 1 thread, load avg "
                  f"{os.getloadavg()[0]:.2f} at start")
    for c in ("source", "policy", "measured ms", "predicted ms", "error", "measured speed-up", "predicted speed-up",
              "error "):
        table.add_column(c, justify="left" if c in ("source", "policy") else "right")
    out = []
    results = []
    for s in [s for s in args.shapes.split(",") if s]:
        results += _shape_rows(SHAPES[s], args, base / s)
    if args.demo:
        results += _demo_rows(args, base / "demo")
    worst_t = worst_x = 0.0
    for src, pol, m, p, mx, px in results:
        et, ex = p / m - 1.0, px / mx - 1.0
        worst_t, worst_x = max(worst_t, abs(et)), max(worst_x, abs(ex))
        table.add_row(src, pol, f"{1e3 * m:.2f}", f"{1e3 * p:.2f}", f"{100 * et:+.1f} %", f"{mx:.3f}", f"{px:.3f}",
                      f"{100 * ex:+.1f} %")
        x = f"2x1/{src}"
        out += [row(WHAT, pol, "measured_layer_time", "s", x, [m]), row(WHAT, pol, "predicted_layer_time", "s", x, [p]),
                row(WHAT, pol, "measured_speedup_vs_none", "ratio", x, [mx]),
                row(WHAT, pol, "predicted_speedup_vs_none", "ratio", x, [px])]
    console = Console(width=160)
    console.print(table)
    console.print(f"worst |predicted / measured - 1|: layer time {100 * worst_t:.1f} % (goal <= 10 %), speed-up over none "
                  f"{100 * worst_x:.1f} % (goal <= 5 %); recorded runs in {base}")
    print(f"rows appended to {write_rows('bench_validate', out)}")


if __name__ == "__main__":
    main()
