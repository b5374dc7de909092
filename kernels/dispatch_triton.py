"""Triton kernels for :mod:`ultraep.kernels.dispatch`. Imported lazily (needs triton); see ``_backend``.

Legend:
    T  tokens    K  experts per token    H  hidden size    n = T * K (token, k) pairs
    N  rows of the send buffer (pairs not dropped)         G = R * S global slots (bins)
    BLOCK_*  rows / columns per program; the H loop runs inside a program so grids stay 1-D and small

Three row kernels cover forward and backward of both directions:

    gather_rows   out[p] = src[pair[p] // K] (* w[pair[p]])       permute fwd; unpermute bwd (grad_y)
    combine_rows  out[t] = Σ_k (w[t, k] *) y[pos[t, k]]            unpermute fwd; permute bwd (grad_x)
    row_dot       out[t, k] = <y[pos[t, k]], g[t]>                 unpermute bwd (grad_w)

Sums run over k in order in an fp32 (fp64 for fp64 inputs) accumulator: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultraep.kernels._triton_common import cast_rn
from ultraep.kernels.rerouting_triton import group_rank, ranked_block


@triton.jit
def place_kernel(keys_ptr, rank_ptr, base_ptr, pos_ptr, pair_ptr, n, num_bins, num_rows, BLOCK: tl.constexpr):
    """``pos[i] = base[block, key[i]] + rank[i]`` (``-1`` for keys outside ``[0, G)``) and the inverse
    ``pair[pos[i]] = i``. keys/pos ``[n]``, rank ``[n]`` int32, base ``[NB, G]`` int64, pair ``[N]`` int64."""
    pid, offs, m, valid, ks, r = ranked_block(keys_ptr, rank_ptr, n, num_bins, BLOCK)
    p = tl.load(base_ptr + pid * num_bins + ks, mask=valid, other=0) + r
    ok = valid & (p < num_rows)
    tl.store(pos_ptr + offs, tl.where(ok, p, -1), mask=m)
    tl.store(pair_ptr + p, offs, mask=ok)


@triton.jit
def gather_rows_kernel(
    src_ptr, pair_ptr, w_ptr, out_ptr, N, H, K, stride_src, stride_out,
    HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[p, :] = src[pair[p] // K, :]``, times ``w[pair[p]]`` when ``HAS_W``.
    src ``[T, H]``, pair ``[N]`` int64, w ``[n]``, out ``[N, H]``."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rm = rows < N
    pair = tl.load(pair_ptr + rows, mask=rm, other=0)
    tok = pair // K
    if HAS_W:
        w = tl.load(w_ptr + pair, mask=rm, other=0).to(ACC)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rm[:, None] & (cols < H)[None, :]
        x = tl.load(src_ptr + tok[:, None] * stride_src + cols[None, :], mask=m, other=0)
        if HAS_W:
            x = x.to(ACC) * w[:, None]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], cast_rn(x, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def combine_rows_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, T, H, K, stride_y, stride_out,
    HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t, :] = Σ_k w[t, k] * y[pos[t, k], :]`` over ``pos >= 0`` (``w = 1`` without ``HAS_W``),
    summed in k order. y ``[N, H]``, pos ``[T, K]`` int64, w ``[T, K]``, out ``[T, H]``."""
    pid = tl.program_id(0).to(tl.int64)
    toks = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tm = toks < T
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=ACC)
        for k in range(0, K):
            p = tl.load(pos_ptr + toks * K + k, mask=tm, other=-1)
            ok = tm & (p >= 0)
            y = tl.load(y_ptr + p[:, None] * stride_y + cols[None, :], mask=ok[:, None] & cm[None, :], other=0)
            y = y.to(ACC)
            if HAS_W:
                w = tl.load(w_ptr + toks * K + k, mask=ok, other=0).to(ACC)
                y = y * w[:, None]
            acc += y
        tl.store(
            out_ptr + toks[:, None] * stride_out + cols[None, :], cast_rn(acc, out_ptr.dtype.element_ty),
            mask=tm[:, None] & cm[None, :],
        )


@triton.jit
def row_dot_kernel(
    y_ptr, g_ptr, pos_ptr, out_ptr, T, H, K, stride_y, stride_g,
    ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t, k] = Σ_h y[pos[t, k], h] * g[t, h]`` (0 where ``pos < 0``).
    y ``[N, H]``, g ``[T, H]``, pos ``[T, K]`` int64, out ``[T, K]``."""
    pid = tl.program_id(0).to(tl.int64)
    toks = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tm = toks < T
    for k in range(0, K):
        p = tl.load(pos_ptr + toks * K + k, mask=tm, other=-1)
        ok = tm & (p >= 0)
        acc = tl.zeros((BLOCK_ROWS,), dtype=ACC)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cm = cols < H
            y = tl.load(y_ptr + p[:, None] * stride_y + cols[None, :], mask=ok[:, None] & cm[None, :], other=0)
            g = tl.load(g_ptr + toks[:, None] * stride_g + cols[None, :], mask=ok[:, None] & cm[None, :], other=0)
            acc += tl.sum(y.to(ACC) * g.to(ACC), axis=1)
        tl.store(out_ptr + toks * K + k, cast_rn(acc, out_ptr.dtype.element_ty), mask=tm)


# ---------------------------------------------------------------------- launchers (torch tensors in, out)
def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block_h(H: int, interpreted: bool) -> int:
    return max(16, min(256 if interpreted else 512, triton.next_power_of_2(max(H, 1))))


def _block_rows(interpreted: bool) -> int:
    # Interpreted, every program costs milliseconds of Python: few, fat programs. On a GPU, many small ones.
    return 512 if interpreted else 16


def layout(keys: torch.Tensor, num_bins: int, num_rows: int | None, block: int):
    """keys ``[n]`` -> (pos ``[n]`` int64, pair ``[N]`` int64, counts ``[G]`` int64)."""
    n = keys.numel()
    rank, counts = group_rank(keys, num_bins, block)
    counts = counts.to(torch.int64)
    total = counts.sum(dim=0)
    start = torch.cumsum(total, 0) - total
    base = (torch.cumsum(counts, 0) - counts + start).contiguous()  # [NB, G]
    N = int(total.sum()) if num_rows is None else int(num_rows)
    pos = torch.empty(n, dtype=torch.int64, device=keys.device)
    pair = torch.empty(N, dtype=torch.int64, device=keys.device)
    place_kernel[(triton.cdiv(n, block),)](keys, rank, base, pos, pair, n, num_bins, N, BLOCK=block)
    return pos, pair, total


def _launch_rows(kernel, rows: int, H: int, interpreted: bool, *args, **meta) -> None:
    """One program per ``BLOCK_ROWS`` rows; the H loop runs inside the program."""
    block = _block_rows(interpreted)
    kernel[(triton.cdiv(rows, block),)](*args, **meta, BLOCK_ROWS=block, BLOCK_H=_block_h(H, interpreted))


def gather_rows(src, pair, w, K: int, out, interpreted: bool):
    N, H = out.shape
    if N and H:
        _launch_rows(gather_rows_kernel, N, H, interpreted, src, pair, w if w is not None else pair, out, N, H, K,
                     src.stride(0), out.stride(0), HAS_W=w is not None, ACC=_acc(out.dtype))
    return out


def combine_rows(y, pos, w, out, interpreted: bool):
    T, H = out.shape
    if T and H:
        _launch_rows(combine_rows_kernel, T, H, interpreted, y, pos, w if w is not None else pos, out, T, H,
                     pos.shape[1], y.stride(0), out.stride(0), HAS_W=w is not None, ACC=_acc(out.dtype))
    return out


def row_dot(y, g, pos, out, interpreted: bool):
    T, K = pos.shape
    if T and K:
        _launch_rows(row_dot_kernel, T, g.shape[1], interpreted, y, g, pos, out, T, g.shape[1], K, y.stride(0),
                     g.stride(0), ACC=_acc(out.dtype))
    return out
