"""An incremental in-memory mirror of one run's Parquet parts, reduced to the scalar facts the pages chart.

Why not query the store's views directly: on a run with 1 M layer-step rows (2-core machine), one pass of
``layer_balance`` takes ~4 s, because DuckDB evaluates ``list_max`` / ``list_avg`` on a million nested
lists and sorts the wide rows for the lowest-recording-rank rule. Parts are immutable and only ever added
(``telemetry/sinks.py``), so a reader can instead read each part once, reduce its list columns to a few
numbers with numpy, drop the columns no page needs, and keep the result. A live refresh then reads only
the parts written since the last one, and every page query runs on compact in-memory Arrow tables (tens
of milliseconds at 1 M rows).

What each fact table holds, and how a part becomes facts: :mod:`.facts`. The store's row-choice rules
applied when a fact table is asked for: :mod:`.dedupe`. Nothing here does I/O at import time;
:class:`RunMirror` reads only in :meth:`RunMirror.refresh`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from ultraep.dashboard.dedupe import (KEY, first_per_layer, key_arrays, lowest_rank_rows, max_per_key,
                                      sorted_groups, strictly_increasing)
from ultraep.dashboard.facts import FACT_SCHEMAS, FACTS, HEAVY, LIGHT, TERM_COLS, UNIT_OF, UNITS, convert, read_part
from ultraep.telemetry import semconv as sc

__all__ = ["RunMirror", "FACT_SCHEMAS", "FACTS", "HEAVY", "LIGHT", "UNIT_OF", "UNITS"]

MEMO_SIZE = 128


def _read_and_convert(run_dir: Path, unit: str, name: str):
    try:
        u = UNITS[unit]
        return convert(unit, read_part(run_dir / u.table / name, u.table, u.columns))
    except Exception as exc:
        return exc


def _map_parts(run_dir: Path, todo: list[tuple[str, str]]) -> list:
    workers = min(4, os.cpu_count() or 1, len(todo))
    if workers <= 1:
        return [_read_and_convert(run_dir, u, n) for u, n in todo]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ultraep-dashboard-read") as pool:
        return list(pool.map(lambda un: _read_and_convert(run_dir, *un), todo))


@dataclass
class _Fact:
    chunks: list = field(default_factory=list)
    rows: int = 0
    clean: bool = True          # no two rows share a key (only tracked for per-layer facts)
    ordered: bool = True        # ... and rows are in key order
    max_key: tuple | None = None
    cache: pa.Table | None = None
    generation: int = 0


_PER_LAYER = ("layer_facts", "plan_facts", "decision_facts", "expert_facts", "replica_facts")
_LOWEST_RANK = ("transfer_facts", "transfer_plan_facts", "transfer_expert_facts")


class RunMirror:
    """The facts of one run directory, refreshed incrementally (thread-safe).

    ``refresh(units)`` reads the parts written since the last call and returns how many it read;
    ``facts(name)`` gives a fact table (see the module docstring) as one ``pyarrow.Table``.
    ``generation`` grows whenever new parts arrive, so callers can cache derived results on it.
    """

    def __init__(self, run_dir) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = self.run_dir.name
        self.generation = 0
        self.last_write = 0.0          # mtime of the newest part seen (seconds since the epoch)
        self.refreshed_at = 0.0
        self.read_errors: list[str] = []
        self.warm_started = False          # cache.warm_up ran for this mirror
        self._seen: dict[str, set[str]] = {u: set() for u in UNITS}
        self._facts: dict[str, _Fact] = {f: _Fact() for f in FACTS}
        self._lock = threading.RLock()
        self._memo: "OrderedDict[tuple, object]" = OrderedDict()
        self._memo_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RunMirror({str(self.run_dir)!r}, generation={self.generation})"

    # ------------------------------------------------------------------ reading
    def _new_parts(self, unit: str) -> list[tuple[str, float]]:
        d = self.run_dir / UNITS[unit].table
        seen = self._seen[unit]
        out = []
        try:
            with os.scandir(d) as it:
                for entry in it:
                    name = entry.name
                    if name.endswith(".parquet") and not name.startswith(".") and name not in seen:
                        try:
                            out.append((name, entry.stat().st_mtime))
                        except FileNotFoundError:  # pragma: no cover - parts are never deleted
                            continue
        except (FileNotFoundError, NotADirectoryError):
            return []
        out.sort()
        return out

    def refresh(self, units=LIGHT) -> int:
        """Read the parts written since the last refresh for ``units`` (default: all but the per-expert
        ones, :data:`HEAVY`); returns the number of parts read. Parts are read on a few threads."""
        with self._lock:
            todo = []
            for unit in units:
                for name, mtime in self._new_parts(unit):
                    self._seen[unit].add(name)
                    self.last_write = max(self.last_write, mtime)
                    todo.append((unit, name))
            if todo:
                results = _map_parts(self.run_dir, todo)
                by_fact: dict[str, list] = {}
                for (unit, name), res in zip(todo, results):
                    if isinstance(res, BaseException):  # a part we cannot read: say so, keep the rest
                        self.read_errors.append(f"{UNITS[unit].table}/{name}: {type(res).__name__}: {res}")
                        continue
                    for fact, tbl in res.items():
                        by_fact.setdefault(fact, []).append(tbl)
                for fact, tables in by_fact.items():
                    self._append(fact, pa.concat_tables(tables) if len(tables) > 1 else tables[0])
                    self._facts[fact].generation += 1
                self.generation += 1
            self.refreshed_at = time.time()
            return len(todo)

    def _append(self, name: str, tbl: pa.Table) -> None:
        f = self._facts[name]
        if tbl.num_rows == 0:
            return
        if name in _PER_LAYER and f.clean:
            keys = key_arrays(tbl, KEY)
            ordered = strictly_increasing(keys)
            if ordered:  # the usual case: records arrive in key order
                lo = tuple(int(k[0]) for k in keys)
                hi = tuple(int(k[-1]) for k in keys)
                unique = True
            else:
                idx, first = sorted_groups(keys, [])
                lo = tuple(int(k[idx[0]]) for k in keys)
                hi = tuple(int(k[idx[-1]]) for k in keys)
                unique = bool(first.all())
            after = f.max_key is None or lo > f.max_key
            f.clean = unique and after
            f.ordered = f.ordered and ordered and after
            f.max_key = hi if f.max_key is None else max(f.max_key, hi)
        f.chunks.append(tbl)
        f.rows += tbl.num_rows
        f.cache = None
        if len(f.chunks) > 64:  # many small live parts: merge so scans stay fast
            f.chunks = [pa.concat_tables(f.chunks).combine_chunks()]

    # ------------------------------------------------------------------ facts
    def fact_generation(self, name: str) -> int:
        """Grows whenever new parts of fact table ``name`` arrive (a cache key for derived results)."""
        return self._facts[name].generation

    def is_sorted(self, name: str) -> bool:
        """Whether a per-layer fact table's rows are unique and in (step, microbatch, layer) order."""
        f = self._facts[name]
        return name in _PER_LAYER and f.clean and f.ordered

    def raw_rows(self, name: str) -> int:
        """Rows read into fact table ``name`` before any dedupe."""
        return self._facts[name].rows

    def facts(self, name: str) -> pa.Table:
        """Fact table ``name`` with the store's dedupe rules applied (cached until new parts arrive)."""
        with self._lock:
            f = self._facts[name]
            if f.cache is not None:
                return f.cache
            schema = FACT_SCHEMAS[name]
            tbl = pa.concat_tables(f.chunks) if f.chunks else schema.empty_table()
            if name in _PER_LAYER and not f.clean:
                tbl = first_per_layer(tbl)
            elif name in _LOWEST_RANK:
                tbl = lowest_rank_rows(tbl)
            elif name == "timing_facts":
                tbl = max_per_key(tbl, KEY,
                                  (sc.C_RANK, sc.C_TS) + sc.TIMING_KEYS + ("ideal_s",) + TERM_COLS
                                  ).select(schema.names)
            elif name == "transfer_time_facts":
                tbl = max_per_key(tbl, KEY + ("idx",), (sc.C_RANK, "seconds")).select(schema.names)
            f.cache = tbl
            return tbl

    def memo(self, key: tuple, facts: tuple[str, ...], compute):
        """``compute()`` cached under ``key`` until new parts of any of ``facts`` arrive (every session
        shares the result; at most :data:`MEMO_SIZE` results are kept)."""
        full = (key, tuple(self._facts[f].generation for f in facts))
        with self._memo_lock:
            if full in self._memo:
                self._memo.move_to_end(full)
                return self._memo[full]
        value = compute()
        with self._memo_lock:
            self._memo[full] = value
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return value

    def all_facts(self) -> dict[str, pa.Table]:
        return {name: self.facts(name) for name in FACTS}
