"""benchmarks/replay_long.py: the engine of this checkout replayed on bench_long's recorded calls (issue 56)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import replay_long
from benchmarks.common import adaptive_options
from benchmarks.bench_long import FIXED, Shape, write_calls

N = 60


def _recording(path, times: dict[str, float], extra: dict[str, float] | None = None) -> str:
    """A --calls-out CSV of N calls: each fixed policy measures ``times[policy]`` s every call (planning 1 ms); the
    recorded adaptive ran ``none`` with planning 1 ms + ``extra[kind]`` for its decisions' kinds (idle, cheapest)."""
    extra = extra or {}
    res = {}
    for p in FIXED:
        res[p] = {"t": np.full(N, times[p]), "measured": np.full(N, times[p]), "predicted": np.full(N, times[p]),
                  "plan": np.full(N, 1e-3), "chosen": [p] * N, "probe": [False] * N, "reason": [""] * N}
    kinds = ["idle: none in force" if i % 3 else "cheapest (kept)" for i in range(N)]
    res["adaptive"] = {"t": np.full(N, times["none"]), "measured": np.full(N, times["none"]),
                       "predicted": np.full(N, times["none"]),
                       "plan": np.array([1e-3 + extra.get(replay_long.kind_of(k), 0.0) for k in kinds]),
                       "chosen": ["none"] * N, "probe": [False] * N, "reason": kinds}
    write_calls(res, str(path))
    return str(path)


def test_deciding_costs_are_read_per_kind_from_the_recording(tmp_path):
    import gzip

    plain = _recording(tmp_path / "c.csv", {p: 0.02 for p in FIXED}, {"idle": 0.2e-3, "cheapest": 1.5e-3})
    with open(plain, "rb") as f, gzip.open(tmp_path / "c.csv.gz", "wb") as g:
        g.write(f.read())
    rec = replay_long.read_calls(str(tmp_path / "c.csv.gz"))  # a committed recording is gzipped
    assert np.array_equal(rec["none"]["t"], replay_long.read_calls(plain)["none"]["t"])
    cost = replay_long.deciding_cost(rec)
    assert cost["idle"] == pytest.approx(0.2e-3) and cost["cheapest"] == pytest.approx(1.5e-3)
    assert cost[""] == pytest.approx((2 * 0.2e-3 + 1.5e-3) / 3, rel=0.05)  # the mean over every recorded decision


def test_the_replay_runs_what_the_recording_measured(tmp_path):
    """The replayed engine's calls cost what its chosen policy measured: where ``none`` measured half of every other
    policy it ends on ``none``; where quota measured a quarter of the others (the negative control: the same model,
    other recorded times) it ends on quota."""
    shape = Shape()
    slow = {p: 0.04 for p in FIXED}
    times = {**slow, "none": 0.02}
    got = replay_long.replay(replay_long.read_calls(_recording(tmp_path / "a.csv", times)), shape, 0)
    assert got["chosen"][-10:] == ["none"] * 10
    assert set(got["chosen"]) > {"none"}  # it explored: other calls cost what those policies measured
    assert got["t"] == pytest.approx([times[c] for c in got["chosen"]])  # (this recording's deciding costs are 0)
    got = replay_long.replay(replay_long.read_calls(_recording(tmp_path / "b.csv", {**slow, "quota": 0.01})), shape, 0)
    assert got["chosen"][-10:] == ["quota"] * 10


def test_the_replay_says_what_deciding_cost_the_run(tmp_path, capsys, monkeypatch):
    """Each replayed call carries its kind's deciding cost (``decide``, inside ``t``); the CLI reports it as a share of
    the best fixed policy's time, and the windows within 3 % without it. The control: a recording whose decisions cost
    nothing beyond the fixed policies' planning reports 0.00 %."""
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path, raising=False)
    times = {**{p: 0.04 for p in FIXED}, "none": 0.02}
    costly = _recording(tmp_path / "a.csv", times, {"idle": 0.2e-3, "cheapest": 1.5e-3})
    rec = replay_long.read_calls(costly)
    got = replay_long.replay(rec, Shape(), 0)
    cost = replay_long.deciding_cost(rec)
    assert set(np.round(got["decide"], 9)) <= {round(v, 9) for v in cost.values()} and got["decide"].min() > 0
    assert got["t"] == pytest.approx([times[c] for c in got["chosen"]] + got["decide"])
    none_s = rec["none"]["t"].sum()
    assert replay_long.main([costly, "--window", "20", "--repeats", "1"]) == 0  # (unjittered: the same path)
    out = capsys.readouterr().out
    assert f"{got['decide'].sum() / none_s:.2%} of the best fixed policy's time" in out
    free = _recording(tmp_path / "b.csv", times)
    assert replay_long.main([free, "--window", "20"]) == 0
    assert "0.00% of the best fixed policy's time" in capsys.readouterr().out


def test_a_recording_that_cannot_be_replayed_is_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("policy,call,t_s,measured_s,predicted_s,plan_s,chosen,probe,reason\nnone,0,0.1,0.1,0.1,0.001,none,0,\n")
    assert replay_long.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "quota" in err and "Traceback" not in err
    assert replay_long.main([str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_jittered_replays_are_samples_of_the_same_run(tmp_path, capsys, monkeypatch):
    """Each replay multiplies every call by its own draw of exp(N(0, jitter)): draws differ from each other and from the
    unjittered replay by about the jitter; the CLI replays each recording ``--repeats`` times and reports their mean."""
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path, raising=False)
    rec = replay_long.read_calls(_recording(tmp_path / "a.csv", {**{p: 0.04 for p in FIXED}, "none": 0.02}))
    plain = replay_long.replay(rec, Shape(), 0)["t"]
    a, b = (replay_long.replay(rec, Shape(), 0, jitter=0.01, draw=k)["t"] for k in (0, 1))
    assert not np.allclose(a, b) and not np.allclose(a, plain)
    assert np.std(np.log(a[-20:] / plain[-20:])) == pytest.approx(0.01, rel=0.5)  # (the same policy: none)
    assert replay_long.main([str(tmp_path / "a.csv"), "--repeats", "2", "--window", "20"]) == 0
    out = capsys.readouterr().out
    assert "2 replay(s) each" in out and "a.csv" in out and "x 2 replay(s)" in out


def test_an_adaptive_option_is_weighed_on_the_recorded_calls(tmp_path, capsys, monkeypatch):
    """``--option KEY=VALUE`` reaches the replayed engine (``explore_share=null``: every decision weighs, so ``none``'s
    decisions neither idle nor settle) and names its rows; a key or value AdaptiveOptions refuses exits 2 naming the
    field and the value, without a traceback."""
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path, raising=False)
    path = _recording(tmp_path / "a.csv", {**{p: 0.04 for p in FIXED}, "none": 0.02})
    rec = replay_long.read_calls(path)
    plain, off = (replay_long.replay(rec, Shape(), 0, o)["kinds"] for o in ({}, {"explore_share": None}))
    assert plain["idle"] + plain["settled"] > N // 2 and off["idle"] + off["settled"] == 0
    assert adaptive_options(["probe_every=0", "explore_share=null"]) == {"probe_every": 0, "explore_share": None}
    assert replay_long.main([path, "--window", "20", "--repeats", "1", "--option", "explore_share=null"]) == 0
    assert "(explore_share=None)" in capsys.readouterr().out
    import csv

    with open(tmp_path / "replay_long.csv") as f:
        providers = {r["provider"] for r in csv.DictReader(f)}
    assert "adaptive[explore_share=None]" in providers
    for bad, says in (("probe_every", "KEY=VALUE"), ("probe_shar=0.1", "adaptive.probe_shar"),
                      ("probe_share=-1", "adaptive.probe_share = -1"), ("probe_every=abc", "'abc'")):
        assert replay_long.main([path, "--option", bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def test_the_replayed_engine_learns_what_its_decisions_cost_on_the_runtime(tmp_path):
    """Each replayed call's planning (its policy's recorded plan_s plus its decision kind's cost) reaches the engine, so
    its own overhead, which the exploration budget charges each weighing, calibrates as on the runtime: near the 1.5 ms
    the recording's weighings cost beyond planning. The control: a recording whose decisions cost nothing beyond their
    planning leaves it lower by that much."""
    times = {**{p: 0.04 for p in FIXED}, "none": 0.02}
    costly = replay_long.read_calls(_recording(tmp_path / "a.csv", times, {"idle": 0.2e-3, "cheapest": 1.5e-3}))
    free = replay_long.read_calls(_recording(tmp_path / "b.csv", times))
    assert replay_long.replay(costly, Shape(), 0)["overhead_s"] - replay_long.replay(free, Shape(), 0)["overhead_s"] \
        == pytest.approx(1.5e-3, rel=0.3)
