"""The dashboard in a real browser: `ultraep dashboard`'s Streamlit server (127.0.0.1, a free port) on a run
that a background thread keeps recording, driven by Playwright in Debian's chromium. Every page renders its
charts with no exception element, the live row count grows, and screenshots go to the test's tmp dir only (the
suite never writes into the checkout; ``DASHBOARD_SCREENSHOT=docs/img/dashboard.png pytest
tests/test_dashboard_browser.py`` copies the Overview one there to refresh the README's image).

Skipped, with the reason, when chromium or the Python playwright package is missing (never downloads a
browser: `playwright install` is not used)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from browser_utils import chromium, open_page, require_browser, served_dashboard
PAGES = [("Layers", "layers"), ("Experts", "experts"), ("Policies", "policies"), ("Transfers", "transfers"),
         ("Compare", "compare"), ("SQL", "sql")]

require_browser()

import ultraep  # noqa: E402
from ultraep.telemetry import Recorder  # noqa: E402

TOPO = ultraep.Topology(num_ranks=8, num_experts=32, num_redundant_slots=2, expert_bytes=64 << 20)
LAYERS = 8


def _load(rng, step: int, layer: int) -> np.ndarray:
    load = rng.integers(0, 120, (8, 32))
    hot = (step // 6 + 3 * layer) % 32  # hot experts drift every few steps
    load[:, hot] += 900
    load[:, (hot + 7) % 32] += 400
    return load


_PLANS: dict = {}


def _plan(step: int, layer: int, policy: str):
    """Plans come from a small pool (planned once), so the background 'training loop' costs little CPU."""
    key = (step % 48, layer, policy)
    if key not in _PLANS:
        rng = np.random.default_rng(hash(key) % (1 << 32))
        _PLANS[key] = ultraep.plan_layer(_load(rng, step % 48, layer), policy, topology=TOPO)
    return _PLANS[key]


def record_steps(rec, rng, steps, policy_of) -> None:
    for step in steps:
        for layer in range(LAYERS):
            pol = policy_of(step, layer)
            plan = _plan(step, layer, pol)
            pred = {"quota": 2.0e-3, "eplb": 2.4e-3, "none": 3.1e-3}
            rec.record_plan(step, 0, layer, plan)
            rec.record_decision(step, 0, layer, policy=pol, reason=f"cheapest predicted ({pol})",
                                predictions=pred, chosen_predicted_s=pred[pol])
            rec.record_timings(step, 0, layer, {"plan_s": 5e-5, "transfer_s": 1e-5 * len(plan.transfers),
                                                "measured_s": pred[pol] * float(rng.uniform(0.95, 1.2)),
                                                "predicted_s": pred[pol],
                                                # the rank's expert activations: a hot layer holds 2x before
                                                "activation_bytes_before": 4e7 * (1 + layer % 2),
                                                "activation_bytes_after": 4e7})
        rec.record_step(step, loss=2.0 / (1 + 0.1 * step), step_time_s=0.2)


def _adaptive(step: int, layer: int) -> str:
    return ("quota", "eplb", "quota", "none")[(step // 5 + layer) % 4]


class LiveRun:
    """A training loop stand-in that keeps recording until stopped."""

    def __init__(self, root: Path) -> None:
        self.rec = Recorder.open(root, "live-train", kind="train", model="toy-moe-8x32", world_size=8, rank=0,
                                 topology=TOPO, flush_interval_s=0.5)
        self.stop = threading.Event()
        self.step = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        rng = np.random.default_rng(0)
        try:
            while not self.stop.is_set():
                record_steps(self.rec, rng, [self.step], _adaptive)
                self.step += 1
                time.sleep(0.25)
        except BaseException as exc:  # pragma: no cover - surfaced by the test
            self.error = exc

    def __enter__(self) -> "LiveRun":
        rng = np.random.default_rng(1)
        record_steps(self.rec, rng, range(30), _adaptive)  # some history before the dashboard opens
        self.step = 30
        self.rec.flush()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.rec.close()


def _row_count(page) -> int:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="layer-microbatch rows")
    return int(metric.locator('[data-testid="stMetricValue"]').inner_text().replace(",", "").strip())


def _settle(page) -> None:
    """Wait until every chart on the page is drawn."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')]"
        ".every(c => c.querySelector('.main-svg'))", timeout=60_000)
    page.wait_for_timeout(300)


@pytest.mark.slow
def test_dashboard_in_chromium_on_a_run_being_written(tmp_path):
    root = tmp_path / "runs"
    with Recorder.open(root, "done-train", kind="train", model="toy-moe-8x32", world_size=8, rank=0, topology=TOPO,
                       flush_interval_s=None) as done:  # a finished run of the same workload (Compare)
        record_steps(done, np.random.default_rng(2), range(40), lambda s, layer: "quota")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with LiveRun(root) as live:
        with served_dashboard(root, tmp_path, refresh=2.0) as url, chromium() as browser:
            page = open_page(browser)
            page.goto(url + "/?run=live-train")
            page.wait_for_selector('[data-testid="stPlotlyChart"]')
            page.wait_for_selector('[data-testid="stMetric"]')
            header = page.locator('[data-testid="stMain"]').inner_text()
            assert "live-train" in header and "● live" in header, header[:300]
            first = _row_count(page)
            grown = first
            deadline = time.time() + 30
            while grown <= first and time.time() < deadline:  # the page refreshes itself
                page.wait_for_timeout(1000)
                grown = _row_count(page)
            assert grown > first, f"the live row count stayed at {first}"
            assert page.locator('[data-testid="stException"]').count() == 0
            _settle(page)
            page.screenshot(path=str(shots / "overview.png"), full_page=True)
            for title, path in PAGES:
                page.locator('[data-testid="stSidebar"] a').filter(has_text=title).first.click()
                page.wait_for_url(f"**/{path}*")
                if path == "sql":
                    page.get_by_role("button", name="Run", exact=True).click()
                    page.wait_for_selector('[data-testid="stDataFrame"]')
                else:
                    page.wait_for_selector('[data-testid="stPlotlyChart"]')
                _settle(page)
                assert page.locator('[data-testid="stException"]').count() == 0, path
                assert page.locator("h1").first.inner_text().strip() == title
                if path == "layers":  # the activation-memory view draws its per-rank chart (issue 35)
                    view = page.locator('[data-testid="stPlotlyChart"]').filter(
                        has_text="expert activation memory per rank")
                    view.first.wait_for()
                    assert "Expert activation memory" in page.locator('[data-testid="stMain"]').inner_text()
                page.screenshot(path=str(shots / f"{path}.png"), full_page=True)
        assert live.error is None, live.error
        assert live.step > 30
    for name in ["overview"] + [p for _, p in PAGES]:
        assert (shots / f"{name}.png").stat().st_size > 10_000, name
    target = os.environ.get("DASHBOARD_SCREENSHOT")
    if target:  # asked for by name: the README's image is refreshed on purpose, never by a plain run
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shots / "overview.png", target)
