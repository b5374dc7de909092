"""``benchmarks/bench_runtime.py --repeats N`` (issue 56, item 5): each run of a shape reports adaptive's first-calls
figure and its steady-state figure on rows of its own (x ``<shape>/run<k>``), from that run's calls only."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_runtime import SHAPES, _report_shape  # noqa: E402


def _res(first: dict, steady: dict) -> dict:
    """What ``_run_shape`` returns for policies with these per-call seconds (first calls, timed calls)."""
    out = {}
    for name in steady:
        info = {"times": [], "phases": [{}], "chosen": ["quota"] * 4, "imb_before": 1.6, "imb_after": 1.0,
                "replicas": 2, "first_calls": np.full(20, first[name])}
        out[name] = (np.full(4, steady[name]), [info, dict(info)])
    return out


def _rows(rows, x):
    return {r["metric"]: r["p50"] for r in rows if r["x"] == x and r["provider"] == "adaptive"}


def test_each_run_has_its_own_first_calls_and_steady_rows():
    from rich.table import Table

    main_t, phase_t, rows = Table(), Table(), []
    runs = [({"none": 1.4, "quota": 1.0, "adaptive": 1.03}, {"none": 1.4, "quota": 1.0, "adaptive": 1.01}),
            ({"none": 1.4, "quota": 1.0, "adaptive": 1.10}, {"none": 1.4, "quota": 1.0, "adaptive": 0.99})]
    figs = [_report_shape(SHAPES["default"], _res(*r), f"2x1/default/run{k + 1}", main_t, phase_t, rows)
            for k, r in enumerate(runs)]
    one, two = _rows(rows, "2x1/default/run1"), _rows(rows, "2x1/default/run2")
    assert one["vs_best_fixed_first20"] == pytest.approx(1.03) and one["vs_best_fixed"] == pytest.approx(1.01)
    assert two["vs_best_fixed_first20"] == pytest.approx(1.10) and two["vs_best_fixed"] == pytest.approx(0.99)
    assert figs[0][0].startswith("1.030 (quota") and figs[1][0].startswith("1.100 (quota")
    # negative control: a run without adaptive has no figures, and its rows carry no adaptive metric
    assert _report_shape(SHAPES["default"], _res({"none": 1.4, "quota": 1.0}, {"none": 1.4, "quota": 1.0}),
                         "2x1/default/run3", main_t, phase_t, rows) is None
    assert not _rows(rows, "2x1/default/run3")


def test_calls_out_writes_every_call_of_every_run_with_adaptives_reasons(tmp_path):
    """``--calls-out``: a tiny run on two gloo ranks; every call (warm-up included) of every policy is a row, and
    adaptive's rows carry its decisions' reasons (a fixed policy's are empty: nothing was chosen)."""
    import argparse
    import csv

    from benchmarks.bench_runtime import POLICIES, Shape, _run_shape, write_calls

    args = argparse.Namespace(warmup=2, iters=2, seed=0, slots=1, backend="gloo")
    shape = Shape("tiny", tokens=32, hidden=32, ffn=32, experts=4)
    policies = [p for p in POLICIES if p[0] in ("none", "adaptive")]
    res = _run_shape(shape, args, policies)
    calls = [("2x1/tiny", name, i, *c) for name, (_, out) in res.items() for i, c in enumerate(out[0]["calls"])]
    write_calls(calls, tmp_path / "calls.csv")
    with (tmp_path / "calls.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["policy"], int(r["call"])) for r in rows} == {(n, i) for n in ("none", "adaptive") for i in range(4)}
    assert all(float(r["t_s"]) > 0 for r in rows)
    assert all(r["reason"] for r in rows if r["policy"] == "adaptive")
    assert all(r["chosen"] == "none" and not r["reason"] for r in rows if r["policy"] == "none")


def test_vs_none_has_its_interval_from_the_paired_rounds():
    """adaptive's ``vs none`` comes with a 90 % interval whose rounds are resampled together: where every round's
    noise is shared (a busy host slows both runs of a round alike) and adaptive is 2 % slower on each call, the
    interval is tight around 0.98; the same times with adaptive's rounds shuffled (the pairing lost) give a wide one."""
    from rich.table import Table

    rng = np.random.default_rng(0)
    shared = np.exp(rng.normal(0.0, 0.1, 120))  # each round's machine state
    none, quota = 1.0 * shared, 1.1 * shared
    out = {}
    for label, ad in (("paired", 1.02 * shared), ("shuffled", rng.permutation(1.02 * shared))):
        res = _res({"none": 1.4, "quota": 1.0, "adaptive": 1.0}, {"none": 1.0, "quota": 1.0, "adaptive": 1.0})
        for name, t in (("none", none), ("quota", quota), ("adaptive", ad)):
            res[name] = (t, res[name][1])
        rows = []
        fig = _report_shape(SHAPES["default"], res, f"2x1/default/{label}", Table(), Table(), rows)
        got = _rows(rows, f"2x1/default/{label}")
        assert got["speedup_vs_none_lo90"] <= got["speedup_vs_none"] <= got["speedup_vs_none_hi90"]
        assert "[" in fig[2]
        out[label] = got["speedup_vs_none_hi90"] - got["speedup_vs_none_lo90"]
        if label == "paired":
            assert got["speedup_vs_none"] == pytest.approx(1 / 1.02) and out[label] < 0.005
    assert out["shuffled"] > 5 * out["paired"]
