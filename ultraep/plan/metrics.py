"""Balance metrics, all derived from raw counts.

Peers disagree on what "balancedness" means (and one reduces the wrong axis), so ultraep stores raw
per-(layer, rank, expert) counts and derives every figure here, each with the exact definition:

=================  =========================================================  =======================
metric             definition                                                 source
=================  =========================================================  =======================
``imbalance``      max / mean of rank load over ranks (1.0 = perfect)         UltraEP, LLEP
``straggler``      max - mean of rank load (absolute tokens)                  FEPLB
``balancedness``   Σ_layers mean_r / Σ_layers max_r of a ``[layers, ranks]``  vLLM (documented form)
``utilization``    mean over layers of mean_r / max_r                         SGLang
``maxvio``         max_e / mean_e of expert load, minus 1                     MoonEP
=================  =========================================================  =======================

Ranks (or experts) are always the **last** axis. A layer with no tokens counts as perfectly balanced.
"""

from __future__ import annotations

import numpy as np


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.ones(np.broadcast(num, den).shape, dtype=np.float64)
    np.divide(num, den, out=out, where=den > 0)
    return out


def imbalance(rank_load, axis: int = -1):
    """max / mean over ranks (last axis by default). ``[..., R] -> [...]``; a float for 1-D input."""
    a = np.asarray(rank_load, dtype=np.float64)
    res = _ratio(a.max(axis=axis), a.mean(axis=axis))
    return float(res) if res.ndim == 0 else res


def straggler(rank_load, axis: int = -1):
    """max - mean over ranks. ``[..., R] -> [...]``."""
    a = np.asarray(rank_load, dtype=np.float64)
    res = a.max(axis=axis) - a.mean(axis=axis)
    return float(res) if np.ndim(res) == 0 else res


def balancedness(load_LR) -> float:
    """vLLM's balancedness of a ``[layers, ranks]`` array: Σ_l mean_r / Σ_l max_r (1.0 = perfect).

    Sums over layers happen *after* the per-layer reduction over ranks; transposing the input changes the
    result, which is exactly the axis mix-up reported against vLLM (PR #39178).
    """
    a = np.asarray(load_LR, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"balancedness expects [layers, ranks], got shape {a.shape}")
    return float(_ratio(a.mean(axis=1).sum(), a.max(axis=1).sum()))


def utilization(load_LR) -> float:
    """SGLang's utilisation of a ``[layers, ranks]`` array: mean over layers of mean_r / max_r."""
    a = np.asarray(load_LR, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"utilization expects [layers, ranks], got shape {a.shape}")
    return float(_ratio(a.mean(axis=1), a.max(axis=1)).mean())


def maxvio(expert_load, axis: int = -1):
    """MoonEP's expert-level violation: max_e / mean_e - 1 over the expert axis (0.0 = perfect)."""
    a = np.asarray(expert_load, dtype=np.float64)
    res = _ratio(a.max(axis=axis), a.mean(axis=axis)) - 1.0
    return float(res) if res.ndim == 0 else res


def rank_load(expert_load_E, home_E, num_ranks: int) -> np.ndarray:
    """``[E] -> [R]`` tokens each rank receives when every expert is served by its master only."""
    return np.bincount(home_E, weights=expert_load_E, minlength=num_ranks).astype(np.int64)
