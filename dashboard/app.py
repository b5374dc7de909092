"""The ultraep dashboard (Streamlit entry point): ``ultraep dashboard [RUN_OR_DIR]`` runs
``streamlit run app.py -- --root RUN_OR_DIR``.

This script only sets the page up and the navigation; each page lives in ``pages/`` and reads the
selected run through :mod:`ultraep.dashboard.ui` (mirror and queries in :mod:`.data`, figures in
:mod:`.charts`). It never imports torch or the runtime.
"""

import streamlit as st

from ultraep.dashboard import ui

if ui.leave_pages_directory_mode():  # a fresh server's first run: start over with st.navigation in charge
    st.rerun()
page = st.navigation(
    [st.Page(path, title=title, url_path=url, default=(url == "overview")) for path, title, url in ui.NAV],
    position="hidden",  # the sidebar menu is ui.setup's (the same in Streamlit's pages-directory mode)
)
ui.setup()
page.run()
