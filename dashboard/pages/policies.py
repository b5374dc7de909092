"""Policies: per-layer decision timeline with reasons; predicted vs measured time with the error."""

import streamlit as st

from ultraep.dashboard import charts, data, ui


def body(ctx: ui.Context) -> None:
    m = ctx.mirror
    bins, layers = ui.page_bins(ctx, "Policies")
    if bins is None:
        return
    m.refresh(("decision",))
    if m.facts("decision_facts").num_rows == 0:
        ui.empty_state(ctx, "decisions")
    else:
        ui.plot(charts.decision_timeline(data.decision_map(m, bins)), "policies_timeline")
        st.caption(f"{bins.bin} step(s) per column; each cell is the most frequent decision in its bin.")
        left, right = st.columns(2)
        with left:
            ui.plot(charts.switches(data.decision_switches(m)), "policies_switches")
        with right:
            st.markdown("**reasons**")
            st.dataframe(data.decision_reasons(m), hide_index=True, key="policies_reasons")
        layer = st.selectbox("latest decisions of layer", layers, key="policies_layer")
        st.dataframe(data.recent_decisions(m, int(layer)), hide_index=True, key="policies_recent")

    st.subheader("Predicted vs measured")
    st.caption("summary table: warm-up excluded")
    summary = data.prediction_summary(m)
    if not len(summary):
        st.info("No layer-microbatch has both a measured time and a prediction yet.")
        return
    st.dataframe(summary, hide_index=True, key="policies_prediction_summary", column_config={
        "mean_predicted_s": st.column_config.NumberColumn(format="%.6f"),
        "mean_measured_s": st.column_config.NumberColumn(format="%.6f"),
        "mean_abs_rel_error": st.column_config.NumberColumn(format="%.3f"),
        "measured_over_predicted": st.column_config.NumberColumn(format="%.3f")})
    over = data.prediction_over_steps(m, bins)
    left, right = st.columns(2)
    with left:
        ui.plot(charts.predicted_vs_measured_lines(over), "policies_pvm")
    with right:
        ui.plot(charts.prediction_scatter(data.prediction_sample(m)), "policies_scatter")
    ui.plot(charts.relative_error(over), "policies_error")
    terms = data.phase_errors_over_steps(m, bins)
    if len(terms):
        st.caption("prediction error per cost-model term: median |measured / predicted − 1| per step bin")
        ui.plot(charts.relative_error(terms, title="prediction error per term (median |error|)"), "policies_terms")


ui.live(body, key="policies")
