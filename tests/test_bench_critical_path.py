"""benchmarks/bench_critical_path.py (issue 55) runs on CPU at its smoke size and writes rows of the common schema:
every stage of both shapes with its 99th percentile, the whole path, the d2h -> plan -> h2d chain, the planner's
share, and the world-size-1 comparison with its ratios. (On CPU the times mean nothing; the GPU run is gpu-check's.)"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_critical_path as bench  # noqa: E402
from benchmarks import common  # noqa: E402


def test_smoke_run_writes_rows_of_every_stage_and_the_ws1_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = bench.main(["--smoke", "--iters", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "critical path of one rank, EP64/E256" in out and "300 per layer" in out and "world size 1" in out
    with (tmp_path / "bench_critical_path.csv").open(newline="") as fh:
        written = list(csv.DictReader(fh))
    assert len(written) == len(rows) and list(written[0]) == common.COLUMNS
    got = {(r["what"], r["provider"], r["metric"]): float(r["p50"]) for r in written}
    for shape in bench.SHAPES:
        for stage in (*bench.STAGES, "stages_sum", "path", "chain"):
            assert got[("critical_path", shape, stage)] > 0, (shape, stage)
            assert got[("critical_path", shape, f"{stage}_p99")] >= got[("critical_path", shape, stage)]
        assert 0 < got[("planner", shape, "plan_layer")]
        assert got[("planner", shape, "imbalance_after")] <= got[("planner", shape, "imbalance_before")]
    for mode in ("forward", "train_step"):
        plain, bal = got[("ws1_overhead", "plain", mode)], got[("ws1_overhead", "balanced", mode)]
        assert got[("ws1_overhead", "balanced", f"{mode}_ratio")] > 0 and plain > 0 and bal > 0
    assert {r["unit"] for r in written} == {"s", "ratio", "x"}


def test_an_unknown_shape_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--smoke", "--shapes", "EP8/E64,EP3/E5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench_critical_path: --shapes: unknown shape(s) EP3/E5; choose from EP8/E64, EP64/E256"]
