"""Dispatch permutation and combine: (token, k) pairs -> a send buffer ordered by destination, and back.

Legend:
    T  tokens of this source rank     K  experts per token       H  hidden size
    R  ranks    S  slots per rank     G = R * S global slots     N  rows of the send buffer

After :func:`~ultraep.kernels.rerouting.reroute` every pair ``(t, k)`` has a global slot ``g = r * S + s``.

    Step 1 (:func:`dispatch_layout`): a stable counting sort by ``g`` gives each pair its send row
            ``pos[t, k]`` (rank-major, then slot, then token order) and the inverse ``pair[p] = t * K + k``;
            per-rank row counts are the ``input_split_sizes`` of ``all_to_all_single``. Pairs with
            ``g < 0`` (dropped) get ``pos = -1`` and no row.
    Step 2 (:func:`permute`): ``send[p] = x[pair[p] // K]``.
    Step 3 (:func:`unpermute`, after the experts and the reverse all-to-all): the combine
            ``out[t] = Σ_k w[t, k] * y[pos[t, k]]``, summed in k order with an fp32 accumulator.

Both directions are differentiable (``torch.autograd.Function`` around the Triton kernels; the references
use plain torch autograd): permute's backward is a combine with unit weights, unpermute's backward is a
weighted gather (grad of y) and a row dot product (grad of w).

Worked example: S = 2, K = 2, slots ``[[3, 0], [1, 3]]`` (token 0 -> g 3, 0; token 1 -> g 1, 3):
sorted by g the pairs are (0,1) g0, (1,0) g1, (0,0) g3, (1,1) g3, so ``pos = [[2, 0], [1, 3]]``,
``pair = [1, 2, 0, 3]``, rows per rank (g // 2) ``[2, 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultraep.kernels._backend import Backend, KernelInputError, is_interpreted, resolve, triton_module


@dataclass(frozen=True)
class DispatchLayout:
    """Where each (token, k) pair goes in the send buffer.

    pos_TK          ``[T, K]`` int64  send row of pair (t, k), ``-1`` if dropped
    pair_N          ``[N]``    int64  flat pair index ``t * K + k`` of send row p
    slot_counts_G   ``[G]``    int64  rows per global slot (``G = R * S``)
    num_ranks, num_slots              R and S
    """

    pos_TK: torch.Tensor
    pair_N: torch.Tensor
    slot_counts_G: torch.Tensor
    num_ranks: int
    num_slots: int

    @property
    def num_rows(self) -> int:
        return int(self.pair_N.shape[0])

    @property
    def rank_counts_R(self) -> torch.Tensor:
        """``[R]`` rows sent to each rank."""
        return self.slot_counts_G.view(self.num_ranks, self.num_slots).sum(dim=1)

    def input_split_sizes(self) -> list[int]:
        """Per-rank row counts for ``torch.distributed.all_to_all_single`` (a host sync on GPU)."""
        return [int(c) for c in self.rank_counts_R.tolist()]


def _check_phys(phys_TK: torch.Tensor) -> None:
    if phys_TK.dim() != 2 or phys_TK.dtype.is_floating_point or phys_TK.dtype == torch.bool:
        raise KernelInputError(
            "phys_TK", f"expected an integer tensor [T, K] of global slots, got {phys_TK.dtype} {tuple(phys_TK.shape)}"
        )


def dispatch_layout_reference(phys_TK: torch.Tensor, num_ranks: int, num_slots: int,
                              num_rows: int | None = None) -> DispatchLayout:
    """Pure-torch :func:`dispatch_layout`. ``num_rows``: the pairs not dropped, taken as exact (None: counted,
    which on a GPU reads the count on the host)."""
    _check_phys(phys_TK)
    G = num_ranks * num_slots
    flat = phys_TK.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < G)
    key = torch.where(valid, flat, torch.full_like(flat, G))
    order = torch.argsort(key, stable=True)
    # (a scatter, not bincount: bincount on CUDA reads the largest key on the host first)
    counts = torch.zeros(G + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))[:G]
    N = int(valid.sum()) if num_rows is None else int(num_rows)
    pos = torch.full_like(flat, -1)
    pos[order[:N]] = torch.arange(N, device=flat.device)
    return DispatchLayout(pos.view(phys_TK.shape), order[:N].contiguous(), counts, num_ranks, num_slots)


def dispatch_layout(
    phys_TK: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    *,
    num_rows: int | None = None,
    backend: Backend = "auto",
    block: int | None = None,
) -> DispatchLayout:
    """Stable counting sort of the pairs by global slot (Step 1 of the module docstring).

    Args:
        phys_TK: ``[T, K]`` global slots ``r * S + s`` (from reroute); values outside ``[0, R*S)`` drop.
        num_ranks, num_slots: R and S.
        num_rows: the number of pairs not dropped, when the caller knows it (``routes[src].sum()`` from
            the plan); saves a device-to-host sync on GPU. Must be exact.
        backend, block: see :func:`~ultraep.kernels.rerouting.reroute`.
    """
    _check_phys(phys_TK)
    if num_ranks < 1 or num_slots < 1:
        raise KernelInputError("num_ranks", f"num_ranks ({num_ranks}) and num_slots ({num_slots}) must be >= 1")
    which = resolve(backend, phys_TK.device, "dispatch_layout", 24 * phys_TK.numel())
    if which == "torch" or phys_TK.numel() == 0:
        # on a GPU the given count is trusted, as the Triton kernel trusts it (checking it would synchronise)
        lay = dispatch_layout_reference(phys_TK, num_ranks, num_slots, num_rows if phys_TK.is_cuda else None)
        if num_rows is not None and num_rows != lay.num_rows:
            raise KernelInputError("num_rows", f"({num_rows}) differs from the {lay.num_rows} pairs not dropped", num_rows)
        return lay
    blk = block or (1024 if is_interpreted(phys_TK.device) else 256)
    tri = triton_module("dispatch_triton", "dispatch_layout")
    pos, pair, counts = tri.layout(phys_TK.contiguous().view(-1), num_ranks * num_slots, num_rows, blk)
    return DispatchLayout(pos.view(phys_TK.shape), pair, counts, num_ranks, num_slots)


# ---------------------------------------------------------------------------------------------- references
def permute_reference(x_TH: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """``[T, H]`` -> send buffer ``[N, H]`` (torch autograd)."""
    K = layout.pos_TK.shape[1]
    return x_TH[layout.pair_N // K]


def unpermute_reference(y_NH: torch.Tensor, weights_TK: torch.Tensor | None, layout: DispatchLayout) -> torch.Tensor:
    """``[N, H]`` expert outputs in send order + weights ``[T, K]`` -> combined ``[T, H]`` (torch autograd).
    ``weights_TK=None`` means unit weights."""
    acc = torch.float64 if y_NH.dtype == torch.float64 else torch.float32
    pos = layout.pos_TK
    N, H = y_NH.shape
    padded = torch.cat([y_NH, y_NH.new_zeros(1, H)])  # row N is the zero row for dropped pairs
    rows = padded[torch.where(pos >= 0, pos, torch.full_like(pos, N))].to(acc)  # [T, K, H]
    if weights_TK is not None:
        rows = rows * weights_TK.to(acc)[..., None]
    return rows.sum(dim=1).to(y_NH.dtype)


# ---------------------------------------------------------------------------------------------- autograd
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, pair_N, pos_TK, out):
        tri = triton_module("dispatch_triton", "permute")
        K = pos_TK.shape[1]
        if out is None:
            out = torch.empty((pair_N.shape[0], x_TH.shape[1]), dtype=x_TH.dtype, device=x_TH.device)
        else:
            ctx.mark_dirty(out)
        tri.gather_rows(x_TH, pair_N, None, K, out, is_interpreted(x_TH.device))
        ctx.save_for_backward(pos_TK)
        ctx.x_shape = x_TH.shape
        return out

    @staticmethod
    def backward(ctx, g_NH):
        (pos_TK,) = ctx.saved_tensors
        tri = triton_module("dispatch_triton", "permute")
        g_NH = g_NH.contiguous()
        grad_x = torch.empty(ctx.x_shape, dtype=g_NH.dtype, device=g_NH.device)
        tri.combine_rows(g_NH, pos_TK, None, grad_x, is_interpreted(g_NH.device))
        return grad_x, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, w_TK, pos_TK, pair_N, out):
        tri = triton_module("dispatch_triton", "unpermute")
        T = pos_TK.shape[0]
        if out is None:
            out = torch.empty((T, y_NH.shape[1]), dtype=y_NH.dtype, device=y_NH.device)
        else:
            ctx.mark_dirty(out)
        tri.combine_rows(y_NH, pos_TK, w_TK, out, is_interpreted(y_NH.device))
        ctx.save_for_backward(y_NH, w_TK, pos_TK, pair_N)
        return out

    @staticmethod
    def backward(ctx, g_TH):
        y_NH, w_TK, pos_TK, pair_N = ctx.saved_tensors
        tri = triton_module("dispatch_triton", "unpermute")
        g_TH = g_TH.contiguous()
        interp = is_interpreted(g_TH.device)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = torch.empty_like(y_NH)
            tri.gather_rows(g_TH, pair_N, w_TK, pos_TK.shape[1], grad_y, interp)
        if w_TK is not None and ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(w_TK)
            tri.row_dot(y_NH, g_TH, pos_TK, grad_w, interp)
        return grad_y, grad_w, None, None, None


def _check_out(out, shape, dtype, device, args) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise KernelInputError("out", f"expected contiguous {dtype} {tuple(shape)} on {device}, got {out.dtype} {tuple(out.shape)}")
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
        raise KernelInputError("out", "cannot be given when an input requires grad; let the kernel allocate")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise KernelInputError(name, f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def permute(
    x_TH: torch.Tensor, layout: DispatchLayout, *, out: torch.Tensor | None = None, backend: Backend = "auto"
) -> torch.Tensor:
    """Token rows ``[T, H]`` -> send buffer ``[N, H]`` in the layout's order (Step 2). Differentiable."""
    x_TH = _rows(x_TH, "x_TH")
    T, K = layout.pos_TK.shape
    if x_TH.shape[0] != T:
        raise KernelInputError("x_TH", f"has {x_TH.shape[0]} rows but the layout has T = {T} tokens")
    _check_out(out, (layout.num_rows, x_TH.shape[1]), x_TH.dtype, x_TH.device, (x_TH,))
    if resolve(backend, x_TH.device, "permute", 2 * layout.num_rows * x_TH.shape[1] * x_TH.element_size()) == "torch":
        res = permute_reference(x_TH, layout)
        return res if out is None else out.copy_(res)
    return _Permute.apply(x_TH, layout.pair_N, layout.pos_TK, out)


def unpermute(
    y_NH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    layout: DispatchLayout,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Expert outputs in send order ``[N, H]`` + routing weights ``[T, K]`` (or ``None`` for 1) ->
    combined ``[T, H]`` in y's dtype (Step 3). Differentiable in ``y`` and ``weights``."""
    y_NH = _rows(y_NH, "y_NH")
    T, K = layout.pos_TK.shape
    if y_NH.shape[0] != layout.num_rows:
        raise KernelInputError("y_NH", f"has {y_NH.shape[0]} rows but the layout has N = {layout.num_rows}")
    if weights_TK is not None:
        if tuple(weights_TK.shape) != (T, K) or not weights_TK.dtype.is_floating_point:
            raise KernelInputError(
                "weights_TK", f"expected floating [T, K] = {(T, K)}, got {weights_TK.dtype} {tuple(weights_TK.shape)}"
            )
        weights_TK = weights_TK.contiguous()
    _check_out(out, (T, y_NH.shape[1]), y_NH.dtype, y_NH.device, (y_NH, weights_TK))
    size = (y_NH.numel() + T * y_NH.shape[1]) * y_NH.element_size() + (
        weights_TK.numel() * weights_TK.element_size() if weights_TK is not None else 0)
    if resolve(backend, y_NH.device, "unpermute", size) == "torch":
        res = unpermute_reference(y_NH, weights_TK, layout)
        return res if out is None else out.copy_(res)
    return _Unpermute.apply(y_NH, weights_TK, layout.pos_TK, layout.pair_N, out)
