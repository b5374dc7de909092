"""ultraep.kernels: Triton kernels for the real-time path, each a triple (docs/design.md, Conventions; docs/kernels.md):
a ``@triton.jit`` kernel (``*_triton`` modules), a torch wrapper and a pure-torch reference.

    reroute        logical top-k ids -> physical instances by the plan's per-source split   (rerouting.py)
    permute        (token, k) pairs -> send buffer by destination rank and slot; combine back (dispatch.py)
    tiles          pack / forward (relay) / unpack expert state in fixed-size tiles           (tiles.py)
    grad_reduce    replica fp32 gradient tiles -> master gradients, fixed order              (grad_reduce.py)

Every wrapper takes ``backend="auto"``: CUDA tensors run the Triton kernel, CPU tensors the reference;
``"triton"`` forces the kernel (CPU needs ``TRITON_INTERPRET=1`` before triton is imported) and
``"torch"`` the reference. Importing this package imports neither triton nor torch; the names below load
their module on first access. Without triton, asking for a Triton kernel raises
:class:`KernelUnavailableError` naming ``pip install 'ultraep[kernels]'``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    # reroute
    "RerouteTable": "rerouting", "reroute_table": "rerouting", "reroute": "rerouting", "reroute_reference": "rerouting",
    # permute
    "DispatchLayout": "dispatch", "dispatch_layout": "dispatch", "dispatch_layout_reference": "dispatch",
    "permute": "dispatch", "permute_reference": "dispatch", "unpermute": "dispatch", "unpermute_reference": "dispatch",
    # tiles
    "TensorSpec": "tiles", "ExpertLayout": "tiles", "Message": "tiles", "StreamSchedule": "tiles",
    "pack_tiles": "tiles", "pack_tiles_reference": "tiles", "unpack_tiles": "tiles",
    "unpack_tiles_reference": "tiles", "forward_tiles": "tiles", "forward_tiles_reference": "tiles",
    "pack_sends": "tiles", "forward_sends": "tiles", "unpack_received": "tiles",
    # grad_reduce
    "GradReduceSchedule": "grad_reduce", "reduce_replica_grads": "grad_reduce",
    "reduce_replica_grads_reference": "grad_reduce", "pack_grad_sends": "grad_reduce", "reduce_received": "grad_reduce",
    # backend
    "KernelUnavailableError": "_backend", "KernelInputError": "_backend", "INSTALL_HINT": "_backend",
    "upload": "_backend",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ultraep.kernels' has no attribute {name!r}")
    # Modules are named apart from their functions (rerouting / reroute, dispatch / permute), so importing a
    # submodule, which binds its name on this package, never hides a function.
    value = getattr(import_module(f"ultraep.kernels.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
