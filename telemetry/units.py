"""Figures and labels as a person reads them (``ultraep report``, the demo, the dashboard): seconds as s / ms /
µs, bytes as B / KiB / MiB / GiB, ``—`` for an unknown value; run ids shortened to what tells them apart."""

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


def short_labels(run_ids: list[str]) -> tuple[dict[str, str], str | None]:
    """Labels without the prefix every run id shares (cut at a ``-``), and that prefix (``None`` if none)."""
    if len(run_ids) < 2:
        return {r: r for r in run_ids}, None
    prefix = run_ids[0]
    for r in run_ids[1:]:
        while not r.startswith(prefix):
            prefix = prefix[:-1]
    cut = prefix.rfind("-") + 1
    if cut <= 0 or any(len(r) <= cut for r in run_ids):
        return {r: r for r in run_ids}, None
    return {r: r[cut:] for r in run_ids}, run_ids[0][:cut]
