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
        ui.plot(charts.decision_timeline(ui.shown_policies(data.decision_map(m, bins), ctx.run)),
                "policies_timeline")
        st.caption(f"{bins.bin} step(s) per column; each cell is the most frequent decision in its bin.")
        left, right = st.columns(2)
        with left:
            sw = data.decision_switches(m)
            ui.plot_or_say(charts.switches(sw), "policies_switches", sw["switches"],
                           "Every layer switched policy {value} times: the same count everywhere, so no chart. "
                           "A fixed policy never switches; the adaptive engine switches when another candidate "
                           "is predicted cheaper.")
        with right:
            st.markdown("**reasons**")
            ui.table(ui.shown_policies(data.decision_reasons(m), ctx.run), "policies_reasons")
        probes = data.exploration(m)
        if len(probes):  # an engine chose: what its probes took (issue 56)
            x = probes.iloc[0]
            cost = x["probe_cost_share"]
            st.caption(f"probes: {int(x['probe_calls'])} of {int(x['chosen_calls'])} chosen layer calls "
                       f"({ui.fmt_pct(100 * x['probe_share'])}), costing {ui.fmt_seconds(x['probe_cost_s'])} = "
                       f"{ui.fmt_pct(None if cost != cost or cost is None else 100 * cost)} of their measured time "
                       "against the policy in force's calls beside them (warm-up excluded)")
        layer = st.selectbox("latest decisions of layer", layers, key="policies_layer")
        ui.table(ui.shown_policies(data.recent_decisions(m, int(layer)), ctx.run), "policies_recent")

    st.subheader("Predicted vs measured")
    st.caption("summary table: warm-up excluded")
    summary = ui.shown_policies(data.prediction_summary(m), ctx.run)
    if not len(summary):
        st.info("No layer-microbatch has both a measured time and a prediction yet.")
        return
    ui.table(summary, "policies_prediction_summary", {
        "mean_predicted_s": "%.6f", "mean_measured_s": "%.6f", "mean_abs_rel_error": "%.3f",
        "measured_over_predicted": "%.3f"})
    over = ui.shown_policies(data.prediction_over_steps(m, bins), ctx.run)
    left, right = st.columns(2)
    with left:
        ui.plot(charts.predicted_vs_measured_lines(over), "policies_pvm")
    with right:
        ui.plot(charts.prediction_scatter(ui.shown_policies(data.prediction_sample(m), ctx.run)), "policies_scatter")
    ui.plot(charts.relative_error(over), "policies_error")
    terms = data.phase_errors_over_steps(m, bins)
    if len(terms):
        st.caption("prediction error per cost-model term: median |measured / predicted − 1| per step bin")
        ui.plot(charts.relative_error(terms, title="prediction error per term (median |error|)"), "policies_terms")


ui.live(body, key="policies")
