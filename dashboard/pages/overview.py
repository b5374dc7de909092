"""Overview: every run (live ones marked) with its measured step time and speed-up first, then the selected run:
the measured answer (did balancing pay), then plan quality and overhead, labelled as such."""

import pandas as pd
import streamlit as st

from ultraep.dashboard import charts, data, ui
from ultraep.dashboard.runs import run_info_at
from ultraep.telemetry import answer as A
from ultraep.telemetry.units import fmt_s


def body(ctx: ui.Context) -> None:
    ui.header(ctx, "Overview")
    st.subheader("Runs")
    rows = []
    for info in ctx.runs:
        info = run_info_at(info.path)
        h = ui.cached_headline(info, selected=ctx.run.path)
        a = ui.cached_answer(info, ctx.runs)
        rows.append({
            "run": info.label, "step time p50 (measured)": a.steps.p50_s,
            "speed-up": ui.speedup_text(a), "status": info.status, "kind": info.kind, "model": info.model,
            "EP ranks": info.world_size, "steps": h["steps"], "warm-up steps": h["warmup_steps"],
            "layers": h["layers"],
            "layer-microbatches": h["plans"],
            "mean imbalance before": h["mean_imbalance_before"], "mean imbalance after": h["mean_imbalance_after"],
            "plan quality: % of ideal": h["pct_of_ideal"],
            "planning (s)": h["plan_s"], "transfers (s)": h["transfer_s"],
            "recording errors": info.errors, "started (UTC)": info.started_at,
        })
    st.caption("Step time: the slowest rank's, median over the steps not marked warm-up; speed-up: over the "
               "baseline run of the same stream (measured), or an estimate where none was recorded. Means, times "
               "and shares leave warm-up steps out; counts keep them.")
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="overview_runs", column_config={
        "step time p50 (measured)": st.column_config.NumberColumn(format="%.3f s"),
        "mean imbalance before": st.column_config.NumberColumn(format="%.3f"),
        "mean imbalance after": st.column_config.NumberColumn(format="%.3f"),
        "plan quality: % of ideal": st.column_config.NumberColumn(
            format="%.1f%%", help="plan quality, not a measured time: the plans' share of the force-balanced ideal"),
        "planning (s)": st.column_config.NumberColumn(format="%.4f"),
        "transfers (s)": st.column_config.NumberColumn(format="%.4f"),
    })

    m, run = ctx.mirror, ctx.run
    h = data.headline(m)
    st.subheader(f"Run {run.run_id}")
    if h["plans"] == 0:
        ui.empty_state(ctx, "layer rows")
        st.metric("layer-microbatch rows", ui.fmt_int(0))
        return
    a = ui.cached_answer(run, ctx.runs)
    st.markdown("**Did balancing pay?** " + ui.answer_basis(a))
    c = st.columns(3)
    c[0].metric("step time p50 (measured)", fmt_s(a.steps.p50_s),
                help=f"slowest rank per step, median over {a.steps.timed_steps} steps not marked warm-up")
    base = {"measured": f"measured against run {a.baseline_id} ({ui.fmt_seconds(a.baseline_p50_s)})",
            "estimate": f"ESTIMATE ({a.estimate_source}): no baseline run was recorded",
            "baseline": "this run is unbalanced: it is the baseline"}.get(a.basis, "nothing to compare with")
    c[1].metric("speed-up over none" + (" (estimate)" if a.basis == "estimate" else ""), ui.speedup_text(a),
                help=base)
    c[2].metric("warm-up (one-time)", fmt_s(a.steps.warmup_time_s),
                help=f"{a.steps.warmup_steps} warm-up step(s) (compiles, first plans), left out of the p50")
    st.caption(A.headline(a))
    st.markdown("**Plan quality and overhead** (from the plans and timings, warm-up excluded)")
    c = st.columns(3) + st.columns(3)
    c[0].metric("layer-microbatch rows", ui.fmt_int(h["plans"]),
                help="recorded plans, one per layer and microbatch (lowest recording rank)")
    c[1].metric("imbalance before → after",
                f"{ui.fmt_ratio(h['mean_imbalance_before'])} → {ui.fmt_ratio(h['mean_imbalance_after'])}",
                help="max / mean rank load, averaged over layer-microbatches (warm-up excluded); 1.000 = perfect")
    basis = {"time": "Σ ideal time / Σ time (recorded ideal_s)",
             "load": "Σ mean rank load / Σ max rank load after balancing (no ideal_s recorded; overhead not "
                     "counted)"}.get(h["ideal_basis"], "")
    c[2].metric("plan quality: % of ideal", ui.fmt_pct(h["pct_of_ideal"]),
                help="plan quality, not a measured time: " + basis)
    plan_help = ("summed planning time, warm-up excluded" + (" (planner solve time; no timings recorded)"
                                           if h["plan_basis"] == "solve_time" else " (timings.plan_s)"))
    c[3].metric("planning overhead", ui.fmt_seconds(h["plan_s"]), help=plan_help)
    c[4].metric("transfer overhead", ui.fmt_seconds(h["transfer_s"]),
                help=f"summed timings.transfer_s, warm-up excluded; {ui.fmt_int(h['transfers'])} transfers")
    c[5].metric("recording errors", ui.fmt_int(run.errors),
                help=f"{run.dropped_rows} rows lost" + (f"; first: {run.first_error}" if run.first_error else ""))

    if h["plan_share"] is not None or h["transfer_share"] is not None:
        st.caption(f"planning {ui.fmt_pct(None if h['plan_share'] is None else 100 * h['plan_share'])} and "
                   f"transfers {ui.fmt_pct(None if h['transfer_share'] is None else 100 * h['transfer_share'])} "
                   f"of the summed layer time ({ui.fmt_seconds(h['time_s'])})"
                   + (f" (warm-up excluded: {ui.fmt_int(h['warmup_steps'])} step"
                      f"{'s' if h['warmup_steps'] != 1 else ''})." if h["warmup_steps"] else "."))
    bins, _ = data.layer_bins(m)
    left, right = st.columns([3, 2])
    with left:
        warm = data.warmup_steps(m)
        ui.plot(charts.imbalance_over_steps(data.imbalance_over_steps(m, bins), warmup=warm, bin=bins.bin,
                                            title="imbalance over steps (mean over layers)"), "overview_imbalance")
        if warm:
            st.caption(f"grey: the warm-up step{'s' if len(warm) != 1 else ''} ({warm[0]}"
                       f"{'–' + str(warm[-1]) if len(warm) > 1 else ''}), left out of every figure above")
    with right:
        st.markdown("**policy shares** (of layer-microbatches)")
        ui.plot(charts.policy_shares(data.policy_shares(m)), "overview_shares")


ui.live(body, key="overview")
