"""``make gpu-check`` (benchmarks/gpu_check.py): one line and exit 0 without a GPU; with one, its steps within the
budget, the rows it commits (not prose: docs/benchmarks.md is never written) and the line naming what it could not
run (driven here with stand-in commands)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import gpu_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs for real")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to check."]
    assert "gpu-check:" in (ROOT / "Makefile").read_text()


def test_steps_say_what_one_gpu_cannot_run():
    one, not_run = gpu_check.steps_for(1)
    assert [s.name for s in one] == ["CUDA-only tests", "kernel timings", "critical path"]
    assert "--table" in one[1].cmd and "--table" not in gpu_check.steps_for(1, table=False)[0][1].cmd
    assert "benchmarks/bench_critical_path.py" in one[2].cmd
    # every step's own limit fits the default budget, and the budget fits the 10 minutes a device is lent for
    assert sum(s.timeout_s for s in one) <= gpu_check.BUDGET_S <= 600
    assert len(not_run) == 1 and "NCCL pair" in not_run[0]
    two, not_run = gpu_check.steps_for(2)
    assert two[-1].name == "bench_runtime on NCCL" and "--backend" in two[-1].cmd and not not_run
    assert "-m" in one[0].cmd and "cuda" in one[0].cmd
    # only the modules that hold a CUDA test are collected: a GPU machine needs no dashboard or browser packages
    assert "tests/test_gpu.py" in one[0].cmd and "tests/test_kernels_dispatch.py" in one[0].cmd
    assert not any("dashboard" in a for a in one[0].cmd)


def test_outcomes_become_a_summary_and_committed_rows(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "COMMITTED", tmp_path / "committed")
    py = sys.executable
    ok = gpu_check.run_step(gpu_check.Step("table", [py, "-c", "print('| a | 1 |')"], 30, show_output=True,
                                           commits=("bench_x",)), {})
    bad = gpu_check.run_step(gpu_check.Step("broken", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 30,
                                            commits=("bench_y",)), {})
    slow = gpu_check.run_step(gpu_check.Step("slow", [py, "-c", "import time; time.sleep(5)"], 100), {}, timeout_s=1)
    assert ok.ok and not bad.ok and not slow.ok and "timed out after 1 s" in slow.tail  # the budget's limit
    text = gpu_check.section([ok, bad, slow], ["one GPU only"], "1 x Fake GPU", "abc1234", "2026-11-25 17:00")
    assert "### 2026-11-25 17:00 UTC: 1 x Fake GPU, commit abc1234" in text
    assert "| table | passed |" in text and "| broken | FAILED |" in text and "boom" in text and "| a | 1 |" in text
    assert text.rstrip().endswith("Not run: one GPU only.")
    # rows: each step's result and seconds, what was not run; the passed steps' benchmark rows are committed
    common.write_rows("bench_x", [common.row("k", "p", "time", "s", "x", [1.0])])
    common.write_rows("bench_y", [common.row("k", "p", "time", "s", "x", [1.0])])
    rows = gpu_check.outcome_rows([ok, bad, slow], ["one GPU only"], "1 x Fake GPU", "abc1234")
    assert all(list(r) == common.COLUMNS for r in rows)
    got = {(r["provider"], r["metric"]): r["p50"] for r in rows}
    assert got[("table", "passed")] == 1.0 and got[("broken", "passed")] == 0.0 and got[("one GPU only", "not_run")]
    paths = gpu_check.commit_rows([ok, bad, slow], rows)
    assert sorted(p.name for p in paths) == ["bench_x.csv", "gpu_check.csv"]  # bench_y's step failed
    assert not hasattr(gpu_check, "append_section")  # gpu-check writes rows, never docs/benchmarks.md


def test_a_spent_budget_names_the_steps_it_did_not_run(monkeypatch, capsys, tmp_path):
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "COMMITTED", tmp_path / "committed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    py = sys.executable
    steps = [gpu_check.Step("first", [py, "-c", "import time; time.sleep(2)"], 30),
             gpu_check.Step("second", [py, "-c", "print(1)"], 30)]
    monkeypatch.setattr(gpu_check, "steps_for", lambda n, table=True: (steps, ["no NCCL pair"]))
    assert gpu_check.main(["--budget", "21"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check: could not run: no NCCL pair; second (the budget of 21 s was spent)" in out

def test_a_gpu_machine_with_the_cpu_wheel_is_not_a_pass(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "visible_gpus", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert gpu_check.main([]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "sees 2 GPU(s)" in out[0] and "CPU build" in out[0]


def test_a_cuda_test_that_skipped_on_the_gpu_machine_fails_the_step():
    """pytest exits 0 when every test skips (no CUDA in the test process, say): the step must not read as passed.
    Only the reason one GPU cannot help (no NCCL pair) is allowed, and the step's last line lands in the table."""
    py = sys.executable

    def pytest_like(*reasons):
        lines = [f"SKIPPED [1] tests/test_gpu.py:{i}: {r}" for i, r in enumerate(reasons)] + ["9 passed, 1 skipped"]
        return gpu_check.Step("CUDA-only tests", [py, "-c", f"print({chr(10).join(lines)!r})"], 30,
                              allowed_skips=(gpu_check.TWO_GPUS,))

    ok = gpu_check.run_step(pytest_like(gpu_check.TWO_GPUS), {})
    assert ok.ok and ok.summary == "9 passed, 1 skipped"
    bad = gpu_check.run_step(pytest_like(gpu_check.TWO_GPUS, "needs a CUDA GPU"), {})
    assert not bad.ok and "skipped on this machine" in bad.summary and "needs a CUDA GPU" in bad.summary
    text = gpu_check.section([ok, bad], [], "1 x Fake GPU", "abc1234", "2026-11-27 04:00")
    assert "| CUDA-only tests | passed | 0 | 9 passed, 1 skipped |" in text and "| CUDA-only tests | FAILED |" in text
    # with two GPUs nothing may skip
    assert gpu_check.steps_for(2)[0][0].allowed_skips == ()
