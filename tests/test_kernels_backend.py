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
