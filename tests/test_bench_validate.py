"""benchmarks/bench_validate.py runs end to end on a tiny shape (issue 35): it measures every policy recorded, replays
the calibrate-on run's routing on its learned model, prints the validation table and adaptive against the best fixed
policy, and re-predicts the kept recordings (``--from``) to the same table. It crashed once with an AttributeError
nobody saw for a day; this keeps it from breaking silently again."""

from __future__ import annotations

import argparse
import math
import re
import os
import sys

import numpy as np
import pytest
import torch  # noqa: F401 - imported before fork so ranks start fast
import transformers  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_validate  # noqa: E402
from benchmarks.bench_runtime import Shape  # noqa: E402


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One tiny shape measured and recorded by the benchmark's own runner: (its rows, what adaptive ran, the calls
    behind the predictions, the dir)."""
    runs = tmp_path_factory.mktemp("validate") / "tiny"
    args = argparse.Namespace(slots=2, iters=4, warmup=1, seed=0, backend="gloo", calibrate_on="calibration",
                              max_iters_scale=1.0, resamples=40, interval_seed=0)
    rows, ran, calls = bench_validate._shape_rows(Shape("tiny", tokens=64, hidden=32, ffn=32), args, runs)
    return rows, ran, calls, runs


def test_every_policy_has_a_measured_and_a_predicted_layer_time(recorded):
    rows, ran, calls, _ = recorded
    assert [r[1] for r in rows] == ["none", "quota", "feplb", "adaptive"]
    for src, pol, m, p, mx, px, se, iv in rows:
        assert src == "tiny" and m > 0 and p > 0 and math.isfinite(m) and math.isfinite(p), (pol, m, p)
        assert mx == pytest.approx(rows[0][2] / m) and px == pytest.approx(rows[0][3] / p)
        assert se == 0.0 if pol == "none" else 0.0 < se < 1.0, (pol, se)  # the measured speed-up's own uncertainty
        # the predicted speed-up's 90 % interval, by the same statistic: it holds the point (none's is 1, 1)
        assert iv[0] <= px <= iv[1] and (iv == (1.0, 1.0) if pol == "none" else iv[0] < iv[1] or iv[0] == px), (pol, iv)
    assert rows[0][4] == 1.0 and rows[0][5] == 1.0
    # adaptive ran one policy or several, one decision per timed call (4 asked, rounded up to the 10 interleaving
    # orders of 5 runs: the four policies and the calibration run)
    assert sum(ran.values()) == 10 and set(ran) <= {"none", "quota", "feplb", "eplb", "hybridep"}
    # calibrated on the calibration run: in its 11 calls (1 warm-up step + 10 timed) its engine ran every policy
    # of the table. (At least once: it probes one candidate a decision, and with eplb among them a policy the model
    # predicts to lose may get a single call of the 11; CI saw none 4, quota 1, feplb 3 on 2026-11-27.)
    assert set(calls) == {"none", "quota", "feplb"} and sum(calls.values()) <= 11 and min(calls.values()) >= 1, calls


def test_the_inside_count_takes_each_measured_speed_up_against_its_interval():
    def rows(src, *hits):
        out = [(src, "none", 2.0, 2.0, 1.0, 1.0, 0.0, (1.0, 1.0))]
        for pol, measured in zip(("quota", "feplb", "adaptive"), hits):
            out.append((src, pol, 1.0, 1.0, measured, 1.5, 0.01, (1.4, 1.6)))
        return out

    a = rows("a", 1.45, 1.6, 1.4)  # inside, the bounds included
    b = rows("b", 1.45, 1.39, 1.5)  # negative control: one below its interval
    assert [bench_validate.inside(r) for r in a] == [None, True, True, True]
    assert [bench_validate.inside(r) for r in b] == [None, True, False, True]
    assert bench_validate.inside_counts([("a", a, {}, {}), ("b", b, {}, {})]) == (5, 6, 1, 2)
    no_interval = [r[:7] + (None,) for r in a]  # a source without intervals is not counted
    assert bench_validate.inside_counts([("a", no_interval, {}, {})]) == (0, 0, 0, 0)


def test_bad_interval_options_exit_with_one_line(monkeypatch):
    for argv, msg in ((["--resamples", "5"], "--resamples: must be 0 (no interval) or >= 20, got 5"),
                      (["--interval-seed", "-1"], "--interval-seed: must be >= 0, got -1")):
        monkeypatch.setattr(sys, "argv", ["bench_validate", "--shapes", "", *argv])
        with pytest.raises(SystemExit, match=re.escape(msg)):
            bench_validate.main()


def test_adaptive_against_the_best_fixed_policy():
    rows = [("s", "none", 2.0, 2.2, 1.0, 1.0), ("s", "quota", 1.0, 1.1, 2.0, 2.0), ("s", "feplb", 1.5, 1.0, 1.33, 2.2),
            ("s", "adaptive", 1.1, 1.05, 1.82, 2.1)]
    ratio, best, predicted = bench_validate.adaptive_vs_best(rows)
    # measured: adaptive 1.1 / quota 1.0 (the fastest fixed); predicted: 1.05 / feplb's 1.0 (the fastest predicted)
    assert (ratio, best, predicted) == (pytest.approx(1.1), "quota", pytest.approx(1.05))
    assert bench_validate.adaptive_vs_best(rows[:3]) is None


def test_from_a_recording_without_a_calibration_run_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "default" / "default-adaptive").mkdir(parents=True)  # recorded before the calibration run existed
    monkeypatch.setattr(sys, "argv", ["bench_validate", "--from", str(tmp_path), "--shapes", "default"])
    with pytest.raises(SystemExit, match="has no calibration run to calibrate on .*use --calibrate-on adaptive"):
        bench_validate.main()


def test_the_tables_print_and_from_re_predicts_the_same(recorded, capsys, monkeypatch):
    rows, ran, calls, runs = recorded
    out = bench_validate.print_tables([("tiny", rows, ran, calls)], "title")
    text = capsys.readouterr().out
    assert "adaptive / best fixed" in text and "worst |predicted / measured - 1|" in text and "calls behind" in text
    assert {r["metric"] for r in out} >= {"measured_layer_time", "predicted_layer_time",
                                          "measured_adaptive_vs_best_fixed", "calibration_calls",
                                          "measured_speedup_relative_se"}
    assert "its SE" in text and "largest standard error of a measured speed-up" in text
    assert "predicted 90 %" in text and "inside" in text and "measured speed-up inside the predicted 90 % interval" in text
    assert "with its SE" not in text  # the interval holds the run's own noise: no second count
    k, n, _, _ = bench_validate.inside_counts([("tiny", rows, ran, calls)])
    assert n == 3 and f"{k} of 3 speed-ups" in " ".join(text.split())
    assert {r["metric"] for r in out} >= {"predicted_speedup_lo90", "predicted_speedup_hi90",
                                          "measured_speedup_inside_90"}
    again, ran2, calls2 = bench_validate.recorded_rows(runs, "tiny", ["none", "quota", "feplb", "adaptive"],
                                                      "calibration", 1, resamples=40)
    assert again == rows and ran2 == ran and calls2 == calls  # deterministic: the recordings, re-predicted
    other, _, _ = bench_validate.recorded_rows(runs, "tiny", ["none", "quota", "feplb", "adaptive"], "calibration", 1,
                                               resamples=40, seed=1)
    assert [r[:7] for r in other] == [r[:7] for r in rows]  # another seed: the same points, its own draws
    # calibrated on the adaptive run instead, the calls behind each prediction are the ones its engine ran
    _, ran3, calls3 = bench_validate.recorded_rows(runs, "tiny", ["none", "quota", "feplb", "adaptive"], "adaptive", 1)
    assert sum(calls3.values()) <= 11 and all(calls3[p] >= ran3.get(p, 0) for p in calls3)
    # a fixed policy's run: its own calls are every prediction's, none of the others'
    _, _, calls4 = bench_validate.recorded_rows(runs, "tiny", ["none", "quota", "feplb", "adaptive"], "quota", 1)
    assert calls4 == {"none": 0, "quota": 11, "feplb": 0}
    # the summary line: the same recordings on the adaptive run's model
    args = argparse.Namespace(calibrate_on="calibration", warmup=1)
    bench_validate.print_adaptive_calibrated(runs.parent, [("tiny", rows, ran, calls)], ["none", "quota", "feplb",
                                                                                          "adaptive"], args)
    assert "calibrated on each shape's adaptive run instead" in capsys.readouterr().out
    # and on the calibrating run's model as its engine learned it, not anchored on that run's calls: the measured
    # side is the same, the predictions are the model's alone
    raw, _, _ = bench_validate.recorded_rows(runs, "tiny", ["none", "quota", "feplb", "adaptive"], "calibration", 1,
                                             anchor=False)
    assert [r[:3] for r in raw] == [r[:3] for r in rows] and all(p > 0 for _, _, _, p, _, _, _, _ in raw)
    assert all(r[7] is None for r in raw)  # no anchoring, nothing resampled
    bench_validate.print_unanchored(runs.parent, [("tiny", rows, ran, calls)], ["none", "quota", "feplb", "adaptive"],
                                    args)
    assert "not anchored on the calibrating runs' own calls" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["bench_validate", "--from", str(runs.parent), "--shapes", "nope"])
    with pytest.raises(SystemExit, match="--shapes: unknown shape 'nope'"):
        bench_validate.main()


def test_both_sides_reduce_the_same_calls_the_same_way():
    """Per layer the median of its calls, averaged over layers, warm-up and skipped steps left out: a mean of one side
    against a median of the other put a 2-layer model's `none` 6.5 % off (the demo, 2026-11-26)."""
    step = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    layer = [0, 1] * 5
    secs = [9.0, 9.0, 1.0, 3.0, 1.0, 3.0, 2.0, 5.0, 50.0, 4.0]  # step 0 is warm-up; layer 0's step 4 a slow outlier
    got = bench_validate.per_layer_median(step, layer, secs, 1, {0})
    assert got == pytest.approx((1.5 + 3.5) / 2)  # medians of (1, 1, 2, 50) and (3, 3, 5, 4)
    assert bench_validate.per_layer_median(step, layer, secs, 0, set()) == pytest.approx((2.0 + 4.0) / 2)
    assert math.isnan(bench_validate.per_layer_median(step, layer, secs, 9, set()))


def test_a_speed_ups_standard_error_shrinks_with_its_calls_and_pairing_removes_the_shared_drift():
    """The bootstrap's SE of a measured speed-up: a quarter with 16x the calls; and where both runs slow together
    step by step (bench_runtime interleaves them), pairing the steps sees through it."""
    rng = np.random.default_rng(1)

    def calls(n, drift):
        steps = np.arange(n)
        return steps, np.zeros(n, int), 1.0 + drift + 0.1 * rng.standard_normal(n)

    few = bench_validate.speedup_se(calls(20, 0), calls(20, 0), paired=False)
    many = bench_validate.speedup_se(calls(320, 0), calls(320, 0), paired=False)
    assert 0.02 < few < 0.06 and many == pytest.approx(few / 4, rel=0.35)
    drift = 0.5 * np.sin(np.arange(40))  # the machine's slow moments, the same for both runs
    a, b = calls(40, drift), calls(40, drift)
    assert bench_validate.speedup_se(a, b, paired=True) < 0.5 * bench_validate.speedup_se(a, b, paired=False)
    assert math.isnan(bench_validate.speedup_se(calls(1, 0), calls(1, 0), paired=True))


def test_cheap_shapes_get_more_timed_calls():
    from benchmarks.bench_runtime import SHAPES

    got = {k: bench_validate.timed_iters(s, 20) for k, s in SHAPES.items()}
    assert got["default"] == got["mixtral"] == got["e16"] == got["tok4096"] == 20
    assert got["tok64"] >= 5 * 20 and got["tok512"] == 40 and 20 < got["tok1024"] < 40
    assert all(v % 4 == 0 for v in got.values())  # whole rounds of the 4 interleaving orders
    assert bench_validate.timed_iters(SHAPES["tok64"], 20, max_scale=1.0) == 20
    assert bench_validate.timed_iters(Shape("tiny", tokens=1, hidden=8, ffn=8), 20) == 120  # at most 6x


def test_a_shape_with_more_calls_gets_a_longer_launch_limit():
    """The launcher's 600 s held 20 warm-up + 20 timed calls of 5 runs; 60 timed calls (the runs of record) of the costliest
    shape ran past it, so the limit grows with the calls."""
    from benchmarks.bench_runtime import launch_timeout

    assert launch_timeout(argparse.Namespace(warmup=20, iters=20), 5) == 600.0
    assert launch_timeout(argparse.Namespace(warmup=1, iters=3), 4) == 600.0
    assert launch_timeout(argparse.Namespace(warmup=20, iters=60), 5) == pytest.approx(1200.0)


def test_the_demo_is_the_users_command_with_more_steps_where_asked(tmp_path, capsys):
    """The validation measures ``ultraep demo`` as a user runs it; ``--demo-steps`` only lengthens its runs."""
    args = argparse.Namespace(quick_demo=False, demo_steps=None)
    cmd = bench_validate.demo_command(args, tmp_path)
    assert cmd[1:] == ["-m", "ultraep.cli", "demo", "--out", str(tmp_path)]
    args = argparse.Namespace(quick_demo=True, demo_steps=90)
    assert bench_validate.demo_command(args, tmp_path)[-3:] == ["--quick", "--steps", "90"]
    from ultraep.cli import main as cli_main

    with pytest.raises(SystemExit) as e:  # the flag it passes is the demo's own
        cli_main(["demo", "--help"])
    assert e.value.code == 0 and "--steps" in capsys.readouterr().out
