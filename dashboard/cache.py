"""What the dashboard keeps between reruns: mirrors, one DuckDB, store connections, query results.

* :class:`MirrorPool`: one :class:`~.mirror.RunMirror` per run directory, shared by every session.
* :func:`cursor` / :func:`facts_query`: a cursor on one process-wide in-memory DuckDB, with the given
  Arrow tables registered under their names.
* :func:`mirror_query`: a query on a mirror's facts, memoised on the mirror until new parts of those
  facts arrive.
* :func:`store`: cached ``open_run`` connections for point look-ups on the full store.
* :func:`warm_up`: read a run in the background so later pages open without waiting.

Nothing here does I/O at import time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from ultraep.dashboard.facts import UNIT_OF
from ultraep.dashboard.mirror import RunMirror
from ultraep.dashboard.page_sql import OVERVIEW_UNITS
from ultraep.telemetry.queries import Query


class MirrorPool:
    """One :class:`RunMirror` per run directory, shared by every session; least recently used ones are
    dropped beyond ``capacity`` (a dropped run is simply read again when next shown)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._mirrors: OrderedDict[Path, RunMirror] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_dir) -> RunMirror:
        key = Path(run_dir).resolve()
        with self._lock:
            m = self._mirrors.get(key)
            if m is None:
                m = self._mirrors[key] = RunMirror(key)
            self._mirrors.move_to_end(key)
            while len(self._mirrors) > self.capacity:
                self._mirrors.popitem(last=False)
            return m


# --------------------------------------------------------------------------- running queries on facts
_BASE = None
LOCK = threading.Lock()
"""Guards the module-level caches here and in :mod:`.runs` (held only for dictionary updates)."""


def cursor():
    """A cursor on one process-wide in-memory DuckDB (opening a database costs ~80 ms; a cursor ~0.5 ms).
    Each query gets its own cursor, so registered tables never cross threads or queries."""
    global _BASE
    import duckdb

    with LOCK:
        if _BASE is None:
            _BASE = duckdb.connect(":memory:")
        return _BASE.cursor()


def facts_query(tables: dict, query: Query, **params):
    """Run ``query`` on the given Arrow tables (registered under their names); returns a DataFrame."""
    cur = cursor()
    try:
        for name, tbl in tables.items():
            cur.register(name, tbl)
        return cur.execute(query.sql, query.bind(**params)).df()
    finally:
        cur.close()


def facts_arrow(tables: dict, sql: str):
    """Run ``sql`` (no parameters) on the given Arrow tables; returns an Arrow table."""
    cur = cursor()
    try:
        for name, tbl in tables.items():
            cur.register(name, tbl)
        rel = cur.sql(sql)
        fn = getattr(rel, "to_arrow_table", None) or rel.arrow
        return fn()
    finally:
        cur.close()


def mirror_query(mirror: RunMirror, query: Query, facts: tuple[str, ...], **params):
    """Run ``query`` on the mirror's ``facts``, after reading any new parts they come from. Results are
    cached on the mirror until new parts of those facts arrive (a copy is returned)."""
    mirror.refresh(tuple(dict.fromkeys(UNIT_OF[f] for f in facts)))
    key = ("query", query.name, tuple(sorted(params.items())))
    df = mirror.memo(key, facts, lambda: facts_query({f: mirror.facts(f) for f in facts}, query, **params))
    return df.copy()


def warm_up(mirror: RunMirror) -> None:
    """Read the run in the background (once per mirror): the pages' facts in the order a visitor meets
    them, then the per-expert ones, so later pages open without waiting for their first read. Each unit is
    refreshed on its own, so a page never waits longer than one unit's read."""
    with LOCK:
        if mirror.warm_started:
            return
        mirror.warm_started = True

    def work() -> None:
        try:
            import plotly.graph_objects  # noqa: F401  (the first page needs it; import it meanwhile)

            for unit in OVERVIEW_UNITS + ("decision", "transfer", "transfer_time", "expert", "replica"):
                mirror.refresh((unit,))
        except Exception as exc:  # never let the warm-up break a page; the pages read on their own
            mirror.read_errors.append(f"warm-up: {type(exc).__name__}: {exc}")

    threading.Thread(target=work, name="ultraep-dashboard-warm-up", daemon=True).start()


# --------------------------------------------------------------------------- the store, for point look-ups
_STORES: OrderedDict = OrderedDict()


def store(run_dir):
    """A cursor on the run's store connection (``open_run``, cached per run; its views re-glob the parts
    at every query, so new rows show up)."""
    from ultraep.telemetry import open_run

    key = Path(run_dir).resolve()
    with LOCK:
        con = _STORES.get(key)
        if con is None:
            con = _STORES[key] = open_run(key)
        _STORES.move_to_end(key)
        while len(_STORES) > 8:
            _STORES.popitem(last=False)[1].close()
        return con.cursor()
