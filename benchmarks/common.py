"""Shared helpers for benchmark scripts: timing and long-form result rows.

Every benchmark prints a table and writes long-form rows with the columns
``what, provider, metric, unit, x, p50, p20, p80, machine, timestamp, version`` to
``benchmarks/results/<bench>.csv`` (appending), which DuckDB reads directly:
``SELECT * FROM read_csv_auto('benchmarks/results/*.csv')``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import time
from pathlib import Path

import numpy as np

from ultraep.cli.paired import carryover_orders, ratio_interval  # noqa: F401  (re-exported for the benchmarks)

COLUMNS = ["what", "provider", "metric", "unit", "x", "p50", "p20", "p80", "machine", "timestamp", "version"]
RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    return f"{platform.machine()}-{os.cpu_count()}cpu-{platform.python_version()}"


def time_calls(fn, repeat: int, warmup: int = 3) -> np.ndarray:
    """Seconds per call of ``fn()`` over ``repeat`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = np.empty(repeat)
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out


def row(what, provider, metric, unit, x, values) -> dict:
    v = np.atleast_1d(np.asarray(values, dtype=np.float64))
    from ultraep import __version__

    return {
        "what": what, "provider": provider, "metric": metric, "unit": unit, "x": x,
        "p50": float(np.percentile(v, 50)), "p20": float(np.percentile(v, 20)), "p80": float(np.percentile(v, 80)),
        "machine": machine(), "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "version": __version__,
    }


def write_rows(bench: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}.csv"
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
    return path
