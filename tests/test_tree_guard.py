"""The suite leaves the tree as it found it (tests/tree_guard.py, run by tests/conftest.py at the end of every
run): a pytest run in a scratch git checkout whose test writes into the checkout fails and names the file; a
developer's own uncommitted edit that no test touches does not fail it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

TESTS = {
    "clean": "def test_writes_to_tmp(tmp_path):\n    (tmp_path / 'x').write_text('ok')\n",
    "tracked": "from pathlib import Path\n\ndef test_rewrites_a_tracked_file():\n"
               "    (Path(__file__).parents[1] / 'docs' / 'img.png').write_bytes(b'new')\n",
    "untracked": "from pathlib import Path\n\ndef test_leaves_a_file():\n"
                 "    (Path(__file__).parents[1] / 'stray.csv').write_text('a,b')\n",
    "dirty-rewritten": "from pathlib import Path\n\ndef test_rewrites_the_edited_file():\n"
                       "    (Path(__file__).parents[1] / 'notes.md').write_text('overwritten')\n",
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    return tmp_path_factory.mktemp("guard")


def _run(root: Path, case: str, edit_first: bool = False) -> subprocess.CompletedProcess:
    repo = root / case
    (repo / "tests").mkdir(parents=True)
    (repo / "docs").mkdir()
    for f in ("conftest.py", "tree_guard.py"):
        shutil.copy(HERE / f, repo / "tests" / f)
    (repo / "tests" / "test_case.py").write_text(TESTS[case])
    (repo / "docs" / "img.png").write_bytes(b"old")
    (repo / "notes.md").write_text("committed")
    (repo / ".gitignore").write_text("__pycache__/\n.pytest_cache/\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    if edit_first:  # the developer's own uncommitted edit, made before the run
        (repo / "notes.md").write_text("my edit")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_case.py"],
                          cwd=repo, capture_output=True, text=True, timeout=120)


def test_a_run_that_writes_only_to_tmp_passes_even_with_the_developers_edits(checkout):
    p = _run(checkout, "clean", edit_first=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "left the working tree changed" not in p.stdout


@pytest.mark.parametrize("case,names", [("tracked", " M docs/img.png"), ("untracked", "?? stray.csv")])
def test_a_run_that_writes_into_the_checkout_fails_and_names_the_file(checkout, case, names):
    p = _run(checkout, case)
    assert p.returncode != 0 and "1 passed" in p.stdout, p.stdout + p.stderr  # the test passed, the run failed
    assert "left the working tree changed" in p.stdout and names in p.stdout, p.stdout


def test_a_developers_edited_file_rewritten_by_a_test_fails_the_run(checkout):
    p = _run(checkout, "dirty-rewritten", edit_first=True)
    assert p.returncode != 0 and " M notes.md" in p.stdout, p.stdout + p.stderr
