"""``ultraep sql``, ``ultraep report`` and ``ultraep export``: offline SQL over recorded runs.

RUN is a run directory (``RUNS_DIR/RUN_ID``), a directory of runs, or a ``.duckdb`` file made by
``ultraep export``. User mistakes (no such run, a bad query) raise :class:`TelemetryError`, which the
``ultraep`` entry point prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sql",
        help="run a SQL query over a recorded run",
        description="Run one SQL statement over a recorded run. Tables: runs_log, steps, layer_loads, plans, "
        "transfers, transfer_times, decisions, timings, spans, metric_points; views: run_summary (one row per run: "
        "its step time p50 and, where the store holds its baseline, the measured speed-up), step_times, "
        "runs (one row per recording rank: filter on rank or join on run_summary), layer_balance and "
        "transfer_detail (with a warmup column: WHERE NOT warmup gives ultraep report's figures), warmup_steps "
        "(see telemetry/schema.sql).",
    )
    p.add_argument("run", type=Path, help="run directory, directory of runs, or exported .duckdb file")
    p.add_argument("query", help='SQL, e.g. "SELECT layer, avg(imbalance_after) FROM layer_balance GROUP BY 1"')
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV (header + every row)")
    fmt.add_argument("--json", action="store_true", help="print a JSON array of objects (every row)")
    p.add_argument("--max-rows", type=int, default=200, help="rows shown in the table view (default 200)")
    p.set_defaults(func=run_sql)

    p = sub.add_parser(
        "report",
        help="did balancing pay? measured step time and speed-up, then balance, overhead, predictions, transfers",
        description="Summarise recorded runs: the measured step time and the speed-up over a baseline run first "
        "(or a labelled estimate without one), then balance (plan quality), overhead, prediction quality and "
        "transfers. Warm-up steps are left out of every time and mean.",
    )
    p.add_argument("run", type=Path, help="run directory, directory of runs, or exported .duckdb file")
    p.add_argument("--run-id", default=None, help="only this run (when RUN holds several)")
    p.add_argument("--baseline", default=None, metavar="RUN",
                   help="the unbalanced run of the same token stream to measure the speed-up against (a run id "
                        "in RUN or a run directory); default: the baseline the run recorded (the demo and "
                        "--compare record one)")
    p.add_argument("--json", action="store_true", help="print the sections as one JSON object")
    p.set_defaults(func=run_report)

    p = sub.add_parser(
        "export",
        help="write a recorded run (or a directory of runs) into one DuckDB file",
        description="Materialise every table and view of a run into one .duckdb file (readable with "
        "`ultraep sql FILE ...` or any DuckDB client).",
    )
    p.add_argument("run", type=Path, help="run directory or directory of runs")
    p.add_argument("out", type=Path, help="the .duckdb file to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run_export)


# --------------------------------------------------------------------------- helpers
def _connect(path: Path):
    from ultraep.telemetry.store import open_run

    return open_run(path)


def _has_runs(con) -> bool:
    return con.execute("SELECT count(*) FROM runs_log").fetchone()[0] > 0


def _require_runs(con, path: Path) -> None:
    from ultraep.telemetry.store import TelemetryError

    if not _has_runs(con):
        raise TelemetryError(str(path), "holds no recorded ultraep run (no runs_log parts)")


def _execute(con, sql: str, params: dict | None = None):
    import duckdb

    from ultraep.telemetry.store import TelemetryError, _first_line

    try:
        cur = con.execute(sql, params) if params is not None else con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        rows = cur.fetchall() if cur.description else []
    except duckdb.Error as exc:
        raise TelemetryError("query", _first_line(exc)) from None
    return cols, rows


def _jsonable(v: Any) -> Any:
    if isinstance(v, (datetime, date)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    return v


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, datetime):
        return v.isoformat(sep=" ", timespec="seconds")
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def _table(title: str | None, cols: list[str], rows: list[tuple], max_rows: int | None = None):
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in cols:
        t.add_column(c, overflow="fold")
    for r in rows[: max_rows if max_rows is not None else len(rows)]:
        t.add_row(*(_cell(v) for v in r))
    return t


# --------------------------------------------------------------------------- commands
def run_sql(args: argparse.Namespace) -> int:
    con = _connect(args.run)
    try:
        cols, rows = _execute(con, args.query)
    finally:
        con.close()
    out = sys.stdout
    if args.csv:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if v is None else json.dumps(_jsonable(v)) if isinstance(v, (list, dict)) else v
                        for v in r])
        return 0
    if args.json:
        json.dump([dict(zip(cols, (_jsonable(v) for v in r))) for r in rows], out, indent=1)
        out.write("\n")
        return 0
    console = _console()
    if not cols:
        console.print("OK")
        return 0
    console.print(_table(None, cols, rows, args.max_rows))
    if len(rows) > args.max_rows:
        console.print(f"... {len(rows) - args.max_rows} more rows (use LIMIT, --csv or --json)")
    else:
        console.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}")
    return 0


def _baseline_times(con, args):
    """The ``--baseline`` run's step times: a run id inside RUN, or a run directory of its own."""
    from ultraep.telemetry import answer as A
    from ultraep.telemetry.store import TelemetryError

    name = args.baseline
    if name is None:
        return None, None
    ids = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM runs_log").fetchall()]
    if name in ids:
        return A.step_times(con, name).get(name), A.run_facts(con, name)
    path = Path(name).expanduser()
    if not path.exists() and (Path(args.run) / name).exists():
        path = Path(args.run) / name
    if not path.exists() and Path(args.run).parent.joinpath(name).exists():
        path = Path(args.run).parent / name
    if not path.exists():
        raise TelemetryError("--baseline", f"{name!r} is neither a run in {args.run} nor a run directory", name)
    bcon = _connect(path)
    try:
        bids = [r[0] for r in bcon.execute("SELECT DISTINCT run_id FROM runs_log").fetchall()]
        if len(bids) != 1:
            raise TelemetryError("--baseline", f"{name} holds {len(bids)} runs; name one run directory", name)
        return A.step_times(bcon, bids[0]).get(bids[0]), A.run_facts(bcon, bids[0])
    finally:
        bcon.close()


def run_report(args: argparse.Namespace) -> int:
    from ultraep.telemetry import answer as A
    from ultraep.telemetry import queries as Q
    from ultraep.telemetry import report as R
    from ultraep.telemetry.store import TelemetryError

    con = _connect(args.run)
    try:
        _require_runs(con, args.run)
        known = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM runs_log ORDER BY 1").fetchall()]
        if args.run_id is not None and args.run_id not in known:
            raise TelemetryError("--run-id", f"{args.run_id!r} is not in {args.run} (runs: {', '.join(known)})",
                                 args.run_id)
        base, base_facts = _baseline_times(con, args)
        sections = []
        for q in Q.REPORT:
            cols, rows = _execute(con, q.sql, q.bind(run_id=args.run_id))
            sections.append((q, cols, rows))
        order = [r["run_id"] for r in (dict(zip(cols, row)) for q, cols, rows in sections[:1] for row in rows)]
        answers = {}
        for rid in order:
            if base is not None:
                why = A.same_stream_problem(A.run_facts(con, rid), base_facts)
                if why is not None:
                    raise TelemetryError("--baseline", f"{args.baseline} cannot be the baseline of {rid}: {why}",
                                         args.baseline)
                answers[rid] = A.answer(con, rid, baseline=base)
            else:  # the recorded baseline, in this store or beside it (the dashboard's lookup too)
                answers[rid] = A.answer_at(con, args.run, rid)
    finally:
        con.close()
    if args.json:
        out = {q.name: [dict(zip(cols, (_jsonable(v) for v in r))) for r in rows] for q, cols, rows in sections}
        out["answer"] = [{k: _jsonable(v) for k, v in a.items()} for a in R.answers_json(answers)]
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    labels, prefix = R.short_labels(order)
    data = R.ReportData(order, labels, answers,
                        {q.name: [dict(zip(cols, r)) for r in rows] for q, cols, rows in sections})
    from rich.console import Console

    R.render(Console(width=R.terminal_width()), data, prefix)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from ultraep.telemetry.store import TelemetryError, export_run

    if args.run.is_file():
        raise TelemetryError(str(args.run), "is already a file; export reads a run directory")
    con = _connect(args.run)
    try:
        _require_runs(con, args.run)
    finally:
        con.close()
    dest = export_run(args.run, args.out, overwrite=args.force)
    print(f"wrote {dest}")
    return 0
