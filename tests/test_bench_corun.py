"""benchmarks/bench_corun.py: the co-run slowdown and the per-instance cost, measured on real gloo ranks."""

from __future__ import annotations

import csv
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_corun, common  # noqa: E402


def test_slowdown_is_the_cost_models_k():
    alone = np.array([1.0, 2.0])
    # beside 3 others a rank runs 1 + 3k times slower: 1.3x at k = 0.1
    assert np.allclose(bench_corun.slowdown(alone, 1.3 * alone, ranks=4), 0.1)
    assert np.allclose(bench_corun.slowdown(alone, alone, ranks=2), 0.0)
    assert np.allclose(bench_corun.slowdown([1.0], [0.9], ranks=2), -0.1)  # faster beside: negative, not clipped


def test_per_instance_rows_is_the_lines_intercept_over_its_slope():
    rows = np.array([256, 1024, 2048])
    # 4 instances at 1 ms each plus 0.05 ms per row: 1 ms = 20 rows per instance
    assert bench_corun.per_instance_rows(rows, 4e-3 + 5e-5 * rows, instances=4) == pytest.approx(20.0)
    assert math.isnan(bench_corun.per_instance_rows([1024], [0.05], instances=4))  # one row count: no line
    assert math.isnan(bench_corun.per_instance_rows([256, 1024], [0.05, 0.04], instances=4))  # no positive slope


def test_a_run_prints_both_tables_and_writes_its_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_corun.main(["--shape", "h512", "--rows", "16,64", "--trials", "2"])
    out = capsys.readouterr().out
    assert "co-run slowdown k of h512's experts" in out and "per-instance cost in" in out
    with (tmp_path / "bench_corun.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    got = {(r["provider"], r["metric"], r["x"]) for r in rows}
    for rank in ("rank0", "rank1"):
        for rows_x in ("2x1/h512/16", "2x1/h512/64"):
            for metric in ("k_fwd", "k_bwd", "fwd_alone", "fwd_together", "bwd_alone", "bwd_together"):
                assert (rank, metric, rows_x) in got
        assert (rank, "half_rows_bwd", "2x1/h512") in got
    alone = [float(r["p50"]) for r in rows if r["metric"].endswith("_alone")]
    assert alone and all(v > 0 for v in alone)
    assert all(r["threads"] == "1" for r in rows)


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "a,b"], ["--trials", "0"], ["--ranks", "1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_corun.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
