"""Plotly figures for the dashboard: one function per chart, DataFrames in, figures out (no Streamlit).

Conventions: before balancing is always :data:`BEFORE` (red), after is :data:`AFTER` (green); each policy,
and each policy chosen by the adaptive engine ("quota via adaptive"), has its own colour, the same on every
page (:func:`policy_color`); every axis names its quantity in the words of docs/design.md (Vocabulary) and
its unit as a word (tokens, MiB, ms, ratio). Legends sit right of the plot, never on the title; runs are
labelled by what tells them apart (:func:`run_labels`), with the full id on hover.
"""

from __future__ import annotations

import hashlib
import math

BEFORE = "#d62728"
AFTER = "#2ca02c"
RELAY = "#9467bd"
DIRECT = "#1f77b4"
POLICY_COLORS = {
    "none": "#7f7f7f",
    "quota": "#1f77b4",
    "eplb": "#ff7f0e",
    "feplb": "#17becf",
    "hybridep": "#9467bd",
    "adaptive": "#8c564b",
}
#: a candidate the adaptive engine chose ("quota via adaptive"): the light partner of its policy's colour
VIA_COLORS = {
    "none": "#c7c7c7",
    "quota": "#aec7e8",
    "eplb": "#ffbb78",
    "feplb": "#9edae5",
    "hybridep": "#c5b0d5",
    "adaptive": "#c49c94",
}
_EXTRA = ["#e377c2", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]
IMBALANCE_AXIS = "imbalance (max / mean rank load, 1 = perfect)"
MIB = float(1 << 20)
HEAT = "YlOrRd"


def policy_color(name) -> str:
    """The colour of a policy: fixed for the built-in ones, a stable pick for any other name. A candidate
    an adaptive layer chose (``"quota via adaptive"``) has a colour of its own, the light partner of the
    candidate's, so "quota" and "quota via adaptive" never share one."""
    name = str(name)
    base, via, _ = name.partition(" via ")
    table = VIA_COLORS if via else POLICY_COLORS
    if base in table:
        return table[base]
    h = int(hashlib.blake2b(name.encode(), digest_size=2).hexdigest(), 16)
    return _EXTRA[h % len(_EXTRA)]


def run_labels(run_ids) -> dict[str, str]:
    """``{run id: short label}``: the ids without the prefix they all share (``demo-...-quota`` -> ``quota``)."""
    from ultraep.telemetry.units import short_labels

    return short_labels(sorted({str(r) for r in run_ids}))[0]


def _go():
    import plotly.graph_objects as go

    return go


def _layout(fig, *, x: str, y: str, title: str | None = None, height: int = 340, legend: bool = True):
    """Common layout: the title top left in its own margin, the legend right of the plot (Plotly widens the
    right margin for it), so legend and title never overlap however many entries the legend has."""
    fig.update_layout(
        title=dict(text=title, x=0, xanchor="left", y=0.98, yanchor="top", yref="container") if title else None,
        height=height, margin=dict(l=60, r=20, t=44 if title else 16, b=50),
        xaxis_title=x, yaxis_title=y, showlegend=legend, template="plotly_white",
        legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02),
    )
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return fig


def _colorbar(title: str, **kw) -> dict:
    """A colour bar whose title runs along its right side, where no tick label can sit on it."""
    return dict(title=dict(text=title, side="right"), **kw)


def _nice_step(span: float, ticks: int = 10) -> int:
    raw = max(1.0, span / ticks)
    mag = 10 ** int(math.floor(math.log10(raw)))
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return int(m * mag)
    return int(10 * mag)  # pragma: no cover


def int_axis(fig, axis: str, values) -> None:
    """Integer ticks (layers, steps, ranks, experts): never 0.5."""
    vals = [float(v) for v in values]
    if not vals:
        return
    step = _nice_step(max(vals) - min(vals))
    getattr(fig, f"update_{axis}axes")(tick0=0, dtick=step, tickformat="d")


def empty(message: str):
    """A blank figure with a message (used when a chart has nothing to show yet)."""
    go = _go()
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig.update_layout(height=200, template="plotly_white")


# --------------------------------------------------------------------------- overview / layers
def shade_warmup(fig, warmup: list[int] | None, bin: int = 1) -> None:
    """Grey band over the warm-up steps (left out of every summary; kept in charts over steps)."""
    if warmup:
        fig.add_vrect(x0=min(warmup) - 0.5 * bin, x1=max(warmup) + 0.5 * bin, fillcolor="#bbbbbb", opacity=0.25,
                      line_width=0, layer="below")


def imbalance_over_steps(df, *, title: str | None = None, warmup: list[int] | None = None, bin: int = 1):
    go = _go()
    fig = go.Figure()
    shade_warmup(fig, warmup, bin)
    fig.add_scatter(x=df["step"], y=df["imbalance_before"], mode="lines", name="before balancing",
                    line=dict(color=BEFORE))
    fig.add_scatter(x=df["step"], y=df["imbalance_after"], mode="lines", name="after balancing",
                    line=dict(color=AFTER))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#999", annotation_text="force-balanced ideal",
                  annotation_position="bottom right")  # below the line: imbalance never goes under 1
    int_axis(fig, "x", df["step"])
    return _layout(fig, x="step (bin start)", y=IMBALANCE_AXIS, title=title)


def policy_shares(df):
    go = _go()
    fig = go.Figure(go.Bar(
        x=100.0 * df["share"], y=df["policy"], orientation="h",
        marker_color=[policy_color(p) for p in df["policy"]],
        text=[f"{100 * s:.1f}%" for s in df["share"]], textposition="auto",
        customdata=df["plans"], hovertemplate="%{y}: %{x:.1f}% (%{customdata} layer-microbatches)<extra></extra>",
    ))
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, x="share (%)", y="policy", height=110 + 34 * max(1, len(df)),
                   legend=False)


def imbalance_heatmap(df, which: str, *, zmax: float | None = None):
    """Layer × step heatmap of ``imbalance_<which>`` (``which`` = before | after)."""
    go = _go()
    wide = df.pivot(index="layer", columns="step", values=f"imbalance_{which}")
    fig = go.Figure(go.Heatmap(
        z=wide.to_numpy(), x=wide.columns.to_numpy(), y=wide.index.to_numpy(), colorscale=HEAT,
        zmin=1.0, zmax=zmax, colorbar=_colorbar("imbalance"),
        hovertemplate="layer %{y}, step %{x}: imbalance %{z:.3f}<extra></extra>",
    ))
    fig.update_yaxes(autorange="reversed")
    int_axis(fig, "x", wide.columns)
    int_axis(fig, "y", wide.index)
    word = "before" if which == "before" else "after"
    return _layout(fig, x="step (bin start)", y="layer", title=f"imbalance {word} balancing", legend=False)


def rank_load_stacked(df, which: str, *, ymax: float | None = None, top: int = 12):
    """Per-rank load stacked by logical expert, ``which`` = before | after (tokens, {token})."""
    go = _go()
    col = f"load_{which}"
    totals = df.groupby("expert")[["load_before", "load_after"]].sum().sum(axis=1).sort_values(ascending=False)
    keep = list(totals.index[:top]) if len(totals) > top else list(totals.index)
    fig = go.Figure()
    ranks = sorted(df["rank"].unique())
    palette = _expert_palette(len(keep))
    for i, e in enumerate(sorted(keep)):
        sub = df[df["expert"] == e].set_index("rank")[col].reindex(ranks, fill_value=0)
        fig.add_bar(x=ranks, y=sub.to_numpy(), name=f"expert {e}", marker_color=palette[i],
                    hovertemplate=f"rank %{{x}}, expert {e}: %{{y}} tokens<extra></extra>")
    rest = df[~df["expert"].isin(keep)]
    if len(rest):
        sub = rest.groupby("rank")[col].sum().reindex(ranks, fill_value=0)
        fig.add_bar(x=ranks, y=sub.to_numpy(), name="other experts", marker_color="#c7c7c7")
    mean = df.groupby("rank")[col].sum().reindex(ranks, fill_value=0).mean() if len(df) else 0
    fig.add_hline(y=float(mean), line_dash="dot", line_color="#444", annotation_text="mean (ideal)")
    fig.update_layout(barmode="stack")
    if ymax:
        fig.update_yaxes(range=[0, ymax * 1.05])
    fig.update_xaxes(tickmode="array", tickvals=ranks)
    word = "before" if which == "before" else "after"
    return _layout(fig, x="rank", y="tokens received", title=f"rank load {word} balancing")


def activation_by_rank(df, layer: int):
    """Bars per rank: the peak expert-activation MB it held before and after balancing; a dashed line for each
    marks the mean rank's (the mean over ranks and calls)."""
    go = _go()
    fig = go.Figure()
    for which, color in (("before", BEFORE), ("after", AFTER)):
        fig.add_bar(x=df["rank"], y=df[f"peak_{which}_MB"], name=f"peak {which} balancing", marker_color=color)
        mean = float(df[f"mean_{which}_MB"].mean()) if len(df) else 0.0
        fig.add_hline(y=mean, line_dash="dash", line_color=color, annotation_text=f"mean rank {which}: {mean:.1f} MB")
    _layout(fig, x="rank", y="expert activations (MB)", title=f"expert activation memory per rank, layer {layer}")
    fig.update_layout(barmode="group")
    int_axis(fig, "x", df["rank"])
    return fig


def _expert_palette(n: int) -> list[str]:
    import plotly.colors as pc

    base = pc.qualitative.Light24 + pc.qualitative.Dark24
    return [base[i % len(base)] for i in range(n)]


# --------------------------------------------------------------------------- experts
def expert_heatmap(df, value: str, *, colorbar: str, title: str, colorscale: str = HEAT):
    go = _go()
    wide = df.pivot(index="expert", columns="step", values=value)
    fig = go.Figure(go.Heatmap(
        z=wide.to_numpy(), x=wide.columns.to_numpy(), y=wide.index.to_numpy(), colorscale=colorscale,
        colorbar=_colorbar(colorbar),
        hovertemplate="expert %{y}, step %{x}: %{z:.1f}<extra></extra>",
    ))
    fig.update_yaxes(autorange="reversed")
    int_axis(fig, "x", wide.columns)
    int_axis(fig, "y", wide.index)
    return _layout(fig, x="step (bin start)", y="logical expert", title=title, legend=False, height=380)


def expert_lines(df, experts: list[int]):
    go = _go()
    fig = go.Figure()
    palette = _expert_palette(len(experts))
    for i, e in enumerate(experts):
        sub = df[df["expert"] == e]
        fig.add_scatter(x=sub["step"], y=sub["load_tokens"], mode="lines", name=f"expert {e}",
                        line=dict(color=palette[i]))
    return _layout(fig, x="step (bin start)", y="tokens per step", title="hottest experts over time")


def turnover(df):
    go = _go()
    fig = go.Figure(go.Scatter(x=df["step"], y=df["turnover"], mode="lines+markers", line=dict(color="#444"),
                               customdata=df["hottest_expert"],
                               hovertemplate="step %{x}: %{y:.2f} of the hot set changed; hottest expert "
                                             "%{customdata}<extra></extra>"))
    fig.update_yaxes(range=[-0.05, 1.05])
    return _layout(fig, x="step (bin start)", y="share of hot set new",
                   title="drift of the hot experts (turnover of the top experts)", legend=False, height=300)


# --------------------------------------------------------------------------- policies
def decision_timeline(df):
    """Layer × step map, each cell coloured by the most frequent decision in it (one heatmap trace: a
    browser draws 50 layers × 240 bins as fast as a handful)."""
    go = _go()
    policies = sorted(df["policy"].astype(str).unique())
    code = {p: i for i, p in enumerate(policies)}
    n = max(1, len(policies))
    scale = []
    for i, p in enumerate(policies):
        scale += [(i / n, policy_color(p)), ((i + 1) / n, policy_color(p))]
    z = df.assign(c=df["policy"].astype(str).map(code)).pivot(index="layer", columns="step", values="c")
    text = df.assign(t=df["policy"].astype(str) + " (" + df["decisions"].astype(str) + " decisions, "
                     + df["policies"].astype(str) + " policies in bin)").pivot(index="layer", columns="step", values="t")
    fig = go.Figure(go.Heatmap(
        z=z.to_numpy(dtype=float), x=z.columns.to_numpy(), y=z.index.to_numpy(), text=text.to_numpy(),
        colorscale=scale or [(0, "#ccc"), (1, "#ccc")], zmin=-0.5, zmax=n - 0.5, xgap=1, ygap=1,
        colorbar=_colorbar("policy", tickvals=list(range(n)), ticktext=policies),
        hovertemplate="layer %{y}, step %{x}: %{text}<extra></extra>",
    ))
    fig.update_yaxes(autorange="reversed")
    int_axis(fig, "x", df["step"])
    int_axis(fig, "y", df["layer"])
    return _layout(fig, x="step (bin start)", y="layer", title="decision per layer over time", height=380,
                   legend=False)


def predicted_vs_measured_lines(df):
    go = _go()
    fig = go.Figure()
    for pol, sub in df.groupby("policy", sort=True):
        c = policy_color(pol)
        fig.add_scatter(x=sub["step"], y=1e3 * sub["measured_s"], mode="lines", name=f"{pol} measured",
                        line=dict(color=c))
        fig.add_scatter(x=sub["step"], y=1e3 * sub["predicted_s"], mode="lines", name=f"{pol} predicted",
                        line=dict(color=c, dash="dash"))
    return _layout(fig, x="step (bin start)", y="ms per layer-microbatch",
                   title="predicted vs measured")


def prediction_scatter(df):
    go = _go()
    fig = go.Figure()
    for pol, sub in df.groupby("policy", sort=True):
        fig.add_scatter(x=1e3 * sub["predicted_s"], y=1e3 * sub["measured_s"], mode="markers", name=str(pol),
                        marker=dict(color=policy_color(pol), size=5, opacity=0.6))
    if len(df):
        hi = 1e3 * float(max(df["predicted_s"].max(), df["measured_s"].max()))
        fig.add_scatter(x=[0, hi], y=[0, hi], mode="lines", name="measured = predicted",
                        line=dict(color="#999", dash="dot"))
    return _layout(fig, x="predicted (ms)", y="measured (ms)", title="each layer-microbatch (sample)")


def relative_error(df, title: str = "prediction error"):
    """Lines of ``rel_error`` (a fraction) per ``policy`` (or per cost-model term) over step bins."""
    go = _go()
    fig = go.Figure()
    for pol, sub in df.groupby("policy", sort=True):
        fig.add_scatter(x=sub["step"], y=100 * sub["rel_error"], mode="lines+markers", name=str(pol),
                        line=dict(color=policy_color(pol)), marker=dict(size=4))
    fig.add_hline(y=0, line_dash="dot", line_color="#999")
    lo, hi, off = readable_range(100 * df["rel_error"]) if len(df) else (None, None, 0)
    if lo is not None:
        fig.update_yaxes(range=[lo, hi])
    if off:
        title = f"{title} ({off} point{'s' if off != 1 else ''} off the axis)"
    return _layout(fig, x="step (bin start)", y="measured / predicted − 1 (%)", title=title, height=280)


def readable_range(values, q: float = 0.9) -> tuple[float | None, float | None, int]:
    """A y range in which the steady state is readable: the central ``q`` of the values plus a margin (always
    including 0), and how many values fall outside it. ``(None, None, 0)`` when every value fits anyway."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size < 4:
        return None, None, 0
    a, b = np.quantile(v, [(1 - q) / 2, (1 + q) / 2])
    pad = max(5.0, 0.25 * (b - a))
    lo, hi = min(0.0, a) - pad, max(0.0, b) + pad
    off = int(((v < lo) | (v > hi)).sum())
    return (lo, hi, off) if off else (None, None, 0)


def switches(df):
    go = _go()
    fig = go.Figure(go.Bar(x=df["layer"], y=df["switches"], marker_color="#444",
                           hovertemplate="layer %{x}: %{y} policy changes<extra></extra>"))
    int_axis(fig, "x", df["layer"])
    return _layout(fig, x="layer", y="policy changes (count)", title="how often each layer switched policy",
                   legend=False, height=260)


# --------------------------------------------------------------------------- transfers
def transfer_bytes(df):
    go = _go()
    fig = go.Figure()
    fig.add_bar(x=df["step"], y=df["direct_bytes"] / MIB, name="direct from the master's rank", marker_color=DIRECT)
    fig.add_bar(x=df["step"], y=df["relay_bytes"] / MIB, name="relay forward", marker_color=RELAY)
    fig.update_layout(barmode="stack")
    return _layout(fig, x="step (bin start)", y="expert state moved (MiB)", title="bytes per step bin")


def busiest_sender_over_steps(df):
    go = _go()
    fig = go.Figure(go.Scatter(x=df["step"], y=df["busiest_sender_bytes"] / MIB, mode="lines",
                               line=dict(color="#444"), name="busiest sender"))
    return _layout(fig, x="step (bin start)", y="MiB sent by one rank (max)",
                   title="busiest sender per layer-microbatch", legend=False, height=260)


def fanout(df, top: int = 32):
    go = _go()
    sub = df.head(top)
    fig = go.Figure()
    fig.add_bar(x=[str(e) for e in sub["expert"]], y=sub["max_fan_out"], name="max fan-out", marker_color="#444")
    fig.add_bar(x=[str(e) for e in sub["expert"]], y=sub["mean_fan_out"], name="mean fan-out",
                marker_color="#aaa")
    fig.update_layout(barmode="group")
    return _layout(fig, x="logical expert (most copied first)", y="fan-out (copies from one rank)",
                   title="fan-out per expert")


def senders(df):
    go = _go()
    fig = go.Figure()
    x = [str(r) for r in df["rank"]]
    fig.add_bar(x=x, y=df["direct_bytes"] / MIB, name="direct", marker_color=DIRECT)
    fig.add_bar(x=x, y=df["relay_bytes"] / MIB, name="relay forward", marker_color=RELAY)
    fig.update_layout(barmode="stack")
    return _layout(fig, x="sending rank", y="expert state sent (MiB)", title="bytes sent per rank")


# --------------------------------------------------------------------------- compare
def run_policy_names(run_ids, policies) -> list[str]:
    """A label per (run, policy) pair: ``"quota"`` for run ``…-quota``'s quota, ``"eplb via adaptive"`` for run
    ``…-adaptive``'s, else ``"<run> · <policy>"`` (also whenever the short form would give two pairs one name)."""
    labels = run_labels(run_ids)
    pairs = [(str(r), str(p)) for r, p in zip(run_ids, policies)]
    names = [p if p == labels[r] or p.endswith(f" via {labels[r]}") else f"{labels[r]} · {p}" for r, p in pairs]
    if len(set(names)) < len(set(pairs)):
        names = [f"{labels[r]} · {p}" for r, p in pairs]
    return names


def compare_bars(df, value: str, axis: str, *, scale: float = 1.0, title: str | None = None):
    """Horizontal bars of ``value``, one per (run, policy), labelled "run · policy" by the runs' short labels
    (the full id on hover) and coloured by policy: one label per row, so no legend, and no label can run into
    another however narrow the page."""
    go = _go()
    fig = go.Figure()
    order = df.sort_values(["run_id", "policy"])
    names = run_policy_names(order["run_id"], order["policy"])
    for pol in sorted(order["policy"].astype(str).unique()):
        sel = (order["policy"].astype(str) == pol).to_numpy()
        fig.add_bar(y=[n for n, k in zip(names, sel) if k], x=scale * order[value].to_numpy()[sel], name=pol,
                    orientation="h", marker_color=policy_color(pol), customdata=order["run_id"].to_numpy()[sel],
                    hovertemplate=f"%{{customdata}} · {pol}: %{{x:.3g}}<extra></extra>")
    fig.update_layout(barmode="relative")
    fig.update_yaxes(categoryorder="array", categoryarray=names, autorange="reversed")
    return _layout(fig, x=axis, y="", title=title, height=90 + 26 * max(1, len(names)), legend=False)


def compare_lines(df):
    go = _go()
    fig = go.Figure()
    labels = run_labels(df["run_id"])
    dashes = {r: ("solid", "dash", "dot", "dashdot")[i % 4] for i, r in enumerate(sorted(labels))}
    keys = list(df.groupby(["run_id", "policy"], sort=True).groups)
    shown = dict(zip(keys, run_policy_names([k[0] for k in keys], [k[1] for k in keys])))
    for (run, pol), sub in df.groupby(["run_id", "policy"], sort=True):
        name = shown[(run, pol)]
        fig.add_scatter(x=sub["step"], y=sub["imbalance_after"], mode="lines", name=name,
                        line=dict(color=policy_color(pol), dash=dashes[run]), hovertemplate=f"{run} · {pol}: step %{{x}}, "
                        "imbalance %{y:.3f}<extra></extra>")
    fig.add_hline(y=1.0, line_dash="dot", line_color="#999")
    return _layout(fig, x="step (bin start)", y="imbalance after (max / mean)",
                   title="imbalance after balancing over time")


# --------------------------------------------------------------------------- SQL page
def quick_chart(df, x: str, y: str, kind: str = "auto"):
    """A line (numeric x) or bar (anything else) chart of ``y`` over ``x`` for a query result."""
    go = _go()
    import pandas as pd

    numeric_x = pd.api.types.is_numeric_dtype(df[x]) or pd.api.types.is_datetime64_any_dtype(df[x])
    if kind == "auto":
        kind = "line" if numeric_x and len(df) > 1 else "bar"
    fig = go.Figure()
    if kind == "line":
        sub = df.sort_values(x)
        fig.add_scatter(x=sub[x], y=sub[y], mode="lines+markers", name=y)
    else:
        fig.add_bar(x=df[x].astype(str) if not numeric_x else df[x], y=df[y], name=y)
    return _layout(fig, x=x, y=y, legend=False)
