"""Shared by the real-browser dashboard tests: Debian's chromium (never a downloaded browser), a free port, and
``ultraep dashboard``'s Streamlit server started, waited for and stopped (:func:`served_dashboard`), the browser
launched (:func:`chromium`) and a page opened in it (:func:`open_page`)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def served_dashboard(root: Path, tmp_path: Path, *, refresh: float, timeout: float = 60.0) -> Iterator[str]:
    """``ultraep dashboard root``'s Streamlit server on 127.0.0.1 and a free port, run in ``tmp_path`` with its output
    in ``tmp_path/streamlit-<port>.log`` (nothing written into the checkout); yields its URL once its health check
    answers (within ``timeout`` s), and stops it on the way out (killed when it has not exited within 20 s)."""
    from ultraep.dashboard.cli import streamlit_command

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / f"streamlit-{port}.log", "w") as log:
        proc = subprocess.Popen(streamlit_command(root, port=port, refresh=refresh), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_healthy(url, proc, timeout=timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()


@contextmanager
def chromium():
    """Debian's chromium, headless, driven by Playwright (a ``playwright.sync_api.Browser``); closed on the way out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, width: int = 1500, height: int = 1100, timeout_ms: float = 60_000):
    """A new page of ``browser`` with a ``width`` x ``height`` px viewport, waiting up to ``timeout_ms`` by default."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(timeout_ms)
    return page
