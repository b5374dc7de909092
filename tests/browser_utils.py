"""Shared by the real-browser dashboard tests: Debian's chromium (never a downloaded browser), a free port, and
waiting for the Streamlit server to answer."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def require_browser() -> None:
    """Skip the calling test module unless Debian's chromium, Playwright and Streamlit are here."""
    import pytest

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium; .ci/run does)",
                    allow_module_level=True)
    pytest.importorskip("playwright.sync_api", reason="the Python playwright package is not installed")
    pytest.importorskip("streamlit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("streamlit did not become healthy")
