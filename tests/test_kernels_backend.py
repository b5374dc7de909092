"""Backend choice of the kernel triples: importing needs no triton, the messages say what to do, and
``auto`` picks the reference on CPU. Environment-sensitive cases run in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ultraep.kernels import KernelInputError, KernelUnavailableError, reroute
from ultraep.kernels._backend import resolve
from ultraep.kernels.rerouting import RerouteTable

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=120)


def test_import_without_triton_and_clear_message():
    # `triton` made unimportable: the package, its wrappers and the references still work on CPU; asking
    # for the Triton kernel names the install command.
    res = run_py("""
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import numpy as np, torch
        import ultraep, ultraep.kernels
        from ultraep.kernels import reroute, KernelUnavailableError
        from ultraep.kernels.rerouting import RerouteTable
        table = RerouteTable.from_arrays(np.array([[0, 1]]), np.array([[1, 1]]))
        ids = torch.tensor([[0], [1]])
        assert reroute(ids, table).tolist() == [[0], [1]]  # auto on CPU -> reference
        try:
            reroute(ids, table, backend="triton")
        except KernelUnavailableError as exc:
            print("MSG", exc)
    """, TRITON_INTERPRET="1")
    assert res.returncode == 0, res.stderr
    assert "MSG ultraep.kernels.reroute: the Triton kernel needs the `triton` package" in res.stdout
    assert "pip install 'ultraep[kernels]'" in res.stdout


def test_import_does_not_load_triton():
    res = run_py("""
        import sys
        import ultraep, ultraep.kernels
        from ultraep.kernels import reroute, permute, pack_tiles, reduce_replica_grads  # wrappers only
        print("LOADED", "triton" in sys.modules, "ultraep.kernels.rerouting_triton" in sys.modules)
    """)
    assert res.returncode == 0, res.stderr
    assert "LOADED False False" in res.stdout


def test_cpu_triton_without_interpreter_is_refused():
    res = run_py("""
        import numpy as np, torch
        from ultraep.kernels import reroute, KernelUnavailableError
        from ultraep.kernels.rerouting import RerouteTable
        table = RerouteTable.from_arrays(np.array([[0, 1]]), np.array([[1, 1]]))
        try:
            reroute(torch.tensor([[0]]), table, backend="triton")
        except KernelUnavailableError as exc:
            print("MSG", exc)
    """)
    assert res.returncode == 0, res.stderr
    assert "set TRITON_INTERPRET=1 before triton is imported" in res.stdout


def test_resolve_rules(monkeypatch):
    from ultraep.kernels import choice

    monkeypatch.setattr(choice, "device_name", lambda index: "NVIDIA H200")  # (no GPU here to ask)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve("auto", cpu, "k") == "torch"
    # on CUDA, auto runs the faster of the two from the measured table (tests/test_kernels_choice.py); a kernel
    # never measured runs the reference
    assert resolve("auto", cuda, "unpermute", 1 << 30) == "triton"
    assert resolve("auto", cuda, "pack_tiles", 1 << 30) == "torch"
    assert resolve("auto", cuda, "k") == "torch"
    assert resolve("torch", cuda, "k") == "torch"
    assert resolve("triton", cpu, "k") == "triton"  # the tests run under TRITON_INTERPRET=1
    with pytest.raises(KernelInputError, match="backend: unknown backend 'gpu'; choose one of auto, triton, torch"):
        resolve("gpu", cpu, "k")
    assert issubclass(KernelUnavailableError, ImportError)
    table = RerouteTable.from_arrays([[0]], [[3]])
    assert reroute(torch.zeros((3, 1), dtype=torch.int64), table).tolist() == [[0], [0], [0]]


def test_every_kernel_runs_its_torch_path_without_triton():
    """Triton has no macOS or Windows wheels (the ``kernels`` extra is Linux-only): with triton unimportable every
    kernel triple's wrapper runs its pure-torch path on CPU (``auto``) and equals the reference. Negative control:
    the last call asks for the Triton kernel and is refused with the install command."""
    res = run_py("""
        import sys
        sys.modules["triton"] = None  # import triton -> ModuleNotFoundError, as without the package
        import torch
        from ultraep.kernels import (ExpertLayout, KernelUnavailableError, dispatch_layout, dispatch_layout_reference,
            pack_tiles, pack_tiles_reference, permute, permute_reference, reduce_replica_grads,
            reduce_replica_grads_reference, unpack_tiles, unpermute, unpermute_reference)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 8, (9, 2), generator=g)
        lay = dispatch_layout(ids, 2, 4)
        ref = dispatch_layout_reference(ids, 2, 4)
        assert lay.num_rows == ref.num_rows
        x, w = torch.randn(9, 5, generator=g), torch.rand(9, 2, generator=g)
        send = permute(x, lay)
        assert torch.equal(send, permute_reference(x, lay))
        y = torch.randn(lay.num_rows, 5, generator=g)
        assert torch.allclose(unpermute(y, w, lay), unpermute_reference(y, w, lay))
        experts = [[torch.randn(6, 3, generator=g), torch.randn(7, generator=g)] for _ in range(2)]
        layout = ExpertLayout.of(experts[0], tile_bytes=64)
        packed = pack_tiles(experts, layout, out=layout.empty(2))
        assert torch.equal(packed, pack_tiles_reference(experts, layout, layout.empty(2)))
        back = [[torch.empty_like(t) for t in e] for e in experts]
        unpack_tiles(packed, back, layout, first_tile=[0, layout.tiles_per_expert])
        assert all(torch.equal(a, b) for e, f in zip(back, experts) for a, b in zip(e, f))
        glay = layout.with_dtype(torch.float32)
        P = glay.tiles_per_expert
        arena = torch.zeros(2 * P, 64, dtype=torch.uint8)
        arena.view(torch.float32).copy_(torch.randn(arena.numel() // 4, generator=g).view(2 * P, 16))
        got = [[torch.zeros_like(t) for t in experts[0]]]
        want = [[torch.zeros_like(t) for t in experts[0]]]
        reduce_replica_grads(got, arena.clone(), [[0, P]], glay)
        reduce_replica_grads_reference(want, arena.clone(), [[0, P]], glay)
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
        print("TORCH PATHS OK", "triton" in sys.modules and sys.modules["triton"] is not None)
        try:
            permute(x, lay, backend="triton")
        except KernelUnavailableError as exc:
            print("REFUSED", exc)
    """, TRITON_INTERPRET="1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TORCH PATHS OK False" in res.stdout
    assert "REFUSED ultraep.kernels.permute: the Triton kernel needs the `triton` package" in res.stdout
