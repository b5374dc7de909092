"""The ultraep dashboard (Streamlit entry point): ``ultraep dashboard [RUN_OR_DIR]`` runs
``streamlit run app.py -- --root RUN_OR_DIR``.

This script only sets the page up and the navigation; each page lives in ``pages/`` and reads the
selected run through :mod:`ultraep.dashboard.ui` (mirror and queries in :mod:`.data`, figures in
:mod:`.charts`). It never imports torch or the runtime.
"""

import streamlit as st

from ultraep.dashboard import ui

st.set_page_config(page_title="ultraep dashboard", page_icon=":material/balance:", layout="wide")
ui.setup()
PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/dashboard:", url_path="overview", default=True),
    st.Page("pages/layers.py", title="Layers", icon=":material/layers:", url_path="layers"),
    st.Page("pages/experts.py", title="Experts", icon=":material/hub:", url_path="experts"),
    st.Page("pages/policies.py", title="Policies", icon=":material/rule:", url_path="policies"),
    st.Page("pages/transfers.py", title="Transfers", icon=":material/swap_horiz:", url_path="transfers"),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("pages/sql.py", title="SQL", icon=":material/database:", url_path="sql"),
]
st.navigation(PAGES).run()
