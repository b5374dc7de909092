"""`ultraep plan`: tables and JSON on a real load file; user mistakes exit 2 with one line, no traceback."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ultraep.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ultraep.cli", *args], capture_output=True, text=True)


@pytest.fixture
def load_file(tmp_path):
    load = np.zeros((4, 8), dtype=np.int64)
    load[0] = [10, 2, 3, 3, 2, 2, 1, 1]
    path = tmp_path / "load.npy"
    np.save(path, load)
    return path


def test_plan_json(load_file, capsys):
    assert main(["plan", "--load", str(load_file), "--ranks", "4", "--slots", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "quota"
    assert out["rank_load_before"] == [12, 6, 4, 2]
    assert out["rank_load_after"] == [6, 6, 6, 6]
    assert out["num_replicas"] == 2 and len(out["transfers"]) == 2


def test_plan_table_compare(load_file, capsys):
    assert main(["plan", "--load", str(load_file), "--ranks", "4", "--slots", "1", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "before → after" in out and "quota" in out and "eplb" in out and "none" in out


def test_plan_synthetic(capsys):
    rc = main(["plan", "--synthetic", "--ranks", "8", "--experts", "32", "--top-k", "2", "--tokens", "512",
               "--imbalance", "2.0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["imbalance_after"] < out["imbalance_before"]


@pytest.mark.parametrize("make_args, fragment", [
    (lambda p: ["--load", str(p.parent / "missing.npy"), "--ranks", "4"], "missing.npy: no such file"),
    (lambda p: ["--load", str(p), "--ranks", "3"], "has 4 rows but the EP group has 3 ranks"),
    (lambda p: ["--load", str(p), "--ranks", "4", "--slots", "9"], "num_redundant_slots (9) must be <="),
    (lambda p: ["--load", str(p), "--ranks", "4", "--policy", "best"], "unknown policy 'best'; available:"),
    (lambda p: ["--load", str(p), "--ranks", "four"], "invalid int value"),
    (lambda p: ["--synthetic", "--ranks", "4"], "--experts: is required with --synthetic"),
])
def test_user_mistakes_exit_2_without_traceback(load_file, make_args, fragment):
    res = run_cli("plan", *make_args(load_file))
    assert res.returncode == 2, res.stderr
    assert fragment in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("content, fragment", [
    (np.array([[1.5, 2.0]]), "is not a whole number of tokens (1.5)"),
    (np.array([[-1, 2]]), "load.npy[0, 0]: is negative (-1)"),
    (np.array([[np.nan, 2.0]]), "is not finite"),
    (np.array([1, 2, 3]), "must be a 2-D [ranks, experts] matrix"),
])
def test_bad_load_values(tmp_path, content, fragment):
    path = tmp_path / "load.npy"
    np.save(path, content)
    res = run_cli("plan", "--load", str(path), "--ranks", str(content.shape[0]))
    assert res.returncode == 2 and fragment in res.stderr and "Traceback" not in res.stderr


def test_pickled_npy_is_refused(tmp_path):
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    res = run_cli("plan", "--load", str(path), "--ranks", "1")
    assert res.returncode == 2 and "not a plain numeric .npy" in res.stderr
