"""Buffered records → Arrow tables, off the hot path (runs in the recorder's flush path).

The hot path only appends a tuple per record (see :mod:`ultraep.telemetry.recorder`); everything here
works on a whole batch at once: plans of the same shape are stacked into ``[B, R, E]`` / ``[B, R, S]``
arrays and turned into nested LIST columns from offsets, so no per-value Python loop runs.

Bad values never poison a batch: the fast path builds each column with an explicit Arrow type (which
refuses strings for numbers, truncating floats for integers, and the like); if it fails, every record is
checked on its own, the bad ones are dropped and counted, and the good ones are written.

Legend: B records in a batch, R ranks, E experts, S slots per rank, T transfers.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ultraep.telemetry import semconv as sc

# --------------------------------------------------------------------------- record layouts (hot path)
# plan:      (step, microbatch, layer, plan, record_routes, ts_ns)
# decision:  (step, microbatch, layer, ts_ns, policy, reason, predictions | None, chosen_predicted_s)
# timings:   (step, microbatch, layer, ts_ns, timings_dict)
# ttimes:    (step, microbatch, layer, ts_ns, seconds)
# step:      (step, ts_ns, loss, step_time_s, extra | None)


@dataclass
class StepAggregate:
    """Per-step sums the flush path keeps for the step span and metrics."""

    plans: int = 0
    tokens: int = 0
    solve_time_s: float = 0.0
    transfers: int = 0
    transfer_bytes: int = 0
    imbalance_before_sum: float = 0.0
    imbalance_after_sum: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    def add(self, other: "StepAggregate") -> None:
        self.plans += other.plans
        self.tokens += other.tokens
        self.solve_time_s += other.solve_time_s
        self.transfers += other.transfers
        self.transfer_bytes += other.transfer_bytes
        self.imbalance_before_sum += other.imbalance_before_sum
        self.imbalance_after_sum += other.imbalance_after_sum
        for k, v in other.timings.items():
            self.timings[k] = self.timings.get(k, 0.0) + v


@dataclass
class Built:
    """Result of converting one batch: tables to write, rows dropped as bad, the first bad value's error."""

    tables: dict[str, pa.Table] = field(default_factory=dict)
    bad: int = 0
    first_error: str | None = None
    steps: dict[int, StepAggregate] = field(default_factory=dict)

    def drop(self, exc: BaseException, n: int = 1) -> None:
        self.bad += n
        if self.first_error is None:
            self.first_error = f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- helpers
def _const(value, n: int, typ) -> pa.Array:
    """A column of ``n`` copies of ``value`` (Parquet's dictionary/RLE encoding stores it once)."""
    return pa.repeat(pa.scalar(value, type=typ), n)


def _ts(ns) -> pa.Array:
    """Nanoseconds since the epoch (UTC) → a TIMESTAMP (µs) column; ``None`` stays null."""
    if isinstance(ns, list) and any(v is None for v in ns):
        return pa.array([None if v is None else operator.index(v) // 1000 for v in ns], type=pa.timestamp("us"))
    return pa.array(_ints(ns) // 1000, type=pa.timestamp("us"))


def _ints(values, dtype=np.int64) -> np.ndarray:
    """Integer column from Python/numpy ints; raises on floats, strings, bools and None."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        raise TypeError(f"expected integers, got dtype {a.dtype}")
    return a.astype(dtype, copy=False)


def _dumps(obj) -> str:
    return _ENCODER.encode(obj)


def _json_default(obj):
    """JSON for numpy values (``Plan.info`` holds arrays); anything else as its ``str``."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


_ENCODER = json.JSONEncoder(default=_json_default, sort_keys=True)


def _int_array(values, typ) -> pa.Array:
    """Strict nullable integer column (pyarrow alone would silently truncate 1.5 to 1)."""
    a = np.asarray(values)
    if a.dtype.kind in "iu":
        return pa.array(a, type=typ)
    if a.dtype == object and all(
        v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool)) for v in values
    ):
        return pa.array(list(values), type=typ)
    raise TypeError(f"expected integers, got dtype {a.dtype}")


def _nested(arr: np.ndarray, typ) -> pa.Array:
    """``[B, d1, ..., dk]`` → a ``B``-row Arrow column of k-level nested lists (row-major)."""
    values = pa.array(np.ascontiguousarray(arr).ravel(), type=typ)
    shape = arr.shape
    out = values
    for d in reversed(range(1, len(shape))):
        n_lists = int(np.prod(shape[:d]))
        offsets = np.arange(0, n_lists * shape[d] + 1, shape[d], dtype=np.int32)
        out = pa.ListArray.from_arrays(pa.array(offsets), out)
    return out


def _imbalance_rows(load_BR: np.ndarray) -> np.ndarray:
    """``[B, R]`` → ``[B]`` max/mean per row, 1.0 where the row is empty (as ultraep.metrics.imbalance)."""
    mean = load_BR.mean(axis=1)
    out = np.ones(load_BR.shape[0], dtype=np.float64)
    np.divide(load_BR.max(axis=1), mean, out=out, where=mean > 0)
    return out


def _agg_by_step(steps: np.ndarray, built: Built, tokens, solve, transfers, nbytes, imb_before, imb_after) -> None:
    """Sum per-plan figures by step into ``built.steps`` (vectorised over the batch)."""
    uniq, inv = np.unique(steps, return_inverse=True)

    def by_step(v):
        return np.bincount(inv, weights=np.asarray(v, dtype=np.float64), minlength=uniq.size)

    counts = np.bincount(inv, minlength=uniq.size)
    tok, sol, ntr, nby, ib, ia = (by_step(v) for v in (tokens, solve, transfers, nbytes, imb_before, imb_after))
    for j, s in enumerate(uniq.tolist()):
        a = built.steps.setdefault(s, StepAggregate())
        a.plans += int(counts[j])
        a.tokens += int(tok[j])
        a.solve_time_s += float(sol[j])
        a.transfers += int(ntr[j])
        a.transfer_bytes += int(nby[j])
        a.imbalance_before_sum += float(ib[j])
        a.imbalance_after_sum += float(ia[j])


# --------------------------------------------------------------------------- plans
def _check_plan_record(rec) -> tuple:
    step, mb, layer, plan, routes, ts = rec
    step, mb, layer = operator.index(step), operator.index(mb), operator.index(layer)
    t = plan.topology
    R, E, S = t.num_ranks, t.num_experts, t.num_slots
    for name, shape in (("load_RE", (R, E)), ("phy2log_RS", (R, S)), ("quota_RS", (R, S))):
        arr = getattr(plan, name)
        if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype.kind not in "iu":
            raise ValueError(f"plan.{name} must be an integer array of shape {shape}")
    if routes and plan.routes_RRS.shape != (R, R, S):
        raise ValueError(f"plan.routes_RRS must have shape {(R, R, S)}")
    tr = plan.transfers
    n = len(tr)
    for name in ("expert", "src", "dst", "bytes", "stage"):
        col = np.asarray(getattr(tr, name))
        if col.shape != (n,) or (n and col.dtype.kind not in "iu"):
            raise ValueError(f"plan.transfers.{name} must be {n} integers")
    float(plan.solve_time_s)
    str(plan.policy)
    return (step, mb, layer, plan, bool(routes), int(ts))


def plan_tables(run_id: str, rank: int, records: list, built: Built) -> None:
    """Convert plan records into ``layer_loads``, ``plans`` and ``transfers`` tables (in ``built``)."""
    if not records:
        return
    try:
        _plan_tables_fast(run_id, rank, records, built)
        return
    except Exception:
        pass
    good = []
    for rec in records:
        try:
            good.append(_check_plan_record(rec))
        except Exception as exc:
            built.drop(exc)
    if good:
        _plan_tables_fast(run_id, rank, good, built)


def _plan_tables_fast(run_id: str, rank: int, records: list, built: Built) -> None:
    steps_t, mbs_t, layers_t, plans, flags, tss = zip(*records)
    step_a = _ints(steps_t)
    mb_a = _ints(mbs_t, np.int32)
    layer_a = _ints(layers_t, np.int32)
    ts_a = np.asarray(tss, dtype=np.int64)
    B = len(plans)

    # Group records whose arrays stack: plans of one topology object (its shapes fix every array's;
    # a plan that breaks this makes np.stack raise and the batch take the checked slow path).
    topos = [p.topology for p in plans]
    t0 = topos[0]
    if all(t is t0 for t in topos):
        groups: dict[int, list[int]] = {id(t0): list(range(B))}
    else:
        groups = {}
        for i, t in enumerate(topos):
            groups.setdefault(id(t), []).append(i)

    ll_parts, pl_parts = [], []
    tokens_all = np.zeros(B, dtype=np.int64)
    imb_b = np.zeros(B)
    imb_a = np.zeros(B)
    for idx_list in groups.values():
        idx = np.asarray(idx_list, dtype=np.int64)
        gp = [plans[i] for i in idx_list]
        t = gp[0].topology
        R, E = gp[0].load_RE.shape
        S = gp[0].quota_RS.shape[1]
        n = len(gp)
        L = np.stack([p.load_RE for p in gp])  # [n, R, E]
        Q = np.stack([p.quota_RS for p in gp])  # [n, R, S]
        P = np.stack([p.phy2log_RS for p in gp])  # [n, R, S]
        if L.dtype.kind not in "iu" or Q.dtype.kind not in "iu" or P.dtype.kind not in "iu":
            raise TypeError("plan arrays must be integer")
        L = L.astype(np.int64, copy=False)
        Q = Q.astype(np.int64, copy=False)
        # Step 1: derived raw sums (exact integer sums of the recorded counts).
        expert_load = L.sum(axis=1)  # [n, E]
        home = np.asarray(t.home_E, dtype=np.int64)
        onehot_ER = (home[:, None] == np.arange(R)[None, :]).astype(np.int64)
        before = expert_load @ onehot_ER  # [n, R]
        after = Q.sum(axis=2)  # [n, R]
        tokens = expert_load.sum(axis=1)
        tokens_all[idx] = tokens
        imb_b[idx] = _imbalance_rows(before)
        imb_a[idx] = _imbalance_rows(after)
        policy = pa.array([str(p.policy) for p in gp], type=pa.string())
        common = {
            sc.C_RUN_ID: _const(run_id, n, pa.string()),
            sc.C_RANK: _const(rank, n, pa.int32()),
            sc.C_STEP: pa.array(step_a[idx]),
            sc.C_MICROBATCH: pa.array(mb_a[idx]),
            sc.C_LAYER: pa.array(layer_a[idx]),
            sc.C_TS: _ts(ts_a[idx]),
        }
        ll_parts.append(pa.table({
            **common,
            "policy": policy,
            "num_ranks": _const(R, n, pa.int32()),
            "num_experts": _const(E, n, pa.int32()),
            "tokens": pa.array(tokens),
            "load": _nested(L, pa.int64()),
            "expert_load": _nested(expert_load, pa.int64()),
            "rank_load_before": _nested(before, pa.int64()),
            "rank_load_after": _nested(after, pa.int64()),
        }, schema=sc.arrow_schema(sc.T_LAYER_LOADS)))
        # Step 2: the plan itself; routes only for records that asked for them.
        want = np.asarray([flags[i] for i in idx_list], dtype=bool)
        if want.any():
            W = np.stack([gp[j].routes_RRS for j in np.flatnonzero(want)]).astype(np.int64, copy=False)
            sizes = np.where(want, R, 0).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
            inner = _nested(W, pa.int64())  # [w] rows of [R][R][S]; flatten one level to [w*R] rows of [R][S]
            inner = inner.flatten()
            routes = pa.ListArray.from_arrays(pa.array(offsets), inner, mask=pa.array(~want))
        else:
            routes = pa.nulls(n, type=pa.list_(pa.list_(pa.list_(pa.int64()))))
        solve = np.asarray([float(p.solve_time_s) for p in gp], dtype=np.float64)
        ntr = np.asarray([len(p.transfers) for p in gp], dtype=np.int32)
        infos = [_dumps(p.info) if p.info else None for p in gp]
        pl_parts.append(pa.table({
            **common,
            "policy": policy,
            "num_ranks": _const(R, n, pa.int32()),
            "num_experts": _const(E, n, pa.int32()),
            "num_masters": _const(int(t.num_masters), n, pa.int32()),
            "num_slots": _const(S, n, pa.int32()),
            "domain_size": _const(int(t.D), n, pa.int32()),
            "phy2log": _nested(P.astype(np.int32), pa.int32()),
            "quota": _nested(Q, pa.int64()),
            "routes": routes,
            "solve_time_s": pa.array(solve),
            "num_replicas": pa.array((P[:, :, int(t.num_masters):] >= 0).sum(axis=(1, 2)).astype(np.int32)),
            "num_transfers": pa.array(ntr),
            "info_json": pa.array(infos, type=pa.string()),
        }, schema=sc.arrow_schema(sc.T_PLANS)))

    # Step 3: transfers, one row each (ragged across plans: concatenate columns).
    trs = [p.transfers for p in plans]
    T = np.asarray([len(tr) for tr in trs], dtype=np.int64)
    total = int(T.sum())
    out: dict[str, pa.Table] = {}
    bytes_per_plan = np.zeros(B, dtype=np.int64)
    if total:
        cols = {}
        nonempty = [tr for tr, t in zip(trs, T.tolist()) if t]
        for name in ("expert", "src", "dst", "stage", "bytes"):
            arr = np.concatenate([np.asarray(getattr(tr, name)) for tr in nonempty])
            if arr.dtype.kind not in "iu":
                raise TypeError(f"transfers.{name} must be integer")
            cols[name] = arr.astype(np.int64 if name == "bytes" else np.int32, copy=False)
        row_of = np.repeat(np.arange(B), T)
        starts = np.concatenate([[0], np.cumsum(T)[:-1]])
        idx_in_plan = (np.arange(total) - np.repeat(starts, T)).astype(np.int32)
        bytes_per_plan = np.bincount(row_of, weights=cols["bytes"], minlength=B).astype(np.int64)
        out[sc.T_TRANSFERS] = pa.table({
            sc.C_RUN_ID: _const(run_id, total, pa.string()),
            sc.C_RANK: _const(rank, total, pa.int32()),
            sc.C_STEP: pa.array(step_a[row_of]),
            sc.C_MICROBATCH: pa.array(mb_a[row_of]),
            sc.C_LAYER: pa.array(layer_a[row_of]),
            "idx": pa.array(idx_in_plan),
            "expert": pa.array(cols["expert"]),
            "src": pa.array(cols["src"]),
            "dst": pa.array(cols["dst"]),
            "stage": pa.array(cols["stage"]),
            "bytes": pa.array(cols["bytes"]),
        }, schema=sc.arrow_schema(sc.T_TRANSFERS))
    out[sc.T_LAYER_LOADS] = pa.concat_tables(ll_parts)
    out[sc.T_PLANS] = pa.concat_tables(pl_parts)
    built.tables.update(out)
    solve_all = np.asarray([float(p.solve_time_s) for p in plans])
    _agg_by_step(step_a, built, tokens_all, solve_all, T, bytes_per_plan, imb_b, imb_a)


# --------------------------------------------------------------------------- generic row tables
def _coerce(value, duck_type: str):
    """Strict per-value conversion used on the slow path (after the fast path refused a batch)."""
    if value is None:
        return None
    if duck_type in ("BIGINT", "INTEGER"):
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"expected an integer, got {value!r}")
        return operator.index(value)
    if duck_type == "DOUBLE":
        if isinstance(value, (str, bytes)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if duck_type == "VARCHAR":
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        return value
    if duck_type == "TIMESTAMP":
        return int(value)
    if duck_type == "DOUBLE[]":
        return [None if v is None else float(v) for v in np.asarray(value, dtype=np.float64).tolist()]
    if duck_type.startswith("MAP("):
        return [(str(k) if isinstance(k, str) else _bad_key(k), None if v is None else _coerce(v, "DOUBLE"))
                for k, v in dict(value).items()]
    return value


def _bad_key(k):
    raise TypeError(f"map keys must be strings, got {k!r}")


def rows_table(table: str, cols: dict, n: int) -> pa.Table:
    """Build ``table`` from ``{column: python/numpy values}`` with the semconv types (raises on bad values)."""
    schema = sc.arrow_schema(table)
    arrays = []
    for f in schema:
        v = cols[f.name]
        if isinstance(v, pa.Array):
            arrays.append(v)
        elif f.type == pa.timestamp("us"):
            arrays.append(_ts(v))
        elif pa.types.is_integer(f.type):
            arrays.append(_int_array(v, f.type))
        else:
            arrays.append(pa.array(v, type=f.type))
    if any(len(a) != n for a in arrays):
        raise ValueError("columns of unequal length")
    return pa.Table.from_arrays(arrays, schema=schema)


def _generic(table: str, run_id: str, rank: int, records: list, to_cols, built: Built) -> None:
    """Fast path: ``to_cols(records) -> dict of columns``; slow path: strict per-record coercion."""
    if not records:
        return
    types = dict(sc.TABLES[table])
    try:
        cols = to_cols(records)
        n = len(records)
        cols[sc.C_RUN_ID] = _const(run_id, n, pa.string())
        cols[sc.C_RANK] = _const(rank, n, pa.int32())
        built.tables[table] = rows_table(table, cols, n)
        return
    except Exception:
        pass
    good = []
    for rec in records:
        try:
            one = to_cols([rec])
            for name, vals in one.items():
                if not isinstance(vals, pa.Array):
                    one[name] = [_coerce(v, types[name]) for v in vals]
                    if name in _KEYS and one[name][0] is None:
                        raise ValueError(f"{name} must not be None")
            one[sc.C_RUN_ID] = [run_id]
            one[sc.C_RANK] = [rank]
            rows_table(table, one, 1)
            good.append(one)
        except Exception as exc:
            built.drop(exc)
    if good:
        merged = {name: [v for one in good for v in one[name]] for name in good[0]}
        built.tables[table] = rows_table(table, merged, len(good))


def _layer_cols(records) -> dict:
    steps, mbs, layers, tss = (list(c) for c in zip(*((r[0], r[1], r[2], r[3]) for r in records)))
    return {sc.C_STEP: steps, sc.C_MICROBATCH: mbs, sc.C_LAYER: layers, sc.C_TS: _ints(tss)}


def decision_table(run_id: str, rank: int, records: list, built: Built) -> None:
    def cols(recs):
        out = _layer_cols(recs)
        out["policy"] = [r[4] for r in recs]
        out["reason"] = [r[5] for r in recs]
        out["predictions"] = [None if r[6] is None else list(r[6].items()) for r in recs]
        out["chosen_predicted_s"] = [r[7] for r in recs]
        return out

    _generic(sc.T_DECISIONS, run_id, rank, records, cols, built)


_KEYS = frozenset((sc.C_STEP, sc.C_MICROBATCH, sc.C_LAYER))
_TIMING_SET = frozenset(sc.TIMING_KEYS)


def timings_table(run_id: str, rank: int, records: list, built: Built) -> None:
    def cols(recs):
        out = _layer_cols(recs)
        dicts = [r[4] for r in recs]
        for k in sc.TIMING_KEYS:
            out[k] = [d.get(k) for d in dicts]
        out["other"] = [[(k, v) for k, v in d.items() if k not in _TIMING_SET] or None for d in dicts]
        return out

    _generic(sc.T_TIMINGS, run_id, rank, records, cols, built)
    # per-step sums of each timing key (for the step span), from the rows that were written
    tbl = built.tables.get(sc.T_TIMINGS)
    if tbl is not None and tbl.num_rows:
        steps = tbl.column(sc.C_STEP).to_numpy()
        uniq, inv = np.unique(steps, return_inverse=True)
        for k in sc.TIMING_KEYS:
            col = tbl.column(k).to_numpy(zero_copy_only=False)
            col = np.nan_to_num(np.asarray(col, dtype=np.float64), nan=0.0)
            if not col.any():
                continue
            sums = np.bincount(inv, weights=col, minlength=uniq.size)
            for j, s in enumerate(uniq.tolist()):
                a = built.steps.setdefault(s, StepAggregate())
                a.timings[k] = a.timings.get(k, 0.0) + float(sums[j])


def transfer_times_table(run_id: str, rank: int, records: list, built: Built) -> None:
    def cols(recs):
        out = _layer_cols(recs)
        out["seconds"] = [np.asarray(r[4], dtype=np.float64) for r in recs]
        return out

    _generic(sc.T_TRANSFER_TIMES, run_id, rank, records, cols, built)


def steps_table(run_id: str, rank: int, records: list, built: Built) -> None:
    def cols(recs):
        return {
            sc.C_STEP: [r[0] for r in recs],
            sc.C_TS: _ints([r[1] for r in recs]),
            "loss": [r[2] for r in recs],
            "step_time_s": [r[3] for r in recs],
            "extra_json": [None if r[4] is None else _dumps(r[4]) for r in recs],
        }

    _generic(sc.T_STEPS, run_id, rank, records, cols, built)
