"""Dispatch permutation and combine (ultraep.kernels.dispatch): layout, permute, unpermute, forward and
backward, Triton (interpreted on CPU) vs the pure-torch reference.

Legend: T tokens, K top-k, H hidden, R ranks, S slots per rank, G = R * S, N send rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultraep.kernels import (
    KernelInputError, dispatch_layout, dispatch_layout_reference, permute, permute_reference, unpermute,
    unpermute_reference,
)

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics

R, S = 4, 3
G = R * S
# Per-dtype tolerances against the fp64 truth computed from the same inputs: the Triton kernels sum in fp32
# and round once to the output dtype, so they are within about one ulp of that dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}


def phys_ids(T: int, K: int, seed: int, *, drop: float = 0.0, hot: int | None = None) -> torch.Tensor:
    """``[T, K]`` global slots; a fraction ``drop`` set to -1; ``hot``: every pair goes to that slot."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, G, (T, K), generator=g)
    ids[:, :] = torch.where(torch.isin(ids, torch.tensor([4, 9])), (ids + 1) % G, ids)  # slots 4, 9 stay empty
    if hot is not None:
        ids.fill_(hot)
    if drop:
        ids[torch.rand((T, K), generator=g) < drop] = -1
    return ids


SHAPES = [(T, K) for T in (1, 7, 1023) for K in (1, 2, 8)]


@pytest.mark.parametrize("T,K", SHAPES)
def test_layout_triton_equals_reference(T, K):
    phys = phys_ids(T, K, seed=T * 10 + K, drop=0.1 if T > 1 else 0.0)
    ref = dispatch_layout_reference(phys, R, S)
    got = dispatch_layout(phys, R, S, backend="triton", block=256)
    assert torch.equal(got.pos_TK, ref.pos_TK) and torch.equal(got.pair_N, ref.pair_N)
    assert torch.equal(got.slot_counts_G, ref.slot_counts_G)
    valid = phys.reshape(-1)[phys.reshape(-1) >= 0]
    assert got.slot_counts_G.tolist() == torch.bincount(valid, minlength=G).tolist()
    assert got.slot_counts_G[[4, 9]].tolist() == [0, 0]  # empty slots get no rows
    assert sum(got.input_split_sizes()) == got.num_rows == valid.numel()
    # Rows are ordered by destination rank, then slot, then token order.
    slots = phys.reshape(-1)[got.pair_N]
    assert (slots[1:] >= slots[:-1]).all()
    same = slots[1:] == slots[:-1]
    assert (got.pair_N[1:][same] > got.pair_N[:-1][same]).all()


def test_layout_worked_example():
    # Module docstring: S = 2, K = 2, token 0 -> g 3, 0; token 1 -> g 1, 3. Sorted by g: (0,1) g0, (1,0) g1,
    # (0,0) g3, (1,1) g3.
    phys = torch.tensor([[3, 0], [1, 3]])
    for backend in ("torch", "triton"):
        lay = dispatch_layout(phys, 2, 2, backend=backend)
        assert lay.pos_TK.tolist() == [[2, 0], [1, 3]]
        assert lay.pair_N.tolist() == [1, 2, 0, 3]
        assert lay.input_split_sizes() == [2, 2]


def test_layout_hot_slot_and_num_rows():
    phys = phys_ids(1023, 2, seed=3, hot=7)  # one slot (an expert holding all tokens) receives every pair
    lay = dispatch_layout(phys, R, S, backend="triton", num_rows=2046)
    assert lay.input_split_sizes() == [0, 0, 2046, 0]
    assert torch.equal(lay.pair_N, torch.arange(2046))
    with pytest.raises(KernelInputError, match=r"num_rows: \(5\) differs"):
        dispatch_layout(phys, R, S, backend="torch", num_rows=5)


def _inputs(T, K, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    phys = phys_ids(T, K, seed=seed, drop=0.15 if T > 1 else 0.0)
    lay = dispatch_layout(phys, R, S, backend="triton")
    x = torch.randn((T, H), generator=g).to(dtype)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.rand((T, K), generator=g).to(wdt)
    y = torch.randn((lay.num_rows, H), generator=g).to(dtype)
    go = torch.randn((T, H), generator=g).to(dtype)
    gs = torch.randn((lay.num_rows, H), generator=g).to(dtype)
    return lay, x, w, y, go, gs


def _close(got, truth, dtype):
    """``got`` (in ``dtype``) against ``truth`` (any float dtype) with ``dtype``'s tolerance: ``rtol`` per element,
    ``atol`` scaled by ``max |truth|`` (tests/numerics.py: never an absolute threshold on an unnormalised value).
    assert_close fails on NaN and inf."""
    t = truth.double()
    scale = float(t.abs().max()) if t.numel() else 0.0
    torch.testing.assert_close(got.double(), t, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


FWD_CASES = [(1, 1, 5), (7, 2, 33), (1023, 8, 40), (7, 8, 300)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K,H", FWD_CASES)
def test_permute_unpermute_forward_backward(T, K, H, dtype):
    lay, x, w, y, go, gs = _inputs(T, K, H, dtype, seed=T + K + H)
    # Forward, into poisoned buffers: every element must be written.
    send = torch.full((lay.num_rows, H), float("nan"), dtype=dtype)
    assert permute(x, lay, out=send, backend="triton").data_ptr() == send.data_ptr()
    assert torch.equal(send, permute_reference(x, lay))  # a pure copy: bit-exact
    comb = torch.full((T, H), float("nan"), dtype=dtype)
    unpermute(y, w, lay, out=comb, backend="triton")
    assert not comb.isnan().any()
    _close(comb, unpermute_reference(y.double(), w.double(), lay), dtype)
    # Backward: the custom Functions against torch autograd through the references, evaluated in fp64 on
    # the same (rounded) inputs; the reference in a low dtype accumulates in that dtype and is no yardstick.
    grads = {}
    for backend, cast in (("torch", torch.float64), ("triton", None)):
        xr, yr, wr = (t.to(cast or t.dtype).clone().requires_grad_() for t in (x, y, w))
        gs_, go_ = gs.to(cast or gs.dtype), go.to(cast or go.dtype)
        (gx,) = torch.autograd.grad(permute(xr, lay, backend=backend), xr, gs_)
        gy, gw = torch.autograd.grad(unpermute(yr, wr, lay, backend=backend), (yr, wr), go_)
        grads[backend] = (gx, gy, gw)
    for a, b, t in zip(grads["triton"], grads["torch"], (x, y, w)):
        assert a.dtype == t.dtype and a.shape == b.shape
        _close(a, b.to(a.dtype) if a.dtype == torch.float64 else b, a.dtype)


def test_unit_weights_and_round_trip():
    # permute then unpermute without weights sums each token's kept copies: x * (kept pairs per token).
    T, K, H = 7, 8, 24
    lay, x, *_ = _inputs(T, K, H, torch.float32, seed=11)
    kept = (lay.pos_TK >= 0).sum(dim=1, keepdim=True).float()
    for backend in ("torch", "triton"):
        back = unpermute(permute(x, lay, backend=backend), None, lay, backend=backend)
        torch.testing.assert_close(back, x * kept)


def test_gradcheck_fp64():
    T, K, H = 5, 2, 3
    lay, x, w, y, *_ = _inputs(T, K, H, torch.float64, seed=5)
    x, w, y = (t.requires_grad_() for t in (x, w, y))
    assert torch.autograd.gradcheck(lambda a: permute(a, lay, backend="triton"), (x,))
    assert torch.autograd.gradcheck(lambda a, b: unpermute(a, b, lay, backend="triton"), (y, w))


def test_all_pairs_dropped_and_errors():
    phys = torch.full((7, 2), -1)
    lay = dispatch_layout(phys, R, S, backend="triton")
    assert lay.num_rows == 0 and lay.input_split_sizes() == [0] * R
    x = torch.randn(7, 4, requires_grad=True)
    send = permute(x, lay, backend="triton")
    assert send.shape == (0, 4)
    out = unpermute(send, torch.rand(7, 2), lay, backend="triton")
    assert torch.equal(out, torch.zeros(7, 4))
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(gx, torch.zeros(7, 4))
    with pytest.raises(KernelInputError, match="x_TH"):
        permute(torch.randn(6, 4), lay)
    with pytest.raises(KernelInputError, match="requires grad"):
        permute(x, lay, out=torch.empty(0, 4))
    with pytest.raises(KernelInputError, match="weights_TK"):
        unpermute(send.detach(), torch.rand(7, 3), lay)
    with pytest.raises(KernelInputError, match="phys_TK"):
        dispatch_layout(torch.zeros(3, 2), R, S)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dispatch_cuda_auto_runs_triton_and_matches():
    phys = phys_ids(4096, 8, seed=1, drop=0.05)
    lay = dispatch_layout(phys.cuda(), R, S)
    ref = dispatch_layout_reference(phys, R, S)
    assert torch.equal(lay.pos_TK.cpu(), ref.pos_TK)
    x = torch.randn(4096, 512, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(permute(x, lay).cpu(), permute_reference(x.cpu(), ref))
    assert np.isfinite(unpermute(permute(x, lay), torch.rand(4096, 8, device="cuda"), lay).float().cpu().numpy()).all()
