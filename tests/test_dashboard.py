"""Dashboard pages (Streamlit AppTest) on runs recorded by the real Recorder: every page renders without an
exception, and the figures it shows equal the store's canned SQL on the same data (the dashboard computes
them on its own path: an in-memory mirror of the Parquet parts, see dashboard/mirror.py).

The fixture is deliberately awkward for the mirror: two ranks record the same run, rank 0 misses one
layer-microbatch (so that row must come from rank 1), rank 1's timings are slower (so the slowest rank's
time must win), and the same rank records one layer-microbatch twice (two recorder sessions)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")

import ultraep  # noqa: E402
from ultraep.telemetry import Recorder, open_run, queries  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
PAGES = ("overview", "layers", "experts", "policies", "transfers", "compare", "sql")
TOPO = ultraep.Topology(num_ranks=4, num_experts=8, num_redundant_slots=2, expert_bytes=1 << 20)
POLICIES = ("quota", "eplb", "none")
MISSING_ON_RANK0 = (1, 0, 1)  # (step, microbatch, layer) only rank 1 records


def make_plan(step: int, mb: int, layer: int, policy: str, salt: int = 0):
    rng = np.random.default_rng(1000 * step + 100 * mb + 10 * layer + salt)
    load = rng.integers(0, 60, (4, 8))
    load[:, (step + layer) % 8] += 300  # a hot expert that moves: replicas, transfers, drift
    return ultraep.plan_layer(load, policy, topology=TOPO)


def record_run(runs_dir, name: str, *, steps: int = 4, microbatches: int = 2, layers: int = 3,
               policies=POLICIES, ranks=(0, 1), close: bool = True, model: str = "toy-moe", activation: bool = True):
    """Record a run with the real Recorder from every rank in ``ranks`` (same run name); ``activation``: with the
    expert activation bytes the runtime records."""
    recs = [Recorder.open(runs_dir, name, kind="train", model=model, world_size=2, rank=r, topology=TOPO,
                          flush_interval_s=None) for r in ranks]
    for step in range(steps):
        for mb in range(microbatches):
            for layer in range(layers):
                pol = policies[(step + layer) % len(policies)]
                plan = make_plan(step, mb, layer, pol)
                for rec in recs:
                    if rec.rank == 0 and (step, mb, layer) == MISSING_ON_RANK0:
                        continue
                    rec.record_plan(step, mb, layer, plan)
                    rec.record_decision(step, mb, layer, policy=pol, reason=f"{pol}: load skew {step % 2}",
                                        predictions={pol: 1e-3, "none": 2e-3},
                                        chosen_predicted_s=1e-3 * (1 + layer))
                    slow = 1.0 + 0.25 * rec.rank  # rank 1 is the straggler
                    rec.record_timings(step, mb, layer, {
                        "plan_s": 1e-4 * slow, "transfer_s": 2e-4 * layer * slow,
                        "measured_s": (1.1e-3 * (1 + layer) + 1e-5 * step) * slow,
                        "predicted_s": 1e-3 * (1 + layer),
                        # rank 0 holds the hot experts' rows until balancing spreads them (expert activations)
                        **({"activation_bytes_before": 1e6 * (4 - 3 * rec.rank) * (1 + layer + step),
                            "activation_bytes_after": 1e6 * (2.5 - rec.rank) * (1 + layer + step)}
                           if activation else {})})
                    rec.record_transfer_times(step, mb, layer, [1e-3 * slow] * len(plan.transfers))
        for rec in recs:
            rec.record_step(step, loss=1.0 / (step + 1), step_time_s=0.05)
        for rec in recs:
            rec.flush()
    if close:
        for rec in recs:
            rec.close()
    return recs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    record_run(root, "fx")
    # the same rank records one layer-microbatch again in a second recorder session (a resumed rank); the first
    # recording must win. (A plan without transfers: the store's transfer_detail keeps every recording of
    # the lowest rank, so a duplicate with transfers would be counted twice there.)
    with Recorder.open(root, "fx", kind="train", model="toy-moe", world_size=2, rank=0, topology=TOPO,
                       flush_interval_s=None) as again:
        again.record_plan(0, 0, 0, make_plan(0, 0, 0, "none", salt=7))
    record_run(root, "fx-b", steps=3, policies=("quota", "none"), ranks=(0,), activation=False)
    Recorder.open(root, "empty", kind="train", model="toy-moe", flush_interval_s=None).close()
    return root


def app(root, page: str | None = None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["ultraep_root"] = str(root)
    at.run()
    if page and page != "overview":
        at.switch_page(f"pages/{page}.py")
    # AppTest starts every run in Streamlit's 'pages/ directory' mode (a server does so only for its first
    # run): the first run goes through app.py and st.navigation, the later ones run the page file, which sets
    # itself up (ui.context). Widget ids differ between the two, so settle on the second kind before
    # touching widgets.
    at.run()
    return at


def select_run(at, run_id: str):
    at.sidebar.selectbox(key="ultraep_run").set_value(run_id).run()
    return at


def sql(con, query: str, **params):
    cur = con.execute(query, params or None)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def canned(con, q, **params):
    cols, rows = queries.run(con, q, **params)
    return [dict(zip(cols, r)) for r in rows]


def _decode(v):
    """Plotly ≥ 6 writes numeric arrays as {dtype, bdata[, shape]}."""
    if isinstance(v, dict) and "bdata" in v:
        arr = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        if "shape" in v:
            arr = arr.reshape([int(s) for s in str(v["shape"]).split(",")])
        return arr
    return np.asarray(v)


def figures(at) -> dict[str, dict]:
    """Plotly figures on the page by their layout title (or their position)."""
    out = {}
    for i, el in enumerate(at.get("plotly_chart")):
        fig = json.loads(el.proto.spec)
        title = fig["layout"].get("title", {})
        text = title.get("text") if isinstance(title, dict) else title
        out[text or f"#{i}"] = fig
    return out


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def frame(at, *columns: str):
    """The first table on the page that has all ``columns`` (named as in the data; tables show them in words,
    ``ui.human``: ``mean_before`` -> ``mean before``), with the data's names back."""
    from ultraep.dashboard.ui import human

    def data_name(shown: str) -> str:  # the inverse of ui.human
        for unit, suffix in ((" (s)", "_s"), (" (bytes)", "_bytes"), (" (B/s)", "_Bps"), (" (tokens)", "_tokens")):
            if shown.endswith(unit):
                shown = shown[: -len(unit)] + suffix
        return shown.replace(" ", "_")

    for df in at.dataframe:
        if set(columns) <= set(df.value.columns):
            return df.value
        if {human(c) for c in columns} <= set(df.value.columns):
            return df.value.rename(columns={c: data_name(c) for c in df.value.columns})
    raise KeyError(columns)


def assert_ok(at):
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


# --------------------------------------------------------------------------- every page
def test_every_page_renders_without_exceptions(runs):
    # (run fx is shown on every page by the tests below; here the one-rank run of another policy mix)
    for page in PAGES:
        at = select_run(app(runs, page), "fx-b")
        assert_ok(at)
        assert at.title and at.title[0].value.lower() == page.lower(), page


def test_an_empty_run_shows_a_message_not_an_error(runs):
    for page in PAGES:
        at = select_run(app(runs, page), "empty")
        assert_ok(at)
        if page != "sql":
            assert any("has no" in i.value for i in at.info), (page, [i.value for i in at.info])


def test_no_runs_yet_is_a_message(tmp_path):
    at = app(tmp_path)
    assert_ok(at)
    assert any("No recorded runs" in i.value for i in at.info)


# --------------------------------------------------------------------------- overview
def test_overview_figures_equal_sql(runs):
    at = select_run(app(runs), "fx")
    assert_ok(at)
    con = open_run(runs / "fx")
    ov = canned(con, queries.OVERVIEW, run_id="fx")[0]
    m = metrics(at)
    assert m["layer-microbatch rows"] == f"{ov['plans']:,}"
    assert m["imbalance before → after"] == (
        f"{ov['mean_imbalance_before']:.3f} → {ov['mean_imbalance_after']:.3f}")
    assert m["recording errors"] == str(ov["errors"])
    # % of the force-balanced ideal (no ideal_s recorded: Σ mean / Σ max rank load after balancing)
    ideal = sql(con, "SELECT 100 * sum(list_avg(rank_load_after)) / sum(list_max(rank_load_after)) AS p "
                     "FROM layer_balance")[0]["p"]
    assert m["plan quality: % of ideal"] == f"{ideal:.1f}%"
    # planning / transfer overhead: Σ over layer-microbatches of the slowest recording rank's seconds
    over = sql(con, "SELECT sum(p) AS plan_s, sum(t) AS transfer_s FROM (SELECT max(plan_s) AS p, "
                    "max(transfer_s) AS t FROM timings GROUP BY step, microbatch, layer)")[0]
    assert m["planning overhead"] == f"{over['plan_s'] * 1e3:.2f} ms"
    assert m["transfer overhead"] == f"{over['transfer_s'] * 1e3:.2f} ms"
    shares = figures(at)["#1"]["data"][0]  # the policy-shares bar chart (untitled)
    expected = canned(con, queries.POLICY_SHARES, run_id="fx")
    assert list(shares["y"]) == [r["policy"] for r in expected]
    assert list(_decode(shares["customdata"])) == [r["plans"] for r in expected]
    np.testing.assert_allclose(_decode(shares["x"]), [100 * r["share"] for r in expected])
    table = frame(at, "run", "layer-microbatches")
    row = table[table["run"] == "fx"].iloc[0]
    assert row["layer-microbatches"] == ov["plans"] and row["steps"] == ov["steps"]
    assert row["mean imbalance after"] == pytest.approx(ov["mean_imbalance_after"])
    assert set(table["run"]) == {"fx", "fx-b", "empty"}
    line = figures(at)["imbalance over steps (mean over layers)"]["data"]
    per_step = sql(con, "SELECT step, avg(imbalance_before) AS b, avg(imbalance_after) AS a FROM layer_balance "
                        "GROUP BY step ORDER BY step")
    np.testing.assert_allclose(_decode(line[0]["y"]), [r["b"] for r in per_step])
    np.testing.assert_allclose(_decode(line[1]["y"]), [r["a"] for r in per_step])


# --------------------------------------------------------------------------- layers
def test_layers_heatmaps_and_rank_load_equal_sql(runs):
    at = select_run(app(runs, "layers"), "fx")
    assert_ok(at)
    con = open_run(runs / "fx")
    cells = canned(con, queries.LAYER_IMBALANCE, run_id="fx")
    figs = figures(at)
    for which in ("before", "after"):
        fig = figs[f"imbalance {which} balancing"]["data"][0]
        z = _decode(fig["z"])
        xs, ys = list(_decode(fig["x"])), list(_decode(fig["y"]))
        for r in cells:
            assert z[ys.index(r["layer"]), xs.index(r["step"])] == pytest.approx(r[f"imbalance_{which}"])
    summary = frame(at, "layer", "mean_before", "mean_after")
    expected = canned(con, queries.LAYER_SUMMARY, run_id="fx")
    np.testing.assert_allclose(summary["mean_after"], [r["mean_after"] for r in expected])
    np.testing.assert_allclose(summary["max_before"], [r["max_before"] for r in expected])
    # per-rank load for a chosen layer and step: the layer-microbatch only rank 1 recorded
    step, mb, layer = MISSING_ON_RANK0
    at.selectbox(key="layers_layer").set_value(layer).run()
    at.number_input(key="layers_step").set_value(step).run()
    for choice in ("all (summed)", mb):
        at.selectbox(key="layers_microbatch").set_value(choice).run()
        assert_ok(at)
        totals = frame(at, "rank", "load_before", "load_after")
        ranks = canned(con, queries.RANK_LOAD, run_id="fx", layer=layer, step=step,
                       microbatch=None if choice == "all (summed)" else mb)
        assert list(totals["load_before"]) == [r["load_before"] for r in ranks]
        assert list(totals["load_after"]) == [r["load_after"] for r in ranks]
        stacked = figures(at)["rank load after balancing"]["data"]
        bars = [t for t in stacked if t["type"] == "bar"]
        summed = np.sum([_decode(t["y"]) for t in bars], axis=0)
        assert list(summed) == [r["load_after"] for r in ranks]


def test_layers_activation_memory_equals_sql(runs):
    at = select_run(app(runs, "layers"), "fx")
    assert_ok(at)
    con = open_run(runs / "fx")
    shown = frame(at, "layer", "peak_busiest_before_MB", "peak_busiest_after_MB", "peak_over_mean_after")
    expected = canned(con, queries.ACTIVATION_MEMORY, run_id="fx")
    assert list(shown["layer"]) == [r["layer"] for r in expected] == [0, 1, 2]
    for col in ("peak_busiest_before_MB", "peak_busiest_after_MB", "mean_rank_MB", "peak_over_mean_before",
                "peak_over_mean_after"):
        np.testing.assert_allclose(shown[col], [r[col] for r in expected])
    # by hand, layer 2: steps 1-3 settled (step 0 is the warm-up step), the last step the largest, so the peaks are
    # rank 0's at step 3: 4 MB x (1 + 2 + 3) = 24 MB before, 2.5 MB x 6 = 15 MB after
    assert shown["peak_busiest_before_MB"].iloc[2] == pytest.approx(24.0)
    assert shown["peak_busiest_after_MB"].iloc[2] == pytest.approx(15.0)
    at.selectbox(key="layers_activation_layer").set_value(2).run()
    assert_ok(at)
    bars = [t for t in figures(at)["expert activation memory per rank, layer 2"]["data"] if t["type"] == "bar"]
    ranks = canned(con, queries.ACTIVATION_MEMORY_BY_RANK, run_id="fx", layer=2)
    assert [t["name"] for t in bars] == ["peak before balancing", "peak after balancing"]
    np.testing.assert_allclose(_decode(bars[0]["y"]), [r["peak_before_MB"] for r in ranks])
    np.testing.assert_allclose(_decode(bars[1]["y"]), [24.0 * 2.5 / 4, 6.0 * 1.5])  # rank 0 15 MB, rank 1 9 MB


def test_a_run_without_activation_memory_says_so(runs):
    at = select_run(app(runs, "layers"), "fx")
    assert not [el for el in at.info if "activation memory" in el.value]
    at = select_run(app(runs, "layers"), "fx-b")  # recorded without activation bytes (e.g. an older run)
    assert_ok(at)
    assert [el for el in at.info if "recorded no expert activation memory" in el.value]
    with pytest.raises(KeyError):
        frame(at, "layer", "peak_busiest_before_MB")


# --------------------------------------------------------------------------- experts
def test_experts_load_replicas_and_hottest_equal_sql(runs):
    at = select_run(app(runs, "experts"), "fx")
    at.selectbox(key="experts_layer").set_value(1).run()
    assert_ok(at)
    con = open_run(runs / "fx")
    expected = canned(con, queries.EXPERT_LOAD, run_id="fx", layer=1)
    fig = figures(at)["load per logical expert, layer 1"]["data"][0]
    z, xs, ys = _decode(fig["z"]), list(_decode(fig["x"])), list(_decode(fig["y"]))
    for r in expected:
        assert z[ys.index(r["expert"]), xs.index(r["step"])] == r["load"]
    totals = sql(con, "SELECT expert, sum(load) AS load FROM (" + queries.EXPERT_LOAD.sql + ") GROUP BY expert "
                      "ORDER BY load DESC, expert", **queries.EXPERT_LOAD.bind(run_id="fx", layer=1))
    hot = frame(at, "expert", "load_tokens", "drift")
    steps = len({r["step"] for r in expected})
    assert list(hot["expert"][:3]) == [r["expert"] for r in totals[:3]]
    assert hot["load_tokens"].iloc[0] == pytest.approx(totals[0]["load"] / 1.0)  # one step per bin
    assert hot["share"].sum() <= 1.0 + 1e-9 and steps == 4
    # replicas: redundant slots holding each expert, mean over the step's microbatches (lowest rank's plan)
    reps = sql(con, """
        WITH p AS (SELECT * FROM plans WHERE layer = 1
                   QUALIFY row_number() OVER (PARTITION BY step, microbatch, layer ORDER BY rank, ts) = 1)
        SELECT step, e AS expert, count(*) / count(DISTINCT microbatch) AS n FROM (
            SELECT step, microbatch, unnest(list_slice(row, num_masters + 1, num_slots)) AS e
            FROM (SELECT step, microbatch, num_masters, num_slots, unnest(phy2log) AS row FROM p))
        WHERE e >= 0 GROUP BY step, e""")
    micro = {r["step"]: r["n"] for r in sql(con, "SELECT step, count(*) AS n FROM layer_balance WHERE layer = 1 "
                                                   "GROUP BY step")}
    fig = figures(at)["replicas per logical expert (mean in bin), layer 1"]["data"][0]
    z, xs, ys = _decode(fig["z"]), list(_decode(fig["x"])), list(_decode(fig["y"]))
    seen = {(r["step"], r["expert"]) for r in reps}
    for r in reps:
        count = sql(con, """
            WITH p AS (SELECT * FROM plans WHERE layer = 1 AND step = $s
                       QUALIFY row_number() OVER (PARTITION BY step, microbatch, layer ORDER BY rank, ts) = 1)
            SELECT count(*) AS c FROM (SELECT unnest(list_slice(row, num_masters + 1, num_slots)) AS e
                                       FROM (SELECT num_masters, num_slots, unnest(phy2log) AS row FROM p))
            WHERE e = $e""", s=r["step"], e=r["expert"])[0]["c"]
        assert z[ys.index(r["expert"]), xs.index(r["step"])] == pytest.approx(count / micro[r["step"]])
    assert seen


# --------------------------------------------------------------------------- policies
def test_policies_decisions_and_predictions_equal_sql(runs):
    at = select_run(app(runs, "policies"), "fx")
    assert_ok(at)
    con = open_run(runs / "fx")
    timeline = canned(con, queries.DECISION_TIMELINE, run_id="fx")
    reasons = frame(at, "policy", "reason", "decisions", "first_step")
    counts = {}
    for r in timeline:
        counts[(r["policy"], r["reason"])] = counts.get((r["policy"], r["reason"]), 0) + 1
    assert {(p, r): n for p, r, n in zip(reasons["policy"], reasons["reason"], reasons["decisions"])} == counts
    at.selectbox(key="policies_layer").set_value(2).run()
    recent = frame(at, "step", "microbatch", "policy", "reason", "chosen_predicted_s")
    last = sorted((r for r in timeline if r["layer"] == 2), key=lambda r: (r["step"], r["microbatch"]))[::-1]
    assert list(recent["policy"]) == [r["policy"] for r in last][: len(recent)]
    assert list(recent["reason"]) == [r["reason"] for r in last][: len(recent)]
    summary = frame(at, "policy", "samples", "mean_abs_rel_error")
    expected = canned(con, queries.PREDICTION_SUMMARY, run_id="fx")
    assert list(summary["policy"]) == [r["policy"] for r in expected]
    for col in ("samples", "mean_predicted_s", "mean_measured_s", "mean_abs_rel_error", "measured_over_predicted"):
        np.testing.assert_allclose(summary[col], [r[col] for r in expected], err_msg=col)
    # the timeline marks each (layer, step) with the decision made there
    fig = figures(at)["decision per layer over time"]["data"][0]
    names = fig["colorbar"]["ticktext"]
    z, xs, ys = _decode(fig["z"]), list(_decode(fig["x"])), list(_decode(fig["y"]))
    marks = {(int(x), int(y)): names[int(z[i, j])] for i, y in enumerate(ys) for j, x in enumerate(xs)}
    for r in timeline:
        if all(o["policy"] == r["policy"] for o in timeline if (o["step"], o["layer"]) == (r["step"], r["layer"])):
            assert marks[(r["step"], r["layer"])] == r["policy"]


# --------------------------------------------------------------------------- transfers
def test_transfers_figures_equal_sql(runs):
    at = select_run(app(runs, "transfers"), "fx")
    assert_ok(at)
    con = open_run(runs / "fx")
    tot = sql(con, "SELECT count(*) AS n, sum(bytes) AS b, sum(bytes) FILTER (WHERE stage = 1) AS relay "
                   "FROM transfer_detail")[0]
    m = metrics(at)
    assert m["transfers"] == f"{tot['n']:,}"
    assert m["expert state moved"] == f"{tot['b'] / (1 << 20):.2f} MiB"
    assert m["relay share"] == f"{100 * (tot['relay'] or 0) / tot['b']:.1f}%"
    per_step = canned(con, queries.TRANSFER_BYTES_PER_STEP, run_id="fx")
    assert m["max fan-out"] == str(max(r["max_fan_out"] for r in per_step))
    fig = figures(at)
    bars = fig["bytes per step bin"]["data"]
    summed = np.sum([_decode(t["y"]) for t in bars], axis=0) * (1 << 20)
    np.testing.assert_allclose(summed, [r["bytes"] for r in per_step])
    expected_busiest = [r["busiest_sender_bytes"] for r in per_step]
    if len(set(expected_busiest)) > 1:
        busiest = _decode(fig["busiest sender per layer-microbatch"]["data"][0]["y"]) * (1 << 20)
        np.testing.assert_allclose(busiest, expected_busiest)
    else:  # a flat line is replaced by one sentence naming the value
        assert "busiest sender per layer-microbatch" not in fig
        assert any(f"same {expected_busiest[0] / (1 << 20):g} MiB" in i.value for i in at.info)
    layers = frame(at, "layer", "transfers", "planned_microbatches")
    expected = canned(con, queries.TRANSFER_SUMMARY, run_id="fx")
    assert list(layers["transfers"]) == [r["transfers"] for r in expected]
    assert list(layers["bytes"]) == [r["bytes"] for r in expected]
    assert list(layers["planned_microbatches"]) == [r["planned_microbatches"] for r in expected]
    np.testing.assert_allclose(layers["measured_s"], [r["measured_s"] for r in expected])
    fan = frame(at, "expert", "copies", "max_fan_out")
    exp_fan = sql(con, "SELECT expert, sum(c) AS copies, max(c) AS max_fan_out FROM (SELECT step, microbatch, layer, "
                       "src, expert, count(*) AS c FROM transfer_detail GROUP BY ALL) GROUP BY expert")
    got = {int(e): (int(c), int(f)) for e, c, f in zip(fan["expert"], fan["copies"], fan["max_fan_out"])}
    assert got == {r["expert"]: (r["copies"], r["max_fan_out"]) for r in exp_fan}
    senders = sql(con, "SELECT src, sum(bytes) AS b FROM transfer_detail GROUP BY src ORDER BY b DESC, src")
    assert m["busiest sender"] == f"rank {senders[0]['src']}"


# --------------------------------------------------------------------------- compare
def test_compare_puts_policies_side_by_side_equal_sql(runs):
    at = select_run(app(runs, "compare"), "fx")
    assert_ok(at)
    assert set(at.multiselect(key="compare_runs").value) == {"fx", "fx-b"}  # same workload (kind, model, EP)
    table = frame(at, "run", "policy", "imbalance after (plan)")
    shown = {"plans": ("plans", 1), "share": ("share of layer calls", 1),
             "mean_imbalance_before": ("imbalance before", 1), "mean_imbalance_after": ("imbalance after (plan)", 1),
             "mean_transfer_bytes": ("MiB moved per layer call", 1 / (1 << 20)),
             "mean_measured_s": ("layer time ms (measured)", 1e3), "mean_predicted_s": ("layer time ms (predicted)", 1e3)}
    for run_id in ("fx", "fx-b"):
        con = open_run(runs / run_id)
        expected = {r["policy"]: r for r in canned(con, queries.POLICY_COMPARISON, run_id=run_id)}
        got = table[table["run"] == run_id].set_index("policy")
        assert set(got.index) == set(expected)
        for pol, r in expected.items():
            for col, (name, scale) in shown.items():
                assert got.loc[pol, name] == pytest.approx(scale * r[col]), (run_id, pol, col)
    bars = figures(at)["imbalance after (plan quality)"]["data"]
    from ultraep.dashboard.charts import policy_color

    assert all(t["marker"]["color"] == policy_color(t["name"]) for t in bars)


# --------------------------------------------------------------------------- SQL page
REFUSED = {
    "COPY": "COPY (SELECT 1 AS x) TO '{out}'",
    "read_text": "SELECT * FROM read_text('{secret}')",
    "ATTACH": "ATTACH '{out}.duckdb' AS x",
    "INSTALL": "INSTALL httpfs",
    "SET": "SET enable_external_access = true",
}


def test_sql_page_answers_queries_and_shows_a_chart(runs):
    at = select_run(app(runs, "sql"), "fx")
    q = "SELECT layer, avg(imbalance_after) AS after FROM layer_balance GROUP BY layer ORDER BY layer"
    at.text_area(key="sql_text").set_value(q)
    at.button[0].click().run()
    assert_ok(at)
    got = frame(at, "layer", "after")
    expected = sql(open_run(runs / "fx"), q)
    np.testing.assert_allclose(got["after"], [r["after"] for r in expected])
    assert figures(at)


def test_sql_page_refuses_file_access_extensions_and_settings(runs, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me")
    out = tmp_path / "leak.csv"
    at = select_run(app(runs, "sql"), "fx")
    for name, q in REFUSED.items():
        at.text_area(key="sql_text").set_value(q.format(out=out, secret=secret))
        at.button[0].click().run()
        assert not at.exception, (name, [e.value for e in at.exception])
        assert at.error and at.error[0].value.startswith("Refused"), name
        assert not any("do not read me" in str(df.value.to_dict()) for df in at.dataframe), name
    assert not out.exists() and not Path(f"{out}.duckdb").exists()


# The sandbox itself (the locked-down connection, the statement check): tests/test_sql_sandbox.py.


# --------------------------------------------------------------------------- live
def test_a_live_run_is_marked_and_its_new_rows_show_up(tmp_path):
    recs = record_run(tmp_path, "live", steps=2, ranks=(0,), close=False)
    at = app(tmp_path)
    assert_ok(at)
    assert at.sidebar.selectbox(key="ultraep_run").value == "live"
    assert "● live" in " ".join(c.value for c in at.caption)
    before = metrics(at)["layer-microbatch rows"]
    rec = recs[0]
    for layer in range(3):
        rec.record_plan(2, 0, layer, make_plan(2, 0, layer, "quota"))
    rec.flush()
    at.run()
    assert_ok(at)
    assert int(metrics(at)["layer-microbatch rows"].replace(",", "")) == int(before.replace(",", "")) + 3
    rec.close()
    at.run()  # the run closed: one full re-run, then no more refreshing
    assert "closed" in " ".join(c.value for c in at.caption)


def test_live_or_stalled_follows_the_newest_part(tmp_path):
    from ultraep.dashboard import runs as run_status

    recs = record_run(tmp_path, "open", steps=1, ranks=(0,), close=False)
    assert run_status.run_info_at(tmp_path / "open").status == "live"
    later = time.time() + run_status.LIVE_WINDOW_S + 60  # no part for longer than the window: stalled
    assert run_status.run_info_at(tmp_path / "open", now=later).status == "stalled"
    recs[0].close()
    assert run_status.run_info_at(tmp_path / "open", now=later).status == "closed"


def test_mirror_refresh_reads_only_new_parts(tmp_path):
    from ultraep.dashboard.mirror import RunMirror

    recs = record_run(tmp_path, "grow", steps=1, ranks=(0,), close=False)
    m = RunMirror(tmp_path / "grow")
    first = m.refresh()
    assert first > 0 and m.refresh() == 0
    n = m.facts("layer_facts").num_rows
    recs[0].record_plan(5, 0, 0, make_plan(5, 0, 0, "quota"))
    recs[0].flush()
    assert m.refresh() == 3  # layer_loads, plans and transfers parts of one flush
    assert m.facts("layer_facts").num_rows == n + 1
    recs[0].close()


# --------------------------------------------------------------------------- isolation, import hygiene, CLI
def test_dashboard_never_imports_torch_or_the_runtime(runs):
    code = textwrap.dedent(f"""
        import sys
        from streamlit.testing.v1 import AppTest
        for page in {list(PAGES)!r}:
            at = AppTest.from_file({str(APP)!r}, default_timeout=60)
            at.session_state["ultraep_root"] = {str(runs)!r}
            at.run()
            if page != "overview":
                at.switch_page(f"pages/{{page}}.py").run()
            assert not at.exception, [e.value for e in at.exception]
        bad = [m for m in sys.modules if m == "torch" or m.startswith(("torch.", "numba", "triton",
               "ultraep.planning", "ultraep.policies", "ultraep.kernels", "ultraep.sim.replay", "ultraep.cost",
               "ultraep.telemetry.recorder", "ultraep.telemetry.otel", "opentelemetry"))]
        print(bad)
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_dashboard_modules_do_no_io_at_import():
    code = textwrap.dedent("""
        import builtins, os, pathlib, sys
        import duckdb, numpy, pandas, plotly.graph_objects, pyarrow, pyarrow.compute, pyarrow.parquet, streamlit
        def refuse(*a, **k):
            raise AssertionError(f"I/O at import time: {a[:1]}")
        builtins.open = os.scandir = os.listdir = pathlib.Path.iterdir = pathlib.Path.glob = refuse
        import ultraep.dashboard.mirror, ultraep.dashboard.data, ultraep.dashboard.charts, ultraep.dashboard.cli
        import ultraep.dashboard.cache, ultraep.dashboard.runs, ultraep.dashboard.page_sql, ultraep.dashboard.sandbox
        import ultraep.dashboard.facts, ultraep.dashboard.dedupe
        import ultraep.dashboard.ui
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_cli_binds_localhost_by_default_and_refuses_bad_paths(runs, tmp_path, capsys):
    import argparse

    from ultraep.cli import COMMANDS, _Parser
    from ultraep.dashboard import cli
    from ultraep.errors import UltraEPError

    assert "ultraep.dashboard.cli" in COMMANDS
    parser = _Parser(prog="ultraep")
    cli.register(parser.add_subparsers(dest="command", parser_class=_Parser))

    def run(*argv):
        args = parser.parse_args(["dashboard", *argv])
        return args.func(args)

    assert run(str(runs), "--dry-run") == 0
    cmd = capsys.readouterr().out
    assert "--server.address 127.0.0.1" in cmd and "--root " + str(runs.resolve()) in cmd
    assert "--server.port 8501" in cmd
    with pytest.raises(UltraEPError, match="no such run directory"):
        run(str(tmp_path / "nope"))
    f = tmp_path / "x.duckdb"
    f.write_text("")
    with pytest.raises(UltraEPError, match="is a file"):
        run(str(f))
    with pytest.raises(UltraEPError, match="--port"):
        run(str(runs), "--port", "70000")
    assert isinstance(parser, argparse.ArgumentParser)
    # importing the subcommand does not import Streamlit (the ultraep CLI imports every subcommand)
    r = subprocess.run([sys.executable, "-c", "import sys, ultraep.dashboard.cli; "
                        "assert 'streamlit' not in sys.modules and 'duckdb' not in sys.modules"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_list_stats_handles_ragged_and_empty_lists():
    import pyarrow as pa

    from ultraep.dashboard.facts import list_stats

    arr = pa.array([[3, 1, 2], [], None, [5], [0, 0]], type=pa.list_(pa.int64()))
    mx, sm, ln = list_stats(arr.slice(0))
    assert list(mx) == [3, 0, 0, 5, 0] and list(sm) == [6, 0, 0, 5, 0] and list(ln) == [3, 0, 0, 1, 2]
    mx, sm, ln = list_stats(pa.chunked_array([arr.slice(3), arr.slice(0, 1)]))
    assert list(mx) == [5, 0, 3] and list(sm) == [5, 0, 6]
