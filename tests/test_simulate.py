"""Simulator: replay through every policy, summaries, plan budget, CLI end to end with JSON and telemetry."""

import json

import numpy as np
import pytest

from ultraep.cli import main
from ultraep.sim import build_cost_model, plan_stride, simulate
from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(SyntheticSpec(num_ranks=16, num_experts=32, num_layers=2, num_steps=24,
                                         imbalance=(1.5, 3.0), drift=0.25, seed=2))


def test_simulate_all_policies(trace):
    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    res = simulate(trace, cm)
    summary = {s["policy"]: s for s in res.summary()}
    assert list(summary) == ["none", "eplb", "quota", "feplb", "hybridep", "adaptive"]
    none, quota = summary["none"], summary["quota"]
    assert none["speedup_vs_none"] == 1.0 and none["replicas"] == 0 and none["transfer_bytes"] == 0
    assert none["imbalance_after"] == pytest.approx(none["imbalance_before"])
    assert quota["imbalance_after"] < quota["imbalance_before"] and quota["replicas"] > 0
    assert quota["speedup_vs_none"] > 1.0 and 0 < quota["pct_of_ideal"] <= 100.0
    assert summary["feplb"]["imbalance_after"] <= summary["feplb"]["imbalance_before"]
    for s in summary.values():
        assert s["layer_steps"] == 48 and s["imbalance_after_p99"] >= s["imbalance_after"] - 1e-9
    # adaptive is as fast as the best single policy up to its engine overhead, layer by layer
    per_layer = res.per_layer()
    for layer in (0, 1):
        best = min(per_layer[p][layer] for p in ("none", "eplb", "quota", "feplb", "hybridep"))
        assert per_layer["adaptive"][layer] <= best * 1.01
    assert len(res.decisions["adaptive"]) == 48


def test_budget_sets_the_stride_and_scales_eplb(trace):
    assert plan_stride(1000, 60, 30_000) == 2 and plan_stride(10, 2, 100) == 1 and plan_stride(10, 2, None) == 1
    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    res = simulate(trace, cm, ["none", "eplb"], max_plans=12, layers=[1])
    assert res.settings["stride"] == 2 and res.settings["layer_steps_per_policy"] == 12
    assert res.rows["eplb"]["step"].tolist() == list(range(0, 24, 2))


def test_simulate_two_workers_match_one(trace):
    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    one = simulate(trace, cm, ["none", "quota"], workers=1)
    done = []
    two = simulate(trace, cm, ["none", "quota"], workers=2, progress=lambda d, t: done.append((d, t)))
    assert np.allclose(one.rows["quota"]["time_s"], two.rows["quota"]["time_s"])
    assert done and done[-1] == (48, 48)


def test_cli_end_to_end(tmp_path, capsys):
    tr = tmp_path / "t.parquet"
    assert main(["trace", "synth", str(tr), "--ranks", "8", "--experts", "16", "--layers", "2", "--steps", "12",
                 "--imbalance", "1.5:2.5", "--drift", "0.2"]) == 0
    out = tmp_path / "sim.json"
    runs = tmp_path / "runs"
    rc = main(["simulate", str(tr), "--ranks", "8", "--topology", "h100-8x-ib", "--policies",
               "none,eplb,quota,feplb,hybridep,adaptive", "--json", str(out), "--out", str(runs), "--workers", "1",
               "--record-plans", "5", "--run-name", "t1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "quota" in text and "%ideal" in text
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["none", "eplb", "quota", "feplb", "hybridep", "adaptive"]
    for r in rows:
        assert {"policy", "imbalance_before", "imbalance_after", "pct_of_ideal", "speedup_vs_none"} <= set(r)
    assert sorted(p.name for p in runs.iterdir()) == sorted(f"t1-{p}" for p in
                                                            ("none", "eplb", "quota", "feplb", "hybridep", "adaptive"))
    from ultraep.telemetry import open_run

    con = open_run(runs / "t1-adaptive")
    n = con.execute("SELECT count(*) FROM decisions").fetchall()[0][0]
    assert n == 24
    kinds = con.execute("SELECT DISTINCT kind FROM runs").fetchall()
    assert kinds == [("simulation",)]


def test_cli_errors(tmp_path, capsys):
    tr = tmp_path / "t.parquet"
    main(["trace", "synth", str(tr), "--ranks", "4", "--experts", "8", "--steps", "2"])
    # a trace of global counts that names no EP size (a synthetic one keeps --ranks: issue 32)
    import dataclasses

    from ultraep.traces import Trace

    t = Trace.read(tr)
    bare = tmp_path / "bare.parquet"
    dataclasses.replace(t, meta=t.meta.model_copy(update={"extra": {}})).write(bare)
    assert main(["simulate", str(bare)]) == 2
    assert "pass --ranks R" in capsys.readouterr().err
    assert main(["simulate", str(tr), "--ranks", "4", "--policies", "none,magic"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err
    assert main(["simulate", str(tr), "--ranks", "3"]) == 2
    assert "must divide" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "nope.parquet"), "--ranks", "4"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["simulate", str(tr), "--ranks", "4", "--set", "scale_out.bandwidth_GBps=-3"]) == 2
    assert "topology.scale_out.bandwidth_GBps" in capsys.readouterr().err
    assert main(["trace", "info", str(tr)]) == 0
    assert json.loads(capsys.readouterr().out)["num_experts"] == 8


def test_replay_decides_and_commits_through_the_engine(trace, monkeypatch):
    """One decision loop: every replayed point is decided and committed by ``ultraep.engine.Engine`` (one per
    simulated policy), and the rows carry the engine's CostBreakdown terms under their own names."""
    from ultraep.engine import Engine
    from ultraep.plan import Plan
    from ultraep.policies import identity_plan

    calls = {"decide": 0, "commit": 0}
    decide, commit = Engine.decide, Engine.commit

    def counted_decide(self, *a, **k):
        calls["decide"] += 1
        return decide(self, *a, **k)

    def counted_commit(self, d):
        calls["commit"] += 1
        assert isinstance(d.plan, Plan)
        return commit(self, d)

    monkeypatch.setattr(Engine, "decide", counted_decide)
    monkeypatch.setattr(Engine, "commit", counted_commit)
    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    res = simulate(trace, cm, ["none", "quota", "adaptive"], workers=1)
    assert calls == {"decide": 3 * 48, "commit": 3 * 48}
    # the terms are the cost model's own, not a translation (no all-to-all split in halves)
    r = res.rows["none"]
    load = next(trace.layer_loads(0, 16))[2]
    bd = cm.predict(identity_plan("none", cm.topology, load))
    for term in ("compute_fwd_s", "a2a_fwd_s", "a2a_bwd_s", "weight_sync_s", "plan_s", "engine_s", "fwd_s", "bwd_s"):
        assert r[term][0] == pytest.approx(getattr(bd, term)), term
    assert r["time_s"][0] == pytest.approx(bd.total_s)
    # a policy shared with the adaptive engine advances once per point: its rows do not depend on adaptive
    alone = simulate(trace, cm, ["none", "eplb", "feplb"], workers=1).rows
    both = simulate(trace, cm, ["none", "eplb", "feplb", "adaptive"], workers=1).rows
    for p in ("eplb", "feplb"):
        assert np.array_equal(alone[p]["time_s"], both[p]["time_s"]), p
    # the adaptive engine reused the standalone engines' plans: its choice is predicted as that policy's time
    # plus the engine overhead. Every decision is checked against the policy it chose, replayed alone (this
    # fixture's adaptive picks hybridep: a check limited to quota never ran)
    picked = simulate(trace, cm, ["none", "quota", "hybridep", "adaptive"], workers=1)
    checked = 0
    for i, d in enumerate(picked.decisions["adaptive"]):
        assert d[3] in picked.rows, d
        assert picked.rows["adaptive"]["time_s"][i] >= picked.rows[d[3]]["time_s"][i], (i, d)
        checked += 1
    assert checked == len(picked.decisions["adaptive"]) == 48


def test_recorded_runs_use_the_engine_term_names(trace, tmp_path):
    from ultraep.sim import record
    from ultraep.telemetry import open_run

    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    res = simulate(trace, cm, ["none", "quota"], workers=1, layers=[0])
    record(res, tmp_path, run_name="r")
    con = open_run(tmp_path / "r-quota")
    got = con.execute("SELECT step, other['predicted.a2a_fwd_s'], other['predicted.compute_fwd_s'], "
                      "other['ideal_s'] FROM timings ORDER BY step").fetchall()
    r = res.rows["quota"]
    assert [g[0] for g in got] == r["step"].tolist()
    assert np.allclose([g[1] for g in got], r["a2a_fwd_s"]) and np.allclose([g[2] for g in got], r["compute_fwd_s"])
    assert np.allclose([g[3] for g in got], r["ideal_s"])
    cols = [c[0] for c in con.execute("DESCRIBE timings").fetchall()]
    keys = con.execute("SELECT DISTINCT unnest(map_keys(other)) FROM timings").fetchall()
    assert not any("dispatch" in k[0] or "combine" in k[0] for k in keys)  # no halves of the all-to-all
    assert "predicted_s" in cols or ("predicted_s",) in keys


def test_eplb_plus_next_to_eplb_and_charged(trace):
    """EPLB+ (EPLB fed the exact current load) is its own simulated policy, replayed next to historical eplb,
    with its planner on the critical path (0.153 ms, UltraEP Table 3); historical eplb plans off it."""
    from policies.eplb import EPLB_PLUS_PLAN_S

    cm = build_cost_model("h100-8x-ib", 16, 32, 2)
    res = simulate(trace, cm, ["none", "eplb", "eplb+"], workers=1)
    s = {x["policy"]: x for x in res.summary()}
    assert set(s) == {"none", "eplb", "eplb+"}
    assert np.allclose(res.rows["eplb+"]["plan_s"], EPLB_PLUS_PLAN_S)
    assert np.all(res.rows["eplb"]["plan_s"] == 0)
    # exact load from step 0: EPLB+ balances the first point, historical eplb has no history yet
    first = res.rows["eplb+"]["step"] == 0
    assert np.all(res.rows["eplb+"]["imbalance_after"][first] < res.rows["eplb"]["imbalance_after"][first])
    assert s["eplb+"]["imbalance_after"] < s["eplb"]["imbalance_after"]


def test_replicas_are_charged_as_the_runtime_cache_moves_them():
    """Residency as the runtime's replica cache keeps it (a replica is valid until its master changes): in
    training the masters change every step, so the first microbatch of a step sends every replica, historical
    eplb included, and a later microbatch of the same step sends only what is not resident; in prefill an
    unchanged placement moves nothing; ``resend_all_replicas`` charges every replica every time."""
    from ultraep.sim import sim_params

    tr = synthetic_trace(SyntheticSpec(num_ranks=16, num_experts=32, num_layers=1, num_steps=12, microbatches=2,
                                       imbalance=(2.0, 2.5), seed=3))
    res = {}
    for label, params in (("train", sim_params()), ("prefill", sim_params(mode="prefill")),
                          ("resend", sim_params(resend_all_replicas=True))):
        cm = build_cost_model("h100-8x-ib", 16, 32, 2, params=params)
        res[label] = simulate(tr, cm, ["none", "eplb"], workers=1, policy_options={"eplb": {"interval": 4}}).rows["eplb"]
    e = res["train"]
    placed = e["replicas"] > 0
    first, second = placed & (e["microbatch"] == 0), placed & (e["microbatch"] == 1)
    assert first.sum() >= 5 and np.all(e["weight_sync_s"][first] > 0) and np.all(e["transfer_bytes"][first] > 0)
    # a second microbatch keeps the step's placement unless eplb re-places right then (every 4th point): nothing
    # moves then
    assert second.sum() >= 5 and (e["weight_sync_s"][second] == 0).sum() >= second.sum() // 2
    p = res["prefill"]
    assert (p["weight_sync_s"][p["replicas"] > 0] == 0).mean() > 0.5  # only re-placements move weights
    r = res["resend"]
    assert np.all(r["weight_sync_s"][r["replicas"] > 0] > 0) and r["time_s"].sum() > e["time_s"].sum()


def test_cli_layers_reads_only_those_layers(tmp_path, monkeypatch, capsys):
    from ultraep.traces import Trace

    tr = tmp_path / "t.parquet"
    assert main(["trace", "synth", str(tr), "--ranks", "8", "--experts", "16", "--layers", "3", "--steps", "6"]) == 0
    seen = []
    read = Trace.read.__func__

    def spy(cls, path, *, layers=None):
        t = read(cls, path, layers=layers)
        seen.append((layers, t.layers.tolist()))
        return t

    monkeypatch.setattr(Trace, "read", classmethod(spy))
    out = tmp_path / "s.json"
    assert main(["simulate", str(tr), "--ranks", "8", "--topology", "h100-8x-ib", "--policies", "none,eplb,eplb+",
                 "--layers", "1", "--workers", "1", "--json", str(out), "--resend-replicas"]) == 0
    assert seen == [([1], [1])]  # the reader got the filter: only layer 1's rows were read
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["none", "eplb", "eplb+"] and rows[0]["settings"]["layers"] == [1]
    capsys.readouterr()
    assert main(["simulate", str(tr), "--ranks", "8", "--layers", "7", "--workers", "1"]) == 2
    assert "layer 7 is not in the trace" in capsys.readouterr().err
