"""The measured phases of one balanced-layer call on one rank, typed: :class:`CallTimings`.

A call's phases are written by three parties — the layer's forward (load all-gather, plan, reroute, dispatch,
experts, combine), its replica job (weight posts, waits, replica compute, restores, gradient posts and
reductions) and its backward hooks (the backward and its two all-to-alls) — and read by three: telemetry
(:meth:`CallTimings.to_record`: the ``timings`` row, whose keys are the DuckDB columns and the ``other`` map's
keys), the engine's calibration (:meth:`CallTimings.rank_vector`: what the next call's load all-gather carries)
and :attr:`BalancedExperts.last_timings <ultraep.runtime.layer.BalancedExperts>`. Fields are slots: a misspelt
name is an ``AttributeError`` (a ``TypeError`` in the constructor), never a phase silently read as 0 s.

``None`` means "not measured in this call" (no replica job, no backward yet, no replica cache) and leaves the key
out of the record, exactly as the record had no such key before. Values are :data:`~ultraep.runtime.clock.Time`
until :meth:`CallTimings.read` turns them into seconds (CUDA events are read when the call is recorded).
Derived phases (``experts_s``, ``transfer_s``, ``measured_s``, ``backward_compute_s``, ...) are computed in one
place, :meth:`CallTimings.to_record`, from the measured ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ultraep.cost import CostBreakdown
from ultraep.runtime import phases
from ultraep.runtime.clock import Time, clamp0
from ultraep.timings import TERMS

#: the replica job's phases (``ReplicaJob.phases`` keys) read with the forward and with the backward
JOB_FORWARD = ("weight_post_s", "relay_s", "weight_wait_s", "weight_sync_flight_s", "weight_unpack_s",
               "replica_compute_s")
JOB_BACKWARD = ("restore_s", "recompute_s", "replica_backward_s", "grad_post_s", "grad_wait_s", "grad_reduce_s")


def _job_phases(ph: Mapping[str, Time]) -> Mapping[str, Time]:
    """The job's phases, refused when one is not a known name (a typo in the job would read as 0 s)."""
    unknown = sorted(set(ph) - set(JOB_FORWARD) - set(JOB_BACKWARD))
    if unknown:
        raise KeyError(f"ReplicaJob.phases has unknown phase(s) {unknown}; known: {JOB_FORWARD + JOB_BACKWARD}")
    return ph


@dataclass(slots=True)
class CallTimings:
    """One call's phases on this rank (seconds; see the module docstring for ``None``)."""

    # forward, always (t0..t7 of the layer's steps)
    load_s: Time
    plan_s: Time
    reroute_s: Time
    dispatch_s: Time
    master_compute_s: Time
    combine_s: Time
    forward_s: Time
    predicted: CostBreakdown  # the engine's prediction of the call: predicted_s and predicted.<term>
    activation_bytes_before: float
    activation_bytes_after: float
    # the replica job's forward (None without a job; replica_compute_s is 0 then)
    replica_compute_s: Time = 0.0
    weight_post_s: Time | None = None
    relay_s: Time | None = None
    weight_wait_s: Time | None = None
    weight_sync_flight_s: Time | None = None
    weight_unpack_s: Time | None = None
    replica_kept: bool | None = None
    transfer_bytes: float | None = None
    # the replica cache (None unless the call used it): this rank's replicas found resident / streamed, bytes saved
    cache_hits: float | None = None
    cache_misses: float | None = None
    cache_bytes_saved: float | None = None
    # the replica job's backward (None: not run, or no job)
    restore_s: Time | None = None
    recompute_s: Time | None = None
    replica_backward_s: Time | None = None
    grad_post_s: Time | None = None
    grad_wait_s: Time | None = None
    grad_reduce_s: Time | None = None
    grad_bytes: float | None = None  # replica gradient bytes this rank sent (0: deferred under no_sync)
    # the layer's backward (None until it ran): the whole, and its two all-to-alls
    backward_s: float | None = None
    combine_bwd_s: float | None = None
    dispatch_bwd_s: float | None = None

    def add_job_forward(self, ph: Mapping[str, Time], kept: bool, bytes_sent: int) -> None:
        """The replica job's forward phases (read right after the call's forward)."""
        ph = _job_phases(ph)
        self.replica_compute_s = ph.get("replica_compute_s", 0.0)
        for k in JOB_FORWARD[:-1]:
            setattr(self, k, ph.get(k, 0.0))
        self.replica_kept = kept
        self.transfer_bytes = float(bytes_sent)

    def add_job_backward(self, ph: Mapping[str, float], grad_bytes_sent: int) -> None:
        """The replica job's backward phases (seconds, read when the call is recorded)."""
        ph = _job_phases(ph)
        for k in JOB_BACKWARD:
            if k in ph:
                setattr(self, k, ph[k])
        self.grad_bytes = float(grad_bytes_sent)

    def read(self, read) -> "CallTimings":
        """A copy with every duration in seconds (``read``: the call's ``clock.read``)."""
        return dataclasses.replace(self, **{
            f.name: read(v) for f in dataclasses.fields(self)
            if f.name.endswith("_s") and (v := getattr(self, f.name)) is not None})

    # ------------------------------------------------------------------ derived phases (seconds)
    @property
    def has_job(self) -> bool:
        return self.transfer_bytes is not None

    @property
    def measured_s(self) -> float:
        """The whole layer on this rank, as ``predicted_s``: forward, plus backward once it ran."""
        return self.forward_s if self.backward_s is None else self.forward_s + self.backward_s

    @property
    def transfer_s(self) -> Time:
        """Replica weight sync on the forward's path: posts, relays and the wait for the weights."""
        return (self.weight_post_s or 0.0) + (self.relay_s or 0.0) + (self.weight_wait_s or 0.0)

    @property
    def backward_reduce_s(self) -> float:
        """The replica job's share of the backward: restore, gradient posts, the wait and the reduction."""
        return sum(x or 0.0 for x in (self.restore_s, self.grad_post_s, self.grad_wait_s, self.grad_reduce_s))

    @property
    def backward_compute_s(self) -> float:
        """The layer's backward less its all-to-alls, the gradient sink and a restore: expert backward,
        weight-gradient finalisation, (un)permute — this rank's backward compute."""
        sink = (self.grad_wait_s or 0.0) + (self.grad_reduce_s or 0.0)
        return max(0.0, self.backward_s - self.combine_bwd_s - self.dispatch_bwd_s - sink - (self.restore_s or 0.0))

    def rank_vector(self) -> np.ndarray:
        """``[K]`` (:data:`~ultraep.runtime.phases.RANK_PHASES`): what the next call's load all-gather carries."""
        return phases.rank_phases(self)

    def to_record(self, rank_vector: np.ndarray | None = None) -> dict[str, float]:
        """The telemetry ``timings`` row (seconds): the keys the record always had, in the order it had them.
        ``rank_vector``: :meth:`rank_vector` if already computed."""
        t = {"load_s": self.load_s, "plan_s": self.plan_s, "reroute_s": self.reroute_s, "dispatch_s": self.dispatch_s,
             "master_compute_s": self.master_compute_s, "replica_compute_s": self.replica_compute_s,
             "experts_s": self.master_compute_s + self.replica_compute_s, "transfer_s": self.transfer_s,
             "combine_s": self.combine_s, "forward_s": self.forward_s, "measured_s": self.measured_s}
        if self.has_job:
            t.update(weight_post_s=self.weight_post_s, relay_s=self.relay_s, weight_wait_s=self.weight_wait_s,
                     weight_sync_flight_s=self.weight_sync_flight_s, weight_unpack_s=self.weight_unpack_s,
                     weight_sync_hidden_s=clamp0(self.weight_sync_flight_s - self.weight_wait_s),
                     replica_kept=1.0 if self.replica_kept else 0.0, transfer_bytes=self.transfer_bytes)
        t["predicted_s"] = self.predicted.total_s
        for k in TERMS:  # predicted next to measured, per term
            t[f"predicted.{k}"] = float(getattr(self.predicted, k))
        t.update(activation_bytes_before=self.activation_bytes_before,
                 activation_bytes_after=self.activation_bytes_after)
        if self.cache_hits is not None:
            t.update(cache_hits=self.cache_hits, cache_misses=self.cache_misses,
                     cache_bytes_saved=self.cache_bytes_saved)
        if self.has_job:
            t.update({k: getattr(self, k) for k in JOB_BACKWARD if getattr(self, k) is not None})
            if self.grad_bytes is not None:
                t["grad_bytes"] = self.grad_bytes
                t["backward_reduce_s"] = self.backward_reduce_s
        if self.backward_s is not None:
            t.update(backward_s=self.backward_s, combine_bwd_s=self.combine_bwd_s,
                     dispatch_bwd_s=self.dispatch_bwd_s, backward_compute_s=self.backward_compute_s)
        vec = self.rank_vector() if rank_vector is None else rank_vector
        mine, total = phases.reduce_phases(vec[None, :])
        for k, v in {**mine, "total_s": total}.items():
            t[f"measured.{k}"] = v  # this rank's; the engine calibrates from every rank's (next call)
        return t


def forward_timings(ts: tuple, master_s: Time, job, predicted: CostBreakdown, plan, rank: int,
                    row_bytes: float) -> CallTimings:
    """This rank's forward phases of one call: ``ts`` = t0..t7 (before the load all-gather, after it, after the
    plan, after the weight posts, after the reroute, after the dispatch, after the experts, after the combine),
    the masters' compute seconds, the replica ``job`` (or None), the engine's prediction; the expert activations
    this rank holds for the call without and with balancing (``row_bytes`` per row it computes: the third cost of
    imbalance, telemetry.queries.ACTIVATION_MEMORY)."""
    t0, t1, t2, t3, t4, t5, t6, t7 = ts
    t = CallTimings(load_s=t1 - t0, plan_s=t2 - t1, reroute_s=t4 - t3, dispatch_s=t5 - t4, master_compute_s=master_s,
                    combine_s=t7 - t6, forward_s=t7 - t0, predicted=predicted,
                    activation_bytes_before=float(plan.rank_load_before_R[rank]) * row_bytes,
                    activation_bytes_after=float(plan.rank_load_after_R[rank]) * row_bytes)
    if job is not None:
        t.add_job_forward(job.phases, job.kept, job.bytes_sent)
    return t
