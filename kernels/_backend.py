"""Backend choice for the kernel triples (docs/kernels.md) and the lazy Triton import.

Every public kernel function takes ``backend="auto" | "triton" | "torch"`` and resolves it once, at the
top of the call, from the device of its main input:

    auto    CUDA tensors -> the faster of the two for this kernel, GPU model and size, from the measured
            table (``ultraep.kernels.choice``); CPU tensors -> the pure-torch reference
    triton  the Triton kernel; on CPU tensors this needs ``TRITON_INTERPRET=1`` set before triton is
            imported (the test suite does this in ``tests/conftest.py``)
    torch   the pure-torch reference, on any device

``import ultraep.kernels`` never imports triton: the ``*_triton`` modules holding the ``@triton.jit``
functions are imported on the first call that resolves to ``triton``. Without triton that call raises
:class:`KernelUnavailableError`, which names the install command.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Literal

import torch

from ultraep.errors import UltraEPError

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")

INSTALL_HINT = "pip install 'ultraep[kernels]'"


class KernelUnavailableError(ImportError):
    """A Triton kernel was requested but cannot run here (triton missing, or CPU without the interpreter)."""


class KernelInputError(UltraEPError):
    """A kernel was called with inputs of the wrong shape, dtype, device or layout."""


def interpreting() -> bool:
    """True when Triton runs its interpreter (``TRITON_INTERPRET=1``), i.e. kernels execute on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve(backend: str, device: torch.device, kernel: str, size: int | None = None) -> str:
    """Return ``"triton"`` or ``"torch"`` for one call of ``kernel`` on ``device`` moving ``size`` bytes (the
    measure of :data:`ultraep.kernels.choice.SIZE_OF`; it only matters to ``auto`` on CUDA)."""
    if backend not in BACKENDS:
        raise KernelInputError("backend", f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}", backend)
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        from ultraep.kernels.choice import choose_for

        return choose_for(kernel, device, size)
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise KernelUnavailableError(
            f"ultraep.kernels.{kernel}: the Triton kernel was requested for a {device.type} tensor; Triton runs "
            "CPU tensors only in its interpreter: set TRITON_INTERPRET=1 before triton is imported, or use "
            "backend='torch' (or 'auto') for the pure-torch reference"
        )
    return backend


def triton_module(name: str, kernel: str) -> ModuleType:
    """Import ``ultraep.kernels.<name>`` (a module defining ``@triton.jit`` functions) on first use."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise KernelUnavailableError(
            f"ultraep.kernels.{kernel}: the Triton kernel needs the `triton` package, which is not installed; "
            f"install it with {INSTALL_HINT} (or call with backend='torch' for the pure-torch reference)"
        ) from exc
    return importlib.import_module(f"ultraep.kernels.{name}")


def is_interpreted(device: torch.device) -> bool:
    """True when a Triton launch on ``device`` runs in the interpreter (the launch grid is then kept small)."""
    return device.type != "cuda" or interpreting()


def upload(arrays, device: torch.device) -> list[torch.Tensor]:
    """Host arrays (numpy or CPU tensors, one dtype) -> tensors on ``device``, without blocking the host.

    On CUDA the arrays go through one pinned staging buffer and one asynchronous copy on the current stream
    (a copy from pageable memory, ``tensor.to(device)``, waits for the stream to drain: a host synchronisation).
    Torch's pinned-memory allocator keeps the staging buffer until the copy has completed, so dropping it at once
    is safe. Elsewhere the arrays are returned as tensors sharing their memory where they can."""
    ts = [torch.as_tensor(a) for a in arrays]
    if device.type != "cuda" or not ts:
        return [t if t.device == device else t.to(device) for t in ts]
    flat = torch.cat([t.reshape(-1) for t in ts]).pin_memory()
    dev = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in ts:
        out.append(dev[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out
