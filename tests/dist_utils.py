"""Multi-rank test helper: ``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on gloo
ranks started with the fork start method (``ultraep.launch``) and fails the test with a rank's traceback.

Every run is also checked against NCCL's point-to-point rules (``nccl_harness``), in their stricter form —
one stream per communicator, so every peer's operations of a rank and group queue together, which implies
the per-pair rule: whatever passes here on gloo issues its point-to-point operations in an order NCCL runs
without a deadlock. The record must also hold the point-to-point operations the test expects (``p2p=``): a
run that moved nothing between ranks fails unless the test says nothing was to move."""

from __future__ import annotations

from ultraep.errors import LaunchedRankError
from ultraep.launch import free_port, launch  # noqa: F401


def run_ranks_unchecked(fn, world_size: int, *args, timeout: float = 300.0):
    """``fn`` on gloo ranks, as gloo runs it (``run_ranks`` also checks NCCL's point-to-point rules)."""
    try:
        return launch(fn, world_size, *args, backend="gloo", timeout_s=timeout)
    except LaunchedRankError as exc:
        raise AssertionError(str(exc)) from None


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, p2p=True):
    """``p2p``: the point-to-point operations the run must have issued (``nccl_harness.expect_p2p``): by default
    some (an empty record fails), ``False`` for a test where nothing moves between ranks, or a callable that
    checks the record (``nccl_harness.P2PRecord``)."""
    from nccl_harness import run_ranks_nccl

    return run_ranks_nccl(fn, world_size, *args, timeout=timeout, scope="communicator", p2p=p2p)
