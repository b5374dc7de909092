"""Exact integer token splits: from an instance placement and quotas to ``routes[src, r, s]``.

Legend: R ranks, E experts, S slots per rank, P replicas in the plan (redundant slots in use).

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

    Step 1: an expert with one instance receives every source's tokens at its master.
    Step 2: for a replicated expert, tokens that start on a rank holding an instance stay there, up to
            that instance's quota (``local_j = min(λ[h_j, e], q_j)``).
    Step 3: each source's remaining tokens are shared across instances in proportion to their remaining
            capacity ``rc_j = q_j - local_j``: floors first, then the deficits by largest remainder
            (ties: lower host rank), never giving an instance more than its remaining capacity, so the
            column sums (quotas) are exact as well as the row sums (loads).

    Memory layout matters more than arithmetic here: ``routes`` is written source-major (steps 1 and the
    final scatter) and replicated experts are solved in a compact ``[R, C]`` buffer each.
    """
    R, E = load_RE.shape
    P = rep_ptr[E]
    S = routes_RRS.shape[2]
    # Step 1: master-only experts, source-major through row views so writes stay inside routes[src].
    gid = np.empty(E, np.int64)
    n_single = 0
    for e in range(E):
        if rep_ptr[e + 1] == rep_ptr[e]:
            gid[n_single] = e
            n_single += 1
    dst = np.empty(n_single, np.int64)
    for i in range(n_single):
        dst[i] = home_E[gid[i]] * S + master_slot_E[gid[i]]
    flat = routes_RRS.reshape(R, R * S)
    for src in range(R):
        row = flat[src]
        lrow = load_RE[src]
        for i in range(n_single):
            row[dst[i]] = lrow[gid[i]]
    if P == 0:
        return
    # Instances of replicated experts: inst_* [P + n_rep], expert blocks start at ioff[e].
    ioff = np.full(E + 1, -1, np.int64)
    n_inst = 0
    for e in range(E):
        if rep_ptr[e + 1] > rep_ptr[e]:
            ioff[e] = n_inst
            n_inst += rep_ptr[e + 1] - rep_ptr[e] + 1
    inst_h = np.empty(n_inst, np.int64)
    inst_s = np.empty(n_inst, np.int64)
    alloc = np.zeros((R, n_inst), np.int64)  # alloc[src, instance]
    MAXC = 1
    for e in range(E):
        c = rep_ptr[e + 1] - rep_ptr[e] + 1
        if c > MAXC:
            MAXC = c
    rc = np.empty(MAXC, np.int64)
    cdef = np.empty(MAXC, np.int64)
    frac = np.empty(MAXC, np.int64)
    order = np.empty(MAXC, np.int64)
    on_rank = np.full(R, -1, np.int64)
    rem_R = np.zeros(R, np.int64)
    fr = np.zeros((R, MAXC), np.int64)
    for e in range(E):
        k0 = rep_ptr[e]
        k1 = rep_ptr[e + 1]
        if k1 == k0:
            continue
        C = k1 - k0 + 1
        o = ioff[e]
        lam = 0
        for src in range(R):
            lam += load_RE[src, e]
        inst_h[o] = home_E[e]
        inst_s[o] = master_slot_E[e]
        rc[0] = lam
        for j in range(1, C):
            inst_h[o + j] = rep_rank[k0 + j - 1]
            inst_s[o + j] = rep_slot[k0 + j - 1]
            rc[j] = rep_quota[k0 + j - 1]
            rc[0] -= rep_quota[k0 + j - 1]
        # Step 2: local fill.
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
        if total == 0:
            continue
        # Step 3a: proportional floors. floor(rem * rc_j / total) is taken in floating point and corrected
        # to the exact integer, so no integer division sits in the loop.
        inv_total = 1.0 / total
        for src in range(R):
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
        # Step 3b: row deficits by largest remainder, bounded by each column's remaining deficit.
        for src in range(R):
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
            while d > 0:  # rare: remainders exhausted by earlier sources; take the largest deficit
                best = -1
                for j in range(C):
                    if cdef[j] > 0 and (best < 0 or cdef[j] > cdef[best]):
                        best = j
                alloc[src, o + best] += 1
                cdef[best] -= 1
                d -= 1
    # Scatter the replicated experts' allocations, source-major.
    idst = np.empty(n_inst, np.int64)
    for i in range(n_inst):
        idst[i] = inst_h[i] * S + inst_s[i]
    for src in range(R):
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
