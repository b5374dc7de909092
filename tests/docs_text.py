"""Readers of the project's Markdown for the documentation tests: fenced blocks, tables, links, headings' anchors.

Kept apart from the tests so that each test states what it checks and the negative controls feed these same
readers a broken text.
"""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "benchmarks" / "results_committed"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced code blocks of ``text`` whose info string is ``lang``."""
    return [body for info, body in _FENCE.findall(text) if info == lang]


def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code spans blanked (links inside code are not links)."""
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "``", text)


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text`` (up to the next heading of level 2 or 1)."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, re.S | re.M)
    if m is None:
        raise AssertionError(f"no '## {heading}' section")
    return m.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``text``, as lists of cells (header and rule left out)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]] for ln in lines]
    return [r for r in rows[2:]]


def numbers(cell: str) -> list[str]:
    """The numbers printed in a table cell, as written (markup stripped; ``1.36-1.41`` is two numbers)."""
    return _NUMBER.findall(cell.replace("**", "").replace(",", ""))


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"`", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs (GitHub's numbering of repeats included)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"^(#{1,6}) (.+?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images of ``text`` outside code."""
    return [a or b for a, b in _LINK.findall(without_code(text))]


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Relative links of the Markdown file ``path`` whose file or anchor does not exist (web links are not
    followed). ``text`` replaces the file's content (for negative controls)."""
    text = path.read_text() if text is None else text
    bad = []
    for target in links(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{path.relative_to(ROOT)}: {target} (no such anchor)")
    return bad


def committed_rows() -> dict[str, list[dict]]:
    """Every committed benchmark CSV's rows, by file stem."""
    return {p.stem: list(csv.DictReader(p.open())) for p in sorted(COMMITTED.glob("*.csv"))}


def tracked_text_files() -> list[Path]:
    """The files git tracks (plus untracked, not ignored ones) that are text: docs, code, configuration."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    files = []
    for name in out:
        p = ROOT / name
        if not name or not p.is_file() or p.suffix in {".png", ".jpg", ".parquet", ".npy", ".pt", ".duckdb"}:
            continue
        try:
            p.read_text()
        except UnicodeDecodeError:
            continue
        files.append(p)
    return files


def markdown_files() -> list[Path]:
    """The README, the changelog and every Markdown page under docs/ and benchmarks/."""
    return [p for p in tracked_text_files() if p.suffix == ".md"]
