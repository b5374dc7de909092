"""The local launcher's start method: fork where it can, spawn where a forked rank could not use CUDA."""

import torch

from ultraep.launch import launch, start_method


def _rank_sum(rank, world, base):
    import torch.distributed as dist

    t = torch.tensor([float(rank + base)])
    dist.all_reduce(t)
    return rank, world, float(t)


def test_fork_unless_nccl_ranks_follow_a_process_that_used_cuda(monkeypatch):
    assert start_method("gloo") == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert start_method("nccl") == "fork"  # the ranks create their own CUDA contexts
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method("nccl") == "spawn"  # a forked child cannot re-initialise CUDA
    assert start_method("gloo") == "fork"  # gloo ranks on CPU never touch CUDA


def test_spawned_ranks_run_a_module_level_function_and_return_by_rank():
    got = launch(_rank_sum, 2, 10, backend="gloo", method="spawn", timeout_s=120)
    assert got == [(0, 2, 21.0), (1, 2, 21.0)]


def _one_rank_crashes(rank, world):
    import os

    import torch.distributed as dist

    if rank == 1:
        import faulthandler

        faulthandler.disable()  # (pytest's dump of every thread would only fill the log)
        os.abort()  # a crash in native code (SIGABRT), as a double free is
    dist.all_reduce(torch.ones(1))  # rank 0 waits on the dead peer: a connection reset, not the cause


def test_a_rank_killed_by_a_signal_is_named_before_its_peers_errors():
    import pytest

    from ultraep.errors import LaunchedRankError

    with pytest.raises(LaunchedRankError) as info:
        launch(_one_rank_crashes, 2, backend="gloo", timeout_s=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 died with signal SIGABRT"), str(info.value)


def _collect(rank, world):
    import gc

    gc.collect()  # what any rank's allocations trigger sooner or later
    return rank


def test_a_forked_rank_never_destroys_a_process_group_its_launcher_left_as_garbage(monkeypatch):
    """A gloo group in a reference cycle, garbage in the launcher when it forks: collected in a rank, its destructor
    would join threads the fork did not copy and the rank would wait for good (the suite hung so at random). The
    launcher freezes its objects across the fork; without that (negative control) the ranks do not finish."""
    import gc

    import pytest
    import torch.distributed as dist

    from ultraep.errors import LaunchedRankError

    def leave_a_group_as_garbage():
        cycle = {"group": dist.ProcessGroupGloo(dist.HashStore(), 0, 1)}
        cycle["self"] = cycle

    gc.disable()  # the group stays garbage until the fork (the collector's timing is what made the hang random)
    try:
        leave_a_group_as_garbage()
        assert launch(_collect, 2, backend="gloo", timeout_s=60) == [0, 1]
        assert gc.get_freeze_count() == 0  # the launcher's objects are unfrozen again
        monkeypatch.setattr(gc, "freeze", lambda: None)  # negative control: ranks that may collect it
        leave_a_group_as_garbage()
        with pytest.raises(LaunchedRankError, match="did not finish"):
            launch(_collect, 2, backend="gloo", timeout_s=10)
    finally:
        gc.enable()
        gc.collect()  # here the group's threads exist: its destructor joins them
