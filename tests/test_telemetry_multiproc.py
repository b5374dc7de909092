"""Telemetry across processes on real files: several gloo ranks write one run and every row arrives; a
reader queries while the writer writes (no lock errors); SIGKILL loses nothing that was flushed."""

import multiprocessing as mp
import os
import signal
import socket
import time

import numpy as np
import pytest

import ultraep
from ultraep.telemetry import MemorySink, Recorder, open_run

R, E, STEPS, MBS, LAYERS = 3, 12, 3, 2, 4
TOPO = ultraep.Topology(num_ranks=R, num_experts=E, num_redundant_slots=2, expert_bytes=4096)
FORK = mp.get_context("fork")


def local_counts(rank: int, step: int, mb: int, layer: int) -> np.ndarray:
    """``[E]`` what source rank ``rank`` routes in (step, mb, layer): deterministic, skewed to expert 0."""
    c = np.random.default_rng([rank, step, mb, layer]).integers(0, 50, E)
    c[0] += 100 * (layer + 1)
    return c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, runs_dir: str, errors) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    try:
        # run_name=None: rank 0's generated id is broadcast, so every rank writes the same run
        with Recorder.open(runs_dir, None, world_size=R, rank=rank, topology=TOPO, flush_interval_s=0.05) as rec:
            for step in range(STEPS):
                for mb in range(MBS):
                    for layer in range(LAYERS):
                        mine = torch.from_numpy(local_counts(rank, step, mb, layer))
                        gathered = [torch.zeros_like(mine) for _ in range(R)]
                        dist.all_gather(gathered, mine)  # exact load: every rank sees the same λ
                        load = torch.stack(gathered).numpy()
                        t0 = time.perf_counter()
                        plan = ultraep.plan_layer(load, "quota", topology=TOPO)
                        rec.record_plan(step, mb, layer, plan)
                        rec.record_timings(step, mb, layer, {"plan_s": time.perf_counter() - t0,
                                                             "measured_s": 1e-3 * (rank + 1)})
                        own = np.where(plan.transfers.src == rank, 1e-4, np.nan)  # only this rank's sends
                        rec.record_transfer_times(step, mb, layer, own)
                rec.record_step(step, loss=1.0, step_time_s=0.01)
        errors[rank] = rec.errors
    finally:
        dist.destroy_process_group()


def test_multi_rank_gloo_run_every_row_arrives(tmp_path):
    pytest.importorskip("torch.distributed")  # imported here, so the forked ranks share it
    # load the planner, pyarrow and the OpenTelemetry SDK once here, so the forked ranks share them
    ultraep.plan_layer(np.ones((R, E), dtype=np.int64), "quota", topology=TOPO)
    Recorder.open(MemorySink(), "warm-up", flush_interval_s=None).close()
    port = free_port()
    errors = FORK.Array("i", [-1] * R)
    procs = [FORK.Process(target=_rank_main, args=(r, port, str(tmp_path), errors)) for r in range(R)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert [p.exitcode for p in procs] == [0] * R
    assert list(errors) == [0] * R
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]  # one run, shared by all ranks
    con = open_run(run_dir)
    n = STEPS * MBS * LAYERS
    per_rank = dict(con.execute("SELECT rank, count(*) FROM layer_loads GROUP BY 1").fetchall())
    assert per_rank == {r: n for r in range(R)}
    assert con.execute("SELECT count(*) FROM timings").fetchone()[0] == R * n
    assert con.execute("SELECT count(*), count(DISTINCT rank) FROM steps").fetchone() == (R * STEPS, R)
    assert con.execute("SELECT count(*), bool_and(status = 'closed') FROM runs").fetchone() == (R, True)
    # every rank recorded the identical plan; the view keeps one, and it is the exact all-gathered load
    assert con.execute("SELECT count(*) FROM layer_balance").fetchone()[0] == n
    distinct = con.execute("SELECT count(*) FROM (SELECT DISTINCT step, microbatch, layer, load, rank_load_after "
                           "FROM layer_loads)").fetchone()[0]
    assert distinct == n
    load = np.array(con.execute("SELECT load FROM layer_loads WHERE rank = 2 AND step = 1 AND microbatch = 0 "
                                "AND layer = 3").fetchone()[0])
    assert np.array_equal(load, np.stack([local_counts(r, 1, 0, 3) for r in range(R)]))
    expected = ultraep.plan_layer(load, "quota", topology=TOPO)
    assert con.execute("SELECT rank_load_after FROM layer_balance WHERE step = 1 AND microbatch = 0 AND layer = 3"
                       ).fetchone()[0] == expected.rank_load_after_R.tolist()
    # transfer times: each rank measured its own sends; the view has a time for every transfer
    T = con.execute("SELECT count(*), count(measured_s) FROM transfer_detail").fetchone()
    assert T[0] > 0 and T[0] == T[1]
    # predicted-vs-measured uses the slowest rank
    assert con.execute("SELECT min(measured_s), max(measured_s) FROM ("
                       "SELECT max(measured_s) AS measured_s FROM timings GROUP BY step, microbatch, layer)"
                       ).fetchone() == (pytest.approx(3e-3), pytest.approx(3e-3))


def _writer(runs_dir: str, steps: int, flushed, sleep_s: float, kill_safe: bool) -> None:
    plan = ultraep.plan_layer(np.arange(R * E).reshape(R, E) % 17, "quota", topology=TOPO)
    rec = Recorder.open(runs_dir, "live", flush_interval_s=0.02, flush_every=64)
    for step in range(steps):
        for layer in range(LAYERS):
            rec.record_plan(step, 0, layer, plan)
            rec.record_timings(step, 0, layer, {"measured_s": 1e-3})
        rec.record_step(step, loss=0.5)
        if kill_safe:
            rec.flush()           # everything up to this step is on disk now
            flushed.value = step  # ...and only then say so
        time.sleep(sleep_s)
    rec.close()


def test_reader_queries_while_the_writer_writes(tmp_path):
    steps = 100
    flushed = FORK.Value("i", -1)
    writer = FORK.Process(target=_writer, args=(str(tmp_path), steps, flushed, 0.02, False))
    writer.start()
    run_dir = tmp_path / "live"
    seen, queries = [], 0
    con = None
    while writer.is_alive() or queries == 0:
        if con is None and run_dir.exists():
            con = open_run(run_dir)  # one connection for the whole run: views re-glob at every query
        if con is not None:
            n_plans = con.execute("SELECT count(*) FROM layer_balance").fetchone()[0]
            n_steps = con.execute("SELECT count(*) FROM steps").fetchone()[0]
            seen.append((n_plans, n_steps))
            queries += 1
        # a fresh reader opening mid-run also works (what a dashboard refresh does)
        if run_dir.exists() and queries % 5 == 1:
            open_run(run_dir).execute("SELECT count(*) FROM timings").fetchone()
        time.sleep(0.01)
    writer.join(timeout=30)
    assert writer.exitcode == 0
    assert queries >= 3
    plans_seen = [s[0] for s in seen]
    assert plans_seen == sorted(plans_seen)  # rows only ever appear
    assert any(0 < p < steps * LAYERS for p in plans_seen)  # we did read mid-run
    final = con.execute("SELECT count(*) FROM layer_balance").fetchone()[0]
    assert final == steps * LAYERS
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "closed"


def test_sigkill_loses_nothing_that_was_flushed(tmp_path):
    flushed = FORK.Value("i", -1)
    writer = FORK.Process(target=_writer, args=(str(tmp_path), 10_000, flushed, 0.0, True))
    writer.start()
    deadline = time.time() + 30
    while flushed.value < 20 and time.time() < deadline:
        time.sleep(0.005)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(timeout=10)
    assert writer.exitcode == -signal.SIGKILL
    last = flushed.value
    assert last >= 20
    con = open_run(tmp_path / "live")
    per_step = dict(con.execute("SELECT step, count(*) FROM plans GROUP BY 1").fetchall())
    assert all(per_step.get(s) == LAYERS for s in range(last + 1))
    timings = dict(con.execute("SELECT step, count(*) FROM timings GROUP BY 1").fetchall())
    assert all(timings.get(s) == LAYERS for s in range(last + 1))
    steps = {r[0] for r in con.execute("SELECT step FROM steps").fetchall()}
    assert set(range(last + 1)) <= steps
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "running"  # never closed
    # a part being written at the kill stays a hidden .tmp file that no query reads
    leftovers = list((tmp_path / "live").glob("*/.*.tmp"))
    assert all(p.name.startswith(".r00000-") for p in leftovers)
