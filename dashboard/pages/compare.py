"""Compare: policies side by side, within a run (adaptive, a simulation) or across runs of one workload."""

import streamlit as st

from ultraep.dashboard import charts, data, ui


def body(ctx: ui.Context) -> None:
    ui.header(ctx, "Compare")
    run = ctx.run
    same = [i.run_id for i in ctx.runs if i.workload() == run.workload()]
    ids = [i.run_id for i in ctx.runs]
    by_id = {i.run_id: i for i in ctx.runs}
    stale = st.session_state.get("compare_for") != run.run_id
    if stale or "compare_runs" not in st.session_state or not set(st.session_state["compare_runs"]) <= set(ids):
        st.session_state["compare_runs"] = same or [run.run_id]
        st.session_state["compare_for"] = run.run_id
    chosen = st.multiselect("runs", ids, key="compare_runs", format_func=lambda r: by_id[r].label,
                            help="default: the runs of the selected run's workload (a simulation's runs of one "
                                 "trace, or runs of the same kind, model and EP size)")
    if not chosen:
        st.info("Pick at least one run.")
        return
    cmp, over = data.compare_runs([ui.pool().get(by_id[r].path) for r in chosen])
    if not len(cmp):
        ui.empty_state(ctx, "layer rows in the chosen runs")
        return
    st.caption("means, times and shares of the ideal: warm-up excluded; plans and shares: every step")
    st.dataframe(cmp.drop(columns=["load_ideal_after", "time_ideal"]), hide_index=True, key="compare_table",
                 column_config={c: st.column_config.NumberColumn(format="%.4g") for c in cmp.columns
                                if c not in ("run_id", "policy", "plans")})
    c = st.columns(2)
    with c[0]:
        ui.plot(charts.compare_bars(cmp, "mean_imbalance_after", "imbalance after (max / mean)",
                                    title="imbalance after balancing"), "compare_imbalance")
    with c[1]:
        ui.plot(charts.compare_bars(cmp, "pct_of_ideal", "% of force-balanced ideal",
                                    title="share of the force-balanced ideal"), "compare_ideal")
    c = st.columns(2)
    with c[0]:
        ui.plot(charts.compare_bars(cmp, "mean_time_s", "ms per layer-microbatch", scale=1e3,
                                    title="layer time (measured, else predicted)"), "compare_time")
    with c[1]:
        ui.plot(charts.compare_bars(cmp, "mean_transfer_bytes", "MiB per layer-microbatch",
                                    scale=1.0 / charts.MIB, title="bytes moved"), "compare_bytes")
    if len(over):
        ui.plot(charts.compare_lines(over), "compare_lines")


ui.live(body, key="compare")
