"""Real-time path kernels (issue 5): effective bandwidth of each Triton kernel vs its torch reference and vs
the device's copy bandwidth.

One rank of a DeepSeek-V3-like EP64 layer: 256 experts, 2 redundant slots, top-8, 8192 tokens, hidden 7168,
experts of gate_up [4096, 7168] + down [7168, 2048] in bf16 (88 MB). Effective GB/s counts the bytes a
kernel must read and write (1 GB = 1e9 B); the device copy is ``dst.copy_(src)`` of 1 GiB, counted as read
plus write. Times are CUDA-event p50 (p20, p80) over the repeats.

    .venv/bin/python benchmarks/bench_kernels.py            # on a GPU: Triton vs torch vs copy
    .venv/bin/python benchmarks/bench_kernels.py --quick    # fewer repeats
    .venv/bin/python benchmarks/bench_kernels.py --smoke    # no GPU: Triton path in the interpreter, tiny

Without a GPU it says so, and times the pure-torch references on one CPU thread at a reduced size instead.
Rows are appended to ``benchmarks/results/bench_kernels.csv`` (see ``benchmarks/common.py``). With ``--table`` (on a
GPU; ``make gpu-check`` passes it) each kernel's p50 of both implementations is also appended to the measured times
``backend="auto"`` chooses from (``kernels/kernel_times.csv`` and ``benchmarks/results_committed/kernel_times.csv``,
kept identical; ``ultraep.kernels.choice``), and the script prints what ``auto`` now runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.common import COMMITTED, RUN, machine, row, time_calls, write_rows  # noqa: E402
from ultraep.kernels import choice  # noqa: E402
from ultraep.kernels.choice import append_times  # noqa: E402
from ultraep.kernels import (  # noqa: E402
    ExpertLayout, dispatch_layout, forward_tiles, pack_tiles, permute, reduce_replica_grads, reroute, reroute_table,
    unpack_tiles, unpermute,
)

ROOT = Path(__file__).resolve().parent.parent
#: the kernel times ``auto`` reads (shipped with the package) and their committed twin
TABLES = (choice.TABLE, COMMITTED / "kernel_times.csv")


def git_commit() -> str:
    """The commit of the measured tree (``-dirty`` when it differs)."""
    import subprocess

    return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"


GPU_SIZE = dict(R=64, E=256, N=2, K=8, T=8192, H=7168, I=2048, experts=4, contributions=4)
CPU_SIZE = dict(R=64, E=256, N=2, K=8, T=2048, H=1024, I=512, experts=2, contributions=4)
SMOKE_SIZE = dict(R=8, E=16, N=2, K=2, T=64, H=32, I=16, experts=2, contributions=2)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.0f}MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f}kB"


def timer(device: torch.device):
    """``time(fn, repeat) -> seconds per call [repeat]`` on ``device`` (CUDA events on a GPU)."""

    def cuda_time(fn, repeat: int, warmup: int = 5) -> np.ndarray:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        out = np.empty(repeat)
        for i in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out[i] = a.elapsed_time(b) / 1e3
        return out

    return cuda_time if device.type == "cuda" else time_calls


def workload(size: dict, device: torch.device, seed: int = 0):
    """Top-k ids of one source rank, its plan, and the tensors every kernel needs."""
    from ultraep import plan_layer
    from ultraep.sim.workload import synthetic_load

    R, E, N, K, T, H, I = (size[k] for k in ("R", "E", "N", "K", "T", "H", "I"))
    g = torch.Generator().manual_seed(seed)
    load = synthetic_load(R, E, top_k=K, tokens_per_rank=T, target_imbalance=2.0, seed=seed)
    # Source rank 0 draws its own ids from its row of the load: shuffle the multiset of assignments into
    # [T, K] (duplicates inside a row do not matter to the kernels).
    flat = np.repeat(np.arange(E), load[0])
    flat = flat[torch.randperm(flat.size, generator=g).numpy()][: T * K]
    load[0] = np.bincount(flat, minlength=E)
    ids = torch.as_tensor(flat.reshape(T, K)).to(device)
    plan = plan_layer(load, "quota", num_redundant_slots=N)
    table = reroute_table(plan, 0, device=device)
    return plan, ids, table


def build_cases(size: dict, device: torch.device, providers) -> list:
    """``[(kernel, x label, bytes read + written, {provider: fn})]`` at ``size`` on ``device``; the bytes are the
    size each wrapper passes to ``auto``'s choice (``ultraep.kernels.choice.SIZE_OF``)."""
    R, K, T, H, I, X, C = (size[k] for k in ("R", "K", "T", "H", "I", "experts", "contributions"))
    plan, ids, table = workload(size, device)
    S = plan.topology.num_slots

    cases = []  # (what, x, bytes moved, {provider: fn})
    # 1. reroute: read ids (8 B) + write slots (8 B) per pair.
    cases.append(("reroute", f"T{T}xK{K}", 16 * T * K,
                  {p: (lambda p=p: reroute(ids, table, backend=p)) for p in providers}))
    phys = reroute(ids, table)
    # 2. layout: read slots + write pos + write pair (8 B each).
    rows0 = int(plan.routes_RRS[0].sum())  # as the runtime calls it: the row count from the plan (no host read)
    cases.append(("dispatch_layout", f"T{T}xK{K}", 24 * T * K,
                  {p: (lambda p=p: dispatch_layout(phys, R, S, num_rows=rows0, backend=p)) for p in providers}))
    lay = dispatch_layout(phys, R, S, num_rows=rows0)
    Nr = lay.num_rows
    x = torch.randn((T, H), device=device).bfloat16()
    w = torch.rand((T, K), device=device)
    y = torch.randn((Nr, H), device=device).bfloat16()
    # 3. permute: read a token row + write a send row per pair, bf16.
    cases.append(("permute", f"N{Nr}xH{H}", 2 * 2 * Nr * H,
                  {p: (lambda p=p: permute(x, lay, backend=p)) for p in providers}))
    # 4. unpermute (combine): read every expert output row, write a token row, read the weights.
    cases.append(("unpermute", f"N{Nr}xH{H}", 2 * Nr * H + 2 * T * H + 4 * T * K,
                  {p: (lambda p=p: unpermute(y, w, lay, backend=p)) for p in providers}))
    # 5-7. tile streaming of X experts (gate_up [2I, H], down [H, I], bf16), 32 KiB tiles.
    experts = [[torch.randn((2 * I, H), device=device).bfloat16(), torch.randn((H, I), device=device).bfloat16()]
               for _ in range(X)]
    layout = ExpertLayout.of(experts[0])
    staging = layout.empty(X, device)
    moved = 2 * X * layout.payload_bytes
    xs = f"{X}x{_size(layout.payload_bytes)}"
    cases.append(("pack_tiles", xs, moved,
                  {p: (lambda p=p: pack_tiles(experts, layout, out=staging, backend=p)) for p in providers}))
    index = torch.arange(staging.shape[0], device=device).flip(0)
    relay_out = torch.empty_like(staging)
    cases.append(("forward_tiles", xs, 2 * staging.numel(),
                  {p: (lambda p=p: forward_tiles(staging, index, out=relay_out, backend=p)) for p in providers}))
    slots = [[torch.empty_like(t) for t in e] for e in experts]
    cases.append(("unpack_tiles", xs, moved,
                  {p: (lambda p=p: unpack_tiles(staging, slots, layout, backend=p)) for p in providers}))
    # 8. replica gradient reduction: one master expert's fp32 grads += C replica tiles.
    glayout = layout.with_dtype(torch.float32, tile_bytes=64 * 1024)
    master = [torch.zeros(s.shape, device=device) for s in glayout.specs]
    arena = glayout.empty(C, device).zero_()
    contrib = [[c * glayout.tiles_per_expert for c in range(C)]]
    gbytes = glayout.payload_bytes
    cases.append(("reduce_replica_grads", f"C{C}x{_size(gbytes)}", (2 + C) * gbytes,
                  {p: (lambda p=p: reduce_replica_grads([master], arena, contrib, glayout, backend=p))
                   for p in providers}))

    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing repeats")
    ap.add_argument("--smoke", action="store_true",
                    help="without a GPU: run the Triton provider too, in the interpreter, at a tiny size (checks that "
                         "the script runs end to end; the times mean nothing; writes no rows)")
    ap.add_argument("--table", action="store_true",
                    help="on a GPU: append each kernel's p50 (Triton and torch) to the measured times backend='auto' "
                         "chooses from (kernels/kernel_times.csv and its twin in benchmarks/results_committed/)")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel call imports triton
    console = Console(width=120)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    smoke = args.smoke and not gpu
    size = GPU_SIZE if gpu else SMOKE_SIZE if smoke else CPU_SIZE
    repeat = (20 if args.quick else 100) if gpu else 1 if smoke else (3 if args.quick else 10)
    providers = ("triton", "torch") if gpu or smoke else ("torch",)
    where = machine() + (f"-{torch.cuda.get_device_name()}".replace(" ", "_") if gpu else "")
    if not gpu and not smoke:
        torch.set_num_threads(1)  # a shared 2-core box: more threads only add contention noise
        where += "-1thread"
        console.print("[bold]bench_kernels: no CUDA GPU here; the Triton kernels need one.[/bold] Timing the "
                      "pure-torch references on the CPU at a reduced size (T=2048, H=1024) instead.")
    t_of = timer(device)
    cases = build_cases(size, device, providers)
    table_out = Table(title=f"real-time path kernels on {where}")
    for col in ["kernel", "size", "provider", "p50 µs", "p20 µs", "p80 µs", "GB/s", "% of copy"]:
        table_out.add_column(col, justify="right")
    rows = []
    # Baseline: the device's copy bandwidth, dst.copy_(src) counted as read + write.
    nb = (1 << 30) if gpu else (64 << 20)
    a = torch.empty(nb, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    tc = t_of(lambda: b.copy_(a), repeat)
    copy_gbs = 2 * nb / np.percentile(tc, 50) / 1e9
    xcopy = f"{nb >> 20}MiB"
    rows += [row("device_copy", "torch", "time", "s", xcopy, tc),
             row("device_copy", "torch", "bandwidth", "GB/s", xcopy, 2 * nb / tc / 1e9)]
    table_out.add_row("device copy", xcopy, "copy_", *(f"{np.percentile(tc, q) * 1e6:.0f}" for q in (50, 20, 80)),
                      f"{copy_gbs:.1f}", "100")
    del a, b
    p50s = {}  # (kernel, x, bytes) -> {provider: p50 seconds}
    for what, xlabel, nbytes, fns in cases:
        for provider, fn in fns.items():
            ts = t_of(fn, repeat)
            p50s.setdefault((what, xlabel, nbytes), {})[provider] = float(np.percentile(ts, 50))
            gbs = nbytes / ts / 1e9
            p50 = nbytes / np.percentile(ts, 50) / 1e9
            for r in (row(what, provider, "time", "s", xlabel, ts), row(what, provider, "bandwidth", "GB/s", xlabel, gbs)):
                r["machine"] = where
                rows.append(r)
            table_out.add_row(what, xlabel, provider if gpu or smoke else "torch (CPU)",
                              *(f"{np.percentile(ts, q) * 1e6:.0f}" for q in (50, 20, 80)), f"{p50:.1f}",
                              f"{100 * p50 / copy_gbs:.0f}")
    for r in rows:
        r["machine"] = where
    console.print(table_out)
    if smoke:
        print("smoke run: no rows written")
        return
    path = write_rows("bench_kernels", rows)
    print(f"rows appended to {path}")
    if args.table and gpu:
        times = [dict(kernel=k, device=torch.cuda.get_device_name(), x=x, size_bytes=nb, triton_s=f"{p['triton']:.6g}",
                      torch_s=f"{p['torch']:.6g}", machine=where, run=RUN,
                      source=f"benchmarks/bench_kernels.py {'--quick ' if args.quick else ''}--table (p50 of {repeat}), "
                             f"commit {git_commit()}")
                 for (k, x, nb), p in p50s.items()]
        for table in TABLES:
            append_times(table, times)
        choice._load.cache_clear()
        picks = ", ".join(f"{k} {choice.kernel_times().choose(k, torch.cuda.get_device_name(), nb)}"
                          for (k, _, nb) in p50s)
        print(f"kernel times appended to {', '.join(str(t.relative_to(ROOT)) for t in TABLES)}; auto now runs: {picks}")


if __name__ == "__main__":
    main()
