"""Raw Parquet parts → the compact facts the dashboard charts: schemas, reading units, conversion.

Each part is read once; its list columns are reduced to a few numbers with numpy (``rank_load_after`` →
max, mean, imbalance) and the columns no page needs are dropped (why: :mod:`.mirror`).

The facts keep the store's meaning exactly (``telemetry/schema.sql``):

* ``layer_facts`` / ``plan_facts`` / ``decision_facts``: one row per layer-microbatch, the row of the
  lowest recording rank (earliest ``ts`` on ties), as the ``layer_balance`` view keeps;
  imbalance = max / mean rank load (1.0 when the layer has no tokens), straggler = max - mean.
* ``transfer_facts``: the transfers of the lowest rank that recorded that layer-microbatch's transfers
  (as ``transfer_detail``); ``transfer_time_facts``: measured seconds per transfer, the largest any rank
  reported, NaN/NULL dropped.
* ``timing_facts``: one row per layer-microbatch, every timing the slowest recording rank's (``max``),
  as the canned queries treat measured times; ``ideal_s`` comes from ``timings.other['ideal_s']``
  (the simulator's force-balanced ideal).
* ``expert_facts`` (``expert_load``, E int32 per row) and ``replica_facts`` (replicas of each expert,
  E int16 per row, counted from ``phy2log``'s redundant slots): per layer-microbatch like
  ``layer_facts``; read only when a page asks (:data:`HEAVY`).
* ``cache_facts``: every rank's replica-cache counters of each call (``timings.other['cache_hits']``,
  ``cache_misses``, ``cache_bytes_saved``), one row per rank and layer-microbatch (they add up over ranks).
* ``steps``, ``runs_log``: as written.

The mirror (:mod:`.mirror`) reads parts with :func:`read_part` and :func:`convert`, and applies the store's
row-choice rules (:mod:`.dedupe`) when a fact table is asked for. Nothing here does I/O at import time.

Legend: n rows, R ranks, E experts, S slots per rank, M master slots per rank, N redundant slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ultraep.dashboard.dedupe import key_arrays, nondecreasing
from ultraep.telemetry import semconv as sc

# --------------------------------------------------------------------------- fact schemas
_BASE = [(sc.C_RANK, pa.int32()), (sc.C_STEP, pa.int64()),
         (sc.C_MICROBATCH, pa.int32()), (sc.C_LAYER, pa.int32())]
_TS = [(sc.C_TS, pa.timestamp("us"))]

FACT_SCHEMAS: dict[str, pa.Schema] = {
    "layer_facts": pa.schema(_BASE + _TS + [
        ("policy", pa.string()), ("num_ranks", pa.int32()), ("num_experts", pa.int32()), ("tokens", pa.int64()),
        ("max_before", pa.int64()), ("mean_before", pa.float64()), ("max_after", pa.int64()),
        ("mean_after", pa.float64()), ("imbalance_before", pa.float64()), ("imbalance_after", pa.float64()),
    ]),
    "plan_facts": pa.schema(_BASE + _TS + [
        ("policy", pa.string()), ("num_masters", pa.int32()), ("num_slots", pa.int32()),
        ("solve_time_s", pa.float64()), ("num_replicas", pa.int32()), ("num_transfers", pa.int32()),
    ]),
    "decision_facts": pa.schema(_BASE + _TS + [
        ("policy", pa.string()), ("reason", pa.string()), ("chosen_predicted_s", pa.float64()),
    ]),
    "timing_facts": pa.schema(_BASE + _TS + [(k, pa.float64()) for k in sc.TIMING_KEYS] + [
        ("ideal_s", pa.float64()),
    ] + [(f"{side}.{t}", pa.float64()) for t in sc.PREDICTED_TERMS for side in ("predicted", "measured")]),
    "transfer_facts": pa.schema(_BASE + [
        ("idx", pa.int32()), ("expert", pa.int32()), ("src", pa.int32()), ("dst", pa.int32()),
        ("stage", pa.int32()), ("bytes", pa.int64()),
    ]),
    "transfer_plan_facts": pa.schema(_BASE + [
        ("transfers", pa.int64()), ("bytes", pa.int64()), ("relay_transfers", pa.int64()), ("relay_bytes", pa.int64()),
        ("busiest_sender_bytes", pa.int64()), ("max_fan_out", pa.int64()),
    ]),
    "transfer_expert_facts": pa.schema(_BASE + [
        ("expert", pa.int32()), ("copies", pa.int64()), ("bytes", pa.int64()), ("fan_out", pa.int64()),
    ]),
    "transfer_time_facts": pa.schema(_BASE + [("idx", pa.int32()), ("seconds", pa.float64())]),
    "cache_facts": pa.schema(_BASE + [(k, pa.float64()) for k in sc.CACHE_KEYS]),
    "expert_facts": pa.schema(_BASE + _TS + [("expert_load", pa.list_(pa.int32()))]),
    "replica_facts": pa.schema(_BASE + _TS + [("replicas", pa.list_(pa.int16()))]),
    sc.T_STEPS: sc.arrow_schema(sc.T_STEPS),
    sc.T_RUNS_LOG: sc.arrow_schema(sc.T_RUNS_LOG),
}

_KEYCOLS = tuple(n for n, _ in _BASE + _TS)
# predicted and measured cost-model terms, per layer-microbatch (the slowest rank's, like every timing here)
TERM_COLS = tuple(f"{side}.{t}" for t in sc.PREDICTED_TERMS for side in ("predicted", "measured"))


@dataclass(frozen=True)
class Unit:
    """One way of reading a raw table's parts: the columns read and the fact tables they produce."""

    table: str
    columns: tuple[str, ...]
    facts: tuple[str, ...]


# The [R][E] load and the routes are never read; per-expert units (HEAVY) only when a page asks.
UNITS: dict[str, Unit] = {
    "layer": Unit(sc.T_LAYER_LOADS, _KEYCOLS + ("policy", "num_ranks", "num_experts", "tokens",
                                                "rank_load_before", "rank_load_after"), ("layer_facts",)),
    "plan": Unit(sc.T_PLANS, tuple(FACT_SCHEMAS["plan_facts"].names), ("plan_facts",)),
    "decision": Unit(sc.T_DECISIONS, tuple(FACT_SCHEMAS["decision_facts"].names), ("decision_facts",)),
    "timing": Unit(sc.T_TIMINGS, _KEYCOLS + sc.TIMING_KEYS + ("other",), ("timing_facts", "cache_facts")),
    "transfer": Unit(sc.T_TRANSFERS, tuple(FACT_SCHEMAS["transfer_facts"].names),
                     ("transfer_facts", "transfer_plan_facts", "transfer_expert_facts")),
    "transfer_time": Unit(sc.T_TRANSFER_TIMES, tuple(n for n, _ in _BASE) + ("seconds",), ("transfer_time_facts",)),
    "expert": Unit(sc.T_LAYER_LOADS, _KEYCOLS + ("expert_load",), ("expert_facts",)),
    "replica": Unit(sc.T_PLANS, _KEYCOLS + ("num_experts", "num_masters", "phy2log"), ("replica_facts",)),
    "steps": Unit(sc.T_STEPS, sc.columns(sc.T_STEPS), (sc.T_STEPS,)),
    "runs_log": Unit(sc.T_RUNS_LOG, sc.columns(sc.T_RUNS_LOG), (sc.T_RUNS_LOG,)),
}
UNIT_OF: dict[str, str] = {f: u for u, unit in UNITS.items() for f in unit.facts}
FACTS = tuple(UNIT_OF)
HEAVY = ("expert", "replica")
LIGHT = tuple(u for u in UNITS if u not in HEAVY)


# --------------------------------------------------------------------------- reading one part
def read_part(path: Path, table: str, columns: tuple[str, ...]) -> pa.Table:
    """The ``columns`` of one Parquet part with the semconv types; a column the part lacks is NULL."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    have = set(pf.schema_arrow.names)
    tbl = pf.read(columns=[c for c in columns if c in have])
    types = dict(sc.TABLES[table])
    cols = []
    for c in columns:
        typ = sc.arrow_type(types[c])
        if c in have:
            col = tbl.column(c)
            cols.append(col if col.type == typ else col.cast(typ))
        else:
            cols.append(pa.nulls(tbl.num_rows, type=typ))
    return pa.Table.from_arrays(cols, names=list(columns))


def list_stats(col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(max, sum, length)`` of each list of an Arrow list column (``[n]`` each; 0 for empty/NULL lists)."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [_list_stats_chunk(c) for c in chunks]
    if not parts:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    return tuple(np.concatenate(p) if len(parts) > 1 else p[0] for p in zip(*parts))


def _list_stats_chunk(arr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(arr)
    offsets = arr.offsets.to_numpy().astype(np.int64)  # [n + 1], honours slicing
    lengths = np.diff(offsets)
    if arr.null_count:
        lengths[~arr.is_valid().to_numpy(zero_copy_only=False)] = 0
    values = arr.values
    if values.null_count:
        values = pc.fill_null(values, 0)
    flat = values.to_numpy(zero_copy_only=False)
    mx = np.zeros(n, dtype=np.int64)
    sm = np.zeros(n, dtype=np.int64)
    if n == 0:
        return mx, sm, lengths
    width = int(lengths[0])
    lo, hi = int(offsets[0]), int(offsets[-1])
    if width > 0 and not arr.null_count and hi - lo == n * width and (lengths == width).all():
        grid = flat[lo:hi].reshape(n, width)  # the usual case: one R per run
        mx[:] = grid[:, 0]
        sm[:] = grid[:, 0]
        for j in range(1, width):  # column by column: faster than reducing short rows
            np.maximum(mx, grid[:, j], out=mx)
            sm += grid[:, j]
        return mx, sm, lengths
    nonempty = lengths > 0
    if nonempty.any():
        starts = offsets[:-1][nonempty]
        mx[nonempty] = np.maximum.reduceat(flat, starts)[: nonempty.sum()]
        sm[nonempty] = np.add.reduceat(flat, starts)[: nonempty.sum()]
    return mx, sm, lengths


def _imbalance(mx: np.ndarray, mean: np.ndarray) -> np.ndarray:
    out = np.ones(mx.shape[0], dtype=np.float64)
    np.divide(mx, mean, out=out, where=mean > 0)
    return out


def _cols(tbl: pa.Table, names) -> dict:
    return {n: tbl.column(n) for n in names}


def replica_counts(phy2log, num_experts, num_masters) -> pa.Array:
    """``[n]`` lists of ``E`` int16: replicas of each logical expert (its instances in redundant slots)."""
    arr = phy2log.combine_chunks() if isinstance(phy2log, pa.ChunkedArray) else phy2log
    n = len(arr)
    E = pc.fill_null(num_experts, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    M = pc.fill_null(num_masters, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if n == 0:
        return pa.array([], type=pa.list_(pa.int16()))
    outer = arr.offsets.to_numpy().astype(np.int64)  # [n + 1] into slot rows
    inner_arr = arr.values
    inner = inner_arr.offsets.to_numpy().astype(np.int64)  # [n*R + 1] into slots
    R = np.diff(outer)
    S = np.diff(inner)[outer[0]:outer[-1]] if inner.size > 1 else np.zeros(0, dtype=np.int64)
    uniform = (arr.null_count == 0 and inner_arr.null_count == 0 and inner_arr.values.null_count == 0
               and (E == E[0]).all() and (M == M[0]).all() and (R == R[0]).all() and S.size
               and (S == S[0]).all())
    if uniform:  # the usual case: one topology per run
        e, m, r, s = int(E[0]), int(M[0]), int(R[0]), int(S[0])
        lo, hi = int(inner[outer[0]]), int(inner[outer[-1]])
        vals = inner_arr.values.to_numpy(zero_copy_only=False)[lo:hi].astype(np.int64).reshape(n, r * s)
        grid = vals.reshape(n, r, s)[:, :, m:].reshape(n, -1)  # [n, R*N] experts in redundant slots
        ok = (grid >= 0) & (grid < e)
        flat_idx = (np.arange(n)[:, None] * e + grid)[ok]
        counts = np.bincount(flat_idx, minlength=n * e).astype(np.int16)
        return pa.ListArray.from_arrays(pa.array(np.arange(0, n * e + 1, e, dtype=np.int32)), pa.array(counts))
    out = []  # ragged shapes or NULLs: row by row (rare)
    for i, ph in enumerate(arr.to_pylist()):
        c = np.zeros(int(E[i]), dtype=np.int16)
        for slot_row in ph or []:
            for v in (slot_row or [])[int(M[i]):]:
                if v is not None and 0 <= v < E[i]:
                    c[v] += 1
        out.append(c)
    return pa.array(out, type=pa.list_(pa.int16()))


def convert(unit: str, raw: pa.Table) -> dict[str, pa.Table]:
    """Convert one raw part (as read by :func:`read_part` with the unit's columns) into its facts' rows."""
    if unit == "transfer":
        return transfer_facts(raw)
    return {fact: _to_fact(fact, raw) for fact in UNITS[unit].facts}


def transfer_facts(raw: pa.Table) -> dict[str, pa.Table]:
    """Transfers as written, plus sums per layer-microbatch and per (layer-microbatch, expert).

    One plan's transfers are always in one part (one record, one flush), so summing a part is exact.
    fan-out = copies of one expert one rank sent in one layer-microbatch (as the canned queries);
    busiest sender = the most bytes one rank sent in one layer-microbatch.
    """
    t = _to_fact("transfer_facts", raw)
    n = t.num_rows
    plan_key = [sc.C_RANK, sc.C_STEP, sc.C_MICROBATCH, sc.C_LAYER]
    if n == 0:
        return {"transfer_facts": t, "transfer_plan_facts": FACT_SCHEMAS["transfer_plan_facts"].empty_table(),
                "transfer_expert_facts": FACT_SCHEMAS["transfer_expert_facts"].empty_table()}
    keys = key_arrays(t, plan_key)
    # Step 1: a dense id per (rank, step, microbatch, layer); rows of one plan are usually contiguous.
    if nondecreasing(keys):
        change = np.zeros(n, dtype=bool)
        change[0] = True
        for k in keys:
            change[1:] |= k[1:] != k[:-1]
        plan_id = np.cumsum(change) - 1
        first_row = np.flatnonzero(change)
    else:
        stacked = np.stack(keys, axis=1)
        _, first_row, plan_id = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
        plan_id = plan_id.ravel()
    P = first_row.size
    nbytes = key_arrays(t, ["bytes"])[0]
    src, expert, stage = (key_arrays(t, [c])[0] for c in ("src", "expert", "stage"))
    relay = stage == 1
    # Step 2: per plan sums.
    count = np.bincount(plan_id, minlength=P).astype(np.int64)
    total = np.bincount(plan_id, weights=nbytes, minlength=P).astype(np.int64)
    relay_n = np.bincount(plan_id, weights=relay, minlength=P).astype(np.int64)
    relay_b = np.bincount(plan_id, weights=np.where(relay, nbytes, 0), minlength=P).astype(np.int64)
    # Step 3: one sort by (plan, src, expert); every other grouping is a run of that order.
    smin, emin = int(src.min()), int(expert.min())
    exp_span = int(expert.max()) - emin + 1
    span = (int(src.max()) - smin + 1) * exp_span
    comp = plan_id.astype(np.int64) * span + (src - smin) * exp_span + (expert - emin)
    order = np.argsort(comp, kind="stable")
    c = comp[order]
    st3 = _run_starts(c)                                   # (plan, src, expert) groups
    copies3 = np.diff(np.append(st3, n))
    bytes3 = np.add.reduceat(nbytes[order], st3)
    key3 = c[st3]
    plan3, src3, exp3 = key3 // span, (key3 % span) // exp_span, key3 % exp_span
    st2 = _run_starts(plan3 * (span // exp_span) + src3)   # (plan, src) groups
    sent2 = np.add.reduceat(bytes3, st2)
    plan2 = plan3[st2]
    stp = _run_starts(plan2)
    busiest = np.zeros(P, dtype=np.int64)
    busiest[plan2[stp]] = np.maximum.reduceat(sent2, stp)
    stp3 = _run_starts(plan3)
    fan = np.zeros(P, dtype=np.int64)
    fan[plan3[stp3]] = np.maximum.reduceat(copies3, stp3)
    plan_tbl = pa.table({
        **{k: t.column(k).take(pa.array(first_row)) for k in plan_key},
        "transfers": pa.array(count), "bytes": pa.array(total),
        "relay_transfers": pa.array(relay_n), "relay_bytes": pa.array(relay_b),
        "busiest_sender_bytes": pa.array(busiest), "max_fan_out": pa.array(fan),
    }, schema=FACT_SCHEMAS["transfer_plan_facts"])
    # Step 4: per (plan, expert): copies, bytes and fan-out (the most copies from one sender).
    pe = plan3 * exp_span + exp3
    o2 = np.argsort(pe, kind="stable")
    pe_s = pe[o2]
    st = _run_starts(pe_s)
    expert_tbl = pa.table({
        **{k: t.column(k).take(pa.array(first_row[pe_s[st] // exp_span])) for k in plan_key},
        "expert": pa.array((pe_s[st] % exp_span + emin).astype(np.int32)),
        "copies": pa.array(np.add.reduceat(copies3[o2], st).astype(np.int64)),
        "bytes": pa.array(np.add.reduceat(bytes3[o2], st).astype(np.int64)),
        "fan_out": pa.array(np.maximum.reduceat(copies3[o2], st).astype(np.int64)),
    }, schema=FACT_SCHEMAS["transfer_expert_facts"])
    return {"transfer_facts": t, "transfer_plan_facts": plan_tbl, "transfer_expert_facts": expert_tbl}


def _run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values starts in a sorted array."""
    m = np.ones(sorted_keys.size, dtype=bool)
    m[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return np.flatnonzero(m)


def _to_fact(fact: str, raw: pa.Table) -> pa.Table:
    schema = FACT_SCHEMAS[fact]
    if fact == "layer_facts":
        out = _cols(raw, list(_KEYCOLS) + ["policy", "num_ranks", "num_experts", "tokens"])
        for side in ("before", "after"):
            mx, sm, ln = list_stats(raw.column(f"rank_load_{side}"))
            mean = np.divide(sm, ln, out=np.zeros(ln.shape[0]), where=ln > 0)
            out[f"max_{side}"] = pa.array(mx)
            out[f"mean_{side}"] = pa.array(mean)
            out[f"imbalance_{side}"] = pa.array(_imbalance(mx, mean))
        return pa.table(out, schema=schema)
    if fact == "timing_facts":
        out = _cols(raw, list(_KEYCOLS) + list(sc.TIMING_KEYS))
        other = raw.column("other")
        for key in ("ideal_s",) + TERM_COLS:  # lifted out of the `other` map
            if other.null_count == len(other):
                out[key] = pa.nulls(raw.num_rows, type=pa.float64())
            else:
                out[key] = pc.map_lookup(other, pa.scalar(key), "first").cast(pa.float64())
        return pa.table(out, schema=schema)
    if fact == "cache_facts":  # every rank's replica-cache counters of each call, where the layer has a cache
        other = raw.column("other")
        if other.null_count == len(other):
            return schema.empty_table()
        cols = {k: pc.map_lookup(other, pa.scalar(k), "first").cast(pa.float64()) for k in sc.CACHE_KEYS}
        keep = pc.is_valid(cols[sc.CACHE_KEYS[0]])
        out = {n: pc.filter(raw.column(n), keep) for n, _ in _BASE}
        out.update({k: pc.filter(v, keep) for k, v in cols.items()})
        return pa.table(out, schema=schema)
    if fact == "transfer_time_facts":
        secs = raw.column("seconds").combine_chunks()
        lengths = pc.fill_null(pc.list_value_length(secs), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(secs)
        values = pc.fill_null(flat, float("nan")).to_numpy(zero_copy_only=False)
        row = np.repeat(np.arange(raw.num_rows), lengths)
        idx = np.arange(values.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        ok = np.isfinite(values)
        take = pa.array(row[ok])
        out = {n: raw.column(n).take(take) for n, _ in _BASE}
        out["idx"] = pa.array(idx[ok].astype(np.int32))
        out["seconds"] = pa.array(values[ok])
        return pa.table(out, schema=schema)
    if fact == "expert_facts":
        out = _cols(raw, list(_KEYCOLS))
        out["expert_load"] = raw.column("expert_load").cast(pa.list_(pa.int32()))
        return pa.table(out, schema=schema)
    if fact == "replica_facts":
        out = _cols(raw, list(_KEYCOLS))
        out["replicas"] = replica_counts(raw.column("phy2log"), raw.column("num_experts"), raw.column("num_masters"))
        return pa.table(out, schema=schema)
    return pa.table(_cols(raw, schema.names), schema=schema).cast(schema)
