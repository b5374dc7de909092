"""The policy Protocol and the plan assembly every policy shares.

A policy is a plain class constructed with its options. ``plan`` is pure (reads state, never writes it);
``commit`` advances history (windows, EWMA, current replica set) once the plan is accepted, so every
recorded plan can be replayed.

Legend: R ranks, E experts, S slots per rank, P replicas (CSR, grouped by expert; see ``split``).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from ultraep.plan import Plan, Transfers
from ultraep.topology import Topology

from .split import even_split, locality_split
from .transfers import RELAY_MODES, schedule_transfers


@runtime_checkable
class Policy(Protocol):
    """What the engine, simulator and ``plan_layer`` call."""

    name: ClassVar[str]

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        """Decide one layer and microbatch. ``load_RE`` is a validated int64 ``[R, E]``; no side effects."""
        ...

    def commit(self, plan: Plan) -> None:
        """Advance the policy's history with an accepted plan (no-op for stateless policies)."""
        ...


def replicas_to_csr(rep_e, rep_rank, rep_slot, rep_quota, num_experts: int):
    """Sort replica rows by expert (stable, so acceptance order is kept) into CSR arrays."""
    rep_e = np.asarray(rep_e, dtype=np.int64)
    order = np.argsort(rep_e, kind="stable")
    counts = np.bincount(rep_e, minlength=num_experts)
    ptr = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    take = lambda a: np.ascontiguousarray(np.asarray(a, dtype=np.int64)[order])  # noqa: E731
    return ptr, take(rep_rank), take(rep_slot), (take(rep_quota) if rep_quota is not None else None)


def assemble_plan(
    policy: str,
    topology: Topology,
    load_RE: np.ndarray,
    rep_ptr: np.ndarray,
    rep_rank: np.ndarray,
    rep_slot: np.ndarray,
    rep_quota: np.ndarray | None,
    *,
    transfer_mask: np.ndarray | None = None,
    relay: str = "auto",
    solve_time_s: float = 0.0,
    info: dict | None = None,
) -> Plan:
    """Build a :class:`Plan` from replicas in CSR form.

    With ``rep_quota`` the quotas are given (quota planners) and tokens are split with locality; without
    it tokens are split evenly over instances (historical balancing) and quotas follow from the split.
    ``transfer_mask[P]`` selects which replicas need their weights sent (default: all).
    """
    t = topology
    R, E, S = t.num_ranks, t.num_experts, t.num_slots
    phy2log = np.full((R, S), -1, dtype=np.int64)
    phy2log[:, : t.num_masters] = t.masters_RM
    counts = np.diff(rep_ptr)
    if rep_rank.size:
        phy2log[rep_rank, rep_slot] = np.repeat(np.arange(E, dtype=np.int64), counts)
    routes = np.zeros((R, R, S), dtype=np.int64)
    quota = np.zeros((R, S), dtype=np.int64)
    if rep_quota is not None:
        locality_split(load_RE, t.home_E, t.master_slot_E, rep_ptr, rep_rank, rep_slot, rep_quota, routes)
        exported = np.zeros(E, dtype=np.int64)
        if rep_quota.size:
            np.add.at(exported, np.repeat(np.arange(E), counts), rep_quota)
            quota[rep_rank, rep_slot] = rep_quota
        quota[t.home_E, t.master_slot_E] = load_RE.sum(axis=0) - exported
    else:
        even_split(load_RE, t.home_E, t.master_slot_E, rep_ptr, rep_rank, rep_slot, routes, quota)
    if rep_rank.size:
        sel_ptr, sel_rank = rep_ptr, rep_rank
        if transfer_mask is not None and not transfer_mask.all():
            keep_e = np.repeat(np.arange(E), counts)[transfer_mask]
            sel_ptr = np.zeros(E + 1, dtype=np.int64)
            np.cumsum(np.bincount(keep_e, minlength=E), out=sel_ptr[1:])
            sel_rank = np.ascontiguousarray(rep_rank[transfer_mask])
        te, ts, td, tb, tg = schedule_transfers(
            t.home_E, sel_ptr, sel_rank, t.expert_bytes, R, t.D, RELAY_MODES[relay]
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
        routes_RRS=routes,
        transfers=transfers,
        solve_time_s=solve_time_s,
        info=info or {},
    )


_EMPTY = np.zeros(0, dtype=np.int64)


def identity_plan(policy: str, topology: Topology, load_RE: np.ndarray, solve_time_s: float = 0.0, info=None) -> Plan:
    """Masters only: every expert's tokens go to its home rank."""
    ptr = np.zeros(topology.num_experts + 1, dtype=np.int64)
    return assemble_plan(policy, topology, load_RE, ptr, _EMPTY, _EMPTY, _EMPTY, solve_time_s=solve_time_s, info=info)
