"""The speed-up's interval over paired steps: ``median(a) / median(b)`` where ``a[i]`` and ``b[i]`` were timed in the
same round of an interleaved launch (the demo, ``--compare``, the benchmarks), so noise a round shares cancels.

It lives in telemetry because every surface prints it from the same numbers: the demo from the times it just
measured, ``ultraep report`` (:mod:`.answer`) from the steps the store holds; same steps, same seed, same interval.
"""

from __future__ import annotations

import numpy as np

#: the interval every surface prints
LEVEL = 0.90


def ratio_interval(a, b, level: float = LEVEL, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of ``median(a) / median(b)`` for paired samples (``a[i]`` and ``b[i]`` timed in the same
    round of an interleaved benchmark): rounds are resampled together, so noise shared by a round cancels. Tells
    whether a ratio a few % from 1 is a difference or the noise of this many rounds."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(draws, len(a)))
    r = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
