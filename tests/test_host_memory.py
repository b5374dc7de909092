"""benchmarks/host_memory.py: the runs of record keep the memory they free (and re-execute themselves to do so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import host_memory  # noqa: E402

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")

# faults while touching a 16 MiB block the second time it is allocated (the first one was freed)
_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, so the count is the same where THP is "always"
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 16 << 20
p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
p = libc.malloc(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(p, 1, n)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in host_memory.SETTINGS and k != host_memory.SWITCH}
    return {**env, **extra}


def test_with_settings_adds_what_is_missing_and_keeps_the_users_values():
    got = host_memory.with_settings({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "123"})
    if not sys.platform.startswith("linux"):
        assert got is None
        return
    assert got["PATH"] == "/bin" and got["MALLOC_TRIM_THRESHOLD_"] == "123"
    assert got["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and set(got) == {"PATH", *host_memory.SETTINGS}
    assert host_memory.with_settings({**host_memory.SETTINGS}) is None  # nothing to change: no re-execution
    assert host_memory.with_settings({host_memory.SWITCH: "asis"}) is None


@linux
def test_reexec_restarts_the_same_command_with_the_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(host_memory.os, "execve", lambda exe, argv, env: seen.append((exe, argv, env)))
    monkeypatch.setattr(host_memory, "started_here", lambda: True)
    for k in host_memory.SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv(host_memory.SWITCH, raising=False)
    host_memory.reexec_with_settings()
    (exe, argv, env), = seen
    assert exe == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert all(env[k] == v for k, v in host_memory.SETTINGS.items())
    monkeypatch.setenv(host_memory.SWITCH, "asis")  # the user's way out
    host_memory.reexec_with_settings()
    assert len(seen) == 1


def test_a_test_calling_a_benchmarks_main_keeps_its_process():
    assert not host_memory.started_here()  # pytest's __main__ is not a script of benchmarks/


@linux
def test_the_command_form_runs_the_command_with_the_settings():
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_memory", sys.executable, "-c",
                          "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'], os.environ['MALLOC_MMAP_THRESHOLD_'])"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str((1 << 31) - 1), str(32 << 20)]


def test_the_command_form_refuses_a_missing_command_with_exit_2():
    for argv in ([], ["no-such-command-ultraep"]):
        out = subprocess.run([sys.executable, "-m", "benchmarks.host_memory", *argv], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert ("usage" in out.stderr) if not argv else ("no-such-command-ultraep" in out.stderr)


@linux
def test_the_malloc_settings_keep_a_freed_block_resident():
    """Without them glibc hands the freed 16 MiB back and faults every page in again; with them it reuses it."""
    pages = (16 << 20) // os.sysconf("SC_PAGE_SIZE")
    runs = {}
    for name, extra in (("default", {}), ("kept", dict(host_memory.SETTINGS))):
        out = subprocess.run([sys.executable, "-c", _FAULTS], env=_env(**extra), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        runs[name] = int(out.stdout.strip())
    assert runs["default"] > pages // 2, runs  # the negative control: the block's pages were handed back
    assert runs["kept"] < pages // 20, runs
