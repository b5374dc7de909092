"""Layers: imbalance heatmaps (layer × step) before and after; per-rank load stacked by expert; the expert
activation memory each rank holds (the busiest rank's peak against the mean) before and after."""

import streamlit as st

from ultraep.dashboard import charts, data, ui


def body(ctx: ui.Context) -> None:
    m = ctx.mirror
    bins, layers = ui.page_bins(ctx, "Layers")
    if bins is None:
        return
    df = data.layer_step_imbalance(m, bins)
    zmax = float(max(df["imbalance_before"].max(), df["imbalance_after"].max()))
    ui.before_after(lambda which: charts.imbalance_heatmap(df, which, zmax=zmax), "layers_heat")
    st.caption(f"{bins.bin} step(s) per column (steps {bins.first_step}–{bins.last_step}); each cell is the mean "
               "over its layer-microbatches; both maps share one colour scale.")
    st.subheader("Per layer")
    st.caption("means and maxima: warm-up excluded; plans: every step")
    ui.table(data.layer_summary(m), "layers_summary")

    _activation_memory(ctx)

    st.subheader("Rank load by expert")
    c = st.columns(3)
    layer = c[0].selectbox("layer", layers, key="layers_layer")
    step = c[1].number_input("step", min_value=bins.first_step, max_value=bins.last_step,
                             value=bins.last_step, step=1, key="layers_step")
    options = ["all (summed)"] + data.microbatches(m, int(layer), int(step))
    mb = c[2].selectbox("microbatch", options, key="layers_microbatch")
    mb = None if mb == "all (summed)" else int(mb)
    per = data.rank_load_by_expert(ctx.run.path, ctx.run.run_id, int(layer), int(step), mb)
    if not len(per):
        st.info(f"No plan recorded for layer {layer} at step {step}.")
        return
    totals = per.groupby("rank")[["load_before", "load_after"]].sum().reset_index()
    ymax = float(max(totals["load_before"].max(), totals["load_after"].max()))
    ui.before_after(lambda which: charts.rank_load_stacked(per, which, ymax=ymax), "layers_rank")
    ui.table(totals, "layers_rank_totals")


def _activation_memory(ctx: ui.Context) -> None:
    """The third cost of imbalance: the expert activations a rank must hold for a call (issue 35, item 5)."""
    st.subheader("Expert activation memory")
    per_layer = data.activation_memory(ctx.run.path, ctx.run.run_id)
    if not len(per_layer):
        st.info("This run recorded no expert activation memory (the runtime records it on every rank; "
                "`ultraep simulate` prints it per policy).")
        return
    st.caption("What a rank holds of expert activations for one call (rows it computes × the expert's activation "
               "width × dtype), warm-up excluded: the busiest rank's peak over the calls against the mean rank, "
               "without balancing (before) and with the plan (after).")
    ui.table(per_layer.drop(columns=["run_id"]), "layers_activation", {
        c: "%.1f" for c in ("peak_busiest_before_MB", "peak_busiest_after_MB", "mean_rank_MB")} | {
        c: "%.2f" for c in ("peak_over_mean_before", "peak_over_mean_after")})
    recorded = [int(x) for x in per_layer["layer"]]
    layer = st.selectbox("layer", recorded, key="layers_activation_layer")
    ranks = data.activation_memory_by_rank(ctx.run.path, ctx.run.run_id, int(layer))
    ui.plot(charts.activation_by_rank(ranks, int(layer)), "layers_activation_ranks")


ui.live(body, key="layers")
