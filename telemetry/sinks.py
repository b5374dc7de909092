"""Where recorded batches go: one small protocol, two implementations.

A sink receives whole Arrow tables (one per raw table per flush) from the recorder's flush path, never
single rows. :class:`ParquetSink` is the store (see ``docs/telemetry.md``); :class:`MemorySink` keeps the
tables in memory for tests and the simulator and can be queried with the same views.

Store layout (one directory per run; every rank and every recorder session writes its own parts)::

    RUNS_DIR/RUN_ID/<table>/r<rank:05d>-<session>-<seq:06d>.parquet

A part is written to a hidden ``.<name>.tmp`` file in the same directory and renamed into place with
``os.replace`` (atomic on POSIX): a reader's glob ``*.parquet`` only ever sees complete parts, a
``SIGKILL`` mid-write leaves at most a ``.tmp`` file that no reader looks at, and no process ever holds a
lock a reader could trip over. Parts are never modified after the rename (append-only).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """What the recorder writes to."""

    def write(self, table: str, data) -> None:
        """Append ``data`` (a ``pyarrow.Table`` with the table's schema) to ``table``. May raise; the
        recorder catches, counts and drops the batch."""
        ...

    def close(self) -> None:
        """Release resources; called once by :meth:`Recorder.close`."""
        ...


def take(buf: list) -> list:
    """Remove and return the first ``len(buf)`` items of a list other threads append to: the slice and
    the deletion are each atomic under the GIL, so an item appended meanwhile stays for the next call."""
    n = len(buf)
    out = buf[:n]
    del buf[:n]
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def part_name(rank: int, session: str, seq: int) -> str:
    return f"r{rank:05d}-{session}-{seq:06d}.parquet"


class ParquetSink:
    """Per-rank append-only Parquet parts under one run directory, renamed into place atomically.

    Args:
        run_dir: ``RUNS_DIR/RUN_ID``; created (with parents) on the first write, so an unwritable path
            fails there (and is counted by the recorder), never at construction.
        rank: the writing rank (part names start with it).
        session: a random id of the writing recorder, so two processes never pick the same part name.
        fsync: also ``fsync`` each part and its directory (survives power loss, not just ``SIGKILL``;
            costs a few ms per part).
        compression: Parquet codec (``zstd`` by default; ``snappy`` and ``none`` work too).
        small_part_rows: parts with fewer rows are written plain (no compression, dictionary or
            statistics): for the few-row parts of a periodic flush that set-up costs more than it saves.
    """

    def __init__(self, run_dir, rank: int, session: str, *, fsync: bool = False, compression: str = "zstd",
                 small_part_rows: int = 1024):
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.session = session
        self.fsync = fsync
        self.compression = compression
        self.small_part_rows = small_part_rows
        self._seq = 0
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self.parts_written = 0
        self.rows_written = 0

    def _dir(self, table: str) -> Path:
        d = self.run_dir / table
        if table not in self._made:
            d.mkdir(parents=True, exist_ok=True)
            self._made.add(table)
        return d

    def write(self, table: str, data) -> None:
        import pyarrow.parquet as pq

        with self._lock:
            seq = self._seq
            self._seq += 1
        d = self._dir(table)
        name = part_name(self.rank, self.session, seq)
        tmp = d / f".{name}.tmp"
        try:
            if data.num_rows < self.small_part_rows:  # per-file codec/dictionary/statistics set-up dominates
                pq.write_table(data, tmp, compression="none", use_dictionary=False, write_statistics=False)
            else:
                pq.write_table(data, tmp, compression=self.compression)
            if self.fsync:
                _fsync(tmp)
            os.replace(tmp, d / name)
            if self.fsync:
                _fsync(d)  # the rename itself
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        self.parts_written += 1
        self.rows_written += data.num_rows

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"ParquetSink({str(self.run_dir)!r}, rank={self.rank})"


class MemorySink:
    """Keeps every batch in memory; :meth:`connect` gives a DuckDB connection with the same views as
    :func:`ultraep.telemetry.open_run`."""

    def __init__(self) -> None:
        self.batches: dict[str, list] = {}
        self._lock = threading.Lock()

    def write(self, table: str, data) -> None:
        with self._lock:
            self.batches.setdefault(table, []).append(data)

    def close(self) -> None:
        pass

    def table(self, name: str):
        """All rows written to ``name`` as one ``pyarrow.Table`` (empty with the schema if none)."""
        import pyarrow as pa

        from ultraep.telemetry.semconv import arrow_schema

        with self._lock:
            parts = list(self.batches.get(name, ()))
        if not parts:
            return arrow_schema(name).empty_table()
        return pa.concat_tables(parts)

    def num_rows(self, name: str) -> int:
        with self._lock:
            return sum(t.num_rows for t in self.batches.get(name, ()))

    def connect(self):
        """A DuckDB in-memory connection with every raw table and derived view of the store."""
        from ultraep.telemetry.store import connect_memory

        return connect_memory(self)
