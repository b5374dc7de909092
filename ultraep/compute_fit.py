"""What expert compute costs, fitted over every rank of every measured call (issue 35).

Legend: R ranks, K slowdowns tried (:data:`SLOWDOWNS`), P = 3 unknowns.

A rank's expert compute, as alone, is ``w_r = a·n_r + b·i_r + d·p_r`` in model seconds: ``n_r`` tokens and ``i_r``
active instances at the layer's seconds per token (``CostModel.sec_per_token``), so ``a`` is ``compute_scale`` and
``b / a`` the per-instance cost in tokens (``half_tokens``), and ``p_r`` replica instances at ``d`` seconds each
(``replica_instance_s``). Ranks that share one host slow each other while they compute
(``CostParams.corun_slowdown`` = k): ordered by work, the rank with the least finishes at ``(1 + k (R - 1)) w``, the
next that plus ``(1 + k (R - 2))`` times its remaining work, and so on. For a fixed k every rank's measured time is
linear in ``(a, b, d)``, so each k of :data:`SLOWDOWNS` keeps its own least-squares sums and the best k wins.

    Step 1 (:meth:`ComputeFit.add`, every measured call): each rank gives one row, divided by its measured seconds so
           that every rank weighs by its relative error; older sums decay by :data:`DECAY` per call (the machine
           drifts).
    Step 2 (:meth:`ComputeFit.solve`): per k the non-negative least squares of the three unknowns (every subset of
           them tried: 7 small solves, batched over k); the smallest k whose residual is within :data:`TIE` of the
           best (balanced calls cannot tell a slowdown from a slower machine: only uneven ones can).

Why: one ratio per uneven call (the slowest rank over the least busy) learned the per-instance cost from a few
probes, and the scale followed whatever policy ran last, so a balanced policy's run over-predicted ``none`` by 3-7 %
(2026-11-26 validation). The fit uses every rank of every call, balanced ones too (their instance counts differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

#: the co-run slowdowns tried (0: ranks do not slow each other)
SLOWDOWNS = np.round(np.arange(0.0, 1.0001, 0.025), 3)
#: weight of the sums kept from the calls before, per new call (about the last 20 calls count)
DECAY = 0.95
#: the smallest slowdown whose residual is within this (relative) of the best one's is taken
TIE = 0.01
#: calls a fit needs before it is used
MIN_CALLS = 4
#: a solved fit is kept for this many calls (the sums move slowly; a solve costs ~0.15 ms on the decision's path)
SOLVE_EVERY = 4
#: ``[7, 3]`` which unknowns each subset solves for (every non-empty subset)
_MASKS = np.array([[float(j in sub) for j in range(3)] for m in (1, 2, 3) for sub in combinations(range(3), m)])


@dataclass(frozen=True)
class Fit:
    """One solved fit: the slowdown ``k``, ``a`` (s per model second of tokens), ``b`` (s per instance's model
    second), ``d`` (s per replica instance), and the calls behind it."""

    k: float
    a: float
    b: float
    d: float
    calls: int


def corun_matrices(t_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[R, R]`` A0, A1 with ``finish_R = (A0 + k A1) @ work_R`` for ranks ordered as ``t_R`` orders them (the rank
    measured last has the most work): rank ``order[j]`` runs ``1 + k (R - m - 1)`` times slower while ``m`` ranks
    have finished, so its finish is ``sum_{m <= j} (1 + k (R - m - 1)) (w_(m) - w_(m-1))``: linear in k."""
    R = t_R.shape[0]
    order = np.argsort(t_R, kind="stable")
    steps = np.eye(R) - np.eye(R, k=-1)  # row m: w_(m) - w_(m-1), in sorted order
    lower = np.tril(np.ones((R, R)))  # finish of the j-th: the sum over m <= j
    slope = (R - 1 - np.arange(R)).astype(np.float64)
    perm = np.eye(R)[order]  # sorted = perm @ unsorted
    A0 = perm.T @ lower @ steps @ perm
    A1 = perm.T @ lower @ (slope[:, None] * steps) @ perm
    return A0, A1


class ComputeFit:
    """Decaying least-squares sums of every rank's measured compute. Every rank's row is ``D0 + k D1`` (linear in the
    slowdown k), so three matrices and two vectors hold the sums of every k of :data:`SLOWDOWNS` at once."""

    def __init__(self) -> None:
        self.G = np.zeros((3, 3, 3))  # sums of D0'D0, D0'D1 + D1'D0, D1'D1: G(k) = G[0] + k G[1] + k^2 G[2]
        self.g = np.zeros((2, 3))  # sums of D0, D1: g(k) = g[0] + k g[1] (the target is 1 per row)
        self.c = 0.0  # rows
        self.calls = 0
        self._solved: tuple[int, Fit | None] | None = None  # (calls when solved, the fit)

    def add(self, tokens_R, instances_R, replicas_R, t_R, sec_per_token: float) -> bool:
        """Fold one call in: ``[R]`` tokens, active instances, replica instances and measured seconds per rank.
        Ranks that computed nothing or measured nothing are left out; False when no rank was usable."""
        n, i, p, t = (np.asarray(x, dtype=np.float64) for x in (tokens_R, instances_R, replicas_R, t_R))
        use = (t > 0) & (n > 0)
        if use.sum() == 0 or not np.all(np.isfinite(t)):
            return False
        X = np.stack([n * sec_per_token, i * sec_per_token, p], axis=1)  # [R, 3] model seconds
        A0, A1 = corun_matrices(t)
        D0, D1 = ((A @ X)[use] / t[use, None] for A in (A0, A1))  # [R', 3]: each row over its measurement
        self.G *= DECAY
        self.g *= DECAY
        self.c *= DECAY
        self.G += np.stack([D0.T @ D0, D0.T @ D1 + D1.T @ D0, D1.T @ D1])
        self.g += np.stack([D0.sum(axis=0), D1.sum(axis=0)])
        self.c += float(use.sum())
        self.calls += 1
        return True

    def solve(self) -> Fit | None:
        """The best non-negative fit (see the module docstring), or None before :data:`MIN_CALLS` calls; solved
        again once :data:`SOLVE_EVERY` calls were added since the last solve."""
        if self.calls < MIN_CALLS:
            return None
        if self._solved is not None and self.calls - self._solved[0] < SOLVE_EVERY:
            return self._solved[1]
        fit = self._solve()
        self._solved = (self.calls, fit)
        return fit

    def _solve(self) -> Fit | None:
        K = len(SLOWDOWNS)
        k = SLOWDOWNS[:, None]
        GK = self.G[0] + SLOWDOWNS[:, None, None] * self.G[1] + (SLOWDOWNS ** 2)[:, None, None] * self.G[2]  # [K,3,3]
        gK = self.g[0] + k * self.g[1]  # [K, 3]
        # every subset of the unknowns for every k in one batched solve: an unknown left out of a subset gets the
        # identity row and a 0 right-hand side, so it solves to 0
        # (solved in unknowns scaled to a unit diagonal: tokens, instances and replicas differ by orders of magnitude)
        diag = np.einsum("kii->ki", GK)
        u = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 1.0)  # [K, 3]
        GU = GK * u[:, :, None] * u[:, None, :] + 1e-12 * np.eye(3)
        M = _MASKS[:, None, :]  # [S, 1, 3]
        sel = M[..., :, None] * M[..., None, :]  # [S, 1, 3, 3]
        A = np.where(sel > 0, GU[None], np.eye(3))  # [S, K, 3, 3]
        try:
            W = np.linalg.solve(A, (gK * u)[None, ..., None] * M[..., None])[..., 0] * u[None]  # [S, K, 3]
        except np.linalg.LinAlgError:
            return None
        resid = np.einsum("ski,kij,skj->sk", W, GK, W) - 2 * np.einsum("ski,ki->sk", W, gK) + self.c  # [S, K]
        feasible = (W >= 0).all(axis=2) & (W.sum(axis=2) > 0)
        resid = np.where(feasible, resid, np.inf)
        s_best = resid.argmin(axis=0)  # [K]
        best_r = resid[s_best, np.arange(K)]
        best_w = W[s_best, np.arange(K)]
        if not np.isfinite(best_r).any():
            return None
        floor = max(float(best_r.min()), 0.0)
        kk = int(np.flatnonzero(best_r <= floor * (1 + TIE) + 1e-9 * self.c)[0])  # the smallest near the best
        if not np.isfinite(best_r[kk]) or best_w[kk, 0] <= 0:
            return None
        a, b, d = (float(x) for x in best_w[kk])
        return Fit(float(SLOWDOWNS[kk]), a, b, d, self.calls)
