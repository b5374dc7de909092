"""The wheel installs one namespace: `ultraep` (top-level folders mapped into it), nothing generic."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_only_the_ultraep_namespace(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("ultraep-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ultraep", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for pkg in ("policies", "kernels", "telemetry", "dashboard"):
        assert f"ultraep/{pkg}/__init__.py" in names
    assert "ultraep/policies/quota.py" in names
    assert "ultraep/kernels/kernel_times.csv" in names  # the measured times backend="auto" chooses from
    assert not any("/tests/" in n or n.startswith("benchmarks") for n in names)


def test_import_ultraep_is_light():
    code = (
        "import sys, ultraep; ultraep.Topology; "
        "heavy = [m for m in ('torch', 'triton', 'streamlit', 'duckdb', 'transformers', 'numba') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
