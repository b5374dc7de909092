"""Work the machine cannot hold is refused up front with one line (issue 22).

The CLI rows run as the issue's new user ran them: a 6 GB address-space limit, in a fresh process whose
CPU time and peak RSS (``getrusage(RUSAGE_CHILDREN)`` of a small wrapper process, so other tests'
children do not count) are measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ultraep import limits
from ultraep.errors import ConfigError

# Runs the CLI under RLIMIT_AS, reports {rc, wall_s, maxrss_mb, stderr} as JSON. Only the standard library is
# imported here, so the child's RSS is the CLI's own.
_WRAPPER = r"""
import json, resource, subprocess, sys, time
limit = int(sys.argv[1])
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
t = time.perf_counter()
p = subprocess.run(sys.argv[2:], capture_output=True, text=True, preexec_fn=cap, timeout=120)
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": p.returncode, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "stderr": p.stderr,
                  "stdout": p.stdout, "maxrss_mb": ru.ru_maxrss / 1024}))
"""
_SIX_GB = 6 * 10**9


def _cli(*args, cwd=None, limit_bytes=_SIX_GB) -> dict:
    cmd = [sys.executable, "-c", _WRAPPER, str(limit_bytes), sys.executable, "-m", "ultraep.cli", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=180, check=True)
    return json.loads(out.stdout)


# (id, argv, fragments of the one error line); the first four are the issue's table
ROWS = [
    ("plan 1e9 experts", ["plan", "--synthetic", "--ranks", "4", "--experts", "1000000000"],
     ["--experts", "1,000,000,000", "16,777,216", "MAX_EXPERTS"]),
    ("plan 1e8 ranks x 1e8 experts", ["plan", "--synthetic", "--ranks", "100000000", "--experts", "100000000"],
     ["--ranks", "100,000,000", "MAX_RANKS"]),
    ("plan 1e12 tokens", ["plan", "--synthetic", "--ranks", "4", "--experts", "16", "--tokens", "1000000000000"],
     ["--tokens", "1,000,000,000,000", "2^31 - 1"]),
    ("trace synth 1e6 ranks x 1e6 experts", ["trace", "synth", "{tmp}/x.parquet", "--ranks", "1000000", "--experts",
                                             "1000000"], ["--ranks", "1,000,000", "MAX_RANKS"]),
    # within the bounds, beyond this address space: the memory check itself
    ("plan beyond memory", ["plan", "--synthetic", "--ranks", "64", "--experts", "16777216"],
     ["--ranks x --experts", "64 x 16,777,216", "would need", "available"]),
    ("trace synth beyond memory", ["trace", "synth", "{tmp}/y.parquet", "--ranks", "64", "--experts", "65536",
                                   "--steps", "1000"],
     ["--steps x --microbatches x --layers x --experts", "1,000 x 1 x 1 x 65,536", "would need", "available"]),
]


@pytest.mark.parametrize("argv, fragments", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_issue_rows_refused_fast_in_one_line_with_little_memory(tmp_path, argv, fragments):
    res = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = res["stderr"].strip()
    assert res["rc"] == 2, err
    assert err.startswith("ultraep: error: ") and "\n" not in err and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    # the child's whole life in CPU seconds (interpreter start, imports, refusal: about 1.5 s here), not wall seconds,
    # which a busy machine stretches (2.6 s measured beside another test suite); the work refused would take minutes
    assert res["cpu_s"] < 5.0, res
    assert res["maxrss_mb"] < 200, res
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a partial file


def test_large_token_counts_cost_what_small_ones_do():
    """Item 2: loads are sampled as counts, so 10^12 tokens per rank take no longer than 10^4."""
    from ultraep.sim.workload import synthetic_load

    def timed(tokens):
        t = time.perf_counter()
        load = synthetic_load(8, 64, top_k=4, tokens_per_rank=tokens, seed=2)
        return time.perf_counter() - t, load

    timed(10**4)  # warm-up
    small_s, small = timed(10**4)
    big_s, big = timed(10**12)
    assert big_s < 3 * small_s + 0.2, (small_s, big_s)
    # every token takes k distinct experts: each row sums to T * k, no expert gets more than T from a rank
    assert (big.sum(axis=1) == 4 * 10**12).all() and big.max() <= 10**12
    assert (small.sum(axis=1) == 4 * 10**4).all() and small.max() <= 10**4


def test_synthetic_load_is_deterministic_and_matches_its_inclusion_probabilities():
    from ultraep.sim.workload import fit_popularity, quantise_inclusion, solve_inclusion, synthetic_load, systematic_counts

    a = synthetic_load(8, 32, top_k=3, tokens_per_rank=1000, target_imbalance=1.7, seed=5)
    b = synthetic_load(8, 32, top_k=3, tokens_per_rank=1000, target_imbalance=1.7, seed=5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, synthetic_load(8, 32, top_k=3, tokens_per_rank=1000, target_imbalance=1.7, seed=6))
    # the counts sampler is exact for its per-token model: mean count of expert e over many draws = T * π_e
    pi = solve_inclusion(fit_popularity(8, 32, 3, 1.7, 5)[None], 3)[0]
    q = quantise_inclusion(pi, 3)
    assert q.sum() == 3 * 2**38 and q.max() <= 2**38
    rng = np.random.default_rng(0)
    draws = np.stack([systematic_counts(q, 40, rng) for _ in range(4000)])
    assert (draws.sum(axis=1) == 120).all() and draws.max() <= 40 and draws.min() >= 0
    se = np.sqrt(40 * pi * (1 - pi) / 4000) + 1e-9
    assert (np.abs(draws.mean(axis=0) - 40 * pi) < 5 * se + 1e-3).all()


def test_api_refusals_are_config_errors():
    from ultraep.planning import plan_layer
    from ultraep.sim.workload import synthetic_load

    with pytest.raises(ConfigError, match=r"synthetic_load\.num_experts: \(1,000,000,000\) must be in"):
        synthetic_load(4, 1_000_000_000)
    with pytest.raises(ConfigError, match=r"tokens_per_rank"):
        synthetic_load(4, 16, tokens_per_rank=2**52)  # x 4 ranks > 2^53
    # plan_layer checks the plan's size; lowered limits show the plumbing without allocating anything big
    with limits.raised(MAX_RANKS=4):
        with pytest.raises(ConfigError, match=r"topology\.num_ranks: \(8\) must be in 1\.\.4"):
            plan_layer(np.ones((8, 16), dtype=np.int64))
    plan_layer(np.ones((8, 16), dtype=np.int64))  # the override ended with the block
    with limits.raised(MEMORY_FRACTION=1e-9):
        with pytest.raises(ConfigError, match=r"would need .* for the \[R, E\] load .* available"):
            limits.check_plan(2048, 4096, 2)
    with pytest.raises(ConfigError, match="unknown limit 'MAX_FOO'"):
        limits.configure(MAX_FOO=1)


def test_check_dense_names_field_value_need_and_available():
    avail, src = limits.available_memory()
    if avail is None:
        pytest.skip("no memory information on this platform (not Linux)")
    with pytest.raises(ConfigError) as info:
        limits.check_dense("dump.csv.num_experts", 4, 2_000_000_000, value=2_000_000_000)
    msg = str(info.value)
    assert msg.startswith("dump.csv.num_experts: (2,000,000,000) would need 59.6 GiB for a dense [4, 2,000,000,000]")
    assert "available" in msg and src in msg and "\n" not in msg
    assert limits.check_dense("x", 4, 1000) == 32_000


def test_imported_trace_with_a_huge_expert_id_is_refused(tmp_path):
    """A plain Parquet trace whose experts are inferred as largest id + 1 = 2e9 + 1: refused before a dense
    matrix of that width exists (importer check), and a canonical trace that *declares* such a width is
    refused where it would be densified (simulate)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"step": [0, 0], "microbatch": [0, 0], "layer": [0, 0], "src_rank": [-1, -1],
                             "expert": [0, 2_000_000_000], "tokens": [5, 7]}), plain)
    res = _cli("trace", "import", plain, tmp_path / "out.parquet")
    err = res["stderr"].strip()
    assert res["rc"] == 2 and "\n" not in err and "num_experts" in err and "2,000,000,001" in err, err
    assert res["wall_s"] < 3.0, res
    # the refusal holds only the CLI, pyarrow and the two rows (~130 MB measured), not a dense matrix (60 GiB);
    # building the parser imports neither numba nor the cost model
    assert res["maxrss_mb"] < 200, res
    assert not (tmp_path / "out.parquet").exists()

    from ultraep.sim import build_cost_model, simulate
    from ultraep.traces import Trace, TraceMeta

    E = limits.MAX_EXPERTS * 2
    tr = Trace.from_columns(TraceMeta(num_experts=E), step=[0], microbatch=[0], layer=[0], src_rank=[-1],
                            expert=[E - 1], tokens=[3])
    cm = build_cost_model("gb200-nvl72", 4, E, 2)
    with pytest.raises(ConfigError, match=r"trace\.num_experts: \(33,554,432\) must be in 1\.\.16,777,216"):
        simulate(tr, cm, ["none"], workers=1)


def test_interrupted_write_leaves_no_trace_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from ultraep.traces import Trace, TraceMeta

    tr = Trace.from_columns(TraceMeta(num_experts=4), step=[0], microbatch=[0], layer=[0], src_rank=[-1],
                            expert=[1], tokens=[3])
    real = pq.write_table

    def half_then_ctrl_c(table, where, **kw):
        real(table.slice(0, 0), where, **kw)  # something is on disk under the temporary name
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        tr.write(tmp_path / "t.parquet")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(pq, "write_table", real)
    tr.write(tmp_path / "t.parquet")
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a live process (its threads included) has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd on (the name may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and signals a process group")
def test_ctrl_c_during_trace_synth_stops_cleanly(tmp_path):
    out = tmp_path / "big.parquet"
    # ~30 s of sampling and writing if left alone
    p = subprocess.Popen([sys.executable, "-m", "ultraep.cli", "trace", "synth", str(out), "--ranks", "64", "--experts",
                          "65536", "--steps", "400", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # wait until it is sampling (its RSS passes the ~150 MB of a started CLI), not still importing
    deadline = time.time() + 30
    while _rss_mb(p.pid) < 350 and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()
    cpu_before = _cpu_s(p.pid)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    # "stops promptly" in CPU seconds the process spends after the signal (the ~30 s of work left would show),
    # not wall seconds, which a busy machine stretches
    deadline = time.monotonic() + 120
    while (done := os.wait4(p.pid, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, "no exit within 120 s of Ctrl-C"
        time.sleep(0.05)
    _, status, usage = done
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read()
    assert usage.ru_utime + usage.ru_stime - cpu_before < 5.0
    assert p.returncode == 130, err
    assert err.strip() == "ultraep: interrupted", err
    assert list(Path(tmp_path).iterdir()) == []  # no output, no partial file
