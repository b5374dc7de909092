"""The integrations guide's recipes run as written on dumps laid out as their writers write them.

docs/guide/integrations.md tells Megatron-LM and SGLang users how to estimate their speed-up from their own dumps.
Each recipe's shell block runs here, line by line through the real ``ultraep`` command, on a dump written by the
importer tests' writers (tests/test_trace_importers.py: Megatron's ``--moe-routing-trace-path`` directory, SGLang's
stat-mode ``.pt``), and must print the policy table (``simulate``) or the dump's description (``trace info``).
Negative control: the same simulate line on a dump that is not there exits 2.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from docs_text import ROOT, fenced_blocks
from test_trace_importers import _sglang_stat_dump, _write_megatron

GUIDE = ROOT / "docs" / "guide" / "integrations.md"


def _recipe(heading: str) -> list[str]:
    text = GUIDE.read_text()
    body = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
    (block,) = fenced_blocks(body, "bash")
    return [ln for ln in block.splitlines() if ln.strip()]


def _run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(shlex.split(line), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _check(lines: list[str], cwd: Path) -> None:
    for line in lines:
        out = _run(line, cwd)
        assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        if " simulate " in f" {line} ":
            assert "quota" in out.stdout and "speedup" in out.stdout and "projected" in out.stdout, out.stdout[-2000:]
        else:
            assert '"num_experts": 16' in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
def test_the_megatron_recipe_runs_on_a_megatron_trace_directory(tmp_path):
    _write_megatron(tmp_path / "router_traces", ranks=tuple(range(8)), steps=3, E=16, topk=4, tokens=64)
    _check(_recipe("From Megatron-LM"), tmp_path)
    assert (tmp_path / "sim.json").is_file()


@pytest.mark.slow
def test_the_sglang_recipe_runs_on_a_stat_dump(tmp_path):
    lines = _recipe("From SGLang")
    dump = shlex.split(lines[0])[-1]
    rng = np.random.default_rng(0)
    _sglang_stat_dump(tmp_path / dump, [rng.integers(0, 500, (2, 16)).astype(np.int32) for _ in range(6)], 8)
    _check(lines, tmp_path)
    missing = _run(lines[-1].replace(dump, "no_such_dump.pt"), tmp_path)
    assert missing.returncode == 2 and "no_such_dump.pt" in missing.stderr
