"""The wheel installs one namespace: `ultraep` (top-level folders mapped into it), nothing generic; it installs and
runs outside the repository; building it (and the editable install `make setup` does) prints no setuptools warning.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a build reads: the project table, the readme, and the folders package-dir maps
SOURCES = ("pyproject.toml", "README.md", "ultraep", "policies", "kernels", "telemetry", "dashboard")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out)],
        check=True, capture_output=True,
    )
    (whl,) = out.glob("ultraep-*.whl")
    return whl


def test_wheel_has_only_the_ultraep_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ultraep", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for pkg in ("policies", "kernels", "telemetry", "dashboard"):
        assert f"ultraep/{pkg}/__init__.py" in names
    assert "ultraep/policies/quota.py" in names and "ultraep/telemetry/schema.sql" in names
    assert "ultraep/dashboard/pages/overview.py" in names  # Streamlit reads its pages from the installed folder
    assert "ultraep/kernels/kernel_times.csv" in names  # the measured times backend="auto" chooses from
    assert "ultraep/integrations/torchtitan.py" in names and "ultraep/models/torchtitan.py" in names
    assert not any("/tests/" in n or n.startswith("benchmarks") for n in names)


def test_the_wheel_installs_and_runs_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    # the wheel's copy first on the path (dependencies come from this interpreter's site-packages); run from a
    # folder that is not the repository, so nothing of the checkout can be imported by accident
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([str(site / "bin" / "ultraep"), "--version"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ultraep 0.1.0", out.stdout + out.stderr
    code = (
        "import ultraep, numpy as np; from ultraep.telemetry import Recorder, open_run\n"
        "plan = ultraep.plan_layer(np.array([[90, 10, 10, 10], [90, 10, 10, 10]]), 'quota', num_redundant_slots=1)\n"
        "with Recorder.open('runs', 'r', flush_interval_s=None) as rec:\n"
        "    rec.record_step(0, loss=1.0, step_time_s=0.1)\n"
        "print(ultraep.__file__, plan.num_replicas, open_run('runs/r').execute('SELECT count(*) FROM steps').fetchone()[0])"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    where, replicas, steps = res.stdout.split()
    assert Path(where).is_relative_to(site) and int(replicas) > 0 and steps == "1"


def unlisted_packages(cfg: dict, root: Path = ROOT) -> set[str]:
    """Folders of .py files under the mapped folders that ``packages`` does not list (setuptools warns about
    each and leaves it out of the wheel)."""
    st = cfg["tool"]["setuptools"]
    found = set()
    for name, folder in st["package-dir"].items():
        for d in [root / folder, *(p for p in (root / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" not in d.parts and any(d.glob("*.py")):
                rel = d.relative_to(root / folder).parts
                found.add(".".join((name, *rel)))
    return found - set(st["packages"])


def test_every_folder_of_python_files_is_a_listed_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert unlisted_packages(cfg) == set()
    # negative control: the list as it was before the pages folder was added
    cfg["tool"]["setuptools"]["packages"].remove("ultraep.dashboard.pages")
    assert unlisted_packages(cfg) == {"ultraep.dashboard.pages"}


# pip runs the build backend's hooks in a subprocess and shows every UserWarning they raise: this does the same
_BUILD = r"""
import json, sys, warnings
from setuptools import build_meta
out, hooks = sys.argv[1], sys.argv[2:]
with warnings.catch_warnings(record=True) as caught:
    for hook in hooks:
        getattr(build_meta, hook)(out)
with open(out + "/warnings.json", "w") as f:
    json.dump([str(w.message).split("\n")[0] for w in caught if issubclass(w.category, UserWarning)], f)
"""


def _build_warnings(src: Path, hooks: list[str], filters: str | None) -> list[str]:
    out = src / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if filters:
        env["PYTHONWARNINGS"] = filters
    res = subprocess.run([sys.executable, "-c", _BUILD, str(out), *hooks], cwd=src, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "warnings.json").read_text())


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)
    return dest


def _makefile_filter() -> str:
    return re.search(r"^QUIET_BUILD := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()


@pytest.mark.slow
def test_make_setups_build_prints_no_warning(tmp_path):
    """The wheel and the editable install `make setup` makes, built with the Makefile's one filter: no warning.
    Negative controls: without the filter setuptools' editable notice shows (the recording sees warnings), and
    the project table as it was (license as a table, the pages folder unlisted) warns twice."""
    src = _copy_sources(tmp_path / "now")
    assert _build_warnings(src, ["build_wheel", "build_editable"], _makefile_filter()) == []
    src = _copy_sources(tmp_path / "unfiltered")
    assert any(w.startswith("Editable installation") for w in _build_warnings(src, ["build_editable"], None))

    old = _copy_sources(tmp_path / "old")
    text = (old / "pyproject.toml").read_text()
    text = text.replace('license = "Apache-2.0"', 'license = { text = "Apache-2.0" }')
    text = text.replace(', "ultraep.dashboard.pages"]', "]").replace(
        '"ultraep.telemetry" = ["*.sql"]', '"ultraep.telemetry" = ["*.sql"]\n"ultraep.dashboard" = ["pages/*.py"]')
    (old / "pyproject.toml").write_text(text)
    got = _build_warnings(old, ["build_wheel"], _makefile_filter())
    assert any("project.license` as a TOML table is deprecated" in w for w in got), got
    assert any("'ultraep.dashboard.pages' is absent from the `packages` configuration" in w for w in got), got


def test_the_kernels_extra_installs_triton_on_linux_only():
    """Triton has no macOS or Windows wheels: the extra carries a platform marker (the kernels' pure-torch
    references serve every CPU path; tests/test_kernels_backend.py runs them with triton unimportable)."""
    from packaging.requirements import Requirement

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in cfg["project"]["optional-dependencies"]["kernels"]]
    assert req.name == "triton" and req.marker is not None
    assert req.marker.evaluate({"platform_system": "Linux"})
    assert not req.marker.evaluate({"platform_system": "Darwin"})
    assert not req.marker.evaluate({"platform_system": "Windows"})


def test_version_is_the_projects_and_the_cli_prints_it():
    """pyproject.toml's version is the one source: the installed metadata, ``ultraep.__version__`` and
    ``ultraep --version`` all say it."""
    import ultraep

    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ultraep.__version__ == want
    assert want not in (ROOT / "ultraep" / "__init__.py").read_text()  # no second copy to drift
    out = subprocess.run([sys.executable, "-m", "ultraep.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"ultraep {want}", out.stdout + out.stderr


def test_import_ultraep_is_light():
    code = (
        "import sys, ultraep; ultraep.Topology; "
        "heavy = [m for m in ('torch', 'triton', 'streamlit', 'duckdb', 'transformers', 'numba', 'torchtitan') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
