"""`.ci/run` reruns the exactness tests under other kernel paths and says, for each, whether it changes anything
against the plain run (``.ci/kernel_fingerprint.py``): a path that changes nothing on this machine (MKL held to
AVX2 on an AMD CPU) or whose portable kernels give the plain run's bits is never a silent duplicate."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "kernel_fingerprint.py"
_spec = importlib.util.spec_from_file_location("kernel_fingerprint", SCRIPT)
kf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kf)

PLAIN = {"capability": "AVX512", "digests": {"sgemm": "aaaa", "silu": "bbbb", "sum": "cccc"}}


def test_the_verdict_tells_a_duplicate_from_a_path_that_changes_bits():
    same = kf.verdict(PLAIN, json.loads(json.dumps(PLAIN)), "MKL_ENABLE_INSTRUCTIONS=AVX2")
    assert "changes nothing here" in same and "repeats the plain run" in same, same
    portable = kf.verdict(PLAIN, {**PLAIN, "capability": "DEFAULT"}, "ATEN_CPU_CAPABILITY=default")
    assert "DEFAULT kernels" in portable and "plain run's (AVX512) fp32 bits" in portable, portable
    # negative controls: one operation's bits differ, so neither duplicate verdict may be given
    for capability in ("AVX512", "DEFAULT"):
        other = {"capability": capability, "digests": {**PLAIN["digests"], "silu": "dddd"}}
        got = kf.verdict(PLAIN, other, "X=1")
        assert "other bits" in got and "silu" in got and "sgemm" not in got, got
        assert "nothing" not in got and "duplicate" not in got, got


def test_the_script_compares_with_the_saved_plain_fingerprint(tmp_path):
    plain = tmp_path / "plain.json"
    run = [sys.executable, str(SCRIPT)]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    first = subprocess.run([*run, "--save", str(plain)], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.startswith("cpu capability ") and plain.exists()
    again = subprocess.run([*run, "--against", str(plain), "--label", "the same environment"], env=env,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert again[0] == first.stdout.strip() and again[1].startswith("the same environment changes nothing here")
    # the portable kernels: whatever this CPU gives, the verdict is the one the digests call for
    portable = subprocess.run([*run, "--against", str(plain), "--label", "default"],
                              env={**env, "ATEN_CPU_CAPABILITY": "default"}, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    saved = json.loads(plain.read_text())
    digests = dict(zip(*[iter(portable[0].split("fp32 digests: ")[1].split())] * 2))
    want = kf.verdict(saved, {"capability": portable[0].split(";")[0].split()[-1], "digests": digests}, "default")
    assert portable[1] == want


def test_ci_prints_a_verdict_for_every_kernel_path():
    run = (ROOT / ".ci" / "run").read_text()
    assert "kernel_fingerprint.py --save" in run and '--against "$plain" --label "$path"' in run
