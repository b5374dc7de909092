"""Streamlit glue shared by the pages: where the runs are, the run picker, live refresh, formatting.

The app (``app.py``) calls :func:`setup` once per script run; pages call :func:`context` to get the
selected run and :func:`live` to render their body inside a fragment that re-runs itself every few
seconds while the run is being written. Nothing here does I/O at import time.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from ultraep.dashboard import data
from ultraep.dashboard.cache import MirrorPool, warm_up
from ultraep.dashboard.mirror import RunMirror
from ultraep.dashboard.runs import RunInfo, find_runs, run_info, run_info_at, run_signature

ROOT_KEY = "ultraep_root"          # session-state override of the runs directory (tests)
REFRESH_KEY = "ultraep_refresh_s"
RUN_KEY = "ultraep_run"
CTX_KEY = "_ultraep_ctx"
DEFAULT_ROOT = "runs"
DEFAULT_REFRESH_S = 2.0
REFRESH_CHOICES = (1.0, 2.0, 5.0, 10.0, 30.0)


# --------------------------------------------------------------------------- shared state
@st.cache_resource(show_spinner=False)
def pool() -> MirrorPool:
    """One mirror pool per server process, shared by every browser session."""
    return MirrorPool(capacity=8)


@st.cache_resource(show_spinner=False)
def headline_cache() -> dict:
    return {}


def script_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``streamlit run app.py -- --root DIR --refresh S`` (what ``ultraep dashboard`` passes)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--root", default=None)
    p.add_argument("--refresh", type=float, default=None)
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args


def root() -> Path:
    if ROOT_KEY in st.session_state:
        return Path(st.session_state[ROOT_KEY]).expanduser()
    args = script_args()
    return Path(args.root or DEFAULT_ROOT).expanduser()


@dataclass
class Context:
    root: Path
    runs: list[RunInfo]
    run: RunInfo | None
    mirror: Any
    refresh_s: float | None


# --------------------------------------------------------------------------- set-up (app.py)
# (file, title, url path) of every page, in menu order; app.py registers the same list
NAV = (
    ("pages/overview.py", "Overview", "overview"),
    ("pages/layers.py", "Layers", "layers"),
    ("pages/experts.py", "Experts", "experts"),
    ("pages/policies.py", "Policies", "policies"),
    ("pages/transfers.py", "Transfers", "transfers"),
    ("pages/compare.py", "Compare", "compare"),
    ("pages/sql.py", "SQL", "sql"),
)


def setup() -> Context:
    """Page layout, the sidebar menu, the runs directory, the run picker (live runs marked ●), the
    refresh period."""
    st.set_page_config(page_title="ultraep dashboard", layout="wide")
    for path, title, _ in NAV:
        st.sidebar.page_link(path, label=title)
    st.sidebar.divider()
    r = root()
    p = pool()
    runs = [run_info_at(d) for d in find_runs(r)]
    runs.sort(key=lambda i: (i.started_at is None, str(i.started_at or ""), i.run_id), reverse=True)
    st.sidebar.markdown("**ultraep** · expert-parallel balancing")
    st.sidebar.caption(f"runs directory: `{r}`")
    run = None
    if runs:
        ids = [i.run_id for i in runs]
        by_id = {i.run_id: i for i in runs}
        wanted = st.query_params.get("run")
        if RUN_KEY in st.session_state and st.session_state[RUN_KEY] not in ids:
            del st.session_state[RUN_KEY]
        if RUN_KEY not in st.session_state:
            live = [i.run_id for i in runs if i.live]
            st.session_state[RUN_KEY] = wanted if wanted in ids else (live[0] if live else ids[0])
        chosen = st.sidebar.selectbox("run", ids, key=RUN_KEY, format_func=lambda rid: by_id[rid].label,
                                      help="● live (being written) · ◐ stalled (no new rows for a while)")
        run = by_id[chosen]
        if st.query_params.get("run") != chosen:
            st.query_params["run"] = chosen
    default = script_args().refresh or DEFAULT_REFRESH_S
    choices = sorted(set(REFRESH_CHOICES) | {default})
    if REFRESH_KEY not in st.session_state:
        st.session_state[REFRESH_KEY] = default
    refresh = st.sidebar.select_slider("refresh every (s) while live", options=choices, key=REFRESH_KEY)
    ctx = Context(root=r, runs=runs, run=run, mirror=p.get(run.path) if run else None, refresh_s=float(refresh))
    st.session_state[CTX_KEY] = ctx
    return ctx


def context() -> Context:
    """The set-up of this script run (made by ``app.py`` before it runs the page)."""
    if leave_pages_directory_mode():  # the page file runs without app.py: set up here, in this run
        return setup()
    ctx = st.session_state.get(CTX_KEY)
    if ctx is None:  # pragma: no cover - defensive
        ctx = setup()
    return ctx


def leave_pages_directory_mode() -> bool:
    """Streamlit runs a fresh server's first script run (and every AppTest run) in its old 'pages/
    directory' mode, where a deep link (``/layers``) runs the page file alone, without ``app.py``, until
    some script calls ``st.navigation``. Switch that mode off for the next runs; returns whether this run
    is in it (then the page sets itself up; the built-in navigation is hidden and the sidebar links are
    ours, so both modes look the same)."""
    try:
        from streamlit.runtime.pages_manager import PagesManager
    except ImportError:  # pragma: no cover - Streamlit moved it
        return False
    if PagesManager.uses_pages_directory:
        PagesManager.uses_pages_directory = False
        return True
    return False


def current_run_info(ctx: Context) -> RunInfo | None:
    """The selected run's status now (it may have closed since the full run of the script)."""
    if ctx.run is None:
        return None
    return run_info(ctx.mirror)


# --------------------------------------------------------------------------- live pages
def live(body: Callable[[Context], None], *, key: str, refresh: bool = True) -> None:
    """Render ``body(ctx)`` in a fragment that re-runs every ``refresh_s`` seconds while the selected run
    is live (the Overview: while any run is; with no runs yet: until one appears).

    When a live run closes (or the first run appears), one full re-run stops (or starts) the refreshing.
    """
    ctx = context()
    if ctx.run is None:
        every = ctx.refresh_s
    elif key == "overview":
        every = ctx.refresh_s if any(i.live for i in ctx.runs) else None
    else:
        every = ctx.refresh_s if ctx.run.live else None
    if not refresh:
        every = None
    was_live = ctx.run is not None and ctx.run.live

    def frag() -> None:
        if ctx.run is None:
            if find_runs(ctx.root):
                st.rerun(scope="app")
            no_runs(ctx)
            return
        now = current_run_info(ctx)
        if was_live and now is not None and not now.live:
            st.rerun(scope="app")
        body(Context(ctx.root, ctx.runs, now, ctx.mirror, ctx.refresh_s))
        st.caption(f"updated {time.strftime('%H:%M:%S')}" + (f" · refreshing every {every:g} s" if every else ""))
        warm_up(ctx.mirror)  # after the page is drawn: read the rest of the run for the next pages

    st.fragment(frag, run_every=every)()


def cached_headline(info: RunInfo, selected=None) -> dict:
    """:func:`data.headline` of a run, recomputed only when a part was added since the last time."""
    sig = run_signature(info.path)
    cache = headline_cache()
    hit = cache.get(info.path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    # live runs (and the one on screen) keep a mirror, read incrementally; a finished run is read once
    # by a throwaway mirror, so listing many runs never evicts the mirrors in use
    keep = info.live or (selected is not None and Path(selected).resolve() == Path(info.path).resolve())
    h = data.headline(pool().get(info.path) if keep else RunMirror(info.path))
    cache[info.path] = (sig, h)
    return h


def cached_answer(info: RunInfo, runs: list[RunInfo]):
    """:func:`data.measured_answer` of a run, recomputed only when it or the baseline it was measured against got
    a new part, or the set of runs on show changed (a baseline may have appeared)."""
    by_id = {i.run_id: i.path for i in runs}
    cache = headline_cache()
    key = ("answer", info.path)

    def sig(base_id):
        base = by_id.get(base_id)
        return (run_signature(info.path), tuple(sorted(by_id)), run_signature(base) if base is not None else None)

    hit = cache.get(key)
    if hit is not None and hit[0] == sig(hit[1].baseline_id):
        return hit[1]
    a = data.measured_answer(info.path, info.run_id, by_id)
    cache[key] = (sig(a.baseline_id), a)
    return a


def answer_basis(a) -> str:
    """What the answer's figures are, for a heading: "measured" only where the speed-up was measured against a
    baseline run (or the run is the baseline); an estimate or a simulation says so."""
    if a.simulated:
        return "(simulated: the cost model over a replayed trace, not measured)"
    return {"measured": "(measured)", "baseline": "(measured; this run is the baseline)",
            "estimate": "(step time measured; speed-up ESTIMATED: no baseline run found)",
            "untimed": "(no step was timed)"}.get(a.basis, "(step time measured; no baseline run found)")


def speedup_text(a) -> str:
    """The speed-up as a metric value: measured, or marked as an estimate."""
    if a.speedup is None:
        return "baseline" if a.basis == "baseline" else "—"
    return (f"{a.speedup:.2f}x" + (" (estimate)" if a.basis == "estimate" else "")
            + (" (simulated)" if a.simulated else ""))


def no_runs(ctx: Context) -> None:
    st.info(f"No recorded runs under `{ctx.root}` yet. Start a run with telemetry on "
            "(`Recorder.open(\"{root}\", ...)`) or point the dashboard at a runs directory: "
            "`ultraep dashboard RUNS_DIR`. This page refreshes by itself.".replace("{root}", str(ctx.root)))


def empty_state(ctx: Context, what: str) -> None:
    st.info(f"Run `{ctx.run.run_id if ctx.run else '?'}` has no {what} yet"
            + (" — it is being written; this page refreshes by itself." if ctx.run and ctx.run.live else "."))


def header(ctx: Context, title: str) -> None:
    st.title(title)
    r = ctx.run
    if r is None:
        return
    status = {"live": "● live", "stalled": "◐ stalled (no new rows lately)", "closed": "closed",
              "empty": "no rows yet"}[r.status]
    bits = [f"run **{r.run_id}**", status]
    if r.kind:
        bits.append(r.kind)
    if r.model:
        bits.append(r.model)
    if r.world_size:
        bits.append(f"EP {r.world_size}")
    st.caption(" · ".join(bits))
    if r.errors:
        st.warning(f"{r.errors} recording error(s), {r.dropped_rows} row(s) lost; first: {r.first_error}")
    if ctx.mirror is not None and ctx.mirror.read_errors:
        st.warning(f"{len(ctx.mirror.read_errors)} part(s) could not be read; first: {ctx.mirror.read_errors[0]}")


# --------------------------------------------------------------------------- formatting
def fmt_ratio(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.3f}"


def fmt_pct(v, digits: int = 1) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.{digits}f}%"


def fmt_seconds(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    v = float(v)
    if abs(v) >= 1:
        return f"{v:.2f} s"
    if abs(v) >= 1e-3:
        return f"{v * 1e3:.2f} ms"
    return f"{v * 1e6:.1f} µs"


def fmt_bytes(v) -> str:
    from ultraep.telemetry.units import fmt_bytes as fmt

    return fmt(v, digits=2)


def fmt_int(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{int(v):,}"


def plot(fig, key: str) -> None:
    st.plotly_chart(fig, key=key, config={"displaylogo": False})


def configured_policy(run: RunInfo | None) -> str | None:
    """The policy the run was configured with (its config's ``policy``), or ``None``."""
    import json

    try:
        cfg = json.loads(run.config_json) if run is not None and run.config_json else None
    except ValueError:
        return None
    pol = cfg.get("policy") if isinstance(cfg, dict) else None
    return pol if isinstance(pol, str) else None


def shown_policies(df, run: RunInfo | None, column: str = "policy"):
    """``df`` with the decisions' policies named as everywhere else: a candidate the run's configured policy
    chose (adaptive) is "quota via adaptive" (the rule of ``queries.SHOWN_POLICY``), so it keeps one colour on
    every page."""
    conf = configured_policy(run)
    if conf is None or df is None or column not in getattr(df, "columns", ()):
        return df
    df = df.copy()
    df[column] = [p if p is None or str(p) == conf else f"{p} via {conf}" for p in df[column]]
    return df


def plot_or_say(fig, key: str, values, sentence: str) -> None:
    """The chart, or — when ``values`` (what it would draw) is empty or constant — one sentence saying why
    (``sentence`` may name the constant as ``{value}``): a flat line on a made-up axis tells nothing."""
    import numpy as np

    v = np.asarray(values, dtype=float) if values is not None else np.zeros(0)
    v = v[np.isfinite(v)]
    if v.size == 0 or float(v.min()) == float(v.max()):
        st.info(sentence.format(value=(f"{float(v[0]):g}" if v.size else "nothing")))
        return
    plot(fig, key)


_UNITS = (("_bps", " (B/s)"), ("_s", " (s)"), ("_bytes", " (bytes)"), ("_tokens", " (tokens)"))


def human(col: str) -> str:
    """A column name as words: ``mean_predicted_s`` -> ``mean predicted (s)``, ``bytes_saved`` -> ``bytes saved``."""
    c = str(col)
    for suffix, unit in _UNITS:
        if c.lower().endswith(suffix) and len(c) > len(suffix):
            return c[: -len(suffix)].replace("_", " ") + unit
    return c.replace("_", " ")


def table(df, key: str, formats: dict[str, str] | None = None) -> None:
    """``st.dataframe`` with headers in words (:func:`human`), floats rounded (``formats`` by original column
    name, default 3 significant digits); wider than the page, it scrolls."""
    import pandas as pd

    formats = formats or {}
    config = {}
    for c in df.columns:
        if c in formats:
            config[human(c)] = st.column_config.NumberColumn(format=formats[c])
        elif pd.api.types.is_float_dtype(df[c]):
            config[human(c)] = st.column_config.NumberColumn(format="%.3g")
    st.dataframe(df.rename(columns={c: human(c) for c in df.columns}), hide_index=True, key=key,
                 column_config=config)


def before_after(make: Callable[[str], Any], key: str) -> None:
    """Two charts side by side: ``make("before")`` and ``make("after")``."""
    for col, which in zip(st.columns(2), ("before", "after")):
        with col:
            plot(make(which), f"{key}_{which}")


def page_bins(ctx: Context, title: str):
    """The page header, then the run's step bins and layers; ``(None, [])`` (with the empty-state
    message shown) while the run has no layer rows."""
    header(ctx, title)
    bins, layers = data.layer_bins(ctx.mirror)
    if bins is None:
        empty_state(ctx, "layer rows")
    return bins, layers
