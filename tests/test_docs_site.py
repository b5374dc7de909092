"""The documentation site's pages: the README and the changelog join the site with their links pointed at its pages.

``make docs`` builds the site with ``--strict`` (CI runs it; a broken link or anchor fails the build). Here, without
building: the hook that adds the README as the home page rewrites its links to the site's pages, and turns a link to
a file outside ``docs/`` into its path in code (negative control: a docs link is kept a link, a code block is left
alone). And every page under docs/ is in the site's navigation, so none is unreachable.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from docs_text import ROOT

pytest.importorskip("mkdocs", reason="the docs extra (make setup installs it)")
spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def test_the_readme_links_point_at_site_pages():
    text = "[a](docs/guide/gpus.md#install) [b](examples/train_torchrun.py) [c](CHANGELOG.md) [d](#results)\n"
    assert hooks.rewrite(text, "README.md") == (
        "[a](guide/gpus.md#install) b (`examples/train_torchrun.py`) [c](changelog.md) [d](#results)\n")


def test_links_from_a_guide_and_code_blocks():
    text = "[r](../../README.md#results) [s](../simulator.md) [t](../../benchmarks/results_committed/README.md)\n"
    assert hooks.rewrite(text, "docs/guide/simulator.md") == (
        "[r](../index.md#results) [s](../simulator.md) t (`benchmarks/results_committed/README.md`)\n")
    code = "```\n[x](../../examples/a.py)\n```\n"
    assert hooks.rewrite(code, "docs/guide/x.md") == code


def test_every_docs_page_is_in_the_navigation():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
