"""Dashboard page load on a large run: every page, cold (first view after the server started) and warm.

The run: ``--layers`` × ``--steps`` layer-step rows (default 50 × 20 000 = 1 M) of an EP8 model with 32
experts and 2 redundant slots per rank, with a plan, a decision and timings per row. Rows are generated
through the recorder's own batch path (``telemetry.batches.plan_tables`` / ``decision_table`` /
``timings_table`` → Arrow) from a pool of real plans (``ultraep.plan_layer``: quota, eplb, none), for one
block of steps, and the block is written again with shifted steps through the recorder's ``ParquetSink``
(one part per table per block, as a flush writes them).

Measured, in one process (Streamlit's AppTest runs the real app script; a page load = one script run of
that page, what the server spends before the browser can draw):

* ``mirror ingest``: reading the run's parts into the dashboard's in-memory facts (cold only);
* ``page load (cold)``: the first view of each page, in menu order (Overview pays the ingest of the
  per-layer facts, Experts the per-expert ones);
* ``page load (warm)``: later views (what every visit and every live refresh costs), ``--repeat`` times;
* ``live refresh``: the Overview after one more step of rows was written.

``--browser`` also times each page in Debian's chromium (Playwright): click in the menu → every chart drawn.

Usage::

    .venv/bin/python benchmarks/bench_dashboard.py                     # 1 M rows, AppTest only
    .venv/bin/python benchmarks/bench_dashboard.py --browser           # + real browser
    .venv/bin/python benchmarks/bench_dashboard.py --steps 2000 --repeat 3   # quick

Prints a table; writes long-form rows to ``benchmarks/results/bench_dashboard.csv``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import row, write_rows  # noqa: E402

PAGES = ("overview", "layers", "experts", "policies", "transfers", "compare", "sql")
APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


# --------------------------------------------------------------------------- the run
def generate(runs_dir: Path, name: str, layers: int, steps: int, block_steps: int = 2000) -> tuple[Path, int]:
    """Write the run; returns (run directory, layer-step rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    import ultraep
    from ultraep.telemetry import Recorder
    from ultraep.telemetry import batches as bt
    from ultraep.telemetry.sinks import ParquetSink

    topo = ultraep.Topology(num_ranks=8, num_experts=32, num_redundant_slots=2, expert_bytes=64 << 20)
    rng = np.random.default_rng(0)
    pool = []
    for i in range(96):
        load = rng.integers(0, 200, (8, 32))
        load[:, (i * 5) % 32] += 900
        load[:, (i * 11 + 3) % 32] += 400
        pool.append(ultraep.plan_layer(load, ("quota", "eplb", "none")[i % 3], topology=topo))
    rec = Recorder.open(runs_dir, name, kind="simulation", model="bench-moe-8x32", world_size=8, rank=0,
                        topology=topo, flush_interval_s=None, otel=False)
    sink = ParquetSink(rec.run_dir, 0, "bench0000")
    block_steps = min(block_steps, steps)
    B = block_steps * layers
    idx = np.arange(B)
    bsteps, blayers = idx // layers, idx % layers
    pick = (bsteps * 7 + blayers * 13 + (bsteps // 50) * 3) % len(pool)
    t0 = time.time_ns()
    plans = [(int(s), 0, int(l), pool[k], False, t0 + int(s) * 1000) for s, l, k in zip(bsteps, blayers, pick)]
    built = bt.Built()
    bt.plan_tables(rec.run_id, 0, plans, built)
    pred = {"quota": 2.0e-3, "eplb": 2.4e-3, "none": 3.1e-3}
    bt.decision_table(rec.run_id, 0, [(s, mb, l, ts, p.policy, f"cheapest predicted ({p.policy})", pred,
                                       pred[p.policy]) for s, mb, l, p, _, ts in plans], built)
    noise = rng.uniform(0.95, 1.2, B)
    bt.timings_table(rec.run_id, 0, [(s, mb, l, ts, {"plan_s": p.solve_time_s, "transfer_s": 1e-5 * len(p.transfers),
                                                     "measured_s": pred[p.policy] * float(noise[i]),
                                                     "predicted_s": pred[p.policy]})
                                     for i, (s, mb, l, p, _, ts) in enumerate(plans)], built)
    assert built.bad == 0, built.first_error
    for start in range(0, steps, block_steps):
        n = min(block_steps, steps - start)
        for table, tbl in built.tables.items():
            if "step" not in tbl.column_names:
                continue
            t = tbl.filter(pc.less(tbl.column("step"), n)) if n < block_steps else tbl
            i = t.column_names.index("step")
            t = t.set_column(i, "step", pc.add(t.column("step"), pa.scalar(start, pa.int64())))
            sink.write(table, t)
    rec.close()
    return rec.run_dir, steps * layers


def append_step(run_dir: Path, step: int, layers: int) -> None:
    """One more step of rows (a live run's next flush; removed again by :func:`remove_appended`)."""
    import ultraep
    from ultraep.telemetry import batches as bt
    from ultraep.telemetry.sinks import ParquetSink

    topo = ultraep.Topology(num_ranks=8, num_experts=32, num_redundant_slots=2, expert_bytes=64 << 20)
    load = np.random.default_rng(step).integers(0, 200, (8, 32))
    load[:, 3] += 900
    plan = ultraep.plan_layer(load, "quota", topology=topo)
    built = bt.Built()
    bt.plan_tables(run_dir.name, 0, [(step, 0, l, plan, False, time.time_ns()) for l in range(layers)], built)
    sink = ParquetSink(run_dir, 0, f"live{step:05d}")
    for table, tbl in built.tables.items():
        sink.write(table, tbl)


def remove_appended(run_dir: Path) -> None:
    for part in run_dir.glob("*/r*-live*.parquet"):
        part.unlink()


# --------------------------------------------------------------------------- timing pages
def _apptest(root: Path, page: str):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(APP), default_timeout=600)
    at.session_state["ultraep_root"] = str(root)
    return at


def _load(at, page: str) -> float:
    if page != "overview":
        at.switch_page(f"pages/{page}.py")
    t = time.perf_counter()
    at.run()
    dt = time.perf_counter() - t
    assert not at.exception, (page, [e.value for e in at.exception])
    return dt


def _sql(at) -> None:
    if at.text_area:
        at.text_area(key="sql_text").set_value(
            "SELECT layer, avg(imbalance_after) AS after FROM layer_balance WHERE step >= 19000 GROUP BY layer")
        at.button(key="sql_run").click()


def bench_apptest(root: Path, run_dir: Path, rows: int, repeat: int, layers: int) -> list[dict]:
    from ultraep.dashboard import data

    out = []
    # Process warm-up on a tiny run: imports (plotly, pandas, duckdb), Arrow kernels, Streamlit.
    tiny = Path(tempfile.mkdtemp(prefix="ultraep-bench-tiny-"))
    generate(tiny, "tiny", 2, 4)
    t = time.perf_counter()
    at = _apptest(tiny, "overview")
    for page in PAGES:
        _load(at, page)
    out.append(("process warm-up (tiny run, all pages)", "cold", [time.perf_counter() - t]))
    shutil.rmtree(tiny, ignore_errors=True)

    # Mirror ingest alone (a fresh mirror of the big run).
    m = data.RunMirror(run_dir)
    t = time.perf_counter()
    m.refresh()
    out.append(("mirror ingest: per-layer facts", "cold", [time.perf_counter() - t]))
    t = time.perf_counter()
    m.refresh(("expert", "replica"))
    out.append(("mirror ingest: per-expert facts", "cold", [time.perf_counter() - t]))
    del m

    # Pages: cold (first view, fresh mirror pool) then warm.
    from ultraep.dashboard import ui

    ui.pool.clear()
    ui.headline_cache.clear()
    at = _apptest(root, "overview")
    for page in PAGES:
        if page == "sql":
            _load(at, page)  # the SQL page shows nothing until a query runs
            _sql(at)
        out.append((f"page load: {page}", "cold", [_load(at, page)]))
    for page in PAGES:
        times = []
        for _ in range(repeat):
            if page == "sql":
                _sql(at)
            times.append(_load(at, page))
        out.append((f"page load: {page}", "warm", times))
    # Live: one more step arrives; the Overview refreshes.
    steps = rows // layers
    times = []
    for k in range(repeat):
        append_step(run_dir, steps + k, layers)
        times.append(_load(at, "overview"))
    out.append(("live refresh: overview after one more step", "warm", times))
    remove_appended(run_dir)
    return [_row(what, state, v, rows) for what, state, v in out]


def bench_browser(root: Path, rows: int, repeat: int) -> list[dict]:
    """Menu click → every chart drawn, in Debian's chromium (cold: first visit of the server)."""
    import socket
    import subprocess
    import urllib.request

    from playwright.sync_api import sync_playwright

    from ultraep.dashboard.cli import streamlit_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(streamlit_command(root, port=port), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    out = []
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/_stcore/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        drawn = ("() => { const c = [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')];"
                 " return c.length > 0 && c.every(x => x.querySelector('.main-svg')) &&"
                 " !document.querySelector('[data-testid=\"stStatusWidget\"]'); }")
        drawn_page = ("(title) => { const h = document.querySelector('h1');"
                      " const c = [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')];"
                      " return h && h.innerText.trim() === title && c.length > 0 &&"
                      " c.every(x => x.querySelector('.main-svg')) &&"
                      " !document.querySelector('[data-testid=\"stStatusWidget\"]'); }")
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                   args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                         "--disable-component-update", "--disable-sync"])
            page = b.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(120_000)
            t = time.perf_counter()
            page.goto(url + "/")
            page.wait_for_function(drawn)
            out.append(("browser: first page (server cold)", "cold", [time.perf_counter() - t]))
            titles = {"overview": "Overview", "layers": "Layers", "experts": "Experts", "policies": "Policies",
                      "transfers": "Transfers", "compare": "Compare"}
            for state, n in (("cold", 1), ("warm", repeat)):
                for key, title in titles.items():
                    times = []
                    for _ in range(n):
                        other = "Layers" if key == "overview" else "Overview"
                        page.locator('[data-testid="stSidebar"] a').filter(has_text=other).first.click()
                        page.wait_for_function(drawn_page, arg=other)
                        t = time.perf_counter()
                        page.locator('[data-testid="stSidebar"] a').filter(has_text=title).first.click()
                        page.wait_for_function(drawn_page, arg=title)
                        times.append(time.perf_counter() - t)
                    out.append((f"browser: {key}", state, times))
            b.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return [_row(what, state, v, rows) for what, state, v in out]


def _row(what: str, state: str, values, rows: int) -> dict:
    r = row(what, f"ultraep.dashboard ({state})", "wall time", "s", rows, values)
    r["_n"] = len(values)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5, help="warm page loads per page")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="where to write the run (default: a temporary directory, removed afterwards)")
    p.add_argument("--browser", action="store_true", help="also time the pages in chromium (Playwright)")
    p.add_argument("--no-write", action="store_true", help="print only; do not append to benchmarks/results")
    args = p.parse_args(argv)

    root = args.runs_dir or Path(tempfile.mkdtemp(prefix="ultraep-bench-dashboard-"))
    name = f"bench-{args.layers}x{args.steps}"
    t = time.perf_counter()
    run_dir = root / name
    if run_dir.exists():
        rows = args.layers * args.steps
        remove_appended(run_dir)
        print(f"reusing {run_dir}")
    else:
        run_dir, rows = generate(root, name, args.layers, args.steps)
    gen_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in run_dir.rglob("*.parquet"))
    print(f"run: {rows:,} layer-step rows, {size / 2**20:.0f} MiB of Parquet, generated in {gen_s:.1f} s")
    try:
        results = bench_apptest(root, run_dir, rows, args.repeat, args.layers)
        if args.browser:
            results += bench_browser(root, rows, args.repeat)
    finally:
        if args.runs_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'what':48s} {'state':6s} {'n':>3s} {'p50 s':>8s} {'p20 s':>8s} {'p80 s':>8s}")
    for r in results:
        state = r["provider"].split("(")[1].rstrip(")")
        print(f"{r['what']:48s} {state:6s} {r.pop('_n'):3d} {r['p50']:8.3f} {r['p20']:8.3f} {r['p80']:8.3f}")
    if not args.no_write:
        print(f"\nrows appended to {write_rows('bench_dashboard', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
