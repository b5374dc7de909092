"""MkDocs hooks for the documentation site (``mkdocs.yml``: ``hooks``).

* The README becomes the home page (``index.md``) and CHANGELOG.md the changelog page (``changelog.md``): both live
  at the repository's root, where GitHub shows them, not under ``docs/``.
* A Markdown link whose target is a file of the repository outside ``docs/`` (an example script, a benchmark, the
  committed rows) works on GitHub but is no page of the site: on the site it becomes its path in code
  (``examples/train_torchrun.py``), so that ``mkdocs build --strict`` checks every link that is a page.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
#: repository files shown as pages of the site, and their place in it
PAGES = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _site_target(repo_path: str) -> str | None:
    """Where a repository path is on the site (relative to docs/), or None when it is no page of it."""
    if repo_path in PAGES:
        return PAGES[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):]
    return None


def rewrite(markdown: str, repo_path: str) -> str:
    """``markdown`` of the repository file ``repo_path`` with its links pointed at the site's pages."""
    here = _site_target(repo_path) or ""

    def one(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
        site = _site_target(repo_target)
        if site is None:
            return text if text.startswith("`") else f"{text} (`{repo_target}`)"
        rel = posixpath.relpath(site, posixpath.dirname(here) or ".")
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"

    parts, last = [], 0
    for fence in _FENCE.finditer(markdown):  # links inside code blocks are code
        parts.append(_LINK.sub(one, markdown[last:fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(_LINK.sub(one, markdown[last:]))
    return "".join(parts)


def on_files(files, config):
    for src, dest in PAGES.items():
        files.append(File.generated(config, dest, content=(ROOT / src).read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    repo_path = next((k for k, v in PAGES.items() if v == src), f"docs/{src}")
    return rewrite(markdown, repo_path)
