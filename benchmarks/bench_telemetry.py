"""Telemetry cost (issue 3): hot-path overhead per record, ingest rate, share of step time.

1. **Hot path**: seconds per ``record_plan`` call and per layer-microbatch bundle (``record_plan`` +
   ``record_decision`` + ``record_timings`` + ``record_transfer_times``), with the background flusher
   running at its defaults and a little GIL-releasing numpy work between records, as in a training loop.
   ``NullRecorder`` (telemetry off) for comparison. Goal: <= 20 µs per bundle.
2. **Ingest**: rows per second (a) into the store — one Arrow batch of ``transfers`` rows written as a
   Parquet part and renamed into place, then counted by DuckDB — and (b) through the whole flush path,
   from buffered records to parts (plan bundles: layer_loads + plans + transfers + decisions + timings +
   transfer_times rows; and narrow timing rows). Goal: >= 1 M rows/s.
3. **Share of step time** in a representative CPU run: a small MoE (8 simulated EP ranks, 32 experts,
   top-2, 4 layers, 2 microbatches of 1024 tokens) trained with autograd on CPU, planning every layer with ``quota``
   and recording everything; blocks of ``Recorder`` and ``NullRecorder`` steps alternate. Reported: time
   inside the record calls / step time (hot path), the flushing thread's CPU time / step time (flush
   path, at the default 2 s interval), and the median and mean step-time difference between the two
   (noisy on a shared machine). Goal: <= 2 %.

    .venv/bin/python benchmarks/bench_telemetry.py            # about 1-2 minutes
    .venv/bin/python benchmarks/bench_telemetry.py --quick    # fewer repeats

Rows are appended to ``benchmarks/results/bench_telemetry.csv`` (see ``benchmarks/common.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.common import row, write_rows  # noqa: E402
from ultraep import plan_layer  # noqa: E402
from ultraep.telemetry import NullRecorder, Recorder, open_run  # noqa: E402
from ultraep.telemetry.sinks import ParquetSink  # noqa: E402
from ultraep.topology import Topology  # noqa: E402
from ultraep.sim.workload import power_law_popularity  # noqa: E402

EXPERT_BYTES = 3 * 7168 * 2048 * 2  # DeepSeek-V3-like expert in bf16
SHAPES = [("EP8/64e/2s", 8, 64, 2, 2048), ("EP64/256e/2s", 64, 256, 2, 8192)]


def _plans(R: int, E: int, N: int, tokens: int, n: int = 16) -> list:
    """Real quota plans of skewed loads: power-law expert popularity, top-8 counts per source rank."""
    topo = Topology(num_ranks=R, num_experts=E, num_redundant_slots=N, expert_bytes=EXPERT_BYTES)
    out = []
    for s in range(n):
        rng = np.random.default_rng(s)
        pop = power_law_popularity(R, E, 1.0, rng)
        load = np.stack([rng.multinomial(tokens * 8, pop) for _ in range(R)])
        out.append(plan_layer(load, "quota", topology=topo))
    return out


PREDICTIONS = {"quota": 1.1e-3, "eplb": 1.4e-3, "none": 2.0e-3}
TIMINGS = {"plan_s": 2e-4, "transfer_s": 3e-4, "dispatch_s": 4e-4, "experts_s": 9e-4, "combine_s": 3e-4,
           "measured_s": 1.2e-3, "predicted_s": 1.1e-3}


def _bundle(rec, step: int, layer: int, plan, seconds) -> None:
    """Everything recorded for one layer-microbatch (arguments prepared by the caller)."""
    rec.record_plan(step, 0, layer, plan)
    rec.record_decision(step, 0, layer, policy="quota", reason="hot experts", predictions=PREDICTIONS,
                        chosen_predicted_s=1.1e-3)
    rec.record_timings(step, 0, layer, TIMINGS)
    rec.record_transfer_times(step, 0, layer, seconds)


# --------------------------------------------------------------------------- 1. hot path
def bench_hot_path(runs: Path, n: int) -> list[dict]:
    rows = []
    work = np.random.default_rng(0).standard_normal((96, 96))
    for name, R, E, N, tokens in SHAPES:
        plans = _plans(R, E, N, tokens)
        secs = [p.transfers.bytes * 1e-11 for p in plans]
        for provider, make in (("NullRecorder", lambda: NullRecorder()),
                               ("Recorder", lambda: Recorder.open(runs, f"hot-{R}", flush_interval_s=1.0))):
            rec = make()
            plan_t = np.empty(n)
            bundle_t = np.empty(n)
            for i in range(n):
                work @ work  # GIL-releasing work between records (the "training" in between)
                p, sec = plans[i % len(plans)], secs[i % len(plans)]
                t0 = time.perf_counter()
                rec.record_plan(i // 64, 1, i % 64, p)
                t1 = time.perf_counter()
                _bundle(rec, i // 64, i % 64, p, sec)
                t2 = time.perf_counter()
                plan_t[i] = t1 - t0
                bundle_t[i] = t2 - t1
            rec.close()
            assert getattr(rec, "errors", 0) == 0
            rows.append(row("record_plan", provider, "latency", "s", name, plan_t))
            rows.append(row("record_bundle", provider, "latency", "s", name, bundle_t))
            rows.append(row("record_bundle", provider, "mean_latency", "s", name, bundle_t.mean()))
    return rows


# --------------------------------------------------------------------------- 2. ingest
def bench_store_ingest(runs: Path, n_rows: int, repeat: int) -> list[dict]:
    import duckdb
    import pyarrow as pa

    from ultraep.telemetry import semconv as sc

    rng = np.random.default_rng(0)
    i32 = lambda hi: pa.array(rng.integers(0, hi, n_rows, dtype=np.int32))  # noqa: E731
    table = pa.table({
        "run_id": pa.repeat(pa.scalar("ingest"), n_rows), "rank": pa.repeat(pa.scalar(0, pa.int32()), n_rows),
        "step": pa.array(np.arange(n_rows, dtype=np.int64) // 1000), "microbatch": i32(4), "layer": i32(60),
        "idx": i32(32), "expert": i32(256), "src": i32(64), "dst": i32(64), "stage": i32(2),
        "bytes": pa.array(np.full(n_rows, EXPERT_BYTES, dtype=np.int64)),
    }, schema=sc.arrow_schema(sc.T_TRANSFERS))
    rates, visible = [], []
    for k in range(repeat):
        run_dir = runs / f"ingest-{k}"
        sink = ParquetSink(run_dir, 0, "bench")
        t0 = time.perf_counter()
        sink.write(sc.T_TRANSFERS, table)
        t1 = time.perf_counter()
        con = duckdb.connect()
        got = con.execute("SELECT count(*) FROM read_parquet(?)", [str(run_dir / "transfers" / "*.parquet")]
                          ).fetchone()[0]
        t2 = time.perf_counter()
        assert got == n_rows
        rates.append(n_rows / (t1 - t0))
        visible.append(n_rows / (t2 - t0))
    x = f"transfers x{n_rows}"
    return [row("store_ingest", "parquet-part", "rows_per_s", "{row}/s", x, rates),
            row("store_ingest+count", "parquet-part+duckdb", "rows_per_s", "{row}/s", x, visible)]


def bench_flush_path(runs: Path, n_bundles: int, n_timings: int, repeat: int) -> list[dict]:
    out = []
    plans = _plans(8, 64, 2, 2048)
    secs = [p.transfers.bytes * 1e-11 for p in plans]
    for kind, n in (("plan bundles", n_bundles), ("timings", n_timings)):
        rates, rec_rates = [], []
        for k in range(repeat):
            rec = Recorder.open(runs, f"flush-{kind[0]}-{k}", flush_interval_s=None, flush_every=1 << 30,
                                max_pending=1 << 30, otel=False)
            if kind == "plan bundles":
                for i in range(n):
                    _bundle(rec, i // 64, i % 64, plans[i % len(plans)], secs[i % len(plans)])
            else:
                t = {"plan_s": 1e-4, "dispatch_s": 2e-4, "measured_s": 1e-3, "predicted_s": 1e-3}
                for i in range(n):
                    rec.record_timings(i // 64, 0, i % 64, t)
            before = rec._sink.rows_written
            t0 = time.perf_counter()
            rec.flush()
            dt = time.perf_counter() - t0
            written = rec._sink.rows_written - before
            rec.close()
            assert rec.errors == 0
            rates.append(written / dt)
            rec_rates.append(n / dt)
        x = f"{kind} x{n}"
        out.append(row("flush_path", "Recorder", "rows_per_s", "{row}/s", x, rates))
        out.append(row("flush_path", "Recorder", "records_per_s", "{record}/s", x, rec_rates))
    return out


# --------------------------------------------------------------------------- 3. share of a CPU step
def bench_step_share(runs: Path, steps: int) -> list[dict]:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    R, E, K, D, F, L, MB, T = 8, 32, 2, 128, 256, 4, 2, 1024  # ranks, experts, top-k, dims, layers, mbs, tokens
    topo = Topology(num_ranks=R, num_experts=E, num_redundant_slots=2, expert_bytes=EXPERT_BYTES)
    routers = [torch.nn.Linear(D, E) for _ in range(L)]
    # one weight pair per expert (indexing one big [E, D, F] tensor would make every backward write it whole)
    w1 = [[torch.nn.Parameter(torch.randn(D, F) * 0.02) for _ in range(E)] for _ in range(L)]
    w2 = [[torch.nn.Parameter(torch.randn(F, D) * 0.02) for _ in range(E)] for _ in range(L)]
    params = [p for r in routers for p in r.parameters()] + [w for ws in w1 + w2 for w in ws]
    opt = torch.optim.SGD(params, lr=1e-3)
    # skewed inputs so some experts are hot (the router sees a biased mean)
    bias = torch.zeros(D)
    bias[:8] = 1.0

    def step(rec, s: int) -> tuple[float, float]:
        t_start = time.perf_counter()
        rec_t = 0.0
        opt.zero_grad()
        total = 0.0
        for mb in range(MB):
            x = torch.randn(T, D) + bias
            h = x
            for layer in range(L):
                logits = routers[layer](h)
                top_w, top_e = logits.softmax(-1).topk(K, dim=-1)
                src = torch.arange(T) // (T // R)  # token -> source rank
                t0 = time.perf_counter()
                load = torch.zeros(R, E, dtype=torch.int64)
                load.index_put_((src.repeat_interleave(K), top_e.reshape(-1)), torch.ones(T * K, dtype=torch.int64),
                                accumulate=True)
                plan = plan_layer(load.numpy(), "quota", topology=topo)
                plan_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                flat_e = top_e.reshape(-1)
                order = flat_e.argsort()
                tok = torch.arange(T).repeat_interleave(K)[order]
                counts = torch.bincount(flat_e, minlength=E).tolist()
                outs = []
                for e, chunk in zip(range(E), torch.split(tok, counts)):
                    if len(chunk):
                        outs.append(torch.relu(h[chunk] @ w1[layer][e]) @ w2[layer][e])
                y = torch.zeros_like(h).index_add_(0, tok, torch.cat(outs) * top_w.reshape(-1)[order, None])
                experts_s = time.perf_counter() - t1
                h = h + y
                r0 = time.perf_counter()
                rec.record_plan(s, mb, layer, plan)
                rec.record_decision(s, mb, layer, policy="quota", reason="exact load",
                                    predictions={"quota": plan_s + experts_s, "none": 1.2 * experts_s},
                                    chosen_predicted_s=plan_s + experts_s)
                rec.record_timings(s, mb, layer, {"plan_s": plan_s, "experts_s": experts_s,
                                                  "measured_s": plan_s + experts_s,
                                                  "predicted_s": plan_s + experts_s})
                rec.record_transfer_times(s, mb, layer, plan.transfers.bytes * 1e-11)
                rec_t += time.perf_counter() - r0
            loss = h.pow(2).mean()
            loss.backward()
            total += loss.item()
        opt.step()
        dt = time.perf_counter() - t_start
        r0 = time.perf_counter()
        rec.record_step(s, loss=total / MB, step_time_s=dt)
        rec_t += time.perf_counter() - r0
        return time.perf_counter() - t_start, rec_t

    rec = Recorder.open(runs, "cpu-moe", kind="train", topology=topo, model="bench-moe")  # default flushing
    busy = {"wall": 0.0, "cpu": 0.0}
    drain = rec._drain

    def timed_drain(*a, **k):  # the flusher's busy time (wall, and CPU time of the flushing thread)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return drain(*a, **k)
        finally:
            busy["wall"] += time.perf_counter() - t0
            busy["cpu"] += time.thread_time() - c0

    rec._drain = timed_drain
    null = NullRecorder()
    for s in range(3):  # warm up both
        step(null, -1 - s)
        step(rec, -1 - s)
    rec.flush()
    busy.update(wall=0.0, cpu=0.0)
    times = {"Recorder": [], "NullRecorder": []}
    rec_share, s_idx = [], 0
    block = 8  # alternate blocks of steps; the recorder flushes on its own (default: every 2 s)
    for b in range(max(1, steps // block)):
        order = (("Recorder", rec), ("NullRecorder", null)) if b % 2 == 0 else (("NullRecorder", null),
                                                                                  ("Recorder", rec))
        for name, r in order:
            for k in range(block):
                dt, rt = step(r, s_idx)
                s_idx += 1
                times[name].append(dt)
                if name == "Recorder":
                    rec_share.append(rt / dt)
    rec.flush()  # what is still buffered counts too
    busy_wall, busy_cpu = busy["wall"], busy["cpu"]
    rec.close()
    assert rec.errors == 0, rec.first_error
    total_rec_time = sum(times["Recorder"])
    con = open_run(rec.run_dir)
    n_rows = sum(con.execute(f"SELECT count(*) FROM {t} WHERE step >= 0").fetchone()[0] for t in (
        "layer_loads", "plans", "transfers", "decisions", "timings", "transfer_times", "steps"))
    x = f"cpu-moe R{R} E{E} L{L} MB{MB} T{T}"
    med_rec, med_null = np.median(times["Recorder"]), np.median(times["NullRecorder"])
    mean_rec, mean_null = np.mean(times["Recorder"]), np.mean(times["NullRecorder"])
    return [
        row("step_time", "Recorder", "latency", "s", x, times["Recorder"]),
        row("step_time", "NullRecorder", "latency", "s", x, times["NullRecorder"]),
        row("step_share", "Recorder", "record_calls_share", "1", x, rec_share),
        row("step_share", "Recorder", "flusher_cpu_share", "1", x, busy_cpu / total_rec_time),
        row("step_share", "Recorder", "flusher_wall_share", "1", x, busy_wall / total_rec_time),
        row("step_share", "Recorder", "median_step_increase", "1", x, med_rec / med_null - 1),
        row("step_share", "Recorder", "mean_step_increase", "1", x, mean_rec / mean_null - 1),
        row("step_share", "Recorder", "rows_per_step", "{row}", x, n_rows / len(times["Recorder"])),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them (default: a temp dir)")
    args = ap.parse_args()
    runs = args.keep or Path(tempfile.mkdtemp(prefix="ultraep-bench-telemetry-"))
    q = args.quick
    rows = []
    try:
        rows += bench_hot_path(runs, 5_000 if q else 20_000)
        rows += bench_store_ingest(runs, 1_000_000, 3 if q else 7)
        rows += bench_flush_path(runs, 5_000 if q else 20_000, 100_000 if q else 400_000, 2 if q else 5)
        rows += bench_step_share(runs, 16 if q else 48)
    finally:
        if args.keep is None:
            shutil.rmtree(runs, ignore_errors=True)
    table = Table(title="telemetry cost (CPU)")
    for col in ("what", "provider", "metric", "x", "p50", "p20", "p80", "unit"):
        table.add_column(col, justify="right" if col.startswith("p") else "left")
    for r in rows:
        scale, unit = (1e6, "µs") if r["unit"] == "s" and r["metric"] != "latency" or (
            r["unit"] == "s" and r["what"].startswith("record")) else (1.0, r["unit"])
        if r["what"] == "step_time":
            scale, unit = 1e3, "ms"
        if r["unit"] == "1":
            scale, unit = 100.0, "%"
        fmt = (lambda v: f"{v * scale:,.3g}") if scale != 1.0 else (lambda v: f"{v:,.0f}")
        table.add_row(r["what"], r["provider"], r["metric"], r["x"], fmt(r["p50"]), fmt(r["p20"]), fmt(r["p80"]), unit)
    Console(width=max(Console().width, 150)).print(table)
    path = write_rows("bench_telemetry", rows)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
