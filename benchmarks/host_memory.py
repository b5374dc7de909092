"""The host memory settings of the CPU runs of record (``make demo``, ``bench_runtime``, ``bench_validate``,
``bench_serving``): glibc keeps the memory a rank frees instead of handing it back to the kernel.

Why: a training step on CPU allocates and frees the same tens of MiB every layer call (activations, weight
gradients, receive buffers). By default glibc serves a block of 128 KiB or more with a fresh ``mmap`` (the
threshold rises to the largest block freed, at most 32 MiB) and trims the heap's top once twice that is free, so
every call touches fresh pages again, and what that costs moved from hour to hour on a 2-core VM
(docs/guide/cpus.md). The cost model cannot predict the kernel's page handling, and on GPUs the CUDA
caching allocator keeps freed blocks in the same way. The CPU guide (docs/guide/cpus.md) gives users the same settings.

- ``MALLOC_MMAP_THRESHOLD_=32 MiB`` (the largest glibc accepts on 64-bit) and ``MALLOC_TRIM_THRESHOLD_=2 GiB``:
  blocks below 32 MiB come from the heap, and the heap's top is kept. The cost is memory: a rank's peak stays
  resident until it exits. Measured (step p50, alternating with the machine as it is): at 64 tokens per rank
  none 0.108-0.119 s against 0.127-0.137, feplb 0.126-0.129 against 0.150-0.153; at 4096 tokens quota 2.07-2.19 s
  against 2.13-2.24, none 3.16-3.29 against 3.29-3.31.
- Not set: torch's ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for tensors of 2 MiB and more). With it and
  the two above, a 30-call tok64 run took 0.37-0.41 M minor page faults (1.9-2.0 M with the two alone, 2.9-3.3 M as
  is) and tok64 ran faster still, but at 4096 tokens per rank quota took 2.40-2.46 s with it alone against
  2.13-2.24 as is: a cost at the sizes where balancing pays most.

The settings are read once, when a process starts (glibc's before ``main``), so a benchmark re-executes itself with
them (:func:`reexec_with_settings`), and ``python -m benchmarks.host_memory CMD ...`` runs ``CMD`` with them (the
Makefile's demo). ``ULTRAEP_HOST_MEMORY=asis`` runs as the machine is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: what the runs of record set, name -> value
SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1)}
#: ``asis``: run without the settings (and without re-executing)
SWITCH = "ULTRAEP_HOST_MEMORY"


def with_settings(env: dict[str, str]) -> dict[str, str] | None:
    """``env`` with :data:`SETTINGS` added (a value the user set is kept), or None when nothing is to change:
    every setting present, ``ULTRAEP_HOST_MEMORY=asis``, or not Linux (the names are glibc's)."""
    if env.get(SWITCH) == "asis" or not sys.platform.startswith("linux"):
        return None
    if all(k in env for k in SETTINGS):
        return None
    return {**SETTINGS, **env}


def started_here() -> bool:
    """Whether this process runs a script of ``benchmarks/`` (``python benchmarks/x.py`` or ``-m benchmarks.x``)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(main_file) and Path(main_file).resolve().parent == Path(__file__).resolve().parent


def reexec_with_settings() -> None:
    """Re-execute this Python process (same interpreter, flags and arguments) with :data:`SETTINGS`, unless
    :func:`with_settings` says nothing is to change or the process was not started as a script of this folder
    (a test calling a benchmark's ``main`` keeps its process). Call it first thing in a benchmark's ``main``."""
    env = with_settings(dict(os.environ))
    if env is None or not started_here():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main(argv: list[str]) -> int:
    """``python -m benchmarks.host_memory CMD ...``: run ``CMD`` with the settings (it replaces this process)."""
    if not argv:
        print("usage: python -m benchmarks.host_memory CMD [ARG ...]", file=sys.stderr)
        return 2
    env = with_settings(dict(os.environ)) or dict(os.environ)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"benchmarks.host_memory: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 2
    return 0  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
