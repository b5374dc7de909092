"""The canonical trace written by anyone: a Parquet or CSV file with the six columns and no ultraep metadata.

A user who writes ``step, microbatch, layer, src_rank, expert, tokens`` from DuckDB
(``COPY (SELECT ...) TO 't.parquet'``), pandas or a spreadsheet has a trace; what :class:`TraceMeta` would
say is inferred and marked so (issue 15):

* ``num_experts`` = the largest ``expert`` + 1,
* ``num_ranks`` = the largest ``src_rank`` + 1 (``None`` when every row is ``-1``, global counts),
* ``top_k`` unknown,

each overridable with ``--trace-opt num_experts=E num_ranks=R top_k=K`` (also on a Parquet file written by
:meth:`Trace.write`, whose metadata the options then replace). A column other than the six is refused: it
would otherwise be dropped without a word. ``ultraep trace info`` lists what was inferred.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import COLUMNS, META_KEY, Trace, TraceMeta
from ._build import check_num_experts


def _override(meta: TraceMeta, path: str, **opts) -> TraceMeta:
    given = {k: v for k, v in opts.items() if v is not None}
    for k, v in given.items():
        if type(v) is not int or v < 1:
            raise TraceError(f"{path}.{k}", f"must be an integer >= 1, got {v!r}", v)
    if "num_experts" in given:
        check_num_experts(given["num_experts"], path, False)
    inferred = [f for f in meta.inferred if f not in given]
    return meta.model_copy(update={**given, "inferred": inferred})


def _infer(cols: dict[str, np.ndarray], path: str, source: str) -> TraceMeta:
    n = cols["tokens"].shape[0]
    ex = np.asarray(cols["expert"])
    src = np.asarray(cols["src_rank"])
    for name, a in (("expert", ex), ("src_rank", src)):
        if a.dtype.kind not in "iu" and n:
            raise TraceError(f"{path}.{name}", f"must hold integers, got dtype {a.dtype}", str(a.dtype))
    E = check_num_experts(int(ex.max()) + 1 if n and ex.max() >= 0 else 1, path, True)
    R = int(src.max()) + 1 if n and src.max() >= 0 else None
    return TraceMeta(num_experts=E, num_ranks=R, source=source,
                     inferred=["num_experts", "top_k"] + (["num_ranks"] if R is not None else []),
                     description=f"plain {source} table: num_experts = largest expert + 1"
                     + (", num_ranks = largest src_rank + 1" if R is not None else ", global counts (src_rank -1)")
                     + ", top_k unknown")


def _check_names(names, path: str) -> None:
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise TraceError(path, f"lacks column(s) {missing}; a trace has {list(COLUMNS)}", missing)
    extra = [c for c in names if c not in COLUMNS]
    if extra:
        raise TraceError(f"{path}.{extra[0]}", f"is not a trace column ({', '.join(COLUMNS)}); drop it before "
                         "importing", extra[0])


def import_parquet(path, num_experts: int | None = None, num_ranks: int | None = None, top_k: int | None = None,
                   **_) -> Trace:
    """A Parquet trace, with ultraep metadata (:meth:`Trace.write`) or without (module docstring)."""
    import pyarrow.parquet as pq

    p = str(path)
    try:
        schema = pq.read_schema(p)
    except Exception as exc:
        raise TraceError(p, f"is not a readable Parquet file ({exc})") from None
    opts = {"num_experts": num_experts, "num_ranks": num_ranks, "top_k": top_k}
    if META_KEY in (schema.metadata or {}):
        trace = Trace.read(p)
        if not any(v is not None for v in opts.values()):
            return trace
        return Trace.from_columns(_override(trace.meta, p, **opts), p, **trace.columns)
    _check_names(schema.names, p)
    table = pq.read_table(p, columns=list(COLUMNS))
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}
    meta = _override(_infer(cols, p, "parquet"), p, **opts)
    return Trace.from_columns(meta, p, **cols)


def is_canonical_csv(path) -> bool:
    try:
        with open(path, newline="") as fh:
            first = fh.readline()
    except (OSError, UnicodeDecodeError):
        return False
    return set(h.strip() for h in first.split(",")) >= set(COLUMNS)


def import_csv(path, num_experts: int | None = None, num_ranks: int | None = None, top_k: int | None = None,
               **_) -> Trace:
    """A CSV with the six canonical columns (header required, any order)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    p = str(path)
    if not Path(p).exists():
        raise TraceError(p, "does not exist")
    try:
        table = pcsv.read_csv(p, convert_options=pcsv.ConvertOptions(
            column_types={c: pa.int64() for c in COLUMNS}))
    except Exception as exc:
        raise TraceError(p, f"is not a readable trace CSV ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    _check_names(table.column_names, p)
    cols = {}
    for c in COLUMNS:
        col = table.column(c)
        if col.null_count:
            i = int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise TraceError(f"{p}:{i + 2}.{c}", "is empty", None)
        cols[c] = col.to_numpy()
    meta = _override(_infer(cols, p, "csv"), p, num_experts=num_experts, num_ranks=num_ranks, top_k=top_k)
    return Trace.from_columns(meta, p, **cols)
