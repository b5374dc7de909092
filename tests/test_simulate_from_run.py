"""`ultraep simulate RUN --topology from-run` replays a recorded run on the cost model its engine learned, and a
preset replays it as a projection; the output says which figures were measured, predicted and projected
(issue 35, items 1 and 3)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch  # noqa: F401 - imported before fork so ranks start fast
import transformers  # noqa: F401

from dist_utils import run_ranks
from ultraep.cli import main
from ultraep.cost import CostParams, cost_model_from_record, cost_record
from ultraep.errors import ConfigError
from ultraep.models import build_model
from ultraep.telemetry import open_run


def _ids(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    # low token ids: skewed routing in the tiny model, so balancing has something to do
    return torch.randint(0, 40, (2, 32), generator=g)


def _recorded(rank, world, runs):
    import ultraep

    model = build_model("qwen3-moe")
    with ultraep.telemetry.Recorder.open(runs, "rec", world_size=world, rank=rank, flush_interval_s=None,
                                         config={"policy": "quota"}) as rec:
        rt = ultraep.runtime_of(ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec))
        for step in range(STEPS):  # the recorder keeps the engine's model at every step's end
            model(input_ids=_ids(rank, step)).logits.float().pow(2).mean().backward()
            rt.next_step()
    return cost_record(rt.engine.cost_model_for(rt.layers[0].layer))


#: steps of the recorded run: its calls after the first step (2 layers each) are what anchoring compares
STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    learned = run_ranks(_recorded, 2, str(runs))[0]
    return runs / "rec", learned


def test_the_runtime_records_the_cost_model_its_engine_learned(run):
    path, learned = run
    con = open_run(path)
    rows = con.execute("SELECT rank, step, extra_json FROM steps ORDER BY step, rank").fetchall()
    kept = [json.loads(x)["cost_model"] for r, _, x in rows if r == 0]
    assert len(kept) == STEPS and all(x is None for r, _, x in rows if r == 1)  # rank 0's copy only
    assert kept[-1] == json.loads(json.dumps(learned))  # the engine's model after the last step
    params = cost_model_from_record(kept[-1]).params
    assert params.compute_scale != CostParams().compute_scale  # calibrated on this machine, not the seed


def test_from_run_replays_the_runs_routing_on_its_own_model(run, tmp_path, capsys):
    path, learned = run
    out = tmp_path / "sim.json"
    assert main(["simulate", str(path), "--topology", "from-run", "--policies", "none,quota", "--json", str(out),
                 "--no-progress", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "predicted: every figure" in text and "measured: run rec ran policy quota" in text
    # the quota run measured no call of none and 12 of quota (6 steps x 2 layers): none's prediction rests on few
    # calls, and the output says so
    few = " ".join(text[text.index("few calls"):].split())
    assert "none 0 layer calls" in few and "calibration_config()" in few
    anchored = " ".join(text[text.index("anchored on the run's own calls"):].split())
    assert "calls moving" in anchored and "overhead moved" in anchored
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert rows["quota"]["basis"] == "predicted" and rows["quota"]["settings"]["num_ranks"] == 2
    m = rows["quota"]["measured"]
    # 2 layers x the steps after the first (a warm-up step)
    assert m["policy"] == "quota" and m["calls"] == 2 * (STEPS - 1) and m["measured_layer_ms"] > 0
    # what anchoring compared: every call after the first step, of each kind (moving expert weights or not)
    anchor = rows["quota"]["settings"]["anchor"]
    assert sum(k["calls"] for k in anchor.values()) == 2 * (STEPS - 1)
    assert rows["quota"]["settings"]["topology"] == learned["topology"]["name"]


def test_from_run_prints_and_writes_each_figures_90_percent_interval(run, tmp_path, capsys):
    """Item 8 of issue 56: every predicted layer time and speed-up gets an interval from the run's own compared steps,
    in the table and in the JSON; the same seed gives the same interval."""
    path, _ = run
    outs = [tmp_path / f"sim{i}.json" for i in range(2)]
    for out in outs:
        assert main(["simulate", str(path), "--topology", "from-run", "--policies", "none,quota", "--json", str(out),
                     "--no-progress", "--workers", "1", "--resamples", "40", "--interval-seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "ms/layer 90%" in text and "speedup 90%" in text
    line = " ".join(text[text.index("interval (90 %)"):].split())
    # the calls after the first step: STEPS - 1 steps compared
    assert f"a bootstrap of the run's {STEPS - 1} compared steps (40 resamples, seed 3)" in line
    rows = [{r["policy"]: r for r in json.loads(out.read_text())} for out in outs]
    assert rows[0]["quota"]["interval"] == rows[1]["quota"]["interval"]  # seeded
    iv = rows[0]["quota"]["interval"]
    lo, hi = iv["time_per_layer_ms"]
    assert lo <= rows[0]["quota"]["time_per_layer_ms"] <= hi
    lo, hi = iv["speedup_vs_none"]
    assert lo <= rows[0]["quota"]["speedup_vs_none"] <= hi
    kept = dict(rows[0]["quota"]["settings"]["interval"])
    assert kept.pop("policies") == {p: r["interval"] for p, r in rows[0].items()}
    assert kept == {"resamples": 40, "seed": 3, "steps": STEPS - 1}
    # recorded with --out, each simulated run's config carries them
    assert main(["simulate", str(path), "--topology", "from-run", "--policies", "none,quota", "--no-progress",
                 "--workers", "1", "--resamples", "40", "--interval-seed", "3", "--out", str(tmp_path / "sims"),
                 "--run-name", "iv", "--record-plans", "0"]) == 0
    capsys.readouterr()
    cfg = json.loads(open_run(tmp_path / "sims" / "iv-quota").execute("SELECT config_json FROM runs").fetchone()[0])
    assert cfg["interval"]["policies"]["quota"] == iv
    # wider than ±5 %: the table says so with the steps that would narrow it; within, it says nothing
    wide = max(iv["time_half_width"], iv["speedup_half_width"]) > 0.05
    assert ("wider than ±5 %: quota" in text) == wide
    # --resamples 0: no interval, and the output says the uncertainty is not known
    assert main(["simulate", str(path), "--topology", "from-run", "--policies", "none,quota", "--json", str(outs[0]),
                 "--no-progress", "--workers", "1", "--resamples", "0"]) == 0
    text = capsys.readouterr().out
    assert "ms/layer 90%" not in text and "interval: none (--resamples 0)" in text
    assert json.loads(outs[0].read_text())[0]["interval"] is None


@pytest.mark.parametrize("argv, flag", [
    (["--resamples", "5"], "--resamples: must be 0 (no interval) or >= 20, got 5"),
    (["--resamples", "-1"], "--resamples: must be 0 (no interval) or >= 20, got -1"),
    (["--interval-seed", "-2"], "--interval-seed: must be >= 0, got -2"),
])
def test_bad_interval_options_exit_2_with_one_line(run, capsys, argv, flag):
    path, _ = run
    assert main(["simulate", str(path), "--topology", "from-run", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1


def test_interval_options_apply_to_from_run_only(run, capsys):
    path, _ = run
    assert main(["simulate", str(path), "--topology", "gb200-nvl72", "--ranks", "8", "--tile-ranks",
                 "--resamples", "40", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--resamples: applies to --topology from-run only" in err and len(err.strip().splitlines()) == 1
    # negative control: the smallest number of resamples allowed runs
    assert main(["simulate", str(path), "--topology", "from-run", "--policies", "none", "--resamples", "20",
                 "--no-progress", "--workers", "1"]) == 0
    assert "interval (90 %)" in capsys.readouterr().out


def test_a_preset_projects_the_run_and_says_so(run, tmp_path, capsys):
    path, _ = run
    out = tmp_path / "sim.json"
    assert main(["simulate", str(path), "--topology", "gb200-nvl72", "--ranks", "8", "--tile-ranks", "--policies",
                 "none,quota", "--json", str(out), "--no-progress", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "projected: every figure" in text and "measured: run rec" in text
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert rows["none"]["basis"] == "projected" and rows["none"]["settings"]["num_ranks"] == 8


def test_from_run_refuses_what_would_not_be_the_runs_machine(run, tmp_path, capsys):
    path, _ = run
    assert main(["simulate", str(path), "--topology", "from-run", "--ranks", "4"]) == 2
    assert "--ranks: (4) must be the run's 2 ranks" in capsys.readouterr().err
    assert main(["simulate", str(path), "--topology", "from-run", "--set", "scale_out.bandwidth_GBps=5"]) == 2
    assert "--set" in capsys.readouterr().err
    assert main(["trace", "synth", str(tmp_path / "t.parquet"), "--ranks", "2", "--experts", "8", "--steps", "2"]) == 0
    assert main(["simulate", str(tmp_path / "t.parquet"), "--topology", "from-run"]) == 2
    assert "from-run needs a recorded ultraep run" in capsys.readouterr().err
    # a run that kept no cost model (a simulation's, or one recorded before the runtime kept it): one line
    assert main(["simulate", str(tmp_path / "t.parquet"), "--ranks", "2", "--policies", "none", "--out",
                 str(tmp_path / "runs"), "--run-name", "old", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(tmp_path / "runs" / "old-none"), "--topology", "from-run"]) == 2
    err = capsys.readouterr().err
    assert "recorded no cost model" in err and len(err.strip().splitlines()) == 1


def test_a_bad_cost_model_record_is_refused_by_field():
    from ultraep.sim import build_cost_model

    rec = json.loads(json.dumps(cost_record(build_cost_model("gb200-nvl72", 8, 64, 2))))
    rec["params"]["compute_scale"] = -1
    with pytest.raises(ConfigError, match=r"cost_model.params.compute_scale"):
        cost_model_from_record(rec)
    with pytest.raises(ConfigError, match="must hold exactly"):
        cost_model_from_record({"params": {}})


def test_the_runtime_records_the_expert_activations_each_rank_holds(run):
    """Per layer call and rank: rows the rank computes x the expert's activation width x dtype, without and with
    balancing; the canned query gives the busiest rank's peak against the mean rank."""
    from ultraep.presets import ExpertSpec
    from ultraep.telemetry import queries

    path, learned = run
    expert = ExpertSpec.model_validate(learned["expert"])
    # SwiGLU: the row (H) and its gate, up and activated product (3 x F) stay until the backward
    assert expert.activation_width == expert.hidden_size + 3 * expert.ffn_size
    con = open_run(path)
    got = con.execute(
        "SELECT t.rank, t.other['activation_bytes_before'], t.other['activation_bytes_after'], "
        "l.rank_load_before[t.rank + 1], l.rank_load_after[t.rank + 1] FROM timings t JOIN layer_loads l "
        "USING (run_id, step, microbatch, layer) ORDER BY ALL").fetchall()
    assert len(got) == 2 * 2 * STEPS  # ranks x layers x steps
    for _, before, after, rows_before, rows_after in got:
        assert before == rows_before * expert.activation_row_bytes and after == rows_after * expert.activation_row_bytes
    cols, rows = queries.run(con, queries.ACTIVATION_MEMORY)
    r = dict(zip(cols, rows[0]))
    assert r["peak_over_mean_before"] > 1.0 and r["peak_over_mean_after"] < r["peak_over_mean_before"]
    assert r["peak_busiest_after_MB"] < r["peak_busiest_before_MB"]


def test_the_simulator_reports_activation_memory_before_and_after(capsys, tmp_path):
    from ultraep.sim import build_cost_model, simulate
    from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace

    tr = synthetic_trace(SyntheticSpec(num_ranks=8, num_experts=64, num_steps=6, tokens_per_rank=1024,
                                       imbalance=(2.0, 2.0), per_source=True, seed=2))
    cm = build_cost_model("gb200-nvl72", 8, 64, 2)
    res = simulate(tr, cm, ("none", "quota"), max_plans=None)
    s = {x["policy"]: x for x in res.summary()}
    row_bytes = cm.expert.activation_row_bytes
    load = next(tr.layer_loads(0, 8))[2]
    home = load.sum(axis=0).reshape(8, 8).sum(axis=1)  # rows each rank computes without balancing, step 0
    assert res.rows["none"]["act_busiest_before"][0] == home.max() * row_bytes
    assert res.rows["none"]["act_mean"][0] == pytest.approx(home.mean() * row_bytes)
    assert s["none"]["activation_peak_after_MB"] == s["none"]["activation_peak_before_MB"]
    assert s["quota"]["activation_peak_after_MB"] < 0.6 * s["quota"]["activation_peak_before_MB"]
    assert s["quota"]["activation_mean_MB"] == pytest.approx(s["none"]["activation_mean_MB"])
    tr.write(tmp_path / "t.parquet")
    assert main(["simulate", str(tmp_path / "t.parquet"), "--policies", "none,quota", "--no-progress"]) == 0
    assert "expert activations per rank (MB)" in capsys.readouterr().out


def test_a_run_recorded_before_call_overhead_learns_it_from_its_timings(tmp_path):
    """A cost model recorded without ``call_overhead_s`` (older runs) gets it as the engine's calibrator would have
    learned it: per call, the slowest rank's layer time minus the terms the engine observes (compute, copies and
    planning the slowest rank's, each all-to-all exchange the fastest rank's), weights max(0.2, 1/n) in call order."""
    from ultraep.sim import build_cost_model
    from ultraep.sim.from_run import recorded_cost_model
    from ultraep.telemetry import Recorder

    old = json.loads(json.dumps(cost_record(build_cost_model("gb200-nvl72", 2, 8, 2))))
    del old["params"]["call_overhead_s"]
    recs = [Recorder.open(tmp_path, "old", world_size=2, rank=r, flush_interval_s=None) for r in (0, 1)]
    for step in range(3):
        for r, rec in enumerate(recs):
            slow = 1.0 + r  # rank 1 computes twice as long; rank 0's exchanges are the fastest
            rec.record_timings(step, 0, 0, {
                "measured_s": 1.0 + 0.1 * step, "plan_s": 0.001, "dispatch_s": 0.010 * slow, "combine_s": 0.020 * slow,
                "combine_bwd_s": 0.005 * slow, "dispatch_bwd_s": 0.005 * slow, "measured.compute_fwd_s": 0.2 * slow,
                "measured.compute_bwd_s": 0.3 * slow, "measured.copy_s": 0.0})
        recs[0].record_step(step, extra={"cost_model": old})
    for rec in recs:
        rec.close()
    # every call: terms 0.4 + 0.6 + (0.010 + 0.020) + (0.005 + 0.005) + 0 + 0.001 = 1.041 s; layer 1.0, 1.1, 1.2 s
    # -> residuals 0 (clamped), 0.059, 0.159; weights 1, 1/2, 1/3: 0 -> 0.0295 -> 0.0295 * 2/3 + 0.159 / 3 = 0.0727
    cm = recorded_cost_model(tmp_path / "old", "old")
    assert cm.params.call_overhead_s == pytest.approx(0.0295 * 2 / 3 + 0.159 / 3)
    rec = json.loads(json.dumps(old))
    rec["params"]["call_overhead_s"] = 0.5  # a run that recorded it keeps its own
    with Recorder.open(tmp_path, "new", flush_interval_s=None) as r:
        r.record_step(0, extra={"cost_model": rec})
    assert recorded_cost_model(tmp_path / "new", "new").params.call_overhead_s == 0.5


def test_the_few_calls_line_names_only_the_policies_measured_few_times():
    from rich.console import Console

    from ultraep.cli.simulate import print_basis

    measured = {"run_id": "r", "policy": "adaptive", "chosen": {"quota": 40, "feplb": 3}, "calls": 43,
                "measured_layer_ms": 1.0, "predicted_layer_ms": 1.0}
    settings = {"topology": "t", "num_ranks": 2, "reported": ["none", "quota", "feplb", "adaptive"]}
    console = Console(record=True, width=300)
    print_basis("predicted", settings, measured, console)
    text = console.export_text()
    assert "measured none 0, feplb 3 layer calls" in text  # quota's 40 calls are enough; adaptive is not a policy run
    console = Console(record=True, width=300)
    print_basis("projected", settings, measured, console)  # a projection says what it is, no calibration advice
    assert "few calls" not in console.export_text()


def test_anchoring_moves_each_kind_of_call_by_what_the_model_missed(run):
    """The anchored model reproduces the run's own calls: every call after the first step is compared with the
    prediction of the policy that ran it, per kind of call; a model that over-predicts every call by 50 ms is seen
    as exactly 50 ms further off, and anchoring takes that back (item 2: fix the model, not the table)."""
    from ultraep.sim.from_run import ANCHOR_MIN_CALLS, anchored_cost_model, recorded_cost_model
    from ultraep.traces import load_trace

    path, _ = run
    trace = load_trace(path, "recorded-run")
    cm = recorded_cost_model(path, "rec")
    # the same predictions with the calls moving weights not clamped at 0 overhead (a negative transfer_call_overhead_s
    # below -call_overhead_s predicts 0), so that 50 ms more call overhead is 50 ms more in both kinds of call
    p = cm.params
    cm = cm.with_params(p.model_copy(update={"transfer_call_overhead_s": max(p.transfer_call_overhead_s,
                                                                             -p.call_overhead_s)}))
    _, first = anchored_cost_model(path, "rec", cm, trace)
    assert sum(s.calls for s in first.values()) == 2 * (STEPS - 1)
    p = cm.params
    long = cm.with_params(p.model_copy(update={"call_overhead_s": p.call_overhead_s + 0.05}))
    fixed, off = anchored_cost_model(path, "rec", long, trace)
    assert off.keys() == first.keys()
    for kind, s in first.items():
        assert off[kind].calls == s.calls
        assert off[kind].median_s == pytest.approx(s.median_s - 0.05, abs=1e-9)
    # 50 ms against calls that vary by a few ms: a kind measured often enough is moved back by nearly all of it, and
    # the model it gives sees what the shift left of the miss
    often = [k for k, s in off.items() if s.calls >= ANCHOR_MIN_CALLS]
    assert often
    _, again = anchored_cost_model(path, "rec", fixed, trace)
    q = fixed.params
    moving = {"plain": q.call_overhead_s, "transfer": q.call_overhead_s + q.transfer_call_overhead_s}
    for kind in often:
        assert off[kind].shift_s == pytest.approx(off[kind].median_s, rel=0.05)
        if moving[kind] > 0:  # (a kind the shift took below 0 overhead is predicted at 0: the model's floor)
            assert again[kind].median_s == pytest.approx(off[kind].median_s - off[kind].shift_s, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0), min_size=0, max_size=60), st.floats(-0.5, 0.5))
def test_a_shift_never_exceeds_the_median_and_needs_enough_calls(noise, offset):
    """Every kind's shift lies between 0 and the median of its differences, is 0 below ANCHOR_MIN_CALLS calls, and a
    shift the calls' spread cannot tell from noise is shrunk toward 0."""
    from ultraep.sim.from_run import ANCHOR_MIN_CALLS, _shift

    diff = np.asarray(noise, dtype=np.float64) + offset
    s = _shift(diff)
    assert s.calls == len(noise)
    if len(noise) < ANCHOR_MIN_CALLS:
        assert s.shift_s == 0.0 and s.se_s is None
        return
    assert s.median_s == pytest.approx(float(np.median(diff)))
    assert 0.0 <= s.shift_s / s.median_s <= 1.0 if s.median_s else s.shift_s == 0.0
    if s.se_s >= abs(s.median_s):  # no further from 0 than one standard error: nothing moves
        assert s.shift_s == 0.0


def test_a_constant_miss_is_shifted_whole_and_pure_noise_barely():
    from ultraep.sim.from_run import _shift

    rng = np.random.default_rng(0)
    assert _shift(0.004 + 1e-4 * rng.standard_normal(80)).shift_s == pytest.approx(0.004, rel=0.01)
    # zero-mean noise (12 calls of a layer varying 1 %): what is left of the medians after shrinking is under half
    noise = [_shift(np.random.default_rng(seed).standard_normal(12) * 0.01) for seed in range(40)]
    assert sum(abs(s.shift_s) for s in noise) < 0.5 * sum(abs(s.median_s) for s in noise)
