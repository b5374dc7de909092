"""The project's text stays true and speaks of itself only.

* Every relative link and anchor of the README, the changelog and the docs resolves (files, and headings' anchors
  as GitHub and MkDocs make them).
* The word "session" appears only in its technical senses (a DuckDB, Streamlit, browser, HTTP or recorder session,
  and identifiers such as ``session_state``), in every tracked text file.
* No absolute path of a development machine (``/work/``, ``/root/``, ``/home/``, ``/Users/``) appears in a tracked
  text file: a user has none of them.

Each check has a negative control that feeds it a broken text.
"""

from __future__ import annotations

import re
from pathlib import Path

from docs_text import ROOT, broken_links, markdown_files, tracked_text_files

#: the technical senses of "session": a phrase around the word, or the word as an identifier in code or SQL
SESSION_ALLOWED = [
    r"(?:duckdb|streamlit|browser|http|recorder|pytest|requests\.?)\s+sessions?",
    r"session[_ ]state", r"start_new_session", r"SESSION_STRIDE", r"by_session", r"pytest_session\w*",
    r"[._\"'`(<{\[-]sessions?\b", r"(?:=|for|in)\s+sessions?\b",
    r"\bsessions?\b(?=\s*(?:$|[=:,)>}\]*%\-]|VARCHAR|ORDER|in range)|\.\w)",
    r"crashed session", r"per rank and session", r"(?:every|each|any) (?:recorder |browser )?session",
    r"count\(DISTINCT session\)",
]
_SESSION = re.compile(r"sessions?", re.I)
_ALLOWED = [re.compile(p, re.I) for p in SESSION_ALLOWED]
ABSOLUTE = re.compile(r"(?:^|[^\w.~/])(/(?:work|root|home|Users)/[^\s`'\")]*)")
THIS = Path(__file__).resolve()


def session_misuses(path: Path, text: str) -> list[str]:
    """Lines of ``text`` where "session" is used outside every allowed technical phrase."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        spans = [m.span() for p in _ALLOWED for m in p.finditer(line)]
        for m in _SESSION.finditer(line):
            if not any(a <= m.start() and m.end() <= b for a, b in spans):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
                break
    return bad


def absolute_paths(path: Path, text: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}: {m.group(1)}" for n, line in enumerate(text.splitlines(), 1)
            for m in ABSOLUTE.finditer(line)]


def test_every_relative_link_and_anchor_resolves():
    bad = [b for p in markdown_files() for b in broken_links(p)]
    assert bad == [], "\n".join(bad)


def test_a_broken_link_or_anchor_is_reported():
    readme = ROOT / "README.md"
    text = readme.read_text() + "\n[a](docs/no-such-page.md) [b](docs/benchmarks.md#no-such-heading) [c](#results)\n"
    assert broken_links(readme, text) == ["README.md: docs/no-such-page.md (no such file)",
                                          "README.md: docs/benchmarks.md#no-such-heading (no such anchor)"]


def test_session_appears_only_in_technical_senses():
    bad = [b for p in tracked_text_files() if p.resolve() != THIS for b in session_misuses(p, p.read_text())]
    assert bad == [], "\n".join(bad)


def test_a_narrative_session_is_reported():
    p = ROOT / "docs" / "benchmarks.md"
    assert session_misuses(p, "Measured in the fourteenth session.\n") != []
    assert session_misuses(p, "## Session of 2026-11-26\n") != []
    assert session_misuses(p, "Each browser session has its own state; `st.session_state`.\n") == []


def test_no_absolute_path_of_a_development_machine():
    bad = [b for p in tracked_text_files() if p.resolve() != THIS for b in absolute_paths(p, p.read_text())]
    assert bad == [], "\n".join(bad)


def test_an_absolute_path_is_reported():
    p = ROOT / "docs" / "simulator.md"
    assert absolute_paths(p, "ultraep trace info /work/shared/data/OLMoE/expert_counts.json\n") == [
        "docs/simulator.md:1: /work/shared/data/OLMoE/expert_counts.json"]
    assert absolute_paths(p, "see ../shared/data and /tmp/x and https://example.org/home/x\n") == []


_DATED_HEADING = re.compile(r"^#{1,6} .*(?:\b20\d\d-\d\d-\d\d\b|\bsession\b)", re.I | re.M)


def history_problems(name: str, text: str) -> list[str]:
    """What makes a page of record a log: dated or per-session headings; docs/benchmarks.md over 300 lines."""
    bad = [f"{name}: heading {m.group(0).strip()!r}" for m in _DATED_HEADING.finditer(text)]
    if name == "docs/benchmarks.md" and len(text.splitlines()) > 300:
        bad.append(f"{name}: {len(text.splitlines())} lines (at most 300)")
    return bad


def test_the_docs_state_what_holds_now_not_a_log():
    bad = [b for p in markdown_files() for b in history_problems(str(p.relative_to(ROOT)), p.read_text())]
    assert bad == [], "\n".join(bad)


def test_a_dated_log_is_reported():
    assert history_problems("docs/simulator.md", "## Validation on a quiet machine, 2026-11-27\n") != []
    assert history_problems("docs/benchmarks.md", "## Session of the evening\n") != []
    assert history_problems("docs/benchmarks.md", "x\n" * 301) == ["docs/benchmarks.md: 301 lines (at most 300)"]
    assert history_problems("docs/benchmarks.md", "## Runtime\n\nMeasured on 2026-11-24.\n") == []
