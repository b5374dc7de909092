"""SQL: a read-only query box over the selected run's tables (no file, network or settings access)."""

import streamlit as st

from ultraep.dashboard import charts, sandbox, ui
from ultraep.telemetry import semconv as sc

DEFAULT_SQL = ("SELECT layer, avg(imbalance_before) AS before, avg(imbalance_after) AS after\n"
               "FROM layer_balance GROUP BY layer ORDER BY layer")


def body(ctx: ui.Context) -> None:
    ui.header(ctx, "SQL")
    st.caption("One read-only query over this run: tables " + ", ".join(sc.RAW_TABLES) + "; views "
               + ", ".join(sc.VIEWS) + " (telemetry/schema.sql). Files, extensions and settings are off limits.")
    text = st.text_area("query", value=DEFAULT_SQL, height=140, key="sql_text")
    if st.button("Run", key="sql_run", type="primary"):
        st.session_state["sql_last"] = text
    sql = st.session_state.get("sql_last")
    if not sql:
        return
    try:
        df, truncated = sandbox.run_sql(ctx.run.path, sql)
    except sandbox.SqlRefused as exc:
        st.error(f"Refused: {exc}")
        return
    st.dataframe(df, hide_index=True, key="sql_result")
    st.caption(f"{len(df)} row(s)" + (f" (first {sandbox.MAX_SQL_ROWS} shown)" if truncated else ""))
    numeric = [c for c in df.columns if df[c].dtype.kind in "iuf"]
    if len(df) and len(df.columns) >= 2 and numeric:
        c = st.columns(2)
        x = c[0].selectbox("x", list(df.columns), index=0, key="sql_x")
        ys = [n for n in numeric if n != x] or numeric
        y = c[1].selectbox("y", ys, index=0, key="sql_y")
        ui.plot(charts.quick_chart(df, x, y), "sql_chart")


ui.live(body, key="sql", refresh=False)
