"""CLI paper cuts of issue 32, each pinned: every user mistake is one line and exit 2 (argparse's own included),
messages name the CLI flag, `report`/`sql` tell a trace from a run, `trace synth --ranks` is kept in the trace,
`simulate --help` prints no literal `%%`, and the README says how to run `ultraep` after `make setup`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ultraep.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def one_line_exit_2(res, *fragments):
    assert res.returncode == 2, (res.returncode, res.stdout[-500:], res.stderr[-2000:])
    err = res.stderr
    assert err.count("\n") == 1 and err.startswith("ultraep: error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "t.parquet"
    res = cli("trace", "synth", "--ranks", "4", "--experts", "8", "--layers", "1", "--steps", "3", "--top-k", "2", "--tokens", "64", str(out),
              "--no-progress")
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("args, fragments", [
    (["simulate", "t.parquet", "--topology", "h100-8x"], ["argument --topology: invalid choice: 'h100-8x'",
                                                          "(see: ultraep simulate --help)"]),
    (["demo", "--ranks", "two"], ["argument --ranks: invalid int value: 'two'"]),
    ([], ["the following arguments are required: command"]),
    (["report"], ["the following arguments are required: run"]),
    (["no-such-command"], ["invalid choice: 'no-such-command'"]),
])
def test_argparse_mistakes_are_one_line(args, fragments):
    one_line_exit_2(cli(*args), *fragments)


def test_report_and_sql_tell_a_trace_from_a_run(trace):
    one_line_exit_2(cli("report", str(trace)), "is a routing trace, not a recorded run", "ultraep simulate")
    one_line_exit_2(cli("sql", str(trace), "SELECT 1"), "is a routing trace, not a recorded run")
    renamed = trace.with_name("no-suffix")
    renamed.write_bytes(trace.read_bytes())  # told by Parquet's magic bytes, not only by the name
    one_line_exit_2(cli("report", str(renamed)), "is a routing trace")


def test_trace_synth_keeps_ranks_so_simulate_needs_no_flag(trace):
    res = cli("simulate", str(trace), "--policies", "none,quota", "--workers", "1", "--no-progress",
              "--topology", "gb200-nvl72")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "global counts only" not in res.stderr + res.stdout


def test_messages_name_the_cli_flag(tmp_path):
    odd = tmp_path / "loads.weird"
    odd.write_text("x")
    one_line_exit_2(cli("trace", "info", str(odd)), "--format")


def test_simulate_help_has_no_literal_percent_escape():
    res = cli("simulate", "--help")
    assert res.returncode == 0 and "%%" not in res.stdout and "percent of the" in res.stdout


def test_readme_says_how_to_run_ultraep_after_setup():
    text = (REPO / "README.md").read_text()
    head = text[: text.index("## Concepts")]
    assert ".venv/bin/ultraep" in head and re.search(r"source \.venv/bin/activate", head)
