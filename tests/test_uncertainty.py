"""A from-run prediction says how sure it is (issue 56, item 8): the anchoring's calls resampled by step, the model
re-anchored per resample and every replayed call re-predicted (``ultraep.sim.uncertainty``)."""

import numpy as np
import pytest

from ultraep.cost import CostParams
from ultraep.sim import build_cost_model, simulate
from ultraep.sim.from_run import AnchorCalls, anchor
from ultraep.sim.uncertainty import (bounds, chooser_ran, half_width, predicted_times, resampled_overheads,
                                     resampled_sums, resampled_times, run_noise, steps_for, summary_intervals)
from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace

PARAMS = CostParams(call_overhead_s=0.002, transfer_call_overhead_s=0.001)


def _calls(steps: int, sd: float, seed: int = 0, per_step: int = 4) -> AnchorCalls:
    """``steps`` steps of ``per_step`` calls, half of each step's moving weights; each kind ran 3 ms (plain) and
    8 ms (moving) over the model, plus normal noise of ``sd`` seconds."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.arange(steps), per_step)
    transfer = np.tile(np.arange(per_step) % 2 == 1, steps)
    diff = np.where(transfer, 0.008, 0.003) + sd * rng.standard_normal(step.size)
    return AnchorCalls(step, transfer, diff)


def _width(over) -> float:
    lo, hi = bounds(over.moving_s)
    return hi - lo


def test_noisier_calls_give_a_wider_interval_and_identical_calls_none():
    quiet = resampled_overheads(_calls(30, 0.001), PARAMS, 400, seed=0)
    noisy = resampled_overheads(_calls(30, 0.004), PARAMS, 400, seed=0)
    assert _width(noisy) > 2.5 * _width(quiet) > 0  # the median's spread goes with the calls' spread
    same = resampled_overheads(AnchorCalls(np.repeat(np.arange(30), 2), np.tile([False, True], 30),
                                           np.tile([0.003, 0.008], 30)), PARAMS, 400, seed=0)
    # every resample sees the same differences: the same shifts, the point model's overheads, no width
    assert np.ptp(same.plain_s) == 0.0 and np.ptp(same.moving_s) == 0.0
    assert same.plain_s[0] == pytest.approx(0.002 + 0.003) and same.moving_s[0] == pytest.approx(0.003 + 0.008)


def test_the_resample_is_seeded():
    calls = _calls(30, 0.004)
    a, b = (resampled_overheads(calls, PARAMS, 100, seed=7) for _ in range(2))
    assert np.array_equal(a.moving_s, b.moving_s) and np.array_equal(a.plain_s, b.plain_s)
    other = resampled_overheads(calls, PARAMS, 100, seed=8)  # negative control: another seed draws otherwise
    assert not np.array_equal(a.moving_s, other.moving_s)


def test_the_width_narrows_as_one_over_the_square_root_of_the_steps():
    widths = {n: np.mean([_width(resampled_overheads(_calls(n, 0.004, seed=s), PARAMS, 400, seed=s))
                          for s in range(6)]) for n in (30, 120)}
    assert widths[120] == pytest.approx(widths[30] / 2, rel=0.3)
    # so a half-width of 10 % from 30 steps needs 4x the steps for 5 %, and one within 5 % needs none more
    assert steps_for(30, 0.10) == 120 and steps_for(30, 0.04) == 30


def test_a_kind_too_rare_to_shift_is_unshifted_at_the_point_but_its_interval_spans_its_calls():
    """Anchoring leaves a kind of fewer than ANCHOR_MIN_CALLS calls unshifted: too few to tell a shift from noise. The
    interval does not claim that certainty: each resample moves that kind by its drawn calls' median, so the interval
    spans what those calls say the model missed."""
    from ultraep.sim.from_run import ANCHOR_MIN_CALLS

    calls = _calls(30, 0.004, per_step=2)  # 30 calls of each kind: plain 3 ms over the model, moving 8 ms
    rare = ~calls.transfer & (calls.step >= 30 - (ANCHOR_MIN_CALLS - 1))  # the last plain calls, 3 of them
    keep = calls.transfer | rare
    few = AnchorCalls(calls.step[keep], calls.transfer[keep], calls.diff_s[keep])
    point, shifts = anchor(build_cost_model("gb200-nvl72", 4, 16, 2).with_params(PARAMS), few)
    assert shifts["plain"].shift_s == 0.0 and point.params.call_overhead_s == PARAMS.call_overhead_s
    over = resampled_overheads(few, PARAMS, 400, seed=0)
    lo, hi = bounds(over.plain_s)
    diffs = few.diff_s[~few.transfer]
    base = PARAMS.call_overhead_s
    assert lo < base + float(np.median(diffs)) < hi and hi - lo > 0.002  # around the 3 ms the calls say
    assert max(0.0, base + diffs.min()) <= lo and hi <= base + diffs.max()
    # negative control: a kind the run never ran is not moved by any resample
    only_moving = AnchorCalls(calls.step[calls.transfer], calls.transfer[calls.transfer], calls.diff_s[calls.transfer])
    over = resampled_overheads(only_moving, PARAMS, 200, seed=0)
    assert np.ptp(over.moving_s) > 0 and np.all(over.plain_s == PARAMS.call_overhead_s)


def test_no_interval_from_fewer_than_two_steps_or_no_resample():
    assert resampled_overheads(_calls(1, 0.004), PARAMS, 400) is None
    assert resampled_overheads(_calls(30, 0.004), PARAMS, 0) is None
    assert resampled_overheads(_calls(2, 0.004), PARAMS, 20) is not None  # negative control: two steps are enough


@pytest.fixture(scope="module")
def replay():
    tr = synthetic_trace(SyntheticSpec(num_ranks=4, num_experts=16, num_steps=12, tokens_per_rank=512,
                                       imbalance=(2.0, 2.0), per_source=True, seed=3))
    cm = build_cost_model("gb200-nvl72", 4, 16, 2).with_params(PARAMS)
    return tr, cm


def test_re_predicting_a_call_is_exact_under_the_resamples_overheads(replay):
    """Each resample's re-prediction is what a replay on that resample's re-anchored model predicts, call by call,
    for every fixed policy (their plans do not depend on the cost model)."""
    tr, cm = replay
    calls = _calls(30, 0.004)
    point, _ = anchor(cm, calls)
    res = simulate(tr, point, ("none", "quota", "feplb"), max_plans=None)
    over = resampled_overheads(calls, cm.params, 20, seed=1)
    for b in (0, 7):
        plain, moving = float(over.plain_s[b]), float(over.moving_s[b])
        other = point.with_params(point.params.model_copy(update={"call_overhead_s": plain,
                                                                  "transfer_call_overhead_s": moving - plain}))
        again = simulate(tr, other, ("none", "quota", "feplb"), max_plans=None)
        for p in ("none", "quota", "feplb"):
            got = resampled_times(res.rows[p], over)[b]
            np.testing.assert_allclose(got, again.rows[p]["time_s"], rtol=1e-12, atol=1e-15)
            assert resampled_sums(res.rows[p], over, noise=False)[b] == pytest.approx(got.sum(), rel=1e-12)
            # with a new run's noise: the sum of the same draws predicted_times adds, call by call
            full = predicted_times(res.rows[p], over, p)[b]
            assert resampled_sums(res.rows[p], over, p)[b] == pytest.approx(full.sum(), rel=1e-12)
            assert not np.allclose(full, got)  # negative control: the noise moves the calls
    # negative control: the two kinds' overheads swapped, a policy whose calls move weights is re-predicted wrong
    swapped = type(over)(over.moving_s, over.plain_s, over.steps)
    assert not np.allclose(resampled_times(res.rows["quota"], swapped)[0], again.rows["quota"]["time_s"])


def test_summary_intervals_hold_the_point_and_flag_what_is_wider_than_5_percent(replay):
    tr, cm = replay
    calls = _calls(30, 0.004)
    point, _ = anchor(cm, calls)
    res = simulate(tr, point, ("none", "quota"), max_plans=None)
    summary = {s["policy"]: s for s in res.summary()}
    iv = summary_intervals(res.rows, ["none", "quota"], resampled_overheads(calls, cm.params, 400, seed=0))
    for p in ("none", "quota"):
        lo, hi = iv[p]["time_per_layer_ms"]
        assert lo <= summary[p]["time_per_layer_ms"] <= hi and hi > lo
        assert iv[p]["steps"] == 30 and iv[p]["resamples"] == 400
    assert iv["none"]["speedup_vs_none"] == [1.0, 1.0]
    lo, hi = iv["quota"]["speedup_vs_none"]
    assert lo <= summary["quota"]["speedup_vs_none"] <= hi
    w = max(iv["quota"]["time_half_width"], iv["quota"]["speedup_half_width"])
    assert iv["quota"]["steps_for_5pct"] == steps_for(30, w)
    # with a fixed time per step outside the layers, the same draws weigh less: a narrower speed-up interval
    fixed = summary_intervals(res.rows, ["quota"], resampled_overheads(calls, cm.params, 400, seed=0),
                              step_fixed_s=0.5)
    assert fixed["quota"]["speedup_half_width"] < iv["quota"]["speedup_half_width"]


def test_half_width_is_the_larger_side_over_the_point():
    assert half_width(1.0, 0.98, 1.10) == pytest.approx(0.10)
    assert half_width(2.0, 1.8, 2.1) == pytest.approx(0.10)
    assert half_width(1.0, 1.0, 1.0) == 0.0


def test_the_note_says_how_many_more_steps_narrow_a_wide_interval():
    from rich.console import Console

    from ultraep.cli.simulate import print_intervals

    def text(ivs, resamples=400, steps=29):
        console = Console(record=True, width=400)
        print_intervals(ivs, {"steps": steps, "resamples": resamples, "seed": 0}, console)
        return console.export_text()

    wide = {"quota": {"time_half_width": 0.03, "speedup_half_width": 0.10, "steps_for_5pct": 116}}
    out = text(wide)
    assert "a bootstrap of the run's 29 compared steps (400 resamples, seed 0)" in out
    assert "wider than ±5 %: quota speed-up ±10.0 %; about 87 more calibration steps (116 in all" in out
    assert "ms/layer ±" not in out  # the layer time's ±3 % is within 5 %
    # negative control: an interval within ±5 % gets no note
    assert "wider than" not in text({"quota": {"time_half_width": 0.03, "speedup_half_width": 0.04,
                                               "steps_for_5pct": 29}})
    assert "interval: none (--resamples 0)" in text(None, resamples=0)
    assert "interval: none (the run compared calls of 1 step(s), 2 needed)" in text(None, steps=1)


def test_an_interval_holds_its_point_even_where_every_draw_lies_beside_it():
    draws = np.linspace(1.10, 1.20, 101)
    assert bounds(draws) == pytest.approx((1.105, 1.195))
    assert bounds(draws, point=1.0) == pytest.approx((1.0, 1.195))  # stretched down to the point
    assert bounds(draws, point=1.15) == pytest.approx((1.105, 1.195))  # negative control: a point inside moves nothing


def test_building_the_simulate_command_imports_no_simulator():
    """The interval's defaults sit in ``ultraep.config``: the ``simulate`` parser's help names them without importing
    the simulator (numba, the policies), which every ``ultraep`` command would otherwise pay at start."""
    import subprocess
    import sys

    probe = ("import argparse, sys; from ultraep.cli import simulate; "
             "simulate.register(argparse.ArgumentParser().add_subparsers()); {extra}"
             "print(sorted(m for m in ('numba', 'ultraep.sim') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe.format(extra="")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # negative control: the module that computes the interval does import them
    out = subprocess.run([sys.executable, "-c", probe.format(extra="import ultraep.sim.uncertainty; ")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['numba', 'ultraep.sim']"


def test_a_degenerate_interval_equals_the_reported_figure_to_the_last_bit():
    """Where every resample re-predicts the point (no spread), the layer-time bounds are the figure ``summarise``
    prints, computed the same way: these ten times give 1e3 * t / n != t / n * 1e3, which once put the point a
    rounding error outside its own interval."""
    times = np.array([0.0085, 0.017, 0.0189, 0.009, 0.0131, 0.0116, 0.019, 0.0056, 0.016, 0.0142])
    n = times.size
    assert 1e3 * times.sum() / n != times.sum() / n * 1e3  # the case this pins
    keys = ("imbalance_before imbalance_after replicas transfer_bytes ideal_s scheme_ideal_s gemm_straggler_s "
            "token_straggler act_busiest_before act_busiest_after act_mean weight_sync_s copy_s grad_reduce_s")
    rows = {k: np.zeros(n) for k in keys.split()}
    rows.update(time_s=times, call_overhead_s=np.full(n, 0.002), step=np.arange(n))
    from ultraep.sim.replay import summarise
    from ultraep.sim.uncertainty import Overheads

    point = summarise({"none": rows}, ["none"])[0]["time_per_layer_ms"]
    lo, hi = summary_intervals({"none": rows}, ["none"], Overheads(np.full(8, 0.002), np.full(8, 0.002), n))[
        "none"]["time_per_layer_ms"]
    assert lo <= point <= hi


def _labelled(steps: int, sd: float, seed: int = 0) -> AnchorCalls:
    """``steps`` steps of one plain call of ``none`` (3 ms over the model) and one moving call each of ``quota``
    (10 ms over) and ``feplb`` (6 ms over), plus normal noise of ``sd`` seconds: the kind's median (about 8 ms) misses
    both moving policies by 2 ms."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.arange(steps), 3)
    policy = np.tile(np.array(["none", "quota", "feplb"], dtype=object), steps)
    diff = np.select([policy == "none", policy == "quota"], [0.003, 0.010], 0.006) + sd * rng.standard_normal(step.size)
    return AnchorCalls(step, policy != "none", diff, policy)


def test_a_policy_is_anchored_on_its_own_calls_in_every_resample(replay):
    """The point anchors per kind of call; a resample anchors each policy on its own drawn calls, unshrunk: the
    interval spans what the model misses on that policy, not only on its kind."""
    tr, cm = replay
    calls = _labelled(40, 0.0005)
    over = resampled_overheads(calls, cm.params, 200, seed=0)
    assert set(over.own_s) == {"none", "quota", "feplb"}
    assert np.median(over.own_s["quota"]) == pytest.approx(0.010, abs=3e-4)
    assert np.median(over.own_s["feplb"]) == pytest.approx(0.006, abs=3e-4)
    res = simulate(tr, cm, ("quota",), max_plans=None)
    rows = res.rows["quota"]
    moving = np.array([w + c + g > 0 for w, c, g in zip(rows["weight_sync_s"], rows["copy_s"], rows["grad_reduce_s"])])
    assert moving.any()
    base = rows["time_s"] - rows["call_overhead_s"]
    own = resampled_times(rows, over, "quota")
    expect = base[None, :] + np.where(moving, over.base_s[1], over.base_s[0])[None, :] + over.own_s["quota"][:, None]
    np.testing.assert_allclose(own, expect, rtol=1e-12)
    # a chooser's calls each pay the candidate that ran them
    ran = np.array(["feplb"] * len(base), dtype=object)
    np.testing.assert_allclose(resampled_times(rows, over, "adaptive", ran)[:, moving],
                               (base[None, :] + over.base_s[1] + over.own_s["feplb"][:, None])[:, moving], rtol=1e-12)
    # negative control: calls that do not say their policy anchor by kind, about 2 ms below quota's own
    plain = resampled_overheads(AnchorCalls(calls.step, calls.transfer, calls.diff_s), cm.params, 200, seed=0)
    assert plain.own_s == {}
    by_kind = resampled_times(rows, plain, "quota")
    assert np.median(own[:, moving] - by_kind[:, moving]) == pytest.approx(0.002, abs=5e-4)


def test_a_new_runs_noise_is_drawn_from_the_calls_of_the_policy_that_ran_them(replay):
    """What a run measures scatters about the model by its calls' noise: each replayed call draws from the
    calibration's calls of its policy about their median; a policy's draws are seeded, and independent of another's."""
    tr, cm = replay
    rows = simulate(tr, cm, ("quota",), max_plans=None).rows["quota"]
    quiet = resampled_overheads(_labelled(40, 0.0005), cm.params, 100, seed=3)
    noisy = resampled_overheads(_labelled(40, 0.004), cm.params, 100, seed=3)
    a, b = run_noise(rows, noisy, "quota"), run_noise(rows, noisy, "quota")
    assert a.shape == (100, len(rows["time_s"])) and np.array_equal(a, b)  # seeded
    assert np.std(a) == pytest.approx(0.004, rel=0.25) and abs(np.median(a)) < 5e-4
    assert np.std(run_noise(rows, quiet, "quota")) < np.std(a) / 5  # the calls' spread sets it
    assert not np.array_equal(run_noise(rows, noisy, "feplb"), a)  # another policy's run: other draws
    # negative control: calls without noise give a run without it
    same = AnchorCalls(np.repeat(np.arange(10), 2), np.tile([False, True], 10), np.tile([0.003, 0.008], 10))
    assert not run_noise(rows, resampled_overheads(same, cm.params, 50, seed=0), "quota").any()


def test_a_chooser_runs_the_candidates_its_replay_decided():
    rows = {"step": np.array([0, 0, 1]), "microbatch": np.array([0, 0, 0]), "layer": np.array([0, 1, 0])}
    decisions = [(0, 0, 0, "quota", "r", {}, 0.1), (1, 0, 0, "none", "r", {}, 0.1)]
    assert list(chooser_ran(rows, decisions)) == ["quota", None, "none"]


def test_the_speed_up_interval_holds_a_new_runs_noise(replay):
    """With noisy calls the speed-up's interval is wider than the model's alone (the same resampled overheads without
    the noise), and none over itself stays exactly 1."""
    tr, cm = replay
    calls = _labelled(40, 0.004)
    point, _ = anchor(cm, calls)
    res = simulate(tr, point, ("none", "quota"), max_plans=None)
    over = resampled_overheads(calls, cm.params, 400, seed=0)
    iv = summary_intervals(res.rows, ["none", "quota"], over)
    assert iv["none"]["speedup_vs_none"] == [1.0, 1.0]
    sums = {p: resampled_sums(res.rows[p], over, p, noise=False) for p in ("none", "quota")}
    lo, hi = bounds(sums["none"] / sums["quota"])
    assert iv["quota"]["speedup_vs_none"][1] - iv["quota"]["speedup_vs_none"][0] > hi - lo
