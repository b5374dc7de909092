"""Transfers: replica-cache hits and bytes saved, bytes per step, fan-out per expert, relay use, busiest sender."""

import streamlit as st

from ultraep.dashboard import charts, data, ui


def body(ctx: ui.Context) -> None:
    ui.header(ctx, "Transfers")
    m = ctx.mirror
    cache = data.cache_layers(m)
    if len(cache):
        hits, misses = int(cache["hits"].sum()), int(cache["misses"].sum())
        c = st.columns(3)
        c[0].metric("replica cache hit rate", ui.fmt_pct(100 * hits / max(1, hits + misses)),
                    help=f"{ui.fmt_int(hits)} replicas found resident (no transfer), {ui.fmt_int(misses)} streamed; "
                    "warm-up excluded")
        c[1].metric("weight bytes saved", ui.fmt_bytes(cache["bytes_saved"].sum()),
                    help="weight bytes the resident replicas did not receive again (all ranks)")
        c[2].metric("calls with a cache", ui.fmt_int(cache["calls"].sum()))
        ui.table(cache, "transfers_cache")
    tot = data.transfer_totals(m)
    if int(tot["transfers"]) == 0:
        ui.empty_state(ctx, "transfers (no plan moved expert state so far)")
        return
    senders = data.transfer_senders(m)
    busiest = senders.sort_values(["bytes", "rank"], ascending=[False, True]).iloc[0]
    c = st.columns(5)
    c[0].metric("transfers", ui.fmt_int(tot["transfers"]))
    c[1].metric("expert state moved", ui.fmt_bytes(tot["bytes"]))
    relay_share = float(tot["relay_bytes"]) / float(tot["bytes"]) if tot["bytes"] else 0.0
    c[2].metric("relay share", ui.fmt_pct(100 * relay_share), help=f"{ui.fmt_int(tot['relay_transfers'])} relay "
                "forwards (stage 1) of all transfers, by bytes")
    c[3].metric("max fan-out", ui.fmt_int(tot["max_fan_out"]),
                help="most copies of one expert one rank sent in one layer-microbatch")
    c[4].metric("busiest sender", f"rank {int(busiest['rank'])}",
                help=f"sent {ui.fmt_bytes(busiest['bytes'])} over the run, the most of any rank")
    bins, _ = data.layer_bins(m)
    over = data.transfers_over_steps(m, bins)
    ui.plot(charts.transfer_bytes(over), "transfers_bytes")
    st.caption(f"{bins.bin} step(s) per bar.")
    left, right = st.columns(2)
    with left:
        ui.plot_or_say(charts.busiest_sender_over_steps(over), "transfers_busiest",
                       over["busiest_sender_bytes"] / charts.MIB,
                       "The busiest sender sent the same {value} MiB in every step bin: no chart for a flat line.")
    with right:
        ui.plot(charts.senders(senders), "transfers_senders")
    fan = data.transfer_fanout(m)
    ui.plot(charts.fanout(fan), "transfers_fanout")
    left, right = st.columns(2)
    with left:
        st.markdown("**per expert**")
        ui.table(fan, "transfers_fanout_table")
    with right:
        st.markdown("**per layer** (bandwidth from measured transfer times, where recorded; warm-up excluded)")
        ui.table(data.transfer_layers(m), "transfers_layers")


ui.live(body, key="transfers")
