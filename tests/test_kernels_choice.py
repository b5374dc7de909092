"""``backend="auto"`` on a GPU runs the faster implementation of each kernel, from the committed measured times
(ultraep.kernels.choice; issue 55). Everything here runs on CPU: the choice is a function of the table, the GPU's
name and the call's size, and the CUDA device's name is the one thing stood in for."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from ultraep.kernels import choice
from ultraep.kernels._backend import resolve
from ultraep.kernels.choice import KERNELS, KernelTimes

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results_committed" / "kernel_times.csv"


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def slower_picks(rows: list[dict], choose) -> list[tuple]:
    """Every (kernel, device, size) of ``rows`` where ``choose`` names the implementation whose p50 in the latest run
    that timed it is the higher one (computed here from the rows, not by the module under test)."""
    latest = {}
    for r in rows:  # oldest first: the last row of a key is its latest run
        latest[(r["kernel"], r["device"], int(r["size_bytes"]))] = (float(r["triton_s"]), float(r["torch_s"]))
    bad = []
    for (k, d, s), (tri, ref) in latest.items():
        slower = "triton" if tri > ref else "torch" if ref > tri else None
        if slower is not None and choose(k, d, s) == slower:
            bad.append((k, d, s, tri, ref))
    return bad


def test_the_shipped_table_is_the_committed_one_and_is_measured():
    """The package reads kernels/kernel_times.csv; benchmarks/results_committed/kernel_times.csv is its committed
    twin (bench_kernels.py --table writes both). Each row says where it came from."""
    assert choice.TABLE.read_bytes() == COMMITTED.read_bytes()
    rows = _rows(COMMITTED)
    assert rows and list(rows[0]) == choice.COLUMNS
    assert {r["kernel"] for r in rows} == set(KERNELS)
    assert {r["device"] for r in rows} >= {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    assert all(r["source"] and r["run"] and r["machine"] for r in rows)


def test_auto_never_picks_the_slower_kernel_at_a_measured_size():
    rows = _rows(COMMITTED)
    table = KernelTimes(rows)
    assert slower_picks(rows, table.choose) == []
    # negative controls: "Triton on every GPU" (the old rule) and the opposite of the rule both fail the check
    assert slower_picks(rows, lambda k, d, s: "triton")
    assert slower_picks(rows, lambda k, d, s: {"triton": "torch", "torch": "triton"}[table.choose(k, d, s)])


def test_what_the_committed_measurements_decide_on_an_h200():
    """The H200 runs of gpu-check: Triton was faster for reroute, unpermute and reduce_replica_grads, the torch
    reference for the tile copies, permute and dispatch_layout (their p50s, docs/benchmarks.md)."""
    table = KernelTimes(_rows(COMMITTED))
    picks = {k: table.choose(k, "NVIDIA H200", 1 << 30) for k in KERNELS}
    assert picks == {"reroute": "triton", "dispatch_layout": "torch", "permute": "torch", "unpermute": "triton",
                     "pack_tiles": "torch", "forward_tiles": "torch", "unpack_tiles": "torch",
                     "reduce_replica_grads": "triton"}


def _row(kernel, device, size, tri, ref, run="r"):
    return dict(kernel=kernel, device=device, x="x", size_bytes=size, triton_s=tri, torch_s=ref, machine="m", run=run,
                source="test")


def test_unmeasured_sizes_take_the_nearest_measured_size_by_ratio():
    t = KernelTimes([_row("permute", "G", 1_000, 1.0, 2.0), _row("permute", "G", 1_000_000, 2.0, 1.0)])
    assert t.choose("permute", "G", 1_000) == "triton" and t.choose("permute", "G", 1_000_000) == "torch"
    assert t.choose("permute", "G", 30_000) == "triton"  # 30x above 1e3, 33x below 1e6
    assert t.choose("permute", "G", 33_000) == "torch"
    assert t.choose("permute", "G", 1) == "triton" and t.choose("permute", "G", 10**12) == "torch"


def test_the_latest_run_decides_and_a_tie_runs_the_reference():
    """A run appended later timed the code as it is now (a kernel made faster, a sync removed); the older rows stay
    as history."""
    runs = [_row("reroute", "G", 8, 3.0, 2.0, "a"), _row("reroute", "G", 8, 3.5, 2.6, "b"),
            _row("reroute", "G", 8, 1.0, 2.0, "c")]
    t = KernelTimes(runs)
    assert t.choose("reroute", "G", 8) == "triton" and t.nearest("reroute", "G", 8).runs == 3
    assert KernelTimes(runs[:2]).choose("reroute", "G", 8) == "torch"
    assert KernelTimes([_row("reroute", "G", 8, 2.0, 2.0)]).choose("reroute", "G", 8) == "torch"


def test_an_unknown_gpu_runs_triton_only_where_it_was_faster_on_every_measured_gpu():
    t = KernelTimes([_row("reroute", "A", 8, 1.0, 2.0), _row("reroute", "B", 8, 1.0, 3.0),
                     _row("permute", "A", 8, 1.0, 2.0), _row("permute", "B", 8, 3.0, 2.0)])
    assert t.choose("reroute", "new GPU", 8) == "triton"
    assert t.choose("permute", "new GPU", 8) == "torch"  # faster on A only
    assert t.choose("unpermute", "new GPU", 8) == "torch"  # never measured: the reference
    assert KernelTimes([]).choose("reroute", "A", 8) == "torch"


def test_bad_rows_are_refused_with_the_row_named():
    with pytest.raises(ValueError, match="kernel times row 2"):
        KernelTimes([_row("reroute", "A", 8, 1.0, 2.0), _row("reroute", "A", 8, "fast", 2.0)])
    with pytest.raises(ValueError, match="row 1: size and times must be positive"):
        KernelTimes([_row("reroute", "A", 0, 1.0, 2.0)])


def test_resolve_reads_the_table_for_a_cuda_device(monkeypatch, tmp_path):
    """resolve("auto", cuda) looks the GPU's name up (stood in for: no GPU here) and reads the table that
    ULTRAEP_KERNEL_TIMES names; CPU tensors and explicit backends ignore the table."""
    path = tmp_path / "times.csv"
    choice.append_times(path, [_row("permute", "Fake GPU", 100, 1.0, 2.0), _row("pack_tiles", "Fake GPU", 100, 2.0, 1.0)])
    monkeypatch.setenv(choice.ENV, str(path))
    monkeypatch.setattr(choice, "device_name", lambda index: "Fake GPU")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve("auto", cuda, "permute", 100) == "triton"
    assert resolve("auto", cuda, "pack_tiles", 100) == "torch"
    assert resolve("auto", cpu, "permute", 100) == "torch"
    assert resolve("triton", cuda, "pack_tiles", 100) == "triton" and resolve("torch", cuda, "permute", 100) == "torch"
    choice.append_times(path, [_row("permute", "Fake GPU", 100, 9.0, 2.0, "later")])  # a later run: slower now
    choice._load.cache_clear()
    assert resolve("auto", cuda, "permute", 100) == "torch"


def test_the_benchmark_counts_the_sizes_the_wrappers_pass(monkeypatch):
    """bench_kernels.py writes each case's bytes as the table's size; the kernel wrappers pass their own count to
    resolve. They must agree, or auto would look up a size the benchmark never measured."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks import bench_kernels

    seen = []
    for mod in ("rerouting", "dispatch", "tiles", "grad_reduce"):
        m = importlib.import_module(f"ultraep.kernels.{mod}")
        real = m.resolve
        monkeypatch.setattr(m, "resolve", lambda b, d, k, size=None, real=real: (seen.append((k, size)),
                                                                                    real(b, d, k, size))[1])
    cases = bench_kernels.build_cases(bench_kernels.SMOKE_SIZE, torch.device("cpu"), ("torch",))
    for kernel, _x, nbytes, fns in cases:
        seen.clear()
        fns["torch"]()
        assert seen == [(kernel, nbytes)], (kernel, nbytes, seen)
