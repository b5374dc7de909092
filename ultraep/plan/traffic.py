"""Traffic: what a plan makes every rank send, receive and compute, per link level (numba kernels).

Split from :mod:`ultraep.cost`, which turns a :class:`Traffic` into seconds. Legend: R ranks, E experts,
S slots per rank, L = 2 link levels (0 = scale-up inside a domain, 1 = scale-out between domains), D ranks
per domain (domains are contiguous blocks of D ranks).

Counts are token–expert assignments, or distinct tokens when de-duplicated (:func:`dedup_levels`: a token
is sent once per destination rank inside a domain and once per destination domain across domains, as
DeepEP does; estimated from counts with independent choices).

HybridEP's expert-domain routing (:func:`hybrid_destinations`, :func:`hybrid_flows`) sits here too: it is a
plan's traffic (a :class:`~ultraep.plan.ExpertDomains` overlay), which the cost model prices for any policy
that returns one; the policy (``policies/hybridep.py``) only chooses the overlay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

if TYPE_CHECKING:
    from ultraep.topology import Topology


@njit(cache=True)
def route_flows(routes_RRS, domain_R):
    """``[R, R, S]`` routes → ``(send [R, 2], recv [R, 2])`` assignments per link level (self excluded)."""
    R, _, S = routes_RRS.shape
    send = np.zeros((R, 2))
    recv = np.zeros((R, 2))
    for src in range(R):
        for dst in range(R):
            if dst == src:
                continue
            x = 0
            for s in range(S):
                x += routes_RRS[src, dst, s]
            if x:
                lvl = 0 if domain_R[src] == domain_R[dst] else 1
                send[src, lvl] += x
                recv[dst, lvl] += x
    return send, recv


@njit(cache=True)
def home_flows(load_RE, home_E, domain_R):
    """Masters-only routing: ``(send [R, 2], recv [R, 2])`` per link level (self excluded)."""
    R, E = load_RE.shape
    send = np.zeros((R, 2))
    recv = np.zeros((R, 2))
    for src in range(R):
        for e in range(E):
            x = load_RE[src, e]
            d = home_E[e]
            if x != 0 and d != src:
                lvl = 0 if domain_R[src] == domain_R[d] else 1
                send[src, lvl] += x
                recv[d, lvl] += x
    return send, recv


@njit(cache=True)
def level_flows(tok_RR, domain_R):
    """``[R, R]`` flows → ``(send [R, 2], recv [R, 2])`` per link level (self excluded)."""
    R = tok_RR.shape[0]
    send = np.zeros((R, 2))
    recv = np.zeros((R, 2))
    for src in range(R):
        for dst in range(R):
            x = tok_RR[src, dst]
            if dst != src and x != 0:
                lvl = 0 if domain_R[src] == domain_R[dst] else 1
                send[src, lvl] += x
                recv[dst, lvl] += x
    return send, recv


@njit(cache=True)
def dedup_levels(logmiss_RR, tok_R, D):
    """Distinct tokens per link level: ``(send [R, 2], recv [R, 2])``.

    ``logmiss_RR[src, dst]`` is the log-probability that a token of ``src`` goes to no instance on ``dst``
    (``Σ log(1 − x_i / T_src)`` over the instances ``i`` of ``dst`` that ``src`` sends ``x_i`` assignments,
    independent choices); ``tok_R`` the tokens of each source. Inside the source's domain a token is sent once
    per destination rank; to another domain once (DeepEP's RDMA leg), received by the rank with the source's
    in-domain offset, which forwards it over the scale-up link (not counted: that link is many times faster).
    Ranks of a domain are contiguous blocks of ``D``.
    """
    R = logmiss_RR.shape[0]
    G = R // D
    send = np.zeros((R, 2))
    recv = np.zeros((R, 2))
    for src in range(R):
        T = tok_R[src]
        if T <= 0:
            continue
        a = src // D
        for dst in range(a * D, a * D + D):
            if dst != src:
                x = T * (1.0 - np.exp(logmiss_RR[src, dst]))
                send[src, 0] += x
                recv[dst, 0] += x
        for b in range(G):
            if b == a:
                continue
            lm = 0.0
            for dst in range(b * D, b * D + D):
                lm += logmiss_RR[src, dst]
            x = T * (1.0 - np.exp(lm))
            send[src, 1] += x
            recv[b * D + src % D, 1] += x
    return send, recv


_CAP = 1.0 - 1e-12  # a count can reach all of a source's tokens: keep the log finite


@njit(cache=True)
def route_logmiss(routes_RRS, tok_R):
    """``[R, R]``: ``Σ_s log(1 − routes[src, dst, s] / T_src)``, a token's log-chance to miss every instance of
    ``dst`` (see :func:`dedup_levels`)."""
    R, _, S = routes_RRS.shape
    out = np.zeros((R, R))
    for src in range(R):
        if tok_R[src] <= 0:
            continue
        inv = 1.0 / tok_R[src]
        for dst in range(R):
            acc = 0.0
            for s in range(S):
                x = routes_RRS[src, dst, s]
                if x:
                    acc += np.log1p(-min(x * inv, _CAP))
            out[src, dst] = acc
    return out


@njit(cache=True)
def dest_logmiss(load_RE, dst_RE, tok_R):
    """As :func:`route_logmiss` when ``load_RE[r, e]`` assignments of source ``r`` to expert ``e`` go to rank
    ``dst_RE[r, e]``."""
    R, E = load_RE.shape
    out = np.zeros((R, R))
    for src in range(R):
        if tok_R[src] <= 0:
            continue
        inv = 1.0 / tok_R[src]
        for e in range(E):
            x = load_RE[src, e]
            if x:
                out[src, dst_RE[src, e]] += np.log1p(-min(x * inv, _CAP))
    return out


@dataclass(frozen=True)
class Traffic:
    """What a plan makes every rank do. ``send_RL``/``recv_RL`` count token–expert assignments crossing
    each link level (self-traffic excluded); ``tokens_R`` assignments computed; ``instances_R`` active
    expert instances; ``static_tokens_R`` tokens of instances that need no transfer (FEPLB overlap)."""

    tokens_R: np.ndarray
    instances_R: np.ndarray
    send_RL: np.ndarray
    recv_RL: np.ndarray
    static_tokens_R: np.ndarray | None = None
    static_instances_R: np.ndarray | None = None
    #: tokens and active instances of the replica slots (beyond the masters): the runtime's per-replica cost
    replica_tokens_R: np.ndarray | None = None
    replica_instances_R: np.ndarray | None = None


def hybrid_destinations(topology: "Topology", S: int, fetched: int | None = None) -> np.ndarray:
    """``[G, E]`` rank that computes scale-out domain ``a``'s tokens for expert ``e`` with expert-domain size S
    (HybridEP, arXiv 2510.19470 §III), when every rank fetches the first ``fetched`` masters of each peer
    (default: all ``M``): a fetched copy on the rank of domain ``a`` with ``e``'s home offset when ``e``'s home
    domain is in ``a``'s expert domain, else ``e``'s home rank."""
    t = topology
    D, G = t.D, t.num_domains
    home = t.home_E
    hdc, hoff = home // D, home % D
    a = np.arange(G)[:, None]
    same = (a // S) == (hdc // S)[None, :]
    if fetched is not None and fetched < t.num_masters:
        same &= (t.master_slot_E < fetched)[None, :]
    return np.where(same, a * D + hoff[None, :], home[None, :])


@njit(cache=True)
def hybrid_flows(load_RE, dst_AE, domain_R):
    """Tokens routed by ``dst_AE`` (:func:`hybrid_destinations`) as flows: ``(send [R, 2], recv [R, 2],
    tokens [R], instances [R])`` per link level."""
    R, E = load_RE.shape
    send = np.zeros((R, 2))
    recv = np.zeros((R, 2))
    tokens = np.zeros(R)
    active = np.zeros((R, E), np.bool_)
    for r in range(R):
        a = domain_R[r]
        for e in range(E):
            x = load_RE[r, e]
            if x == 0:
                continue
            d = dst_AE[a, e]
            tokens[d] += x
            active[d, e] = True
            if d != r:
                lvl = 0 if domain_R[d] == a else 1
                send[r, lvl] += x
                recv[d, lvl] += x
    instances = np.zeros(R)
    for d in range(R):
        for e in range(E):
            if active[d, e]:
                instances[d] += 1
    return send, recv, tokens, instances
