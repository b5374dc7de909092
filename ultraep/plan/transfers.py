"""Transfer schedule: how each expert's weights reach its new replicas (direct sends or a relay tree).

Legend: E experts, P replicas in the plan, T transfers (P <= T).

The bottleneck of replica weight sync is the *sender*: each rank receives at most N replicas, but the
rank that owns a hot expert may have to feed many. UltraEP (arXiv 2606.04101 §6; the authors'
``Dots-Infra/UltraEP`` documents the rule) bounds it with a two-level relay tree:

    n = remote replicas of expert e
    relays = min(floor(sqrt(n)), 8, n - 1)
    use the tree iff n >= 4 and n - max(relays, ceil((n - relays) / relays)) >= 2

The master sends to the relays (stage 0); each relay forwards to its children (stage 1). Relays are the
replica ranks with the smallest accumulated send bytes so far; children are dealt one per relay, then
each to the relay with the smallest projected send load. Counters carry over from expert to expert (in
expert id order), which keeps the busiest sender's bytes bounded across the whole plan.

Relay modes: 0 = direct only, 1 = auto (tree when the rule says so and the domain has more than 8 ranks;
UltraEP forces direct sends in small domains), 2 = always (tree whenever the rule says so).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit

from ultraep.plan import Transfers

RELAY_MODES = {"direct": 0, "auto": 1, "always": 2}


@njit(cache=True)
def schedule_transfers(home_E, rep_ptr, rep_rank, expert_bytes, num_ranks, domain_size, relay_mode):
    """Return ``(expert, src, dst, nbytes, stage)``, each ``[T]``, for the replicas in CSR form."""
    E = home_E.shape[0]
    P = rep_ptr[E]
    t_exp = np.empty(P, np.int64)
    t_src = np.empty(P, np.int64)
    t_dst = np.empty(P, np.int64)
    t_stage = np.empty(P, np.int64)
    sent = np.zeros(num_ranks, np.int64)
    relay_ok = relay_mode == 2 or (relay_mode == 1 and domain_size > 8)
    n_t = 0
    for e in range(E):
        k0 = rep_ptr[e]
        n = rep_ptr[e + 1] - k0
        if n == 0:
            continue
        src = home_E[e]
        use_relay = False
        nrel = 0
        if relay_ok and n >= 4:
            nrel = min(int(np.floor(np.sqrt(n))), 8, n - 1)
            worst = max(nrel, (n - nrel + nrel - 1) // nrel)
            use_relay = n - worst >= 2
        if not use_relay:
            for k in range(k0, k0 + n):
                t_exp[n_t] = e
                t_src[n_t] = src
                t_dst[n_t] = rep_rank[k]
                t_stage[n_t] = 0
                n_t += 1
                sent[src] += expert_bytes
            continue
        # Choose relays: replica ranks with the least accumulated send bytes (ties: lower rank).
        cand = rep_rank[k0:k0 + n].copy()
        is_relay = np.zeros(n, np.bool_)
        relays = np.empty(nrel, np.int64)
        for a in range(nrel):
            best = -1
            for b in range(n):
                if is_relay[b]:
                    continue
                if best < 0 or sent[cand[b]] < sent[cand[best]] or (
                    sent[cand[b]] == sent[cand[best]] and cand[b] < cand[best]
                ):
                    best = b
            is_relay[best] = True
            relays[a] = cand[best]
            t_exp[n_t] = e
            t_src[n_t] = src
            t_dst[n_t] = cand[best]
            t_stage[n_t] = 0
            n_t += 1
            sent[src] += expert_bytes
        # Deal children: first one per relay, then to the relay with the least projected send bytes.
        dealt = 0
        for b in range(n):
            if is_relay[b]:
                continue
            if dealt < nrel:
                r = relays[dealt]
            else:
                r = relays[0]
                for a in range(1, nrel):
                    if sent[relays[a]] < sent[r]:
                        r = relays[a]
            dealt += 1
            t_exp[n_t] = e
            t_src[n_t] = r
            t_dst[n_t] = cand[b]
            t_stage[n_t] = 1
            n_t += 1
            sent[r] += expert_bytes
    nbytes = np.full(n_t, expert_bytes, np.int64)
    return t_exp[:n_t], t_src[:n_t], t_dst[:n_t], nbytes, t_stage[:n_t]


def transfers_for(plan, resident_RE: np.ndarray | None = None, relay: str = "auto", expert_bytes: int | None = None):
    """``plan`` with exactly the weight transfers it needs: one for every replica whose weights are not
    already resident on its rank (``resident_RE[r, e]``: rank ``r`` holds a valid copy of expert ``e``; None
    = nothing is resident, every replica is streamed). ``expert_bytes``: bytes per copy (default: the
    topology's).

    This is what the runtime moves, whatever the policy listed (a historical placement lists only its new
    replicas, assuming the others stay resident; a runtime whose masters changed must send them all).
    """
    t = plan.topology
    ptr, rank = plan.replicas.ptr, plan.replicas.rank
    everything = True  # every replica needs its weights
    if resident_RE is not None and len(rank):
        expert_P = np.repeat(np.arange(t.num_experts), np.diff(ptr))
        need = ~np.asarray(resident_RE, dtype=bool)[rank, expert_P]
        everything = bool(need.all())
        if not everything:
            ptr = np.zeros(t.num_experts + 1, dtype=np.int64)
            np.cumsum(np.bincount(expert_P[need], minlength=t.num_experts), out=ptr[1:])
            rank = np.ascontiguousarray(rank[need])
    if everything and expert_bytes is None and len(plan.transfers) == len(rank):
        return plan  # the policy already scheduled one transfer per replica: nothing to drop or add
    cols = schedule_transfers(t.home_E, np.ascontiguousarray(ptr, dtype=np.int64), np.ascontiguousarray(
        rank, dtype=np.int64), t.expert_bytes if expert_bytes is None else int(expert_bytes), t.num_ranks, t.D,
        RELAY_MODES[relay])
    return dataclasses.replace(plan, transfers=Transfers(*cols))
