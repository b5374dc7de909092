"""The critical path of a balanced layer call on one rank (issue 55), next to UltraEP's budget.

UltraEP's authors report at most 300 µs of exposed overhead per layer at EP64, with the quota solve under 100 µs
on the GPU (``../shared/references/papers.md`` §1.3-1.4). This benchmark times the same path of one rank, from the
gate's output to the first expert GEMM, with the functions the runtime calls (``runtime/layer.py``,
``runtime/token_path.py``), stage by stage:

    count        the rank's per-expert counts of its top-k ids (``expert_counts``; on the device)
    (load all-gather: excluded — the load [R, E] it returns is generated on the device, as if gathered)
    d2h          the load to the host (the call's one host synchronisation: the planner runs there)
    decide       the engine's decide + commit (the runtime's plan step: the quota planner, then the cost model's
                 prediction of the plan); the planner alone is timed apart (``planner``: ``plan_layer``)
    h2d          the rank's reroute table, built on the host and copied without blocking
    reroute      logical ids -> physical instances (kernel)
    layout       the dispatch layout: send rows by destination (kernel)
    permute      token rows -> the send buffer (kernel)
    (dispatch all-to-all: not on one GPU)
    slot_order   the received rows ordered by slot (host argsort, non-blocking copy, one gather)
    replica      this rank's replica weights unpacked from their received tiles (the local part of the replica
                 wait; the transfer itself needs peers)

Two timings of the path: ``stages`` synchronises the device after each stage (each stage's own latency, launch
included) and ``path`` only at the end (the path as it runs: later launches overlap earlier kernels). ``chain`` is
d2h -> decide -> h2d alone (issue 55's item 4: the cost of planning on the host, to set against a GPU planner).
Shapes, each rank with T = 8192 tokens and 2 redundant slots, loads drawn on the device (Zipf popularity, exponent
1, over an expert order that changes with each of the 8 loads cycled through):

    EP8/E64     8 ranks, 64 experts, top-6, hidden 2048, expert hidden 1408 (DeepSeek-V2-Lite's experts)
    EP64/E256   64 ranks, 256 experts, top-8, hidden 7168, expert hidden 2048 (DeepSeek-V3's experts)

Then the balanced layer at world size 1 against the plain experts container it replaces (Qwen3-30B-A3B-like: 128
experts, top-8, hidden 2048, expert hidden 768, 8192 tokens): forward without grad and a training step (forward +
backward), alternating calls; at world size 1 there is nothing to balance, so the ratio is the runtime's overhead
(goal: at most 3 % slower).

    .venv/bin/python benchmarks/bench_critical_path.py            # on a GPU (about a minute; a CPU runs it too)
    .venv/bin/python benchmarks/bench_critical_path.py --smoke    # tiny shapes, a few calls: checks it runs

Rows go to ``benchmarks/results/bench_critical_path.csv`` (``benchmarks/common.py``): what = ``critical_path``
(provider = the shape, metric = the stage, ``<stage>_p99`` for the 99th percentile), ``planner``, and
``ws1_overhead`` (provider ``plain`` / ``balanced``, metric ``forward`` / ``train_step``, and their ``ratio``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # the planner runs on one core, as the runtime's host thread does

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.common import machine, row, write_rows  # noqa: E402

#: UltraEP's published budget (papers.md §1.3-1.4): exposed overhead per layer at EP64, and its GPU quota solve
ULTRAEP_LAYER_S = 300e-6
ULTRAEP_PLANNER_S = 100e-6
#: the world-size-1 goal: the balanced layer at most this much slower than the plain container
WS1_GOAL = 1.03

SHAPES = {
    "EP8/E64": dict(R=8, E=64, K=6, T=8192, H=2048, I=1408, N=2),
    "EP64/E256": dict(R=64, E=256, K=8, T=8192, H=7168, I=2048, N=2),
}
SMOKE_SHAPES = {
    "EP8/E64": dict(R=8, E=64, K=6, T=64, H=32, I=16, N=2),
    "EP64/E256": dict(R=64, E=256, K=8, T=64, H=32, I=16, N=2),
}
WS1 = dict(E=128, K=8, T=8192, H=2048, I=768)
SMOKE_WS1 = dict(E=8, K=2, T=32, H=32, I=16)
STAGES = ("count", "d2h", "decide", "h2d", "reroute", "layout", "permute", "slot_order", "replica")
LOADS = 8  # distinct loads cycled through (the planner sees a new one every call)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_loads(shape: dict, device: torch.device, count: int, seed: int = 0):
    """``count`` loads drawn on ``device``: (rank 0's ids ``[T, K]``, the load ``[R, E]`` int64) each."""
    R, E, K, T = (shape[k] for k in ("R", "E", "K", "T"))
    g = torch.Generator(device=device).manual_seed(seed)
    zipf = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)
    out = []
    for _ in range(count):
        w = zipf[torch.randperm(E, generator=g, device=device)]
        ids = torch.multinomial(w, R * T * K, replacement=True, generator=g).view(R, T * K)
        load = torch.zeros(R, E, dtype=torch.int64, device=device).scatter_add_(1, ids, torch.ones_like(ids))
        out.append((ids[0].view(T, K).contiguous(), load))
    return out


class RankPath:
    """One rank's path of one shape (rank 0 of R), built once; :meth:`run` runs it for one load."""

    def __init__(self, shape: dict, device: torch.device) -> None:
        from ultraep.config import BalancerConfig
        from ultraep.engine import Engine
        from ultraep.kernels import ExpertLayout
        from ultraep.planning import plan_layer

        self.s, self.device = shape, device
        R, E, N, T, H, I = (shape[k] for k in ("R", "E", "N", "T", "H", "I"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.loads = device_loads(shape, device, LOADS)
        first = self.loads[0][1].cpu().numpy()
        self.topology = plan_layer(first, "quota", num_redundant_slots=N).topology
        self.engine = Engine(BalancerConfig(policy="quota", num_redundant_slots=N), self.topology)
        self.x = torch.randn(T, H, device=device).to(dtype)
        # the rows rank 0 receives: about its share T * K once balanced (grown if a plan sends more)
        self.recv = torch.randn(T * shape["K"] * 2, H, device=device).to(dtype)
        like = [torch.empty(2 * I, H, dtype=dtype), torch.empty(H, I, dtype=dtype)]
        self.layout = ExpertLayout.of(like)
        self.arena = self.layout.empty(N, device).random_(0, 255)
        self.slots = [[torch.empty(t.shape, dtype=dtype, device=device) for t in like] for _ in range(N)]
        self.calls = 0

    def run(self, i: int, mark) -> None:
        """The path for load ``i``; ``mark(stage)`` after each stage (it times, and synchronises or not)."""
        from ultraep.kernels import dispatch_layout, permute, reroute, reroute_table, unpack_tiles, upload
        from ultraep.runtime.load_header import expert_counts

        ids, load_dev = self.loads[i % LOADS]
        R, S, E = self.topology.num_ranks, self.topology.num_slots, self.s["E"]
        expert_counts(ids, E)
        mark("count")
        load = load_dev.cpu().numpy()  # (the all-gather's output reaches the host)
        mark("d2h")
        self.calls += 1
        decision = self.engine.decide(self.calls, 0, 0, load)
        self.engine.commit(decision)
        plan = decision.plan
        mark("decide")
        table = reroute_table(plan, 0, device=self.device)
        mark("h2d")
        phys = reroute(ids, table)
        mark("reroute")
        lay = dispatch_layout(phys, R, S, num_rows=int(plan.routes_RRS[0].sum()))
        mark("layout")
        permute(self.x, lay)
        mark("permute")
        C = plan.routes_RRS[:, 0, :]
        slot_of_row = np.repeat(np.tile(np.arange(S), C.shape[0]), C.ravel())
        order_np = np.argsort(slot_of_row, kind="stable")
        inv_np = np.empty_like(order_np)
        inv_np[order_np] = np.arange(order_np.size)
        order, _inv = upload([order_np, inv_np], self.device)
        if order.numel() > self.recv.shape[0]:  # (a plan that sends this rank more rows than any before)
            self.recv = self.recv.new_empty((order.numel(), self.recv.shape[1]))
        self.recv[: order.numel()].index_select(0, order)
        mark("slot_order")
        mine = int((plan.replicas.rank == 0).sum()) if plan.num_replicas else 0
        if mine:
            unpack_tiles(self.arena, self.slots[:mine], self.layout)
        mark("replica")


def time_path(path: RankPath, iters: int, warmup: int, synced: bool) -> dict[str, np.ndarray]:
    """Seconds per stage (``synced``: the device drained after each stage) and of the whole path."""
    dev = path.device
    out = {s: np.zeros(iters) for s in STAGES}
    out["path"] = np.zeros(iters)
    for it in range(-warmup, iters):
        sync(dev)
        t0 = last = time.perf_counter()

        def mark(stage, it=it):
            nonlocal last
            if synced:
                sync(dev)
            now = time.perf_counter()
            if it >= 0:
                out[stage][it] = now - last
            last = now

        path.run(it, mark)
        sync(dev)
        if it >= 0:
            out["path"][it] = time.perf_counter() - t0
    return out


def time_chain(path: RankPath, iters: int, warmup: int) -> np.ndarray:
    """d2h -> decide -> h2d: the load from the device, the plan on the host, its table back on the device."""
    from ultraep.kernels import reroute_table

    dev, out = path.device, np.zeros(iters)
    for it in range(-warmup, iters):
        _ids, load_dev = path.loads[it % LOADS]
        sync(dev)
        t0 = time.perf_counter()
        load = load_dev.cpu().numpy()
        path.calls += 1
        d = path.engine.decide(path.calls, 0, 0, load)
        path.engine.commit(d)
        reroute_table(d.plan, 0, device=dev)
        sync(dev)
        if it >= 0:
            out[it] = time.perf_counter() - t0
    return out


def time_planner(path: RankPath, iters: int, warmup: int) -> tuple[np.ndarray, float, float]:
    """``plan_layer`` alone on host loads (the planner's share); and the mean imbalance before and after."""
    from ultraep.planning import plan_layer

    loads = [ld.cpu().numpy() for _, ld in path.loads]
    out, before, after = np.zeros(iters), [], []
    for it in range(-warmup, iters):
        t0 = time.perf_counter()
        plan = plan_layer(loads[it % LOADS], "quota", num_redundant_slots=path.s["N"])
        if it >= 0:
            out[it] = time.perf_counter() - t0
            before.append(plan.imbalance_before)
            after.append(plan.imbalance_after)
    return out, float(np.mean(before)), float(np.mean(after))


# ------------------------------------------------------------------------------------------- world size 1
def ws1_pair(shape: dict, device: torch.device):
    """(plain experts container, the same wrapped by ultraep at world size 1, x, ids, weights)."""
    import ultraep
    from ultraep.models import build_model

    E, K, T, H, I = (shape[k] for k in ("E", "K", "T", "H", "I"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = build_model("qwen3-moe", num_experts=E, top_k=K, hidden=H, expert_hidden=I, layers=1, dtype=dtype)
    experts = model.model.layers[0].mlp.experts
    for p in experts.parameters():
        p.data.normal_(0, 0.02)
    plain = copy.deepcopy(experts)
    holder = torch.nn.Module()
    holder.experts = experts
    ultraep.wrap(holder, {"policy": "quota", "num_redundant_slots": 0})
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    logits = torch.randn(T, E, device=device, generator=g)
    w, idx = torch.softmax(logits, -1).topk(K, dim=-1)
    return plain, holder.experts, x, idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def time_ws1(shape: dict, device: torch.device, iters: int, warmup: int) -> dict[tuple[str, str], np.ndarray]:
    """Alternating calls of the plain container and the balanced layer: forward (no grad) and a training step."""
    plain, balanced, x, idx, w = ws1_pair(shape, device)
    out = {}
    for mode in ("forward", "train_step"):
        ts = {"plain": np.zeros(iters), "balanced": np.zeros(iters)}
        for it in range(-warmup, iters):
            for name, mod in (("plain", plain), ("balanced", balanced)) if it % 2 else (("balanced", balanced),
                                                                                         ("plain", plain)):
                xi = x.detach().requires_grad_(mode == "train_step")
                sync(device)
                t0 = time.perf_counter()
                if mode == "forward":
                    with torch.no_grad():
                        mod(xi, idx, w)
                else:
                    mod(xi, idx, w).float().pow(2).mean().backward()
                sync(device)
                if it >= 0:
                    ts[name][it] = time.perf_counter() - t0
            for p in list(plain.parameters()) + list(balanced.parameters()):
                p.grad = None
        out.update({(name, mode): v for name, v in ts.items()})
    return out


def with_group(device: torch.device, fn, *args):
    """Run ``fn`` inside a world-size-1 process group of this process (NCCL on a GPU, gloo on CPU)."""
    import torch.distributed as dist

    from ultraep.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- main
def us(v) -> str:
    return f"{v * 1e6:.0f}"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and a few calls (the times mean nothing)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 200; smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 20; smoke 1)")
    ap.add_argument("--no-ws1", action="store_true", help="skip the world-size-1 comparison")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    iters = args.iters or (3 if args.smoke else 200)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 20)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [n for n in names if n not in shapes]
    if bad:
        print(f"bench_critical_path: --shapes: unknown shape(s) {', '.join(bad)}; choose from {', '.join(shapes)}",
              file=sys.stderr)
        raise SystemExit(2)
    where = machine() + (f"-{torch.cuda.get_device_name(device)}".replace(" ", "_") if gpu else "")
    console = Console(width=140)
    if not gpu and not args.smoke:
        console.print("[bold]bench_critical_path: no CUDA GPU here[/bold]: timing the CPU path (the kernels run their "
                      "torch references; no device to synchronise).")
    rows: list[dict] = []
    written = 0

    def flush() -> None:
        """Write the rows made since the last flush: a later part that fails keeps the earlier parts' rows."""
        nonlocal written
        for r in rows[written:]:
            r["machine"] = where
        if rows[written:]:
            out = write_rows("bench_critical_path", rows[written:])
            print(f"rows appended to {out}")
        written = len(rows)

    def add(what, provider, metric, unit, x, values, p99=True):
        rows.append(row(what, provider, metric, unit, x, values))
        if p99:
            rows.append(row(what, provider, f"{metric}_p99", unit, x, [np.percentile(values, 99)]))

    for name in names:
        shape = shapes[name]
        x = f"{name}/T{shape['T']}/H{shape['H']}"
        path = RankPath(shape, device)
        staged = time_path(path, iters, warmup, synced=True)
        free = time_path(path, iters, warmup, synced=False)
        chain = time_chain(path, iters, warmup)
        planner, before, after = time_planner(path, iters, warmup)
        table = Table(title=f"critical path of one rank, {name} (T={shape['T']}, H={shape['H']}, top-{shape['K']}), "
                            f"imbalance {before:.2f} -> {after:.2f}, on {where}")
        for col in ("stage", "p50 µs", "p99 µs", "share of path p50", "UltraEP budget"):
            table.add_column(col, justify="right")
        total50 = float(np.percentile(free["path"], 50))
        for stage in STAGES:
            v = staged[stage]
            add("critical_path", name, stage, "s", x, v)
            table.add_row(stage, us(np.percentile(v, 50)), us(np.percentile(v, 99)),
                          f"{100 * np.percentile(v, 50) / total50:.0f} %" if total50 else "-", "")
        add("critical_path", name, "stages_sum", "s", x, sum(staged[s] for s in STAGES))
        add("critical_path", name, "path", "s", x, free["path"])
        add("critical_path", name, "chain", "s", x, chain)
        add("planner", name, "plan_layer", "s", x, planner)
        rows.append(row("planner", name, "imbalance_before", "ratio", x, [before]))
        rows.append(row("planner", name, "imbalance_after", "ratio", x, [after]))
        table.add_row("of decide: planner", us(np.percentile(planner, 50)), us(np.percentile(planner, 99)),
                      f"{100 * np.percentile(planner, 50) / total50:.0f} %" if total50 else "-",
                      f"< {us(ULTRAEP_PLANNER_S)} (GPU)")
        table.add_row("chain d2h+decide+h2d", us(np.percentile(chain, 50)), us(np.percentile(chain, 99)),
                      f"{100 * np.percentile(chain, 50) / total50:.0f} %" if total50 else "-", "")
        table.add_row("[bold]path[/bold] (one sync)", us(total50), us(np.percentile(free["path"], 99)), "100 %",
                      f"<= {us(ULTRAEP_LAYER_S)} per layer")
        console.print(table)
        del path
        flush()
    if not args.no_ws1:
        shape = SMOKE_WS1 if args.smoke else WS1
        x = f"E{shape['E']}/K{shape['K']}/T{shape['T']}/H{shape['H']}/I{shape['I']}"
        ts = with_group(device, time_ws1, shape, device, iters if args.smoke else max(iters // 4, 20), warmup)
        table = Table(title=f"balanced layer at world size 1 against the plain experts container ({x}), on {where}")
        for col in ("call", "plain p50 ms", "balanced p50 ms", "ratio", "goal"):
            table.add_column(col, justify="right")
        for mode in ("forward", "train_step"):
            a, b = ts[("plain", mode)], ts[("balanced", mode)]
            add("ws1_overhead", "plain", mode, "s", x, a, p99=False)
            add("ws1_overhead", "balanced", mode, "s", x, b, p99=False)
            ratio = np.percentile(b, 50) / np.percentile(a, 50)
            rows.append(row("ws1_overhead", "balanced", f"{mode}_ratio", "x", x, [ratio]))
            table.add_row(mode, f"{np.percentile(a, 50) * 1e3:.2f}", f"{np.percentile(b, 50) * 1e3:.2f}",
                          f"{ratio:.3f}", f"<= {WS1_GOAL:.2f}")
        console.print(table)
        flush()
    return rows


if __name__ == "__main__":
    main()
