"""The policy Protocol and the plan assembly every policy shares.

A policy is a plain class constructed with its options. ``plan`` is pure (reads state, never writes it);
``commit`` advances history (windows, EWMA, current replica set) once the plan is accepted, so every
recorded plan can be replayed.

Legend: R ranks, E experts, S slots per rank, P replicas in the plan.
"""

from __future__ import annotations

import time
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
from numba import njit

from ultraep.plan import ExpertDomains, Plan, Replicas, Transfers
from ultraep.topology import Topology

from ultraep.plan.routes import even_split
from ultraep.plan.transfers import RELAY_MODES, schedule_transfers, transfers_for

_EMPTY = np.zeros(0, dtype=np.int64)


@runtime_checkable
class Policy(Protocol):
    """What the engine, simulator and ``plan_layer`` call.

    Optional class attributes a policy declares about itself (absent = the default): ``planner_s`` (its
    planning seconds on the critical path, put on every plan it makes for the cost model; 0),
    ``planner_exposed`` (False when planning hides behind compute; True), ``needs_cost_model``,
    ``uses_residency``, ``one_shot_options``, ``step_count_options``, ``chooses_among_policies``, and what a
    chooser asks of its candidates: ``fallback`` (does nothing, always on time: ``none``), ``screenable`` (a
    stateless planner on the critical path that may be skipped when it cannot pay: ``quota``) and
    ``placement_interval`` (a historical placement, resident this many decisions, sends all its replicas
    when switched to: ``eplb``). The planning time is measured by :func:`plan_resident`, not by the policy."""

    name: ClassVar[str]

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        """Decide one layer and microbatch. ``load_RE`` is a validated int64 ``[R, E]``; no side effects."""
        ...

    def commit(self, plan: Plan) -> None:
        """Advance the policy's history with an accepted plan (no-op for stateless policies)."""
        ...

    # Optional: ``advance(load_RE)`` advances the history with a load the policy did not plan (a chooser such
    # as ``adaptive`` rested it for a decision). Only a policy that has it may go unplanned for a decision.


class Stateless:
    """Base of a policy with no history (it plans from the load at hand): ``commit`` and ``advance`` have
    nothing to do, so a chooser may leave it unplanned for any decision."""

    def commit(self, plan: Plan) -> None:
        return None

    def advance(self, load_RE: np.ndarray) -> None:
        return None


def plan_resident(policy, load_RE: np.ndarray, topology: Topology, resident_RE: np.ndarray | None) -> Plan:
    """:func:`plan_with_residency`, timed: the returned plan's ``solve_time_s`` is the wall time of this call
    (the policy's planning, and for a chooser the planning of its candidates). Measured here, once, where the
    engine and ``plan_layer`` call a policy, rather than by each policy writing into its frozen plan."""
    t0 = time.perf_counter()
    plan = plan_with_residency(policy, load_RE, topology, resident_RE)
    return plan.with_solve_time(time.perf_counter() - t0)


def plan_with_residency(policy, load_RE: np.ndarray, topology: Topology, resident_RE: np.ndarray | None) -> Plan:
    """``policy``'s plan, untimed (a chooser plans its candidates with it; :func:`plan_resident` times the
    whole call), when ``resident_RE[r, e]`` (bool ``[R, E]``) says which ranks already hold valid
    weights of which experts, with transfers for exactly the non-resident replicas
    (:func:`~ultraep.plan.transfers.transfers_for`). A policy that declares ``uses_residency = True`` plans with
    it (it may prefer resident replicas) and returns such transfers itself (the plan object it returns is
    the one it will see in ``commit``); any other policy's transfers are recomputed here.
    ``resident_RE=None``: the policy's own plan."""
    if resident_RE is None:
        return policy.plan(load_RE, topology)
    if getattr(policy, "uses_residency", False):
        return policy.plan(load_RE, topology, resident_RE=resident_RE)
    return transfers_for(policy.plan(load_RE, topology), resident_RE)


@njit(cache=True)
def _assemble_arrays(load_RE, home_E, master_slot_E, masters_RM, S, rep_e, rep_rank, rep_slot, rep_quota,
                     has_quota):
    """Rows of replicas (any order) → CSR by expert (stable), ``phy2log``, ``quota``; with no quotas given,
    the even split's ``routes`` too (its quotas follow from it). Quota plans derive routes lazily."""
    R, E = load_RE.shape
    M = masters_RM.shape[1]
    P = rep_e.shape[0]
    # CSR by expert, keeping each expert's rows in their given order.
    ptr = np.zeros(E + 1, np.int64)
    for k in range(P):
        ptr[rep_e[k] + 1] += 1
    for e in range(E):
        ptr[e + 1] += ptr[e]
    fill = ptr[:E].copy()
    order = np.empty(P, np.int64)
    rr = np.empty(P, np.int64)
    ss = np.empty(P, np.int64)
    qq = np.zeros(P, np.int64)
    for k in range(P):
        i = fill[rep_e[k]]
        fill[rep_e[k]] += 1
        order[i] = k
        rr[i] = rep_rank[k]
        ss[i] = rep_slot[k]
        if has_quota:
            qq[i] = rep_quota[k]
    phy2log = np.full((R, S), -1, np.int64)
    phy2log[:, :M] = masters_RM
    for e in range(E):
        for k in range(ptr[e], ptr[e + 1]):
            phy2log[rr[k], ss[k]] = e
    quota = np.zeros((R, S), np.int64)
    routes = np.zeros((R if not has_quota else 0, R, S), np.int64)
    if has_quota:
        lam_E = np.zeros(E, np.int64)
        for r in range(R):  # row-major: contiguous reads
            lrow = load_RE[r]
            for e in range(E):
                lam_E[e] += lrow[e]
        for e in range(E):
            lam = lam_E[e]
            for k in range(ptr[e], ptr[e + 1]):
                lam -= qq[k]
                quota[rr[k], ss[k]] = qq[k]
            quota[home_E[e], master_slot_E[e]] = lam
    else:
        even_split(load_RE, home_E, master_slot_E, ptr, rr, ss, routes, quota)
    return ptr, rr, ss, qq, order, phy2log, quota, routes


def assemble_plan(
    policy: str,
    topology: Topology,
    load_RE: np.ndarray,
    rep_e: np.ndarray,
    rep_rank: np.ndarray,
    rep_slot: np.ndarray,
    rep_quota: np.ndarray | None = None,
    *,
    transfer_mask: np.ndarray | None = None,
    relay: str = "auto",
    solve_time_s: float = 0.0,
    info: dict | None = None,
    expert_domains: ExpertDomains | None = None,
    static_overlap: bool = False,
    planner_s: float | None = None,
) -> Plan:
    """Build a :class:`Plan` from replica rows ``(expert, rank, slot[, quota])``, each ``[P]``.

    With ``rep_quota`` the quotas are given (quota planners) and tokens are split with locality when
    ``plan.routes_RRS`` is first read; without it tokens are split evenly over instances (historical
    balancing) right away and quotas follow from the split.
    ``transfer_mask[P]`` (row order) selects the replicas whose weights must be sent (default: all).
    ``expert_domains``, ``static_overlap`` and ``planner_s`` are the plan's typed facts for the cost model (see
    :class:`Plan`).
    """
    t = topology
    has_quota = rep_quota is not None
    ptr, rr, ss, qq, order, phy2log, quota, routes = _assemble_arrays(
        load_RE, t.home_E, t.master_slot_E, t.masters_RM, t.num_slots,
        rep_e, rep_rank, rep_slot, rep_quota if has_quota else _EMPTY, has_quota,
    )
    if rr.size:
        sel_ptr, sel_rank = ptr, rr
        if transfer_mask is not None and not transfer_mask.all():
            keep = np.asarray(transfer_mask, dtype=bool)[order]
            counts = np.bincount(np.asarray(rep_e)[order][keep], minlength=t.num_experts)
            sel_ptr = np.zeros(t.num_experts + 1, dtype=np.int64)
            np.cumsum(counts, out=sel_ptr[1:])
            sel_rank = np.ascontiguousarray(rr[keep])
        te, ts, td, tb, tg = schedule_transfers(
            t.home_E, sel_ptr, sel_rank, t.expert_bytes, t.num_ranks, t.D, RELAY_MODES[relay]
        )
        transfers = Transfers(te, ts, td, tb, tg)
    else:
        transfers = Transfers.empty()
    return Plan(
        policy=policy,
        topology=t,
        load_RE=load_RE,
        phy2log_RS=phy2log,
        quota_RS=quota,
        replicas=Replicas(ptr, rr, ss, qq),
        transfers=transfers,
        solve_time_s=solve_time_s,
        info=info if info is not None else {},
        routes=None if has_quota else routes,
        expert_domains=expert_domains,
        static_overlap=static_overlap,
        planner_s=planner_s,
    )



def identity_plan(policy: str, topology: Topology, load_RE: np.ndarray, solve_time_s: float = 0.0, info=None,
                  **typed) -> Plan:
    """Masters only: every expert's tokens go to its home rank. (Passed as a quota plan with no replicas, so
    its routes are derived on first use instead of being split eagerly.) ``typed``: the plan's typed facts
    (``expert_domains``, ``static_overlap``), as for :func:`assemble_plan`."""
    return assemble_plan(policy, topology, load_RE, _EMPTY, _EMPTY, _EMPTY, _EMPTY, solve_time_s=solve_time_s,
                         info=info, **typed)
