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
