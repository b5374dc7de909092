"""The store's row-choice rules, applied to the dashboard's facts (as ``telemetry/schema.sql`` applies them).

* per layer-microbatch facts: one row per (step, microbatch, layer), the lowest recording rank's, earliest
  ``ts`` on ties (:func:`first_per_layer`, as the ``layer_balance`` view);
* transfers: the rows of the lowest rank that recorded that layer-microbatch (:func:`lowest_rank_rows`, as
  ``transfer_detail``);
* timings and transfer times: the slowest rank's, the ``max`` per key (:func:`max_per_key`).

Plus the key helpers the conversion uses (lexicographic order checks on numpy key columns).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ultraep.telemetry import semconv as sc

KEY = (sc.C_STEP, sc.C_MICROBATCH, sc.C_LAYER)


def key_arrays(tbl: pa.Table, names) -> list[np.ndarray]:
    out = []
    for n in names:
        col = tbl.column(n)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.int64())
        out.append(pc.fill_null(col, 0).to_numpy().astype(np.int64, copy=False))
    return out


def sorted_groups(keys: list[np.ndarray], order: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Row order sorted by ``keys`` then ``order``, and a mask of the first row of each key group."""
    idx = np.lexsort(tuple(reversed(keys + order)))
    n = idx.size
    first = np.ones(n, dtype=bool)
    if n > 1:
        diff = np.zeros(n - 1, dtype=bool)
        for k in keys:
            ks = k[idx]
            diff |= ks[1:] != ks[:-1]
        first[1:] = diff
    return idx, first


def _lex_steps(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive rows: (key increases, key is equal), lexicographically over ``keys``."""
    n = max(keys[0].size - 1, 0)
    gt = np.zeros(n, dtype=bool)
    eq = np.ones(n, dtype=bool)
    for k in keys:
        a, b = k[1:], k[:-1]
        gt |= eq & (a > b)
        eq &= a == b
    return gt, eq


def strictly_increasing(keys: list[np.ndarray]) -> bool:
    """Whether consecutive rows' keys increase strictly (lexicographically): unique and sorted."""
    return bool(_lex_steps(keys)[0].all())


def nondecreasing(keys: list[np.ndarray]) -> bool:
    """Whether consecutive rows' keys never decrease (lexicographically): equal keys are contiguous."""
    gt, eq = _lex_steps(keys)
    return bool((gt | eq).all())


def first_per_layer(tbl: pa.Table) -> pa.Table:
    """One row per (step, microbatch, layer): the lowest rank's, earliest ``ts`` on ties."""
    if tbl.num_rows < 2:
        return tbl
    keys = key_arrays(tbl, KEY)
    order = key_arrays(tbl, [sc.C_RANK] + ([sc.C_TS] if sc.C_TS in tbl.column_names else []))
    idx, first = sorted_groups(keys, order)
    if first.all():
        return tbl
    return tbl.take(pa.array(idx[first]))


def lowest_rank_rows(tbl: pa.Table) -> pa.Table:
    """Rows of the lowest rank that recorded each (step, microbatch, layer) (transfers: many rows per key)."""
    if tbl.num_rows < 2 or pc.count_distinct(tbl.column(sc.C_RANK)).as_py() < 2:
        return tbl
    keys = key_arrays(tbl, KEY)
    rank = key_arrays(tbl, [sc.C_RANK])[0]
    idx, first = sorted_groups(keys, [rank])
    group = np.cumsum(first) - 1
    group_min = rank[idx][first][group]
    keep = idx[rank[idx] == group_min]
    keep.sort()
    return tbl.take(pa.array(keep))


def max_per_key(tbl: pa.Table, keys: tuple[str, ...], values: tuple[str, ...]) -> pa.Table:
    """One row per key with the ``max`` of each value column over the rows sharing it (NULLs ignored)."""
    if tbl.num_rows < 2:
        return tbl
    k = key_arrays(tbl, keys)
    if strictly_increasing(k) or sorted_groups(k, [])[1].all():
        return tbl
    agg = tbl.group_by(list(keys), use_threads=False).aggregate([(v, "max") for v in values])
    agg = agg.rename_columns([c[:-4] if c.endswith("_max") else c for c in agg.column_names])
    return agg
