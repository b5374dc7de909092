"""Triton helpers shared by the ``*_triton`` modules. Imported lazily (needs triton).

``cast_rn``: downcast to a storage dtype with round-to-nearest-even. For bf16 the rounding is spelled out on
the fp32 bits, because Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.9) truncates fp32 -> bf16
while GPUs round to nearest even; written this way both agree bit for bit with ``torch``'s ``.to(bfloat16)``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rn(x, DT: tl.constexpr):
    """``x`` (any float block) -> ``DT``, rounding to nearest even; NaN stays NaN."""
    if DT == tl.bfloat16:
        xf = x.to(tl.float32)  # exact for bf16/fp16/fp32 inputs
        bits = xf.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet = (bits >> 16) | 0x40
        hi = tl.where(xf != xf, quiet, rounded)
        out = hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(DT)
    return out
