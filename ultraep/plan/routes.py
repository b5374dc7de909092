"""Exact integer token splits: from an instance placement and quotas to ``routes[src, r, s]``.

Part of the vocabulary: :attr:`ultraep.plan.Plan.routes_RRS` derives the locality-aware split on first
use, and the policies (``policies/``) use both splits when they build plans. Compiled with numba.

Legend: R ranks, E experts, S slots per rank, P replicas in the plan (redundant slots in use),
C instances of one expert (its master and its replicas), I instances of all replicated experts.

Replicas are passed in CSR form grouped by expert: ``rep_ptr[E + 1]``; for ``k in rep_ptr[e]:rep_ptr[e+1]``
replica ``k`` of expert ``e`` lives in slot ``rep_slot[k]`` of rank ``rep_rank[k]`` and receives
``rep_quota[k]`` tokens. The master of ``e`` lives at ``(home[e], master_slot[e])`` and receives
``λ_e - Σ rep_quota``.

Both splits here are exact in integers and satisfy the two conservation laws by construction:
``Σ_instances routes[src, ·] = load[src, e]`` and ``Σ_src routes[·, r, s] = quota[r, s]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def locality_split(load_RE, home_E, master_slot_E, rep_ptr, rep_rank, rep_slot, rep_quota, routes_RRS):
    """Locality-aware split (UltraEP §5.2) written into ``routes_RRS`` (zeroed ``[R, R, S]``).

    Step 1: an expert with one instance receives every source's tokens at its master
            (:func:`_route_master_only`).
    Step 2: for a replicated expert, tokens that start on a rank holding an instance stay there, up to
            that instance's quota (``local_j = min(λ[h_j, e], q_j)``; :func:`_local_fill`).
    Step 3: each source's remaining tokens are shared across instances in proportion to their remaining
            capacity ``rc_j = q_j - local_j``: floors first (:func:`_proportional_floors`), then the
            deficits by largest remainder (ties: lower host rank; :func:`_largest_remainders`), never
            giving an instance more than its remaining capacity, so the column sums (quotas) are exact as
            well as the row sums (loads).
    Step 4: scatter the replicated experts' allocations into ``routes`` (:func:`_scatter`).

    Memory layout matters more than arithmetic here: ``routes`` is written source-major (steps 1 and 4)
    and replicated experts are solved in a compact ``alloc[R, I]`` buffer, one ``[R, C]`` block each.
    """
    R, E = load_RE.shape
    S = routes_RRS.shape[2]
    flat = routes_RRS.reshape(R, R * S)  # row views: writes stay inside routes[src]
    _route_master_only(load_RE, home_E, master_slot_E, rep_ptr, S, flat)
    if rep_ptr[E] == 0:
        return
    ioff, n_inst, max_c = _instance_blocks(rep_ptr)
    inst_h = np.empty(n_inst, np.int64)
    inst_s = np.empty(n_inst, np.int64)
    alloc = np.zeros((R, n_inst), np.int64)  # alloc[src, instance]
    # Scratch reused by every expert (one allocation per call, not per expert).
    rc = np.empty(max_c, np.int64)       # remaining capacity per instance
    cdef = np.empty(max_c, np.int64)     # remaining deficit per instance (column)
    frac = np.empty(max_c, np.int64)
    order = np.empty(max_c, np.int64)
    on_rank = np.full(R, -1, np.int64)   # local tokens kept on a rank holding an instance, else -1
    rem_R = np.zeros(R, np.int64)        # tokens of each source still to place
    fr = np.zeros((R, max_c), np.int64)  # remainders of the proportional floors
    for e in range(E):
        k0 = rep_ptr[e]
        C = rep_ptr[e + 1] - k0 + 1
        if C == 1:
            continue
        o = ioff[e]
        _list_instances(e, k0, C, o, load_RE, home_E, master_slot_E, rep_rank, rep_slot, rep_quota,
                        inst_h, inst_s, rc)
        total = _local_fill(e, C, o, load_RE, inst_h, rc, cdef, on_rank, rem_R, alloc)
        if total == 0:
            continue
        _proportional_floors(C, o, total, rc, cdef, rem_R, fr, alloc)
        _largest_remainders(C, o, inst_h, cdef, rem_R, fr, frac, order, alloc)
    _scatter(inst_h, inst_s, alloc, S, flat)


@njit(cache=True)
def _route_master_only(load_RE, home_E, master_slot_E, rep_ptr, S, flat):
    """Step 1: every source's tokens of a master-only expert go to its master (``flat`` is ``[R, R*S]``)."""
    R, E = load_RE.shape
    gid = np.empty(E, np.int64)
    n_single = 0
    for e in range(E):
        if rep_ptr[e + 1] == rep_ptr[e]:
            gid[n_single] = e
            n_single += 1
    dst = np.empty(n_single, np.int64)
    for i in range(n_single):
        dst[i] = home_E[gid[i]] * S + master_slot_E[gid[i]]
    for src in range(R):
        row = flat[src]
        lrow = load_RE[src]
        for i in range(n_single):
            row[dst[i]] = lrow[gid[i]]


@njit(cache=True)
def _instance_blocks(rep_ptr):
    """Where each replicated expert's instances start in the compact buffers: ``(ioff [E + 1] (-1 for a
    master-only expert), I, the largest C)``."""
    E = rep_ptr.shape[0] - 1
    ioff = np.full(E + 1, -1, np.int64)
    n_inst = 0
    max_c = 1
    for e in range(E):
        c = rep_ptr[e + 1] - rep_ptr[e] + 1
        if c > 1:
            ioff[e] = n_inst
            n_inst += c
        if c > max_c:
            max_c = c
    return ioff, n_inst, max_c


@njit(cache=True)
def _list_instances(e, k0, C, o, load_RE, home_E, master_slot_E, rep_rank, rep_slot, rep_quota,
                    inst_h, inst_s, rc):
    """Expert ``e``'s instances at ``inst_*[o:o + C]`` (master first) and their quotas in ``rc[:C]``
    (the master's: ``λ_e`` minus the replicas' quotas)."""
    lam = 0
    for src in range(load_RE.shape[0]):
        lam += load_RE[src, e]
    inst_h[o] = home_E[e]
    inst_s[o] = master_slot_E[e]
    rc[0] = lam
    for j in range(1, C):
        inst_h[o + j] = rep_rank[k0 + j - 1]
        inst_s[o + j] = rep_slot[k0 + j - 1]
        rc[j] = rep_quota[k0 + j - 1]
        rc[0] -= rep_quota[k0 + j - 1]


@njit(cache=True)
def _local_fill(e, C, o, load_RE, inst_h, rc, cdef, on_rank, rem_R, alloc):
    """Step 2: each instance keeps its host's own tokens up to its quota. Leaves the remaining capacity in
    ``rc`` and ``cdef``, each source's remaining tokens in ``rem_R``; returns the total remaining capacity."""
    R = load_RE.shape[0]
    for j in range(C):
        hj = inst_h[o + j]
        local = min(load_RE[hj, e], rc[j])
        alloc[hj, o + j] = local
        rc[j] -= local
        on_rank[hj] = local
    total = 0
    for j in range(C):
        total += rc[j]
        cdef[j] = rc[j]
    for src in range(R):
        rem = load_RE[src, e]
        if on_rank[src] >= 0:
            rem -= on_rank[src]
        rem_R[src] = rem
    for j in range(C):
        on_rank[inst_h[o + j]] = -1
    return total


@njit(cache=True)
def _proportional_floors(C, o, total, rc, cdef, rem_R, fr, alloc):
    """Step 3a: each source gives instance ``j`` ``floor(rem * rc_j / total)`` tokens; the remainders go to
    ``fr``. The floor is taken in floating point and corrected to the exact integer, so no integer
    division sits in the loop."""
    inv_total = 1.0 / total
    for src in range(rem_R.shape[0]):
        rem = rem_R[src]
        if rem <= 0:
            continue
        for j in range(C):
            num = rem * rc[j]
            x = np.int64(num * inv_total)
            if x * total > num:
                x -= 1
            elif (x + 1) * total <= num:
                x += 1
            fr[src, j] = num - x * total
            alloc[src, o + j] += x
            cdef[j] -= x
            rem_R[src] -= x


@njit(cache=True)
def _largest_remainders(C, o, inst_h, cdef, rem_R, fr, frac, order, alloc):
    """Step 3b: each source's leftover tokens by largest remainder (ties: lower host rank), bounded by each
    column's remaining deficit; if the remainders run out (rare: earlier sources took those columns'
    deficits), the instance with the largest deficit takes the rest."""
    for src in range(rem_R.shape[0]):
        d = rem_R[src]
        if d <= 0:
            continue
        for j in range(C):
            frac[j] = fr[src, j]
            order[j] = j
        for a in range(1, C):  # insertion sort: remainder desc, then host rank asc
            v = order[a]
            b = a - 1
            while b >= 0 and (frac[order[b]] < frac[v] or
                              (frac[order[b]] == frac[v] and inst_h[o + order[b]] > inst_h[o + v])):
                order[b + 1] = order[b]
                b -= 1
            order[b + 1] = v
        for a in range(C):
            if d == 0:
                break
            j = order[a]
            if frac[j] > 0 and cdef[j] > 0:
                alloc[src, o + j] += 1
                cdef[j] -= 1
                d -= 1
        while d > 0:
            best = -1
            for j in range(C):
                if cdef[j] > 0 and (best < 0 or cdef[j] > cdef[best]):
                    best = j
            alloc[src, o + best] += 1
            cdef[best] -= 1
            d -= 1


@njit(cache=True)
def _scatter(inst_h, inst_s, alloc, S, flat):
    """Step 4: add the replicated experts' allocations to ``routes``, source-major."""
    n_inst = inst_h.shape[0]
    idst = np.empty(n_inst, np.int64)
    for i in range(n_inst):
        idst[i] = inst_h[i] * S + inst_s[i]
    for src in range(alloc.shape[0]):
        row = flat[src]
        arow = alloc[src]
        for i in range(n_inst):
            row[idst[i]] += arow[i]


@njit(cache=True)
def even_split(load_RE, home_E, master_slot_E, rep_ptr, rep_rank, rep_slot, routes_RRS, quota_RS):
    """Even split (historical balancing): each source spreads ``λ[src, e]`` over e's instances in equal
    parts, the remainder going round-robin with a per-source offset so the totals stay even too.
    Quotas are the column sums of the result. Writes ``routes_RRS`` and ``quota_RS`` (both zeroed).
    """
    R, E = load_RE.shape
    for e in range(E):
        k0 = rep_ptr[e]
        C = rep_ptr[e + 1] - k0 + 1
        h0 = home_E[e]
        s0 = master_slot_E[e]
        for src in range(R):
            x = load_RE[src, e]
            if x == 0:
                continue
            base = x // C
            extra = x % C
            for j in range(C):
                part = base
                if (j - src) % C < extra:
                    part += 1
                if part == 0:
                    continue
                if j == 0:
                    r, s = h0, s0
                else:
                    r, s = rep_rank[k0 + j - 1], rep_slot[k0 + j - 1]
                routes_RRS[src, r, s] += part
                quota_RS[r, s] += part
