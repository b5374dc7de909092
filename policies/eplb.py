"""``eplb``: historical balancing after DeepSeek EPLB (``deepseek-ai/EPLB``, ``eplb.py``). Independent
implementation of the published algorithm, in numpy + numba.

Two things live here:

1. :func:`rebalance_experts` reproduces DeepSeek's function exactly (same arguments, same outputs, the
   README example is a test), plus an opt-in ``anti_affinity`` mode that never packs two copies of an
   expert onto one GPU (deepseek-ai/EPLB issue #22).
2. :class:`EplbPolicy`, historical balancing for ultraep's runtime: masters stay fixed (ultraep never
   reorders experts), replicas are placed from a window (or EWMA) of *past* loads every ``interval``
   steps, tokens are split evenly across an expert's instances, and history advances only on ``commit``.

Legend: L layers, E logical experts, P physical experts (replicas in EPLB's sense), G groups,
Nn nodes, Ng GPUs; X rows of a batched helper.

Algorithm of ``rebalance_experts`` (hierarchical when ``num_groups % num_nodes == 0``, global otherwise,
which is the hierarchical one with one group and one node):

    Step 1: pack expert groups onto nodes, balancing the group loads (balanced_packing).
    Step 2: inside each node, add replicas one at a time to the expert with the largest load per
            replica, until the node has P / Nn physical experts (replicate_experts).
    Step 3: pack each node's physical experts (load / replica count each) onto its GPUs
            (balanced_packing), then map everything back to global ids.

balanced_packing: items by weight (desc), each into the lightest pack that still has room; every pack
gets exactly n / packs items (identity when that is 1).

Worked example (DeepSeek's README): weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
[20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], 16 replicas, 4 groups, 2 nodes, 8 GPUs →
phy2log = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]].
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numba import njit

from ultraep.errors import ConfigError
from ultraep.plan import Plan
from ultraep.topology import Topology

from .base import assemble_plan


# ---------------------------------------------------------------------------------------------- kernels
@njit(cache=True)
def _balanced_packing(weight, num_packs, item_key, anti_affinity):
    """``[X, n] -> (pack [X, n], rank_in_pack [X, n])``. With ``anti_affinity`` an item avoids packs that
    already hold an item of the same ``item_key`` (``[X, n]``) while another pack with room allows it."""
    X, n = weight.shape
    per_pack = n // num_packs
    pack = np.empty((X, n), np.int64)
    rank = np.empty((X, n), np.int64)
    if per_pack == 1:
        for x in range(X):
            for i in range(n):
                pack[x, i] = i
                rank[x, i] = 0
        return pack, rank
    pw = np.zeros(num_packs, np.float64)
    cnt = np.zeros(num_packs, np.int64)
    keys = np.empty((num_packs, per_pack), np.int64)
    for x in range(X):
        order = np.argsort(-weight[x], kind="mergesort")
        pw[:] = 0.0
        cnt[:] = 0
        for i in order:
            best = -1
            for p in range(num_packs):
                if cnt[p] >= per_pack:
                    continue
                if anti_affinity:
                    clash = False
                    for k in range(cnt[p]):
                        if keys[p, k] == item_key[x, i]:
                            clash = True
                    if clash:
                        continue
                if best < 0 or pw[p] < pw[best]:
                    best = p
            if best < 0:  # anti-affinity impossible for this item: lightest pack with room
                for p in range(num_packs):
                    if cnt[p] < per_pack and (best < 0 or pw[p] < pw[best]):
                        best = p
            pack[x, i] = best
            rank[x, i] = cnt[best]
            keys[best, cnt[best]] = item_key[x, i]
            pw[best] += weight[x, i]
            cnt[best] += 1
    return pack, rank


@njit(cache=True)
def _replicate_experts(weight, num_phy):
    """``[X, n] float32 -> (phy2log [X, num_phy], replica_rank [X, num_phy], count [X, n])``: replicas go
    one at a time to the expert with the largest load per replica (first index on ties)."""
    X, n = weight.shape
    phy2log = np.empty((X, num_phy), np.int64)
    rank = np.zeros((X, num_phy), np.int64)
    cnt = np.ones((X, n), np.int64)
    for x in range(X):
        for i in range(n):
            phy2log[x, i] = i
        for i in range(n, num_phy):
            best = 0
            bv = np.float32(weight[x, 0]) / np.float32(cnt[x, 0])
            for e in range(1, n):
                v = np.float32(weight[x, e]) / np.float32(cnt[x, e])
                if v > bv:
                    bv = v
                    best = e
            phy2log[x, i] = best
            rank[x, i] = cnt[x, best]
            cnt[x, best] += 1
    return phy2log, rank, cnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    rows = np.arange(perm.shape[0])[:, None]
    inv[rows, perm] = np.arange(perm.shape[1])[None, :]
    return inv


def _hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus, anti_affinity):
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus
    # Step 1: groups -> nodes.
    tokens_per_group = weight.reshape(L, num_groups, group_size).sum(-1)
    gkey = np.zeros(tokens_per_group.shape, np.int64)
    g_pack, g_rank = _balanced_packing(tokens_per_group.astype(np.float64), num_nodes, gkey, False)
    log2mlog = (((g_pack * groups_per_node + g_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # Step 2: replicas inside each node.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate_experts(tokens_per_mlog, num_physical // num_nodes)
    # Step 3: physical experts -> GPUs of the node.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, -1)
    pack, rank_in_pack = _balanced_packing(
        tokens_per_phy.astype(np.float64), num_gpus // num_nodes, phy2mlog, anti_affinity
    )
    phy2pphy = pack * phy_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    offsets = np.arange(0, E, E // num_nodes).reshape(1, -1, 1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1) + offsets).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, anti_affinity: bool = False):
    """DeepSeek EPLB's entry point.

    Args:
        weight: ``[L, E]`` load estimate per layer and logical expert (any numeric array or tensor).
        num_replicas: physical experts P (a multiple of ``num_gpus``, at least E).
        num_groups: expert groups (group-limited routing); hierarchical policy iff divisible by nodes.
        num_nodes, num_gpus: cluster shape (GPUs a multiple of nodes).
        anti_affinity: never two copies of one expert on a GPU when avoidable (not in DeepSeek's code).

    Returns:
        ``phy2log [L, P]``, ``log2phy [L, E, maxcnt]`` (-1 padded), ``logcnt [L, E]``, all int64 numpy.
    """
    w = np.asarray(weight.cpu() if hasattr(weight, "cpu") else weight, dtype=np.float32)
    if w.ndim != 2:
        raise ConfigError("weight", f"must be [layers, experts], got shape {w.shape}", w.shape)
    L, E = w.shape
    if num_gpus <= 0 or num_nodes <= 0 or num_groups <= 0:
        raise ConfigError("num_gpus", "num_groups, num_nodes and num_gpus must be positive",
                          (num_groups, num_nodes, num_gpus))
    if num_gpus % num_nodes:
        raise ConfigError("num_gpus", f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})", num_gpus)
    if num_replicas % num_gpus:
        raise ConfigError("num_replicas", f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})",
                          num_replicas)
    if num_replicas < E:
        raise ConfigError("num_replicas", f"num_replicas ({num_replicas}) must be >= num_experts ({E})", num_replicas)
    if num_groups % num_nodes == 0:
        if E % num_groups:
            raise ConfigError("num_groups", f"num_experts ({E}) must be divisible by num_groups ({num_groups})",
                              num_groups)
        if num_replicas % num_nodes:
            raise ConfigError("num_replicas", f"num_replicas ({num_replicas}) must be a multiple of num_nodes "
                              f"({num_nodes})", num_replicas)
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus, anti_affinity)
    else:
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus, anti_affinity)
    maxcnt = int(logcnt.max())
    log2phy = np.full((L, E, maxcnt), -1, dtype=np.int64)
    layers = np.repeat(np.arange(L), num_replicas)
    log2phy[layers, phy2log.ravel(), phyrank.ravel()] = np.tile(np.arange(num_replicas), L)
    return phy2log.astype(np.int64), log2phy, logcnt.astype(np.int64)


@njit(cache=True)
def _place_replicas(w_E, home_E, masters_RM, D, N):
    """Historical placement with fixed masters, per domain.

    Step 1: the domain's D * N redundant slots go one at a time to the expert with the largest predicted
            load per instance (at most one instance per rank, so at most D per expert).
    Step 2: replicas by predicted load per instance (desc) go to the rank with the least predicted load
            that has a free slot and does not hold the expert yet.
    Returns replicas ``(e, rank, slot)`` ``[P]``.
    """
    R = masters_RM.shape[0]
    E = w_E.shape[0]
    M = masters_RM.shape[1]
    cnt = np.ones(E, np.int64)
    out_e = np.empty(R * N, np.int64)
    out_r = np.empty(R * N, np.int64)
    out_s = np.empty(R * N, np.int64)
    n_out = 0
    used = np.zeros(R, np.int64)
    pred = np.zeros(R, np.float64)
    hosts = np.zeros((R, E), np.bool_)
    for d in range(R // D):
        d0 = d * D
        # Step 1: replica counts.
        for _ in range(D * N):
            best = -1
            bv = 0.0
            for r in range(d0, d0 + D):
                for m in range(M):
                    e = masters_RM[r, m]
                    if e < 0 or cnt[e] >= D:
                        continue
                    v = w_E[e] / cnt[e]
                    if v > bv:
                        bv = v
                        best = e
            if best < 0:
                break
            cnt[best] += 1
        # Step 2: placement, heaviest replica first.
        for r in range(d0, d0 + D):
            for m in range(M):
                e = masters_RM[r, m]
                if e >= 0:
                    pred[r] += w_E[e] / cnt[e]
                    hosts[r, e] = True
        items = []
        for r in range(d0, d0 + D):
            for m in range(M):
                e = masters_RM[r, m]
                if e >= 0:
                    for _ in range(cnt[e] - 1):
                        items.append(e)
        if len(items) == 0:
            continue
        item_arr = np.array(items, dtype=np.int64)
        per = np.empty(item_arr.shape[0], np.float64)
        for i in range(item_arr.shape[0]):
            per[i] = w_E[item_arr[i]] / cnt[item_arr[i]]
        order = np.argsort(-per, kind="mergesort")
        for i in order:
            e = item_arr[i]
            best = -1
            for r in range(d0, d0 + D):
                if used[r] < N and not hosts[r, e] and (best < 0 or pred[r] < pred[best]):
                    best = r
            if best < 0:
                continue
            out_e[n_out] = e
            out_r[n_out] = best
            out_s[n_out] = M + used[best]
            n_out += 1
            used[best] += 1
            hosts[best, e] = True
            pred[best] += per[i]
    return out_e[:n_out], out_r[:n_out], out_s[:n_out]


# ---------------------------------------------------------------------------------------------- policy
#: Planner latency of EPLB fed the exact current load ("EPLB+"), seconds: it plans on the critical path of
#: every microbatch, 0.153 ms in the UltraEP paper's planner ablation (arXiv 2606.04101 Table 3, EP64). The
#: historical policy plans off the critical path (from past loads) and is charged nothing.
EPLB_PLUS_PLAN_S = 1.53e-4


class EplbPolicy:
    """Historical balancing for the runtime: replicas from past load, even token split.

    Options:
        interval: steps between re-placements (a step = one committed plan of this layer). The first
            placement happens as soon as one load is committed (step 1), then every ``interval`` steps.
        window: past loads averaged for the estimate (ignored with ``ewma``).
        ewma: if set, an exponential moving average with this weight on the newest load instead of a window.
        use_current_load: plan from the load being balanced (DeepSeek EPLB fed exact load, the "EPLB+"
            baseline of the UltraEP paper) instead of history; ``plan_layer`` uses this.
        relay: weight-transfer tree, ``auto`` | ``direct`` | ``always``.
    """

    name = "eplb"
    #: historical placement is decided off the critical path (0); fed the current load (EPLB+) it plans on it
    #: and its plans carry EPLB_PLUS_PLAN_S instead
    planner_s = 0.0
    #: defaults of a one-shot plan (``plan_layer``): with no history, plan from the load given (EPLB+)
    one_shot_options = {"use_current_load": True}
    #: options counted in committed plans of the layer: a replay of every k-th point divides them by k, so that
    #: they keep their stretch in steps (the simulator's stride)
    step_count_options = ("interval", "window")

    def __init__(self, interval: int = 50, window: int = 50, ewma: float | None = None,
                 use_current_load: bool = False, relay: str = "auto") -> None:
        self.interval = int(interval)
        self.window = int(window)
        self.ewma = ewma
        self.use_current_load = bool(use_current_load)
        self.relay = relay
        self._history: deque[np.ndarray] = deque(maxlen=self.window)
        self._ewma_E: np.ndarray | None = None
        self._replicas: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (e, rank, slot)
        self._age = 0  # steps since the current placement was made

    @property
    def placement_interval(self) -> int:
        """Decisions a placement stays resident: a chooser switching to this historical placement sends all its
        replicas once and spreads that switching cost over this many decisions."""
        return self.interval

    def _estimate(self) -> np.ndarray | None:
        if self.ewma is not None:
            return self._ewma_E
        if not self._history:
            return None
        return np.mean(np.stack(self._history), axis=0)

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        t = topology
        refresh = self.use_current_load or self._replicas is None or self._age >= self.interval
        w = None
        if refresh:
            w = load_RE.sum(axis=0).astype(np.float64) if self.use_current_load else self._estimate()
            if w is None or t.num_redundant_slots == 0 or t.D == 1:
                z = np.zeros(0, dtype=np.int64)
                reps = (z, z, z)
            else:
                reps = _place_replicas(w, t.home_E, t.masters_RM, t.D, t.num_redundant_slots)
        else:
            reps = self._replicas
        e, r, s = reps
        # Only replicas that are new relative to the committed placement move weights.
        mask = None
        if self._replicas is not None and len(e):
            old = set(zip(self._replicas[0].tolist(), self._replicas[1].tolist()))
            mask = np.array([(a, b) not in old for a, b in zip(e.tolist(), r.tolist())], dtype=bool)
        return assemble_plan(
            self.name, t, load_RE, e, r, s, None, transfer_mask=mask, relay=self.relay,
            # "placed": the refresh had an estimate to place from. Without one (no load committed yet) the
            # masters-only plan is not a placement: the next step places as soon as history exists
            # instead of waiting ``interval`` steps (issue 15, item 2).
            info={"refreshed": bool(refresh), "placed": bool(refresh and w is not None),
                  "age": 0 if refresh else self._age, "replicas": reps},
            planner_s=EPLB_PLUS_PLAN_S if self.use_current_load else self.planner_s,
        )

    def commit(self, plan: Plan) -> None:
        self._fold(plan.expert_load_E)
        if plan.info.get("refreshed") and plan.info.get("placed", True):
            self._replicas = plan.info["replicas"]
            self._age = 1
        else:
            self._age += 1

    def advance(self, load_RE: np.ndarray) -> None:
        """History advances with a load this policy did not plan (a chooser rested it): the window and EWMA take
        it, the placement ages; no re-placement happens (the next plan re-places if one is due)."""
        self._fold(load_RE.sum(axis=0))
        self._age += 1

    def _fold(self, lam_E: np.ndarray) -> None:
        lam = lam_E.astype(np.float64)
        if self.ewma is not None:
            self._ewma_E = lam if self._ewma_E is None else self.ewma * lam + (1 - self.ewma) * self._ewma_E
        self._history.append(lam)
