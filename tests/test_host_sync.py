"""A balanced layer's forward reads the device from the host only where the design needs it (issue 55; docs/design.md,
"Host synchronisations of a layer call").

The one read a call needs: the load all-gather's result reaches the host, where the quota planner runs. Anything
else — ``dropped.any()``, a blocking copy of the reroute table or the row order, an ``.item()`` — stalls the CUDA
stream for nothing. :class:`sync_probe.HostSyncs` records every host read with the project function that made it:
on CPU the torch calls that read values (the real code path, on gloo ranks), on CUDA also everything
``torch.cuda.set_sync_debug_mode`` reports and event synchronisations. Each test has its negative control: an
``.item()`` injected into the token path is caught and named.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ultraep.launch import launch
from ultraep.models import build_model, preload

preload()

GPUS = torch.cuda.device_count()  # (through NVML where it can: no CUDA context before the ranks start)

#: the host reads a balanced layer call needs, each with its reason (docs/design.md names them)
NEEDED = {
    ("ultraep/runtime/comm.py", "gather_load"):
        "the load all-gather's result [R, E] reaches the host: the planner runs there (one D2H per layer call)",
}
#: reads that only the CPU path makes (on a GPU the CUDA test allows none of them)
CPU_ONLY = {
    ("kernels/dispatch.py", "dispatch_layout_reference"):
        "on CPU the wrapper checks the plan's row count against the ids; on a GPU the count is trusted, as the "
        "Triton kernel trusts it",
}
INJECTED = ("ultraep/runtime/token_path.py", "route_tokens")


def _calls(rank, world, device, inject, modes):
    """Per mode (``True``: training, the forward under grad and its backward; ``False``: evaluating), one warm-up
    call, then one probed forward of a balanced layer (quota; replicas with 2 ranks; a slot dropped to the sentinel
    id). Returns per mode (sites read, unexpected sites, replicas in the plan) as plain values."""
    import ultraep
    import ultraep.kernels
    from sync_probe import HostSyncs

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    model = build_model("qwen3-moe")
    holder = torch.nn.Module()
    holder.experts = copy.deepcopy(model.model.layers[0].mlp.experts).to(dev)
    E = model.config.num_experts
    ultraep.wrap(holder, {"policy": "quota", "num_redundant_slots": 2 if world > 1 else 0})
    g = torch.Generator().manual_seed(rank)
    T, K, H = 24, 2, model.config.hidden_size
    allowed = set(NEEDED) | (set(CPU_ONLY) if device == "cpu" else set())
    if inject:  # the negative control: a host read of a device value on the token path
        real = ultraep.kernels.permute

        def permute_and_read(x_TH, layout, **kw):
            layout.slot_counts_G.sum().item()
            return real(x_TH, layout, **kw)

        ultraep.kernels.permute = permute_and_read

    def inputs(grad):
        x = torch.randn(T, H, generator=g).to(dev).requires_grad_(grad)
        idx = torch.randint(0, E, (T, K), generator=g)
        idx[: T // 2, 0] = 0  # a hot expert: the quota plan replicates it
        idx[3, 1] = E  # a dropped slot (the experts interface's sentinel)
        w = torch.rand(T, K, generator=g)
        return x, idx.to(dev), w.to(dev)

    results = []
    for grad in modes:
        with torch.set_grad_enabled(grad):
            out = holder.experts(*inputs(grad))
            if grad:
                out.float().pow(2).sum().backward()
            x, idx, w = inputs(grad)
            if device == "cuda":
                torch.cuda.synchronize()
            with HostSyncs(cuda=device == "cuda") as probe:
                out = holder.experts(x, idx, w)
            if grad:
                out.float().pow(2).sum().backward()
        results.append((dict(probe.sites()), probe.unexpected(allowed), holder.experts.last_plan.num_replicas))
    return results


def _run(world, device, inject=False, modes=(True, False)):
    backend = "nccl" if device == "cuda" else "gloo"
    ranks = launch(_calls, world, device, inject, modes, backend=backend, timeout_s=300)
    return [r for by_rank in ranks for r in by_rank]


def _check(results, world):
    for sites, unexpected, replicas in results:
        assert unexpected == {}, f"host reads beyond the needed ones: {unexpected}"
        # the probe sees the read the design needs (else it would pass by seeing nothing)
        assert set(NEEDED) <= set(sites), sites
    if world > 1:
        assert sum(r for *_, r in results) > 0  # the replica path ran


def test_forward_reads_the_device_only_for_the_load_on_cpu_ranks():
    """Two gloo ranks with replicas and a dropped slot, training (forward under grad) and evaluating."""
    _check(_run(2, "cpu"), 2)


def test_an_injected_item_on_the_token_path_is_caught():
    for sites, unexpected, _ in _run(1, "cpu", inject=True, modes=(True,)):
        assert unexpected == {INJECTED: ["item"]}, unexpected


@pytest.mark.cuda
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_forward_syncs_only_for_the_load_on_a_gpu():
    """Under torch.cuda.set_sync_debug_mode: the layer call at world size 1 on NCCL, training and evaluating."""
    _check(_run(1, "cuda"), 1)


@pytest.mark.cuda
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_an_injected_item_is_caught_on_a_gpu():
    for sites, unexpected, _ in _run(1, "cuda", inject=True, modes=(True,)):
        assert INJECTED in unexpected and "item" in unexpected[INJECTED], unexpected
