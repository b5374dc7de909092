"""``hybridep``: hybrid expert/token transmission for low-bandwidth links (HybridEP, Yang et al.,
arXiv 2510.19470, §III-IV). Independent implementation of the published model.

HybridEP is not a load balancer. Across slow links (between datacenters) it moves part of the
expert-parallel traffic as **expert weights** instead of tokens: scale-out domains (DCs) are grouped into
*expert domains* of ``S`` consecutive domains; inside an expert domain every rank fetches (all-gathers)
the experts of its peers with the same in-domain offset and computes its own DC's tokens for them
locally; only tokens for experts outside the expert domain cross the slow link as an all-to-all.

Stream model (paper Eq. 3-12): token all-to-all volume per GPU ≈ D·(G−1)/G, roughly constant in the
number of GPUs G; an expert all-gather moves P_E·(|G_AG| − 1), linear in it; fetching one expert removes
D/G of token traffic and adds P_E of weight traffic. ``p`` = fraction of a GPU's outgoing chunks still
sent as tokens; ``p = 1`` is plain EP. The closed-form optimum (:func:`stream_p_star`) is reported for
reference; the policy itself evaluates every feasible expert-domain size with ultraep's cost model on the
*actual* load (the paper assumes a uniform gate) and keeps the cheapest, preferring the smaller domain
on ties, so it reduces to plain EP wherever bandwidth is plentiful.

**Mapping onto ultraep's Plan.** Replicas never leave their master's scale-up domain in a Plan, so a
HybridEP decision is an *overlay*: the Plan is the plain-EP identity plan (``phy2log``, ``routes`` as
logical destinations) with a typed overlay ``plan.expert_domains`` (:class:`~ultraep.plan.ExpertDomains`: S, the
masters fetched per peer, the compression); ``plan.info["hybridep"]`` holds the diagnostics (``p``, the number
of scale-out domains, the predicted time of every candidate). The cost model reads the overlay and computes
the traffic with :meth:`~ultraep.cost.CostModel.hybrid_traffic` (tokens served by fetched copies in the
source's own DC; the routing itself is :func:`ultraep.plan.traffic.hybrid_destinations`) plus the weight
all-gather (:meth:`~ultraep.cost.CostModel.allgather_bytes_R`), hidden behind the pre-expert window. The
policy only chooses the overlay, so the cost model never imports it.

Legend: R ranks, E experts, M masters per rank, D ranks per scale-up domain (one DC), G = R / D scale-out
domains, S expert-domain size in scale-out domains (S divides G).

Steps:

    Step 1: candidates S ∈ divisors of G (or the configured ``domain_sizes``).
    Step 2: for each S, route every (source DC a, expert e) pair: if e's home DC is in a's expert domain,
            the tokens go to the rank of DC a with e's home offset (a fetched copy), else to e's home.
    Step 3: predict each candidate with the cost model (token all-to-all per link level, expert compute,
            all-gather exposed beyond the prefetch window, gradients of fetched experts returned in
            backward); choose the minimum (ties → smaller S).

Worked example (``tests/test_hybridep.py``): R = 4, D = 2 → G = 2 DCs; expert e homed on rank 3 (DC 1,
offset 1). With S = 2 both DCs form one expert domain, so DC 0's tokens for e are computed on rank
0·2 + 1 = 1 (a fetched copy) and never cross the slow link; with S = 1 they go to rank 3.
"""

from __future__ import annotations


import numpy as np

from ultraep.cost import model_for
from ultraep.plan import ExpertDomains, Plan
from ultraep.topology import Topology

from .base import Stateless, assemble_plan

_EMPTY = np.zeros(0, dtype=np.int64)


def paper_p(S: int, G: int) -> float:
    """HybridEP's transmission ratio for expert-domain size S out of G (paper: S_ED ∈ {8, 4, 2, 1} ↔
    p ∈ {0, 0.5, 0.75, 1} at G = 8, i.e. ``1 − S/G`` for S ≥ 2 and 1 for plain EP)."""
    return 1.0 if S <= 1 else 1.0 - S / G


def stream_p_star(D_bytes: float, P_E: float, G: int, B: float, lat_pe: float) -> float:
    """Closed-form optimum of the stream model (paper Eq. 10-12), assuming a uniform gate.

    ``D_bytes`` data per GPU, ``P_E`` expert bytes, ``G`` GPUs (DCs), ``B`` bytes/s, ``lat_pe`` the
    pre-expert compute that can hide the all-gather. Case 2.2 (2D ≥ G·P_E): p* = 0 (experts only);
    otherwise p* = 1 − B·lat_pe / (P_E·(G − 1)), clipped to [0, 1].
    """
    if G <= 1 or P_E <= 0:
        return 1.0
    bound = min(1.0, max(0.0, 1.0 - B * lat_pe / (P_E * (G - 1))))
    return 0.0 if 2.0 * D_bytes - G * P_E >= 0 else bound


class HybridEPPolicy(Stateless):
    """Hybrid expert/token transmission (HybridEP).

    Options:
        domain_sizes: candidate expert-domain sizes in scale-out domains (default: every divisor of G).
        compression: expert compression ratio for the all-gather (the paper's SR compression reaches 50×;
            default 1 = uncompressed).
        memory_fraction: share of a GPU's memory (``HardwareSpec.memory_GB``) the fetched experts of one layer
            may take, their weights and the gradients they return in backward (as stored, uncompressed); an
            expert-domain size whose fetches do not fit is not considered.
        cost_model: a :class:`~ultraep.cost.CostModel` (not a config value; the simulator and engine pass
            theirs). Default: one built from the topology's preset.
    """

    name = "hybridep"
    planner_s = 0.0  # a closed-form choice made off the critical path
    needs_cost_model = True  # the engine hands it the calibrated model

    def __init__(self, domain_sizes: list[int] | None = None, compression: float = 1.0,
                 memory_fraction: float = 0.25, cost_model=None) -> None:
        self.domain_sizes = None if domain_sizes is None else [int(s) for s in domain_sizes]
        self.compression = float(compression)
        if not 0.0 < float(memory_fraction) <= 1.0:
            from ultraep.errors import ConfigError

            raise ConfigError("hybridep.memory_fraction", f"must be in (0, 1], got {memory_fraction!r}", memory_fraction)
        self.memory_fraction = float(memory_fraction)
        self.cost_model = cost_model

    def _cost(self, topology: Topology):
        return model_for(self.cost_model, topology)

    def fetch_bytes(self, topology: Topology, S: int, fetched: int | None = None) -> float:
        """Bytes one rank holds for the experts it fetches with expert-domain size S (``fetched`` masters of each
        peer, default all): their weights and the gradients it returns for them."""
        cm = self._cost(topology)
        f = topology.num_masters if fetched is None else fetched
        return float((S - 1) * f * (cm.expert_bytes + cm.grad_bytes))

    @staticmethod
    def fetch_options(topology: Topology) -> list[int]:
        """Masters fetched per peer: all M, then halving down to 1 (a partial fetch, HybridEP's intermediate p:
        the part of the experts an all-gather can move while the rest still travels as tokens)."""
        M, out = topology.num_masters, set()
        f = M
        while f >= 1:
            out.add(f)
            f = f // 2
        return sorted(out)

    def candidates(self, topology: Topology) -> list[tuple[int, int]]:
        """Step 1: ``(S, fetched)`` pairs to weigh: expert-domain sizes (divisors of G, or the configured ones)
        times the fetch options, whose fetched experts fit in ``memory_fraction`` of a GPU's memory; plain EP
        ``(1, M)`` always, first."""
        M = topology.num_masters
        return [(1, M)] + [(S, f) for S in self._sizes(topology) if S > 1 for f in self.fetch_options(topology)
                           if self._fits(topology, S, f)]

    def _sizes(self, topology: Topology) -> list[int]:
        G = topology.num_domains
        divisors = [s for s in range(1, G + 1) if G % s == 0]
        if self.domain_sizes is not None:
            divisors = sorted({s for s in self.domain_sizes if s in divisors} | {1})
        return divisors

    def _fits(self, topology: Topology, S: int, fetched: int | None = None) -> bool:
        budget = self.memory_fraction * self._cost(topology).hardware.memory_GB * 1e9
        return self.fetch_bytes(topology, S, fetched) <= budget

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        t = topology
        cm = self._cost(t)
        G, M = t.num_domains, t.num_masters
        predicted: dict[str, float] = {}
        by_pair: dict[str, float] = {}
        best, best_t = (1, M), float("inf")
        for S, f in self.candidates(t):  # Step 1; ties keep the smaller domain, then the smaller fetch
            total = cm.predict_hybrid(load_RE, S, self.compression, fetched=f).total_s  # Steps 2-3
            by_pair[f"{S}x{f}"] = total
            predicted[str(S)] = min(predicted.get(str(S), float("inf")), total)
            if total < best_t * (1 - 1e-12):
                best, best_t = (S, f), total
        S, f = best
        send_bytes = float(load_RE.sum(axis=1).mean()) * cm.token_bytes
        info = {
            "hybridep": {
                "expert_domain_size": S,
                "fetched_masters": f,
                "p": paper_p(S, G) if f == M else 1.0 - (S - 1) * f / ((G - 1) * M),
                "num_scale_out_domains": G,
                "compression": self.compression,
                "predicted_s": predicted,
                "predicted_fetch_s": by_pair,
                "memory_refused": [f"{s}x{x}" for s in self._sizes(t) if s > 1 for x in self.fetch_options(t)
                                   if not self._fits(t, s, x)],
                "stream_p_star": stream_p_star(
                    send_bytes, cm.expert_bytes / max(self.compression, 1e-9), G,
                    float(t.scale_out.bandwidth_GBps) * 1e9, cm.prefetch_window,
                ),
                "mode": "plain-ep" if S == 1 else ("expert-transmission" if f == M else "mixed"),
            }
        }
        domains = ExpertDomains(S, f, self.compression) if S > 1 else None  # S = 1: plain EP, no overlay
        return assemble_plan(self.name, t, load_RE, _EMPTY, _EMPTY, _EMPTY, _EMPTY, info=info,  # masters only
                             expert_domains=domains)
