"""Rank failure: a rank SIGKILLed mid-step makes every surviving rank raise a clear error in bounded time.

Three gloo ranks train a wrapped model (quota, so replicas are streamed and their gradients reduced). In
step 1 the victim rank kills itself with SIGKILL, either in the middle of the forward pass (as layer 1
gathers its load, after layer 0 ran) or between forward and backward. Every survivor must then raise
:class:`ultraep.errors.CollectiveFailedError` naming the layer, the phase and the peers, within the process group's
timeout (plus start-up slack) instead of hanging, and its telemetry must be on disk: the recorders here
never flush on their own (no flusher thread, huge ``flush_every``), so rows of step 1 can only be there
because the failure path flushed them.

The ranks are forked by hand rather than with ``ultraep.launch``: the launcher (rightly) stops and kills
the other ranks as soon as one dies, but here the survivors' own reports are what is tested.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import time

import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from ultraep.launch import free_port
from ultraep.models import build_model, preload

preload()

WORLD = 3
VICTIM = 1
PG_TIMEOUT_S = 5.0
FORK = mp.get_context("fork")


def _rank_main(rank: int, port: int, runs_dir: str, kill_at: str, results) -> None:
    import torch.distributed as dist

    import ultraep
    import ultraep.runtime.layer as ep
    from ultraep.errors import CollectiveFailedError
    from ultraep.telemetry import Recorder

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        torch.manual_seed(0)
        model = build_model("qwen3-moe", num_experts=6)
        rec = Recorder.open(runs_dir, "rankfail", world_size=WORLD, rank=rank, flush_interval_s=None,
                            flush_every=1 << 20, otel=False)
        ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec)
        rt = ultraep.runtime_of(model)
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 3, (2, 12), generator=gen)  # few token ids: skewed routing, replicas
        model(input_ids=ids).logits.pow(2).mean().backward()  # step 0 completes on every rank
        rt.next_step()
        if rank == VICTIM and kill_at in ("forward", "stall"):
            real, calls = ep.gather_load, [0]

            def die_at_layer_1(counts, group):
                calls[0] += 1
                if calls[0] == 2:  # layer 1 of step 1: layer 0 already exchanged tokens
                    # SIGKILL closes the victim's sockets; SIGSTOP leaves them open and silent (a hung rank)
                    os.kill(os.getpid(), signal.SIGKILL if kill_at == "forward" else signal.SIGSTOP)
                return real(counts, group)

            ep.gather_load = die_at_layer_1
        t0 = time.monotonic()
        try:
            out = model(input_ids=ids).logits
            if rank == VICTIM and kill_at == "backward":
                os.kill(os.getpid(), signal.SIGKILL)
            out.pow(2).mean().backward()
        except CollectiveFailedError as exc:
            results.put((rank, "CollectiveFailedError", str(exc), exc.layer, exc.phase, exc.peers,
                         time.monotonic() - t0, rt.recording.recorder.errors))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, type(exc).__name__, str(exc)[:2000], None, None, None, time.monotonic() - t0, None))
        else:
            results.put((rank, "no error", "", None, None, None, time.monotonic() - t0, None))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "setup:" + type(exc).__name__, str(exc)[:2000], None, None, None, 0.0, None))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # no destroy_process_group (its peer is gone), no atexit flush: what is on disk is tested


@pytest.mark.parametrize("kill_at", ["forward", "backward", "stall"])
def test_sigkilled_rank_makes_every_survivor_raise_a_clear_error(tmp_path, kill_at):
    """forward/backward: the victim is SIGKILLed there (peers see the connection close at once). stall: the
    victim is SIGSTOPped (sockets open, no answer): only the process group timeout can end the wait."""
    results = FORK.Queue()
    port = free_port()
    procs = [FORK.Process(target=_rank_main, args=(r, port, str(tmp_path), kill_at, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 120
    try:
        while len(got) < WORLD - 1 and time.monotonic() < deadline:
            try:
                r = results.get(timeout=0.5)
            except queue.Empty:
                continue
            got[r[0]] = r
    finally:
        if kill_at == "stall" and procs[VICTIM].is_alive():
            procs[VICTIM].kill()  # the stopped victim, once the survivors have reported
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():  # a hung survivor: fail below, but never leave it behind
                p.kill()
                p.join()
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert sorted(got) == survivors, f"survivors that reported: {sorted(got)} ({got})"
    for rank in survivors:
        _, kind, msg, layer, phase, peers, elapsed, _errors = got[rank]
        assert kind == "CollectiveFailedError", (rank, kind, msg)
        # the message names the layer (index and module path), the phase, this rank and the peers
        assert f"failed on rank {rank} of {WORLD}" in msg and "experts" in msg and "Telemetry was flushed" in msg
        assert msg.startswith(f"layer {layer} (model.layers.{layer}.mlp.experts): {phase}")
        assert VICTIM in peers or peers == [r for r in range(WORLD) if r != rank]
        # bounded: at most the process group timeout after the step started (plus slack for a loaded machine)
        assert elapsed < PG_TIMEOUT_S + 10, elapsed
        if kill_at == "stall":  # nobody closed a socket: the timeout did it
            assert elapsed > PG_TIMEOUT_S * 0.9, elapsed
        if kill_at in ("forward", "stall"):
            assert layer == 1 and "forward" not in phase and "gradient" not in phase, (layer, phase)
        else:
            assert "gradient" in phase or "reduction" in phase or "sync" in phase, phase
    # Telemetry flushed by the failure path: the survivors' rows of the failed step are on disk.
    from ultraep.telemetry import open_run

    con = open_run(tmp_path / "rankfail")
    rows = con.execute("SELECT rank, step, layer FROM timings ORDER BY 1, 2, 3").fetchall()
    for rank in survivors:
        mine = [(s, layer) for r, s, layer in rows if r == rank]
        assert (0, 0) in mine and (0, 1) in mine and (1, 0) in mine, (rank, mine)
        if kill_at == "backward":
            assert (1, 1) in mine
    assert not [r for r in rows if r[0] == VICTIM]  # the victim never flushed: nothing of it is on disk
    assert {r[0] for r in con.execute("SELECT rank FROM runs").fetchall()} >= set(survivors)


def test_distributed_errors_join_the_hierarchy_with_distinct_names(monkeypatch, capsys):
    import pickle

    from ultraep import cli, errors, launch
    from ultraep.runtime import layer as ep

    exc = errors.CollectiveFailedError("layer 1: load all-gather failed", layer=1, name="m.experts",
                                       phase="load all-gather", rank=0, peers=[1], step=3)
    back = pickle.loads(pickle.dumps(exc))  # errors cross process boundaries (launched ranks, pools)
    assert type(back) is errors.CollectiveFailedError and str(back) == str(exc)
    assert (back.layer, back.name, back.phase, back.rank, back.peers, back.step) == (1, "m.experts",
                                                                                      "load all-gather", 0, [1], 3)
    classes = (errors.CollectiveFailedError, errors.PlanDivergenceError, errors.LaunchedRankError)
    assert len({c.__name__ for c in classes}) == 3
    assert all(issubclass(c, errors.DistributedError) and issubclass(c, errors.UltraEPError) for c in classes)
    # the old in-library aliases are gone (issue 33): one name per error
    assert not hasattr(ep, "RankFailureError") and not hasattr(launch, "RankFailedError")
    # the CLI: one line, exit code 1 (a failed peer is not a user mistake, which exits with 2)
    parser = cli.build_parser()

    def boom(args):
        raise errors.LaunchedRankError("rank 1 died (exit code -9)")

    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    args = parser.parse_args(["sql", "run", "SELECT 1"])
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: argparse_ns(args, boom))
    assert cli.main(["sql", "run", "SELECT 1"]) == 1
    assert capsys.readouterr().err.strip() == "ultraep: error: rank 1 died (exit code -9)"


def argparse_ns(args, func):
    args.func = func
    args.command = "sql"
    return args
