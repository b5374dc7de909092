"""The demo's verdict is read off the numbers its step table prints (issue 32): it cannot contradict them. Runs
made by hand with known per-step times and per-call timings: balancing that loses, that wins, that wins without
any expert compute saved (the case that once printed "saved 1 ms" beside an unchanged 97 vs 97 ms), and noise."""

import io

import numpy as np
import pytest

from ultraep.cli.demo_report import DemoTiming, step_rows, step_table, verdict

STEPS, WARM, LAYERS = 24, 4, 2


def _run(step_s, expert_s, overhead_s=0.0, jitter=0.0, seed=0):
    """Two ranks' results of one run: every step takes ``step_s`` (x (1 +- jitter)), every layer call's busiest rank
    computes its experts for ``expert_s`` and plans for ``overhead_s``."""
    rng = np.random.default_rng(seed)
    ranks = []
    for rank in range(2):
        times = list(step_s * (1 + jitter * rng.uniform(-1, 1, STEPS)))
        calls = [(s, la, {"experts_s": expert_s if rank == 0 else expert_s / 2, "plan_s": overhead_s})
                 for s in range(STEPS) for la in range(LAYERS)]
        ranks.append({"times": times, "calls": calls, "history": [], "recording_errors": 0})
    return ranks


def _rows(none, other):
    return step_rows({"none": ("demo-x-none", none), "quota": ("demo-x-quota", other)}, WARM, train=False)


def _printed(rows) -> str:
    from rich.console import Console

    con = Console(file=io.StringIO(), width=200)
    con.print(step_table(rows, DemoTiming(wall_s=10.0, setup_s=5.0, warmup=WARM), STEPS))
    return con.file.getvalue()


def test_balancing_that_loses_says_so_with_the_printed_numbers():
    rows = _rows(_run(0.100, 0.040, jitter=0.01), _run(0.130, 0.040, overhead_s=0.010, jitter=0.01, seed=1))
    quota = rows[1]
    assert quota.hi < 1.0 and quota.speedup == pytest.approx(0.77, abs=0.01)
    text = verdict(quota)
    assert text.startswith("balancing did not pay: quota ran at 0.77x of none")
    assert f"{quota.lo:.2f}x-{quota.hi:.2f}x" in text
    assert f"{quota.speedup:.2f}x [{quota.lo:.2f}-{quota.hi:.2f}]" in _printed(rows)
    assert "saved no expert compute" in text and "paid" not in text.replace("did not pay", "")


def test_balancing_that_wins_names_what_it_saved():
    rows = _rows(_run(0.100, 0.060, jitter=0.01), _run(0.080, 0.040, overhead_s=0.002, jitter=0.01, seed=1))
    text = verdict(rows[1])
    assert text.startswith("balancing paid: quota ran at 1.25x of none")
    assert "expert compute 60 -> 40 ms per layer call" in text and "exposed overhead 2.0 ms" in text


def test_a_win_without_expert_compute_saved_is_not_explained_by_balancing():
    rows = _rows(_run(0.111, 0.097, jitter=0.01), _run(0.100, 0.097, jitter=0.01, seed=1))
    text = verdict(rows[1])
    assert text.startswith("balancing paid") and "97 -> 97 ms" in text
    assert "did not shrink" in text and "saved 1 ms" not in text


def test_noise_is_no_measurable_difference():
    rows = _rows(_run(0.100, 0.050, jitter=0.2), _run(0.101, 0.050, jitter=0.2, seed=1))
    quota = rows[1]
    assert quota.lo <= 1.0 <= quota.hi
    assert verdict(quota).startswith("no measurable difference")


def test_the_step_table_leaves_the_warm_up_out_and_shows_it_apart():
    none = _run(0.100, 0.050)
    for r in none:
        r["times"][0] = 30.0  # a compile in step 0
    rows = _rows(none, _run(0.100, 0.050, seed=1))
    assert rows[0].p50_s == pytest.approx(0.100) and rows[0].warmup_s == pytest.approx(30.3)
