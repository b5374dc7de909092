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
    """
    R, E = load_RE.shape
    MAXC = 1
    for e in range(E):
        c = rep_ptr[e + 1] - rep_ptr[e] + 1
        if c > MAXC:
            MAXC = c
    h = np.empty(MAXC, np.int64)
    sl = np.empty(MAXC, np.int64)
    rc = np.empty(MAXC, np.int64)
    cdef = np.empty(MAXC, np.int64)
    frac = np.empty(MAXC, np.int64)
    order = np.empty(MAXC, np.int64)
    on_rank = np.full(R, -1, np.int64)
    for e in range(E):
        k0 = rep_ptr[e]
        k1 = rep_ptr[e + 1]
        h0 = home_E[e]
        s0 = master_slot_E[e]
        if k1 == k0:
            # Step 1: master only.
            for src in range(R):
                routes_RRS[src, h0, s0] = load_RE[src, e]
            continue
        C = k1 - k0 + 1
        lam = 0
        for src in range(R):
            lam += load_RE[src, e]
        q_master = lam
        for k in range(k0, k1):
            q_master -= rep_quota[k]
        h[0] = h0
        sl[0] = s0
        rc[0] = q_master
        for j in range(1, C):
            h[j] = rep_rank[k0 + j - 1]
            sl[j] = rep_slot[k0 + j - 1]
            rc[j] = rep_quota[k0 + j - 1]
        # Step 2: local fill.
        for j in range(C):
            local = min(load_RE[h[j], e], rc[j])
            routes_RRS[h[j], h[j], sl[j]] = local
            rc[j] -= local
            on_rank[h[j]] = local
        total = 0
        for j in range(C):
            total += rc[j]
        if total == 0:
            for j in range(C):
                on_rank[h[j]] = -1
            continue
        # Column deficits start at the remaining capacities and shrink as floors are assigned.
        for j in range(C):
            cdef[j] = rc[j]
        # Step 3a: proportional floors per source.
        for src in range(R):
            rem = load_RE[src, e]
            if on_rank[src] >= 0:
                rem -= on_rank[src]
            if rem <= 0:
                continue
            for j in range(C):
                x = rem * rc[j] // total
                routes_RRS[src, h[j], sl[j]] += x
                cdef[j] -= x
        # Step 3b: deficits by largest remainder, bounded by each column's remaining deficit.
        for src in range(R):
            rem = load_RE[src, e]
            if on_rank[src] >= 0:
                rem -= on_rank[src]
            if rem <= 0:
                continue
            d = rem
            for j in range(C):
                frac[j] = rem * rc[j] % total
                d -= rem * rc[j] // total
            if d == 0:
                continue
            # insertion sort of instances by remainder desc, then host rank asc
            for j in range(C):
                order[j] = j
            for a in range(1, C):
                v = order[a]
                b = a - 1
                while b >= 0 and (frac[order[b]] < frac[v] or (frac[order[b]] == frac[v] and h[order[b]] > h[v])):
                    order[b + 1] = order[b]
                    b -= 1
                order[b + 1] = v
            for a in range(C):
                if d == 0:
                    break
                j = order[a]
                if frac[j] > 0 and cdef[j] > 0:
                    routes_RRS[src, h[j], sl[j]] += 1
                    cdef[j] -= 1
                    d -= 1
            while d > 0:  # rare: remainders exhausted by earlier sources; take the largest deficit
                best = -1
                for j in range(C):
                    if cdef[j] > 0 and (best < 0 or cdef[j] > cdef[best]):
                        best = j
                routes_RRS[src, h[best], sl[best]] += 1
                cdef[best] -= 1
                d -= 1
        for j in range(C):
            on_rank[h[j]] = -1


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
