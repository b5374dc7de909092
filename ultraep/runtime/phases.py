"""A balanced layer's measured phases, in the one set of phase names (:mod:`ultraep.timings`).

Legend: R ranks, K = ``len(RANK_PHASES)``.

    Step 1 (each rank, after a call's backward or, when serving, its forward): :func:`rank_phases` sums the
           call's :class:`~ultraep.runtime.call_timings.CallTimings` (``master_compute_s``, ``weight_post_s``, ...) into
           ``RANK_PHASES`` — the cost model's terms, with the all-to-all kept as its four exchanges.
    Step 2: the ``[K]`` vector rides on the next call's load all-gather (int64 nanoseconds), so every rank
           holds ``[R, K]``.
    Step 3 (every rank alike): :func:`reduce_phases` reduces it to the layer's measurement in
           :data:`~ultraep.timings.TERMS` — the slowest rank sets compute, copies, planning and the layer time;
           each all-to-all takes the *fastest* rank's time (the last to arrive waits for nobody, so its time is
           the exchange itself, not another rank's straggling) — and the engine calibrates from it, with the least
           busy rank's compute and the replicas' (:func:`compute_spread`) and every rank's (:func:`rank_compute`).
"""

from __future__ import annotations

import numpy as np

#: what each rank measured of a layer's call: the cost model's terms, the all-to-alls as their four exchanges
RANK_PHASES = ("compute_fwd_s", "compute_bwd_s", "dispatch_s", "combine_s", "combine_bwd_s", "dispatch_bwd_s",
               "weight_sync_s", "copy_s", "plan_s", "total_s", "replica_compute_s", "weight_wait_s")
#: the all-to-all terms and the exchanges each sums
_A2A = {"a2a_fwd_s": ("dispatch_s", "combine_s"), "a2a_bwd_s": ("combine_bwd_s", "dispatch_bwd_s")}


def rank_phases(t: "CallTimings") -> np.ndarray:
    """Step 1: ``[K]`` seconds from one call's timings ``t`` (:class:`~ultraep.runtime.call_timings.CallTimings`,
    read into seconds) on this rank; a phase the call did not run (``None``) counts 0 s."""
    bwd = t.backward_s is not None

    def z(x) -> float:
        return 0.0 if x is None else x

    return np.array([
        t.master_compute_s + t.replica_compute_s,
        max(0.0, t.backward_compute_s - z(t.grad_post_s) - z(t.recompute_s)) if bwd else 0.0,
        t.dispatch_s,
        t.combine_s,
        t.combine_bwd_s if bwd else 0.0,
        t.dispatch_bwd_s if bwd else 0.0,
        z(t.weight_sync_flight_s),
        z(t.weight_post_s) + z(t.weight_unpack_s) + z(t.grad_post_s) + z(t.grad_reduce_s),
        t.plan_s,
        t.measured_s,
        t.replica_compute_s,
        z(t.weight_wait_s),
    ])


def reduce_phases(meas_RK: np.ndarray) -> tuple[dict[str, float], float]:
    """Step 3: every rank's ``[R, K]`` phases → ``({term: seconds}, layer seconds)``; forward-only calls
    (serving) leave the backward terms out."""
    hi = dict(zip(RANK_PHASES, meas_RK.max(axis=0).tolist()))
    lo = dict(zip(RANK_PHASES, meas_RK.min(axis=0).tolist()))
    m = {k: hi[k] for k in ("compute_fwd_s", "compute_bwd_s", "weight_sync_s", "copy_s", "plan_s")}
    for term, parts in _A2A.items():
        m[term] = sum(lo[p] for p in parts)
    if m["compute_bwd_s"] <= 0:  # forward only (serving): nothing measured of the backward
        m.pop("compute_bwd_s")
        m.pop("a2a_bwd_s")
    return m, hi["total_s"]


def compute_spread(meas_RK: np.ndarray) -> dict[str, float]:
    """What the engine learns an expert instance's cost beyond its tokens from, seconds: the least busy rank's expert
    compute, forward and (when measured) backward, next to the slowest rank's (``CostParams.half_tokens``), the
    replicas' forward compute summed over the ranks (``CostParams.replica_instance_s``), and the longest wait for the
    replica weights (what the critical path paid of their copy: it bounds the exposure the model predicts)."""
    fwd, bwd, rep, wait = (meas_RK[:, RANK_PHASES.index(k)]
                           for k in ("compute_fwd_s", "compute_bwd_s", "replica_compute_s", "weight_wait_s"))
    out = {"compute_fwd_fastest_s": float(fwd.min()), "replica_compute_s": float(rep.sum()),
           "weight_wait_s": float(wait.max())}
    if bwd.max() > 0:
        out["compute_bwd_fastest_s"] = float(bwd.min())
    return out


def rank_compute(meas_RK: np.ndarray) -> dict[str, np.ndarray]:
    """Every rank's expert compute ``[R]``, forward and (when measured) backward: what the engine fits the compute
    parameters over (:class:`~ultraep.cost.ComputeFit`)."""
    out = {"compute_fwd_s": meas_RK[:, RANK_PHASES.index("compute_fwd_s")].astype(np.float64)}
    bwd = meas_RK[:, RANK_PHASES.index("compute_bwd_s")].astype(np.float64)
    if bwd.max() > 0:
        out["compute_bwd_s"] = bwd
    return out
