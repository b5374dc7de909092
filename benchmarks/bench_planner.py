"""Planner quality and latency (issue: core planners).

For each configuration: initial and final rank imbalance, replicas (max instances per expert / total
redundant slots used), the busiest sender's transfer bytes, and planner latency p50/p90 on one CPU core
(the whole ``plan_layer`` call: search, quota split into routes, transfer schedule, Plan object), for
``quota`` and for ``eplb`` fed the same exact load (the UltraEP paper's "EPLB+").

Workloads are UltraEP-style synthetic loads (``ultraep.sim.workload.synthetic_load``): power-law expert
popularity, top-k without replacement per token, skew searched to hit the target initial imbalance.

    .venv/bin/python benchmarks/bench_planner.py            # full table (about 2 minutes)
    .venv/bin/python benchmarks/bench_planner.py --quick    # smaller repeat counts
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import benchmarks.common  # noqa: E402
from benchmarks.common import row, time_calls, write_rows  # noqa: E402
from ultraep import plan_layer  # noqa: E402
from ultraep.topology import Topology  # noqa: E402
from ultraep.sim.workload import synthetic_load  # noqa: E402

benchmarks.common.THREADS = 1  # the rows' threads: the planners run on one core (NUMBA_NUM_THREADS=1)

# DeepSeek-V3-like expert: 3 matrices of 7168 x 2048 in bf16.
EXPERT_BYTES = 3 * 7168 * 2048 * 2

CONFIGS = [
    # (name, ranks, experts, slots, top_k, tokens/rank, target imbalance, goal final, published replicas)
    ("EP64/256e/2s", 64, 256, 2, 8, 8192, 1.5, 1.01, 38),
    ("EP64/256e/2s", 64, 256, 2, 8, 8192, 2.0, 1.01, 46),
    ("EP64/256e/2s", 64, 256, 2, 8, 8192, 3.0, 1.01, 51),
    ("EP64/128e/1s", 64, 128, 1, 8, 8192, 6.0, 1.05, None),
    ("EP64/128e/1s", 64, 128, 1, 8, 8192, 8.0, 1.05, None),
    ("EP256/1024e/2s", 256, 1024, 2, 8, 1024, 2.0, None, None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing repeats")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    repeat = 50 if args.quick else 400
    table = Table(title="planner quality and latency (one CPU core)")
    for col in ["config", "policy", "imb before", "imb after", "goal", "replicas max/total",
                "UltraEP replicas", "busiest sender", "p50 µs", "p90 µs"]:
        table.add_column(col, justify="right")
    rows = []
    for name, R, E, N, K, T, target, goal, published in CONFIGS:
        load = synthetic_load(R, E, top_k=K, tokens_per_rank=T, target_imbalance=target, seed=args.seed)
        topo = Topology(num_ranks=R, num_experts=E, num_redundant_slots=N, expert_bytes=EXPERT_BYTES)
        for policy in ("quota", "eplb"):
            plan = plan_layer(load, policy, topology=topo)
            plan.check()
            lat = time_calls(lambda: plan_layer(load, policy, topology=topo), repeat if R <= 64 else repeat // 4)
            x = f"{name}@{target}"
            table.add_row(
                name, policy, f"{plan.imbalance_before:.3f}", f"{plan.imbalance_after:.4f}",
                f"<= {goal}" if goal and policy == "quota" else "",
                f"{int(plan.replica_count_E.max())} / {plan.num_replicas}",
                str(published) if published and policy == "quota" else "",
                f"{plan.busiest_sender_bytes / 1e6:.0f} MB",
                f"{np.percentile(lat, 50) * 1e6:.0f}", f"{np.percentile(lat, 90) * 1e6:.0f}",
            )
            rows += [
                row("planner", policy, "imbalance_before", "ratio", x, plan.imbalance_before),
                row("planner", policy, "imbalance_after", "ratio", x, plan.imbalance_after),
                row("planner", policy, "replicas", "count", x, plan.num_replicas),
                row("planner", policy, "max_instances_per_expert", "count", x, plan.replica_count_E.max()),
                row("planner", policy, "busiest_sender_bytes", "By", x, plan.busiest_sender_bytes),
                row("planner", policy, "latency", "s", x, lat),
            ]
    Console(width=200).print(table)
    path = write_rows("bench_planner", rows)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
