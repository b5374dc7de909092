"""Print which kernel path this process computes on, and a fingerprint of its fp32 results.

`.ci/run` prints this line before each run of the numerics-sensitive tests (``pytest -m numerics``) under
another kernel path, so the CI log shows whether a variable really changed the numerics on that machine:
a digest that equals the plain environment's means the variable changed nothing there (for example
``MKL_ENABLE_INSTRUCTIONS`` on an AMD CPU, where MKL takes its own code path; docs/benchmarks.md, "Kernel
paths"). Inputs come from numpy, so they have the same bits whatever torch's kernels are.
"""

import hashlib

import numpy as np
import torch


def main() -> None:
    torch.set_num_threads(1)
    r = np.random.default_rng(0)
    a = torch.from_numpy(r.standard_normal((256, 512), dtype=np.float32))
    b = torch.from_numpy(r.standard_normal((512, 1024), dtype=np.float32))
    x = torch.from_numpy(r.standard_normal((1024, 512), dtype=np.float32))
    parts = {"sgemm": a @ b, "silu": torch.nn.functional.silu(x), "softmax": torch.softmax(x, -1),
             "sum": x.sum(0), "exp": x.exp()}
    digest = " ".join(f"{k} {hashlib.sha1(v.contiguous().numpy().tobytes()).hexdigest()[:8]}" for k, v in parts.items())
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; fp32 digests: {digest}")


if __name__ == "__main__":
    main()
