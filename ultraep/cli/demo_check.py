"""The demo's equality verdict: step 0 of a balanced run against the unbalanced run, gradient by expert row.

Balancing must not change the math. Step 0 — before any optimizer step could amplify a rounding
difference — must give the same loss and the same gradients up to fp32 summation order:

* every **expert row** (logical expert ``e`` of every expert parameter: its master's gradient, which the
  balanced layer summed over every rank's tokens and replicas) is compared with the same row of the
  unbalanced run, relative to that row's largest magnitude. A gradient that lands on the wrong expert row
  changes two rows, which a per-parameter checksum (Σ|g|, Σg²) cannot see;
* every other parameter (attention, norms, router; data-parallel averaged, so equal on every rank) is
  compared whole, relative to its largest magnitude;
* a NaN or inf anywhere is a mismatch (the figure is ``inf``), never a silent 0.

The tolerance is the tests' fp32 tolerance (``tests/numerics.py``; docs/design.md, "How a tolerance is
chosen"): 1e-5 of the reference's largest magnitude, which reordered fp32 sums stay far inside on every
kernel path.

Legend: R ranks, M masters per rank, E experts.
"""

from __future__ import annotations

import math

import numpy as np

#: fp32: the largest difference, relative to the reference's largest magnitude, that summation order explains
REL_TOL = 1e-5


def step0_gradients(model, rt, rank: int) -> dict:
    """This rank's gradients after step 0's backward (and data-parallel averaging), as float32 arrays.

    Returns ``{"rows": {(parameter name, e): [...]}, "other": {parameter name: [...]}}``: ``rows`` holds one
    array per master of this rank (row ``i`` of a master parameter ``[M, ...]`` is logical expert
    ``topology.masters_RM[rank, i]``); ``other`` every non-expert parameter, on rank 0 only (equal on every
    rank). A parameter without a gradient counts as a zero gradient."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    masters = set()
    rows = {}
    for layer in rt.layers:
        experts_M = layer.topology.masters_RM[rank]
        for p in layer.master_params():
            masters.add(id(p))
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            for i, e in enumerate(experts_M):
                if e >= 0:
                    rows[(names[id(p)], int(e))] = g[i].detach().float().numpy().copy()
    other = {}
    if rank == 0:
        for n, p in model.named_parameters():
            if id(p) not in masters:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                other[n] = g.detach().float().numpy().copy()
    return {"rows": rows, "other": other}


def rel_difference(a, b) -> float:
    """``max |a - b| / max |b|`` in float64; ``inf`` on a NaN or inf on either side or different shapes, 0.0
    when both are all zero (an expert that got no token)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or not np.isfinite(a).all() or not np.isfinite(b).all():
        return math.inf
    if a.size == 0:
        return 0.0
    diff, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def _merge(ranks: list[dict]) -> dict:
    """One run's step-0 gradients from every rank's :func:`step0_gradients`: ``{key: array}``."""
    out = {}
    for r in ranks:
        out.update({("row",) + k: v for k, v in r["rows"].items()})
        out.update({("param", k): v for k, v in r["other"].items()})
    return out


def _label(key: tuple) -> str:
    return f"{key[1]} expert {key[2]}" if key[0] == "row" else key[1]


def step0_difference(base: list[dict], other: list[dict]) -> tuple[float, str]:
    """The largest relative difference of step 0 between two runs, and where it is.

    ``base`` and ``other`` are the runs' per-rank results, each with ``losses`` (step 0 first) and ``grads0``
    (:func:`step0_gradients`; ``None`` in prefill, where only the loss is compared). Compares the step-0 loss,
    every expert row and every other parameter; a key present in one run only, a NaN or an inf gives ``inf``."""
    worst, where = rel_difference(other[0]["losses"][:1], base[0]["losses"][:1]), "loss"
    if base[0]["grads0"] is None and other[0]["grads0"] is None:
        return worst, where
    a, b = _merge([r["grads0"] for r in other]), _merge([r["grads0"] for r in base])
    if not a or set(a) != set(b):
        missing = sorted(set(a) ^ set(b), key=str)
        return math.inf, f"gradients of {_label(missing[0]) if missing else 'every parameter'} missing in one run"
    for key in b:
        d = rel_difference(a[key], b[key])
        if not d <= worst:  # `not <=`: NaN never hides behind a running maximum
            worst, where = d, _label(key)
    return worst, where


def is_match(difference: float) -> bool:
    """The verdict: within :data:`REL_TOL`; ``inf`` and NaN are mismatches."""
    return difference <= REL_TOL
