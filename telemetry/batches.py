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
# step:      (step, ts_ns, loss, step_time_s, extra | None, warmup)


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
    """``[B, R]`` → ``[B]`` max/mean per row, 1.0 where the row is empty (as ultraep.plan.metrics.imbalance)."""
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


def _with_fallback(records: list, convert, clean, built: Built):
    """``convert(records)``; if that refuses the batch, ``convert`` the records ``clean`` accepts (each bad
    one is dropped and counted in ``built``). ``None`` when no record is left."""
    try:
        return convert(records)
    except Exception:
        pass
    good = []
    for rec in records:
        try:
            good.append(clean(rec))
        except Exception as exc:
            built.drop(exc)
    return convert(good) if good else None


def plan_tables(run_id: str, rank: int, records: list, built: Built) -> None:
    """Convert plan records into ``layer_loads``, ``plans`` and ``transfers`` tables (in ``built``)."""
    if not records:
        return
    out = _with_fallback(records, lambda recs: _plan_tables_fast(run_id, rank, recs), _check_plan_record, built)
    if out is not None:
        tables, steps = out
        built.tables.update(tables)
        for s, agg in steps.items():
            built.steps.setdefault(s, StepAggregate()).add(agg)


def _plan_tables_fast(run_id: str, rank: int, records: list) -> tuple[dict, dict]:
    """Tables and per-step aggregates of a batch of plan records; raises on anything unexpected.

    Step 1: group the records whose arrays stack (:func:`_stackable_groups`).
    Step 2: per group, stack the arrays ``[n, R, E]`` / ``[n, R, S]`` (:func:`_stacked_arrays`), derive the
            raw sums and write the ``layer_loads`` rows (:func:`_layer_loads_rows`), then the ``plans`` rows
            (:func:`_plans_rows`; routes only for records that asked for them).
    Step 3: the transfers, one row each, ragged across plans (:func:`_transfer_rows`).
    Step 4: per-step aggregates for the step span and metrics (:func:`_agg_by_step`).
    """
    steps_t, mbs_t, layers_t, plans, flags, tss = zip(*records)
    keys = (_ints(steps_t), _ints(mbs_t, np.int32), _ints(layers_t, np.int32), np.asarray(tss, dtype=np.int64))
    B = len(plans)
    tokens_all = np.zeros(B, dtype=np.int64)
    imb_b = np.zeros(B)
    imb_a = np.zeros(B)
    ll_parts, pl_parts = [], []
    for idx_list in _stackable_groups(plans):
        idx = np.asarray(idx_list, dtype=np.int64)
        gp = [plans[i] for i in idx_list]
        L, Q, P = _stacked_arrays(gp)
        common = _key_columns(run_id, rank, keys, idx)
        policy = pa.array([str(p.policy) for p in gp], type=pa.string())
        table, tokens_all[idx], imb_b[idx], imb_a[idx] = _layer_loads_rows(gp[0].topology, L, Q, common, policy)
        ll_parts.append(table)
        pl_parts.append(_plans_rows(gp, [flags[i] for i in idx_list], Q, P, common, policy))
    out: dict[str, pa.Table] = {}
    transfers, T, bytes_per_plan = _transfer_rows(run_id, rank, keys, plans)
    if transfers is not None:
        out[sc.T_TRANSFERS] = transfers
    out[sc.T_LAYER_LOADS] = pa.concat_tables(ll_parts)
    out[sc.T_PLANS] = pa.concat_tables(pl_parts)
    solve_all = np.asarray([float(p.solve_time_s) for p in plans])
    agg = Built()
    _agg_by_step(keys[0], agg, tokens_all, solve_all, T, bytes_per_plan, imb_b, imb_a)
    return out, agg.steps


def _stackable_groups(plans) -> list[list[int]]:
    """Indices of the records whose arrays stack: plans of one topology object (its shapes fix every array's;
    a plan that breaks this makes ``np.stack`` raise and the batch take the checked slow path)."""
    topos = [p.topology for p in plans]
    t0 = topos[0]
    if all(t is t0 for t in topos):
        return [list(range(len(plans)))]
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(topos):
        groups.setdefault(id(t), []).append(i)
    return list(groups.values())


def _stacked_arrays(gp: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``load [n, R, E]`` and ``quota [n, R, S]`` as int64, ``phy2log [n, R, S]`` as recorded (integers)."""
    L = np.stack([p.load_RE for p in gp])
    Q = np.stack([p.quota_RS for p in gp])
    P = np.stack([p.phy2log_RS for p in gp])
    if L.dtype.kind not in "iu" or Q.dtype.kind not in "iu" or P.dtype.kind not in "iu":
        raise TypeError("plan arrays must be integer")
    return L.astype(np.int64, copy=False), Q.astype(np.int64, copy=False), P


def _key_columns(run_id: str, rank: int, keys: tuple, idx: np.ndarray) -> dict:
    """The columns every plan-derived row starts with, for the records ``idx``."""
    step_a, mb_a, layer_a, ts_a = keys
    n = len(idx)
    return {
        sc.C_RUN_ID: _const(run_id, n, pa.string()),
        sc.C_RANK: _const(rank, n, pa.int32()),
        sc.C_STEP: pa.array(step_a[idx]),
        sc.C_MICROBATCH: pa.array(mb_a[idx]),
        sc.C_LAYER: pa.array(layer_a[idx]),
        sc.C_TS: _ts(ts_a[idx]),
    }


def _layer_loads_rows(t, L: np.ndarray, Q: np.ndarray, common: dict, policy: pa.Array):
    """The ``layer_loads`` rows of one group with their derived raw sums (exact integer sums of the recorded
    counts). Returns ``(table, tokens [n], imbalance_before [n], imbalance_after [n])``."""
    n, R, E = L.shape
    expert_load = L.sum(axis=1)  # [n, E]
    home = np.asarray(t.home_E, dtype=np.int64)
    onehot_ER = (home[:, None] == np.arange(R)[None, :]).astype(np.int64)
    before = expert_load @ onehot_ER  # [n, R]
    after = Q.sum(axis=2)  # [n, R]
    tokens = expert_load.sum(axis=1)
    table = pa.table({
        **common,
        "policy": policy,
        "num_ranks": _const(R, n, pa.int32()),
        "num_experts": _const(E, n, pa.int32()),
        "tokens": pa.array(tokens),
        "load": _nested(L, pa.int64()),
        "expert_load": _nested(expert_load, pa.int64()),
        "rank_load_before": _nested(before, pa.int64()),
        "rank_load_after": _nested(after, pa.int64()),
    }, schema=sc.arrow_schema(sc.T_LAYER_LOADS))
    return table, tokens, _imbalance_rows(before), _imbalance_rows(after)


def _routes_column(gp: list, flags: list, R: int) -> pa.Array:
    """``routes [n]`` (each ``[R][R][S]``), null for the records that did not ask for routes."""
    n = len(gp)
    want = np.asarray(flags, dtype=bool)
    if not want.any():
        return pa.nulls(n, type=pa.list_(pa.list_(pa.list_(pa.int64()))))
    W = np.stack([gp[j].routes_RRS for j in np.flatnonzero(want)]).astype(np.int64, copy=False)
    sizes = np.where(want, R, 0).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    inner = _nested(W, pa.int64())  # [w] rows of [R][R][S]; flatten one level to [w*R] rows of [R][S]
    inner = inner.flatten()
    return pa.ListArray.from_arrays(pa.array(offsets), inner, mask=pa.array(~want))


def _plans_rows(gp: list, flags: list, Q: np.ndarray, P: np.ndarray, common: dict, policy: pa.Array) -> pa.Table:
    """The ``plans`` rows of one group: the plan itself (placement, quotas, routes if asked, solve time)."""
    t = gp[0].topology
    n, R, S = Q.shape
    E = gp[0].load_RE.shape[1]
    solve = np.asarray([float(p.solve_time_s) for p in gp], dtype=np.float64)
    ntr = np.asarray([len(p.transfers) for p in gp], dtype=np.int32)
    infos = [_dumps(p.info) if p.info else None for p in gp]
    return pa.table({
        **common,
        "policy": policy,
        "num_ranks": _const(R, n, pa.int32()),
        "num_experts": _const(E, n, pa.int32()),
        "num_masters": _const(int(t.num_masters), n, pa.int32()),
        "num_slots": _const(S, n, pa.int32()),
        "domain_size": _const(int(t.D), n, pa.int32()),
        "phy2log": _nested(P.astype(np.int32), pa.int32()),
        "quota": _nested(Q, pa.int64()),
        "routes": _routes_column(gp, flags, R),
        "solve_time_s": pa.array(solve),
        "num_replicas": pa.array((P[:, :, int(t.num_masters):] >= 0).sum(axis=(1, 2)).astype(np.int32)),
        "num_transfers": pa.array(ntr),
        "info_json": pa.array(infos, type=pa.string()),
    }, schema=sc.arrow_schema(sc.T_PLANS))


def _transfer_rows(run_id: str, rank: int, keys: tuple, plans) -> tuple[pa.Table | None, np.ndarray, np.ndarray]:
    """The ``transfers`` rows of the batch (``None`` if no plan moves weights), transfers per plan ``[B]``
    and bytes per plan ``[B]``."""
    step_a, mb_a, layer_a, _ = keys
    B = len(plans)
    trs = [p.transfers for p in plans]
    T = np.asarray([len(tr) for tr in trs], dtype=np.int64)
    total = int(T.sum())
    if not total:
        return None, T, np.zeros(B, dtype=np.int64)
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
    table = pa.table({
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
    return table, T, bytes_per_plan


# --------------------------------------------------------------------------- generic row tables
# Fast path: transpose the records with zip(*records) and let Arrow convert whole columns in C++ (dicts
# to STRUCT/MAP included). Slow path (only when the fast path refused the batch): clean every record with
# its table's strict `clean` function, drop the ones that fail, convert the rest.
def _int(v) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"expected an integer, got {v!r}")
    return operator.index(v)


def _float(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)  # numpy scalars, 0-d tensors


def _bool(v) -> bool:
    if not isinstance(v, (bool, np.bool_)):  # 1 or "yes" would silently mark a warm-up step
        raise TypeError(f"expected a bool, got {v!r}")
    return bool(v)


def _str(v) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _float_map(d) -> dict | None:
    if d is None:
        return None
    return {_str(k): _float(v) for k, v in dict(d).items()}


_NOT_NULL = frozenset((sc.C_RUN_ID, sc.C_RANK, sc.C_STEP, sc.C_MICROBATCH, sc.C_LAYER))


def rows_table(table: str, cols: dict, n: int) -> pa.Table:
    """Build ``table`` from ``{column: values}`` with the semconv types (raises on bad values)."""
    schema = sc.arrow_schema(table)
    arrays = []
    for f in schema:
        v = cols[f.name]
        if isinstance(v, (pa.Array, pa.ChunkedArray)):
            arrays.append(v)
        elif f.type == pa.timestamp("us"):
            arrays.append(_ts(v))
        elif pa.types.is_integer(f.type):
            arrays.append(_int_array(v, f.type))
        else:
            arrays.append(pa.array(v, type=f.type))
    if any(len(a) != n for a in arrays):
        raise ValueError("columns of unequal length")
    for f, a in zip(schema, arrays):
        if f.name in _NOT_NULL and a.null_count:
            raise ValueError(f"{f.name} must not be None")
    return pa.Table.from_arrays(arrays, schema=schema)


def _generic(table: str, run_id: str, rank: int, records: list, to_cols, clean, built: Built) -> None:
    if not records:
        return

    def build(recs) -> pa.Table:
        cols = to_cols(recs)
        n = len(recs)
        cols[sc.C_RUN_ID] = _const(run_id, n, pa.string())
        cols[sc.C_RANK] = _const(rank, n, pa.int32())
        return rows_table(table, cols, n)

    def checked(rec):
        rec = clean(rec)
        build([rec])  # everything the batch conversion would refuse, refused now
        return rec

    tbl = _with_fallback(records, build, checked, built)
    if tbl is not None:
        built.tables[table] = tbl


def _layer_cols(steps, mbs, layers, tss) -> dict:
    return {sc.C_STEP: steps, sc.C_MICROBATCH: mbs, sc.C_LAYER: layers, sc.C_TS: _ints(tss)}


_MAP = pa.map_(pa.string(), pa.float64())


def _decision_cols(recs) -> dict:
    steps, mbs, layers, tss, policy, reason, preds, chosen = zip(*recs)
    out = _layer_cols(steps, mbs, layers, tss)
    out.update(policy=pa.array(policy, type=pa.string()), reason=pa.array(reason, type=pa.string()),
               predictions=pa.array(preds, type=_MAP), chosen_predicted_s=pa.array(chosen, type=pa.float64()))
    if out["policy"].null_count:
        raise ValueError("policy must not be None")
    return out


def _decision_clean(r) -> tuple:
    return (_int(r[0]), _int(r[1]), _int(r[2]), int(r[3]), _str(r[4]), _str(r[5]), _float_map(r[6]),
            _float(r[7]))


def decision_table(run_id: str, rank: int, records: list, built: Built) -> None:
    _generic(sc.T_DECISIONS, run_id, rank, records, _decision_cols, _decision_clean, built)


_TIMING_SET = frozenset(sc.TIMING_KEYS)
_TIMING_STRUCT = pa.struct([(k, pa.float64()) for k in sc.TIMING_KEYS])


def _timing_cols(recs) -> dict:
    steps, mbs, layers, tss, dicts = zip(*recs)
    out = _layer_cols(steps, mbs, layers, tss)
    st = pa.array(dicts, type=_TIMING_STRUCT)  # C++ conversion; unknown keys are ignored here
    for i, k in enumerate(sc.TIMING_KEYS):
        out[k] = st.field(i)
    if set().union(*dicts) <= _TIMING_SET:
        out["other"] = pa.nulls(len(recs), type=_MAP)
    else:
        out["other"] = pa.array([{k: v for k, v in d.items() if k not in _TIMING_SET} or None for d in dicts],
                                type=_MAP)
    return out


def _timing_clean(r) -> tuple:
    return (_int(r[0]), _int(r[1]), _int(r[2]), int(r[3]), _float_map(r[4]))


def timings_table(run_id: str, rank: int, records: list, built: Built) -> None:
    _generic(sc.T_TIMINGS, run_id, rank, records, _timing_cols, _timing_clean, built)
    # per-step sums of each timing key (for the step span), from the rows that were written
    tbl = built.tables.get(sc.T_TIMINGS)
    if tbl is not None and tbl.num_rows:
        steps = tbl.column(sc.C_STEP).to_numpy()
        uniq, inv = np.unique(steps, return_inverse=True)
        for k in sc.TIMING_KEYS:
            col = tbl.column(k)
            if col.null_count == len(col):
                continue
            vals = np.nan_to_num(col.to_numpy(zero_copy_only=False).astype(np.float64), nan=0.0)
            sums = np.bincount(inv, weights=vals, minlength=uniq.size)
            for j, s in enumerate(uniq.tolist()):
                a = built.steps.setdefault(s, StepAggregate())
                a.timings[k] = a.timings.get(k, 0.0) + float(sums[j])


def _ttimes_cols(recs) -> dict:
    steps, mbs, layers, tss, secs = zip(*recs)
    out = _layer_cols(steps, mbs, layers, tss)
    out["seconds"] = pa.array(secs, type=pa.list_(pa.float64()))
    return out


def _ttimes_clean(r) -> tuple:
    return (_int(r[0]), _int(r[1]), _int(r[2]), int(r[3]), np.asarray(r[4], dtype=np.float64).ravel())


def transfer_times_table(run_id: str, rank: int, records: list, built: Built) -> None:
    _generic(sc.T_TRANSFER_TIMES, run_id, rank, records, _ttimes_cols, _ttimes_clean, built)


def _steps_cols(recs) -> dict:
    steps, tss, loss, st, extra, warm = zip(*recs)
    warm = [_bool(w) for w in warm]
    return {sc.C_STEP: steps, sc.C_TS: _ints(tss), "loss": pa.array(loss, type=pa.float64()),
            "step_time_s": pa.array(st, type=pa.float64()),
            "extra_json": pa.array([None if e is None else _dumps(e) for e in extra], type=pa.string()),
            "warmup": pa.array(warm, type=pa.bool_())}


def _steps_clean(r) -> tuple:
    return (_int(r[0]), int(r[1]), _float(r[2]), _float(r[3]), r[4], _bool(r[5]))


def steps_table(run_id: str, rank: int, records: list, built: Built) -> None:
    _generic(sc.T_STEPS, run_id, rank, records, _steps_cols, _steps_clean, built)
