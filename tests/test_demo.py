"""`ultraep demo --quick` end to end: real ranks (subprocess), both runs in the store, balancing helped on
the skewed layers, and the losses of the two runs are equal."""

import json
import re
import subprocess
import sys

import pytest

from ultraep.cli.demo_check import REL_TOL
from ultraep.telemetry import open_run


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    runs = tmp_path / "runs"
    res = subprocess.run(
        [sys.executable, "-m", "ultraep.cli", "demo", "--quick", "--ranks", "2", "--steps", "8", "--policy", "quota",
         "--out", str(runs)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "imbalance" in out and "speed-up" in out and "match: balancing does not change the math" in out
    assert "MISMATCH" not in out and "two equivalent unbalanced runs" in out
    assert "exposed overhead" in out and "predicted / measured" in out
    assert f"ultraep dashboard {runs}" in out
    # the verdict reads the step table, and the report measures the same step times from the store
    verdict = next(x for x in out.splitlines() if x.startswith(("balancing paid", "balancing did not pay",
                                                                 "no measurable difference")))
    printed = dict(re.findall(r"│\s+(none|quota)\s+│\s+([0-9]+\.[0-9]{3})\s+│", out))
    assert set(printed) == {"none", "quota"}, out[-3000:]
    assert f"step time p50 {printed['quota']} s" in verdict
    rep = subprocess.run([sys.executable, "-m", "ultraep.cli", "report", str(runs), "--json"], capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    answers = {a["policy"]: a for a in json.loads(rep.stdout)["answer"]}
    for pol in ("none", "quota"):
        assert f"{answers[pol]['step_time_p50_s']:.3f}" == printed[pol], (pol, answers[pol])
    assert answers["quota"]["basis"] == "measured" and answers["quota"]["baseline_id"].endswith("-none")
    # the speed-up's 90 % interval: the report computes the demo's from the store's steps (README: same figures)
    lo, hi = re.search(r"90 % interval (\d+\.\d\d)x-(\d+\.\d\d)x over the paired steps",
                       " ".join(verdict.split())).groups()
    assert [f"{v:.2f}" for v in answers["quota"]["speedup_interval_90"]] == [lo, hi], (lo, hi, answers["quota"])
    con = open_run(runs)
    kinds = con.execute("SELECT run_id, kind, world_size FROM runs WHERE rank = 0 ORDER BY run_id").fetchall()
    assert len(kinds) == 2 and {k[1] for k in kinds} == {"train"} and {k[2] for k in kinds} == {2}
    by_run = dict(con.execute(
        "SELECT run_id, avg(imbalance_after) / avg(imbalance_before) FROM layer_balance GROUP BY run_id").fetchall())
    none_run = next(r for r in by_run if r.endswith("-none"))
    quota_run = next(r for r in by_run if r.endswith("-quota"))
    assert by_run[none_run] == pytest.approx(1.0)
    assert by_run[quota_run] < 0.8  # imbalance after < before on the skewed layers
    skew = con.execute("SELECT avg(imbalance_before) FROM layer_balance WHERE run_id = ?", [quota_run]).fetchone()[0]
    assert skew > 1.3
    losses = con.execute(
        "SELECT step, max(loss) FILTER (WHERE run_id = ?), max(loss) FILTER (WHERE run_id = ?) FROM steps "
        "WHERE rank = 0 GROUP BY step ORDER BY step", [none_run, quota_run]).fetchall()
    assert len(losses) == 8
    # Same math, different fp32 summation order (replica rows are summed on another rank); Adam amplifies
    # the last-bit differences a little over the steps: 1e-4 relative is what the runs show.
    for _, a, b in losses:
        assert a == pytest.approx(b, rel=1e-3)


@pytest.mark.numerics
@pytest.mark.slow
def test_demo_compare_every_policy_first_step_is_exact(tmp_path):
    """--compare runs every policy on the same token stream; step 0's loss and gradients (before any optimizer
    step can amplify rounding) equal the unbalanced run's, expert row by expert row, within the fp32 tolerance
    for each, which the demo checks and prints as the verdict (exit 1 and MISMATCH otherwise)."""
    policies = ["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]
    res = subprocess.run(
        [sys.executable, "-m", "ultraep.cli", "demo", "--quick", "--ranks", "2", "--steps", "4", "--compare",
         ",".join(policies), "--out", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for p in policies[1:]:
        line = next(x for x in res.stdout.splitlines() if x.startswith(f"{p}: step 0"))
        step0 = float(line.split("max relative difference ")[1].split(" ")[0])
        assert step0 <= REL_TOL and "-> match" in line, line
    con = open_run(tmp_path / "runs")
    assert con.execute("SELECT count(DISTINCT run_id) FROM runs").fetchone()[0] == len(policies)


@pytest.mark.slow
def test_a_short_band_run_ends_early_and_says_so(tmp_path):
    """A machine too slow for three full runs in the budget runs the fp32 band's run (none, batch order reversed)
    for fewer steps (ultraep.cli.demo_size): the header says so, the band is compared over the steps it ran, and the
    verdict still comes from step 0."""
    code = ("import sys; from ultraep.cli.demo_job import DemoSettings, run_demo; "
            f"sys.exit(run_demo(DemoSettings(quick=True, steps=6, band_steps=4, policy='quota', out={str(tmp_path)!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "(+ none reordered, for the fp32 band, 4 steps)" in out
    line = next(x for x in out.splitlines() if x.startswith("quota: step 0"))
    assert "by step 5:" in line and "by step 3: Adam" in line and "by the end" not in line
    assert "-> match" in line
