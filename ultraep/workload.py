"""Synthetic routing workloads for benchmarks, tests and the simulator.

:func:`synthetic_load` follows the UltraEP evaluation's recipe (arXiv 2606.04101 §8.3; the exponent and
token counts of the paper are not published, so the skew is *searched* to hit a target): expert
popularity follows a power law over (a random order of) home ranks and over each rank's local experts,
and every token picks its top-k experts **without replacement** in proportion to popularity
(Gumbel-top-k), so a hot expert can take at most one slot per token, as with a real router.

Legend: R ranks, E experts, K top-k, T tokens per rank.
"""

from __future__ import annotations

import numpy as np

from ultraep.metrics import imbalance


def power_law_popularity(num_ranks: int, num_experts: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """``[E]`` expert popularity: ``(rank_order + 1)^-alpha * (local_index + 1)^-(alpha / 2)``, normalised.

    ``rank_order`` is a random permutation of home ranks (the hot rank is not always rank 0); experts
    are contiguous per rank.
    """
    M = num_experts // num_ranks
    rank_order = rng.permutation(num_ranks)
    e = np.arange(num_experts)
    w = (rank_order[e // M] + 1.0) ** (-alpha) * ((e % M) + 1.0) ** (-alpha / 2)
    return w / w.sum()


def sample_topk_counts(popularity: np.ndarray, num_tokens: int, top_k: int, rng: np.random.Generator,
                       chunk: int = 4096) -> np.ndarray:
    """``[E]`` counts of ``num_tokens`` tokens each choosing ``top_k`` distinct experts (Gumbel-top-k)."""
    E = popularity.shape[0]
    logp = np.log(np.maximum(popularity, 1e-300))
    counts = np.zeros(E, dtype=np.int64)
    done = 0
    while done < num_tokens:
        n = min(chunk, num_tokens - done)
        keys = logp[None, :] + rng.gumbel(size=(n, E))
        top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        counts += np.bincount(top.ravel(), minlength=E)
        done += n
    return counts


def _expected_imbalance(num_ranks, num_experts, top_k, alpha, seed, probe_tokens=8192) -> float:
    rng = np.random.default_rng(seed)
    pop = power_law_popularity(num_ranks, num_experts, alpha, rng)
    counts = sample_topk_counts(pop, probe_tokens, top_k, rng)
    M = num_experts // num_ranks
    return imbalance(counts.reshape(num_ranks, M).sum(axis=1))


def synthetic_load(
    num_ranks: int,
    num_experts: int,
    *,
    top_k: int = 8,
    tokens_per_rank: int = 8192,
    target_imbalance: float = 2.0,
    seed: int = 0,
) -> np.ndarray:
    """``[R, E]`` load whose rank-level imbalance is close to ``target_imbalance``.

    The power-law exponent is found by bisection on a probe sample (same seed, so the result is
    deterministic); every source rank then samples its own tokens from the same popularity.
    """
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in 1..{num_experts}")
    if not 1.0 <= target_imbalance < float("inf"):  # NaN fails this too
        raise ValueError(f"target_imbalance ({target_imbalance}) must be a finite number >= 1.0")
    if tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank ({tokens_per_rank}) must be >= 0")
    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if _expected_imbalance(num_ranks, num_experts, top_k, mid, seed) < target_imbalance:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-3:
            break
    alpha = (lo + hi) / 2
    rng = np.random.default_rng(seed)
    pop = power_law_popularity(num_ranks, num_experts, alpha, rng)
    load = np.empty((num_ranks, num_experts), dtype=np.int64)
    for r in range(num_ranks):
        load[r] = sample_topk_counts(pop, tokens_per_rank, top_k, rng)
    return load
