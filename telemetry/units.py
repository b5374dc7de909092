"""Figures in the units a person reads (``ultraep report``, the demo, the dashboard): seconds as s / ms / µs,
bytes as B / KiB / MiB / GiB; ``—`` for an unknown value."""

from __future__ import annotations

import math


def _bad(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def fmt_s(v: float | None) -> str:
    """Seconds in the unit a person reads (``1.23 s``, ``45.6 ms``, ``789 µs``); ``—`` when unknown."""
    if _bad(v):
        return "—"
    a = abs(v)
    if a >= 1:
        return f"{v:.2f} s"
    if a >= 1e-3:
        return f"{v * 1e3:.3g} ms" if a < 0.1 else f"{v * 1e3:.0f} ms"
    return f"{v * 1e6:.3g} µs"



def fmt_bytes(v, digits: int = 1) -> str:
    """Bytes in binary units (``1.5 MiB``); ``—`` when unknown."""
    if _bad(v):
        return "—"
    v = float(v)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(v) >= scale:
            return f"{v / scale:.{digits}f} {unit}"
    return f"{int(v)} B"
