"""``feplb``: whole-expert moves inside a scale-up domain (FEPLB, Qi, Liu & Zhao, arXiv 2604.19654, §2).
Independent implementation of the published greedy.

FEPLB splits each rank's experts into *static* ones, always computed at home, and a few *dynamic* ones
that may be moved for the current microbatch: the dynamic expert's weights **and all of its tokens** go
to an under-loaded GPU of the same NVLink domain, copied by the copy engine while the static experts
compute, planned by a deterministic greedy on a CPU thread (~50 µs). No token splitting, no cross-domain
moves.

**Mapping onto ultraep's Plan.** ultraep keeps every master in its fixed slot (``0 .. M-1``). A "move" of
expert ``e`` from rank ``h`` to rank ``t`` is represented as a replica of ``e`` in a redundant slot of
``t`` that receives **all** of ``e``'s tokens (quota λ_e) while the master keeps quota 0. The weights
travel as an ordinary transfer (direct, no relay); the slot is a per-microbatch buffer, exactly FEPLB's
``max_num_dyn`` buffers. ``plan.static_overlap = True`` tells the cost model that planning and copies
overlap the static-expert compute.

Legend: R ranks, E experts, M masters per rank, N redundant slots (dynamic buffers per rank), D ranks per
domain.

Steps:

    Step 1: choose the dynamic experts: on every rank the ``num_dynamic`` masters with the highest
            predicted load (an EWMA of committed loads — FEPLB's router predictor; the current load before
            any history exists). Everything else is static.
    Step 2: per domain, repeat the greedy:
              hi = most loaded rank of the domain (ties: lowest id)
              lo = least loaded rank of the domain with a free dynamic buffer, ≠ hi (ties: lowest id)
              e  = busiest not-yet-moved dynamic master of hi with λ_e ≥ min_tokens and
                   load[lo] + λ_e < load[hi]        (the move lowers hi and keeps lo below the old load of
                                                     hi, so the maximum never rises)
              if there is no such e or lo: stop (the domain maximum cannot be lowered by a move)
              move e: load[hi] -= λ_e, load[lo] += λ_e
    Step 3: assemble the plan (replica with quota λ_e on lo, master quota 0) and report the token
            straggler (max − mean of rank load) before and after, FEPLB's metric.

Worked example (``tests/test_feplb.py`` pins it): R = 4 in one domain, E = 8 (M = 2), N = 1, expert
loads λ = [8, 4, 1, 1, 2, 2, 1, 1] → rank loads [12, 2, 4, 2], max 12, mean 5. hi = 0, lo = 1 (load 2,
lowest id among the least loaded); expert 0 (λ 8): 2 + 8 = 10 < 12 → move 0 to rank 1: loads [4, 10, 4, 2].
hi = 1; its only dynamic masters are 2 and 3 (λ 1, not moved); lo = 3 (load 2, free buffer): 2 + 1 < 10 →
move expert 2 to rank 3: [4, 9, 4, 3]. hi = 1 again; ranks 0 and 2 still have a free buffer (load 4
each, lowest id wins): 4 + 1 < 9 → move expert 3 to rank 0: [5, 8, 4, 3]. hi = 1 has no unmoved dynamic
master left (expert 0 arrived by a move and moves only once) → stop. Maximum 12 → 8, straggler 7 → 3.
"""

from __future__ import annotations


import numpy as np
from numba import njit

from ultraep.plan import Plan
from ultraep.topology import Topology

from .base import assemble_plan, identity_plan


@njit(cache=True)
def feplb_greedy(ell_R, lam_E, masters_RM, dynamic_E, D, N, min_tokens):
    """Step 2 for every domain. ``ell_R [R]`` rank loads, ``lam_E [E]`` expert loads, ``dynamic_E [E]``
    bool. Returns the moves ``(expert, target rank, target slot, tokens)``, each ``[P]``, in greedy order,
    and the rank loads after the moves ``[R]``."""
    R = ell_R.shape[0]
    M = masters_RM.shape[1]
    E = lam_E.shape[0]
    loads = ell_R.copy()
    used = np.zeros(R, np.int64)
    moved = np.zeros(E, np.bool_)
    cap = R * N
    out_e = np.empty(cap, np.int64)
    out_r = np.empty(cap, np.int64)
    out_s = np.empty(cap, np.int64)
    out_q = np.empty(cap, np.int64)
    n = 0
    for d in range(R // D):
        d0 = d * D
        while True:
            hi = d0
            for r in range(d0 + 1, d0 + D):
                if loads[r] > loads[hi]:
                    hi = r
            lo = -1
            for r in range(d0, d0 + D):
                if r != hi and used[r] < N and (lo < 0 or loads[r] < loads[lo]):
                    lo = r
            if lo < 0:
                break
            best = -1
            for m in range(M):
                e = masters_RM[hi, m]
                if e < 0 or not dynamic_E[e] or moved[e]:
                    continue
                lam = lam_E[e]
                if lam <= 0 or lam < min_tokens:
                    continue
                if loads[lo] + lam < loads[hi] and (best < 0 or lam > lam_E[best]):
                    best = e
            if best < 0:
                break
            out_e[n] = best
            out_r[n] = lo
            out_s[n] = M + used[lo]
            out_q[n] = lam_E[best]
            n += 1
            used[lo] += 1
            moved[best] = True
            loads[hi] -= lam_E[best]
            loads[lo] += lam_E[best]
    return out_e[:n], out_r[:n], out_s[:n], out_q[:n], loads


def _straggler(loads: np.ndarray) -> float:
    return float(loads.max() - loads.mean()) if loads.size else 0.0


class FeplbPolicy:
    """Whole-expert intra-domain moves (FEPLB).

    Options:
        num_dynamic: dynamic experts per rank (FEPLB recommends 4); capped by the masters per rank.
        min_tokens: τ, the smallest expert load worth moving (FEPLB does not publish a value; default 1).
        ewma: weight of the newest committed load in the predictor that picks the dynamic experts.
    The number of moves a rank may receive is the topology's redundant slots (FEPLB's ``max_num_dyn``).
    """

    name = "feplb"
    #: planning seconds: a CPU greedy of ~50 µs (FEPLB §2), hidden behind static-expert compute (planner_exposed)
    planner_s = 5.0e-5
    #: FEPLB plans on a CPU thread while the static experts compute: its planner is off the critical path
    planner_exposed = False

    def __init__(self, num_dynamic: int = 4, min_tokens: int = 1, ewma: float = 0.3) -> None:
        if num_dynamic < 0:
            from ultraep.errors import ConfigError

            raise ConfigError("feplb.num_dynamic", f"num_dynamic ({num_dynamic}) must be >= 0", num_dynamic)
        self.num_dynamic = int(num_dynamic)
        self.min_tokens = int(min_tokens)
        self.ewma = float(ewma)
        self._pred_E: np.ndarray | None = None

    def dynamic_experts(self, lam_E: np.ndarray, topology: Topology) -> np.ndarray:
        """Step 1: ``[E]`` bool, the ``num_dynamic`` hottest predicted masters of every rank."""
        t = topology
        M = t.num_masters
        k = min(self.num_dynamic, M)
        dyn = np.zeros(t.num_experts, dtype=bool)
        if k == 0:
            return dyn
        if k == M:
            dyn[:] = True
            return dyn
        pred = self._pred_E if self._pred_E is not None and self._pred_E.shape[0] == t.num_experts else lam_E
        m = t.masters_RM
        score = np.where(m >= 0, pred[np.maximum(m, 0)], -np.inf)
        order = np.argsort(-score, axis=1, kind="stable")[:, :k]
        chosen = np.take_along_axis(m, order, axis=1)
        dyn[chosen[chosen >= 0]] = True
        return dyn

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        t = topology
        lam_E = load_RE.sum(axis=0)
        ell_R = np.bincount(t.home_E, weights=lam_E, minlength=t.num_ranks).astype(np.int64)
        info = {"token_straggler_before": _straggler(ell_R)}
        if t.num_redundant_slots == 0 or t.D == 1 or self.num_dynamic == 0:
            info.update(token_straggler_after=info["token_straggler_before"], moves=[], num_dynamic_experts=0)
            return identity_plan(self.name, t, load_RE, info=info, static_overlap=True,
                                 planner_s=self.planner_s)
        dyn = self.dynamic_experts(lam_E, t)
        e, r, s, q, after = feplb_greedy(ell_R, lam_E, t.masters_RM, dyn, t.D, t.num_redundant_slots, self.min_tokens)
        info.update(
            token_straggler_after=_straggler(after),
            num_dynamic_experts=int(dyn.sum()),
            moves=[{"expert": int(a), "src": int(t.home_E[a]), "dst": int(b), "tokens": int(c)}
                   for a, b, c in zip(e, r, q)],
        )
        return assemble_plan(self.name, t, load_RE, e, r, s, q, relay="direct", info=info, static_overlap=True,
                             planner_s=self.planner_s)

    def commit(self, plan: Plan) -> None:
        self.advance(plan.load_RE)

    def advance(self, load_RE: np.ndarray) -> None:
        """History advances with a load (planned and committed, or not planned: a chooser rested it): the
        predictor of the dynamic experts takes it."""
        lam = load_RE.sum(axis=0).astype(np.float64)
        if self._pred_E is None or self._pred_E.shape != lam.shape:
            self._pred_E = lam
        else:
            self._pred_E = self.ewma * lam + (1.0 - self.ewma) * self._pred_E
