"""The suite leaves the working tree as it found it: ``git status`` after the run equals ``git status`` before
it, so a test that writes into the checkout (a screenshot over a tracked image, a results file, a stray run
directory) fails the run and is named.

Robust to a developer's own uncommitted work: the comparison is against the status at the start of the run,
and a file already modified or untracked then is compared by content (a test that rewrites it is still caught).
Outside a git checkout, or without git, nothing is checked."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path


def _git(root: Path, *args: str) -> str | None:
    if shutil.which("git") is None:
        return None
    p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else None


def _digest(path: Path) -> str:
    if path.is_dir():  # an untracked directory: its files' names and contents
        h = hashlib.sha1()
        for f in sorted(q for q in path.rglob("*") if q.is_file()):
            h.update(str(f.relative_to(path)).encode())
            h.update(_digest(f).encode())
        return h.hexdigest()
    if not path.exists():
        return "absent"
    return hashlib.sha1(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str] | None:
    """``{status line's path: its content digest}`` for every entry of ``git status --porcelain`` (None when
    ``root`` is not a git checkout)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    top_path = Path(top.strip())
    out = _git(top_path, "status", "--porcelain=v1", "--untracked-files=all", "-z")
    if out is None:
        return None
    entries: dict[str, str] = {}
    items = out.split("\0")
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if not item:
            continue
        code, path = item[:2], item[3:]
        if code[0] in "RC":  # a rename's source follows
            i += 1
        entries[f"{code} {path}"] = _digest(top_path / path)
    return entries


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What the run changed: status entries that appeared, or whose content changed (sorted)."""
    return sorted(k for k, v in after.items() if before.get(k) != v) + sorted(
        f"{k} (no longer reported: reverted or deleted)" for k in before if k not in after)
