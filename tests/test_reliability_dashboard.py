"""Dashboard SQL page: bypass attempts beyond the direct statements ``tests/test_dashboard.py`` tries.

``test_dashboard.py`` already pins the basics (not repeated here): the CLI binds 127.0.0.1 unless
``--host`` says otherwise (``test_cli_binds_localhost_by_default_and_refuses_bad_paths``), and the SQL page
and its sandbox refuse ``COPY ... TO``, ``read_text``, ``ATTACH``, ``INSTALL``, ``SET``/``RESET``, raw
``read_parquet`` paths and multi-statements (``test_sql_page_refuses_file_access_extensions_and_settings``,
``test_sandbox_itself_refuses_even_without_the_statement_check``).

Here: statements smuggled through what the page does allow. ``EXPLAIN ANALYZE`` passes the statement-type
filter (it is an EXPLAIN) yet *executes* its statement; ``query('...')`` runs a SQL string; and file-reading
table functions other than ``read_text`` (``glob``, ``read_blob``, ``read_csv``, ``sniff_csv``,
``parquet_metadata``) and catalog functions that list the home directory's secrets and extensions. Each
must be refused, with no file written and no secret shown.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ultraep
from ultraep.telemetry import Recorder

pytest.importorskip("pandas")


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
    from ultraep.dashboard import data

    run_dir, secret, out = run
    q = template.format(secret=secret, out=out)
    try:
        df, _ = data.run_sql(run_dir, q, timeout_s=10)
    except data.SqlRefused:
        pass
    else:  # allowed only if harmless: nothing of the secret in the answer
        assert "TOPSECRET" not in df.to_string(), q
        pytest.fail(f"not refused: {q}")
    assert not list(out.parent.glob(out.name + "*")), q


def test_sql_page_still_answers_read_only_queries(run):
    from ultraep.dashboard import data

    df, truncated = data.run_sql(run[0], "SELECT count(*) AS n FROM layer_balance")
    assert int(df["n"][0]) == 1 and not truncated
