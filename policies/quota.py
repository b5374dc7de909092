"""``quota``: the exact-load real-time planner of UltraEP (arXiv 2606.04101, §5; the authors'
``Dots-Infra/UltraEP`` documents the same method). Independent implementation.

Every microbatch and layer, all ranks hold the exact load ``λ[R, E]`` and run this deterministic planner.
It searches the smallest per-rank threshold τ for which a greedy *oracle* can bring every rank's load
down to τ by replicating hot experts into redundant slots. The oracle's key move is that accepting a
transfer both **creates a replica and reserves exactly the tokens it will receive** (its quota), so a
replica that would get little traffic is never created.

Legend: R ranks, E experts, M masters per rank, N redundant slots, S = M + N, D ranks per domain,
P replicas in the plan.

Steps (per scale-up domain; replicas never leave the master's domain):

    Step 1: rank loads ℓ_r = Σ_{e homed on r} λ_e; sources sorted by ℓ (desc), masters by λ_e (desc) —
            with a replica cache, masters that have a resident replica first (see ``QuotaPolicy.plan``).
    Step 2: fast path: τ = ⌊(1 + ε) · mean⌋ (ε = 0.01 by default), oracle with the dynamic floor.
    Step 3: if infeasible, binary search τ in (fast τ, max ℓ] with the same oracle (max ℓ is always
            feasible: nothing moves).
    Step 4: re-run the oracle at the final τ, recording the accepted transfers → replicas and quotas.
    Step 5: locality-aware split of every expert's tokens into ``routes`` (``ultraep.plan.routes.locality_split``).
    Step 6: weight-transfer schedule, direct or two-level relay (``transfers.schedule_transfers``).

The oracle at threshold τ (the best-fit target choice is ours; UltraEP takes the most slack. On the
benchmark loads it cuts the N = 1 final imbalance from 1.05-1.06 to 1.02 and uses fewer replicas):
    exc[r] = max(ℓ_r - τ, 0), slk[r] = max(τ - ℓ_r, 0)
    for each overloaded rank r (by excess, desc), for each master e of r (by λ_e, desc):
        cap = λ_e - 1                      (a master keeps at least one token)
        while exc[r] > 0 and cap > 0:
            targets = ranks of the domain with slk > 0, a free redundant slot, not yet hosting e
            need = min(exc[r], cap)
            t* = the target with the least slack >= need (best fit: one replica finishes the job and the
                 big slacks stay for later sources), else the target with the most slack; ties: lowest rank;
                 but a target already holding a valid copy of e (resident) comes first if it can take the floor
            δ = min(exc[r], slk[t*], cap)
            floor = max(min_replica_quota, ⌈need / |targets|⌉)  (dynamic floor: an even share)
            if δ < floor: stop with this expert
            replica of e on t* with quota δ; exc[r] -= δ; slk[t*] -= δ; cap -= δ
    feasible iff every exc[r] == 0

Worked example (hand-checked; ``tests/test_quota.py`` pins it): R = 4, E = 8 (2 masters per rank), N = 1,
expert loads λ = [10, 2, 3, 3, 2, 2, 1, 1] on one source rank → ℓ = [12, 6, 4, 2], mean 6, imbalance 2.0.
The fast path τ = ⌊6.06⌋ = 6: rank 0 has excess 6, slack is [0, 0, 2, 4]; expert 0 (λ = 10, cap 9) goes
first to rank 3 (δ = min(6, 4, 9) = 4, floor ⌈6/2⌉ = 3), then to rank 2 (δ = min(2, 2, 5) = 2, floor 2).
Quotas of expert 0: 4 on its master, 4 on rank 3, 2 on rank 2 → every rank receives 6, imbalance 1.0,
2 of 4 redundant slots used.
"""

from __future__ import annotations


import numpy as np
from numba import njit

from ultraep.plan import Plan, Replicas, Transfers
from ultraep.topology import Topology


from .base import Stateless, _assemble_arrays, identity_plan
from ultraep.plan.transfers import RELAY_MODES, schedule_transfers, transfers_for


@njit(cache=True)
def _oracle(tau, d0, D, N, M, ell_R, lam_E, src_order, mst_order_RM, min_quota, pref_RE,
            exc, slk, used, mark, out_e, out_r, out_s, out_q):
    """One greedy pass at threshold ``tau`` over the domain ranks ``d0 .. d0 + D - 1``.

    ``pref_RE[t, e] != 0``: rank ``t`` already holds a valid copy of expert ``e`` (a resident replica); such a
    target is taken first (the one with the most slack) whenever it can carry at least the dynamic floor.
    Returns ``(feasible, n)``; the accepted replicas are written to ``out_*[:n]``.
    """
    n_out = 0
    for i in range(D):
        r = d0 + i
        exc[r] = max(ell_R[r] - tau, 0)
        slk[r] = max(tau - ell_R[r], 0)
        used[r] = 0
        mark[r] = -1
    for idx in range(D):
        r = src_order[idx]
        if exc[r] <= 0:
            break  # sources are sorted by load, so no later source is overloaded either
        for m in range(M):
            e = mst_order_RM[r, m]
            if e < 0:
                break
            cap = lam_E[e] - 1 if lam_E[e] > 0 else 0
            mark[r] = e
            while exc[r] > 0 and cap > 0:
                need = min(exc[r], cap)
                best = -1
                fit = -1
                warm = -1
                n_el = 0
                for i in range(D):
                    t = d0 + i
                    if slk[t] > 0 and used[t] < N and mark[t] != e:
                        n_el += 1
                        if best < 0 or slk[t] > slk[best]:
                            best = t
                        if slk[t] >= need and (fit < 0 or slk[t] < slk[fit]):
                            fit = t
                        if pref_RE[t, e] != 0 and (warm < 0 or slk[t] > slk[warm]):
                            warm = t
                if best < 0:
                    break
                if fit >= 0:
                    best = fit
                floor = (need + n_el - 1) // n_el
                if floor < min_quota:
                    floor = min_quota
                if warm >= 0 and min(exc[r], slk[warm], cap) >= floor:
                    best = warm  # a resident replica: no weights to move
                delta = min(exc[r], slk[best], cap)
                if delta < floor:
                    break
                out_e[n_out] = e
                out_r[n_out] = best
                out_s[n_out] = M + used[best]
                out_q[n_out] = delta
                n_out += 1
                used[best] += 1
                mark[best] = e
                exc[r] -= delta
                slk[best] -= delta
                cap -= delta
            if exc[r] <= 0:
                break
    for i in range(D):
        if exc[d0 + i] > 0:
            return False, n_out
    return True, n_out


@njit(cache=True)
def _keep(tmp_e, tmp_r, tmp_s, tmp_q, out_e, out_r, out_s, out_q, at, n):
    """Copy a feasible pass's ``n`` replicas from the scratch buffers to ``out_*[at:at + n]``."""
    out_e[at:at + n] = tmp_e[:n]
    out_r[at:at + n] = tmp_r[:n]
    out_s[at:at + n] = tmp_s[:n]
    out_q[at:at + n] = tmp_q[:n]


@njit(cache=True)
def solve_quota(load_RE, home_E, masters_RM, D, N, eps, min_quota, pref_RE):
    """Steps 1-4 for every domain. Returns replicas ``(e, rank, slot, quota)``, each ``[P]``, in acceptance
    order, and the chosen τ per domain ``[R / D]``.

    Step 1: loads (:func:`_loads`) and the masters' order (:func:`_masters_in_order`). Per domain: nothing
    moves when it is balanced already or has no redundant slot; Step 2: the oracle at the fast threshold;
    if that fails, Steps 3-4: :func:`_search_tau`. The domain loop stays in this function: the planner runs
    on every microbatch, and a compiled call per domain measured ~2 µs slower at EP64 (8 domains).
    """
    R = load_RE.shape[0]
    M = masters_RM.shape[1]
    lam_E, ell_R = _loads(load_RE, home_E)
    mst = _masters_in_order(masters_RM, lam_E, pref_RE)
    cap_out = R * N
    out_e = np.empty(cap_out, np.int64)
    out_r = np.empty(cap_out, np.int64)
    out_s = np.empty(cap_out, np.int64)
    out_q = np.empty(cap_out, np.int64)
    # scratch for one oracle pass; a feasible pass is copied to out_* (the last feasible one wins)
    tmp_e = np.empty(D * N, np.int64)
    tmp_r = np.empty(D * N, np.int64)
    tmp_s = np.empty(D * N, np.int64)
    tmp_q = np.empty(D * N, np.int64)
    exc = np.zeros(R, np.int64)
    slk = np.zeros(R, np.int64)
    used = np.zeros(R, np.int64)
    mark = np.full(R, -1, np.int64)
    n_dom = R // D
    tau_dom = np.zeros(n_dom, np.int64)
    n_out = 0
    for d in range(n_dom):
        d0 = d * D
        total = 0
        hi = 0
        for i in range(D):
            total += ell_R[d0 + i]
            hi = max(hi, ell_R[d0 + i])
        lo = (total + D - 1) // D
        tau_dom[d] = hi
        if N == 0 or D == 1 or hi <= lo:
            continue
        src_order = d0 + np.argsort(-ell_R[d0:d0 + D], kind="mergesort")
        # Step 2: fast path at (1 + eps) * mean.
        tau = max(lo, int(np.floor(total * (1.0 + eps) / D)))
        if tau >= hi:
            continue
        ok, n = _oracle(tau, d0, D, N, M, ell_R, lam_E, src_order, mst, min_quota, pref_RE,
                        exc, slk, used, mark, tmp_e, tmp_r, tmp_s, tmp_q)
        if ok:  # Step 4: keep the fast pass's replicas
            _keep(tmp_e, tmp_r, tmp_s, tmp_q, out_e, out_r, out_s, out_q, n_out, n)
        else:  # Steps 3-4: the smallest feasible τ, its replicas kept as it searches
            tau, n = _search_tau(tau, hi, total, d0, D, N, M, eps, min_quota, ell_R, lam_E, src_order, mst,
                                 pref_RE, exc, slk, used, mark, tmp_e, tmp_r, tmp_s, tmp_q,
                                 out_e, out_r, out_s, out_q, n_out)
        tau_dom[d] = tau
        n_out += n
    return out_e[:n_out], out_r[:n_out], out_s[:n_out], out_q[:n_out], tau_dom


@njit(cache=True)
def _loads(load_RE, home_E):
    """Step 1a: expert loads ``λ [E]`` and rank loads ``ℓ [R]`` (each rank's masters' total)."""
    R, E = load_RE.shape
    lam_E = np.zeros(E, np.int64)
    for r in range(R):
        lrow = load_RE[r]
        for e in range(E):
            lam_E[e] += lrow[e]
    ell_R = np.zeros(R, np.int64)
    for e in range(E):
        ell_R[home_E[e]] += lam_E[e]
    return lam_E, ell_R


@njit(cache=True)
def _masters_in_order(masters_RM, lam_E, pref_RE):
    """Step 1b: each rank's masters ``[R, M]`` by load (desc, ids asc; -1 padding last), masters that have a
    resident replica somewhere first (stable)."""
    R, M = masters_RM.shape
    E = lam_E.shape[0]
    mst = masters_RM.copy()
    for r in range(R):  # insertion sort of each rank's masters by load desc, id asc
        for a in range(1, M):
            v = mst[r, a]
            b = a - 1
            while b >= 0 and v >= 0 and (mst[r, b] < 0 or lam_E[mst[r, b]] < lam_E[v] or
                                         (lam_E[mst[r, b]] == lam_E[v] and mst[r, b] > v)):
                mst[r, b + 1] = mst[r, b]
                b -= 1
            mst[r, b + 1] = v
    # resident experts first (stable): a source sheds load through replicas that already exist before it
    # creates new ones, so a persistent skew keeps its placement even when the hot experts' order shuffles
    warm_E = np.zeros(E, np.bool_)
    for t in range(R):
        for e in range(E):
            if pref_RE[t, e] != 0:
                warm_E[e] = True
    if warm_E.any():
        for r in range(R):
            row = mst[r].copy()
            k = 0
            for a in range(M):
                if row[a] >= 0 and warm_E[row[a]]:
                    mst[r, k] = row[a]
                    k += 1
            for a in range(M):
                if not (row[a] >= 0 and warm_E[row[a]]):
                    mst[r, k] = row[a]
                    k += 1
    return mst


@njit(cache=True)
def _search_tau(tau, hi, total, d0, D, N, M, eps, min_quota, ell_R, lam_E, src_order, mst, pref_RE,
                exc, slk, used, mark, tmp_e, tmp_r, tmp_s, tmp_q, out_e, out_r, out_s, out_q, n_out):
    """Steps 3-4 for one domain whose fast threshold ``tau`` failed: gallop up from it (steps of eps * mean,
    doubling) to a feasible τ, then bisect between the last failure and it, down to a resolution of
    mean / 2048. Every feasible pass's replicas are copied to ``out_*[n_out:]`` (a later feasible pass
    replaces them). Returns ``(τ, replicas kept)``; none kept when only ``hi`` (nothing moves) is feasible."""
    n_best = -1
    step = max(1, int(np.ceil(eps * total / D)))
    a = tau + 1
    b = hi
    probe = tau + step
    while probe < hi:
        ok_p, n = _oracle(probe, d0, D, N, M, ell_R, lam_E, src_order, mst, min_quota, pref_RE,
                          exc, slk, used, mark, tmp_e, tmp_r, tmp_s, tmp_q)
        if ok_p:
            b = probe
            n_best = n
            _keep(tmp_e, tmp_r, tmp_s, tmp_q, out_e, out_r, out_s, out_q, n_out, n)
            break
        a = probe + 1
        step *= 2
        probe = tau + step
    resolution = max(1, total // (D * 2048))
    while b - a >= resolution:
        mid = (a + b) // 2
        ok_mid, n = _oracle(mid, d0, D, N, M, ell_R, lam_E, src_order, mst, min_quota, pref_RE,
                            exc, slk, used, mark, tmp_e, tmp_r, tmp_s, tmp_q)
        if ok_mid:
            b = mid
            n_best = n
            _keep(tmp_e, tmp_r, tmp_s, tmp_q, out_e, out_r, out_s, out_q, n_out, n)
        else:
            a = mid + 1
    if b >= hi or n_best <= 0:
        return b, 0
    return b, n_best


@njit(cache=True)
def quota_plan_arrays(load_RE, home_E, master_slot_E, masters_RM, S, D, N, eps, min_quota, expert_bytes,
                      relay_mode, pref_RE):
    """Steps 1-4 and 6 in one compiled call (one dispatch on the hot path); routes (step 5) stay lazy."""
    e, r, s, q, tau = solve_quota(load_RE, home_E, masters_RM, D, N, eps, min_quota, pref_RE)
    ptr, rr, ss, qq, _, phy2log, quota, _ = _assemble_arrays(
        load_RE, home_E, master_slot_E, masters_RM, S, e, r, s, q, True
    )
    te, ts, td, tb, tg = schedule_transfers(home_E, ptr, rr, expert_bytes, masters_RM.shape[0], D, relay_mode)
    # Few, packed return values: every array handed back to Python costs a boxing step (~1 µs).
    reps = np.empty((3, rr.shape[0]), np.int64)
    reps[0] = rr
    reps[1] = ss
    reps[2] = qq
    trans = np.empty((5, te.shape[0]), np.int64)
    trans[0] = te
    trans[1] = ts
    trans[2] = td
    trans[3] = tb
    trans[4] = tg
    return phy2log, quota, ptr, reps, trans, tau


class QuotaPolicy(Stateless):
    """Exact-load real-time balancing (UltraEP). Stateless: ``commit`` does nothing.

    Options:
        balance_eps: target threshold (1 + ε) · mean of the fast path (UltraEP: 0.01).
        min_replica_quota: smallest quota a new replica may carry, in tokens, on top of the dynamic
            floor (UltraEP's fixed u_min is 1024 for 8k-token microbatches; default 1 lets the dynamic
            floor alone decide, which scales with the microbatch).
        relay: weight-transfer tree, ``auto`` | ``direct`` | ``always``.
    """

    name = "quota"
    #: planning seconds on the critical path (the cost model's seed; calibration scales it): UltraEP's GPU
    #: planner 0.07 ms + reroute 0.04 ms at EP64 (UltraEP README)
    planner_s = 1.1e-4
    #: stateless with its planner on the critical path: a chooser may skip planning it when even a perfect
    #: balance could not pay for that planner (adaptive's Step 1 gain bound)
    screenable = True

    def __init__(self, balance_eps: float = 0.01, min_replica_quota: int = 1, relay: str = "auto",
                 cache_tolerance: float = 0.02) -> None:
        self.balance_eps = float(balance_eps)
        self.min_replica_quota = int(min_replica_quota)
        self.relay = relay
        self.cache_tolerance = float(cache_tolerance)
        self._relay_mode = RELAY_MODES[relay]
        self._no_pref: np.ndarray | None = None

    #: the planner can prefer replicas that are already resident (the engine passes ``resident_RE``)
    uses_residency = True

    def _solve(self, load_RE: np.ndarray, t: Topology, pref_RE: np.ndarray):
        return quota_plan_arrays(
            load_RE, t.home_E, t.master_slot_E, t.masters_RM, t.num_slots, t.D, t.num_redundant_slots,
            self.balance_eps, self.min_replica_quota, t.expert_bytes, self._relay_mode, pref_RE,
        )

    def plan(self, load_RE: np.ndarray, topology: Topology, resident_RE: np.ndarray | None = None) -> Plan:
        """Plan one layer. ``resident_RE[r, e]`` (optional, bool): rank ``r`` already holds valid weights of
        expert ``e``. The oracle then places a replica on such a rank first, and that plan is kept when its
        threshold τ is within ``cache_tolerance`` x the mean rank load of the plan that ignores residency
        (which is solved only when the resident plan misses the fast-path τ): a near-equal balance with no
        weights to move beats a marginally better one that moves them. Deterministic in its inputs, so
        every rank holding the same ``resident_RE`` computes the same plan."""
        t = topology
        if t.num_redundant_slots == 0 or t.D == 1:
            return identity_plan(self.name, t, load_RE, planner_s=self.planner_s)
        if self._no_pref is None or self._no_pref.shape != (t.num_ranks, t.num_experts):
            self._no_pref = np.zeros((t.num_ranks, t.num_experts), dtype=np.int8)
        blind = self._no_pref
        if resident_RE is None or not resident_RE.any():
            out = self._solve(load_RE, t, blind)
        else:
            out = self._solve(load_RE, t, np.ascontiguousarray(resident_RE, dtype=np.int8))
            tau = out[-1]
            ell_R = np.bincount(t.home_E, weights=load_RE.sum(axis=0), minlength=t.num_ranks)
            dom = ell_R.reshape(-1, t.D).sum(axis=1)  # [R / D] tokens per domain
            fast = np.maximum(np.ceil(dom / t.D), np.floor(dom * (1.0 + self.balance_eps) / t.D))
            if (tau > fast).any():  # the resident plan missed the fast path: compare with the blind plan
                other = self._solve(load_RE, t, blind)
                if (tau - other[-1]).max() > self.cache_tolerance * ell_R.mean():
                    out = other
        phy2log, quota, ptr, reps, trans, tau = out
        plan = Plan(
            policy=self.name,
            topology=t,
            load_RE=load_RE,
            phy2log_RS=phy2log,
            quota_RS=quota,
            replicas=Replicas(ptr, reps[0], reps[1], reps[2]),
            transfers=Transfers(trans[0], trans[1], trans[2], trans[3], trans[4]),
            info={"tau": tau},
            planner_s=self.planner_s,
        )
        return plan if resident_RE is None else transfers_for(plan, resident_RE, self.relay)
