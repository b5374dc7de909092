"""The dashboard's figures: every table and series the pages show, shaped from a run's mirror (no Streamlit).

Where the pieces live: run discovery and status in :mod:`.runs`; the SQL each page runs in
:mod:`.page_sql`; mirrors, the DuckDB cursor and result caching in :mod:`.cache`; the SQL page's sandbox
(a security boundary) in :mod:`.sandbox`. This module only shapes: it runs those queries through the
cache (or reads the mirror's Arrow facts directly where numpy is faster) and returns pandas DataFrames
whose columns carry units in their names (``_s`` seconds, ``bytes``, ``tokens``), ready for :mod:`.charts`
and ``st.dataframe``. Point look-ups that need the full matrices of one layer-microbatch go to the store
(``ultraep.telemetry.open_run``, :func:`rank_load_by_expert`). Nothing here does I/O at import time.

Step binning: charts over steps show at most ``max_bins`` points; a bin covers ``bin`` consecutive steps
starting at ``first_step + k * bin`` and its value is the mean (or sum, where stated) over the
layer-microbatches inside. With ``bin == 1`` every figure equals the canned query's.

Legend: R ranks, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ultraep.dashboard import page_sql as sql
from ultraep.dashboard.cache import facts_arrow, facts_query, mirror_query, store
from ultraep.dashboard.mirror import RunMirror
from ultraep.telemetry import semconv as sc
from ultraep.telemetry.queries import ACTIVATION_MEMORY, ACTIVATION_MEMORY_BY_RANK, RANK_LOAD_BY_EXPERT, Query

MAX_BINS = 240


# --------------------------------------------------------------------------- binning
@dataclass(frozen=True)
class Bins:
    first_step: int
    last_step: int
    bin: int

    @property
    def count(self) -> int:
        return (self.last_step - self.first_step) // self.bin + 1


def step_bins(first: int, last: int, max_bins: int = MAX_BINS) -> Bins:
    span = max(1, int(last) - int(first) + 1)
    return Bins(int(first), int(last), max(1, math.ceil(span / max(1, max_bins))))



def layer_bins(mirror: RunMirror, max_bins: int = MAX_BINS) -> tuple[Bins | None, list[int]]:
    """Step bins over the run's layer-microbatches and the layers recorded (``None`` if no rows yet)."""
    df = mirror_query(mirror, sql.STEP_RANGE, ("layer_facts",))
    if not len(df) or int(df["rows"].iloc[0]) == 0:
        return None, []
    r = df.iloc[0]
    return step_bins(int(r["first_step"]), int(r["last_step"]), max_bins), [int(x) for x in r["layers"]]


# --------------------------------------------------------------------------- overview
def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def headline(mirror: RunMirror) -> dict[str, Any]:
    """The Overview's figures for one run (see docs/dashboard.md for each definition).

    * ``mean_imbalance_before/after``: mean over layer-microbatches of max/mean rank load.
    * ``pct_of_ideal``: Σ force-balanced ideal time / Σ time (measured, else predicted) over the
      layer-microbatches that recorded ``ideal_s`` (the simulator does), in %; ``ideal_basis`` 'time'.
      Without ``ideal_s``: Σ mean rank load / Σ max rank load after balancing (compute-bound share of
      the ideal, no overhead counted), ``ideal_basis`` 'load'.
    * ``plan_s`` / ``transfer_s``: summed planning / transfer seconds (timings; planning falls back to
      the planners' ``solve_time_s``), and their share of the summed layer time when one is known.
    * ``warmup_steps``: steps marked warm-up; every figure above leaves them out (counts keep them).
    """
    mirror.refresh(sql.OVERVIEW_UNITS)
    lay = mirror_query(mirror, sql.HEADLINE_LAYERS, ("layer_facts", sc.T_STEPS)).iloc[0].to_dict()
    tim = mirror_query(mirror, sql.HEADLINE_TIMINGS, ("timing_facts", sc.T_STEPS)).iloc[0].to_dict()
    pl = mirror_query(mirror, sql.HEADLINE_PLANS, ("plan_facts", sc.T_STEPS)).iloc[0].to_dict()
    out: dict[str, Any] = {
        "plans": int(lay["plans"] or 0), "layers": int(lay["layers"] or 0), "steps": int(lay["steps"] or 0),
        "warmup_steps": int(lay["warmup_steps"] or 0),
        "first_step": _num(lay["first_step"]), "last_step": _num(lay["last_step"]),
        "tokens": int(_num(lay["tokens"]) or 0),
        "mean_imbalance_before": _num(lay["mean_imbalance_before"]),
        "mean_imbalance_after": _num(lay["mean_imbalance_after"]),
        "timed": int(tim["timed"] or 0), "transfers": int(_num(pl["transfers"]) or 0),
        "mean_replicas": _num(pl["mean_replicas"]),
    }
    ideal, t_ideal = _num(tim["ideal_s"]), _num(tim["time_with_ideal_s"])
    if ideal is not None and t_ideal:
        out["pct_of_ideal"], out["ideal_basis"] = 100.0 * ideal / t_ideal, "time"
    elif _num(lay["load_ideal_after"]) is not None:
        out["pct_of_ideal"], out["ideal_basis"] = 100.0 * float(lay["load_ideal_after"]), "load"
    else:
        out["pct_of_ideal"], out["ideal_basis"] = None, None
    out["pct_of_ideal_before"] = (100.0 * float(lay["load_ideal_before"])
                                  if _num(lay["load_ideal_before"]) is not None else None)
    plan_s = _num(tim["plan_s"])
    out["plan_basis"] = "timings"
    if plan_s is None:
        plan_s, out["plan_basis"] = _num(pl["solve_time_s"]), "solve_time"
    out["plan_s"] = plan_s
    out["transfer_s"] = _num(tim["transfer_s"])
    time_s = _num(tim["time_s"])
    out["time_s"] = time_s
    out["plan_share"] = plan_s / time_s if plan_s is not None and time_s else None
    out["transfer_share"] = out["transfer_s"] / time_s if out["transfer_s"] is not None and time_s else None
    out["generation"] = mirror.generation
    return out


def policy_shares(mirror: RunMirror):
    return mirror_query(mirror, sql.POLICY_SHARES, sql.SHOWN_FACTS)


def warmup_steps(mirror: RunMirror) -> list[int]:
    """The steps any rank marked warm-up (``steps.warmup``), in order."""
    import pyarrow.compute as pc

    mirror.refresh(("steps",))
    t = mirror.facts(sc.T_STEPS)
    if t.num_rows == 0:
        return []
    warm = t.filter(pc.fill_null(t.column("warmup"), False))
    return sorted({int(s) for s in warm.column(sc.C_STEP).to_pylist()})


def imbalance_over_steps(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, sql.IMBALANCE_OVER_STEPS, ("layer_facts",), first=bins.first_step, bin=bins.bin)


# --------------------------------------------------------------------------- layers
def layer_step_imbalance(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, sql.LAYER_STEP_IMBALANCE, ("layer_facts",), first=bins.first_step, bin=bins.bin)


def layer_summary(mirror: RunMirror):
    return mirror_query(mirror, sql.LAYER_SUMMARY, ("layer_facts", sc.T_STEPS))



def microbatches(mirror: RunMirror, layer: int, step: int) -> list[int]:
    """The microbatches recorded for one layer and step, in order."""
    df = mirror_query(mirror, sql.MICROBATCHES, ("layer_facts",), layer=layer, step=step)
    return [int(x) for x in df["microbatch"]]


def rank_load_by_expert(run_dir, run_id: str, layer: int, step: int, microbatch: int | None = None):
    """Tokens each rank receives from each expert before/after balancing for one layer and step (store,
    ``queries.RANK_LOAD_BY_EXPERT``)."""
    cur = store(run_dir)
    try:
        q = RANK_LOAD_BY_EXPERT
        return cur.execute(q.sql, q.bind(run_id=run_id, layer=layer, step=step, microbatch=microbatch)).df()
    finally:
        cur.close()


def _store_query(run_dir, query: Query, **params):
    cur = store(run_dir)
    try:
        return cur.execute(query.sql, query.bind(**params)).df()
    finally:
        cur.close()


def activation_memory(run_dir, run_id: str):
    """Per layer: the busiest rank's peak expert-activation MB before/after balancing against the mean rank's
    (store, ``queries.ACTIVATION_MEMORY``; empty for a run that recorded none, e.g. a simulation)."""
    return _store_query(run_dir, ACTIVATION_MEMORY, run_id=run_id)


def activation_memory_by_rank(run_dir, run_id: str, layer: int):
    """Per rank of ``layer``: peak and mean expert-activation MB before/after (``queries.ACTIVATION_MEMORY_BY_RANK``)."""
    return _store_query(run_dir, ACTIVATION_MEMORY_BY_RANK, run_id=run_id, layer=layer)


# --------------------------------------------------------------------------- experts
def _per_layer_matrix(tbl, column: str, layer: int):
    """Rows of one layer as ``(steps [n], matrix [n, E])`` from a per-expert fact table."""
    import pyarrow.compute as pc

    sel = tbl.filter(pc.equal(tbl.column(sc.C_LAYER), layer))
    n = sel.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
    steps = sel.column(sc.C_STEP).to_numpy()
    col = sel.column(column).combine_chunks()
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    E = int(lengths.max()) if n else 0
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
    if (lengths == E).all():
        return steps, flat.reshape(n, E)
    mat = np.zeros((n, E), dtype=np.int64)  # ragged (a run whose E changed): pad with zeros
    pos = 0
    for i, ln in enumerate(lengths.tolist()):
        mat[i, :ln] = flat[pos:pos + ln]
        pos += ln
    return steps, mat


def _bin_sum(steps: np.ndarray, mat: np.ndarray, bins: Bins) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step bin: (bin start steps [b], summed matrix [b, E], rows per bin [b])."""
    b = (steps - bins.first_step) // bins.bin
    uniq, inv = np.unique(b, return_inverse=True)
    out = np.zeros((uniq.size, mat.shape[1]), dtype=np.float64)
    np.add.at(out, inv, mat)
    counts = np.bincount(inv, minlength=uniq.size)
    return bins.first_step + uniq * bins.bin, out, counts


def expert_load(mirror: RunMirror, layer: int, bins: Bins):
    """Long table (step, expert, load_tokens): tokens routed to each expert per step bin, summed over the
    bin's microbatches and divided by the number of steps in the bin (per-step load, {token})."""
    import pandas as pd

    mirror.refresh(("expert",))
    steps, mat = _per_layer_matrix(mirror.facts("expert_facts"), "expert_load", layer)
    if steps.size == 0:
        return pd.DataFrame(columns=["step", "expert", "load_tokens"])
    starts, sums, _ = _bin_sum(steps, mat, bins)
    per_bin_steps = _steps_per_bin(steps, bins, starts)
    loads = sums / per_bin_steps[:, None]
    B, E = loads.shape
    return pd.DataFrame({"step": np.repeat(starts, E), "expert": np.tile(np.arange(E), B),
                         "load_tokens": loads.ravel()})


def _steps_per_bin(steps: np.ndarray, bins: Bins, starts: np.ndarray) -> np.ndarray:
    u = np.unique(steps)
    b = (u - bins.first_step) // bins.bin
    cnt = np.bincount(b, minlength=int(b.max()) + 1 if b.size else 0)
    return cnt[(starts - bins.first_step) // bins.bin].astype(np.float64)


def replica_counts(mirror: RunMirror, layer: int, bins: Bins):
    """Long table (step, expert, replicas): mean replicas (instances beyond the master) per step bin."""
    import pandas as pd

    mirror.refresh(("replica",))
    steps, mat = _per_layer_matrix(mirror.facts("replica_facts"), "replicas", layer)
    if steps.size == 0:
        return pd.DataFrame(columns=["step", "expert", "replicas"])
    starts, sums, counts = _bin_sum(steps, mat, bins)
    mean = sums / counts[:, None]
    B, E = mean.shape
    return pd.DataFrame({"step": np.repeat(starts, E), "expert": np.tile(np.arange(E), B),
                         "replicas": mean.ravel()})


def hottest_experts(load_df, top: int = 10):
    """The ``top`` experts by total load with their share of the layer's load in the first and last
    quarter of the bins (drift: how the hot set moves)."""
    import pandas as pd

    cols = ["expert", "load_tokens", "share", "share_first_quarter", "share_last_quarter", "drift"]
    if load_df is None or not len(load_df):
        return pd.DataFrame(columns=cols)
    wide = load_df.pivot_table(index="step", columns="expert", values="load_tokens", aggfunc="sum").fillna(0.0)
    total = wide.sum(axis=0)
    grand = float(total.sum()) or 1.0
    q = max(1, len(wide) // 4)
    first, last = wide.iloc[:q].sum(axis=0), wide.iloc[-q:].sum(axis=0)
    f_tot, l_tot = float(first.sum()) or 1.0, float(last.sum()) or 1.0
    df = pd.DataFrame({"expert": total.index.astype(int), "load_tokens": total.values,
                       "share": total.values / grand, "share_first_quarter": first.values / f_tot,
                       "share_last_quarter": last.values / l_tot})
    df["drift"] = df["share_last_quarter"] - df["share_first_quarter"]
    return df.sort_values(["load_tokens", "expert"], ascending=[False, True]).head(top).reset_index(drop=True)[cols]


def hot_set_turnover(load_df, k: int = 4):
    """Per step bin: the hottest expert and the share of the top-``k`` set that changed since the
    previous bin (0 = the same hot experts, 1 = all new)."""
    import pandas as pd

    if load_df is None or not len(load_df):
        return pd.DataFrame(columns=["step", "hottest_expert", "turnover"])
    wide = load_df.pivot_table(index="step", columns="expert", values="load_tokens", aggfunc="sum").fillna(0.0)
    vals = wide.to_numpy()
    k = max(1, min(k, vals.shape[1]))
    top = np.argsort(-vals, axis=1, kind="stable")[:, :k]
    experts = wide.columns.to_numpy()
    turnover = [np.nan]
    for i in range(1, len(top)):
        turnover.append(1.0 - len(set(top[i]) & set(top[i - 1])) / k)
    return pd.DataFrame({"step": wide.index.to_numpy(), "hottest_expert": experts[top[:, 0]].astype(int),
                         "turnover": turnover})


# --------------------------------------------------------------------------- policies
def decision_map(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, sql.DECISION_MAP, ("decision_facts",), first=bins.first_step, bin=bins.bin)


def decision_switches(mirror: RunMirror):
    """Per layer: decisions, distinct policies and policy changes (in step, microbatch order)."""
    mirror.refresh(("decision",))
    if not mirror.is_sorted("decision_facts"):
        return mirror_query(mirror, sql.DECISION_SWITCHES, ("decision_facts",))

    def compute():  # rows already in (step, microbatch, layer) order: a stable sort by layer suffices
        import pandas as pd
        import pyarrow.compute as pc

        t = mirror.facts("decision_facts")
        layer = t.column(sc.C_LAYER).to_numpy()
        codes = pc.dictionary_encode(t.column("policy")).combine_chunks().indices.to_numpy(zero_copy_only=False)
        order = np.argsort(layer, kind="stable")
        lay, pol = layer[order], codes[order]
        change = np.zeros(lay.size, dtype=bool)
        change[1:] = (lay[1:] == lay[:-1]) & (pol[1:] != pol[:-1])
        uniq, start = np.unique(lay, return_index=True)
        counts = np.diff(np.append(start, lay.size))
        switches = np.add.reduceat(change, start) if lay.size else np.zeros(0, dtype=np.int64)
        policies = [len(np.unique(pol[a:a + n])) for a, n in zip(start, counts)]
        return pd.DataFrame({"layer": uniq.astype(np.int64), "decisions": counts.astype(np.int64),
                             "policies": np.asarray(policies, dtype=np.int64),
                             "switches": np.asarray(switches, dtype=np.int64)})

    return mirror.memo(("decision_switches",), ("decision_facts",), compute).copy()


def decision_reasons(mirror: RunMirror):
    return mirror_query(mirror, sql.DECISION_REASONS, ("decision_facts",))


def recent_decisions(mirror: RunMirror, layer: int, limit: int = 50):
    return mirror_query(mirror, sql.RECENT_DECISIONS, ("decision_facts",), layer=layer, limit=limit)


def predictions(mirror: RunMirror):
    """The joined predictions table (Arrow), cached until new timings or decisions arrive."""
    facts = ("timing_facts", "decision_facts")
    mirror.refresh(("timing", "decision"))

    return mirror.memo(("predictions",), facts,
                       lambda: facts_arrow({f: mirror.facts(f) for f in facts}, sql.PREDICTIONS.sql))


def _on_predictions(mirror: RunMirror, query: Query, *, with_steps: bool = False, **params):
    table = predictions(mirror)
    tables, facts = {"predictions": table}, ("timing_facts", "decision_facts")
    if with_steps:  # the warm-up steps, for summaries that leave them out
        mirror.refresh(("steps",))
        tables[sc.T_STEPS], facts = mirror.facts(sc.T_STEPS), facts + (sc.T_STEPS,)
    key = ("predictions", query.name, tuple(sorted(params.items())))
    return mirror.memo(key, facts, lambda: facts_query(tables, query, **params)).copy()


def prediction_summary(mirror: RunMirror):
    return _on_predictions(mirror, sql.PREDICTION_SUMMARY, with_steps=True)


def exploration(mirror: RunMirror):
    """The probes an engine ran (one row, none where no engine chose): share of the chosen calls and measured cost
    against the policy in force (:data:`.page_sql.EXPLORATION`)."""
    return mirror_query(mirror, sql.EXPLORATION, ("decision_facts", "timing_facts", sc.T_STEPS))


def prediction_over_steps(mirror: RunMirror, bins: Bins):
    return _on_predictions(mirror, sql.PREDICTION_OVER_STEPS, with_steps=True, first=bins.first_step, bin=bins.bin)


def phase_errors_over_steps(mirror: RunMirror, bins: Bins):
    """Per step bin and cost-model term (column ``policy``, so the prediction charts draw it): the median
    absolute relative prediction error."""
    return mirror_query(mirror, sql.PHASE_ERRORS_OVER_STEPS, ("timing_facts", sc.T_STEPS), first=bins.first_step,
                        bin=bins.bin)


def prediction_sample(mirror: RunMirror, limit: int = 1500):
    """At most ``limit`` layer-microbatches, evenly spread over the run (for the scatter)."""
    t = predictions(mirror)
    if t.num_rows > limit:
        t = t.take(np.linspace(0, t.num_rows - 1, limit).astype(np.int64))
    return t.to_pandas()


# --------------------------------------------------------------------------- transfers
def transfers_over_steps(mirror: RunMirror, bins: Bins):
    return mirror_query(mirror, sql.TRANSFERS_OVER_STEPS, ("transfer_plan_facts",), first=bins.first_step, bin=bins.bin)


def transfer_totals(mirror: RunMirror) -> dict[str, Any]:
    return mirror_query(mirror, sql.TRANSFER_TOTALS, ("transfer_plan_facts",)).iloc[0].to_dict()


def transfer_senders(mirror: RunMirror):
    return mirror_query(mirror, sql.TRANSFER_SENDERS, ("transfer_facts",))


def transfer_fanout(mirror: RunMirror):
    return mirror_query(mirror, sql.TRANSFER_FANOUT, ("transfer_expert_facts",))


def cache_layers(mirror: RunMirror):
    """Per layer: replica-cache hits, misses, hit rate, bytes saved (empty when no layer has a cache)."""
    return mirror_query(mirror, sql.CACHE_LAYERS, ("cache_facts", sc.T_STEPS))


def transfer_layers(mirror: RunMirror):
    df = mirror_query(mirror, sql.TRANSFER_LAYERS, ("transfer_plan_facts",))
    mirror.refresh(("transfer_time",))
    if mirror.facts("transfer_time_facts").num_rows:
        meas = mirror_query(mirror, sql.TRANSFER_LAYERS_MEASURED, ("transfer_facts", "transfer_time_facts", sc.T_STEPS))
        df = df.merge(meas, on="layer", how="left")
        df["measured"] = df["measured"].fillna(0).astype("int64")
    else:
        df["measured"], df["measured_s"], df["bandwidth_Bps"] = 0, np.nan, np.nan
    return df


def transfer_step_range(mirror: RunMirror) -> Bins | None:
    t = mirror.facts("transfer_plan_facts")
    if t.num_rows == 0:
        return None
    import pyarrow.compute as pc

    mm = pc.min_max(t.column(sc.C_STEP)).as_py()
    return step_bins(mm["min"], mm["max"])


# --------------------------------------------------------------------------- the measured answer
def measured_answer(run_dir, run_id: str, runs: dict | None = None):
    """:func:`ultraep.telemetry.answer.answer_at` of one run (measured step time p50, the speed-up over its
    recorded baseline, else a labelled estimate), read from the store: the baseline is looked up as
    ``ultraep report`` does — in the run's store, among ``runs`` (``{run_id: run directory}`` of the runs on
    show), else in its own run directory beside ``run_dir``."""
    from ultraep.telemetry import answer as A

    cur = store(run_dir)
    try:
        return A.answer_at(cur, run_dir, run_id, runs)
    finally:
        cur.close()


# --------------------------------------------------------------------------- compare
def compare_runs(mirrors: list[RunMirror], bins_max: int = MAX_BINS):
    """Per (run, policy) comparison rows and per (run, policy, step bin) mean imbalance after."""
    import pandas as pd

    rows, series = [], []
    for m in mirrors:
        m.refresh(sql.COMPARE_UNITS)
        df = mirror_query(m, sql.COMPARE, sql.SHOWN_FACTS + ("transfer_plan_facts", "timing_facts", sc.T_STEPS))
        if not len(df):
            continue
        df.insert(0, "run_id", m.run_id)
        df["pct_of_ideal"] = np.where(df["time_ideal"].notna(), 100.0 * df["time_ideal"],
                                      100.0 * df["load_ideal_after"])
        rows.append(df)
        bins, _ = layer_bins(m, bins_max)
        if bins is not None:
            s = mirror_query(m, sql.COMPARE_OVER_STEPS, sql.SHOWN_FACTS, first=bins.first_step, bin=bins.bin)
            s.insert(0, "run_id", m.run_id)
            series.append(s)
    cmp = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    over = pd.concat(series, ignore_index=True) if series else pd.DataFrame()
    return cmp, over
