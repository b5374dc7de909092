"""Multi-rank test helper: ``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on gloo
ranks started with the fork start method (``ultraep.launch``) and fails the test with a rank's traceback."""

from __future__ import annotations

from ultraep.errors import LaunchedRankError
from ultraep.launch import free_port, launch  # noqa: F401


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0):
    try:
        return launch(fn, world_size, *args, backend="gloo", timeout_s=timeout)
    except LaunchedRankError as exc:
        raise AssertionError(str(exc)) from None

