"""Where the shared data lives: ``shared/`` beside the repository (``<repository root>/../shared``), so a test
that reads it runs in any checkout placed next to it and skips cleanly where it is absent — never a path of one
machine."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def shared_path(*parts: str) -> Path:
    """``<repository root>/../shared/<parts...>`` (it may not exist: callers skip on ``.exists()``)."""
    return SHARED.joinpath(*parts)
