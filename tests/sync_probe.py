"""Where a block of code reads the device from the host: :class:`HostSyncs`, for the sync tests (issue 55).

A host synchronisation stalls the CUDA stream: the host waits for the device to drain before it can go on. The
probe records each one with the project function that caused it (the innermost frame under ``ultraep/``,
``kernels/`` or ``policies/``; a read made by torch or by a test on the project's behalf counts for the project
function that called it):

* on every device, the torch calls that read a tensor's values on the host — ``item``, ``tolist``, ``numpy``,
  ``cpu``, ``bool()``/``int()``/``float()``/``index()`` of a tensor — and the ops whose output size depends on
  the values (``nonzero``, ``bincount``, ``unique``, ``masked_select``, ``repeat_interleave``), which on CUDA
  read the device before they can allocate; so the check runs on CPU too, on the real code path;
* on CUDA, in addition, everything torch itself reports as synchronising (``torch.cuda.set_sync_debug_mode
  ("warn")``: blocking copies either way, stream and device synchronisations, the reads above), and CUDA event
  and stream ``synchronize`` calls, which the debug mode does not report.

    with HostSyncs() as probe:
        layer(x, idx, w)
    probe.sites()   # {("ultraep/runtime/comm.py", "gather_load"): 2, ...}
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tuple(str(ROOT / d) + "/" for d in ("ultraep", "kernels", "policies"))

#: (owner, attribute) of every host read patched on all devices
READS = [(torch.Tensor, n) for n in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                                     "nonzero", "bincount", "unique", "masked_select", "repeat_interleave")]
READS += [(torch, n) for n in ("nonzero", "bincount", "unique", "masked_select", "repeat_interleave")]
CUDA_WAITS = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
SYNC_WARNING = "synchronizing CUDA operation"


def project_site(stack=None) -> tuple[str, str] | None:
    """(path relative to the repository, function) of the innermost project frame of ``stack``, or None."""
    for frame in reversed(stack if stack is not None else traceback.extract_stack()):
        if frame.filename.startswith(PROJECT):
            return str(Path(frame.filename).relative_to(ROOT)), frame.name
    return None


class HostSyncs:
    """Context manager recording host reads of device data made by project code (see the module docstring)."""

    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.events: list[tuple[str, tuple[str, str]]] = []  # (what, site)
        self._saved: list = []
        self._inside = False

    def _record(self, what: str) -> None:
        site = project_site()
        if site is not None:
            self.events.append((what, site))

    def _wrap(self, owner, name: str):
        real = getattr(owner, name)
        probe = self

        def wrapper(*args, **kwargs):
            if not probe._inside:  # a read made while recording one (e.g. a bool inside torch's own code)
                probe._inside = True
                try:
                    probe._record(name)
                finally:
                    probe._inside = False
            return real(*args, **kwargs)

        wrapper.__name__ = name
        self._saved.append((owner, name, real, name in vars(owner)))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "HostSyncs":
        for owner, name in READS + (CUDA_WAITS if self.cuda else []):
            self._wrap(owner, name)
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def showwarning(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING in str(message):
                    self._record("sync_debug_mode")  # (called while the warning is raised: the stack is live)
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._warnings.__exit__(*exc)
        for owner, name, real, own in reversed(self._saved):
            if own:
                setattr(owner, name, real)
            else:  # inherited (e.g. from torch._C.TensorBase): remove the patch, leave the class as it was
                delattr(owner, name)
        self._saved.clear()

    def sites(self) -> Counter:
        """``{(path, function): reads}``."""
        return Counter(site for _, site in self.events)

    def unexpected(self, allowed) -> dict:
        """The sites not in ``allowed`` (a collection of (path, function)), with what was read there."""
        out: dict = {}
        for what, site in self.events:
            if site not in allowed:
                out.setdefault(site, []).append(what)
        return out


if __name__ == "__main__":  # pragma: no cover - a quick look: python tests/sync_probe.py
    with HostSyncs() as p:
        torch.ones(3).sum().item()
    print(p.events, file=sys.stderr)
