"""The examples run, through the real ``torchrun`` binary, and record a run (issue 15, item 6; issue 57: the
README's example is ``examples/train_ddp.py``, run whole here, with triton unimportable).

``examples/train_torchrun.py`` trains a tiny Qwen3-MoE (built from its config) on 2 CPU ranks over gloo
under ``torchrun --standalone --nproc-per-node 2``, with recording on. Checked: exit 0, rank 0's summary,
and a run that ``ultraep.telemetry.open_run`` reads with both ranks closed, every step on both ranks
(step 0 marked warm-up) and the layer plans. ~10 s on a 2-core machine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ultraep.telemetry import open_run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_torchrun.py"
STEPS = 4


def test_torchrun_example_trains_and_records(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    assert torchrun.is_file(), f"{torchrun} missing: torch installs it beside the interpreter"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CI's path: gloo on CPU, whatever the machine has
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", str(STEPS),
         "--runs-dir", str(tmp_path / "runs"), "--run-name", "ex"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks on gloo (cpu)" in proc.stdout and f"run ex: {STEPS} steps (1 warm-up)" in proc.stdout
    assert "0 recording errors" in proc.stdout and "loss " in proc.stdout

    con = open_run(tmp_path / "runs" / "ex")
    assert con.execute("SELECT rank, status, world_size, errors FROM runs ORDER BY rank").fetchall() == [
        (0, "closed", 2, 0), (1, "closed", 2, 0)]
    steps = con.execute("SELECT rank, step, warmup, loss IS NOT NULL FROM steps ORDER BY rank, step").fetchall()
    assert steps == [(r, s, s == 0, True) for r in (0, 1) for s in range(STEPS)]
    # every MoE layer (2) planned once per step (plans by rank 0: every rank plans the same), timed by both
    assert con.execute("SELECT count(*), count(DISTINCT layer) FROM layer_balance").fetchone() == (2 * STEPS, 2)
    assert con.execute("SELECT rank, count(*) FROM timings GROUP BY rank ORDER BY rank").fetchall() == [
        (0, 2 * STEPS), (1, 2 * STEPS)]


def test_example_outside_torchrun_says_how_to_run_it(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location("train_torchrun", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2
    assert "torchrun --standalone --nproc-per-node 2" in capsys.readouterr().err


# ------------------------------------------------------------------ examples/train_ddp.py (the README's example)
SHORT = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
# a `sitecustomize` that makes triton unimportable in every process started with it on PYTHONPATH (torchrun's
# ranks included): `import triton` raises ModuleNotFoundError and importlib.util.find_spec("triton") is None,
# as on a machine without it (macOS, Windows: the kernels extra has no triton there)
NO_TRITON = 'import sys\nsys.modules["triton"] = None\n'


def test_the_short_example_trains_records_and_reads_back_without_triton(tmp_path):
    """The README's example, as a file: DDP + activation checkpointing + recording, on 2 gloo ranks under the real
    ``torchrun``, with triton unimportable. Checked: exit 0, no deprecation warning, the printed summary, and the
    run in the store (both ranks, every step with a finite loss, replicas placed)."""
    assert len(SHORT.read_text().splitlines()) <= 60, "the README shows the example whole"
    blocker = tmp_path / "no_triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_TRITON)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "PYTHONWARNINGS")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(blocker), "RUNS_DIR": str(tmp_path / "runs")}
    # negative control of the blocker: with it on the path, triton cannot be imported
    probe = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(SHORT)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "deprecat" not in proc.stderr.lower(), proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"2 ranks, 8 steps: loss " in proc.stdout and f"ultraep report {run_dir}" in proc.stdout, proc.stdout

    con = open_run(run_dir)
    assert con.execute("SELECT rank, status, errors FROM runs ORDER BY rank").fetchall() == [
        (0, "closed", 0), (1, "closed", 0)]
    steps = con.execute("SELECT rank, step, isfinite(loss), step_time_s > 0 FROM steps ORDER BY rank, step").fetchall()
    assert steps == [(r, s, True, True) for r in (0, 1) for s in range(8)]
    first, last = con.execute("SELECT arg_min(loss, step), arg_max(loss, step) FROM steps WHERE rank = 0").fetchone()
    assert last < first  # it learned (the sequences are predictable)
    assert con.execute("SELECT sum(num_replicas) FROM plans WHERE rank = 0").fetchone()[0] > 0
    # with activation checkpointing each layer's forward runs again in the backward; it replays its call: one plan
    # per layer and step
    assert con.execute("SELECT count(*) FROM layer_balance").fetchone()[0] == 2 * 8


def test_no_project_code_calls_the_deprecated_checkpointing_name():
    """transformers 5.x deprecates ``gradient_checkpointing_enable``: the project calls
    ``activation_checkpointing_enable``; the one call of the old name is the test that keeps it working."""
    root = Path(__file__).resolve().parents[1]
    OLD_NAME = ".gradient_checkpointing" + "_enable("  # spelled in two parts so that this file does not match
    calls = [str(p.relative_to(root)) for folder in ("ultraep", "policies", "kernels", "telemetry", "dashboard",
                                                    "examples", "benchmarks", "tests")
             for p in (root / folder).rglob("*.py") if OLD_NAME in p.read_text()]
    assert calls == ["tests/test_train_as_users.py"], calls
