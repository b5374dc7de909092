"""Experts: per-expert load over time, replica counts, the hottest experts and how they drift."""

import streamlit as st

from ultraep.dashboard import charts, data, ui


def body(ctx: ui.Context) -> None:
    m = ctx.mirror
    bins, layers = ui.page_bins(ctx, "Experts")
    if bins is None:
        return
    c = st.columns(2)
    layer = c[0].selectbox("layer", layers, key="experts_layer")
    top = c[1].slider("hottest experts shown", 1, 20, 5, key="experts_top")
    load = data.expert_load(m, int(layer), bins)
    if not len(load):
        ui.empty_state(ctx, f"rows for layer {layer}")
        return
    ui.plot(charts.expert_heatmap(load, "load_tokens", colorbar="tokens per step",
                                  title=f"load per logical expert, layer {layer}"), "experts_load")
    st.caption(f"{bins.bin} step(s) per column; load = token-expert assignments per step, summed over source ranks "
               "and microbatches.")
    hot = data.hottest_experts(load, top=max(top, 10))
    left, right = st.columns([3, 2])
    with left:
        ui.plot(charts.expert_lines(load, [int(e) for e in hot["expert"].head(top)]), "experts_lines")
    with right:
        st.markdown("**hottest experts** (share of the layer's load; drift = last quarter − first quarter)")
        ui.table(hot, "experts_hot", {"load_tokens": "%.0f", **{
            c: "%.3f" for c in ("share", "share_first_quarter", "share_last_quarter", "drift")}})
    turn = data.hot_set_turnover(load, k=min(4, top))
    ui.plot_or_say(charts.turnover(turn), "experts_turnover", turn["turnover"],
                   "The hot set's turnover is {value} in every step bin (0: the same hot experts throughout; "
                   "1: all new every bin), so no chart.")
    reps = data.replica_counts(m, int(layer), bins)
    if len(reps) and reps["replicas"].max() > 0:
        ui.plot(charts.expert_heatmap(reps, "replicas", colorbar="replicas", colorscale="Blues",
                                      title=f"replicas per logical expert (mean in bin), layer {layer}"),
                "experts_replicas")
    else:
        st.info("No replicas in this layer (no plan used a redundant slot).")


ui.live(body, key="experts")
