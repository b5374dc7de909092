"""``make gpu-check``: everything that needs a GPU, in one command (issues 34 and 55).

On a machine without CUDA it prints one line saying so and exits 0 (with GPUs but a CPU build of torch — the
pin ``make setup`` installs — it says that and exits 1: not a silent pass). With CUDA it runs, each step under a
time limit and all of them within ``--budget`` seconds (default 570: the whole fits in 10 minutes on one GPU):

1. every CUDA-only test (``pytest -m cuda`` on the test modules that hold one, with ``TRITON_INTERPRET=0``, so
   Triton compiles for the GPU): each Triton kernel against its torch reference on odd shapes, empty experts and
   one-token inputs, the balanced layer and a wrapped tiny model at world size 1 on NCCL, and with two GPUs the
   two-rank NCCL exactness run (``tests/test_gpu.py``, plus the kernel modules' CUDA tests); a CUDA test that
   skips fails the step (with one GPU, only the NCCL pair may);
2. the kernel timings (``benchmarks/bench_kernels.py --quick --table``), which also append each kernel's Triton
   and torch p50 to the times ``backend="auto"`` chooses from (``kernels/kernel_times.csv`` and its twin
   ``benchmarks/results_committed/kernel_times.csv``);
3. the critical path of a balanced layer call (``benchmarks/bench_critical_path.py``: EP8/E64 and EP64/E256, and
   the balanced layer at world size 1 against the plain experts container);
4. with two GPUs, ``benchmarks/bench_runtime.py --backend nccl`` (none vs quota at the default shape).

It writes rows, not prose: each step's result and seconds (``gpu_check``), and the benchmarks' latest rows, copied to
``benchmarks/results_committed/`` (``gpu_check.csv``, ``bench_kernels.csv``, ``bench_critical_path.csv``; the
kernel times appended as above), for the person who ran it to commit. It prints each step's table and ends with one
line naming what it could not run (with one GPU: the NCCL pair). Exit status 1 when a step failed.

    make gpu-check
    .venv/bin/python benchmarks/gpu_check.py --budget 540      # a tighter total limit, seconds
    .venv/bin/python benchmarks/gpu_check.py --no-commit       # leave benchmarks/results_committed/ alone
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))
#: the total limit of a run, seconds: the device is lent for minutes, and gpu-check must fit in 10 of them
BUDGET_S = 570


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout_s: int
    show_output: bool = False  # its output (a benchmark's table) is printed
    allowed_skips: tuple[str, ...] | None = None  # a pytest step: the skip reasons that do not fail it
    commits: tuple[str, ...] = ()  # benchmarks whose latest rows go to results_committed/ when the step passed


@dataclass
class Outcome:
    step: Step
    ok: bool
    seconds: float
    tail: str
    summary: str = ""  # the output's last line (pytest's counts), or why an exit status 0 was not a pass


def unexpected_skips(out: str, allowed: tuple[str, ...]) -> list[str]:
    """The ``-rs`` lines of a pytest run (``SKIPPED [2] tests/x.py:60: needs a CUDA GPU``) whose reason is not
    one of ``allowed``: on a GPU machine a CUDA test that skipped did not run, and pytest still exits 0."""
    lines = [ln for ln in out.splitlines() if ln.startswith("SKIPPED [")]
    return [ln for ln in lines if not any(ln.rstrip().endswith(": " + a) for a in allowed)]


def run_step(step: Step, env: dict, timeout_s: float | None = None) -> Outcome:
    """Run one step from the repository root (within ``timeout_s``, default the step's own limit); a timeout is a
    failure, with what it printed so far."""
    t0 = time.perf_counter()
    limit = step.timeout_s if timeout_s is None else max(1, int(min(step.timeout_s, timeout_s)))
    try:
        p = subprocess.run(step.cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        ok, out = p.returncode == 0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ok, out = False, out + f"\n(timed out after {limit} s)"
    lines = out.strip().splitlines()
    summary = lines[-1].strip() if lines else ""
    if ok and step.allowed_skips is not None and (bad := unexpected_skips(out, step.allowed_skips)):
        ok, summary = False, f"{summary}; skipped on this machine: " + "; ".join(bad)
    return Outcome(step, ok, time.perf_counter() - t0, "\n".join(lines[-40:]), summary)


def section(outcomes: list[Outcome], not_run: list[str], device: str, commit: str, when: str) -> str:
    """The run's summary, printed at the end (Markdown: the device, the commit, each step, what it could not run)."""
    out = [f"\n### {when} UTC: {device}, commit {commit}\n", "| step | result | seconds | last line |",
           "|---|---|---|---|"]
    out += [f"| {o.step.name} | {'passed' if o.ok else 'FAILED'} | {o.seconds:.0f} | {o.summary.replace('|', '/')} |"
            for o in outcomes]
    for o in outcomes:
        if o.step.show_output or not o.ok:
            out += ["", f"`{' '.join(o.step.cmd[1:])}` (last lines):", "", "```", o.tail, "```"]
    out += ["", "Not run: " + ("; ".join(not_run) if not_run else "nothing") + "."]
    return "\n".join(out) + "\n"


def outcome_rows(outcomes: list[Outcome], not_run: list[str], device: str, commit: str) -> list[dict]:
    """The run as rows (``benchmarks/common.py``): per step its result (metric ``passed``, 1 or 0) and seconds; per
    thing it could not run a ``not_run`` row naming it. x is the device, run the commit's id."""
    from benchmarks.common import row

    where = f"{device}, commit {commit}"
    rows = []
    for o in outcomes:
        rows.append(row("gpu_check", o.step.name, "passed", "bool", where, [1.0 if o.ok else 0.0]))
        rows.append(row("gpu_check", o.step.name, "seconds", "s", where, [o.seconds]))
    rows += [row("gpu_check", what, "not_run", "count", where, [1.0]) for what in not_run]
    return rows


def commit_rows(outcomes: list[Outcome], rows: list[dict]) -> list[Path]:
    """Write the run's rows and copy them, and the passed steps' benchmark rows, to results_committed/."""
    from benchmarks import common

    common.write_rows("gpu_check", rows)
    out = [common.commit("gpu_check")]
    for o in outcomes:
        if o.ok:
            out += [common.commit(b) for b in o.step.commits if (common.RESULTS / f"{b}.csv").exists()]
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def visible_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without the tool): tells a machine without a GPU from one whose torch
    was installed without CUDA (``make setup`` pins torch's CPU wheel)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


TWO_GPUS = "needs 2 CUDA GPUs (an NCCL pair)"  # tests/test_gpu.py's skip reason for the two-rank NCCL run


def cuda_test_modules(tests: Path = ROOT / "tests") -> list[str]:
    """The test modules that hold a ``cuda``-marked test, relative to the repository root. Collecting only these
    (not the whole suite) means a GPU machine needs the runtime's packages, not the dashboard's or the browser's,
    and skips collecting some 900 CPU tests the marker would deselect anyway."""
    return sorted(str(p.relative_to(ROOT)) for p in tests.glob("test_*.py") if "pytest.mark.cuda" in p.read_text())


def steps_for(num_gpus: int, table: bool = True) -> tuple[list[Step], list[str]]:
    """The steps for ``num_gpus`` GPUs and what they cannot run. ``table``: the kernel timings append to the kernel
    times ``auto`` reads."""
    py = sys.executable
    steps = [
        Step("CUDA-only tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
                                 *cuda_test_modules()], 300,
             allowed_skips=() if num_gpus >= 2 else (TWO_GPUS,)),
        Step("kernel timings", [py, "benchmarks/bench_kernels.py", "--quick", *(["--table"] if table else [])], 90,
             show_output=True, commits=("bench_kernels",)),
        Step("critical path", [py, "benchmarks/bench_critical_path.py"], 180, show_output=True,
             commits=("bench_critical_path",)),
    ]
    not_run = []
    if num_gpus >= 2:
        steps.append(Step("bench_runtime on NCCL", [py, "benchmarks/bench_runtime.py", "--backend", "nccl",
                                                     "--shapes", "default", "--policies", "none,quota",
                                                     "--warmup", "3", "--iters", "10"], 180, show_output=True,
                          commits=("bench_runtime",)))
    else:
        not_run.append("one GPU only, so no NCCL pair: the 2-rank NCCL exactness test and bench_runtime.py on "
                       "NCCL")
    return steps, not_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"total seconds for all steps (default {BUDGET_S}); a step gets what is left, at most its own "
                         "limit, and a step with under 20 s left is not run (and named)")
    ap.add_argument("--no-commit", action="store_true",
                    help="write rows to benchmarks/results/ only, not to benchmarks/results_committed/")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        gpus = visible_gpus()
        if gpus and torch.version.cuda is None:  # a GPU machine with the CPU wheel: not a pass
            print(f"gpu-check: nvidia-smi sees {gpus} GPU(s) but this torch ({torch.__version__}) is a CPU build: "
                  "install a CUDA build of the same version into .venv and run make gpu-check again.")
            return 1
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to check.")
        return 0
    n = torch.cuda.device_count()
    device = f"{n} x {torch.cuda.get_device_name(0)}"
    # "-dirty" when the working tree differs from the commit (a copy carried to a GPU machine, say)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    # compile for the GPU (tests/conftest.py defaults it to 1); check CUDA through NVML, which creates no CUDA
    # context, so the test processes can still fork their ranks (ultraep.launch) after asking for a GPU
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    steps, not_run = steps_for(n, table=not args.no_commit)
    outcomes = []
    start = time.perf_counter()
    for step in steps:
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            not_run.append(f"{step.name} (the budget of {args.budget:.0f} s was spent)")
            continue
        print(f"gpu-check: {step.name} ...", flush=True)
        o = run_step(step, env, left)
        outcomes.append(o)
        print(f"gpu-check: {step.name}: {'passed' if o.ok else 'FAILED'} ({o.seconds:.0f} s)", flush=True)
        if not o.ok:
            print(o.tail)
    print(section(outcomes, not_run, device, commit, when))
    rows = outcome_rows(outcomes, not_run, device, commit)
    if args.no_commit:
        from benchmarks.common import write_rows

        print(f"gpu-check: rows written to {_shown(write_rows('gpu_check', rows))}")
    else:
        paths = commit_rows(outcomes, rows)
        kernels_ok = any(o.ok and "bench_kernels" in o.step.commits for o in outcomes)
        print("gpu-check: rows to commit: " + ", ".join(_shown(p) for p in paths)
              + (", kernels/kernel_times.csv and benchmarks/results_committed/kernel_times.csv (kernel times appended)"
                 if kernels_ok else ""))
    print("gpu-check: could not run: " + ("; ".join(not_run) if not_run else "nothing (everything ran)"))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
