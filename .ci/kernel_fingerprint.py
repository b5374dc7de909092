"""Print which kernel path this process computes on, and a fingerprint of its fp32 results; compare it with the
plain environment's.

`.ci/run` saves the plain environment's fingerprint (``--save FILE``) and, before each run of the
numerics-sensitive tests (``pytest -m numerics``) under another kernel path, prints this path's fingerprint with
its verdict against the plain one (``--against FILE --label NAME``), so a rerun is never a silent duplicate:

* the same capability and the same digests: the variable changed nothing on this machine (for example
  ``MKL_ENABLE_INSTRUCTIONS`` on an AMD CPU, where MKL takes its own code path; docs/benchmarks.md, "Kernel
  paths");
* another capability (torch's portable ``default`` kernels) but the same digests: those kernels give the
  plain run's bits for every sampled operation;
* otherwise the operations whose bits differ are named: the rerun exercises other numerics.

Inputs come from numpy, so they have the same bits whatever torch's kernels are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np


def fingerprint() -> dict:
    """``{"capability": torch's CPU capability, "digests": {operation: sha1 prefix of its fp32 result}}``."""
    import torch

    torch.set_num_threads(1)
    r = np.random.default_rng(0)
    a = torch.from_numpy(r.standard_normal((256, 512), dtype=np.float32))
    b = torch.from_numpy(r.standard_normal((512, 1024), dtype=np.float32))
    x = torch.from_numpy(r.standard_normal((1024, 512), dtype=np.float32))
    parts = {"sgemm": a @ b, "silu": torch.nn.functional.silu(x), "softmax": torch.softmax(x, -1),
             "sum": x.sum(0), "exp": x.exp()}
    return {"capability": str(torch.backends.cpu.get_cpu_capability()),
            "digests": {k: hashlib.sha1(v.contiguous().numpy().tobytes()).hexdigest()[:8] for k, v in parts.items()}}


def describe(fp: dict) -> str:
    digest = " ".join(f"{k} {v}" for k, v in fp["digests"].items())
    return f"cpu capability {fp['capability']}; fp32 digests: {digest}"


def verdict(plain: dict, other: dict, label: str) -> str:
    """One line: what the kernel path ``label`` (fingerprint ``other``) changes against the plain run's."""
    differ = [k for k in plain["digests"] if other["digests"].get(k) != plain["digests"][k]]
    if differ:
        return (f"{label} computes other bits than the plain run ({', '.join(differ)} differ): "
                "its rerun checks other numerics")
    if other["capability"] == plain["capability"]:
        return (f"{label} changes nothing here (the same capability and fp32 bits as the plain run): "
                "its rerun repeats the plain run's numerics")
    return (f"{label} runs torch's {other['capability']} kernels but they give the plain run's "
            f"({plain['capability']}) fp32 bits for every sampled operation: its rerun is a near duplicate")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="write this environment's fingerprint (JSON) here")
    ap.add_argument("--against", type=Path, help="the plain environment's fingerprint (from --save) to compare with")
    ap.add_argument("--label", default="this kernel path", help="the kernel path's name in the verdict")
    args = ap.parse_args(argv)
    fp = fingerprint()
    print(describe(fp))
    if args.save is not None:
        args.save.write_text(json.dumps(fp))
    if args.against is not None:
        print(verdict(json.loads(args.against.read_text()), fp, args.label))


if __name__ == "__main__":
    main()
