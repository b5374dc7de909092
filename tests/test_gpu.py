"""What ``make gpu-check`` runs on a CUDA machine (issue 34), written once for both devices.

* every Triton kernel against its torch reference on odd shapes, empty experts and one-token inputs — on
  ``cuda`` compiled for the GPU (``make gpu-check`` runs with ``TRITON_INTERPRET=0``), on ``cpu`` in
  Triton's interpreter, so the checks themselves run on every machine;
* the balanced layer and a wrapped tiny model at world size 1 (NCCL on ``cuda``, gloo on ``cpu``);
* with two GPUs, the two-rank NCCL exactness run.

The ``cuda`` cases carry the ``cuda`` marker (``pytest -m cuda``) and skip without a GPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

import ultraep
from ultraep.kernels import (
    ExpertLayout, dispatch_layout, dispatch_layout_reference, forward_tiles, forward_tiles_reference, pack_tiles,
    pack_tiles_reference, permute, permute_reference, reduce_replica_grads, reduce_replica_grads_reference,
    reroute, reroute_reference, reroute_table, unpack_tiles, unpermute, unpermute_reference,
)
from ultraep.launch import launch
from ultraep.models import build_model, preload

preload()

GPUS = torch.cuda.device_count()  # (through NVML where it can: no CUDA context before the ranks fork)
CUDA = GPUS > 0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")])]
R, S = 3, 5  # odd: 3 ranks of 5 slots
TOKENS = [1, 37]  # one token, and an odd count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", TOKENS)
def test_dispatch_kernels_match_reference(device, T):
    g = torch.Generator().manual_seed(T)
    phys = torch.randint(0, R * S, (T, 3), generator=g)
    phys[phys == 7] = 8  # slot 7 stays empty
    if T > 1:
        phys[0, 1] = -1  # a dropped pair
    ref = dispatch_layout_reference(phys, R, S)
    lay = dispatch_layout(phys.to(device), R, S, backend="triton")
    assert torch.equal(lay.pos_TK.cpu(), ref.pos_TK) and torch.equal(lay.pair_N.cpu(), ref.pair_N)
    assert int(lay.slot_counts_G[7]) == 0
    x = torch.randn(T, 19, generator=g)  # odd hidden size
    send = permute(x.to(device), lay, backend="triton")
    assert torch.equal(send.cpu(), permute_reference(x, ref))
    w = torch.rand(T, 3, generator=g)
    y = unpermute(send, w.to(device), lay, backend="triton")
    torch.testing.assert_close(y.cpu(), unpermute_reference(permute_reference(x, ref), w, ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", TOKENS)
def test_reroute_kernel_matches_reference(device, T):
    E = 9  # odd; experts 2 and 6 receive no token
    g = torch.Generator().manual_seed(T)
    w = torch.ones(E)
    w[[2, 6]] = 0
    ids = [torch.multinomial(w.expand(T, E), 2, generator=g) for _ in range(R)]
    load = np.stack([np.bincount(i.reshape(-1).numpy(), minlength=E) for i in ids])
    plan = ultraep.plan_layer(load, "quota", num_redundant_slots=2)
    table = reroute_table(plan, 1)
    got = reroute(ids[1].to(device), reroute_table(plan, 1, device=device), backend="triton")
    assert torch.equal(got.cpu(), reroute_reference(ids[1], table))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts", [1, 3])
def test_tile_kernels_match_reference(device, experts):
    g = torch.Generator().manual_seed(experts)
    like = [torch.randn(13, 7, generator=g).bfloat16(), torch.randn(31, generator=g).half(), torch.randn(5, 3)]
    xs = [[torch.randn(t.shape, generator=g).to(t.dtype) for t in like] for _ in range(experts)]
    lay = ExpertLayout.of(like, tile_bytes=48)
    packed = pack_tiles([[t.to(device) for t in x] for x in xs], lay, backend="triton")
    assert torch.equal(packed.cpu(), pack_tiles_reference(xs, lay, lay.empty(experts)))
    back = [[torch.full_like(t, float("nan")).to(device) for t in like] for _ in range(experts)]
    unpack_tiles(packed, back, lay, backend="triton")
    assert all(torch.equal(a.cpu(), b) for x, y in zip(back, xs) for a, b in zip(x, y))
    P = lay.tiles_per_expert
    index = torch.arange(experts * P).flip(0)
    fwd = forward_tiles(packed, index.to(device), backend="triton")
    assert torch.equal(fwd.cpu(), forward_tiles_reference(packed.cpu(), index, torch.empty_like(packed.cpu())))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_reduce_kernel_matches_reference_with_an_expert_without_replicas(device):
    g = torch.Generator().manual_seed(5)
    lay = ExpertLayout.of([torch.zeros(11, 3), torch.zeros(7)], tile_bytes=64).with_dtype(torch.float32)
    P = lay.tiles_per_expert
    arena = torch.empty(4 * P, 64, dtype=torch.uint8)
    arena.view(torch.float32).copy_(torch.randn(arena.numel() // 4, generator=g).view(4 * P, 16))
    contributions = [[2 * P, 0], [], [P]]  # the middle expert has no replica
    grads = [[torch.randn(11, 3, generator=g), torch.randn(7, generator=g)] for _ in range(3)]
    want = [[t.clone() for t in x] for x in grads]
    got = [[t.to(device) for t in x] for x in grads]
    reduce_replica_grads(got, arena.to(device), contributions, lay, backend="triton")
    reduce_replica_grads_reference(want, arena.clone(), contributions, lay)
    assert all(torch.equal(a.cpu(), b) for x, y in zip(got, want) for a, b in zip(x, y))


# ---------------------------------------------------------------------------------------------- runtime
def _layer_and_model(rank, world, device):
    """The balanced layer on a bare experts container, and a wrapped tiny model, against the unwrapped ones:
    ``(errors, master gradient errors, every phase a float, backward seconds)``, every error a
    :func:`numerics.rel_error` (relative to the reference's largest magnitude; ``inf`` on NaN or inf)."""
    from numerics import master_grad_errors, rel_error

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    cfg = {"policy": "quota", "num_redundant_slots": 2 if world > 1 else 0}  # one rank: no other rank to replicate on
    model = build_model("qwen3-moe").to(dev)
    ref = copy.deepcopy(model)
    # the layer alone: a bare experts container, wrapped, against its own forward
    holder = torch.nn.Module()
    holder.experts = copy.deepcopy(ref.model.layers[0].mlp.experts)
    bare = copy.deepcopy(holder.experts)
    ultraep.wrap(holder, cfg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(11, ref.config.hidden_size, generator=g).to(dev)
    idx = torch.randint(0, ref.config.num_experts, (11, 2), generator=g).to(dev)
    w = torch.rand(11, 2, generator=g).to(dev)
    errs = {"bare layer": rel_error(holder.experts(x, idx, w), bare(x, idx, w))}
    ultraep.wrap(model, cfg)
    rt = ultraep.runtime_of(model)
    for step in range(2):
        ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(step + 17 * rank)).to(dev)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
        out.float().pow(2).mean().backward()
        want.float().pow(2).mean().backward()
        rt.next_step()
        errs[f"logits step {step}"] = rel_error(out, want)
    timings = rt.layers[0].last_timings
    return errs, master_grad_errors(rt, ref, rank), all(isinstance(v, float) for v in timings.values()), \
        timings.get("backward_s", -1.0)


def _check_runtime(results):
    """Every rank's outputs and master gradients within the fp32 tolerance (tests/numerics.py: relative, and a NaN,
    an inf or nothing compared fails), and every phase read back as seconds."""
    from numerics import assert_within

    assert results, "no rank returned"
    for rank, (errs, grads, floats, backward_s) in enumerate(results):
        assert errs and grads, f"rank {rank}: nothing was compared ({errs}, {grads})"
        assert_within({**errs, **{f"grad {k}": v for k, v in grads.items()}}, what=f"rank {rank}")
        assert floats and backward_s >= 0.0  # every phase read back as seconds


@pytest.mark.parametrize("device", DEVICES)
def test_balanced_model_at_world_size_one(device):
    _check_runtime(launch(_layer_and_model, 1, device, backend="nccl" if device == "cuda" else "gloo",
                          timeout_s=300))


def test_the_runtime_check_fails_on_nan_on_a_relative_error_and_on_nothing_compared():
    """Negative controls of :func:`_check_runtime` (it guards the CUDA runs, so it is tested here on figures): a NaN
    after a good figure (Python's ``max([0.1, nan])`` is 0.1), logits of magnitude 1e-3 off by 1e-5 (within an
    absolute 1e-4, a 1 % error relative to them), and a rank that compared no gradient."""
    good = ({"bare layer": 1e-7, "logits step 0": 2e-7}, {"layer.w": 3e-7}, True, 0.01)
    _check_runtime([good])
    small_logits_off = torch.full((4,), 1e-3), torch.full((4,), 1e-3) + torch.tensor([1e-5, 0, 0, 0])
    assert float((small_logits_off[1] - small_logits_off[0]).abs().max()) < 1e-4  # the old absolute check passed it
    from numerics import rel_error

    bad = [({"bare layer": 0.1, "logits step 0": float("nan")}, good[1], True, 0.01),
           ({**good[0], "logits step 1": rel_error(*small_logits_off)}, good[1], True, 0.01),
           (good[0], {}, True, 0.01),
           (good[0], {"layer.w": float("inf")}, True, 0.01)]
    for case in bad:
        with pytest.raises(AssertionError):
            _check_runtime([good, case])


@pytest.mark.cuda
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (an NCCL pair)")
def test_two_rank_nccl_exactness():
    _check_runtime(launch(_layer_and_model, 2, "cuda", backend="nccl", timeout_s=300))
