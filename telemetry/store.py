"""Reading the store: :func:`open_run`, :func:`export_run`, and the view set-up both share.

Why Parquet parts and not one DuckDB file per run: DuckDB lets a single process hold a database file and
blocks every other opener (read-only ones too). A live dashboard, several rank processes and an offline
analyst all need the same run at once, so writers never open DuckDB at all: each rank appends immutable
Parquet parts (written to a temp name, renamed atomically), and every reader opens its *own* in-memory
DuckDB whose views ``read_parquet`` the parts. Nobody holds a lock anyone else can hit; a part is either
complete or invisible; a killed writer loses only what it had not flushed. ``export_run`` turns a run
into one ``.duckdb`` file when a single file is wanted (sharing, archiving).

The view definitions embed the run's path as an escaped SQL string literal (DuckDB binds no parameters
in DDL); every query that carries values (:mod:`.queries`, the CLI) is parameterised.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ultraep.errors import UltraEPError
from ultraep.telemetry import semconv as sc


class TelemetryError(UltraEPError):
    """A missing or unreadable run, a bad query, or another telemetry mistake a user can fix."""


_EMPTY_SCHEMA = "_ultraep_empty"


@lru_cache(maxsize=1)
def schema_sql() -> str:
    """The text of ``schema.sql``."""
    return resources.files("ultraep.telemetry").joinpath("schema.sql").read_text()


@lru_cache(maxsize=1)
def schema_statements() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(create_table_statements, create_view_statements)`` of ``schema.sql``, in file order."""
    tables, views = [], []
    for chunk in re.split(r";[ \t]*$", schema_sql(), flags=re.MULTILINE):
        body = "\n".join(line for line in chunk.splitlines() if not line.lstrip().startswith("--")).strip()
        if not body:
            continue
        head = body.upper()
        if head.startswith("CREATE TABLE"):
            tables.append(body)
        elif head.startswith("CREATE VIEW"):
            views.append(body)
        else:  # pragma: no cover - schema.sql holds nothing else
            raise AssertionError(f"unexpected statement in schema.sql: {body[:60]}")
    return tuple(tables), tuple(views)


def _literal(text: str) -> str:
    """A SQL string literal (single quotes doubled)."""
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _create_empty_tables(con) -> None:
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {_EMPTY_SCHEMA}")
    con.execute(f"USE memory.{_EMPTY_SCHEMA}")
    try:
        for stmt in schema_statements()[0]:
            con.execute(stmt)
    finally:
        con.execute("USE memory.main")


def _add_missing_views(con) -> None:
    """An export made before a view existed (``step_times``) gets it as a temporary view over its own tables
    (the file is opened read-only), so the queries that read it work on old exports too."""
    have = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    for stmt in schema_statements()[1]:
        name = re.match(r"CREATE VIEW\s+(\w+)", stmt, flags=re.IGNORECASE).group(1)
        if name not in have:
            con.execute(re.sub(r"^CREATE VIEW", "CREATE TEMP VIEW", stmt, flags=re.IGNORECASE))


def _create_derived_views(con) -> None:
    for stmt in schema_statements()[1]:
        con.execute(stmt)


def _select_columns(table: str) -> str:
    return ", ".join(_ident(c) for c in sc.columns(table))


def run_layout(path: Path) -> str:
    """``'run'`` if ``path`` is one run directory, ``'runs'`` if it holds run directories."""
    if any((path / t).is_dir() for t in sc.RAW_TABLES):
        return "run"
    return "runs"


def table_glob(path: Path, table: str) -> str:
    """The Parquet glob of ``table`` under a run directory or a directory of runs."""
    if run_layout(path) == "run":
        return str(path / table / "*.parquet")
    return str(path / "*" / table / "*.parquet")


#: file names of the routing-trace formats ``ultraep trace`` / ``simulate`` read (never a run: runs are
#: directories, or ``.duckdb`` files from ``ultraep export``)
_TRACE_SUFFIXES = (".parquet", ".csv", ".pt", ".pth", ".jsonl", ".json", ".pkl", ".npz")


def _looks_like_trace(p: Path) -> bool:
    """Whether a file is a routing trace rather than a DuckDB file: a trace's suffix, or Parquet's magic bytes."""
    if p.suffix.lower() in _TRACE_SUFFIXES:
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def open_run(path, *, threads: int | None = None):
    """A DuckDB connection with every table and view of the store ready to query.

    ``path`` is a run directory (``RUNS_DIR/RUN_ID``), a directory of runs (all of them, told apart by
    ``run_id``), or a ``.duckdb`` file made by :func:`export_run` (opened read-only). For directories the
    connection is in-memory and the raw tables are views over the Parquet parts, re-globbed at every
    query: a live run's new rows appear without reopening, and no writer is ever blocked.
    """
    import duckdb

    p = Path(path).expanduser()
    if not p.exists():
        raise TelemetryError(str(path), "no such run directory, runs directory or .duckdb file")
    if p.is_file():
        if _looks_like_trace(p):
            raise TelemetryError(str(path), "is a routing trace, not a recorded run: replay it with `ultraep simulate "
                                 f"{path} --out RUNS_DIR`, then query RUNS_DIR (or describe it: `ultraep trace info "
                                 f"{path}`)")
        try:
            con = duckdb.connect(str(p), read_only=True)
        except duckdb.Error as exc:
            raise TelemetryError(str(path), f"is not a readable DuckDB file ({_first_line(exc)})") from None
        _add_missing_views(con)
        return con
    con = duckdb.connect(":memory:")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    _create_empty_tables(con)
    for table in sc.RAW_TABLES:
        glob = table_glob(p, table)
        # The typed empty table fixes the column types even before the first part exists.
        con.execute(
            f"CREATE VIEW {_ident(table)} AS SELECT {_select_columns(table)} FROM ("
            f"SELECT * FROM {_EMPTY_SCHEMA}.{_ident(table)} UNION ALL BY NAME "
            f"SELECT * FROM read_parquet({_literal(glob)}, union_by_name = true, allow_empty = true))"
        )
    _create_derived_views(con)
    return con


def connect_memory(sink):
    """A DuckDB connection over a :class:`~ultraep.telemetry.sinks.MemorySink` (same tables and views)."""
    import duckdb

    con = duckdb.connect(":memory:")
    for table in sc.RAW_TABLES:
        con.register(f"_arrow_{table}", sink.table(table))
        con.execute(f"CREATE VIEW {_ident(table)} AS SELECT {_select_columns(table)} FROM _arrow_{table}")
    _create_derived_views(con)
    return con


def export_run(path, dest, *, overwrite: bool = False) -> Path:
    """Materialise a run (or a directory of runs) into one DuckDB file with the same tables and views.

    Returns the file's path. Raises :class:`TelemetryError` if ``dest`` exists and not ``overwrite``.
    """
    import duckdb

    dest = Path(dest).expanduser()
    if dest.exists():
        if not overwrite:
            raise TelemetryError(str(dest), "already exists (pass overwrite=True / --force to replace it)")
        dest.unlink()
    con = open_run(path)
    tmp = dest.with_name(f".{dest.name}.tmp")
    if tmp.exists():
        tmp.unlink()
    try:
        con.execute(f"ATTACH {_literal(str(tmp))} AS ultraep_export")
        for table in sc.RAW_TABLES:
            con.execute(f"CREATE TABLE ultraep_export.{_ident(table)} AS SELECT * FROM main.{_ident(table)}")
        con.execute("USE ultraep_export")
        _create_derived_views(con)
        con.execute("USE memory.main")
        con.execute("DETACH ultraep_export")
    except duckdb.Error as exc:
        raise TelemetryError(str(dest), f"export failed ({_first_line(exc)})") from None
    finally:
        con.close()
    tmp.replace(dest)
    return dest


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
