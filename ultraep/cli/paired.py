"""Paired, interleaved timing: the demo and ``--compare`` time the runs they compare in one launch, step by
step, as ``benchmarks/bench_runtime.py`` does, so a busy machine slows every run alike instead of whichever
run it happened to overlap. The benchmarks import these two helpers from here (the interval lives in
telemetry, where ``ultraep report`` computes it from the store the same way).
"""

from __future__ import annotations

from ultraep.telemetry.paired import ratio_interval  # noqa: F401  (re-exported)


def carryover_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` interleaved runs, one per iteration (cycle through them), in which every run follows
    every other run equally often: a Williams design (a Latin square balanced for first-order carry-over;
    for odd ``n`` the square and its mirror, ``2n`` orders).

    Why: a run inherits part of its predecessor's state — memory it freed or touched, caches it
    evicted. With a plain rotation (0 1 2 3, 1 2 3 0, ...) each run nearly always follows the same one,
    so that inheritance becomes a bias of one run against the others (at 64 tokens per rank the run after
    ``quota``, which allocates and frees replica buffers, measured 5-8 % slower than the same layer after
    ``force-balanced``). Use a multiple of ``len(carryover_orders(n))`` iterations."""
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(v + i) % n for v in first] for i in range(n)]
    if n % 2:
        rows += [r[::-1] for r in rows]
    return rows
