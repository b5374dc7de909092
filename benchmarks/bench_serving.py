"""Serving and gradient-accumulation benchmark of one balanced MoE layer: the replica cache at work.

``--mode serve`` (prefill serving): forward only under ``torch.no_grad()``, a new batch every call whose
routing is drawn from the same skewed distribution (hot experts stay hot across batches), 2 local gloo
ranks x 1 thread. Runs per shape:

  * ``none``              no balancing,
  * ``quota (no cache)``  exact-load balancing that streams every replica every call (``replica_cache=False``),
  * ``quota``             with the replica cache (resident replicas reused; the planner prefers them),
  * ``adaptive``          the adaptive engine, with the cache,
  * ``force-balanced``    uniform routing (the ideal).

All runs of a shape share one pair of processes, interleaved call by call in carry-over balanced orders
(``--iters`` is rounded up to whole rounds of them). Time per forward = max over ranks; weight bytes per forward = bytes every rank sent, summed (median of the
timed calls, i.e. steady state after the warm-up). Goals (issue "Prefill serving pays too"): at 3072+ tokens
per rank quota >= 1.25x over none and >= 90 % of force-balanced, weight bytes <= 10 % of quota (no cache).

``--mode accumulate`` (training, 4 microbatches per optimizer step): forward + backward of every microbatch,
then an SGD step; weight and gradient bytes per step and step time, with and without the cache, and with the
first 3 microbatches under ``runtime.no_sync()`` (replica gradients reduced once per step). Gradient bytes are
the bytes the ranks measured sending. Goal: bytes per step >= 3x fewer than quota (no cache).

    .venv/bin/python benchmarks/bench_serving.py --mode serve
    .venv/bin/python benchmarks/bench_serving.py --mode serve --shapes qwen3-t3072 --iters 3
    .venv/bin/python benchmarks/bench_serving.py --mode accumulate
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_runtime import wrapped_layer  # noqa: E402 - the same containers and weights
import benchmarks.common  # noqa: E402
from benchmarks.common import carryover_orders, row, write_rows  # noqa: E402
from benchmarks.host_memory import reexec_with_settings  # noqa: E402
from ultraep.launch import launch  # noqa: E402

benchmarks.common.THREADS = 1  # the rows' threads: each rank runs one thread


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    family: str = "qwen3-moe"
    hidden: int = 768
    ffn: int = 1536
    experts: int = 16
    top_k: int = 2
    slots: int = 4  # rank 0 holds 8 hot experts: 4 replicas can carry the 0.6 x mean its ideal share leaves

    def label(self) -> str:
        return f"{self.family} T={self.tokens} H={self.hidden} I={self.ffn} E={self.experts} k={self.top_k} N={self.slots}"


SERVE_SHAPES = {f"qwen3-t{t}": Shape(f"qwen3-t{t}", t) for t in (512, 1024, 3072, 4096, 8192)}
SERVE_SHAPES.update({f"mixtral-t{t}": Shape(f"mixtral-t{t}", t, family="mixtral") for t in (512, 1024, 3072, 4096, 8192)})
DEFAULT_SERVE = ",".join(SERVE_SHAPES)
ACCUM_SHAPES = {"qwen3-t1024": Shape("qwen3-t1024", 1024, hidden=512, ffn=1024, experts=8),
                "mixtral-t1024": Shape("mixtral-t1024", 1024, family="mixtral", hidden=512, ffn=1024, experts=8)}
#: (run, policy, replica cache, skewed routing)
RUNS = [("none", "none", True, True), ("quota (no cache)", "quota", False, True), ("quota", "quota", True, True),
        ("adaptive", "adaptive", True, True), ("force-balanced", "none", True, False)]
#: (run, policy, replica cache, skewed routing, microbatches but the last under no_sync)
ACCUM_RUNS = [("none", "none", True, True, False), ("quota (no cache)", "quota", False, True, False),
              ("quota", "quota", True, True, False), ("quota + no_sync", "quota", True, True, True)]


def _batch(rank: int, shape: Shape, skew: bool, batch: int):
    """One batch: hidden ``[T, H]``, top-k ids ``[T, K]`` (rank 0's masters 4x as popular when skewed; a new
    draw every batch from the same distribution), weights ``[T, K]``."""
    g = torch.Generator().manual_seed(1_000_003 * batch + 7 * rank + 1)
    T, E, K = shape.tokens, shape.experts, shape.top_k
    p = torch.full((E,), 1.0)
    if skew:
        p[: E // 2] = 4.0
    idx = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    x = torch.randn(T, shape.hidden, generator=g)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, idx, w


def _wrapped(shape: Shape, policy: str, cache: bool):
    return wrapped_layer(shape, {"policy": policy, "num_redundant_slots": shape.slots, "replica_cache": cache})


class _Serve:
    """One serving run in a rank's process: its wrapped layer; :meth:`call` times one forward of batch ``it``."""

    def __init__(self, rank, shape: Shape, args, policy, cache, skew) -> None:
        self.rank, self.shape, self.skew = rank, shape, skew
        self.layer, self.rt = _wrapped(shape, policy, cache)
        self.out = {"times": [], "sent": [], "hits": [], "chosen": []}

    def call(self, it: int, timed: bool) -> None:
        x, idx, w = _batch(self.rank, self.shape, self.skew, it)
        with torch.no_grad():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            self.layer(x, idx, w)
            t = time.perf_counter() - t0
        self.rt.next_step()
        if timed:
            lt, o = self.layer.last_timings, self.out
            o["times"].append(t)
            o["sent"].append(lt.get("transfer_bytes", 0.0))
            o["hits"].append((lt.get("cache_hits", 0.0), lt.get("cache_misses", 0.0)))
            o["chosen"].append(self.rt.recording.history[-1][2])

    def result(self) -> dict:
        plan = self.layer.last_plan
        return {**self.out, "imb_before": plan.imbalance_before, "imb_after": plan.imbalance_after,
                "replicas": plan.num_replicas}


class _Accumulate:
    """One training run with ``args.microbatches`` microbatches per optimizer step; :meth:`call` times step ``it``."""

    def __init__(self, rank, shape: Shape, args, policy, cache, skew, no_sync) -> None:
        self.rank, self.shape, self.skew, self.no_sync, self.mbs = rank, shape, skew, no_sync, args.microbatches
        self.layer, self.rt = _wrapped(shape, policy, cache)
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=1e-3)
        self.out = {"times": [], "wbytes": [], "gbytes": []}

    def call(self, step: int, timed: bool) -> None:
        import contextlib

        layer, rt = self.layer, self.rt
        torch.distributed.barrier()
        t0 = time.perf_counter()
        w_b = g_b = 0.0
        for mb in range(self.mbs):
            x, idx, w = _batch(self.rank, self.shape, self.skew, step * self.mbs + mb)
            with rt.no_sync() if self.no_sync and mb < self.mbs - 1 else contextlib.nullcontext():
                layer(x.requires_grad_(True), idx, w).pow(2).mean().backward()
            rt.flush_records()
            lt = layer.last_timings
            w_b += lt.get("transfer_bytes", 0.0)
            g_b += lt.get("grad_bytes", 0.0)  # replica gradients this rank sent (fp32; 0 when deferred)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t = time.perf_counter() - t0
        rt.next_step()
        if timed:
            self.out["times"].append(t)
            self.out["wbytes"].append(w_b)
            self.out["gbytes"].append(g_b)

    def result(self) -> dict:
        return self.out


def _body(rank, world, shape: Shape, args, kind, runs):
    """Every run of ``runs`` in one pair of processes, interleaved call by call in carry-over balanced orders
    (:func:`benchmarks.common.carryover_orders`, as ``bench_runtime``): launch-to-launch noise (memory layout;
    the ideal's median moved 6 % between separate launches) stays out of the ratios."""
    made = [kind(rank, shape, args, *opts) for _, *opts in runs]
    orders = carryover_orders(len(made))
    for it in range(args.warmup + args.iters):
        for k in orders[it % len(orders)]:
            made[k].call(it, it >= args.warmup)
    return {name: m.result() for (name, *_), m in zip(runs, made)}


def _launch(kind, shape, args, runs):
    out = launch(_body, 2, shape, args, kind, runs, backend="gloo", threads_per_rank=1)
    res = {}
    for name, *_ in runs:
        per_rank = [o[name] for o in out]
        res[name] = (np.max(np.array([o["times"] for o in per_rank]), axis=0), per_rank)  # the slowest rank sets the pace
    return res


def serve(args, console) -> list[dict]:
    from rich.table import Table

    tab = Table(title=f"serving: one MoE layer forward under no_grad, 2 ranks x 1 thread, load avg "
                      f"{os.getloadavg()[0]:.2f} at start")
    for c in ["shape", "run", "imb. before", "imb. after", "replicas", "p50 (s)", "min..max (s)", "vs none",
              "% of force-balanced", "weight bytes/fwd", "vs no cache", "hits/misses", "adaptive chose"]:
        tab.add_column(c, justify="right")
    rows = []
    for name in args.shapes.split(","):
        if name not in SERVE_SHAPES:
            sys.exit(f"--shapes: unknown serve shape {name!r}; choose from {', '.join(SERVE_SHAPES)}")
        shape = SERVE_SHAPES[name]
        res = _launch(_Serve, shape, args, [r for r in RUNS if r[0] in args.runs or r[0] == "none"])
        t_none = float(np.median(res["none"][0]))
        t_ideal = float(np.median(res["force-balanced"][0])) if "force-balanced" in res else float("nan")
        b_base = (float(np.median(np.sum([o["sent"] for o in res["quota (no cache)"][1]], axis=0)))
                  if "quota (no cache)" in res else float("nan"))
        x = f"2x1/serve/{shape.name}"
        for run, (t, out) in res.items():
            p50 = float(np.median(t))
            b = float(np.median(np.sum([o["sent"] for o in out], axis=0)))
            h = sum(hh for o in out for hh, _ in o["hits"])
            m = sum(mm for o in out for _, mm in o["hits"])
            chose = ""
            if run == "adaptive":
                ch = [c for o in out for c in o["chosen"]]
                chose = ", ".join(f"{c} {ch.count(c)}" for c in sorted(set(ch)))
            tab.add_row(shape.label() if run == "none" else "", run, f"{out[0]['imb_before']:.3f}",
                        f"{out[0]['imb_after']:.3f}", str(out[0]["replicas"]), f"{p50:.3f}",
                        f"{t.min():.3f}..{t.max():.3f}", f"{t_none / p50:.2f}x", f"{100 * t_ideal / p50:.1f} %",
                        f"{b / 2**20:.1f} MiB", f"{100 * b / b_base:.0f} %" if b_base > 0 else "",
                        f"{h:.0f}/{m:.0f}", chose)
            rows.append(row("runtime_serve_fwd", run, "layer_time", "s", x, t))
            rows.append(row("runtime_serve_fwd", run, "speedup_vs_none", "ratio", x, t_none / p50))
            rows.append(row("runtime_serve_fwd", run, "pct_of_force_balanced", "%", x, 100 * t_ideal / p50))
            rows.append(row("runtime_serve_fwd", run, "weight_bytes_per_fwd", "B", x, b))
        tab.add_section()
    console.print(tab)
    return rows


def accumulate(args, console) -> list[dict]:
    from rich.table import Table

    tab = Table(title=f"training, {args.microbatches} microbatches per optimizer step: one MoE layer, 2 ranks x 1 "
                      f"thread, load avg {os.getloadavg()[0]:.2f} at start")
    for c in ["shape", "run", "step p50 (s)", "vs none", "weight bytes/step", "grad bytes/step", "weight bytes vs "
              "no cache", "all bytes vs no cache"]:
        tab.add_column(c, justify="right")
    rows = []
    runs = ACCUM_RUNS
    for name in args.shapes.split(","):
        if name not in ACCUM_SHAPES:
            sys.exit(f"--shapes: unknown accumulate shape {name!r}; choose from {', '.join(ACCUM_SHAPES)}")
        shape = ACCUM_SHAPES[name]
        res = _launch(_Accumulate, shape, args, runs)
        t_none = float(np.median(res["none"][0]))

        def per_step(out, key):
            return float(np.median(np.sum([o[key] for o in out], axis=0)))

        base_w = per_step(res["quota (no cache)"][1], "wbytes")
        base_all = base_w + per_step(res["quota (no cache)"][1], "gbytes")
        x = f"2x1/accumulate{args.microbatches}/{shape.name}"
        for run, (t, out) in res.items():
            p50 = float(np.median(t))
            wb, gb = per_step(out, "wbytes"), per_step(out, "gbytes")
            tab.add_row(shape.label() if run == "none" else "", run, f"{p50:.3f}", f"{t_none / p50:.2f}x",
                        f"{wb / 2**20:.1f} MiB", f"{gb / 2**20:.1f} MiB",
                        f"{base_w / wb:.1f}x less" if wb > 0 and run != "quota (no cache)" else "",
                        f"{base_all / (wb + gb):.1f}x less" if wb + gb > 0 and run != "quota (no cache)" else "")
            rows.append(row("runtime_accumulate_step", run, "step_time", "s", x, t))
            rows.append(row("runtime_accumulate_step", run, "weight_bytes_per_step", "B", x, wb))
            rows.append(row("runtime_accumulate_step", run, "grad_bytes_per_step", "B", x, gb))
        tab.add_section()
    console.print(tab)
    return rows


def main() -> None:
    reexec_with_settings()  # the host memory settings of the runs of record (benchmarks/host_memory.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["serve", "accumulate"], default="serve")
    ap.add_argument("--shapes", default=None, help=f"serve: {', '.join(SERVE_SHAPES)}; accumulate: "
                                                   f"{', '.join(ACCUM_SHAPES)}")
    ap.add_argument("--runs", default=",".join(r for r, *_ in RUNS), help="serve: which runs (none always)")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    args.runs = args.runs.split(",")
    n = len([r for r in RUNS if r[0] in args.runs or r[0] == "none"]) if args.mode == "serve" else len(ACCUM_RUNS)
    k = len(carryover_orders(n))
    args.iters = -(-args.iters // k) * k  # timed calls in whole rounds of the orders
    from rich.console import Console

    from ultraep.models import preload

    preload()
    console = Console(width=240)
    if args.mode == "serve":
        args.shapes = args.shapes or DEFAULT_SERVE
        rows = serve(args, console)
    else:
        args.shapes = args.shapes or ",".join(ACCUM_SHAPES)
        rows = accumulate(args, console)
    print(f"rows appended to {write_rows('bench_serving', rows)}")


if __name__ == "__main__":
    main()
