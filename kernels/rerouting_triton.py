"""Triton kernels for :mod:`ultraep.kernels.rerouting` and the counting sort shared with
:mod:`ultraep.kernels.dispatch`. Imported lazily (needs triton); see ``_backend``.

Legend:
    n   flattened (token, k) assignments, row-major over ``[T, K]``
    B   assignments per program (``BLOCK``); NB = ceil(n / B) programs
    G   bins of the counting sort (E logical experts for reroute, R * S global slots for permute)
    E   logical experts     I  instances of the most replicated expert (padded width of the table)

The counting sort is stable and deterministic without atomics: each program ranks its B keys among the
earlier equal keys of its own block with a ``[B, B]`` comparison, and the last occurrence of each key
writes the block's count. A torch ``cumsum`` over blocks then turns counts into per-block offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def group_rank_kernel(keys_ptr, rank_ptr, counts_ptr, n, num_bins, BLOCK: tl.constexpr):
    """Per block: ``rank[i]`` = earlier keys equal to ``keys[i]`` in the block (``-1`` for keys outside
    ``[0, G)``); ``counts[block, g]`` = keys equal to ``g`` in the block (only bins present are written).

    keys ``[n]`` int32/int64, rank ``[n]`` int32, counts ``[NB, G]`` int32 (zeroed by the caller).
    """
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    offs = pid * BLOCK + idx
    m = offs < n
    key = tl.load(keys_ptr + offs, mask=m, other=-1).to(tl.int64)
    valid = m & (key >= 0) & (key < num_bins)
    key = tl.where(valid, key, -1)
    same = (key[:, None] == key[None, :]) & valid[:, None]
    before = tl.sum((same & (idx[None, :] < idx[:, None])).to(tl.int32), axis=1)
    after = tl.sum((same & (idx[None, :] > idx[:, None])).to(tl.int32), axis=1)
    tl.store(rank_ptr + offs, tl.where(valid, before, -1), mask=m)
    tl.store(counts_ptr + pid * num_bins + key, before + 1, mask=valid & (after == 0))


@triton.jit
def ranked_block(keys_ptr, rank_ptr, n, num_bins, BLOCK: tl.constexpr):
    """This program's block after :func:`group_rank_kernel`: ``(pid, offs, in range, valid, key, rank)`` with
    keys outside ``[0, G)`` marked invalid and clamped to 0; key and rank as int64 ``[B]``."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    key = tl.load(keys_ptr + offs, mask=m, other=-1).to(tl.int64)
    valid = m & (key >= 0) & (key < num_bins)
    ks = tl.where(valid, key, 0)
    r = tl.load(rank_ptr + offs, mask=valid, other=0).to(tl.int64)
    return pid, offs, m, valid, ks, r


@triton.jit
def reroute_kernel(
    ids_ptr, rank_ptr, boff_ptr, cum_ptr, gid_ptr, total_ptr, stride_ptr, offset_ptr, out_ptr,
    n, E, I, BLOCK: tl.constexpr, I_PAD: tl.constexpr,
):
    """``out[i]`` = global slot of the instance that the ``j``-th assignment of expert ``e = ids[i]`` goes
    to, ``j = boff[block, e] + rank[i]``; interleaved ``j' = (j * stride[e] + offset[e]) mod total[e]``;
    the instance is the first whose inclusive prefix ``cum[e, ·]`` exceeds ``j'``. ``-1`` for ids outside
    ``[0, E)`` and for assignments beyond the planned ``total[e]``.

    ids ``[n]``, rank ``[n]`` int32, boff ``[NB, E]`` int64, cum/gid ``[E, I]`` int64,
    total/stride/offset ``[E]`` int64, out ``[n]`` int64.
    """
    pid, offs, m, valid, es, r = ranked_block(ids_ptr, rank_ptr, n, E, BLOCK)
    j = tl.load(boff_ptr + pid * E + es, mask=valid, other=0) + r
    total = tl.load(total_ptr + es, mask=valid, other=0)
    stride = tl.load(stride_ptr + es, mask=valid, other=1)
    shift = tl.load(offset_ptr + es, mask=valid, other=0)
    ok = valid & (j < total)
    jp = (j * stride + shift) % tl.where(total > 0, total, 1)
    ii = tl.arange(0, I_PAD)
    cm = ok[:, None] & (ii[None, :] < I)
    cum = tl.load(cum_ptr + es[:, None] * I + ii[None, :], mask=cm, other=0)
    inst = tl.sum(((cum <= jp[:, None]) & cm).to(tl.int64), axis=1)
    gid = tl.load(gid_ptr + es * I + inst, mask=ok & (inst < I), other=-1)
    tl.store(out_ptr + offs, tl.where(ok, gid, -1), mask=m)


def group_rank(keys: torch.Tensor, num_bins: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`group_rank_kernel`. keys ``[n]`` -> (rank ``[n]`` int32, counts ``[NB, G]`` int32)."""
    n = keys.numel()
    nb = triton.cdiv(n, block)
    rank = torch.empty(n, dtype=torch.int32, device=keys.device)
    counts = torch.zeros((nb, num_bins), dtype=torch.int32, device=keys.device)
    group_rank_kernel[(nb,)](keys, rank, counts, n, num_bins, BLOCK=block)
    return rank, counts


def reroute(ids: torch.Tensor, table, out: torch.Tensor, block: int) -> torch.Tensor:
    """ids ``[n]`` (contiguous), table: a :class:`~ultraep.kernels.rerouting.RerouteTable` on ids' device,
    out ``[n]`` int64. Two launches plus a cumsum."""
    n = ids.numel()
    E, I = table.gid_EI.shape
    rank, counts = group_rank(ids, E, block)
    counts = counts.to(torch.int64)
    boff = torch.cumsum(counts, dim=0) - counts  # [NB, E] exclusive prefix over blocks
    reroute_kernel[(triton.cdiv(n, block),)](
        ids, rank, boff, table.cum_EI, table.gid_EI, table.total_E, table.stride_E, table.offset_E, out,
        n, E, I, BLOCK=block, I_PAD=triton.next_power_of_2(I),
    )
    return out
