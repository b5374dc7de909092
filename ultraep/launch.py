"""The local launcher: run a function on N ranks of a fresh process group on this machine.

``launch(fn, world_size, *args)`` forks ``world_size`` processes (fork start: ~0.1 s, versus 6-11 s for
spawn; spawn only where fork cannot work: NCCL ranks from a process that has already used CUDA, since a forked
child cannot re-initialise CUDA), initialises ``torch.distributed`` on a free loopback port (gloo on CPU; NCCL with one GPU per rank
when CUDA is available and ``backend="auto"``), runs ``fn(rank, world_size, *args)`` in each and returns
the per-rank results in rank order. An exception on any rank is raised in the caller with that rank's
traceback; a rank that dies (killed, crashed) is reported instead of hanging the caller. With
``torchrun``, call ``torch.distributed.init_process_group`` yourself and use ``ultraep.wrap`` directly.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue as _queue
import socket
import time
import traceback

from ultraep.errors import LaunchedRankError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, threads, fn, args, results, timeout_s):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def start_method(backend: str) -> str:
    """``fork`` unless this process has used CUDA and the ranks need it (NCCL): a forked child of a process with a
    CUDA context fails at its first CUDA call ("Cannot re-initialize CUDA in forked subprocess"). Then ``spawn``,
    which needs ``fn`` and its arguments to be picklable (module-level functions)."""
    if backend != "nccl":
        return "fork"
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def _crashed(procs, errors: list[str]) -> list[str]:
    """The ranks a signal killed (a crash in native code), not reported yet: a peer of a crashed rank fails with
    a connection reset, and its traceback alone would point at the wrong rank. The ranks this launch killed
    (SIGKILL, after the first error) are not listed."""
    import signal

    return [f"rank {r} died with {_death(p.exitcode)} (its peers' errors follow)" for r, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode < 0 and -p.exitcode != signal.SIGKILL
            and not any(e.startswith(f"rank {r} ") for e in errors)]


def _death(code: int) -> str:
    """A dead rank's exit code in words: a negative one is the signal that killed it (a crash in native code)."""
    import signal

    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name} (a crash in native code, or killed)"
    except ValueError:
        return f"signal {-code}"


def _start(procs, forking: bool) -> None:
    """Start ``procs``; a forked rank never collects the objects it inherited. Garbage the launcher still holds (a
    process group left in a reference cycle by earlier code) would otherwise be destroyed in the rank by its first
    garbage collection, and a gloo group's destructor joins its threads, which the fork did not copy: the rank
    waits for good (the test suite hung so at random, as the collector's timing fell). ``gc.freeze`` before the
    fork puts every object the launcher holds out of the ranks' collections; the launcher unfreezes them after, unless
    it had frozen objects of its own before (they stay frozen, with the rest)."""
    thaw = forking and gc.get_freeze_count() == 0
    if forking:
        gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        if thaw:
            gc.unfreeze()


def launch(fn, world_size: int, *args, backend: str = "auto", threads_per_rank: int = 1,
           timeout_s: float = 600.0, method: str | None = None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return the results by rank.

    ``method`` is the start method (``fork`` or ``spawn``); None picks it with :func:`start_method`."""
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    ctx = mp.get_context(method or start_method(backend))
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, threads_per_rank, fn, args, results,
                                              timeout_s), daemon=False)
             for r in range(world_size)]
    _start(procs, ctx.get_start_method() == "fork")
    got, errors = {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size and not errors:
            try:
                rank, ok, out = results.get(timeout=0.5)
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode != 0 and r not in got]
                if dead:
                    errors.append(f"rank {dead[0]} died with {_death(procs[dead[0]].exitcode)}")
                elif time.monotonic() > deadline:
                    errors.append(f"ranks did not finish within {timeout_s:.0f} s")
                continue
            if ok:
                got[rank] = out
            else:
                errors.append(f"rank {rank} failed:\n{out}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=1)
    if errors:
        raise LaunchedRankError("\n".join(_crashed(procs, errors) + errors))
    return [got[r] for r in range(world_size)]
