"""The compute fit: what expert compute costs, fitted over every rank of every measured call (:class:`ComputeFit`,
issue 35), and the per-instance cost from one call's slowest and least busy rank (:func:`half_tokens_from_spread`).
:class:`~ultraep.cost.calibrator.Calibrator` feeds both and writes what they find into
:class:`~ultraep.cost.params.CostParams`; nothing here reads the model."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
from numba import njit


#: a call teaches the per-instance cost only when its busiest rank has this many times the tokens of the least busy
#: one (ranks with about equal tokens cannot tell a per-instance cost from a per-token one)
HALF_TOKENS_MIN_SPREAD = 1.3
#: the largest per-instance cost, in tokens, the calibrator learns (a bound against a noisy ratio)
MAX_HALF_TOKENS = 1e5


def half_tokens_from_spread(tokens_R: np.ndarray, instances_R: np.ndarray, measured_ratio: float) -> float | None:
    """The per-instance cost h (tokens) with which the rank with the most tokens (a) and the one with the fewest (b)
    compute in the measured ratio slowest / fastest: ``(n_a + h i_a) / (n_b + h i_b) = ratio``, so
    ``h = (n_a - ratio n_b) / (ratio i_b - i_a)``, kept in [0, :data:`MAX_HALF_TOKENS`]. None when the ranks'
    tokens are too even to tell (:data:`HALF_TOKENS_MIN_SPREAD`) or the ratio is not a number."""
    n = np.asarray(tokens_R, dtype=np.float64)
    i = np.asarray(instances_R, dtype=np.float64)
    busy = np.flatnonzero((n > 0) & (i > 0))
    if busy.size < 2 or not np.isfinite(measured_ratio) or measured_ratio <= 0:
        return None
    a, b = busy[np.argmax(n[busy])], busy[np.argmin(n[busy])]
    if n[a] < HALF_TOKENS_MIN_SPREAD * n[b]:
        return None
    # as h grows from 0 the ratio moves from the tokens' ratio r_n towards the instances' ratio r_i
    r_n, r_i = n[a] / n[b], i[a] / i[b]
    if abs(r_n - r_i) <= 1e-9 * r_n:
        return None
    if (measured_ratio - r_n) * (r_i - r_n) <= 0:  # not moved towards r_i: no per-instance cost explains it
        return 0.0
    if (measured_ratio - r_i) * (r_n - r_i) <= 0:  # at or past r_i: only an unbounded cost would
        return MAX_HALF_TOKENS
    return float(min(MAX_HALF_TOKENS, (n[a] - measured_ratio * n[b]) / (measured_ratio * i[b] - i[a])))


# ---------------------------------------------------------------------------------------------- compute fit
# What expert compute costs, fitted over every rank of every measured call (issue 35).
#
# Legend: R ranks, K slowdowns tried (FIT_SLOWDOWNS), 4 unknowns.
#
# A rank's expert compute, as alone, is ``w_r = a·n_r + b·i_r + d·p_r + e·m_r`` in model seconds: ``n_r`` tokens and
# ``i_r`` active instances at the layer's seconds per token (``CostModel.sec_per_token``), so ``a`` is
# ``compute_scale`` and ``b / a`` the per-instance cost in tokens (``half_tokens``), ``p_r`` replica instances at
# ``d`` seconds each (``replica_instance_s``) and ``m_r`` replica copies the rank sends or receives at ``e`` seconds
# each (``replica_move_s``: on a host, the transport's copies run on the cores that compute; 0 where not modelled).
# Ranks that share one host slow each other while they compute (``CostParams.corun_slowdown`` = k): ordered by work,
# the rank with the least finishes at ``(1 + k (R - 1)) w``, the next that plus ``(1 + k (R - 2))`` times its
# remaining work, and so on. For a fixed k every rank's measured time is linear in ``(a, b, d, e)``, and every rank's
# row is linear in k, so three matrices hold the least-squares sums of every k of FIT_SLOWDOWNS at once, and the best
# k wins.
#
#     Step 1 (:meth:`ComputeFit.add`, every measured call): each rank gives one row, divided by its measured seconds so
#            that every rank weighs by its relative error; older sums decay by FIT_DECAY per call of the same
#            policy and FIT_STALE_DECAY per call of another (the machine drifts, and one policy's calls must not
#            wash out the few of a probed one: :class:`ComputeFit`).
#     Step 2 (:meth:`ComputeFit.solve`): per k the non-negative least squares of the four unknowns (every subset
#            of them tried: 15 small solves, batched over k); the smallest k whose residual is within FIT_TIE of the
#            best one's (balanced calls cannot tell a slowdown from a slower machine: only uneven ones can).
#
# Why: one ratio per uneven call (the slowest rank over the least busy) learned the per-instance cost from a few
# probes, and the scale followed whatever policy ran last, so a balanced policy's run over-predicted ``none`` by 3-7 %
# (2026-11-26 validation). The fit uses every rank of every call, balanced ones too (their instance counts differ).

#: the co-run slowdowns tried (0: ranks do not slow each other)
FIT_SLOWDOWNS = np.round(np.arange(0.0, 1.0001, 0.025), 3)
#: weight of a regime's sums kept from its calls before, per new call of that regime (its last ~20 calls count)
FIT_DECAY = 0.95
#: ...and per call of another regime (a probe's calls keep half their weight for ~35 calls of the policy in force,
#: about one probe period, so a drifting machine still moves the fit)
FIT_STALE_DECAY = 0.98
#: the smallest slowdown whose residual is within this (relative) of the best one's is taken
FIT_TIE = 0.01
#: a call whose ranks' tokens differ by this share of the busiest's or more shows the co-run slowdown (its rows are
#: kept apart: :class:`ComputeFit`); quota's balanced plans are within its ``balance_eps`` (1 %) of their mean, so they
#: stay out. None: nothing kept apart (every call decays alike: the fit before issue 56)
FIT_UNEVEN: float | None = 0.1
#: calls a fit needs before it is used
FIT_MIN_CALLS = 4
#: a solved fit is kept for this many calls (the sums move slowly; a solve, on the call's path, costs 0.2 ms compiled)
FIT_SOLVE_EVERY = 4
#: the unknowns: a (tokens), b (instances), d (replica instances), e (replica copies)
FIT_UNKNOWNS = 4
#: ``[15, 4]`` which unknowns each subset solves for (every non-empty subset)
_FIT_MASKS = np.array([[float(j in sub) for j in range(FIT_UNKNOWNS)] for m in range(1, FIT_UNKNOWNS + 1)
                       for sub in combinations(range(FIT_UNKNOWNS), m)])


@dataclass(frozen=True)
class FittedCompute:
    """One solved fit: the slowdown ``k``, ``a`` (s per model second of tokens), ``b`` (s per instance's model
    second), ``d`` (s per replica instance), ``e`` (s per replica copy sent or received), and the calls behind it."""

    k: float
    a: float
    b: float
    d: float
    calls: int
    noise: float = 0.0  # the ranks' relative spread around the fit within a call (CostParams.compute_noise)
    e: float = 0.0


def corun_matrices(t_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[R, R]`` A0, A1 with ``finish_R = (A0 + k A1) @ work_R`` for ranks ordered as ``t_R`` orders them (the rank
    measured last has the most work): rank ``order[j]`` runs ``1 + k (R - m - 1)`` times slower while ``m`` ranks
    have finished, so its finish is ``sum_{m <= j} (1 + k (R - m - 1)) (w_(m) - w_(m-1))``: linear in k."""
    R = t_R.shape[0]
    order = np.argsort(t_R, kind="stable")
    # In sorted order the finish is lower @ diag(1 + k slope) @ steps @ w, with steps (row m: w_(m) - w_(m-1)) and
    # lower (the sum over m <= j) inverse to each other: A0 = I, and A1's row j is 1 left of the diagonal and
    # slope[j] = R - 1 - j on it (slope falls by one per step). Built directly: this runs twice per measured call.
    A1s = np.tri(R, k=-1)
    A1s[np.arange(R), np.arange(R)] = R - 1 - np.arange(R)
    A1 = np.empty((R, R))
    A1[np.ix_(order, order)] = A1s  # A1[order[j], order[m]] = A1s[j, m]: back to the ranks' order
    return np.eye(R), A1


def uneven(tokens_R: np.ndarray, share: float) -> bool:
    """Whether ranks carrying ``tokens_R`` (> 0) differ by ``share`` of the busiest's or more."""
    return tokens_R.size > 1 and float(tokens_R.max() - tokens_R.min()) >= share * float(tokens_R.max())


class _FitSums:
    """The decaying least-squares sums of one regime's calls (see :class:`ComputeFit`)."""

    def __init__(self) -> None:
        U = FIT_UNKNOWNS
        self.G = np.zeros((3, U, U))  # sums of D0'D0, D0'D1 + D1'D0, D1'D1: G(k) = G[0] + k G[1] + k^2 G[2]
        self.g = np.zeros((2, U))  # sums of D0, D1: g(k) = g[0] + k g[1] (the target is 1 per row)
        self.c = 0.0  # rows
        self.H = np.zeros((3, U, U))  # the same sums over rows centred within their call: the ranks' spread
        self.dof = 0.0  # rows minus calls (the spread's degrees of freedom)

    def decay(self, w: float) -> None:
        for acc in (self.G, self.g, self.H):
            acc *= w
        self.c *= w
        self.dof *= w

    def add(self, D0: np.ndarray, D1: np.ndarray) -> None:
        """One call's rows ``[R', U]`` (``D0 + k D1`` per rank, over its measurement)."""
        _accumulate(self.G, self.g, self.H, D0, D1)
        self.c += float(D0.shape[0])
        self.dof += float(D0.shape[0]) - 1.0

    @classmethod
    def total(cls, parts) -> "_FitSums":
        out = cls()
        for r in parts:
            out.G += r.G
            out.g += r.g
            out.H += r.H
            out.c += r.c
            out.dof += r.dof
        return out


class ComputeFit:
    """Decaying least-squares sums of every rank's measured compute. Every rank's row is ``D0 + k D1`` (linear in the
    slowdown k), so three matrices and two vectors hold the sums of every k of :data:`FIT_SLOWDOWNS` at once.

    The sums are kept per *regime* (the policy whose plan ran the call): a call decays its own regime's sums by
    FIT_DECAY and the others' only by FIT_STALE_DECAY, and the fit solves over their total. Why: one regime's calls
    (``none``'s: every rank the same instance count) cannot tell a per-instance cost from a slowdown; a probe's
    calls of another policy can, and the policy in force's calls must not decay them away before they are used
    (2026-11-26 validation, tok64: 34 calls of ``none`` after 5 balanced ones left those at 0.95^34 = 17 % of their
    weight, and the fit under-predicted the balanced policies' backward by 13-15 %).

    The co-run slowdown k is kept apart: only *uneven* calls show it (ranks whose tokens differ by FIT_UNEVEN of the
    busiest's or more: on balanced ones every rank finishes at ``(1 + k (R - 1)) w``, which a slower machine
    explains as well). Their rows also go into sums of their own that decay by FIT_DECAY per uneven call and never
    otherwise. The regimes' sums pick k as before: the smallest whose residual is within FIT_TIE of the best one's;
    where several are (the calls weighed now cannot tell them apart) and the uneven sums (once FIT_MIN_CALLS calls
    went there) pick one of them, that one is taken, and the other unknowns are solved at it. Why: a run of balanced
    calls decayed the uneven ones away (FIT_STALE_DECAY leaves 3 % of their weight after 170 calls) and the fit took
    k = 0 and a scale that over-stated ``none``'s cost by 10 % in a 90-step run (issue 56). The scale still follows
    the machine (it is solved from the regimes' decaying sums), and where the calls weighed now do show k, theirs is
    taken."""

    def __init__(self) -> None:
        self._regimes: dict[str, _FitSums] = {}
        self._uneven = _FitSums()  # the uneven calls' rows, decayed only by uneven calls: what k is solved from
        self.uneven_calls = 0
        self.calls = 0
        self._solved: tuple[int, FittedCompute | None] | None = None  # (calls when solved, the fit)

    # the sums over every regime, which the solve reads (summed when read: a solve runs every FIT_SOLVE_EVERY calls)
    G = property(lambda self: sum(r.G for r in self._regimes.values()))
    g = property(lambda self: sum(r.g for r in self._regimes.values()))
    c = property(lambda self: sum(r.c for r in self._regimes.values()))
    H = property(lambda self: sum(r.H for r in self._regimes.values()))
    dof = property(lambda self: sum(r.dof for r in self._regimes.values()))

    def add(self, tokens_R, instances_R, replicas_R, t_R, sec_per_token: float, regime: str = "",
            moves_R=None) -> bool:
        """Fold one call in: ``[R]`` tokens, active instances, replica instances and measured seconds per rank;
        ``regime``: the policy whose plan ran it; ``moves_R``: replica copies each rank sent or received (None: 0).
        Ranks that computed nothing or measured nothing are left out; False when no rank was usable."""
        n, i, p, t = (np.asarray(x, dtype=np.float64) for x in (tokens_R, instances_R, replicas_R, t_R))
        m = np.zeros_like(n) if moves_R is None else np.asarray(moves_R, dtype=np.float64)
        use = (t > 0) & (n > 0)
        if use.sum() == 0 or not np.all(np.isfinite(t)):
            return False
        D0, D1 = _rows(n, i, p, m, t, float(sec_per_token), use)  # [R', 4]: each row over its measurement
        for key, sums in self._regimes.items():
            sums.decay(FIT_DECAY if key == regime else FIT_STALE_DECAY)
        self._regimes.setdefault(regime, _FitSums()).add(D0, D1)
        if FIT_UNEVEN is not None and uneven(n[use], FIT_UNEVEN):
            self._uneven.decay(FIT_DECAY)
            self._uneven.add(D0, D1)
            self.uneven_calls += 1
        self.calls += 1
        return True

    def solve(self) -> FittedCompute | None:
        """The best non-negative fit (see the comment above :class:`ComputeFit`), or None before
        :data:`FIT_MIN_CALLS` calls; solved again once :data:`FIT_SOLVE_EVERY` calls were added since the last. A
        solve that fails (no non-negative fit with a token cost: two ranks whose calls all look alike can be fitted
        without one) keeps the last solution: see :meth:`Calibrator._fit_compute` for what mixing did."""
        if self.calls < FIT_MIN_CALLS:
            return None
        if self._solved is not None and self.calls - self._solved[0] < FIT_SOLVE_EVERY:
            return self._solved[1]
        fit = self._solve()
        if fit is None and self._solved is not None:
            fit = self._solved[1]
        self._solved = (self.calls, fit)
        return fit

    def _solve(self) -> FittedCompute | None:
        total = _FitSums.total(self._regimes.values())
        got = _best_per_slowdown(total)
        if got is None:
            return None
        best_r, best_w = got
        near = _near_best(best_r, total.c)  # the slowdowns the calls cannot tell from the best
        kk = int(near[0])
        if self.uneven_calls >= FIT_MIN_CALLS and near.size > 1:  # the one the uneven calls showed, if it is one
            kept = _best_per_slowdown(self._uneven)
            if kept is not None:
                kept_k = int(_near_best(kept[0], self._uneven.c)[0])
                kk = kept_k if kept_k in near else kk
        if not np.isfinite(best_r[kk]) or best_w[kk, 0] <= 0:
            return None
        a, b, d, e = (float(x) for x in best_w[kk])
        k_ = float(FIT_SLOWDOWNS[kk])
        # the ranks' relative spread within a call: a rank's residual minus its call's mean residual is C w (the
        # target, 1 per row, centres to 0), so its mean square is w' H(k) w over the degrees of freedom
        H = total.H
        spread = float(best_w[kk] @ (H[0] + k_ * H[1] + k_ * k_ * H[2]) @ best_w[kk])
        noise = float(np.sqrt(max(spread, 0.0) / total.dof)) if total.dof > 0 else 0.0
        return FittedCompute(k_, a, b, d, self.calls, min(noise, 1.0), e)


def _best_per_slowdown(sums: _FitSums) -> tuple[np.ndarray, np.ndarray] | None:
    """``([K], [K, 4])`` per slowdown of FIT_SLOWDOWNS the least residual of a non-negative fit of ``sums`` and its
    unknowns (inf where none is feasible), or None where no k has one (or a system is singular)."""
    best_r, best_w, ok = _best_fits(sums.G, sums.g, float(sums.c), FIT_SLOWDOWNS, _FIT_MASKS)
    if not ok or not np.isfinite(best_r).any():
        return None
    return best_r, best_w


# ------------------------------------------------------------------------------------------- compiled kernels
# The calibrator folds every measured layer call into two fits (forward, backward) and solves them every
# FIT_SOLVE_EVERY calls, on the call's critical path (after the load all-gather, before the plan). In numpy that was
# 1.2 ms of every layer call on the runtime (2 gloo ranks, 256 tokens per rank: 3-4 % of the call, for every policy;
# dozens of array calls on [R, 4] rows and 615 batched 4 x 4 solves). Compiled, the same arithmetic in loops.

@njit(cache=True)
def _rows(n, i, p, m, t, sec_per_token, use):
    """``(D0, D1)`` ``[R', 4]``: the model seconds ``X = [n spt, i spt, p, m]`` of the used ranks and ``A1 @ X``
    (:func:`corun_matrices`: in ``t``'s order, row j of A1 is 1 left of the diagonal and ``R - 1 - j`` on it), each
    row over its rank's measured seconds."""
    R = n.shape[0]
    X = np.empty((R, 4))
    for r in range(R):
        X[r, 0] = n[r] * sec_per_token
        X[r, 1] = i[r] * sec_per_token
        X[r, 2] = p[r]
        X[r, 3] = m[r]
    order = np.argsort(t, kind="mergesort")  # (stable, as corun_matrices')
    AX = np.zeros((R, 4))
    for j in range(R):
        row = order[j]
        for u in range(4):
            acc = (R - 1 - j) * X[row, u]
            for q in range(j):
                acc += X[order[q], u]
            AX[row, u] = acc
    cnt = 0
    for r in range(R):
        if use[r]:
            cnt += 1
    D0 = np.empty((cnt, 4))
    D1 = np.empty((cnt, 4))
    w = 0
    for r in range(R):
        if use[r]:
            for u in range(4):
                D0[w, u] = X[r, u] / t[r]
                D1[w, u] = AX[r, u] / t[r]
            w += 1
    return D0, D1


@njit(cache=True)
def _accumulate(G, g, H, D0, D1):
    """Add one call's rows to the sums in place: ``G[0] += D0'D0``, ``G[1] += D0'D1 + D1'D0``, ``G[2] += D1'D1``, the
    same of the rows centred within the call into H, and the columns' sums into g."""
    n, U = D0.shape
    m0 = np.zeros(U)
    m1 = np.zeros(U)
    for r in range(n):
        for a in range(U):
            m0[a] += D0[r, a]
            m1[a] += D1[r, a]
    for a in range(U):
        g[0, a] += m0[a]
        g[1, a] += m1[a]
        m0[a] /= n
        m1[a] /= n
    for r in range(n):
        for a in range(U):
            x0, x1 = D0[r, a], D1[r, a]
            c0, c1 = x0 - m0[a], x1 - m1[a]
            for b in range(U):
                y0, y1 = D0[r, b], D1[r, b]
                e0, e1 = y0 - m0[b], y1 - m1[b]
                G[0, a, b] += x0 * y0
                G[1, a, b] += x0 * y1 + x1 * y0
                G[2, a, b] += x1 * y1
                H[0, a, b] += c0 * e0
                H[1, a, b] += c0 * e1 + c1 * e0
                H[2, a, b] += c1 * e1


@njit(cache=True)
def _solve_small(M, x):
    """``M x = b`` in place for a small dense ``M`` (overwritten) and ``x`` (``b`` in, the solution out), by Gaussian
    elimination with partial pivoting (LAPACK's getrf/getrs on one matrix); False where a pivot is exactly 0
    (singular, where numpy raises)."""
    U = M.shape[0]
    for col in range(U):
        piv = col
        big = abs(M[col, col])
        for r in range(col + 1, U):
            if abs(M[r, col]) > big:
                big, piv = abs(M[r, col]), r
        if big == 0.0:
            return False
        if piv != col:
            for c in range(U):
                M[col, c], M[piv, c] = M[piv, c], M[col, c]
            x[col], x[piv] = x[piv], x[col]
        for r in range(col + 1, U):
            f = M[r, col] / M[col, col]
            if f != 0.0:
                for c in range(col, U):
                    M[r, c] -= f * M[col, c]
                x[r] -= f * x[col]
    for r in range(U - 1, -1, -1):
        acc = x[r]
        for c in range(r + 1, U):
            acc -= M[r, c] * x[c]
        x[r] = acc / M[r, r]
    return True


@njit(cache=True)
def _best_fits(G, g, c, slowdowns, masks):
    """Per slowdown k: ``G(k) = G0 + k G1 + k^2 G2``, ``g(k) = g0 + k g1``; every subset of the unknowns (``masks``
    ``[S, U]``: an unknown left out gets the identity row and a 0 right-hand side) solved in unknowns scaled to a unit
    diagonal (tokens, instances and replicas differ by orders of magnitude), its residual ``w'G(k)w - 2 w'g(k) + c``
    where the fit is non-negative and not all 0 (else inf), the least one kept. Returns ``(best_r [K], best_w [K, U],
    ok)``; ok False where a system is singular."""
    K = slowdowns.shape[0]
    S, U = masks.shape
    best_r = np.full(K, np.inf)
    best_w = np.zeros((K, U))
    GK = np.empty((U, U))
    gK = np.empty(U)
    u = np.empty(U)
    A = np.empty((U, U))
    x = np.empty(U)
    for kk in range(K):
        k = slowdowns[kk]
        for a in range(U):
            gK[a] = g[0, a] + k * g[1, a]
            for b in range(U):
                GK[a, b] = G[0, a, b] + k * G[1, a, b] + k * k * G[2, a, b]
        for a in range(U):
            u[a] = 1.0 / np.sqrt(GK[a, a]) if GK[a, a] > 0 else 1.0
        first = True
        for s in range(S):
            for a in range(U):
                for b in range(U):
                    if masks[s, a] > 0 and masks[s, b] > 0:
                        A[a, b] = GK[a, b] * u[a] * u[b] + (1e-12 if a == b else 0.0)
                    else:
                        A[a, b] = 1.0 if a == b else 0.0
                x[a] = gK[a] * u[a] * masks[s, a]
            if not _solve_small(A, x):
                return best_r, best_w, False
            feasible = True
            tot = 0.0
            for a in range(U):
                x[a] *= u[a]
                if x[a] < 0:
                    feasible = False
                tot += x[a]
            if not feasible or tot <= 0:
                continue
            quad = 0.0
            lin = 0.0
            for a in range(U):
                lin += x[a] * gK[a]
                for b in range(U):
                    quad += x[a] * GK[a, b] * x[b]
            r = quad - 2.0 * lin + c
            if first or r < best_r[kk]:
                best_r[kk] = r
                for a in range(U):
                    best_w[kk, a] = x[a]
                first = False
    return best_r, best_w, True


def _near_best(best_r: np.ndarray, rows: float) -> np.ndarray:
    """The indices of the slowdowns whose residual is within FIT_TIE of the best one's, smallest first (balanced
    calls cannot tell a slowdown from a slower machine: all of them are)."""
    floor = max(float(best_r.min()), 0.0)
    return np.flatnonzero(best_r <= floor * (1 + FIT_TIE) + 1e-9 * rows)
