"""Reroute: logical top-k expert ids of one source rank -> physical instances (global slots).

Legend:
    T  tokens of this source rank      K  experts per token (top-k)
    E  logical experts                 R  ranks     S  slots per rank (global slot id = rank * S + slot)
    I  instances of the most replicated expert (padded width of the per-source table)

The plan's per-source split ``routes[src, r, s]`` says how many of ``src``'s assignments of expert ``e``
go to each instance ``(r, s)`` of ``e``. Reroute realises it token by token (UltraEP §5.2, "upper-bound
lookup"):

    Step 1: number the assignments of each expert in token order: the (t, k) pairs are read row-major
            over ``[T, K]``; the j-th pair with id e gets ``j`` (a stable counting sort).
    Step 2: optionally interleave, ``j' = (j * stride_e + e mod n_e) mod n_e`` with ``n_e`` this source's
            total for e and ``stride_e`` coprime with ``n_e`` (a bijection on ``0..n_e-1``), so
            consecutive tokens spread over the instances (the UltraEP code's ``QUOTA_REROUTE_INTERLEAVE``).
    Step 3: the pair goes to the first instance whose inclusive prefix of counts exceeds ``j'``.

Because ``j'`` runs over ``0..n_e-1`` exactly once per expert, every instance receives exactly
``routes[src, r, s]`` pairs whenever the ids hold ``load[src, e]`` assignments of each expert. Ids
outside ``[0, E)`` (dropped tokens) and assignments beyond the planned total map to ``-1``.

Worked example: instances of expert 3 for this source are global slots (1, 6) with counts (2, 1), so the
prefix row is ``[2, 3]``. Ids ``[[3, 0], [3, 2], [3, 1]]``: the three 3s get j = 0, 1, 2 -> slots 1, 1, 6.
Interleaved, stride = 3 // 2 + 1 = 2 (coprime with 3), offset = 3 mod 3 = 0: j' = 0, 2, 1 -> slots
1, 6, 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np
import torch

from ultraep.kernels._backend import Backend, KernelInputError, is_interpreted, resolve, triton_module, upload


@dataclass(frozen=True)
class RerouteTable:
    """One source rank's instance prefix table (all int64 tensors on one device).

    gid_EI     ``[E, I]`` global slot of each instance of e, in ascending slot order, ``-1`` padded
    cum_EI     ``[E, I]`` inclusive prefix of this source's counts over those instances (padded with total)
    total_E    ``[E]``    this source's assignments of e (``load[src, e]``)
    stride_E   ``[E]``    interleave stride (1 when not interleaved)
    offset_E   ``[E]``    interleave offset (0 when not interleaved)
    """

    gid_EI: torch.Tensor
    cum_EI: torch.Tensor
    total_E: torch.Tensor
    stride_E: torch.Tensor
    offset_E: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.gid_EI.shape[0])

    @property
    def device(self) -> torch.device:
        return self.gid_EI.device

    def to(self, device) -> "RerouteTable":
        return RerouteTable(*(t.to(device) for t in (self.gid_EI, self.cum_EI, self.total_E, self.stride_E, self.offset_E)))

    def counts_EI(self) -> torch.Tensor:
        """``[E, I]`` per-instance counts (the differences of the prefix), 0 on padding."""
        c = torch.diff(self.cum_EI, dim=1, prepend=torch.zeros_like(self.cum_EI[:, :1]))
        return torch.where(self.gid_EI >= 0, c, torch.zeros_like(c))

    @staticmethod
    def from_arrays(
        phy2log_RS: np.ndarray, routes_RS: np.ndarray, *, interleave: bool = False, device=None
    ) -> "RerouteTable":
        """Build from ``phy2log[R, S]`` and one source's ``routes[src][R, S]`` (numpy, int)."""
        p = np.asarray(phy2log_RS, dtype=np.int64).ravel()
        q = np.asarray(routes_RS, dtype=np.int64).ravel()
        if p.shape != q.shape:
            raise KernelInputError(
                "routes_RS", f"shape {np.shape(routes_RS)} differs from phy2log_RS {np.shape(phy2log_RS)}"
            )
        E = int(p.max()) + 1 if p.size and p.max() >= 0 else 0
        # Step 1: instances of each expert in ascending global slot order (stable sort by expert id).
        held = np.flatnonzero(p >= 0)
        order = held[np.argsort(p[held], kind="stable")]
        count_E = np.bincount(p[held], minlength=E)
        width = max(int(count_E.max()) if E else 1, 1)
        start_E = np.concatenate([[0], np.cumsum(count_E)[:-1]]) if E else np.zeros(0, np.int64)
        gid = np.full((E, width), -1, dtype=np.int64)
        cnt = np.zeros((E, width), dtype=np.int64)
        col = np.arange(order.size) - np.repeat(start_E, count_E)
        gid[p[order], col] = order
        cnt[p[order], col] = q[order]
        # Step 2: inclusive prefix over instances (padding repeats the total).
        cum = np.cumsum(cnt, axis=1)
        total = cum[:, -1].copy() if E else np.zeros(0, np.int64)
        stride = np.ones(E, dtype=np.int64)
        offset = np.zeros(E, dtype=np.int64)
        if interleave:
            # Step 3: stride ≈ n / (instances used) + 1, made coprime with n, so j -> j' is a bijection.
            used = (cnt > 0).sum(axis=1)
            for e in range(E):
                n = int(total[e])
                if n <= 1 or used[e] <= 1:
                    continue
                s = n // int(used[e]) + 1
                while gcd(s, n) != 1:
                    s += 1
                stride[e] = s % n
                offset[e] = e % n
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # one asynchronous copy on CUDA (a blocking copy per array would stall the stream five times)
        return RerouteTable(*upload([gid, cum, total, stride, offset], dev))


def reroute_table(plan, src: int, *, interleave: bool = False, device=None) -> RerouteTable:
    """The :class:`RerouteTable` of source rank ``src`` from a :class:`~ultraep.plan.Plan`."""
    R = plan.topology.num_ranks
    if not 0 <= src < R:
        raise KernelInputError("src", f"source rank {src} is outside 0..{R - 1}", src)
    table = RerouteTable.from_arrays(plan.phy2log_RS, plan.routes_RRS[src], interleave=interleave, device=device)
    E = plan.topology.num_experts
    if table.num_experts != E:  # experts with no instance cannot occur in a valid plan
        raise KernelInputError("plan.phy2log_RS", f"holds {table.num_experts} experts, topology has {E}")
    return table


def reroute_reference(ids_TK: torch.Tensor, table: RerouteTable) -> torch.Tensor:
    """Pure-torch reroute. ids ``[T, K]`` (any integer dtype) -> global slots ``[T, K]`` int64."""
    flat = ids_TK.reshape(-1).to(torch.int64)
    n = flat.numel()
    E, I = table.gid_EI.shape
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, torch.full_like(flat, E))
    # Step 1: j = position among equal keys in token order (stable sort).
    order = torch.argsort(key, stable=True)
    # (a scatter, not bincount: bincount on CUDA reads the largest key on the host first)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    start = torch.cumsum(counts, 0) - counts
    j = torch.empty_like(flat)
    j[order] = torch.arange(n, device=flat.device) - start[key[order]]
    es = key.clamp(max=max(E - 1, 0))
    if E == 0:
        return torch.full_like(ids_TK, -1, dtype=torch.int64)
    total = table.total_E[es]
    ok = valid & (j < total)
    # Step 2: interleave (identity when stride 1, offset 0).
    jp = (j * table.stride_E[es] + table.offset_E[es]) % total.clamp(min=1)
    # Step 3: first instance whose inclusive prefix exceeds j'.
    inst = (table.cum_EI[es] <= jp[:, None]).sum(dim=1).clamp(max=I - 1)
    gid = table.gid_EI[es, inst]
    return torch.where(ok, gid, torch.full_like(gid, -1)).reshape(ids_TK.shape)


def reroute(
    ids_TK: torch.Tensor,
    table: RerouteTable,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    block: int | None = None,
) -> torch.Tensor:
    """Logical ids ``[T, K]`` of one source rank -> global slots ``[T, K]`` int64 (see module docstring).

    Args:
        ids_TK: integer tensor ``[T, K]``; ids outside ``[0, E)`` are dropped (-> -1).
        table: this source's :class:`RerouteTable`, on the device of ``ids_TK``.
        out: optional int64 ``[T, K]`` to write into (every element is written).
        backend: ``auto`` (CUDA -> Triton, CPU -> reference), ``triton`` or ``torch``.
        block: assignments per Triton program (power of two); default 256 on GPU, 1024 interpreted.
    """
    if ids_TK.dim() != 2 or ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise KernelInputError("ids_TK", f"expected an integer tensor [T, K], got {ids_TK.dtype} {tuple(ids_TK.shape)}")
    if table.device != ids_TK.device:
        raise KernelInputError("table", f"is on {table.device}, ids_TK on {ids_TK.device}; use table.to(device)")
    if out is not None and (out.shape != ids_TK.shape or out.dtype != torch.int64 or not out.is_contiguous()):
        raise KernelInputError("out", f"expected contiguous int64 {tuple(ids_TK.shape)}, got {out.dtype} {tuple(out.shape)}")
    which = resolve(backend, ids_TK.device, "reroute", 16 * ids_TK.numel())
    if which == "torch":
        res = reroute_reference(ids_TK, table)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty(ids_TK.shape, dtype=torch.int64, device=ids_TK.device)
    if ids_TK.numel() == 0:
        return out
    if table.num_experts == 0:
        return out.fill_(-1)
    blk = block or (1024 if is_interpreted(ids_TK.device) else 256)
    tri = triton_module("rerouting_triton", "reroute")
    tri.reroute(ids_TK.contiguous().reshape(-1), table, out.view(-1), blk)
    return out
