"""Shared helpers for benchmark scripts: timing and long-form result rows.

Every benchmark prints a table and writes long-form rows with the columns
``what, provider, metric, unit, x, p50, p20, p80, machine, timestamp, version, cpu, isa, cores, threads, run``
to ``benchmarks/results/<bench>.csv`` (appending; ignored by git), which DuckDB reads directly:
``SELECT * FROM read_csv_auto('benchmarks/results/*.csv')``.

Numbers say where they came from: ``cpu`` is the CPU model, ``isa`` the vector ISA torch's kernels run
(``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2, DEFAULT, ...), ``cores`` the cores this process
may use, ``threads`` the threads the measured code ran on (:data:`THREADS`, set by a benchmark whose ranks
run one thread each), ``run`` one id per invocation. The rows behind a figure the README quotes are
committed: ``python benchmarks/common.py commit <bench>`` copies the latest run's rows to
``benchmarks/results_committed/<bench>.csv`` (``--runs N``: the latest N runs, for a goal met in N runs).
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

COLUMNS = ["what", "provider", "metric", "unit", "x", "p50", "p20", "p80", "machine", "timestamp", "version",
           "cpu", "isa", "cores", "threads", "run"]
RESULTS = Path(__file__).resolve().parent / "results"
COMMITTED = Path(__file__).resolve().parent / "results_committed"
#: one id per benchmark invocation: the rows a `commit` copies
RUN = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
#: threads the measured code runs on; None: this process's torch threads (a benchmark whose ranks run one
#: thread each sets 1)
THREADS: int | None = None


def adaptive_options(items: list[str]) -> dict:
    """``--option KEY=VALUE`` items as adaptive options: each VALUE read as JSON (``0.01``, ``null``, ``true``), else
    as a string, and the whole set checked by :class:`~ultraep.config.AdaptiveOptions`. Raises ``ValueError`` naming
    the item (no ``=``) or the field and value it refused."""
    import json

    from pydantic import ValidationError

    from ultraep.config import AdaptiveOptions

    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE (e.g. probe_share=0.01)")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    try:
        AdaptiveOptions(**out)
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"--option adaptive.{path} = {out.get(err['loc'][0], '')!r}: {err['msg']}") from None
    return out


def option_text(options: dict) -> str:
    """Adaptive options as ``key=value, ...`` (what names a row's provider, ``adaptive[...]``, and a table's title)."""
    return ", ".join(f"{k}={v}" for k, v in options.items())


def adaptive_provider(options: dict) -> str:
    """The rows' provider of an adaptive engine run with ``options``: ``adaptive``, or ``adaptive[key=value, ...]``."""
    return f"adaptive[{option_text(options)}]" if options else "adaptive"


def machine() -> str:
    return f"{platform.machine()}-{os.cpu_count()}cpu-{platform.python_version()}"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def where() -> dict:
    """The machine columns of a row: CPU model, torch's vector ISA, usable cores, threads of the measurement."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(), "cores": cores,
            "threads": THREADS if THREADS is not None else torch.get_num_threads(), "run": RUN}


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
        "version": __version__, **where(),
    }


def write_rows(bench: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}.csv"
    if path.exists():  # a file of older columns is kept beside, never appended to with other columns
        with path.open() as fh:
            header = fh.readline().strip().split(",")
        if header != COLUMNS:
            path.rename(path.with_name(f"{bench}.columns-{len(header)}.csv"))
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def commit(bench: str, runs: int = 1) -> Path:
    """Copy the rows of the latest ``runs`` runs of ``results/<bench>.csv`` to ``results_committed/<bench>.csv``
    (replacing it): the rows behind the figures the README and docs/benchmarks.md quote, committed with them.
    ``runs`` > 1 keeps repeated runs of record together (a goal met "in three runs")."""
    if runs < 1:
        raise SystemExit(f"commit: --runs must be at least 1, got {runs}")
    src = RESULTS / f"{bench}.csv"
    if not src.exists():
        raise SystemExit(f"commit: no results for {bench!r} ({src}); run benchmarks/{bench}.py first")
    with src.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    order = list(dict.fromkeys(r["run"] for r in rows))  # the runs in the order they were written
    if len(order) < runs:
        raise SystemExit(f"commit: {src} holds {len(order)} run(s) of {bench}, fewer than --runs {runs}")
    latest = set(order[-runs:])
    keep = [r for r in rows if r["run"] in latest]
    COMMITTED.mkdir(parents=True, exist_ok=True)
    out = COMMITTED / f"{bench}.csv"
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(keep)
    return out


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    n = 1
    if len(args) == 4 and args[2] == "--runs" and args[3].isdigit():
        n, args = int(args[3]), args[:2]
    if len(args) != 2 or args[0] != "commit":
        raise SystemExit("usage: python benchmarks/common.py commit <bench> [--runs N]   (e.g. bench_planner; "
                         "--runs 3: the latest three runs)")
    print(f"{commit(args[1], n)}: the latest {n} run(s)' rows, to commit with the figures they back")
