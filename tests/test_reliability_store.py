"""Crash safety of the telemetry store, and recording failures that must never stop training.

Already covered elsewhere (not repeated here): one SIGKILL after a known flush
(``test_telemetry_multiproc.py::test_sigkill_loses_nothing_that_was_flushed``), a disk that fills up mid-run
and an unwritable runs path under a plain training loop (``test_telemetry.py``). This file adds:

* **20 SIGKILLs at random points** of one run: a small writer process records plans, timings and steps,
  with the background flusher running every few milliseconds *and* explicit flushes, and is killed after a
  random delay (some during ``Recorder.open``). Every kill appends one crashed session to the same run.
  After each kill the store opens, every part on disk reads in full, and every row the writer had flushed
  (``flush()`` returned before it said so) is there, for every session so far.
* **Disk full and read-only under the real EP runtime**: two gloo ranks train a wrapped model while the
  store's writes fail (ENOSPC for a while on one rank; EROFS for every write on both); the losses are
  bit-identical to training without telemetry, every step runs, and the failures are counted.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

import ultraep
from dist_utils import run_ranks
from ultraep.models import build_model, preload
from ultraep.telemetry import Recorder, open_run

preload()

FORK = mp.get_context("fork")
R, E, LAYERS = 4, 8, 3
TOPO = ultraep.Topology(num_ranks=R, num_experts=E, num_redundant_slots=1, expert_bytes=4096)
PLAN = ultraep.plan_layer(np.arange(R * E).reshape(R, E) % 13, "quota", topology=TOPO)
KILLS = 20
SESSION_STRIDE = 1_000_000  # recorder session i writes steps i * SESSION_STRIDE + 0, 1, 2, ...


def _writer(runs_dir: str, session: int, started, flushed) -> None:
    rec = Recorder.open(runs_dir, "crashy", flush_interval_s=0.01, flush_every=64, otel=False)
    started.value = 1
    step = session * SESSION_STRIDE
    while True:
        for layer in range(LAYERS):
            rec.record_plan(step, 0, layer, PLAN)
            rec.record_timings(step, 0, layer, {"measured_s": 1e-3, "plan_s": 1e-4})
        rec.record_step(step, loss=0.5)
        if step % 8 == 0:
            rec.flush()            # every record up to this step is in renamed parts now...
            flushed.value = step   # ...and only then is it claimed
        step += 1


def _check_store(run_dir, flushed_by_session: dict[int, int], read: set) -> int:
    """Open the store, read every new visible part in full, and find every flushed row. Returns parts seen."""
    parts = sorted(run_dir.glob("*/*.parquet"))
    for p in parts:  # a visible part is always complete (written to a hidden temp name, then renamed)
        if p not in read:
            pq.read_table(p)
            read.add(p)
    con = open_run(run_dir)
    try:
        rows = con.execute(
            "SELECT 'plans', step, count(*) FROM plans GROUP BY step UNION ALL "
            "SELECT 'layer_loads', step, count(*) FROM layer_loads GROUP BY step UNION ALL "
            "SELECT 'timings', step, count(*) FROM timings GROUP BY step UNION ALL "
            "SELECT 'steps', step, count(*) FROM steps GROUP BY step UNION ALL "
            "SELECT 'sessions', -1, count(DISTINCT session) FROM runs_log").fetchall()
    finally:
        con.close()
    seen = {(t, s): n for t, s, n in rows}
    for session, last in flushed_by_session.items():
        for s in range(session * SESSION_STRIDE, last + 1):
            for t, want in (("plans", LAYERS), ("layer_loads", LAYERS), ("timings", LAYERS), ("steps", 1)):
                assert seen.get((t, s)) == want, (t, session, s, last)
    # Rows past the last completed flush may be partial: one part per table per flush, so a kill between two
    # renames shows the newer part of one table only, and a background flush may cut a step in two. A part
    # itself is never torn (read in full above).
    assert seen[("sessions", -1)] >= sum(1 for v in flushed_by_session.values() if v >= 0)
    return len(parts)


def test_sigkill_at_random_points_twenty_times(tmp_path):
    # Warm the recording path once here, so forked writers start with every lazy import and cache loaded
    # and reach their first flush in milliseconds (the kills should land in flushes, not in imports).
    with Recorder.open(tmp_path / "warm", "warm", flush_interval_s=None, otel=False) as rec:
        rec.record_plan(0, 0, 0, PLAN)
        rec.record_timings(0, 0, 0, {"measured_s": 1e-3})
        rec.record_step(0, loss=0.5)
    rng = random.Random(20260614)
    run_dir = tmp_path / "crashy"
    flushed_by_session: dict[int, int] = {}
    read: set = set()
    kinds = {"during open": 0, "mid-run": 0}
    for session in range(KILLS):
        # lock-free: a writer killed inside a locked write would hold the lock for good, and the next read here
        # would wait on it forever (one writer, word-sized values, read here only after it started or died)
        started, flushed = FORK.Value("i", 0, lock=False), FORK.Value("q", -1, lock=False)
        p = FORK.Process(target=_writer, args=(str(tmp_path), session, started, flushed))
        p.start()
        if session % 5 == 4:  # kill while the recorder opens (writing its first runs_log row, or before)
            time.sleep(rng.uniform(0.0, 0.01))
            kinds["during open"] += 1
        else:
            deadline = time.monotonic() + 20
            while not started.value and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.25))
            kinds["mid-run"] += 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=10)
        assert p.exitcode == -signal.SIGKILL
        flushed_by_session[session] = flushed.value
        if run_dir.exists():
            _check_store(run_dir, flushed_by_session, read)
    parts = _check_store(run_dir, flushed_by_session, read)
    claimed = sum(v - s * SESSION_STRIDE + 1 for s, v in flushed_by_session.items() if v >= 0)
    assert claimed > 0 and parts > KILLS  # the writers did get rows out before being killed
    # killed recorder sessions are recorded as never closed; leftovers are hidden temp files no reader globs
    con = open_run(run_dir)
    assert {r[0] for r in con.execute("SELECT DISTINCT status FROM runs_log").fetchall()} == {"running"}
    leftovers = list(run_dir.glob("*/.*.tmp"))
    assert all(t.name.startswith(".r00000-") for t in leftovers)


# --------------------------------------------------------------------------------------------- training
def _train_with_failing_store(rank, world, runs_dir):
    """Train the same wrapped model three times on this rank: no telemetry, a disk that fills up for a
    while on rank 0, and a read-only store on every rank. Returns losses and recorder counters."""
    import torch.distributed as dist

    from ultraep.telemetry.sinks import ParquetSink

    real_write = ParquetSink.write
    out = {}
    for mode in ("off", "disk-full", "read-only"):
        full = [False]

        def write(self, table, data, mode=mode, full=full):
            if mode == "read-only":
                raise OSError(errno.EROFS, "Read-only file system", str(self.run_dir))
            if full[0]:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir))
            return real_write(self, table, data)

        ParquetSink.write = write
        try:
            torch.manual_seed(0)
            model = build_model("qwen3-moe")
            rec = None
            if mode != "off":
                rec = Recorder.open(runs_dir, f"store-{mode}", world_size=world, rank=rank, flush_interval_s=0.005,
                                    flush_every=8, otel=False)
            ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec)
            rt = ultraep.runtime_of(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for step in range(4):
                full[0] = mode == "disk-full" and rank == 0 and step in (1, 2)  # rank 0's disk fills for 2 steps
                ids = torch.randint(0, 3, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
                opt.zero_grad(set_to_none=True)
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
                loss.backward()
                for name, p in model.named_parameters():
                    if p.grad is not None and ".experts." not in name:
                        dist.all_reduce(p.grad)
                opt.step()
                rt.next_step(loss=float(loss))
                if rec is not None:
                    rec.flush()
                losses.append(float(loss))
            if rec is not None:
                rec.close()
            out[mode] = (losses, 0 if rec is None else rec.errors, 0 if rec is None else rec.dropped_rows,
                         None if rec is None else rec.first_error)
        finally:
            ParquetSink.write = real_write
    return out


def test_disk_full_and_read_only_store_never_stop_training(tmp_path):
    results = run_ranks(_train_with_failing_store, 2, str(tmp_path))
    for rank, out in enumerate(results):
        base = out["off"][0]
        assert len(base) == 4
        for mode in ("disk-full", "read-only"):
            losses, errors, dropped, first = out[mode]
            assert losses == base, (rank, mode)  # bit-identical: recording failures change nothing
            if mode == "read-only" or rank == 0:
                assert errors > 0 and dropped > 0, (rank, mode)
                assert ("Read-only" if mode == "read-only" else "No space left") in first
            else:
                assert errors == 0
    assert not (tmp_path / "store-read-only").exists() or not list((tmp_path / "store-read-only").rglob("*.parquet"))
    # disk full on rank 0 during steps 1-2: those rows are lost (and counted), steps 0 and 3 are there;
    # rank 1 lost nothing
    con = open_run(tmp_path / "store-disk-full")
    steps = con.execute("SELECT rank, list(DISTINCT step ORDER BY step) FROM timings GROUP BY rank").fetchall()
    assert dict(steps) == {0: [0, 3], 1: [0, 1, 2, 3]}
    status = dict(con.execute("SELECT rank, status FROM runs").fetchall())
    assert status == {0: "closed", 1: "closed"}
