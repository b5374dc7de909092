"""Synthetic routing workloads for benchmarks, tests and the simulator.

:func:`synthetic_load` follows the UltraEP evaluation's recipe (arXiv 2606.04101 §8.3; the exponent and
token counts of the paper are not published, so the skew is *searched* to hit a target): expert
popularity follows a power law over (a random order of) home ranks and over each rank's local experts.
Every token picks exactly ``k`` **distinct** experts (a hot expert takes at most one slot per token, as
with a real router), expert ``e`` with inclusion probability ``π_e = 1 − exp(−c·w_e)``, ``c`` solved so
that ``Σ_e π_e = k`` (the same inclusion model as the synthetic traces).

**Counts, not tokens.** The per-token choice is systematic πps sampling (Madow, 1949): lay the experts'
``π_e`` end to end on ``[0, k)`` (in a random order per source rank), draw one uniform ``u`` per token and
take the experts whose intervals hold ``u, u + 1, …, u + k − 1``. Since every ``π_e <= 1`` these are ``k``
distinct experts, each included with probability exactly ``π_e``. Which experts a token takes depends only
on the segment of ``[0, 1)`` (cut at the interval ends modulo 1) that ``u`` falls in, so the counts of
``T`` tokens are one multinomial draw of ``T`` over at most ``E + 1`` segments, summed per expert: exact
for this per-token model, ``Σ_e λ[r, e] = T · k`` and ``λ[r, e] <= T``, and the cost does not depend on
``T`` (``--tokens 10**12`` costs what ``10**4`` does). Interval ends are integers in units of
``2^-38`` so that the cut points and sums are exact. (Earlier versions drew Gumbel-top-k keys per token,
at a cost of ``T · E``; the loads a given seed produces changed with the sampler.)

Legend: R ranks, E experts, K top-k, T tokens per rank.
"""

from __future__ import annotations

import numpy as np

from ultraep.limits import check_synthetic_load

#: Units per token on the systematic-sampling line: π_e is held as an integer multiple of 2^-38, so
#: ``k · 2^38 <= 2^62`` for every ``k <= 2^24`` (``limits.MAX_EXPERTS``) and the cut points are exact.
_UNIT = 1 << 38


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


def solve_inclusion(w_TE: np.ndarray, k: int, iters: int = 60) -> np.ndarray:
    """``[T, E] -> [T, E]`` inclusion probabilities ``1 − exp(−c_t · w)`` with ``Σ_e = k`` per row
    (bisection on ``log c``, vectorised over rows)."""
    w = np.maximum(np.asarray(w_TE, dtype=np.float64), 1e-300)
    E = w.shape[1]
    if k >= E:
        return np.ones_like(w)
    lo = np.full(w.shape[0], -60.0)
    hi = np.full(w.shape[0], 60.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        s = (-np.expm1(-np.exp(mid)[:, None] * w)).sum(axis=1)
        big = s > k
        hi = np.where(big, mid, hi)
        lo = np.where(big, lo, mid)
    return -np.expm1(-np.exp((lo + hi) / 2)[:, None] * w)


def expected_imbalance(pi_E: np.ndarray, num_ranks: int) -> float:
    """Rank-level imbalance (max / mean) of the expected load ``π[E]`` with contiguous homes."""
    per_rank = pi_E.reshape(num_ranks, -1).sum(axis=1)
    return float(per_rank.max() / per_rank.mean())


def fit_popularity(num_ranks: int, num_experts: int, top_k: int, target: float, seed: int) -> np.ndarray:
    """``[E]`` power-law popularity whose *expected* rank-level imbalance (after the top-k cap) is close to
    ``target``: bisection on the exponent in ``[0, 12]``; the most skewed one when the cap makes the target
    unreachable. Deterministic in ``seed`` (the same rank order for every exponent)."""
    R, E, k = num_ranks, num_experts, top_k

    def at(alpha):
        return power_law_popularity(R, E, alpha, np.random.default_rng(seed))

    lo, hi = 0.0, 12.0
    if expected_imbalance(solve_inclusion(at(hi)[None], k)[0], R) < target:
        return at(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_imbalance(solve_inclusion(at(mid)[None], k)[0], R) < target:
            lo = mid
        else:
            hi = mid
    return at((lo + hi) / 2)


def quantise_inclusion(pi_E: np.ndarray, top_k: int) -> np.ndarray:
    """``[E]`` float inclusion probabilities → ``[E]`` int64 multiples of ``2^-38`` in ``0 .. 2^38`` summing to
    exactly ``top_k · 2^38`` (largest remainders round up; ties by expert id)."""
    pi = np.clip(np.asarray(pi_E, dtype=np.float64), 0.0, None)
    total = pi.sum()
    if not total > 0:
        raise ValueError("inclusion probabilities sum to 0")
    scaled = np.minimum(pi * (top_k / total), 1.0) * _UNIT
    q = np.floor(scaled).astype(np.int64)
    rem = scaled - q
    short = top_k * _UNIT - int(q.sum())
    # round up the largest remainders among experts below the cap (or down the smallest, if over)
    if short > 0:
        cand = np.flatnonzero(q < _UNIT)
        pick = cand[np.argsort(-rem[cand], kind="stable")[:short]]
        assert pick.size == short, "top_k exceeds the number of experts"
        q[pick] += 1
    elif short < 0:
        cand = np.flatnonzero(q > 0)
        pick = cand[np.argsort(rem[cand], kind="stable")[:-short]]
        q[pick] -= 1
    return q


def systematic_counts(q_E: np.ndarray, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """``[E]`` counts of ``num_tokens`` tokens under systematic πps sampling (module docstring).

    ``q_E``: inclusion probabilities in units of ``2^-38`` (:func:`quantise_inclusion`), summing to
    ``k · 2^38``. The experts are laid out in a fresh random order; the result is in expert order.
    Cost ``O(E log E)``, independent of ``num_tokens``.
    """
    E = q_E.shape[0]
    perm = rng.permutation(E)
    x = np.concatenate(([0], np.cumsum(q_E[perm])))  # [E + 1] interval boundaries on [0, k)
    frac = x % _UNIT
    order = np.argsort(frac, kind="stable")
    new = np.ones(E + 1, dtype=bool)
    new[1:] = frac[order][1:] != frac[order][:-1]
    cuts = frac[order][new]  # sorted distinct segment starts in [0, 2^38), cuts[0] = 0
    seg_of = np.empty(E + 1, dtype=np.int64)
    seg_of[order] = np.cumsum(new) - 1  # boundary j sits at cuts[seg_of[j]]
    seg = np.diff(np.append(cuts, _UNIT)) / _UNIT  # segment lengths; exact binary fractions
    below = np.concatenate(([0], np.cumsum(rng.multinomial(num_tokens, seg))))  # tokens with u < cuts[j]
    # tokens whose u (mod 1) lies in [x[e], x[e + 1]): whole turns plus the partial arc
    c = num_tokens * (x[1:] // _UNIT - x[:-1] // _UNIT) + below[seg_of[1:]] - below[seg_of[:-1]]
    out = np.empty(E, dtype=np.int64)
    out[perm] = c
    return out


def sample_topk_counts(popularity: np.ndarray, num_tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """``[E]`` counts of ``num_tokens`` tokens each choosing ``top_k`` distinct experts, with inclusion
    probabilities solved from ``popularity`` (:func:`solve_inclusion`), by :func:`systematic_counts`."""
    pi = solve_inclusion(np.asarray(popularity, dtype=np.float64)[None], top_k)[0]
    return systematic_counts(quantise_inclusion(pi, top_k), int(num_tokens), rng)


def synthetic_load(
    num_ranks: int,
    num_experts: int,
    *,
    top_k: int = 8,
    tokens_per_rank: int = 8192,
    target_imbalance: float = 2.0,
    seed: int = 0,
    names: dict[str, str] | None = None,
) -> np.ndarray:
    """``[R, E]`` load whose rank-level imbalance is close to ``target_imbalance``.

    The power-law exponent is found by bisection on the expected imbalance (:func:`fit_popularity`); every
    source rank then samples its ``tokens_per_rank`` tokens from the same inclusion probabilities, as
    counts (:func:`systematic_counts`). Deterministic in ``seed``. Sizes are checked first
    (:func:`ultraep.limits.check_synthetic_load`; ``names`` renames the fields in its messages, e.g. to the
    CLI flags): refusals are :class:`~ultraep.errors.ConfigError`, bad values :class:`ValueError`.
    """
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in 1..{num_experts}")
    if not 1.0 <= target_imbalance < float("inf"):  # NaN fails this too
        raise ValueError(f"target_imbalance ({target_imbalance}) must be a finite number >= 1.0")
    if tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank ({tokens_per_rank}) must be >= 0")
    if seed < 0:
        raise ValueError(f"seed ({seed}) must be >= 0")
    check_synthetic_load(num_ranks, num_experts, top_k, tokens_per_rank, names=names)
    pop = fit_popularity(num_ranks, num_experts, top_k, target_imbalance, seed)
    q = quantise_inclusion(solve_inclusion(pop[None], top_k)[0], top_k)
    rng = np.random.default_rng([seed, 1])
    load = np.empty((num_ranks, num_experts), dtype=np.int64)
    for r in range(num_ranks):
        load[r] = systematic_counts(q, int(tokens_per_rank), rng)
    return load
