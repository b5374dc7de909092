"""ultraep.dashboard: the live Streamlit dashboard over recorded runs (``ultraep dashboard``; docs/dashboard.md).

Modules: ``app.py`` and ``pages/`` (the Streamlit scripts), :mod:`.ui` (Streamlit glue), :mod:`.data`
(runs, mirrors and every figure, no Streamlit), :mod:`.mirror` (incremental in-memory facts of a run's
Parquet parts), :mod:`.charts` (Plotly figures), :mod:`.cli` (the subcommand). Reads the telemetry store
only; never imports torch or the runtime. Importing this package does nothing.
"""
