"""Triton kernels for :mod:`ultraep.kernels.tiles` and :mod:`ultraep.kernels.grad_reduce`. Imported lazily
(needs triton); see ``_backend``.

Legend:
    W  work items (one program each): a run of at most one tile of one tensor, or a zero-filled pad
    n  elements of one item (in the unit of its launch: a raw word of 1/2/4/8 bytes, or the element type)
    TW words per tile (forwarding copies whole tiles as int32 words)
    C  contributions (replica gradient tiles) of one master expert, summed in the order given

Tensors of any count and dtype are reached through a table of raw addresses (``data_ptr``) cast to typed
pointers inside the kernel, so one launch serves all tensors of all experts of a message.
Item table rows, int64 ``[W, 4]``: ``(address, n, tensor element offset, buffer element offset)``;
address 0 marks a pad (packing writes zeros there; unpacking skips it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultraep.kernels._triton_common import cast_rn


@triton.jit
def copy_items_kernel(items_ptr, buf_ptr, W, TO_BUF: tl.constexpr, T_DT: tl.constexpr, BLOCK: tl.constexpr):
    """``TO_BUF``: ``buf[boff:boff+n] = tensor[toff:toff+n]`` (zeros for pads); else the reverse (pads skipped).
    Values convert between ``T_DT`` (the tensor's element type) and the buffer's element type."""
    pid = tl.program_id(0).to(tl.int64)
    ok = pid < W  # always true for the grid the launcher uses; every access is masked all the same
    addr = tl.load(items_ptr + pid * 4, mask=ok, other=0)
    n = tl.load(items_ptr + pid * 4 + 1, mask=ok, other=0)
    toff = tl.load(items_ptr + pid * 4 + 2, mask=ok, other=0)
    boff = tl.load(items_ptr + pid * 4 + 3, mask=ok, other=0)
    tptr = addr.to(tl.pointer_type(T_DT))
    # A per-element mask (a scalar `addr != 0` and-ed into a block trips the interpreter).
    live = (tl.zeros((BLOCK,), dtype=tl.int64) + addr) != 0
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < n
        if TO_BUF:
            v = tl.load(tptr + toff + offs, mask=m & live, other=0)
            tl.store(buf_ptr + boff + offs, cast_rn(v, buf_ptr.dtype.element_ty), mask=m)
        else:
            v = tl.load(buf_ptr + boff + offs, mask=m & live, other=0)
            tl.store(tptr + toff + offs, cast_rn(v, T_DT), mask=m & live)


@triton.jit
def gather_tiles_kernel(src_ptr, index_ptr, dst_ptr, n_tiles, TW, BLOCK: tl.constexpr):
    """``dst[i, :] = src[index[i], :]`` for one tile ``i`` per program. src ``[*, TW]``, dst ``[n, TW]`` int32."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.load(index_ptr + pid, mask=pid < n_tiles, other=0)
    live = (tl.zeros((BLOCK,), dtype=tl.int64) + pid) < n_tiles  # per element: see copy_items_kernel
    for w0 in range(0, TW, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        m = (offs < TW) & live
        v = tl.load(src_ptr + s * TW + offs, mask=m, other=0)
        tl.store(dst_ptr + pid * TW + offs, v, mask=m)


@triton.jit
def reduce_items_kernel(
    items_ptr, contrib_ptr, arena_ptr, W, TILE_ELEMS, T_DT: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per item ``(address, n, tensor offset, payload offset, c0, c1)`` (int64 ``[W, 6]``):
    ``g = tensor[toff:toff+n]`` (in fp32); for c in c0..c1-1 in order: ``g += arena[contrib[c] * TILE_ELEMS +
    poff : + n]``; store ``g`` back in ``T_DT``. ``ZERO`` zeroes each consumed arena range.
    arena ``[*, TILE_ELEMS]`` fp32, contrib ``[C_total]`` int64 (first tile of each contribution)."""
    pid = tl.program_id(0).to(tl.int64)
    ok = pid < W
    addr = tl.load(items_ptr + pid * 6, mask=ok, other=0)
    n = tl.load(items_ptr + pid * 6 + 1, mask=ok, other=0)
    toff = tl.load(items_ptr + pid * 6 + 2, mask=ok, other=0)
    poff = tl.load(items_ptr + pid * 6 + 3, mask=ok, other=0)
    c0 = tl.load(items_ptr + pid * 6 + 4, mask=ok, other=0)
    c1 = tl.load(items_ptr + pid * 6 + 5, mask=ok, other=0)
    tptr = addr.to(tl.pointer_type(T_DT))
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < n
        acc = tl.load(tptr + toff + offs, mask=m, other=0).to(tl.float32)
        for c in range(c0, c1):
            base = tl.load(contrib_ptr + c, mask=c < c1, other=0) * TILE_ELEMS + poff
            acc += tl.load(arena_ptr + base + offs, mask=m, other=0)
            if ZERO:
                tl.store(arena_ptr + base + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=m)
        tl.store(tptr + toff + offs, cast_rn(acc, T_DT), mask=m)


_TL = {
    torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float64: tl.float64,
    torch.uint8: tl.uint8, torch.int16: tl.int16, torch.int32: tl.int32, torch.int64: tl.int64,
}


def tl_dtype(dtype: torch.dtype):
    return _TL[dtype]


def copy_items(items: torch.Tensor, buf: torch.Tensor, to_buf: bool, t_dtype: torch.dtype, interpreted: bool) -> None:
    """items int64 ``[W, 4]`` on buf's device; buf a flat view in the launch's buffer unit."""
    if items.shape[0] == 0:
        return
    block = 4096 if interpreted else 1024
    copy_items_kernel[(items.shape[0],)](items, buf, items.shape[0], TO_BUF=to_buf, T_DT=_TL[t_dtype], BLOCK=block)


def gather_tiles(src_words: torch.Tensor, index: torch.Tensor, dst_words: torch.Tensor, interpreted: bool) -> None:
    """src ``[*, TW]`` / dst ``[n, TW]`` int32 views, index ``[n]`` int64."""
    n, tw = dst_words.shape
    if n == 0:
        return
    block = min(8192 if interpreted else 2048, triton.next_power_of_2(tw))
    gather_tiles_kernel[(n,)](src_words, index, dst_words, n, tw, BLOCK=block)


def reduce_items(items, contrib, arena_f32, tile_elems: int, t_dtype: torch.dtype, zero: bool, interpreted: bool) -> None:
    if items.shape[0] == 0:
        return
    block = 4096 if interpreted else 1024
    reduce_items_kernel[(items.shape[0],)](
        items, contrib, arena_f32, items.shape[0], tile_elems, T_DT=_TL[t_dtype], ZERO=zero, BLOCK=block
    )
