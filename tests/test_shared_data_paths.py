"""The shared data is found beside the repository (``<repository root>/../shared``), never at one machine's
absolute path: a test that reads it runs in any checkout placed next to ``shared/`` (and skips where it is
absent)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import shared_data

ROOT = Path(__file__).resolve().parents[1]
#: an absolute path of one machine written in code: a string starting at one of these directories
MACHINE_PATH = re.compile(r"""["'](/(?:work|root|home)/[^"']*)["']""")


def test_shared_data_resolves_from_the_repository_root():
    assert shared_data.ROOT == ROOT and shared_data.SHARED == ROOT.parent / "shared"
    assert shared_data.shared_path("data", "x.json") == ROOT.parent / "shared" / "data" / "x.json"


def _code_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py", ".ci/*", "Makefile"], capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def machine_paths(text: str) -> list[str]:
    return MACHINE_PATH.findall(text)


def test_no_code_names_a_machine_path():
    found = {str(f.relative_to(ROOT)): hits for f in _code_files() if (hits := machine_paths(f.read_text()))}
    assert not found, f"absolute machine paths in code (resolve them from the repository root): {found}"


def test_the_scan_finds_the_paths_the_tests_once_held():
    # negative control: the two lines this replaced (tests/test_adaptive_budget.py, tests/test_traces.py)
    old = 'OLMOE = Path("' + "/work" + '/shared/data/OLMoE/expert_counts.json")'
    assert machine_paths(old) == ["/work" + "/shared/data/OLMoE/expert_counts.json"]
    assert machine_paths('OLMOE = shared_path("data", "OLMoE", "expert_counts.json")') == []
