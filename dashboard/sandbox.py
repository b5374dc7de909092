"""The SQL page's sandbox: a user's query runs against one run's tables and nothing else.

This module is a security boundary (the SQL page runs text typed by whoever reaches the dashboard), so it
stands alone, small, with its tests beside it (``tests/test_sql_sandbox.py``). Two layers, each enough
on its own for what it guards:

* :func:`check_sql` refuses anything but one read-only statement (SELECT / WITH / VALUES / DESCRIBE /
  SHOW / EXPLAIN), from DuckDB's own parser, not from string matching;
* :func:`sandbox` is a DuckDB connection locked down before any user text reaches it: no file, network
  or extension access, no Python replacement scans, no ``SET`` / ``RESET``.

:func:`run_sql` puts them together with a row cap and a time limit. Nothing here does I/O at import time.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ultraep.telemetry import semconv as sc


class SqlRefused(Exception):
    """A statement the SQL page does not run (anything but a read-only query)."""


SANDBOX_TABLES = sc.RAW_TABLES
MAX_SQL_ROWS = 10_000
SQL_TIMEOUT_S = 30.0


def _dataset(run_dir: Path, table: str):
    """A pyarrow dataset of the table's parts as they are now (a Python object: no path reaches DuckDB)."""
    import pyarrow.dataset as ds

    d = run_dir / table
    files = sorted(str(p) for p in d.glob("*.parquet") if not p.name.startswith(".")) if d.is_dir() else []
    return ds.dataset(files, schema=sc.arrow_schema(table), format="parquet")


def sandbox(run_dir, *, memory_limit: str = "2GB", threads: int = 2):
    """A DuckDB connection over one run that can read the run's tables and nothing else.

    Every raw table is a view over a pyarrow dataset of the run's parts as they are now (Python objects,
    not file paths); the derived views come from ``schema.sql``. Then ``enable_external_access = false``
    (no file, network or extension access: ``read_text``, ``COPY ... TO``, ``ATTACH``, ``INSTALL`` fail),
    Python replacement scans are off, and ``lock_configuration = true`` (no ``SET`` / ``RESET``).
    """
    import duckdb

    from ultraep.telemetry.store import schema_statements

    run_dir = Path(run_dir)
    con = duckdb.connect(":memory:")
    con.execute(f"SET memory_limit = '{memory_limit}'")  # fixed settings, not user values
    con.execute(f"SET threads = {int(threads)}")
    cols = {t: ", ".join('"' + c + '"' for c in sc.columns(t)) for t in SANDBOX_TABLES}
    for t in SANDBOX_TABLES:
        con.register(f"_parts_{t}", _dataset(run_dir, t))
        con.execute(f'CREATE VIEW "{t}" AS SELECT {cols[t]} FROM "_parts_{t}"')
    for stmt in schema_statements()[1]:
        con.execute(stmt)
    con.execute("SET enable_external_access = false")
    try:
        con.execute("SET python_enable_replacements = false")
    except duckdb.Error:  # pragma: no cover - older DuckDB
        pass
    con.execute("SET lock_configuration = true")
    return con


def check_sql(con, sql: str) -> None:
    """Refuse anything but one read-only query (SELECT / WITH / VALUES / DESCRIBE / SHOW / EXPLAIN)."""
    import duckdb

    text = sql.strip().rstrip(";").strip()
    if not text:
        raise SqlRefused("empty query")
    try:
        stmts = con.extract_statements(text)
    except duckdb.Error as exc:
        raise SqlRefused(_first_line(exc)) from None
    if len(stmts) != 1:
        raise SqlRefused(f"one statement at a time, got {len(stmts)}")
    st = stmts[0].type
    allowed = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
    if st not in allowed:
        raise SqlRefused(f"only read-only queries run here (SELECT, WITH, EXPLAIN); got {st.name}")


def run_sql(run_dir, sql: str, *, max_rows: int = MAX_SQL_ROWS, timeout_s: float = SQL_TIMEOUT_S):
    """Run a user's query in :func:`sandbox`; returns ``(DataFrame, truncated)``.

    Raises :class:`SqlRefused` for anything but one read-only query, and for queries DuckDB refuses
    (file access, locked configuration, syntax) with DuckDB's first line.
    """
    import duckdb
    import pandas as pd

    con = sandbox(run_dir)
    timer = threading.Timer(timeout_s, con.interrupt)
    try:
        check_sql(con, sql)
        timer.start()
        try:
            cur = con.execute(sql.strip().rstrip(";"))
            names = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchmany(max_rows + 1)
        except duckdb.InterruptException:
            raise SqlRefused(f"stopped after {timeout_s:.0f} s") from None
        except duckdb.Error as exc:
            raise SqlRefused(_first_line(exc)) from None
    finally:
        timer.cancel()
        con.close()
    truncated = len(rows) > max_rows
    df = pd.DataFrame.from_records(rows[:max_rows], columns=names)
    return df, truncated


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
