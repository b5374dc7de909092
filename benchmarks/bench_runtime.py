"""Runtime benchmark: one balanced MoE layer, forward + backward, on 2 local gloo ranks (one thread each).

The layer is a transformers v5 experts container (``Qwen3MoeExperts``, or ``MixtralExperts``) big enough that
expert compute dominates; shape ``torchtitan`` is torchtitan's ``RoutedExperts`` (``GroupedExperts``: bf16 grouped
mm, the local dispatcher) at the default shape, balanced through ``ultraep.models.torchtitan``. Routing is skewed so that the rank-level imbalance without balancing is about 1.6
(hot experts on rank 0); the same tokens are then run

  * ``none``            no balancing,
  * ``quota``           exact-load real-time balancing (planning, weight streaming, replica gradient
                        reduction all included in the time),
  * ``feplb``           FEPLB's two-phase intra-domain moves (the fixed policy the adaptive engine picks at
                        some shapes, so that its row is compared with it),
  * ``adaptive``        the adaptive engine choosing per call,
  * ``force-balanced``  the router forced uniform (the ideal: every rank gets the mean load, no overhead).

Layer time = max over ranks of (forward + backward) wall time per iteration (the all-to-alls make every
rank wait for the slowest). All runs of a shape share one pair of processes and are interleaved, iteration
by iteration, so launch-to-launch noise does not enter the ratios; the orders form a Williams design (every
run follows every other equally often, :func:`benchmarks.common.carryover_orders`), and ``--iters`` is
rounded up to a multiple of their number. Goals (issue "Balancing must pay"): quota >= 1.20x over none and >= 90 % of
force-balanced at the default shape. A second table gives quota's per-phase time on each rank, exposed
(on the rank's critical path) and hidden (weight transfer in flight behind compute).

    .venv/bin/python benchmarks/bench_runtime.py                 # the whole shape matrix
    .venv/bin/python benchmarks/bench_runtime.py --warmup 20 --iters 30   # the runs of record (about 20 min):
                    # with fewer timed calls the 90 % interval of adaptive / best fixed is wider than 3 %
    .venv/bin/python benchmarks/bench_runtime.py --shapes default,mixtral --iters 3
    .venv/bin/python benchmarks/bench_runtime.py --shapes default,tok64 --policies quota,feplb,adaptive \
        --warmup 20 --iters 30 --repeats 5     # issue 56's first calls: 5 fresh runs per shape, a row per run
    .venv/bin/python benchmarks/bench_runtime.py --shapes custom --tokens 2048 --hidden 1024 --ffn 1024
    .venv/bin/python benchmarks/bench_runtime.py --mode serve        # forward only (benchmarks/bench_serving.py)
    .venv/bin/python benchmarks/bench_runtime.py --backend nccl      # 2 GPUs, NCCL (make gpu-check runs it)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import benchmarks.common  # noqa: E402
from benchmarks.common import carryover_orders, ratio_interval, row, write_rows  # noqa: E402
from benchmarks.host_memory import reexec_with_settings  # noqa: E402
from ultraep.launch import launch  # noqa: E402

benchmarks.common.THREADS = 1  # the rows' threads: each rank runs one thread


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int = 2048
    hidden: int = 1024
    ffn: int = 1024
    experts: int = 8
    top_k: int = 2
    family: str = "qwen3-moe"
    slots: int | None = None  # redundant slots per rank (default: --slots)

    def label(self) -> str:
        n = f" N={self.slots}" if self.slots else ""
        return f"{self.family} T={self.tokens} H={self.hidden} I={self.ffn} E={self.experts} k={self.top_k}{n}"


SHAPES = {
    "default": Shape("default"),
    "tok64": Shape("tok64", tokens=64),
    "tok512": Shape("tok512", tokens=512),
    "tok1024": Shape("tok1024", tokens=1024),
    "tok4096": Shape("tok4096", tokens=4096),
    "h512": Shape("h512", hidden=512),
    "mixtral": Shape("mixtral", family="mixtral"),
    "torchtitan": Shape("torchtitan", family="torchtitan"),
    # 16 experts = 8 masters per rank: 4 redundant slots keep the default's share (2 per 4 masters)
    "e16": Shape("e16", experts=16, slots=4),
}
POLICIES = [("none", "none", True), ("quota", "quota", True), ("feplb", "feplb", True), ("adaptive", "adaptive", True),
            ("force-balanced", "none", False)]
PHASES = [  # (timings key, label, exposed?)
    ("plan_s", "plan", True), ("weight_post_s", "weight post", True), ("relay_s", "relay", True),
    ("weight_wait_s", "weight wait+unpack", True), ("weight_sync_hidden_s", "weight in flight (hidden)", False),
    ("dispatch_s", "dispatch a2a", True), ("master_compute_s", "master compute", True),
    ("replica_compute_s", "replica compute", True), ("combine_s", "combine a2a", True),
    ("combine_bwd_s", "combine a2a bwd", True), ("backward_compute_s", "expert backward", True),
    ("grad_post_s", "grad pack+post", True), ("grad_wait_s", "grad wait", True),
    ("grad_reduce_s", "grad reduce", True), ("dispatch_bwd_s", "dispatch a2a bwd", True),
]


def _routing(rank: int, T: int, K: int, E: int, skew: bool, seed: int) -> torch.Tensor:
    """Top-k ids ``[T, K]``: skewed (rank 0's masters 4x as popular) or uniform (force-balanced)."""
    g = torch.Generator().manual_seed(seed + rank)
    p = torch.full((E,), 1.0)
    if skew:
        p[: E // 2] = 4.0  # rank 0's masters get 4x the popularity -> rank loads 1.6 : 0.4 of the mean
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)


def _experts(shape: Shape):
    if shape.family == "torchtitan":  # RoutedExperts: the module ultraep.wrap prepares (the experts live inside)
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        return RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=shape.hidden, hidden_dim=shape.ffn, num_experts=shape.experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=shape.experts, top_k=shape.top_k)).build()
    import transformers as tf

    if shape.family == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_local_experts=shape.experts,
                               num_experts_per_tok=shape.top_k)
        return tf.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    cfg = tf.Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.ffn, num_experts=shape.experts,
                            num_experts_per_tok=shape.top_k)
    return tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)


def seeded_experts(shape, device: torch.device | None = None):
    """``shape``'s experts container on ``device`` (default CPU) with seeded weights, N(0, 0.02), the same in every
    process: its constructor leaves them uninitialised (``torch.empty``: whatever the memory held, NaN at times, which
    the adapter's probe then refuses)."""
    torch.manual_seed(0)
    experts = _experts(shape).to(device or "cpu")
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    return experts


def wrapped_layer(shape, config: dict, device: torch.device | None = None, recorder=None):
    """``shape``'s experts container (seeded weights, the same for every run) wrapped with ``config`` (recording into
    ``recorder`` when given): ``(balanced layer, its runtime)``, on ``device`` (default CPU)."""
    import ultraep

    experts = seeded_experts(shape, device)
    if shape.family == "torchtitan":  # the balanced layer takes RoutedExperts' inner_experts
        ultraep.wrap(experts, config, recorder=recorder)
        return experts.inner_experts, ultraep.runtime_of(experts)
    holder = torch.nn.Module()
    holder.experts = experts
    ultraep.wrap(holder, config, recorder=recorder)
    return holder.experts, ultraep.runtime_of(holder)


def _setup(rank, shape: Shape, args, policy, skew, recorder=None):
    """One wrapped layer (the same expert weights for every policy) and this rank's batch."""
    dev = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    config = dict(policy) if isinstance(policy, dict) else {"policy": policy}  # a name, or a whole config
    layer, rt = wrapped_layer(shape, {**config, "num_redundant_slots": shape.slots or args.slots}, dev, recorder)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(dev).requires_grad_(True)
    idx = _routing(rank, shape.tokens, shape.top_k, shape.experts, skew, args.seed).to(dev)
    w = torch.softmax(torch.randn(shape.tokens, shape.top_k, generator=g), -1).to(dev)
    # an optimizer step after every iteration (untimed): training changes the masters every step, so every
    # replica is streamed again, as in a real run (without it the replica cache would reuse them)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-6)
    return layer, rt, (x, idx, w), opt


def _body(rank, world, shape: Shape, args, policies, runs_dir=None):
    """Every run of ``policies`` in one pair of processes, interleaved: iteration i runs each policy once, in
    the i-th carry-over balanced order, so process-level noise (memory layout, frequency) hits all of them
    alike, no run always inherits the same predecessor's state, and the ratios come from one run. With
    ``runs_dir``, run ``name`` is recorded there as ``<shape>-<name>`` (benchmarks/bench_validate.py)."""
    recs = {}
    if runs_dir is not None:
        from ultraep.telemetry import Recorder

        recs = {name: Recorder.open(runs_dir, f"{shape.name}-{name}", world_size=world, rank=rank, flush_interval_s=None,
                                    config={"policy": policy}) for name, policy, _ in policies}
    runs = [(name, *_setup(rank, shape, args, policy, skew, recs.get(name))) for name, policy, skew in policies]
    out = {name: {"times": [], "phases": [], "chosen": [], "first": [], "calls": []} for name, *_ in runs}
    orders = carryover_orders(len(runs))
    # on GPUs the work is asynchronous: the wall time of a call ends when the device finished it
    sync = torch.cuda.synchronize if args.backend == "nccl" else (lambda: None)
    for it in range(args.warmup + args.iters):
        for k in orders[it % len(orders)]:
            name, layer, rt, (x, idx, w), opt = runs[k]
            sync()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            layer(x, idx, w).pow(2).mean().backward()
            sync()
            t = time.perf_counter() - t0
            opt.step()
            layer.zero_grad(set_to_none=True)
            x.grad = None
            rt.next_step()  # records the call (with its backward phases) into layer.last_timings
            if it < FIRST_CALLS:  # a fresh wrap's first calls, warm-up included: what a user's first try sees
                out[name]["first"].append(t)
            choice = getattr(layer.last_plan, "choice", None)  # every call, warm-up included (--calls-out)
            out[name]["calls"].append((t, layer.last_plan.chosen_policy, choice.reason if choice is not None else ""))
            if it >= args.warmup:
                o = out[name]
                o["times"].append(t)
                o["phases"].append(dict(layer.last_timings))
                o["chosen"].append(rt.recording.history[-1][2])
    for name, layer, *_ in runs:
        plan = layer.last_plan
        out[name].update(imb_before=plan.imbalance_before, imb_after=plan.imbalance_after,
                         replicas=plan.num_replicas)
    for rec in recs.values():
        rec.close()
    return out


#: layer calls of one shape's ranks (warm-up and timed, every run) the launcher's default limit of 600 s is kept for:
#: bench_validate's runs with 20 + 20 calls of 5 runs took up to ~500 s at the costliest shape, tok4096 (2 cores)
LAUNCH_CALLS = 200


def launch_timeout(args, runs: int) -> float:
    """Seconds one shape's ranks may take: 600 up to :data:`LAUNCH_CALLS` calls, more in proportion beyond. Why: with
    60 timed calls tok4096's ranks ran past the fixed 600 s and the validation lost the shape (2026-11-27)."""
    return 600.0 * max(1.0, (args.warmup + args.iters) * runs / LAUNCH_CALLS)


#: the first calls of a fresh wrap (warm-up included) whose adaptive / best fixed is reported beside the steady state
FIRST_CALLS = 20


def _run_shape(shape: Shape, args, policies, runs_dir=None) -> dict:
    out = launch(_body, 2, shape, args, policies, runs_dir, backend=args.backend, threads_per_rank=1,
                 timeout_s=launch_timeout(args, len(policies)))
    res = {}
    for name, _, _ in policies:
        per_rank = [o[name] for o in out]
        per_iter = np.max(np.array([o["times"] for o in per_rank]), axis=0)  # the slowest rank sets the pace
        res[name] = (per_iter, per_rank)
        per_rank[0]["first_calls"] = np.max(np.array([o["first"] for o in per_rank]), axis=0)
    return res


def _report_shape(shape: Shape, res: dict, x: str, main_t, phase_t, rows: list) -> tuple | None:
    """One run of ``shape`` (``res``: :func:`_run_shape`'s) into the tables and ``rows`` (x column ``x``). Returns
    adaptive's figures for the per-run table (first calls, steady state and vs none with their intervals, what it
    chose), or None without an adaptive run."""
    fig = None
    t_none = float(np.median(res["none"][0]))
    t_ideal = float(np.median(res["force-balanced"][0])) if "force-balanced" in res else float("nan")
    fixed = {n: float(np.median(t)) for n, (t, _) in res.items() if n not in ("adaptive", "force-balanced")}
    best = min(fixed, key=fixed.get)
    for name, (t, out) in res.items():
        p50 = float(np.median(t))
        info = out[0]
        chose = vs_best = ""
        if name == "adaptive":
            ch = [c for o in out for c in o["chosen"]]
            chose = ", ".join(f"{c} {ch.count(c)}" for c in sorted(set(ch)))
            lo, hi = ratio_interval(t, res[best][0])
            vs_best = f"{p50 / fixed[best]:.3f} [{lo:.3f}, {hi:.3f}] ({best})"
            rows.append(row("runtime_layer_fwd_bwd", name, "vs_best_fixed", "ratio", x, p50 / fixed[best]))
            rows.append(row("runtime_layer_fwd_bwd", name, "vs_best_fixed_lo90", "ratio", x, lo))
            rows.append(row("runtime_layer_fwd_bwd", name, "vs_best_fixed_hi90", "ratio", x, hi))
            first = {n: float(np.sum(o[0]["first_calls"])) for n, (_, o) in res.items() if n in fixed or n == name}
            best_first = min((n for n in first if n != name), key=first.get)
            n_first = len(out[0]["first_calls"])
            vs_best += f"; first {n_first} calls {first[name] / first[best_first]:.3f} ({best_first})"
            rows.append(row("runtime_layer_fwd_bwd", name, f"vs_best_fixed_first{n_first}", "ratio", x,
                            first[name] / first[best_first]))
            # (none's time over adaptive's, rounds resampled together: what noise leaves of a ratio a few % from 1)
            nlo, nhi = ratio_interval(res["none"][0], t)
            rows.append(row("runtime_layer_fwd_bwd", name, "speedup_vs_none_lo90", "ratio", x, nlo))
            rows.append(row("runtime_layer_fwd_bwd", name, "speedup_vs_none_hi90", "ratio", x, nhi))
            fig = (f"{first[name] / first[best_first]:.3f} ({best_first}, {n_first} calls)",
                   f"{p50 / fixed[best]:.3f} [{lo:.3f}, {hi:.3f}] ({best})",
                   f"{t_none / p50:.3f}x [{nlo:.3f}, {nhi:.3f}]", chose)
        main_t.add_row(shape.label() if name == "none" else "", name, f"{info['imb_before']:.3f}",
                       f"{info['imb_after']:.3f}", str(info["replicas"]), f"{p50:.3f}",
                       f"{t.min():.3f}..{t.max():.3f}", f"{t_none / p50:.2f}x", f"{100 * t_ideal / p50:.1f} %", chose,
                       vs_best)
        rows.append(row("runtime_layer_fwd_bwd", name, "layer_time", "s", x, t))
        rows.append(row("runtime_layer_fwd_bwd", name, "speedup_vs_none", "ratio", x, t_none / p50))
        rows.append(row("runtime_layer_fwd_bwd", name, "pct_of_force_balanced", "%", x, 100 * t_ideal / p50))
    if "quota" in res:
        cells = []
        for key, _, _ in PHASES:
            per_rank = [float(np.median([ph.get(key, 0.0) for ph in o["phases"]])) for o in res["quota"][1]]
            cells.append(" / ".join(f"{v:.3f}" for v in per_rank))
            for r, v in enumerate(per_rank):
                rows.append(row("runtime_phase", f"quota/rank{r}", key, "s", x, v))
        phase_t.add_row(x.split("/", 1)[1], *cells)
    main_t.add_section()
    return fig


def main() -> None:
    reexec_with_settings()  # the host memory settings of the runs of record (benchmarks/host_memory.py)
    if "--mode" in sys.argv:  # serving / gradient accumulation: the replica cache's benchmark
        i = sys.argv.index("--mode")
        if sys.argv[i + 1:i + 2] != ["train"]:
            from benchmarks import bench_serving

            return bench_serving.main()
        del sys.argv[i:i + 2]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}, custom")
    ap.add_argument("--policies", default=",".join(p for p, _, _ in POLICIES))
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank (custom shape)")
    ap.add_argument("--hidden", type=int, default=1024, help="(custom shape)")
    ap.add_argument("--ffn", type=int, default=1024, help="expert intermediate size (custom shape)")
    ap.add_argument("--experts", type=int, default=8, help="(custom shape)")
    ap.add_argument("--top-k", type=int, default=2, help="(custom shape)")
    ap.add_argument("--family", default="qwen3-moe", choices=["qwen3-moe", "mixtral", "torchtitan"], help="(custom shape)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each shape, each a fresh pair of processes (fresh wraps: their own first calls); "
                    "rows per run (x <shape>/run<k>) and a table of adaptive's first-calls and steady figures per run")
    ap.add_argument("--calls-out", default=None, metavar="CSV",
                    help="also write every call of every run (warm-up included: time, policy run, adaptive's reason)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                    help="gloo: CPU ranks (the runs of record); nccl: one GPU per rank (needs 2 GPUs)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        ap.error(f"--backend nccl: needs 2 CUDA GPUs, this machine has "
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    from rich.console import Console
    from rich.table import Table

    from ultraep.models import preload

    preload()
    shapes = []
    for s in args.shapes.split(","):
        if s == "custom":
            shapes.append(Shape("custom", args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.family))
        elif s in SHAPES:
            shapes.append(SHAPES[s])
        else:
            sys.exit(f"--shapes: unknown shape {s!r}; choose from {', '.join(SHAPES)}, custom")
    wanted = args.policies.split(",")
    policies = [p for p in POLICIES if p[0] in wanted or p[0] == "none"]
    n_orders = len(carryover_orders(len(policies)))
    args.iters = -(-args.iters // n_orders) * n_orders  # timed calls in whole rounds of the orders: none favoured
    console = Console(width=220)
    main_t = Table(title=f"one MoE layer fwd+bwd, 2 ranks x 1 thread, load avg {os.getloadavg()[0]:.2f} at start")
    for c in ["shape", "run", "imb. before", "imb. after", "replicas", "p50 (s)", "min..max (s)", "vs none",
              "% of force-balanced", "adaptive chose", "adaptive / best fixed [90 % interval]; first calls"]:
        main_t.add_column(c, justify="right")
    phase_t = Table(title="quota: per-phase seconds per iteration (rank 0 / rank 1, median); exposed unless marked")
    phase_t.add_column("shape")
    for _, label, _ in PHASES:
        phase_t.add_column(label, justify="right")
    runs_t = Table(title=f"adaptive per run: its first {FIRST_CALLS} calls (a fresh wrap's, warm-up included) and the "
                   "timed calls after the warm-up, against the best fixed policy of each")
    for c in ["shape", "run", f"first {FIRST_CALLS}: adaptive / best fixed", "steady: adaptive / best fixed [90 %]",
              "steady: vs none [90 %]", "adaptive chose"]:
        runs_t.add_column(c, justify="right")
    rows, calls = [], []
    for shape in shapes:
        for k in range(args.repeats):
            x = f"2x1/{shape.name}" + (f"/run{k + 1}" if args.repeats > 1 else "")
            res = _run_shape(shape, args, policies)
            calls += [(x, name, i, *c) for name, (_, out) in res.items() for i, c in enumerate(out[0]["calls"])]
            fig = _report_shape(shape, res, x, main_t, phase_t, rows)
            if fig is not None:
                runs_t.add_row(shape.name if k == 0 else "", str(k + 1), *fig)
        runs_t.add_section()
    console.print(main_t)
    console.print(phase_t)
    if args.repeats > 1 and "adaptive" in {p for p, _, _ in policies}:
        console.print(runs_t)
    print(f"rows appended to {write_rows('bench_runtime', rows)}")
    if args.calls_out:
        write_calls(calls, args.calls_out)


def write_calls(calls: list, path: str) -> None:
    """Every call of every run (warm-up included) as CSV rows ``x, policy, call, t_s, chosen, reason``: rank 0's wall
    time of the call, the policy that ran and, for ``adaptive``, its decision's reason (a fixed policy's is empty)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["x", "policy", "call", "t_s", "chosen", "reason"])
        w.writerows((x, name, i, f"{t:.6g}", chosen, reason) for x, name, i, t, chosen, reason in calls)


if __name__ == "__main__":
    main()
