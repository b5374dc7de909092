"""What ``backend="auto"`` runs on a GPU: the faster of each kernel's two implementations, from measured times.

Legend: a *size* is the bytes a call must read and write (:data:`SIZE_OF` says how each kernel counts them, as
``benchmarks/bench_kernels.py`` counts them for its GB/s column).

The table (``kernel_times.csv`` beside this module, the same file as ``benchmarks/results_committed/kernel_times.csv``;
``ULTRAEP_KERNEL_TIMES`` names another) holds one row per kernel, GPU model, size and run: the p50 seconds of the
Triton kernel and of the pure-torch reference, with where they came from. ``make gpu-check`` appends its run's rows
(``bench_kernels.py --table``). The rule, for a call of ``kernel`` on a CUDA device at ``size`` bytes:

1. rows of this GPU model (``torch.cuda.get_device_name``) and kernel: take the measured size nearest to ``size``
   (by ratio: ``|log size - log measured|``); at that size, the latest run's p50 of each implementation (the
   rows further up are history: they may have timed older code); Triton only when its p50 is strictly lower (a
   tie runs the reference, the truth both are tested against);
2. no row of this GPU model: Triton only when rule 1 picks Triton on *every* GPU model the table measured for
   this kernel (the kernel is known faster), else the reference;
3. no row of the kernel at all: the reference.

So ``auto`` never runs the slower implementation at a measured size and device. CPU tensors always run the
reference (the Triton kernels need a GPU or the interpreter).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

#: the table shipped with the package (its twin is ``benchmarks/results_committed/kernel_times.csv``)
TABLE = Path(__file__).resolve().parent / "kernel_times.csv"
ENV = "ULTRAEP_KERNEL_TIMES"
COLUMNS = ["kernel", "device", "x", "size_bytes", "triton_s", "torch_s", "machine", "run", "source"]
KERNELS = ("reroute", "dispatch_layout", "permute", "unpermute", "pack_tiles", "forward_tiles", "unpack_tiles",
           "reduce_replica_grads")

#: how each kernel's size (bytes read + written) follows from its call (what the wrappers pass to ``resolve``)
SIZE_OF = {
    "reroute": "16 B per (token, k) pair: the id read, the slot written (int64)",
    "dispatch_layout": "24 B per pair: the slot read, its row and the inverse written (int64)",
    "permute": "2 x rows x hidden x element size: a token row read, a send row written",
    "unpermute": "rows x hidden + tokens x hidden elements, plus the routing weights",
    "pack_tiles": "2 x experts x payload bytes", "unpack_tiles": "2 x experts x payload bytes",
    "forward_tiles": "2 x tiles x tile bytes",
    "reduce_replica_grads": "(2 + contributions) x fp32 payload bytes, summed over the master experts",
}


@dataclass(frozen=True)
class Measured:
    """One kernel on one GPU model at one size: the p50 of each implementation in the latest run that timed it, and
    how many runs did."""

    size_bytes: int
    triton_s: float
    torch_s: float
    runs: int

    @property
    def faster(self) -> str:
        return "triton" if self.triton_s < self.torch_s else "torch"


class KernelTimes:
    """The table, grouped: ``(kernel, device) -> [Measured]`` by ascending size."""

    def __init__(self, rows: list[dict]) -> None:
        """``rows`` in the table's order (oldest first: a run appends its rows at the end)."""
        groups: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for i, r in enumerate(rows):
            try:
                key = (r["kernel"], r["device"], int(r["size_bytes"]))
                times = (float(r["triton_s"]), float(r["torch_s"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"kernel times row {i + 1}: {exc!r} in {r}") from None
            if key[2] <= 0 or not all(t > 0 and math.isfinite(t) for t in times):
                raise ValueError(f"kernel times row {i + 1}: size and times must be positive, got {r}")
            groups.setdefault(key, []).append(times)
        self.by: dict[tuple[str, str], list[Measured]] = {}
        for (kernel, device, size), ts in sorted(groups.items()):
            m = Measured(size, ts[-1][0], ts[-1][1], len(ts))
            self.by.setdefault((kernel, device), []).append(m)

    @classmethod
    def read(cls, path: Path | str) -> "KernelTimes":
        with open(path, newline="") as fh:
            return cls(list(csv.DictReader(fh)))

    def devices(self, kernel: str) -> list[str]:
        return sorted(d for k, d in self.by if k == kernel)

    def nearest(self, kernel: str, device: str, size: int) -> Measured | None:
        """The measurement of ``kernel`` on ``device`` at the size nearest ``size`` (by ratio), or None."""
        ms = self.by.get((kernel, device))
        if not ms:
            return None
        s = math.log(max(int(size), 1))
        return min(ms, key=lambda m: (abs(math.log(m.size_bytes) - s), m.size_bytes))

    def choose(self, kernel: str, device: str, size: int) -> str:
        """``"triton"`` or ``"torch"`` for one call (the rule of the module docstring)."""
        here = self.nearest(kernel, device, size)
        if here is not None:
            return here.faster
        elsewhere = [self.nearest(kernel, d, size) for d in self.devices(kernel)]
        return "triton" if elsewhere and all(m.faster == "triton" for m in elsewhere) else "torch"


def append_times(path: Path | str, rows: list[dict]) -> None:
    """Append rows of :data:`COLUMNS` to the table at ``path`` (written with its header when new)."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerows(rows)


def table_path() -> Path:
    return Path(os.environ[ENV]) if os.environ.get(ENV) else TABLE


@lru_cache(maxsize=4)
def _load(path: str) -> KernelTimes:
    p = Path(path)
    return KernelTimes.read(p) if p.exists() else KernelTimes([])


def kernel_times() -> KernelTimes:
    """The table ``auto`` reads (read once per path)."""
    return _load(str(table_path()))


@lru_cache(maxsize=16)
def device_name(index: int) -> str:
    """``torch.cuda.get_device_name(index)``, asked once per device (a host call: no synchronisation)."""
    import torch

    return torch.cuda.get_device_name(index)


def choose_for(kernel: str, device, size: int | None) -> str:
    """The implementation ``auto`` runs for ``kernel`` on CUDA ``device`` at ``size`` bytes (None: size unknown,
    taken as the largest measured)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return kernel_times().choose(kernel, device_name(index), size if size is not None else 1 << 62)
