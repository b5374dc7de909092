"""Compare: runs of one workload side by side, measured step time and speed-up first; then per policy
(within a run: "quota via adaptive"), the measured layer time, with plan quality labelled as such."""

import pandas as pd
import streamlit as st

from ultraep.dashboard import charts, data, ui
from ultraep.telemetry.units import short_labels


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
    st.markdown("**Did balancing pay?** (measured step time; speed-up over each run's baseline)")
    answers = [(by_id[r], ui.cached_answer(by_id[r], ctx.runs)) for r in chosen]
    labels, prefix = short_labels(sorted(chosen))
    if prefix:
        st.caption(f"runs {prefix}<run>")
    st.dataframe(pd.DataFrame([{
        "run": labels[info.run_id], "policy": a.policy, "step time p50 (ms, measured)": (
            None if a.steps.p50_s is None else 1e3 * a.steps.p50_s),
        "speed-up": ui.speedup_text(a), "against": labels.get(a.baseline_id, a.baseline_id) if a.basis == "measured" else {
            "estimate": f"estimate ({a.estimate_source})", "baseline": "(is the baseline)"}.get(a.basis, "—"),
        "timed steps": a.steps.timed_steps} for info, a in answers]), hide_index=True, key="compare_answer",
        column_config={"step time p50 (ms, measured)": st.column_config.NumberColumn(format="%.1f")})
    cmp, over = data.compare_runs([ui.pool().get(by_id[r].path) for r in chosen])
    if not len(cmp):
        ui.empty_state(ctx, "layer rows in the chosen runs")
        return
    st.markdown("**Per policy** (within a run, the candidate an adaptive layer chose: 'quota via adaptive')")
    st.caption("layer time: measured (slowest rank), mean per layer-microbatch; imbalance and % of ideal are plan "
               "quality, not measured times. Warm-up excluded from means; plans and shares count every step.")
    shown = cmp.assign(measured_ms=1e3 * cmp["mean_measured_s"], predicted_ms=1e3 * cmp["mean_predicted_s"],
                       mib=cmp["mean_transfer_bytes"] / charts.MIB, run_id=[labels[r] for r in cmp["run_id"]])
    shown = shown[["run_id", "policy", "plans", "share", "measured_ms", "predicted_ms", "mean_imbalance_before",
                   "mean_imbalance_after", "pct_of_ideal", "mib"]].rename(columns={
        "run_id": "run", "share": "share of layer calls", "measured_ms": "layer time ms (measured)",
        "predicted_ms": "layer time ms (predicted)", "mean_imbalance_before": "imbalance before",
        "mean_imbalance_after": "imbalance after (plan)", "pct_of_ideal": "plan quality: % of ideal",
        "mib": "MiB moved per layer call"})
    st.dataframe(shown, hide_index=True, key="compare_table", column_config={
        "share of layer calls": st.column_config.NumberColumn(format="%.2f"),
        "layer time ms (measured)": st.column_config.NumberColumn(format="%.1f"),
        "layer time ms (predicted)": st.column_config.NumberColumn(format="%.1f"),
        "imbalance before": st.column_config.NumberColumn(format="%.3f"),
        "imbalance after (plan)": st.column_config.NumberColumn(format="%.3f"),
        "plan quality: % of ideal": st.column_config.NumberColumn(format="%.1f%%"),
        "MiB moved per layer call": st.column_config.NumberColumn(format="%.2f")})
    measured = bool(cmp["mean_measured_s"].notna().any())
    c = st.columns(2)
    with c[0]:
        ui.plot(charts.compare_bars(cmp, "mean_measured_s" if measured else "mean_time_s",
                                    "ms per layer call", scale=1e3,
                                    title="layer time (measured)" if measured else "layer time (predicted: none measured)"),
                "compare_time")
    with c[1]:
        ui.plot(charts.compare_bars(cmp, "mean_imbalance_after", "max / mean rank load",
                                    title="imbalance after (plan quality)"), "compare_imbalance")
    c = st.columns(2)
    with c[0]:
        ui.plot(charts.compare_bars(cmp, "mean_transfer_bytes", "MiB per layer call",
                                    scale=1.0 / charts.MIB, title="bytes moved"), "compare_bytes")
    with c[1]:
        ui.plot(charts.compare_bars(cmp, "pct_of_ideal", "% of ideal",
                                    title="plan quality: % of ideal"), "compare_ideal")
    if len(over):
        ui.plot(charts.compare_lines(over), "compare_lines")


ui.live(body, key="compare")
