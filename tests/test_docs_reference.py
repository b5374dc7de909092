"""The reference pages (configuration, CLI, SQL) are generated from the code and committed; a stale one fails.

``tools/gen_reference.py`` reads the pydantic models, the argparse parser and the store's schema. A field, flag or
column added without regenerating the pages fails here, naming the page and the command that fixes it.
Negative controls: a page changed by hand is reported stale; a field's description changed in the model changes the
generated page.
"""

from __future__ import annotations

import importlib.util
import shutil

from docs_text import ROOT

spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_the_committed_reference_pages_are_what_the_code_generates():
    for name, text in gen.generate().items():
        page = ROOT / "docs" / "reference" / name
        assert page.exists(), f"{page} is missing: run `python tools/gen_reference.py`"
        assert page.read_text() == text, f"docs/reference/{name} is stale: run `python tools/gen_reference.py`"


def test_a_stale_page_is_reported(tmp_path, monkeypatch, capsys):
    out = tmp_path / "reference"
    shutil.copytree(ROOT / "docs" / "reference", out)
    monkeypatch.setattr(gen, "OUT", out)
    assert gen.main(["--check"]) == 0
    page = out / "config.md"
    page.write_text(page.read_text().replace("Redundant (replica) slots per rank", "Replica slots per rank"))
    assert gen.main(["--check"]) == 1
    assert "config.md" in capsys.readouterr().err


def test_the_pages_follow_the_code(monkeypatch):
    from ultraep.config import BalancerConfig

    before = gen.config_page()
    monkeypatch.setattr(BalancerConfig.model_fields["sync_check_every"], "description", "changed in the model")
    assert gen.config_page() != before and "changed in the model" in gen.config_page()
    assert "## `ultraep simulate`" in gen.cli_page() and "`--topology " in gen.cli_page()
    assert "## layer_balance" in gen.sql_page() and "| `imbalance_before` |" in gen.sql_page()
