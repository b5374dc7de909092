"""The README is for users: at most 200 lines, its headline figures backed by committed rows, its example run.

* Every number in the Results table's *figure* column is a value of a committed row of the same result,
  printed at the precision it is printed with: ``benchmarks/results_committed/records.csv`` rows marked
  ``headline`` whose ``figure`` is the row's link anchor, and the long-form rows of the benchmark its command runs
  for the policy the row names (in backticks) and the configuration its text names (the first part of ``x``). The machine cell names
  those rows' CPU or GPU.
* The Python example trains on 2 gloo ranks under the real ``torchrun``, recording a run, and every line of the
  shell block after it (report, SQL, simulate) runs on that recording with exit status 0, as do the queries and the
  Python block of the SQL guide (docs/guide/sql.md).

Negative controls: a figure changed by one unit in its last digit is reported as unbacked; a row whose anchor
names no committed figure is reported; a command the rows were not made by is reported; a SQL line naming a view that does not exist exits non-zero.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from docs_text import ROOT, committed_rows, fenced_blocks, numbers, section, table_rows

README = ROOT / "README.md"
SCALES = {"s": (1.0, 1e3, 1e6), "us": (1.0,), "ratio": (1.0, 100.0)}


def _values(row: dict) -> list[tuple[float, str]]:
    """(value, unit) of every number a committed row states: records' value/low/high, long form's p50/p20/p80."""
    out = []
    for key in ("value", "low", "high", "p50", "p20", "p80"):
        v = row.get(key)
        if v not in (None, ""):
            out.append((float(v), row.get("unit", "")))
    return out


def _matches(printed: str, value: float, unit: str) -> bool:
    decimals = len(printed.partition(".")[2])
    target = float(printed)
    return any(abs(round(value * s, decimals) - target) < 1e-9 for s in SCALES.get(unit, (1.0,)))


def headline_problems(text: str, rows_by_file: dict[str, list[dict]]) -> list[str]:
    """What in the README's Results table is not backed by committed rows (empty: every figure is)."""
    table = table_rows(section(text, "Results"))
    problems = []
    if not 1 <= len(table) <= 8:
        problems.append(f"the Results table has {len(table)} rows (1-8 allowed)")
    records = rows_by_file.get("records", [])
    for result, figure, reproduce, machine in table:
        m = re.search(r"\]\(docs/benchmarks\.md#([\w-]+)\)", result)
        if m is None:
            problems.append(f"{result[:40]!r}: no link to its section of docs/benchmarks.md")
            continue
        key = m.group(1).replace("-", "_")
        backing = [r for r in records if r["figure"] == key and r["headline"] == "yes"]
        command = reproduce.strip("`")
        commanded = [r for r in backing if r["command"] == command or r["command"].startswith(command + " (")]
        policies = set(re.findall(r"`(\w+)`", result))
        for bench in re.findall(r"benchmarks/(bench_\w+)\.py", reproduce):
            rows = [r for r in rows_by_file.get(bench, [])
                    if r["provider"] in policies and r["x"].split("/")[0] in result]
            backing += rows
            commanded += rows  # the long form's rows are the named benchmark's own
        if not backing:
            problems.append(f"{key}: no committed rows")
            continue
        if not commanded:
            problems.append(f"{key}: no committed row was made by {command!r}")
        for printed in numbers(figure):
            if not any(_matches(printed, v, u) for r in backing for v, u in _values(r)):
                problems.append(f"{key}: {printed} is in no committed row")
        cpus = {r["cpu"] for r in backing if r.get("cpu") and r["cpu"] != "not recorded"}
        gpus = {r["machine"].split(",")[0].removeprefix("1 x ") for r in backing if r.get("isa") == "CUDA"}
        if not any(name in machine for name in cpus | gpus):
            problems.append(f"{key}: the machine cell {machine!r} names none of {sorted(cpus | gpus)}")
    return problems


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines"


def test_every_headline_figure_is_a_committed_row():
    assert headline_problems(README.read_text(), committed_rows()) == []


def test_an_unbacked_figure_is_reported():
    """Negative controls: one figure nudged in its last digit, and a row pointing at a section with no rows."""
    text = README.read_text()
    assert "**1.36-1.41×**" in text
    nudged = text.replace("**1.36-1.41×**", "**1.37-1.41×**")
    assert headline_problems(nudged, committed_rows()) == ["runtime: 1.37 is in no committed row"]
    moved = text.replace("(docs/benchmarks.md#demo)", "(docs/benchmarks.md#kernel-paths)")
    assert any("kernel_paths: no committed rows" in p for p in headline_problems(moved, committed_rows()))
    other = text.replace("bench_runtime.py --warmup 20 --iters 30`", "bench_runtime.py --warmup 20 --iters 10`")
    assert headline_problems(other, committed_rows()) == [
        "runtime: no committed row was made by '.venv/bin/python benchmarks/bench_runtime.py --warmup 20 --iters 10'"]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _shell_lines(text: str) -> list[str]:
    """The commands of the README's shell block that follows the example (one command per line)."""
    block = fenced_blocks(section(text, "Example: DDP with activation checkpointing"), "bash")
    assert len(block) == 1, "the example section has one shell block"
    return [ln.split("  #")[0].strip() for ln in block[0].splitlines() if ln.strip()]


@pytest.mark.slow
def test_readme_example_trains_on_two_ranks_and_its_commands_run(tmp_path):
    text = README.read_text()
    (code,) = fenced_blocks(section(text, "Example: DDP with activation checkpointing"), "python")
    (tmp_path / "train.py").write_text(code)
    torchrun = Path(sys.executable).parent / "torchrun"
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "train.py"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "runs" / "example").is_dir()
    for line in _shell_lines(text):
        out = subprocess.run(shlex.split(line), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        assert out.stdout.strip(), f"{line} printed nothing"
    sql = next(ln for ln in _shell_lines(text) if ln.startswith("ultraep sql"))
    rows = subprocess.run(shlex.split(sql) + ["--csv"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert len(rows.stdout.strip().splitlines()) == 1 + 2, rows.stdout  # a header and the model's 2 MoE layers
    # negative control: the same SQL on a view that does not exist fails, so a broken line would be seen
    broken = subprocess.run(shlex.split(sql.replace("FROM layer_balance", "FROM layer_balanse")), cwd=tmp_path,
                            env=_env(), capture_output=True, text=True)
    assert broken.returncode != 0
    # the SQL guide's queries and its Python block run on the same recording
    guide = (ROOT / "docs" / "guide" / "sql.md").read_text()
    for query in fenced_blocks(guide, "sql"):
        out = subprocess.run(["ultraep", "sql", "runs/example", query.strip(), "--csv"], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and len(out.stdout.splitlines()) >= 2, f"{query}\n{out.stdout}{out.stderr}"
    (py,) = fenced_blocks(guide, "python")
    (tmp_path / "sql_guide.py").write_text(py)
    out = subprocess.run([sys.executable, "sql_guide.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("[(0, "), out.stdout + out.stderr
