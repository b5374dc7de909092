"""Issue 15, item 5: ``ultraep dashboard`` takes its Streamlit server down with it.

The command is started as a user would (``python -m ultraep.cli dashboard DIR --port P``), the test waits
until the server listens, signals the *parent* only (as a process manager or ``kill PID`` does), and then
checks that the parent exits, the Streamlit child is gone and nothing listens on the port any more.
Before the fix SIGTERM killed the parent and left the child serving.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the child through /proc")

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:  # fields after "(comm)": state, ppid, ...
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_dashboard_stops_the_streamlit_server(tmp_path, sig):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, "-m", "ultraep.cli", "dashboard", str(tmp_path), "--port", str(port)],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):
            assert parent.poll() is None, parent.stderr.read().decode()
            assert time.monotonic() < deadline, "the dashboard never started listening"
            time.sleep(0.2)
        children = _children(parent.pid)
        assert children, "the dashboard runs Streamlit in a child process"
        parent.send_signal(sig)
        parent.wait(timeout=120)  # a stop, not a timing: Streamlit's shutdown takes 40 s+ on a machine at load 13
        deadline = time.monotonic() + 15
        while (_listening(port) or any(map(_alive, children))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port), f"something still listens on port {port} after {sig.name} to the dashboard"
        assert not any(map(_alive, children)), f"Streamlit child left running after {sig.name}"
        # Ctrl+C is a normal stop (0); after SIGTERM Streamlit exits 0, or 143 (128 + 15) when the signal
        # lands before it has installed its own handler
        ok = (0,) if sig == signal.SIGINT else (0, 128 + signal.SIGTERM)
        assert parent.returncode in ok, parent.stderr.read().decode()
    finally:
        for pid in [*children, parent.pid]:  # never leave a server behind, whatever failed above
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(timeout=10)
