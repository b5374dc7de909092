"""The plan: everything a policy decides for one MoE layer and one microbatch.

Legend:
    R  ranks   E  logical experts   M  master slots per rank   N  redundant slots   S = M + N
    T  transfers in the plan

Arrays (all int64, read-only):
    load_RE      ``[R, E]``    λ: token–expert assignments source rank r routes to expert e
    phy2log_RS   ``[R, S]``    logical expert held by slot s of rank r; slots 0..M-1 are masters, -1 = empty
    quota_RS     ``[R, S]``    tokens the instance in slot s of rank r receives
    routes_RRS   ``[R, R, S]`` tokens source rank src sends to instance (r, s) (derived on first use)

Invariants (checked by :meth:`Plan.check`, asserted by the property tests for every policy):
    * master slots hold exactly ``home``'s experts; replicas only in redundant slots, at most one instance
      of an expert per rank, replicas inside their master's domain;
    * ``routes.sum(axis=0) == quota`` (instances receive their quota) and, for every source and expert,
      routes summed over that expert's instances equal ``load[src, e]`` (load is conserved);
    * empty slots receive nothing.

The package holds the plan and the parts it is made of, all vocabulary (no import of ``policies/``, the
runtime or the simulator): :mod:`.routes` (the exact integer token splits ``routes_RRS`` is derived with),
:mod:`.transfers` (the weight-transfer schedule, and the transfers of exactly the non-resident replicas),
:mod:`.traffic` (what a plan makes every rank send, receive and compute, which the cost model prices) and
:mod:`.metrics` (imbalance and the other balance figures, from raw counts). The numba-compiled parts load on
first use: ``import ultraep.plan`` stays numpy-only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

import numpy as np

from ultraep.plan.metrics import imbalance
from ultraep.topology import Topology


@dataclass(frozen=True)
class Transfers:
    """Expert-state movements of a plan, as columns of equal length ``[T]``.

    ``stage`` 0 is a direct send from the master's rank; stage 1 is a relay rank forwarding a copy it
    received in stage 0 to one of its children (two-level relay tree).
    """

    expert: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    bytes: np.ndarray
    stage: np.ndarray

    @staticmethod
    def empty() -> "Transfers":
        z = np.zeros(0, dtype=np.int64)
        return Transfers(z, z, z, z, z)

    def __len__(self) -> int:
        return int(self.expert.shape[0])

    def send_bytes_R(self, num_ranks: int) -> np.ndarray:
        """``[R]`` bytes each rank sends."""
        return np.bincount(self.src, weights=self.bytes, minlength=num_ranks).astype(np.int64)

    def rows(self) -> list[dict[str, int]]:
        return [
            {"expert": int(e), "src": int(s), "dst": int(d), "bytes": int(b), "stage": int(g)}
            for e, s, d, b, g in zip(self.expert, self.src, self.dst, self.bytes, self.stage)
        ]


@dataclass(frozen=True)
class Replicas:
    """The plan's replicas grouped by expert (CSR), ``P`` rows in all.

    For ``k in ptr[e]:ptr[e + 1]``, replica ``k`` of expert ``e`` sits in slot ``slot[k]`` of rank ``rank[k]``
    and receives ``quota[k]`` tokens. ``ptr`` is ``[E + 1]``; the others are ``[P]``.
    """

    ptr: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    quota: np.ndarray

    def __len__(self) -> int:
        return int(self.rank.shape[0])


@dataclass(frozen=True)
class Choice:
    """How a policy that chooses among candidates (``adaptive``) decided one plan.

    chosen       the candidate whose plan this is          reason       why, in words
    predictions  ``{candidate: predicted layer seconds}`` (corrected by measured outcomes where known)
    predicted_s  the chosen plan's prediction, with the engine's own overhead
    probe        True when the candidate ran only to be measured (bounded-regret re-probe)
    """

    chosen: str
    reason: str
    predictions: dict[str, float]
    predicted_s: float
    screened: tuple[str, ...] = ()
    probe: bool = False


@dataclass(frozen=True)
class ExpertDomains:
    """A transmission overlay on a masters-only plan (HybridEP, ``policies/hybridep.py``), read by the cost model.

    Scale-out domains are grouped into expert domains of ``size`` consecutive domains (``size`` ≥ 2; plain EP has
    no overlay). Every rank fetches the first ``fetched`` masters of each same-offset peer in its expert domain
    (weights compressed ``compression``×) and computes its own domain's tokens for them; every other token goes
    to its expert's home rank (:func:`ultraep.plan.traffic.hybrid_destinations`).
    """

    size: int
    fetched: int
    compression: float = 1.0


@dataclass(frozen=True)
class Plan:
    """One layer's balancing decision. Immutable; derived figures are computed on first access.

    Besides the placement, typed facts tell the cost model how the plan runs (set by the policy that made it,
    kept by a policy that passes another's plan on): ``expert_domains`` (HybridEP's weight-fetching overlay) and
    ``static_overlap`` (FEPLB: planning and replica copies run while the static masters compute, only the excess
    is exposed). A policy that chose among candidates (``adaptive``) adds its ``choice`` and what the choice
    costs: ``engine_s`` (its exposed decision overhead), ``planner_s`` (the chosen candidate's planning seconds,
    when not the preset's) and ``sync_s`` (a weight sync other than the transfers', e.g. a historical placement
    switched to). ``info`` holds the policy's own diagnostics (recorded by telemetry, read by the policy and its
    tests), never read across packages."""

    policy: str
    topology: Topology
    load_RE: np.ndarray
    phy2log_RS: np.ndarray
    quota_RS: np.ndarray
    replicas: Replicas
    transfers: Transfers
    solve_time_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    routes: np.ndarray | None = field(default=None, repr=False)
    """Precomputed ``routes_RRS`` (even split); ``None`` = derive the locality-aware split on first use."""
    expert_domains: ExpertDomains | None = None
    static_overlap: bool = False
    choice: Choice | None = None
    engine_s: float = 0.0
    planner_s: float | None = None
    sync_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("load_RE", "phy2log_RS", "quota_RS"):
            getattr(self, name).setflags(write=False)

    def with_solve_time(self, seconds: float) -> "Plan":
        """A copy of this plan whose ``solve_time_s`` is ``seconds`` (measured by whoever called the policy:
        :func:`ultraep.policies.plan_resident`). The copy shares every array and ``info``."""
        return self.replaced(solve_time_s=float(seconds))

    def replaced(self, **changes) -> "Plan":
        """``dataclasses.replace(self, **changes)`` that keeps what was derived from the placement: where ``changes``
        leave the load, placement, quotas, replicas, routes, transfers and overlay as they are (a policy name, the
        costs, the choice, diagnostics), the copy shares this plan's derived figures (its cached properties and what
        the cost model derived from it, :func:`ultraep.cost.model.plan_memo`) instead of deriving them again: the
        adaptive engine hands on a candidate's plan as its own, and the engine predicts that copy."""
        if _STRUCTURE.intersection(changes) or not _FIELDS.issuperset(changes):
            return replace(self, **changes)  # (a new placement: derived again; an unknown field: replace's TypeError)
        # the same placement: this plan's fields and derived figures, with ``changes`` (dataclasses.replace runs the
        # constructor and __post_init__ again: most of the time of handing a candidate's plan on)
        out = object.__new__(type(self))
        d = out.__dict__
        d.update(self.__dict__)
        d.update(changes)
        return out

    @property
    def decision(self) -> Choice | None:
        """The typed choice of a policy that chose among candidates; None for a fixed policy."""
        return self.choice

    @property
    def chosen_policy(self) -> str:
        """The policy whose plan this is: the candidate an ``adaptive`` layer chose, else ``policy``."""
        d = self.decision
        return d.chosen if d is not None else self.policy

    @cached_property
    def routes_RRS(self) -> np.ndarray:
        """``[R, R, S]`` tokens each source rank sends to each instance (read-only).

        Quota planners leave it to first use: the decision (placement, quotas, transfers) is what sits on
        the critical path; each rank then needs only its own row and column of the split.
        """
        if self.routes is not None:
            arr = self.routes
        else:
            # Imported here, not at the top: ultraep.plan.routes is numba-compiled and `import ultraep.plan`
            # stays numpy-only, as `import ultraep` promises (numba loads when a split is first needed).
            from ultraep.plan.routes import locality_split

            t = self.topology
            arr = np.zeros((t.num_ranks, t.num_ranks, t.num_slots), dtype=np.int64)
            r = self.replicas
            locality_split(self.load_RE, t.home_E, t.master_slot_E, r.ptr, r.rank, r.slot, r.quota, arr)
        arr.setflags(write=False)
        return arr

    # ------------------------------------------------------------------ derived figures
    @cached_property
    def expert_load_E(self) -> np.ndarray:
        """``[E]`` total load of each logical expert (λ_e)."""
        return self.load_RE.sum(axis=0)

    @cached_property
    def rank_load_before_R(self) -> np.ndarray:
        """``[R]`` tokens each rank would receive without balancing (its masters' total load)."""
        return np.bincount(
            self.topology.home_E, weights=self.expert_load_E, minlength=self.topology.num_ranks
        ).astype(np.int64)

    @cached_property
    def rank_load_after_R(self) -> np.ndarray:
        """``[R]`` tokens each rank receives under the plan."""
        return self.quota_RS.sum(axis=1)

    @cached_property
    def imbalance_before(self) -> float:
        return imbalance(self.rank_load_before_R)

    @cached_property
    def imbalance_after(self) -> float:
        return imbalance(self.rank_load_after_R)

    @cached_property
    def replica_count_E(self) -> np.ndarray:
        """``[E]`` instances of each expert (1 = master only)."""
        held = self.phy2log_RS[self.phy2log_RS >= 0]
        return np.bincount(held, minlength=self.topology.num_experts).astype(np.int64)

    @cached_property
    def num_replicas(self) -> int:
        """Redundant slots in use."""
        M = self.topology.num_masters
        return int(np.count_nonzero(self.phy2log_RS[:, M:] >= 0))

    @cached_property
    def busiest_sender_bytes(self) -> int:
        if len(self.transfers) == 0:
            return 0
        return int(self.transfers.send_bytes_R(self.topology.num_ranks).max())

    def log2phy(self) -> np.ndarray:
        """``[E, max_instances]`` global slot ids ``r * S + s`` of each expert's instances, master first,
        padded with -1 (EPLB's ``log2phy``)."""
        S = self.topology.num_slots
        E = self.topology.num_experts
        width = int(self.replica_count_E.max()) if E else 0
        out = np.full((E, max(width, 1)), -1, dtype=np.int64)
        fill = np.zeros(E, dtype=np.int64)
        for gid in range(self.phy2log_RS.size):  # small: R * S
            e = self.phy2log_RS.flat[gid]
            if e >= 0:
                out[e, fill[e]] = gid
                fill[e] += 1
        return out

    def digest(self) -> str:
        """A hash of the decision (placement, quotas, routes): equal on every rank iff plans agree."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.policy.encode())
        for arr in (self.phy2log_RS, self.quota_RS, self.routes_RRS):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        return h.hexdigest()

    def summary(self) -> dict[str, Any]:
        """Headline figures, JSON-ready."""
        return {
            "policy": self.policy,
            "imbalance_before": self.imbalance_before,
            "imbalance_after": self.imbalance_after,
            "rank_load_before": self.rank_load_before_R.tolist(),
            "rank_load_after": self.rank_load_after_R.tolist(),
            "num_replicas": self.num_replicas,
            "max_instances_per_expert": int(self.replica_count_E.max()) if self.replica_count_E.size else 0,
            "num_transfers": len(self.transfers),
            "busiest_sender_bytes": self.busiest_sender_bytes,
            "solve_time_s": self.solve_time_s,
        }

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise ``AssertionError`` naming the first violated invariant (see module docstring)."""
        t = self.topology
        R, E, M, S = t.num_ranks, t.num_experts, t.num_masters, t.num_slots
        p, q, routes, load = self.phy2log_RS, self.quota_RS, self.routes_RRS, self.load_RE
        assert p.shape == (R, S), f"phy2log shape {p.shape} != {(R, S)}"
        assert q.shape == (R, S), f"quota shape {q.shape} != {(R, S)}"
        assert routes.shape == (R, R, S), f"routes shape {routes.shape} != {(R, R, S)}"
        assert load.shape == (R, E), f"load shape {load.shape} != {(R, E)}"
        assert np.array_equal(p[:, :M], t.masters_RM), "master slots differ from home placement"
        assert ((p >= -1) & (p < E)).all(), "phy2log holds an id outside -1..E-1"
        for r in range(R):
            held = p[r][p[r] >= 0]
            assert len(np.unique(held)) == len(held), f"rank {r} holds an expert twice: {held}"
            for s in range(M, S):
                e = p[r, s]
                if e >= 0:
                    assert t.domain_R[t.home_E[e]] == t.domain_R[r], (
                        f"replica of expert {e} on rank {r} leaves its master's domain"
                    )
        assert (q >= 0).all() and (routes >= 0).all(), "negative quota or route"
        assert (q[p < 0] == 0).all(), "an empty slot has quota"
        assert np.array_equal(routes.sum(axis=0), q), "routes summed over sources != quota"
        # Load conservation: for each source, routes into e's instances sum to load[src, e].
        pe = np.where(p >= 0, p, E)  # empty slots -> a dummy expert E
        per_expert = np.zeros((R, E + 1), dtype=np.int64)
        for src in range(R):
            per_expert[src] = np.bincount(pe.ravel(), weights=routes[src].ravel(), minlength=E + 1)
        assert np.array_equal(per_expert[:, :E], load), "routes summed over instances != load"
        assert per_expert[:, E].sum() == 0, "routes into empty slots"
        tr = self.transfers
        if len(tr):
            assert (p[tr.dst] == tr.expert[:, None]).any(axis=1).all(), "a transfer targets a rank without that replica"


#: Plan's fields that its derived figures depend on (:meth:`Plan.replaced` keeps those figures when none changes)
_STRUCTURE = frozenset({"topology", "load_RE", "phy2log_RS", "quota_RS", "replicas", "transfers", "routes",
                        "expert_domains", "static_overlap"})
_FIELDS = frozenset(f.name for f in fields(Plan))
