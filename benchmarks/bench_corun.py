"""Do ranks on one host slow each other's expert compute? (issue 35: the co-run slowdown)

The cost model's ``corun_slowdown`` k says that a rank computing beside ``m`` others runs ``1 + k m`` times slower
than alone. The engine fits k from its calls, which can tell it only where ranks compute for different lengths;
a run of balanced plans cannot (docs/simulator.md, section 9). This measures it directly: every rank runs the
same expert forward and backward once alone, while the others wait in a gloo barrier (which does not spin: it takes
no CPU), and once beside them, in alternating order from trial to trial. The work is the runtime's expert phase on the
``bench_runtime.py`` shape's experts (its transformers container and the adapter ``wrap`` uses): the rank's masters
as leaf tensors unbound into per-expert views, ``rows`` rows sorted by expert, each expert's rows through the
adapter, and the rows put back in order (``ultraep.runtime.token_path.run_slots``). Per trial k = (together / alone - 1) / (ranks - 1); the table gives its
median and 20-80 % range per rank, phase and rows. A second table gives what the alone times say of the
per-instance cost (``half_tokens``: the line through them at the row counts measured, its intercept over the
masters, in rows of its slope), which a run of balanced calls cannot tell from the per-row cost either.

It times the experts' compute, not the whole layer call; the runtime's backward also reduces replica gradients and
waits on the exchanges, and the validation's pooled calls imply more in the backward (0.04-0.13 on the 2-core VM of
2026-11-26) than this measured there (0.00-0.06, moving from minute to minute; docs/simulator.md).

    .venv/bin/python -m benchmarks.bench_corun                                  # tok512's experts, 256-2048 rows
    .venv/bin/python -m benchmarks.bench_corun --shape default --rows 4096 --trials 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import benchmarks.common  # noqa: E402
from benchmarks.common import row, write_rows  # noqa: E402
from benchmarks.host_memory import reexec_with_settings  # noqa: E402

WHAT = "corun_slowdown"


def slowdown(alone_s, together_s, ranks: int) -> np.ndarray:
    """Per trial ``k = (together / alone - 1) / (ranks - 1)``: the cost model's co-run slowdown (a rank beside
    ``ranks - 1`` others runs ``1 + k (ranks - 1)`` times slower). ``alone_s``, ``together_s``: ``[trials]`` seconds."""
    a, t = np.asarray(alone_s, dtype=np.float64), np.asarray(together_s, dtype=np.float64)
    return (t / a - 1.0) / max(1, ranks - 1)


def per_instance_rows(rows, alone_s, instances: int) -> float:
    """The per-instance cost in rows (the cost model's ``half_tokens``): a line ``c0 + c1 rows`` through the alone
    medians ``alone_s`` at ``rows`` (least squares, 2 or more row counts), ``c0 / (instances c1)``; nan with fewer
    than 2 row counts or a slope that is not positive."""
    x, y = np.asarray(rows, dtype=np.float64), np.asarray(alone_s, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return float("nan")
    c1, c0 = np.polyfit(x, y, 1)
    return float(c0 / (instances * c1)) if c1 > 0 else float("nan")


def _masters(shape, world: int, rank: int):
    """This rank's masters as the runtime holds them: the shape's transformers experts container, its adapter (the
    one-expert function ``wrap`` uses), and the rank's M = experts / ranks slices of each expert parameter as leaf
    tensors (the runtime's master tensors), and the hidden size."""
    from benchmarks.bench_runtime import seeded_experts
    from ultraep.models.adapters import adapter_for

    container = seeded_experts(shape)  # (unseeded, its uninitialised weights were NaN at times: the probe refused)
    adapter = adapter_for(container)
    m = max(1, shape.experts // world)
    lo = (rank * m) % shape.experts
    masters = [getattr(container, n).detach()[lo:lo + m].clone().requires_grad_() for n in adapter.param_names]
    return container, adapter, masters, shape.hidden


def _work(container, adapter, masters: list[torch.Tensor], hidden: int, rows: int) -> tuple[float, float]:
    """One forward and backward of the masters on ``rows`` rows spread evenly over them, as
    :func:`ultraep.runtime.token_path.run_slots` runs them: sorted by expert, each expert's rows through the adapter
    on its views of the master tensors, put back in order. Seconds of each."""
    m = int(masters[0].shape[0])
    x = torch.randn(rows, hidden, requires_grad=True)
    expert_of_row = torch.arange(rows) % m
    t0 = time.perf_counter()
    order = torch.argsort(expert_of_row, stable=True)
    xs = x.index_select(0, order)
    counts = torch.bincount(expert_of_row, minlength=m).tolist()
    unbound = [t.unbind(0) for t in masters]
    outs, at = [], 0
    for e, c in enumerate(counts):
        outs.append(adapter.forward(container, xs[at:at + c], [u[e] for u in unbound]))
        at += c
    inv = torch.empty_like(order)
    inv[order] = torch.arange(rows)
    y = torch.cat(outs).index_select(0, inv)
    t1 = time.perf_counter()
    y.backward(torch.ones_like(y))
    t2 = time.perf_counter()
    for t in masters:
        t.grad = None
    return t1 - t0, t2 - t1


def _measure(rank: int, world: int, shape_name: str, rows_list: list[int], trials: int) -> dict:
    """On every rank: ``{rows: {"fwd_alone": [trials], "fwd_together": ..., "bwd_alone": ..., "bwd_together": ...}}``
    (seconds); alone first in even trials, beside the others first in odd ones, so neither order carries over."""
    import torch.distributed as dist

    from benchmarks.bench_runtime import SHAPES

    torch.manual_seed(rank)
    experts = _masters(SHAPES[shape_name], world, rank)
    out = {}
    for rows in rows_list:
        got = {k: [] for k in ("fwd_alone", "bwd_alone", "fwd_together", "bwd_together")}

        def timed(kind: str) -> None:
            f, b = _work(*experts, rows)
            got[f"fwd_{kind}"].append(f)
            got[f"bwd_{kind}"].append(b)

        def alone() -> None:  # each rank alone in turn; the others wait in the barrier
            for r in range(world):
                dist.barrier()
                if r == rank:
                    timed("alone")
                dist.barrier()

        def beside() -> None:
            dist.barrier()
            timed("together")
            dist.barrier()

        for _ in range(2):  # warm-up: the allocator and the kernels' first calls
            _work(*experts, rows)
        for trial in range(trials):
            for part in ((alone, beside) if trial % 2 == 0 else (beside, alone)):
                part()
        out[rows] = got
    return out


def main(argv: list[str] | None = None) -> None:
    reexec_with_settings()  # the host memory settings of the runs of record (benchmarks/host_memory.py)
    from benchmarks.bench_runtime import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tok512", choices=sorted(SHAPES),
                    help="the bench_runtime.py shape whose expert sizes are timed")
    ap.add_argument("--rows", default="256,1024,2048", help="comma list: rows per rank")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        rows_list = [int(x) for x in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: a comma list of positive integers, got {args.rows!r}")
    if not rows_list or min(rows_list) <= 0 or args.trials <= 0 or args.ranks < 2:
        ap.error(f"--rows, --trials must be positive and --ranks at least 2, got {args.rows!r}, {args.trials}, "
                 f"{args.ranks}")
    from rich.console import Console
    from rich.table import Table

    from ultraep.launch import launch
    from ultraep.models import preload

    preload()
    benchmarks.common.THREADS = 1
    res = launch(_measure, args.ranks, args.shape, rows_list, args.trials, backend="gloo", threads_per_rank=1)
    table = Table(title=f"co-run slowdown k of {args.shape}'s experts, {args.ranks} ranks x 1 thread, "
                        f"{args.trials} trials, load avg {os.getloadavg()[0]:.2f} at the end")
    for c in ("rows", "rank", "phase", "alone ms (p50)", "beside ms (p50)", "k p50", "k 20-80 %"):
        table.add_column(c, justify="right")
    out_rows = []
    for rows in rows_list:
        for rank, got in enumerate(res):
            for phase in ("fwd", "bwd"):
                alone, together = got[rows][f"{phase}_alone"], got[rows][f"{phase}_together"]
                k = slowdown(alone, together, args.ranks)
                lo, mid, hi = np.percentile(k, [20, 50, 80])
                table.add_row(str(rows), str(rank), phase, f"{1e3 * np.median(alone):.1f}",
                              f"{1e3 * np.median(together):.1f}", f"{mid:+.3f}", f"{lo:+.3f}..{hi:+.3f}")
                x = f"{args.ranks}x1/{args.shape}/{rows}"
                out_rows.append(row(WHAT, f"rank{rank}", f"k_{phase}", "ratio", x, k))
                out_rows.append(row(WHAT, f"rank{rank}", f"{phase}_alone", "s", x, alone))
                out_rows.append(row(WHAT, f"rank{rank}", f"{phase}_together", "s", x, together))
    console = Console(width=160)
    console.print(table)
    m = max(1, SHAPES[args.shape].experts // args.ranks)
    fixed = Table(title=f"per-instance cost in rows (half_tokens): alone time = c0 + c1 rows, c0 / ({m} masters x c1)")
    for c in ("rank", "fwd", "bwd"):
        fixed.add_column(c, justify="right")
    for rank, got in enumerate(res):
        h = {ph: per_instance_rows(rows_list, [np.median(got[r][f"{ph}_alone"]) for r in rows_list], m)
             for ph in ("fwd", "bwd")}
        fixed.add_row(str(rank), f"{h['fwd']:.1f}", f"{h['bwd']:.1f}")
        for ph, v in h.items():
            out_rows.append(row(WHAT, f"rank{rank}", f"half_rows_{ph}", "rows", f"{args.ranks}x1/{args.shape}", [v]))
    console.print(fixed)
    path = write_rows("bench_corun", out_rows)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
