"""The SQL page's sandbox (``dashboard/sandbox.py``), a security boundary, tested on its own.

Two layers, each tested without the other: the locked-down DuckDB connection (:func:`sandbox`: no file,
network or extension access, configuration locked) and the statement check (:func:`run_sql` refuses
anything but one read-only query). The page itself (the Streamlit SQL page refusing ``COPY ... TO``,
``read_text``, ``ATTACH``, ``INSTALL``, ``SET``) and the CLI's localhost binding are tested with the page in
``tests/test_dashboard.py``.

Beyond the direct statements: statements smuggled through what the page does allow. ``EXPLAIN ANALYZE``
passes the statement-type filter (it is an EXPLAIN) yet *executes* its statement; ``query('...')`` runs a
SQL string; and file-reading table functions other than ``read_text`` (``glob``, ``read_blob``,
``read_csv``, ``sniff_csv``, ``parquet_metadata``) and catalog functions that list the home directory's
secrets and extensions. Each must be refused, with no file written and no secret shown.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ultraep
from ultraep.telemetry import Recorder

pytest.importorskip("pandas")
pytest.importorskip("duckdb")

from ultraep.dashboard import sandbox  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    topo = ultraep.Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    with Recorder.open(root, "fx", flush_interval_s=None, otel=False) as rec:
        rec.record_plan(0, 0, 0, ultraep.plan_layer(np.ones((4, 8), np.int64), topology=topo))
        rec.record_step(0, loss=1.0)
    secret = root / "secret.txt"
    secret.write_text("TOPSECRET")
    return root / "fx", secret, root / "leak"


SMUGGLED = [
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{out}.csv'",
    "EXPLAIN ANALYZE SELECT * FROM read_text('{secret}')",
    "EXPLAIN ANALYZE ATTACH '{out}.duckdb' AS x",
    "FROM query('COPY (SELECT 1) TO ''{out}.csv''')",
    "FROM query('SET lock_configuration = false')",
    "FROM query('INSTALL httpfs')",
    "FROM query('SELECT * FROM read_text(''{secret}'')')",
    "SELECT * FROM glob('{secret}')",
    "SELECT * FROM read_blob('{secret}')",
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM sniff_csv('{secret}')",
    "SELECT * FROM parquet_metadata('{secret}')",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM duckdb_extensions()",
    "PRAGMA enable_external_access",
    "CALL enable_logging()",
]


@pytest.mark.parametrize("template", SMUGGLED)
def test_sql_page_refuses_smuggled_statements(run, template):
    run_dir, secret, out = run
    q = template.format(secret=secret, out=out)
    try:
        df, _ = sandbox.run_sql(run_dir, q, timeout_s=10)
    except sandbox.SqlRefused:
        pass
    else:  # allowed only if harmless: nothing of the secret in the answer
        assert "TOPSECRET" not in df.to_string(), q
        pytest.fail(f"not refused: {q}")
    assert not list(out.parent.glob(out.name + "*")), q


def test_sql_page_still_answers_read_only_queries(run):
    df, truncated = sandbox.run_sql(run[0], "SELECT count(*) AS n FROM layer_balance")
    assert int(df["n"][0]) == 1 and not truncated


# Statements the page's filter would refuse anyway: the connection must refuse them on its own too.
DIRECT = {
    "COPY": "COPY (SELECT 1 AS x) TO '{out}'",
    "read_text": "SELECT * FROM read_text('{secret}')",
    "ATTACH": "ATTACH '{out}.duckdb' AS x",
    "INSTALL": "INSTALL httpfs",
    "SET": "SET enable_external_access = true",
    "RESET": "RESET lock_configuration",
    "unlock": "SET lock_configuration = false",
    "raw parquet path": "SELECT * FROM read_parquet('{run}/plans/*.parquet')",
    "file as table": "SELECT * FROM '{secret}'",
}


def test_sandbox_itself_refuses_even_without_the_statement_check(run):
    """Defence in depth: the DuckDB connection is locked down, not only the statement filter."""
    import duckdb

    run_dir, secret, out = run
    con = sandbox.sandbox(run_dir)
    try:
        assert con.execute("SELECT count(*) FROM layer_balance").fetchone()[0] == 1
        for name, q in DIRECT.items():
            with pytest.raises(duckdb.Error):
                con.execute(q.format(out=out, secret=secret, run=run_dir)).fetchall()
    finally:
        con.close()
    assert not list(out.parent.glob(out.name + "*"))


@pytest.mark.parametrize("q", ["DELETE FROM runs_log", "CREATE TABLE t AS SELECT 1", "SELECT 1; SELECT 2", "",
                               "  ;  "])
def test_statement_check_refuses_writes_and_multi_statements(run, q):
    with pytest.raises(sandbox.SqlRefused):
        sandbox.run_sql(run[0], q)


def test_rows_beyond_the_cap_are_cut_and_flagged(run):
    df, truncated = sandbox.run_sql(run[0], "SELECT * FROM range(10)", max_rows=4)
    assert truncated and list(df["range"]) == [0, 1, 2, 3]
    df, truncated = sandbox.run_sql(run[0], "SELECT * FROM range(4)", max_rows=4)
    assert not truncated and len(df) == 4
