"""``make gpu-check``: everything that needs a GPU, in one command (issue 34).

On a machine without CUDA it prints one line saying so and exits 0 (with GPUs but a CPU build of torch — the
pin ``make setup`` installs — it says that and exits 1: not a silent pass). With CUDA it runs, each step under a
time limit so the whole fits in 10 minutes on one H100:

1. every CUDA-only test (``pytest -m cuda`` on the test modules that hold one, with ``TRITON_INTERPRET=0``, so
   Triton compiles for the GPU): each Triton kernel against its torch reference on odd shapes, empty experts and
   one-token inputs, the balanced layer and a wrapped tiny model at world size 1 on NCCL, and with two GPUs the
   two-rank NCCL exactness run (``tests/test_gpu.py``, plus the kernel modules' CUDA tests); a CUDA test that
   skips fails the step (with one GPU, only the NCCL pair may);
2. the kernel timings (``benchmarks/bench_kernels.py --quick``);
3. with two GPUs, ``benchmarks/bench_runtime.py --backend nccl`` (none vs quota at the default shape).

It appends a dated section to ``benchmarks/results/gpu_check.md`` (the device, the commit, each step's result
and seconds, the benchmarks' tables; ignored by git, like the benchmarks' rows: the figures of record are committed
as rows in ``benchmarks/results_committed/``, docs/benchmarks.md shows them) and ends with one line naming what it could not run. Exit status 1 when a
step failed.

    make gpu-check
    .venv/bin/python benchmarks/gpu_check.py --no-append     # write no report
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
DOC = ROOT / "benchmarks" / "results" / "gpu_check.md"
HEADING = "## GPU check (issue 34)"


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout_s: int
    show_output: bool = False  # its output (a benchmark's table) goes into the dated section
    allowed_skips: tuple[str, ...] | None = None  # a pytest step: the skip reasons that do not fail it


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


def run_step(step: Step, env: dict) -> Outcome:
    """Run one step from the repository root; a timeout is a failure, with what it printed so far."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(step.cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout_s)
        ok, out = p.returncode == 0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ok, out = False, out + f"\n(timed out after {step.timeout_s} s)"
    lines = out.strip().splitlines()
    summary = lines[-1].strip() if lines else ""
    if ok and step.allowed_skips is not None and (bad := unexpected_skips(out, step.allowed_skips)):
        ok, summary = False, f"{summary}; skipped on this machine: " + "; ".join(bad)
    return Outcome(step, ok, time.perf_counter() - t0, "\n".join(lines[-40:]), summary)


def section(outcomes: list[Outcome], not_run: list[str], device: str, commit: str, when: str) -> str:
    """The dated Markdown section appended to the report (:data:`DOC`)."""
    out = [f"\n### {when} UTC: {device}, commit {commit}\n", "| step | result | seconds | last line |",
           "|---|---|---|---|"]
    out += [f"| {o.step.name} | {'passed' if o.ok else 'FAILED'} | {o.seconds:.0f} | {o.summary.replace('|', '/')} |"
            for o in outcomes]
    for o in outcomes:
        if o.step.show_output or not o.ok:
            out += ["", f"`{' '.join(o.step.cmd[1:])}` (last lines):", "", "```", o.tail, "```"]
    out += ["", "Not run: " + ("; ".join(not_run) if not_run else "nothing") + "."]
    return "\n".join(out) + "\n"


def append_section(text: str, path: Path = DOC) -> None:
    """Add ``text`` as the last section under :data:`HEADING` (before the next ``## `` heading, if any), the heading
    first added at the end when the document lacks it."""
    doc = path.read_text() if path.exists() else ""
    if HEADING not in doc:
        doc = doc.rstrip("\n") + f"\n\n{HEADING}\n\n`make gpu-check` appends one section per run (benchmarks/gpu_check.py).\n"
    at = doc.find("\n## ", doc.index(HEADING) + len(HEADING))
    path.parent.mkdir(parents=True, exist_ok=True)
    if at < 0:
        path.write_text(doc.rstrip("\n") + "\n" + text)
    else:
        path.write_text(doc[:at].rstrip("\n") + "\n" + text + doc[at:])


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


def steps_for(num_gpus: int) -> tuple[list[Step], list[str]]:
    py = sys.executable
    steps = [
        Step("CUDA-only tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
                                 *cuda_test_modules()], 240,
             allowed_skips=() if num_gpus >= 2 else (TWO_GPUS,)),
        Step("kernel timings", [py, "benchmarks/bench_kernels.py", "--quick"], 150, show_output=True),
    ]
    not_run = []
    if num_gpus >= 2:
        steps.append(Step("bench_runtime on NCCL", [py, "benchmarks/bench_runtime.py", "--backend", "nccl",
                                                     "--shapes", "default", "--policies", "none,quota",
                                                     "--warmup", "3", "--iters", "10"], 180, show_output=True))
    else:
        not_run.append("one GPU only, so no NCCL pair: the 2-rank NCCL exactness test and bench_runtime.py on "
                       "NCCL")
    return steps, not_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-append", action="store_true", help="print the section instead of appending it")
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
    steps, not_run = steps_for(n)
    outcomes = []
    for step in steps:
        print(f"gpu-check: {step.name} ...", flush=True)
        o = run_step(step, env)
        outcomes.append(o)
        print(f"gpu-check: {step.name}: {'passed' if o.ok else 'FAILED'} ({o.seconds:.0f} s)", flush=True)
        if not o.ok:
            print(o.tail)
    text = section(outcomes, not_run, device, commit, when)
    if args.no_append:
        print(text)
    else:
        append_section(text)
        print(f"gpu-check: section appended to {DOC.relative_to(ROOT)}")
    print("gpu-check: could not run: " + ("; ".join(not_run) if not_run else "nothing (everything ran)"))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
